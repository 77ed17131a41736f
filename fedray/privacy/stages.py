"""Client-level DP's parts: the clip and local noise as channel stages (where the client runs, after an adversary's
forgery and before compression: :data:`fedray.channel.stages.ORDER`), and central noise as the aggregation hook's rule.

A client's upload is one vector for the clip: every model leaf as its update from the payload it trained from (the
leaf's reference), every values leaf (logits, scores, a model the payload does not carry) as it is; counts never
reach the clip. Under local noise a message's counts are handled before it is split (:meth:`LocalNoise.client_message`):
its sample counts are not sent, its label histograms are sent noised. Clipping scales the whole vector by min(1, C / ||u||) (Abadi et al. 2016's per-example clip, applied
per client as McMahan et al., ICLR 2018, DP-FedAvg Alg. 1 does), so its direction is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch

from fedray.channel.message import Leaf, declared_counts, replaced
from fedray.channel.stages import ORDER, Stage
from fedray.learning.aggregation import Aggregation, T
from fedray.learning.robust import as_vector, from_vector
from fedray.seeding import derive_seed


def _rows(leaf: Leaf, n: int) -> torch.Tensor:
    """A batched leaf as (n, d) float64: the update from its reference for a model leaf, else its values."""
    x = leaf.data.detach().reshape(n, -1).to(torch.float64)
    if leaf.reference is not None:
        x = x - leaf.reference.detach().reshape(1, -1).to(x)
    return x


def _put(leaf: Leaf, n: int, x: torch.Tensor) -> None:
    """``x`` (n, d), an update or values as :func:`_rows` gave them, back into ``leaf`` in its shape and dtype."""
    if leaf.reference is not None:
        x = x + leaf.reference.detach().reshape(1, -1).to(x)
    leaf.data = x.reshape(leaf.data.shape).to(leaf.data.dtype)


def clip_factors(leaves: Sequence[Leaf], n: int, clip: float) -> torch.Tensor:
    """min(1, C / ||u_i||) for each of the batch's ``n`` messages, ||u_i|| over all its leaves (a zero update: 1)."""
    sq = torch.zeros(n, dtype=torch.float64)
    for leaf in leaves:
        sq += _rows(leaf, n).pow(2).sum(1)
    norms = sq.sqrt()
    return torch.where(norms > clip, clip / torch.where(norms > 0, norms, 1.0), torch.ones_like(norms))


@dataclass(frozen=True)
class Adaptive:
    """Andrew et al., NeurIPS 2021 ("Differentially Private Learning with Adaptive Clipping", Alg. 1): the clip
    follows the ``quantile`` gamma of the clients' update norms. Each client tells whether its update was within
    the clip, b_k = 1[||u_k|| <= C]; the server counts them with noise, b = (sum_k (b_k - 1/2) + N(0, sigma_b^2)) / m
    + 1/2 (centred: one client moves the sum by 1/2), and moves the clip geometrically, C <- C exp(-eta (b - gamma)),
    with ``lr`` = eta over ``expected`` = m uploads a step; the count's noise comes from the stream of (run seed,
    round)."""

    quantile: float
    lr: float
    count_std: float
    expected: int
    seed: int


class Clip(Stage):
    """``privacy.clip``: each message's whole update scaled to L2 norm at most C, direction kept; with ``adaptive``
    C is the server's (announced with every payload) and follows a quantile of the norms (:class:`Adaptive`)."""

    name = "clip"
    order = ORDER["clip"]

    def __init__(self, clip: float, adaptive: Adaptive | None = None):
        self.clip, self.adaptive = clip, adaptive
        self.per_server = self.listens = adaptive is not None

    def init_state(self, client_id: int) -> dict[str, float] | None:
        return {"clip": self.clip} if self.adaptive is not None else None

    def _now(self, heard: dict[str, float] | None) -> float:
        return heard["clip"] if heard and "clip" in heard else self.clip

    def announce(self, state: dict[str, float] | None) -> dict[str, float]:
        return {"clip": (state or self.init_state(-1))["clip"]}

    def tell(self, leaves, keys, heard):
        within = clip_factors(leaves, len(keys), self._now(heard)) == 1.0
        return [{"clip/within": float(w)} for w in within.tolist()]

    def hear(self, state: dict[str, float] | None, told: list[dict[str, float]], round_: int) -> dict[str, float]:
        a = self.adaptive
        assert a is not None
        clip = (state or self.init_state(-1))["clip"]
        total = sum(t["clip/within"] - 0.5 for t in told if "clip/within" in t)
        share = (total + float(gaussian(1, a.count_std, derive_seed(a.seed, "privacy/clip", round_)))) / a.expected
        return {"clip": clip * math.exp(-a.lr * (share + 0.5 - a.quantile))}

    def client_encode(self, leaves, states, keys, heard=None):
        n = len(keys)
        scale = clip_factors(leaves, n, self._now(heard)).unsqueeze(1)
        for leaf in leaves:
            _put(leaf, n, _rows(leaf, n) * scale)
        return leaves, states


