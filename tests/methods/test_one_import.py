"""The contract's one import: a method file imports fedray only from the contract module (fedray.methods.api) and
the method it subclasses (a module of a method's own subpackage, such as dafkd/, also from its siblings)."""

from __future__ import annotations

import ast
from pathlib import Path

import fedray.methods.api as api

METHODS = Path(api.__file__).parent
NOT_METHODS = {"api.py", "registry.py", "__init__.py"}


def _method_files() -> list[Path]:
    return sorted(p for p in METHODS.rglob("*.py") if p.name not in NOT_METHODS)


def _fedray_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import of fedray in ``path``, at any depth (a function's own imports too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fedray":
            out.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "fedray"]
    return out


def _subclassed(path: Path) -> set[str]:
    """The names the file's classes subclass."""
    return {base.id for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
            for base in node.bases if isinstance(base, ast.Name)}


def _problems(path: Path, root: Path = METHODS.parents[1]) -> list[str]:
    """What ``path`` (a file under ``root``/fedray/methods) imports that it should not, one line each."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    bases = _subclassed(path)
    out = []
    for line, module, names in _fedray_imports(path):
        if module == "fedray.methods.api":
            continue
        if package != "fedray.methods" and module.startswith(package + "."):
            continue  # a sibling inside the method's own subpackage
        if module.startswith("fedray.methods.") and module.count(".") == 2 and set(names) & bases:
            continue  # the method it subclasses (with that method's boundary types and helpers)
        out.append(f"{path.relative_to(root)}:{line}: imports {module}"
                   + (f" ({', '.join(names)})" if names else ""))
    return out


def test_a_method_file_imports_fedray_from_the_contract_and_its_parent_alone():
    problems = [p for path in _method_files() for p in _problems(path)]
    assert not problems, ("a method imports fedray only from fedray.methods.api (re-export what it needs there) and "
                          "the method it subclasses:\n" + "\n".join(problems))


def test_the_check_sees_a_stray_import(tmp_path):
    stray = tmp_path / "fedray" / "methods" / "stray.py"
    stray.parent.mkdir(parents=True)
    stray.write_text("from fedray.methods.api import Algorithm\nfrom fedray.methods.fedavg import ModelUpload\n"
                     "from fedray.seeding import derive_seed\n\nclass M(Algorithm):\n    def f(self):\n"
                     "        import fedray.learning.distill\n")
    assert _problems(stray, tmp_path) == ["fedray/methods/stray.py:2: imports fedray.methods.fedavg (ModelUpload)",
                                          "fedray/methods/stray.py:3: imports fedray.seeding (derive_seed)",
                                          "fedray/methods/stray.py:7: imports fedray.learning.distill"]


def test_what_api_exports_exists():
    assert [name for name in api.__all__ if not hasattr(api, name)] == []
