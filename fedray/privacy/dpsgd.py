"""Sample-level DP for a client's local training: DP-SGD (Abadi et al., CCS 2016, Alg. 1) on every update of its
training plan that reads its examples, run by the runtime's engine (:mod:`fedray.vectorized.engine`, one client alone
or a worker's clients batched) in place of the plain gradient, so that no method changes.

Each such update's step computes every example's gradient of the update's own loss on that example alone
(``torch.func``: ``grad`` of a ``functional_call``, ``vmap``-ed over the batch's rows, and over the clients when
batched), clips each to L2 norm C_s (``privacy.sample_clip``) over all the parameters the update moves, sums them,
adds N(0, (sigma_s C_s)^2) to every coordinate (``privacy.sample_noise``), divides by the batch's size (Poisson
batches: the expected size) and hands that to the method's optimizer as the gradient. The noise comes from the
client's own stream of (run seed, round, client, "dp_sgd"), so a client's draws do not depend on who it is batched
with. An update that does not read the examples (a generator's step against a discriminator DP-SGD trained:
DaFKD's, FedKF's) is post-processing and runs as usual (:class:`~fedray.learning.training.Update`'s
``reads_examples``). Per-example gradients need layers that do not mix a batch's examples: a module with BatchNorm
that such an update trains is refused.

A loss that also reads other inputs (generated samples, a teacher's logits on them) keeps them in every example's
term: each example's gradient carries its share of them, clipped with it, which bounds what one example moves the
sum by C_s all the same (Opacus's DP-GAN clips the generated rows as examples too).

Accounting (:func:`sample_epsilon`), per client over its own local steps, the worst client's reported:

- ``privacy.sample_batches=passes`` (the plain runner's batches): passes over the client's data, reshuffled each
  pass, not independent draws, so no amplification is claimed: within a pass an example is in exactly one batch,
  each of its batches one Gaussian release of multiplier sigma_s (add or remove one example moves the clipped sum
  by at most C_s), composed over the most batches any example of any client can have been in after the run's
  rounds, had its client taken part in every one (:func:`batches_per_example`).
- ``poisson``: each step's batch takes every example of the client independently with probability
  q = min(1, B / n) (B ``federation.batch_size``, n the client's examples), the sum divided by the expected size qn;
  each step is dp-accounting's ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma_s))`` (amplification by sampling,
  Mironov et al. 2019's sampled Gaussian under add or remove one), composed over the client's steps in every round.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.func import functional_call, grad, vmap

from fedray.errors import RunFailure
from fedray.learning.training import EXAMPLES, split_loss


@dataclass
class DPSGD:
    """DP-SGD's settings for a worker's clients of a round: clip C_s, multiplier sigma_s, and per client (by id) its
    noise stream and, with Poisson batches, the expected batch size its sums are divided by."""

    clip: float
    noise: float
    generators: dict[int, torch.Generator]
    denominators: dict[int, float] | None = None  # None: each batch's own size
    method: str = ""

    @classmethod
    def of(cls, cfg: Any, ctxs: list[Any]) -> "DPSGD":
        """The clients ``ctxs``' DP-SGD under ``cfg.privacy``."""
        p = cfg.privacy
        denominators = None
        if p.sample_batches == "poisson":
            denominators = {c.client_id: float(min(cfg.federation.batch_size, c.num_samples)) for c in ctxs}
        return cls(p.sample_clip, p.sample_noise, {c.client_id: c.generator("dp_sgd") for c in ctxs}, denominators,
                   cfg.algorithm.name)

    def check(self, modules: torch.nn.Module, updates: list[Any]) -> None:
        """Refuses (RunFailure naming the key) a module with BatchNorm that an update reading the examples trains."""
        for u in updates:
            for name in u.groups:
                if has_batch_norm(modules[name]):
                    raise RunFailure(f"privacy.sample_clip: {self.method}'s {name} has BatchNorm, whose batch "
                                     "statistics mix a batch's examples, so DP-SGD cannot bound one example's "
                                     "gradient; use a model without BatchNorm (lenet5, resnet8, mlp)")

    def noised_mean(self, per: dict[str, torch.Tensor], client_ids: list[int], rows: int) -> dict[str, torch.Tensor]:
        """(sum_i g_i min(1, C / ||g_i||) + N(0, (sigma C)^2 I)) / denominator for each client: ``per`` holds each
        parameter's per-example gradients (clients, examples, ...), ``rows`` the batch's size."""
        n = len(client_ids)
        first = next(iter(per.values()))
        norms = torch.sqrt(sum(g.reshape(n, rows, -1).pow(2).sum(-1) for g in per.values()))
        factor = torch.where(norms > self.clip, self.clip / norms.clamp_min(1e-12), torch.ones_like(norms))
        if self.denominators is None:
            denom = torch.full((n,), float(max(rows, 1)))
        else:
            denom = torch.tensor([self.denominators[c] for c in client_ids])
        denom = denom.to(first)
        out = {}
        for name, g in per.items():
            shape = g.shape[2:]
            total = (g * factor.view(n, rows, *([1] * len(shape)))).sum(1)
            draws = torch.stack([torch.randn(shape, generator=self.generators[c], dtype=torch.float32)
                                 for c in client_ids]).to(total)
            out[name] = (total + self.noise * self.clip * draws) / denom.view(n, *([1] * len(shape)))
        return out