def gaussian(shape: tuple[int, ...] | int, std: float, seed: int) -> torch.Tensor:
    """N(0, std^2) float64 draws from their own seeded generator: a function of ``seed`` alone, wherever it runs."""
    gen = torch.Generator().manual_seed(seed % (1 << 63))
    return torch.randn(shape, generator=gen, dtype=torch.float64) * std


class LocalNoise(Stage):
    """``privacy.mechanism=local``: N(0, (sigma C)^2) added to every coordinate of each clipped upload before it leaves
    its client, drawn from the stream of (run seed, round, client, leaf): a client sends the same alone, batched, in
    process or on Ray, and after a resume.

    A message's counts (fields declared counts, :func:`~fedray.learning.boundary.counts_field`) are not sent in the
    clear: a sample count (an int of the header) is sent as 1, so the server weighs the uploads equally (DP-FedAvg's
    w_k = 1); the label histograms (integer tensors), all of the message's as one vector, are clipped to L2 norm
    ``counts_clip`` (scaled, so their proportions are kept) and sent with N(0, (sigma_k counts_clip)^2) added, rounded
    and floored at 0 (post-processing): a second Gaussian release of the client's a round, which the accountant's
    multiplier covers with the update's (:func:`~fedray.privacy.accounting.update_noise_multiplier`)."""

    name = "local_noise"
    order = ORDER["local_noise"]

    def __init__(self, clip: float, sigma: float, seed: int, counts_clip: float = 1.0,
                 counts_sigma: float | None = None):
        self.std, self.seed = sigma * clip, seed
        # None: the method declares no histograms in its uploads (one found is refused)
        self.counts_clip, self.counts_sigma = counts_clip, counts_sigma

    def client_message(self, message: Any, key: tuple[int, ...]) -> Any:
        found = declared_counts(message)
        histograms = [(path, t) for path, t in found if isinstance(t, torch.Tensor)]
        if histograms and self.counts_sigma is None:
            from fedray.errors import RunFailure

            raise RunFailure("privacy.mechanism=local: an upload carries label histograms its method does not declare "
                             "(Algorithm.uploads_label_counts), so the accountant would not cover them; declare them")
        if histograms:
            flat = torch.cat([t.reshape(-1).to(torch.float64) for _, t in histograms])
            norm = float(flat.norm())
            flat = flat * min(1.0, self.counts_clip / norm) if norm > 0 else flat
            flat = flat + gaussian(flat.numel(), self.counts_sigma * self.counts_clip,
                                   derive_seed(self.seed, "privacy/counts", *key))
            parts = iter(flat.round().clamp_min(0).split([t.numel() for _, t in histograms]))
            noised = {path: next(parts).reshape(t.shape).to(t.dtype) for path, t in histograms}
        else:
            noised = {}
        sample_counts = {path: 1 for path, v in found if not isinstance(v, torch.Tensor)}  # not sent
        return replaced(message, {**sample_counts, **noised})

    def client_encode(self, leaves, states, keys):
        n = len(keys)
        for j, leaf in enumerate(leaves):
            x = _rows(leaf, n)
            noise = torch.stack([gaussian(x.shape[1], self.std, derive_seed(self.seed, "privacy/local", *key, j))
                                 for key in keys])
            _put(leaf, n, x + noise)
        return leaves, states


class CentralNoise(Aggregation):
    """``privacy.mechanism=central`` at the aggregation hook: r + (sum_k (x_k - r) + N(0, (sigma C)^2 I)) / m, the
    unweighted sum of the clipped updates (of values such as logits, r = 0), noised once, over a fixed denominator m, the uploads a server step expects
    (``federation.clients_per_round``; FedBuff's ``buffer_size``): DP-FedAvg's fixed-denominator estimator (McMahan
    et al., ICLR 2018, Alg. 1 with w_k = 1). Sample counts are not used: a count is the client's own, and weighing by
    it would need it private too. The noise of each hook call of a step comes from the stream of (run seed, round,
    call): a resume draws it again."""

    name = "central_noise"
    weighted: ClassVar[bool] = False

    def __init__(self, clip: float, sigma: float, denominator: int, seed: int):
        self.clip, self.sigma, self.denominator, self.seed = clip, sigma, denominator, seed
        self.std = sigma * clip
        self.round, self.calls = 0, 0

    def start_step(self, round_: int, announced: dict[str, float] | None = None) -> None:
        """The step's stream; the noise's scale from the clip the step's uploads were clipped at (announced by the
        adaptive clip, else the fixed one)."""
        self.round, self.calls = round_, 0
        self.std = self.sigma * (announced or {}).get("clip", self.clip)

    def mean(self, items: Sequence[T], weights: Sequence[float], reference: T | None = None) -> T:
        if not items:
            raise ValueError("aggregation over no uploads")
        # models are summed as their updates from the model sent (``reference``); values (logits) as they are
        r = as_vector(reference) if reference is not None else torch.zeros((), dtype=torch.float64)
        total = (torch.stack([as_vector(item) for item in items]) - r).sum(0)
        noise = gaussian(total.numel(), self.std, derive_seed(self.seed, "privacy/central", self.round, self.calls))
        self.calls += 1
        return from_vector(r + (total + noise) / self.denominator, items[0])


__all__ = ["Adaptive", "CentralNoise", "Clip", "LocalNoise", "clip_factors", "gaussian"]
