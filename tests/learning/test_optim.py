"""fedray's SGD and Adam against torch.optim's: the same bits, step after step."""

from __future__ import annotations

import pytest
import torch

from fedray.learning import optim


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _train(model: torch.nn.Module, opt, steps: int = 5) -> None:
    g = torch.Generator().manual_seed(1)
    for s in range(steps):
        x = torch.randn(8, 5, generator=g)
        # the last layer is left out of some steps: a parameter without a gradient is skipped, not stepped
        out = model[:3](x) if s % 2 else model(x)
        opt.zero_grad()
        out.square().mean().backward()
        opt.step()


@pytest.mark.parametrize("ours, theirs", [
    (lambda p: optim.SGD(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    (lambda p: optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2)),
    (lambda p: optim.Adam(p, lr=1e-2, betas=(0.5, 0.999), weight_decay=1e-3),
     lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.5, 0.999), weight_decay=1e-3)),
    # parameter groups with their own learning rates (DaFKD's classifier and discriminator)
    (lambda p: optim.SGD([{"params": p[:2], "lr": 0.1}, {"params": p[2:], "lr": 0.01}], momentum=0.9),
     lambda p: torch.optim.SGD([{"params": p[:2], "lr": 0.1}, {"params": p[2:], "lr": 0.01}], momentum=0.9)),
    (lambda p: optim.Adam([{"params": p[:2], "lr": 1e-2}, {"params": p[2:], "lr": 1e-3}], weight_decay=1e-4),
     lambda p: torch.optim.Adam([{"params": p[:2], "lr": 1e-2}, {"params": p[2:], "lr": 1e-3}], weight_decay=1e-4)),
])
def test_steps_are_torch_optims_bit_for_bit(ours, theirs):
    a, b = _model(), _model()
    opt_a, opt_b = ours(list(a.parameters())), theirs(list(b.parameters()))
    _train(a, opt_a)
    _train(b, opt_b)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
        assert opt_a.state.get(pa, {}).keys() == opt_b.state.get(pb, {}).keys(), name
        for key, value in opt_b.state.get(pb, {}).items():
            assert torch.equal(opt_a.state[pa][key], value), (name, key)


def test_adam_continues_a_saved_state_as_torch_optims_load_state_dict_does():
    """FedKF's generator keeps its Adam moments across rounds: a continued state gives torch.optim's numbers and
    does not write into the saved moments."""
    a, b = _model(), _model()
    saved = {name: (torch.rand_like(p) * 0.1, torch.rand_like(p) * 0.01) for name, p in a.named_parameters()}
    kept = {name: (m.clone(), v.clone()) for name, (m, v) in saved.items()}
    opt_a = optim.Adam(a.parameters(), lr=1e-2)
    for name, p in a.named_parameters():
        opt_a.init_state(p, 3, *saved[name])
    opt_b = torch.optim.Adam(b.parameters(), lr=1e-2)
    sd = opt_b.state_dict()
    sd["state"] = {i: {"step": torch.tensor(3.0), "exp_avg": kept[n][0].clone(), "exp_avg_sq": kept[n][1].clone()}
                   for i, (n, _) in enumerate(b.named_parameters())}
    opt_b.load_state_dict(sd)
    _train(a, opt_a, steps=3)
    _train(b, opt_b, steps=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
        assert float(opt_a.state[pa]["step"]) == float(opt_b.state[pb]["step"]) > 3
        assert torch.equal(saved[name][0], kept[name][0]) and torch.equal(saved[name][1], kept[name][1])
