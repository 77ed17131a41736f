"""MLflow tracking: where the store is, one MLflow run per ``fedray run`` (or Tune trial), its params,
tags, a metric batch per round (every numeric ``scope/name`` key of a history row at ``step=round``),
the result files as artifacts, and an end status that is never left RUNNING.

Only MLflow lives here: the run directory and its file names belong to :mod:`fedray.record.run_dir`, terminal
output to :mod:`fedray.record.console`. :mod:`fedray.simulation` and this module do not import each other:
:class:`RunTracking` reaches a run only through the hooks that ``run_experiment`` is given.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from fedray.errors import interrupts_deferred
from fedray.record.provenance import data_facts, dataset_inputs, final_model, fluent_store, git_commit, run_label
from fedray.record.run_dir import OPTIONAL_FILES, RESULT_FILES, write_json


SQLITE = "sqlite:///"


def resolve_tracking_uri(uri: str | None) -> str:
    """``tracking.uri``, else $MLFLOW_TRACKING_URI, else a SQLite store ``./mlflow.db``.

    A SQLite store's path is made absolute from the current folder (``sqlite:///runs.db`` means
    ``./runs.db``, as in MLflow), so what is recorded of it (``mlflow_run.json``, the ``mlflow ui`` hint)
    names the same store when read from another folder. The config keeps the URI as given.
    """
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or SQLITE + "mlflow.db"
    path, sep, query = uri[len(SQLITE):].partition("?")
    if uri.startswith(SQLITE) and path not in ("", ":memory:") and not path.startswith("/"):
        uri = f"{SQLITE}{Path.cwd().resolve() / path}{sep}{query}"
    return uri


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI (its query string dropped); None for other stores."""
    return Path(uri[len(SQLITE):].partition("?")[0]) if uri.startswith(SQLITE) else None


def resumed_store(configured: str | None, recorded: str | None) -> str | None:
    """The tracking URI of a resumed run or sweep: ``recorded`` (the store it started in) when the config
    leaves the store to the default, which is ``./mlflow.db`` of the folder it started from, not of this one."""
    if configured is None and not os.environ.get("MLFLOW_TRACKING_URI") and recorded:
        return recorded
    return configured


# MLflow 3 records what an experiment is for in this tag; "custom_model_development" is model training.
EXPERIMENT_KIND = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"
UI_PORT = 5000
# MLflow 3.17's UI opens every experiment in its GenAI view (traces) unless the browser last chose "Model
# training" or the page's URL says so: the pages we print say so.
UI_VIEW = "workflowType=machine_learning"


def ui_hint(uri: str, experiment_id: str, run_id: str | None = None) -> str:
    """How to look at a run: the ``mlflow ui`` command for a local store, and the run's page."""
    page = f"#/experiments/{experiment_id}/runs" + (f"/{run_id}" if run_id else "") + f"?{UI_VIEW}"
    if uri.startswith(("http://", "https://")):
        return f"MLflow: {uri.rstrip('/')}/{page}"
    return (f"MLflow: mlflow ui --backend-store-uri {uri} --port {UI_PORT}, then open "
            f"http://127.0.0.1:{UI_PORT}/{page}")


def _artifact_root(uri: str) -> str | None:
    # A local store keeps artifacts in an absolute folder beside the database (MLflow 3 needs it absolute);
    # a remote server decides for itself.
    db = sqlite_path(uri)
    return None if db is None else (db.parent / "mlartifacts").resolve().as_uri()


def numeric_metrics(row: dict[str, Any]) -> dict[str, float]:
    """A history row's finite numbers but its round, as floats: what MLflow and Ray Tune take as metrics."""
    return {k: float(v) for k, v in row.items()
            if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)}


def _uninterrupted(method):
    """An MLflow write that a first Ctrl-C / SIGTERM does not cut in half (:func:`~fedray.errors.interrupts_deferred`)."""
    @functools.wraps(method)
    def write(*args, **kwargs):
        with interrupts_deferred():
            return method(*args, **kwargs)
    return write


