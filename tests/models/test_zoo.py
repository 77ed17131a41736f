"""Tests for the heterogeneous-client model zoo (mlp, vgg_small, resnet18, mobilenet_v3_small) and the
registry: the FedModel contract, no dropout / in-place ops, determinism, hand-counted parameter counts,
state_dict / deep-copy round trips, torch.func (functional_call + vmap) over stacked copies,
describe_models and the separate discriminator."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap
from torch.utils._python_dispatch import TorchDispatchMode

from fedray.errors import ConfigError
from fedray.models import MODEL_NAMES, FedModel, build_model, describe_models
from fedray.models.dcgan import separate_discriminator

NEW_MODELS = ("mlp", "vgg_small", "resnet18", "mobilenet_v3_small")
SHAPES = [(1, 28, 28), (3, 32, 32), (1, 16, 16)]
FEATURE_DIMS = {"mlp": 200, "vgg_small": 256, "resnet18": 512, "mobilenet_v3_small": 1024}


def _make(name, shape, num_classes=10, seed=0):
    torch.manual_seed(seed)
    return build_model(name, shape, num_classes)


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class _RecordOps(TorchDispatchMode):
    """Records every aten op a forward runs, to catch in-place ones (``relu_``, ``add_``, ``hardswish_``)."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", NEW_MODELS)
def test_contract_determinism_and_round_trips(name, shape):
    model = _make(name, shape, num_classes=7)
    assert isinstance(model, FedModel)
    assert model.input_shape == shape and model.num_classes == 7
    assert model.feature_dim == FEATURE_DIMS[name]
    assert isinstance(model.head, nn.Linear)
    assert (model.head.in_features, model.head.out_features) == (model.feature_dim, 7)
    assert not any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
    assert not [type(m).__name__ for m in model.modules() if getattr(m, "inplace", False)]
    assert _n_params(model) == PARAM_COUNTS[name](*shape, 7)

    x = torch.randn(2, *shape)
    model.train()  # BN in train mode: batch statistics, running-stat updates
    assert model(x).shape == (2, 7)
    model.eval()
    recorder = _RecordOps()
    with torch.no_grad(), recorder:
        feats = model.features(x)
    # no in-place activation or residual add anywhere in the extractor (aten in-place ops end in "_")
    assert not [op for op in recorder.ops if op.split("::")[-1].endswith("_")]
    with torch.no_grad():
        assert feats.shape == (2, model.feature_dim)
        logits = model(x)
        assert logits.shape == (2, 7)
        assert torch.equal(logits, model.head(feats))  # a second pass through features: deterministic

    # state_dict round-trips into another initialisation; deep copies compute the same function
    other = _make(name, shape, num_classes=7, seed=1)
    other.load_state_dict(model.state_dict())
    clone = copy.deepcopy(model)
    reference = model.state_dict()
    for m in (other, clone):
        m.eval()
        assert m.feature_dim == model.feature_dim and m.input_shape == model.input_shape
        state = m.state_dict()
        assert list(state) == list(reference)
        for key, value in reference.items():
            assert torch.equal(value, state[key]), key
        with torch.no_grad():
            assert torch.equal(m(x), logits)


def assert_vmap_matches_separate_forwards(name, shape):
    """The vectorised-clients pattern: stack two clients' weights (eval mode), vmap one functional
    forward over them, and compare with each copy's own forward. Shared with test_cifar_resnets."""
    torch.manual_seed(5)
    first = _make(name, shape, seed=0)
    second = _make(name, shape, seed=1)
    with torch.no_grad():  # distinct BN statistics too, so buffers must be stacked correctly
        for buf in second.buffers():
            if buf.is_floating_point():
                buf.add_(0.1)
    models = [first.eval(), second.eval()]
    params, buffers = stack_module_state(models)
    skeleton = copy.deepcopy(first).to("meta")
    x = torch.randn(2, 2, *shape)  # (client, batch, C, H, W)

    def forward(p, b, xi):
        return functional_call(skeleton, (p, b), (xi,))

    out = vmap(forward, randomness="different")(params, buffers, x)
    with torch.no_grad():
        expected = torch.stack([m(xi) for m, xi in zip(models, x)])
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", NEW_MODELS)
def test_functional_call_vmap_over_stacked_copies(name, shape):
    assert_vmap_matches_separate_forwards(name, shape)


