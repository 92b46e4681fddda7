"""Direct export: finding which of an exporter's tensors are views or row selections of the trainer's parameters,
and exporting them from the parameters as they are at each refit.

The exporter here follows Megatron-Bridge's conversions at tensor parallelism 1 on a Megatron-shaped layer: the
interleaved ``linear_qkv`` split into q, k and v (Bridge's ``split_qkv_weights``: per query group, its query heads
then one key and one value head), ``linear_fc1`` chunked into gate and up, other parameters as they are, and one
computed tensor (a zero-centred norm exported as ``1 + w``). The tasks carry the fields the finder reads from
Bridge's ``WeightConversionTask`` (``mapping.hf_param``, ``param_weight``, ``global_param_name``).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlc.runtime.policy.direct_export import (
    DirectExport,
    DirectExportError,
    DirectFinder,
    ParamRows,
    ParamsByStorage,
    ParamView,
    row_hashes,
    rows_of,
)
from rlc.runtime.refit.sources import RowsOf, View, copy_export, materialize
from rlc.runtime.refit.specs import TensorSpec

GROUPS, HEADS_PER_GROUP, HEAD_DIM, HIDDEN, INTER = 2, 3, 4, 16, 24


@dataclass
class Task:
    global_param_name: str
    param_weight: Any
    mapping: Any


def _layer(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    rows = GROUPS * (HEADS_PER_GROUP + 2) * HEAD_DIM

    def param(*shape: int) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.randn(*shape, generator=g).to(torch.bfloat16))

    return {"linear_qkv.weight": param(rows, HIDDEN), "linear_fc1.weight": param(2 * INTER, HIDDEN),
            "linear_fc2.weight": param(HIDDEN, INTER), "layer_norm_weight": param(HIDDEN),
            "q_layernorm.weight": param(HEAD_DIM)}


def split_qkv(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's interleaved QKV as separate q, k, v (new tensors, as Bridge's split returns them)."""
    per = qkv.view(GROUPS, HEADS_PER_GROUP + 2, HEAD_DIM, HIDDEN)
    return (per[:, :HEADS_PER_GROUP].reshape(-1, HIDDEN), per[:, HEADS_PER_GROUP].reshape(-1, HIDDEN),
            per[:, HEADS_PER_GROUP + 1].reshape(-1, HIDDEN))


def _tasks(layer: dict[str, torch.nn.Parameter]) -> list[Task]:
    def task(param: str, hf: Any) -> Task:
        return Task(f"decoder.layers.0.{param}", layer[param], SimpleNamespace(hf_param=hf))

    a = "model.layers.0.self_attn"
    qkv = {"q": f"{a}.q_proj.weight", "k": f"{a}.k_proj.weight", "v": f"{a}.v_proj.weight"}
    return [task("linear_qkv.weight", qkv),
            task("linear_fc1.weight", {"gate": "model.layers.0.mlp.gate_proj.weight",
                                       "up": "model.layers.0.mlp.up_proj.weight"}),
            task("linear_fc2.weight", "model.layers.0.mlp.down_proj.weight"),
            task("layer_norm_weight", "model.layers.0.input_layernorm.weight"),
            task("q_layernorm.weight", f"{a}.q_norm.weight")]


def bridge_export(layer: dict[str, torch.nn.Parameter], tasks: list[Task] | None = None):
    """What Bridge yields for ``tasks`` (all of them by default), in task order."""
    a = "model.layers.0.self_attn"
    out = {}
    q, k, v = split_qkv(layer["linear_qkv.weight"].detach())
    out["linear_qkv.weight"] = [(f"{a}.q_proj.weight", q), (f"{a}.k_proj.weight", k), (f"{a}.v_proj.weight", v)]
    gate, up = torch.chunk(layer["linear_fc1.weight"].detach(), 2, dim=0)
    out["linear_fc1.weight"] = [("model.layers.0.mlp.gate_proj.weight", gate),
                                ("model.layers.0.mlp.up_proj.weight", up)]
    out["linear_fc2.weight"] = [("model.layers.0.mlp.down_proj.weight", layer["linear_fc2.weight"].detach())]
    out["layer_norm_weight"] = [("model.layers.0.input_layernorm.weight", layer["layer_norm_weight"].detach())]
    out["q_layernorm.weight"] = [(f"{a}.q_norm.weight", layer["q_layernorm.weight"].detach() + 1)]  # computed
    for t in tasks if tasks is not None else _tasks(layer):
        yield from out[t.global_param_name.removeprefix("decoder.layers.0.")]


