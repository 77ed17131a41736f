"""``runtime.cpu_channels_last``: the same training in the channels-last layout, to float rounding."""

import pytest
import torch

from fedray.data import build_federated_data
from fedray.runtime import make_runtime
from fedray.seeding import sample_clients
from tests.conftest import tiny_config
from tests.vectorized.test_vectorized import COVERED, _max_relative_difference, _one_round, float64_runs

# A method per way its modules are built: the shared model (LeNet-5, BatchNorm), a model bank of client
# architectures (GroupNorm ResNet-8 stays as built), a generator beside the student, DaFKD's GAN.
CASES = ["fedavg_sgd_momentum", "fedavg_batchnorm", "local_heterogeneous", "fedd3a_heterogeneous", "fedkf", "dafkd"]


def _layouts(module: torch.nn.Module) -> set[bool]:
    """Whether each 2-d convolution weight whose layouts differ (not 1x1, more than one input channel) is
    channels-last."""
    return {w.is_contiguous(memory_format=torch.channels_last) for m in module.modules()
            if isinstance(m, torch.nn.Conv2d) and (w := m.weight).shape[1] > 1 and w.shape[2] > 1}


@pytest.mark.parametrize("name", CASES)
def test_a_channels_last_round_equals_the_default_one(monkeypatch, name):
    """One round in float64 (where BatchNorm over a few rows amplifies rounding to ~1e-16, not the 1e-4-1e-3 of
    float32) gives the default layout's weights; in float32 the worker's modules with 2-d convolutions and no
    GroupNorm are channels-last after a round, and the rest as built."""
    kw = COVERED[name]
    with float64_runs(monkeypatch):
        default_w, _ = _one_round(False, **kw)
        fast_w, _ = _one_round(False, runtime__cpu_channels_last=True, **kw)
    for c in default_w:
        assert _max_relative_difference(default_w[c], fast_w[c]) < 1e-12
    monkeypatch.undo()
    cfg = tiny_config(runtime__cpu_channels_last=True, **kw)
    data = build_federated_data(cfg.data, cfg.seed)
    with make_runtime(cfg, data) as rt:
        rt.run_round(1, sample_clients(cfg.seed, 1, data.num_clients, cfg.federation.clients_per_round))
        built = vars(rt.worker.modules).values() if rt.worker.modules is not None else ()  # "local" builds none
        modules = [m for m in built if isinstance(m, torch.nn.Module)]
        modules += list(rt.worker.models._modules.values())
    for m in modules:
        has_gn = any(isinstance(x, torch.nn.GroupNorm) for x in m.modules())
        assert _layouts(m) in ({False} if has_gn else {True}, set()), type(m).__name__
    assert any(_layouts(m) == {True} for m in modules), "no module was converted"
