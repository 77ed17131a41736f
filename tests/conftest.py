"""Shared fixtures: tiny synthetic configs and one local Ray instance for the whole session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# The decoded-dataset cache (fedray.data.cache): a throwaway folder per test session, never the user's
# (tests load fake datasets under the real names, which would replace the user's entries).
_DECODED_CACHE = tempfile.mkdtemp(prefix="fedray-test-decoded-")
os.environ["FEDRAY_CACHE_DIR"] = _DECODED_CACHE
atexit.register(shutil.rmtree, _DECODED_CACHE, True)

from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

from fedray.config import ExperimentConfig, load_config  # noqa: E402
from fedray.data.datasets import DATA_DIR_ENV, debian_fashion_mnist_dir  # noqa: E402

FMNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

TINY = {
    "data.dataset": "synthetic",
    "data.num_clients": 6,
    "data.alpha": 1.0,
    "data.synthetic_train_samples": 600,
    "data.synthetic_test_samples": 200,
    "data.synthetic_image_size": 16,
    "federation.rounds": 2,
    "federation.clients_per_round": 3,
    "federation.local_steps": 4,
    "federation.batch_size": 16,
    "federation.lr": 0.05,
}


def tiny_config(**overrides) -> ExperimentConfig:
    """A seconds-long synthetic experiment; keyword overrides use '__' for dots (data__alpha=0.5)."""
    merged = dict(TINY)
    merged.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load_config(None, merged)


@pytest.fixture
def tiny():
    return tiny_config


def _ensure_ray():
    import ray

    if not ray.is_initialized():
        from fedray.runtime.ray_start import LOCAL_SYSTEM_CONFIG

        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
                 _system_config=LOCAL_SYSTEM_CONFIG)
    return ray


def object_of_a_dead_owner(value, settle: bool = False):
    """A reference to ``value`` put by an actor that is then killed: the object is lost, as when the node holding
    it goes. With ``settle``, returned once the driver sees it lost (~1 s after the kill; until then a get
    may still succeed)."""
    import time

    import ray

    @ray.remote(num_cpus=0)
    class Owner:
        def put(self, x):
            return [ray.put(x)]

    owner = Owner.remote()
    lost = ray.get(owner.put.remote(value))[0]
    ray.kill(owner)
    for _ in range(300 if settle else 0):
        try:
            ray.get(lost)
            time.sleep(0.1)
        except ray.exceptions.ObjectLostError:
            break
    return lost


@pytest.fixture
def ray_local():
    """A local Ray shared by the tests that need one (ray.init costs ~4 s and ~700 MB here).

    Started on first use and shut down at the end of the session; a test that needs its own cluster
    (the two-node one) shuts it down, and the next user starts it again.
    """
    return _ensure_ray()


@pytest.fixture(scope="session", autouse=True)
def _shutdown_ray_at_exit():
    yield
    import sys

    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()


@pytest.fixture(scope="session")
def fashion_mnist_root(tmp_path_factory) -> Path:
    """A ``data.data_dir`` from which the real Fashion-MNIST loads.

    Uses ``$FEDRAY_DATA_DIR`` when it already holds torchvision's layout; otherwise a fresh temporary
    root, which the loader fills from Debian's ``dataset-fashion-mnist``. When neither is available the
    test is skipped, unless ``FEDRAY_REQUIRE_REAL_DATA=1`` (CI with the package installed), which turns
    the skip into a failure so a broken discovery cannot hide behind a skip.
    """
    env_root = os.environ.get(DATA_DIR_ENV)
    if env_root and all((Path(env_root) / "FashionMNIST" / "raw" / f).is_file() for f in FMNIST_FILES):
        return Path(env_root)
    debian = debian_fashion_mnist_dir()
    if all((debian / f"{f}.gz").is_file() for f in FMNIST_FILES):
        return tmp_path_factory.mktemp("fashion_mnist_root")
    reason = (
        f"real Fashion-MNIST not found: no Debian copy at {debian} (apt install dataset-fashion-mnist) "
        f"and ${DATA_DIR_ENV} holds no FashionMNIST/raw"
    )
    if os.environ.get("FEDRAY_REQUIRE_REAL_DATA") == "1":
        pytest.fail(reason + "; FEDRAY_REQUIRE_REAL_DATA=1 forbids skipping")
    pytest.skip(reason)


class _CaptureRules(TorchDispatchMode):
    """What a CUDA graph capture refuses, checked on the CPU: ops that need the host inside the captured step."""

    REFUSED = {torch.ops.aten.lift_fresh.default: "a tensor made from host data (on a GPU, a copy to the device)",
               torch.ops.aten._local_scalar_dense.default: "a device value read on the host (.item(), float())"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # a 0-d host tensor is exempt: it enters a device op as a scalar, no copy (torch's Adam on a CPU makes one)
        if func in self.REFUSED and not (func is torch.ops.aten.lift_fresh.default and args[0].dim() == 0):
            raise RuntimeError(f"not capturable in a CUDA graph: {self.REFUSED[func]} ({func})")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """CUDA graphs (``fedray.learning.cuda_graphs``) on the CPU, where CI runs: a "replay" calls the captured step again, under
    the capture's rules (:class:`_CaptureRules`), so the bookkeeping (when to capture, the inputs copied in, outputs,
    the optimizers' host counts, when to drop a graph) and what the step may do are checked. ``replays`` counts the
    replays. CUDA's own part, kernels recorded once and rerun on the same tensors, is benchmarks/gpu.py's check."""
    from fedray.learning import cuda_graphs
    from fedray.vectorized.stacked_optimizer import StackedOptimizer

    replays = []

    def capture(body, stream):
        def replay():
            replays.append(1)
            with _CaptureRules():
                body()
        return replay

    def outside_the_rules(step):
        def run(*args, **kwargs):
            with _disable_current_modes():
                return step(*args, **kwargs)
        return run

    monkeypatch.setattr(cuda_graphs, "GRAPH_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(cuda_graphs, "capture", capture)
    # torch's Adam reads its step counts on the host on a CPU; on CUDA they are device tensors (capturable)
    monkeypatch.setattr(StackedOptimizer, "step_device", outside_the_rules(StackedOptimizer.step_device))
    return replays
