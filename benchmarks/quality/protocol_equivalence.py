"""The "nothing moves" check of a refactor of the round protocol: every figure of every round of every method, before
and after, compared exactly.

Runs every case of the every-method tests (``METHOD_CASES`` in tests/conftest.py, and every built-in method) for 3
rounds on the learnable tiny synthetic task of tests/test_every_method.py, in process, in three modes:

- ``sync``: the case as it is (no simulated system unless the case sets one);
- ``system``: the simulated system on every path: heterogeneous phones that come and go (Markov availability with
  short online periods: dropouts), over-selection (stragglers), a deadline and the server's own time;
- ``async``: FedBuff (4 in flight, a server step every 2 uploads, polynomial staleness) on heterogeneous phones, for
  every case whose method can run async; the others are recorded as refused with ConfigError's message.

and writes, per mode and case, every history row's figures (all keys but the wall times ``time/*``; NaN as "nan"),
the summary's eval/, val/, comm/ and sim/ figures and clients.parquet's rows to a JSON file. A run that raises
records its exception's type and message instead, and the script goes on.

    .venv/bin/python benchmarks/quality/protocol_equivalence.py --out before.json [--modes sync,system] \
        [--cases fedavg,scaffold]
    .venv/bin/python benchmarks/quality/protocol_equivalence.py --compare before.json after.json

``--compare`` prints a table (mode, case, rounds, figures compared, equal or the keys that differ with both values)
and exits 1 if anything differs. To produce the figures of another commit without uncommitted edits leaking in, run
the script from a worktree of that commit: it imports fedray and tests/ from the tree it lives in (the repository
root two folders up), and prints ``fedray.__file__`` and that tree's commit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this tree's fedray and tests/, ahead of an editable install elsewhere

ROUNDS = 3
MODES = ("sync", "system", "async")
# The simulated system of the "system" mode: phones of the heterogeneous profile (seed 0's 6 clients take 3 s to 8 s
# for FedAvg's 8 steps of 16 samples, client 5 19 s; DaFKD's and FedKF's generated batches triple that), online for
# 40 s on average and offline for 10 s, so that some go offline before their upload (dropouts); 5 selected for 3 slots
# (stragglers); a 20-s deadline that some clients of the heavier methods miss (FedCD, FedGen, FedKF here; a shorter
# one leaves DaFKD rounds without any upload); the server's own work (distillation, generator training) timed.
SYSTEM = {"system__devices": "heterogeneous", "system__availability": "markov", "system__mean_online_s": 40.0,
          "system__mean_offline_s": 10.0, "system__overcommit": 1.5, "system__deadline_s": 20.0,
          "system__server_sps": 2000.0}
ASYNC = {"federation__mode": "async", "system__devices": "heterogeneous", "federation__concurrency": 4,
         "federation__buffer_size": 2, "federation__staleness": "polynomial",
         "system__overcommit": 1.0}  # over-selection is refused with async (a case's own, fedavg-system's, too)


def _commit(tree: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no", "--", "fedray",
                                "tests"], capture_output=True, text=True, check=True).stdout.strip()
        return out.stdout.strip() + (" (with uncommitted changes under fedray/ or tests/)" if dirty else "")
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"unknown ({exc})"


# --- running -------------------------------------------------------------------------------------------------------

def _plain(value):
    """A JSON value that reads back equal: numpy scalars and arrays as Python's, NaN and infinities as strings."""
    if hasattr(value, "tolist"):  # numpy scalar or array, torch tensor
        value = value.tolist()
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value == math.inf else "-inf" if value == -math.inf
                                                 else value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return repr(value)


def _figures(row: dict) -> dict:
    return {k: _plain(v) for k, v in row.items() if not k.startswith("time/")}


def _seed_global_generators() -> None:
    """Every run starts from the same state of torch's, numpy's and Python's global generators (as every test does,
    tests/conftest.py): a run's figures do not depend on which runs came before it in this process."""
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def _error(exc: BaseException) -> dict:
    return {"status": "error", "error": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(exc))[-4000:]}


