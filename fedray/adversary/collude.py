"""Attacks that need other clients' updates (``lie``, ``min_max``): a server-side stage before aggregation.

A colluding adversary sees the updates of a server step before it sends its own, which a client-side stage cannot
(each client encodes alone, where it runs). So these run at the server, on the step's uploads as the channel decoded
them and before the method's server update: every malicious upload's model leaves are replaced by one forged update
added to the model that client was sent. Its other fields (counts, logits) are sent as they were. The benign
statistics come from the malicious clients' own updates of the step (``adversary.estimate=own``: what they trained
honestly, their papers' partial-knowledge setting) or from every honest upload of the step (``omniscient``).

With u_i the benign updates (flattened model leaves, x_i - r_i), mu and sigma their coordinate-wise mean and
standard deviation (unbiased; 0 from one update):

- ``lie`` (Baruch et al., "A Little Is Enough", NeurIPS 2019, Alg. 1): u_m = mu - z sigma with z = ``adversary.lie_z``
  or the paper's z_max = Phi^-1((n - s) / n), s = floor(n / 2 + 1) - m, for n uploads of the step and m of them
  malicious (the largest deviation a majority still sees as closer than the mean);
- ``min_max`` (Shejwalkar and Houmansadr, NDSS 2021, Sec. IV-B, Alg. 1): u_m = mu + gamma p with p = -mu / ||mu||
  (``unit_vec``), -sigma (``std``) or -sign(mu) (``sign``) and the largest gamma found by the paper's halving search
  (gamma from 10, tolerance 1e-5) for which max_i ||u_m - u_i|| <= max_{i,j} ||u_i - u_j|| over the benign updates.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fedray.adversary.config import AdversaryConfig
from fedray.channel.message import join, split
from fedray.errors import RunFailure


def lie_z(n: int, m: int) -> float:
    """Baruch et al. 2019's z_max for ``n`` workers of which ``m`` are malicious."""
    s = math.floor(n / 2 + 1) - m
    return float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor((n - s) / n, dtype=torch.float64)))


def min_max(benign: torch.Tensor, perturbation: str, gamma: float = 10.0, tol: float = 1e-5) -> torch.Tensor:
    """Shejwalkar and Houmansadr 2021's Min-Max update over ``benign`` (rows: updates)."""
    mu = benign.mean(0)
    if perturbation == "unit_vec":
        p = -mu / mu.norm().clamp_min(1e-12)
    elif perturbation == "std":
        p = -_std(benign)
    else:
        p = -torch.sign(mu)
    bound = torch.cdist(benign, benign).max()
    step, succ = gamma / 2, 0.0
    while abs(succ - gamma) > tol:  # their halving search: up while it holds, down while it does not
        if (benign - (mu + gamma * p)).norm(dim=1).max() <= bound:
            succ, gamma = gamma, gamma + step
        else:
            gamma -= step
        step /= 2
    return mu + succ * p


def _std(x: torch.Tensor) -> torch.Tensor:
    return x.std(0) if x.shape[0] > 1 else torch.zeros_like(x[0])


class Colluder:
    """The server-side stage of ``lie`` / ``min_max`` for the ``malicious`` clients."""

    def __init__(self, adv: AdversaryConfig, malicious: frozenset[int]):
        self.adv, self.malicious = adv, malicious

    def __call__(self, uploads: list[Any], client_ids: list[int], payloads: list[Any]) -> list[Any]:
        """The step's uploads with the malicious ones forged; ``payloads``: each upload's payload as its client
        decoded it (the references of its model leaves)."""
        bad = [i for i, c in enumerate(client_ids) if c in self.malicious]
        if not bad:
            return uploads
        parts = [split(u, p) for u, p in zip(uploads, payloads)]
        models = [[leaf for leaf in leaves if leaf.kind == "model" and leaf.reference is not None
                   and (self.adv.fields is None or leaf.path[0] in self.adv.fields)] for _, leaves in parts]
        updates = [torch.cat([(leaf.data - leaf.reference).reshape(-1).to(torch.float64) for leaf in leaves])
                   if leaves else torch.zeros(0, dtype=torch.float64) for leaves in models]
        if updates[bad[0]].numel() == 0:  # refused rather than run as a no-op
            raise RunFailure(f"adversary.attack={self.adv.attack}: this method's upload carries no model updated from "
                             f"the payload{' in adversary.fields' if self.adv.fields else ''}; choose another "
                             "adversary.attack", resumable=False)
        known = bad if self.adv.estimate == "own" else [i for i in range(len(uploads)) if i not in bad]
        if not known:
            return uploads  # every upload of the step malicious (omniscient): no honest update to learn from
        benign = torch.stack([updates[i] for i in known])
        if self.adv.attack == "lie":
            z = self.adv.lie_z if self.adv.lie_z is not None else lie_z(len(uploads), len(bad))
            forged = benign.mean(0) - z * _std(benign)
        else:
            forged = min_max(benign, self.adv.perturbation)
        out = list(uploads)
        for i in bad:
            at = 0
            for leaf in models[i]:
                n = leaf.reference.numel()
                leaf.data = (leaf.reference.to(torch.float64) + forged[at:at + n].reshape(leaf.shape)).to(leaf.dtype)
                at += n
            out[i] = join(parts[i][0], parts[i][1])
        return out


__all__ = ["Colluder", "lie_z", "min_max"]
