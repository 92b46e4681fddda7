#!/usr/bin/env python3
"""The files of a small container image made from this host's own Debian packages (no download).

    image_files.py PACKAGE...        print the installed packages PACKAGE... depend on (all of them,
                                     PACKAGE... included), one "name version" per line
    image_files.py --files PACKAGE...  print the files of those packages, one absolute path per line,
                                     with documentation left out and every folder symlink of a
                                     merged-/usr host (/bin -> usr/bin) resolved, so that a tar of the
                                     list unpacks into a tree with the same layout

Used by local_slurm.sh to build the stand-in container image for the SLURM tests. Standard library only
(it runs with the system's python3, before any virtual environment exists).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

SKIP = ("/usr/share/doc/", "/usr/share/man/", "/usr/share/info/", "/usr/share/locale/", "/usr/share/lintian/",
        "/usr/share/bug/")


def installed() -> dict[str, tuple[str, list[list[str]], list[str]]]:
    """Every installed package: version, dependency groups (alternatives), provided names."""
    out = subprocess.run(["dpkg-query", "-W", "-f",
                          "${Package}\t${db:Status-Status}\t${Version}\t${Pre-Depends}, ${Depends}\t${Provides}\n"],
                         capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.splitlines():
        name, status, version, deps, provides = (line.split("\t") + [""] * 5)[:5]
        if status != "installed":
            continue
        groups = []
        for group in deps.split(","):
            alts = [re.sub(r"\(.*?\)|:any|:native|\[.*?\]", "", a).strip() for a in group.split("|")]
            if any(alts):
                groups.append([a for a in alts if a])
        found[name] = (version, groups, [re.sub(r"\(.*?\)", "", p).strip() for p in provides.split(",") if p.strip()])
    return found


def closure(roots: list[str]) -> dict[str, str]:
    """``roots`` and every installed package they depend on, by name, with its version."""
    pkgs = installed()
    providers: dict[str, str] = {}
    for name, (_, _, provides) in pkgs.items():
        for p in provides:
            providers.setdefault(p, name)
    missing = [r for r in roots if r not in pkgs]
    if missing:
        sys.exit(f"image_files.py: not installed: {' '.join(missing)}")
    seen: dict[str, str] = {}
    queue = list(roots)
    while queue:
        name = queue.pop()
        if name in seen:
            continue
        version, groups, _ = pkgs[name]
        seen[name] = version
        for alts in groups:
            pick = next((a for a in alts if a in pkgs), None) or next((providers[a] for a in alts if a in providers),
                                                                     None)
            if pick:
                queue.append(pick)
    return dict(sorted(seen.items()))


def canonical(path: str) -> str:
    """``path`` with its folders' symlinks resolved (the last part is kept as it is)."""
    head, tail = os.path.split(path)
    return os.path.join(os.path.realpath(head), tail)


def files(roots: list[str]) -> list[str]:
    names = list(closure(roots))
    out = subprocess.run(["dpkg-query", "-L", *names], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        path = line.strip()
        if not path.startswith("/") or path == "/." or path.startswith(SKIP) or not os.path.lexists(path):
            continue
        found.add(canonical(path))
    return sorted(found)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--files"]:
        print("\n".join(files(argv[1:])))
    else:
        print("\n".join(f"{n} {v}" for n, v in closure(argv).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
