"""The classifier contract every fedray model follows: a feature extractor, then one linear head.

DaFKD (Sec. 3.4, Fig. 2) shares "all previous layers before the last fully-connected layer" between the
classifier and the domain discriminator: the classifier is ``head(features(x))`` with
``head = Linear(feature_dim, C)`` and the discriminator is ``sigmoid(Linear(feature_dim, 1)(features(x)))``
on the same extractor. FedKF's data-free generator loss L_A (Eq. 5) also needs the teacher's
pre-classifier features. Both read :meth:`FedModel.features`; nothing else of a model is assumed.

Rules every subclass keeps, because models are copied between processes, averaged and swapped per
client: no dropout or other randomness in ``forward`` (the same weights and input give the same output
in every worker), no in-place activations or residual adds (they break ``torch.func`` transforms and
autograd on shared tensors), no state outside parameters and buffers (so ``state_dict`` round-trips
exactly and the module pickles and deep-copies), and the rows of a batch do not interact in ``forward``
except through BatchNorm (vectorised clients pad short batches; under BatchNorm the padded rows are left out of
the batch statistics, see :func:`batch_rows` and ``fedray.vectorized.engine``).
"""

from __future__ import annotations

import math
import types
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch
from torch import Tensor, nn


def channels_last_if_faster(model: nn.Module) -> nn.Module:
    """``model`` moved to the channels-last memory layout, in place, when it runs faster so on a CPU: when it
    has 2-d convolutions and no GroupNorm (oneDNN's NHWC convolutions and pooling; its NHWC GroupNorm is slow).
    Measured on one thread (benchmarks/README.md): inference 1.1-1.65x faster (FedKF's GroupNorm ResNet-8:
    0.63x), training steps 1.17-1.38x. Values agree with the default layout's to float rounding, not bit for
    bit. Parameters keep the layout through ``load_state_dict`` (it copies into them)."""
    mods = list(model.modules())
    if any(isinstance(m, nn.Conv2d) for m in mods) and not any(isinstance(m, nn.GroupNorm) for m in mods):
        model.to(memory_format=torch.channels_last)
    return model


class FedModel(nn.Module):
    """A classifier split as features -> head, so a second head (DaFKD's discriminator) can share the
    extractor (DaFKD Sec. 3.4 / Fig. 2).

    Subclasses set ``feature_dim`` and ``head = nn.Linear(feature_dim, num_classes)`` and implement
    :meth:`features`. ``input_shape`` is the (C, H, W) the model was built for and ``num_classes`` its
    number of outputs; both are plain attributes, not part of the ``state_dict``.
    """

    feature_dim: int
    head: nn.Linear

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__()
        shape = tuple(int(d) for d in input_shape)
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(f"input_shape must be (channels, height, width) of positive ints, got {input_shape!r}")
        if int(num_classes) < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes!r}")
        self.input_shape: tuple[int, int, int] = shape  # type: ignore[assignment]
        self.num_classes = int(num_classes)

    def features(self, x: Tensor) -> Tensor:
        """(B, feature_dim): everything before the last fully-connected layer."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        """Logits (B, num_classes) = head(features(x))."""
        return self.head(self.features(x))

    def extra_repr(self) -> str:
        return f"input_shape={self.input_shape}, num_classes={self.num_classes}, feature_dim={self.feature_dim}"


def disable_inplace(module: nn.Module) -> nn.Module:
    """Turn off ``inplace`` on every submodule that has the flag (ReLU, Hardswish, Dropout ...); returns ``module``.

    torchvision builds its activations with ``inplace=True`` to save memory; an in-place op on a tensor
    that a ``torch.func`` transform or autograd still needs breaks the rules above, so adapted
    torchvision models pass through here. Residual adds are separate: they live in ``forward`` code and
    are rewritten where the block is defined.
    """
    for m in module.modules():
        if getattr(m, "inplace", False) is True:
            m.inplace = False
    return module


@contextmanager
def frozen_bn_stats(module: nn.Module) -> Iterator[nn.Module]:
    """BatchNorm layers of ``module`` normalise by the batch's own statistics (as in training) but leave
    their running statistics, and their count of batches, as they are.

    For passes of inputs that are not the data the running statistics describe: DaFKD's generated images
    through the classifier's extractor (discriminator, generator and gradient-penalty steps). Evaluation,
    the clients' outputs and the server's distillation then use statistics of real data only.
    """
    layers = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [m.track_running_stats for m in layers]
    for m in layers:
        m.track_running_stats = False  # in training mode: batch statistics, no running update
    try:
        yield module
    finally:
        for m, keep in zip(layers, saved):
            m.track_running_stats = keep


# The real rows of the batch the module calls inside a batch_rows block see (None: all of them)
_ROWS: ContextVar[Tensor | None] = ContextVar("fedray_batch_rows", default=None)


@contextmanager
def batch_rows(valid: Tensor | None) -> Iterator[None]:
    """Inside the block, a batch of ``len(valid)`` rows holds real rows where ``valid`` (bool, (N,)) is True and
    padding elsewhere: BatchNorm layers made row-aware by :func:`row_masked_batchnorm` normalise it by the real
    rows' statistics and update their running statistics from those alone, so the real rows come out as they would
    without the padding (up to float rounding). None, or a layer that is not row-aware: a no-op. Under ``vmap``
    ``valid`` is one client's row mask, as the batch is one client's batch."""
    token = _ROWS.set(valid)
    try:
        yield
    finally:
        _ROWS.reset(token)


@contextmanager
def row_masked_batchnorm(module: nn.Module) -> Iterator[nn.Module]:
    """The BatchNorm layers of ``module`` honour :func:`batch_rows` while the block runs (their class's
    ``forward`` otherwise, and again after it). The vectorised runtime's padded steps of BatchNorm models run so."""
    layers = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in layers:
        m.forward = types.MethodType(_row_masked_forward, m)  # an instance attribute: the class's is untouched
    try:
        yield module
    finally:
        for m in layers:
            del m.forward


def _row_masked_forward(self: nn.modules.batchnorm._BatchNorm, x: Tensor) -> Tensor:
    """``_BatchNorm.forward`` in training, with the batch statistics (and the running statistics' update, its
    variance unbiased by the real values' count) over the rows :func:`batch_rows` marks real."""
    valid = _ROWS.get()
    if valid is None or not self.training or x.shape[0] != valid.shape[0]:
        return type(self).forward(self, x)
    self._check_input_dim(x)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    weights = valid.to(x.dtype).reshape((-1,) + (1,) * (x.dim() - 1))
    dims = [0, *range(2, x.dim())]
    count = weights.sum() * math.prod(x.shape[2:])  # values per channel
    mean = (x * weights).sum(dims) / count
    centred = x - mean.reshape(shape)
    var = (centred.square() * weights).sum(dims) / count
    out = centred * torch.rsqrt(var + self.eps).reshape(shape)
    if self.affine:
        out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
    if self.track_running_stats and self.running_mean is not None:  # not under frozen_bn_stats
        with torch.no_grad():
            factor: float | Tensor = self.momentum if self.momentum is not None else 0.0
            if self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
                if self.momentum is None:  # a cumulative moving average, as the class's forward keeps it
                    factor = 1.0 / self.num_batches_tracked
            self.running_mean.mul_(1 - factor).add_(mean.detach() * factor)
            self.running_var.mul_(1 - factor).add_(var.detach() * (count / (count - 1)) * factor)
    return out
