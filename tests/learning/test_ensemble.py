"""The stacked teacher ensemble (fedray.learning.ensemble) equals the loop over client models up to float
rounding: LeNet-5, a BatchNorm ResNet with per-teacher running statistics, heterogeneous architectures in
upload order, chunks grown to the activation budget, sub-groups under a small weights budget,
multi-output modules (DaFKD's classifier + discriminator), and the module's own weights left untouched."""

import pytest
import torch

from fedray.learning import ensemble
from fedray.methods.api import DataSpec
from fedray.learning.ensemble import loop_outputs, stacked_outputs
from fedray.learning.weights import clone_weights
from fedray.models import build_model


def _teachers(name: str, shape, k: int, seed: int = 0):
    """One module and k different weight sets for it; BatchNorm running statistics made distinct per teacher."""
    module = build_model(name, shape, 10)
    out = []
    for i in range(k):
        torch.manual_seed(seed + i)
        m = build_model(name, shape, 10)
        for bn in m.modules():
            if isinstance(bn, torch.nn.modules.batchnorm._BatchNorm):
                bn.running_mean.uniform_(-0.3, 0.3)
                bn.running_var.uniform_(0.5, 1.5)
                bn.weight.data.uniform_(0.5, 1.5)
        out.append((module, clone_weights(m)))
    return module, out


def _close(a: torch.Tensor, b: torch.Tensor):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


@pytest.mark.parametrize("name,shape", [("lenet5", (1, 28, 28)), ("resnet8_bn", (3, 16, 16))])
def test_stacked_equals_loop(name, shape):
    module, teachers = _teachers(name, shape, 5)
    x = torch.randn(37, *shape)
    before = clone_weights(module)
    stacked = stacked_outputs(teachers, x, batch_size=16)[0]  # 16 rows: chunks of 3 images x 5 teachers
    assert all(torch.equal(before[k], v) for k, v in clone_weights(module).items())  # module untouched
    loop = loop_outputs(teachers, x, batch_size=16)[0]
    assert stacked.shape == loop.shape == (5, 37, 10)
    _close(stacked, loop)
    # BatchNorm: each teacher used its own running statistics (teachers differ, so do their outputs)
    assert float((loop[0] - loop[1]).abs().max()) > 1e-3


def test_heterogeneous_groups_keep_upload_order_and_subgroups(monkeypatch):
    _, lenets = _teachers("lenet5", (1, 28, 28), 3)
    _, mlps = _teachers("mlp", (1, 28, 28), 2, seed=10)
    mixed = [lenets[0], mlps[0], lenets[1], mlps[1], lenets[2]]
    x = torch.randn(20, 1, 28, 28)
    loop = loop_outputs(mixed, x, batch_size=8)[0]
    _close(stacked_outputs(mixed, x, batch_size=8)[0], loop)
    # chunks grown to the activation budget (the GPU setting): same numbers
    monkeypatch.setattr(ensemble, "BUDGET_DEVICES", ("cpu", "cuda"))
    _close(stacked_outputs(mixed, x, batch_size=8)[0], loop)
    # a weights budget below two LeNets: sub-groups of one teacher, the plain functional call, same numbers
    monkeypatch.setattr(ensemble, "STACKED_WEIGHTS_BYTES", 1)
    _close(stacked_outputs(mixed, x, batch_size=8)[0], loop)


