"""An FP8 refit through the real refit engine on CPU (shared-memory transport, producer and consumer in two
threads): the trainer's block-quantized stream crosses the wire as float8_e4m3fn weights plus fp32 scales
(not cast to bf16), bit for bit, and a consumer that keeps the tensors it was given across buckets (what
vLLM's layerwise reload does until a layer is complete) gets a private copy of each bucket instead of
views of a buffer the producer overwrites.
"""
from __future__ import annotations

import threading
import uuid

import pytest
import torch

from rlc.contract.fp8 import SCALE_SUFFIX
from tests.refit import harness as H
from rlc.runtime.refit.buffers import ShmBackend
from rlc.runtime.refit.consumer import RefitConsumer
from rlc.runtime.refit.errors import RefitLeakError
from rlc.runtime.refit.fp8 import quantize_blocks, quantize_export, quantized_specs
from rlc.runtime.refit.producer import RefitProducer
from rlc.runtime.refit.specs import TensorSpec

LAYER = [("model.embed_tokens.weight", (40, 256)), ("model.layers.0.self_attn.q_proj.weight", (128, 256)),
         ("model.layers.0.self_attn.k_proj.weight", (128, 256)), ("model.layers.0.input_layernorm.weight", (256,)),
         ("model.layers.0.mlp.gate.weight", (4, 256))]
LAYER += [
    (f"model.layers.0.mlp.experts.{e}.{p}.weight", (128, 256)) for e in range(3) for p in ("gate_proj", "up_proj")
]
LAYER += [("lm_head.weight", (40, 256))]


def export(step: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [(n, (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)) for n, s in LAYER]


def refit(keep: bool, copy_buckets: bool, steps: int = 2) -> dict:
    """One producer thread and one consumer (this thread) over shm; 64 KiB halves: several buckets."""
    session = uuid.uuid4().hex[:10]
    key = f"fp8-{session}"
    cfg = H.refit_config(buffer_gb=(128 << 10) / (1 << 30))
    specs = quantized_specs([TensorSpec.from_tensor(n, t) for n, t in export(0)])
    producer = RefitProducer(cfg, session=session, rank=0, world_size=1, export_dtype="bfloat16",
                             backend=ShmBackend(key), free_bytes=1 << 24, timeout_s=20.0,
                             extra_fp32_params=["*" + SCALE_SUFFIX])
    consumer = RefitConsumer(session=session, backend=ShmBackend(key), timeout_s=20.0)
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            producer.prepare(specs)
            for step in range(steps):
                producer.send(quantize_export(iter(export(step)), quantize_blocks))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    thread = threading.Thread(target=produce)
    thread.start()
    out: dict = {"wire": None, "received": [], "buckets": []}
    try:
        out["wire"] = {s.name: s for s in consumer.prepare()}
        for _ in range(steps):
            got: dict[str, torch.Tensor] = {}

            def load(weights):
                for name, t in weights:
                    got[name] = t if keep else t.clone()  # noqa: B023

            out["buckets"].append(consumer.receive(load, copy_buckets=copy_buckets).num_buckets)
            out["received"].append({n: t.clone() for n, t in got.items()})
    finally:
        thread.join(timeout=30)
        consumer.close()
        producer.close()
    if errors:
        raise errors[0]
    return out


def test_fp8_weights_and_scales_cross_the_wire_unchanged_and_router_embedding_stay_bf16():
    out = refit(keep=True, copy_buckets=True)
    wire = out["wire"]
    assert wire["model.layers.0.self_attn.q_proj.weight"].dtype == "float8_e4m3fn"
    assert wire["model.layers.0.self_attn.q_proj.weight_scale_inv"].dtype == "float32"
    assert wire["model.layers.0.mlp.gate.weight"].dtype == "bfloat16"
    assert wire["model.embed_tokens.weight"].dtype == "bfloat16"
    assert min(out["buckets"]) > 2
    for step, received in enumerate(out["received"]):
        want = dict(quantize_export(iter(export(step)), quantize_blocks))
        assert set(received) == set(want)
        for name, t in received.items():
            w = want[name]
            assert t.dtype == w.dtype, name
            if t.element_size() == 1:
                assert torch.equal(t.view(torch.uint8), w.view(torch.uint8)), name
            else:
                assert torch.equal(t, w), name


def test_a_loader_that_keeps_tensors_needs_the_bucket_copies():
    with pytest.raises(RefitLeakError, match="still referenced"):
        refit(keep=True, copy_buckets=False, steps=1)
    refit(keep=False, copy_buckets=False, steps=1)  # a loader that copies is fine without them


def test_kept_layers_travel_unquantized_and_the_list_says_so():
    keep = ("mlp.experts",)
    specs = {s.name: s for s in quantized_specs([TensorSpec.from_tensor(n, t) for n, t in export(0)], keep)}
    sent = dict(quantize_export(iter(export(0)), quantize_blocks, keep=keep))
    expert = "model.layers.0.mlp.experts.1.up_proj.weight"
    assert specs[expert].dtype == "bfloat16" and sent[expert].dtype == torch.bfloat16
    assert expert + SCALE_SUFFIX not in specs and expert + SCALE_SUFFIX not in sent
    q = "model.layers.0.self_attn.q_proj.weight"
    assert specs[q].dtype == "float8_e4m3fn" and sent[q].dtype == torch.float8_e4m3fn
    assert list(specs) == list(sent)  # the announced list is the stream's
