"""README.md's reference tables and commands agree with the code (fast: no Ray, no data loading).

- the Methods table has one row per registered algorithm (minus the ``test_*`` methods that the test
  suite registers), with every field of its ``Params`` model as `field` (bare, without ``algorithm.``)
  and its per-client-models column right;
- the Config keys section names every key of the config schema as `dotted.key`;
- the Presets and Sweeps tables name every preset and every file of ``tune_configs/``, and nothing else;
- every ``.venv/bin/fedray ...`` command parses with fedray's own CLI parser, names an existing preset,
  YAML file or sweep spec, and its overrides validate; a command followed by an ``error: ...`` line in
  the README must fail with exactly that error.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
from pydantic import BaseModel

from fedray.methods import ALGORITHMS, load_experiment
from fedray.cli import build_parser
from fedray.config import ExperimentConfig, preset_names
from fedray.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FEDRAY = ".venv/bin/fedray"


# --------------------------------------------------------------------------------------------------
# parsing the README


def _lines() -> list[str]:
    return README.read_text(encoding="utf-8").splitlines()


def _in_fence(lines: list[str]) -> list[bool]:
    """For each line: whether it lies inside a fenced code block (fence lines included)."""
    out, inside = [], False
    for line in lines:
        fence = line.lstrip().startswith("```")
        out.append(inside or fence)
        if fence:
            inside = not inside
    return out


def section(title: str) -> list[str]:
    """The lines under the heading ``title`` (any level) up to the next heading of the same or a higher
    level, headings inside code blocks ignored."""
    lines = _lines()
    fenced = _in_fence(lines)
    start = level = None
    for i, (line, f) in enumerate(zip(lines, fenced)):
        m = None if f else re.match(r"^(#+)\s+(.*?)\s*$", line)
        if not m:
            continue
        if start is None:
            if m.group(2) == title:
                start, level = i + 1, len(m.group(1))
        elif len(m.group(1)) <= level:
            return lines[start:i]
    if start is None:
        pytest.fail(f"README.md has no section titled {title!r}")
    return lines[start:]


def cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


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
    pytest.fail(f"README.md section {where!r} has no table whose first column is {first_cell}")


def ticked(name: str, text: str) -> bool:
    return f"`{name}`" in text


def first_ticked(cell: str) -> str | None:
    m = re.match(r"`([^`]+)`", cell)
    return m.group(1) if m else None


# --------------------------------------------------------------------------------------------------
# methods


def registered_methods() -> dict:
    return {n: c for n, c in ALGORITHMS.items() if not n.startswith("test_")}


def test_methods_table_lists_every_registered_method_and_its_options():
    table = table_with_header(section("Methods"), "`algorithm.name`", "Methods")
    header = [c.lower() for c in cells(table[0])]
    per_client_col = next((i for i, c in enumerate(header) if "per-client" in c), None)
    assert per_client_col is not None, f"Methods table has no 'per-client models?' column: {table[0]}"
    rows = {first_ticked(cells(r)[0]): r for r in table[1:]}
    methods = registered_methods()
    problems = []
    missing = sorted(set(methods) - set(rows))
    extra = sorted(set(rows) - set(methods))
    if missing:
        problems.append(f"no row for registered method(s): {', '.join(missing)}")
    if extra:
        problems.append(f"row(s) for unregistered method(s): {', '.join(map(str, extra))}")
    for name in sorted(set(methods) & set(rows)):
        cls, row = methods[name], rows[name]
        lost = [f for f in cls.Params.model_fields if not ticked(f, row)]
        if lost:
            problems.append(f"{name}: option(s) not in its row (as `name`): {', '.join(lost)}")
        said = cells(row)[per_client_col].lower()
        want = "no" if cls.shared_architecture else "yes"
        if said != want:
            problems.append(f"{name}: per-client models column says {said!r}, the code says {want!r} "
                            f"(shared_architecture={cls.shared_architecture})")
    assert not problems, "README.md Methods table:\n  " + "\n  ".join(problems)


# --------------------------------------------------------------------------------------------------
# config keys, presets, sweeps


def config_keys(model: type[BaseModel] = ExperimentConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema; ``algorithm`` is free-form, so only ``algorithm.name`` counts."""
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += config_keys(ann, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def test_config_keys_section_names_every_key():
    keys = config_keys()
    assert "data.server_data.per_class" in keys and "algorithm.name" in keys  # the walk reaches nested models
    text = "\n".join(section("Config keys"))
    missing = [k for k in keys if not ticked(k, text)]
    assert not missing, f"README.md Config keys section lacks (as `key`): {', '.join(missing)}"


def test_presets_table_names_every_preset():
    table = table_with_header(section("Presets"), "preset", "Presets")
    listed = {first_ticked(cells(r)[0]) for r in table[1:]}
    presets = set(preset_names())
    assert not presets - listed, f"README.md Presets table lacks: {', '.join(sorted(presets - listed))}"
    assert not listed - presets, f"README.md Presets table names no preset: {', '.join(map(str, listed - presets))}"


def test_sweeps_table_names_every_spec():
    table = table_with_header(section("Sweeps (Ray Tune)"), "spec", "Sweeps (Ray Tune)")
    listed = {first_ticked(cells(r)[0]) for r in table[1:]}
    specs = {p.name for p in (ROOT / "tune_configs").glob("*.yaml")}
    assert not specs - listed, f"README.md Sweeps table lacks: {', '.join(sorted(specs - listed))}"
    assert not listed - specs, f"README.md Sweeps table names no file of tune_configs/: " \
                               f"{', '.join(map(str, listed - specs))}"


# --------------------------------------------------------------------------------------------------
# commands


def readme_commands() -> list[tuple[int, list[str], str | None]]:
    """(line number, argv after ``.venv/bin/fedray``, the ``error: ...`` line that follows or None) of
    every fedray command in the README, in code blocks and in inline code; ``$VAR`` set by a
    ``VAR="..."`` line of the README is expanded."""
    lines = _lines()
    fenced = _in_fence(lines)
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
    """What is wrong with ``fedray *argv`` as the README gives it, or None."""
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
            return None if got == expected_error else f"{got} (README expects: {expected_error})"
        if expected_error:
            return f"validates, but the README shows it failing with {expected_error!r}"
    return None


def test_readme_commands_work():
    commands = readme_commands()
    assert len(commands) >= 20, f"found only {len(commands)} '{FEDRAY} ...' commands in README.md"
    seen = {argv[0] for _, argv, _ in commands if argv}
    assert {"run", "partition", "tune", "report", "models"} <= seen, f"README.md shows only {sorted(seen)}"
    problems = []
    for lineno, argv, expected in commands:
        why = check_command(argv, expected)
        if why:
            problems.append(f"README.md:{lineno}: {FEDRAY} {shlex.join(argv)}: {why}")
    assert not problems, "\n".join(problems)


def test_command_check_catches_mistakes():
    assert check_command(["fly", "quickstart"], None).startswith("unknown subcommand")
    assert "neither a preset" in check_command(["run", "no_such_preset"], None)
    assert "neither a preset" in check_command(["partition", "my_experiment.yaml"], None)
    assert "algorithm.nope" in check_command(["run", "quickstart", "algorithm.nope=1"], None)
    assert "does not exist" in check_command(["tune", "tune_configs/none.yaml"], None)
    assert check_command(["run", "--resume", "runs/q"], None) is None
