"""q-FFL (q-FedAvg) against its closed form on a quadratic toy problem; FedGKD's buffered teacher and loss;
two-round runs of both."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedray.methods import DataSpec, ServerContext
from fedray.methods.fedavg import ModelUpload
from fedray.methods.fedgkd import FedGKD, GKDModules
from fedray.methods.qffl import QFFL, QFFLUpload, qffl_terms
from fedray.learning.training import IGNORE_LABEL
from fedray.data import build_federated_data
from fedray.runtime.core import ClientWorkerCore
from fedray.runtime.server_core import ServerCore
from fedray.simulation import run_experiment
from tests.conftest import tiny_config

SPEC4 = DataSpec(input_shape=(1, 16, 16), num_classes=10, num_clients=4, mean=(0.5,), std=(0.25,))


def _ctx(r):
    return ServerContext(round=r, seed=0, device=torch.device("cpu"), modules=None)


# --- q-FFL ---------------------------------------------------------------------------------------------

# Client k's objective F_k(w) = 1/2 ||w - c_k||^2; its local training is one gradient step of size lr, so
# w_k = w - lr (w - c_k) and g_k = (w - w_k) / lr = w - c_k, F_k = ||g_k||^2 / 2. Then
# Delta_k = F_k^q g_k and h_k = q F_k^(q-1) ||g_k||^2 + F_k^q / lr = F_k^q (2q + 1/lr), so q-FedAvg's step is
#   w+ = w - lr / (1 + 2 q lr) * sum_k pi_k g_k,   pi_k = F_k^q / sum_j F_j^q.
W = torch.tensor([0.0, 0.0], dtype=torch.float64)
CENTERS = [torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 3.0], dtype=torch.float64)]
LR = 0.1


def _closed_form(q: float) -> torch.Tensor:
    g = [W - c for c in CENTERS]
    f = [0.5 * float(gk @ gk) for gk in g]
    pi = [fk ** q / sum(fj ** q for fj in f) for fk in f]
    return W - LR / (1 + 2 * q * LR) * sum(p * gk for p, gk in zip(pi, g))


def _qffl_step(q: float) -> torch.Tensor:
    algo = QFFL(tiny_config(algorithm__name="qffl", algorithm__q=q), SPEC4)
    w = {"w": W.clone()}
    uploads = []
    for c in CENTERS:
        w_k = {"w": W - LR * (W - c)}
        loss = 0.5 * float((W - c) @ (W - c))
        delta, h = qffl_terms(w, w_k, loss, q, LR)
        uploads.append(QFFLUpload(delta=delta, h=h))
    state, metrics = algo.server_update(algo_state(w), uploads, _ctx(1))
    assert metrics["server/h_sum"] == pytest.approx(sum(u.h for u in uploads))
    return state.weights["w"]


def algo_state(w):
    from fedray.methods.fedavg import ModelState

    return ModelState(weights=w)


@pytest.mark.parametrize("q", [0.0, 1e-4, 1.0, 2.0, 5.0])
def test_qffl_step_matches_the_closed_form_on_a_quadratic(q):
    assert torch.allclose(_qffl_step(q), _closed_form(q), rtol=1e-7, atol=1e-9)


def test_qffl_with_q0_is_the_plain_mean_and_larger_q_favours_the_worst_client():
    mean_of_locals = sum(W - LR * (W - c) for c in CENTERS) / len(CENTERS)
    assert torch.allclose(_qffl_step(0.0), mean_of_locals, atol=1e-9)

    # Client 1 (centre (0, 3), F = 4.5) is worse off than client 0 (centre (1, 0), F = 0.5): as q grows the
    # step turns towards client 1's centre (the fairness knob), while h_k's 2q term shortens it.
    def tilt(q):
        step = _qffl_step(q) - W
        return float(step[1] / step[0])

    tilts = [tilt(q) for q in (0.0, 1.0, 5.0)]
    assert tilts == sorted(tilts) and tilts[0] == pytest.approx(3.0) and tilts[2] > 100


def test_qffl_client_uploads_delta_and_h_of_its_own_local_training():
    cfg = tiny_config(algorithm__name="qffl", algorithm__q=0.5)
    data = build_federated_data(cfg.data, cfg.seed)
    server = ServerCore(cfg, data, torch.device("cpu"))
    worker = ClientWorkerCore(cfg, data, torch.device("cpu"))
    payload, _ = server.payload(0)
    upload, state, info, _ = worker.train(1, 0, payload, None)
    assert isinstance(upload, QFFLUpload) and state is None
    # the same client under FedAvg trains to the same w_k (same seed, same batches)
    fedavg = ClientWorkerCore(tiny_config(), data, torch.device("cpu"))
    trained, _, _, _ = fedavg.train(1, 0, payload, None)
    f = info["train/loss_before"]
    assert f > 0
    expect_delta, expect_h = qffl_terms(payload.weights, trained.weights, f, 0.5, cfg.federation.lr)
    assert upload.h == pytest.approx(expect_h, rel=1e-9)
    assert all(torch.equal(upload.delta[k], expect_delta[k]) for k in expect_delta)
    g = {k: (payload.weights[k].double() - trained.weights[k].double()) / cfg.federation.lr for k in expect_delta}
    for k in g:  # Delta_k = F_k^q (w - w_k) / lr
        assert torch.allclose(upload.delta[k].double(), (f + 1e-10) ** 0.5 * g[k], rtol=1e-5, atol=1e-7)


# --- FedGKD ----------------------------------------------------------------------------------------------


def _lin(value):
    lin = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(value)
    return lin


def _teacher_value(algo, state, r):
    t = algo.broadcast(state, r).teacher
    return None if t is None else float(t["weight"].item())


@pytest.mark.parametrize("full_only", [False, True])
def test_fedgkd_teacher_is_the_mean_of_the_last_m_global_models(full_only):
    cfg = tiny_config(algorithm__name="fedgkd", algorithm__buffer_size=3, algorithm__full_buffer_only=full_only)
    algo = FedGKD(cfg, SPEC4)
    state = algo.init_server_state(GKDModules(model=_lin(0.0), teacher=_lin(0.0)))
    values = [1.0, 2.0, 4.0, 8.0, 16.0]  # the global model after rounds 1..5 (one client per round)
    # w0 = 0 is buffered unless full_buffer_only; the teacher of round r averages the last 3 global models
    expected = ([0.0, 0.5, 1.0, 7 / 3, 14 / 3, 28 / 3] if not full_only
                else [None, None, None, 7 / 3, 14 / 3, 28 / 3])
    assert _teacher_value(algo, state, 1) == expected[0]
    for r, v in enumerate(values, start=1):
        up = ModelUpload({"weight": torch.tensor([[v]])}, num_samples=5)
        state, _ = algo.server_update(state, [up], _ctx(r))
        assert float(state.weights["weight"].item()) == v
        assert len(state.buffer) <= 3  # bounded by M
        t = _teacher_value(algo, state, r + 1)
        assert (t is None) if expected[r] is None else t == pytest.approx(expected[r], rel=1e-6)


def test_fedgkd_server_step_is_the_sample_weighted_mean_and_buffers_it():
    algo = FedGKD(tiny_config(algorithm__name="fedgkd", algorithm__buffer_size=2), SPEC4)
    state = algo.init_server_state(GKDModules(model=_lin(0.0), teacher=_lin(0.0)))
    ups = [ModelUpload({"weight": torch.tensor([[1.0]])}, num_samples=1),
           ModelUpload({"weight": torch.tensor([[5.0]])}, num_samples=3)]
    state, _ = algo.server_update(state, ups, _ctx(1))
    assert float(state.weights["weight"].item()) == (1 * 1.0 + 3 * 5.0) / 4  # 4.0, FedAvg's mean
    assert _teacher_value(algo, state, 2) == pytest.approx((0.0 + 4.0) / 2)  # the buffer: w0 = 0 and 4


def test_fedgkd_local_loss_is_ce_plus_half_gamma_kl():
    algo = FedGKD(tiny_config(algorithm__name="fedgkd", algorithm__gamma=0.4), SPEC4)
    torch.manual_seed(0)
    model, teacher = nn.Linear(3, 4), nn.Linear(3, 4)
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 2, 3, 0])
    with torch.no_grad():
        p_t, log_p_s = teacher(x).softmax(1), model(x).log_softmax(1)
        kl = float((p_t * (p_t.log() - log_p_s)).sum(1).mean())
        ce = float(F.cross_entropy(model(x), y))
    assert float(algo.local_loss(model, x, y, teacher).detach()) == pytest.approx(ce + 0.2 * kl, rel=1e-6)
    assert float(algo.local_loss(model, x, y, None).detach()) == pytest.approx(ce, rel=1e-6)
    # padded with 3 rows labelled IGNORE_LABEL (the vectorised runtime's short batch): both terms are the means over
    # the 5 real rows, whatever the padded rows hold
    padded_x, padded_y = torch.cat([x, 50 * torch.randn(3, 3)]), torch.cat([y, torch.full((3,), IGNORE_LABEL)])
    assert float(algo.local_loss(model, padded_x, padded_y, teacher).detach()) == pytest.approx(ce + 0.2 * kl, rel=1e-6)


# --- two-round runs --------------------------------------------------------------------------------------


def test_two_round_runs_of_qffl_and_fedgkd():
    fedavg = run_experiment(tiny_config(), progress=False).summary
    qffl = run_experiment(tiny_config(algorithm__name="qffl"), progress=False)
    gkd = run_experiment(tiny_config(algorithm__name="fedgkd"), progress=False)
    late = run_experiment(tiny_config(algorithm__name="fedgkd", algorithm__full_buffer_only=True), progress=False)
    for res in (qffl, gkd, late):
        assert [r["round"] for r in res.history] == [1, 2]
        assert all(math.isfinite(res.summary[f"eval/{k}"]) for k in ("accuracy", "amp", "fm", "wlp"))
    assert all(r["server/h_sum"] > 0 and r["train/loss_before"] > 0 for r in qffl.history)
    # q-FFL uploads (Delta_k, h_k): as many bytes as FedAvg's (weights, |D_k|)
    assert qffl.summary["comm/bytes_up"] == fedavg["comm/bytes_up"]
    # FedGKD's teacher is a second model sent down; with full_buffer_only it is not sent before M models exist
    assert gkd.summary["comm/bytes_down"] == 2 * fedavg["comm/bytes_down"]
    assert late.summary["comm/bytes_down"] == fedavg["comm/bytes_down"]
    # with no teacher FedGKD is FedAvg, step for step
    plain = run_experiment(tiny_config(), progress=False)
    assert [r["train/loss"] for r in late.history] == [r["train/loss"] for r in plain.history]


def test_qffl_terms_skip_integer_buffers_wherever_they_sit_and_difference_in_float64():
    """Delta_k and h_k over the floating-point entries only: an integer buffer (BatchNorm's num_batches_tracked)
    before the others is skipped, not the end of the model; (w - w_k) / lr is taken in float64 from the float32
    weights (in float32 h_k would be off by ~1e-8 here)."""
    w = {"bn.num_batches_tracked": torch.tensor(3), "b": torch.tensor([0.3, 4.0])}
    w_k = {"bn.num_batches_tracked": torch.tensor(5), "b": torch.tensor([0.1, 1.0])}
    q, lr, loss = 2.0, 0.1, 3.0
    delta, h = qffl_terms(w, w_k, loss, q, lr)
    f = loss + 1e-10
    g = [(float(a) - float(b)) / lr for a, b in zip(w["b"], w_k["b"])]  # float64, from the float32 values
    assert set(delta) == {"b"} and delta["b"].dtype == torch.float32
    assert delta["b"].tolist() == pytest.approx([f**q * v for v in g], rel=1e-6)
    assert h == pytest.approx(q * f ** (q - 1) * sum(v * v for v in g) + f**q / lr, rel=1e-12)
