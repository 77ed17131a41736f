"""A run's output directory: the names of its files, writing them once a run has finished, reading them back.

A finished ``fedray run`` leaves in its directory:

- ``config.yaml`` (:data:`CONFIG_FILE`): the full, validated config;
- ``history.parquet`` (:data:`HISTORY_FILE`): one row per round (``round``, ``eval/*``, ``comm/*``, ...);
- ``curves.png`` / ``partition.png`` (:data:`CURVES_FILE` / :data:`PARTITION_FILE`): the learning curve
  and the data partition;
- ``clients.parquet`` (:data:`CLIENT_HISTORY_FILE`): one row per evaluated client and evaluated round
  (``round``, ``client``, ``accuracy``, ``loss``, ``correct``, ``samples``; personalised methods add
  ``global_accuracy`` and, with a validation set, ``val_accuracy``), written during the run as one part per
  evaluation (:class:`ClientHistory`) and put together at the end;
- ``model.pt`` (:data:`MODEL_FILE`): the final global weights;
- ``summary.json`` (:data:`SUMMARY_FILE`): the final figures. It is written last, so its presence marks a
  finished run (:func:`is_finished`);
- ``mlflow_run.json`` (:data:`MLFLOW_RUN_FILE`), when the run is tracked: which MLflow run it is, so that a
  resumed run continues it.

Every file is written to a temporary name and renamed, so a crash never leaves a half-written file. This
module knows nothing of MLflow (:mod:`fedray.record.tracking`) or of the console (:mod:`fedray.record.console`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

try:
    import fcntl
except ImportError:  # not POSIX: run directories are not locked
    fcntl = None  # type: ignore[assignment]

import pyarrow as pa
import pyarrow.parquet as pq

if TYPE_CHECKING:
    from fedray.config import ExperimentConfig
    from fedray.data.federated import FederatedData

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
HISTORY_FILE = "history.parquet"
CURVES_FILE = "curves.png"
PARTITION_FILE = "partition.png"
MODEL_FILE = "model.pt"
CLIENTS_FILE = "clients.json"  # personalised methods: each client's own model at the last evaluation
CLIENT_HISTORY_FILE = "clients.parquet"  # every method: each evaluated client at every evaluation
CLIENT_PARTS_DIR = ".clients-parts"  # clients.parquet's parts while the run goes on (ClientHistory)
EVENTS_FILE = "events.parquet"  # with a simulated system: every selected client of every round, its times and fate
EVENT_PARTS_DIR = ".events-parts"  # events.parquet's parts while the run goes on (EventHistory)
CLIENTS_PLOT_FILE = "clients.png"  # fedray report --clients RUN's plot when no --plot is given
MLFLOW_RUN_FILE = "mlflow_run.json"
LOCK_FILE = ".fedray.lock"  # held while a run writes the folder (claim_run_dir)

# What a finished run leaves in its output directory (and logs to MLflow as artifacts).
RESULT_FILES = (CONFIG_FILE, SUMMARY_FILE, HISTORY_FILE, CLIENT_HISTORY_FILE, CURVES_FILE, PARTITION_FILE,
                MODEL_FILE)
OPTIONAL_FILES = (CLIENTS_FILE, EVENTS_FILE)  # left by some runs only (personalised methods; a simulated system)

# The evaluation columns of a history row; ``None`` in rounds that were not evaluated.
EVAL_KEYS = ("eval/accuracy", "eval/amp", "eval/fm", "eval/wlp")


def final_figures(evaluated: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's final evaluation figures from its evaluated history rows (round order): the last round's
    ``eval/*`` and ``val/*``, ``eval/best_accuracy`` (the best round chosen on the test set itself, as papers
    often report it), and with a validation set ``eval/accuracy_at_best_val``: the test accuracy of the round
    with the best ``val/accuracy`` (the earliest of equals; ``val/best_round``), a round chosen without the
    test set."""
    if not evaluated:
        return {}
    out = {k: v for k, v in evaluated[-1].items() if k.startswith(("eval/", "val/"))}
    out["eval/best_accuracy"] = max(row["eval/accuracy"] for row in evaluated)
    scored = [row for row in evaluated if isinstance(row.get("val/accuracy"), (int, float))]
    if scored:
        chosen = max(scored, key=lambda row: row["val/accuracy"])
        out["eval/accuracy_at_best_val"], out["val/best_round"] = chosen["eval/accuracy"], int(chosen["round"])
    return out


