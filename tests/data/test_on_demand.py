"""Clients made on demand (fedray.data.on_demand): a client's data is a function of (seed, id) alone, whatever order
clients are derived in; what is kept per registered client is its sizes; pseudo-clients are distinct and seeded."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fedray.data.on_demand import PseudoClients, SampledClients


def _base(n: int = 600, classes: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 1, 8, 8), dtype=np.uint8), np.arange(n, dtype=np.int64) % classes


def _sampled(num_clients: int = 50, seed: int = 3, alpha: float = 0.5, **kw) -> SampledClients:
    x, y = _base()
    return SampledClients(x, y, 4, num_clients, seed, alpha, **kw)


def test_a_clients_data_is_the_same_whatever_order_clients_are_derived_in():
    """Client 7 derived first, last, or by another instance of the same (seed, base): the same rows; another seed
    gives other rows. Its train and test split add up to its drawn size, as the size arrays say."""
    first, later = _sampled(), _sampled()
    a = first.client(7)
    for k in (3, 49, 0, 12):
        later.client(k)
    b = later.client(7)
    assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("train_x", "train_y", "test_x", "test_y"))
    assert not np.array_equal(_sampled(seed=4).indices(7)[0], first.indices(7)[0])
    for k in range(50):
        train, test = first.indices(k)
        assert (len(train), len(test)) == (first.train_sizes()[k], first.test_sizes()[k])
        assert len(train) + len(test) == first.sizes[k] >= 2
    assert first.derivations == 1 and later.derivations == 5  # indices() alone derives nothing


def test_the_sizes_average_the_base_mean_and_the_mixture_follows_alpha():
    """Sizes: log-normal around the mean size (by default the base's examples over the clients, 600 / 50 = 12; set
    to 12 for 4,000 clients, which average it within 5 %).
    Alpha 0.01: nearly every client's examples are of one class; alpha 100: every class about a quarter."""
    many = _sampled(num_clients=4000, mean_size=12)
    assert many.sizes.mean() == pytest.approx(12, rel=0.05) and many.sizes.std() > 3
    crowded = _sampled(num_clients=2000, seed=9).sizes  # 600 // 2000 is under min_size: 2, sizes floored there
    assert crowded.min() == 2 and crowded.mean() < 3
    peaked = _sampled(alpha=0.01, min_size=40)
    flat = _sampled(alpha=100.0, min_size=400)

    def top_share(src: SampledClients, k: int) -> float:
        y = np.concatenate([src.client(k).train_y, src.client(k).test_y])
        return np.bincount(y, minlength=4).max() / len(y)

    assert np.mean([top_share(peaked, k) for k in range(20)]) > 0.95
    assert max(top_share(flat, k) for k in range(20)) < 0.35


def test_a_million_registered_clients_keep_eight_bytes_each_and_derive_in_their_own_size():
    """1,000,000 clients: the sizes and test sizes (int32) are all that is kept per client, made in well under a
    second; deriving a client costs its own size, not the registry's."""
    t0 = time.perf_counter()
    big = _sampled(num_clients=1_000_000)
    made = time.perf_counter() - t0
    assert big.sizes.nbytes == 4_000_000 and made < 1.0
    assert big.tests.nbytes == 4_000_000
    small = _sampled(num_clients=100)
    t0 = time.perf_counter()
    for k in range(200):
        big.client(999_000 + k)
    t_big = time.perf_counter() - t0
    t0 = time.perf_counter()
    for k in range(200):
        small.client(k % 100)
    assert t_big < 5 * (time.perf_counter() - t0) + 0.05


def test_pseudo_clients_keep_their_base_clients_labels_under_their_own_seeded_warp():
    """Pseudo-clients 1 and 1 + K share base client 1's labels and sizes but not its images (each its own warp);
    the same seed gives the same images, another seed others; with every bound 0 the warp is the identity."""
    x, y = _base(n=80)
    base_train = [np.arange(0, 30), np.arange(40, 70)]
    base_test = [np.arange(30, 40), np.arange(70, 80)]
    src = PseudoClients(x, y, base_train, base_test, num_clients=1000, seed=5)
    a, b = src.client(1), src.client(3)
    assert np.array_equal(a.train_y, y[40:70]) and np.array_equal(b.train_y, a.train_y)
    assert not np.array_equal(a.train_x, b.train_x) and a.train_x.shape == b.train_x.shape == (30, 1, 8, 8)
    again = PseudoClients(x, y, base_train, base_test, num_clients=1000, seed=5)
    assert np.array_equal(again.client(3).test_x, b.test_x)
    other = PseudoClients(x, y, base_train, base_test, num_clients=1000, seed=6)
    assert not np.array_equal(other.client(3).train_x, b.train_x)
    assert list(src.train_sizes()[:4]) == [30, 30, 30, 30] and src.derivations == 2
    still = PseudoClients(x, y, base_train, base_test, num_clients=4, seed=5, max_rotation=0, max_scale=0,
                          max_shear=0, max_shift=0)
    assert np.array_equal(still.client(2).train_x, x[:30])


