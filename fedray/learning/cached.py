"""Cached-model ("active-inactive") aggregation, FedKF's T1 (FedKF Sec. IV-A, Alg. 1 lines 2, 7, 9, 10).

The server keeps one cache slot per registered client holding the model that client uploaded last.
Every round it computes both

- the **ACA** model (active clients aggregated): the sample-weighted mean of this round's uploads
  (Alg. 1 line 9); this is FedAvg's global model and what is broadcast;
- the **OCA** model (overall clients aggregated): the sample-weighted mean over *all* slots, active and
  inactive (Alg. 1 line 10).

It is orthogonal to the local objective, so any parameter-averaging method can use it: FedAvg, FedProx
and FedGKD take ``algorithm.report_model=aca|oca`` (``oca`` = "FedAvg (OCA)" of FedKF Table XII: the
training is unchanged, the ACA model is still broadcast, only the reported model differs) and
``algorithm.cache_init``:

- ``initial`` (the paper, Alg. 1 line 2): every slot starts as w0, so the OCA model averages w0 into
  the slots of clients that have not taken part yet;
- ``participated`` (the authors' code): the OCA model averages only the slots of clients that have
  uploaded at least once.

The server only learns a client's |D_k| from its first upload. Under ``initial`` a slot that still holds
w0 is weighted by the mean |D_k| of the clients seen so far, which is Alg. 1 line 10 exactly once every
client has uploaded (the paper assumes the server knows every |D_k| up front).

Memory: slots are stored sparsely, ``{client id: weights}``, one entry per client that has uploaded,
overwritten on each new upload, plus one shared copy of w0 and the OCA model: at most (K + 2) models
however long the run, growing only with the number of registered clients K. The whole cache is a
dataclass of tensors, so the checkpoint code saves and restores it like any other server state.

At scale (clients made on demand, or ``runtime.client_state_memory`` set) the OCA model must not cost a pass over
every filled slot each round, nor every slot live in memory: the cache then keeps a running sum
sum_k |D_k| w_k over the filled slots (float64), to which each upload adds its term after taking out its slot's
previous one (read back from the slot), so a round costs O(its uploads); the slots live in a
:class:`~fedray.learning.store.ClientStore` when ``runtime.client_state_memory`` bounds them (the least recently
filled on disk). The same line-10 mean, summed in another order (equal to the recomputed mean to float64
rounding, not bit for bit: the eager modes keep the recomputation); integer buffers are the latest upload's. Only
the weighted mean is computed this way (a rule that votes per slot is refused with clients made on demand).

With the cache on, each upload also carries its client's id (8 bytes in ``comm/bytes_up``), because
the server must know whose slot to overwrite; with ``report_model=aca`` FedAvg keeps no cache and its
uploads, numbers and memory are exactly those of plain FedAvg.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedray.learning.aggregation import Aggregation
from fedray.learning.weights import Weights


class CacheParams(BaseModel):
    """``algorithm.report_model`` and ``algorithm.cache_init`` (mixed into a method's own Params).

    Unset (None) means ``aca`` / ``initial``: a method's runs from before these keys existed and runs that
    leave them out read as the same configuration in ``fedray report``.
    """

    model_config = ConfigDict(extra="forbid")
    report_model: Literal["aca", "oca"] | None = Field(
        default=None, description="model reported as eval/* and saved: aca (default; this round's uploads) or oca "
        "(every client's cached model, FedKF T1); oca also evaluates both as eval/*_aca and eval/*_oca")
    cache_init: Literal["initial", "participated"] | None = Field(
        default=None, description="OCA slots of clients not seen yet: initial (default) = hold w0 (paper, Alg. 1 "
        "line 2); participated = left out (authors' code)")


@dataclass
class ModelCache:
    """One slot per client with its latest upload (FedKF Alg. 1 line 7) and the OCA model over them.

    ``slots`` holds only clients that have uploaded; under ``cache_init=initial`` every other slot holds
    ``initial`` (w0). ``sizes[k]`` is the |D_k| of slot k's upload, 0 while slot k was never filled.
    """

    initial: Weights  # w0, the content of a never-filled slot under cache_init=initial
    slots: MutableMapping[int, Weights]  # client id -> its latest uploaded weights (a dict, or a ClientStore)
    sizes: torch.Tensor  # (K,) int64 sample count of each filled slot, 0 = never filled
    oca: Weights  # the OCA model over the slots (Alg. 1 line 10), recomputed every round
    mode: str = "initial"  # cache_init
    total: Weights | None = None  # running mode: sum_k |D_k| w_k over the filled slots, float64; None: recomputed


def init_cache(w0: Weights, num_clients: int, mode: str = "initial", running: bool = False,
               slots: MutableMapping[int, Weights] | None = None) -> ModelCache:
    """Round-0 cache: no slot filled yet, OCA = w0 (Alg. 1 line 2: w_hat^0 <- w0). ``running``: the OCA model from a
    running sum (module docstring), the slots in ``slots`` (a dict when None)."""
    total = ({k: torch.zeros_like(v, dtype=torch.float64) for k, v in w0.items() if torch.is_floating_point(v)}
             if running else None)
    return ModelCache(initial=w0, slots={} if slots is None else slots,
                      sizes=torch.zeros(num_clients, dtype=torch.int64), oca=w0, mode=mode, total=total)


def oca_members(cache: ModelCache, votes: bool = False) -> tuple[list[Weights], list[float]]:
    """The models and weights Alg. 1 line 10 averages: filled slots in client-id order, then (``initial``)
    w0 once with the summed weight of the never-filled slots (each the mean size of the filled ones).

    ``votes``: for a rule that gives each item one vote and ignores the weights (``Aggregation.weighted`` False: the
    median, the trimmed mean, Krum), w0 once for each never-filled slot (the same tensors, not copies), so that
    every registered client's slot is one vote, as each weighs its share in the mean."""
    filled = sorted(cache.slots)
    models = [cache.slots[k] for k in filled]
    coefs = [float(cache.sizes[k]) for k in filled]
    empty = int(cache.sizes.numel()) - len(filled)
    if cache.mode == "initial" and empty > 0:
        mean_size = sum(coefs) / len(coefs) if coefs else 1.0
        if votes:
            models += [cache.initial] * empty
            coefs += [mean_size] * empty
        else:
            models.append(cache.initial)
            coefs.append(empty * mean_size)
    return models, coefs


def update_cache(cache: ModelCache, client_ids: list[int], weights: list[Weights], sizes: list[int],
                 aggregation: Aggregation) -> ModelCache:
    """Overwrite the uploaders' slots (Alg. 1 line 7) and recompute the OCA model (line 10), a mean over the clients'
    cached uploads by the server's ``aggregation`` rule (``ServerContext.aggregation``).

    Returns a new cache: the previous one is left untouched (its slot dict and size vector are copied,
    the weight tensors themselves are shared, never modified); a running cache is updated in place.
    """
    if cache.total is not None:
        return _update_running(cache, client_ids, weights, sizes)
    slots = dict(cache.slots)
    new_sizes = cache.sizes.clone()
    for cid, w, n in zip(client_ids, weights, sizes):
        if not 0 <= cid < new_sizes.numel():
            raise ValueError(f"upload from client {cid}, but the cache has slots 0..{new_sizes.numel() - 1}")
        slots[cid] = w
        new_sizes[cid] = int(n)
    out = ModelCache(initial=cache.initial, slots=slots, sizes=new_sizes, oca=cache.oca, mode=cache.mode)
    models, coefs = oca_members(out, votes=not aggregation.weighted)
    # the step's choice of a rule that selects (Krum's ``kept``) is over its uploads: the call over the slots keeps it
    kept = aggregation.kept
    out.oca = aggregation.mean(models, coefs) if models else cache.initial
    aggregation.kept = kept
    return out


def _update_running(cache: ModelCache, client_ids: list[int], weights: list[Weights], sizes: list[int]) -> ModelCache:
    """Line 7 and line 10 in O(the uploads): each upload's slot's old term |D_k| w_k taken out of the running sum
    and the new one added, then the mean over the filled slots and (``initial``) w0's share of the empty ones."""
    total = cache.total
    for cid, w, n in zip(client_ids, weights, sizes):
        if not 0 <= cid < cache.sizes.numel():
            raise ValueError(f"upload from client {cid}, but the cache has slots 0..{cache.sizes.numel() - 1}")
        old = int(cache.sizes[cid])
        if old:
            for key, acc in total.items():
                acc.sub_(cache.slots[cid][key].to(torch.float64), alpha=old)
        for key, acc in total.items():
            acc.add_(w[key].to(torch.float64), alpha=int(n))
        cache.slots[cid] = w
        cache.sizes[cid] = int(n)
    filled = int((cache.sizes > 0).sum())
    if not filled:
        return cache
    mass = float(cache.sizes.sum())
    empty = int(cache.sizes.numel()) - filled
    w0_mass = empty * mass / filled if cache.mode == "initial" else 0.0
    oca = {}
    for key, ref in cache.initial.items():
        if key not in total:
            oca[key] = weights[-1][key].clone()  # integer buffers: the latest upload's
            continue
        acc = total[key] + ref.to(torch.float64) * w0_mass if w0_mass else total[key]
        oca[key] = (acc / (mass + w0_mass)).to(ref.dtype)
    cache.oca = oca
    return cache