def _plan(layer):
    tasks = _tasks(layer)
    finder = DirectFinder(tasks, ParamsByStorage(layer.values()))
    specs = []
    for name, tensor in bridge_export(layer):
        specs.append(TensorSpec.from_tensor(name, tensor))
        finder.observe(name, tensor)
    return finder.plan(tasks, specs), specs


def test_views_slices_and_qkv_rows_are_found_and_computed_tensors_stay_with_bridge():
    layer = _layer()
    direct, specs = _plan(layer)
    kinds = {n: type(s).__name__ for n, s in direct.sources.items()}
    a = "model.layers.0.self_attn"
    assert kinds == {f"{a}.q_proj.weight": "ParamRows", f"{a}.k_proj.weight": "ParamRows",
                     f"{a}.v_proj.weight": "ParamRows", "model.layers.0.mlp.gate_proj.weight": "ParamView",
                     "model.layers.0.mlp.up_proj.weight": "ParamView",
                     "model.layers.0.mlp.down_proj.weight": "ParamView",
                     "model.layers.0.input_layernorm.weight": "ParamView"}
    assert "computes it" in direct.refused[f"{a}.q_norm.weight"]
    assert [t.global_param_name for t in direct.bridge_tasks] == ["decoder.layers.0.q_layernorm.weight"]
    # the wire order: direct tensors first (in Bridge's order), then Bridge's remaining export
    assert [s.name for s in direct.wire_specs(specs)] == [n for n in kinds] + [f"{a}.q_norm.weight"]
    direct.check_rest(specs, (n for n, _ in bridge_export(layer, direct.bridge_tasks)))
    assert direct.summary()["row_gathers"] == 3 and direct.summary()["views"] == 4


def test_every_refit_reads_the_parameters_as_they_are_then():
    layer = _layer()
    direct, _ = _plan(layer)
    with torch.no_grad():
        layer["linear_qkv.weight"].mul_(-2)  # an optimizer step in place
        layer["linear_fc1.weight"].data = layer["linear_fc1.weight"].data.clone() * 3  # offloaded and restored
    want = dict(bridge_export(layer))
    got = {n: materialize(t) for n, t in direct.stream()}
    assert set(got) == set(want) - {"model.layers.0.self_attn.q_norm.weight"}
    for name, tensor in got.items():
        assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name


def test_rows_are_gathered_straight_into_the_producers_buffer():
    layer = _layer()
    q, _, _ = split_qkv(layer["linear_qkv.weight"].detach())
    rows = rows_of(q, layer["linear_qkv.weight"])
    assert isinstance(rows, ParamRows)
    source = rows.tensor()
    assert isinstance(source, RowsOf) and source.shape == q.shape
    buffer = torch.zeros(q.numel() + 64, dtype=torch.bfloat16)
    out = buffer[64:].view(q.shape)
    copy_export(out, source)
    assert torch.equal(out, q) and bool((buffer[:64] == 0).all())
    wide = torch.zeros(q.shape, dtype=torch.float32)  # a converting pack goes through a gathered tensor
    copy_export(wide, source)
    assert torch.equal(wide, q.float())


def test_ambiguous_or_foreign_rows_are_refused():
    base = torch.randn(8, HIDDEN).to(torch.bfloat16)
    assert rows_of(base[[5, 1, 2]].clone(), base) is not None
    twice = base.clone()
    twice[6] = twice[1]  # the parameter holds row 1 twice: which one a tensor's row comes from is unknown
    assert rows_of(twice[[1, 3]].clone(), twice) is None
    assert rows_of(twice[[3, 4]].clone(), twice) is not None  # rows held once are fine
    assert rows_of(base[[2, 2]].clone(), base) is None  # the same row twice in the tensor
    assert rows_of(base[[1, 2]].clone() + 1, base) is None  # computed rows
    assert rows_of(base[[1, 2]].float(), base) is None  # converted rows
    assert torch.equal(row_hashes(base[[3, 3]]), row_hashes(base[3:4]).repeat(2))


