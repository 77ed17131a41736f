"""SCAFFOLD (option II): the client's corrected steps and control variate, and the server's two updates, by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedray.errors import ConfigError
from fedray.learning.training import run_update
from fedray.methods import DataSpec, validate_experiment
from fedray.methods.api import ServerContext
from fedray.methods.scaffold import Scaffold, ScaffoldState, ScaffoldUpload
from tests.conftest import method_overrides, tiny_config
from tests.methods.plans import client_step

# every client in every round: in round 2 each holds a control variate c_i of its own, and the server's c is not 0
ALL_CLIENTS = {**method_overrides("scaffold"), "federation__clients_per_round": 6}


def test_a_clients_steps_are_corrected_by_c_minus_ci_and_option_ii_gives_its_new_ci():
    """Alg. 1 lines 10-13 by hand: K steps y <- y - lr (grad CE(y) + c - c_i) from x, then
    c_i+ = c_i - c + (x - y) / (K lr); the upload is y and Delta c_i = c_i+ - c_i, and c_i+ is the client's state."""
    with client_step(2, **ALL_CLIENTS) as s:
        c, c_i, x = s.payload.control, s.state.control, s.payload.weights
        assert max(float(v.abs().max()) for v in c.values()) > 0 and max(float(v.abs().max()) for v in c_i.values()) > 0
        result = run_update(s.ctx, s.plan)
        model, lr, steps = s.plan.model, s.ctx.fed.lr, s.ctx.num_local_steps()
        model.load_state_dict(x)
        model.train()
        for bx, by in s.ctx.batches():
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(bx), by).backward()
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p -= lr * (p.grad + c[k] - c_i[k])
        y = {k: v.detach() for k, v in model.state_dict().items()}
        for k in y:
            torch.testing.assert_close(result.upload.weights[k], y[k], rtol=1e-5, atol=1e-6)
        for k in c:
            new = c_i[k] - c[k] + (x[k] - y[k]) / (steps * lr)
            torch.testing.assert_close(result.state.control[k], new, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(result.upload.control_delta[k], new - c_i[k], rtol=1e-4, atol=1e-4)
        assert set(result.upload.control_delta) == {k for k, _ in model.named_parameters()}


def test_the_server_moves_x_by_eta_g_times_the_mean_update_and_c_by_s_over_n_times_the_mean_delta():
    """Alg. 1 lines 16-17 with eta_g = 0.5, |S| = 2 of N = 6: x + 0.5 * mean(y_i - x) (uniform, not by samples) and
    c + (2/6) * mean(Delta c_i)."""
    cfg = validate_experiment(tiny_config(algorithm__name="scaffold", algorithm__server_lr=0.5))
    algo = Scaffold(cfg, DataSpec(input_shape=(1, 16, 16), num_classes=10, num_clients=6, mean=(0.5,), std=(0.25,)))
    g = torch.Generator().manual_seed(0)
    rand = lambda w: {k: torch.randn(v.shape, generator=g) for k, v in w.items()}  # noqa: E731
    modules = algo.build_modules()
    state = algo.init_server_state(modules)
    floats = {k: v for k, v in state.weights.items() if v.is_floating_point()}
    state = ScaffoldState(weights={**state.weights, **rand(floats)}, control=rand(state.control))
    ups = [ScaffoldUpload(weights={**state.weights, **rand(floats)}, num_samples=n, control_delta=rand(state.control))
           for n in (10, 90)]
    new, metrics = algo.server_update(state, ups, ServerContext(1, 0, torch.device("cpu"), modules))
    for k in floats:
        mean_y = (ups[0].weights[k] + ups[1].weights[k]) / 2
        torch.testing.assert_close(new.weights[k], state.weights[k] + 0.5 * (mean_y - state.weights[k]))
    for k in state.control:
        mean_d = (ups[0].control_delta[k] + ups[1].control_delta[k]) / 2
        torch.testing.assert_close(new.control[k], state.control[k] + (2 / 6) * mean_d)
    norm = torch.sqrt(sum((v.double() ** 2).sum() for v in new.control.values()))
    assert metrics["server/control_norm"] == pytest.approx(float(norm))


def test_adam_is_refused_in_one_line_naming_the_key():
    with pytest.raises(ConfigError, match="federation.optimizer.*sgd") as err:
        validate_experiment(tiny_config(algorithm__name="scaffold", federation__optimizer="adam"))
    assert "\n" not in str(err.value)