@pytest.mark.parametrize("name", NEW_MODELS)
def test_grad_through_functional_call_in_train_mode(name):
    """A local training step in torch.func style; BN buffers go in as inputs, since BN updates them."""
    model = _make(name, (1, 16, 16), num_classes=3).train()
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    x, y = torch.randn(2, 1, 16, 16), torch.tensor([0, 2])

    def loss_fn(p, b):
        return nn.functional.cross_entropy(functional_call(model, (p, b), (x,)), y)

    grads = torch.func.grad(loss_fn)(params, buffers)
    assert set(grads) == set(params)
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().sum() > 0 for g in grads.values())


def _mlp_count(c, h, w, k):
    # McMahan et al.'s 2NN: 784*200+200 = 157000; 200*200+200 = 40200; 200*k+k.
    return (c * h * w * 200 + 200) + (200 * 200 + 200) + (200 * k + k)


def _vgg_small_count(c, k):
    # conv3x3 with bias + BN (2 per channel): c*32*9+32+64; 32*64*9+64+128 = 18624;
    # 64*128*9+128+256 = 74112; 128*128*9+128+256 = 147840; FC (128*2*2)*256+256 = 131328; 256*k+k.
    return (c * 32 * 9 + 32 + 64) + 18624 + 74112 + 147840 + 131328 + (256 * k + k)


def _resnet18_count(c, k):
    # stem c*64*9 + BN 128; layer1 4 x (64*64*9 + 128) = 147968;
    # layer2 (64*128*9 + 256) + (128*128*9 + 256) + (64*128 + 256) + 2 x (128*128*9 + 256) = 525568;
    # layer3 (the same with 128 -> 256) = 2099712; layer4 (256 -> 512) = 8393728; head 512*k + k.
    return (c * 64 * 9 + 128) + 147968 + 525568 + 2099712 + 8393728 + (512 * k + k)


# MobileNetV3-Small (Howard et al., ICCV 2019, Table 2) as torchvision builds it:
# (in, kernel, expanded, out, squeeze channels of the SE block or 0 without SE);
# squeeze = make_divisible(expanded // 4, 8). torchvision (like the authors' TF code) puts no SE block
# on the final 1x1 conv that the paper's table marks with one.
_MNV3_SMALL = [
    (16, 3, 16, 16, 8), (16, 3, 72, 24, 0), (24, 3, 88, 24, 0), (24, 5, 96, 40, 24),
    (40, 5, 240, 40, 64), (40, 5, 240, 40, 64), (40, 5, 120, 48, 32), (48, 5, 144, 48, 40),
    (48, 5, 288, 96, 72), (96, 5, 576, 96, 144), (96, 5, 576, 96, 144),
]


def _mobilenet_v3_small_count(c, k):
    total = c * 16 * 9 + 2 * 16  # stem conv3x3 (no bias) + BN
    for cin, kernel, exp, out, squeeze in _MNV3_SMALL:
        if exp != cin:
            total += cin * exp + 2 * exp  # 1x1 expand + BN
        total += exp * kernel * kernel + 2 * exp  # depthwise + BN
        if squeeze:
            total += (exp * squeeze + squeeze) + (squeeze * exp + exp)  # SE: two 1x1 convs with bias
        total += exp * out + 2 * out  # 1x1 project + BN
    total += 96 * 576 + 2 * 576  # last 1x1 conv + BN
    total += 576 * 1024 + 1024  # classifier.0 (inside features)
    return total + 1024 * k + k  # head


PARAM_COUNTS = {
    "mlp": lambda c, h, w, k: _mlp_count(c, h, w, k),
    "vgg_small": lambda c, h, w, k: _vgg_small_count(c, k),
    "resnet18": lambda c, h, w, k: _resnet18_count(c, k),
    "mobilenet_v3_small": lambda c, h, w, k: _mobilenet_v3_small_count(c, k),
}


def test_parameter_counts():
    # the documented numbers (1x28x28 / 3x32x32, 10 classes)
    assert _mlp_count(1, 28, 28, 10) == 199210  # McMahan et al.'s "199,210 total parameters"
    assert _mlp_count(3, 32, 32, 10) == 656810
    assert _vgg_small_count(1, 10) == 374858 and _vgg_small_count(3, 10) == 375434
    assert _resnet18_count(3, 10) == 11173962 and _resnet18_count(1, 10) == 11172810
    assert _mobilenet_v3_small_count(3, 10) == 1528106 and _mobilenet_v3_small_count(1, 10) == 1527818
    # torchvision's own numbers: ResNet-18 has 11,689,512 with the ImageNet stem and 1000 classes;
    # MobileNetV3-Small 2,542,856 with 1000 classes.
    assert _resnet18_count(3, 1000) - 3 * 64 * 9 + 3 * 64 * 49 == 11689512
    assert _mobilenet_v3_small_count(3, 1000) == 2542856

    # the models themselves (built on the meta device: same modules, no weight memory or init time;
    # test_contract_determinism_and_round_trips checks real models with 7 classes)
    for name, count in PARAM_COUNTS.items():
        for shape in SHAPES:
            with torch.device("meta"):
                model = build_model(name, shape, 10)
            assert _n_params(model) == count(*shape, 10), (name, shape)


