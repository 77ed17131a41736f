"""Reading the system's trace files (CSV or parquet) into checked columns.

Every malformed input is refused before any work, in one :class:`~fedray.errors.ConfigError` naming the key, the
file's row (1 = the first data row) and the column: a missing or unknown column, a value that is not a number, a
speed that is not positive, a client id out of range, a client listed twice or missing, an interval that ends
before it starts or overlaps another of its client's, an empty cell, a CSV row with too few or too many cells.
Intervals of a client that touch (one ends where the next starts) are one interval: the client stays online.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from fedray.errors import ConfigError

DEVICE_COLUMNS = ("client", "compute_sps", "up_mbps", "down_mbps", "latency_ms")
AVAILABILITY_COLUMNS = ("client", "start_s", "end_s")


def read_device_trace(key: str, path: str, num_clients: int) -> dict[str, np.ndarray]:
    """``{column: array indexed by client id}`` of a device trace: one row per client 0..num_clients-1."""
    cols = _read(key, path, DEVICE_COLUMNS)
    client = _client_ids(key, path, cols["client"], num_clients)
    seen = np.full(num_clients, -1, dtype=np.int64)
    for row, c in enumerate(client):
        if seen[c] >= 0:
            raise ConfigError(key, f"{path}: row {row + 1}: client {c} is listed again (first in row {seen[c] + 1}); "
                              "give one row per client")
        seen[c] = row
    if (missing := np.flatnonzero(seen < 0)).size:
        raise ConfigError(key, f"{path}: client {missing[0]} has no row ({missing.size} of data.num_clients="
                          f"{num_clients} missing); give one row per client id 0..{num_clients - 1}")
    for name in DEVICE_COLUMNS[1:]:
        values = cols[name]
        bad = np.flatnonzero(values < 0 if name == "latency_ms" else ~(values > 0))
        if bad.size:
            need = ">= 0" if name == "latency_ms" else "> 0"
            raise ConfigError(key, f"{path}: row {bad[0] + 1}, column {name}: {values[bad[0]]:g}; must be {need}")
    return {name: cols[name][seen] for name in DEVICE_COLUMNS[1:]}


def read_availability_trace(key: str, path: str, num_clients: int,
                            cycle_s: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(client, start_s, end_s)`` sorted by client then start, each client's intervals disjoint and apart: those
    that touch are merged (``[0, 10)`` and ``[10, 50)`` read as ``[0, 50)``). ``cycle_s`` (a repeating trace,
    ``system.availability_cycle_s``): every interval must lie within ``[0, cycle_s]``."""
    cols = _read(key, path, AVAILABILITY_COLUMNS)
    client = _client_ids(key, path, cols["client"], num_clients)
    start, end = cols["start_s"], cols["end_s"]
    for name, values in (("start_s", start), ("end_s", end)):
        if (bad := np.flatnonzero(values < 0)).size:
            raise ConfigError(key, f"{path}: row {bad[0] + 1}, column {name}: {values[bad[0]]:g}; must be >= 0")
    if (bad := np.flatnonzero(~(end > start))).size:
        raise ConfigError(key, f"{path}: row {bad[0] + 1}, column end_s: {end[bad[0]]:g} is not after start_s="
                          f"{start[bad[0]]:g}")
    if cycle_s is not None and (bad := np.flatnonzero(end > cycle_s)).size:
        raise ConfigError("system.availability_cycle_s", f"{path}: row {bad[0] + 1}, column end_s: {end[bad[0]]:g} is "
                          f"past the cycle's end ({cycle_s:g} s): a repeating trace's intervals lie within [0, "
                          f"{cycle_s:g}]; end the interval by then or raise system.availability_cycle_s")
    order = np.lexsort((start, client))
    client, start, end = client[order], start[order], end[order]
    clash = np.flatnonzero((client[1:] == client[:-1]) & (start[1:] < end[:-1]))
    if clash.size:
        i = clash[0]
        raise ConfigError(key, f"{path}: row {order[i + 1] + 1}, column start_s: client {client[i]}'s interval "
                          f"[{start[i + 1]:g}, {end[i + 1]:g}) overlaps row {order[i] + 1}'s [{start[i]:g}, {end[i]:g}); "
                          "merge them")
    # a new interval begins where its client changes or a gap opens; touching ones run on as one
    begins = np.ones(client.size, dtype=bool)
    begins[1:] = (client[1:] != client[:-1]) | (start[1:] > end[:-1])
    last = np.append(np.flatnonzero(begins)[1:] - 1, client.size - 1)
    return client[begins], start[begins], end[last]


