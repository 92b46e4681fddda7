"""The driver <-> worker boundary (CPU): the worker classes implement the protocols the driver calls them through,
and every call the driver makes names a real worker method with arguments that fit it.

The type checker holds the classes to the protocols too (``_IMPLEMENTS`` in each worker module); this test does it
without it, from the signatures Python sees, and reads the driver's calls from its source.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest

from rlc.runtime.worker_api import GenerationWorkerApi, PolicyWorkerApi

pytest.importorskip("torch")

from rlc.runtime.generation.vllm_worker import VllmGenerationWorker  # noqa: E402
from rlc.runtime.policy.megatron_worker import MegatronPolicyWorker  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROTOCOLS = {"PolicyWorkerApi": (PolicyWorkerApi, MegatronPolicyWorker),
             "GenerationWorkerApi": (GenerationWorkerApi, VllmGenerationWorker)}
#: The driver's side of the boundary: every module that calls worker methods.
DRIVER_MODULES = ("driver.py", "worker_groups.py", "weight_sync.py", "generation/backend.py", "workers.py")
CALLS = {"call": 0, "submit": 0, "call_on": 1, "submit_to": 1}  # group method -> index of the method reference


def protocol_methods(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")]


def mismatches(protocol: type, cls: type) -> list[str]:
    """How ``cls`` differs from ``protocol``: missing methods, and parameters (names, kinds, defaults, annotations)
    or answers that are not the protocol's."""
    out = []
    for name in protocol_methods(protocol):
        impl = getattr(cls, name, None)
        if impl is None or not callable(impl):
            out.append(f"{cls.__name__}.{name}: missing")
            continue
        want, got = inspect.signature(getattr(protocol, name)), inspect.signature(impl)
        w = [(p.name, p.kind, p.default, p.annotation) for p in want.parameters.values()]
        g = [(p.name, p.kind, p.default, p.annotation) for p in got.parameters.values()]
        if w != g:
            out.append(f"{cls.__name__}.{name}{got} is not {protocol.__name__}.{name}{want}")
        if want.return_annotation != got.return_annotation:
            out.append(f"{cls.__name__}.{name} answers {got.return_annotation}, the protocol "
                       f"{want.return_annotation}")
    return out


def driver_calls(sources: dict[str, str]) -> list[tuple[str, int, str, str, int, list[str]]]:
    """Every ``group.call(Api.method, ...)``-like call: (file, line, protocol, method, positional args, keywords)."""
    found = []
    for file, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CALLS):
                continue
            at = CALLS[node.func.attr]
            if len(node.args) <= at:
                continue
            ref = node.args[at]
            if isinstance(ref, ast.Attribute) and isinstance(ref.value, ast.Name) and ref.value.id in PROTOCOLS:
                found.append((file, node.lineno, ref.value.id, ref.attr, len(node.args) - at - 1,
                              [k.arg for k in node.keywords if k.arg]))
    return found


def bad_calls(calls: list[tuple[str, int, str, str, int, list[str]]]) -> list[str]:
    out = []
    for file, line, api, method, positional, keywords in calls:
        cls = PROTOCOLS[api][1]
        impl = getattr(cls, method, None)
        if impl is None:
            out.append(f"{file}:{line}: {cls.__name__} has no method {method}")
            continue
        try:
            inspect.signature(impl).bind(None, *([None] * positional), **{k: None for k in keywords})
        except TypeError as exc:
            out.append(f"{file}:{line}: {cls.__name__}.{method}: {exc}")
    return out


@pytest.mark.parametrize("api", sorted(PROTOCOLS))
def test_the_worker_class_implements_the_protocol(api):
    protocol, cls = PROTOCOLS[api]
    assert protocol_methods(protocol), api
    assert mismatches(protocol, cls) == []


def test_every_call_the_driver_makes_names_a_worker_method_its_arguments_fit():
    sources = {m: (ROOT / "rlc" / "runtime" / m).read_text(encoding="utf-8") for m in DRIVER_MODULES}
    calls = driver_calls(sources)
    named = {(api, method) for _, _, api, method, _, _ in calls}
    assert len(named) >= 25, sorted(named)  # the scan sees the calls (a rename of the group's methods shows here)
    assert bad_calls(calls) == []
    for api, method in named:  # and each names a method of the protocol, not only of the class
        assert method in protocol_methods(PROTOCOLS[api][0]), (api, method)


def test_no_worker_method_is_called_by_a_string_name():
    """Ray dispatches on the name: the one place a reference becomes it is ``workers.remote_method``
    (``getattr(actor, method.__name__)``); ``getattr(actor, "name").remote(...)`` is not used."""
    for module in DRIVER_MODULES:
        for node in ast.walk(ast.parse((ROOT / "rlc" / "runtime" / module).read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
                named = node.args[1]
                assert not (isinstance(named, ast.Constant) and isinstance(named.value, str)
                            and any(isinstance(a, ast.Name) and "actor" in a.id for a in ast.walk(node.args[0]))), (
                    f"{module}:{node.lineno}: a worker method called by its name")
                if isinstance(named, ast.Attribute):
                    assert named.attr == "__name__", f"{module}:{node.lineno}"


class _Api:
    def setup(self, master: tuple[str, int], total_opt_steps: int) -> int: ...

    def memory(self) -> float: ...


class _Worker:
    def setup(self, master: tuple[str, int]) -> int:
        return 0


def test_the_checks_catch_a_changed_signature_a_missing_method_and_a_call_that_does_not_fit(monkeypatch):
    assert mismatches(_Api, _Worker) == [
        "_Worker.setup(self, master: 'tuple[str, int]') -> 'int' is not _Api.setup(self, master: 'tuple[str, int]', "
        "total_opt_steps: 'int') -> 'int'",
        "_Worker.memory: missing"]
    monkeypatch.setitem(PROTOCOLS, "_Api", (_Api, _Worker))
    calls = driver_calls({"x.py": "g.call(_Api.setup, m, 3)\ng.call_on(0, _Api.memory)\ng.submit(_Api.setup, m)\n"
                                  "g.call(other.setup, 1, 2, 3)\n"})
    assert [(c[0], c[1], c[3], c[4]) for c in calls] == [("x.py", 1, "setup", 2), ("x.py", 2, "memory", 0),
                                                         ("x.py", 3, "setup", 1)]
    problems: list[Any] = bad_calls(calls)
    assert len(problems) == 2 and problems[0].startswith("x.py:1: _Worker.setup: too many positional arguments")
    assert problems[1] == "x.py:2: _Worker has no method memory"


def test_every_method_the_vllm_worker_calls_in_its_engine_exists_there():
    """``llm.collective_rpc("name")`` runs ``name`` on each of vLLM's workers: the ``rlc_*`` names on the extension
    class the engine is started with, the others on vLLM's own worker (``wake_up`` with tags)."""
    from rlc.runtime.generation.extension import RlcWorkerExtension  # noqa: PLC0415

    source = (ROOT / "rlc" / "runtime" / "generation" / "vllm_worker.py").read_text(encoding="utf-8")
    called = {node.args[0].value for node in ast.walk(ast.parse(source))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "collective_rpc" and node.args and isinstance(node.args[0], ast.Constant)}
    assert {"rlc_sleep_kv_cache", "rlc_refit_receive", "wake_up"} <= called, called
    missing = [name for name in called if name.startswith("rlc_") and not callable(getattr(RlcWorkerExtension, name,
                                                                                           None))]
    assert missing == []
    assert called - {n for n in called if n.startswith("rlc_")} == {"wake_up"}  # vLLM's Worker.wake_up(tags)