# --------------------------------------------------------------------------------------------------
# writing


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """``data`` into ``path`` whole or not at all: a temporary file beside it, then renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, allow_nan=True) + "\n").encode())


def write_history(path: Path, history: list[dict[str, Any]]) -> None:
    path = Path(path)
    keys: list[str] = []
    for row in history:
        keys += [k for k in row if k not in keys]
    for k in EVAL_KEYS:  # eval columns exist even when a run evaluated rarely
        if k not in keys:
            keys.append(k)
    columns = {k: [row.get(k) for row in history] for k in keys}
    table = pa.table({k: pa.array(v, type=pa.int64() if k == "round" else None) for k, v in columns.items()})
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def plot_learning_curve(history: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Accuracy (global test set) and AMP / WLP (client test splits) per evaluated round."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, safe in workers

    fig = Figure(figsize=(6, 4), dpi=100)
    ax = fig.add_subplot()
    for key, label in (("eval/accuracy", "accuracy (global test)"), ("eval/amp", "AMP (clients)"),
                       ("eval/wlp", "WLP (worst client)")):
        pts = [(row["round"], row[key]) for row in history if row.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, markersize=3, label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("fraction correct")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path


class ClientHistory:
    """``clients.parquet`` as a run writes it: each evaluation's rows go at once to a part file of their own in
    :data:`CLIENT_PARTS_DIR` (``round-00000012.parquet``, written to a temporary name, synced and renamed), so
    the driver holds one evaluation's rows at a time, however many clients and rounds; :meth:`finish` puts the
    parts together, one at a time, into ``clients.parquet`` when the run has finished.

    A killed run leaves its parts beside its checkpoint, never a ``clients.parquet``. Resumed from the
    checkpoint of round R, the parts of rounds after R are removed (those rounds are run again) and those up
    to R kept, so the finished file holds each evaluated (round, client) exactly once.
    """

    PARTS, FILE = CLIENT_PARTS_DIR, CLIENT_HISTORY_FILE

    def __init__(self, out: str | Path, resume_round: int | None = None, resume_from: str | Path | None = None):
        """A new run (``resume_round`` None): parts an earlier run left in ``out`` are removed. A run resumed
        from the checkpoint of round ``resume_round`` (in ``resume_from``, default ``out``) keeps the parts up
        to that round, copied over when the checkpoint's folder is another."""
        self.parts = Path(out) / self.PARTS
        if resume_round is None:
            shutil.rmtree(self.parts, ignore_errors=True)
            return
        source = Path(resume_from) / self.PARTS if resume_from is not None else self.parts
        finished = source.parent / self.FILE
        if not self._found(source) and finished.is_file():  # a finished run being extended: its parts were joined
            self._split(finished, resume_round)
            return
        for round_, path in self._found(source).items():
            if round_ > resume_round:
                path.unlink(missing_ok=True)  # from rounds after the checkpoint, run again now
            elif source != self.parts and not (self.parts / path.name).exists():
                self.parts.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, self.parts / path.name)

    def _split(self, finished: Path, resume_round: int) -> None:
        """The parts of rounds up to ``resume_round`` again, from a finished run's ``clients.parquet``."""
        import pyarrow.compute as pc

        table = pq.read_table(finished)
        rounds = table.column("round").to_numpy()
        for round_ in sorted(set(rounds.tolist())):
            if round_ <= resume_round:
                part = table.filter(pc.equal(table.column("round"), round_))
                self.parts.mkdir(parents=True, exist_ok=True)
                pq.write_table(part, self._part(round_))

    @staticmethod
    def _found(folder: Path) -> dict[int, Path]:
        if not folder.is_dir():
            return {}
        return {int(p.stem.split("-")[1]): p for p in folder.glob("round-*.parquet")}

    def _part(self, round_: int) -> Path:
        return self.parts / f"round-{round_:08d}.parquet"

    def add(self, round_: int, columns: dict[str, Any]) -> None:
        """Write evaluated round ``round_``'s rows (``columns``: equal-length arrays, one row per client)."""
        n = len(next(iter(columns.values())))
        table = pa.table({"round": pa.array([round_] * n, type=pa.int64()), **columns})
        path = self._part(round_)
        tmp = path.with_name(f".{path.name}.tmp")
        self.parts.mkdir(parents=True, exist_ok=True)  # made here: a run stopped before it evaluates leaves none
        pq.write_table(table, tmp)
        with open(tmp, "rb") as fh:  # on disk before the round's checkpoint, which is synced too
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def finish(self, path: str | Path, rounds: list[int]) -> bool:
        """Write ``clients.parquet`` at ``path`` (a temporary name, then renamed) from the parts of the
        evaluated ``rounds``, in round order, one part in memory at a time. False, writing nothing, when a
        round has no part (a run resumed from a checkpoint of a fedray that did not record them): a file
        missing rounds would read as complete."""
        if not rounds:  # a run evaluates at least its last round
            return False
        parts = [self._part(r) for r in rounds]
        missing = [r for r, p in zip(rounds, parts) if not p.is_file()]
        if missing:
            logging.getLogger("fedray").warning(
                "%s not written: no per-client figures of round(s) %s (the run was resumed from a checkpoint "
                "written before fedray recorded them)", self.FILE, ", ".join(map(str, missing[:10]))
                + (", ..." if len(missing) > 10 else ""))
            return False
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        writer = None
        try:
            for part in parts:
                table = pq.read_table(part)
                if writer is None:
                    writer = pq.ParquetWriter(tmp, table.schema)
                writer.write_table(table)
        finally:
            if writer is not None:
                writer.close()
        os.replace(tmp, path)
        return True

    def discard(self) -> None:
        """Remove the parts (once the run's files are written)."""
        shutil.rmtree(self.parts, ignore_errors=True)

    def stopped(self) -> None:
        """The run stopped before its end: the parts stay for a resume when there is a checkpoint to resume
        from; without one nothing can use them, and the run's folder is left as it would be without them."""
        from fedray.record.checkpoint import FILENAME as CHECKPOINT_FILE

        if not (self.parts.parent / CHECKPOINT_FILE).is_file():
            self.discard()


