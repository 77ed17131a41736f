"""The mutation run's resume state: mutmut's verdicts (``mutants/**/*.py.meta``) to and from the committed
``benchmarks/results/mutation-verdicts.json``, and verdicts set back to unchecked after a test is mended."""

from __future__ import annotations

import functools
import json
import lzma
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = ROOT / "mutants"
OUT = ROOT / "benchmarks" / "results"
VERDICTS = OUT / "mutation-verdicts.json"  # the resume state, committed with the record
# mutmut's stats (which tests reach which function, each test's duration), compressed: a fresh checkout starts from
# them instead of collecting them again (~8 min here); mutmut collects the reach of test ids it has not seen
STATS = OUT / "mutation-stats.json.xz"
MUTMUT_STATS = MUTANTS / "mutmut-stats.json"  # mutmut's own copy, which it reads and writes
# what `[tool.mutmut]`'s only_mutate names (pyproject.toml), as path prefixes
SCOPE = ("fedray/methods", "fedray/learning", "fedray/system", "fedray/channel", "fedray/privacy", "fedray/adversary",
         "fedray/simulation.py", "fedray/evaluation.py", "fedray/report/table.py", "fedray/runtime/local.py",
         "fedray/runtime/core.py", "fedray/runtime/server_core.py", "fedray/runtime/base.py", "fedray/runtime/root.py",
         "fedray/runtime/personal.py", "fedray/runtime/server_inputs.py")
# mutmut 3's exit codes (mutmut/stats.py)
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 35: "suspicious",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", 37: "caught by type check",
          -11: "segfault", -9: "segfault", None: "not checked"}


def status_of(code) -> str:
    return STATUS.get(code, "suspicious")


def save_verdicts() -> None:
    """mutants/'s verdicts into :data:`VERDICTS`: per file, each function's hash and its mutants' exit codes (by the
    mutant's number, from 1; ``null``: not checked), one function a line so that git's diffs stay small."""
    files = {}
    for meta_path in sorted(MUTANTS.glob("fedray/**/*.py.meta")):
        rel = meta_path.relative_to(MUTANTS).as_posix()[: -len(".meta")]
        meta = json.loads(meta_path.read_text())
        if not rel.startswith(SCOPE) or not meta["exit_code_by_key"]:
            continue
        codes: dict[str, dict[int, int | None]] = {}
        for key, code in meta["exit_code_by_key"].items():
            func, _, number = key.rpartition("__mutmut_")
            codes.setdefault(func, {})[int(number)] = code
        files[rel] = {"hash_by_function_name": meta["hash_by_function_name"],
                      "exit_codes": {f: [c.get(i) for i in range(1, max(c) + 1)] for f, c in sorted(codes.items())}}
    lines = ["{", f' "tool": {json.dumps(mutmut_version())},', ' "files": {']
    for i, (rel, entry) in enumerate(files.items()):
        lines += [f"  {json.dumps(rel)}: {{", f'   "hash_by_function_name": '
                  f"{json.dumps(entry['hash_by_function_name'], sort_keys=True, ensure_ascii=False)},", '   "exit_codes": {']
        rows = [f"    {json.dumps(f, ensure_ascii=False)}: {json.dumps(c)}" for f, c in entry["exit_codes"].items()]
        lines += [",\n".join(rows), "   }", "  }" + ("," if i < len(files) - 1 else "")]
    partial = VERDICTS.with_suffix(".partial")
    partial.write_text("\n".join(lines + [" }", "}"]) + "\n", encoding="utf-8")
    partial.replace(VERDICTS)


def save_stats() -> None:
    """:data:`MUTMUT_STATS` into :data:`STATS`, when newer."""
    if MUTMUT_STATS.exists() and (not STATS.exists() or MUTMUT_STATS.stat().st_mtime > STATS.stat().st_mtime):
        partial = STATS.with_suffix(".partial")
        partial.write_bytes(lzma.compress(MUTMUT_STATS.read_bytes()))
        partial.replace(STATS)


def restore_stats() -> bool:
    """:data:`STATS` into :data:`MUTMUT_STATS` where mutmut has none; whether it did."""
    if MUTMUT_STATS.exists() or not STATS.exists():
        return False
    MUTANTS.mkdir(exist_ok=True)
    MUTMUT_STATS.write_bytes(lzma.decompress(STATS.read_bytes()))
    return True


