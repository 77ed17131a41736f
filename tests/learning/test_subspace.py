"""FedD3A's subspace projection (Eq. 5) and teacher weights (Eq. 6): the recursion equals the closed form
(Sherman-Morrison), a 2-D example by hand, the projector's span / orthogonal behaviour and spectrum, the
cosine score's range and zero guards, and the softmax weights' normalisation, ties and monotonicity."""

import math

import pytest
import torch

from fedray.learning.subspace import (
    batch_means,
    projection_cosine,
    projector,
    projector_recursive,
    subspace_weights,
)

F64 = torch.float64


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


# ---------------------------------------------------------------- Eq. 5 and its closed form


def test_hand_example_2d():
    # Zb = [[1, 0]], a = 1: P_hat = (I + diag(1, 0))^-1 = diag(1/2, 1), P = I - P_hat = diag(1/2, 0).
    zb = torch.tensor([[1.0, 0.0]], dtype=F64)
    want = torch.tensor([[0.5, 0.0], [0.0, 0.0]], dtype=F64)
    assert torch.allclose(projector_recursive(zb, 1.0), want, atol=1e-15)
    assert torch.allclose(projector(zb, 1.0), want, atol=1e-15)
    # a = 3: the kept share of the span direction is lam / (lam + a) = 1 / 4.
    assert torch.allclose(projector(zb, 3.0), torch.diag(torch.tensor([0.25, 0.0], dtype=F64)), atol=1e-15)
    # Two batch means [2, 0] and [0, 1], a = 1: diag(4 / 5, 1 / 2).
    zb2 = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=F64)
    want2 = torch.diag(torch.tensor([0.8, 0.5], dtype=F64))
    assert torch.allclose(projector_recursive(zb2, 1.0), want2, atol=1e-15)
    assert torch.allclose(projector(zb2, 1.0), want2, atol=1e-15)


@pytest.mark.parametrize("a", [1e-2, 1.0, 7.5, 1e3])
@pytest.mark.parametrize("m,d", [(3, 6), (6, 6), (20, 5)])  # fewer, as many and more batch means than dims
def test_recursion_equals_closed_form(a, m, d):
    zb = _randn(m, d, seed=m * 10 + d) * 2.0
    rec = projector_recursive(zb, a)
    closed = projector(zb, a)
    assert rec.dtype == closed.dtype == F64
    assert torch.allclose(rec, closed, rtol=0, atol=1e-10)
    # and both equal the textbook forms
    eye = torch.eye(d, dtype=F64)
    assert torch.allclose(closed, eye - a * torch.linalg.inv(a * eye + zb.T @ zb), atol=1e-10)
    assert torch.allclose(closed, zb.T @ torch.linalg.inv(zb @ zb.T + a * torch.eye(m, dtype=F64)) @ zb,
                          atol=1e-10)


def test_a_one_is_identity_minus_p_hat():
    zb = _randn(4, 5, seed=1)
    p_hat = torch.eye(5, dtype=F64) / 1.0
    for z in zb:  # Eq. 5 written out once more, independently of the module
        p_hat = p_hat - (p_hat @ torch.outer(z, z) @ p_hat) / (1 + z @ p_hat @ z)
    assert torch.allclose(projector(zb, 1.0), torch.eye(5, dtype=F64) - p_hat, atol=1e-12)
    assert torch.allclose(projector_recursive(zb, 1.0), torch.eye(5, dtype=F64) - p_hat, atol=1e-12)


def test_batch_means_and_projector_batch_size():
    z = torch.arange(14, dtype=F64).reshape(7, 2)  # rows (0,1), (2,3), ..., (12,13)
    # batches of 3: rows 0-2, 3-5, and the remaining row 6
    want = torch.tensor([[2.0, 3.0], [8.0, 9.0], [12.0, 13.0]], dtype=F64)
    assert torch.equal(batch_means(z, 3), want)
    assert torch.equal(batch_means(z, None), z)
    assert torch.equal(batch_means(z, 1), z)
    assert torch.allclose(projector(z, 2.0, batch_size=3), projector_recursive(want, 2.0), atol=1e-12)
    assert torch.allclose(projector(z, 2.0), projector_recursive(z, 2.0), atol=1e-12)
    # float32 input is promoted, the result is float64
    assert projector(z.float(), 1.0).dtype == F64


