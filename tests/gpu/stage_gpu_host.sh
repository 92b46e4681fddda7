#!/usr/bin/env bash
# Pack the GPU-host stack (../shared/gpu-host/stage.sh: vLLM 0.22.0, Ray, Megatron-core 0.19.2, Megatron-Bridge,
# Transformer Engine) plus what two of rlc's features need beyond it, from the repo root:
#  - humming-kernels, which vLLM 0.22.0's quantization registry imports for every quantized model
#    (generation.precision: fp8 stops at "No module named 'humming'" without it; stage.sh skips it by default);
#  - the FlashAttention that megatron-core's dynamic inference engine needs on Hopper (generation.backend: megatron).
#
#   bash tests/gpu/stage_gpu_host.sh OUT       # OUT/part00 ... (parts of PART_MB megabytes, default 48)
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
# stage.sh's own default skip list, less humming-kernels (vLLM pins its version)
if [[ -z ${SKIP:-} ]]; then
  SKIP=$(sed -n 's/^SKIP=\${SKIP:-"\(.*\)"}$/\1/p' "$STAGE_SH" | tr ' ' '\n' | grep -vx humming-kernels | tr '\n' ' ')
  [[ -n $SKIP ]] || { echo "could not read the default SKIP list from $STAGE_SH" >&2; exit 2; }
  export SKIP
fi
OUT=${1:?usage: stage_gpu_host.sh OUT}
bash "$STAGE_SH" "$OUT"
# A call carries the checkout and one part under 64 MiB together: parts of PART_MB (default 48 MB) leave the
# checkout room that stage.sh's 55 MiB parts no longer do. Same stream, cut finer: packNN in partNN, the last
# part keeping unpack.sh and zstd (host_run.sh unpacks from the last part it was carried).
PART_MB=${PART_MB:-48}
tools=$(ls -d "$OUT"/part* | tail -1)
tmp=$(mktemp -d "$OUT/.rechunk.XXXX")
cp "$tools/unpack.sh" "$tools/zstd" "$tmp/"
cat "$OUT"/part*/pack* | split -b "${PART_MB}000000" -d - "$tmp/pack"
rm -rf "$OUT"/part*
n=0
for f in "$tmp"/pack*; do
  d=$(printf '%s/part%02d' "$OUT" "$n"); mkdir -p "$d"; mv "$f" "$d/$(printf 'pack%02d' "$n")"; n=$((n + 1))
done
mv "$tmp/unpack.sh" "$tmp/zstd" "$d/" && rmdir "$tmp"
echo "re-cut into $n parts of at most ${PART_MB} MB: $OUT/part00 .. $(basename "$d")"
