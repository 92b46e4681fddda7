"""The import graph of a Python package tree, read with ``ast`` (nothing is imported).

``ImportGraph.of(root, package)`` reads every module of ``package`` under ``root`` (the folder that holds the
package; symlinked subpackages are followed, as Python follows them) and records each import of another module of the
package: where it sits (module level or inside a function) and whether it only serves the type checker
(``if TYPE_CHECKING:``). ``cycles()`` are the groups of modules that import each other at run time, however
indirectly; ``third_party_closure()`` is what importing a module loads from outside the package.
"""
from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    local: bool  # inside a function: runs when the function is called, not when the module loads
    remote: bool = False  # inside a Ray task (``@ray.remote``): it runs in another process, on another node


@dataclass
class ImportGraph:
    package: str
    files: dict[str, Path]
    edges: list[Edge] = field(default_factory=list)
    third_party: dict[str, set[str]] = field(default_factory=dict)  # module -> top-level names it loads at import

    @classmethod
    def of(cls, root: Path, package: str) -> ImportGraph:
        files: dict[str, Path] = {}
        base = root / package
        for folder, dirs, names in os.walk(base, followlinks=True):  # rlc/'s subpackages are symlinks
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for file in sorted(n for n in names if n.endswith(".py")):
                path = Path(folder) / file
                parts = [package, *path.relative_to(base).with_suffix("").parts]
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                files[".".join(parts)] = path
        if not files:
            raise ValueError(f"no modules under {base}")
        graph = cls(package, files)
        for name, path in files.items():
            graph._read(name, path)
        return graph

    def _resolve(self, dotted: str) -> str | None:
        """The package module that ``dotted`` (a module, or a name inside one) loads."""
        while dotted:
            if dotted in self.files:
                return dotted
            dotted = dotted.rpartition(".")[0]
        return None

    def _read(self, name: str, path: Path) -> None:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        typing_only: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                typing_only.update(id(n) for n in ast.walk(node) if n is not node.test)
        self.third_party[name] = set()
        is_package = path.name == "__init__.py"
        self._visit(tree, name, is_package, typing_only, local=False, remote=False)

    def _visit(self, node: ast.AST, name: str, is_package: bool, typing_only: set[int], local: bool,
               remote: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            task = remote or (isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                              and any("remote" in ast.unparse(d) for d in child.decorator_list))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and id(child) not in typing_only:
                for dotted in self._imported(child, name, is_package, self.files):
                    target = self._resolve(dotted) if dotted.split(".")[0] == self.package else None
                    if target is None:
                        if not local and dotted.split(".")[0] != self.package:
                            self.third_party[name].add(dotted.split(".")[0])
                        continue
                    edge = Edge(name, target, child.lineno, local, remote)
                    if target != name and edge not in self.edges[-8:]:
                        self.edges.append(edge)
            self._visit(child, name, is_package, typing_only, inner, task)

    @staticmethod
    def _imported(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, files: dict[str, Path]
                  ) -> list[str]:
        """The modules an import statement loads: ``from pkg import sub`` loads the submodule ``pkg.sub`` (``pkg``
        is loading already when it is the importer's own package), ``from mod import name`` loads ``mod``."""
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        return [f"{module}.{alias.name}" if f"{module}.{alias.name}" in files else module for alias in node.names]

    # ------------------------------------------------------------------ questions

    def runtime_edges(self) -> dict[str, set[str]]:
        """Module -> the package modules it loads (at import or when a function runs), parents included: loading
        ``a.b.c`` runs ``a/b/__init__.py`` first unless ``a.b`` is already loading (an ancestor of the importer)."""
        out: dict[str, set[str]] = {m: set() for m in self.files}
        for e in self.edges:
            out[e.source].add(e.target)
            parent = e.target.rpartition(".")[0]
            while parent and parent in self.files:
                if not e.source.startswith(parent + ".") and parent != e.source:
                    out[e.source].add(parent)
                parent = parent.rpartition(".")[0]
        return out

    def cycles(self) -> list[list[str]]:
        """Groups of two or more modules that load each other (strongly connected components), sorted."""
        edges = self.runtime_edges()
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        found: list[list[str]] = []
        counter = [0]

        def connect(v: str) -> None:
            index[v] = low[v] = counter[0]
            counter[0] += 1
            stack.append(v)
            on_stack.add(v)
            for w in sorted(edges[v]):
                if w not in index:
                    connect(w)
                    low[v] = min(low[v], low[w])
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    found.append(sorted(group))

        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 10 * len(self.files) + 100))
        try:
            for v in sorted(edges):
                if v not in index:
                    connect(v)
        finally:
            sys.setrecursionlimit(limit)
        return sorted(found)

    def path_within(self, group: list[str]) -> str:
        """One import loop through ``group``, as ``a:12 -> b:40 -> a`` (module:line of each import)."""
        members = set(group)
        by_source: dict[str, list[Edge]] = {}
        for e in self.edges:
            if e.source in members and e.target in members:
                by_source.setdefault(e.source, []).append(e)
        start = group[0]
        seen = [start]
        lines: list[str] = []
        node = start
        while True:
            nxt = sorted(by_source.get(node, []), key=lambda e: (e.target not in seen[:1], e.target))
            if not nxt:
                return " -> ".join(group)
            edge = nxt[0]
            lines.append(f"{node}:{edge.line}{' (in a function)' if edge.local else ''}")
            node = edge.target
            if node in seen:
                return " -> ".join(lines + [node])
            seen.append(node)

    def third_party_closure(self, module: str) -> set[str]:
        """The outside modules that importing ``module`` loads (its own module-level imports and those of every
        package module it loads at import time, parent packages included)."""
        top: dict[str, set[str]] = {m: set() for m in self.files}
        for e in self.edges:
            if not e.local:
                top[e.source].add(e.target)
        todo = [module]
        parent = module.rpartition(".")[0]
        while parent:
            if parent in self.files:
                todo.append(parent)
            parent = parent.rpartition(".")[0]
        seen: set[str] = set()
        out: set[str] = set()
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            out |= self.third_party.get(m, set())
            for t in top[m]:
                todo.append(t)
                parent = t.rpartition(".")[0]
                while parent:
                    if parent in self.files:
                        todo.append(parent)
                    parent = parent.rpartition(".")[0]
        return out