def trace_digests(cfg) -> dict[str, dict[str, str]]:
    """``{key: {"path", "sha256"}}`` of the trace files ``cfg`` (``system.*``) reads: recorded in the checkpoint,
    ``summary.json`` and MLflow, so that a run says which traces it ran on and a resume refuses a changed one."""
    used = {"system.trace": cfg.trace if cfg.devices in ("trace", "fedscale") else None,
            "system.availability_trace": cfg.availability_trace if cfg.availability in ("trace", "fedscale") else None}
    out = {}
    for key, path in used.items():
        if path:
            p = Path(os.path.expanduser(path))
            stat = p.stat()
            out[key] = {"path": str(p.resolve()), "sha256": _sha256(str(p), stat.st_mtime_ns, stat.st_size)}
    return out


@functools.lru_cache(maxsize=8)
def _sha256(path: str, _mtime: int, _size: int) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def check_trace_digests(saved: dict[str, dict[str, str]], now: dict[str, dict[str, str]]) -> None:
    """A resume reads the traces its checkpoint was written with: a changed file is refused naming its key."""
    for key, was in saved.items():
        got = now.get(key)
        if got is not None and got["sha256"] != was["sha256"]:
            raise ConfigError(key, f"{got['path']} changed since the checkpoint was written (sha256 "
                              f"{was['sha256'][:12]}... then, {got['sha256'][:12]}... now): the resumed rounds would "
                              "run on other devices or availability; restore the file or start a new run")


def _client_ids(key: str, path: str, values: np.ndarray, num_clients: int) -> np.ndarray:
    bad = np.flatnonzero((values != np.round(values)) | (values < 0) | (values >= num_clients))
    if bad.size:
        raise ConfigError(key, f"{path}: row {bad[0] + 1}, column client: {values[bad[0]]:g} is not a client id; "
                          f"allowed: 0..{num_clients - 1} (data.num_clients={num_clients})")
    return values.astype(np.int64)


def _read(key: str, path: str, columns: tuple[str, ...]) -> dict[str, np.ndarray]:
    p = Path(os.path.expanduser(path))
    if not p.is_file():
        raise ConfigError(key, f"{p} is not a file; give a CSV or parquet file with columns {', '.join(columns)}")
    stat = p.stat()
    return _read_cached(key, str(p), stat.st_mtime_ns, stat.st_size, columns)


@functools.lru_cache(maxsize=8)  # a sweep validates its trials' configs many times; a trace is read once
def _read_cached(key: str, path: str, _mtime: int, _size: int, columns: tuple[str, ...]) -> dict[str, np.ndarray]:
    import pyarrow as pa

    try:
        if path.endswith((".parquet", ".pq")):
            import pyarrow.parquet as pq

            table = pq.read_table(path)
        else:
            import pyarrow.csv as pacsv

            table = pacsv.read_csv(path)
    except (pa.ArrowInvalid, OSError) as e:
        where = "" if path.endswith((".parquet", ".pq")) else _ragged_row(path)
        raise ConfigError(key, f"{path}{where} is not a readable CSV or parquet file ({str(e).splitlines()[0]})") from None
    unknown = [c for c in table.column_names if c not in columns]
    if unknown:
        raise ConfigError(key, f"{path}: unknown column {unknown[0]!r}; the columns are {', '.join(columns)}")
    if missing := [c for c in columns if c not in table.column_names]:
        raise ConfigError(key, f"{path}: no column {missing[0]!r}; the columns are {', '.join(columns)}")
    if table.num_rows == 0:
        raise ConfigError(key, f"{path} has no rows")
    out = {}
    for name in columns:
        col = table.column(name)
        if col.null_count:
            row = next(i for i, v in enumerate(col.to_pylist()) if v is None)
            raise ConfigError(key, f"{path}: row {row + 1}, column {name}: empty; give a number")
        try:
            values = col.cast(pa.float64()).to_numpy(zero_copy_only=False)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            values = _first_non_number(key, path, name, col.to_pylist())
        if (bad := np.flatnonzero(~np.isfinite(values))).size:
            raise ConfigError(key, f"{path}: row {bad[0] + 1}, column {name}: {values[bad[0]]} is not a finite number")
        values.setflags(write=False)
        out[name] = values
    return out


def _ragged_row(path: str) -> str:
    """``": row N"`` for the first data row of a CSV whose cell count is not the header's ("" when none is)."""
    import csv

    with open(path, newline="") as f:
        rows = csv.reader(f)
        header = next(rows, [])
        for n, cells in enumerate(rows, start=1):
            if cells and len(cells) != len(header):
                return f": row {n} has {len(cells)} cells, the header {len(header)};"
    return ""


def _first_non_number(key: str, path: str, name: str, values: list) -> np.ndarray:
    for row, v in enumerate(values):
        try:
            float(v)
        except (TypeError, ValueError):
            raise ConfigError(key, f"{path}: row {row + 1}, column {name}: {v!r} is not a number") from None
    return np.asarray(values, dtype=np.float64)
