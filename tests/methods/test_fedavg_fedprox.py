"""FedAvg / FedProx: server step against hand-computed values, the proximal term. (Every method learning on the
synthetic task: tests/test_every_method.py.)"""

import math

import pytest
import torch

from fedray.methods import get_algorithm
from fedray.methods.api import ServerContext
from fedray.methods.fedavg import ModelState, ModelUpload
from fedray.methods.fedprox import FedProx
from fedray.learning.weights import nbytes, weighted_average
from fedray.data import build_federated_data
from fedray.runtime.core import ClientWorkerCore
from fedray.runtime.server_core import ServerCore
from tests.conftest import tiny_config


def _ctx():
    return ServerContext(round=1, seed=0, device=torch.device("cpu"), modules=None)


@pytest.mark.parametrize("name", ["fedavg", "fedprox"])
def test_server_step_is_the_sample_weighted_mean(name):
    algo = get_algorithm(name)(tiny_config(algorithm__name=name), None)
    ups = [
        ModelUpload({"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(5)}, num_samples=1),
        ModelUpload({"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(9)}, num_samples=3),
    ]
    state, metrics = algo.server_update(ModelState({}), ups, _ctx())
    # (1*[1,2] + 3*[3,6]) / 4 = [2.5, 5.0]; integer buffers are not averaged.
    assert torch.equal(state.weights["w"], torch.tensor([2.5, 5.0]))
    assert state.weights["n"].item() == 5
    assert metrics == {}


def test_weighted_average_is_exact_for_equal_weights():
    a, b = {"w": torch.randn(100)}, {"w": torch.randn(100)}
    avg = weighted_average([a, b], [1, 1])
    assert torch.allclose(avg["w"], (a["w"] + b["w"]) / 2, atol=1e-7)


def test_weighted_average_keeps_the_bits_of_the_plain_float64_sum():
    """Its buffer reuse must not change a bit: recorded figures rest on ``sum_k w_k.to(float64) * (c_k / total)``."""
    g = torch.Generator().manual_seed(0)
    ups = [{"conv": torch.randn(8, 3, 3, 3, generator=g), "half": torch.randn(5, generator=g).to(torch.bfloat16),
            "n": torch.tensor(i)} for i in range(7)]
    coefs = [float(c) for c in torch.randint(1, 500, (7,), generator=g)]
    avg = weighted_average(ups, coefs)
    for key in ("conv", "half"):
        ref = torch.zeros_like(ups[0][key], dtype=torch.float64)
        for w, c in zip(ups, coefs):
            ref += w[key].to(torch.float64) * (c / sum(coefs))
        assert avg[key].dtype == ups[0][key].dtype and torch.equal(avg[key], ref.to(ups[0][key].dtype))
    assert avg["n"] == 0  # integer buffers: the first client's


def test_nbytes_counts_tensors_and_scalars():
    up = ModelUpload({"w": torch.zeros(10), "b": torch.zeros(3, dtype=torch.float64)}, num_samples=4)
    assert nbytes(up) == 10 * 4 + 3 * 8 + 8


def test_fedprox_loss_adds_half_mu_squared_distance():
    cfg = tiny_config(algorithm__name="fedprox", algorithm__mu=0.5)
    algo = get_algorithm("fedprox")(cfg, None)
    model = torch.nn.Linear(3, 2)
    anchor = algo.make_anchor(model)
    with torch.no_grad():
        model.weight.add_(1.0)  # 6 weights moved by 1 -> ||w - w_t||^2 = 6
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    ce = torch.nn.functional.cross_entropy(model(x), y)
    assert math.isclose(float(algo.local_loss(model, x, y, anchor).detach()), float(ce) + 0.5 * 0.5 * 6, rel_tol=1e-6)


def _client_drift(name: str, mu: float | None = None) -> float:
    over = {"algorithm__name": name, "federation__local_steps": 30, "federation__lr": 0.1}
    if mu is not None:
        over["algorithm__mu"] = mu
    cfg = tiny_config(**over)
    data = build_federated_data(cfg.data, cfg.seed)
    server = ServerCore(cfg, data, torch.device("cpu"))
    worker = ClientWorkerCore(cfg, data, torch.device("cpu"))
    payload, _ = server.payload(0)
    upload, state, info, _ = worker.train(1, 0, payload, None)
    assert state is None and info["train/loss"] > 0
    return sum(float(((upload.weights[k] - payload.weights[k]) ** 2).sum()) for k in payload.weights)


def test_fedprox_keeps_clients_closer_to_the_global_model():
    assert _client_drift("fedprox", mu=10.0) < 0.5 * _client_drift("fedavg")
    # mu = 0 is FedAvg exactly (same seed, same batches)
    assert _client_drift("fedprox", mu=0.0) == pytest.approx(_client_drift("fedavg"), rel=1e-6)


def test_registry_rejects_a_second_class_under_a_taken_name():
    from fedray.methods import register_algorithm

    class Impostor(FedProx):
        name = "fedavg"

    with pytest.raises(ValueError, match="already taken"):
        register_algorithm(Impostor)
