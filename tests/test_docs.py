"""docs/ and the README agree with the code (fast: no Ray, no data loading, no training).

- docs/configuration.md names every config key of ``fedray.config`` with its default, and names no key
  that does not exist; it has one section per registered method naming every ``algorithm.<param>`` of its
  ``Params`` with its default, and nothing else; any `data.*`, `algorithm.*`, ... written in backticks
  anywhere in the README or docs/ is a real key;
- the README's Methods table has exactly one row per registered method, and every preset in the row of its
  method; docs/methods.md's table has one row per method with its per-client-models column right;
- the presets and sweep-spec tables name every preset and every file of ``tune_configs/``, and nothing else;
- every ``.venv/bin/fedray`` command of docs/ works as written (see ``tests/test_readme.py``), and the
  sweep spec shown in docs/sweeps-and-mlflow.md validates;
- every relative link (and its ``#anchor``) in README.md and docs/*.md resolves, and every repository path
  written in backticks (`fedray/...`, `tests/...`) exists;
- README.md is at most 250 lines.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedray.load import load_config, preset_names
from tests.test_readme import (DOCS, README, ROOT, all_ticked, cells, command_problems, config_keys,
                               config_sections, doc_commands, first_ticked, headings, in_fence, lines_of,
                               registered_methods, section, table_with_header, tables)

CONFIGURATION = DOCS / "configuration.md"
METHODS = DOCS / "methods.md"
SWEEPS = DOCS / "sweeps-and-mlflow.md"
ALGORITHM_SECTION = "`algorithm.*`: each method's parameters"
README_MAX_LINES = 250


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --------------------------------------------------------------------------------------------------
# defaults as written: `null`, `true`, `0.01`, `fashion_mnist`


def parse_default(text: str | None):
    if text is None or text == "null":
        return None
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def same_default(written, code) -> bool:
    if isinstance(code, bool) or isinstance(written, bool) or code is None or written is None:
        return written is code
    if isinstance(code, (int, float)) and isinstance(written, (int, float)):
        return float(written) == float(code)
    return written == code


def key_rows(lines: list[str]) -> list[tuple[str, str | None]]:
    """(key, written default) of every row of every ``| key | default | meaning |`` table in ``lines``."""
    out = []
    for t in tables(lines):
        header = [c.lower() for c in cells(t[0])]
        if header[:2] == ["key", "default"]:
            out += [(first_ticked(cells(r)[0]), first_ticked(cells(r)[1])) for r in t[1:]]
    return out


def test_parse_and_compare_defaults():
    assert same_default(parse_default("0.01"), 0.01) and same_default(parse_default("1e-08"), 1e-8)
    assert same_default(parse_default("null"), None) and not same_default(parse_default("0"), None)
    assert same_default(parse_default("true"), True) and not same_default(parse_default("1"), True)
    assert same_default(parse_default("fashion_mnist"), "fashion_mnist")
    assert same_default(parse_default("0"), 0.0) and not same_default(parse_default("2"), 1)


# --------------------------------------------------------------------------------------------------
# config keys


def configuration_key_rows() -> list[tuple[str, str | None]]:
    """Key rows of configuration.md outside the per-method section."""
    lines = lines_of(CONFIGURATION)
    start = next(i for i, _, text in headings(CONFIGURATION) if text == ALGORITHM_SECTION)
    return key_rows(lines[:start])


def test_configuration_names_every_config_key_with_its_default():
    keys = config_keys()
    assert "data.server_data.per_class" in keys and "algorithm.name" in keys  # the walk reaches nested models
    rows = configuration_key_rows()
    written = {k: d for k, d in rows}
    problems = []
    missing = [k for k in keys if k not in written]
    if missing:
        problems.append("no row for: " + ", ".join(missing) + " (add a row: | `key` | `default` | meaning |)")
    unknown = [k for k in written if k not in keys]
    if unknown:
        problems.append("rows for keys fedray/config.py does not have: " + ", ".join(map(str, unknown)))
    twice = sorted({k for k, _ in rows if [r for r, _ in rows].count(k) > 1})
    if twice:
        problems.append("keys with more than one row: " + ", ".join(twice))
    for k in keys.keys() & written.keys():
        if not same_default(parse_default(written[k]), keys[k]):
            problems.append(f"{k}: default written `{written[k]}`, the code's is {keys[k]!r}")
    assert not problems, "docs/configuration.md:\n  " + "\n  ".join(problems)


def test_configuration_names_every_method_parameter_with_its_default():
    lines = section(CONFIGURATION, ALGORITHM_SECTION)
    subsections: dict[str, list[str]] = {}
    current = None
    fenced = in_fence(lines)
    for line, f in zip(lines, fenced):
        m = None if f else re.match(r"^###\s+`([^`]+)`\s*$", line)
        if m:
            current = m.group(1)
            subsections[current] = []
        elif current is not None:
            subsections[current].append(line)
    problems = []
    methods = registered_methods()
    for name in sorted(set(methods) - set(subsections)):
        rows = "".join(f"\n    | `algorithm.{f}` | `{field.get_default(call_default_factory=True)}` | <meaning> |"
                       for f, field in methods[name].Params.model_fields.items())
        problems.append(f"no section '### `{name}`' for registered method {name}: add to docs/configuration.md, "
                        f"beside the other methods' sections:\n    ### `{name}`\n\n    | key | default | meaning |"
                        f"\n    | --- | --- | --- |{rows}")
    for name in sorted(set(subsections) - set(methods)):
        problems.append(f"section '### `{name}`' names no registered method")
    for name in sorted(set(methods) & set(subsections)):
        fields = methods[name].Params.model_fields
        written = dict(key_rows(subsections[name]))
        want = {f"algorithm.{f}": field.get_default(call_default_factory=True) for f, field in fields.items()}
        missing = sorted(set(want) - set(written))
        extra = sorted(set(written) - set(want), key=str)
        if missing:
            problems.append(f"{name}: no row for {', '.join(missing)}")
        if extra:
            problems.append(f"{name}: rows for parameters its Params does not have: {', '.join(map(str, extra))}")
        for key in set(want) & set(written):
            if not same_default(parse_default(written[key]), want[key]):
                problems.append(f"{name}: {key}: default written `{written[key]}`, the code's is {want[key]!r}")
    assert not problems, "docs/configuration.md, section " + ALGORITHM_SECTION + ":\n  " + "\n  ".join(problems)


KEY_PREFIXES = ("data.", "model.", "federation.", "runtime.", "tracking.", "algorithm.")
FILE_LIKE = re.compile(r"\.(pt|py|yaml|yml|json|md|png|parquet|db|npy|npz|txt)$")


def mentioned_keys(path: Path) -> list[tuple[int, str]]:
    """(line number, key) of every `section.key` (optionally `=value`) written in inline code in ``path``."""
    out = []
    lines = lines_of(path)
    for i, (line, f) in enumerate(zip(lines, in_fence(lines))):
        if f:
            continue
        for span in re.findall(r"`([^`]+)`", line):
            words = span.split("=", 1)[0].split()
            if not words:
                continue
            token = words[0]
            if (token.startswith(KEY_PREFIXES) and re.fullmatch(r"[a-z_]+(\.[a-z0-9_]+)+", token)
                    and not FILE_LIKE.search(token)):
                out.append((i + 1, token))
    return out


def test_every_key_the_docs_mention_exists():
    known = set(config_keys()) | config_sections()
    known |= {f"algorithm.{f}" for cls in registered_methods().values() for f in cls.Params.model_fields}
    mentions = [(path, n, k) for path in doc_files() for n, k in mentioned_keys(path)]
    assert len(mentions) > 50, f"found only {len(mentions)} keys written in backticks"  # the scan works
    stale = [f"{rel(path)}:{n}: `{k}`" for path, n, k in mentions if k not in known]
    assert not stale, "keys that fedray/config.py (or no method's Params) has:\n  " + "\n  ".join(stale)


# --------------------------------------------------------------------------------------------------
# methods: the README's table and docs/methods.md's


def test_readme_methods_table_has_one_row_per_registered_method():
    table = table_with_header(section(README, "Methods"), "`algorithm.name`", "README.md section 'Methods'")
    names = [first_ticked(cells(r)[0]) for r in table[1:]]
    methods = registered_methods()
    problems = []
    for name in sorted(set(methods) - set(names)):
        problems.append(f"no row for registered method `{name}`: add to README.md's Methods table the row "
                        f"| `{name}` | <paper> | <what the server does> | <preset(s)> |")
    for name in sorted({n for n in names if names.count(n) > 1}, key=str):
        problems.append(f"more than one row for `{name}`: keep one")
    for name in sorted(set(names) - set(methods), key=str):
        problems.append(f"row for `{name}`, which is not in fedray.methods.ALGORITHMS: remove it")
    assert not problems, "README.md Methods table:\n  " + "\n  ".join(problems)


def test_readme_methods_table_lists_every_preset_under_its_method():
    table = table_with_header(section(README, "Methods"), "`algorithm.name`", "README.md section 'Methods'")
    header = [c.lower() for c in cells(table[0])]
    col = next((i for i, c in enumerate(header) if c.startswith("preset")), None)
    assert col is not None, f"README.md's Methods table has no preset(s) column: {table[0]}"
    rows = {first_ticked(cells(r)[0]): all_ticked(cells(r)[col]) for r in table[1:]}
    presets = set(preset_names())
    problems = []
    for name, ticks in rows.items():
        bad = [t for t in ticks if "=" not in t and t not in presets]
        if bad:
            problems.append(f"`{name}`: {', '.join(bad)} is not a preset ({', '.join(sorted(presets))})")
    for preset in sorted(presets):
        method = load_config(preset).algorithm.name
        if method in rows and preset not in rows[method]:
            problems.append(f"preset `{preset}` runs `{method}` but is not in that row")
    assert not problems, "README.md Methods table:\n  " + "\n  ".join(problems)


def test_methods_doc_table_has_every_method_and_its_per_client_column():
    table = table_with_header(lines_of(METHODS), "`algorithm.name`", "docs/methods.md")
    header = [c.lower() for c in cells(table[0])]
    col = next((i for i, c in enumerate(header) if "per-client" in c), None)
    assert col is not None, f"docs/methods.md's table has no 'per-client models?' column: {table[0]}"
    rows = {first_ticked(cells(r)[0]): r for r in table[1:]}
    methods = registered_methods()
    problems = [f"no row for `{n}`: add to docs/methods.md's table the row | `{n}` | "
                f"{'no' if methods[n].shared_architecture else 'yes'} | <what a client sends up> | "
                "<what a client keeps, never sent> |" for n in sorted(set(methods) - set(rows))]
    problems += [f"row for `{n}`, not a registered method" for n in sorted(set(rows) - set(methods), key=str)]
    for name in sorted(set(methods) & set(rows)):
        said = cells(rows[name])[col].lower()
        want = "no" if methods[name].shared_architecture else "yes"
        if said != want:
            problems.append(f"{name}: per-client models column says {said!r}, the code says {want!r} "
                            f"(shared_architecture={methods[name].shared_architecture})")
    assert not problems, "docs/methods.md:\n  " + "\n  ".join(problems)


# --------------------------------------------------------------------------------------------------
# presets, sweep specs, commands


def test_presets_table_names_every_preset():
    table = table_with_header(section(CONFIGURATION, "Presets"), "preset", "docs/configuration.md 'Presets'")
    listed = {first_ticked(cells(r)[0]) for r in table[1:]}
    presets = set(preset_names())
    assert not presets - listed, f"docs/configuration.md Presets table lacks: {', '.join(sorted(presets - listed))}"
    assert not listed - presets, f"docs/configuration.md Presets table names no preset: " \
                                 f"{', '.join(map(str, listed - presets))}"


def test_sweeps_table_names_every_spec():
    table = table_with_header(section(SWEEPS, "Sweeps"), "spec", "docs/sweeps-and-mlflow.md 'Sweeps'")
    listed = {first_ticked(cells(r)[0]) for r in table[1:]}
    specs = {p.name for p in (ROOT / "tune_configs").glob("*.yaml")}
    assert not specs - listed, f"docs/sweeps-and-mlflow.md lacks sweep specs: {', '.join(sorted(specs - listed))}"
    assert not listed - specs, f"docs/sweeps-and-mlflow.md names no file of tune_configs/: " \
                               f"{', '.join(map(str, listed - specs))}"


def test_docs_commands_work():
    docs = sorted(DOCS.glob("*.md"))
    commands = [c for path in docs for c in doc_commands(path)]
    assert len(commands) >= 30, f"found only {len(commands)} '.venv/bin/fedray ...' commands in docs/"
    problems = [p for path in docs for p in command_problems(path)]
    assert not problems, "\n".join(problems)


def test_sweep_spec_example_validates(tmp_path, monkeypatch):
    from fedray.sweep.spec import load_spec

    text = SWEEPS.read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    assert blocks, "docs/sweeps-and-mlflow.md shows no spec (a ```yaml block)"
    monkeypatch.chdir(ROOT)
    for n, block in enumerate(blocks):
        spec_file = tmp_path / f"spec{n}.yaml"
        spec_file.write_text(block, encoding="utf-8")
        load_spec(spec_file)  # raises ConfigError naming the key


# --------------------------------------------------------------------------------------------------
# links and length


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, seen = set(), {}
    for _, _, text in headings(path):
        s = slug(text)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link and image outside code blocks."""
    lines = lines_of(path)
    return [(i + 1, target) for i, (line, f) in enumerate(zip(lines, in_fence(lines))) if not f
            for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line))]


