"""FedD3A: domain discrepancy aware distillation for model aggregation (FedD3A paper, Algorithm 1).

The server holds unlabelled data of another domain (``data.server_data.kind=domain``). Round t:

- Client k receives the global model, extracts the features of its training data with the global backbone
  B in eval mode, and builds its subspace projection by the recursion of Eq. 5 over the mean features of
  its batches (``federation.batch_size`` each, a seeded permutation). By Sherman-Morrison the recursion
  ends at P_hat = (aI + Zb^T Zb)^-1, so the projector is P_k = I - a P_hat (``algorithm.proj_a`` = a; the
  paper's "P = I - P_hat" is the a = 1 case). P_k (d x d) is uploaded with the model.
- Local training is the engine's FedAvg step from the global weights (homogeneous clients), or, when
  ``model.client_models`` gives clients other architectures than ``model.name`` (the paper's Fig. 6),
  each client trains its own persistent model on CE + ``hetero_kd_weight`` x KL(global || own), the
  received global model being the teacher.
- The server starts the student from the average of the uploaded models (homogeneous; sample-weighted as
  FedAvg) or from its global model (heterogeneous). For each server image x: r_k = cos(B(x), P_k B(x)) with
  the backbone the clients used (the broadcast model), alpha = softmax((r - mean r) / std r) over the
  clients (Eq. 6), the teacher y_hat = sum_k alpha_k softmax(h_k(x) / T) (Eq. 7), and the student is
  trained on KL(y_hat || student) (Eq. 8) for ``distill_epochs`` passes (the paper: 1) with momentum SGD, its
  lr following the clients' ``federation.lr_schedule``. Eq. 8's text writes D_KL(h(x) || y_hat), the student
  first; the default is the usual distillation direction, which the authors' code minimises and which keeps
  the student covering every class the weighted teachers give mass to (the reverse is mode-seeking: with a
  mixture of teachers it can settle on one teacher's classes). ``kl_direction=student_teacher`` is the
  text's order.
- ``weighting`` = ``soft`` (Eq. 6), ``onehot`` (only the highest-weighted teacher), ``avg`` (uniform) or
  ``random`` (softmax of seeded Gaussian noise): Table 1's rows.

Logged: ``server/alpha_entropy`` (normalised, 1 = uniform), ``server/alpha_max_mean``, ``server/r_mean``,
``server/r_std`` and the KD loss; when the server's data has labels (the method never reads them):
``diag/teacher_acc_<weighting>`` for all four weightings on this round's teachers,
``diag/teacher_acc_best_single`` (the best single client), and the student's accuracy there before and
after its distillation (``diag/student_acc_start``, ``diag/student_acc``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from fedray.methods.api import (Algorithm, ClientContext, ClientResult, ClientState, DistillSettings, ExperimentConfig,
                                FedModel, IGNORE_LABEL, LocalTraining, ModelBank, Payload, PersonalModel,
                                ServerContext, ServerState, Trained, Upload, Weights, build_model, clone_weights,
                                counts_field, derive_seed, distil, kd_kl, model_field, normalised_entropy,
                                projection_cosine, projector, require_server_data, run_in_batches, soft_targets,
                                subspace_weights, teacher_logits, to_float, values_field, weights_only)

WEIGHTINGS = ("soft", "onehot", "avg", "random")


class FedD3AParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    proj_a: float = Field(default=1.0, gt=0, description="a of Eq. 5 (regulariser of the projector)")
    weighting: Literal["soft", "onehot", "avg", "random"] = Field(default="soft", description="Table 1's rows")
    distill_lr: float = Field(default=0.01, gt=0, description="the paper's momentum SGD lr")
    distill_optimizer: Literal["sgd", "adam"] = "sgd"
    distill_batch_size: int = Field(default=256, ge=1, description="the paper: 256")
    distill_epochs: float = Field(default=1.0, gt=0, description="passes over the server data (the paper: 1)")
    temperature: float = Field(default=1.0, gt=0)
    kl_direction: Literal["teacher_student", "student_teacher"] = Field(
        default="teacher_student", description="Eq. 8's KL: KL(y_hat || h), the usual distillation direction and the "
        "authors' code's, or KL(h || y_hat), the order Eq. 8's text writes (mode-seeking)")
    hetero_kd_weight: float = Field(default=1.0, ge=0, description="heterogeneous clients: weight of KL to "
                                    "the global teacher")


@dataclass
class FedD3AModules:
    model: FedModel  # the global architecture: backbone B, student, homogeneous clients' model
    bank: ModelBank  # teachers of any architecture (heterogeneous clients)


@dataclass
class GlobalModel(ServerState):
    weights: Weights


@dataclass
class GlobalPayload(Payload):
    weights: Weights = model_field(against=None)


@dataclass
class FedD3AUpload(Upload):
    # the client's trained model: of its own architecture when heterogeneous, so not an update against the payload's
    weights: Weights = model_field(against=None)
    architecture: str
    num_samples: int = counts_field()
    projector: torch.Tensor = values_field()  # P_k (d, d), float32


def weights_for(kind: str, r: torch.Tensor, seed: int) -> torch.Tensor:
    """(N, K) teacher weights from the cosines r (N, K) for one of Table 1's weightings."""
    if kind == "soft":
        return subspace_weights(r)
    if kind == "onehot":
        return F.one_hot(subspace_weights(r).argmax(1), r.shape[1]).to(r.dtype)
    if kind == "avg":
        return torch.full_like(r, 1.0 / r.shape[1])
    noise = torch.randn(r.shape, generator=torch.Generator().manual_seed(seed % (1 << 63)), dtype=r.dtype)
    return torch.softmax(noise, dim=1).to(r.device)


