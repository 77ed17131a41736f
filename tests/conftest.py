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
# Where a test and the clients it holds meet (tests/runtime/faulty.py's Gate): set before any Ray starts, so that
# every Ray worker inherits it.
_GATES = tempfile.mkdtemp(prefix="fedray-test-gates-")
os.environ["FEDRAY_TEST_GATES"] = _GATES
atexit.register(shutil.rmtree, _GATES, True)

from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

# Several test processes on this 2-core machine (`make test`: two): torch's default of a thread per core in each puts
# four busy threads on two cores, where OpenMP threads spinning for one another make the CPU-bound tests about three
# times slower (tests/models and tests/vectorized with two workers: 147 s, one thread each: 50 s). A run sets its
# own threads (fedray.runtime.process) and gives these back.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    torch.set_num_threads(1)

from fedray.config import ExperimentConfig  # noqa: E402
from fedray.load import load_config  # noqa: E402
from fedray.data.datasets import DATA_DIR_ENV, debian_fashion_mnist_dir  # noqa: E402

FMNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

def pytest_collection_modifyitems(config, items):
    """The tests marked slow run first, shared among the workers. `make test` schedules with `--dist worksteal`,
    which hands worker i the i-th of n consecutive blocks of the collection and lets a worker that runs out take
    tests off the end of another's queue: so each block starts with its share of the slow tests (else the first
    worker would run them one after another while the others take its short ones), and the suite ends on short
    tests shared by all rather than on a sweep left running alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order within each part
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    slow = [item for item in items if item.get_closest_marker("slow")]
    if workers > 1 and slow:
        items[:] = _dealt(items, slow, workers)


def _dealt(items, slow, workers: int) -> list:
    """``items`` (slow first) reordered into the blocks worksteal deals (its sizes: what is left over the workers
    left), each block its share of the slow tests, then short ones in collection order. Slow tests that share a
    module-scoped fixture stay in one block (each worker would otherwise build it)."""
    groups: dict = {}
    for item in slow:
        info = getattr(item, "_fixtureinfo", None)
        shared = sorted(name for name, defs in (info.name2fixturedefs.items() if info else ())
                        if defs and defs[-1].scope == "module")
        groups.setdefault((item.path, tuple(shared)) if shared else item.nodeid, []).append(item)
    blocks: list[list] = [[] for _ in range(workers)]
    for group in sorted(groups.values(), key=len, reverse=True):  # the largest first, each to the emptiest block
        min(blocks, key=len).extend(group)
    fast = iter(items[len(slow):])
    left, out = len(items), []
    for i, block in enumerate(blocks):
        size = left // (workers - i)
        out += block + [next(fast) for _ in range(max(0, size - len(block)))]
        left -= size
    return out + list(fast)


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


# The learnable task of the every-method tests (tests/test_every_method.py): class templates far apart under little
# noise, and local training that reads them within a few rounds (LeNet-5 under Adam; plain SGD at TINY's lr stays at
# chance for dozens of steps). Every method ends its 3 rounds well above chance on it; a case's own settings win.
LEARNABLE = {
    "data.synthetic_noise": 0.1,
    "data.synthetic_shift": 0,
    "data.synthetic_contrast": 0.4,
    "federation.optimizer": "adam",
    "federation.lr": 0.005,
    "federation.local_steps": 8,
}


def tiny_config(**overrides) -> ExperimentConfig:
    """A seconds-long synthetic experiment; keyword overrides use '__' for dots (data__alpha=0.5)."""
    merged = dict(TINY)
    merged.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load_config(None, merged)


def cores(cfg):
    """``cfg``'s data and its server and worker cores on the CPU, in this process."""
    from fedray.data import build_federated_data
    from fedray.runtime.core import ClientWorkerCore
    from fedray.runtime.server_core import ServerCore

    data, cpu = build_federated_data(cfg.data, cfg.seed), torch.device("cpu")
    return data, ServerCore(cfg, data, cpu), ClientWorkerCore(cfg, data, cpu)


@pytest.fixture
def tiny():
    return tiny_config


# --- every method ------------------------------------------------------------------------------------------------

