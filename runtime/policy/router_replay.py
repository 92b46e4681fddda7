"""Routing replay in the Megatron trainer (``training.router_replay``): megatron-core's ``RouterReplay`` armed
with each micro batch's vLLM routes.

With ``moe_enable_routing_replay`` every ``TopKRouter`` of the model owns a ``RouterReplay``. Before a micro
batch's forward, :meth:`ReplayRouters.arm` gives each decoder MoE router of that model chunk its layer's routes
(``rlc.runtime.policy.routes.replay_targets``: tokens in the router's order, the sequence-parallel share) and
sets ``REPLAY_FORWARD``: the router takes vLLM's experts and gathers its own scores at them, so the gate weights
still carry gradients. Recompute re-runs the router in the backward pass, after later micro batches' forwards
(1F1B pipelining): ``RouterReplay`` keeps every armed route in a FIFO and ``REPLAY_BACKWARD`` pops the oldest,
so after each forward :meth:`ReplayRouters.after_forward` switches to it when the layers are recomputed, and
otherwise drops the FIFO (nothing would pop it; it would hold every micro batch's routes on the GPU).

The MTP block's router is not replayed: vLLM runs the MTP layer, if at all, as a speculative drafter on other
inputs, and the policy's logprobs do not depend on it. It keeps routing on its own scores.

:meth:`ReplayRouters.check` (logprob passes) compares the routing each router returned with the routes armed for
it: (token, layer) pairs that differ mean the replay was bypassed (a fused router, a layer never armed).
"""
from __future__ import annotations

from typing import Any

import torch

from rlc.runtime.policy.routes import replay_targets


def is_mtp(name: str) -> bool:
    """A module of the MTP block (``...mtp.layers.N...``), which vLLM does not run on the rollout's tokens."""
    return "mtp" in name.split(".")


def decoder_routers(chunk: Any) -> list[tuple[str, Any]]:
    """``(name, router)`` of the decoder's MoE routers with a ``RouterReplay`` in one model chunk."""
    return [(name, module) for name, module in chunk.named_modules()
            if getattr(module, "router_replay", None) is not None and not is_mtp(name)]


def local_moe_layers(chunks: list[Any]) -> list[int]:
    """The decoder layers (0-based, global: pipeline offsets included) whose routers this rank holds."""
    return sorted({int(router.layer_number) - 1 for chunk in chunks for _, router in decoder_routers(chunk)})


class ReplayRouters:
    """Arms, re-arms for recompute, clears and checks the replay of one policy worker's routers."""

    def __init__(self, moe_layers: list[int], *, num_experts: int, keep_for_recompute: bool, sp_rank: int = 0,
                 sp_size: int = 1, check: bool = True) -> None:
        self.index = {layer: m for m, layer in enumerate(moe_layers)}
        self.num_experts = num_experts
        self.keep_for_recompute = keep_for_recompute
        self.sp_rank, self.sp_size = sp_rank, sp_size
        self.check_enabled = check
        self._chunks: dict[int, list[tuple[Any, Any, int]]] = {}  # id(chunk) -> [(router, its replay, route index)]
        self._expected: dict[int, torch.Tensor] = {}  # id(router) -> the routes armed for it (checking)
        self._checking = False
        self._checked = 0
        self._mismatched: torch.Tensor | None = None
        self._unarmed = 0

    def routers(self, chunk: Any) -> list[tuple[Any, Any, int]]:
        key = id(chunk)
        if key not in self._chunks:
            found = []
            for name, router in decoder_routers(chunk):
                layer = int(router.layer_number) - 1
                if layer not in self.index:
                    raise RuntimeError(f"routing replay: the trainer's router {name} (decoder layer {layer}) is not "
                                       f"among the MoE layers vLLM records ({sorted(self.index)})")
                router.register_forward_hook(self._hook)
                found.append((router, router.router_replay, self.index[layer]))
            self._chunks[key] = found
        return self._chunks[key]

    def arm(self, chunk: Any, routes: torch.Tensor, seq_len: int) -> None:
        """Before a micro batch's forward through ``chunk``: its routes ``[b, s', M, K]`` into every router."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction  # noqa: PLC0415

        routers = self.routers(chunk)
        if not routers:
            return
        device = torch.device("cuda", torch.cuda.current_device())
        targets = replay_targets(routes.to(device, non_blocking=True), seq_len, num_experts=self.num_experts,
                                 sp_rank=self.sp_rank, sp_size=self.sp_size)
        for router, replay, m in routers:
            replay.set_target_indices(targets[m])
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            if self._checking:
                self._expected[id(router)] = targets[m]

    def after_forward(self, chunk: Any, forward_only: bool) -> None:
        """After the forward: recompute (train passes only) replays the FIFO; else the FIFO is dropped."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction  # noqa: PLC0415

        for _, replay, _ in self.routers(chunk):
            if self.keep_for_recompute and not forward_only:
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            else:
                replay.replay_backward_list = []

    def clear(self, chunks: list[Any]) -> None:
        """After a pass: no route and no action left in any router of ``chunks``."""
        for chunk in chunks:
            for _, replay, _ in self.routers(chunk):
                replay.clear_indices()
                replay.clear_router_replay_action()
        self._expected.clear()

    # ------------------------------------------------------------------ the check

    def start_check(self) -> None:
        self._checking = self.check_enabled
        self._checked, self._mismatched, self._unarmed = 0, None, 0
        self._expected.clear()

    def stop_check(self) -> dict[str, int]:
        self._checking = False
        mismatched = int(self._mismatched.item()) if self._mismatched is not None else 0
        return {"routes_checked": self._checked, "routes_mismatched": mismatched, "layers_unarmed": self._unarmed}

    def _hook(self, router: Any, inputs: Any, output: Any) -> None:
        if not self._checking:
            return
        expected = self._expected.get(id(router))
        if expected is None:
            self._unarmed += 1
            return
        routing_map = output[1]
        if routing_map.shape[0] != expected.shape[0]:
            raise RuntimeError(f"routing replay: the router saw {routing_map.shape[0]} tokens, the replay armed "
                               f"{expected.shape[0]}")
        want = torch.zeros_like(routing_map, dtype=torch.bool).scatter_(1, expected, True)
        bad = (routing_map.bool() != want).any(dim=-1).sum()
        self._mismatched = bad if self._mismatched is None else self._mismatched + bad
        self._checked += int(routing_map.shape[0])


__all__ = ["ReplayRouters", "decoder_routers", "is_mtp", "local_moe_layers"]
