"""The arithmetic precision of the clients' local training (``runtime.precision``).

``float32`` (the default) leaves torch as it is. ``bf16`` is mixed precision: every convolution (transposed
ones too) and linear layer of local training multiplies bfloat16 copies of its input and weights and hands
on its result in float32. Everything else stays float32: the weights, their gradients, the optimizer state
and the update, BatchNorm, activations between layers and the losses. Why it was built: where the
vectorised step is bound by the GPU's arithmetic (ResNet-11, 8-32 clients), bfloat16 convolutions made the
step 1.6-1.8x faster on an H100 (``benchmarks/speed/step_ceiling.py``, whole-step bf16). What it gave in rounds
(DaFKD, ResNet-11, 28x28, H200, ``benchmarks/speed/gpu_precision.sh``): graphed rounds within -8..+8 % of float32's
(8-64 clients), sequential ones 1.46-1.57x slower; the casts around each product cost about what bfloat16
saves at this size. The figures change beyond float32 rounding, so it is opt-in; bfloat16 needs no loss
scaling (float32's exponent range). Evaluation and the server's work stay float32.

Why not ``torch.autocast``: under ``torch.func.vmap``, how the vectorised runtime trains, autocast leaves
convolutions in float32 (torch 2.14, CPU: the batching rule runs below autocast), and on CUDA its bf16
activations reached BatchNorm against float32 running statistics and were refused (``step_ceiling.py``'s
first bf16 variant, H100, 2026-11-28). A torch-function mode casts at the Python call, before any transform,
so a client trains alike one at a time, vectorised and replayed from a CUDA graph. Its cost: every torch call
of an eager step passes through the mode (~1.5 us a call on the project's 2-core CPU machine), host time that
a host-bound eager GPU step pays and a replayed step does not.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from contextvars import ContextVar
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fedray.errors import ResourceError

log = logging.getLogger("fedray")

# The layers whose products run in bfloat16 (an nn.Conv*/nn.Linear calls one of these)
_LOW = frozenset({F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
                  F.linear})


def _low(value):
    return value.to(torch.bfloat16) if isinstance(value, torch.Tensor) and value.dtype == torch.float32 else value


class _BFloat16Products(TorchFunctionMode):
    """Convolutions and linear layers on bfloat16 copies of their float32 tensors, their result in float32
    (the casts' backward brings the gradients back to float32)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _LOW:
            return func(*args, **kwargs)
        out = func(*map(_low, args), **{k: _low(v) for k, v in kwargs.items()})
        return out.float()


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse bf16 on a GPU without bfloat16 arithmetic (before Ampere, compute capability 8.0), where cuDNN has no
    bf16 convolutions to run; say that on a CPU bf16 is emulated and slower than float32 (2.3x a ResNet-8-BN
    round on the project's CPU machine)."""
    if precision == "float32":
        return
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ResourceError("runtime.precision", "bf16 needs a GPU with bfloat16 arithmetic (compute capability 8.0 "
                            "or newer: A100, H100 and later), which this one lacks; use runtime.precision=float32")
    if device.type == "cpu":
        log.warning("runtime.precision=bf16 on a CPU: bfloat16 products are slower than float32 there; it is "
                    "meant for GPU-bound steps")


# Set while a block of local_precision casts: a nested block (train_many training a client by train) adds nothing
_ACTIVE: ContextVar[bool] = ContextVar("fedray_local_precision", default=False)


@contextlib.contextmanager
def local_precision(precision: str) -> Iterator[None]:
    """Local training inside the block runs at ``precision`` (``runtime.precision``)."""
    if precision == "float32" or _ACTIVE.get():
        yield
        return
    token = _ACTIVE.set(True)
    try:
        with _BFloat16Products():
            yield
    finally:
        _ACTIVE.reset(token)


def at_local_precision(method: Callable) -> Callable:
    """A method of an object holding ``cfg`` (an experiment config), run at ``cfg.runtime.precision``."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with local_precision(self.cfg.runtime.precision):
            return method(self, *args, **kwargs)
    return run
