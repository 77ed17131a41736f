"""FedFTG: fine-tuning the global model by data-free knowledge distillation (Zhang et al., CVPR 2022), a baseline of
DaFKD's Table 1.

Clients train as the base method (``base``: FedAvg, or FedProx with ``mu``) and upload their label counts with their
model. The server averages the models (FedAvg's sample weights) and then fine-tunes that average, the student,
with a conditional **image** generator G(z, y) (:class:`~fedray.models.conditional.ImageGenerator`) kept across
rounds, for ``iterations`` iterations a round. Each iteration draws z ~ N(0, I) and labels y; the labels of a
round are drawn in proportion to the round's clients' class totals sum_k n_k^y (customised label sampling), and
every generated sample of label y weighs teacher k by alpha_k^y = n_k^y / sum_j n_j^y (class-level ensemble,
:func:`~fedray.learning.data_free.label_shares`). Then

1. the generator, one Adam step per teacher k (``gen_steps_per_teacher`` rounds of them), on
   ``hard_weight * L_md + cls_weight * L_cls + diversity_weight * L_dis / K`` with
   L_md = -mean_i alpha_k^{y_i} mean_c |s(x_i)_c - t_k(x_i)_c| (hard samples: push the student's logits away from
   the teacher's; the student in eval mode, the teacher's logits detached), L_cls = mean_i alpha_k^{y_i}
   CE(t_k(x_i), y_i) (the teacher should read x_i as y_i), L_dis the diversity term;
2. the student, ``student_steps`` SGD steps (lr ``student_lr``, weight decay ``student_weight_decay``) on the
   same z and y: the cross-entropy to sum_k alpha_k^y softmax(t_k(x)), averaged over rows and classes as the
   authors' code averages it (so ``student_lr`` means what their 0.1 means).

The learning rates decay by ``lr_decay`` per round (the authors' 0.998); both optimisers start afresh each round, as
in their code. Teachers run in eval mode; the generator trains in train mode and feeds the student in eval mode.

From the authors' code (``ZhangLin-PKU/FedFTG``), where the paper leaves it open: 10 iterations of 1 generator step
per teacher and 5 student steps, Adam 0.01 for the generator and SGD 0.1 (weight decay 1e-3) for the student, the
L1 logit distance as the hard-sample term, unit weights, noise 100-d, the generator's width 64, the client batch size
for the generated batches, and the student's BatchNorm statistics updated by the generated images (train mode;
``freeze_student_bn=true`` keeps them to real data). Per-sample class-level weights in L_cls are the paper's (the code
multiplies the batch-mean CE by the mean weight). ``iterations=0`` is FedAvg (or FedProx) with label counts sent up.

**Privacy**: every upload carries the client's label counts (``comm/bytes_up``), as FedGen's do (FedKF's Def. 4).
``eval_average=true`` also evaluates the plain average before fine-tuning (``eval/*_avg``): what the fine-tuning
adds.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch.func import functional_call

from fedray.methods.api import (ClientContext, ExperimentConfig, ImageGenerator, ServerContext, Weights, build_model,
                                check_generator_batch, clone_weights, derive_seed, diversity_loss, frozen_bn_stats,
                                label_shares, optim)
from fedray.methods.fedavg import FedAvg, LabelCountUpload, ModelState, counted_upload, proximal_term, received_weights


class FedFTGParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    base: Literal["fedavg", "fedprox"] = Field(default="fedavg", description="the clients' method")
    mu: float = Field(default=0.01, ge=0, description="base=fedprox: the proximal weight")
    iterations: int = Field(default=10, ge=0, description="server fine-tuning iterations per round; 0 = the base")
    gen_steps_per_teacher: int = Field(default=1, ge=1, description="generator steps per teacher and iteration")
    student_steps: int = Field(default=5, ge=0, description="student steps per iteration")
    noise_dim: int = Field(default=100, ge=1)
    gen_width: int = Field(default=64, ge=1, description="the generator's channels (the authors': 64)")
    gen_lr: float = Field(default=0.01, gt=0)
    student_lr: float = Field(default=0.1, gt=0)
    student_weight_decay: float = Field(default=1e-3, ge=0)
    lr_decay: float = Field(default=0.998, gt=0, le=1, description="both rates x this per round")
    batch_size: int | None = Field(default=None, ge=2, description="generated samples per iteration; default "
                                   "federation.batch_size (the authors' code)")
    hard_weight: float = Field(default=1.0, ge=0, description="weight of L_md (hard samples)")
    cls_weight: float = Field(default=1.0, ge=0, description="weight of L_cls")
    diversity_weight: float = Field(default=1.0, ge=0, description="weight of L_dis")
    freeze_student_bn: bool = Field(default=False, description="keep the student's BatchNorm statistics to real data")
    eval_average: bool = Field(default=False, description="also evaluate the average before fine-tuning (eval/*_avg)")


@dataclass
class FedFTGState(ModelState):
    """FedAvg's global model (fine-tuned), the generator, and the plain average when it is evaluated."""

    generator: Weights = field(default_factory=dict)
    average: Weights | None = None


