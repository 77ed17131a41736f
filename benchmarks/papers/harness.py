"""The harness every method-comparison benchmark in this folder shares.

A benchmark is a grid: method x setting x seed, one run folder each (``RUNS/<method>_<setting>_seed<seed>``,
a ``fedray run`` output directory). The harness

- plans the grid (:func:`plan`) from the benchmark's ``--methods``, ``--settings`` and ``--seeds``;
- runs what is not finished, ``--jobs`` at a time, each in its own process (:func:`execute`): a run folder
  holding ``summary.json`` is finished and skipped; one holding a checkpoint goes on from it, with the
  figures of an uninterrupted run;
- reads the finished runs back (:func:`collect`) for the benchmark's tables, whose cells are
  :func:`fedray.report.runs.fmt_mean_std` (mean ± sample std over seeds), the one format of ``fedray report``;
- keeps the record of how the runs were made (date, commit, device, command) in ``OUT/<name>.json``, so that
  ``--report-only`` rebuilds ``OUT/<name>.md`` from the run folders digit for digit, on any machine.

The run folders are committed (``summary.json``, ``history.parquet``, ``clients.parquet``, ``config.yaml``,
``clients.json``; ``.gitignore`` leaves out checkpoints, the per-client parts of runs in progress and plots, and
the harness deletes ``model.pt`` unless asked to keep it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from fedray.report.runs import RunRecord, fmt_mean_std
from fedray.report.table import LAST_N  # the tables' "last 5": the mean of the last 5 evaluations

__all__ = ["Finished", "LAST_N", "Run", "collect", "execute", "fmt_mean_std", "grid_args", "header", "not_run",
           "plan", "preset_config", "run_and_record", "tabled", "write"]

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


# --------------------------------------------------------------------------------------------------
# the grid


@dataclass(frozen=True)
class Run:
    """One cell of the grid and its run folder."""

    method: str
    setting: str
    seed: int
    out: Path

    @property
    def finished(self) -> bool:
        from fedray.record.run_dir import is_finished

        return is_finished(self.out)

    @property
    def failure(self) -> str | None:
        """Why the run stopped, when a benchmark that counts failures as results recorded one (``FAILED_FILE``)."""
        path = self.out / FAILED_FILE
        return json.loads(path.read_text())["error"] if path.exists() else None


#: A run that stopped with a RunFailure (e.g. every upload non-finite: a model an attack made diverge), written
#: only by benchmarks whose options say ``failures_are_results``: such a run is an outcome, not rerun.
FAILED_FILE = "failed.json"


def run_name(method: str, setting: str, seed: int) -> str:
    return f"{method}_{setting}_seed{seed}"


def plan(root: str | Path, methods: Iterable[str], settings: Iterable[str], seeds: Iterable[int]) -> list[Run]:
    """Every (method, setting, seed) of the grid, setting by setting and seed by seed (a stopped benchmark has
    every method of the seeds it reached)."""
    methods, settings, seeds = list(methods), list(settings), list(seeds)
    return [Run(m, s, seed, Path(root) / run_name(m, s, seed)) for s in settings for seed in seeds for m in methods]


def tabled(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[Run]:
    """The grid the tables cover: every method and setting of the benchmark, its default seeds and any others
    asked for. ``--methods``, ``--settings`` and ``--seeds`` choose what to run; the tables always show every
    finished run of the grid (a run of one method alone does not drop the others' rows) and name the cells
    that have not run."""
    seeds = sorted({*ap.get_default("seeds"), *args.seeds})
    return plan(args.runs_dir, ap.get_default("methods"), ap.get_default("settings"), seeds)


def pending(runs: Iterable[Run]) -> list[Run]:
    """The runs without a ``summary.json`` (or a recorded failure, :data:`FAILED_FILE`)."""
    return [r for r in runs if not r.finished and r.failure is None]


def grid_args(ap: argparse.ArgumentParser, name: str, methods: Sequence[str], settings: Sequence[str], rounds: int,
              seeds: Sequence[int] = (0, 1, 2)) -> None:
    """The options every comparison benchmark takes."""
    ap.add_argument("--methods", nargs="+", default=list(methods), choices=list(methods))
    ap.add_argument("--settings", nargs="+", default=list(settings), choices=list(settings))
    ap.add_argument("--seeds", type=int, nargs="+", default=list(seeds))
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time, each in its own process")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--keep-models", action="store_true", help="keep each run's model.pt (deleted by default)")
    ap.add_argument("--out", type=Path, default=RESULTS, help=f"where {name}.md and {name}.json go")
    ap.add_argument("--runs-dir", type=Path, default=RESULTS / f"{name}_runs", help="one folder per run")
    ap.add_argument("--report-only", action="store_true",
                    help=f"run nothing: rebuild {name}.md from the finished runs and the record in {name}.json")


def preset_config(preset: str, spec: dict[str, Any], overrides: dict[str, Any]):
    """A run's checked config: ``preset`` with ``spec`` (a method's settings: dotted keys, and ``algorithm``, a whole
    section replacing the preset's) and then ``overrides`` applied."""
    from fedray.load import load_config, validate_config
    from fedray.methods import validate_experiment
    from fedray.overrides import apply_overrides

    raw = load_config(preset).model_dump(mode="json")
    spec = dict(spec)
    if "algorithm" in spec:
        raw["algorithm"] = spec.pop("algorithm")
    return validate_experiment(validate_config(apply_overrides(raw, {**spec, **overrides})))


# --------------------------------------------------------------------------------------------------
# running


Build = Callable[[Run, dict], Any]  # (run, options) -> an ExperimentConfig, or (config, FederatedData)


def resume_point(out: Path) -> Path | None:
    """``out`` when it holds a checkpoint of an unfinished run (``run_experiment(..., resume_from=...)``)."""
    from fedray.record.checkpoint import FILENAME

    return out if (out / FILENAME).is_file() else None


def run_one(build: Build, run: Run, options: dict) -> str:
    """One run, in this process: skipped when finished, resumed from its checkpoint when it has one."""
    from fedray.errors import RunFailure
    from fedray.record.run_dir import MODEL_FILE
    from fedray.simulation import run_experiment

    if run.finished:
        return f"skip {run.out.name} (finished)"
    if "threads" in options:
        import torch

        torch.set_num_threads(options["threads"])
    built = build(run, options)
    cfg, data = built if isinstance(built, tuple) else (built, None)
    t0 = time.perf_counter()
    try:
        result = run_experiment(cfg, run.out, progress=False, data=data, resume_from=resume_point(run.out))
    except RunFailure as e:
        if not options.get("failures_are_results"):
            raise
        (run.out / FAILED_FILE).write_text(json.dumps({"error": str(e)}, indent=1) + "\n")
        record_machine(run.out, options.get("device", "cpu"))
        return f"failed {run.out.name}: {e}"
    record_machine(run.out, options.get("device", "cpu"))
    if not options.get("keep_models"):
        (run.out / MODEL_FILE).unlink(missing_ok=True)
    s = result.summary
    return (f"done {run.out.name}: accuracy {s['eval/accuracy']:.4f}, {s['time/round_s']:.2f} s/round, "
            f"{time.perf_counter() - t0:.0f} s")


def execute(build: Build, runs: Sequence[Run], options: dict, jobs: int = 1) -> int:
    """Run the unfinished ``runs``: in this process with ``jobs`` = 1, else ``jobs`` spawned processes at a
    time. ``build`` must be importable from the benchmark's module (a module-level function). Returns how
    many ran."""
    todo = pending(runs)
    for r in runs:
        if r not in todo:
            print(f"skip {r.out.name} (finished)", flush=True)
    if jobs <= 1:
        for r in todo:
            print(run_one(build, r, options), flush=True)
    elif todo:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            for fut in as_completed([pool.submit(run_one, build, r, options) for r in todo]):
                print(fut.result(), flush=True)
    return len(todo)


# --------------------------------------------------------------------------------------------------
# reading back


@dataclass
class Finished:
    """A finished run of the grid: its cell and what ``fedray.report`` reads from its folder."""

    run: Run
    record: RunRecord

    @property
    def seed(self) -> int:
        return self.run.seed

    @property
    def summary(self) -> dict:
        return self.record.summary

    @property
    def history(self) -> list[dict]:
        return self.record.history

    @property
    def params(self) -> dict:
        return self.record.params


def collect(runs: Iterable[Run]) -> dict[tuple[str, str], list[Finished]]:
    """The finished runs, by (method, setting), in seed order; unfinished ones are left out."""
    from fedray.report.runs import load_run_dirs

    out: dict[tuple[str, str], list[Finished]] = {}
    for r in sorted(runs, key=lambda r: r.seed):
        if r.finished:
            out.setdefault((r.method, r.setting), []).append(Finished(r, load_run_dirs([r.out])[0]))
    return out


def not_run(runs: Sequence[Run], name: str) -> list[str]:
    """Markdown lines naming the grid's cells without a finished run, methods that miss the same cells
    together, and the command that runs them (finished runs are skipped); none when the grid is complete."""
    missing: dict[str, dict[str, list[int]]] = {}
    for r in pending(runs):
        missing.setdefault(r.method, {}).setdefault(r.setting, []).append(r.seed)
    if not missing:
        return []
    by_cells: dict[str, list[str]] = {}
    for method, cells in missing.items():
        where = "; ".join(f"{setting} (seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, sorted(seeds)))})"
                          for setting, seeds in cells.items())
        by_cells.setdefault(where, []).append(method)
    lines = ["Not run yet, so not in the tables:"]
    lines += [f"- {', '.join(methods)}: {where}" for where, methods in by_cells.items()]
    return lines + ["", f"`.venv/bin/python benchmarks/papers/{name}.py` runs them (its defaults are this grid; "
                    "finished runs are skipped).", ""]


def last_n(history: Sequence[dict], key: str = "eval/accuracy") -> float | None:
    """The mean of ``key`` over a run's last :data:`LAST_N` evaluated rounds."""
    from fedray.report.table import last_n_mean

    return last_n_mean(history, key, LAST_N)


# --------------------------------------------------------------------------------------------------
# the record: how the runs were made


def code_version() -> str:
    """This checkout's commit (``+changes`` when fedray/ differs from it); ``$FEDRAY_COMMIT`` outside a git
    checkout (a snapshot made with ``git archive``)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "fedray"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("FEDRAY_COMMIT", "unknown")


def device_name(device: str) -> str:
    """The machine the runs use, in words: the GPU's name, or the CPU's model and core count."""
    if device != "cpu":
        try:
            import torch

            if torch.cuda.is_available():
                return f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} CPU cores"
        except ImportError:
            pass
    return f"CPU ({cpu_model()}), {os.cpu_count()} cores"


def cpu_model() -> str:
    """The CPU as far as its rounding goes: its name, family, model and stepping (/proc/cpuinfo) and the vector
    width torch's kernels dispatch to. The name alone is not enough: two AMD EPYC machines of this workplace, one
    AVX2 (family 25 model 1) and an earlier one, both read "AMD EPYC" and give one run's round-1 loss different in
    the 9th digit, which grows over the rounds as another CPU's does."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not line.strip():
                break  # the first processor's block describes them all
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    parts = [fields.get("model name") or platform.processor() or platform.machine()]
    if "cpu family" in fields:
        parts.append(f"family {fields['cpu family']} model {fields.get('model', '?')} "
                     f"stepping {fields.get('stepping', '?')}")
    try:
        import torch

        parts.append(torch.backends.cpu.get_cpu_capability())
    except (ImportError, AttributeError):
        pass
    return "; ".join(parts)


MACHINE_FILE = "machine.json"  # in a run folder: the machine that finished the run (paired runs must share one)


def record_machine(out: Path, device: str) -> None:
    """Write ``out/machine.json``: the machine (:func:`device_name`) that finished the run. Runs paired by seed must
    come from one machine: a CPU's kernels round differently (another model, another vector width), so a difference
    across machines mixes that in with the method's."""
    name = device_name(device)
    (Path(out) / MACHINE_FILE).write_text(json.dumps({"device": name, "cpu": machine_key(name)}, indent=1) + "\n")


def machine_key(device: str) -> str:
    """What must match for two runs to pair: the device's name without its core count (one torch thread a run)."""
    return device.split("), ")[0] + ")" if "), " in device else device


def run_machine(out: Path) -> str | None:
    """The machine that finished the run in ``out`` (:func:`machine_key`), None when its folder does not say."""
    path = Path(out) / MACHINE_FILE
    return json.loads(path.read_text())["cpu"] if path.is_file() else None


# --------------------------------------------------------------------------------------------------
# differences paired by seed: only between runs one machine made

Paired = tuple[float, float | None, int, int]  # mean difference, its standard error, seeds kept, seeds left out
OTHER_CPU, NO_CPU = "— (other CPU)", "— (CPU not recorded)"  # a pair refused, and why
Machines = dict[int, str | None]  # seed -> the machine (run_machine) that made that seed's run


def same_machine_seeds(seeds: Iterable[int], cpus: tuple[Machines, Machines] | None) -> tuple[list[int], str | None]:
    """Of the ``seeds`` two figures share, those whose two runs one machine made (``cpus``: each side's seed ->
    :func:`run_machine`; None when both figures come from the same runs, which pair whatever made them), and, when
    none is kept, why (:data:`OTHER_CPU`, or :data:`NO_CPU` when a run names no machine)."""
    seeds = sorted(seeds)
    if cpus is None:
        return seeds, None
    machines = {s: (cpus[0].get(s), cpus[1].get(s)) for s in seeds}
    kept = [s for s, (ca, cb) in machines.items() if ca is not None and ca == cb]
    if kept or not seeds:
        return kept, None
    return kept, NO_CPU if any(None in m for m in machines.values()) else OTHER_CPU


def paired_by_seed(a: dict[int, float], b: dict[int, float],
                   cpus: tuple[Machines, Machines] | None) -> Paired | str | None:
    """mean(a - b) over the seeds both have, its standard error (None for one seed), how many, and how many seeds were
    refused; None when no seed is shared. A seed pairs only when one machine made both runs
    (:func:`same_machine_seeds`): a seed across machines, or whose run names none, is left out, and when every seed
    is, the reason (:data:`OTHER_CPU`, :data:`NO_CPU`) stands for the difference."""
    import numpy as np

    seeds = set(a) & set(b)
    if not seeds:
        return None
    kept, refused = same_machine_seeds(seeds, cpus)
    if not kept:
        return refused
    d = [a[s] - b[s] for s in kept]
    return (float(np.mean(d)), (float(np.std(d, ddof=1) / np.sqrt(len(d))) if len(d) > 1 else None), len(d),
            len(seeds) - len(kept))


def fmt_paired(p: Paired | str | None, seeds: int = 3) -> str:
    """A :func:`paired_by_seed` difference as the tables print it: "+1.23 ± 0.45", n when not ``seeds``, and how many
    seeds were left out; a dash when no seed is shared, the reason when every seed was refused."""
    if p is None:
        return "—"
    if isinstance(p, str):
        return p
    mean, se, n, refused = p
    return (f"{mean:+.2f}" + (f" ± {se:.2f}" if se is not None else "") + (f" (n={n})" if n != seeds else "")
            + (f" ({refused} seed{'s' if refused > 1 else ''} of another CPU left out)" if refused else ""))


def invocation(script: str, argv: Sequence[str], device: str) -> dict:
    """This invocation: date, commit, device and the command that reproduces it."""
    return {"date": datetime.date.today().isoformat(), "commit": code_version(), "device": device_name(device),
            "command": " ".join([".venv/bin/python", f"benchmarks/papers/{script}.py", *map(shlex.quote, argv)])}


def read_meta(out: Path, name: str) -> dict | None:
    path = Path(out) / f"{name}.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("meta")


def shown(path: Path) -> str:
    """A path as the tables print it: relative to the repository when inside it."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def stopped(runs: Sequence[Run], cause: str, after: str = "") -> list[str]:
    """A section listing the ``runs`` that recorded a failure (:data:`FAILED_FILE`, ``failures_are_results``): outcomes
    left out of the tables' figures (their seeds columns count the runs that finished). ``cause``: what stopped them
    ("the attack"); ``after``: a further sentence."""
    failed = [(r, r.failure) for r in runs if r.failure is not None]
    if not failed:
        return []
    return ([f"## Runs {cause} stopped", "", "Left out of the figures above: the model diverged until no upload "
             f"was finite, which ends a run{after}.", ""]
            + [f"- {r.method} {r.setting} seed {r.seed}: {why}" for r, why in failed] + [""])


def header(title: str, meta: dict, name: str, runs_dir: Path, planned: Sequence[Run] = ()) -> list[str]:
    """The first lines of every comparison table: what ran where, how to rebuild the tables, and which of the
    ``planned`` runs have not run."""
    lines = [f"# {title}", "",
             f"Recorded {meta.get('date', '?')} at commit {meta.get('commit', '?')} on {meta.get('device', '?')}.",
             f"Command: `{meta.get('command', '?')}`", ""]
    for m in meta.get("earlier", []):
        lines += [f"Earlier runs: {m.get('date', '?')} at commit {m.get('commit', '?')} on {m.get('device', '?')}, "
                  f"`{m.get('command', '?')}`", ""]
    return lines + [f"Tables rebuilt from the run folders in `{shown(runs_dir)}/` by "
                    f"`.venv/bin/python benchmarks/papers/{name}.py --report-only`.", "", *not_run(planned, name)]


def run_grid(name: str, script_argv: Sequence[str], ap: argparse.ArgumentParser, args: argparse.Namespace,
             build: Build, options: dict) -> tuple[dict, list[Run]]:
    """A comparison benchmark's main steps: plan the grid it was asked for, run it (:func:`run_and_record`) and
    return the record's meta and the runs its tables cover (:func:`tabled`)."""
    runs = plan(args.runs_dir, args.methods, args.settings, args.seeds)
    return run_and_record(name, script_argv, args, build, runs, options), tabled(ap, args)


def run_planned(name: str, ap: argparse.ArgumentParser, argv: Sequence[str], planned: Callable[..., list[Run]],
                build: Build, **options: Any) -> tuple[argparse.Namespace, dict, list[Run], dict]:
    """A grid benchmark's main steps when its script plans its own grid (``planned(runs_dir, methods, settings,
    seeds)``): parse ``argv`` (:func:`grid_args`' options), run what was asked (:func:`run_and_record`, ``options``
    added to the runs' options), and return (the arguments, the record's meta, the runs the tables cover: every
    method and setting at the default and asked seeds, and those of them finished: :func:`collect`)."""
    args = ap.parse_args(argv)
    opts = {"rounds": args.rounds, "device": args.device, "threads": args.threads, "keep_models": args.keep_models,
            **options}
    meta = run_and_record(name, argv, args, build, planned(args.runs_dir, args.methods, args.settings, args.seeds),
                          opts)
    seeds = sorted({*ap.get_default("seeds"), *args.seeds})
    table_runs = planned(args.runs_dir, ap.get_default("methods"), ap.get_default("settings"), seeds)
    return args, meta, table_runs, collect(table_runs)


def run_and_record(name: str, script_argv: Sequence[str], args: argparse.Namespace, build: Build,
                   runs: Sequence[Run], options: dict, then: Callable[[], Sequence[Run]] | None = None) -> dict:
    """Run the grid unless ``--report-only``; return the record's meta: this invocation's when it ran
    something, else the one in ``OUT/<name>.json`` (so that ``--report-only`` reproduces the tables).

    ``then``, when given, names runs that depend on finished ones (a learning rate chosen from earlier
    runs): it is asked again after each batch, and its unfinished runs run, until it names none."""
    recorded = read_meta(args.out, name)
    if args.report_only:
        if recorded is None:
            print(f"warning: no {Path(args.out) / (name + '.json')}: the tables will not say where the runs "
                  "were made", file=sys.stderr)
        return recorded or {}
    ran = execute(build, runs, options, args.jobs)
    while then is not None and (later := pending(then())):
        ran += execute(build, later, options, args.jobs)
    if ran == 0 and recorded is not None:
        return recorded
    meta = invocation(name, script_argv, args.device)
    if recorded:  # runs of earlier invocations stay in the tables: say where they come from
        earlier = [{k: v for k, v in recorded.items() if k != "earlier"}, *recorded.get("earlier", [])]
        meta["earlier"] = [m for m in earlier if any(m.get(k) != meta[k] for k in ("date", "commit", "command"))]
        if not meta["earlier"]:
            del meta["earlier"]
    return meta


def write(out: Path, name: str, meta: dict, data: Any, md: str) -> None:
    """``OUT/<name>.json`` (the record and the tables' data) and ``OUT/<name>.md``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, **data}, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(md)


def reach(history: list[dict], targets) -> dict[str, dict]:
    """Per target (keyed ``str(target)``): the first round at or above it, the MB (up + down) and the simulated
    hours until then; None each where it is never reached."""
    from fedray.report.table import bytes_to_round, rounds_to_target, sim_hours_at

    out = {}
    for t in targets:
        r = rounds_to_target(history, t)
        mb = bytes_to_round(history, r)
        out[str(t)] = {"rounds": r, "mb": None if mb is None else mb / 1e6, "hours": sim_hours_at(history, r)}
    return out


def mean_reached(rs: list[dict], target: float, what: str, mb_digits: int = 0) -> tuple[float | None, str]:
    """The mean over the seeds that reach ``target`` of their ``reach[target][what]`` (rounds, mb or hours) and its
    text: MB to ``mb_digits`` decimals, rounds to one, hours to two; "(hits/seeds)" when not every seed reaches
    it, "— (0/n)" when none does."""
    vals = [r["reach"][str(target)][what] for r in rs]
    hits = [v for v in vals if v is not None]
    if not hits:
        return None, f"— (0/{len(vals)})"
    m = sum(hits) / len(hits)
    text = f"{m:,.{mb_digits}f}" if what == "mb" else f"{m:.1f}" if what == "rounds" else f"{m:.2f}"
    return m, text if len(hits) == len(vals) else f"{text} ({len(hits)}/{len(vals)})"
