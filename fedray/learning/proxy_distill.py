"""Server-side ensemble distillation on the server's own (unlabelled) data, shared by FedDF and FedD3A.

Both methods average the clients' models (or start from the server's global model), run every uploaded
client model as a teacher on the server's images, combine the teachers' outputs per sample (FedDF: the
mean of the logits; FedD3A: Eq. 6-7's domain-aware weights) and train the student on the KL divergence
to that ensemble. This module holds the common parts: the teachers' outputs, and the distillation loop
with optional early stopping on a held-out part of the server data by agreement with the ensemble
(FedDF's rule: the student's argmax matches the teachers' argmax).

The student is trained in eval mode: its BatchNorm running statistics stay those of the clients' data,
and the server's images (another domain, for FedD3A) never enter them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from fedray.learning import optim
from fedray.learning.weights import Weights
from fedray.learning.distill import KDSteps
from fedray.learning.ensemble import stacked_outputs
from fedray.learning.weights import clone_weights
from fedray.data.federated import to_float


@dataclass
class DistillSettings:
    lr: float
    optimizer: str  # "adam" or "sgd" (momentum 0.9)
    batch_size: int
    epochs: float  # passes over the training part of the server data (at most)
    temperature: float
    val_fraction: float = 0.0  # held out for early stopping; 0 = no early stopping
    patience: int = 0  # evaluations without a better agreement before stopping
    eval_every: int = 50  # steps between early-stopping evaluations
    reverse_kl: bool = False  # KL(student || ensemble) instead of the usual KL(ensemble || student)


def normalised(x: torch.Tensor, spec) -> torch.Tensor:
    return to_float(x, spec.mean, spec.std)


@torch.no_grad()
def run_in_batches(fn, x: torch.Tensor, spec, batch_size: int) -> torch.Tensor:
    """``fn`` on the normalised uint8 images ``x`` in batches, concatenated."""
    return torch.cat([fn(normalised(x[i : i + batch_size], spec)) for i in range(0, len(x), batch_size)])


def teacher_logits(teachers: Iterable[tuple[torch.nn.Module, Weights]], x: torch.Tensor, spec,
                   batch_size: int) -> torch.Tensor:
    """(K, N, C) logits of each teacher on the server's images, in eval mode. A teacher is a module and
    the weights it would be loaded with; teachers sharing a module (one architecture) run as one stacked
    forward per batch (:mod:`fedray.learning.ensemble`), and the module's own weights are left as they are."""
    return stacked_outputs(teachers, x, batch_size, lambda xb: normalised(xb, spec))[0]


def agreement(model: torch.nn.Module, x: torch.Tensor, target_probs: torch.Tensor, spec, batch_size: int) -> float:
    model.eval()
    pred = run_in_batches(model, x, spec, batch_size).argmax(1)
    return float((pred == target_probs.argmax(1)).float().mean())


def distil(model: torch.nn.Module, start: Weights, x: torch.Tensor, targets: torch.Tensor, spec,
           s: DistillSettings, seed: int, cuda_graphs: bool = False) -> tuple[Weights, dict[str, float]]:
    """Train ``model`` from ``start`` on KL(targets || softmax(model(x) / T)) * T^2 over the server's images
    ``x`` (uint8) with teacher probabilities ``targets`` (N, C); seeded batches without replacement.

    With ``val_fraction`` > 0 a seeded part of the images is held out; every ``eval_every`` steps the
    student's agreement with the ensemble's argmax there is measured, the best weights are kept, and the
    loop stops after ``patience`` evaluations without improvement (FedDF's early stopping). ``cuda_graphs``: the
    steps replayed as a CUDA graph on a GPU (:class:`fedray.learning.distill.KDSteps`), the same numbers.
    """
    model.load_state_dict(start)
    model.eval()
    g = torch.Generator().manual_seed(seed % (1 << 63))
    order = torch.randperm(len(x), generator=g)
    n_val = int(len(x) * s.val_fraction) if s.patience > 0 else 0
    val, train = order[:n_val], order[n_val:]
    opt = (optim.Adam(model.parameters(), lr=s.lr) if s.optimizer == "adam"
           else optim.SGD(model.parameters(), lr=s.lr, momentum=0.9))
    steps = max(1, int(round(s.epochs * -(-len(train) // s.batch_size))))
    best, best_weights, since, losses, pos, perm = -1.0, None, 0, [], 0, train[torch.randperm(len(train), generator=g)]
    stopped_at = steps
    kd = KDSteps(model, opt, lambda idx: normalised(x[idx], spec), targets, s.temperature, x.device, cuda_graphs,
                 "the server's distillation step", reverse=s.reverse_kl)
    with kd.running():
        for step in range(1, steps + 1):
            if pos >= len(perm):
                perm, pos = train[torch.randperm(len(train), generator=g)], 0
            losses.append(kd.step(perm[pos : pos + s.batch_size], steps - step + 1))
            pos += s.batch_size
            if n_val and (step % s.eval_every == 0 or step == steps):
                score = agreement(model, x[val.to(x.device)], targets[val.to(x.device)], spec, 1024)
                if score > best:
                    best, best_weights, since = score, clone_weights(model), 0
                else:
                    since += 1
                    if since >= s.patience:
                        stopped_at = step
                        break
    weights = best_weights if best_weights is not None else clone_weights(model)
    t = torch.stack(losses)
    metrics = {"server/kd_loss": float(t.mean()), "server/kd_loss_first": float(t[0]),
               "server/kd_loss_last": float(t[-1]), "server/distill_steps": float(stopped_at)}
    if n_val:
        metrics["server/val_agreement"] = best
    return weights, metrics
