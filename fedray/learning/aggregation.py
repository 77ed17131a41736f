"""The one server-side aggregation hook: every mean over the clients' uploads (the averaging family's weighted
mean of models, FedDistill's and FedCD's means of logits, label histograms and the like) goes through
``ctx.aggregation.mean``, so that a rule replacing the weighted mean (central noise for differential privacy, a
robust rule against adversaries) plugs in once, for every method, instead of into each method.

The default rule is :class:`WeightedMean`: sum_k w_k x_k / sum_k w_k, for models the arithmetic of
:func:`fedray.learning.weights.weighted_average` (FedAvg's server step, Algorithm 1 of McMahan et al. 2017). The
robust rules (median, trimmed mean, Krum, norm bounding, FLTrust: ``aggregation.rule``) are
:mod:`fedray.learning.robust`'s.

``reference``: the model the clients started from (the broadcast one), passed by the calls over models trained from
it; a rule that aggregates updates x_k - reference (norm bounding, FLTrust) refuses a call without it. The weighted
mean does not read it: sum_k p_k x_k = r + sum_k p_k (x_k - r) when the p_k sum to 1.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence, TypeVar

import torch

from fedray.learning.weights import Weights, weighted_average

T = TypeVar("T", Weights, torch.Tensor)

#: The server's own update on its root data (FLTrust's g_0) as the runtime hands it to a rule: the model tensors of
#: the upload the server computed, each as (its path in the upload, its update from the payload, float64).
RootUpdate = list[tuple[tuple[Any, ...], torch.Tensor]]


class Aggregation:
    """A rule combining one item per client (a model's weights, or a tensor of values) into one. Items arrive in
    client-id order with each client's weight (its sample count, a staleness weight, 1 for a uniform mean)."""

    name = "aggregation"
    #: After a call: the indices of the items a rule that selects clients kept (Krum's choice), None when every item
    #: counts. The server reads it for ``adv/malicious_kept``.
    kept: list[int] | None = None
    #: True for a rule that reads the server's own update on its root data each step (FLTrust): the runtime trains
    #: it and hands it over by :meth:`begin_step` before the method's server step.
    needs_root: ClassVar[bool] = False
    #: False for a rule that gives each item one vote and ignores the weights (the median, the trimmed mean, Krum):
    #: a caller whose item stands for several clients (the cache's w0 for every never-filled slot) then passes it
    #: once for each.
    weighted: ClassVar[bool] = True

    def mean(self, items: Sequence[T], weights: Sequence[float], reference: T | None = None) -> T:
        raise NotImplementedError

    def start_step(self, round_: int, announced: dict[str, float] | None = None) -> None:
        """A server step of ``round_`` begins (before the method's server update): a rule whose draws are keyed by the
        step (central DP noise) starts its stream here; ``announced``: what the channel's listening stages announced
        with the payload the step's uploads answer (the adaptive clip's clip)."""

    def begin_step(self, root: RootUpdate) -> None:
        """A server step begins, with the server's update on its root data (called only for a rule that
        ``needs_root``)."""

    def step_metrics(self) -> dict[str, float]:
        """The rule's figures (``agg/*``) over the hook's calls since the last time they were taken: read once after
        each server step. None by default."""
        return {}


class WeightedMean(Aggregation):
    """sum_k w_k x_k / sum_k w_k. Models: :func:`~fedray.learning.weights.weighted_average` (float64
    accumulation in the given order, each term scaled by w_k / sum_j w_j; integer buffers are the first
    client's). Tensors (logits, label histograms): the float64 terms w_k x_k stacked and summed over the clients,
    then divided by sum_k w_k, returned in the first item's dtype: the arithmetic of the masked and uniform means
    the methods compute over values (FedDistill's per-label mean, whose clients not holding a label weigh 0), so
    that they keep their bits through the hook."""

    name = "mean"

    def mean(self, items: Sequence[T], weights: Sequence[float], reference: T | None = None) -> T:
        if not items:
            raise ValueError("aggregation over no uploads")
        if isinstance(items[0], dict):
            return weighted_average(list(items), list(weights))
        total = float(sum(weights))
        terms = torch.stack([x.to(torch.float64) * float(w) for x, w in zip(items, weights)])
        return (terms.sum(0) / total).to(items[0].dtype)


__all__ = ["Aggregation", "RootUpdate", "T", "WeightedMean"]
