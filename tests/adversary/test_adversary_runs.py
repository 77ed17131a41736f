"""Attacked runs on Ray and after a resume give the in-process, uninterrupted figures: the forgeries are seeded by
(round, client) where the client runs and the colluding stage reads only the step's uploads."""

from __future__ import annotations

import pytest

from fedray.simulation import run_experiment
from tests.conftest import tiny_config
from tests.test_every_method import CrashAfter, _Crash, _figures

KRUM = dict(data__num_clients=7, federation__clients_per_round=5, aggregation__rule="krum", aggregation__f=1,
            federation__rounds=3, federation__local_steps=3, adversary__fraction=0.3)


def test_a_colluding_attack_resumed_gives_the_uninterrupted_history(tmp_path):
    cfg = tiny_config(adversary__attack="lie", runtime__checkpoint_every=1, **KRUM)
    whole = run_experiment(cfg, progress=False)
    with pytest.raises(_Crash):
        run_experiment(cfg, tmp_path / "run", progress=False, hooks=[CrashAfter(2)])
    resumed = run_experiment(cfg, tmp_path / "run", progress=False, resume_from=tmp_path / "run")
    assert _figures(resumed.history) == _figures(whole.history)
    assert sum(r["adv/malicious_uploads"] for r in whole.history) > 0


@pytest.mark.ray
def test_on_ray_the_forgeries_and_krums_choice_are_the_in_process_ones(ray_local):
    """Gaussian updates drawn where each malicious client runs (two workers), Krum in the server's actor."""
    kw = dict(adversary__attack="gaussian", adversary__noise_std=0.5, tracking__enabled=False, **KRUM)
    local = run_experiment(tiny_config(**kw), progress=False)
    on_ray = run_experiment(tiny_config(**kw, runtime__backend="ray", runtime__num_workers=2,
                                        runtime__server_in_driver=False), progress=False)
    assert _figures(on_ray.history) == _figures(local.history)
    assert sum(r["adv/malicious_uploads"] for r in local.history) > 0
