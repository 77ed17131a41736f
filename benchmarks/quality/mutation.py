"""Mutation testing of the engine: how many one-line changes to the methods, the learning helpers, the simulated
system, the channel and its stages (compression, privacy, adversaries), the simulation loop, the evaluation, the
result table and the in-process runtime the fast tests catch, and which ones they let through.

Tool: mutmut 3 (``[tool.mutmut]`` in pyproject.toml has the scope and the tests). Chosen over cosmic-ray because it
runs each mutant only against the tests that reach the mutated function (recorded in one instrumented pass of the
suite) in a process forked from one that has already imported torch, so a mutant costs the tests that matter, not
a fresh interpreter and the whole suite; and because ``mutmut show`` / ``mutmut apply`` put any mutant on disk to
look at. Its mutants: operators, constants, strings, arguments dropped or set to None, calls, returns.
mutmut runs through ``mutmut_ordered.py``, which gives each mutant's tests to pytest in the order that finds a kill
soonest: the tests that killed the function's other mutants, then the fastest (mutmut's own order is a set's: a kill
often waited on minutes of slower tests run before the one that failed).

Scope (``SCOPE`` in mutation_state.py, ``only_mutate`` in pyproject.toml): every function (module-level code and
class bodies are not mutated by mutmut 3) of fedray/methods/, fedray/learning/ (the robust aggregation rules
included), fedray/system/, fedray/channel/, fedray/privacy/, fedray/adversary/, fedray/simulation.py,
fedray/evaluation.py, fedray/report/table.py and the in-process runtime (fedray/runtime/local.py, core.py,
server_core.py, base.py, root.py, personal.py, server_inputs.py: what runs a round on either runtime; the Ray-only
modules need Ray, which the fast tests do not start), against every fast test but those that read what no mutant
changes (documents, benchmark records, the install, import rules: ``[tool.mutmut]`` lists them), without the tests
marked ray, realdata or slow, with OMP_NUM_THREADS=1 (forked children and OpenMP's thread pool deadlock).

    .venv/bin/python benchmarks/quality/mutation.py               # mutmut run (resumes where it stopped), the record
    .venv/bin/python benchmarks/quality/mutation.py --record-only # the record from mutants/ as it is

``make mutation`` runs the first. The record: ``benchmarks/results/mutation.{json,md}``, with the score per folder. A survivor is "in a loss"
when the changed line lies in a function (or a function nested in one) whose name says it computes a loss, a
distillation teacher or its weights (LOSS below); every survivor in a loss, in fedray/system/ or in the runtime
(ACCOUNTABLE below) must be killed by a test or be named in
``benchmarks/quality/equivalent_mutants.json`` with the reason it changes nothing a test could see. That file
keys a mutant by its function and its changed line (``fedray.methods.fedkf:FedKF._load_generator: <old> -> <new>``),
so renumbered mutants keep their verdict.

mutmut keeps which tests reach which function (``mutants/mutmut-stats.json``) by test id, and collects it again only
for ids it has not seen: a case inserted into the middle of a ``parametrize`` list shifts the automatic ids after it,
so mutmut would run the old tests' reach under the new ids; and a function moved to a module of its own has no entry
at all, so its mutants are marked "no tests" without running. Give a new case an explicit ``id`` (or put it last),
and after moving functions delete the stats file (and its committed copy, below) to have it collected again.

A run outlives the session that started it: every few minutes, and when it ends, the script writes the record and
the verdicts (``benchmarks/results/mutation-verdicts.json``: each function's source hash and its mutants' exit codes,
committed with the record) and mutmut's stats (``mutation-stats.json.xz``: each test's reach and duration). A run in a
fresh checkout (no mutants/) starts from those: mutmut regenerates the mutants and keeps the verdict of every function
whose source is unchanged (its own hash check), so only new or changed functions are tested again, and collects the
reach of the test ids it has not seen only. mutmut 3 throws away every verdict when ``[tool.mutmut]``'s pytest arguments or
test selection change (its config fingerprint): after such a change a run starts from nothing (~6 hours on 2 cores);
``--restore`` puts the committed verdicts back into mutants/. A kill is only as good as the test that made it:
mutmut runs each mutant's tests in a subset and order of their own, so a test whose outcome hangs on the tests
before it counts its chance failures as kills (tests/conftest.py seeds the global generators before each test for
that reason); after mending such a test, ``--recheck <test name>`` sets the verdicts of every function it reaches
back to unchecked; after adding a test, ``--retry-survivors <function>`` sets that function's survivors back (the
state module: ``mutation_state.py``).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections import Counter
from datetime import date
from pathlib import Path

from mutation_state import (MUTANTS, OUT, ROOT, SCOPE, VERDICTS, mutmut_version, recheck, restore_stats,
                            restore_verdicts, retry_survivors, save_stats, save_verdicts, status_of)

EQUIVALENT = Path(__file__).with_name("equivalent_mutants.json")
SAVE_EVERY_S = 300
# a function computing a loss, a distillation teacher or a teacher's weights (by its name, or a name it nests in)
LOSS = re.compile(r"loss|_kl|kl_|^kl|^kd|bce|entropy|distil|teacher|diversity|correlation_weights|objective|"
                  r"qffl_terms|label_shares|generator_losses|subspace_weights|projection_cosine|ensemble")
# folders whose every survivor, like a loss's, is killed by a test or explained (issue 72: the simulated system and
# the runtime, where a wrong clock or a dropped state passes every accuracy test)
ACCOUNTABLE = ("fedray/system/", "fedray/runtime/")


def folder_of(rel: str) -> str:
    """The record's per-folder row: ``fedray/system/clock.py`` -> ``fedray/system``; a top-level module is its own."""
    head, _, _ = rel.rpartition("/")
    return rel if head == "fedray" else head if head.count("/") == 1 else "/".join(head.split("/")[:2])


