"""runtime.precision=bf16: convolutions and linear layers of local training on bfloat16 copies, the rest float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from fedray.errors import ResourceError
from fedray.models import build_model
from fedray.vectorized.precision import check_precision, local_precision


def _bf16_valued(t: torch.Tensor) -> bool:
    """Every value is a bfloat16 one: the product was rounded to bfloat16 (a float32 product almost never is)."""
    return t.dtype == torch.float32 and torch.equal(t, t.bfloat16().float())


@pytest.mark.parametrize("op, x, w", [
    (F.conv2d, torch.randn(4, 3, 9, 9), torch.randn(5, 3, 3, 3)),
    (F.conv_transpose2d, torch.randn(4, 3, 5, 5), torch.randn(3, 2, 4, 4)),
    (F.linear, torch.randn(4, 7), torch.randn(6, 7)),
])
def test_bf16_multiplies_bfloat16_copies_and_hands_on_float32(op, x, w):
    bias = torch.randn(w.shape[0] if op is not F.conv_transpose2d else w.shape[1])
    plain = op(x, w, bias)
    with local_precision("bf16"):
        out = op(x, w, bias)
        untouched = x * 3 + 1
    assert out.dtype == torch.float32
    assert torch.equal(out, op(x.bfloat16(), w.bfloat16(), bias.bfloat16()).float())
    assert not torch.equal(out, plain)
    assert torch.equal(untouched, x * 3 + 1)  # elementwise work stays float32
    with local_precision("float32"):
        assert torch.equal(op(x, w, bias), plain)


def test_a_bf16_step_keeps_weights_gradients_and_batchnorm_in_float32():
    torch.manual_seed(0)
    model = build_model("resnet8_bn", (1, 28, 28), 10)
    seen = []

    def record(module, inputs, output) -> None:
        seen.append((type(module), inputs[0].dtype, output))

    for m in model.modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.BatchNorm2d)):
            m.register_forward_hook(record)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    with local_precision("bf16"):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
    assert loss.dtype == torch.float32
    assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.float32}
    assert all(b.dtype in (torch.float32, torch.int64) for b in model.buffers())
    convs = [o for kind, _, o in seen if kind is torch.nn.Conv2d]
    norms = [(i, o) for kind, i, o in seen if kind is torch.nn.BatchNorm2d]
    assert convs and norms and all(_bf16_valued(o) for o in convs)
    assert all(i == torch.float32 and not _bf16_valued(o) for i, o in norms)  # BatchNorm computed in float32


def test_bf16_holds_under_vmap_where_autocast_does_not():
    """The vectorised runtime trains under ``vmap``, where ``torch.autocast`` leaves convolutions in float32."""
    w, x = torch.randn(3, 4, 2, 3, 3), torch.randn(3, 5, 2, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not _bf16_valued(vmap(F.conv2d)(x, w))
    with local_precision("bf16"):
        assert _bf16_valued(vmap(F.conv2d)(x, w))
        model = build_model("lenet5", (1, 28, 28), 10)
        params = {n: p.detach().expand(3, *p.shape).clone() for n, p in model.named_parameters()}

        def loss(p, xs, ys):
            return F.cross_entropy(functional_call(model, p, (xs,)), ys)

        grads = vmap(grad(loss))(params, torch.randn(3, 4, 1, 28, 28), torch.randint(0, 10, (3, 4)))
    assert all(g.dtype == torch.float32 and g.shape == params[n].shape for n, g in grads.items())


def test_bf16_is_refused_on_a_gpu_without_bfloat16_arithmetic(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    with pytest.raises(ResourceError) as e:
        check_precision("bf16", torch.device("cuda"))
    assert e.value.key == "runtime.precision" and "runtime.precision=float32" in e.value.message
    check_precision("float32", torch.device("cuda"))  # float32 asks nothing of the GPU
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    check_precision("bf16", torch.device("cuda"))
    with caplog.at_level("WARNING", logger="fedray"):
        check_precision("bf16", torch.device("cpu"))
    assert "slower than float32" in caplog.text


def test_a_nested_block_casts_once_and_the_block_ends_on_an_error(monkeypatch):
    """train_many trains a client by train, both at runtime.precision: the inner block adds no second cast."""
    from fedray.vectorized import precision

    casts = []
    monkeypatch.setattr(precision, "_low", lambda v: casts.append(v) or v.bfloat16())
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    with local_precision("bf16"), local_precision("bf16"):
        F.conv2d(x, w)
    assert len(casts) == 2  # the input and the weight, once
    with pytest.raises(ValueError), local_precision("bf16"):
        raise ValueError
    casts.clear()
    F.conv2d(x, w)
    assert not casts  # the error ended the block: no cast left behind
    with local_precision("bf16"):
        F.conv2d(x, w)
    assert len(casts) == 2  # and a later block casts again


def test_a_worker_checks_the_configs_precision_on_its_device(caplog):
    """bf16 on a CPU is said once a worker is built on it; float32 says nothing."""
    from fedray.data import build_federated_data
    from fedray.runtime.core import ClientWorkerCore
    from tests.conftest import tiny_config

    for precision, warned in [("float32", False), ("bf16", True)]:
        cfg = tiny_config(runtime__precision=precision)
        caplog.clear()
        with caplog.at_level("WARNING", logger="fedray"):
            ClientWorkerCore(cfg, build_federated_data(cfg.data, cfg.seed), torch.device("cpu"))
        assert ("runtime.precision=bf16 on a CPU" in caplog.text) is warned
