"""Tests for the CIFAR ResNet family of knowledge-distillation work (He et al., CVPR 2016; the model zoo of
Tian et al., "Contrastive Representation Distillation", ICLR 2020) that FedCD's Table I gives its ten
users: resnet8_bn ... resnet110 (6n+2, BatchNorm, 16/32/64), resnet8x4 / resnet32x4 (stem 32, stages
64/128/256) and resnet50 (torchvision's bottleneck ResNet-50 with a small-image stem).

Shapes, head, hand-counted parameter counts, depth, option-B shortcuts, no in-place ops, vmap over
stacked copies, forward FLOPs. Deep models run on 3x16x16 where only the code path matters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedray.models import MODEL_NAMES, FedModel, build_model, forward_flops
from tests.models.test_zoo import _make, _n_params, _RecordOps, assert_vmap_matches_separate_forwards

# FedCD Table I, one model per user, in the paper's row order.
TABLE_I = ("resnet8_bn", "resnet14", "resnet20", "resnet32", "resnet44", "resnet50", "resnet56",
           "resnet110", "resnet8x4", "resnet32x4")
BLOCKS_PER_STAGE = {"resnet8_bn": 1, "resnet14": 2, "resnet20": 3, "resnet32": 5, "resnet44": 7,
                    "resnet56": 9, "resnet110": 18, "resnet8x4": 1, "resnet32x4": 5}  # n of 6n+2
DEPTHS = {name: 6 * n + 2 for name, n in BLOCKS_PER_STAGE.items()} | {"resnet50": 50}
WIDE = ("resnet8x4", "resnet32x4")
FEATURE_DIMS = {name: 64 for name in BLOCKS_PER_STAGE} | {"resnet8x4": 256, "resnet32x4": 256, "resnet50": 2048}


def _narrow_count(c: int, n: int, k: int) -> int:
    """16/32/64 basic-block CIFAR ResNet with BN (2 affine parameters per channel), option-B shortcuts.

    c3(i, o) = 9*i*o + 2*o (conv3x3 + BN), p(i, o) = i*o + 2*o (1x1 projection + BN).
    stem c3(c, 16) = 144c + 32; stage 1: n x 2 x c3(16, 16) = 4672n;
    stage 2: c3(16, 32) + c3(32, 32) + p(16, 32) = 4672 + 9280 + 576 = 14528, + (n-1) x 2 x 9280;
    stage 3: c3(32, 64) + c3(64, 64) + p(32, 64) = 18560 + 36992 + 2176 = 57728, + (n-1) x 2 x 36992;
    head 64k + k. Sum: 97216n + 144c + 65k - 20256.
    """
    stem = 144 * c + 32
    stage1 = 4672 * n
    stage2 = 14528 + 18560 * (n - 1)
    stage3 = 57728 + 73984 * (n - 1)
    total = stem + stage1 + stage2 + stage3 + 65 * k
    assert total == 97216 * n + 144 * c + 65 * k - 20256
    return total


def _wide_count(c: int, n: int, k: int) -> int:
    """The x4 variants: stem 32, stages 64/128/256, every stage's first block projected (32 -> 64 too).

    stem c3(c, 32) = 288c + 64;
    stage 1: c3(32, 64) + c3(64, 64) + p(32, 64) = 18560 + 36992 + 2176 = 57728, + (n-1) x 2 x 36992;
    stage 2: c3(64, 128) + c3(128, 128) + p(64, 128) = 73984 + 147712 + 8448 = 230144, + (n-1) x 2 x 147712;
    stage 3: c3(128, 256) + c3(256, 256) + p(128, 256) = 295424 + 590336 + 33280 = 919040,
    + (n-1) x 2 x 590336; head 256k + k.
    """
    stem = 288 * c + 64
    stage1 = 57728 + 73984 * (n - 1)
    stage2 = 230144 + 295424 * (n - 1)
    stage3 = 919040 + 1180672 * (n - 1)
    return stem + stage1 + stage2 + stage3 + 257 * k


def _resnet50_count(c: int, k: int) -> int:
    """torchvision's bottleneck ResNet-50 with a 3x3 stem on c channels (64 outputs) and Linear(2048, k).

    bottleneck(i, p) = 1x1 i->p + BN + 3x3 p->p + BN + 1x1 p->4p + BN [+ projection 1x1 i->4p + BN]:
    stage (planes, blocks): (64, 3) 75008 + 2 x 70400 = 215808; (128, 4) 379392 + 3 x 280064 = 1219584;
    (256, 6) 1512448 + 5 x 1117184 = 7098368; (512, 3) 6039552 + 2 x 4462592 = 14964736.
    """

    def bottleneck(i: int, p: int, projection: bool) -> int:
        main = (i * p + 2 * p) + (9 * p * p + 2 * p) + (p * 4 * p + 8 * p)
        return main + ((i * 4 * p + 8 * p) if projection else 0)

    total, in_ch = 9 * c * 64 + 128, 64
    for planes, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3)):
        total += bottleneck(in_ch, planes, True) + (blocks - 1) * bottleneck(4 * planes, planes, False)
        in_ch = 4 * planes
    assert total - (9 * c * 64 + 128) == 215808 + 1219584 + 7098368 + 14964736 == 23498496
    return total + 2048 * k + k


def _hand_count(name: str, c: int, k: int) -> int:
    if name == "resnet50":
        return _resnet50_count(c, k)
    return (_wide_count if name in WIDE else _narrow_count)(c, BLOCKS_PER_STAGE[name], k)


# The exact counts asserted (trainable parameters; BN running statistics are buffers, not counted).
PARAMS_CIFAR100 = {  # 3x32x32, 100 classes
    "resnet8_bn": 83892, "resnet14": 181108, "resnet20": 278324, "resnet32": 472756,
    "resnet44": 667188, "resnet50": 23705252, "resnet56": 861620, "resnet110": 1736564,
    "resnet8x4": 1233540, "resnet32x4": 7433860,
}
PARAMS_MNIST = {  # 1x28x28, 10 classes
    "resnet8_bn": 77754, "resnet14": 174970, "resnet20": 272186, "resnet32": 466618,
    "resnet44": 661050, "resnet50": 23519690, "resnet56": 855482, "resnet110": 1730426,
    "resnet8x4": 1209834, "resnet32x4": 7410154,
}


def test_table_i_ten_distinct_models_build_for_cifar():
    assert len(TABLE_I) == len(set(TABLE_I)) == 10
    assert set(TABLE_I) <= set(MODEL_NAMES)
    models = {name: _make(name, (3, 32, 32), num_classes=100) for name in TABLE_I}
    assert len({type(m) for m in models.values()}) == 10
    assert len({_n_params(m) for m in models.values()}) == 10
    x = torch.randn(1, 3, 32, 32)
    for name, model in models.items():
        with torch.no_grad():
            assert model.eval()(x).shape == (1, 100), name


@pytest.mark.parametrize("shape,num_classes", [((1, 28, 28), 10), ((3, 32, 32), 100)])
@pytest.mark.parametrize("name", TABLE_I)
def test_logits_features_and_head(name, shape, num_classes):
    model = _make(name, shape, num_classes=num_classes).eval()
    assert isinstance(model, FedModel)
    assert model.input_shape == shape and model.num_classes == num_classes
    assert model.feature_dim == FEATURE_DIMS[name]
    assert type(model.head) is nn.Linear and model.head.bias is not None
    assert (model.head.in_features, model.head.out_features) == (FEATURE_DIMS[name], num_classes)
    x = torch.randn(2, *shape)
    with torch.no_grad():
        feats = model.features(x)
        logits = model(x)
    assert feats.shape == (2, FEATURE_DIMS[name])
    assert logits.shape == (2, num_classes)
    torch.testing.assert_close(logits, model.head(feats), rtol=0, atol=0)


def test_parameter_counts():
    for name in TABLE_I:
        assert _hand_count(name, 3, 100) == PARAMS_CIFAR100[name], name
        assert _hand_count(name, 1, 10) == PARAMS_MNIST[name], name
    for shape, num_classes, expected in (((3, 32, 32), 100, PARAMS_CIFAR100), ((1, 28, 28), 10, PARAMS_MNIST)):
        with torch.device("meta"):  # the same modules, no weight memory or init time
            counts = {name: _n_params(build_model(name, shape, num_classes)) for name in TABLE_I}
        assert counts == expected, shape
    # rounded to 0.01 M: the sizes quoted for the CRD zoo's CIFAR-100 models (resnet20 0.28 M,
    # resnet56 0.86 M, resnet110 1.7 M, resnet8x4 1.23 M, resnet32x4 7.4 M, ResNet50 23.7 M ...)
    published = {"resnet8_bn": 0.08, "resnet14": 0.18, "resnet20": 0.28, "resnet32": 0.47, "resnet44": 0.67,
                 "resnet56": 0.86, "resnet110": 1.74, "resnet8x4": 1.23, "resnet32x4": 7.43, "resnet50": 23.71}
    assert {name: round(count / 1e6, 2) for name, count in PARAMS_CIFAR100.items()} == published
    # option B vs He et al.'s option A: ResNet-20 carries p(16, 32) + p(32, 64) = 576 + 2176 more
    assert PARAMS_CIFAR100["resnet20"] - (576 + 2176) == 275572
    # torchvision's ResNet-50 (25,557,032 with the 7x7 3-channel stem and 1000 classes) less the stem
    # difference and the head difference
    assert PARAMS_CIFAR100["resnet50"] == 25557032 - 3 * 64 * (49 - 9) - 2048 * 900 - 900
    # same layout and 2 affine parameters per channel: the BN ResNet-8 counts as FedKF's GN one
    assert PARAMS_MNIST["resnet8_bn"] == _n_params(_make("resnet8", (1, 28, 28))) == 77754


def _is_shortcut(module_name: str) -> bool:
    return ".shortcut." in module_name or ".downsample." in module_name


@pytest.mark.parametrize("name", TABLE_I)
def test_depth_norms_stem_and_option_b_shortcuts(name):
    with torch.device("meta"):
        model = build_model(name, (3, 32, 32), 100)
    convs = {n: m for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    main_path = [m for n, m in convs.items() if not _is_shortcut(n)]
    projections = [m for n, m in convs.items() if _is_shortcut(n)]
    assert linears == [model.head]
    assert len(main_path) + len(linears) == DEPTHS[name]  # He et al.'s depth: shortcuts not counted
    # option B: a 1x1 projection exactly where a stage changes the shape (the narrow family's stage 1
    # keeps 16 channels at stride 1, so it has none)
    assert all(p.kernel_size == (1, 1) for p in projections)
    assert len(projections) == {"resnet50": 4}.get(name, 3 if name in WIDE else 2)
    assert [p.stride for p in projections][-2:] == [(2, 2), (2, 2)]
    # BatchNorm everywhere, no GroupNorm / dropout / max-pool
    assert not any(isinstance(m, (nn.GroupNorm, nn.Dropout, nn.MaxPool2d)) for m in model.modules())
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == len(convs)
    # the stem: conv3x3, stride 1, on the input's channels, 16 / 32 (x4) / 64 (resnet50) outputs
    stem = main_path[0]
    assert (stem.kernel_size, stem.stride, stem.in_channels) == ((3, 3), (1, 1), 3)
    assert stem.out_channels == (64 if name == "resnet50" else 32 if name in WIDE else 16)
    if name != "resnet50":  # 6n+2 family: every main-path conv is 3x3, stage widths as documented
        assert all(m.kernel_size == (3, 3) for m in main_path)
        widths = (64, 128, 256) if name in WIDE else (16, 32, 64)
        assert [p.out_channels for p in projections][-2:] == list(widths[1:])
        assert {m.out_channels for m in main_path[1:]} == set(widths)


@pytest.mark.parametrize("name", TABLE_I)
def test_no_inplace_ops(name):
    model = _make(name, (3, 16, 16)).eval()
    assert not [type(m).__name__ for m in model.modules() if getattr(m, "inplace", False)]
    recorder = _RecordOps()
    with torch.no_grad(), recorder:
        assert model(torch.randn(2, 3, 16, 16)).shape == (2, 10)
    assert "aten::add" in recorder.ops  # the residual adds are out-of-place ...
    assert not [op for op in recorder.ops if op.split("::")[-1].endswith("_")]  # ... and nothing is in place


@pytest.mark.parametrize("name", TABLE_I)
def test_functional_call_vmap_over_stacked_copies(name):
    assert_vmap_matches_separate_forwards(name, (3, 16, 16))


def test_forward_flops_at_cifar_size():
    flops = {name: forward_flops(name, (3, 32, 32), 100)
             for name in ("resnet8_bn", "resnet14", "resnet20", "resnet32", "resnet8x4")}
    # ResNet-20 by hand, 2 FLOPs per multiply-accumulate of the convolutions and the head:
    # stem 3*16*9*32*32 = 442368; stage 1: 6 x 16*16*9*32*32 = 14155776;
    # stage 2: 16*32*9*16*16 + 5 x 32*32*9*16*16 + 16*32*16*16 = 1179648 + 11796480 + 131072;
    # stage 3: 32*64*9*8*8 + 5 x 64*64*9*8*8 + 32*64*8*8 = 1179648 + 11796480 + 131072; head 64*100.
    macs = 442368 + 14155776 + (1179648 + 11796480 + 131072) * 2 + 6400
    assert flops["resnet20"] == 2 * macs == 81637888
    # each extra block per stage costs the same at every stage (channels x2, pixels /4):
    # 2 convs x 3 stages x 2359296 MACs x 2 FLOPs, so the 6n+2 family is linear in n
    for name in ("resnet8_bn", "resnet14", "resnet20", "resnet32"):
        assert flops[name] == 25014784 + (BLOCKS_PER_STAGE[name] - 1) * 2 * 3 * 2 * 2359296, name
    # ResNet-8x4: stem 3*32*9*32*32 = 884736; each stage at its resolution costs the same,
    # conv1 + conv2 + projection = 18874368 + 37748736 + 2097152 = 58720256 MACs; head 256*100
    assert flops["resnet8x4"] == 2 * (884736 + 3 * 58720256 + 25600) == 354142208


def test_resnet8_description_names_both_variants():
    from fedray.models.zoo import _ZOO  # describe_models' descriptions, without building the zoo

    assert "GroupNorm" in _ZOO["resnet8"].description and "resnet8_bn" in _ZOO["resnet8"].description
    assert "BatchNorm" in _ZOO["resnet8_bn"].description
    gn = _make("resnet8", (3, 32, 32))
    assert any(isinstance(m, nn.GroupNorm) for m in gn.modules())
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gn.modules())
