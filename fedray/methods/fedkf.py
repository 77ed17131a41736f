"""FedKF (Zhou et al., "Handling Data Heterogeneity in Federated Learning via Knowledge Distillation and
Fusion", IEEE IoT-J 2023): cached-model aggregation (T1) plus global-local knowledge fusion (T2).

Server (Alg. 1 lines 2-10): FedAvg's sample-weighted ACA model of this round's uploads (line 9) and the OCA
model over one cache slot per client (lines 7, 10), both from :mod:`fedray.learning.cached`.

Client, every local step on a real batch (x, y) (Alg. 1 lines 16-20), with the client's own persistent
generator g(theta_k) and z ~ N(0, I):

    x_hat = g(theta_k; z)
    student:    L   = CE(h(w_k; x), y) + gamma * KL(h(w_hat; x_hat) || h(w_k; x_hat))       (Eq. 6-8)
    generator:  L_G = L_IE + lambda1 * L_OH + lambda2 * L_A against the frozen teacher w_hat  (Eq. 2-5)
                L_OH = CE(t(x_hat), argmax t(x_hat))                                        (Eq. 2)
                L_IE = 1 + sum_c pbar_c log pbar_c / log C,  pbar = batch mean of softmax t(x_hat)  (Eq. 3)
                L_A  = -mean |f(w_hat; x_hat)|  over the teacher's pre-classifier features  (Eq. 4)

L_IE is Eq. 3 in the normalised form of the authors' code (0 for a uniform pbar, 1 for a one-hot one):
1 - IE(pbar) / log C, i.e. the negative entropy the paper describes, shifted and scaled by 1 / log C so that
lambda1 / lambda2 weigh it as in their experiments. L_A is the mean absolute activation, as in the
authors' code (Eq. 4's L1 norm divided by the feature dimension); ``activation_norm=l1`` gives Eq. 4 as
printed. KL is KL(teacher || student) at temperature 1 with batch-mean reduction.

One batch of generated samples per local step serves both updates (the student sees them detached), which
is what FedKF Table IX counts (generator: 1 forward, 1 backward per batch; classifiers: 3 and 3) and what
the authors' code does; the student is updated first and the generator second, as in that code. Without
``adversarial_kl`` the two updates do not depend on each other, so this equals Alg. 1's order (line 18,
then 19) on the same samples.

Variants (Sec. VI-A): ``fedkf``: the student starts from the ACA model, the teacher is the OCA model (two
models sent down); ``fedkf-``: the ACA model is both (one model sent down). Every evaluation round reports
both final models, ``eval/*_aca`` and ``eval/*_oca``; ``report_model`` picks which one ``eval/*`` and the
saved model are (default ``oca``, the paper's headline FedKF (OCA)).

The generator is client state: never uploaded, restored when the client is next sampled. By default its
Adam moments persist with it (the authors' code keeps one Adam optimiser per client for the whole run);
``persist_generator_optimizer=false`` restarts Adam every round and keeps only the weights (a third of the
memory). Every client starts from the same generator theta (Alg. 1 line 2), built from its own seed.

Options that reproduce the authors' code where it differs from the paper: ``cache_init=participated``,
``warmup_rounds=1`` (plain local training in the first round, no distillation), ``adversarial_kl=true``
(the generator also maximises the student-teacher KL; their CIFAR settings), ``noise_dim=1000`` (their
CIFAR settings). The code also gives every client the same number of steps per epoch (N / (K B)); set
``federation.local_steps`` to E * N / (K B) for that.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field

from fedray.methods.api import (CacheParams, ClientContext, ClientResult, ClientState, DAFLGenerator, IGNORE_LABEL,
                                LocalTraining, OptimSpec, Payload, StepwiseTraining, Trained, Update, Weights,
                                batch_rows, build_model, clone_weights, derive_seed, frozen_bn_stats, is_weights_only,
                                kd_kl, make_optimizer, model_field, module_dict, optim, to_device, weights_only, VALUE_RULES)
from fedray.methods.fedavg import FedAvg, ModelPayload


class FedKFParams(CacheParams):
    report_model: Literal["aca", "oca"] = Field(
        default="oca", description="model reported as eval/* and saved; both are always evaluated (eval/*_aca, "
        "eval/*_oca)")
    cache_init: Literal["initial", "participated"] = Field(
        default="initial", description="OCA slots of clients not seen yet: initial = hold w0 (paper); "
        "participated = left out (authors' code)")
    variant: Literal["fedkf", "fedkf-"] = Field(
        default="fedkf", description="fedkf: teacher = OCA model (two models sent down); fedkf-: teacher = ACA")
    gamma: float = Field(default=1.0, ge=0, description="weight of the KL distillation loss (Eq. 8)")
    lambda1: float = Field(default=0.1, ge=0, description="weight of the one-hot loss L_OH (Eq. 5)")
    lambda2: float = Field(default=0.1, ge=0, description="weight of the activation loss L_A (Eq. 5)")
    generator_lr: float = Field(default=1e-3, gt=0, description="Adam learning rate of the local generator (beta)")
    noise_dim: int = Field(default=100, ge=1, description="size of the generator's noise z")
    gen_width: int = Field(default=128, ge=2, description="the DAFL generator's channels w (w, then w/2; DAFL's and "
                           "the authors' code: 128)")
    generator_batch_size: int | None = Field(default=None, ge=1, description="generated samples per local step; "
                                             "default federation.batch_size")
    persist_generator_optimizer: bool = Field(default=True, description="keep the generator's Adam state across "
                                              "rounds with its weights (authors' code)")
    activation_norm: Literal["mean", "l1"] = Field(default="mean", description="L_A: mean |f| (code) or the "
                                                   "per-sample L1 norm of Eq. 4")
    adversarial_kl: bool = Field(default=False, description="generator also maximises gamma * KL(teacher || "
                                 "student) (authors' code on CIFAR)")
    warmup_rounds: int = Field(default=0, ge=0, description="rounds of plain local training before distillation "
                               "starts (authors' code: 1)")


@dataclass
class FedKFPayload(Payload):
    """What each active client receives: the ACA model, and the OCA model as teacher in variant fedkf."""

    weights: Weights = model_field(against=None)  # w^{t-1}, the student's start (ACA)
    # w_hat^{t-1} (OCA); None: the student start is the teacher (fedkf-, warmup)
    teacher: Weights | None = model_field(against=None, default=None)


@dataclass
class GeneratorState(ClientState):
    """A client's private state: its local generator theta_k (and its Adam moments). Never uploaded."""

    client_id: int
    weights: Weights  # parameters and BatchNorm buffers
    adam_step: int = 0  # Adam steps taken (bias correction); 0 = no optimizer state kept
    adam_exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)  # by parameter name
    adam_exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    rounds: int = 0  # rounds in which this client trained its generator


