"""RLC33x: FP8 rollouts (block-scale alignment, options the FP8 engine owns) and FP8 training (GPU support)."""
from __future__ import annotations

from rlc.compiler.catalog.errors import CatalogError
from rlc.compiler.catalog.gpus import gpu_spec
from rlc.compiler.planner.fp8_layout import block_alignment_problems, fp8_scales
from rlc.compiler.planner.layout import generation_layout
from rlc.compiler.rules.engine import Context, rule


@rule("RLC330", "FP8 rollouts: block scales need 128-aligned projections; the FP8 engine owns its load options",
      severities=("error", "info"), needs=("facts",),
      rationale="With generation.fp8.scales: block the trainer quantizes every exported projection in 128×128 "
                "blocks (vLLM's own per-block function) and vLLM loads the FP8 weights and their scales as a "
                "DeepSeek-V3-style checkpoint: it fuses q/k/v and gate/up and slices them by tensor parallelism. "
                "That equals vLLM quantizing the bf16 weight itself only when every fused part and every "
                "tensor-parallel slice starts on a block boundary; vLLM refuses such a checkpoint at start "
                "otherwise. Per-tensor scales have no such condition: vLLM quantizes as it loads. scales: auto "
                "takes block scales where they fit and tensor scales elsewhere, and says which. The FP8 engine "
                "with block scales starts from random weights (load_format dummy; the first refit writes the "
                "trainer's), so a pass-through load_format or quantization config would contradict it.",
      seed="vLLM 0.22 fp8.py (Fp8LinearMethod, Fp8MoEMethod.create_weights) and fp8_utils.py "
           "(validate_fp8_block_shape); vllm/utils/deep_gemm.py per_block_cast_to_fp8.",
      fixes="Use generation.fp8.scales: tensor (or auto), or a generation TP (or vLLM expert parallelism) that keeps "
            "the shards 128-aligned; drop load_format / hf_overrides.quantization_config from generation.vllm_kwargs.")
def fp8_rollouts(ctx: Context) -> None:
    gen = ctx.recipe.generation
    if gen.precision != "fp8":
        if ctx.user_set("generation.fp8"):
            ctx.info("generation.fp8 has no effect with generation.precision: auto", "generation.fp8")
        return
    scales, reason = fp8_scales(ctx.recipe, ctx.facts)
    gl = generation_layout(ctx.recipe)
    problems = block_alignment_problems(ctx.facts, gl.tp, gl.ep, tuple(gen.fp8.keep_bf16))
    if gen.fp8.scales == "block" and problems:
        ctx.error("128×128 block scales need every quantized projection 128-aligned on each vLLM rank: "
                  + "; ".join(problems), "generation.fp8.scales",
                  hint="generation.fp8.scales: tensor or auto (vLLM quantizes as it loads)")
        return
    if gen.fp8.scales == "auto":
        ctx.decide("generation.fp8.scales", scales, reason)
        if scales == "tensor":
            ctx.info(f"auto picks tensor scales (vLLM quantizes as it loads): {'; '.join(problems) or reason}",
                     "generation.fp8.scales")
    if gen.fp8.pow2_scales and scales == "tensor":
        ctx.error("generation.fp8.pow2_scales rounds block scales; the FP8 engine has tensor scales"
                  + (f" ({reason})" if gen.fp8.scales == "auto" else ""),
                  "generation.fp8.pow2_scales", hint="generation.fp8.pow2_scales: false")
    if scales != "block":
        return
    for key in ("load_format", "hf_overrides"):
        value = gen.vllm_kwargs.get(key)
        if key == "load_format" and value is not None or (
                key == "hf_overrides" and isinstance(value, dict) and "quantization_config" in value):
            path = f"generation.vllm_kwargs.{key}" + (".quantization_config" if key == "hf_overrides" else "")
            ctx.error(f"{path} is set by the FP8 engine (block scales: the DeepSeek-V3 quantization config, "
                      "random start weights the first refit replaces)", path, hint=f"drop {path}")


#: Compute capability of each catalog architecture (Transformer Engine's FP8 checks are by capability).
ARCH_CAPABILITY = {"ampere": (8, 0), "ada": (8, 9), "hopper": (9, 0), "blackwell": (10, 0)}
#: The lowest capability each FP8 training recipe runs on (Transformer Engine 2.x quantization.py).
RECIPE_CAPABILITY = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}
RECIPE_NEEDS = {(8, 9): "an Ada, Hopper or Blackwell GPU (compute capability 8.9 or higher)",
                (9, 0): "a Hopper or Blackwell GPU (compute capability 9.0 or higher, CUDA 12.9 or newer)",
                (10, 0): "a Blackwell GPU (compute capability 10.0)"}


@rule("RLC331", "FP8 training needs a GPU whose tensor cores run its recipe", severities=("error",),
      rationale="Transformer Engine checks the recipe against the GPU when the first FP8 layer runs: FP8 at all "
                "needs compute capability 8.9 (Ada) or higher, block scaling 9.0 (Hopper) with CUDA 12.9, MXFP8 "
                "10.0 (Blackwell). A job whose GPUs cannot run the recipe fails after the model is built; the "
                "cluster's GPU type in the catalog says so before submission.",
      seed="Transformer Engine 2.x pytorch/quantization.py (check_fp8_support, check_fp8_block_scaling_support, "
           "check_mxfp8_support); megatron-core TransformerConfig fp8_recipe ('mxfp8' for Blackwell only).",
      fixes="Use training.fp8.recipe: blockwise (Hopper) or tensorwise / delayed, or a cluster.gpu that runs it.")
def fp8_training_gpu(ctx: Context) -> None:
    fp8 = ctx.recipe.training.fp8
    if not fp8.enabled:
        return
    try:
        arch = gpu_spec(ctx.recipe.cluster.gpu).arch
    except CatalogError:
        return  # the GPU name is reported elsewhere
    have = ARCH_CAPABILITY.get(arch)
    need = RECIPE_CAPABILITY[fp8.recipe]
    if have is not None and have < need:
        hint = ("training.fp8.recipe: blockwise (or tensorwise)" if arch == "hopper" else
                "training.fp8.recipe: tensorwise" if have >= (8, 9) else "training.fp8.enabled: false")
        ctx.error(f"FP8 training with the {fp8.recipe} recipe needs {RECIPE_NEEDS[need]}; cluster.gpu "
                  f"{ctx.recipe.cluster.gpu} is {arch.capitalize()} (compute capability {have[0]}.{have[1]})",
                  "training.fp8.recipe", hint=hint)


__all__ = ["block_alignment_problems", "fp8_scales"]