def test_resnet18_keeps_torchvision_names_and_small_image_stem():
    from torchvision.models import resnet18

    model = _make("resnet18", (1, 28, 28))
    ours = {k.replace("head.", "fc.", 1): v.shape for k, v in model.state_dict().items()}
    theirs = {k: v.shape for k, v in resnet18(num_classes=10).state_dict().items()}
    assert set(ours) == set(theirs)
    assert {k for k in ours if ours[k] != theirs[k]} == {"conv1.weight"}  # 3x3 on 1 channel vs 7x7 on 3
    assert (model.conv1.kernel_size, model.conv1.stride, model.conv1.in_channels) == ((3, 3), (1, 1), 1)
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())


def test_mobilenet_stem_stride_follows_image_size():
    small = _make("mobilenet_v3_small", (3, 32, 32))
    big = _make("mobilenet_v3_small", (3, 96, 96))
    assert small.backbone[0][0].stride == (1, 1) and big.backbone[0][0].stride == (2, 2)
    assert _n_params(small) == _n_params(big)
    with torch.no_grad():
        assert big.eval()(torch.randn(1, 3, 96, 96)).shape == (1, 10)


def test_vgg_small_rejects_images_below_8px():
    with pytest.raises(ConfigError) as info:
        build_model("vgg_small", (1, 7, 7), 10)
    assert info.value.key == "model.name" and "8x8" in info.value.message


def test_every_architecture_builds_for_1x28x28_10_classes():
    models = {name: _make(name, (1, 28, 28)) for name in MODEL_NAMES}
    assert len(MODEL_NAMES) == len(set(MODEL_NAMES)) >= 7
    assert set(NEW_MODELS) <= set(MODEL_NAMES)
    assert len({type(m) for m in models.values()}) == len(MODEL_NAMES)  # distinct architectures
    # distinct parameter counts, except that resnet8 (GroupNorm) and resnet8_bn (BatchNorm) share a
    # layout and both norms have 2 affine parameters per channel
    assert _n_params(models["resnet8"]) == _n_params(models["resnet8_bn"])
    assert len({_n_params(m) for n, m in models.items() if n != "resnet8_bn"}) == len(MODEL_NAMES) - 1
    x = torch.randn(2, 1, 28, 28)
    for name, model in models.items():
        with torch.no_grad():
            assert model.eval()(x).shape == (2, 10), name


def test_describe_models():
    state = torch.get_rng_state()
    rows = describe_models((3, 32, 32), 10)
    assert torch.equal(state, torch.get_rng_state())  # built on the meta device: no RNG draws
    assert [row["name"] for row in rows] == list(MODEL_NAMES)
    for row in rows:
        assert set(row) == {"name", "parameters", "feature_dim", "description", "error"}
        assert row["error"] is None
        assert isinstance(row["parameters"], int) and row["parameters"] > 0
        assert isinstance(row["feature_dim"], int) and row["feature_dim"] > 0
        assert isinstance(row["description"], str) and 0 < len(row["description"]) <= 80
    by_name = {row["name"]: row for row in rows}
    assert by_name["resnet18"]["parameters"] == 11173962 and by_name["resnet18"]["feature_dim"] == 512
    assert by_name["mobilenet_v3_small"]["parameters"] == 1528106
    assert by_name["lenet5"]["parameters"] == 62006  # as test_models.test_parameter_counts
    # an image too small for some architectures: those rows say why instead of counting
    small = {row["name"]: row for row in describe_models((1, 6, 6), 10)}
    assert {n for n, row in small.items() if row["error"]} == {"lenet5", "vgg_small"}
    assert small["lenet5"]["parameters"] is None and "12x12" in small["lenet5"]["error"]


@pytest.mark.parametrize("name", NEW_MODELS)
def test_separate_discriminator(name):
    disc = separate_discriminator(name, (1, 16, 16))
    assert disc.head.out_features == 1
    with torch.no_grad():
        assert disc.eval()(torch.randn(2, 1, 16, 16)).shape == (2, 1)


def test_separate_discriminator_unknown_name():
    with pytest.raises(ConfigError) as info:
        separate_discriminator("vgg", (1, 28, 28))
    assert info.value.key == "model.name" and "allowed: lenet5" in info.value.message