@dataclass
class FedKFModules:
    model: torch.nn.Module  # the student (local model)
    teacher: torch.nn.Module  # frozen during local training
    generator: DAFLGenerator  # holds whichever client's theta_k is being trained
    generator_init: Weights  # theta of Alg. 1 line 2, the same in every process


def kl_teacher_student(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(teacher) || softmax(student)), batch mean, temperature 1 (Eq. 6)."""
    return kd_kl(student_logits, teacher_logits)


def generator_losses(logits: torch.Tensor, features: torch.Tensor,
                     activation_norm: str = "mean") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(L_IE, L_OH, L_A) of Eq. 3, 2, 4 from the teacher's logits and pre-classifier features on x_hat."""
    num_classes = logits.shape[1]
    pbar = F.softmax(logits, dim=1).mean(dim=0)
    # Normalised negative entropy: 0 when pbar is uniform, 1 when one-hot (0 log 0 = 0 via the clamp).
    l_ie = 1.0 + (pbar * pbar.clamp_min(1e-12).log()).sum() / math.log(num_classes)
    l_oh = F.cross_entropy(logits, logits.argmax(dim=1))
    act = features.abs()
    l_a = -(act.mean() if activation_norm == "mean" else act.flatten(1).sum(dim=1).mean())
    return l_ie, l_oh, l_a


