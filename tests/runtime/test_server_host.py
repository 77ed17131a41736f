"""Where the Ray runtime's server runs: ``fedray.runtime.server_host`` (the figures: test_runtimes.py)."""

import pytest

from fedray.methods import resolve_experiment
from fedray.runtime.server_host import DriverServer, server_in_driver
from tests.conftest import object_of_a_dead_owner, tiny_config


def test_the_server_runs_in_the_driver_when_it_reserves_nothing(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert server_in_driver(tiny_config(runtime__backend="ray"))
    assert not server_in_driver(tiny_config(runtime__backend="ray", runtime__server_num_gpus=0.25))
    assert not server_in_driver(tiny_config(runtime__backend="ray", runtime__server_num_cpus=1))
    assert not server_in_driver(tiny_config(runtime__backend="ray", runtime__server_in_driver=False))
    # A Ray Client's driver is outside the cluster: every upload would cross the network to it.
    assert not server_in_driver(tiny_config(runtime__backend="ray", runtime__address="ray://head:10001"))
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert not server_in_driver(tiny_config(runtime__backend="ray"))
    assert server_in_driver(tiny_config(runtime__backend="ray", runtime__server_in_driver=True))


@pytest.mark.ray
def test_a_server_in_the_driver_gets_a_tasks_uploads_and_drops_a_lost_one(ray_local):
    ray = ray_local
    lost = object_of_a_dead_owner({"w": 1}, settle=True)  # an upload lost with its node
    cfg = tiny_config(runtime__backend="ray")
    server = DriverServer(resolve_experiment(cfg))
    try:
        receipt = server.receive([3, 5], [ray.put({"w": 3}), ray.put({"w": 5})])
        assert server.confirm(receipt, 3, 1) and server.confirm(receipt, 5, 1)
        assert server.inbox == {3: {"w": 3}, 5: {"w": 5}}
        receipt = server.receive([7, 8], [ray.put({"w": 7}), lost])
        assert server.confirm(receipt, 7, 2) and not server.confirm(receipt, 8, 2)
        assert server.inbox[7] == {"w": 7} and 8 not in server.inbox
    finally:
        server.close()