def _without(pattern: str, text: str) -> str:
    return re.sub(r",\s*\)", ")", re.sub(pattern, "", text))


def _same_but(pattern: str):
    """A rule: old and new lines are equal once what ``pattern`` matches is taken out of both."""
    return lambda old, new: old != new and _without(pattern, old) == _without(pattern, new)


# Classes of mutants that change nothing the fast tests could see, each with the reason; a survivor they cover is
# counted as equivalent and listed with the rule's name. (A change of precision or of device is equivalent only
# up to rounding, or on the one device the tests run on: said so in the reason.)
RULES = [
    ("device", _same_but(r",?\s*device=[\w.]+|\.to\((?:None|dev|device|[\w.]*\.device)\)|"
                         r"\.to\(\s*\)"),
     "moves a tensor to the device it is already on: the fast tests run on the CPU only (the GPU's copies: "
     "benchmarks/speed/gpu.py on a lent GPU)"),
    ("float64", _same_but(r"\.to\((?:torch\.float64|_F64|None)\)"),
     "a float64 accumulation done in the inputs' float32: the same figures up to the last bits, below every test's "
     "tolerance at the tests' sizes"),
    ("softmax axis", lambda old, new: "softmax" in old and _same_but(r",?\s*dim=(?:[-+]?1|None)")(old, new),
     "softmax over axis 1, -1, +1 or its implicit axis: one axis, the classes, on the (rows, classes) logits these "
     "losses take"),
    ("sum axis", _same_but(r"(?<=\.sum\()[-+]1(?=\))"),
     "sum over axis -1 or +1: the classes, on (rows, classes) tensors"),
    ("keepdim", lambda old, new: "sum(0, keepdim=True)" in old and _same_but(r",?\s*keepdim=(?:True|False)")(old, new),
     "a (K, N) tensor divided by its sum over axis 0: (N,) and (1, N) broadcast the same"),
    ("assert message", lambda old, new: old.startswith("assert ") and new.startswith("assert ") and _same_but(
        r""",\s*(?:f?"[^"]*"|f?'[^']*')\s*$""")(old, new),
     "the message of an internal assertion, which the config checks guarantee holds (the inputs that would break "
     "it are refused before any work, each by its own test)"),
    ("einsum case", lambda old, new: "einsum" in old and old != new and old.lower() == new.lower(),
     "einsum's subscripts renamed in upper case throughout: the same contraction"),
]


