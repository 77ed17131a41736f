"""When a worker trains its clients batched (:mod:`fedray.vectorized.engine` says how): ``runtime.vectorize``,
the worker's device and the method, and how the runtimes describe it."""

from __future__ import annotations

from typing import Any

import torch

def vectorize_enabled(setting: Any, device: torch.device) -> bool:
    """Whether a worker on ``device`` trains its clients batched. ``runtime.vectorize``: true/false as said; ``auto``
    vectorises on CUDA devices only (on a CPU batching clients measured slower than one at a time, see
    benchmarks/speed/overhead.py). A client whose ``client_update`` returns a finished result, not a training plan,
    runs by itself either way."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def vectorize_min_clients(runtime_cfg: Any) -> int:
    """The fewest clients a worker batches in a round: ``runtime.vectorize_min_clients`` under ``auto`` (fewer
    measured slower batched than one by one, see benchmarks/README.md), 1 when ``vectorize`` is forced."""
    return runtime_cfg.vectorize_min_clients if runtime_cfg.vectorize == "auto" else 1


def describe_vectorised(enabled: bool, min_clients: int) -> str:
    """The runtimes' description of it: empty when off."""
    if not enabled:
        return ""
    return ", vectorised clients" + (f" (from {min_clients} per worker)" if min_clients > 1 else "")