class Runner:
    def __init__(self, work: Path):
        from tests.conftest import LEARNABLE, METHOD_CASES, built_in_methods, method_overrides, tiny_config

        self.learnable = {k.replace(".", "__"): v for k, v in LEARNABLE.items()}
        self.method_overrides, self.tiny_config = method_overrides, tiny_config
        # as tests/test_every_method.py: every case, and every built-in method (one without a case records an error)
        self.cases = sorted(set(built_in_methods()) | set(METHOD_CASES))
        self.work = work
        self.data: dict[str, object] = {}

    def config(self, case: str, mode: str):
        """tests/test_every_method.py's ``_config(case)``, under the mode's settings, tracking off."""
        overrides = {**self.learnable, **self.method_overrides(case), "federation__rounds": ROUNDS,
                     "data__val_per_class": 5, "tracking__enabled": False}
        if mode == "system":
            overrides.update(SYSTEM)
            if overrides.get("federation__mode") == "async":  # fedavg-async: over-selection is refused with async
                overrides["system__overcommit"] = 1.0
        elif mode == "async":
            overrides.update(ASYNC)
        return self.tiny_config(**overrides)

    def dataset(self, cfg):
        from fedray.data import build_federated_data

        key = cfg.data.model_dump_json() + f"/{cfg.seed}"
        if key not in self.data:
            self.data[key] = build_federated_data(cfg.data, cfg.seed)
        return self.data[key]

    def run(self, case: str, mode: str) -> dict:
        from fedray.errors import ConfigError

        try:
            try:
                cfg = self.config(case, mode)
                from fedray.methods import resolve_experiment

                resolve_experiment(cfg)
            except ConfigError as exc:
                return {"status": "refused", "error": f"refused: {exc}".replace(str(self.work), "<work>")}
            import pyarrow.parquet as pq

            from fedray.simulation import run_experiment

            _seed_global_generators()
            out = self.work / mode / case
            result = run_experiment(cfg, out, progress=False, data=self.dataset(cfg))
            clients = pq.read_table(out / "clients.parquet").to_pylist()
            return {"status": "ok",
                    "history": [_figures(row) for row in result.history],
                    "summary": {k: v for k, v in _figures(result.summary).items()
                                if k.startswith(("eval/", "val/", "comm/", "sim/"))},
                    "clients": [{k: _plain(v) for k, v in row.items() if not k.startswith("time") and "wall" not in k}
                                for row in clients]}
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 (pytest.fail's Failed, a method without a case, is a BaseException)
            run = _error(exc)
            run["error"] = run["error"].replace(str(self.work), "<work>")  # the temporary folder's name is random
            return run


def produce(out: Path, modes: list[str], cases: list[str] | None) -> int:
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import fedray

    commit = _commit(ROOT)
    print(f"fedray.__file__ = {fedray.__file__}\ntree = {ROOT}, commit {commit}", flush=True)
    if not Path(fedray.__file__).resolve().is_relative_to(ROOT):
        print(f"fedray is imported from outside {ROOT}: refusing to record its figures as this tree's", file=sys.stderr)
        return 2
    start = time.perf_counter()
    record: dict = {"meta": {"commit": commit, "tree": str(ROOT), "fedray_file": fedray.__file__,
                             "python": sys.version.split()[0], "torch": torch.__version__, "rounds": ROUNDS,
                             "modes": modes, "system": SYSTEM, "async": ASYNC}, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="fedray-equivalence-") as work:
        runner = Runner(Path(work))
        unknown = sorted(set(cases or []) - set(runner.cases))
        if unknown:
            print(f"unknown cases {unknown}; allowed: {', '.join(runner.cases)}", file=sys.stderr)
            return 2
        chosen = cases or runner.cases
        record["meta"]["cases"] = chosen
        for mode in modes:
            record["runs"][mode] = {}
            for case in chosen:
                t0 = time.perf_counter()
                run = runner.run(case, mode)
                run["wall_s"] = round(time.perf_counter() - t0, 2)
                record["runs"][mode][case] = run
                extra = ""
                if run["status"] == "ok" and mode != "sync":
                    sim = [(r.get("sim/dropouts", 0), r.get("sim/stragglers", 0)) for r in run["history"]]
                    extra = f" dropouts {[d for d, _ in sim]} stragglers {[s for _, s in sim]}"
                print(f"{mode:6} {case:22} {run['status']:7} {run['wall_s']:7.1f} s"
                      f"{'  ' + run['error'][:150] if 'error' in run else ''}{extra}", flush=True)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(record, indent=1))  # as it goes: a killed run keeps what it did
    record["meta"]["wall_s"] = round(time.perf_counter() - start, 1)
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out} in {record['meta']['wall_s']} s")
    return 0


