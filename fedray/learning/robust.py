"""Robust aggregation rules: what replaces the weighted mean at the one aggregation hook
(:mod:`fedray.learning.aggregation`) when some clients may be adversaries (``aggregation.rule``, docs/adversaries.md).

Each rule is a pure function over an (n, d) float64 matrix, one row a client's flattened upload (:func:`median`,
:func:`trimmed_mean`, :func:`krum_scores`, :func:`multi_krum`, :func:`norm_bound`, :func:`fltrust`), and an
:class:`~fedray.learning.aggregation.Aggregation` that flattens the uploads, applies it and gives back an item of the
uploads' layout (:class:`RobustRule`).

FLTrust also needs the server's own update g_0 on its small clean root dataset, trained each server step from the
model the clients started from, with the clients' local training: the runtime computes it (the server trains as a
pseudo-client on ``data.server_data``, :mod:`fedray.runtime.root`) and hands it to :class:`FLTrust` before the method's
server step; the rule finds, among the model tensors of that root upload, the model of the hook call's layout.

Full models or updates: the coordinate-wise median and trimmed mean commute with a shift (median_k(x_k) = r +
median_k(x_k - r) coordinate by coordinate) and Krum's distances ||x_i - x_j|| do not see it, so on models trained
from one reference these rules give the rule over the updates x_k - r plus r (up to float rounding): they run on the
models as they arrive and ignore ``reference``. Norm bounding and FLTrust do not commute (a norm is measured from
an origin): they need the reference, the model the clients started from, and refuse to run without it.

Sample weights: the median, the trimmed mean and Krum ignore them, as their papers do (Yin et al. 2018 and
Blanchard et al. 2017 take n equal votes: a weight an adversary reports would buy it influence); norm bounding takes
them as the weighted mean does (Sun et al. 2019 clip, then average as FedAvg); FLTrust weighs by trust scores only
(Cao et al. 2021, Eq. 4).
"""

from __future__ import annotations

from typing import Callable, ClassVar, Sequence

import torch

from fedray.errors import RunFailure
from fedray.learning.aggregation import Aggregation, RootUpdate, T, WeightedMean