def test_a_view_must_lie_inside_one_parameter_of_its_dtype():
    flat = torch.randn(40).to(torch.bfloat16)  # two parameters in one buffer, as Megatron's DDP holds them
    a, b = flat[:16].view(4, 4), flat[16:40].view(6, 4)
    params = ParamsByStorage([a, b])
    found = params.view_of(flat[20:28].view(2, 4))
    assert isinstance(found, ParamView) and found.param is b and torch.equal(found.tensor(), flat[20:28].view(2, 4))
    assert params.view_of(flat[12:20]) is None  # straddles both
    assert params.view_of(flat[16:24].view(torch.int16)) is None  # reinterpreted bits


def test_a_task_only_partly_direct_stays_with_bridge_and_a_wrong_rest_is_an_error():
    layer = _layer()
    tasks = _tasks(layer)
    finder = DirectFinder(tasks, ParamsByStorage(layer.values()))
    specs = []
    for name, tensor in bridge_export(layer):
        if name.endswith("v_proj.weight"):
            tensor = tensor * 1  # Bridge made a copy of v that is not a row selection (a new tensor is fine) ...
            tensor[0, 0] += 1  # ... but different values are not
        specs.append(TensorSpec.from_tensor(name, tensor))
        finder.observe(name, tensor)
    direct = finder.plan(tasks, specs)
    assert not any(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) for n in direct.sources)
    assert "another tensor of its conversion task" in direct.refused["model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(DirectExportError, match="does not yield exactly the other tensors"):
        direct.check_rest(specs, ["model.layers.0.self_attn.q_norm.weight"])


def test_extra_tensors_belong_to_the_task_exported_last():
    """A tied embedding's task also yields the LM head (Bridge clones the embedding for it): both go direct, the
    clone as a view of the whole embedding; a task whose extra tensor is computed stays with Bridge whole."""
    g = torch.Generator().manual_seed(3)
    embed = torch.nn.Parameter(torch.randn(32, HIDDEN, generator=g).to(torch.bfloat16))
    norm = torch.nn.Parameter(torch.randn(HIDDEN, generator=g).to(torch.bfloat16))
    tasks = [Task("embedding.word_embeddings.weight", embed, SimpleNamespace(hf_param="model.embed_tokens.weight")),
             Task("decoder.final_layernorm.weight", norm, SimpleNamespace(hf_param="model.norm.weight"))]

    def export():
        yield "model.embed_tokens.weight", embed.detach()
        yield "lm_head.weight", embed.detach().clone()  # the tied output
        yield "model.norm.weight", norm.detach()
        yield "model.norm.bias_like", norm.detach() * 0  # a hook's computed extra

    finder = DirectFinder(tasks, ParamsByStorage([embed, norm]))
    specs = []
    for name, tensor in export():
        specs.append(TensorSpec.from_tensor(name, tensor))
        finder.observe(name, tensor)
    direct = finder.plan(tasks, specs)
    assert list(direct.sources) == ["model.embed_tokens.weight", "lm_head.weight"]
    assert isinstance(direct.sources["lm_head.weight"], ParamView)  # every row in order: no gather
    assert [t.global_param_name for t in direct.bridge_tasks] == ["decoder.final_layernorm.weight"]
    assert "another tensor of its conversion task" in direct.refused["model.norm.weight"]
    with torch.no_grad():
        embed.add_(1)
    assert all(torch.equal(t, embed.detach()) for _, t in direct.stream())


def test_only_contiguous_views_are_read_in_place():
    direct, _ = _plan(_layer())
    assert direct.in_place_views() == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                       "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight"]
    p = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16))
    transposed = DirectExport({"t": ParamView(p, View.of(p.detach().t(), p.detach())),
                               "rows": ParamView(p, View.of(p.detach()[1:3], p.detach()))}, [])
    assert transposed.in_place_views() == ["rows"]  # a transposed view is not one byte range of the parameter
