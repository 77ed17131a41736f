"""Distillation losses shared by the federated-distillation methods (DaFKD, FedKF, ...).

Temperature KD (Hinton et al. 2015), as the DaFKD, FedKF and FedCD papers use it:
``KL(softmax(t / T) || softmax(s / T)) * T^2`` with the batch-mean reduction (the sum over classes,
averaged over samples), unless a method says otherwise. T^2 keeps the gradient's scale independent of T.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from fedray.learning import optim
from fedray.learning.training import row_mean
from fedray.learning.cuda_graphs import GraphedStep


def soft_targets(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """softmax(logits / T) over the last dimension."""
    return F.softmax(logits / temperature, dim=-1)


def kl_rows(teacher_probs: Tensor, log_q: Tensor) -> Tensor:
    """KL(p || q) of each row (sum over the last dimension; 0 log 0 = 0), from p and log q.

    ``F.kl_div`` computes the same, but torch.func.vmap has no batching rule for it and falls back to a
    Python loop over the batch; this stays one kernel when clients are trained batched."""
    return (torch.xlogy(teacher_probs, teacher_probs) - teacher_probs * log_q).sum(-1)


def kd_kl_probs(student_logits: Tensor, teacher_probs: Tensor, temperature: float = 1.0,
                rows: Tensor | None = None) -> Tensor:
    """KL(teacher_probs || softmax(student / T)) * T^2, batch-mean. ``teacher_probs`` rows sum to 1.

    ``rows`` (bool, one per row): the mean over the rows where it holds only (a padded batch's real rows,
    :func:`~fedray.learning.training.row_mean`)."""
    return row_mean(kl_rows(teacher_probs, F.log_softmax(student_logits / temperature, dim=-1)), rows) * temperature**2


def kd_kl_reverse(student_logits: Tensor, teacher_probs: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(softmax(s / T) || teacher_probs) * T^2, batch-mean: the student's distribution first (the reverse, mode-
    seeking direction: the student avoids classes the teacher gives ~0). Teacher probabilities are floored at
    1e-12 so that a class the teacher rules out costs much, not infinitely."""
    log_p = F.log_softmax(student_logits / temperature, dim=-1)
    return (log_p.exp() * (log_p - teacher_probs.clamp_min(1e-12).log())).sum(-1).mean() * temperature**2


def kd_kl(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0,
          rows: Tensor | None = None) -> Tensor:
    """KL(softmax(t / T) || softmax(s / T)) * T^2, batch-mean: the convention's temperature KD (``rows``: as
    :func:`kd_kl_probs`)."""
    return kd_kl_probs(student_logits, soft_targets(teacher_logits, temperature), temperature, rows)


def normalised_entropy(weights: Tensor, dim: int = 0) -> Tensor:
    """H(w) / log(n) along ``dim`` for weights that sum to 1 there: 1 = uniform, 0 = all on one entry."""
    n = weights.shape[dim]
    if n <= 1:
        return torch.zeros_like(weights.sum(dim))
    h = -(weights * torch.log(weights.clamp_min(1e-30))).sum(dim)
    return h / torch.log(torch.tensor(float(n), dtype=weights.dtype, device=weights.device))


class KDSteps:
    """A server's distillation steps on a fixed set: ``step(idx)`` takes one optimizer step of ``model`` on
    ``kd_kl_probs(model(inputs(idx)), targets[idx], T) / divide_by`` (``reverse``: :func:`kd_kl_reverse`) for the
    host batch index ``idx`` and returns the loss (a tensor of its own). With ``cuda_graphs`` on a GPU and fedray's SGD, the step - the same kernels on
    another batch index - is replayed as a CUDA graph after two eager ones (:class:`fedray.learning.cuda_graphs.GraphedStep`;
    fedray's Adam keeps its step counts on the host, which a replay would not advance): the same numbers, without
    the host issuing a few hundred kernels a step. Steps run inside :meth:`running`; other work between them
    (an early-stopping evaluation) is fine, it leaves the optimizer's state where it was."""

    def __init__(self, model: torch.nn.Module, opt, inputs: Callable[[Tensor], Tensor], targets: Tensor,
                 temperature: float, device: torch.device, cuda_graphs: bool, what: str, divide_by: float = 1.0,
                 reverse: bool = False):
        self.model, self.opt, self.inputs, self.targets = model, opt, inputs, targets
        self.temperature, self.divide_by, self.device = temperature, divide_by, device
        self.loss = kd_kl_reverse if reverse else kd_kl_probs  # reverse: KL(student || teacher)
        self.graph = GraphedStep(device, self._step, what) if cuda_graphs and isinstance(opt, optim.SGD) else None

    def _step(self, key: None, inp: dict[str, Tensor]) -> Tensor:
        idx = inp["index"]
        loss = self.loss(self.model(self.inputs(idx)), self.targets[idx], self.temperature)
        if self.divide_by != 1.0:
            loss = loss / self.divide_by
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.detach()

    def running(self):
        return self.graph.running() if self.graph is not None else contextlib.nullcontext()

    def step(self, idx: Tensor, steps_left: int | None = None) -> Tensor:
        if self.graph is not None and self.graph.replay(None, {"index": idx}, steps_left):
            return self.graph.out.clone()  # the next replay rewrites it
        return self._step(None, {"index": idx.to(self.device)})
