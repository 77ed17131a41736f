"""FedDistill: federated distillation by per-label average logits (Jeong et al., "Communication-efficient
on-device machine learning: federated distillation and augmentation", 2018), as FedCD uses it (Table II).

Every client owns its model, of any architecture; no weights are exchanged. Round t:

- The server sends the global per-label logits G (C x C: row c is the average logit vector of label c
  over the clients that hold label c) and which labels have one (none in round 1).
- Each client trains its own model on CE + ``lambda_kd`` * T^2 KL(softmax(G[y] / T) || softmax(z / T)) on its
  private batches: the logits z of a sample of label y are pulled towards the global logits of label y.
- It uploads its per-label mean logits over its training data (after training, in eval mode) and how many
  samples of each label it holds (so the server knows which rows are meaningful).
- The server averages the rows per label over the clients that hold that label.

Communication: C x C logits and C counts up, C x C logits and a C-byte mask down (FedCD Sec. V-C counts
"100x100 logits" for CIFAR-100). Choices where the 2018 paper leaves room: the logits uploaded are computed
after local training over the client's whole training split (the paper accumulates them during training);
the per-label average is unweighted over clients (each client's label mean counts once); the global logit
of a label includes the client's own contribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from fedray.methods.api import (ClientContext, ClientResult, IGNORE_LABEL,
                                LocalTraining, Payload, PersonalModel, PersonalisedAlgorithm, ServerContext, ServerState, Upload, counts_field, kl_rows,
                                row_mean, soft_targets, to_float, values_field)


class FedDistillParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lambda_kd: float = Field(default=1.0, ge=0, description="weight of the distillation regulariser")
    temperature: float = Field(default=1.0, gt=0)


@dataclass
class LabelLogits(ServerState):
    logits: torch.Tensor | None = None  # (C, C) global per-label logits; None before the first uploads
    present: torch.Tensor | None = None  # (C,) bool: labels some client holds


@dataclass
class LabelLogitsPayload(Payload):
    logits: torch.Tensor | None = values_field()
    present: torch.Tensor | None = counts_field()  # bool (C,)


@dataclass
class LabelLogitsUpload(Upload):
    logits: torch.Tensor = values_field()  # (C, C) this client's per-label mean logits (zero rows for absent labels)
    counts: torch.Tensor = counts_field()  # (C,) int64 samples per label


def label_means(logits: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, C) per-label mean of ``logits`` rows (zeros where a label is absent) and (C,) label counts."""
    counts = torch.bincount(y, minlength=num_classes)
    sums = torch.zeros(num_classes, logits.shape[1], dtype=logits.dtype).index_add_(0, y, logits)
    return sums / counts.clamp_min(1).unsqueeze(1).to(logits.dtype), counts


class FedDistill(PersonalisedAlgorithm):
    name = "feddistill"

    @classmethod
    def uploads_label_counts(cls, params: BaseModel) -> bool:
        return True  # each client's samples per label (the logit average's weights)
    synchronous_because = "it averages one round's per-class logits"
    Params = FedDistillParams
    # each label's row of the table: a mean over the logit rows of the clients holding that label, values a
    # coordinate-wise rule (median, trimmed mean) may replace; Krum's distances and the rules that read updates from a
    # broadcast model (norm_bound, fltrust) mean nothing for these rows, and check_config refuses them
    robust_means = ("logits",)

    @classmethod
    def robust_rules(cls, params: BaseModel) -> tuple[tuple[str, ...], str]:
        return ("mean", "median", "trimmed_mean"), ("it aggregates per-label logit rows over the clients holding each "
                                                    "label, not models")

    @classmethod
    def central_noise_refused(cls, params: BaseModel) -> str | None:
        return ("each label's row is a mean over the clients holding that label, a denominator read from their label "
                "counts (sent in the clear), not a fixed one")

    def init_server_state(self, modules: None) -> LabelLogits:
        return LabelLogits()

    def broadcast(self, state: LabelLogits, round_: int) -> LabelLogitsPayload:
        return LabelLogitsPayload(logits=state.logits, present=state.present)

    def client_update(self, ctx: ClientContext, payload: LabelLogitsPayload, state: PersonalModel) -> LocalTraining:
        p = self.params
        if payload.logits is None or p.lambda_kd == 0:
            def loss_fn(m, x, y):
                return F.cross_entropy(m(x), y)
        else:
            table, present = payload.logits.to(ctx.device), payload.present.to(ctx.device)

            def loss_fn(m, x, y):
                # KD on the samples whose label some client holds, batch-mean over them; masked rather than
                # indexed (no data-dependent shapes), so the loss also runs batched over clients. A padded batch's
                # rows labelled IGNORE_LABEL (paddable) are left out like the cross-entropy's.
                z = m(x)
                label = y.clamp_min(0)
                log_q = F.log_softmax(z / p.temperature, dim=-1)
                per_sample = kl_rows(soft_targets(table[label], p.temperature), log_q)
                kd = row_mean(per_sample, present[label] & (y != IGNORE_LABEL)) * p.temperature**2
                return F.cross_entropy(z, y) + p.lambda_kd * kd

        def finish(model: torch.nn.Module, metrics: dict[str, float], new: PersonalModel) -> ClientResult:
            model.eval()
            outs, bs = [], ctx.fed.eval_batch_size
            with torch.no_grad():
                for s in range(0, ctx.num_samples, bs):
                    outs.append(model(to_float(ctx.x[s : s + bs], ctx.spec.mean, ctx.spec.std)).float().cpu())
            means, counts = label_means(torch.cat(outs), ctx.y.cpu(), self.spec.num_classes)
            return ClientResult(upload=LabelLogitsUpload(logits=means, counts=counts), state=new, metrics=metrics)

        return self.own_training(ctx, state, loss_fn, finish, paddable=True)


    def server_update(self, state: LabelLogits, uploads: list[LabelLogitsUpload],
                      ctx: ServerContext) -> tuple[LabelLogits, dict[str, float]]:
        held = torch.stack([u.counts > 0 for u in uploads]).to(torch.float64)  # (n, C)
        rows = torch.stack([u.logits for u in uploads]).to(torch.float64)  # (n, C, C)
        present = held.sum(0) > 0
        # row c: the mean (or the aggregation rule) over the rows of the clients holding label c, one vote each; the
        # others' row c is zeros and not theirs to send
        table = torch.zeros(rows.shape[1:], dtype=torch.float64)
        for c in present.nonzero().flatten().tolist():
            holders = held[:, c].nonzero().flatten().tolist()
            table[c] = ctx.aggregation.mean([rows[i, c] for i in holders], [1.0] * len(holders))
        return LabelLogits(logits=table.float(), present=present), {
            "server/labels_present": float(present.sum())}
