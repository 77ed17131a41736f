"""The package's import graph: no circles (imports inside functions count: a lazy import does not undo a circle), and
``ray`` imported only where work is placed (fedray/runtime/) and swept (fedray/sweep/)."""

from __future__ import annotations

import ast
from pathlib import Path

import fedray

PACKAGE = Path(fedray.__file__).parent
RAY_FOLDERS = ("fedray.runtime", "fedray.sweep")


def _modules(package: Path) -> dict[str, Path]:
    mods = {}
    for f in package.rglob("*.py"):
        parts = list(f.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _type_checking_only(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for sub in node.body for n in ast.walk(sub))
    return skip


def import_graph(package: Path = PACKAGE) -> tuple[dict[str, set[str]], set[str]]:
    """(module -> the package's modules it imports, modules that import ray)."""
    mods = _modules(package)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    ray_users = set()
    for m, f in mods.items():
        tree = ast.parse(f.read_text(), str(f))
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
                    base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names]
                # ``from pkg import module``: an edge to each module; ``from pkg import name``: to pkg itself
                targets = subs if all(t in mods for t in subs) else [base] + [t for t in subs if t in mods]
            else:
                continue
            for t in targets:
                if t == "ray" or t.startswith("ray."):
                    ray_users.add(m)
                r = resolve(t) if t.split(".")[0] == package.name else None
                if r and r != m:
                    edges[m].add(r)
    return edges, ray_users


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            strong(v)
    return out


def test_no_import_circles():
    edges, _ = import_graph()
    assert circles(edges) == []


def test_ray_is_imported_only_by_the_runtime_and_the_sweep():
    _, ray_users = import_graph()
    assert ray_users, "the graph finds no ray import at all: the test itself is broken"
    outside = sorted(m for m in ray_users if not m.startswith(RAY_FOLDERS))
    assert outside == [], f"ray imported outside {', '.join(RAY_FOLDERS)}: {outside}"


def test_the_graph_sees_a_circle_made_by_an_import_inside_a_function(tmp_path):
    """The check itself: a lazy import back up counts as an edge, so it cannot hide a circle; one under
    ``if TYPE_CHECKING:`` does not run and does not count."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("import ray\n\ndef f():\n    from pkg.high import g\n")
    (pkg / "high.py").write_text("from pkg import low\n\ndef g():\n    pass\n")
    (pkg / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import high\n")
    edges, ray_users = import_graph(pkg)
    assert circles(edges) == [["pkg.high", "pkg.low"]]
    assert ray_users == {"pkg.low"} and edges["pkg.typed"] == set()
