"""FedCD: personalised federated learning via collaborative distillation (Ahmad and Aral).

Every client owns its model, of any architecture (``model.client_models``; FedCD_basic is the same method
with one architecture); no weights ever leave a client. A labelled validation set is held out of the
training set (Sec. V-A: 50 images per class of CIFAR-100; ``data.server_data.kind=holdout``); it is shared:
clients hold its images (never its labels) and compute logits on it, the server holds its labels. Round t
(Algorithm 1):

- The server sends the teacher logits z_t on this round's teacher batch (the shared batch of round t-1;
  none in round 1) and the indices of the next shared batch: ``algorithm.shared_batch`` validation images
  drawn from (run seed, round), 64 in the paper ("64x100 logits" per round, Sec. V-C).
- Each client trains its own model for the local budget on CE + lambda * KD (Eq. 2): cross-entropy on a
  private batch plus ``lambda_kd`` times the temperature KD of Eq. 1, T^2 KL(softmax(z_t / T) ||
  softmax(z_j / T)), where z_j are its own logits on the teacher batch. Algorithm 1 line 7 writes
  KL(z_j, z_t) next to logits of the private batch B; z_t are logits of shared samples, so z_j is taken
  on those shared samples: the only reading in which both sides refer to the same images.
- It then uploads its logits z_j on the next shared batch (after training, in eval mode).
- The server finds the ensemble weights of Eq. 4, gamma = argmin CE(sum_j gamma_j z_j, y) over the
  simplex (gamma >= 0, sum gamma = 1), with the batch's labels, and keeps z_t = sum_j gamma_j z_j for the
  next round. Eq. 4 is convex in gamma; it is solved with SLSQP (scipy) to ``gamma_tol`` and its
  Frank-Wolfe gap is logged (``server/gamma_gap``: an upper bound on the remaining suboptimality).
  Whether the teacher beats the uniform average is scored twice: on the batch gamma was fit on
  (``server/teacher_ce``, favourable to gamma) and on images it was not fit on (``server/*_heldout``: last
  round's gamma on this round's batch, less the images both batches share).

Communication is what is sent: logits, the batch indices and the sender's id; never weights. Handing the
validation images to every client once is counted in ``comm/bytes_setup``. ``ensemble=uniform`` replaces
Eq. 4 by the plain average of logits (the averaging teacher the paper improves on, FedMD-style); that average,
and only it, takes a robust ``aggregation.rule`` (median, trimmed mean, Krum, Multi-Krum over the clients' logit
tables).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from fedray.methods.api import (ClientContext, ClientResult, ConfigError, ExperimentConfig, LocalTraining, Payload,
                                PersonalModel, PersonalisedAlgorithm, ServerContext, ServerState, Upload, counts_field,
                                derive_rng, input_spec, kd_kl, normalised_entropy, to_float, values_field, VALUE_RULES,
                                WeightedMean)


class FedCDParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lambda_kd: float = Field(default=1.0, ge=0, description="weight of the KD term of Eq. 2")
    temperature: float = Field(default=1.0, gt=0, description="T of Eq. 1")
    shared_batch: int = Field(default=64, ge=1, description="validation images per round (paper: 64)")
    ensemble: Literal["optimal", "uniform"] = Field(default="optimal", description="Eq. 4 weights, or the plain "
                                                    "average of logits")
    gamma_tol: float = Field(default=1e-9, gt=0, description="SLSQP's tolerance on the Eq. 4 objective")
    gamma_max_iter: int = Field(default=500, ge=1)


@dataclass
class FedCDServerState(ServerState):
    teacher: torch.Tensor | None = None  # z_t (B, C) on the teacher batch; None before the first uploads
    teacher_idx: torch.Tensor | None = None  # (B,) indices of the teacher batch in the validation set
    gamma: torch.Tensor | None = None  # Eq. 4's weights fit on the teacher batch (n,), float64
    gamma_clients: torch.Tensor | None = None  # (n,) the client each weight belongs to


@dataclass
class FedCDPayload(Payload):
    teacher_idx: torch.Tensor | None = counts_field()  # which validation images z_t refers to (int64 indices)
    teacher: torch.Tensor | None = values_field()  # z_t (B, C)
    upload_idx: torch.Tensor = counts_field()  # the validation images to upload logits on after training


@dataclass
class FedCDUpload(Upload):
    client_id: int
    logits: torch.Tensor = values_field()  # z_j (B, C) on the payload's upload_idx


def simplex_weights(z: torch.Tensor, y: torch.Tensor, tol: float = 1e-9,
                    max_iter: int = 500) -> tuple[torch.Tensor, dict[str, float]]:
    """Eq. 4: gamma = argmin_gamma CE(sum_j gamma_j z_j, y) s.t. gamma >= 0, sum_j gamma_j = 1.

    ``z`` is (n, B, C) logits of n models on B labelled samples ``y``. The objective is convex in gamma
    (log-sum-exp of a linear map minus a linear term), so SLSQP from the uniform start converges to the
    global optimum; returns gamma (n,) and the solver's figures: the Frank-Wolfe gap
    g.gamma - min_j g_j (>= 0; an upper bound on f(gamma) - f*), iterations and the final objective.
    """
    zz = z.detach().to(torch.float64).cpu().numpy()
    onehot = np.eye(zz.shape[2])[y.cpu().numpy()]
    n = zz.shape[0]

    def objective(g: np.ndarray) -> tuple[float, np.ndarray]:
        s = np.einsum("n,nbc->bc", g, zz)
        s = s - s.max(axis=1, keepdims=True)
        logp = s - np.log(np.exp(s).sum(axis=1, keepdims=True))
        p = np.exp(logp)
        loss = -float((onehot * logp).sum(axis=1).mean())
        grad = np.einsum("bc,nbc->n", p - onehot, zz) / zz.shape[1]
        return loss, grad

    if n == 1:
        g = np.ones(1)
        iters = 0
    else:
        # Imported here: scipy.optimize costs ~0.25 s, paid only by the process running a FedCD server
        # (every Ray worker imports every method).
        from scipy.optimize import minimize

        res = minimize(objective, np.full(n, 1.0 / n), jac=True, method="SLSQP", bounds=[(0.0, 1.0)] * n,
                       constraints=[{"type": "eq", "fun": lambda g: g.sum() - 1.0, "jac": lambda g: np.ones(n)}],
                       options={"ftol": tol, "maxiter": max_iter})
        g = np.clip(res.x, 0.0, None)
        g = g / g.sum()
        iters = int(res.nit)
    loss, grad = objective(g)
    gap = float(grad @ g - grad.min())
    return torch.from_numpy(g), {"gap": max(gap, 0.0), "iterations": float(iters), "ce": loss}


class FedCD(PersonalisedAlgorithm):
    name = "fedcd"
    synchronous_because = "Eq. 4's ensemble weights are solved over one round's logits together"
    Params = FedCDParams
    clients_hold_server_images = True
    robust_means = ("teacher",)  # ensemble=uniform's teacher, the clients' logits on the shared images

    @classmethod
    def robust_rules(cls, params: BaseModel) -> tuple[tuple[str, ...], str]:
        if params.ensemble == "uniform":
            return VALUE_RULES, ("its teacher is the ensemble of the clients' logits, not an update from a reference "
                                 "model that norm bounding or FLTrust could measure")
        return ("mean",), ("Eq. 4's teacher weighs the clients' logits by weights fit on the labelled server images, "
                           "not by a mean a rule could replace; set algorithm.ensemble=uniform for a robust rule")

    @classmethod
    def central_noise_refused(cls, params: BaseModel) -> str | None:
        # the uniform teacher is the one mean of the uploads (their clipped logit tables), which the server then
        # broadcasts; Eq. 4 reads each client's logits to fit its weights
        return None if params.ensemble == "uniform" else ("Eq. 4 fits its weights on each client's logits one by one; "
                                                          "set algorithm.ensemble=uniform")

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, params: FedCDParams) -> None:
        sd = cfg.data.server_data
        if sd.kind == "none" or not sd.is_labelled():
            raise ConfigError("data.server_data.kind", f"{cls.name} ensembles the clients' logits on a labelled "
                              "validation set held by the server (Eq. 4): set data.server_data.kind=holdout "
                              "(FedCD: data.server_data.per_class=50)")
        if sd.kind == "holdout":
            size = sd.per_class * input_spec(cfg.data)[1]
            batch = params.shared_batch
            if batch > size:
                raise ConfigError("algorithm.shared_batch", f"{batch} exceeds the validation set's {size} images "
                                  f"(data.server_data.per_class x classes); allowed: 1..{size}")

    def init_server_state(self, modules: None) -> FedCDServerState:
        return FedCDServerState()

    def shared_indices(self, round_: int) -> torch.Tensor:
        """The validation images whose logits clients upload in ``round_`` (seeded by run seed and round)."""
        assert self.server_data is not None, "only the server draws the shared batch"
        n = len(self.server_data)
        rng = derive_rng(self.cfg.seed, "fedcd/shared-batch", round_)
        return torch.from_numpy(np.sort(rng.choice(n, size=min(self.params.shared_batch, n), replace=False)))

    def broadcast(self, state: FedCDServerState, round_: int) -> FedCDPayload:
        return FedCDPayload(teacher_idx=state.teacher_idx, teacher=state.teacher,
                            upload_idx=self.shared_indices(round_))

    # --- client (Algorithm 1, lines 2-10) ------------------------------------------------------------
    def shared_images(self, ctx: ClientContext, idx: torch.Tensor) -> torch.Tensor:
        assert ctx.server_x is not None, "FedCD's clients hold the shared validation images"
        return to_float(ctx.server_x[idx.to(ctx.server_x.device)], ctx.spec.mean, ctx.spec.std)

    def client_samples(self, ctx: ClientContext) -> int:
        """Its batches, and the round's shared batch through its model for the logits it uploads."""
        return super().client_samples(ctx) + self.params.shared_batch

    def client_update(self, ctx: ClientContext, payload: FedCDPayload, state: PersonalModel) -> LocalTraining:
        p = self.params
        if payload.teacher is None or p.lambda_kd == 0:
            def loss_fn(m, x, y):
                return F.cross_entropy(m(x), y)
        else:
            shared = self.shared_images(ctx, payload.teacher_idx)
            teacher = payload.teacher.to(ctx.device)

            def loss_fn(m, x, y):  # Eq. 2: CE on the private batch + lambda * Eq. 1 on the teacher batch
                distil = kd_kl(m(shared), teacher, p.temperature)
                return F.cross_entropy(m(x), y) + p.lambda_kd * distil, {"train/kd_loss": distil}

        def finish(model: torch.nn.Module, metrics: dict[str, float], new: PersonalModel) -> ClientResult:
            model.eval()
            with torch.no_grad():
                logits = model(self.shared_images(ctx, payload.upload_idx)).float().cpu()
            return ClientResult(upload=FedCDUpload(client_id=ctx.client_id, logits=logits), state=new,
                                metrics=metrics)

        # the distillation term reads the shared batch, not the private one: padded private rows stay out of it
        return self.own_training(ctx, state, loss_fn, finish, paddable=True)


    # --- server (Algorithm 1, lines 11-16) ------------------------------------------------------------
    def server_update(self, state: FedCDServerState, uploads: list[FedCDUpload],
                      ctx: ServerContext) -> tuple[FedCDServerState, dict[str, float]]:
        assert self.server_data is not None and self.server_data.y is not None
        idx = self.shared_indices(ctx.round)
        y = self.server_data.y[idx.to(self.server_data.y.device)].cpu()
        z = torch.stack([u.logits for u in uploads]).to(torch.float64)  # (n, B, C)
        n = z.shape[0]
        uniform = torch.full((n,), 1.0 / n, dtype=torch.float64)
        if self.params.ensemble == "optimal":
            gamma, solver = simplex_weights(z, y, self.params.gamma_tol, self.params.gamma_max_iter)
        else:
            gamma, solver = uniform, {}
        # Eq. 4's ensemble and the uniform average it is scored against stay outside the aggregation hook: einsum's
        # reduction rounds otherwise than the hook's sum of float64 terms, and the teacher trains every client. A
        # robust rule (ensemble=uniform only) replaces the uniform teacher: over the clients' (B, C) logit tables, one
        # vote each; server/uniform_* still score the plain average
        avg = torch.einsum("n,nbc->bc", uniform, z)
        if not isinstance(ctx.aggregation, WeightedMean):  # a robust rule, or central DP noise on the clipped tables
            teacher = ctx.aggregation.mean(list(z.unbind(0)), [1.0] * n)
        else:
            teacher = torch.einsum("n,nbc->bc", gamma, z)
        metrics = {
            "server/teacher_ce": float(F.cross_entropy(teacher, y)),
            "server/uniform_ce": float(F.cross_entropy(avg, y)),
            "server/teacher_acc": float((teacher.argmax(1) == y).double().mean()),
            "server/uniform_acc": float((avg.argmax(1) == y).double().mean()),
            "server/gamma_max": float(gamma.max()),
            "server/gamma_argmax_client": float(uploads[int(gamma.argmax())].client_id),
            "server/gamma_entropy": float(normalised_entropy(gamma)) if n > 1 else math.nan,
        }
        if solver:
            metrics.update({"server/gamma_gap": solver["gap"], "server/gamma_iterations": solver["iterations"]})
        metrics.update(heldout_scores(state, uploads, z, y, idx))
        clients = torch.tensor([u.client_id for u in uploads], dtype=torch.int64)
        return FedCDServerState(teacher=teacher.float(), teacher_idx=idx, gamma=gamma, gamma_clients=clients), metrics


