"""A two-hidden-layer perceptron: the "2NN" of McMahan et al. (FedAvg, AISTATS 2017).

Layout:

    flatten (C*H*W)  ->  FC 200 ReLU  ->  FC 200 ReLU   (= features, 200-d)   ->  head FC(200 -> num_classes)

McMahan et al. use it on MNIST ("a simple multilayer-perceptron with 2-hidden layers with 200 units each
using ReLu activations (199,210 total parameters)"); with 1x28x28 inputs and 10 classes this module has
exactly that count. The input layer follows the image's C*H*W, so any shape works. Weights keep
PyTorch's default initialisation. As the cheapest model in the zoo it is the natural "weak client" in
heterogeneous-model federations.
"""

from __future__ import annotations

from torch import Tensor, nn

from fedray.models.base import FedModel


class MLP(FedModel):
    """Flatten -> ``hidden`` x (Linear, ReLU) as ``features``; ``head`` = Linear(hidden[-1], C)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, *, hidden: tuple[int, ...] = (200, 200)):
        super().__init__(input_shape, num_classes)
        if not hidden or min(hidden) < 1:
            raise ValueError(f"hidden must be a non-empty tuple of positive widths, got {hidden!r}")
        channels, height, width = self.input_shape
        layers: list[nn.Module] = [nn.Flatten()]
        fan_in = channels * height * width
        for units in hidden:
            layers += [nn.Linear(fan_in, int(units)), nn.ReLU()]
            fan_in = int(units)
        self.feature_dim = fan_in
        self.extractor = nn.Sequential(*layers)
        self.head = nn.Linear(self.feature_dim, self.num_classes)

    def features(self, x: Tensor) -> Tensor:
        return self.extractor(x)
