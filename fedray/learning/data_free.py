"""What the generator-based data-free baselines (FedGen, FedFTG) share: the clients' label counts, the class-level
weights built from them, the labels the server draws, and the generators' diversity term.

- **Label counts** (FedGen's per-client label distribution; FedFTG's n_k^y): each client uploads how many of its
  samples carry each label, a (C,) int64 tensor counted in ``comm/bytes_up``. The server thus learns every
  participating client's label distribution, the leak FedKF's Def. 4 counts against these methods.
- **Label shares** w_{k,y} = n_k^y / sum_j n_j^y over the round's clients: FedGen's per-label teacher weights and
  FedFTG's class-level ensemble weights (alpha_k^y). Each label some client holds has shares summing to one.
- **Diversity** (FedGen's L_div, FedFTG's L_dis, after Mao et al.'s mode-seeking term): ``exp(-mean_ij d_noise(i, j)
  * d_out(i, j))`` over the pairs of a batch, d_noise the mean squared and d_out the mean absolute difference of
  two rows; it falls as outputs drawn from different noise move apart.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedray.errors import ConfigError


def label_counts(y: Tensor, num_classes: int) -> Tensor:
    """(C,) int64: how many of ``y``'s labels are each class (on the CPU: what a client uploads)."""
    return torch.bincount(y.detach().to("cpu", torch.int64), minlength=num_classes)[:num_classes]


def label_shares(counts: Tensor) -> tuple[Tensor, Tensor]:
    """``counts`` (K, C) of the round's clients -> (shares (K, C) float, held (C,) bool).

    ``shares[k, y]`` = n_k^y / sum_j n_j^y for every label some client holds (``held``); 0 for a label none holds
    (such a label is never drawn). Each held label's shares sum to one over the clients."""
    counts = counts.to(torch.float64)
    totals = counts.sum(0)
    held = totals > 0
    shares = torch.where(held, counts / totals.clamp_min(1.0), torch.zeros_like(counts))
    return shares.to(torch.float32), held


def diversity_loss(noise: Tensor, out: Tensor) -> Tensor:
    """exp(-mean over pairs (i, j) of mean_d (noise_i - noise_j)^2 * mean_d |out_i - out_j|) for a batch of
    ``noise`` (B, ...) and the generator's ``out`` (B, ...) from it; both are flattened per row."""
    noise, out = noise.flatten(1), out.flatten(1)
    d_noise = (noise.unsqueeze(1) - noise.unsqueeze(0)).square().mean(2)
    d_out = (out.unsqueeze(1) - out.unsqueeze(0)).abs().mean(2)
    return torch.exp(-(d_noise * d_out).mean())


def check_generator_batch(own: int | None, key: str, federation_batch: int) -> None:
    """Refuse a generator batch of one (``own``, else the clients' ``federation_batch``): its BatchNorm needs two
    rows."""
    if own is None and federation_batch < 2:
        raise ConfigError(key, f"the generator's BatchNorm needs at least 2 samples a step and federation.batch_size "
                          f"is {federation_batch}: set {key} to 2 or more")
