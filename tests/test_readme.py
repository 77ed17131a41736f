"""README.md agrees with the code (fast: no Ray, no data loading, no training).

- every ``.venv/bin/fedray ...`` command parses with fedray's own CLI parser, names an existing preset,
  YAML file or sweep spec, and its overrides validate; a command followed by an ``error: ...`` line must
  fail with exactly that error;
- the tour's tree names every part of the ``fedray`` package, and nothing that is not there.

The helpers here parse any Markdown file of the repository; ``tests/test_docs.py`` uses them for ``docs/``
(config keys, method parameters, links, the README's methods table and length).
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
from pydantic import BaseModel

from fedray.cli import build_parser
from fedray.config import ExperimentConfig
from fedray.load import preset_names
from fedray.errors import UserError
from fedray.methods import ALGORITHMS, load_experiment

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FEDRAY = ".venv/bin/fedray"


# --------------------------------------------------------------------------------------------------
# parsing Markdown


def lines_of(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def in_fence(lines: list[str]) -> list[bool]:
    """For each line: whether it lies inside a fenced code block (fence lines included)."""
    out, inside = [], False
    for line in lines:
        fence = line.lstrip().startswith("```")
        out.append(inside or fence)
        if fence:
            inside = not inside
    return out


def headings(path: Path) -> list[tuple[int, int, str]]:
    """(line index, level, text) of every heading of ``path`` outside code blocks."""
    lines = lines_of(path)
    out = []
    for i, (line, fenced) in enumerate(zip(lines, in_fence(lines))):
        m = None if fenced else re.match(r"^(#+)\s+(.*?)\s*$", line)
        if m:
            out.append((i, len(m.group(1)), m.group(2)))
    return out


def section(path: Path, title: str) -> list[str]:
    """The lines under the heading ``title`` (any level) up to the next heading of the same or a higher
    level, headings inside code blocks ignored."""
    lines = lines_of(path)
    heads = headings(path)
    for n, (i, level, text) in enumerate(heads):
        if text == title:
            end = next((j for j, lv, _ in heads[n + 1:] if lv <= level), len(lines))
            return lines[i + 1:end]
    pytest.fail(f"{path.relative_to(ROOT)} has no section titled {title!r}")


def cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def tables(lines: list[str]) -> list[list[str]]:
    """Markdown tables in ``lines``: each a list of its rows (header first, separator dropped)."""
    out, cur = [], []
    for line in lines + [""]:
        if line.lstrip().startswith("|"):
            if not re.fullmatch(r"\|[\s:|-]+\|?", line.strip()):
                cur.append(line)
        elif cur:
            out.append(cur)
            cur = []
    return out


def table_with_header(lines: list[str], first_cell: str, where: str) -> list[str]:
    for t in tables(lines):
        if cells(t[0])[0] == first_cell:
            return t
    pytest.fail(f"{where} has no table whose first column is {first_cell}")


def ticked(name: str, text: str) -> bool:
    return f"`{name}`" in text


def first_ticked(cell: str) -> str | None:
    m = re.match(r"`([^`]+)`", cell)
    return m.group(1) if m else None


def all_ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


# --------------------------------------------------------------------------------------------------
# the code's side


def registered_methods() -> dict:
    """The registry minus the ``test_*`` methods that the test suite registers."""
    return {n: ALGORITHMS[n] for n in ALGORITHMS if not n.startswith("test_")}


def config_keys(model: type[BaseModel] = ExperimentConfig, prefix: str = "") -> dict[str, object]:
    """Every dotted key of the schema -> its default; ``algorithm`` is free-form, so only ``algorithm.name``
    counts (the methods' own keys are their ``Params``)."""
    keys: dict[str, object] = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.update(config_keys(ann, f"{prefix}{name}."))
        else:
            keys[prefix + name] = field.get_default(call_default_factory=True)
    return keys


def config_sections(model: type[BaseModel] = ExperimentConfig, prefix: str = "") -> set[str]:
    """The dotted names of the schema's nested sections (``data``, ``data.server_data``, ...)."""
    out = set()
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.add(prefix + name)
            out |= config_sections(ann, f"{prefix}{name}.")
    return out


# --------------------------------------------------------------------------------------------------
# commands


def doc_commands(path: Path) -> list[tuple[int, list[str], str | None]]:
    """(line number, argv after ``.venv/bin/fedray``, the ``error: ...`` line that follows or None) of
    every fedray command in ``path``, in code blocks and in inline code; ``$VAR`` set by a ``VAR="..."``
    line of a code block is expanded."""
    lines = lines_of(path)
    fenced = in_fence(lines)
    env: dict[str, list[str]] = {}
    out = []
    for i, (line, f) in enumerate(zip(lines, fenced)):
        m = re.fullmatch(r'\s*([A-Z_][A-Z0-9_]*)="([^"]*)"\s*', line)
        if f and m:
            env[m.group(1)] = shlex.split(m.group(2))
        for hit in re.finditer(re.escape(FEDRAY) + r"\b", line):
            rest = line[hit.end():]
            if not f:  # inline code: up to the closing backtick
                rest = rest.split("`", 1)[0]
            argv = []
            for tok in shlex.split(rest, comments=True):
                argv += env.get(tok[1:], [tok]) if tok.startswith("$") else [tok]
            follow = lines[i + 1] if i + 1 < len(lines) else ""
            out.append((i + 1, argv, follow if follow.startswith("error:") else None))
    return out


def check_command(argv: list[str], expected_error: str | None) -> str | None:
    """What is wrong with ``fedray *argv`` as a document gives it, or None."""
    parser = build_parser()
    if not argv or argv[0] not in parser.commands:
        return f"unknown subcommand {argv[:1]}; fedray has {', '.join(parser.commands)}"
    cmd = argv[0]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.commands[cmd].parse_intermixed_args(argv[1:])
    except SystemExit:
        return f"does not parse: {err.getvalue().strip()}"
    config = getattr(args, "config", None)
    if getattr(args, "resume", None) and config is not None and "=" in config:
        config = None  # `run --resume DIR key=value ...`: overrides of the checkpoint's config, as fedray reads them
    if cmd == "tune" and not (ROOT / args.spec).is_file():
        return f"sweep spec {args.spec} does not exist"
    if config is not None and config not in preset_names() and not (ROOT / config).is_file():
        return f"{config!r} is neither a preset ({', '.join(preset_names())}) nor a file"
    if cmd in ("run", "partition"):
        if config is None:
            return None if getattr(args, "resume", None) else "names no config (preset or YAML file)"
        try:
            load_experiment(config, args.overrides)
        except UserError as e:
            got = f"error: {e}"
            return None if got == expected_error else f"{got} (the document expects: {expected_error})"
        if expected_error:
            return f"validates, but the document shows it failing with {expected_error!r}"
    return None


def command_problems(path: Path) -> list[str]:
    problems = []
    for lineno, argv, expected in doc_commands(path):
        why = check_command(argv, expected)
        if why:
            problems.append(f"{path.relative_to(ROOT)}:{lineno}: {FEDRAY} {shlex.join(argv)}: {why}")
    return problems


def test_readme_commands_work():
    commands = doc_commands(README)
    assert len(commands) >= 10, f"found only {len(commands)} '{FEDRAY} ...' commands in README.md"
    seen = {argv[0] for _, argv, _ in commands if argv}
    assert {"run", "partition", "tune", "report", "models"} <= seen, f"README.md's tour shows only {sorted(seen)}"
    problems = command_problems(README)
    assert not problems, "\n".join(problems)


def test_command_check_catches_mistakes():
    assert check_command(["fly", "quickstart"], None).startswith("unknown subcommand")
    assert "neither a preset" in check_command(["run", "no_such_preset"], None)
    assert "neither a preset" in check_command(["partition", "my_experiment.yaml"], None)
    assert "algorithm.nope" in check_command(["run", "quickstart", "algorithm.nope=1"], None)
    assert "does not exist" in check_command(["tune", "tune_configs/none.yaml"], None)
    assert "expects" in check_command(["run", "quickstart", "data.alpha=-1"], "error: something else")
    assert "validates, but" in check_command(["run", "quickstart"], "error: data.alpha: no")
    assert check_command(["run", "--resume", "runs/q"], None) is None


# --------------------------------------------------------------------------------------------------
# the tour's tree


def tour_tree() -> tuple[set[str], set[str]]:
    """(entries under ``fedray/``, top-level folders) named by the README's tree (the code block that
    starts with ``fedray/``)."""
    lines = lines_of(README)
    start = next((i for i, line in enumerate(lines) if line == "fedray/" and i and lines[i - 1].startswith("```")),
                 None)
    assert start is not None, "README.md has no tree (a code block starting with a 'fedray/' line)"
    package, top = set(), set()
    for line in lines[start + 1:]:
        if line.startswith("```"):
            break
        names = re.split(r"\s{2,}", line.strip())[0].split()
        (package if line.startswith("  ") else top).update(names)
    return package, top


def package_parts() -> set[str]:
    """The ``fedray`` package's modules and non-empty folders (``cli.py``, ``methods/``, ...)."""
    pkg = ROOT / "fedray"
    out = {p.name for p in pkg.glob("*.py") if p.name != "__init__.py"}
    out |= {f"{p.name}/" for p in pkg.iterdir()
            if p.is_dir() and p.name != "__pycache__" and any(q.suffix in (".py", ".yaml") for q in p.iterdir())}
    return out


def test_tour_tree_names_every_part_of_the_package():
    named, top = tour_tree()
    parts = package_parts()
    assert {"cli.py", "methods/", "runtime/"} <= parts  # the walk sees the package
    missing, stale = sorted(parts - named), sorted(named - parts)
    assert not missing, f"README.md's tree lacks fedray/ entries: {', '.join(missing)} (one line each, in " \
                        "dependency order)"
    assert not stale, f"README.md's tree names fedray/ entries that do not exist: {', '.join(stale)}"
    absent = sorted(name for name in top if name.endswith("/") and name != "fedray/" and not (ROOT / name).is_dir())
    assert not absent, f"README.md's tree names folders that do not exist: {', '.join(absent)}"
