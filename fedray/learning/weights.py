"""What travels between client and server, as plain tensors: a model's weights (a detached CPU state
dict), their weighted average (FedAvg's server step in Algorithm 1 of McMahan et al. 2017, and every
method that averages), and the byte count of a payload or upload that the communication metrics report."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import numpy as np
import torch

Weights = dict[str, torch.Tensor]


def clone_weights(module: torch.nn.Module) -> Weights:
    """A detached CPU copy of a module's state dict (what travels between processes)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def weighted_average(weights: list[Weights], coefs: list[float]) -> Weights:
    """sum_k coef_k * w_k, accumulated in the given (client-id) order so every runtime gets the same bits.

    Integer buffers (BatchNorm's ``num_batches_tracked``) are not averaged: the first client's is kept.

    Each term is widened and scaled in one float64 buffer reused across the clients: the same operations, so
    the same bits, as ``acc += w.to(float64) * c``, without its two fresh temporaries per client and key
    (``benchmarks/speed/averaging.py``, one CPU thread, malloc tuned as in a run: 1.2-1.35x faster; more with glibc's
    default thresholds, which adapt to what the process freed before).
    """
    total = float(sum(coefs))
    out: Weights = {}
    for key, ref in weights[0].items():
        if not torch.is_floating_point(ref):
            out[key] = ref.clone()
            continue
        acc = torch.zeros_like(ref, dtype=torch.float64)
        term = torch.empty_like(acc)
        for w, c in zip(weights, coefs):
            acc += term.copy_(w[key]).mul_(c / total)
        out[key] = acc.to(ref.dtype)
    return out


def leaves(obj: Any) -> Iterator[Any]:
    """Tensors, arrays and scalars inside a payload/upload (dataclasses, dicts, lists), depth first."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from leaves(getattr(obj, f.name))
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from leaves(v)
    else:
        yield obj


def _leaf_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, np.ndarray):
        return int(x.nbytes)
    return 8 if isinstance(x, (int, float, bool, np.number)) else 0


def nbytes(obj: Any) -> int:
    """Bytes of the tensors and arrays in a payload/upload (dataclasses, dicts, lists); scalars count 8."""
    return sum(_leaf_bytes(x) for x in leaves(obj))