def verdict_of(old: str, new: str, explicit: str | None) -> tuple[str | None, str | None]:
    """(rule name or "explained", reason) for a survivor, or (None, None)."""
    if explicit:
        return "explained", explicit
    for name, applies, reason in RULES:
        if applies(old, new):
            return name, reason
    return None, None


def _mutant_function(name: str) -> tuple[str, str]:
    """``fedray.methods.fedkf.xǁFedKFǁ_load_generator__mutmut_9`` -> (module, "FedKF._load_generator")."""
    module, _, rest = name.rpartition(".x")
    func = rest.split("__mutmut_")[0].strip("ǁ_")
    return module, ".".join(p for p in func.split("ǁ") if p)


def _definitions(source: str) -> list[tuple[int, int, str]]:
    """(first line, last line, name) of every function definition in ``source``, by first line."""
    return sorted((node.lineno, node.end_lineno, node.name) for node in ast.walk(ast.parse(source))
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _enclosing(definitions: list[tuple[int, int, str]], line: int) -> list[str]:
    """Names of the function definitions enclosing ``line``, outermost first."""
    return [name for first, last, name in definitions if first <= line <= last]


def _changes(source_lines: list[str], spans: dict, key: str) -> tuple[int, str, str]:
    """(line in the mutants file, original line, mutated line) of mutant ``key``: the first line that differs."""
    func = key.split("__mutmut_")[0]
    a0, a1 = spans[f"{func}__mutmut_orig"]
    b0, b1 = spans[key]
    suffix = key.rsplit("__mutmut_", 1)[1]
    orig = source_lines[a0 - 1:a1]
    mut = [line.replace(f"__mutmut_{suffix}(", "__mutmut_orig(") for line in source_lines[b0 - 1:b1]]
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=orig, b=mut, autojunk=False).get_opcodes():
        if op != "equal":
            old = " ".join(s.strip() for s in orig[i1:i2]) or "(nothing)"
            new = " ".join(s.strip() for s in mut[j1:j2]) or "(removed)"
            return b0 + j1, old, new
    return b0, "", ""


def mutants_of_scope():
    """Every mutant of the scope: (name, file, status, function with the closures it nests in, old line, new line,
    accountable: in a loss, the system or the runtime)."""
    for meta_path in sorted(MUTANTS.glob("fedray/**/*.py.meta")):
        rel = meta_path.relative_to(MUTANTS).as_posix()[: -len(".meta")]
        if not rel.startswith(SCOPE):
            continue
        codes = json.loads(meta_path.read_text())["exit_code_by_key"]
        if not codes or not (MUTANTS / rel).exists():  # no mutants file: removed for mutmut to make again
            continue
        source = (MUTANTS / rel).read_text()
        lines, definitions = source.splitlines(), _definitions(source)
        spans = json.loads((MUTANTS / f"{rel}.spans").read_text())["spans"]
        for key, code in codes.items():
            module, func = _mutant_function(key)
            line, old, new = _changes(lines, spans, key.rsplit(".", 1)[-1])
            nested = _enclosing(definitions, line)[1:]  # below the mutant's own (renamed) function
            in_loss = bool(LOSS.search(func.rsplit(".", 1)[-1]) or any(LOSS.search(n) for n in nested))
            yield (key, rel, status_of(code), ".".join([func, *nested]), module, old, new,
                   in_loss or rel.startswith(ACCOUNTABLE))


def collect() -> dict:
    """Every mutant of the scope with its status; survivors with their changed line and whether it must be explained."""
    equivalent = json.loads(EQUIVALENT.read_text()) if EQUIVALENT.exists() else {}
    mutants, survivors = [], []
    for key, rel, status, where, module, old, new, accountable in mutants_of_scope():
        mutants.append({"name": key, "file": rel, "status": status, "accountable": accountable})
        if status not in ("survived", "no tests"):
            continue
        label = f"{module}:{where}: {old} -> {new}"
        rule, reason = verdict_of(old, new, equivalent.get(label))
        survivors.append({"name": key, "file": rel, "status": status, "function": where, "old": old,
                          "new": new, "accountable": accountable, "equivalent": reason, "rule": rule, "label": label})
    counts = Counter(m["status"] for m in mutants)
    accountable_counts = Counter(m["status"] for m in mutants if m["accountable"])
    stale = sorted(set(equivalent) - {s["label"] for s in survivors})
    return {"mutants": mutants, "survivors": survivors, "counts": dict(counts),
            "accountable_counts": dict(accountable_counts),
            "stale_equivalents": stale}