class FedD3A(Algorithm):
    name = "fedd3a"
    synchronous_because = "Eq. 6-7's teacher ensembles one round's uploads on the server's data"
    Params = FedD3AParams
    mean_only_because = ("Eq. 6-7's teacher weighs each client's logits per sample by its domain discrepancy, a "
                         "weighting the method computes, not a mean a rule could replace")
    shared_architecture = False  # heterogeneous clients distil from the global model (the paper's Fig. 6)
    #: This round's cosines r, teacher probabilities and random-weighting seed, kept for server_diagnostics
    #: only (the method never reads them back; not server state, so not checkpointed).
    _round: tuple[torch.Tensor, torch.Tensor, int, Weights, Weights] | None = None

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, params: BaseModel) -> None:
        require_server_data(cls.name, cfg)

    @property
    def heterogeneous(self) -> bool:
        return any(a != self.cfg.model.name for a in (self.cfg.model.client_models or []))

    def build_modules(self) -> FedD3AModules:
        spec = self.spec
        return FedD3AModules(model=build_model(self.cfg.model.name, spec.input_shape, spec.num_classes),
                             bank=ModelBank(spec, torch.device("cpu")))

    def init_server_state(self, modules: FedD3AModules) -> GlobalModel:
        return GlobalModel(weights=clone_weights(modules.model))

    def broadcast(self, state: GlobalModel, round_: int) -> GlobalPayload:
        return GlobalPayload(weights=state.weights)

    def global_weights(self, state: GlobalModel) -> Weights:
        return state.weights

    def init_client_state(self, client_id: int) -> ClientState | None:
        return self.init_personal_model(client_id) if self.heterogeneous else None

    # --- client (Algorithm 1: Eq. 5, then local training) ---------------------------------------------
    @torch.no_grad()
    def client_projector(self, ctx: ClientContext, backbone: FedModel) -> torch.Tensor:
        """P_k of Eq. 5 from the client's features under the received backbone, over seeded batches."""
        backbone.eval()
        perm = torch.randperm(ctx.num_samples, generator=ctx.generator("fedd3a/projector")).to(ctx.device)
        bs = ctx.fed.batch_size
        feats = torch.cat([backbone.features(to_float(ctx.x[perm[i : i + bs]], ctx.spec.mean, ctx.spec.std))
                           for i in range(0, ctx.num_samples, bs)])
        return projector(feats, self.params.proj_a, batch_size=bs).float().cpu()

    def client_update(self, ctx: ClientContext, payload: GlobalPayload, state: ClientState | None) -> LocalTraining:
        glob = ctx.modules.model
        glob.load_state_dict(payload.weights)
        proj = self.client_projector(ctx, glob)
        if not self.heterogeneous:
            @weights_only
            def finish(m: torch.nn.Module, trained: Trained) -> ClientResult:
                upload = FedD3AUpload(weights=clone_weights(m), architecture=self.cfg.model.name,
                                      num_samples=ctx.num_samples, projector=proj)
                return ClientResult(upload=upload, state=None, metrics=trained.means())

            return LocalTraining(model=glob, start=payload.weights, loss=lambda m, x, y: F.cross_entropy(m(x), y),
                                 finish=finish, paddable=True)
        assert isinstance(state, PersonalModel) and state.client_id == ctx.client_id
        glob.eval()  # the received global model is the teacher of every client this round
        w = self.params.hetero_kd_weight

        def loss_fn(m, x, y):  # CE + KL(global teacher || own), the paper's heterogeneous local training
            z = m(x)
            with torch.no_grad():
                t = glob(x)  # eval mode: a padded batch's rows do not reach its BatchNorm
            # both means over the rows not labelled IGNORE_LABEL (paddable)
            return F.cross_entropy(z, y) + w * kd_kl(z, t, self.params.temperature, rows=y != IGNORE_LABEL)

        @weights_only
        def own_finish(m: torch.nn.Module, trained: Trained) -> ClientResult:
            new = PersonalModel(client_id=ctx.client_id, architecture=state.architecture, weights=clone_weights(m))
            upload = FedD3AUpload(weights=new.weights, architecture=state.architecture, num_samples=ctx.num_samples,
                                  projector=proj)
            return ClientResult(upload=upload, state=new, metrics=trained.means())

        return LocalTraining(model=ctx.own_model(), start=state.weights, loss=loss_fn, finish=own_finish,
                             paddable=True)


    # --- server (Algorithm 1: Eq. 6-8) -----------------------------------------------------------------
    def server_samples(self, uploads: int) -> int:
        """``distill_epochs`` passes over the server's data, through every uploaded model (Eq. 6-7's teachers) and
        the student."""
        n = len(self.server_data.x) if self.server_data is not None else 0
        return int(self.params.distill_epochs * n) * (1 + uploads)

    def settings(self, round_: int) -> DistillSettings:
        """Eq. 8's distillation of round ``round_``: the server's lr follows the clients' schedule
        (``federation.lr_schedule``), the same factor each round."""
        p, fed = self.params, self.cfg.federation
        return DistillSettings(lr=p.distill_lr * fed.lr_at(round_) / fed.lr, optimizer=p.distill_optimizer,
                               batch_size=p.distill_batch_size, epochs=p.distill_epochs, temperature=p.temperature,
                               reverse_kl=p.kl_direction == "student_teacher")

    def server_update(self, state: GlobalModel, uploads: list[FedD3AUpload],
                      ctx: ServerContext) -> tuple[GlobalModel, dict[str, float]]:
        assert self.server_data is not None
        p, m, x, bs = self.params, ctx.modules, self.server_data.x, self.cfg.federation.eval_batch_size
        m.model.load_state_dict(state.weights)  # B: the backbone the clients built their projectors with
        m.model.eval()
        feats = run_in_batches(m.model.features, x, self.spec, bs).to(torch.float64)
        projs = torch.stack([u.projector.to(feats.device, torch.float64) for u in uploads])
        r = projection_cosine(projs, feats)  # (N, K)
        logits = teacher_logits(((m.bank.get(u.architecture), u.weights) for u in uploads), x, self.spec, bs)
        probs = soft_targets(logits, p.temperature)  # (K, N, C)
        alpha = weights_for(p.weighting, r, derive_seed(ctx.seed, "fedd3a/random-weights")).to(probs.dtype)
        targets = torch.einsum("nk,knc->nc", alpha, probs)  # Eq. 7
        start = (ctx.aggregation.mean([u.weights for u in uploads], [u.num_samples for u in uploads])
                 if not self.heterogeneous else state.weights)
        weights, metrics = distil(m.model, start, x, targets, self.spec, self.settings(ctx.round),
                                  derive_seed(ctx.seed, "fedd3a/distill"), ctx.cuda_graphs)
        metrics.update({"server/alpha_entropy": float(normalised_entropy(alpha, dim=1).mean()),
                        "server/alpha_max_mean": float(alpha.max(1).values.mean()),
                        "server/r_mean": float(r.mean()), "server/r_std": float(r.std())})
        # held for server_diagnostics on a diagnosed round only, and let go there
        self._round = ((r, probs, derive_seed(ctx.seed, "fedd3a/random-weights"), start, weights)
                       if self.cfg.federation.diagnoses(ctx.round) else None)
        return dataclasses.replace(state, weights=weights), metrics

    def server_diagnostics(self, ctx: ServerContext, labels: torch.Tensor) -> dict[str, float]:
        if self._round is None:
            return {}
        (r, probs, seed, start, distilled), self._round = self._round, None
        y = labels.to(probs.device)
        out = {}
        for kind in WEIGHTINGS:
            teacher = torch.einsum("nk,knc->nc", weights_for(kind, r, seed).to(probs.dtype), probs)
            out[f"diag/teacher_acc_{kind}"] = float((teacher.argmax(1) == y).float().mean())
        out["diag/teacher_acc_best_single"] = float((probs.argmax(2) == y).float().mean(1).max())
        # the student on the server's domain before and after its distillation: can the teacher teach it?
        for key, weights in (("diag/student_acc_start", start), ("diag/student_acc", distilled)):
            out[key] = float((teacher_logits([(ctx.modules.model, weights)], self.server_data.x, self.spec,
                                              self.cfg.federation.eval_batch_size)[0].argmax(1) == y).float().mean())
        return out
