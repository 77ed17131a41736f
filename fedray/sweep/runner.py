"""Ray Tune execution of a :class:`~fedray.sweep.spec.SweepSpec`.

- Each trial is a function trainable running the ordinary round loop; a round is one Tune iteration
  (``tune.report`` per round), so ASHA stops trials at round milestones.
- Each trial reserves its round loop, server actor (when the server reserves resources; else it runs in the
  trial's process) and client workers as one placement group (``tune.PlacementGroupFactory``); the actors
  it starts are captured into that group, so concurrent trials never wait on each other's actors and
  fractional GPUs are shared as the spec says.
- MLflow: one parent run per sweep and one child run per trial, all written by the driver (one SQLite
  writer). A child ends FINISHED when its trial completes (also when ASHA stops it early, tagged
  ``fedray.stopped_early``), FAILED when it raises; a trial's error never stops the sweep.
- ``resume``: Tune's own experiment state under ``storage/name``; unfinished trials are rerun and the
  children a crashed driver left RUNNING are marked KILLED.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import tune
from ray.tune.error import TuneError
from ray.tune.schedulers import ASHAScheduler

from fedray.record.checkpoint import CheckpointError, load_checkpoint
from fedray.errors import ConfigError, RunFailure, check_interrupted, record_interrupt
from fedray.runtime.ray_logs import RayLogFile
from fedray.runtime.ray_start import start_ray
from fedray.sweep.searcher import VALUE_KEY, search_algorithm
from fedray.sweep.tracking import DATA_KEY, MlflowSweepCallback, kill_running_children
from fedray.sweep.report import RESTARTED_KEY, ConsoleTrialReporter, MetricCheck, last_line, plot_sweep
from fedray.simulation import run_experiment
from fedray.record.provenance import data_facts
from fedray.record.run_dir import atomic_write_bytes
from fedray.record.tracking import (MlflowTracker, numeric_metrics, resolve_tracking_uri, resumed_store,
                                   ui_hint)
from fedray.sweep.folder import (SWEEP_STATE, TUNER_COPY, TUNER_FILE, mend_state_files, recorded_state,
                                 stand_in_for_lost_checkpoints, state_file)
from fedray.sweep.spec import (SweepSpec, concurrency, TrialRow, best_setting, check_repeats, check_trials_fit, planned_trials,
                           search_space_summary, trial_bundles, trial_value)

SPEC_FILE = "spec.yaml"  # the sweep's spec as run (after --name), also on the parent MLflow run
SWEEP_PLOT = "sweep.png"  # metric vs each searched parameter, also on the parent MLflow run
RAY_LOG = "ray.log"  # what Ray and Tune print, unless --verbose


class _TuneReport:
    """Run hook inside a trial: one ``tune.report`` per round (the round is Tune's training iteration),
    carrying the run's checkpoint when one was written that round, so a resumed sweep resumes its trials,
    and :data:`~fedray.sweep.searcher.VALUE_KEY`: the trial's value so far (:func:`trial_value`), which a
    model-based searcher is told."""

    def __init__(self, spec: SweepSpec, restarted_from: int | None = None):
        self.spec = spec
        self.pending: Path | None = None
        self.restarted_from = restarted_from
        self.metric_history: dict[int, Any] = {}  # round -> the spec's metric, rounds that reported it
        self.data_facts: str | None = None

    def on_start(self, cfg, data) -> None:
        # What MLflow records of the trial's data, sent once to the driver, which writes the child run
        self.data_facts = json.dumps(data_facts(cfg, data))

    def on_resume(self, history: list[dict[str, Any]]) -> None:
        for row in history:  # a resumed trial's value also counts the rounds before its checkpoint
            self._record(row)

    def on_checkpoint(self, folder: Path) -> None:
        self.pending = folder

    def _record(self, row: dict[str, Any]) -> None:
        if row.get(self.spec.metric) is not None:
            self.metric_history[int(row["round"])] = row[self.spec.metric]

    def on_round(self, row: dict[str, Any]) -> None:
        ckpt = tune.Checkpoint.from_directory(str(self.pending)) if self.pending is not None else None
        self.pending = None
        extra = {RESTARTED_KEY: self.restarted_from} if self.restarted_from is not None else {}
        self.restarted_from = None
        self._record(row)
        value = trial_value([self.metric_history[r] for r in sorted(self.metric_history)], self.spec)
        if value is not None:
            extra[VALUE_KEY] = value
        if self.data_facts is not None:
            extra[DATA_KEY], self.data_facts = self.data_facts, None
        tune.report({**numeric_metrics(row), "round": int(row["round"]), **extra}, checkpoint=ckpt)

    def on_end(self, result) -> None: ...

    def on_error(self, exc: BaseException) -> None: ...


def _checkpoint_round(folder) -> int | None:
    """The round of the fedray checkpoint in ``folder``; None if it is missing or unreadable."""
    try:
        return int(load_checkpoint(folder)["round"])
    except (CheckpointError, OSError):
        return None


def _trial(config: dict[str, Any], spec: SweepSpec) -> None:
    cfg = spec.trial_config(config)
    out = Path(tune.get_context().get_trial_dir()) / "run"
    checkpoint = tune.get_checkpoint()  # set when Tune restarts this trial in a resumed sweep
    if checkpoint is None:
        run_experiment(cfg, out, progress=False, hooks=[_TuneReport(spec)])
        return
    with checkpoint.as_directory() as folder:
        if _checkpoint_round(folder) is not None:
            run_experiment(cfg, out, progress=False, hooks=[_TuneReport(spec)], resume_from=folder)
            return
    # The sweep's saved state names a checkpoint that is gone: the driver was killed (SIGKILL, a second
    # Ctrl-C) after newer checkpoints had replaced it. The trial's own run directory holds its newest
    # checkpoint (Tune's are copies of it): go on from there, else start over; the first report says which.
    done = _checkpoint_round(out)
    if done is None:
        shutil.rmtree(out, ignore_errors=True)
    run_experiment(cfg, out, progress=False, hooks=[_TuneReport(spec, restarted_from=done or 0)],
                   resume_from=out if done is not None else None)


def _domain(d):
    return {"grid": tune.grid_search, "choice": tune.choice, "uniform": lambda v: tune.uniform(*v),
            "loguniform": lambda v: tune.loguniform(*v)}[d.kind](getattr(d, d.kind))


def _stop_tune_gracefully(signum, frame) -> None:
    """Ctrl-C / SIGTERM during ``fit()``: ask Tune to stop through its own SIGUSR1 handler, which saves the
    experiment state one last time. Raising instead skips that save, and the state saved seconds earlier
    may name a trial checkpoint that ``num_to_keep=1`` has since deleted, so `--resume` could not restore
    that trial. A second signal raises at once; ``run_sweep`` raises after ``fit()`` returns."""
    if record_interrupt() or not hasattr(signal, "SIGUSR1"):
        raise KeyboardInterrupt
    signal.raise_signal(signal.SIGUSR1)


def _sweep_dir(spec: SweepSpec) -> Path:
    return (Path(spec.storage).expanduser().resolve() / spec.name)


def latest_sweep(spec_stem: str, storage: str) -> str | None:
    """The most recent sweep name started from a spec (``<stem>-<timestamp>``), for ``--resume``."""
    root = Path(storage).expanduser().resolve()
    names = sorted(p.name for p in root.glob(f"{spec_stem}-*") if state_file(p).is_file())
    return names[-1] if names else None


def run_sweep(spec: SweepSpec, resume: bool = False, max_concurrent: int | None = None,
              num_samples: int | None = None, address: str | None = None, verbose: bool = False,
              console=None, source: str | None = None) -> dict[str, Any]:
    """Run (or resume) a sweep; return the best trial's config and figures (also saved as best.json).

    ``console`` gets one line per trial event (:class:`ConsoleTrialReporter`), where Ray's and Tune's own
    logs went, and how to open the sweep in MLflow; Ray's and Tune's output goes to ``ray.log`` in the sweep
    folder, unless ``verbose`` (then Tune's status block and Ray's lines print as Ray makes them)."""
    check_repeats(spec, num_samples)  # also for callers in code; the CLI checked before its dry run
    # Rounds without evaluation carry no eval/* keys; ASHA skips them (it needs its metric).
    os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # Tune's own Ctrl-C handler ends fit() as if the sweep had finished; ours (_stop_tune_gracefully) stops
    # it the same way but remembers why, so the sweep's MLflow runs end KILLED and the CLI exits 130.
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
    base = spec.base_config()
    sweep_dir = _sweep_dir(spec)
    record_file = sweep_dir / SWEEP_STATE
    recorded = recorded_state(sweep_dir) if resume else {}
    if not resume and sweep_dir.exists():
        raise ConfigError("--name", f"sweep {sweep_dir} already exists; use --resume or another --name")
    uri = resolve_tracking_uri(resumed_store(base.tracking.uri, recorded.get("tracking_uri")))
    parent = MlflowTracker(uri, base.tracking.experiment) if base.tracking.enabled else None
    say = console.print if console is not None else (lambda *a, **k: None)
    owns_ray, ray_log, monitor = False, None, None
    try:
        # Ray first, and the trials' size against it: nothing is written and no MLflow run started for a sweep
        # that cannot begin (an unreachable address) or whose trial could never be placed (Tune would wait on it)
        owns_ray = start_ray(base.model_copy(update={"runtime": base.runtime.model_copy(update={"address": address})}),
                             address_key="--address")
        bundles = [t["bundles"] for t in planned_trials(spec, 1)]
        check_trials_fit(bundles, ray.cluster_resources(), [n["Resources"] for n in ray.nodes() if n.get("Alive")])
        at_once = concurrency(spec, bundles, ray.cluster_resources(), max_concurrent)
        if resume:
            state = recorded
        else:
            sweep_dir.mkdir(parents=True)
            state = {"name": spec.name, "spec": spec.model_dump(mode="json"), "parent_run_id": None,
                     "tracking_uri": uri, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
            if parent is not None:
                state["parent_run_id"] = parent.start(base, kind="sweep", run_name=spec.name, source=source,
                                                      extra_tags={"fedray.sweep": spec.name})
                parent.log_params(search_space_summary(spec) | {"sweep.metric": spec.metric, "sweep.mode": spec.mode})
                (sweep_dir / SPEC_FILE).write_text(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
                parent.client.log_artifact(parent.run_id, str(sweep_dir / SPEC_FILE))
            atomic_write_bytes(record_file, json.dumps(state, indent=2).encode())
        if parent is not None and resume:
            parent.run_id = state["parent_run_id"]
            parent.client.update_run(parent.run_id, status="RUNNING")
            kill_running_children(parent)  # left by a crashed driver; their trials rerun as new children
        ray_log = None if verbose else RayLogFile(sweep_dir / RAY_LOG)
        if ray_log is not None:
            say(f"Ray's and Tune's logs: {ray_log.path}", highlight=False, soft_wrap=True)
        if parent is not None:
            say(ui_hint(uri, parent.experiment_id, parent.run_id), highlight=False, soft_wrap=True)
        trainable = tune.with_resources(
            tune.with_parameters(_trial, spec=spec),
            lambda config: tune.PlacementGroupFactory(trial_bundles(spec.trial_config(config), spec.trial_cpus)),
        )
        callbacks: list[tune.Callback] = [MetricCheck(spec), *([] if verbose else [ConsoleTrialReporter(spec, console)])]
        if parent is not None:
            callbacks.append(MlflowSweepCallback(spec, uri, base.tracking.experiment, state["parent_run_id"], source))
            # the driver's machine while the trials run, on the parent run (trials share it; theirs would repeat it)
            monitor = parent.watch_system(base.tracking.system_metrics_s, resumed=resume)
        if resume and tune.Tuner.can_restore(str(sweep_dir)):
            for line in mend_state_files(sweep_dir):
                say(f"resume: {line} (its driver was killed while Tune saved them)", highlight=False)
            stand_in_for_lost_checkpoints(sweep_dir)
            tuner = tune.Tuner.restore(str(sweep_dir), trainable=trainable, resume_unfinished=True,
                                       resume_errored=False)
        else:
            scheduler = None
            if spec.scheduler is not None:
                scheduler = ASHAScheduler(time_attr="round", max_t=base.federation.rounds,
                                          grace_period=spec.scheduler.grace_period,
                                          reduction_factor=spec.scheduler.reduction_factor)
            space = {k: _domain(d) for k, d in spec.search.items()}
            settings = num_samples or spec.num_samples
            optuna = spec.search_method == "optuna"
            tuner = tune.Tuner(
                trainable,
                param_space={} if optuna else space,  # TPE holds its own space, the seeds come with each setting
                tune_config=tune.TuneConfig(metric=spec.metric, mode=spec.mode, scheduler=scheduler,
                                            search_alg=search_algorithm(spec, space, at_once or 0, settings),
                                            num_samples=settings * len(spec.seeds or [None]) if optuna else settings),
                run_config=tune.RunConfig(name=spec.name, storage_path=str(sweep_dir.parent), callbacks=callbacks,
                                          failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
                                          # 2, not 1: a driver killed between saving its state and
                                          # the trial's next checkpoint still finds the one it names
                                          checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
                                          verbose=1 if verbose else 0),
            )
            # the copy mend_state_files puts back
            atomic_write_bytes(sweep_dir / TUNER_COPY, (sweep_dir / TUNER_FILE).read_bytes())
        main_thread = threading.current_thread() is threading.main_thread()
        stops = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, _stop_tune_gracefully) for sig in stops} if main_thread else {}
        try:
            results = tuner.fit()
        except TuneError as e:  # Tune wraps what a callback raised; MetricCheck's error is the user's to fix
            cause = e.__context__
            while cause is not None and not isinstance(cause, ConfigError):
                cause = cause.__context__
            if cause is None:
                raise
            raise cause from None
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        check_interrupted()  # fit() returned because of Ctrl-C / SIGTERM: the sweep ends KILLED
        rows = trial_rows(results, spec)
        best = _best(results, rows, spec)
        if best["trials"] and best["errored"] == best["trials"]:
            # No best trial to give: an error, not a finished sweep with an empty best.json
            raise RunFailure(f"every trial of sweep {spec.name} failed ({best['trials']}); the first: "
                             f"{_first_error(results)}; each trial's "
                             f"traceback is its error.txt under {sweep_dir}, Ray's and Tune's logs in ray.log")
        (sweep_dir / "best.json").write_text(json.dumps(best, indent=2, default=str) + "\n")
        plot = plot_sweep(rows, spec, best, sweep_dir / SWEEP_PLOT)
        if parent is not None:
            for k, v in best["config"].items():
                parent.client.set_tag(parent.run_id, f"best.{k}", str(v))
            parent.log_params({f"best.{k}": v for k, v in best["config"].items()})
            if best["metric_value"] is not None:
                parent.client.log_metric(parent.run_id, f"best/{spec.metric}", best["metric_value"])
            parent.client.log_artifact(parent.run_id, str(sweep_dir / "best.json"))
            if plot is not None:
                parent.client.log_artifact(parent.run_id, str(plot))
            parent.stop_watching(monitor)
            parent.end("FINISHED")
        return best
    except BaseException as exc:
        if parent is not None and parent.run_id is not None:
            kill_running_children(parent)
            parent.stop_watching(monitor)
            parent.end("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
        raise
    finally:
        if owns_ray and ray.is_initialized():
            ray.shutdown()
        if ray_log is not None:
            ray_log.close()


def _first_error(results) -> str:
    error = next(r.error for r in results if r.error is not None)
    return last_line(str(error), 300) or type(error).__name__


def trial_rows(results, spec: SweepSpec) -> list[TrialRow]:
    """The finished trials that reported the metric, each with its value: the metric over its last
    ``spec.last_rounds`` evaluated rounds, from the trial's reported history (Tune's ``metrics_dataframe``)."""
    rows = []
    for r in results:
        if r.error is not None or spec.metric not in (r.metrics or {}):
            continue
        frame = r.metrics_dataframe
        history = []
        if frame is not None and spec.metric in frame and "round" in frame:
            # one value a round: a trial restarted from a checkpoint reports its last rounds again
            history = list(dict(zip(frame["round"], frame[spec.metric])).values())
        value = trial_value(history or [r.metrics[spec.metric]], spec)
        if value is not None:
            rows.append(TrialRow(dict(r.config), dict(r.metrics), str(r.path), value))
    return rows


def _best(results, rows: list[TrialRow], spec: SweepSpec) -> dict[str, Any]:
    summary = {"sweep": spec.name, "metric": spec.metric, "mode": spec.mode, "trials": len(results),
               "errored": sum(r.error is not None for r in results)}
    if not rows:
        return {**summary, "config": {}, "metric_value": None, "metrics": {}}
    return {**summary, **best_setting(rows, spec)}
