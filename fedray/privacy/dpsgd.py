"""Sample-level DP for a client's local training: DP-SGD (Abadi et al., CCS 2016, Alg. 1) on a
:class:`~fedray.learning.training.LocalTraining` plan, run by the runtime in place of the plain step, so that no method
changes.

Each step computes every example's gradient of the plan's own loss on that example alone (``torch.func``: ``grad``
of a ``functional_call`` over the plan's module, ``vmap``-ed over the batch's rows), clips each to L2 norm C_s
(``privacy.sample_clip``) over all trained parameters, sums them, adds N(0, (sigma_s C_s)^2) to every coordinate
(``privacy.sample_noise``), divides by the batch's size and hands that to the method's optimizer as the gradient. The
noise comes from the client's own stream of (run seed, round, client, "dp_sgd"). Per-sample gradients need layers
that do not mix a batch's examples: a model with BatchNorm is refused.

Accounting (:func:`sample_epsilon`): the batches are passes over the client's data, reshuffled each pass
(:meth:`~fedray.learning.boundary.ClientContext.batch_plan`), not independent draws, so no amplification by sampling
is claimed: within a pass an example is in exactly one batch, and each of its batches is one Gaussian release of
multiplier sigma_s (add or remove one example: the clipped sum moves by at most C_s). Epsilon is that Gaussian
composed over the most batches any example of any client can have been in after the run's rounds, if its client took
part in every one.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch.func import functional_call, grad, vmap

from fedray.learning.training import LocalTraining, Trained, make_optimizer, split_loss


class _LossOf(torch.nn.Module):
    """The plan's loss as a module whose only submodule is the plan's model, so that ``functional_call`` can run the
    loss with other parameters (one example's gradient) without the method knowing."""

    def __init__(self, model: torch.nn.Module, loss):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, x, y, *own):
        return split_loss(self.loss(self.model, x, y, *own))[0]


def has_batch_norm(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def private_gradients(model: torch.nn.Module, loss, x: torch.Tensor, y: torch.Tensor, own: tuple, clip: float,
                      noise: float, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The DP-SGD gradient of one batch, by parameter name: (sum_i g_i min(1, C / ||g_i||) + N(0, (sigma C)^2 I)) / B,
    g_i the i-th example's gradient of ``loss`` (module docstring)."""
    wrapper = _LossOf(model, loss)
    params = {f"model.{n}": p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = {f"model.{n}": b for n, b in model.named_buffers()}

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return functional_call(wrapper, {**p, **buffers}, (xi.unsqueeze(0), yi.unsqueeze(0), *own))

    per = vmap(grad(one), in_dims=(None, 0, 0), randomness="different")(params, x, y)
    norms = torch.sqrt(sum(g.reshape(len(x), -1).pow(2).sum(1) for g in per.values()))
    factor = torch.where(norms > clip, clip / norms.clamp_min(1e-12), torch.ones_like(norms))
    out = {}
    for name, g in per.items():
        total = (g * factor.view(-1, *([1] * (g.dim() - 1)))).sum(0)
        draw = torch.randn(total.shape, generator=gen, dtype=torch.float32).to(total)
        out[name[len("model."):]] = (total + noise * clip * draw) / len(x)
    return out


def run_private_training(ctx: Any, plan: LocalTraining, clip: float, noise: float) -> Any:
    """:func:`~fedray.learning.training.run_local_training` with DP-SGD's gradient in place of the batch loss's; the
    figures are the batch losses as the plain runner computes them (without a gradient)."""
    model = plan.model
    if has_batch_norm(model):
        from fedray.errors import RunFailure

        raise RunFailure("privacy.sample_clip: DP-SGD needs per-example gradients, which BatchNorm's batch "
                         "statistics mix; use a model without BatchNorm (lenet5, resnet8, mlp)")
    model.load_state_dict(plan.start)
    model.train()
    opt = make_optimizer(model.parameters(), ctx.fed)
    gen = ctx.generator("dp_sgd")
    own = () if plan.client_inputs is None else (plan.client_inputs,)
    named = dict(model.named_parameters())
    sums: dict[str, torch.Tensor] = {}
    steps = 0
    for x, y in ctx.batches():
        opt.zero_grad()
        for name, g in private_gradients(model, plan.loss, x, y, own, clip, noise, gen).items():
            named[name].grad = g
        opt.step()
        with torch.no_grad():
            loss, aux = split_loss(plan.loss(model, x, y, *own))
        for key, value in {"train/loss": loss, **aux}.items():
            sums[key] = sums.get(key, 0.0) + value.detach()
        steps += 1
    return plan.finish(model, Trained({key: float(total) for key, total in sums.items()}, steps))


def batches_per_example(fed: Any, sizes: list[int]) -> int:
    """The most batches of one round any example of any client is in: ceil(steps / batches a pass) for its client
    (a client with fewer examples than its steps' batches cover passes over them more often)."""
    from fedray.learning.boundary import local_step_count

    most = 0
    for n in sizes:
        if n > 0:
            per_pass = max(1, -(-n // fed.batch_size))
            most = max(most, -(-local_step_count(fed, n) // per_pass))
    return most


def sample_epsilon(noise: float, delta: float, releases: int) -> float:
    """Epsilon at ``delta`` of ``releases`` Gaussian releases of multiplier ``noise`` (RDP, add or remove one)."""
    if releases <= 0:
        return 0.0
    if noise == 0:
        return math.inf
    return _sample_epsilon(noise, delta, releases)


@functools.lru_cache(maxsize=4096)
def _sample_epsilon(noise: float, delta: float, releases: int) -> float:
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(noise), releases))
    return float(acc.get_epsilon(delta))


__all__ = ["batches_per_example", "has_batch_norm", "private_gradients", "run_private_training", "sample_epsilon"]
