"""The round loop: sample, run the round on a runtime, evaluate, record.

It knows nothing of Ray or of any method: the runtime runs the round, the algorithm defines it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

import contextlib

from fedray import __version__
from fedray.record.checkpoint import CheckpointError, load_checkpoint, restore_rng, rng_state, save_checkpoint
from fedray.config import ExperimentConfig
from fedray.record.console import ConsoleReporter
from fedray.data.federated import FederatedData, build_federated_data
from fedray.errors import check_interrupted
from fedray.paths import DATA_SOURCE_KEYS
from fedray.record.run_dir import (EVAL_KEYS, ClientHistory, EventHistory, claim_run_dir, clear_previous_run, final_figures,
                                   unmark_finished, write_run_outputs)
from fedray.methods import Experiment, resolve_experiment
from fedray.runtime import Runtime, make_runtime
from fedray.runtime.base import RuntimeState
from fedray.runtime.core import summarise_clients
from fedray.runtime.server_inputs import setup_bytes
from fedray.system import Schedule, build_schedule
from fedray.system.traces import check_trace_digests, trace_digests

log = logging.getLogger("fedray")


@dataclass
class RunResult:
    summary: dict[str, Any]
    history: list[dict[str, Any]]
    output_dir: Path | None


def should_evaluate(cfg: ExperimentConfig, round_: int, end: int | None = None) -> bool:
    """Whether ``round_`` is evaluated: every ``eval_every`` rounds and the run's last, ``end`` (the run's rounds, or
    the last one ``privacy.target_epsilon`` allows: :func:`fedray.privacy.accounting.last_round`)."""
    return round_ % cfg.federation.eval_every == 0 or round_ == (cfg.federation.rounds if end is None else end)


def summarise(cfg: ExperimentConfig, history: list[dict[str, Any]], runtime: str, total_s: float,
              bytes_setup: int = 0) -> dict[str, Any]:
    """Final figures: the last evaluation, communication totals, timing."""
    evaluated = [row for row in history if row.get("eval/accuracy") is not None]
    summary: dict[str, Any] = {
        "name": cfg.name,
        "algorithm": cfg.algorithm.name,
        "dataset": cfg.data.dataset,
        "model": cfg.model.name,
        "seed": cfg.seed,
        "backend": cfg.runtime.backend,
        "runtime": runtime,
        "fedray_version": __version__,
        "rounds": len(history),
    }
    summary.update(final_figures(evaluated) or {"eval/best_accuracy": math.nan})
    summary["comm/bytes_up"] = float(sum(row["comm/bytes_up"] for row in history))
    summary["comm/bytes_down"] = float(sum(row["comm/bytes_down"] for row in history))
    if bytes_setup:  # one-time, before round 1 (e.g. FedCD's shared validation images to every client)
        summary["comm/bytes_setup"] = float(bytes_setup)
    if history and "privacy/sample_epsilon" in history[-1]:
        summary["privacy/sample_epsilon"] = float(history[-1]["privacy/sample_epsilon"])
    if history and "privacy/epsilon" in history[-1]:  # client-level DP's epsilon after the last round, its sigma
        from fedray.privacy.accounting import noise_multiplier

        summary["privacy/epsilon"] = float(history[-1]["privacy/epsilon"])
        summary["privacy/noise_multiplier"] = noise_multiplier(cfg)
    if history and "sim/clock_s" in history[-1]:  # the simulated system's clock at the end
        summary["sim/clock_s"] = float(history[-1]["sim/clock_s"])
    if traces := trace_digests(cfg.system):
        summary["traces"] = traces
    times = [row["time/round_s"] for row in history]
    summary["time/round_s"] = float(np.mean(times)) if times else math.nan
    summary["time/total_s"] = total_s
    return summary


class RunHooks(Protocol):
    """Observers of a run (MLflow tracking, Tune reporting). ``on_start`` comes after data and workers
    are ready, so input that fails validation never reaches a hook; exactly one of ``on_end`` /
    ``on_error`` follows it (``on_error`` also when ``on_start`` itself raised). ``on_checkpoint`` (optional)
    precedes the ``on_round`` of its round."""

    def on_start(self, cfg: ExperimentConfig, data: FederatedData) -> None: ...
    def on_round(self, row: dict[str, Any]) -> None: ...
    def on_end(self, result: "RunResult") -> None: ...
    def on_error(self, exc: BaseException) -> None: ...


def run_experiment(
    experiment: Experiment | ExperimentConfig,
    output_dir: str | Path | None = None,
    progress: bool = True,
    data: FederatedData | None = None,
    hooks: Sequence[RunHooks] = (),
    resume_from: str | Path | None = None,
    runtime: Runtime | None = None,
) -> RunResult:
    """Run an experiment to the end; write ``summary.json``, ``history.parquet``, ``clients.parquet`` (every
    evaluated client at every evaluation), the config, the final model and two plots (learning curve, partition).

    ``experiment``: resolved once (:func:`fedray.methods.resolve_experiment`), or a config resolved here before any
    work. ``runtime``: where to run it, from :func:`fedray.runtime.make_runtime` and not yet given data (the CLI
    builds it while it starts); the run closes it. None: built here. Resource checks and data loading come first
    (the runtime is started, then given the data), so a bad path or an impossible resource request fails before
    anything is written. Result files are written only once the run has finished. With an ``output_dir`` a
    checkpoint is written every ``runtime.checkpoint_every`` rounds; ``resume_from`` (a folder with a checkpoint)
    continues from it and ends with exactly the figures of an uninterrupted run.
    """
    with runtime if runtime is not None else contextlib.nullcontext():  # a runtime handed in is closed on every path
        exp = resolve_experiment(experiment)
        if output_dir is None:
            return _run(exp, None, progress, data, hooks, resume_from, runtime)
        with claim_run_dir(output_dir):  # one run at a time in a folder, from its checkpoint to its results
            return _run(exp, output_dir, progress, data, hooks, resume_from, runtime)


def _run(exp: Experiment, output_dir: str | Path | None, progress: bool, data: FederatedData | None,
         hooks: Sequence[RunHooks], resume_from: str | Path | None, given: Runtime | None) -> RunResult:
    cfg = exp.cfg
    start = time.perf_counter()
    fed = cfg.federation
    ckpt = load_checkpoint(resume_from) if resume_from is not None else None
    if ckpt is not None:
        check_resumable(cfg, ckpt)
    history: list[dict[str, Any]] = list(ckpt["history"]) if ckpt else []
    every = cfg.runtime.checkpoint_interval(fed.rounds) if output_dir is not None else 0
    # The runtime first: on Ray its actors start (processes, torch imports) while the data loads here.
    with contextlib.nullcontext(given) if given is not None else make_runtime(exp) as runtime:
        data = data if data is not None else build_federated_data(cfg.data, cfg.seed)
        runtime.attach(data)
        where = runtime.describe()
        schedule = build_schedule(cfg, data.num_clients)
        schedule.register(data.client_sizes())
        if ckpt is not None:
            runtime.import_state(RuntimeState(ckpt["server_state"], ckpt["client_states"],
                                              ckpt.get("channel_states", {}), ckpt.get("sent_payloads", {}),
                                              ckpt.get("server_channel_state")))
            restore_rng(ckpt["rng"])
            schedule.load(ckpt.get("system"))
            schedule.restart(runtime)  # the work in flight at the checkpoint, started again
        if output_dir is not None and ckpt is not None and unmark_finished(output_dir):
            log.info("%s: extending its finished run to %d rounds", output_dir, fed.rounds)
        if output_dir is not None and ckpt is None and (removed := clear_previous_run(output_dir)):
            log.warning("%s held an earlier run: replaced (removed %s)", output_dir, ", ".join(removed))
        # Each evaluation's per-client rows go to disk as they come (clients.parquet at the end); a resume keeps
        # those up to its checkpoint's round.
        client_history = (ClientHistory(output_dir, len(history) if ckpt is not None else None, resume_from)
                          if output_dir is not None else None)
        event_history = (EventHistory(output_dir, len(history) if ckpt is not None else None, resume_from)
                         if output_dir is not None and cfg.system.enabled else None)
        started: list[RunHooks] = []  # a hook whose on_start raised gets on_error too (it may have begun a run)
        try:
            for hook in hooks:
                started.append(hook)
                hook.on_start(cfg, data)
                if ckpt is not None:
                    # The killed run may have died between writing its checkpoint and recording that round.
                    getattr(hook, "on_resume", lambda h: None)(history)
            title = f"{cfg.algorithm.name} on {cfg.data.dataset}"
            end = privacy_rounds(cfg)
            sample_dp = sample_accounting(cfg, data)
            with ConsoleReporter(end, title, enabled=progress, done=len(history)) as bar:
                for r in range(len(history) + 1, end + 1):
                    row = _round(cfg, runtime, r, schedule, client_history, event_history, end)
                    if sample_dp is not None:
                        row["privacy/sample_epsilon"] = sample_dp(r)
                    history.append(row)
                    bar.update(row)
                    if every and (r % every == 0 or r == end):  # the last one too: a run may be extended
                        folder = _checkpoint(Path(output_dir), cfg, runtime, history, schedule)
                        for hook in hooks:
                            getattr(hook, "on_checkpoint", lambda f: None)(folder)
                    for hook in hooks:
                        hook.on_round(row)
                    check_interrupted()
            final_weights = runtime.global_weights() if output_dir is not None else None
            clients = runtime.client_evaluation()
            summary = summarise(cfg, history, where, time.perf_counter() - start,
                                setup_bytes(exp, data))
            out = Path(output_dir) if output_dir is not None else None
            if out is not None:
                write_run_outputs(out, cfg, data, history, summary, final_weights, clients, client_history,
                                  [row["round"] for row in history if should_evaluate(cfg, row["round"], end)],
                                  event_history)
            result = RunResult(summary, history, out)
        except BaseException as exc:
            for parts in (client_history, event_history):
                if parts is not None:
                    parts.stopped()
            for hook in started:
                hook.on_error(exc)
            raise
    for hook in hooks:
        hook.on_end(result)
    return result


def check_resumable(cfg: ExperimentConfig, ckpt: dict[str, Any]) -> None:
    """Only where the work runs, where the data is read from and how it is tracked may change on resume, and
    ``federation.rounds`` where nothing depends on it (:func:`check_extension`); the experiment may not."""
    saved = ExperimentConfig.model_validate(ckpt["config"])
    mine, theirs = cfg.flat(), saved.flat()
    changed = sorted(k for k in mine if not k.startswith(("runtime.", "tracking.")) and k not in DATA_SOURCE_KEYS
                     and k != "federation.rounds" and mine[k] != theirs.get(k))
    if changed:
        raise CheckpointError("--resume", f"the checkpoint was written by another experiment ({', '.join(changed)} "
                              "differ); only runtime.*, tracking.*, where the data is read from "
                              f"({', '.join(DATA_SOURCE_KEYS)}) and federation.rounds may change on resume")
    if cfg.federation.rounds != saved.federation.rounds:
        check_extension(saved, cfg.federation.rounds, int(ckpt["round"]))
    check_trace_digests(ckpt.get("traces", {}), trace_digests(cfg.system))


def check_extension(saved: ExperimentConfig, rounds: int, done: int) -> None:
    """A run of ``saved.federation.rounds`` rounds, checkpointed after round ``done``, goes on to ``rounds``: with
    exactly the figures of a run started with ``rounds``, or refused naming what in it depends on the total."""
    fed, key = saved.federation, "federation.rounds"
    if rounds < done:
        raise CheckpointError(key, f"the checkpoint holds round {done}; give federation.rounds={done} or more")
    if fed.lr_schedule != "constant":
        raise CheckpointError(key, f"federation.lr_schedule={fed.lr_schedule}: every round's learning rate depends "
                              "on the total rounds, so a run of another length differs from round 2 on")
    if done == fed.rounds:  # a finished run: its last round was evaluated (and diagnosed) as the last
        for every, what in ((fed.eval_every, "eval_every"), (fed.diag_every, "diag_every")):
            if done % every:
                raise CheckpointError(key, f"federation.{what}={every}: round {done} was evaluated only as the "
                                      f"last round, which a run of {rounds} rounds would not do")


def _checkpoint(out: Path, cfg: ExperimentConfig, runtime: Runtime, history: list[dict[str, Any]],
                schedule: Schedule) -> Path:
    state = runtime.export_state()
    ckpt = {"round": len(history), "config": cfg.model_dump(mode="json"), "server_state": state.server,
            "client_states": state.clients, "channel_states": state.channel, "sent_payloads": state.sent,
            "server_channel_state": state.server_channel, "history": history, "rng": rng_state()}
    if traces := trace_digests(cfg.system):  # which files the clock ran on (a resume refuses changed ones)
        ckpt["traces"] = traces
    system = schedule.state()
    if system is not None:  # the clock, the availability state, the work in flight: a resume continues them
        ckpt["system"] = system
    save_checkpoint(out, ckpt)
    return out


def privacy_rounds(cfg: ExperimentConfig) -> int:
    """The rounds the run makes: ``federation.rounds``, or fewer where ``privacy.target_epsilon`` stops it (a finished
    run); with privacy on, one line saying what the accountant assumes."""
    if not cfg.privacy.enabled:
        return cfg.federation.rounds
    from fedray.privacy.accounting import amplification, last_round, noise_multiplier

    log.info("privacy: noise multiplier %.4g; %s", noise_multiplier(cfg), amplification(cfg)[1])
    end = last_round(cfg)
    if end < cfg.federation.rounds:
        log.info("privacy.target_epsilon=%g: the run stops after round %d, before the round that would pass it",
                 cfg.privacy.target_epsilon, end)
    return end


def sample_accounting(cfg: ExperimentConfig, data: FederatedData):
    """With DP-SGD (``privacy.sample_clip``): rounds -> the sample-level epsilon after them
    (:mod:`fedray.privacy.dpsgd`); else None."""
    p = cfg.privacy
    if p.sample_clip is None:
        return None
    from fedray.privacy.dpsgd import sample_accountant

    return sample_accountant(cfg.federation, data.client_sizes().tolist(), p.sample_noise, p.delta, p.sample_batches)


def _round(cfg: ExperimentConfig, runtime: Runtime, r: int, schedule: Schedule,
           client_history: ClientHistory | None = None, events: EventHistory | None = None,
           end: int | None = None) -> dict[str, Any]:
    """Round ``r``: the schedule's server step (its work run by the runtime), then evaluation."""
    t0 = time.perf_counter()
    report = schedule.step(r, runtime)
    if events is not None and report.events is not None:
        events.add(r, report.events)
    row: dict[str, Any] = {"round": r, **summarise_clients(report.step.infos), "comm/bytes_down": report.bytes_down,
                           **report.step.metrics, **report.sim}
    if cfg.privacy.enabled:  # epsilon after this step, a function of the config and the steps (no state)
        from fedray.privacy.accounting import epsilon

        row["privacy/epsilon"] = epsilon(cfg, r)
    evaluated, t_eval = should_evaluate(cfg, r, end), time.perf_counter()
    row.update(runtime.evaluate() if evaluated else dict.fromkeys(EVAL_KEYS))
    row["time/eval_s"] = time.perf_counter() - t_eval if evaluated else 0.0
    if evaluated and client_history is not None:
        columns = runtime.client_scores().columns()
        columns.update(schedule.client_columns(columns["client"]))
        client_history.add(r, columns)
    row["time/server_s"] = report.step.wall_s
    row["time/round_s"] = time.perf_counter() - t0
    return row
