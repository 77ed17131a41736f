"""Distillation losses shared by the federated-distillation methods (DaFKD, FedKF, ...).

Temperature KD (Hinton et al. 2015), as the DaFKD, FedKF and FedCD papers use it:
``KL(softmax(t / T) || softmax(s / T)) * T^2`` with the batch-mean reduction (the sum over classes,
averaged over samples), unless a method says otherwise. T^2 keeps the gradient's scale independent of T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def soft_targets(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """softmax(logits / T) over the last dimension."""
    return F.softmax(logits / temperature, dim=-1)


def kl_rows(teacher_probs: Tensor, log_q: Tensor) -> Tensor:
    """KL(p || q) of each row (sum over the last dimension; 0 log 0 = 0), from p and log q.

    ``F.kl_div`` computes the same, but torch.func.vmap has no batching rule for it and falls back to a
    Python loop over the batch; this stays one kernel when clients are trained batched."""
    return (torch.xlogy(teacher_probs, teacher_probs) - teacher_probs * log_q).sum(-1)


def kd_kl_probs(student_logits: Tensor, teacher_probs: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(teacher_probs || softmax(student / T)) * T^2, batch-mean. ``teacher_probs`` rows sum to 1."""
    log_q = F.log_softmax(student_logits / temperature, dim=-1)
    return kl_rows(teacher_probs, log_q).mean() * (temperature**2)


def kd_kl(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(softmax(t / T) || softmax(s / T)) * T^2, batch-mean: the convention's temperature KD."""
    return kd_kl_probs(student_logits, soft_targets(teacher_logits, temperature), temperature)


def normalised_entropy(weights: Tensor, dim: int = 0) -> Tensor:
    """H(w) / log(n) along ``dim`` for weights that sum to 1 there: 1 = uniform, 0 = all on one entry."""
    n = weights.shape[dim]
    if n <= 1:
        return torch.zeros_like(weights.sum(dim))
    h = -(weights * torch.log(weights.clamp_min(1e-30))).sum(dim)
    return h / torch.log(torch.tensor(float(n), dtype=weights.dtype, device=weights.device))
