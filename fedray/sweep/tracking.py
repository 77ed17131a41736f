"""The sweep's MLflow record, written by the Tune driver: one child run per trial under the sweep's parent run
(one SQLite writer). A child ends FINISHED when its trial completes (tagged ``fedray.stopped_early`` when ASHA
stopped it), FAILED when it raises; children a crashed driver left RUNNING are marked KILLED."""

from __future__ import annotations

import json
from pathlib import Path

from ray import tune

from fedray.record.provenance import run_label
from fedray.record.tracking import MlflowTracker, log_final_model
from fedray.sweep.spec import SweepSpec

DATA_KEY = "fedray_data"  # a trial's first report: its data_facts (JSON), for its MLflow run's input and model


class MlflowSweepCallback(tune.Callback):
    """Records every trial as a child run of the sweep's parent run, from the Tune driver."""

    def __init__(self, spec: SweepSpec, uri: str, experiment: str, parent_run_id: str, source: str | None = None):
        self.spec, self.uri, self.experiment, self.parent, self.source = spec, uri, experiment, parent_run_id, source
        self._runs: dict[str, MlflowTracker] = {}
        self._last_round: dict[str, int] = {}
        self._facts: dict[str, dict] = {}

    def __getstate__(self):  # Tune pickles callbacks into its experiment state; clients stay behind
        return {**self.__dict__, "_runs": {}, "_last_round": {}, "_facts": {}}

    def _tracker(self, trial) -> MlflowTracker:
        if trial.trial_id not in self._runs:
            t = MlflowTracker(self.uri, self.experiment)
            cfg = self.spec.trial_config(trial.config)
            # named by what it ran: method, data, seed and the searched values (the trial id is a tag)
            t.start(cfg, kind="trial", parent_run_id=self.parent, run_name=run_label(cfg, trial.config),
                    source=self.source,
                    extra_tags={"fedray.trial_id": trial.trial_id, "fedray.sweep": self.spec.name,
                                "fedray.resumed": str(bool(getattr(trial, "checkpoint", None))).lower()})
            self._runs[trial.trial_id] = t
        return self._runs[trial.trial_id]

    def on_trial_start(self, iteration, trials, trial, **info):
        self._tracker(trial)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if DATA_KEY in result:
            self._facts[trial.trial_id] = json.loads(result[DATA_KEY])
            self._tracker(trial).log_data(self._facts[trial.trial_id])
        if "round" in result:
            self._tracker(trial).log_round({k: v for k, v in result.items() if "/" in k or k == "round"})
            self._last_round[trial.trial_id] = int(result["round"])

    def _finish(self, trial, status: str, tags: dict[str, str]) -> None:
        t = self._tracker(trial)
        for k, v in tags.items():
            t.client.set_tag(t.run_id, k, v)
        run_dir = Path(trial.local_path or "") / "run"
        if run_dir.is_dir():
            t.log_artifacts(run_dir)
            facts = self._facts.pop(trial.trial_id, None)
            if status == "FINISHED" and facts is not None:
                log_final_model(t, self.spec.trial_config(trial.config), facts, run_dir,
                                self._last_round.get(trial.trial_id, 0))
        t.end(status)
        self._runs.pop(trial.trial_id, None)

    def on_trial_complete(self, iteration, trials, trial, **info):
        rounds = self.spec.trial_config(trial.config).federation.rounds
        last = self._last_round.get(trial.trial_id, 0)
        self._finish(trial, "FINISHED", {"fedray.stopped_early": str(last < rounds).lower(),
                                         "fedray.rounds_done": str(last)})

    def on_trial_error(self, iteration, trials, trial, **info):
        error = getattr(trial, "error_file", None) or ""
        self._finish(trial, "FAILED", {"fedray.error_file": str(error)})


def kill_running_children(parent: MlflowTracker) -> None:
    """Mark KILLED the parent's child runs still RUNNING: left by a crashed driver, or by trials a stopped sweep
    never ended."""
    query = f"tags.mlflow.parentRunId = '{parent.run_id}' and attributes.status = 'RUNNING'"
    for child in parent.client.search_runs([parent.experiment_id], query):
        parent.client.set_terminated(child.info.run_id, "KILLED")
