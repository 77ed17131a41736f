"""Subspace projections of client features and the teacher weights built on them (FedD3A, Su, Li & Xue,
"Domain Discrepancy Aware Distillation for Model Aggregation in Federated Learning", Sec. 3).

Each client extracts the features ``Z`` (n x d) of its data with the global backbone and sends the server
the projection onto the subspace its features span. The server scores a feature ``u`` against client k by
``r_k = cos(u, P_k u)``: close to 1 when ``u`` lies near client k's subspace, smaller the further it
points away from it. Eq. 6 turns the scores of one sample into teacher weights.

Eq. 5 (the recursion, over the batch-mean features ``z_i``, i = 1..m, stacked as the rows of ``Zb``)::

    P_hat_0 = I / a
    P_hat_i = P_hat_{i-1} - P_hat_{i-1} z_i z_i^T P_hat_{i-1} / (1 + z_i^T P_hat_{i-1} z_i)

Each step is the Sherman-Morrison formula for the inverse of a matrix plus the rank-one term z_i z_i^T,
so by induction ``P_hat_m = (a I + Zb^T Zb)^-1``. The projector is then

    P = I - a P_hat_m = (a I + Zb^T Zb)^-1 Zb^T Zb = Zb^T (Zb Zb^T + a I)^-1 Zb

(the last form by the push-through identity), the paper's ``P = Z^T (Z Z^T + a I)^-1 Z`` with batch means
for rows. The paper writes ``P = I - P_hat``, which is this only for a = 1, and "cos<P, Pu>", which can
only mean cos<u, Pu>. In the eigenbasis of ``Zb^T Zb`` (eigenvalues lam_j), ``P`` scales direction j by
lam_j / (lam_j + a): P is symmetric, its eigenvalues lie in [0, 1), directions of the span are kept
(almost fully when a << lam_j) and directions orthogonal to every z_i are removed. ``a`` > 0 is the ridge:
small a gives the hard orthogonal projector onto span(Zb), large a gives P ~ Zb^T Zb / a.

Eq. 6 (teacher weights of one server sample over the m clients): ``softmax((r - mean r) / sqrt(var r))``.

Everything is computed in float64 and returned as float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

_F64 = torch.float64
# Rows of ``u`` per chunk in projection_cosine, so that the (chunk, k, d) intermediate stays ~32 MiB.
_COS_BUDGET = 1 << 22


def _check_ridge(a: float) -> float:
    a = float(a)
    if not a > 0 or a == float("inf"):
        raise ValueError(f"the ridge a must be a finite positive number, got {a!r}")
    return a


def batch_means(features: Tensor, batch_size: int | None = None) -> Tensor:
    """Means of consecutive batches of ``batch_size`` rows of ``features`` (n, d), as float64 (m, d).

    ``m = ceil(n / batch_size)``; the last batch holds the remaining ``n mod batch_size`` rows when n is
    not a multiple (as the last batch of a data loader without drop_last). None or 1: each row is its own
    batch (the rows themselves). Shuffle the rows first to get the random batches of a data loader.
    """
    z = torch.as_tensor(features).to(_F64)
    if z.ndim != 2:
        raise ValueError(f"features must be (n, d), got shape {tuple(z.shape)}")
    if batch_size is None or batch_size == 1:
        return z
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
    n, d = z.shape
    full = n // batch_size
    parts = [z[: full * batch_size].reshape(full, batch_size, d).mean(dim=1)]
    if n % batch_size:
        parts.append(z[full * batch_size :].mean(dim=0, keepdim=True))
    return torch.cat(parts)


def projector_recursive(batch_means: Tensor, a: float) -> Tensor:
    """FedD3A's Eq. 5 step by step over the rows of ``batch_means`` (m, d); returns P = I - a P_hat_m.

    O(m d^2); the reference for :func:`projector`, which computes the same in closed form.
    """
    a = _check_ridge(a)
    z = torch.as_tensor(batch_means).to(_F64)
    if z.ndim != 2:
        raise ValueError(f"batch_means must be (m, d), got shape {tuple(z.shape)}")
    d = z.shape[1]
    eye = torch.eye(d, dtype=_F64)
    p_hat = eye / a
    for zi in z:
        pz = p_hat @ zi  # P_hat is symmetric, so z^T P_hat = (P_hat z)^T
        p_hat = p_hat - torch.outer(pz, pz) / (1.0 + zi @ pz)
    return eye - a * p_hat


def projector(features: Tensor, a: float, batch_size: int | None = None) -> Tensor:
    """The projector of Eq. 5 from a feature matrix (n, d), in closed form: (d, d) float64.

    ``Zb`` = :func:`batch_means` (consecutive batches of ``batch_size`` rows; None: every row), then
    ``P = (a I + Zb^T Zb)^-1 Zb^T Zb``, i.e. ``I - a (a I + Zb^T Zb)^-1``, by a Cholesky solve. When Zb has
    fewer rows than columns (m < d) the equal form ``Zb^T (Zb Zb^T + a I)^-1 Zb`` is solved instead: an
    m x m system, better conditioned for a small ``a`` (Zb Zb^T is then usually non-singular). The result
    is symmetrised. Equal to :func:`projector_recursive` on the same batch means to float64 rounding.
    """
    a = _check_ridge(a)
    zb = batch_means(features, batch_size)
    m, d = zb.shape
    if m < d:
        gram = zb @ zb.T
        gram.diagonal().add_(a)
        chol = torch.linalg.cholesky(gram)
        p = zb.T @ torch.cholesky_solve(zb, chol)
    else:
        g = zb.T @ zb
        reg = g.clone()
        reg.diagonal().add_(a)
        chol = torch.linalg.cholesky(reg)
        p = torch.cholesky_solve(g, chol)
    return 0.5 * (p + p.T)


def projection_cosine(P: Tensor, u: Tensor) -> Tensor:
    """``cos(u_i, P_k u_i)`` for every sample i and client k: (n, k) float64 (k = 1 for a single (d, d) P).

    ``P`` is (k, d, d) or (d, d), ``u`` is (n, d). A zero ``u_i`` or a zero ``P_k u_i`` scores 0. Values are
    clamped to [-1, 1] against rounding; for the symmetric positive semi-definite projectors of
    :func:`projector` they lie in [0, 1] (``u^T P u >= 0``). Computed in chunks of samples with one einsum
    per chunk.
    """
    p = torch.as_tensor(P).to(_F64)
    if p.ndim == 2:
        p = p.unsqueeze(0)
    x = torch.as_tensor(u).to(_F64)
    if p.ndim != 3 or p.shape[1] != p.shape[2]:
        raise ValueError(f"P must be (k, d, d) or (d, d), got shape {tuple(torch.as_tensor(P).shape)}")
    if x.ndim != 2 or x.shape[1] != p.shape[1]:
        raise ValueError(f"u must be (n, {p.shape[1]}), got shape {tuple(x.shape)}")
    k, d = p.shape[0], p.shape[1]
    tiny = torch.finfo(_F64).tiny
    u_norm = x.norm(dim=1, keepdim=True)  # (n, 1)
    out = torch.empty(x.shape[0], k, dtype=_F64)
    step = max(1, _COS_BUDGET // max(1, k * d))
    for start in range(0, x.shape[0], step):
        xs = x[start : start + step]
        pu = torch.einsum("kij,nj->nki", p, xs)  # (c, k, d)
        dot = torch.einsum("nki,ni->nk", pu, xs)
        denom = u_norm[start : start + step] * pu.norm(dim=2)
        ok = denom > tiny
        out[start : start + step] = torch.where(ok, dot / torch.where(ok, denom, 1.0), 0.0)
    return out.clamp_(-1.0, 1.0)


def subspace_weights(r: Tensor, correction: int = 1) -> Tensor:
    """FedD3A's Eq. 6: per sample (row of ``r``, (n, k)), ``softmax_k((r_k - mean r) / std r)``: (n, k) float64
    (a 1-D ``r`` of k scores gives k weights).

    ``std`` is the sample standard deviation (divisor k - 1, ``correction=1``, torch.std's default and
    what ``torch.var`` gives a PyTorch implementation of "var(r)"); ``correction=0`` gives the population
    one (divisor k). A row whose std is 0 (all scores equal up to rounding: std <= 1e-12 max(1, max|r|)),
    or a single client, gets uniform weights 1/k. Each row sums to 1 and the weights increase with r.
    """
    if correction not in (0, 1):
        raise ValueError(f"correction must be 1 (sample std) or 0 (population std), got {correction!r}")
    x = torch.as_tensor(r).to(_F64)
    single = x.ndim == 1
    if single:
        x = x.unsqueeze(0)
    if x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"r must be (n, k) with k >= 1, got shape {tuple(torch.as_tensor(r).shape)}")
    k = x.shape[1]
    if k - correction < 1:
        w = torch.full_like(x, 1.0 / k)
        return w[0] if single else w
    mean = x.mean(dim=1, keepdim=True)
    std = x.std(dim=1, correction=correction, keepdim=True)
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1.0)
    flat = std <= 1e-12 * scale
    z = (x - mean) / torch.where(flat, 1.0, std)
    w = torch.where(flat, 1.0 / k, torch.softmax(z, dim=1))
    return w[0] if single else w


__all__ = ["batch_means", "projection_cosine", "projector", "projector_recursive", "subspace_weights"]
