"""DaFKD's client (Alg. 1 lines 17-26), one client at a time (:func:`sequential_update`, ``DaFKD.client_update``)
and as data the runtime can batch over clients (:func:`batched_local_step`, ``runtime.vectorize``): per local step
two updates, (1) classifier and discriminator on Eq. 9, then (2) the generator on Eq. 3 against the just-updated
discriminator, on the batch and the noise drawn in the order :func:`sequential_update` draws them. The sequential
update is the reference; both use the same losses (:mod:`fedray.methods.dafkd.losses`), metrics
(:func:`client_metrics`) and upload (:func:`client_result`), so the two cannot drift apart.

The step is ``paddable``: a short batch may come padded to the step's longest (rows labelled ``IGNORE_LABEL``),
its noise (and conditional labels) with zero rows to the longest client's. The losses then count the real rows
only: the batch's real rows are those not labelled so, and of the generated ones the first ``fake_count`` of
them, as drawn; BatchNorm layers normalise by those rows alone (``batch_rows``), as do the means of the losses
and the discriminator's accuracy counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedray.methods.api import (ClientContext, ClientResult, EXAMPLES, IGNORE_LABEL, OptimSpec, StepwiseTraining, Trained,
                                Update, batch_rows, clone_weights, frozen_bn_stats, label_counts, module_dict, optim,
                                to_device, to_float, weights_only)

from fedray.methods.dafkd.losses import disc_loss, draw_labels, fake_count, gen_loss, gradient_penalty
from fedray.methods.dafkd.types import DaFKDClientState, DaFKDMethod, DaFKDModules, DaFKDPayload, DaFKDUpload


def adversarial_steps(algo: DaFKDMethod, ctx: ClientContext) -> tuple[bool, bool, int]:
    """(train D this round, train G this round, local steps with D/G updates)."""
    p = algo.params
    round_d = p.disc_train_rounds is None or ctx.round <= p.disc_train_rounds
    round_g = p.gen_train_rounds is None or ctx.round <= p.gen_train_rounds
    adv_steps = ctx.num_local_steps()  # the authors' code: adversarial steps in the first local epochs only
    if p.gan_local_epochs is not None:
        adv_steps = min(adv_steps, p.gan_local_epochs * -(-ctx.num_samples // ctx.fed.batch_size))
    return round_d, round_g, adv_steps


def local_optimizer(groups: list[dict], fed) -> optim.SGD | optim.Adam:
    """``federation.*``'s optimizer over the classifier's and the discriminator's parameter groups (each its lr)."""
    if fed.optimizer == "adam":
        return optim.Adam(groups, weight_decay=fed.weight_decay)
    return optim.SGD(groups, momentum=fed.momentum, weight_decay=fed.weight_decay)


def generator_weight_decay(algo: DaFKDMethod, fed) -> float:
    """The generator's weight decay: ``gen_weight_decay``, else ``federation.weight_decay`` (the classifier's)."""
    wd = algo.params.gen_weight_decay
    return fed.weight_decay if wd is None else wd


