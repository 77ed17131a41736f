"""Starting Ray while the caller imports: ``fedray.runtime.ray_start``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# In a fresh process: the test session may have a Ray of its own up, which start_ray_during leaves alone.
SCRIPT = """
import sys, threading
import ray
from fedray.runtime import ray_start
from tests.conftest import tiny_config

cfg = tiny_config(runtime__backend="ray")
where = []

def work():
    where.append(threading.current_thread() is threading.main_thread())
    return "checked"

# The work runs in another thread while Ray starts; the caller is told it owns that Ray.
assert ray_start.start_ray_during(cfg, work) == ("checked", True) and where == [False]
assert ray.is_initialized()

# Ray's processes retry their connections every 50 ms, not every second (ray_start.LOCAL_SYSTEM_CONFIG).
@ray.remote
def connect_retries():
    from ray._raylet import Config
    return Config.raylet_client_connect_timeout_milliseconds(), Config.raylet_client_num_connect_attempts()
assert ray.get(connect_retries.remote()) == (50, 200), ray.get(connect_retries.remote())
assert ray_start.start_ray(cfg) is False  # up already: not this caller's to shut down
assert ray_start.start_ray_during(cfg, work) == ("checked", False)
ray_start.shutdown_ray(False)
assert ray.is_initialized(), "shut down a Ray the caller did not own"

# Handed to the runtime (owns_ray=True), the runtime shuts it down when it closes.
from fedray.runtime import make_runtime
make_runtime(cfg, owns_ray=True).close()
assert not ray.is_initialized(), "the runtime given the Ray left it up"

# The work fails (a bad config): its error, and Ray is down again.
def bad():
    raise ValueError("algorithm.name: unknown")
try:
    ray_start.start_ray_during(cfg, bad)
except ValueError as e:
    assert "algorithm.name" in str(e)
else:
    raise AssertionError("the work's error was lost")
assert not ray.is_initialized()

# Nobody took it over (the run failed before its runtime started): shutdown_ray of the owned Ray shuts it down.
_, owned = ray_start.start_ray_during(cfg, lambda: None)
ray_start.shutdown_ray(owned)
assert not ray.is_initialized()

# An in-process run: the work runs here, and Ray is not started.
assert ray_start.start_ray_during(tiny_config(), work) == ("checked", False) and where[-1] is True
assert not ray.is_initialized()
print("ok")
"""


@pytest.mark.ray
def test_start_ray_during_hands_ray_to_the_runtime_or_shuts_it_down():
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=root, timeout=300,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_an_address_where_nothing_listens_is_refused_at_once():
    import socket

    from fedray.runtime.ray_start import _check_listening

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    _check_listening(f"127.0.0.1:{port}")  # something listens: left to ray.init
    for address in ("auto", "local", "ray://127.0.0.1:1", "garbage"):
        _check_listening(address)  # not host:port: Ray's own checks
    server.close()
    with pytest.raises(ConnectionError, match="nothing accepts connections"):
        _check_listening(f"127.0.0.1:{port}", timeout_s=2)