SERVER_DATA = {"data__server_data__kind": "holdout", "data__server_data__per_class": 10}
UNLABELLED_SERVER_DATA = {**SERVER_DATA, "data__server_data__labelled": False}
# DaFKD with a small generator and a short server distillation (well under a second a round on one core).
DAFKD_TINY = {"algorithm__generator": "dcgan", "algorithm__gen_width": 8, "algorithm__gen_hidden": 32,
              "algorithm__distill_samples": 32, "algorithm__distill_steps": 2, "federation__momentum": 0.9}

# THE place for what each built-in method needs to run on tiny_config's synthetic data (server data, a small
# generator, per-client architectures), read by every test that runs every method (tests/test_every_method.py) and
# by tests/vectorized/test_vectorized.py for the per-method settings it builds on.
# Keys: a method's algorithm.name, or "<name>-<variant>" for a further setting of it worth every check (an optimizer
# state or a schedule carried across rounds). A new method gets a line here: {} if tiny_config suits it.
METHOD_CASES: dict[str, dict] = {
    "fedavg": {},
    # SGD momentum's buffers, Adam's moments and a learning-rate schedule, carried across rounds and a resume
    "fedavg-momentum": {"federation__optimizer": "sgd", "federation__lr": 0.1, "federation__momentum": 0.9,
                        "federation__weight_decay": 1e-3},
    "fedavg-adam-cosine": {"federation__optimizer": "adam", "federation__lr": 0.01, "federation__lr_schedule": "cosine",
                           "federation__lr_min": 0.001},
    # the simulated system on: phones of the heterogeneous profile that come and go, over-selection and a deadline
    # (its clock, availability state and per-client figures checkpointed and resumed, in process and on Ray)
    "fedavg-system": {"system__devices": "heterogeneous", "system__availability": "markov",
                      "system__mean_online_s": 60.0, "system__mean_offline_s": 20.0, "system__overcommit": 1.5,
                      "system__deadline_s": 20.0},
    # buffered asynchronous aggregation (FedBuff) on the same phones: 4 training at once, a server step every 2
    # uploads, staleness-weighted; clients in flight at a checkpoint start again on resume from the same model
    "fedavg-async": {"system__devices": "heterogeneous", "system__availability": "markov",
                     "system__mean_online_s": 60.0, "system__mean_offline_s": 20.0, "federation__mode": "async",
                     "federation__concurrency": 4, "federation__buffer_size": 2, "federation__staleness": "polynomial"},
    # FLTrust (aggregation.rule=fltrust): the server trains its own update on its labelled data every step, seeded by
    # (run seed, round), so a resume gives the uninterrupted run (on Ray too: checked by hand, not in RAY_CASES)
    "fedavg-fltrust": {**SERVER_DATA, "aggregation__rule": "fltrust"},
    "fedprox": {"algorithm__mu": 0.5},
    # plain SGD, the paper's local step; its control variates are client state from round 2 on
    "scaffold": {"federation__optimizer": "sgd", "federation__lr": 0.1},
    # q large enough that the clients' losses weigh (q = 1 shrinks q-FedAvg's step to nothing in a few rounds)
    "qffl": {"algorithm__q": 0.1, "federation__optimizer": "sgd", "federation__lr": 0.1, "federation__momentum": 0.9},
    "fedgkd": {},
    "local": {"model__client_models": ["lenet5", "resnet8_bn"]},  # per-client models of two architectures
    "fedkf": {"algorithm__gen_width": 16},  # DAFL's 128 channels cost most of a FedKF round here
    "dafkd": DAFKD_TINY,
    # its private variant: no shared discriminator, each client's own, logit ensemble without correlation weights
    "dafkd-private": {**DAFKD_TINY, "algorithm__sharing": False, "algorithm__private_discriminator": True,
                      "algorithm__ensemble": "logits", "algorithm__correlation": False},
    # batches of 17: client 3's 35 samples end a pass on a one-sample batch
    "fedcd": {**SERVER_DATA, "model__client_models": ["lenet5", "resnet8"], "federation__batch_size": 17},
    "fedd3a": UNLABELLED_SERVER_DATA,
    # the global model learns only by distillation here: more than the paper's one large batch on 100 server images
    "fedd3a-heterogeneous": {**UNLABELLED_SERVER_DATA, "model__client_models": ["lenet5", "resnet8"],
                             "algorithm__distill_batch_size": 16, "algorithm__distill_lr": 0.05,
                             "algorithm__distill_epochs": 3},
    "feddf": UNLABELLED_SERVER_DATA,
    "feddistill": {"model__client_models": ["lenet5", "mlp"]},
    # a short generator training; the generator's terms from round 2 of the 3 every-method rounds
    "fedgen": {"algorithm__gen_steps": 3, "algorithm__hidden": 16, "algorithm__gen_batch_size": 8},
    "fedftg": {"algorithm__gen_width": 4, "algorithm__iterations": 2, "algorithm__noise_dim": 8},
}