def heldout_scores(state: FedCDServerState, uploads: list[FedCDUpload], z: torch.Tensor, y: torch.Tensor,
                   idx: torch.Tensor) -> dict[str, float]:
    """Does Eq. 4's teacher beat the uniform average on images its gamma was not fit on? Last round's gamma
    (fit on last round's batch) scored on this round's batch less the images the two batches share, against
    the uniform average of the same logits: ``server/teacher_ce_heldout`` / ``uniform_ce_heldout`` (and
    ``_acc_``). The same-batch figures (``server/teacher_ce``) favour gamma, which was fit on them. Only when
    the same clients uploaded both rounds (gamma's weights belong to clients)."""
    if state.gamma is None or state.gamma_clients is None:
        return {}
    now = [u.client_id for u in uploads]
    if sorted(now) != sorted(state.gamma_clients.tolist()):
        return {}
    fresh = ~torch.isin(idx, state.teacher_idx)  # images last round's gamma never saw
    if not fresh.any():
        return {}
    weight = dict(zip(state.gamma_clients.tolist(), state.gamma.tolist()))
    gamma = torch.tensor([weight[c] for c in now], dtype=z.dtype)
    zf, yf = z[:, fresh.to(z.device)], y[fresh]
    teacher = torch.einsum("n,nbc->bc", gamma, zf)
    avg = zf.mean(0)  # the same baseline as server/uniform_ce, on the same arithmetic as the teacher's
    return {"server/teacher_ce_heldout": float(F.cross_entropy(teacher, yf)),
            "server/uniform_ce_heldout": float(F.cross_entropy(avg, yf)),
            "server/teacher_acc_heldout": float((teacher.argmax(1) == yf).double().mean()),
            "server/uniform_acc_heldout": float((avg.argmax(1) == yf).double().mean()),
            "server/heldout_images": float(fresh.sum())}
