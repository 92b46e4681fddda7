"""The KL penalty's fixed bound, read by the loss (``rlc.runtime.grpo.loss``) and the NeMo-RL importer (which maps
NeMo-RL's ``kl_input_clamp_value`` where it equals it). Pure Python."""
from __future__ import annotations

#: Bound on |log(reference / policy)| in the KL term: the k3 estimator's exponent is clamped there, and a token
#: beyond it gives the KL weight (``loss.kl_weighting``) no gradient (NeMo-RL's default ``kl_input_clamp_value``).
KL_LOG_RATIO_BOUND = 20.0
