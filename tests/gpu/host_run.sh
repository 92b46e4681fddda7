#!/usr/bin/env bash
# GPU-host runner (device tool), from the repo root:
#   bash tests/gpu/host_run.sh STAGE_DIR STAGE...   (stages: env flash_attn_probe refit bench bench_zero_copy bench_buckets bench_tensors bench_host_wait bench_timeline refit_scale refit_fast grpo grpo_awake grpo_direct grpo_truncated grpo_zero_copy grpo_overlap grpo_resident grpo_kv_asleep kv_wake grpo_smoke engine_options grad_bf16 param_offload moe_sleep specdec host_copy ref_offload model_overrides moe1 r3 two_gpu packing packing_cp2 packing_smoke packed_rope packed_mla prod_dense prod_moe mcore_shared mcore_moe mcore_dedicated mcore_vs_vllm mcore_reshard_tp mcore_reshard_ep moe2 fp8_refit fp8_refit_moe fp8_grpo fp8_grpo_block fp8_keep fp8_train)
# ref_offload: REF_OFFLOAD_SKIP_DRIVER=1 runs only the worker checks (about 1.5 of its ~4 minutes).
# mcore_*: generation.backend megatron (MCORE_STEPS, MCORE_DEDICATED_STEPS, MCORE_COMPARE_STEPS); each starts with a
#   preflight that fails in seconds when the stack has no FlashAttention megatron-core's dynamic batching accepts.
#   Stage the stack with one: `bash tests/gpu/stage_gpu_host.sh OUT` (shared/gpu-host/stage.sh with
#   EXTRA_REQS="tokenspeed-fa3==3.0.0.post20260810": FlashAttention-3 for sm_90), and run flash_attn_probe first:
#   megatron-core's own detection and its paged-KV prefill and decode calls against a torch reference, in about a
#   minute, so that an mcore_* failure after it is not a packaging one. A machine whose /tmp/site was unpacked
#   from parts staged without it keeps lacking it: rm -rf /tmp/site to unpack the new parts.
# refit_scale: SCALE_CASES (default engine,dense-8b,moe-ep2,moe-tp2; needs 2 GPUs for moe-*),
#   TINY_METRICS=path/metrics.jsonl adds the tiny-run goal (default: a grpo / grpo_smoke stage run before
#   it on this machine), SCALE_TIMEOUT (default 580 s).
# refit_fast: refit_at_scale.py with refit.fused_transfer on (FAST_CASES, default engine,dense-8b,moe-1gpu; one GPU),
#   goals: 30B-A3B median <= 0.5 s and max <= 1.0 s, 8B median <= 0.05 s, engine >= 0.4 of the copy; JSON in
#   $OUT/refit_fast (FAST_TIMEOUT, default 590 s). The cases dense-8b-awake and moe-1gpu-awake run the same with
#   refit.keep_weights_awake (at most about three cases fit one call's 600 s).
# fp8_refit / fp8_refit_moe: a verified refit into FP8 vLLM parameters at Qwen3-8B / Qwen3-30B-A3B shapes with refit
#   time and tokens/s next to bf16 (FP8_SCALES: block (default) or tensor; FP8_CUDA_GRAPHS=1: both engines with
#   CUDA graphs, fp8_refit only); fp8_grpo: the tiny GRPO run with FP8 rollouts, 150 steps (FP8_GRPO_SCALES: tensor
#   (default) or block, FP8_GRPO_STEPS); fp8_grpo_block: the same with block scales on the head_dim 64 tiny model;
#   fp8_train: FP8 training (FP8_TRAIN_RECIPE, default blockwise): the tiny GRPO smoke run and a real-shape train
#   step with memory next to the plan.
# STAGE_DIR holds every packNN of the staged stack (.gpu-host/partNN copied there by earlier calls);
# the last part (carried with this call) has unpack.sh. Unpacks into /tmp/site once per machine,
# puts the checkout (its rlc/ package) on PYTHONPATH, then runs the named stages, each under a
# timeout, all output appended to $OUT/log.
set -uo pipefail
OUT=${OUT:-/tmp/rlc-out}; mkdir -p "$OUT"
STAGE=${1:?usage: host_run.sh STAGE_DIR stages...}; shift
last=$(ls -d .gpu-host/part* 2>/dev/null | tail -1)
if [[ ! -f /tmp/site/.unpacked ]]; then
  [[ -n $last ]] || { echo "no .gpu-host part carried and /tmp/site missing"; exit 3; }
  SITE=/tmp/site bash "$last/unpack.sh" "$STAGE" || exit 3
