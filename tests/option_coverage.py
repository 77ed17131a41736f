"""Which option values have a test naming them (issue: every option's effect tested; tests/test_option_coverage.py).

An option is a field of ``federation.*``, ``system.*`` (``system.oort.*`` included), ``channel.*``, ``privacy.*``,
``adversary.*``, ``aggregation.*``, the million-clients options of ``data.*`` and ``runtime.*``, or a built-in
method's ``algorithm.*`` parameter. What must be named: every value of a choice (a ``Literal``; a bool's non-default
value), and for any other field one value other than its default. A test names ``section.key`` with a value when a
test file writes the key in one of the ways tests set options (``section__key=value`` for tiny_config,
``"section.key": value`` or ``"section.key=value"`` for a config dict or the command line, and ``key=value`` in a
constructor of the section's class, e.g. ``SystemConfig(deadline_s=5.0)``) with that value in the same statement.
A method's parameter counts only in a test that names the method (its ``algorithm.name`` or its class), or that
names none in a file of that method's tests.

This is a census, not a proof: it finds options that no test sets, so that a new option cannot arrive untested;
that the test checks the option's effect by hand is the reviewer's part. ``EXEMPT`` lists what needs no test, and why.
"""

from __future__ import annotations

import ast
import functools
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

TESTS = Path(__file__).parent

#: option (``section.key`` or ``section.key=value``) -> why no test of its effect is asked for
EXEMPT: dict[str, str] = {
    "federation.eval_batch_size": "changes no figure, only memory and speed: the evaluator's figures are the same at "
                                  "any batch size (tests/test_evaluation.py, batch sizes 1024, 64 and 37)",
}


@dataclass(frozen=True)
class Option:
    path: str  # section.key (algorithm.key for a method's parameter)
    values: tuple[str, ...]  # the values to name: a choice's every value; else () = any non-default value
    default: Any
    method: str | None = None  # a method's parameter: its algorithm.name
    owner: str = ""  # the class whose constructor takes it by its bare name
    method_class: str = ""  # a method's parameter: the method's class (a test may build it directly)

    def labels(self) -> list[str]:
        return [f"{self.path}={v}" for v in self.values] or [f"{self.path}=<not {self.default!r}>"]