def test_a_run_makes_the_clients_it_samples_and_evaluates_and_nothing_more():
    """1,000 clients made on demand, 5 a round for 3 rounds, the per-client figures over 20: 35 derivations, none
    before round 1; the per-client figures are over the run's sample; the digest names the split (the same build
    twice, not another seed); pseudo-clients run too."""
    from fedray.data import build_federated_data
    from fedray.evaluation import EvalIndex
    from fedray.simulation import run_experiment
    from tests.conftest import tiny_config

    cfg = tiny_config(data__partition="on_demand", data__num_clients=1000, federation__clients_per_round=5,
                      federation__rounds=3, data__eval_clients=20)
    data = build_federated_data(cfg.data, cfg.seed)
    assert data.source.derivations == 0 and data.client_train == [] and len(data.client_sizes()) == 1000
    history = run_experiment(cfg, progress=False, data=data).history
    assert data.source.derivations == 3 * 5 + 20 and "eval/amp" in history[-1]
    assert EvalIndex(data).clients.tolist() == data.eval_sample.tolist() and len(data.eval_sample) == 20
    assert data.partition_digest() == build_federated_data(cfg.data, cfg.seed).partition_digest()
    assert data.partition_digest() != build_federated_data(cfg.data, cfg.seed + 1).partition_digest()
    pseudo = tiny_config(data__pseudo_base_clients=3, data__num_clients=500, federation__rounds=1,
                         data__eval_clients=10)
    assert run_experiment(pseudo, progress=False).history[-1]["eval/accuracy"] >= 0


@pytest.mark.ray
@pytest.mark.slow  # about a minute: started first, so that it does not end a worker's queue
def test_on_ray_and_after_a_resume_clients_made_on_demand_give_the_in_process_figures(ray_local, tmp_path):
    """100,000 clients made on demand: on Ray's workers (the server in an actor), stopped after round 2 and resumed
    there (one worker, the server in the driver), every figure is the in-process run's: each client's data is made the same wherever and whenever; the
    OCA cache's slots (FedAvg's report_model=oca) beyond 2 on disk, in the actor and in the checkpoint alike."""
    from fedray.simulation import run_experiment
    from tests.conftest import tiny_config
    from tests.test_every_method import CrashAfter, _Crash, _figures

    base = dict(data__partition="on_demand", data__num_clients=100_000, federation__clients_per_round=6,
                federation__rounds=3, data__eval_clients=30, runtime__checkpoint_every=1,
                algorithm__report_model="oca", runtime__client_state_memory=2)
    here = run_experiment(tiny_config(**base), progress=False).history
    on_ray = tiny_config(**base, runtime__backend="ray", runtime__num_workers=2, runtime__server_in_driver=False)
    with pytest.raises(_Crash):
        run_experiment(on_ray, tmp_path / "run", progress=False, hooks=[CrashAfter(2)])
    again = tiny_config(**base, runtime__backend="ray", runtime__num_workers=1)  # one actor to start, not three
    resumed = run_experiment(again, tmp_path / "run", progress=False, resume_from=tmp_path / "run").history
    assert _figures(resumed) == _figures(here) and here[-1]["eval/amp"] > 0
    assert here[-1]["server/cache_filled"] == 18 and here[-1]["eval/accuracy_oca"] != here[-1]["eval/accuracy_aca"]


def test_only_a_run_that_keeps_the_cache_is_refused_a_rule_that_votes_per_slot():
    """A vote per registered client's slot is refused with clients made on demand where the cache is kept (FedKF;
    FedAvg with report_model=oca), not for plain FedAvg, which keeps no cache."""
    from fedray.errors import ConfigError
    from fedray.methods import validate_experiment
    from tests.conftest import tiny_config

    on_demand = dict(data__partition="on_demand", aggregation__rule="median")
    validate_experiment(tiny_config(**on_demand))
    for extra in ({"algorithm__report_model": "oca"}, {"algorithm__name": "fedkf"}):
        with pytest.raises(ConfigError, match="a vote per registered client"):
            validate_experiment(tiny_config(**on_demand, **extra))


def test_the_configs_client_size_and_its_spread_set_every_clients_size():
    """data.client_size=40 with client_size_sigma=0: every client holds 40 examples (32 to train, 8 to test);
    with sigma 0.5 the sizes spread log-normally around it (their mean within 3 % over 20,000 clients)."""
    from fedray.data import build_federated_data
    from tests.conftest import tiny_config

    exact = tiny_config(data__partition="on_demand", data__num_clients=20_000, data__client_size=40,
                        data__client_size_sigma=0.0)
    data = build_federated_data(exact.data, exact.seed)
    assert set(data.client_sizes().tolist()) == {32} and set(data.client_test_sizes().tolist()) == {8}
    spread = exact.model_copy(update={"data": exact.data.model_copy(update={"client_size_sigma": 0.5})})
    sizes = build_federated_data(spread.data, spread.seed)
    total = sizes.client_sizes() + sizes.client_test_sizes()
    assert total.std() > 10 and abs(total.mean() / 40 - 1) < 0.03
