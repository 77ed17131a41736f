"""FedGen: data-free knowledge distillation for heterogeneous federated learning (Zhu et al., ICML 2021), a baseline
of DaFKD's Table 1 and FedKF's Tables V-VIII.

**Server**, each round after the clients' updates: the global model is FedAvg's sample-weighted average, and a
conditional generator G(eps, y) of **latent features** (the input of the classifier's last layer,
:class:`~fedray.models.conditional.FeatureGenerator`) is trained against the round's uploaded models by

    L_G = sum_k E_y [ w_{k,y} CE(head_k(G(eps, y)), y) ] + eta * L_div      (FedGen's knowledge extraction)

y drawn uniformly from the labels the round's clients hold, w_{k,y} = n_k^y / sum_j n_j^y their label shares
(:func:`~fedray.learning.data_free.label_shares`), head_k client k's last layer, L_div the diversity term.
``gen_steps`` Adam steps (lr ``gen_lr`` x ``gen_lr_decay`` ^ (t - 1), weight decay ``gen_weight_decay``), the
moments kept across rounds as the authors' one optimizer keeps them. The generator is broadcast with the model.

**Client** (FedGen's regularised local objective, plus the authors' code's latent KL): from ``start_round`` on,

    L = CE(f(x), y) + alpha_t * (B_g / B) * CE(head(G(eps, y_hat)), y_hat)
          + beta_t * KL(softmax(head(G(eps', y))) || softmax(f(x)))

y_hat drawn uniformly from the labels any client has reported (B_g = ``gen_batch_size`` of them; B_g / B balances
the generated batch against the real one, as the authors' code does), y the real batch's labels, alpha_t =
alpha * ``decay`` ^ (t - 1) and beta_t alike (floored at 1e-4 as in the code, unless 0). The generator is frozen on
the client (eval mode) and runs on the host, fed by a seeded noise stream of its own: the clients' batches are
FedAvg's, so alpha = beta = 0 trains FedAvg's weights exactly. Earlier rounds train plain FedAvg.

**Privacy**: every upload carries the client's label counts (``comm/bytes_up``): the server learns each
participant's label distribution (FedKF's Def. 4).

Where the paper and the authors' code (``zhuangdizhu/FedGen``) differ, the paper is the default and the code an
option: noise N(0, I), as the paper describes it and the code's comment names it (the code itself draws uniform
[0, 1): ``noise=uniform``); label counts of the client's data (code: of the round's batches, the shares smoothed
by one: ``label_counts=batches``). The teacher loss weights each sample by its own label's share, as the paper's
objective does; the code's broadcasting multiplies the batch-mean CE by the mean weight instead, a slip not offered
as an option. From the code, where the paper is silent: the
KL term and its direction, the decays, the sizes (MNIST: eps 32, hidden 256, Adam 3e-4, weight decay 1e-2, 50
generator steps of the client batch size, alpha = beta = 10, from the second round).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from fedray.methods.api import (ClientContext, ClientResult, ExperimentConfig, FeatureGenerator, IGNORE_LABEL,
                                LocalTraining, OptimSpec, ServerContext, StepwiseTraining, Trained, Update, Weights,
                                batch_rows, build_model, check_generator_batch, clone_weights, counts_field,
                                derive_seed, diversity_loss, kl_rows, label_counts, label_shares, make_optimizer,
                                model_field, module_dict, optim, row_mean, split_loss, weights_only)
from fedray.methods.fedavg import FedAvg, LabelCountUpload, ModelPayload, ModelState, counted_upload


class FedGenParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    alpha: float = Field(default=10.0, ge=0, description="weight of the generated-feature CE on the client")
    beta: float = Field(default=10.0, ge=0, description="weight of the latent KL term on the client")
    decay: float = Field(default=0.98, gt=0, le=1, description="alpha_t = alpha * decay^(t-1), beta_t alike")
    start_round: int = Field(default=2, ge=1, description="first round whose clients use the generator")
    gen_batch_size: int = Field(default=32, ge=1, description="generated features per client step")
    noise_dim: int = Field(default=32, ge=1)
    hidden: int = Field(default=256, ge=1, description="the generator's hidden layer")
    noise: Literal["normal", "uniform"] = Field(default="normal", description="normal: the paper; uniform: the code")
    gen_steps: int = Field(default=50, ge=0, description="server generator steps per round")
    gen_server_batch_size: int | None = Field(default=None, ge=2, description="labels per generator step; "
                                              "default federation.batch_size (the authors' code)")
    gen_lr: float = Field(default=3e-4, gt=0)
    gen_weight_decay: float = Field(default=1e-2, ge=0)
    gen_lr_decay: float = Field(default=0.98, gt=0, le=1, description="the generator's lr x this per round")
    diversity_weight: float = Field(default=1.0, ge=0, description="eta")
    label_counts: Literal["data", "batches"] = Field(
        default="data", description="data: the client's label counts (the paper); batches: the labels of the round's "
        "batches, the shares smoothed by one (the authors' code)")


@dataclass
class FedGenState(ModelState):
    """FedAvg's global model, the generator with its Adam state, and the labels any client has reported."""

    generator: Weights = field(default_factory=dict)
    labels_seen: torch.Tensor | None = None  # bool (C,)
    adam_step: int = 0
    adam_exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    adam_exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class FedGenPayload(ModelPayload):
    generator: Weights | None = model_field(against=None, default=None)  # None before start_round: not sent
    labels_seen: torch.Tensor | None = counts_field(default=None)  # bool (C,): which labels some client holds