def restore_verdicts() -> dict[str, int]:
    """:data:`VERDICTS` into mutants/'s meta files, as mutmut writes them; mutmut then keeps the exit code of each
    function whose hash still matches its source. Returns the verdicts put back, by mutant."""
    restored = {}
    for rel, entry in json.loads(VERDICTS.read_text(encoding="utf-8"))["files"].items():
        codes = {f"{func}__mutmut_{i}": code for func, row in entry["exit_codes"].items()
                 for i, code in enumerate(row, start=1)}
        restored.update((key, code) for key, code in codes.items() if code is not None)
        meta_path = MUTANTS / f"{rel}.meta"
        meta_path.parent.mkdir(parents=True, exist_ok=True)
        meta_path.write_text(json.dumps({"exit_code_by_key": codes,
                                         "hash_by_function_name": entry["hash_by_function_name"],
                                         "type_check_error_by_key": {}, "durations_by_key": {},
                                         "estimated_durations_by_key": {}}, indent=4))
        # the mutants file, if any, is older than the meta: mutmut must regenerate it and merge these verdicts
        (MUTANTS / rel).unlink(missing_ok=True)
    return restored


def recheck(test: str) -> int:
    """Sets every verdict of every function a test matching ``test`` reaches back to unchecked (in mutants/'s meta
    files and in :data:`VERDICTS`): the mended test may no longer kill what it killed by chance, and may now kill
    what survived. Run it with mutmut stopped: mutmut rewrites the meta files."""
    reach = json.loads(MUTMUT_STATS.read_text())["tests_by_mangled_function_name"]
    functions = {f for f, tests in reach.items() if any(test in t for t in tests)}
    if not functions:
        raise SystemExit(f"--recheck {test!r}: no test id in {MUTANTS.name}/mutmut-stats.json contains it")
    return _set_back(lambda func, code: func in functions and code is not None)


def retry_survivors(function: str) -> int:
    """Sets the survivors of ``function`` (``clone_weights``, ``Algorithm.parse_params``) back to unchecked, after a
    test that reaches it was added: mutmut keeps a verdict while the function is unchanged, and a new test is not in
    its reach yet, so ``recheck`` cannot name it; ``*``: every survivor (after the test selection grew). A mutant no
    test reached ("no tests") is a survivor too: a test added since may reach it. Kills stand: one more test cannot
    undo them."""
    hit = _set_back(lambda func, code: (function == "*" or function in (_shown(func), _shown(func).rpartition(".")[2]))
                    and status_of(code) in ("survived", "no tests"))
    if not hit:
        raise SystemExit(f"--retry-survivors {function!r}: no survivor in a function of that name")
    return hit


def _shown(mangled: str) -> str:
    """mutmut's mangled name as the source writes it: ``pkg.mod.xǁAlgorithmǁparse_params`` ->
    ``Algorithm.parse_params``, ``pkg.mod.x_clone_weights`` -> ``clone_weights``."""
    name = mangled.rpartition(".")[2]
    return name.removeprefix("xǁ").replace("ǁ", ".") if name.startswith("xǁ") else name.removeprefix("x_")


def _set_back(stale) -> int:
    """Sets the verdicts for which ``stale(function, exit code)`` holds back to unchecked, in mutants/ and in
    :data:`VERDICTS`; returns how many."""
    reset = 0
    for meta_path in MUTANTS.glob("fedray/**/*.py.meta"):
        meta = json.loads(meta_path.read_text())
        codes = meta["exit_code_by_key"]
        keys = [key for key, code in codes.items() if stale(key.rpartition("__mutmut_")[0], code)]
        if keys:
            codes.update(dict.fromkeys(keys))
            meta_path.write_text(json.dumps(meta, indent=4))
            reset += len(keys)
    save_verdicts()
    return reset


@functools.cache
def mutmut_version() -> str:
    shown = subprocess.run([sys.executable, "-m", "pip", "show", "mutmut"], capture_output=True, text=True).stdout
    return "mutmut " + next((line.split(":", 1)[1].strip() for line in shown.splitlines()
                             if line.startswith("Version")), "?")