fi
REPO=$PWD
export PYTHONPATH=/tmp/site:$REPO PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false
export RAY_DEDUP_LOGS=0 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}
log() { echo "[host_run $(date +%T)] $*" | tee -a "$OUT/log"; }
# FlashAttention-3 wheels (tokenspeed-fa3) install their interface as the top-level module flash_attn_interface;
# megatron-core 0.19 imports flash_attn_3.flash_attn_interface: put a copy there (Transformer Engine's FA3 install
# steps did the same)
if [[ -f /tmp/site/flash_attn_interface.py && -f /tmp/site/flash_attn_3/_C.abi3.so \
      && ! -f /tmp/site/flash_attn_3/flash_attn_interface.py ]]; then
  cp /tmp/site/flash_attn_interface.py /tmp/site/flash_attn_3/ && log "FlashAttention-3: flash_attn_interface.py copied into /tmp/site/flash_attn_3/"
fi
run_stage() {  # name timeout cmd...
  local name=$1 t=$2; shift 2
  log "stage $name: $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$t" "$@" 2>&1 | tee -a "$OUT/log"
  local rc=${PIPESTATUS[0]}
  log "stage $name: rc=$rc in $((SECONDS - t0)) s"
  echo "$name rc=$rc s=$((SECONDS - t0))" >>"$OUT/stages.txt"
  # each stage stands alone: no Ray processes (holding GPU memory) or cluster address left for the next one
  python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true
  rm -f /tmp/ray/ray_current_cluster
}
for stage in "$@"; do
  case $stage in
    env) run_stage env 120 bash -c 'nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv; python3 -c "
