"""A run on a real two-node Ray cluster (ray.cluster_utils.Cluster): workers on both nodes, same figures."""

import pytest

from fedray.simulation import run_experiment
from tests.conftest import tiny_config


@pytest.mark.ray
def test_two_node_cluster_run_matches_local():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()  # the session's single-node Ray; the next test that needs it starts it again
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR")
        cfg = tiny_config(runtime__backend="ray", runtime__address=cluster.address)
        from fedray.data import build_federated_data
        from fedray.runtime.ray_runtime import RayRuntime

        data = build_federated_data(cfg.data, cfg.seed)
        with RayRuntime(cfg, data) as rt:
            assert rt.pool_size == 2
            assert len(set(rt.pool.nodes)) == 2, "one worker per node: each node has one CPU"
        remote = run_experiment(cfg, progress=False, data=data)
    finally:
        ray.shutdown()
        cluster.shutdown()
    local_cfg = tiny_config()
    local = run_experiment(local_cfg, progress=False)
    for key in ("eval/accuracy", "eval/amp", "eval/wlp", "comm/bytes_up"):
        assert remote.summary[key] == local.summary[key]