class MlflowTracker:
    """One MLflow run: params, tags, a metric batch per round, artifacts, and an honest end status.

    Talks to MLflow through ``MlflowClient`` with explicit run ids (no global active run), so the same
    class serves ``fedray run`` and the Tune driver's per-trial child runs.
    """

    def __init__(self, uri: str | None, experiment: str):
        from fedray.errors import ConfigError
        from fedray.gc_pause import imports_without_gc

        # MLflow's ~1 s of imports, after torch's, in every run that tracks. Not frozen: this may be a caller's
        # process (`fedray run` imports MLflow earlier, frozen with its other imports).
        with imports_without_gc(freeze=False):
            from mlflow.tracking import MlflowClient

        for name in ("mlflow", "alembic"):  # their INFO lines (creating tables ...) are noise on our console
            logging.getLogger(name).setLevel(logging.WARNING)
        self.uri = resolve_tracking_uri(uri)
        try:
            self.client = MlflowClient(tracking_uri=self.uri)
            exp = self.client.get_experiment_by_name(experiment)
            if exp is None:
                self.experiment_id = self.client.create_experiment(
                    experiment, artifact_location=_artifact_root(self.uri), tags={EXPERIMENT_KIND: MODEL_TRAINING})
            else:
                self.experiment_id = exp.experiment_id
                if EXPERIMENT_KIND not in exp.tags:  # ours from before; a kind someone chose stays
                    self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)
        except Exception as e:  # an unreachable server or a malformed URI is the user's to fix
            raise ConfigError("tracking.uri", f"cannot use MLflow store {self.uri} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]}); fix tracking.uri or set tracking.enabled=false") from None
        self.run_id: str | None = None

    @_uninterrupted
    def start(self, cfg, kind: str = "run", parent_run_id: str | None = None, run_name: str | None = None,
              extra_tags: dict[str, str] | None = None, source: str | None = None) -> str:
        """Create the run: named ``run_name`` (default :func:`run_label`), ``source`` (the command line) as
        MLflow's Source, the config as params."""
        from fedray import __version__

        tags = {"fedray.kind": kind, "fedray.algorithm": cfg.algorithm.name, "fedray.dataset": cfg.data.dataset,
                "fedray.config": cfg.name, "fedray.version": __version__, **(extra_tags or {})}
        if source:
            tags.update({"mlflow.source.name": source, "mlflow.source.type": "LOCAL"})
        commit = git_commit()
        if commit:
            tags["mlflow.source.git.commit"] = commit
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id
        run = self.client.create_run(self.experiment_id, tags=tags, run_name=run_name or run_label(cfg))
        self.run_id = run.info.run_id
        self.log_params(cfg.flat())
        return self.run_id

    @_uninterrupted
    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def holds(self, run_id: str | None) -> bool:
        """Whether this store has the run ``run_id`` (in any experiment)."""
        from mlflow.exceptions import MlflowException

        try:
            return run_id is not None and self.client.get_run(run_id) is not None
        except MlflowException:
            return False

    @_uninterrupted
    def log_round(self, row: dict[str, Any]) -> None:
        """Every numeric key of a history row, at ``step=round``, in one batched call."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        metrics = [Metric(k, v, ts, int(row["round"])) for k, v in numeric_metrics(row).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    @_uninterrupted
    def log_artifacts(self, folder: Path) -> None:
        for name in (*RESULT_FILES, *OPTIONAL_FILES):
            if (Path(folder) / name).is_file():
                self.client.log_artifact(self.run_id, str(Path(folder) / name))

    @_uninterrupted
    def log_data(self, facts: dict[str, Any]) -> None:
        """The run's data and trace files (:func:`data_facts`) as its MLflow inputs."""
        self.client.log_inputs(self.run_id, datasets=dataset_inputs(facts))

    @_uninterrupted
    def log_model(self, cfg, facts: dict[str, Any], weights, step: int) -> str:
        """The final model (:func:`final_model`) as an MLflow PyTorch model of this run at ``step`` (the last
        round); returns its ``models:/`` URI. It takes images normalised as fedray's evaluation does
        (``(x / 255 - mean) / std``, recorded in its metadata). Pickled, not exported (``pt2``): an export
        fixes the batch size it was traced with and a personalised ``ModuleDict`` has no forward; so loading it
        needs fedray importable, and runs pickle's code (load models you trust)."""
        import mlflow
        import mlflow.pytorch
        import numpy as np
        import torch

        model = final_model(cfg, facts, weights)
        example = None if isinstance(model, torch.nn.ModuleDict) else np.zeros((2, *facts["input_shape"]), np.float32)
        version = torch.__version__.split("+")[0]
        # Its warning that pickled models run code when loaded, on every run's console: said once, in the docs
        quiet = logging.getLogger("mlflow.pytorch")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            with fluent_store(self.uri, self.experiment_id):
                info = mlflow.pytorch.log_model(
                    model, name="model", run_id=self.run_id, step=step, input_example=example,
                    serialization_format="pickle", pip_requirements=[f"torch=={version}", "fedray"],
                    metadata={"normalise_mean": facts["mean"], "normalise_std": facts["std"],
                              "input": "float32 NCHW, (uint8 / 255 - mean) / std", "algorithm": cfg.algorithm.name,
                              "personalised": isinstance(model, torch.nn.ModuleDict)})
        finally:
            quiet.setLevel(level)
        return info.model_uri

    def watch_system(self, interval_s: float, resumed: bool = False) -> "Any":
        """Start MLflow's system-metrics monitor on this run (CPU, memory, disk, network; GPU with
        nvidia-ml-py and a GPU), sampling every ``interval_s``; the caller finishes it. None for 0."""
        if not interval_s:
            return None
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        monitor = SystemMetricsMonitor(self.run_id, sampling_interval=interval_s, resume_logging=resumed,
                                       tracking_uri=self.uri)
        monitor.start()
        return monitor

    @staticmethod
    def stop_watching(monitor) -> None:
        """Finish a :meth:`watch_system` monitor (None: none), with one last sample taken now: MLflow's loop
        publishes a sample only after each full interval, so a run shorter than one would show none."""
        if monitor is None:
            return
        monitor.finish()
        try:
            monitor.collect_metrics()
            monitor.publish_metrics(monitor.aggregate_metrics())
            monitor.mlflow_logger.flush()
        except Exception as e:  # a missing sample is no reason to fail a finished run
            logging.getLogger("fedray").warning("the last system-metrics sample was not logged: %s", e)

    @_uninterrupted
    def end(self, status: str = "FINISHED") -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status=status)
            self.run_id = None


