"""A resume restores the driver's global random state: a method (or a model: dropout, an unseeded draw) that draws
from torch's or numpy's global generator after set-up continues after a resume exactly as without the stop."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fedray.methods import register_algorithm
from fedray.methods.fedavg import FedAvg


@register_algorithm
class GlobalDraws(FedAvg):
    """FedAvg whose server adds a draw of torch's global generator to the model and logs one of numpy's."""

    name = "test_global_draws"

    def server_update(self, state, uploads, ctx):
        state, metrics = super().server_update(state, uploads, ctx)
        weights = {k: v + 1e-3 * torch.randn(v.shape) if torch.is_floating_point(v) else v
                   for k, v in state.weights.items()}
        return dataclasses.replace(state, weights=weights), {**metrics, "test/numpy_draw": float(np.random.rand())}


def test_a_resumed_run_draws_from_the_global_generators_as_the_uninterrupted_one(tmp_path):
    from fedray.simulation import run_experiment
    from tests.conftest import tiny_config
    from tests.test_every_method import CrashAfter, _Crash, _figures

    cfg = tiny_config(algorithm__name="test_global_draws", federation__rounds=3, runtime__checkpoint_every=1)
    whole = run_experiment(cfg, progress=False).history
    with pytest.raises(_Crash):
        run_experiment(cfg, tmp_path / "run", progress=False, hooks=[CrashAfter(2)])
    torch.manual_seed(12345)  # whatever the process drew meanwhile
    np.random.seed(12345)
    resumed = run_experiment(cfg, tmp_path / "run", progress=False, resume_from=tmp_path / "run").history
    assert _figures(resumed) == _figures(whole)
    assert len({row["test/numpy_draw"] for row in whole}) == 3