class EventHistory(ClientHistory):
    """``events.parquet`` as a run with a simulated system writes it: a part file per round (every selected client,
    its simulated times and its fate), kept and resumed as :class:`ClientHistory` keeps its parts."""

    PARTS, FILE = EVENT_PARTS_DIR, EVENTS_FILE


def write_run_outputs(out: Path, cfg: "ExperimentConfig", data: "FederatedData", history: list[dict[str, Any]],
                      summary: dict[str, Any], weights: Any, clients: list[dict[str, Any]] | None = None,
                      client_history: ClientHistory | None = None, evaluated: list[int] | None = None,
                      events: "EventHistory | None" = None) -> None:
    """Write a finished run's files into ``out``: config, final weights, both plots, history, the
    per-client history (``clients.parquet``, from ``client_history``'s parts of the ``evaluated`` rounds),
    the per-client figures of personalised methods at the last evaluation (``clients.json``), and last
    ``summary.json``, whose presence marks the run finished. The last round's checkpoint stays, so that
    ``fedray run --resume DIR federation.rounds=N`` can extend the run (:class:`ClientHistory` then takes the rounds
    so far from ``clients.parquet``); the per-client parts go. ``events``: a simulated system's per-round parts
    (``events.parquet``, every round of ``history``)."""
    import torch

    from fedray.record.checkpoint import FILENAME as CHECKPOINT_FILE
    from fedray.data.plot import partition_label, plot_partition

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(cfg.to_yaml())
    torch.save(weights, out / MODEL_FILE)
    title = f"{cfg.name}: {cfg.algorithm.name} on {cfg.data.dataset}"
    plot_learning_curve(history, out / CURVES_FILE, title=title)
    if not data.on_demand:  # made on demand, drawing every client's label mix would make every client
        plot_partition(data, out / PARTITION_FILE, title=f"{cfg.data.dataset}, {partition_label(cfg.data)}")
    write_history(out / HISTORY_FILE, history)
    if client_history is not None:
        client_history.finish(out / CLIENT_HISTORY_FILE, list(evaluated or []))
    if events is not None:
        events.finish(out / EVENTS_FILE, [row["round"] for row in history])
    if clients is not None:
        write_json(out / CLIENTS_FILE, clients)
    write_json(out / SUMMARY_FILE, summary)  # its presence marks a finished run
    for parts in (client_history, events):
        if parts is not None:
            parts.discard()