import importlib.metadata as m, torch
print(\"torch\", torch.__version__, torch.cuda.device_count(), torch.cuda.get_device_name(0))
for d in (\"vllm\",\"ray\",\"megatron-core\",\"megatron-bridge\",\"transformer-engine\",\"transformers\"): print(d, m.version(d))
import vllm, ray, megatron.core, megatron.bridge, transformer_engine.pytorch; print(\"imports ok\")
import rlc.runtime.driver, rlc.runtime.refit; print(\"rlc ok\")"' ;;
    flash_attn_probe)  # the FlashAttention megatron-core's dynamic batching calls: detection, a paged-KV prefill and decode
      run_stage flash_attn_probe 300 python3 "$REPO"/tests/gpu/test_flash_attn_probe.py --out "$OUT/flash_attn_probe" ;;
    refit) run_stage refit 240 python3 "$REPO"/tests/gpu/test_refit_logprobs.py --out "$OUT" ;;
    bench) run_stage bench 150 python3 "$REPO"/benchmarks/refit_bandwidth.py --backend cuda_ipc --gib 2 ;;
    bench_zero_copy) run_stage bench_zero_copy 150 python3 "$REPO"/benchmarks/refit_bandwidth.py --backend cuda_ipc \
      --gib 2 --zero-copy --json "$OUT/bench_zero_copy.json" ;;
    bench_buckets)  # the engine at 2 GiB with ping-pong halves of 0.25, 0.5, 1 and 2 GiB (8, 4, 2 and 1 buckets):
      # how much of the gap to the two-copy bound is per bucket
      mkdir -p "$OUT/bench_buckets"
      for gb in 0.5 1 2 4; do
        run_stage "bench_buffer_${gb}" 150 python3 "$REPO"/benchmarks/refit_bandwidth.py --backend cuda_ipc --gib 2 \
          --buffer-gb "$gb" --repeats 10 --json "$OUT/bench_buckets/buffer_${gb}.json"
      done ;;
    bench_host_wait)  # the engine at 2 GiB (halves of 0.5 and 1 GiB) with each process waiting for the other's events
      # on the host instead of the device: how much of the gap to the two-copy bound is the contexts' device waits
      mkdir -p "$OUT/bench_host_wait"
      # (each next to the same setting with device-side waits, in the same call)
      for gb in 1 2; do
        run_stage "bench_device_wait_${gb}" 150 python3 "$REPO"/benchmarks/refit_bandwidth.py --backend cuda_ipc --gib 2 \
          --buffer-gb "$gb" --repeats 10 --json "$OUT/bench_host_wait/device_wait_${gb}.json"
        run_stage "bench_host_wait_${gb}" 150 python3 "$REPO"/benchmarks/refit_bandwidth.py --backend cuda_ipc --gib 2 \
          --buffer-gb "$gb" --host-wait --repeats 10 --json "$OUT/bench_host_wait/host_wait_${gb}.json"
      done ;;
    bench_timeline)  # the engine at 2 GiB, when each protocol event of both processes happens within a refit (where
      # the time over the copies goes), with the buckets as the engine makes them and as one bucket: packed (halves of
      # 0.5 GiB: 4 buckets; one 2 GiB half kept across refits: 1) and read in place (views of 256 MiB a bucket: 8; 1),
      # then both with the consumer's copies issued a bucket at a time
      mkdir -p "$OUT/bench_timeline"
      bench="python3 $REPO/benchmarks/refit_bandwidth.py --backend cuda_ipc --gib 2 --repeats 20 --timeline"
      run_stage bench_timeline_packed 150 $bench --json "$OUT/bench_timeline/packed.json"
      run_stage bench_timeline_packed_one 150 $bench --buffer-gb 4 --keep-gb 4 --json "$OUT/bench_timeline/packed_one.json"
      run_stage bench_timeline_zero_copy 150 $bench --zero-copy --json "$OUT/bench_timeline/zero_copy.json"
      run_stage bench_timeline_zero_copy_one 150 $bench --zero-copy --zero-copy-bucket-mib 2048 \
        --json "$OUT/bench_timeline/zero_copy_one.json"
      # the consumer's copies a bucket at a time (as refit.replay_load issues them)
      run_stage bench_timeline_packed_batched 150 $bench --batched-load --json "$OUT/bench_timeline/packed_batched.json"
      run_stage bench_timeline_zero_copy_batched 150 $bench --zero-copy --batched-load \
        --json "$OUT/bench_timeline/zero_copy_batched.json" ;;
    bench_tensors)  # the engine at 2 GiB (halves of 0.5 GiB) with tensors of 16, 64, 256 and 512 MiB (32, 8, 2 and 1
      # per bucket): how much of the gap to the two-copy bound is per copy kernel
      mkdir -p "$OUT/bench_tensors"
      for mib in 16 64 256 512; do
        run_stage "bench_tensor_${mib}" 150 python3 "$REPO"/benchmarks/refit_bandwidth.py --backend cuda_ipc --gib 2 \
          --tensor-mib "$mib" --repeats 10 --json "$OUT/bench_tensors/tensor_${mib}.json"
      done ;;
    refit_scale)
      tm=${TINY_METRICS:-}  # the tiny GRPO run's metrics: this call's grpo stage, else grpo_smoke's
      [[ -z $tm && -f $OUT/grpo_metrics.jsonl ]] && tm=$OUT/grpo_metrics.jsonl
      [[ -z $tm && -f /tmp/rlc-smoke/logs/metrics.jsonl ]] && tm=/tmp/rlc-smoke/logs/metrics.jsonl
      run_stage refit_scale "${SCALE_TIMEOUT:-580}" python3 "$REPO"/benchmarks/refit_at_scale.py --out "$OUT/refit_at_scale" \
        --cases "${SCALE_CASES:-engine,dense-8b,moe-ep2,moe-tp2}" ${tm:+--tiny-metrics "$tm"} --check ;;
    refit_fast)
      run_stage refit_fast "${FAST_TIMEOUT:-590}" python3 "$REPO"/benchmarks/refit_at_scale.py --out "$OUT/refit_fast" \
        --cases "${FAST_CASES:-engine,dense-8b,moe-1gpu}" --fused-transfer --check ${FAST_ARGS:-} ;;
    grpo) run_stage grpo 570 python3 "$REPO"/tests/gpu/test_grpo_learning.py --out "$OUT" --steps "${GRPO_STEPS:-150}" --timeout "${GRPO_TIMEOUT:-380}" ;;
    grpo_awake)  # the tiny run with refit.keep_weights_awake (only vLLM's KV cache sleeps), checked bit-exact every 25 refits
      run_stage grpo_awake 570 python3 "$REPO"/tests/gpu/test_grpo_learning.py --root /tmp/rlc-grpo-awake \
        --out "$OUT/grpo_awake" --steps "${GRPO_STEPS:-100}" --timeout "${GRPO_TIMEOUT:-380}" \
        --set refit.keep_weights_awake=true --set refit.sleep_level=1 --set refit.verify_every=25 ;;
    grpo_direct)  # the tiny run with refit.direct_export and refit.replay_load, checked bit-exact every 25 refits
      run_stage grpo_direct 570 python3 "$REPO"/tests/gpu/test_grpo_learning.py --root /tmp/rlc-grpo-direct \
        --out "$OUT/grpo_direct" --steps "${GRPO_STEPS:-100}" --timeout "${GRPO_TIMEOUT:-380}" \
        --set refit.direct_export=true --set refit.replay_load=true --set refit.verify_every=25 ;;
    grpo_truncated)  # the tiny run sampling with min-p, top-k and top-p: the trainer scores under the same cuts
      run_stage grpo_truncated 570 python3 "$REPO"/tests/gpu/test_grpo_learning.py --root /tmp/rlc-grpo-truncated \
        --out "$OUT/grpo_truncated" --steps "${GRPO_STEPS:-100}" --timeout "${GRPO_TIMEOUT:-380}" \
        --set generation.sampling.min_p=0.01 --set generation.sampling.top_k=10 --set generation.sampling.top_p=0.9 ;;
    grpo_zero_copy)  # the same with refit.zero_copy_views (vLLM reads the trainer's views in place)
      run_stage grpo_zero_copy 570 python3 "$REPO"/tests/gpu/test_grpo_learning.py --root /tmp/rlc-grpo-zero-copy \
        --out "$OUT/grpo_zero_copy" --steps "${GRPO_STEPS:-100}" --timeout "${GRPO_TIMEOUT:-380}" \
        --set refit.direct_export=true --set refit.zero_copy_views=true --set refit.replay_load=true \
        --set refit.verify_every=25 ;;
    grpo_overlap)  # every refit switch: weights awake, KV cache woken during the transfer, direct + zero-copy + replay
      run_stage grpo_overlap 570 python3 "$REPO"/tests/gpu/test_grpo_learning.py --root /tmp/rlc-grpo-overlap \
        --out "$OUT/grpo_overlap" --steps "${GRPO_STEPS:-100}" --timeout "${GRPO_TIMEOUT:-380}" \
        --set refit.keep_weights_awake=true --set refit.sleep_level=1 --set refit.wake_kv_during_transfer=true \
        --set refit.direct_export=true --set refit.zero_copy_views=true --set refit.replay_load=true \
        --set refit.verify_every=25 ;;
    grpo_resident)  # every refit switch but the KV wake, and vLLM's KV cache kept awake (the engine never sleeps);
      # prefix caching on, so that a refit leaving the old weights' cached keys and values would show in gen_kl
      run_stage grpo_resident 570 python3 "$REPO"/tests/gpu/test_grpo_learning.py --root /tmp/rlc-grpo-resident \
        --out "$OUT/grpo_resident" --steps "${GRPO_STEPS:-100}" --timeout "${GRPO_TIMEOUT:-380}" \
        --set refit.keep_weights_awake=true --set refit.sleep_level=1 --set refit.keep_kv_cache_awake=true \
        --set refit.direct_export=true --set refit.zero_copy_views=true --set refit.replay_load=true \
        --set generation.vllm_kwargs.enable_prefix_caching=true --set refit.verify_every=25 ;;
    grpo_kv_asleep)  # grpo_resident's switches with the KV cache released between rollouts (its same-loan A/B: the
      # resident run generated slower than the KV-asleep one on the same machine)
      run_stage grpo_kv_asleep 570 python3 "$REPO"/tests/gpu/test_grpo_learning.py --root /tmp/rlc-grpo-kv-asleep \
        --out "$OUT/grpo_kv_asleep" --steps "${GRPO_STEPS:-100}" --timeout "${GRPO_TIMEOUT:-380}" \
        --set refit.keep_weights_awake=true --set refit.sleep_level=1 --set refit.keep_kv_cache_awake=false \
        --set refit.direct_export=true --set refit.zero_copy_views=true --set refit.replay_load=true \
        --set generation.vllm_kwargs.enable_prefix_caching=true --set refit.verify_every=25 ;;
    kv_wake)  # vLLM's sleep-mode allocator: releasing and mapping back a KV-sized pool, by allocation count and gap
      run_stage kv_wake 400 python3 "$REPO"/benchmarks/kv_wake.py --pool-gib "${KV_POOL_GIB:-40}" \
        --allocations "${KV_ALLOCATIONS:-1,36,288}" --gaps "${KV_GAPS:-0,0.5}" --repeats 10 --json "$OUT/kv_wake.json" ;;
    grpo_smoke) run_stage grpo_smoke 300 python3 "$REPO"/tests/gpu/test_grpo_learning.py --root /tmp/rlc-smoke --steps 4 --resume-steps 2 --timeout 200 --smoke ;;
    engine_options) run_stage engine_options 300 python3 "$REPO"/tests/gpu/test_grpo_learning.py --root /tmp/rlc-engine-options \
      --out "$OUT/engine_options" --steps 4 --resume-steps 0 --timeout 240 --smoke \
      --set training.use_precision_aware_optimizer=true --set generation.kv_cache_memory_bytes=2147483648 \
      --set generation.vllm_kwargs.enable_prefix_caching=true --set loss.importance_sampling_correction=true ;;
    grad_bf16)  # training.grad_reduce_in_fp32 off: Megatron's DDP keeps the grad buffers in bf16 (NeMo-RL's setting)
      run_stage grad_bf16 300 python3 "$REPO"/tests/gpu/test_grpo_learning.py --root /tmp/rlc-grad-bf16 \
        --out "$OUT/grad_bf16" --steps 4 --resume-steps 0 --timeout 240 --smoke --set training.grad_reduce_in_fp32=false ;;
    param_offload)  # refit.offload_params_for_generation on, then the same smoke run off: compare
      # summary.memory_used_gib_mean.generate in param_offload/ and param_offload_off/grpo_learning.json
      run_stage param_offload 300 python3 "$REPO"/tests/gpu/test_grpo_learning.py --root /tmp/rlc-param-offload \
        --out "$OUT/param_offload" --steps 4 --resume-steps 2 --timeout 240 --smoke \
        --set refit.offload_params_for_generation=true --set checkpointing.every_steps=2
      run_stage param_offload_off 300 python3 "$REPO"/tests/gpu/test_grpo_learning.py --root /tmp/rlc-param-offload-off \
        --out "$OUT/param_offload_off" --steps 4 --resume-steps 0 --timeout 240 --smoke ;;
    moe_sleep) run_stage moe_sleep 400 python3 "$REPO"/tests/gpu/test_moe_sleep_memory.py --out "$OUT" ;;
    specdec) run_stage specdec 400 python3 "$REPO"/tests/gpu/test_mtp_drafter.py --out "$OUT" ;;
    host_copy) run_stage host_copy 400 python3 "$REPO"/tests/gpu/test_sleep_host_copy.py --out "$OUT" ;;
    ref_offload)  # training.offload_reference_policy: swapped vs resident reference logprobs, memory vs the plan
      run_stage ref_offload 420 python3 "$REPO"/tests/gpu/test_ref_offload.py --root /tmp/rlc-ref-offload \
        --out "$OUT/ref_offload" ${REF_OFFLOAD_SKIP_DRIVER:+--skip-driver} ;;
    fp8_keep)  # generation.fp8.keep_bf16: the named layers bf16 in the FP8 engine (block and tensor scales) and on the wire
      run_stage fp8_keep 300 python3 "$REPO"/tests/gpu/test_fp8_keep.py --root /tmp/rlc-fp8-keep --out "$OUT/fp8_keep" ;;
    model_overrides)  # model.overrides build the trainer and vLLM alike (RoPE base; MTP blocks in Bridge's provider)
      run_stage model_overrides 300 python3 "$REPO"/tests/gpu/test_model_overrides.py --root /tmp/rlc-model-overrides \
        --out "$OUT/model_overrides" ;;
    moe1) run_stage moe1 590 python3 "$REPO"/tests/gpu/test_moe_one_gpu.py --out "$OUT" --steps "${MOE1_STEPS:-150}" ;;
    r3)  # routing replay off vs on, tiny MoE on one GPU: R3_STEPS per run (default 40: both runs in ~8 min);
      # R3_ONLY=on or off runs one of the pair in a call of its own (default on,off: a replay failure shows first);
      # R3_PRIOR=path: the first call's router_replay.json (carried in the tree) joins the second call's for the comparison;
      # R3_SPECDEC=0 drops the MTP drafter; R3_TIMEOUT: seconds per run, startup included
      r3_args=(--out "$OUT" --steps "${R3_STEPS:-40}" --only "${R3_ONLY:-on,off}" --timeout "${R3_TIMEOUT:-280}")
      [[ ${R3_SPECDEC:-1} == 0 ]] && r3_args+=(--no-specdec)
      [[ -n ${R3_PRIOR:-} ]] && r3_args+=(--prior "$R3_PRIOR")
      for kv in ${R3_SETS:-}; do r3_args+=(--set "$kv"); done  # e.g. R3_SETS=training.sequence_packing.enabled=true
      run_stage r3 590 python3 "$REPO"/tests/gpu/test_router_replay.py "${r3_args[@]}" ;;
    two_gpu) run_stage two_gpu 500 python3 "$REPO"/tests/gpu/test_two_gpu.py --out "$OUT" --only "${ONLY:-param_sync,ep2_metadata,calibration}" ;;
    prod_dense|prod_moe)  # GRPO with a KL penalty, the reference in host memory and packing, from a compiled bundle
      # (PROD_STEPS, default 150; PROD_SETS: more space-separated KEY=VALUE, e.g. routing replay for the MoE;
      # PROD_BUDGET: seconds for the check, default 560; the run stops once the goal is reached after step 50)
      m=${stage#prod_}; sets=(); for s in ${PROD_SETS:-}; do sets+=(--set "$s"); done
      run_stage "$stage" $(( ${PROD_BUDGET:-560} + 30 )) python3 "$REPO"/tests/gpu/test_production_settings.py --model "$m" \
        --root "/tmp/rlc-$stage" --out "$OUT/$stage" --steps "${PROD_STEPS:-150}" --budget "${PROD_BUDGET:-560}" "${sets[@]}" ;;
    packing)  # packed vs padded logprobs/loss/gradients (tolerance from the padded pass's bf16 error vs fp32), tokens/s
      run_stage packing 480 python3 "$REPO"/tests/gpu/test_sequence_packing.py --root /tmp/rlc-packing --out "$OUT/packing" ;;
    packing_cp2)  # the same under context parallelism 2 (nvidia-h200-x2)
      run_stage packing_cp2 540 python3 "$REPO"/tests/gpu/test_sequence_packing.py --root /tmp/rlc-packing-cp2 --out "$OUT/packing_cp2" --cp 2 ;;
    packing_smoke)  # the tiny GRPO smoke run with training.sequence_packing on: driver, gen-KL check and refit over packed passes
      run_stage packing_smoke 300 python3 "$REPO"/tests/gpu/test_grpo_learning.py --root /tmp/rlc-packing-smoke \
        --out "$OUT/packing_smoke" --steps 4 --resume-steps 0 --timeout 240 --smoke --set training.sequence_packing.enabled=true ;;
    packed_rope)  # RoPE on packed rows: megatron-core's unfused per-sequence loop vs the fused kernel (time, error vs fp32)
      run_stage packed_rope 300 python3 "$REPO"/tests/gpu/test_packed_rope.py --out "$OUT/packed_rope" ;;
    packed_mla)  # packed rows through MLA's RoPE (unfused per sequence vs megatron-core's fused kernels) and the MTP
      # shift (megatron-core's per-sequence roll vs the runtime's whole-row one, bit for bit): time, error vs fp32
      run_stage packed_mla 300 python3 "$REPO"/tests/gpu/test_packed_mla.py --out "$OUT/packed_mla" ;;
    mcore_shared)  # generation.backend megatron, shared mode: the dense toy task learns (docs/generation-backends.md)
      run_stage mcore_shared 540 python3 "$REPO"/tests/gpu/test_mcore_generation.py --case shared --root /tmp/rlc-mcore-shared \
        --out "$OUT" --steps "${MCORE_STEPS:-150}" --timeout 430 ;;
    mcore_moe)  # the same on the tiny MoE (fp32 router bias, MTP layer), shared mode; the dense recipe's micro batch
      # (2048 rollouts in one pass instead of 8 of 256: the recipe's 3.5 s steps do not fit 150 steps in one call)
      run_stage mcore_moe 585 python3 "$REPO"/tests/gpu/test_mcore_generation.py --case moe --root /tmp/rlc-mcore-moe \
        --out "$OUT" --steps "${MCORE_STEPS:-150}" --timeout "${MCORE_MOE_TIMEOUT:-520}" \
        --set "training.micro_batch_size=${MCORE_MOE_MICRO_BATCH:-2048}" ;;
    mcore_dedicated)  # dedicated mode: swap_model_weights every step, each swap checked bit for bit (>= 20 refits)
      run_stage mcore_dedicated 540 python3 "$REPO"/tests/gpu/test_mcore_generation.py --case dedicated \
        --root /tmp/rlc-mcore-dedicated --out "$OUT" --steps "${MCORE_DEDICATED_STEPS:-25}" --timeout 400 ;;
    mcore_vs_vllm)  # the dense recipe with each backend: step, generation and refit time, memory per phase
      run_stage mcore_vs_vllm 540 python3 "$REPO"/tests/gpu/test_mcore_generation.py --case compare \
        --root /tmp/rlc-mcore-compare --out "$OUT" --compare-steps "${MCORE_COMPARE_STEPS:-20}" --timeout 200 ;;
    mcore_reshard_tp|mcore_reshard_ep)  # nvidia-h200-x2: the dedicated inference model in another layout than the
      # trainer's (tp: train TP2 -> inference TP1 x 2 replicas; ep: train EP2 -> inference EP1, fp32 router bias);
      # GRPO with every swap checked bit for bit against the gathered trainer tensors (>= 20 refits), the toy task
      # learned, memory per phase next to the plan (MCORE_RESHARD_STEPS, default 200; MCORE_RESHARD_TIMEOUT, driver s)
      run_stage "$stage" 530 python3 "$REPO"/tests/gpu/test_mcore_reshard.py --case "${stage#mcore_reshard_}" \
        --root "/tmp/rlc-$stage" --out "$OUT" --steps "${MCORE_RESHARD_STEPS:-200}" \
        --timeout "${MCORE_RESHARD_TIMEOUT:-400}" ;;
    moe2) run_stage moe2 590 python3 "$REPO"/tests/gpu/test_moe_two_gpu.py --out "$OUT" --only "${ONLY:-mtp_off,per_rank_off,fp32_off}" ;;
    fp8_refit) run_stage fp8_refit 540 python3 "$REPO"/tests/gpu/test_fp8_refit.py --case dense-8b \
      --scales "${FP8_SCALES:-block}" --out "$OUT" ${FP8_CUDA_GRAPHS:+--cuda-graphs} ;;
    fp8_refit_moe) run_stage fp8_refit_moe 540 python3 "$REPO"/tests/gpu/test_fp8_refit.py --case moe-1gpu \
      --scales "${FP8_SCALES:-block}" --fp8-util 0.40 --refits 2 --out "$OUT" ;;
    fp8_grpo) run_stage fp8_grpo 540 python3 "$REPO"/tests/gpu/test_fp8_grpo.py --scales "${FP8_GRPO_SCALES:-tensor}" \
      --steps "${FP8_GRPO_STEPS:-150}" --timeout 420 --out "$OUT/fp8_grpo" ;;
    fp8_grpo_block)  # block scales run on DeepGEMM, whose kernels vLLM JIT-compiles at engine start (about 200 s on
      # a fresh host), so this stage runs 40 steps, verified at 0, 20 and 40; learning is the tensor-scale stage's proof
      run_stage fp8_grpo_block 570 python3 "$REPO"/tests/gpu/test_fp8_grpo.py --scales block \
      --root /tmp/rlc-fp8-grpo-block --steps "${FP8_GRPO_STEPS:-40}" --verify-every 20 \
      --timeout "${FP8_GRPO_TIMEOUT:-520}" --out "$OUT/fp8_grpo_block" ;;
    fp8_train) run_stage fp8_train 540 python3 "$REPO"/tests/gpu/test_fp8_train.py --recipe "${FP8_TRAIN_RECIPE:-blockwise}" \
      --steps 8 --timeout 240 --out "$OUT/fp8_train" ;;
    *) log "unknown stage $stage" ;;
  esac
done
# At most 8 files come back from $OUT per call: past that, each folder travels as one archive
if (( $(find "$OUT" -type f | wc -l) > 8 )); then
  for d in "$OUT"/*/; do
    [[ -d $d ]] || continue
    name=$(basename "$d")
    tar -czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "$OUT/$name" && log "packed $name/ into $name.tgz"
  done
fi
log "done; files: $(ls "$OUT" | tr '\n' ' ')"
