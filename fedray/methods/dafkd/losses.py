"""DaFKD's adversarial losses (Sec. 3.2-3.4): the discriminator's f(theta^d; x), Eq. 2 (with Eq. 1 the
classifier's part of Eq. 9), Eq. 3 for the generator, the authors' optional gradient penalty, and what they draw.

Plain functions of the method's parameters and modules: the client's two runs (one client, or batched) and the
server's ensemble use them without reaching into the method's class. A padded batch (the batched runtime's) passes
``rows`` masks (:func:`~fedray.models.base.batch_rows`): every mean here is over the rows that count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedray.methods.api import batch_rows, frozen_bn_stats, row_mean, to_device
from fedray.methods.dafkd.types import DaFKDModules, DaFKDParams


def disc_logits(p: DaFKDParams, m: DaFKDModules, x: torch.Tensor, feats: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) logit of f(theta^d; x); f = sigmoid(logit) is the probability that x is real. With ``sharing`` the head
    reads the classifier's features (``feats`` when already computed), else the separate network reads x."""
    if p.sharing:
        return m.disc(m.model.features(x) if feats is None else feats).squeeze(1)
    return m.disc(x).squeeze(1)


def negative_logits(p: DaFKDParams, m: DaFKDModules, fake: torch.Tensor) -> torch.Tensor:
    """(B,) logit of f(theta^d; x) on Eq. 2's negatives ``fake`` (generated, or pooled images of p). With ``sharing``
    and ``disc_negatives_grad=detached`` the extractor reads them without gradient: the head still learns from them,
    but the classifier's extractor, which Eq. 9 trains with the discriminator, learns from the client's own images
    only (pooled negatives are other clients' images; without the cut they would train this client's classifier)."""
    if p.sharing and p.disc_negatives_grad == "detached":
        with torch.no_grad():  # no graph into the extractor at all (also under vmap, as the generator's no_grad)
            feats = m.model.features(fake)
        return disc_logits(p, m, fake, feats)
    return disc_logits(p, m, fake)


def fake_count(b: int | torch.Tensor) -> int | torch.Tensor:
    """Generated samples n_hat drawn against a real batch of ``b`` (Eq. 2): as many, but at least 2. The generator's
    BatchNorm runs on batch statistics, which one sample cannot give (a pass over a client's data may end on a
    one-sample batch). ``b`` may be a count on the device (a padded batch's real rows)."""
    return b.clamp_min(2) if isinstance(b, torch.Tensor) else max(b, 2)


def draw_labels(p: DaFKDParams, num_classes: int, n: int, rng: torch.Generator,
                device: torch.device) -> torch.Tensor | None:
    """Classes for the conditional generator, uniform (class-balanced); None for the DCGAN, which draws nothing
    more from ``rng``."""
    if p.generator != "conditional":
        return None
    return to_device(torch.randint(num_classes, (n,), generator=rng), device)


def bce(logits: torch.Tensor, target: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """Binary cross-entropy with logits, the mean over the rows where ``rows`` (bool) holds (a padded batch's real
    rows); None: over every row."""
    if rows is None:
        return F.binary_cross_entropy_with_logits(logits, target)
    return row_mean(F.binary_cross_entropy_with_logits(logits, target, reduction="none"), rows)


def disc_loss(p: DaFKDParams, m: DaFKDModules, x: torch.Tensor, feats: torch.Tensor, fake: torch.Tensor,
              real_rows: torch.Tensor | None = None, fake_rows: torch.Tensor | None = None,
              examples: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. 9's adversarial part (Eq. 1 + Eq. 2): the discriminator's BCE on real ``x`` (features ``feats``), labelled
    1, against generated ``fake``, labelled 0 (through :func:`negative_logits`: detached from the extractor with
    ``disc_negatives_grad=detached``); (loss, real logits, fake logits). ``real_rows``/``fake_rows`` (bool): the rows
    of padded batches that count; None: all of them. ``examples`` (DP-SGD's per-example call: ``x`` is one example
    of a batch of that many): the example's share of the batch's loss, (B bce(real) + sum of bce(fake)) / (B + F),
    so that its mean over the batch's examples is the batch's loss."""
    b = x.shape[0]
    with batch_rows(real_rows):
        d_real = disc_logits(p, m, x, feats)
    with frozen_bn_stats(m.model), batch_rows(fake_rows):  # generated images never enter the running statistics
        d_fake = negative_logits(p, m, fake)
    if examples is not None:
        real_term = F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
        fake_sum = F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake), reduction="sum")
        return (examples * real_term + fake_sum) / (examples + fake.shape[0]), d_real, d_fake
    target = torch.cat([torch.ones(b, device=x.device), torch.zeros(fake.shape[0], device=x.device)])
    rows = None if real_rows is None else torch.cat([real_rows, fake_rows])
    return bce(torch.cat([d_real, d_fake]), target, rows), d_real, d_fake


def gen_loss(p: DaFKDParams, m: DaFKDModules, z: torch.Tensor, labels: torch.Tensor | None,
             rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eq. 3, mean log(1 - f(G(z))) (``gen_loss=minimax``), or the non-saturating -mean log f(G(z)), of generated
    images against the discriminator; ``rows`` as :func:`disc_loss`'s ``fake_rows``. With ``gen_class_weight`` > 0
    (an extension, not the paper's) plus that weight times the cross-entropy of the client's classifier on
    G(z, y) against the asked class y. (loss, that cross-entropy or None)."""
    with frozen_bn_stats(m.model), batch_rows(rows):
        fake = m.generator(z, labels)
        d_gen = disc_logits(p, m, fake)
        visible = None
        if p.gen_class_weight > 0:  # the classifier reads the sample: its class must show (only G is stepped)
            ce = F.cross_entropy(m.model(fake), labels, reduction="none")
            visible = ce.mean() if rows is None else row_mean(ce, rows)
    if p.gen_loss == "nonsaturating":
        adv = bce(d_gen, torch.ones_like(d_gen), rows)  # -log f(G(z))
    else:
        adv = -bce(d_gen, torch.zeros_like(d_gen), rows)  # log(1 - f(G(z))), Eq. 3
    return (adv, None) if visible is None else (adv + p.gen_class_weight * visible, visible)


def gradient_penalty(p: DaFKDParams, m: DaFKDModules, real: torch.Tensor, fake: torch.Tensor,
                     rng: torch.Generator) -> torch.Tensor:
    """(||grad_x f(x_mix)||_2 - 1)^2 on random real/fake mixes, as the authors' code (on the sigmoid output; the
    norm here is per sample over all pixels, theirs over channels only)."""
    eps = to_device(torch.rand(real.shape[0], 1, 1, 1, generator=rng), real.device)
    mix = (eps * real + (1 - eps) * fake[: real.shape[0]]).requires_grad_(True)
    out = torch.sigmoid(disc_logits(p, m, mix))
    (grad,) = torch.autograd.grad(out.sum(), mix, create_graph=True)
    return ((grad.flatten(1).norm(2, dim=1) - 1) ** 2).mean()
