"""Per-client state beyond a bound on disk (runtime.client_state_memory): the store gives back exactly what it was
given, and a run with it (resumed too) has the figures of the run that keeps every state in memory."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fedray.learning.store import ClientStore


@dataclass
class _State:
    client_id: int
    weights: dict[str, torch.Tensor]


def test_the_store_keeps_the_recently_used_in_memory_and_the_rest_on_disk_exactly():
    """Bound 2, five states: two in memory, three written out (one file each); every state read back bit for bit
    (a dataclass of tensors, a float64 NaN included); reading one brings it back into memory and evicts the least
    recently used; the checkpoint's copy holds all five and changes nothing; the temporary folder goes with it."""
    store = ClientStore(2)
    states = {k: _State(k, {"w": torch.randn(3, 4), "z": torch.tensor([float(k), float("nan")], dtype=torch.float64)})
              for k in range(5)}
    for k, s in states.items():
        store[k] = s
    assert store.in_memory() == 2 and store.writes == 3 and len(list(store.folder.glob("*.pt"))) == 3
    copy = store.as_dict()
    assert list(copy) == [0, 1, 2, 3, 4] and store.in_memory() == 2 and store.writes == 3
    for k in (0, 4, 2):
        got = store[k]
        assert got.client_id == k and torch.equal(got.weights["w"], states[k].weights["w"])
        assert torch.equal(got.weights["z"][:1], states[k].weights["z"][:1]) and torch.isnan(got.weights["z"][1])
    assert store.in_memory() == 2 and 0 not in store._memory and set(store) == set(range(5)) and len(store) == 5
    del store[3]
    assert 3 not in store and len(store) == 4
    folder = store.folder
    store.close()
    assert not folder.exists()
    with pytest.raises(ValueError):
        ClientStore(0)


def test_a_run_with_states_on_disk_and_its_resume_give_the_in_memory_figures(tmp_path):
    """SCAFFOLD's control variates and compression's error-feedback residuals of 6 clients, at most 2 of each in
    memory: the figures of the run that keeps them all in memory, and the same again stopped after round 2 and
    resumed (the checkpoint holds every state, whichever were on disk)."""
    from fedray.simulation import run_experiment
    from tests.conftest import tiny_config
    from tests.test_every_method import CrashAfter, _Crash, _figures

    base = dict(algorithm__name="scaffold", federation__rounds=3, channel__sparsify="topk", channel__fraction=0.2,
                channel__error_feedback=True, runtime__checkpoint_every=1)
    plain = run_experiment(tiny_config(**base), progress=False).history
    bounded = tiny_config(**base, runtime__client_state_memory=2, runtime__client_state_dir=str(tmp_path / "states"))
    assert _figures(run_experiment(bounded, progress=False).history) == _figures(plain)
    with pytest.raises(_Crash):
        run_experiment(bounded, tmp_path / "run", progress=False, hooks=[CrashAfter(2)])
    resumed = run_experiment(bounded, tmp_path / "run", progress=False, resume_from=tmp_path / "run").history
    assert _figures(resumed) == _figures(plain)
    assert len(list((tmp_path / "states" / "clients").glob("*.pt"))) >= 1  # some states were on disk
