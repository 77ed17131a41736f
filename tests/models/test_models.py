"""Tests for fedray.models: shapes, the features -> head contract, determinism, DaFKD head sharing,
the ability to learn, the unknown-name error and parameter counts."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedray.errors import ConfigError
from fedray.models import MODEL_NAMES, FedModel, build_model

INPUT_SHAPES = [(1, 28, 28), (3, 32, 32), (1, 16, 16), (3, 16, 16)]

# The deeper members of the CIFAR ResNet family run exactly the code of resnet8_bn / resnet8x4 with more
# blocks; test_cifar_resnets checks every one of them (shapes, counts, depth, in-place ops, vmap), so the
# generic tests below take the shallow representatives only, to stay fast.
SAME_CODE_AS_SHALLOWER = ("resnet14", "resnet20", "resnet32", "resnet44", "resnet56", "resnet110", "resnet32x4")
GENERIC_NAMES = [name for name in MODEL_NAMES if name not in SAME_CODE_AS_SHALLOWER]


def _make(name, shape, num_classes=10, seed=0):
    torch.manual_seed(seed)
    return build_model(name, shape, num_classes)


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("shape", INPUT_SHAPES)
@pytest.mark.parametrize("name", GENERIC_NAMES)
def test_shapes_and_feature_contract(name, shape):
    batch = 2 + (sum(shape) % 3)  # 2..4
    model = _make(name, shape, num_classes=7)
    assert isinstance(model, FedModel)
    assert isinstance(model.head, nn.Linear)
    assert (model.head.in_features, model.head.out_features) == (model.feature_dim, 7)
    x = torch.randn(batch, *shape)
    model.train()
    logits = model(x)
    assert logits.shape == (batch, 7)
    model.eval()  # fixed BN statistics, so two passes agree exactly
    with torch.no_grad():
        feats = model.features(x)
        assert feats.shape == (batch, model.feature_dim)
        torch.testing.assert_close(model(x), model.head(feats), rtol=0, atol=0)


def test_expected_feature_dims():
    dims = {name: _make(name, (3, 32, 32)).feature_dim for name in MODEL_NAMES}
    assert dims == {"lenet5": 84, "resnet8": 64, "resnet11": 256, "mlp": 200, "vgg_small": 256,
                    "resnet18": 512, "mobilenet_v3_small": 1024,
                    "resnet8_bn": 64, "resnet14": 64, "resnet20": 64, "resnet32": 64, "resnet44": 64,
                    "resnet56": 64, "resnet110": 64, "resnet8x4": 256, "resnet32x4": 256, "resnet50": 2048}


def test_resnet8_uses_groupnorm_with_one_channel_per_group():
    model = _make("resnet8", (3, 32, 32))
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    gns = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    # stem 1 + three blocks x 2 + two projection shortcuts = 9
    assert len(gns) == 9
    assert all(gn.num_groups == gn.num_channels for gn in gns)
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())


def test_resnet11_is_bottleneck_with_batchnorm_and_256_features():
    model = _make("resnet11", (1, 28, 28))
    assert model.feature_dim == 256
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    # stem + 6 bottlenecks x 3 convs (all 3x3) + 3 projection shortcuts (1x1)
    assert len(convs) == 1 + 18 + 3
    assert sum(c.kernel_size == (3, 3) for c in convs) == 19
    assert model.features(torch.randn(2, 1, 28, 28)).shape == (2, 256)


@pytest.mark.parametrize("name", GENERIC_NAMES)
def test_same_seed_same_weights_and_state_dict_roundtrip(name):
    shape = (1, 28, 28)
    a, b = _make(name, shape, seed=3), _make(name, shape, seed=3)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb
        assert torch.equal(va, vb), ka
    c = _make(name, shape, seed=4)
    assert any(not torch.equal(va, vc) for va, vc in zip(a.state_dict().values(), c.state_dict().values()))
    c.load_state_dict(a.state_dict())
    for key, value in a.state_dict().items():
        assert torch.equal(value, c.state_dict()[key]), key
    x = torch.randn(3, *shape)
    a.eval()
    c.eval()
    with torch.no_grad():
        assert torch.equal(a(x), c(x))
    # pickles and deep-copies to the same function
    for clone in (pickle.loads(pickle.dumps(a)), copy.deepcopy(a)):
        clone.eval()
        with torch.no_grad():
            assert torch.equal(clone(x), a(x))
        assert clone.feature_dim == a.feature_dim and clone.input_shape == a.input_shape


@pytest.mark.parametrize("name", GENERIC_NAMES)
def test_discriminator_head_backpropagates_into_shared_extractor(name):
    """DaFKD Sec. 3.4: a second head Linear(feature_dim, 1) on the shared extractor."""
    model = _make(name, (3, 16, 16))
    disc = nn.Linear(model.feature_dim, 1)
    x = torch.randn(4, 3, 16, 16)
    loss = F.binary_cross_entropy_with_logits(disc(model.features(x)), torch.ones(4, 1))
    loss.backward()
    extractor = [(n, p) for n, p in model.named_parameters() if not n.startswith("head.")]
    assert extractor
    assert all(p.grad is not None for _, p in extractor)
    assert any(p.grad.abs().sum() > 0 for _, p in extractor)
    first_weight = extractor[0][1]
    assert first_weight.grad.abs().sum() > 0  # reaches the very first layer
    assert all(p.grad is None for n, p in model.named_parameters() if n.startswith("head."))
    assert disc.weight.grad is not None


@pytest.mark.parametrize("name,shape", [("lenet5", (1, 28, 28)), ("resnet8", (3, 32, 32)), ("resnet11", (1, 16, 16))])
def test_overfits_a_tiny_batch(name, shape):
    model = _make(name, shape, num_classes=4)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, *shape, generator=gen)
    y = torch.arange(16) % 4
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(200):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if losses[-1] < 0.1:
            break
    assert losses[-1] < 0.1, (name, losses[0], losses[-1])
    assert losses[0] > 1.0  # started from chance (ln 4 ~ 1.39), so it did learn


def test_works_with_torch_func():
    model = _make("resnet8", (1, 16, 16))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(2, 1, 16, 16)
    y = torch.tensor([0, 1])

    def loss_fn(p):
        return F.cross_entropy(torch.func.functional_call(model, p, (x,)), y)

    grads = torch.func.grad(loss_fn)(params)
    assert set(grads) == set(params)


def test_unknown_name_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        build_model("x", (1, 28, 28), 10)
    assert info.value.key == "model.name"
    assert info.value.message == ("unknown model 'x'; allowed: lenet5, resnet8, resnet11, mlp, vgg_small, "
                                  "resnet18, mobilenet_v3_small, resnet8_bn, resnet14, resnet20, resnet32, "
                                  "resnet44, resnet56, resnet110, resnet8x4, resnet32x4, resnet50")
    for bad in ("vgg", "resnet", "ResNet18", "mobilenet", None, 3):
        with pytest.raises(ConfigError) as info:
            build_model(bad, (1, 28, 28), 10)
        assert info.value.key == "model.name"


def test_lenet5_rejects_too_small_images():
    with pytest.raises(ConfigError) as info:
        build_model("lenet5", (1, 8, 8), 10)
    assert info.value.key == "model.name"


def test_parameter_counts():
    # LeNet-5 on 1x28x28 (padding 2 -> 16x5x5 = 400 flattened), 10 classes:
    # conv1 1*6*25 + 6 = 156; conv2 6*16*25 + 16 = 2416; fc1 400*120 + 120 = 48120;
    # fc2 120*84 + 84 = 10164; head 84*10 + 10 = 850  -> 61706 (the classic ~61.7k).
    assert _n_params(_make("lenet5", (1, 28, 28))) == 156 + 2416 + 48120 + 10164 + 850 == 61706
    # On 3x32x32 (no padding, also 16x5x5): conv1 gains 2*6*25 = 300 weights.
    assert _n_params(_make("lenet5", (3, 32, 32))) == 61706 + 300
    # ResNet-8 (GN affine = 2 per channel), 1 input channel, 10 classes:
    # stem 1*16*9 + 32 = 176; stage1 2*(16*16*9 + 32) = 4672;
    # stage2 16*32*9 + 64 + 32*32*9 + 64 + (16*32 + 64) = 14528;
    # stage3 32*64*9 + 128 + 64*64*9 + 128 + (32*64 + 128) = 57728; head 64*10 + 10 = 650 -> 77754.
    assert _n_params(_make("resnet8", (1, 28, 28))) == 176 + 4672 + 14528 + 57728 + 650 == 77754
    assert _n_params(_make("resnet8", (3, 32, 32))) == 77754 + 2 * 16 * 9
    # ResNet-11 (BN affine = 2 per channel; c3(i, o) = 9*i*o + 2*o for conv3x3 + BN), 1 channel, 10 classes:
    # stem 176; stage1 [c3(16,16) + c3(16,16) + c3(16,64) + 16*64 + 128] + [c3(64,16) + c3(16,16) + c3(16,64)]
    # = 15168 + 20928; stage2 73344 + 83328; stage3 292096 + 332544; head 256*10 + 10 = 2570 -> 820154.
    assert 176 + 15168 + 20928 + 73344 + 83328 + 292096 + 332544 + 2570 == 820154
    assert _n_params(_make("resnet11", (1, 28, 28))) == 820154
    assert _n_params(_make("resnet11", (3, 32, 32))) == 820154 + 2 * 16 * 9
