"""What a malicious client sends: the channel's adversary stage (``ORDER["adversary"]``, the first on the way up).

It runs where the client runs, on the rows of the malicious clients only, before any other client-side stage: an
adversary forges the message its client would send and does not clip or noise itself (a privacy stage after it
treats the forgery as the client's upload, as a real client's own DP library would). x is a model leaf the client
sends, r the payload tensor it trained from (``Leaf.reference``), u = x - r its update:

- ``sign_flip``: x' = r - s u (s = ``adversary.scale``; s = 1 the plain sign flip of Damaskinos et al. 2018 /
  Fang et al. 2020's "reverse" model, larger s the "scaled sign flip");
- ``scale``: x' = r + s u (model replacement, Bagdasaryan et al., AISTATS 2020, Eq. 3: s = n / eta, the clients of a
  round over the server's learning rate, 1 for FedAvg's mean);
- ``gaussian``: x' = r + xi, xi ~ N(0, sigma^2 I) (Blanchard et al., NeurIPS 2017, Sec. 5's Gaussian Byzantine
  worker), drawn from a stream seeded by (run seed, round, client, leaf);
- ``forge_logits``: every row of a logits leaf (last dimension the classes) gets its target entry set to the row's
  largest entry plus ``adversary.logit_margin``: the honest logits pushed toward the target class, the others kept;
- ``inflate_count``: the sample count it reports (the upload's ``num_samples``) times ``adversary.count_factor``;
- ``forge_histogram``: a label histogram it sends (``label_counts``, FedDistill's ``counts``, and the set-up counts
  of methods that ask every client for them once: :func:`forged_setup_counts`) replaced by one of the same total on
  the target class.

Model leaves sent whole (no reference: the payload does not carry them) have no update to forge and are sent as they
are. ``adversary.fields`` restricts the forgery to top-level fields of the upload (e.g. ``[generator]``: DaFKD's
generator update sign-flipped or scaled).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fedray.adversary.config import AdversaryConfig
from fedray.channel.message import Leaf
from fedray.channel.stages import ORDER, Stage
from fedray.errors import RunFailure
from fedray.seeding import derive_seed

#: The upload fields a label histogram travels in (counts: never touched by another stage).
HISTOGRAM_FIELDS = ("label_counts", "counts")


class Forge(Stage):
    """The adversary's client side (module docstring). ``malicious``: the clients it acts for."""

    name = "adversary"
    order = ORDER["adversary"]

    def __init__(self, adv: AdversaryConfig, malicious: frozenset[int], num_classes: int, seed: int,
                 setup_counts: bool = False):
        self.adv, self.malicious, self.classes, self.seed = adv, malicious, num_classes, seed
        self.setup_counts = setup_counts  # the method's histograms go at set-up (forged there: forged_setup_counts)

    def _chosen(self, leaf: Leaf) -> bool:
        return self.adv.fields is None or leaf.path[0] in self.adv.fields

    def client_encode(self, leaves: list[Leaf], states: list[Any], keys: list[tuple[int, ...]]):
        rows = [i for i, key in enumerate(keys) if key[1] in self.malicious]
        attack = self.adv.attack
        if not rows or attack not in ("sign_flip", "scale", "gaussian", "forge_logits"):
            return leaves, states
        at, forged = torch.tensor(rows), False
        for j, leaf in enumerate(leaves):
            if not self._chosen(leaf):
                continue
            x = leaf.data.clone()
            if attack == "forge_logits":
                if leaf.kind != "values" or x.dim() < 2 or x.shape[-1] != self.classes:
                    continue
                z = x[at]
                z[..., self.adv.target] = z.amax(-1) + self.adv.logit_margin
                x[at] = z
            else:
                if leaf.kind != "model" or leaf.reference is None:
                    continue
                r = leaf.reference.to(x.dtype).unsqueeze(0)
                if attack == "gaussian":
                    u = torch.stack([self._noise(keys[i], j, leaf.shape, x.dtype) for i in rows])
                else:
                    u = (x[at] - r) * (-self.adv.scale if attack == "sign_flip" else self.adv.scale)
                x[at] = r + u
            leaf.data, forged = x, True
        if not forged:  # nothing of what it sends is what the attack forges: refused rather than run as a no-op
            what = "logits (values of the classes' width)" if attack == "forge_logits" else \
                "model updated from the payload"
            raise RunFailure(f"adversary.attack={attack}: this method's upload carries no {what}"
                             f"{' in adversary.fields' if self.adv.fields else ''}; choose another adversary.attack",
                             resumable=False)
        return leaves, states

    def _noise(self, key: tuple[int, ...], leaf: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """xi for (round, client) ``key`` and the ``leaf``-th leaf: its own stream, so a client sends the same
        alone, batched or on Ray."""
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "adversary", "gaussian", *key, leaf) % (1 << 63))
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * self.adv.noise_std).to(dtype)

    def client_message(self, message: Any, key: tuple[int, ...]) -> Any:
        """The message's header and counts, forged before the stages split it (``inflate_count``,
        ``forge_histogram``)."""
        attack = self.adv.attack
        if key[1] not in self.malicious or attack not in ("inflate_count", "forge_histogram"):
            return message
        if not dataclasses.is_dataclass(message):
            raise RunFailure(f"adversary.attack={attack}: the upload is not a message with fields", resumable=False)
        if attack == "inflate_count":
            if not isinstance(getattr(message, "num_samples", None), int):
                raise RunFailure(f"adversary.attack=inflate_count: {type(message).__name__} reports no sample count "
                                 "(num_samples); choose another adversary.attack", resumable=False)
            return dataclasses.replace(message, num_samples=round(message.num_samples * self.adv.count_factor))
        forged = {name: forged_histogram(getattr(message, name), self.adv.target) for name in HISTOGRAM_FIELDS
                  if isinstance(getattr(message, name, None), torch.Tensor)}
        if not forged and self.setup_counts:
            return message
        if not forged:
            raise RunFailure(f"adversary.attack=forge_histogram: {type(message).__name__} carries no label histogram "
                             f"({' or '.join(HISTOGRAM_FIELDS)}); choose another adversary.attack", resumable=False)
        return dataclasses.replace(message, **forged)


def forged_setup_counts(counts: torch.Tensor, adv: AdversaryConfig, malicious: frozenset[int]) -> torch.Tensor:
    """The set-up label counts the server receives (rows: clients; ``Algorithm.sends_label_counts``), the malicious
    clients' rows forged under ``forge_histogram``."""
    if adv.attack != "forge_histogram" or not malicious:
        return counts
    rows = sorted(malicious)
    out = counts.clone()
    out[rows] = forged_histogram(counts[rows], adv.target)
    return out


def forged_histogram(counts: torch.Tensor, target: int) -> torch.Tensor:
    """A histogram of ``counts``' total (per row: a client's of the set-up counts) all on ``target``."""
    out = torch.zeros_like(counts)
    out[..., target] = counts.sum(-1)
    return out


__all__ = ["Forge", "HISTOGRAM_FIELDS", "forged_histogram", "forged_setup_counts"]