def write_record(found: dict, meta: dict) -> None:
    counts, survivors = found["counts"], found["survivors"]
    total = sum(counts.values())
    caught = counts.get("killed", 0) + counts.get("timeout", 0) + counts.get("caught by type check", 0)
    equivalent = [s for s in survivors if s["equivalent"]]
    unexplained = [s for s in survivors if s["accountable"] and not s["equivalent"]]
    checked = total - counts.get("not checked", 0)
    summary = {"mutants": total, "checked": checked, "killed": counts.get("killed", 0),
               "timeout": counts.get("timeout", 0), "survived": counts.get("survived", 0),
               "no_tests": counts.get("no tests", 0), "equivalent": len(equivalent),
               "survived_accountable_unexplained": len(unexplained),
               "score": round(caught / max(checked - len(equivalent), 1), 4)}
    per_file = {}
    for m in found["mutants"]:
        row = per_file.setdefault(m["file"], Counter())
        row[m["status"]] += 1
    lc = found["accountable_counts"]
    accountable_survivors = [s for s in survivors if s["accountable"]]
    summary["accountable"] = {"mutants": sum(lc.values()), "checked": sum(lc.values()) - lc.get("not checked", 0),
                            "killed": lc.get("killed", 0), "timeout": lc.get("timeout", 0),
                            "survived": len(accountable_survivors),
                            "equivalent": sum(1 for s in accountable_survivors if s["equivalent"]),
                            "unexplained": len(unexplained)}
    per_folder: dict[str, Counter] = {}
    for f, c in per_file.items():
        per_folder.setdefault(folder_of(f), Counter()).update(c)
    for s in equivalent:
        per_folder[folder_of(s["file"])]["equivalent"] += 1
    record = {"meta": meta, "summary": summary, "per_folder": {k: dict(v) for k, v in sorted(per_folder.items())},
              "per_file": {k: dict(v) for k, v in sorted(per_file.items())},
              "survivors": survivors, "stale_equivalents": found["stale_equivalents"]}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "mutation.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    md = [
        "# Mutation testing of the engine against the fast tests",
        "",
        f"{meta['tool']}; {meta['date']}, commit {meta['commit']}, {meta['device']}; wall time "
        f"{meta['wall_s'] / 60:.0f} min{' (the sum of the runs that built it)' if meta.get('runs', 1) > 1 else ''}.",
        f"Command: `{meta['command']}` (the record alone: `--record-only`). Scope and choice of tool: the script's "
        "docstring, `benchmarks/quality/mutation.py`. A run goes on from `mutation-verdicts.json` (each function's "
        "hash and its mutants' verdicts): mutmut keeps the verdicts of functions unchanged since they were checked.",
        "",
        "| mutants | checked | killed | timeout | survived | no test reaches it | equivalent (explained) | score |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {total} | {checked} | {summary['killed']} | {summary['timeout']} | {summary['survived']} | "
        f"{summary['no_tests']} | {summary['equivalent']} | {summary['score']:.1%} |",
        "",
        f"Accountable (in a loss, the LOSS pattern below, or in {' or '.join(ACCOUNTABLE)}): "
        f"{summary['accountable']['mutants']} mutants, "
        f"{summary['accountable']['checked']} checked, {summary['accountable']['killed']} killed, "
        f"{summary['accountable']['timeout']} timeout, {summary['accountable']['survived']} survived: "
        f"{summary['accountable']['equivalent']} equivalent, {summary['accountable']['unexplained']} not explained.",
        "",
        *([f"**Not complete**: {total - checked} of the {total} mutants are not checked yet, "
           f"{summary['accountable']['mutants'] - summary['accountable']['checked']} of them accountable; `make mutation` "
           "goes on where this stopped.", ""] if total - checked else []),
        "Score: (killed + timeout) / (checked - equivalent). A timeout is a mutant that made the tests hang or "
        "loop, counted as caught, as mutmut does. \"No test reaches it\": the function never ran under the selected "
        "tests (the Ray, real-data and slow tests are outside the scope).",
        "",
        "## Per folder",
        "",
        "| folder | mutants | checked | killed | timeout | survived | no tests | equivalent | score |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(_folder_row(f, c) for f, c in record["per_folder"].items()),
        "",
        "## Per file",
        "",
        "| file | mutants | killed | timeout | survived | no tests |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for f, c in record["per_file"].items():
        md.append(f"| `{f}` | {sum(c.values())} | {c.get('killed', 0)} | {c.get('timeout', 0)} | "
                  f"{c.get('survived', 0)} | {c.get('no tests', 0)} |")
    md += ["", "## Accountable survivors", "",
           "In a loss, a distillation teacher or its weights (the script's LOSS pattern on the function's name), in "
           "the simulated system or in the runtime. Each is "
           "killed by a test or explained as equivalent here.", ""]
    accountable_rows = [s for s in survivors if s["accountable"]]
    if not accountable_rows:
        md.append("None.")
    else:
        md += ["| function | change | verdict |", "| --- | --- | --- |"]
        for s in accountable_rows:
            verdict = (f"equivalent ({s['rule']}): {s['equivalent']}" if s["rule"] not in (None, "explained")
                       else f"equivalent: {s['equivalent']}" if s["equivalent"] else "**not explained**")
            md.append(f"| `{s['function']}` | `{_cell(s['old'])}` -> `{_cell(s['new'])}` | {verdict} |")
    others = [s for s in survivors if not s["accountable"]]
    md += ["", "## Other survivors", "",
           f"{len(others)} elsewhere (bookkeeping, error messages, options the fast tests do not reach), "
           "listed with their change in `mutation.json` (`survivors`). By file:", ""]
    for f, n in Counter(s["file"] for s in others).most_common():
        md.append(f"- `{f}`: {n}")
    if found["stale_equivalents"]:
        md += ["", "## Stale verdicts", "", "Named in equivalent_mutants.json but no longer surviving:", ""]
        md += [f"- `{_cell(k)}`" for k in found["stale_equivalents"]]
    (OUT / "mutation.md").write_text("\n".join(md) + "\n")