@dataclass
class FedFTGModules:
    model: torch.nn.Module  # the clients' model; the server's student
    teacher: torch.nn.Module  # the server's: each upload runs through it by functional_call
    generator: ImageGenerator


def proportional_labels(totals: torch.Tensor, n: int, rng: torch.Generator) -> torch.Tensor:
    """``n`` labels, class y about n * totals[y] / sum(totals) times (the authors' cumulative floor), shuffled."""
    bounds = torch.floor(torch.cumsum(totals.double() / totals.sum(), 0) * n).long().clamp(max=n)
    sizes = torch.diff(bounds, prepend=torch.zeros(1, dtype=torch.long))
    sizes[-1] += n - int(sizes.sum())
    labels = torch.repeat_interleave(torch.arange(len(totals)), sizes)
    return labels[torch.randperm(n, generator=rng)]


class FedFTG(FedAvg):
    name = "fedftg"

    @classmethod
    def uploads_label_counts(cls, params: BaseModel) -> bool:
        return True  # the clients' label counts (its label weights)
    synchronous_because = "it fine-tunes against one round's uploads as teachers"
    Params = FedFTGParams
    mean_only_because = ("its fine-tuning's teacher weighs each client's model per label by the label shares of the "
                         "uploaded counts, a weighting, not a mean a rule could replace")

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, params: BaseModel) -> None:
        check_generator_batch(params.batch_size, "algorithm.batch_size", cfg.federation.batch_size)

    def build_modules(self) -> FedFTGModules:
        shape, classes = self.spec.input_shape, self.spec.num_classes
        model = build_model(self.cfg.model.name, shape, classes)  # first: w0 equals FedAvg's under one seed
        teacher = build_model(self.cfg.model.name, shape, classes).eval().requires_grad_(False)
        generator = ImageGenerator(self.params.noise_dim, classes, shape, self.params.gen_width)
        return FedFTGModules(model=model, teacher=teacher, generator=generator)

    def init_server_state(self, modules: FedFTGModules) -> FedFTGState:
        return FedFTGState(weights=clone_weights(modules.model), generator=clone_weights(modules.generator))

    def extra_eval_models(self, state: FedFTGState) -> dict[str, Weights]:
        return {"avg": state.average} if state.average is not None else {}

    # --- client: the base method's local training, the label counts with the upload --------------------------
    def make_anchor(self, model, modules=None, payload=None):
        return received_weights(model) if self.params.base == "fedprox" else None

    local_loss_paddable = True  # FedAvg's CE, plus FedProx's proximal term (weights only)

    def local_loss(self, model, x, y, anchor):
        if self.params.base == "fedprox":
            return F.cross_entropy(model(x), y) + 0.5 * self.params.mu * proximal_term(model, anchor)
        return super().local_loss(model, x, y, anchor)

    def make_upload(self, ctx: ClientContext, weights: Weights) -> LabelCountUpload:
        return counted_upload(ctx, weights, self.spec.num_classes)

    # --- server ---------------------------------------------------------------------------------------------
    def server_samples(self, uploads: int) -> int:
        """Per iteration, a generated batch through the generator and each teacher per generator step, then through
        the student per student step."""
        p = self.params
        batch = p.batch_size or self.cfg.federation.batch_size
        return p.iterations * batch * (p.gen_steps_per_teacher * uploads + p.student_steps)

    def server_update(self, state: FedFTGState, uploads: list[LabelCountUpload],
                      ctx: ServerContext) -> tuple[FedFTGState, dict[str, float]]:
        average = ctx.aggregation.mean([u.weights for u in uploads], [u.num_samples for u in uploads])
        kept = average if self.params.eval_average else None
        if self.params.iterations == 0:
            return dataclasses.replace(state, weights=average, average=kept), {}
        weights, generator, metrics = self.fine_tune(state, average, uploads, ctx)
        return dataclasses.replace(state, weights=weights, generator=generator, average=kept), metrics

    def fine_tune(self, state: FedFTGState, average: Weights, uploads: list[LabelCountUpload],
                  ctx: ServerContext) -> tuple[Weights, Weights, dict[str, float]]:
        p, m, dev = self.params, ctx.modules, ctx.device
        decay = p.lr_decay ** (ctx.round - 1)
        student, gen, teacher = m.model, m.generator, m.teacher
        student.load_state_dict(average)
        gen.load_state_dict(state.generator)
        teacher.eval()
        teachers = [{k: v.to(dev) for k, v in u.weights.items()} for u in uploads]
        counts = torch.stack([u.label_counts for u in uploads])
        shares = label_shares(counts)[0].to(dev)  # (K, C): alpha_k^y
        batch = p.batch_size or self.cfg.federation.batch_size
        rng = torch.Generator().manual_seed(derive_seed(ctx.seed, "fedftg/generator") % (1 << 63))
        # the round's exact class totals, not through the aggregation hook: a float mean's rounding would move the
        # cumulative floor of proportional_labels where it lands on an integer
        labels_all = proportional_labels(counts.sum(0), p.iterations * batch, rng)
        gen_params = list(gen.parameters())
        opt_g = optim.Adam(gen_params, lr=p.gen_lr * decay)
        opt_s = optim.SGD(student.parameters(), lr=p.student_lr * decay, weight_decay=p.student_weight_decay)
        sums = dict.fromkeys(("md", "cls", "div", "kd", "teacher_acc"), 0.0)

        def logits_of(weights: Weights, x: torch.Tensor) -> torch.Tensor:
            return functional_call(teacher, weights, (x,))

        for it in range(p.iterations):
            y = labels_all[it * batch:(it + 1) * batch].to(dev)
            z = torch.randn(batch, p.noise_dim, generator=rng).to(dev)
            w = shares[:, y]  # (K, B): each sample's weight of each teacher
            # 1. the generator, one step per teacher
            gen.train()
            student.eval()
            for _ in range(p.gen_steps_per_teacher):
                for k, tw in enumerate(teachers):
                    fake = gen(z, y)
                    t = logits_of(tw, fake)
                    s = student(fake)
                    md = -((s - t.detach()).abs().mean(1) * w[k]).mean()
                    cls = (F.cross_entropy(t, y, reduction="none") * w[k]).mean()
                    div = diversity_loss(z, fake)
                    loss = p.hard_weight * md + p.cls_weight * cls + p.diversity_weight * div / len(teachers)
                    for prm, g in zip(gen_params, torch.autograd.grad(loss, gen_params)):
                        prm.grad = g
                    opt_g.step()
                    sums["md"] += float(md.detach())
                    sums["cls"] += float(cls.detach())
                    sums["div"] += float(div.detach())
            # 2. the student, on the weighted teachers' soft labels of the same z and y
            gen.eval()
            with torch.no_grad():
                fake = gen(z, y)
                target = sum(F.softmax(logits_of(tw, fake), dim=1) * w[k].unsqueeze(1) for k, tw in enumerate(teachers))
            sums["teacher_acc"] += float((target.argmax(1) == y).float().mean())
            student.train()
            for _ in range(p.student_steps):
                with frozen_bn_stats(student) if p.freeze_student_bn else contextlib.nullcontext():
                    kd = -(F.log_softmax(student(fake), dim=1) * target).mean()
                opt_s.zero_grad()
                kd.backward()
                opt_s.step()
                sums["kd"] += float(kd.detach())
        gen_updates = max(p.iterations * p.gen_steps_per_teacher * len(teachers), 1)
        metrics = {"server/ft_hard": sums["md"] / gen_updates, "server/ft_cls": sums["cls"] / gen_updates,
                   "server/ft_diversity": sums["div"] / gen_updates,
                   "server/gen_acc_teachers": sums["teacher_acc"] / p.iterations}
        if p.student_steps:
            metrics["server/ft_kd"] = sums["kd"] / (p.iterations * p.student_steps)
        metrics["server/gen_acc_global"] = self.generator_agreement(student, gen, labels_all, rng, dev)
        return clone_weights(student), clone_weights(gen), metrics

    @torch.no_grad()
    def generator_agreement(self, student: torch.nn.Module, gen: ImageGenerator, labels: torch.Tensor,
                            rng: torch.Generator, dev: torch.device) -> float:
        """How often the fine-tuned global model classifies the generator's images (eval mode) as their
        conditioning label, on one more batch of the round's labels."""
        y = labels[torch.randperm(len(labels), generator=rng)[:256]].to(dev)
        student.eval()
        gen.eval()
        return float((student(gen(torch.randn(len(y), self.params.noise_dim, generator=rng).to(dev), y)).argmax(1)
                      == y).float().mean())