class FedKF(FedAvg):
    name = "fedkf"
    keeps_cache = True
    robust_means = ("weights",)  # FedAvg's server step (the ACA model), and the OCA model's mean over the cache
    synchronous_because = "its cache and teacher are built from one round's cohort"
    Params = FedKFParams

    @classmethod
    def robust_rules(cls, params: BaseModel) -> tuple[tuple[str, ...], str]:
        # the OCA model, every client's teacher, is built whatever report_model says: a mean over slots trained from
        # the models of older rounds, so only the rules that read no reference model apply
        return VALUE_RULES, ("its OCA model (the clients' teacher, built every round) averages cached models trained "
                             "from older rounds' models: no one reference for a rule of updates")

    @classmethod
    def caches(cls, params: BaseModel) -> bool:
        return True  # the OCA model is the teacher (fedkf) and is always evaluated

    # --- modules and state ------------------------------------------------------------------------
    def build_modules(self) -> FedKFModules:
        shape, classes = self.spec.input_shape, self.spec.num_classes
        model = build_model(self.cfg.model.name, shape, classes)  # first: w0 equals FedAvg's under one seed
        teacher = build_model(self.cfg.model.name, shape, classes)
        teacher.requires_grad_(False)
        # theta from its own seed, so every worker builds the same initial generator whatever came before.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.cfg.seed, "fedkf-generator-init") % (1 << 63))
            generator = DAFLGenerator(shape, self.params.noise_dim, self.spec.mean, self.spec.std,
                                      self.params.gen_width)
        return FedKFModules(model=model, teacher=teacher, generator=generator, generator_init=clone_weights(generator))

    def init_client_state(self, client_id: int) -> None:
        return None  # a client's generator is created from theta on its first distillation round

    def distills(self, round_: int) -> bool:
        return round_ > self.params.warmup_rounds

    def broadcast(self, state, round_: int) -> FedKFPayload:
        teacher = None
        if self.params.variant == "fedkf" and self.distills(round_):
            teacher = state.cache.oca
        return FedKFPayload(weights=state.weights, teacher=teacher)

    # --- client -----------------------------------------------------------------------------------
    def _load_generator(self, ctx: ClientContext,
                        state: GeneratorState | None) -> tuple[GeneratorState, optim.Adam]:
        mods: FedKFModules = ctx.modules
        if state is None:
            state = GeneratorState(client_id=ctx.client_id, weights=mods.generator_init)
        if state.client_id != ctx.client_id:
            raise RuntimeError(f"client {ctx.client_id} received the generator of client {state.client_id}")
        gen = mods.generator
        gen.load_state_dict(state.weights)
        gen.train()
        opt = optim.Adam(gen.parameters(), lr=self.params.generator_lr)
        if self.params.persist_generator_optimizer and state.adam_step > 0:
            for name, prm in gen.named_parameters():
                opt.init_state(prm, state.adam_step, state.adam_exp_avg[name], state.adam_exp_avg_sq[name])
        return state, opt

    def _save_generator(self, ctx: ClientContext, old: GeneratorState, opt: optim.Adam) -> GeneratorState:
        gen = ctx.modules.generator
        new = GeneratorState(client_id=old.client_id, weights=clone_weights(gen), rounds=old.rounds + 1)
        if self.params.persist_generator_optimizer:
            for name, prm in gen.named_parameters():
                st = opt.state.get(prm, {})
                if not st:
                    continue
                new.adam_step = int(st["step"])
                new.adam_exp_avg[name] = st["exp_avg"].detach().to("cpu", copy=True)
                new.adam_exp_avg_sq[name] = st["exp_avg_sq"].detach().to("cpu", copy=True)
        return new

    def client_samples(self, ctx: ClientContext) -> int:
        """Its batches, and each step a generated batch through the local generator, the teacher and the student."""
        p = self.params
        return super().client_samples(ctx) + ctx.num_local_steps() * (p.generator_batch_size or ctx.fed.batch_size)

    def client_update(self, ctx: ClientContext, payload: FedKFPayload,
                      state: GeneratorState | None) -> LocalTraining | StepwiseTraining:
        """The local step as data, for the runtime to run alone or batched over clients: warm-up rounds are
        FedAvg's; a distillation round is two updates per step, (1) the student and (2) the generator, on the batch
        and the noise :meth:`distill_alone` draws, with the generator's Adam state carried over from the client's
        state. :meth:`distill_alone` is the same round one client at a time, the reference the batched run meets."""
        if not self.distills(ctx.round):
            plan = super().client_update(ctx, ModelPayload(weights=payload.weights), None)
            fedavg_finish = plan.finish  # FedAvg's result, with the generator state left as it is

            def finish(m: torch.nn.Module, trained: Trained) -> ClientResult:
                return dataclasses.replace(fedavg_finish(m, trained), state=state)

            return dataclasses.replace(plan, finish=weights_only(finish) if is_weights_only(fedavg_finish) else finish)
        p = self.params
        mods: FedKFModules = ctx.modules
        received = state
        teacher = mods.teacher  # frozen and the same for every client of the round
        teacher.load_state_dict(payload.teacher if payload.teacher is not None else payload.weights)
        teacher.eval()
        if state is None:
            state = GeneratorState(client_id=ctx.client_id, weights=mods.generator_init)
        if state.client_id != ctx.client_id:
            raise RuntimeError(f"client {ctx.client_id} received the generator of client {state.client_id}")
        noise = ctx.generator("noise")
        gen_batch = p.generator_batch_size or ctx.fed.batch_size

        def inputs(step: int) -> tuple[dict[str, torch.Tensor], tuple[bool, ...]]:
            # x and y: the step's batch (``batches`` below); the noise stays on the host until the runtime has
            # stacked every client's
            return {"z": torch.randn(gen_batch, p.noise_dim, generator=noise)}, (True, True)

        def student_loss(m: torch.nn.ModuleDict, inp: dict[str, torch.Tensor], flags: tuple):  # Eq. 6-8
            # x_hat as client_update makes it; its running statistics are updated once, by the generator's update
            with torch.no_grad(), frozen_bn_stats(m["generator"]):
                x_hat = m["generator"](inp["z"])
                t_logits = teacher(x_hat)
            student = m["model"]
            with batch_rows(inp["y"] != IGNORE_LABEL):  # a padded batch (paddable): BatchNorm over its real rows
                ce = F.cross_entropy(student(inp["x"]), inp["y"])
            kl = kl_teacher_student(student(x_hat), t_logits)
            loss = ce + p.gamma * kl
            return loss, {"train/loss": loss, "train/ce": ce, "train/kl": kl}

        def generator_loss(m: torch.nn.ModuleDict, inp: dict[str, torch.Tensor], flags: tuple):  # Eq. 2-5
            x_hat = m["generator"](inp["z"])
            t_feat = teacher.features(x_hat)
            t_logits = teacher.head(t_feat)
            l_ie, l_oh, l_a = generator_losses(t_logits, t_feat, p.activation_norm)
            loss = l_ie + p.lambda1 * l_oh + p.lambda2 * l_a
            if p.adversarial_kl:
                loss = loss - p.gamma * kl_teacher_student(m["model"](x_hat), t_logits.detach())
            return loss, {"train/gen_loss": loss, "train/l_ie": l_ie, "train/l_oh": l_oh, "train/l_a": l_a}

        def finish(m: torch.nn.ModuleDict, trained: Trained) -> ClientResult:
            new = GeneratorState(client_id=state.client_id, weights=clone_weights(m["generator"]),
                                 rounds=state.rounds + 1)
            if p.persist_generator_optimizer:
                for key, st in trained.optimizer_state.items():
                    if key.startswith("generator."):
                        name = key.split(".", 1)[1]
                        new.adam_step = int(st["step"])
                        new.adam_exp_avg[name] = st["exp_avg"].to("cpu", copy=True)
                        new.adam_exp_avg_sq[name] = st["exp_avg_sq"].to("cpu", copy=True)
            steps = max(trained.steps, 1)
            return ClientResult(self.make_upload(ctx, clone_weights(m["model"])), new,
                                {k: v / steps for k, v in trained.sums.items()})

        kept = {}
        if p.persist_generator_optimizer and state.adam_step > 0:
            kept = {f"generator.{name}": {"step": state.adam_step, "exp_avg": state.adam_exp_avg[name],
                                          "exp_avg_sq": state.adam_exp_avg_sq[name]} for name in state.adam_exp_avg}
        return StepwiseTraining(
            modules=module_dict(self, model=mods.model, generator=mods.generator),
            start={"model": payload.weights, "generator": state.weights},
            updates=[Update(student_loss, {"model": OptimSpec.of(ctx.fed)}),
                     Update(generator_loss, {"generator": OptimSpec("adam", p.generator_lr)},
                            reads_examples=False)],  # the teacher and the student on generated samples only
            steps=ctx.num_local_steps(), inputs=inputs, finish=finish, optimizer_state=kept,
            batches=ctx.batch_plan(), paddable=True,  # the batch is read only by the cross-entropy, as above
            alone=lambda: self.distill_alone(ctx, payload, received))

    def distill_alone(self, ctx: ClientContext, payload: FedKFPayload, state: GeneratorState | None) -> ClientResult:
        """A distillation round's local training (Alg. 1 lines 4-8, Eq. 2-8) for one client by itself."""
        p = self.params
        mods: FedKFModules = ctx.modules
        student, teacher, gen = mods.model, mods.teacher, mods.generator
        student.load_state_dict(payload.weights)
        student.train()
        teacher.load_state_dict(payload.teacher if payload.teacher is not None else payload.weights)
        teacher.eval()
        state, opt_g = self._load_generator(ctx, state)
        opt_s = make_optimizer(student.parameters(), ctx.fed)
        noise = ctx.generator("noise")
        gen_batch = p.generator_batch_size or ctx.fed.batch_size
        sums = torch.zeros(7, dtype=torch.float64, device=ctx.device)  # on the device: no sync per step
        steps = 0
        for x, y in ctx.batches():
            z = to_device(torch.randn(gen_batch, p.noise_dim, generator=noise), ctx.device)
            x_hat = gen(z)
            t_feat = teacher.features(x_hat)
            t_logits = teacher.head(t_feat)
            # (1) student: local knowledge (CE on real data) + global knowledge (KL on generated data), Eq. 6-8
            ce = F.cross_entropy(student(x), y)
            kl = kl_teacher_student(student(x_hat.detach()), t_logits.detach())
            loss_s = ce + p.gamma * kl
            opt_s.zero_grad()
            loss_s.backward()
            opt_s.step()
            # (2) generator against the frozen teacher, Eq. 2-5
            l_ie, l_oh, l_a = generator_losses(t_logits, t_feat, p.activation_norm)
            loss_g = l_ie + p.lambda1 * l_oh + p.lambda2 * l_a
            if p.adversarial_kl:
                loss_g = loss_g - p.gamma * kl_teacher_student(student(x_hat), t_logits.detach())
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
            sums += torch.stack([t.detach() for t in (loss_s, ce, kl, loss_g, l_ie, l_oh, l_a)]).double()
            steps += 1
        new_state = self._save_generator(ctx, state, opt_g)
        student.zero_grad(set_to_none=True)
        mean = (sums / max(steps, 1)).cpu().tolist()
        keys = ("train/loss", "train/ce", "train/kl", "train/gen_loss", "train/l_ie", "train/l_oh", "train/l_a")
        return ClientResult(self.make_upload(ctx, clone_weights(student)), new_state, dict(zip(keys, mean)))
