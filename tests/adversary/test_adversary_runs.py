"""An attacked run resumed gives the uninterrupted figures: the colluding stage reads only the step's uploads. (On Ray:
tests/adversary/test_data_attacks.py's backdoor run, poisoned in the workers; the channel's client side on Ray:
tests/channel/test_channel.py.)"""

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