# --- the arithmetic: rows are clients ------------------------------------------------------------------------------
def median(x: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median (Yin et al., ICML 2018, Option II: med{x_k}_j for each coordinate j); for an even n the
    mean of the two middle values, the median's usual definition (torch.median would take the lower one)."""
    s = x.sort(0).values
    n = x.shape[0]
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def trimmed_mean(x: torch.Tensor, beta: float) -> torch.Tensor:
    """Coordinate-wise beta-trimmed mean (Yin et al. 2018, Option I): for each coordinate, drop the floor(beta n)
    largest and the floor(beta n) smallest values and average the n - 2 floor(beta n) left. beta < 1/2 leaves one."""
    n = x.shape[0]
    k = int(beta * n)
    if not 0 <= beta < 0.5:
        raise ValueError(f"aggregation.beta={beta} must be in [0, 0.5)")
    return x.sort(0).values[k:n - k].mean(0)


def krum_scores(x: torch.Tensor, f: int) -> torch.Tensor:
    """Krum's scores (Blanchard et al., NeurIPS 2017, Sec. 4): score(i) = sum over the n - f - 2 nearest neighbours
    j != i of ||x_i - x_j||^2. Needs n - f - 2 >= 1 (the paper asks 2f + 2 < n for its resilience)."""
    n = x.shape[0]
    near = n - f - 2
    if near < 1:
        raise ValueError(f"Krum over {n} uploads with aggregation.f={f} has n - f - 2 = {near} neighbours; it needs "
                         f"at least one: lower aggregation.f below {n - 2}")
    d2 = torch.cdist(x, x).square()  # (n, n); the diagonal (0) is dropped below, not counted as a neighbour
    d2.fill_diagonal_(float("inf"))
    return d2.sort(1).values[:, :near].sum(1)


def krum_choice(x: torch.Tensor, f: int, m: int) -> torch.Tensor:
    """The indices of the m rows of smallest Krum score (ties go to the lower client index)."""
    return torch.sort(krum_scores(x, f), stable=True).indices[:min(m, x.shape[0])]


def multi_krum(x: torch.Tensor, f: int, m: int) -> torch.Tensor:
    """Multi-Krum (Blanchard et al. 2017, Sec. 4): the uniform mean of the m rows of smallest Krum score (scores
    computed once, over all n, as the paper defines it; ties go to the lower client index). m = 1 is Krum."""
    return x[krum_choice(x, f, m)].mean(0)


def norm_bound(updates: torch.Tensor, weights: Sequence[float], max_norm: float) -> torch.Tensor:
    """Norm bounding (Sun et al., "Can You Really Backdoor Federated Learning?", 2019, Sec. 4): each update u_k
    clipped to u_k / max(1, ||u_k||_2 / M), then the weighted mean sum_k w_k u_k / sum_k w_k."""
    w = torch.tensor([float(v) for v in weights], dtype=updates.dtype)
    norms = updates.norm(dim=1)
    clipped = updates / torch.clamp(norms / max_norm, min=1.0).unsqueeze(1)
    return (w.unsqueeze(1) * clipped).sum(0) / w.sum()


def fltrust_scores(updates: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
    """FLTrust's trust scores (Cao et al., NDSS 2021, Eq. 3): TS_k = ReLU(cos(g_k, g_0)), g_0 the server's update on
    its root data. An update of norm 0 has no direction: trust 0."""
    dots = updates @ root
    norms = updates.norm(dim=1) * root.norm()
    cos = torch.where(norms > 0, dots / torch.where(norms > 0, norms, 1.0), torch.zeros_like(dots))
    return torch.relu(cos)


def fltrust(updates: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
    """FLTrust (Cao et al. 2021, Eqs. 3-5): each update rescaled to the root update's norm, g_k' = (||g_0|| /
    ||g_k||) g_k (Eq. 4), then g = sum_k TS_k g_k' / sum_k TS_k (Eq. 5). Every score 0 (no update points within 90
    degrees of g_0): the zero update, the server keeps its model (the paper leaves the 0/0 undefined)."""
    ts = fltrust_scores(updates, root)
    total = ts.sum()
    if total == 0:
        return torch.zeros_like(root)
    norms = updates.norm(dim=1)
    scale = torch.where(norms > 0, root.norm() / torch.where(norms > 0, norms, 1.0), torch.zeros_like(norms))
    return ((ts * scale).unsqueeze(1) * updates).sum(0) / total


# --- the hook's rules ----------------------------------------------------------------------------------------------
def as_vector(item: object) -> torch.Tensor:
    """An upload's floating entries as one float64 vector (a weights dict: its floating tensors in key order)."""
    if isinstance(item, dict):
        return torch.cat([v.reshape(-1).to(torch.float64) for v in item.values() if torch.is_floating_point(v)])
    assert isinstance(item, torch.Tensor)
    return item.reshape(-1).to(torch.float64)


def from_vector(vector: torch.Tensor, like: T) -> T:
    """``vector`` back in the layout and dtypes of ``like``; a weights dict's integer buffers (BatchNorm's
    ``num_batches_tracked``) are ``like``'s, as :func:`~fedray.learning.weights.weighted_average` keeps the first
    client's."""
    if not isinstance(like, dict):
        return vector.reshape(like.shape).to(like.dtype)
    out, at = {}, 0
    for key, v in like.items():
        if torch.is_floating_point(v):
            out[key] = vector[at:at + v.numel()].reshape(v.shape).to(v.dtype)
            at += v.numel()
        else:
            out[key] = v.clone()
    return out  # type: ignore[return-value]


#: Every rule ``aggregation.rule`` names, and those that read the items alone, no reference model: the rules a mean of
#: values other than models trained from one broadcast model (logits, the cache's slots of older rounds) may take.
ALL_RULES = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "norm_bound", "fltrust")
VALUE_RULES = ("mean", "median", "trimmed_mean", "krum", "multi_krum")


class RobustRule(Aggregation):
    """A rule over the uploads flattened to rows (``combine``). ``needs_reference``: the rule reads updates x_k - r
    and refuses a call without ``reference`` (module docstring)."""

    needs_reference: ClassVar[bool] = False
    weighted: ClassVar[bool] = False  # one vote an upload (module docstring); NormBound averages by the weights

    def mean(self, items: Sequence[T], weights: Sequence[float], reference: T | None = None) -> T:
        if not items:
            raise ValueError("aggregation over no uploads")
        if self.needs_reference and reference is None:
            raise ValueError(f"aggregation.rule={self.name} aggregates updates, so it needs the model the clients "
                             "started from: call ctx.aggregation.mean(items, weights, reference=<the broadcast model>)")
        x = torch.stack([as_vector(item) for item in items])
        if self.needs_reference:
            r = as_vector(reference)
            out = r + self.combine(x - r, weights)
        else:
            out = self.combine(x, weights)
        return from_vector(out, items[0])

    def combine(self, x: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
        raise NotImplementedError


class Median(RobustRule):
    """:func:`median`, sample weights ignored."""

    name = "median"

    def combine(self, x: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
        return median(x)


class TrimmedMean(RobustRule):
    """:func:`trimmed_mean` at ``beta``, unweighted as in Yin et al. 2018."""

    name = "trimmed_mean"

    def __init__(self, beta: float):
        self.beta = beta

    def combine(self, x: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
        return trimmed_mean(x, self.beta)


class MultiKrum(RobustRule):
    """:func:`multi_krum` (``m = 1``: Krum, the one upload of least score), sample weights ignored."""

    def __init__(self, f: int, m: int = 1):
        self.f, self.m = f, m
        self.name = "krum" if m == 1 else "multi_krum"

    def combine(self, x: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
        n = x.shape[0]
        if n - self.f - 2 < 1 or self.m > n:  # the config allows a full step; dropouts and stragglers leave fewer
            need = max(self.f + 3, self.m)
            raise RunFailure(f"aggregation.rule={self.name}: only {n} uploads reached this server step and it needs "
                             f"{need} (aggregation.f={self.f}, aggregation.m={self.m}); lower aggregation.f / .m, or "
                             "let more uploads arrive (federation.clients_per_round, system.deadline_s)",
                             resumable=False)
        chosen = krum_choice(x, self.f, self.m)
        self.kept = chosen.tolist()
        return x[chosen].mean(0)


class NormBound(RobustRule):
    """:func:`norm_bound` of the updates from ``reference``, weighted as the mean is."""

    name = "norm_bound"
    needs_reference = True
    weighted = True

    def __init__(self, max_norm: float):
        self.max_norm = max_norm

    def combine(self, x: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
        return norm_bound(x, weights, self.max_norm)


def root_vector(root: RootUpdate, like: object) -> torch.Tensor:
    """g_0 flattened as :func:`as_vector` flattens ``like``, an item of the hook's call: of the root upload's model
    tensors, the one model with ``like``'s layout (a weights dict: the dict in the upload whose entries are
    ``like``'s floating ones, same keys, shapes and order; a tensor: the one tensor of its shape). The root upload is
    the method's own, so its model matches the items of the method's mean; none or several is a bug."""
    if isinstance(like, dict):
        want = [(k, tuple(v.shape)) for k, v in like.items() if torch.is_floating_point(v)]
        groups: dict[tuple, list[tuple[object, torch.Tensor]]] = {}
        for path, g in root:  # a dict's entries share the path above their key
            groups.setdefault(path[:-1], []).append((path[-1], g))
        found = [g for g in groups.values() if [(k, tuple(t.shape)) for k, t in g] == want]
    else:
        assert isinstance(like, torch.Tensor)
        found = [[(path, g)] for path, g in root if tuple(g.shape) == tuple(like.shape)]
    if len(found) != 1:
        raise RuntimeError(f"aggregation.rule=fltrust: {len(found)} models of the server's root upload have the layout "
                           "of this mean's items; exactly one was expected")
    return torch.cat([g.reshape(-1).to(torch.float64) for _, g in found[0]])


class FLTrust(RobustRule):
    """FLTrust (Cao et al., NDSS 2021, Algorithms 1-2): :func:`fltrust` over the updates from ``reference``, g_0 the
    server's update on its root data, handed over by :meth:`begin_step` each server step (the runtime trains it:
    :mod:`fedray.runtime.root`). Sample weights are ignored: the aggregate weighs by trust scores only. Its figures
    (:meth:`step_metrics`): the uploads of trust score 0, the mean trust score."""

    name = "fltrust"
    needs_reference = True
    needs_root = True

    def __init__(self) -> None:
        self.root: RootUpdate | None = None
        self._g0: torch.Tensor | None = None  # g_0 in the layout of the call under way
        self._scores: list[torch.Tensor] = []  # each call's TS_k since the figures were last taken

    def begin_step(self, root: RootUpdate) -> None:
        self.root = root

    def mean(self, items: Sequence[T], weights: Sequence[float], reference: T | None = None) -> T:
        if self.root is None:
            raise RuntimeError("aggregation.rule=fltrust was called before the server's root update g_0 was handed "
                               "over (begin_step): the runtime's server step does it")
        self._g0 = root_vector(self.root, items[0]) if items else None
        return super().mean(items, weights, reference)

    def combine(self, x: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
        assert self._g0 is not None and self._g0.shape == x.shape[1:]
        self._scores.append(fltrust_scores(x, self._g0))
        return fltrust(x, self._g0)

    def step_metrics(self) -> dict[str, float]:
        if not self._scores:
            return {}
        ts, self._scores = torch.cat(self._scores), []
        return {"agg/fltrust_zero_trust": float((ts == 0).sum()), "agg/fltrust_mean_trust": float(ts.mean())}


def build_rule(rule: str, *, beta: float = 0.1, f: int = 1, m: int = 1,
               max_norm: float | None = None) -> Aggregation:
    """The rule ``aggregation.rule`` names, with its keys (checked by :class:`AggregationConfig`)."""
    makers: dict[str, Callable[[], Aggregation]] = {
        "mean": WeightedMean,
        "median": Median,
        "trimmed_mean": lambda: TrimmedMean(beta),
        "krum": lambda: MultiKrum(f, 1),
        "multi_krum": lambda: MultiKrum(f, m),
        "norm_bound": lambda: NormBound(float(max_norm)),  # type: ignore[arg-type]
        "fltrust": FLTrust,
    }
    if rule not in makers:
        raise ValueError(f"no aggregation rule {rule!r}; built: {', '.join(makers)}")
    return makers[rule]()


__all__ = ["ALL_RULES", "VALUE_RULES", "FLTrust", "as_vector", "from_vector", "Median", "MultiKrum", "NormBound", "RobustRule", "TrimmedMean", "build_rule", "fltrust",
           "fltrust_scores", "krum_scores", "median", "multi_krum", "norm_bound", "root_vector", "trimmed_mean"]