def test_on_a_loop_device_teachers_run_one_by_one_exactly_as_the_loop(monkeypatch):
    """CUDA's setting for a model with large activations (``LOOP_DEVICES``, ``LOOP_FROM_ROW_BYTES``; here every
    model counts as large): every teacher a functional call on whole batches, in upload order, BatchNorm teachers
    with their own statistics: the loop's numbers to the bit."""
    monkeypatch.setattr(ensemble, "LOOP_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(ensemble, "LOOP_FROM_ROW_BYTES", 0)
    module, teachers = _teachers("resnet8_bn", (3, 16, 16), 3)
    _, lenets = _teachers("lenet5", (3, 16, 16), 2, seed=10)
    mixed = [teachers[0], lenets[0], teachers[1], teachers[2], lenets[1]]
    x = torch.randn(37, 3, 16, 16)
    stacked, loop = stacked_outputs(mixed, x, batch_size=16)[0], loop_outputs(mixed, x, batch_size=16)[0]
    assert stacked.shape == (5, 37, 10) and torch.equal(stacked, loop)


def test_on_a_loop_device_small_models_stay_stacked(monkeypatch):
    """Below ``LOOP_FROM_ROW_BYTES`` of activations a row (LeNet-5: ~60 KiB), teachers stay vmapped on CUDA too."""
    calls = []
    monkeypatch.setattr(ensemble, "LOOP_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(ensemble, "vmap", lambda f, **kw: calls.append(1) or torch.func.vmap(f, **kw))
    _, lenets = _teachers("lenet5", (1, 28, 28), 3)
    x = torch.randn(10, 1, 28, 28)
    assert ensemble.row_bytes(lenets[0][0], x) < ensemble.LOOP_FROM_ROW_BYTES
    _close(stacked_outputs(lenets, x, batch_size=8)[0], loop_outputs(lenets, x, batch_size=8)[0])
    assert calls == [1]
    monkeypatch.setattr(ensemble, "LOOP_FROM_ROW_BYTES", 1)  # now LeNet-5 counts as large: one by one, no vmap
    stacked_outputs(lenets, x, batch_size=8)
    assert calls == [1]


def test_prepare_and_single_teacher_is_the_loop_exactly():
    module, teachers = _teachers("lenet5", (1, 28, 28), 1)
    x = torch.randint(0, 256, (10, 1, 28, 28), dtype=torch.uint8)
    prep = lambda t: t.float() / 255 - 0.5  # noqa: E731
    assert torch.equal(stacked_outputs(teachers, x, 4, prep)[0], loop_outputs(teachers, x, 4, prep)[0])


@pytest.mark.parametrize("sharing, loop", [(True, False), (False, False), (True, True)])
def test_dafkd_stacked_client_outputs_equal_client_outputs(monkeypatch, sharing, loop):
    from fedray.methods.dafkd import DaFKD, DaFKDUpload
    from fedray.methods.dafkd.server import stacked_client_outputs
    from tests.methods.test_dafkd import dafkd_config

    if loop:  # CUDA's setting for a large model: teacher by teacher, the two outputs (logits, discriminator) apart
        monkeypatch.setattr(ensemble, "LOOP_DEVICES", ("cpu", "cuda"))
        monkeypatch.setattr(ensemble, "LOOP_FROM_ROW_BYTES", 0)
    cfg = dafkd_config(model__name="resnet8_bn", algorithm__sharing=sharing)
    spec = DataSpec(input_shape=(1, 16, 16), num_classes=10, num_clients=6, mean=(0.5,), std=(0.25,))
    algo = DaFKD(cfg, spec)
    m = algo.build_modules()
    uploads = []
    for k in range(3):
        torch.manual_seed(k)
        model, disc = build_model("resnet8_bn", spec.input_shape, 10), algo._build_disc(m.model.feature_dim)
        for bn in model.modules():
            if isinstance(bn, torch.nn.BatchNorm2d):
                bn.running_mean.uniform_(-0.3, 0.3)
        uploads.append(DaFKDUpload(weights=clone_weights(model), generator={}, num_samples=1, disc=clone_weights(disc)))
    x = torch.randn(11, *spec.input_shape)
    s, f = stacked_client_outputs(algo, m, uploads, x)
    ref_s, ref_f = [], []
    for u in uploads:
        m.model.load_state_dict(u.weights)
        m.disc.load_state_dict(u.disc)
        a, b = algo.client_outputs(m, x)
        ref_s.append(a)
        ref_f.append(b)
    _close(s, torch.stack(ref_s))
    _close(f, torch.stack(ref_f))