def unmark_finished(out: str | Path) -> bool:
    """A finished run in ``out`` being extended: its ``summary.json`` goes first, so that stopped midway the folder
    holds an unfinished run (resumable from its checkpoint), not the shorter run's figures as if they were final.
    True if there was one."""
    path = Path(out) / SUMMARY_FILE
    if not path.is_file():
        return False
    path.unlink()
    return True


@contextmanager
def claim_run_dir(out: str | Path) -> Iterator[Path]:
    """Hold the run directory ``out`` for this process while a run (or a resume) writes there.

    Two runs in one folder (``--output-dir`` given twice, or two runs started in the same second under the
    default name) would each replace the other's files and both report success; ``fedray report`` would then
    count one run where two ran. The claim is an advisory lock (``flock``) on :data:`LOCK_FILE`, which the OS
    drops when the process ends however it ends, so a killed run leaves no stale claim. The lock file is
    removed at the end, and so is a folder the run found empty (or made) and left empty. Without ``fcntl``
    (not POSIX) nothing is locked.
    """
    from fedray.errors import ConfigError

    out = Path(out)
    fresh = not out.is_dir() or not any(out.iterdir())
    out.mkdir(parents=True, exist_ok=True)
    lock = out / LOCK_FILE
    with open(lock, "a+") as fh:
        if fcntl is not None:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.seek(0)
                pid = fh.read().strip()
                raise ConfigError("--output-dir", f"{out} is in use by another fedray run"
                                  + (f" (pid {pid})" if pid else "") + "; give another folder, or wait for it to end")
            fh.seek(0)
            fh.truncate()
            fh.write(f"{os.getpid()}\n")
            fh.flush()
        try:
            yield out
        finally:
            lock.unlink(missing_ok=True)  # while held, so no run takes the folder before this one is done with it
            if fresh and not any(out.iterdir()):
                out.rmdir()


def clear_previous_run(out: str | Path) -> list[str]:
    """Remove what an earlier run left in ``out`` (its result files, ``clients.json``, the per-client parts and
    plot, checkpoint and MLflow run file) before a new one starts there: killed midway, the new run would
    otherwise sit beside the old ``summary.json``, which marks a finished run (``fedray report`` would show the
    old figures, ``--resume`` refuse the new checkpoint). Other files are left. Returns the names removed."""
    from fedray.record.checkpoint import FILENAME as CHECKPOINT_FILE

    removed = []  # summary.json first: stopped while clearing, the folder no longer claims a finished run
    for name in dict.fromkeys((SUMMARY_FILE, *RESULT_FILES, CLIENTS_FILE, EVENTS_FILE, CLIENTS_PLOT_FILE,
                               MLFLOW_RUN_FILE, CHECKPOINT_FILE)):
        path = Path(out) / name
        if path.is_file():
            path.unlink()
            removed.append(name)
    for parts in (CLIENT_PARTS_DIR, EVENT_PARTS_DIR):
        if (Path(out) / parts).is_dir():
            shutil.rmtree(Path(out) / parts)
            removed.append(parts)
    return removed


# --------------------------------------------------------------------------------------------------
# reading


def is_finished(folder: str | Path) -> bool:
    """Whether ``folder`` holds a finished run (its ``summary.json``)."""
    return (Path(folder) / SUMMARY_FILE).is_file()


def read_summary(folder: str | Path) -> dict[str, Any]:
    """The final figures of the finished run in ``folder``."""
    return json.loads((Path(folder) / SUMMARY_FILE).read_text())


def read_history(path: str | Path) -> list[dict[str, Any]]:
    """The per-round rows of a ``history.parquet`` file, or of the run folder holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / HISTORY_FILE
    return pq.read_table(path).to_pylist()
