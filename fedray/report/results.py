"""A run's output directory: the names of its files, writing them once a run has finished, reading them back.

A finished ``fedray run`` leaves in its directory:

- ``config.yaml`` (:data:`CONFIG_FILE`): the full, validated config;
- ``history.parquet`` (:data:`HISTORY_FILE`): one row per round (``round``, ``eval/*``, ``comm/*``, ...);
- ``curves.png`` / ``partition.png`` (:data:`CURVES_FILE` / :data:`PARTITION_FILE`): the learning curve
  and the data partition;
- ``model.pt`` (:data:`MODEL_FILE`): the final global weights;
- ``summary.json`` (:data:`SUMMARY_FILE`): the final figures. It is written last, so its presence marks a
  finished run (:func:`is_finished`);
- ``mlflow_run.json`` (:data:`MLFLOW_RUN_FILE`), when the run is tracked: which MLflow run it is, so that a
  resumed run continues it.

Every file is written to a temporary name and renamed, so a crash never leaves a half-written file. This
module knows nothing of MLflow (:mod:`fedray.report.tracking`) or of the console (:mod:`fedray.report.console`).
"""

from __future__ import annotations

import json
import os
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
MLFLOW_RUN_FILE = "mlflow_run.json"
LOCK_FILE = ".fedray.lock"  # held while a run writes the folder (claim_run_dir)

# What a finished run leaves in its output directory (and logs to MLflow as artifacts).
RESULT_FILES = (CONFIG_FILE, SUMMARY_FILE, HISTORY_FILE, CURVES_FILE, PARTITION_FILE, MODEL_FILE)
OPTIONAL_FILES = (CLIENTS_FILE,)  # left by some runs only (personalised methods)

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


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    _atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, allow_nan=True) + "\n").encode())


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


def write_run_outputs(out: Path, cfg: "ExperimentConfig", data: "FederatedData", history: list[dict[str, Any]],
                      summary: dict[str, Any], weights: Any, clients: list[dict[str, Any]] | None = None) -> None:
    """Write a finished run's files into ``out``: config, final weights, both plots, history, the
    per-client figures of personalised methods (``clients.json``), and last ``summary.json``, whose
    presence marks the run finished. The checkpoint, if any, is removed: a finished run has nothing to
    resume."""
    import torch

    from fedray.report.checkpoint import FILENAME as CHECKPOINT_FILE
    from fedray.data.plot import partition_label, plot_partition

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(cfg.to_yaml())
    torch.save(weights, out / MODEL_FILE)
    title = f"{cfg.name}: {cfg.algorithm.name} on {cfg.data.dataset}"
    plot_learning_curve(history, out / CURVES_FILE, title=title)
    plot_partition(data, out / PARTITION_FILE,
                   title=f"{cfg.data.dataset}, {partition_label(cfg.data)}")
    write_history(out / HISTORY_FILE, history)
    if clients is not None:
        write_json(out / CLIENTS_FILE, clients)
    write_json(out / SUMMARY_FILE, summary)  # its presence marks a finished run
    (out / CHECKPOINT_FILE).unlink(missing_ok=True)  # a finished run has nothing to resume


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
    """Remove what an earlier run left in ``out`` (its result files, ``clients.json``, checkpoint and MLflow run
    file) before a new one starts there: killed midway, the new run would otherwise sit beside the old
    ``summary.json``, which marks a finished run (``fedray report`` would show the old figures, ``--resume``
    refuse the new checkpoint). Other files are left. Returns the names removed."""
    from fedray.report.checkpoint import FILENAME as CHECKPOINT_FILE

    removed = []  # summary.json first: stopped while clearing, the folder no longer claims a finished run
    for name in dict.fromkeys((SUMMARY_FILE, *RESULT_FILES, CLIENTS_FILE, MLFLOW_RUN_FILE, CHECKPOINT_FILE)):
        path = Path(out) / name
        if path.is_file():
            path.unlink()
            removed.append(name)
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