@dataclass
class FedGenModules:
    model: torch.nn.Module
    generator: FeatureGenerator


class FedGen(FedAvg):
    name = "fedgen"

    @classmethod
    def uploads_label_counts(cls, params: BaseModel) -> bool:
        return True  # the clients' label counts (its generator's label weights)
    synchronous_because = "its generator learns from one round's heads together"
    Params = FedGenParams
    mean_only_because = ("its generator's teacher weighs each client's head per label by the label shares of the "
                         "uploaded counts, a weighting, not a mean a rule could replace")

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, params: BaseModel) -> None:
        check_generator_batch(params.gen_server_batch_size, "algorithm.gen_server_batch_size",
                              cfg.federation.batch_size)

    def make_generator(self, feature_dim: int) -> FeatureGenerator:
        p = self.params
        return FeatureGenerator(p.noise_dim, self.spec.num_classes, feature_dim, p.hidden)

    def build_modules(self) -> FedGenModules:
        model = build_model(self.cfg.model.name, self.spec.input_shape, self.spec.num_classes)  # first: FedAvg's w0
        return FedGenModules(model=model, generator=self.make_generator(model.feature_dim))

    def init_server_state(self, modules: FedGenModules) -> FedGenState:
        return FedGenState(weights=clone_weights(modules.model), generator=clone_weights(modules.generator),
                           labels_seen=torch.zeros(self.spec.num_classes, dtype=torch.bool))

    def regularised(self, round_: int) -> bool:
        return round_ >= self.params.start_round

    def broadcast(self, state: FedGenState, round_: int) -> FedGenPayload:
        if not self.regularised(round_) or not bool(state.labels_seen.any()):
            return FedGenPayload(weights=state.weights)
        return FedGenPayload(weights=state.weights, generator=state.generator, labels_seen=state.labels_seen)

    def draw_noise(self, n: int, g: torch.Generator) -> torch.Tensor:
        if self.params.noise == "uniform":
            return torch.rand(n, self.params.noise_dim, generator=g)
        return torch.randn(n, self.params.noise_dim, generator=g)

    def weight_at(self, value: float, round_: int) -> float:
        """alpha_t / beta_t: ``value`` x decay^(t-1), floored at 1e-4 as the authors' code floors it (0 stays 0)."""
        return max(min(value, 1e-4), value * self.params.decay ** (round_ - 1))

    # --- client -----------------------------------------------------------------------------------------------
    def client_samples(self, ctx: ClientContext) -> int:
        """Its batches, and each step ``gen_batch_size`` generated features through the classifier's head."""
        return super().client_samples(ctx) + ctx.num_local_steps() * self.params.gen_batch_size

    def server_samples(self, uploads: int) -> int:
        """The generator's steps, each batch through the generator and every uploaded head (Eq. 4)."""
        p = self.params
        return p.gen_steps * (p.gen_server_batch_size or self.cfg.federation.batch_size) * (1 + uploads)

    def client_update(self, ctx: ClientContext[FedGenModules], payload: FedGenPayload, state=None):
        plain = super().client_update(ctx, payload, state)
        if payload.generator is None:
            return plain  # FedAvg's local training
        return self.regularised_training(ctx, payload, plain)

    def regularised_training(self, ctx: ClientContext[FedGenModules], payload: FedGenPayload,
                             plain: LocalTraining) -> StepwiseTraining:
        p, fed = self.params, ctx.fed
        # The frozen generator runs on the host, where the step's other inputs are drawn (eval mode: its BatchNorm
        # uses the statistics the server's training left).
        gen = self.make_generator(ctx.modules.model.feature_dim)
        gen.load_state_dict(payload.generator)
        gen.eval()
        pool = payload.labels_seen.nonzero().flatten()
        batches, noise = ctx.batch_plan(), ctx.generator("fedgen/noise")
        y_host = batches.y.cpu()
        alpha_t, beta_t = self.weight_at(p.alpha, ctx.round), self.weight_at(p.beta, ctx.round)
        gen_ratio = p.gen_batch_size / fed.batch_size

        @torch.no_grad()
        def inputs(step: int) -> tuple[dict[str, torch.Tensor], tuple[bool, ...]]:
            y = y_host[batches.index[step]]
            f_real = gen(self.draw_noise(len(y), noise), y)  # G(eps', y) for the real batch's labels
            y_hat = pool[torch.randint(len(pool), (p.gen_batch_size,), generator=noise)]
            return {"f_real": f_real, "f_hat": gen(self.draw_noise(p.gen_batch_size, noise), y_hat),
                    "y_hat": y_hat}, (True,)

        def loss(mods: torch.nn.ModuleDict, inp: dict[str, torch.Tensor], flags: tuple):
            model, y = mods["model"], inp["y"]
            real = y != IGNORE_LABEL
            with batch_rows(real):
                logits = model(inp["x"])
            ce = F.cross_entropy(logits, y)
            gen_ce = F.cross_entropy(model.head(inp["f_hat"]), inp["y_hat"])
            with torch.no_grad():
                target = F.softmax(model.head(inp["f_real"]), dim=1)
            kl = row_mean(kl_rows(target, F.log_softmax(logits, dim=1)), real)
            total = ce + alpha_t * gen_ratio * gen_ce + beta_t * kl
            return total, {"train/loss": total, "train/ce": ce, "train/gen_ce": gen_ce, "train/gen_kl": kl}

        def finish(mods: torch.nn.ModuleDict, trained: Trained) -> ClientResult:
            return plain.finish(mods["model"], trained)

        if getattr(plain.finish, "weights_only", False):
            weights_only(finish)
        modules = module_dict(self, model=ctx.modules.model)
        plan = StepwiseTraining(modules=modules, start={"model": payload.weights},
                                # G(eps', y_i) pairs with example i (the KL term's target)
                                updates=[Update(loss, {"model": OptimSpec.of(fed)}, paired=("f_real",))],
                                steps=ctx.num_local_steps(),
                                inputs=inputs, finish=finish, batches=batches, paddable=True)

        def alone() -> ClientResult:
            """The sequential reference: FedAvg's runner (its optimizer, its batches) with the extra inputs."""
            model = modules["model"]
            model.load_state_dict(payload.weights)
            model.train()
            opt = make_optimizer(model.parameters(), fed)
            sums: dict[str, float] = {}
            steps = 0
            for step, (x, y) in enumerate(batches):
                extra, flags = inputs(step)
                opt.zero_grad()
                total, aux = split_loss(loss(modules, {"x": x, "y": y, **{k: v.to(x.device) for k, v in
                                                                             extra.items()}}, flags))
                total.backward()
                opt.step()
                for key, value in aux.items():
                    sums[key] = sums.get(key, 0.0) + value.detach()
                steps += 1
            return finish(modules, Trained({k: float(v) for k, v in sums.items()}, steps))

        plan.alone = alone
        return plan

    def make_upload(self, ctx: ClientContext, weights: Weights) -> LabelCountUpload:
        return counted_upload(ctx, weights, self.spec.num_classes, self.params.label_counts == "batches")

    # --- server -----------------------------------------------------------------------------------------------
    def server_update(self, state: FedGenState, uploads: list[LabelCountUpload],
                      ctx: ServerContext) -> tuple[FedGenState, dict[str, float]]:
        average = ctx.aggregation.mean([u.weights for u in uploads], [u.num_samples for u in uploads])
        counts = torch.stack([u.label_counts for u in uploads])
        seen = state.labels_seen | (counts.sum(0) > 0)  # a union of the labels held, not a mean: no aggregation rule
        new = dataclasses.replace(state, weights=average, labels_seen=seen)
        metrics: dict[str, float] = {}
        if self.params.gen_steps > 0:
            new, metrics = self.train_generator(new, uploads, counts, ctx)
        return new, metrics

    def head_stack(self, uploads: list[LabelCountUpload], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The uploaded models' last layers: weights (K, C, F) and biases (K, C)."""
        w = torch.stack([u.weights["head.weight"] for u in uploads]).to(device)
        b = torch.stack([u.weights["head.bias"] for u in uploads]).to(device)
        return w, b

    def train_generator(self, state: FedGenState, uploads: list[LabelCountUpload], counts: torch.Tensor,
                        ctx: ServerContext) -> tuple[FedGenState, dict[str, float]]:
        """``gen_steps`` Adam steps of L_G (module docstring) against the round's uploaded heads."""
        p, dev = self.params, ctx.device
        gen = ctx.modules.generator
        gen.load_state_dict(state.generator)
        gen.train()
        held = counts.sum(0) > 0
        # the authors' code counts from one, so every client has a share of every label some client drew
        shares = label_shares(counts + 1 if p.label_counts == "batches" else counts)[0]
        shares, labels = shares.to(dev), held.nonzero().flatten()
        w, b = self.head_stack(uploads, dev)
        params = dict(gen.named_parameters())
        opt = optim.Adam(list(params.values()), lr=p.gen_lr * p.gen_lr_decay ** (ctx.round - 1),
                         weight_decay=p.gen_weight_decay)
        for name, prm in params.items():
            if name in state.adam_exp_avg:
                opt.init_state(prm, state.adam_step, state.adam_exp_avg[name], state.adam_exp_avg_sq[name])
        rng = torch.Generator().manual_seed(derive_seed(ctx.seed, "fedgen/generator") % (1 << 63))
        batch = p.gen_server_batch_size or self.cfg.federation.batch_size
        sums = torch.zeros(2, device=dev)
        for _ in range(p.gen_steps):
            y = labels[torch.randint(len(labels), (batch,), generator=rng)].to(dev)
            eps = self.draw_noise(batch, rng).to(dev)
            out = gen(eps, y)
            logits = torch.einsum("bf,kcf->kbc", out, w) + b[:, None, :]
            ce = F.cross_entropy(logits.flatten(0, 1), y.repeat(len(uploads)), reduction="none").view(len(uploads), -1)
            teacher = (shares[:, y] * ce).mean(1).sum()
            div = diversity_loss(eps, out)
            opt.zero_grad()
            (teacher + p.diversity_weight * div).backward()
            opt.step()
            sums += torch.stack([teacher.detach(), div.detach()])
        steps = state.adam_step + p.gen_steps
        new = dataclasses.replace(
            state, generator=clone_weights(gen), adam_step=steps,
            adam_exp_avg={n: opt.state[q]["exp_avg"].detach().cpu().clone() for n, q in params.items()},
            adam_exp_avg_sq={n: opt.state[q]["exp_avg_sq"].detach().cpu().clone() for n, q in params.items()})
        teacher_mean, div_mean = (sums / p.gen_steps).tolist()
        metrics = {"server/gen_teacher_loss": teacher_mean, "server/gen_diversity": div_mean,
                   **self.generator_agreement(gen, state.weights, w, b, shares, labels, batch * 8, rng, dev)}
        return new, metrics

    @torch.no_grad()
    def generator_agreement(self, gen: FeatureGenerator, global_weights: Weights, w: torch.Tensor, b: torch.Tensor,
                            shares: torch.Tensor, labels: torch.Tensor, n: int, rng: torch.Generator,
                            dev: torch.device) -> dict[str, float]:
        """How often the trained generator's features (eval mode) are classified as their conditioning label by the
        new global model's head and by the label-share-weighted ensemble of the clients' heads
        (``server/gen_acc_*``)."""
        gen.eval()
        y = labels[torch.randint(len(labels), (n,), generator=rng)].to(dev)
        out = gen(self.draw_noise(n, rng).to(dev), y)
        glob = out @ global_weights["head.weight"].to(dev).T + global_weights["head.bias"].to(dev)
        ens = (shares[:, y].unsqueeze(-1) * F.softmax(torch.einsum("bf,kcf->kbc", out, w) + b[:, None, :], -1)).sum(0)
        return {"server/gen_acc_global": float((glob.argmax(1) == y).float().mean()),
                "server/gen_acc_teachers": float((ens.argmax(1) == y).float().mean())}