def test_slug_follows_github():
    assert slug("`algorithm.*`: each method's parameters") == "algorithm-each-methods-parameters"
    assert slug("Comparing runs: `fedray report`") == "comparing-runs-fedray-report"


def test_every_relative_link_resolves():
    problems, count = [], 0
    for path in doc_files():
        for n, target in links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            count += 1
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                problems.append(f"{rel(path)}:{n}: {target}: {file} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{rel(path)}:{n}: {target}: {rel(dest)} has no heading #{anchor}")
    assert count > 20, f"found only {count} relative links"  # the scan works
    assert not problems, "broken links:\n  " + "\n  ".join(problems)


REPO_PATH = re.compile(r"(fedray|tests|benchmarks|tune_configs|cluster|docs)/[\w./-]*")


def test_every_repository_path_in_backticks_exists():
    """`fedray/gc_pause.py`, `tests/test_reliability.py`, ... written in inline code name real files."""
    problems, count = [], 0
    for path in doc_files():
        lines = lines_of(path)
        for n, (line, f) in enumerate(zip(lines, in_fence(lines)), 1):
            if f:
                continue
            for span in re.findall(r"`([^`]+)`", line):
                m = REPO_PATH.fullmatch(span.split()[0]) if span.split() else None
                if m:
                    count += 1
                    if not (ROOT / m.group(0)).exists():
                        problems.append(f"{rel(path)}:{n}: `{m.group(0)}` does not exist")
    assert count > 10, f"found only {count} repository paths in backticks"  # the scan works
    assert not problems, "paths that do not exist:\n  " + "\n  ".join(problems)


def test_readme_is_short():
    n = len(lines_of(README))
    assert n <= README_MAX_LINES, f"README.md has {n} lines; at most {README_MAX_LINES}: move reference " \
                                  "material to docs/"


@pytest.mark.parametrize("doc", ["configuration.md", "methods.md", "metrics.md", "sweeps-and-mlflow.md",
                                 "cluster.md", "reproducing.md", "writing-a-method.md"])
def test_readme_links_each_doc(doc):
    assert f"](docs/{doc})" in README.read_text(encoding="utf-8"), f"README.md does not link docs/{doc}"
