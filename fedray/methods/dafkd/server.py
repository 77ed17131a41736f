"""DaFKD's server round (Algorithm 1, lines 9-13): Eq. 4 and 6 averages, Eq. 7 weights, Eq. 8 distillation.

Kept apart from :mod:`fedray.methods.dafkd.method` (the method's types and client) because it is the part
another distillation method would read: how a per-sample weighted teacher is built from either the
local models (main variant) or the clients' weighted outputs (Appendix B), and how it is distilled.
"""

from __future__ import annotations

import torch
from torch import nn

from fedray.methods.api import (DiagnosticProbe, KDSteps, ServerContext, Weights, clone_weights, derive_seed,
                                label_shares, normalised_entropy, optim, soft_targets, stacked_outputs)

from fedray.methods.dafkd.types import DaFKDMethod, DaFKDModules, DaFKDServerState, DaFKDUpload


def correlation_weights(f: torch.Tensor, eps: float) -> torch.Tensor:
    """Eq. 7: alpha_{k,i} = f_{k,i} / sum_j f_{j,i} for f of shape (K, N), guarded against a zero sum.

    ``eps`` is added to every f_{k,i} first, so a sample that every discriminator scores 0 gets uniform
    weights 1/K (and non-finite scores never arise); for f >> eps the change is below float precision.
    The Appendix B variant applies the same eps on the clients, so both variants agree.
    """
    w = f + eps
    return w / w.sum(0, keepdim=True)