# --- comparing -----------------------------------------------------------------------------------------------------

def _flatten(run: dict) -> dict[str, object]:
    """Every figure of a recorded run under a key that says where it is: history[r].KEY, summary.KEY,
    clients[i].COLUMN; a refused or failed run is its message."""
    if run["status"] != "ok":
        return {"status": run["status"], "error": run["error"]}
    flat: dict[str, object] = {"status": "ok", "rounds": len(run["history"]), "clients.rows": len(run["clients"])}
    for r, row in enumerate(run["history"]):
        flat.update({f"history[{row.get('round', r + 1)}].{k}": v for k, v in row.items()})
    flat.update({f"summary.{k}": v for k, v in run["summary"].items()})
    for i, row in enumerate(run["clients"]):
        flat.update({f"clients[{i}].{k}": v for k, v in row.items()})
    return flat


def compare(a_path: Path, b_path: Path, show: int = 8) -> int:
    a, b = json.loads(a_path.read_text()), json.loads(b_path.read_text())
    print(f"A: {a_path} (commit {a['meta'].get('commit')})\nB: {b_path} (commit {b['meta'].get('commit')})\n")
    print(f"{'mode':7} {'case':22} {'rounds':>6} {'figures':>8}  verdict")
    different = 0
    total = 0
    for mode in sorted(set(a["runs"]) | set(b["runs"]), key=lambda m: (MODES + (m,)).index(m)):
        ra, rb = a["runs"].get(mode, {}), b["runs"].get(mode, {})
        for case in sorted(set(ra) | set(rb)):
            if case not in ra or case not in rb:
                different += 1
                print(f"{mode:7} {case:22} {'':>6} {'':>8}  MISSING in {'A' if case not in ra else 'B'}")
                continue
            fa, fb = _flatten(ra[case]), _flatten(rb[case])
            keys = sorted(set(fa) | set(fb))
            diffs = [k for k in keys if fa.get(k, "<absent>") != fb.get(k, "<absent>")
                     or type(fa.get(k)) is not type(fb.get(k))]
            total += len(keys)
            rounds = fa.get("rounds", "")
            status = ra[case]["status"]
            if not diffs:
                verdict = "equal" + ("" if status == "ok" else f" ({ra[case]['error'][:90]})")
                print(f"{mode:7} {case:22} {rounds!s:>6} {len(keys):>8}  {verdict}")
                continue
            different += 1
            print(f"{mode:7} {case:22} {rounds!s:>6} {len(keys):>8}  DIFFERENT in {len(diffs)} figure(s):")
            for k in diffs[:show]:
                print(f"{'':48}{k}: A={fa.get(k, '<absent>')!r} B={fb.get(k, '<absent>')!r}")
            if len(diffs) > show:
                print(f"{'':48}... and {len(diffs) - show} more: {', '.join(diffs[show:show + 20])}"
                      f"{' ...' if len(diffs) > show + 20 else ''}")
    print(f"\n{total} figures compared; {'all equal' if not different else f'{different} run(s) differ'}")
    return 1 if different else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the figures of every run to this JSON file")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--cases", default=None, help="comma-separated cases (default: all)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two JSON files exactly")
    parser.add_argument("--show", type=int, default=8, help="--compare: differing keys printed per run")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare, show=args.show)
    if args.out is None:
        parser.error("give --out FILE.json or --compare A B")
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in MODES]:
        parser.error(f"unknown modes {bad}; allowed: {', '.join(MODES)}")
    cases = [c for c in args.cases.split(",") if c] if args.cases else None
    return produce(args.out, modes, cases)


if __name__ == "__main__":
    sys.exit(main())