def built_in_methods() -> list[str]:
    """fedray's own methods in the registry (not those the tests register: they live outside fedray.methods)."""
    from fedray.methods import ALGORITHMS

    return sorted(n for n in ALGORITHMS if ALGORITHMS[n].__module__.startswith("fedray.methods."))


def method_overrides(case: str) -> dict:
    """``algorithm__name`` and the settings of ``case`` (a method's name or "<name>-<variant>"), for tiny_config.
    A built-in method without a case fails, saying what to add where."""
    name = case.split("-")[0]
    if case not in METHOD_CASES:
        pytest.fail(f"method {name!r} is registered but has no case: add {case!r}: {{...}} to METHOD_CASES in "
                    f"tests/conftest.py, the settings it needs to run on tiny_config's synthetic data ({{}} if none)",
                    pytrace=False)
    return {"algorithm__name": name, **METHOD_CASES[case]}


def method_config(case: str, **overrides) -> ExperimentConfig:
    """tiny_config of a method's case, plus ``overrides``."""
    return tiny_config(**{**method_overrides(case), **overrides})


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
def ray_local(request):
    """A local Ray shared by the tests that need one (ray.init costs ~4 s and ~700 MB here).

    Started on first use and shut down at the end of the session; a test that needs its own cluster
    (the two-node one) shuts it down, and the next user starts it again. A test using it must be marked
    ``@pytest.mark.ray`` (``-m "not ray"`` must deselect every test that starts Ray).
    """
    if request.node.get_closest_marker("ray") is None:
        pytest.fail(f"{request.node.nodeid} uses the ray_local fixture without the ray marker: add "
                    "@pytest.mark.ray (or pytest.param(..., marks=pytest.mark.ray))", pytrace=False)
    return _ensure_ray()


@pytest.fixture(autouse=True)
def _markers_say_what_a_test_needs(request):
    """``-m "not ray"`` / ``"not realdata"`` must deselect every test that starts Ray / reads the real Fashion-MNIST:
    a test using ``fashion_mnist_root`` without ``realdata`` fails, as does one that leaves a Ray it started up
    without ``ray`` (the ``ray_local`` fixture checks its users itself)."""
    import sys

    if "fashion_mnist_root" in request.fixturenames and request.node.get_closest_marker("realdata") is None:
        pytest.fail(f"{request.node.nodeid} reads the real Fashion-MNIST (fashion_mnist_root) without the realdata "
                    "marker: add @pytest.mark.realdata", pytrace=False)
    ray_before = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    yield
    if (not ray_before and request.node.get_closest_marker("ray") is None and "ray" in sys.modules
            and sys.modules["ray"].is_initialized()):
        pytest.fail(f"{request.node.nodeid} started Ray without the ray marker: add @pytest.mark.ray", pytrace=False)


@pytest.fixture(autouse=True)
def _global_generators_seeded():
    """Every test starts from the same state of torch's, numpy's and Python's global generators, whatever ran before
    it in its process: a model a test builds without its own seed is then the same in any order, under xdist's
    scheduling or mutmut's subsets of the suite (where a test passing by the draw counts its failures as kills)."""
    import random

    import numpy as np

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


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
    replays. CUDA's own part, kernels recorded once and rerun on the same tensors, is benchmarks/speed/gpu.py's check."""
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
