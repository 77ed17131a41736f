"""FedAvg (McMahan et al., 2017): local SGD on private data, sample-weighted parameter averaging.

Server update (the Eq. 6 of DaFKD, Alg. 1 line 9 of FedKF): w_{t+1} = sum_k |D_k| / sum_j |D_j| * w_k over
the clients that took part in round t. Stateless on the client side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fedray.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientResult,
    ServerContext,
    Weights,
    clone_weights,
    weighted_average,
)
from fedray.models import build_model


@dataclass
class ModelState:
    """Server state: the global model's weights."""

    weights: Weights


@dataclass
class ModelPayload:
    weights: Weights


@dataclass
class ModelUpload:
    weights: Weights
    num_samples: int


@dataclass
class Modules:
    model: torch.nn.Module


class FedAvg(Algorithm):
    name = "fedavg"

    def build_modules(self) -> Modules:
        return Modules(model=build_model(self.cfg.model.name, self.spec.input_shape, self.spec.num_classes))

    def init_server_state(self, modules: Modules) -> ModelState:
        return ModelState(weights=clone_weights(modules.model))

    def broadcast(self, state: ModelState, round_: int) -> ModelPayload:
        return ModelPayload(weights=state.weights)

    def global_weights(self, state: ModelState) -> Weights:
        return state.weights

    # --- client -------------------------------------------------------------------------------------
    def make_optimizer(self, params, fed) -> torch.optim.Optimizer:
        if fed.optimizer == "adam":
            return torch.optim.Adam(params, lr=fed.lr, weight_decay=fed.weight_decay)
        return torch.optim.SGD(params, lr=fed.lr, momentum=fed.momentum, weight_decay=fed.weight_decay)

    def local_loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, anchor: Any) -> torch.Tensor:
        """The client's training objective; subclasses add terms (FedProx's proximal term)."""
        return F.cross_entropy(model(x), y)

    def make_anchor(self, model: torch.nn.Module) -> Any:
        """What the local loss may compare against (the received global model); None for FedAvg."""
        return None

    def client_update(self, ctx: ClientContext, payload: ModelPayload, state: Any) -> ClientResult:
        model = ctx.modules.model
        model.load_state_dict(payload.weights)
        model.train()
        anchor = self.make_anchor(model)
        opt = self.make_optimizer(model.parameters(), ctx.fed)
        total, steps = torch.zeros((), device=ctx.device), 0
        for x, y in ctx.batches():
            opt.zero_grad(set_to_none=True)
            loss = self.local_loss(model, x, y, anchor)
            loss.backward()
            opt.step()
            total += loss.detach()
            steps += 1
        upload = ModelUpload(weights=clone_weights(model), num_samples=ctx.num_samples)
        return ClientResult(upload=upload, state=None, metrics={"train/loss": float(total) / max(steps, 1)})

    # --- server -------------------------------------------------------------------------------------
    def server_update(
        self, state: ModelState, uploads: list[ModelUpload], ctx: ServerContext
    ) -> tuple[ModelState, dict[str, float]]:
        weights = weighted_average([u.weights for u in uploads], [u.num_samples for u in uploads])
        return ModelState(weights=weights), {}
