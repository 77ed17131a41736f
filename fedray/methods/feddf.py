"""FedDF: ensemble distillation for robust model fusion (Lin et al., NeurIPS 2020), as the FedD3A paper's
baseline ("each teacher is treated equally").

Clients train as in FedAvg. The server averages their models (sample-weighted, FedAvg's Eq.) and distils
into that average the ensemble of the uploaded models on its own unlabelled data (``data.server_data``):
the teacher is softmax of the mean of the clients' logits (at temperature T). Defaults follow Lin et al.:
Adam lr 1e-3, batch 128, T=1, early stopping on a held-out part of the server data when the student's
agreement with the ensemble's argmax stops improving. The paper allows up to 10^4 distillation steps;
the default here is ``distill_epochs`` = 2 passes over the server data (CPU-sized), with early stopping.

Under a robust ``aggregation.rule`` (median, trimmed mean, Krum, Multi-Krum) both means become the rule: the fused
model's start over the uploaded models, and the teacher over the clients' logit tables on the server's data.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedray.methods.api import (VALUE_RULES, DistillSettings, WeightedMean, ExperimentConfig, ServerContext, derive_seed, distil,
                                require_server_data, soft_targets, teacher_logits)
from fedray.methods.fedavg import FedAvg, ModelState, ModelUpload


class FedDFParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    distill_lr: float = Field(default=1e-3, gt=0)
    distill_optimizer: Literal["adam", "sgd"] = "adam"
    distill_batch_size: int = Field(default=128, ge=1)
    distill_epochs: float = Field(default=2.0, gt=0, description="passes over the server data, at most")
    temperature: float = Field(default=1.0, gt=0)
    val_fraction: float = Field(default=0.1, ge=0, lt=1, description="server data held out for early stopping")
    patience: int = Field(default=3, ge=0, description="evaluations without improvement; 0 = no early stopping")
    eval_every: int = Field(default=50, ge=1, description="distillation steps between early-stopping checks")


class FedDF(FedAvg):
    name = "feddf"
    synchronous_because = "it distils the ensemble of one round's uploads on the server's data"
    Params = FedDFParams
    # the fused model's start, a mean of models trained from state.weights, and the teacher, the ensemble of the
    # uploaded models' logits on the server's data: both under aggregation.rule
    robust_means = ("weights", "teacher")

    @classmethod
    def robust_rules(cls, params: BaseModel) -> tuple[tuple[str, ...], str]:
        return VALUE_RULES, ("its teacher, the ensemble of the clients' logits, is not an update from a reference "
                             "model that norm bounding or FLTrust could measure")

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, params: BaseModel) -> None:
        require_server_data(cls.name, cfg)

    def settings(self) -> DistillSettings:
        p = self.params
        return DistillSettings(lr=p.distill_lr, optimizer=p.distill_optimizer, batch_size=p.distill_batch_size,
                               epochs=p.distill_epochs, temperature=p.temperature, val_fraction=p.val_fraction,
                               patience=p.patience, eval_every=p.eval_every)

    def server_samples(self, uploads: int) -> int:
        """At most ``distill_epochs`` passes over the server's data, labelled by every uploaded model (the teacher)
        and learned by the student: early stopping may end sooner."""
        n = len(self.server_data.x) if self.server_data is not None else 0
        return int(self.params.distill_epochs * n) * (1 + uploads)

    def server_update(self, state: ModelState, uploads: list[ModelUpload],
                      ctx: ServerContext) -> tuple[ModelState, dict[str, float]]:
        assert self.server_data is not None
        average = ctx.aggregation.mean([u.weights for u in uploads], [u.num_samples for u in uploads],
                                       reference=state.weights)
        model, x = ctx.modules.model, self.server_data.x
        logits = teacher_logits(((model, u.weights) for u in uploads), x, self.spec, self.cfg.federation.eval_batch_size)
        # the teacher: the ensemble of the uploaded models' logits on the server's data, which the server computes.
        # Under the mean a float32 mean (the hook's float64 sum would change its bits); under a robust rule the rule
        # over the clients' (server samples x classes) logit tables, one vote each (the median per sample and class,
        # Krum's choice among the tables)
        if isinstance(ctx.aggregation, WeightedMean):
            ensemble = logits.mean(0)
        else:
            ensemble = ctx.aggregation.mean(list(logits.unbind(0)), [1.0] * len(uploads))
        targets = soft_targets(ensemble, self.params.temperature)
        weights, metrics = distil(model, average, x, targets, self.spec, self.settings(),
                                  derive_seed(ctx.seed, "feddf/distill"), ctx.cuda_graphs)
        self._round = (targets, average, weights)  # for server_diagnostics, this process only
        return dataclasses.replace(state, weights=weights), metrics

    def server_diagnostics(self, ctx: ServerContext, labels: torch.Tensor) -> dict[str, float]:
        """On the server's data, with the labels the method never sees: the accuracy of the clients' ensemble (the
        teacher), of the plain average the student starts from and of the distilled student. Whether the ensemble
        knows more than the average, and whether the distillation passes it on."""
        state, self._round = getattr(self, "_round", None), None
        if state is None:
            return {}
        targets, average, distilled = state
        y = labels.to(targets.device)
        out = {"diag/teacher_acc": float((targets.argmax(1) == y).float().mean())}
        for key, weights in (("diag/student_acc_start", average), ("diag/student_acc", distilled)):
            logits = teacher_logits([(ctx.modules.model, weights)], self.server_data.x, self.spec,
                                    self.cfg.federation.eval_batch_size)[0]
            out[key] = float((logits.argmax(1).to(y.device) == y).float().mean())
        return out