class RunTracking:
    """The hooks ``run_experiment`` calls, recording one ``fedray run`` in MLflow: its config, its data as the
    run's input, its rounds, MLflow's system metrics while it runs, its files and its final model.

    The run is created only once data and workers are ready (bad input never leaves a run behind) and
    always ends: FINISHED, FAILED on an error, KILLED on Ctrl-C / SIGTERM.
    """

    def __init__(self, cfg, kind: str = "run", parent_run_id: str | None = None, run_file: Path | None = None,
                 resume: bool = False, source: str | None = None):
        self.cfg, self.kind, self.parent, self.source = cfg, kind, parent_run_id, source
        self.run_file = run_file
        self.started_run_id: str | None = None  # kept after the run ends, for the UI hint
        # The MLflow run a resumed run continues: {"tracking_uri", "run_id"}; None for a new run.
        self.resumed = json.loads(run_file.read_text()) if resume and run_file and run_file.is_file() else None
        self.fresh_on_resume = False  # resumed, but its MLflow run is not in this store: a new one holds it all
        uri = resumed_store(cfg.tracking.uri, (self.resumed or {}).get("tracking_uri"))
        self.tracker = MlflowTracker(uri, cfg.tracking.experiment)  # fails early on a bad URI
        self.facts: dict[str, Any] | None = None  # data_facts of the run's data
        self.monitor = None
        self.model_uri: str | None = None

    @property
    def run_id(self) -> str | None:
        return self.tracker.run_id

    def on_start(self, cfg, data) -> None:
        self.facts = data_facts(cfg, data)
        if self.resumed:
            run_id = self.resumed.get("run_id")
            if self.tracker.holds(run_id):
                # A resumed run continues its MLflow run: same id, RUNNING again, later rounds appended.
                self.tracker.run_id = self.started_run_id = run_id
                self.tracker.client.update_run(run_id, status="RUNNING")
                self.monitor = self.tracker.watch_system(cfg.tracking.system_metrics_s, resumed=True)
                return
            # tracking.uri now names another store (or the run was deleted): a new run there, with every round
            self.fresh_on_resume = True
            logging.getLogger("fedray").warning(
                "MLflow run %s is not in %s; the resumed run is tracked as a new MLflow run there, with the rounds "
                "it already has", run_id, self.tracker.uri)
        if self.run_file is not None:  # first: a folder that cannot be made leaves no MLflow run behind
            self.run_file.parent.mkdir(parents=True, exist_ok=True)
        run_id = self.tracker.start(cfg, kind=self.kind, parent_run_id=self.parent, source=self.source)
        self.started_run_id = run_id
        if self.run_file is not None:
            write_json(self.run_file, {"tracking_uri": self.tracker.uri, "run_id": run_id})
        self.tracker.log_data(self.facts)
        self.monitor = self.tracker.watch_system(cfg.tracking.system_metrics_s)

    def on_round(self, row: dict[str, Any]) -> None:
        self.tracker.log_round(row)

    def on_resume(self, history: list[dict[str, Any]]) -> None:
        # The last checkpointed round may not have reached MLflow: identical values if it did (a duplicate,
        # never a gap). A new MLflow run gets every round.
        for row in history if self.fresh_on_resume else history[-1:]:
            self.tracker.log_round(row)

    def _stop_monitor(self) -> None:
        self.tracker.stop_watching(self.monitor)  # its last samples written while the run is still RUNNING
        self.monitor = None

    def on_end(self, result) -> None:
        try:
            self._stop_monitor()
            if result.output_dir is not None:
                self.tracker.log_artifacts(result.output_dir)
                last = int(result.history[-1]["round"]) if result.history else 0
                self.model_uri = log_final_model(self.tracker, self.cfg, self.facts, result.output_dir, last)
        except BaseException:  # the run's files are written, but the MLflow run must not stay RUNNING
            self.tracker.end("FAILED")
            raise
        self.tracker.end("FINISHED")

    def on_error(self, exc: BaseException) -> None:
        self._stop_monitor()
        self.tracker.end("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")


def log_final_model(tracker: MlflowTracker, cfg, facts: dict[str, Any], run_dir: Path, step: int) -> str | None:
    """Log the finished run's ``model.pt`` in ``run_dir`` as the MLflow model of ``tracker``'s run, unless
    ``tracking.log_model`` is off; its ``models:/`` URI, or None."""
    import torch

    from fedray.record.run_dir import MODEL_FILE

    path = Path(run_dir) / MODEL_FILE
    if not cfg.tracking.log_model or not path.is_file():
        return None
    return tracker.log_model(cfg, facts, torch.load(path, weights_only=True), step=step)
