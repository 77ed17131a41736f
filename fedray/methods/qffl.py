"""q-FFL, solved with q-FedAvg (Li, Sanjabi, Beirami and Smith, "Fair Resource Allocation in Federated
Learning", ICLR 2020; FedKF ref. [15] and one of its baselines: "we use FedAvg as its optimization method").

q-FFL minimises sum_k p_k / (q + 1) * F_k(w)^(q + 1): larger q weighs clients with a larger loss more
(fairer accuracy across clients); q = 0 is FedAvg's objective. q-FedAvg (their Algorithm 3), with
L = 1 / lr the Lipschitz estimate of their code:

    client k:  F_k  = loss of the received w on its training data, before local training
               w_k  = w after local SGD (FedAvg's local training)
               Delta_k = F_k^q * (w - w_k) / lr
               h_k     = q * F_k^(q-1) * ||(w - w_k) / lr||^2 + F_k^q / lr
    server:    w <- w - sum_k Delta_k / sum_k h_k

Clients upload (Delta_k, h_k), as in the paper's algorithm; the server never sees F_k or w_k. As in the
reference code, F_k is offset by 1e-10 before the powers. With q = 0 the step is the unweighted mean of the
clients' models (not sample-weighted: q-FedAvg samples clients by |D_k| instead, which fedray's uniform
sampler does not). The default q = 1e-4 is what FedKF found best on every dataset (Sec. VI-A).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from fedray.methods.api import (ClientContext, ClientResult, ClientState, LocalTraining, ServerContext, Trained,
                                Upload, Weights, clone_weights, to_float, values_field, weights_only)
from fedray.methods.fedavg import FedAvg, ModelPayload, ModelState

EPS = 1e-10  # the reference code's offset of F_k


class QFFLParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    q: float = Field(default=1e-4, ge=0, description="fairness exponent; 0 = FedAvg's objective")


@dataclass
class QFFLUpload(Upload):
    delta: Weights = values_field()  # Delta_k, a step already (floating-point entries of the model only)
    h: float = values_field()  # h_k


def qffl_terms(w: Weights, w_k: Weights, loss: float, q: float, lr: float) -> tuple[Weights, float]:
    """(Delta_k, h_k) of q-FedAvg from the received weights, the locally trained ones and F_k(w)."""
    f = float(loss) + EPS
    fq = f ** q
    delta: Weights = {}
    norm2 = 0.0
    for key, ref in w.items():
        if not torch.is_floating_point(ref):
            continue
        g = (ref.to(torch.float64) - w_k[key].to(torch.float64)) / lr
        norm2 += float((g * g).sum())
        delta[key] = (fq * g).to(ref.dtype)
    h = q * f ** (q - 1) * norm2 + fq / lr
    return delta, h


def qffl_step(w: Weights, uploads: list[QFFLUpload]) -> Weights:
    """w - sum_k Delta_k / sum_k h_k, accumulated in client-id order in float64; integer buffers kept.

    A ratio of two sums, not a mean of the uploads: it does not go through the aggregation hook (as
    mean(Delta) / mean(h) it would round each mean to the weights' dtype before the division)."""
    hsum = sum(u.h for u in uploads)
    out: Weights = {}
    for key, ref in w.items():
        if not torch.is_floating_point(ref):
            out[key] = ref.clone()
            continue
        acc = torch.zeros_like(ref, dtype=torch.float64)
        for u in uploads:
            acc += u.delta[key].to(torch.float64)
        out[key] = (ref.to(torch.float64) - acc / hsum).to(ref.dtype)
    return out


class QFFL(FedAvg):
    name = "qffl"
    Params = QFFLParams
    mean_only_because = "its server step is a ratio of sums of the clients' Delta and h (Alg. 2), not a mean"
    asynchronous = True  # its own rebase: Delta_k is a step, applied to the current model

    def rebase(self, upload: QFFLUpload, sent: ModelPayload, current: ModelState, weight: float) -> QFFLUpload:
        """Async: Delta_k was taken from the model the client received; the server step applies it, weighted, to the
        current one (h_k as it was): w_now - sum_k s(tau_k) Delta_k / sum_k h_k."""
        return dataclasses.replace(upload, delta={k: v * weight for k, v in upload.delta.items()})

    @torch.no_grad()
    def local_objective(self, ctx: ClientContext, model: torch.nn.Module) -> float:
        """F_k(w): mean cross-entropy of ``model`` over the client's whole training split."""
        model.eval()
        total, bs = 0.0, ctx.fed.eval_batch_size
        for s in range(0, ctx.num_samples, bs):
            logits = model(to_float(ctx.x[s : s + bs], ctx.spec.mean, ctx.spec.std))
            total += float(F.cross_entropy(logits, ctx.y[s : s + bs], reduction="sum"))
        return total / max(ctx.num_samples, 1)

    def client_update(self, ctx: ClientContext, payload: ModelPayload, state: ClientState | None) -> LocalTraining:
        model = ctx.modules.model
        model.load_state_dict(payload.weights)
        loss = self.local_objective(ctx, model)  # F_k(w), before training
        plan = super().client_update(ctx, payload, state)  # FedAvg's local SGD from the same w

        @weights_only
        def finish(model: torch.nn.Module, trained: Trained) -> ClientResult:
            delta, h = qffl_terms(payload.weights, clone_weights(model), loss, self.params.q, ctx.fed.lr)
            return ClientResult(QFFLUpload(delta=delta, h=h), None, {**trained.means(), "train/loss_before": loss})

        return dataclasses.replace(plan, finish=finish)

    def server_update(self, state: ModelState, uploads: list[QFFLUpload], ctx: ServerContext):
        weights = qffl_step(state.weights, uploads)
        return dataclasses.replace(state, weights=weights), {"server/h_sum": float(sum(u.h for u in uploads))}