def per_example_gradients(wrapper: torch.nn.Module, paired: tuple[str, ...] = ()):
    """One client's per-example gradients of an update's loss (``wrapper``: the engine's module of the loss, its
    modules under ``modules_``, called with the step's inputs): for each row of its ``x``/``y`` (and of the
    ``paired`` inputs), the gradient with respect to the moved parameters ``mv`` of the loss on that example alone,
    ``EXAMPLES`` the batch's size (:class:`~fedray.learning.training.Update`'s ``reads_examples``). (B, ...) per
    parameter."""
    rows = ("x", "y", *paired)

    def one_client(mv: dict, fixed: dict, b: dict, inputs: dict):
        own = {k: inputs[k] for k in rows}
        rest = {k: v for k, v in inputs.items() if k not in rows}
        size = inputs["x"].shape[0]

        # the buffers are an argument, not captured: a module the loss runs in training (a generator's BatchNorm)
        # updates them in place, which a grad transform allows only on its inputs (this copy is then dropped)
        def one_example(m: dict, bb: dict, example: dict) -> torch.Tensor:
            ex = {**rest, **{k: v.unsqueeze(0) for k, v in example.items()}, EXAMPLES: size}
            out = functional_call(wrapper, ({f"modules_.{k}": v for k, v in {**fixed, **m}.items()},
                                            {f"modules_.{k}": v for k, v in bb.items()}), (ex,))
            return split_loss(out)[0]
        return vmap(grad(one_example), in_dims=(None, None, 0), randomness="different")(mv, b, own)
    return one_client


def has_batch_norm(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


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


def sample_accountant(fed: Any, sizes: list[int], noise: float, delta: float, batches: str):
    """rounds -> the sample-level epsilon at ``delta`` of the worst client after that many rounds, had it taken part
    in every one (module docstring: ``batches`` is ``privacy.sample_batches``)."""
    worst = _worst_clients(fed, sizes, batches)
    return lambda rounds: max((sample_epsilon(noise, delta, rounds * t, q) for q, t in worst), default=0.0)


def _worst_clients(fed: Any, sizes: list[int], batches: str) -> list[tuple[float, int]]:
    """The (sampling rate, releases a round) of the clients whose epsilon may be the largest: with passes, one
    release a batch at rate 1, the most batches an example is in; with Poisson batches, each client's rate and local
    steps, less those whose rate and steps are both at most another's (their epsilon is the smaller)."""
    if batches == "passes":
        return [(1.0, batches_per_example(fed, sizes))]
    from fedray.learning.boundary import local_step_count

    pairs = {(min(1.0, fed.batch_size / n), local_step_count(fed, n)) for n in sizes if n > 0}
    return [(q, t) for q, t in pairs if not any(q2 >= q and t2 >= t and (q2, t2) != (q, t) for q2, t2 in pairs)]


def sample_noise_for(fed: Any, sizes: list[int], delta: float, batches: str, target: float, rounds: int) -> float:
    """The smallest sigma_s whose sample-level epsilon (:func:`sample_accountant`) after ``rounds`` rounds is within
    ``target``: dp-accounting's ``calibrate_dp_mechanism`` on the worst client's composition (each client of the
    accountant's frontier calibrated, the largest sigma kept)."""
    from dp_accounting import calibrate_dp_mechanism
    from dp_accounting.mechanism_calibration import LowerEndpointAndGuess
    from dp_accounting.rdp import rdp_privacy_accountant

    return max(float(calibrate_dp_mechanism(rdp_privacy_accountant.RdpAccountant,
                                            lambda sigma, q=q, t=t: _releases(sigma, rounds * t, q), target, delta,
                                            bracket_interval=LowerEndpointAndGuess(1e-2, 1.0), tol=1e-4))
               for q, t in _worst_clients(fed, sizes, batches))


def sample_epsilon(noise: float, delta: float, releases: int, rate: float = 1.0) -> float:
    """Epsilon at ``delta`` of ``releases`` Gaussian releases of multiplier ``noise``, each on a Poisson sample of
    rate ``rate`` (1: every example; RDP, add or remove one)."""
    if releases <= 0:
        return 0.0
    if noise == 0:
        return math.inf
    return _sample_epsilon(noise, delta, releases, rate)


@functools.lru_cache(maxsize=4096)
def _sample_epsilon(noise: float, delta: float, releases: int, rate: float) -> float:
    from dp_accounting.rdp import rdp_privacy_accountant

    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(_releases(noise, releases, rate))
    return float(acc.get_epsilon(delta))


def _releases(noise: float, releases: int, rate: float):
    """``releases`` Gaussian releases of multiplier ``noise``, each on a Poisson sample of rate ``rate`` (1: every
    example), as one dp-accounting event."""
    from dp_accounting import dp_event

    event = dp_event.GaussianDpEvent(noise)
    if rate < 1:
        event = dp_event.PoissonSampledDpEvent(rate, event)
    return dp_event.SelfComposedDpEvent(event, releases)


__all__ = ["DPSGD", "per_example_gradients", "batches_per_example", "has_batch_norm", "sample_accountant", "sample_epsilon", "sample_noise_for"]
