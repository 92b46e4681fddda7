#!/usr/bin/env bash
# Pack the GPU-host stack (../shared/gpu-host/stage.sh: vLLM 0.22.0, Ray, Megatron-core 0.19.2, Megatron-Bridge,
# Transformer Engine) plus the FlashAttention that megatron-core's dynamic inference engine needs on Hopper
# (generation.backend: megatron), from the repo root:
#
#   bash tests/gpu/stage_with_flash_attn.sh OUT       # OUT/part00 ... as stage.sh makes them
#
# The FlashAttention is FlashAttention-3 as the `tokenspeed-fa3` wheel builds it: forward kernels for sm_90a
# (paged KV, varlen, split-KV), CUDA 13.0, linked against torch's stable C ABI only (no libtorch C++ symbols), so
# it loads on the host's torch 2.11.0+cu130. It needs torch, einops, packaging and ninja, all on the host, so it
# is resolved with the rest (EXTRA_REQS) and moves no pin of the vLLM stack. The wheel installs its interface as
# the top-level module flash_attn_interface; megatron-core 0.19 imports flash_attn_3.flash_attn_interface, so
# host_run.sh copies that file into flash_attn_3/ after unpacking (Transformer Engine's FA3 install steps did the
# same). Transformer Engine looks for a `flash-attn-3` distribution and so keeps its own attention backends.
#
# Not flash-attn-4: every release megatron-core accepts (>= 4.0.0b20) needs nvidia-cutlass-dsl >= 4.6 and
# apache-tvm-ffi >= 0.1.11, vLLM 0.22.0 pins 4.5.2 and 0.1.9, and with its `flash_attn` namespace installed vLLM
# 0.22.0's rotary embedding imports flash_attn.ops and fails for every model (vLLM #42675). Not flash-attn 2:
# PyPI has only its source release, which needs nvcc to build.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
STAGE_SH=${STAGE_SH:-$HERE/../../../shared/gpu-host/stage.sh}
[[ -f $STAGE_SH ]] || { echo "stage.sh not found at $STAGE_SH (set STAGE_SH)" >&2; exit 2; }
export EXTRA_REQS="${EXTRA_REQS:-} tokenspeed-fa3==3.0.0.post20260810"
exec bash "$STAGE_SH" "${1:?usage: stage_with_flash_attn.sh OUT}"
