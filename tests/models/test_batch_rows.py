"""Row-masked BatchNorm (``fedray.models.base.batch_rows``): a padded batch normalised by its real rows comes out,
on those rows, as the unpadded batch does through the plain layer: outputs, gradients, running statistics."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, vmap

from fedray.models.base import batch_rows, frozen_bn_stats, row_masked_batchnorm

VALID = torch.tensor([True, True, True, False, False])


def _pair(layer: nn.Module) -> tuple[nn.Module, nn.Module]:
    twin = type(layer)(layer.num_features, momentum=layer.momentum)
    twin.load_state_dict(layer.state_dict())
    return layer, twin


def _input(layer: nn.Module) -> torch.Tensor:
    return torch.randn(5, 3, 4, 4) if isinstance(layer, nn.BatchNorm2d) else torch.randn(5, 3)


@pytest.mark.parametrize("make", [lambda: nn.BatchNorm2d(3), lambda: nn.BatchNorm1d(3),
                                  lambda: nn.BatchNorm2d(3, momentum=None)])  # a cumulative average
@pytest.mark.parametrize("frozen", [False, True])
def test_padded_rows_change_nothing_the_real_rows_get(make, frozen):
    torch.manual_seed(0)
    plain, masked = _pair(make())
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5), plain.bias.uniform_(-0.5, 0.5)
        masked.load_state_dict(plain.state_dict())
    x = _input(plain)
    padded = x.clone()
    padded[~VALID] = 100.0  # padding far from the data: it would move the statistics if it counted
    real, pad = x[VALID].clone().requires_grad_(True), padded.requires_grad_(True)
    for _ in range(2):  # twice: the running statistics' update builds on the last one
        with frozen_bn_stats(plain) if frozen else torch.enable_grad():
            out = plain(real)
        with row_masked_batchnorm(masked), batch_rows(VALID), frozen_bn_stats(masked) if frozen else torch.enable_grad():
            out_masked = masked(pad)
        torch.testing.assert_close(out_masked[VALID], out, rtol=1e-5, atol=1e-6)
        (out * torch.arange(out.numel()).view_as(out)).sum().backward()
        (out_masked[VALID] * torch.arange(out.numel()).view_as(out)).sum().backward()
    torch.testing.assert_close(pad.grad[VALID], real.grad, rtol=1e-5, atol=1e-5)
    assert (pad.grad[~VALID] == 0).all()
    for a, b in ((plain.weight.grad, masked.weight.grad), (plain.bias.grad, masked.bias.grad)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(masked.state_dict()[key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert int(masked.num_batches_tracked) == (0 if frozen else 2)


def test_only_inside_the_block_and_only_for_a_batch_of_the_masks_length():
    torch.manual_seed(0)
    layer = nn.BatchNorm2d(3)
    x = _input(layer)
    expected = nn.BatchNorm2d(3)(x)
    with batch_rows(VALID):  # the layer is not row-aware: the class's forward
        torch.testing.assert_close(layer(x), expected)
    with row_masked_batchnorm(layer):
        with batch_rows(VALID):
            assert not torch.allclose(layer(x), expected)
            torch.testing.assert_close(layer(x[:4]), nn.BatchNorm2d(3)(x[:4]))  # another batch: not these rows
        torch.testing.assert_close(layer(x), expected)  # no rows marked
        layer.eval()
        reference = nn.BatchNorm2d(3).eval()
        reference.load_state_dict(layer.state_dict())
        with batch_rows(VALID):
            torch.testing.assert_close(layer(x), reference(x))  # eval: the running statistics, every row
    assert "forward" not in vars(layer)


def test_under_vmap_each_client_is_normalised_by_its_own_real_rows():
    """As the vectorised runtime runs it: stacked per-client weights and buffers, a row mask per client."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3))
    clients = [nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)) for _ in range(3)]
    real_rows = [5, 2, 4]
    x = torch.randn(3, 5, 3, 4, 4)
    valid = torch.arange(5)[None, :] < torch.tensor(real_rows)[:, None]
    params = {k: torch.stack([dict(c.named_parameters())[k].detach() for c in clients]) for k, _ in layer.named_parameters()}
    buffers = {k: torch.stack([dict(c.named_buffers())[k] for c in clients]) for k, _ in layer.named_buffers()}

    def one(p, b, xi, vi):
        with batch_rows(vi):
            return functional_call(layer, (p, b), (xi,))

    with row_masked_batchnorm(layer):
        out = vmap(one)(params, buffers, x, valid)
    for i, (client, n) in enumerate(zip(clients, real_rows)):
        torch.testing.assert_close(out[i, :n], client(x[i, :n]), rtol=1e-5, atol=1e-6)
        for key, value in client.named_buffers():
            torch.testing.assert_close(buffers[key][i], value, rtol=1e-6, atol=1e-7)
