"""FedScale's trace files (pickles) read into fedray's system model: device capacities and client behaviour.

FedScale (Lai et al., ICML 2022; github.com/SymbioticLab/FedScale) ships two pickles in
``benchmark/dataset/data/device_info`` (its README there describes them), which a user downloads; fedray downloads
nothing. What each holds and how FedScale reads it (``fedscale/cloud/internal/client_metadata.py``,
``client_manager.py``, ``aggregation/aggregator.py``):

* ``client_device_capacity`` (``--device_conf_file``): ``{profile id: {'computation': ms per sample of the model's
  inference, 'communication': kbit/s}}``. FedScale's client ids start at 1 (``client_register_handler``:
  ``num_of_clients + 1``); client i gets ``profiles.get(i % len(profiles), {'computation': 1.0,
  'communication': 1.0})``. Its training time is ``3 x batch_size x local_steps x computation / 1000`` s (the
  ``augmentation_factor`` 3: a backward pass costs about twice the forward) and its communication time
  ``(upload_kbit + download_kbit) / communication`` with ``kbit = bytes / 1024 x 8``. No latency.
* ``client_behave_trace`` (``--device_avail_file``): ``{key: {'duration', 'inactive', 'finish_time', 'active',
  'model'}}``; client i gets ``trace[keys[i % len(trace)]]`` (``register_client``) and is active at time t when
  ``active[j] <= t % finish_time <= inactive[j]`` for some j (``is_active``, which walks a stateful index that
  approximates this reading; fedray reads the intervals exactly).

fedray's client c is FedScale's client c + 1. A pickle is untrusted input: :class:`_TraceUnpickler` builds only the
plain containers, numbers and numpy scalars and arrays these files hold, and refuses any other class unbuilt.
Every malformed input is one :class:`~fedray.errors.ConfigError` naming the key, the file, the profile or entry
and the field.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import math
import numbers
import os
import pickle
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fedray.errors import ConfigError

#: FedScale's profile for a client whose mapped id is not a key of the device file (``aggregator.py``'s ``.get``)
DEFAULT_PROFILE = {"computation": 1.0, "communication": 1.0}
#: FedScale's ``augmentation_factor``: training a sample costs 3 inferences (forward, and a backward of about 2)
AUGMENTATION = 3.0
#: The fields of a behaviour entry fedray reads ('duration' and 'model' are FedScale's bookkeeping, unused)
BEHAVIOUR_FIELDS = ("active", "inactive", "finish_time")


class _Refused(Exception):
    def __init__(self, module: str, name: str):
        self.what = f"{module}.{name}"


def _numpy_object(module: str, name: str) -> Any:
    """numpy's object for a name pickled under ``numpy.core`` (numpy 1) or ``numpy._core`` (numpy 2), imported
    from whichever this numpy has (the other spelling is a deprecated alias or absent)."""
    for mod in (module.replace("numpy.core", "numpy._core"), module.replace("numpy._core", "numpy.core")):
        try:
            return getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError):
            continue
    raise _Refused(module, name)


#: What a FedScale trace may ask the unpickler to build besides dicts, lists, tuples, strings and numbers (which
#: need no class): numpy scalars, dtypes and arrays (their reconstruction functions), the byte strings that
#: protocol-2 pickles of numpy scalars carry (``_codecs.encode``), and an ordered dict. Nothing here runs code
#: beyond building a value.
_ALLOWED = {
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "dtype"), ("numpy", "ndarray"), ("_codecs", "encode"), ("collections", "OrderedDict"),
}


class _TraceUnpickler(pickle.Unpickler):
    """An unpickler that builds only :data:`_ALLOWED` classes: a pickle naming any other (``os.system``, a class of
    some package) is refused before anything of it is called, as Python's docs advise for untrusted pickles
    (docs.python.org/3/library/pickle.html#restricting-globals)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise _Refused(module, name)
        if module.startswith("numpy."):
            return _numpy_object(module, name)
        return super().find_class(module, name)


def _read(key: str, path: str, num_clients: int, convert: Callable[[str, str, Any, int], Any]) -> Any:
    """``convert(key, path, the pickle's value, num_clients)``, cached by path, mtime, size and client count."""
    p = Path(os.path.expanduser(path))
    if not p.is_file():
        raise ConfigError(key, f"{p} is not a file; give FedScale's pickle (docs/system.md#fedscales-traces)")
    stat = p.stat()
    return _read_cached(key, str(p), stat.st_mtime_ns, stat.st_size, num_clients, convert)


# A config is validated, then built, and a sweep validates its trials' many times: a file is read once. The arrays
# are kept (read-only), not the pickle's objects, which are far larger.
@functools.lru_cache(maxsize=8)
def _read_cached(key: str, path: str, _mtime: int, _size: int, num_clients: int,
                 convert: Callable[[str, str, Any, int], Any]) -> Any:
    out = convert(key, path, load_pickle(key, path), num_clients)
    for a in out.values() if isinstance(out, dict) else out:
        a.setflags(write=False)
    return out


def load_pickle(key: str, path: str) -> Any:
    """The value a trace pickle holds, built by :class:`_TraceUnpickler`."""
    try:
        with open(path, "rb") as f:
            return _TraceUnpickler(f).load()
    except _Refused as e:
        raise ConfigError(key, f"{path} asks to build a {e.what}, which FedScale's traces never hold; refused "
                          "unbuilt (a pickle can run code: only dicts, lists, numbers, strings and numpy values "
                          "are read)") from None
    except Exception as e:  # noqa: BLE001 - a malformed pickle raises anything (EOFError, UnpicklingError, ...)
        raise ConfigError(key, f"{path} is not a readable pickle ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else 'no detail'})") from None


def _number(v: Any) -> float | None:
    """``v`` as a float when it is a real number (not a bool), else None."""
    if isinstance(v, (numbers.Real, np.number)) and not isinstance(v, (bool, np.bool_)):
        return float(v)
    return None


def read_fedscale_devices(key: str, path: str, num_clients: int) -> dict[str, np.ndarray]:
    """``{compute_sps, up_mbps, down_mbps, latency_ms}`` per fedray client from FedScale's device capacity pickle.

    Client c is FedScale's c + 1 and gets profile ``(c + 1) % len(profiles)``, or :data:`DEFAULT_PROFILE` when that
    is not a key (as FedScale does). ``compute_sps = 1000 / (3 computation)``, so that ``samples / compute_sps``
    is FedScale's training time for ``samples = batch_size x local_steps``; ``up_mbps = down_mbps = communication x
    1024 / 10^6`` (FedScale's kbit is 1024 bits and one bandwidth serves both ways), so that ``bytes / bandwidth`` is
    its ``bytes / 1024 x 8 / communication``; latency 0 (FedScale has none)."""
    return _read(key, path, num_clients, _devices)


def _devices(key: str, path: str, profiles: Any, num_clients: int) -> dict[str, np.ndarray]:
    if not isinstance(profiles, dict) or not profiles:
        what = "an empty dict" if isinstance(profiles, dict) else f"a {type(profiles).__name__}"
        raise ConfigError(key, f"{path} holds {what}, not FedScale's device profiles (a dict {{profile id: "
                          "{'computation': ms per sample, 'communication': kbit/s}})")
    bad = [k for k in profiles if not isinstance(k, (int, np.integer)) or isinstance(k, bool)]
    if bad:
        bad = bad[0]
        raise ConfigError(key, f"{path}: profile key {bad!r} is not an integer; FedScale maps a client id to the "
                          "profile of that integer key")
    # every profile is checked, used or not: a file accepted for 10 clients is accepted for 10,000
    table = {}  # mapped id: (computation, communication)
    for m, entry in itertools.chain(profiles.items(), [(None, DEFAULT_PROFILE)]):
        if not isinstance(entry, dict):
            raise ConfigError(key, f"{path}: profile {m}: a {type(entry).__name__}, not a dict with fields "
                              "'computation' and 'communication'")
        values = []
        for field in ("computation", "communication"):
            if field not in entry:
                raise ConfigError(key, f"{path}: profile {m}: no field {field!r}; a profile is {{'computation': ms "
                                  "per sample, 'communication': kbit/s}")
            v = _number(entry[field])
            if v is None or not math.isfinite(v) or v <= 0:
                raise ConfigError(key, f"{path}: profile {m}, field {field}: {entry[field]!r}; must be a number > 0")
            values.append(v)
        table[m] = values
    mapped = ((c + 1) % len(profiles) for c in range(num_clients))  # FedScale's ids start at 1
    computation, communication = np.array([table.get(m, table[None]) for m in mapped]).reshape(-1, 2).T
    mbps = communication * 1024 / 1e6
    return {"compute_sps": 1000 / (AUGMENTATION * computation), "up_mbps": mbps, "down_mbps": mbps.copy(),
            "latency_ms": np.zeros(num_clients)}


def read_fedscale_behaviour(key: str, path: str, num_clients: int
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(client, start, end, period)`` from FedScale's behaviour pickle, for :class:`~fedray.system.availability.
    CyclicTrace`: client c gets entry ``keys[(c + 1) % len(trace)]``, its intervals ``[active_j, inactive_j]``
    (sorted by start; touching ones merged; zero-length ones, online for an instant, dropped) repeating with period
    ``finish_time`` (``period`` is per client). Every entry is checked, whether a client gets it or not."""
    return _read(key, path, num_clients, _behaviour)


def _behaviour(key: str, path: str, trace: Any, num_clients: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    if not isinstance(trace, dict) or not trace:
        what = "an empty dict" if isinstance(trace, dict) else f"a {type(trace).__name__}"
        raise ConfigError(key, f"{path} holds {what}, not FedScale's client behaviour trace (a dict {{key: "
                          "{'active': [s], 'inactive': [s], 'finish_time': s, ...}})")
    keys = list(trace)  # every entry is checked, used or not: a file accepted for 10 clients is for 10,000
    client_entry = (np.arange(num_clients, dtype=np.int64) + 1) % len(keys)  # FedScale's ids start at 1
    actives, inactives, period = [], [], np.empty(len(keys))
    for e, name in enumerate(keys):
        item, where = trace[name], f"{path}: entry {name!r}"
        if not isinstance(item, dict):
            raise ConfigError(key, f"{where}: a {type(item).__name__}, not a dict with fields "
                              f"{', '.join(BEHAVIOUR_FIELDS)}")
        for field in BEHAVIOUR_FIELDS:
            if field not in item:
                raise ConfigError(key, f"{where}: no field {field!r}; an entry has fields "
                                  f"{', '.join(BEHAVIOUR_FIELDS)} (and FedScale's duration and model, unused)")
        finish = _number(item["finish_time"])
        if finish is None or not math.isfinite(finish) or finish <= 0:
            raise ConfigError(key, f"{where}, field finish_time: {item['finish_time']!r}; must be a number > 0 (the "
                              "period, s, after which the entry's intervals repeat)")
        period[e] = finish
        for field in ("active", "inactive"):
            if not isinstance(item[field], (list, tuple, np.ndarray)):
                raise ConfigError(key, f"{where}, field {field}: must be a list of numbers (seconds), not "
                                  f"{_shown(item[field])}")
        if len(item["active"]) != len(item["inactive"]):
            raise ConfigError(key, f"{where}, field inactive: {len(item['inactive'])} values for "
                              f"{len(item['active'])} in active; interval j is [active[j], inactive[j]]")
        actives.append(item["active"])
        inactives.append(item["inactive"])
    count = np.array([len(a) for a in actives], dtype=np.int64)
    entry = np.repeat(np.arange(len(keys)), count)  # per interval: its entry's index in keys
    start, end = (_numbers(key, path, keys, lists, field)
                  for lists, field in ((actives, "active"), (inactives, "inactive")))
    nth = np.arange(entry.size) - np.repeat(np.cumsum(count) - count, count)  # an interval's index in its entry
    entry, start, end = _check_intervals(key, path, keys, entry, nth, start, end, period)
    # each client's copy of its entry's intervals (clients share an entry when there are more clients than entries)
    first = np.searchsorted(entry, np.arange(len(keys)))
    per_entry = np.bincount(entry, minlength=len(keys))
    n = per_entry[client_entry]
    if not n.sum():
        raise ConfigError(key, f"{path}: none of the entries data.num_clients={num_clients} clients get has an "
                          "online interval: no client would ever be online")
    client = np.repeat(np.arange(num_clients, dtype=np.int64), n)
    index = np.repeat(first[client_entry], n) + np.arange(client.size) - np.repeat(np.cumsum(n) - n, n)
    return client, start[index], end[index], period[client_entry]


def _check_intervals(key: str, path: str, keys: list, entry: np.ndarray, nth: np.ndarray,
                     start: np.ndarray, end: np.ndarray, period: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The entries' intervals checked, sorted by (entry, start), touching ones merged, zero-length ones dropped."""

    def refuse(i: int, field: str, why: str) -> ConfigError:
        return ConfigError(key, f"{path}: entry {keys[entry[i]]!r}, field {field}: interval {nth[i]} "
                           f"[{start[i]:g}, {end[i]:g}] {why}")

    for field, values in (("active", start), ("inactive", end)):
        if (bad := np.flatnonzero(~np.isfinite(values) | (values < 0))).size:
            raise refuse(bad[0], field, "must lie within [0, finish_time] (finite, >= 0)")
    if (bad := np.flatnonzero(end < start)).size:
        raise refuse(bad[0], "inactive", "ends before it starts")
    if (bad := np.flatnonzero(end > period[entry])).size:
        raise refuse(bad[0], "inactive", f"ends past finish_time={period[entry[bad[0]]]:g}, the period")
    order = np.lexsort((start, entry))
    entry, nth, start, end = entry[order], nth[order], start[order], end[order]
    clash = np.flatnonzero((entry[1:] == entry[:-1]) & (start[1:] < end[:-1]))
    if clash.size:
        i = clash[0]
        raise refuse(i + 1, "active", f"overlaps interval {nth[i]} [{start[i]:g}, {end[i]:g}]")
    # a new interval begins where the entry changes or a gap opens; touching ones run on as one
    begins = np.ones(entry.size, dtype=bool)
    begins[1:] = (entry[1:] != entry[:-1]) | (start[1:] > end[:-1])
    last = np.append(np.flatnonzero(begins)[1:] - 1, entry.size - 1)
    entry, start, end = entry[begins], start[begins], end[last] if entry.size else end
    keep = end > start  # [a, a]: online for an instant, never at a time the clock asks about
    return entry[keep], start[keep], end[keep]


def _numbers(key: str, path: str, keys: list, lists: list, field: str) -> np.ndarray:
    """The entries' ``field`` lists as one float array; the first value that is not a number refused."""
    flat = np.asarray(list(itertools.chain.from_iterable(lists)))  # one conversion, not one per entry: 10^5 entries
    if flat.dtype.kind in "iuf" and flat.ndim == 1:
        return flat.astype(np.float64)
    for e, values in enumerate(lists):
        for v in values:
            if _number(v) is None:
                raise ConfigError(key, f"{path}: entry {keys[e]!r}, field {field}: {_shown(v)} is not a "
                                  "number (seconds)")
    return flat.astype(np.float64)  # bools among numbers: numpy reads them as 0 and 1, as FedScale's comparisons do


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
