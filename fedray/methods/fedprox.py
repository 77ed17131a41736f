"""FedProx (Li et al., 2020): FedAvg whose local objective adds the proximal term mu/2 ||w - w_t||^2.

w_t is the global model received this round; the server step is FedAvg's sample-weighted average
(with ``algorithm.report_model=oca``, FedKF's cached-model aggregation as for FedAvg).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedray.methods.api import CacheParams
from fedray.methods.fedavg import FedAvg, proximal_term, received_weights


class FedProxParams(CacheParams):
    mu: float = Field(default=0.01, ge=0, description="weight of the proximal term")


class FedProx(FedAvg):
    name = "fedprox"
    Params = FedProxParams
    asynchronous = True  # FedAvg's rebase: its uploads are weights, its proximal anchor the payload it was sent
    keeps_cache = True
    robust_means = ("weights",)  # FedAvg's server step

    def make_anchor(self, model: torch.nn.Module, modules=None, payload=None) -> list[torch.Tensor]:
        return received_weights(model)

    local_loss_paddable = True  # the proximal term reads the weights, not the batch

    def local_loss(self, model, x, y, anchor: list[torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(x), y) + 0.5 * self.params.mu * proximal_term(model, anchor)