def _folder_row(folder: str, c: dict) -> str:
    mutants = sum(v for k, v in c.items() if k != "equivalent")
    checked = mutants - c.get("not checked", 0)
    caught = c.get("killed", 0) + c.get("timeout", 0) + c.get("caught by type check", 0)
    score = f"{caught / (checked - c.get('equivalent', 0)):.1%}" if checked > c.get("equivalent", 0) else "—"
    return (f"| `{folder}` | {mutants} | {checked} | {c.get('killed', 0)} | {c.get('timeout', 0)} | "
            f"{c.get('survived', 0)} | {c.get('no tests', 0)} | {c.get('equivalent', 0)} | {score} |")


def _cell(text: str) -> str:
    text = text.replace("|", "\\|").replace("`", "'")
    return text if len(text) <= 110 else text[:107] + "..."


def _cpu() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    names = re.findall(r"model name\s*:\s*(.+)", cpuinfo.read_text()) if cpuinfo.exists() else []
    return names[0].strip() if names else platform.machine()


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def _run_saving(command: list[str], env: dict, meta: dict, since: float) -> int:
    """``command`` to its end, the record and the verdicts written every :data:`SAVE_EVERY_S` seconds meanwhile (a
    run stopped from outside leaves both as they were at most that long before)."""
    proc = subprocess.Popen(command, cwd=ROOT, env=env)
    while True:
        try:
            return proc.wait(timeout=SAVE_EVERY_S)
        except subprocess.TimeoutExpired:
            if any(MUTANTS.glob("fedray/**/*.py.meta")):
                _save(meta, meta["wall_s"] + time.time() - since)


