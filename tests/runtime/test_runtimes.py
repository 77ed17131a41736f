"""Local and Ray runtimes: client state kept client-side, pool sizing, actor mapping, start-up order. (Identical
figures in process and on Ray, the server in the driver or an actor, for every method: tests/test_every_method.py.)"""

from collections import Counter

import cloudpickle
import pytest

from fedray.load import load_config
from fedray.data import build_federated_data
from fedray.errors import ResourceError
from fedray.runtime import make_runtime, malloc
from fedray.runtime.placement import plan_pool
from fedray.seeding import sample_clients
from tests.conftest import tiny_config
from tests.runtime import stateful

cloudpickle.register_pickle_by_value(stateful)  # Ray workers cannot import tests/; ship the class by value


def _malloc_applied(actor) -> bool:
    from fedray.runtime import malloc as in_actor

    return in_actor._applied


def _tensors_go_as_numpy(actor=None) -> bool:  # in an actor (through __ray_call__) or in the driver
    import ray
    import torch

    return b"_from_wire" in ray.cloudpickle.dumps(torch.ones(3))  # fedray.runtime.tensor_wire's form


def _collector(actor) -> tuple[bool, int, int]:
    import gc

    return gc.isenabled(), gc.get_freeze_count(), gc.get_stats()[2]["collections"]


def _participations(seed, rounds, k, m):
    counts, expected = Counter(), []
    for r in range(1, rounds + 1):
        ids = sample_clients(seed, r, k, m)
        counts.update(ids)
        expected.append([float(counts[c]) for c in ids])
    return expected


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_private_client_state_persists_per_client(backend, request):
    if backend == "ray":
        request.getfixturevalue("ray_local")
    cfg = tiny_config(algorithm__name="test_counting", runtime__backend=backend, federation__local_steps=1)
    data = build_federated_data(cfg.data, cfg.seed)
    seen = []
    with make_runtime(cfg, data) as rt:
        for r in range(1, 6):
            outcome = rt.run_round(r, sample_clients(cfg.seed, r, 6, 3))
            seen.append([info["test/count"] for info in outcome.client_infos])
            assert outcome.server_s > 0  # the aggregation's wall time (history's time/server_s)
        if backend == "ray":
            import ray

            assert all(isinstance(ref, ray.ObjectRef) for ref in rt.client_states.values())
    assert seen == _participations(cfg.seed, 5, 6, 3)


@pytest.mark.ray
def test_one_actor_per_client_serves_that_client_every_round(ray_local):
    cfg = tiny_config(runtime__backend="ray", runtime__num_workers=4, runtime__num_cpus_per_worker=0.25,
                      data__num_clients=4, federation__clients_per_round=2, federation__local_steps=1)
    data = build_federated_data(cfg.data, cfg.seed)
    served: dict[int, set[int]] = {}
    with make_runtime(cfg, data) as rt:
        assert rt.pool_size == 4
        for r in range(1, 6):
            for info in rt.run_round(r, sample_clients(cfg.seed, r, 4, 2)).client_infos:
                served.setdefault(info["client"], set()).add(info["pid"])
        pids = rt.pool.pids
    assert all(len(p) == 1 for p in served.values()) and len(served) >= 3  # clients served again, by their own actor
    assert {c: next(iter(p)) for c, p in served.items()} == {c: pids[c] for c in served}