def batched_local_step(algo: DaFKDMethod, ctx: ClientContext, payload: "DaFKDPayload",
                       state: "DaFKDClientState") -> StepwiseTraining | None:
    """This client's local training as a :class:`StepwiseTraining`; None with the gradient penalty (a gradient
    inside the loss, which ``vmap`` cannot batch here): that runs sequentially."""
    p, m, fed = algo.params, ctx.modules, ctx.fed
    if p.gp_weight > 0:
        return None
    assert state.client_id == ctx.client_id, "a client received another client's discriminator"
    round_d, round_g, adv_steps = adversarial_steps(algo, ctx)
    batches, noise = ctx.batch_plan(), ctx.generator("dafkd/noise")
    negatives = pooled_negatives(algo, ctx)
    pooled = negatives is not None

    def inputs(step: int) -> tuple[dict[str, torch.Tensor], tuple[bool, ...]]:
        # x and y are the step's batch (``batches``, gathered by the runtime); the noise is drawn here on the host,
        # in sequential_update's order of draws, and the runtime stacks it over clients before one copy to the device
        b, inp = fake_count(len(batches.index[step])), {}
        train_d, train_g = round_d and step < adv_steps, round_g and step < adv_steps
        for flag, key in ((train_d, "fake"), (train_g, "gen")):
            if flag and key == "fake" and pooled:  # real images of p stand in for the generator's samples
                inp["x_neg"] = negatives(b, noise, torch.device("cpu"))
            elif flag:
                inp[f"z_{key}"] = torch.randn(b, p.noise_dim, generator=noise)
                labels = draw_labels(p, algo.spec.num_classes, b, noise, torch.device("cpu"))
                if labels is not None:
                    inp[f"labels_{key}"] = labels
        return inp, (True, train_g, train_d)

    def view(mods: nn.ModuleDict) -> DaFKDModules:
        return DaFKDModules(model=mods["model"], generator=mods["generator"], disc=mods["disc"])

    def rows(inp: dict[str, torch.Tensor], noise: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The real rows of the step's batch and of its generated batch from ``inp[noise]`` (bool masks); under
        DP-SGD's per-example calls the generated batch is the whole batch's (never padded)."""
        real = inp["y"] != IGNORE_LABEL
        drawn = fake_count(inp[EXAMPLES] if EXAMPLES in inp else real.sum())
        return real, torch.arange(inp[noise].shape[0], device=real.device) < drawn

    def classifier_loss(mods: nn.ModuleDict, inp: dict[str, torch.Tensor], flags: tuple):  # Eq. 9
        mm = view(mods)
        real, fake_rows = rows(inp, "x_neg" if pooled else "z_fake") if flags[2] else (inp["y"] != IGNORE_LABEL, None)
        with batch_rows(real):
            feats = mm.model.features(inp["x"])
        ce = F.cross_entropy(mm.model.head(feats), inp["y"])  # IGNORE_LABEL rows left out
        if not flags[2]:
            return ce, {"ce": ce}
        if pooled:
            fake = inp["x_neg"]
        else:
            with torch.no_grad(), batch_rows(fake_rows):
                fake = mm.generator(inp["z_fake"], inp.get("labels_fake"))
        adv, d_real, d_fake = disc_loss(p, mm, inp["x"], feats, fake, real, fake_rows, inp.get(EXAMPLES))
        return ce + adv, {"ce": ce, "adv": adv, "real_ok": ((d_real.detach() > 0) & real).sum().float(),
                          "fake_ok": ((d_fake.detach() < 0) & fake_rows).sum().float(), "n": real.sum().float()}

    def generator_loss(mods: nn.ModuleDict, inp: dict[str, torch.Tensor], flags: tuple):  # Eq. 3
        g_loss, visible = gen_loss(p, view(mods), inp["z_gen"], inp.get("labels_gen"), rows(inp, "z_gen")[1])
        return g_loss, ({"gen": g_loss} if visible is None else {"gen": g_loss, "gen_class": visible})

    def finish(mods: nn.ModuleDict, trained: Trained) -> ClientResult:
        metrics = client_metrics({**trained.sums, "steps": trained.steps}, round_d, round_g, adv_steps)
        return client_result(algo, ctx, view(mods), payload, state, metrics)

    if not p.private_discriminator:  # then client_result only clones the weights; else it runs the trained modules
        weights_only(finish)

    gen_spec = OptimSpec("adam", p.gen_lr, weight_decay=generator_weight_decay(algo, fed), betas=(0.5, 0.999))
    return StepwiseTraining(
        modules=module_dict(algo, model=m.model, generator=m.generator, disc=m.disc),
        start={"model": payload.weights, "generator": payload.generator, "disc": _disc_start(payload, state)},
        updates=[Update(classifier_loss, {"model": OptimSpec.of(fed), "disc": OptimSpec.of(fed, lr=p.disc_lr)},
                        trains=lambda flags: {"model", "disc"} if flags[2] else {"model"}),
                 Update(generator_loss, {"generator": gen_spec}, reads_examples=False)],  # against D: no example
        steps=ctx.num_local_steps(), inputs=inputs, finish=finish, batches=batches, paddable=True)


def sequential_update(algo: DaFKDMethod, ctx: ClientContext, payload: "DaFKDPayload",
                      state: "DaFKDClientState") -> ClientResult:
    """Lines 17-26 one client at a time: ``DaFKD.client_update``, the reference :func:`batched_local_step` matches
    (and what runs with the gradient penalty)."""
    assert state.client_id == ctx.client_id, "a client received another client's discriminator"
    p, m, fed, dev = algo.params, ctx.modules, ctx.fed, ctx.device
    m.model.load_state_dict(payload.weights)  # line 17: w_t^k = w_t, theta^g_k = theta^g_t
    m.generator.load_state_dict(payload.generator)
    m.disc.load_state_dict(_disc_start(payload, state))  # line 18: theta^d_k from this client's previous round
    for module in (m.model, m.generator, m.disc):
        module.train()
    opt = local_optimizer([{"params": list(m.model.parameters()), "lr": fed.lr},
                                 {"params": list(m.disc.parameters()), "lr": p.disc_lr}], fed)
    gen_params, disc_params = list(m.generator.parameters()), list(m.disc.parameters())
    # disc_negatives_grad=detached: the negatives (and the gradient penalty's mixes with them) train the head only
    detached, head_grads = p.sharing and p.disc_negatives_grad == "detached", None
    opt_g = optim.Adam(gen_params, lr=p.gen_lr, betas=(0.5, 0.999), weight_decay=generator_weight_decay(algo, fed))
    noise, gp_rng = ctx.generator("dafkd/noise"), ctx.generator("dafkd/gp")
    negatives = pooled_negatives(algo, ctx)
    tot = {"ce": 0.0, "adv": 0.0, "gen": 0.0, "real_ok": 0.0, "fake_ok": 0.0, "n": 0, "steps": 0}
    round_d, round_g, adv_steps = adversarial_steps(algo, ctx)
    for x, y in ctx.batches():  # lines 19-25
        train_d = round_d and tot["steps"] < adv_steps
        train_g = round_g and tot["steps"] < adv_steps
        b = x.shape[0]
        opt.zero_grad()
        feats = m.model.features(x)
        ce = F.cross_entropy(m.model.head(feats), y)
        loss = ce
        if train_d:  # Eq. 9 = Eq. 1 + Eq. 2
            nf = fake_count(b)
            if negatives is not None:  # real images of p stand in for the generator's samples
                fake = negatives(nf, noise, dev)
            else:
                with torch.no_grad():
                    fake = m.generator(to_device(torch.randn(nf, p.noise_dim, generator=noise), dev),
                                       draw_labels(p, algo.spec.num_classes, nf, noise, dev))
            adv, d_real, d_fake = disc_loss(p, m, x, feats, fake)
            if p.gp_weight > 0:
                with frozen_bn_stats(m.model):
                    penalty = p.gp_weight * gradient_penalty(p, m, x, fake, gp_rng)
                if detached:  # the penalty reads mixes with the negatives through the extractor: the head's alone
                    head_grads = torch.autograd.grad(penalty, disc_params)
                    tot["adv"] += float(penalty.detach())
                else:
                    adv = adv + penalty
            loss = ce + adv
            tot["adv"] += float(adv.detach())
            tot["real_ok"] += float((d_real.detach() > 0).sum())
            tot["fake_ok"] += float((d_fake.detach() < 0).sum())
            tot["n"] += b
        loss.backward()
        if head_grads is not None:
            for prm, g in zip(disc_params, head_grads):
                prm.grad = g if prm.grad is None else prm.grad + g
            head_grads = None
        opt.step()
        if train_g:  # Eq. 3 against the just-updated discriminator; only theta^g_k moves
            nf = fake_count(b)
            z = to_device(torch.randn(nf, p.noise_dim, generator=noise), dev)
            g_loss, visible = gen_loss(p, m, z, draw_labels(p, algo.spec.num_classes, nf, noise, dev))
            for prm, g in zip(gen_params, torch.autograd.grad(g_loss, gen_params)):
                prm.grad = g
            opt_g.step()
            tot["gen"] += float(g_loss.detach())
            if visible is not None:
                tot["gen_class"] = tot.get("gen_class", 0.0) + float(visible.detach())
        tot["ce"] += float(ce.detach())
        tot["steps"] += 1

    return client_result(algo, ctx, m, payload, state, client_metrics(tot, round_d, round_g, adv_steps))


def pooled_negatives(algo: DaFKDMethod, ctx: ClientContext):
    """``disc_negatives=pooled``: a function drawing n real images of the mixture p of every client's data
    (normalised, on a device) with the client's noise generator; None for the method's own negatives."""
    if algo.params.disc_negatives != "pooled":
        return None
    assert ctx.pooled is not None, "the runtime hands every client's images to a method that wants them"

    def draw(n: int, rng: torch.Generator, device: torch.device) -> torch.Tensor:
        return to_float(ctx.pooled.draw(n, rng), algo.spec.mean, algo.spec.std).to(device)
    return draw


def _disc_start(payload: "DaFKDPayload", state: "DaFKDClientState"):
    """The discriminator a client starts its round from: its own from its previous round (Alg. 1 line 18), or
    the server's averaged head (``disc_head=averaged``: one head for all, as the authors' code has)."""
    return payload.disc if payload.disc is not None else state.disc


def client_metrics(tot: dict[str, float], round_d: bool, round_g: bool, adv_steps: int) -> dict[str, float]:
    """``train/*`` from the local steps' sums (ce, adv, gen, real_ok, fake_ok, n, gen_class if any; steps)."""
    steps = max(int(tot["steps"]), 1)
    metrics = {"train/loss": tot["ce"] / steps}
    if round_d and tot.get("n"):
        metrics.update({"train/disc_loss": tot["adv"] / min(steps, adv_steps),
                        "train/disc_acc_real": tot["real_ok"] / tot["n"],
                        "train/disc_acc_fake": tot["fake_ok"] / tot["n"]})
    if round_g and adv_steps:
        metrics["train/gen_loss"] = tot["gen"] / min(steps, adv_steps)
        if "gen_class" in tot:  # gen_class_weight > 0: the classifier's cross-entropy on G(z, y), inside gen_loss
            metrics["train/gen_class_loss"] = tot["gen_class"] / min(steps, adv_steps)
    return metrics


def client_result(algo: DaFKDMethod, ctx: ClientContext, m: "DaFKDModules", payload: "DaFKDPayload",
                  state: "DaFKDClientState", metrics: dict[str, float]) -> ClientResult:
    """Upload and new state from the trained modules ``m`` (Alg. 1 line 26; Appendix B's outputs)."""
    p, dev = algo.params, ctx.device
    disc_w = clone_weights(m.disc)
    upload = DaFKDUpload(weights=clone_weights(m.model), generator=clone_weights(m.generator),
                         num_samples=ctx.num_samples)
    if p.private_discriminator:  # Appendix B: the same seeded samples as the server, from theta^g_t
        x_hat = algo.distillation_set(m, payload.generator, payload.distill_seed, dev)
        s, f = algo.client_outputs(m, x_hat)  # m still holds this client's trained w and theta^d
        w = None if f is None else (f + p.alpha_eps)
        upload.weighted_outputs = (s if w is None else w.unsqueeze(1) * s).cpu()
        upload.output_weights = None if w is None else w.cpu()
    elif algo.weighting == "discriminator" or p.disc_head == "averaged":
        upload.disc = disc_w
    if algo.weighting == "label_share":  # the label-share oracle weighs by them (sent, so counted in comm/bytes_up)
        upload.label_counts = label_counts(ctx.y, algo.spec.num_classes)
    elif algo.weighting == "theorem1":  # the server holds every client's counts (sent once, before round 1)
        upload.client_id = ctx.client_id
    new_state = DaFKDClientState(client_id=ctx.client_id, disc=disc_w, rounds=state.rounds + 1)
    return ClientResult(upload=upload, state=new_state, metrics=metrics)
