"""The server's distillation loop on its own images (fedray.learning.proxy_distill.distil, FedDF's and FedD3A's): how
many steps it takes, on which images, with which optimizer, and FedDF's early stopping (the best weights kept, the
patience counted) under a scripted agreement."""

import math

import pytest
import torch

import fedray.learning.proxy_distill as pd
from fedray.learning.proxy_distill import DistillSettings, distil
from fedray.methods import DataSpec

SPEC = DataSpec(input_shape=(1, 2, 2), num_classes=3, num_clients=2, mean=(0.5,), std=(0.25,))


def _setup(n: int = 10):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, 256, (n, 1, 2, 2), dtype=torch.uint8)
    targets = torch.softmax(torch.randn(n, 3), dim=1)
    return model, start, x, targets


@pytest.mark.parametrize("n, batch, epochs", [(10, 4, 2.0), (10, 5, 2.0)])
def test_without_patience_every_image_trains_for_the_asked_passes(n, batch, epochs):
    """No early stopping: nothing is held out (whatever val_fraction says), round(epochs x ceil(n / batch)) steps,
    a pass ending exactly at the last image starts the next on a fresh permutation (no empty batch)."""
    model, start, x, targets = _setup(n)
    s = DistillSettings(lr=0.1, optimizer="sgd", batch_size=batch, epochs=epochs, temperature=1.0,
                        val_fraction=0.5, patience=0)
    _, metrics = distil(model, start, x, targets, SPEC, s, seed=3)
    assert metrics["server/distill_steps"] == round(epochs * math.ceil(n / batch))
    assert all(math.isfinite(metrics[k]) for k in ("server/kd_loss", "server/kd_loss_first", "server/kd_loss_last"))
    assert "server/val_agreement" not in metrics


def test_adam_takes_the_asked_learning_rate():
    model, start, x, targets = _setup()
    s = DistillSettings(lr=0.05, optimizer="adam", batch_size=10, epochs=1.0, temperature=1.0)
    weights, _ = distil(model, start, x, targets, SPEC, s, seed=3)
    moved = max(float((weights[k] - start[k]).abs().max()) for k in start)
    assert moved == pytest.approx(0.05, rel=1e-3)  # Adam's first step moves each weight by lr (times sign)


def test_early_stopping_keeps_the_best_weights_and_counts_patience(monkeypatch):
    """Scores 0.5, 0.9, 0.9 (a tie is no improvement), 0.2 at evaluations every 2 steps, patience 2: the best is
    the second evaluation's (step 4), the loop stops at the fourth (step 8) and returns step 4's weights."""
    scores = iter([0.5, 0.9, 0.9, 0.2, 0.1, 0.1])
    seen = []

    def scripted(model, x, target_probs, spec, batch_size):
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
        return next(scores)

    monkeypatch.setattr(pd, "agreement", scripted)
    model, start, x, targets = _setup(20)
    s = DistillSettings(lr=0.1, optimizer="sgd", batch_size=2, epochs=10.0, temperature=1.0, val_fraction=0.5,
                        patience=2, eval_every=2)
    weights, metrics = distil(model, start, x, targets, SPEC, s, seed=3)
    assert metrics["server/distill_steps"] == 8 and metrics["server/val_agreement"] == 0.9 and len(seen) == 4
    assert all(torch.equal(weights[k], seen[1][k]) for k in weights)
    assert not all(torch.equal(weights[k], seen[3][k]) for k in weights)
