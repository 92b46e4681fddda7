"""The swap check of a resharded inference model across two real gloo ranks: each rank gathers the trainer's
pieces over the trainer's groups (tensor-parallel pieces joined, experts under their global index), cuts what its
own inference tensors should hold and compares them bit for bit and in dtype. A correct swap passes; a wrong
element, a gated MLP joined without its stride, an expert under the wrong global index or an fp32 router bias
left in bf16 each fail with the tensor named. The tensors carry megatron-core's attributes
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, ``allreduce``) as plain values."""
from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.gloo_ranks import run_ranks

WORLD = 2
FC1 = "decoder.layers.0.mlp.linear_fc1.weight"
PROJ = "decoder.layers.0.self_attention.linear_proj.weight"
NORM = "decoder.final_layernorm.weight"
EXPERT = "decoder.layers.1.mlp.experts.linear_fc1.weight{}"
BIAS = "decoder.layers.1.mlp.router.expert_bias"


def _param(t: torch.Tensor, *, tp: bool = False, dim: int = 0, stride: int = 1, allreduce: bool = True):
    p = torch.nn.Parameter(t, requires_grad=False)
    p.tensor_model_parallel, p.partition_dim, p.partition_stride, p.allreduce = tp, dim, stride, allreduce
    return p


def _full(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def _tp2_train(rank: int) -> dict[str, torch.Tensor]:
    fc1, proj = _full(FC1, (8, 4)), _full(PROJ, (4, 6))
    gate, up = fc1.chunk(2)
    return {FC1: _param(torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]), tp=True, stride=2),
            PROJ: _param(proj.chunk(2, dim=1)[rank].contiguous(), tp=True, dim=1), NORM: _param(_full(NORM, (4,)))}


def _tp1_inference(fault: str) -> dict[str, torch.Tensor]:
    fc1 = _full(FC1, (8, 4))
    if fault == "no_stride":  # the TP2 pieces laid end to end: [g0 u0 g1 u1] instead of [g0 g1 u0 u1]
        gate, up = fc1.chunk(2)
        fc1 = torch.cat([gate.chunk(2)[0], up.chunk(2)[0], gate.chunk(2)[1], up.chunk(2)[1]])
    proj = _full(PROJ, (4, 6)).clone()
    if fault == "element":
        proj[1, 5] += 1
    return {FC1: _param(fc1, tp=True, stride=2), PROJ: _param(proj, tp=True, dim=1), NORM: _param(_full(NORM, (4,)))}


def _ep2_train(rank: int) -> dict[str, torch.Tensor]:
    out = {EXPERT.format(k): _param(_full(EXPERT.format(4 * rank + k), (2, 3)), tp=True, allreduce=False)
           for k in range(4)}
    out[BIAS] = torch.arange(8, dtype=torch.float32) / 3  # fp32, not representable in bf16
    return out


def _ep1_inference(fault: str) -> dict[str, torch.Tensor]:
    out = {EXPERT.format(k): _param(_full(EXPERT.format(k), (2, 3)), tp=True) for k in range(8)}
    if fault == "expert_order":  # the second rank's experts under local indices 0..3 again
        out[EXPERT.format(4)] = _param(_full(EXPERT.format(0), (2, 3)), tp=True)
    bias = torch.arange(8, dtype=torch.float32) / 3
    out[BIAS] = bias.to(torch.bfloat16) if fault == "bias_bf16" else bias
    return out


def _worker(rank: int, world: int, case: str, fault: str) -> tuple[dict, list]:
    import torch.distributed as dist

    from rlc.runtime.generation.reshard_verify import expected_inference_tensors, gathered_training_tensors
    from rlc.runtime.refit.verify import compare_parameters

    both = dist.new_group([0, 1])
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in one order
    mine = singles[rank]
    if case == "tp":
        train_pg = SimpleNamespace(tp=both, ep=mine, expt_tp=mine)
        train, inference, experts = _tp2_train(rank), _tp1_inference(fault), None
    else:
        train_pg = SimpleNamespace(tp=mine, ep=both, expt_tp=mine)
        train, inference, experts = _ep2_train(rank), _ep1_inference(fault), 8
    infer_pg = SimpleNamespace(tp=mine, ep=mine, expt_tp=mine)
    cfg = SimpleNamespace(num_moe_experts=experts)
    whole = gathered_training_tensors(SimpleNamespace(pg_collection=train_pg, config=cfg), train)
    expected, unmatched = expected_inference_tensors(SimpleNamespace(pg_collection=infer_pg, config=cfg),
                                                     inference, whole)
    return compare_parameters(inference, expected).to_dict(), unmatched


def _run(case: str, fault: str = "") -> list[dict]:
    with tempfile.TemporaryDirectory() as rendezvous:
        out = run_ranks(_worker, WORLD, Path(rendezvous), case, fault)
    assert all(unmatched == [] for _, unmatched in out)
    return [report for report, _ in out]


def _bad(reports: list[dict]) -> list[list[str]]:
    return [sorted(m["name"] for m in r["mismatches"]) for r in reports]


def test_tp2_to_tp1_swap_checks_exact_and_catches_faults():
    ok = _run("tp")
    assert all(r["bit_exact"] and r["params_compared"] == 3 for r in ok)
    assert _bad(_run("tp", "element")) == [[PROJ], [PROJ]]
    assert _bad(_run("tp", "no_stride")) == [[FC1], [FC1]]


def test_ep2_to_ep1_swap_checks_every_expert_and_the_fp32_bias():
    ok = _run("ep")
    assert all(r["bit_exact"] and r["params_compared"] == 9 and r["fp32_params"] == [BIAS] for r in ok)
    assert _bad(_run("ep", "expert_order")) == [[EXPERT.format(4)]] * 2
    bf16 = _run("ep", "bias_bf16")
    assert _bad(bf16) == [[BIAS], [BIAS]]
    assert all(r["mismatches"][0]["rounded_to_bf16"] for r in bf16)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
