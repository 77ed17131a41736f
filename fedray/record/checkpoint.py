"""Checkpoints: server state, every client's private state, the round, RNG state and the history so far.

Written atomically (a temporary file, then ``os.replace``), so a crash mid-write leaves the previous
checkpoint intact. Read with ``torch.load(weights_only=True)``: no arbitrary object is unpickled. Typed
state (dataclasses) is encoded as plain dicts naming its class; on load only dataclasses defined in
fedray's own modules or in the module of a registered algorithm are rebuilt.

Every random draw in fedray is derived from (seed, purpose, round, client) (``fedray.seeding``), so the
sampler needs no state beyond the round; the driver's torch / numpy global RNG states are saved anyway,
for methods that draw from them.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedray import __version__
from fedray.errors import UserError
from fedray.learning.store import ClientStore

FORMAT = "fedray-checkpoint"
VERSION = 1
FILENAME = "checkpoint.pt"
_DC = "__dataclass__"
_STORE = "__client_store__"


class CheckpointError(UserError):
    """A checkpoint that is missing, corrupt, foreign or from an incompatible run."""


def encode(obj: Any) -> Any:
    """Typed state -> nested dicts/lists of tensors and primitives (what weights_only loading allows)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        return {_DC: f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    if isinstance(obj, ClientStore):  # every state, on disk or not, and the bound to rebuild it with
        return {_STORE: {"bound": obj.bound, "folder": obj.kept_folder(), "states": encode(obj.as_dict())}}
    if isinstance(obj, dict):
        if any(not isinstance(k, (str, int)) for k in obj):
            raise TypeError(f"checkpointed dicts need str or int keys, got {[type(k) for k in obj]}")
        return {k: encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.array(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (torch.Tensor, bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint a {type(obj).__qualname__}: state must be dataclasses of tensors, "
                    "dicts, lists and numbers")


def _allowed_modules() -> set[str]:
    from fedray.methods import ALGORITHMS

    return {cls.__module__ for cls in ALGORITHMS.values()}


# Checkpoints written before the package took its present layout name the state classes of every method and helper
# under fedray.algorithms; where each class lives now, so such a run still resumes.
_FORMER_HOMES = {"fedray.algorithms.dafkd": "fedray.methods.dafkd.types",
                 "fedray.algorithms.base": "fedray.learning.boundary"}
_FORMER_HELPERS = ("cached", "distill", "ensemble", "optim", "proxy_distill", "subspace", "training", "weights")


def current_module(module: str) -> str:
    """Where a module named in a checkpoint lives now (itself, unless it was moved)."""
    if module in _FORMER_HOMES:
        return _FORMER_HOMES[module]
    if module.startswith("fedray.algorithms."):
        name = module.rpartition(".")[2]
        return f"fedray.{'learning' if name in _FORMER_HELPERS else 'methods'}.{name}"
    return module


def decode(obj: Any) -> Any:
    if isinstance(obj, dict) and _DC in obj:
        module, _, qualname = obj[_DC].partition(":")
        module = current_module(module)
        if not (module == "fedray" or module.startswith("fedray.") or module in _allowed_modules()):
            raise CheckpointError("--resume", f"the checkpoint names a class from module '{module}', which is "
                                  "neither fedray's nor a registered algorithm's; refusing to load it")
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if not dataclasses.is_dataclass(cls):
            raise CheckpointError("--resume", f"{obj[_DC]} in the checkpoint is not a state dataclass")
        return cls(**{k: decode(v) for k, v in obj["fields"].items()})
    if isinstance(obj, dict) and _STORE in obj:
        kept = obj[_STORE]
        return ClientStore.holding(kept["bound"], kept["folder"], decode(kept["states"]))
    if isinstance(obj, dict):
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    return obj


def save_checkpoint(folder: Path, payload: dict[str, Any]) -> Path:
    """Write ``folder/checkpoint.pt`` atomically; the previous checkpoint stays valid until the rename."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / FILENAME
    tmp = folder / f".{FILENAME}.tmp"
    body = {"format": FORMAT, "version": VERSION, "fedray_version": __version__, **encode(payload)}
    with open(tmp, "wb") as f:
        torch.save(body, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(folder: str | Path) -> dict[str, Any]:
    """Read and check ``folder/checkpoint.pt``; one clear error for anything missing, corrupt or foreign."""
    path = Path(folder) / FILENAME
    if not path.is_file():
        raise CheckpointError("--resume", f"no checkpoint at {path}; resume a run directory written with "
                              "runtime.checkpoint_every > 0")
    try:
        body = torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, garbage, or objects weights_only refuses
        raise CheckpointError("--resume", f"{path} is corrupt or not a fedray checkpoint "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointError("--resume", f"{path} is not a fedray checkpoint")
    if body.get("version") != VERSION:
        raise CheckpointError("--resume", f"{path} has checkpoint format {body.get('version')}; this fedray "
                              f"reads format {VERSION}")
    return decode({k: v for k, v in body.items() if k not in ("format", "version")})


def rng_state() -> dict[str, Any]:
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
            "numpy_pos": int(pos), "numpy_has_gauss": int(has_gauss), "numpy_cached": float(cached)}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"],
                         state["numpy_has_gauss"], state["numpy_cached"]))