def test_projector_span_and_orthogonal_complement():
    d = 6
    basis = torch.linalg.qr(_randn(d, d, seed=2))[0]
    span, orth = basis[:, :2], basis[:, 2:]
    zb = (_randn(5, 2, seed=3) * 3.0) @ span.T  # 5 batch means in a 2-D subspace
    p = projector(zb, 1e-9)
    u_in = span @ torch.tensor([0.3, -1.2], dtype=F64)
    u_out = orth @ torch.tensor([1.0, 2.0, -0.5, 0.7], dtype=F64)
    assert torch.allclose(p @ u_in, u_in, atol=1e-8)
    assert torch.allclose(p @ u_out, torch.zeros(d, dtype=F64), atol=1e-12)
    # the hard limit is the orthogonal projector onto the span
    assert torch.allclose(p, span @ span.T, atol=1e-8)
    # the recursion agrees at a small ridge too (looser: it subtracts from I / a = 1e9 I)
    assert torch.allclose(projector_recursive(zb, 1e-3), projector(zb, 1e-3), atol=1e-6)


@pytest.mark.parametrize("a", [1e-3, 1.0, 1e3])
def test_projector_spectrum_in_unit_interval(a):
    z = _randn(40, 8, seed=4)
    for bs in (None, 16):
        p = projector(z, a, batch_size=bs)
        assert torch.equal(p, p.T)
        ev = torch.linalg.eigvalsh(p)
        assert ev.min() >= -1e-12 and ev.max() < 1.0
        # eigenvalues are lam / (lam + a) of Zb^T Zb
        lam = torch.linalg.eigvalsh(batch_means(z, bs).T @ batch_means(z, bs))
        assert torch.allclose(ev, lam / (lam + a), atol=1e-10)


def test_bad_arguments():
    z = _randn(3, 2)
    for a in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            projector(z, a)
        with pytest.raises(ValueError):
            projector_recursive(z, a)
    with pytest.raises(ValueError):
        projector(z, 1.0, batch_size=0)
    with pytest.raises(ValueError):
        projector(z[0], 1.0)
    with pytest.raises(ValueError):
        projection_cosine(torch.eye(3), z)
    with pytest.raises(ValueError):
        subspace_weights(z, correction=2)


# ---------------------------------------------------------------- cos(u, P u)


def test_projection_cosine_by_hand():
    p = torch.diag(torch.tensor([0.5, 0.0], dtype=F64))  # the 2-D example above
    u = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]], dtype=F64)
    r = projection_cosine(p, u)
    assert r.shape == (4, 1)
    # [1, 0] in the span: 1; [0, 1] orthogonal: Pu = 0 -> 0; [1, 1]: Pu = [.5, 0] -> cos 45 deg; zero u -> 0
    assert torch.allclose(r[:, 0], torch.tensor([1.0, 0.0, 1 / math.sqrt(2), 0.0], dtype=F64), atol=1e-15)


def test_projection_cosine_range_batched_and_span():
    d = 7
    zs = [_randn(30, d, seed=10 + k) for k in range(3)]
    P = torch.stack([projector(z, a, batch_size=4) for z, a in zip(zs, (1e-2, 1.0, 50.0))])
    u = _randn(25, d, seed=20)
    r = projection_cosine(P, u)
    assert r.shape == (25, 3) and r.dtype == F64
    assert (r >= 0).all() and (r <= 1).all()
    # batched == one client at a time == the plain formula
    for k in range(3):
        assert torch.allclose(r[:, k], projection_cosine(P[k], u)[:, 0], atol=1e-14)
        pu = u @ P[k].T
        assert torch.allclose(r[:, k], torch.nn.functional.cosine_similarity(u, pu, dim=1), atol=1e-12)
    # a vector of a client's span scores 1 against a hard projector onto that span
    basis = torch.linalg.qr(_randn(d, 3, seed=5))[0]
    p_hard = projector(_randn(4, 3, seed=6) @ basis.T, 1e-10)
    u_span = _randn(6, 3, seed=7) @ basis.T
    assert torch.allclose(projection_cosine(p_hard, u_span), torch.ones(6, 1, dtype=F64), atol=1e-9)


def test_projection_cosine_chunks(monkeypatch):
    import fedray.learning.subspace as sub

    P = torch.stack([projector(_randn(10, 4, seed=k), 1.0) for k in range(2)])
    u = _randn(9, 4, seed=8)
    full = projection_cosine(P, u)
    monkeypatch.setattr(sub, "_COS_BUDGET", 8)  # one row per chunk
    assert torch.allclose(sub.projection_cosine(P, u), full, atol=1e-15)