def _choices(annotation: Any) -> tuple[str, ...] | None:
    """The values of a Literal (inside Optional / a union too), a bool's both; None for any other type."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return tuple(str(a) for a in args)
    if annotation is bool:
        return ("True", "False")
    if args:
        found = [c for a in args if a is not type(None) and (c := _choices(a)) is not None]
        if found and all(typing.get_origin(a) is Literal or a is bool or a is type(None) for a in args):
            return tuple(v for c in found for v in c)
    return None


def options_of(model: type[BaseModel], prefix: str, method: str | None = None, method_class: str = "") -> list[Option]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += options_of(ann, f"{prefix}.{name}", method, method_class)
            continue
        default = field.get_default(call_default_factory=True)
        values = _choices(ann)
        if values is not None:
            values = tuple(v for v in values if not (ann is bool or v in ("True", "False")) or v != str(default))
        out.append(Option(f"{prefix}.{name}", values or (), default, method, model.__name__, method_class))
    return out


MILLION = {"data": ("partition", "client_size", "client_size_sigma", "pseudo_base_clients", "eval_clients"),
           "runtime": ("client_state_memory", "client_state_dir")}


def all_options() -> list[Option]:
    from fedray.config import ExperimentConfig
    from fedray.methods import ALGORITHMS

    fields = ExperimentConfig.model_fields
    out: list[Option] = []
    for section in ("federation", "system", "channel", "privacy", "adversary", "aggregation"):
        out += options_of(fields[section].annotation, section)
    for section, keys in MILLION.items():
        out += [o for o in options_of(fields[section].annotation, section) if o.path.split(".")[1] in keys]
    out = [o if o.path != "data.partition" else Option(o.path, ("on_demand",), o.default, None, o.owner) for o in out]
    for name, cls in sorted(ALGORITHMS.items()):
        if cls.__module__.startswith("fedray.") and cls.Params is not None:
            out += options_of(cls.Params, "algorithm", name, cls.__name__)
    return out


def _statements(text: str) -> list[tuple[str, str]]:
    """The test files' statements as (source, context): a call's arguments across lines are one statement (so that
    a key and its value set in one call are found together), a compound statement's header one too (a ``for`` over
    settings); the context is the test function around it with its decorators, where a key set to a name
    (``cache_init=mode``) finds the values it is given (``pytest.mark.parametrize``, a loop, an assignment)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return [(line, line) for line in text.splitlines()]
    lines = text.splitlines()
    out: list[tuple[str, str]] = []

    def source(first: int, last: int) -> str:
        return "\n".join(lines[first - 1 : last])

    def walk(node: ast.AST, context: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([d.lineno for d in child.decorator_list] + [child.lineno])
                whole = source(first, child.end_lineno)
                out.extend((source(d.lineno, d.end_lineno), whole) for d in child.decorator_list)
                walk(child, whole)
            elif isinstance(child, ast.ClassDef):
                walk(child, context)
            elif isinstance(child, ast.stmt):
                body = getattr(child, "body", None)
                last = body[0].lineno - 1 if isinstance(body, list) and body else child.end_lineno
                own = source(child.lineno, max(last, child.lineno))
                out.append((own, context or own))
                walk(child, context)
    walk(tree, "")
    return out


def _value_pattern(value: str) -> str:
    if value in ("True", "False"):
        return rf"(?:{value}|{value.lower()})\b"
    return rf"""(?:["']{re.escape(value)}["']|(?<=[=:])\s*{re.escape(value)}\b|={re.escape(value)}\b)"""


def _key_patterns(opt: Option) -> list[str]:
    section, _, rest = opt.path.partition(".")
    dunder = re.escape(opt.path.replace(".", "__"))
    dotted = re.escape(opt.path)
    bare = re.escape(rest.rpartition(".")[2])
    return [rf"(?:\b{dunder}\s*=|[\"']{dunder}[\"']\s*:)", rf"""["']{dotted}["']\s*:""", rf"""["']{dotted}=""",
            rf"""(?:\b{bare}\s*=|["']{bare}["']\s*:)"""]


def _values_after(statement: str, key: str) -> list[str]:
    """The values ``key`` is set to: the token after it, and the other branch of a conditional (``1.0 if ... else
    0.0``)."""
    return (re.findall(key + r"""\s*["']?([^,)\s"'}\]]+)""", statement)
            + re.findall(key + r"""[^,)]*?\belse\s+["']?([^,)\s"'}\]]+)""", statement))


def named(opt: Option, files: dict[str, str], statements: dict[str, list[str]]) -> dict[str, bool]:
    """Each label of ``opt`` -> whether some test statement sets it."""
    method_names = {opt.method} if opt.method else set()
    found = {label: False for label in opt.labels()}
    keys = _key_patterns(opt)
    name = opt.path.rpartition(".")[2]
    for path, text in files.items():
        if name not in text:  # every way of naming the option writes its last part
            continue
        if opt.method and not (opt.method in Path(path).stem or re.search(rf"""["']{re.escape(opt.method)}["']""",
                                                                         text)
                               or re.search(rf"\b{re.escape(opt.method_class)}\b", text)):
            continue
        # a bare key counts where the test is about its section: the section's class, folder or keys are named
        section = opt.path.split(".")[0]
        bare_ok = (bool(method_names) or opt.owner in text or section in Path(path).parts[:-1]
                   or section in Path(path).stem or f"{section}__" in text or f".{section}" in text)
        for st, context in statements[path]:
            if name not in st:
                continue
            if opt.method and not _about(opt, context, Path(path).stem):
                continue
            for i, key in enumerate(keys):
                if i == 3 and not bare_ok:
                    continue
                if not re.search(key, st):
                    continue
                if opt.values:
                    for v in opt.values:
                        # set to it, or set to a name in a test (with its decorators) that writes it
                        if re.search(key + r"\s*" + _value_pattern(v), st) or (
                                re.search(key + r"\s*[A-Za-z_]", st) and re.search(_value_pattern(v), context)):
                            found[f"{opt.path}={v}"] = True
                else:
                    if any(v not in (repr(opt.default), str(opt.default), "None") for v in _values_after(st, key)):
                        found[opt.labels()[0]] = True
    return found


@functools.cache
def _method_names() -> frozenset[str]:
    from fedray.methods import ALGORITHMS

    return frozenset(ALGORITHMS)


def _about(opt: Option, context: str, stem: str) -> bool:
    """Whether a test (``context``: its source) is about ``opt``'s method: it names that method (its name quoted, its
    class, or a helper named for it), or it names no built-in method and its file is that method's (a file of two
    methods' tests counts a test for the method it names)."""
    quoted = set(re.findall(r"""["']([a-z0-9_]+)["']""", context)) & _method_names()
    if opt.method in quoted or re.search(rf"\b({re.escape(opt.method_class)}|{re.escape(opt.method)}_\w+)\b",
                                         context):  # its class, or a helper named for it (dafkd_config)
        return True
    return not quoted and opt.method in stem


def census() -> tuple[list[str], list[str]]:
    """(labels named by a test, labels no test names), EXEMPT left out of both."""
    files = {str(p): p.read_text() for p in TESTS.rglob("test_*.py") if p.name != "test_option_coverage.py"}
    files.update({str(p): p.read_text() for p in [TESTS / "conftest.py"]})
    statements = {p: _statements(t) for p, t in files.items()}
    done, missing = [], []
    for opt in all_options():
        for label, ok in named(opt, files, statements).items():
            tag = f"{opt.method}: {label}" if opt.method else label
            if label in EXEMPT or opt.path in EXEMPT:
                continue
            (done if ok else missing).append(tag)
    return done, missing


if __name__ == "__main__":
    done, missing = census()
    print(f"{len(done)} named, {len(missing)} not:")
    print("\n".join(missing))
