"""The FedCD benchmark's figures with numpy's BLAS on one thread (every training process since fedray.runtime.process)
against the machine's default threads (as FedCD's recorded benchmark ran): the first rounds of each method's
Fashion-MNIST benchmark run, each in a process of its own, every history figure compared. A method whose figures
all agree needs no rerun of its recorded runs.

    .venv/bin/python benchmarks/quality/fedcd_blas_threads.py [--rounds 2] [--setting alpha0.5] [--methods fedcd ...]

Record: benchmarks/results/fedcd_blas_threads.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAPERS = HERE.parent / "papers"  # fedcd_fmnist.py: the benchmark's own configs
OUT = HERE.parent / "results" / "fedcd_blas_threads.md"


def one_run(method: str, default_threads: bool, setting: str, rounds: int) -> list[dict]:
    sys.path.insert(0, str(PAPERS))
    from fedcd_fmnist import make_config

    import fedray.runtime.process as process
    from fedray.simulation import run_experiment

    if default_threads:  # the claim before one BLAS thread: torch's threads only
        process._BLAS_THREAD_VARIABLES = ()
        process.threadpool_limits = lambda **kw: type("Kept", (), {"restore_original_limits": lambda self: None})()
    cfg = make_config(method, setting, 0, rounds, "cpu", None, eval_every=1)
    cfg = cfg.model_copy(update={"federation": cfg.federation.model_copy(update={"rounds": rounds, "eval_every": 1})})
    return run_experiment(cfg, progress=False).history


def compare(method: str, setting: str, rounds: int) -> list[str]:
    """One method's section of the record: its runs with default and with one BLAS thread, side by side."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    procs = {child: subprocess.Popen([sys.executable, __file__, "--child", child, "--rounds", str(rounds),
                                      "--setting", setting, "--methods", method], stdout=subprocess.PIPE, text=True,
                                     env=env)
             for child in ("default", "one")}  # side by side: each run's threads are set, its figures its own
    hist = {}
    for child, proc in procs.items():
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"the {method} {child} run failed ({proc.returncode})")
        hist[child] = json.loads(out.strip().splitlines()[-1])
    rows = []
    for a, b in zip(hist["default"], hist["one"]):
        for key in sorted(a):
            if key.startswith(("time/", "sys/")) or not isinstance(a[key], (int, float)) or a[key] is None:
                continue
            x, y = float(a[key]), float(b[key])
            if not (x == y or (math.isnan(x) and math.isnan(y))):
                rows.append((a["round"], key, x, y))
    keys = sum(1 for row in hist["one"] for k in row if not k.startswith(("time/", "sys/")))
    lines = [f"## {method}", "", f"{keys} history figures compared (rounds 1-{rounds}, time/* left out): "
             f"{len(rows)} differ." + (" Those that differ:" if rows else ""), ""]
    if rows:
        lines += ["| round | figure | default threads | one thread | relative difference |", "| ---: | --- | ---: | ---: | ---: |"]
        lines += [f"| {r} | `{k}` | {x!r} | {y!r} | {abs(x - y) / max(abs(x), 1e-300):.1e} |" for r, k, x, y in rows]
        lines.append("")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--setting", default="alpha0.5")
    ap.add_argument("--methods", nargs="+", default=["fedcd"])
    ap.add_argument("--child", choices=["one", "default"])
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_run(args.methods[0], args.child == "default", args.setting, args.rounds)))
        return
    lines = [f"# The FedCD benchmark with one BLAS thread against the default threads ({args.setting}, {args.rounds} "
             "rounds)", "",
             f"{date.today()}, this CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores). "
             f"Command: `.venv/bin/python benchmarks/quality/fedcd_blas_threads.py --rounds {args.rounds} "
             f"--setting {args.setting} --methods {' '.join(args.methods)}`", ""]
    for method in args.methods:
        lines += compare(method, args.setting, args.rounds)
    OUT.write_text("\n".join(lines))
    print(OUT.read_text())


if __name__ == "__main__":
    main()
