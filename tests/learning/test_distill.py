"""The distillation losses every KD method shares (fedray.learning.distill), by hand on tiny cases: each term's
direction (teacher first or student first), its temperature and T^2 factor, its reduction (the sum over classes,
the mean over rows, a padded batch's rows left out), and a server's distillation step (KDSteps, distil) as the
gradient step of that loss."""

import math

import pytest
import torch

from fedray.learning import optim
from fedray.learning.distill import (KDSteps, kd_kl, kd_kl_probs, kd_kl_reverse, kl_rows, normalised_entropy,
                                     soft_targets)

S = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]])  # student logits
T = torch.tensor([[0.0, 1.0, 0.0], [3.0, -2.0, 1.0]])  # teacher logits


def _softmax(row: list[float], temp: float = 1.0) -> list[float]:
    e = [math.exp(v / temp) for v in row]
    return [v / sum(e) for v in e]


def _kl(p: list[float], q: list[float]) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def test_soft_targets_are_the_softmax_at_temperature():
    assert soft_targets(T, 2.0)[1].tolist() == pytest.approx(_softmax([3.0, -2.0, 1.0], 2.0))


def test_kl_rows_is_each_rows_kl_with_zero_log_zero():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.25, 0.25, 0.5], [0.5, 0.25, 0.25]])
    assert kl_rows(p, q.log()).tolist() == pytest.approx([_kl(p[0].tolist(), q[0].tolist()),
                                                           _kl(p[1].tolist(), q[1].tolist())])


@pytest.mark.parametrize("temp", [1.0, 3.0])
def test_kd_kl_is_the_teachers_kl_to_the_student_at_temperature_times_t_squared_batch_mean(temp):
    """KL(softmax(t / T) || softmax(s / T)) T^2, averaged over rows: the teacher's distribution first (the reverse
    direction, student first, differs on these rows)."""
    rows = [_kl(_softmax(t, temp), _softmax(s, temp)) for s, t in zip(S.tolist(), T.tolist())]
    assert float(kd_kl(S, T, temp)) == pytest.approx(sum(rows) / 2 * temp**2, rel=1e-5)
    reverse = [_kl(_softmax(s, temp), _softmax(t, temp)) for s, t in zip(S.tolist(), T.tolist())]
    assert abs(sum(reverse) - sum(rows)) > 0.1 * sum(rows)  # the two directions are told apart here
    assert float(kd_kl_probs(S, soft_targets(T, temp), temp)) == pytest.approx(float(kd_kl(S, T, temp)))


def test_kd_kl_over_a_padded_batchs_real_rows_only():
    rows = torch.tensor([False, True])
    one = _kl(_softmax(T[1].tolist()), _softmax(S[1].tolist()))
    assert float(kd_kl(S, T, rows=rows)) == pytest.approx(one, rel=1e-5)


def test_kd_kl_reverse_is_the_students_kl_to_the_teacher_with_a_floor():
    probs = torch.tensor([[0.7, 0.3, 0.0], [0.2, 0.2, 0.6]])
    rows = []
    for s, p in zip(S.tolist(), probs.tolist()):
        q = _softmax(s, 3.0)
        rows.append(sum(qi * (math.log(qi) - math.log(max(pi, 1e-12))) for qi, pi in zip(q, p)))
    assert float(kd_kl_reverse(S, probs, 3.0)) == pytest.approx(sum(rows) / 2 * 9.0, rel=1e-5)  # T^2, not 2T
    assert math.isfinite(float(kd_kl_reverse(S, probs)))  # a class the teacher rules out costs much, not inf


def test_a_student_step_on_kd_kl_moves_it_toward_the_teacher():
    s = S.clone().requires_grad_(True)
    kd_kl(s, T).backward()
    with torch.no_grad():
        closer = s - 0.5 * s.grad
    assert float(kd_kl(closer, T)) < float(kd_kl(S, T))
    assert T.grad is None  # the teacher is not trained through the loss


def test_normalised_entropy():
    w = torch.tensor([[0.5, 1.0, 0.25], [0.5, 0.0, 0.25], [0.0, 0.0, 0.5]])  # columns sum to 1
    h = normalised_entropy(w, dim=0)
    assert h.tolist() == pytest.approx([math.log(2) / math.log(3), 0.0,
                                        -(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5)) / math.log(3)], abs=1e-6)
    assert float(normalised_entropy(torch.full((4,), 0.25))) == pytest.approx(1.0)
    assert normalised_entropy(torch.ones(1, 3), dim=0).tolist() == [0.0, 0.0, 0.0]  # one entry: nothing to spread


@pytest.mark.parametrize("reverse", [False, True])
def test_a_kd_step_is_one_gradient_step_of_the_loss_divided_as_asked(reverse):
    """KDSteps.step(idx): loss = KL(targets[idx] || softmax(model(inputs(idx)) / T)) T^2 / divide_by (reverse: the
    student first), one SGD step on it; it returns that loss."""
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    targets = torch.softmax(torch.randn(6, 3), dim=1)
    model = torch.nn.Linear(4, 3)
    w0 = {k: v.clone() for k, v in model.state_dict().items()}
    opt = optim.SGD(model.parameters(), lr=0.1)
    kd = KDSteps(model, opt, lambda idx: x[idx], targets, 3.0, torch.device("cpu"), False, "test", divide_by=4.0,
                 reverse=reverse)
    idx = torch.tensor([1, 4, 5])
    with kd.running():
        got = kd.step(idx)
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(w0)
    loss_fn = kd_kl_reverse if reverse else kd_kl_probs
    loss = loss_fn(ref(x[idx]), targets[idx], 3.0) / 4.0
    loss.backward()
    assert float(got) == pytest.approx(float(loss.detach()), rel=1e-6)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(model.state_dict()[name], w0[name] - 0.1 * p.grad)


def test_the_kl_losses_default_to_temperature_1():
    probs = soft_targets(T)
    assert float(kd_kl(S, T)) == pytest.approx(sum(_kl(_softmax(t), _softmax(s)) for s, t in
                                                    zip(S.tolist(), T.tolist())) / 2, rel=1e-5)
    assert float(kd_kl_probs(S, probs)) == pytest.approx(float(kd_kl(S, T)))
    reverse = sum(_kl(_softmax(s), _softmax(t)) for s, t in zip(S.tolist(), T.tolist())) / 2
    assert float(kd_kl_reverse(S, probs)) == pytest.approx(reverse, rel=1e-5)
