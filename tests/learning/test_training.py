"""The sequential local-training runner (fedray.learning.training): a LocalTraining's steps are the optimizer's steps
of its loss on the client's batches, by hand; its figures are step means; a padded batch's rows are left out."""

import pytest
import torch
import torch.nn.functional as F

from fedray.learning.training import IGNORE_LABEL, row_mean, run_update, step_means
from tests.methods.plans import client_step


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_one_local_step_is_one_sgd_step_of_the_loss_on_the_first_batch(wd):
    """federation.local_steps=1: the upload is w - lr (grad CE(w; x, y) + wd w), and train/loss is that CE."""
    with client_step(federation__local_steps=1, federation__weight_decay=wd, federation__lr=0.3) as s:
        model = s.plan.model
        model.load_state_dict(s.plan.start)
        model.train()
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(s.x), s.y)
        loss.backward()
        want = {n: s.plan.start[n] - 0.3 * (p.grad + wd * s.plan.start[n]) for n, p in model.named_parameters()}
        result = run_update(s.ctx, s.plan)
        assert result.metrics["train/loss"] == pytest.approx(float(loss.detach()), rel=1e-6)
        for name, w in want.items():
            torch.testing.assert_close(result.upload.weights[name], w, rtol=1e-5, atol=1e-7)


def test_row_mean_and_step_means():
    values = torch.tensor([1.0, 2.0, 4.0, 8.0])
    assert float(row_mean(values, None)) == pytest.approx(3.75)
    assert float(row_mean(values, torch.tensor([True, False, True, False]))) == pytest.approx(2.5)
    assert float(row_mean(values, torch.tensor([1, 2, 3, IGNORE_LABEL]) != IGNORE_LABEL)) == pytest.approx(7 / 3)
    assert step_means({"train/loss": torch.tensor(6.0), "x": 3.0}, 3) == {"train/loss": 2.0, "x": 1.0}
    assert step_means({}, 0) == {"train/loss": 0.0}