# ---------------------------------------------------------------- Eq. 6


def test_weights_sum_to_one_uniform_on_ties_and_monotone():
    r = torch.tensor([[0.9, 0.5, 0.1], [0.3, 0.3, 0.3], [0.2, 0.8, 0.5]], dtype=F64)
    w = subspace_weights(r)
    assert w.shape == (3, 3) and w.dtype == F64
    assert torch.allclose(w.sum(dim=1), torch.ones(3, dtype=F64), atol=1e-15)
    assert torch.allclose(w[1], torch.full((3,), 1 / 3, dtype=F64))
    for row_r, row_w in zip(r, w):
        order = torch.argsort(row_r)
        assert (row_w[order].diff() > 0).all() or torch.equal(row_r, row_r[0].expand(3))


def test_weights_by_hand_sample_vs_population_std():
    r = torch.tensor([0.0, 1.0], dtype=F64)  # mean 0.5; sample std 1/sqrt(2), population std 1/2
    w = subspace_weights(r)
    s = math.sqrt(2) / 2
    e0, e1 = math.exp(-0.5 / s), math.exp(0.5 / s)
    assert torch.allclose(w, torch.tensor([e0, e1], dtype=F64) / (e0 + e1), atol=1e-15)
    wp = subspace_weights(r, correction=0)  # z = [-1, 1]
    assert torch.allclose(wp, torch.softmax(torch.tensor([-1.0, 1.0], dtype=F64), 0), atol=1e-15)
    # invariant to shifting and scaling r (it is standardised first)
    assert torch.allclose(subspace_weights(3 * r + 7), w, atol=1e-14)


def test_weights_degenerate_rows():
    assert torch.equal(subspace_weights(torch.tensor([[0.7]], dtype=F64)), torch.ones(1, 1, dtype=F64))
    assert torch.equal(subspace_weights(torch.tensor([[0.7]]), correction=0), torch.ones(1, 1, dtype=F64))
    tied = torch.full((2, 4), 0.123456789, dtype=F64)
    tied[1] += torch.tensor([0.0, 1e-17, 0.0, -1e-17], dtype=F64)  # rounding-level differences
    assert torch.equal(subspace_weights(tied), torch.full((2, 4), 0.25, dtype=F64))
    assert not subspace_weights(tied).isnan().any()


def test_projection_cosine_refuses_other_shapes_naming_them_and_takes_more_clients_than_dimensions():
    with pytest.raises(ValueError, match=r"P must be \(k, d, d\) or \(d, d\), got shape \(2, 3, 4\)"):
        projection_cosine(torch.zeros(2, 3, 4), torch.zeros(5, 3))
    with pytest.raises(ValueError, match=r"P must be .* got shape \(3, 3, 3, 3\)"):
        projection_cosine(torch.zeros(3, 3, 3, 3), torch.zeros(5, 3))
    with pytest.raises(ValueError, match=r"u must be \(n, 3\), got shape \(5, 4\)"):
        projection_cosine(torch.eye(3), torch.zeros(5, 4))
    P = torch.stack([projector(_randn(6, 2, seed=k), 1.0) for k in range(5)])  # 5 clients, 2 dimensions
    u = _randn(4, 2, seed=9)
    r = projection_cosine(P, u)
    for k in range(5):
        assert torch.allclose(r[:, k], torch.nn.functional.cosine_similarity(u, u @ P[k].T, dim=1), atol=1e-12)


def test_subspace_weights_shapes_a_single_client_and_refusals():
    """A 1-D r of k scores gives k weights; one client gets weight 1; another shape or correction is refused
    naming it."""
    one = subspace_weights(torch.tensor([0.7], dtype=F64))
    assert one.shape == (1,) and float(one[0]) == 1.0
    row = subspace_weights(torch.tensor([0.1, 0.5, 0.2], dtype=F64))
    assert row.shape == (3,) and torch.allclose(row, subspace_weights(torch.tensor([[0.1, 0.5, 0.2]], dtype=F64))[0])
    with pytest.raises(ValueError, match=r"r must be \(n, k\) with k >= 1, got shape \(2, 3, 4\)"):
        subspace_weights(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match=r"r must be \(n, k\) with k >= 1, got shape \(4, 0\)"):
        subspace_weights(torch.zeros(4, 0))
    with pytest.raises(ValueError, match=r"correction must be 1 \(sample std\) or 0 \(population std\), got 2"):
        subspace_weights(torch.zeros(4, 3), correction=2)