def _save(meta: dict, wall_s: float) -> None:
    """The verdicts and the record, with ``wall_s`` the runs' time so far (collecting the record is not a run)."""
    save_verdicts()
    save_stats()
    write_record(collect(), {**meta, "date": date.today().isoformat(), "commit": _git("rev-parse", "--short", "HEAD"),
                             "wall_s": round(wall_s, 1)})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record-only", action="store_true", help="write the record and the verdicts from mutants/ as "
                    "it is")
    ap.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--wall-s", type=float, help="with --record-only: the wall time of the mutmut runs the record "
                    "comes from, when they ran outside this script")
    ap.add_argument("--restore", action="store_true", help=f"put the committed verdicts ({VERDICTS.name}) back into "
                    "mutants/ (after mutmut dropped them); the next run keeps those of unchanged functions")
    ap.add_argument("--runs", type=int, help="with --wall-s: how many mutmut runs that time adds up")
    ap.add_argument("--recheck", metavar="TEST", help="set back to unchecked the verdicts of every function a test "
                    "whose id contains TEST reaches, after that test was mended: a flaky test's failures were "
                    "counted as kills, its chance passes as survivals")
    ap.add_argument("--retry-survivors", metavar="FUNCTION", help="set back to unchecked the survivors of FUNCTION "
                    "(clone_weights, Algorithm.parse_params) after a test reaching it was added; '*': all of them")
    args = ap.parse_args(argv)
    if args.recheck or args.retry_survivors:
        reset = recheck(args.recheck) if args.recheck else retry_survivors(args.retry_survivors)
        print(f"{reset} verdicts set back to unchecked; the next run checks them again")
        return 0
    record = json.loads((OUT / "mutation.json").read_text()) if (OUT / "mutation.json").exists() else {}
    previous = record.get("meta", {})
    if args.restore:
        print(f"{len(restore_verdicts())} verdicts put back into {MUTANTS.name}/ from {VERDICTS.relative_to(ROOT)}")
        return 0
    meta = {"tool": mutmut_version(), "device": f"this CPU ({_cpu()}, {os.cpu_count()} cores)",
            "command": ".venv/bin/python benchmarks/quality/mutation.py", "scope": list(SCOPE),
            "wall_s": args.wall_s or previous.get("wall_s", 0.0), "runs": args.runs or previous.get("runs", 1)}
    if not args.record_only:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        # mutmut itself, each mutant's tests in the order of mutmut_ordered.py
        mutmut = [sys.executable, str(Path(__file__).with_name("mutmut_ordered.py")), "run", "--max-children",
                  str(args.max_children)]
        start = time.time()
        fresh = not any(MUTANTS.glob("fedray/**/*.py.meta"))
        if fresh and VERDICTS.exists():
            # a fresh checkout: the committed verdicts and stats, then one known mutant so that mutmut generates every
            # mutant (keeping the verdicts of unchanged functions) and collects the reach of new tests before the
            # accountable go first
            restore_stats()
            known = next((key for key, code in restore_verdicts().items() if status_of(code) == "killed"), None)
            if known:
                subprocess.run(mutmut + [known], cwd=ROOT, env=env)
        found = collect()["mutants"] if any(MUTANTS.glob("fedray/**/*.py.spans")) else []
        # a run that goes on from verdicts already checked adds its time to theirs, also after some were set back
        # (--recheck, --retry-survivors, a changed function); one from none (all dropped, no verdicts file) starts
        # the sum again
        resumed = any(m["status"] != "not checked" for m in found)
        meta.update(wall_s=previous.get("wall_s", 0.0) if resumed else 0.0,
                    runs=previous.get("runs", 0) + 1 if resumed else 1)
        # the accountable unchecked mutants first (mutmut otherwise takes the fastest first, and the slowest, in the
        # helpers every test reaches, take hours): a run stopped early has still checked what the record must explain
        losses = [m["name"] for m in found if m["accountable"] and m["status"] == "not checked"]
        # a non-zero exit is mutmut refusing to go on (a test failing with no mutant in: its verdicts would mean
        # nothing), not a score
        code = _run_saving(mutmut + losses, env, meta, start) if losses else 0
        if code == 0:
            code = _run_saving(mutmut, env, meta, start)
        meta["wall_s"] = round(meta["wall_s"] + time.time() - start, 1)
        if code != 0:
            print(f"mutmut run exited {code}", file=sys.stderr)
            return code
    _save(meta, meta["wall_s"])
    print((OUT / "mutation.md").read_text().split("## Per file")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
