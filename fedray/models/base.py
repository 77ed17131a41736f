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
except through BatchNorm (vectorised clients pad short batches of models without BatchNorm, see
``fedray.runtime.vectorized``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import Tensor, nn


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
