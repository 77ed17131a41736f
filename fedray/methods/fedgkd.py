"""FedGKD (Yao et al., "Local-Global Knowledge Distillation in Heterogeneous Federated Learning with Non-IID
Data", arXiv 2107.00051; FedKF ref. [14] and one of its baselines, FedKF Sec. VI-A).

The server keeps a buffer of the last M global models (M = ``buffer_size``, 5 by default, as FedKF
Sec. VI-A follows [14]) and sends their mean as the teacher together with the current global model. Each
client trains on

    L = CE(h(w; x), y) + gamma / 2 * KL(h(w_teacher; x) || h(w; x))

on its own batches (temperature 1, batch-mean KL; the teacher is frozen). The server step is FedAvg's
sample-weighted average (``report_model=oca`` adds FedKF's cached-model aggregation, as for FedAvg).

The buffer starts with w0, so round 1 distils from w0 and the teacher averages however many models exist
until M do. ``full_buffer_only=true`` is the FedKF authors' FedGKD instead: w0 is not buffered and clients
train with plain CE until M aggregated models exist. The teacher is one extra model sent down per client
(counted in ``comm/bytes_down``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from pydantic import Field

from fedray.methods.api import (CacheParams, IGNORE_LABEL, Payload, ServerContext, Weights, build_model, kd_kl,
                                model_field, weighted_average)
from fedray.methods.fedavg import FedAvg, ModelState, ModelUpload


class FedGKDParams(CacheParams):
    gamma: float = Field(default=0.2, ge=0, description="KD weight; the local loss adds gamma/2 * KL")
    buffer_size: int = Field(default=5, ge=1, description="M: global models averaged into the teacher")
    full_buffer_only: bool = Field(default=False, description="authors' code: no distillation until M aggregated "
                                   "models (w0 excluded) are buffered")


@dataclass
class GKDState(ModelState):
    """FedAvg's state plus the buffer of the last M global models, oldest first."""

    buffer: list[Weights] = field(default_factory=list)


@dataclass
class GKDPayload(Payload):
    weights: Weights = model_field(against=None)  # the global model, the student's start
    teacher: Weights | None = model_field(against=None)  # mean of the buffered models; None = no distillation


@dataclass
class GKDModules:
    model: torch.nn.Module
    teacher: torch.nn.Module


class FedGKD(FedAvg):
    name = "fedgkd"
    Params = FedGKDParams
    # FedAvg's rebase: its uploads are weights trained from the payload's; asynchronously, the buffer holds the models
    # of the last M server steps
    asynchronous = True
    keeps_cache = True
    robust_means = ("weights",)  # FedAvg's server step; the buffer keeps its results

    def build_modules(self) -> GKDModules:
        shape, classes = self.spec.input_shape, self.spec.num_classes
        model = build_model(self.cfg.model.name, shape, classes)  # first: w0 equals FedAvg's under one seed
        teacher = build_model(self.cfg.model.name, shape, classes)
        teacher.requires_grad_(False)
        return GKDModules(model=model, teacher=teacher)

    def init_server_state(self, modules: GKDModules) -> GKDState:
        base = super().init_server_state(modules)
        buffer = [] if self.params.full_buffer_only else [base.weights]
        return GKDState(weights=base.weights, cache=base.cache, buffer=buffer)

    def teacher_weights(self, state: GKDState) -> Weights | None:
        """The teacher: the uniform mean of the buffered global models (None while there is none to use)."""
        buf = state.buffer[-self.params.buffer_size:]
        if not buf or (self.params.full_buffer_only and len(buf) < self.params.buffer_size):
            return None
        return weighted_average(buf, [1.0] * len(buf))

    def broadcast(self, state: GKDState, round_: int) -> GKDPayload:
        return GKDPayload(weights=state.weights, teacher=self.teacher_weights(state))

    # --- client -----------------------------------------------------------------------------------
    def make_anchor(self, model, modules=None, payload: GKDPayload | None = None):
        if payload is None or payload.teacher is None:
            return None
        teacher = modules.teacher
        teacher.load_state_dict(payload.teacher)
        teacher.eval()
        return teacher

    # Paddable: both terms average over the rows not labelled IGNORE_LABEL (a padded batch's real rows); the
    # teacher runs in eval mode, so its BatchNorm does not read the padded rows either.
    local_loss_paddable = True

    def local_loss(self, model, x, y, anchor) -> torch.Tensor:
        logits = model(x)
        ce = F.cross_entropy(logits, y)
        if anchor is None:
            return ce
        with torch.no_grad():
            t = anchor(x)
        # KL(teacher || student), T = 1, the mean over the batch's real rows
        return ce + 0.5 * self.params.gamma * kd_kl(logits, t, rows=y != IGNORE_LABEL)

    # --- server -----------------------------------------------------------------------------------
    def server_update(self, state: GKDState, uploads: list[ModelUpload], ctx: ServerContext):
        new, metrics = super().server_update(state, uploads, ctx)
        # Keep only the last M: the buffer's memory is bounded by M models.
        buffer = (list(state.buffer) + [new.weights])[-self.params.buffer_size:]
        return dataclasses.replace(new, buffer=buffer), metrics