def test_pool_size_follows_resources():
    cfg = load_config("quickstart")  # 8 clients per round, 1 CPU per worker
    node = [{"CPU": 16.0}]
    assert plan_pool(cfg, {"CPU": 16.0}, node) == 8  # capped by clients per round
    assert plan_pool(cfg, {"CPU": 2.0}, [{"CPU": 2.0}]) == 2
    gpu = load_config("quickstart", ["runtime.num_gpus_per_worker=0.5"])
    assert plan_pool(gpu, {"CPU": 16.0, "GPU": 2.0}, node) == 4  # 2 GPUs / 0.5
    with pytest.raises(ResourceError) as e:
        plan_pool(gpu, {"CPU": 16.0}, node)
    assert e.value.key == "runtime.num_gpus_per_worker"
    many = load_config("quickstart", ["runtime.num_workers=20"])
    with pytest.raises(ResourceError) as e:
        plan_pool(many, {"CPU": 2.0}, [{"CPU": 2.0}])
    assert e.value.key == "runtime.num_workers" and "at most 2" in e.value.message
    served = load_config("quickstart", ["runtime.num_workers=2", "runtime.server_num_cpus=1"])
    with pytest.raises(ResourceError) as e:  # 2 CPUs, 2 workers of 1: the server's CPU is why they do not fit
        plan_pool(served, {"CPU": 2.0}, [{"CPU": 2.0}])
    assert "1 CPU of them for the server (runtime.server_num_cpus)" in e.value.message
    assert "at most 1" in e.value.message
    fat = load_config("quickstart", ["runtime.num_cpus_per_worker=4"])
    with pytest.raises(ResourceError) as e:
        plan_pool(fat, {"CPU": 6.0}, [{"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 2.0}])
    assert e.value.key == "runtime.num_cpus_per_worker"


def test_clients_are_dealt_longest_first_to_the_least_loaded_worker():
    from fedray.runtime.placement import deal

    assert deal([1, 3, 4, 7], [1.0] * 8, 2) == [(1, 0), (3, 1), (4, 0), (7, 1)]  # equal costs: round-robin
    cost = [10.0, 1.0, 1.0, 1.0, 1.0, 100.0]
    assert deal(list(range(6)), cost, 2) == [(5, 0), (0, 1), (1, 1), (2, 1), (3, 1), (4, 1)]  # the heavy one alone


def test_client_costs_follow_architecture_flops_and_local_steps():
    from fedray.models import forward_flops
    from fedray.runtime.placement import client_costs

    cfg = tiny_config(algorithm__name="local", model__client_models=["lenet5", "resnet8"], federation__local_epochs=1)
    costs = client_costs(cfg, (1, 16, 16), 10, [32, 32, 64])
    lenet, resnet = forward_flops("lenet5", (1, 16, 16), 10), forward_flops("resnet8", (1, 16, 16), 10)
    assert costs == [lenet * 2, resnet * 2, lenet * 4]  # one epoch of batch 16: 2 or 4 steps


@pytest.mark.ray
def test_ray_actors_start_before_the_data_and_evaluate_as_in_process(ray_local):
    """Start-up order: the actors come up from small arguments while the driver has no data yet; after
    ``attach`` a round and its evaluation (the global model scored on the workers, two parts) give the
    in-process figures exactly."""
    import ray

    cfg = tiny_config(federation__local_steps=2)
    ray_cfg = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(
        update={"backend": "ray", "num_workers": 2, "server_in_driver": False})})
    data = build_federated_data(cfg.data, cfg.seed)
    with make_runtime(ray_cfg) as rt:
        assert [attached for _, _, attached in ray.get([w.ready.remote() for w in rt.pool.workers])] == [False, False]
        ray.get(rt.server.actor.ready.remote())
        rt.attach(data)
        assert rt.spread_eval
        rt.run_round(1, [0, 2, 4])
        remote = rt.evaluate()

        def in_each_actor(fn):  # server, then the workers
            return ray.get([a.__ray_call__.remote(fn) for a in [rt.server.actor, *rt.pool.workers]])

        # Every actor set its malloc thresholds (runtime.malloc_tuning, on by default) where glibc has them.
        assert in_each_actor(_malloc_applied) == [malloc.glibc()] * 3
        # Each actor imported torch, pydantic and fedray in __init__ with the garbage collector paused, then froze
        # them (fedray.gc_pause): the collector is on, the imports' ~300,000 objects frozen, and the only full
        # collection is the one of Ray's own start. Had Ray's shipping of the class imported torch before
        # __init__ (it ships the class by value, with what its methods name), there would be 3 more.
        for enabled, frozen, full_collections in in_each_actor(_collector):
            assert enabled and frozen > 100_000 and full_collections <= 2
        # Tensors cross the object store as numpy arrays from every process of the run (fedray.runtime.tensor_wire).
        assert in_each_actor(_tensors_go_as_numpy) == [True] * 3
        assert _tensors_go_as_numpy()
    with make_runtime(cfg, data) as local:
        local.run_round(1, [0, 2, 4])
        assert local.evaluate() == remote


def test_personalised_evaluation_tasks_are_balanced_over_the_workers():
    from fedray.runtime.placement import eval_tasks

    assert [len(t) for t in eval_tasks(list(range(20)), 2, 16)] == [10, 10]  # was 16 + 4
    tasks = eval_tasks(list(range(100)), 3, 16)
    assert len(tasks) % 3 == 0 and max(map(len, tasks)) <= 16 and max(map(len, tasks)) - min(map(len, tasks)) <= 1
    assert [c for t in tasks for c in t] == list(range(100))
    assert eval_tasks([4, 7], 4, 16) == [[4], [7]]


def test_a_round_reports_the_payload_bytes_each_client_was_sent():
    """RoundOutcome.payload_bytes: what the channel sent one client (the method's broadcast), a round of one client."""
    cfg = tiny_config(federation__local_steps=1)
    data = build_federated_data(cfg.data, cfg.seed)
    with make_runtime(cfg, data) as rt:
        sent = rt.server.payload(0)[1]
        assert sent > 0 and rt.run_round(1, [2]).payload_bytes == sent
