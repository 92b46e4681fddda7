"""rlc's modules import each other without circles, at the top of the module.

Read with ``ast`` (``tests/repo/import_graph.py``), so a circle fails here even when the import order of the
day happens to work. An import inside a function is allowed for what is heavy to load (the GPU stack, and the
libraries whose import the compiler's start-up keeps off the commands that do not need them), in a Ray task (it
runs in a fresh interpreter on another node) and in the CLI, which loads each command's modules when that command
runs.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.repo.import_graph import ImportGraph

ROOT = Path(__file__).resolve().parents[2]

#: Third-party packages a module may import inside a function (loaded when needed, not at import).
HEAVY = frozenset({
    "torch", "ray", "vllm", "megatron", "transformer_engine", "transformers", "omegaconf", "numpy", "zmq",
    "safetensors", "tensorboard", "torch_memory_saver", "flashinfer", "huggingface_hub",
    # the compiler's start-up: `rlc validate` never renders; `import rlc.compiler.cli` and the contract load no
    # schema validator, template engine or YAML parser until a command needs one
    "jsonschema", "jinja2", "yaml",
})
#: Modules that load other rlc modules inside functions by design, and why.
LAZY_BY_DESIGN = {
    "rlc.compiler.cli": "each command loads its own modules when it runs (the start-up of every `rlc` command)",
}


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return ImportGraph.of(ROOT, "rlc")


def test_no_import_cycles_among_rlc_modules(graph):
    loops = [graph.path_within(group) for group in graph.cycles()]
    assert not loops, "modules that import each other (break the loop: move the shared part down):\n" + "\n".join(
        loops)


def test_a_function_local_import_of_an_rlc_module_loads_something_heavy(graph):
    """A function-local import of a light rlc module only hides a dependency: it belongs at the top."""
    light = sorted({f"{e.source}:{e.line} imports {e.target}" for e in graph.edges
                    if e.local and not e.remote and e.source not in LAZY_BY_DESIGN
                    and not graph.third_party_closure(e.target) & HEAVY})
    assert not light, "move these imports to the top of the module:\n" + "\n".join(light)


def _tree(root: Path, modules: dict[str, str]) -> Path:
    for name, text in modules.items():
        path = root / (name.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_the_graph_finds_a_circle_through_a_function_local_import_and_a_package(tmp_path):
    """The checks above can fail: a loop that runs only when a function is called, and one through a package's
    ``__init__`` (loading ``pkg.sub.a`` runs ``pkg/sub/__init__.py`` first), are both circles."""
    _tree(tmp_path, {
        "pkg.__init__": "",
        "pkg.a": "def f():\n    from pkg import b\n",
        "pkg.b": "import pkg.a\n",
        "pkg.sub.__init__": "from pkg.sub.x import X\n",
        "pkg.sub.x": "from pkg.c import C\nX = 1\n",
        "pkg.c": "from pkg.sub.y import Y\nC = 2\n",
        "pkg.sub.y": "Y = 3\n",
        "pkg.typed": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\n",
        "pkg.d": "import pkg.typed\n",
    })
    g = ImportGraph.of(tmp_path, "pkg")
    assert g.cycles() == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.sub", "pkg.sub.x"]]  # the TYPE_CHECKING one is none
    assert g.path_within(["pkg.a", "pkg.b"]) == "pkg.a:2 (in a function) -> pkg.b:1 -> pkg.a"


def test_the_graph_tells_a_heavy_local_import_from_a_light_one(tmp_path):
    _tree(tmp_path, {
        "pkg.__init__": "",
        "pkg.gpu": "import torch\n",
        "pkg.uses_gpu": "from pkg import gpu\n",
        "pkg.plain": "import json\n",
        "pkg.caller": "def f():\n    from pkg import uses_gpu, plain\n",
        "pkg.task": "import ray\ndef f():\n    @ray.remote\n    def g():\n        from pkg import plain\n",
    })
    g = ImportGraph.of(tmp_path, "pkg")
    assert g.third_party_closure("pkg.uses_gpu") == {"torch"}
    assert g.third_party_closure("pkg.plain") == {"json"}
    assert {e.target for e in g.edges if e.source == "pkg.caller" and e.local} == {"pkg.uses_gpu", "pkg.plain"}
    assert [(e.target, e.remote) for e in g.edges if e.source == "pkg.task"] == [("pkg.plain", True)]