def label_share_weights(counts: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The label-share oracle (``alpha_source=label_share``): alpha_{k,i} = client k's share of the round's
    training images of class y_i, from the clients' label counts (K, C) and the samples' classes y (N,); (K, N),
    uniform for a class no client of the round holds. Which client an image of class y most likely comes from:
    not Eq. 7 at Theorem 1's optimum (:func:`theorem1_weights`), which is flatter."""
    shares, held = label_shares(counts)
    alpha = shares[:, y.to(shares.device)]
    uniform = torch.full_like(alpha, 1.0 / counts.shape[0])
    return torch.where(held[y.to(held.device)].unsqueeze(0), alpha, uniform)


def theorem1_weights(counts: torch.Tensor, client_ids: list[int], y: torch.Tensor, eps: float) -> torch.Tensor:
    """Eq. 7 from Theorem 1's optimal discriminators f*_k(x) = p_k(x) / (p_k(x) + p(x)) under the run's label
    distributions: (K_t, N) weights of the round's clients ``client_ids`` for samples of classes ``y`` (N,).

    p is the generator's optimum in the proof of Theorem 1 (Appendix C): the centroid p = (1/K) sum_k p_k of all
    K registered clients' distributions, each weighing 1/K as in Eq. 5 whatever its size. Under label skew the
    clients share the class-conditionals q(x | y) and differ in their class distributions pi_k, p_k(x) =
    sum_y pi_k(y) q(x | y); for an x of class y, the classes' supports apart, f*_k(x) = pi_k(y) / (pi_k(y) + pi(y))
    with pi = (1/K) sum_k pi_k. ``counts`` (K, C): every registered client's training images per class. Eq. 7
    then normalises f*_k + eps over the round's clients as it does the discriminators' f: uniform for a class none
    of them holds."""
    counts = counts.to(torch.float64)
    pi_k = counts / counts.sum(1, keepdim=True).clamp_min(1.0)
    pi = pi_k.mean(0)
    own, mixture = pi_k[client_ids][:, y.to(counts.device)], pi[y.to(counts.device)]
    f = torch.where(mixture > 0, own / (own + mixture).clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    return correlation_weights(f, eps).float()


def alpha_metrics(alpha: torch.Tensor) -> dict[str, float]:
    """How peaked the weights (K, N) are: ``alpha_max_mean`` = mean_i max_k alpha (1/K uniform .. 1 one
    client), ``alpha_entropy`` = mean_i H(alpha_i) / log K (1 uniform .. 0 one client)."""
    return {"server/alpha_max_mean": float(alpha.max(0).values.mean()),
            "server/alpha_entropy": float(normalised_entropy(alpha, dim=0).mean())}


class _ClassifierAndDiscriminator(nn.Module):
    """The classifier and discriminator of :class:`DaFKDModules` as one module whose forward gives both
    outputs (logits, discriminator logit; or the logits alone without correlation), so the K uploaded
    pairs can be stacked and run as one functional call (state-dict keys ``model.*`` and ``disc.*``).

    The submodules are the method's own (reparametrised during the call), so the discriminator is applied
    by the method's :meth:`DaFKD.disc_logits`, on the shared extractor's features or on x."""

    def __init__(self, algo: DaFKDMethod, modules: "DaFKDModules"):
        super().__init__()
        self.algo, self.mods = algo, modules
        self.model = modules.model
        self.with_disc = algo.weighting == "discriminator"
        if self.with_disc:
            self.disc = modules.disc

    def forward(self, x: torch.Tensor):
        feats = self.model.features(x)
        logits = self.model.head(feats)
        if not self.with_disc:
            return logits
        return logits, self.algo.disc_logits(self.mods, x, feats)


def stacked_client_outputs(algo: DaFKDMethod, modules: "DaFKDModules", uploads: list["DaFKDUpload"],
                           x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """s_k(x_i) (K, N, C) and f_k(x_i) (K, N) (None without correlation) of every upload's classifier and
    discriminator in eval mode: :meth:`DaFKD.client_outputs` for all K clients as one stacked forward per
    batch (:mod:`fedray.learning.ensemble`) instead of K loads and forwards."""
    p = algo.params
    pair = _ClassifierAndDiscriminator(algo, modules)
    teachers = []
    for u in uploads:
        w = {f"model.{k}": v for k, v in u.weights.items()}
        if pair.with_disc:
            w.update({f"disc.{k}": v for k, v in u.disc.items()})
        teachers.append((pair, w))
    outs = stacked_outputs(teachers, x, algo.cfg.federation.eval_batch_size)
    logits = outs[0]
    s = soft_targets(logits, p.temperature) if p.ensemble == "probs" else logits
    return s, (torch.sigmoid(outs[1]) if pair.with_disc else None)


def ensemble_teacher(algo: DaFKDMethod, uploads: list["DaFKDUpload"], x: torch.Tensor, ctx: ServerContext,
                     y: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Teacher targets (N, C): sum_k alpha_{k,i} s_k(x_i), with s = probabilities or logits (``ensemble``) and
    alpha from the discriminators (Eq. 7), Theorem 1's optimal discriminators or the label-share oracle (both from
    the samples' classes ``y``), or uniform (:attr:`DaFKD.weighting`)."""
    p = algo.params
    if p.private_discriminator:  # Appendix B: sum_k (f_k + eps) s_k / sum_k (f_k + eps)
        # Appendix B's secure-aggregation sums (sum_k f_k s_k, sum_k f_k), a ratio of sums in float32, outside the
        # aggregation hook as the main variant's per-sample Eq. 7 ensemble is
        num = torch.stack([u.weighted_outputs.to(ctx.device) for u in uploads]).sum(0)
        if p.correlation:
            w = torch.stack([u.output_weights.to(ctx.device) for u in uploads])  # (K, N), f_k + eps
            alpha, teacher = w / w.sum(0, keepdim=True), num / w.sum(0).unsqueeze(1)
            scores = w - p.alpha_eps
        else:
            alpha = torch.full((len(uploads), x.shape[0]), 1.0 / len(uploads), device=ctx.device)
            teacher, scores = num / len(uploads), None
    else:  # main variant: run every uploaded classifier and discriminator on the distillation set, stacked
        s, f = stacked_client_outputs(algo, ctx.modules, uploads, x)  # (K, N, C), (K, N)
        if algo.weighting == "discriminator":
            scores = f
            alpha = correlation_weights(scores, p.alpha_eps)  # Eq. 7
        elif algo.weighting == "label_share":
            assert y is not None, "the oracle needs the distillation samples' classes (check_config)"
            scores, alpha = None, label_share_weights(torch.stack([u.label_counts for u in uploads]), y).to(s.device)
        elif algo.weighting == "theorem1":
            assert y is not None and algo.client_label_counts is not None, "theorem1 needs classes and counts"
            scores = None
            alpha = theorem1_weights(algo.client_label_counts, [u.client_id for u in uploads], y,
                                     p.alpha_eps).to(s.device)
        else:  # Table 3 no-correlation: plain ensemble
            scores, alpha = None, torch.full(s.shape[:2], 1.0 / len(uploads), device=ctx.device)
        teacher = (alpha.unsqueeze(2) * s).sum(0)
    metrics = alpha_metrics(alpha)
    if scores is not None:
        metrics["server/disc_score_mean"] = float(scores.mean())  # how real the discriminators find x_hat
    return teacher, metrics


def distil(algo: DaFKDMethod, start: Weights, x: torch.Tensor, teacher_probs: torch.Tensor,
           ctx: ServerContext) -> tuple[Weights, dict[str, float]]:
    """Eq. 8: from w_hat, minimise KL(teacher || s(w; x)) (temperature KD, batch mean) over the set.

    The student stays in eval mode: BatchNorm running statistics remain those averaged from the clients'
    real data, and generated batches never enter them. Batches are drawn without replacement from a
    seeded permutation (reshuffled after each pass). With ``ctx.cuda_graphs`` on a GPU and SGD, the step (the
    same kernels on another batch index) is replayed as a CUDA graph after two eager ones: the same numbers.
    """
    p, model = algo.params, ctx.modules.model
    model.load_state_dict(start)
    model.eval()
    opt = (optim.Adam(model.parameters(), lr=p.distill_lr) if p.distill_optimizer == "adam"
           else optim.SGD(model.parameters(), lr=p.distill_lr, momentum=0.9))
    rng = torch.Generator().manual_seed(derive_seed(ctx.seed, "dafkd/distill-batches") % (1 << 63))
    n, bs = x.shape[0], p.distill_batch_size

    # the authors' nn.KLDivLoss() (kd_reduction "mean") averages over the classes as well
    steps = KDSteps(model, opt, lambda idx: x[idx], teacher_probs, p.temperature, ctx.device, ctx.cuda_graphs,
                    "DaFKD's distillation step", teacher_probs.shape[1] if p.kd_reduction == "mean" else 1.0)
    perm, pos, losses = torch.randperm(n, generator=rng), 0, []
    with steps.running():
        for s in range(p.distill_steps):
            if pos >= n:
                perm, pos = torch.randperm(n, generator=rng), 0
            losses.append(steps.step(perm[pos : pos + bs], p.distill_steps - s))
            pos += bs
    if not losses:
        return start, {}
    t = torch.stack(losses)
    return clone_weights(model), {"server/kd_loss": float(t.mean()), "server/kd_loss_first": float(t[0]),
                                  "server/kd_loss_last": float(t[-1])}


def server_round(algo: DaFKDMethod, state: "DaFKDServerState", uploads: list["DaFKDUpload"],
                 ctx: ServerContext) -> tuple["DaFKDServerState", dict[str, float]]:
    p = algo.params
    coefs = [1.0] * len(uploads) if p.aggregation == "uniform" else [float(u.num_samples) for u in uploads]
    average = ctx.aggregation.mean([u.weights for u in uploads], coefs)  # Eq. 6
    generator = ctx.aggregation.mean([u.generator for u in uploads], coefs)  # Eq. 4
    # disc_head=averaged: one head for every client, averaged (the authors' code passes one from client to client)
    head = ctx.aggregation.mean([u.disc for u in uploads], coefs) if p.disc_head == "averaged" else None
    weights, metrics = average, {}
    if ctx.round >= p.distill_start_round:
        # the set comes from the generator broadcast this round (the clients' theta^g_t), not the new average
        x, y = algo.distillation_data(ctx.modules, state.generator, ctx.round, ctx.device)
        teacher, metrics = ensemble_teacher(algo, uploads, x, ctx, y)
        if y is not None:  # how often the teacher reads a sample as the class it was generated for (or is, proxy)
            metrics["server/teacher_label_agreement"] = float((teacher.argmax(1) == y).float().mean())
        probs = teacher if p.ensemble == "probs" else soft_targets(teacher, p.temperature)
        weights, kd = distil(algo, average, x, probs, ctx)
        metrics.update(kd)
    new = DaFKDServerState(weights=weights, generator=generator, average=average if p.eval_average else None,
                           disc=head)
    return new, metrics


def _auc(pos: torch.Tensor, neg: torch.Tensor) -> float:
    """P(score of a positive > score of a negative), ties counting 1/2 (the Mann-Whitney AUC)."""
    diff = pos.unsqueeze(1) - neg.unsqueeze(0)
    return float((diff > 0).float().mean() + 0.5 * (diff == 0).float().mean())


def probe_diagnostics(algo: DaFKDMethod, uploads: list["DaFKDUpload"], probe: "DiagnosticProbe",
                      client_ids: list[int], ctx: ServerContext) -> dict[str, float]:
    """Does the mechanism work, on real images (simulation-only ``diag/*``; the method never sees them)?

    - ``diag/domain_auc``: how well each client's discriminator ranks its own real training images above the
      other aggregated clients' (mean over clients; 0.5 = cannot tell them apart).
    - ``diag/alpha_entropy_real``: Eq. 7's normalised weight entropy on real test images (1 = uniform).
    - ``diag/ens_acc_eq7`` / ``_uniform`` / ``_theorem1`` / ``_label_share``: test accuracy of the ensemble of
      this round's local models weighted by Eq. 7, uniformly, by Eq. 7 at Theorem 1's optimal discriminators
      (:func:`theorem1_weights`, from the test image's true class), and by client k's share of the training
      images of that class (which client the image most likely comes from).
    """
    p = algo.params
    if algo.weighting != "discriminator" or p.private_discriminator or len(uploads) < 2:
        return {}  # no discriminators at the server (Appendix B keeps them on the clients)
    own_x = [probe.client_x[c] for c in client_ids]
    s, f_test = stacked_client_outputs(algo, ctx.modules, uploads, probe.test_x)
    # f_k on client j's real images: every client's images in one stacked forward, split back per client
    f_all = stacked_client_outputs(algo, ctx.modules, uploads, torch.cat(own_x))[1]
    f_own = [list(f_k.split([len(xj) for xj in own_x])) for f_k in f_all]
    counts = probe.label_counts[client_ids][:, probe.test_y]  # (K, N): client k's images of x_i's class
    theorem1 = theorem1_weights(probe.label_counts, client_ids, probe.test_y, p.alpha_eps).to(s.device)
    return mechanism_figures(s, f_test, f_own, counts, probe.test_y, p.alpha_eps, theorem1)


def mechanism_figures(s: torch.Tensor, f: torch.Tensor, f_own: list[list[torch.Tensor]], counts: torch.Tensor,
                      y: torch.Tensor, eps: float, theorem1: torch.Tensor) -> dict[str, float]:
    """The figures of :func:`probe_diagnostics` from the K clients' outputs s (K, N, C) and discriminator
    scores f (K, N) on N test images of labels y, their scores ``f_own[k][j]`` on client j's images,
    ``counts`` (K, N): client k's training images of image i's class, and Theorem 1's weights (K, N)."""
    k_ = len(f_own)
    aucs = [_auc(f_own[k][k], torch.cat([f_own[k][j] for j in range(k_) if j != k])) for k in range(k_)]
    alpha = correlation_weights(f, eps)
    shares = counts / counts.sum(0, keepdim=True).clamp_min(1.0)

    def accuracy(weights: torch.Tensor) -> float:
        return float(((weights.unsqueeze(2) * s).sum(0).argmax(1) == y).float().mean())

    return {"diag/domain_auc": float(sum(aucs) / k_),
            "diag/alpha_entropy_real": float(normalised_entropy(alpha, dim=0).mean()),
            "diag/ens_acc_eq7": accuracy(alpha),
            "diag/ens_acc_uniform": accuracy(torch.full_like(alpha, 1.0 / k_)),
            "diag/ens_acc_theorem1": accuracy(theorem1),
            "diag/ens_acc_label_share": accuracy(shares)}
