"""FedKF's AMP / FM / WLP and rounds-to-target, on small examples whose figures are worked out by hand."""

import math

import numpy as np
import pytest

from fedray.metrics import client_metrics, rounds_to_target


def _metrics(correct, total):
    return client_metrics(np.asarray(correct), np.asarray(total))


def test_amp_fm_wlp_of_three_clients():
    # accuracies 3/4 = 0.75, 1/2 = 0.5, 4/8 = 0.5
    m = _metrics([3, 1, 4], [4, 2, 8])
    # AMP = total correct / total samples = (3 + 1 + 4) / (4 + 2 + 8) = 8/14, not the mean accuracy 7/12
    assert m["eval/amp"] == pytest.approx(8 / 14)
    # FM = population variance: mean 7/12; deviations 1/6, -1/12, -1/12; squares 4/144 + 1/144 + 1/144
    # = 6/144 = 1/24; divided by 3 clients (not 2) = 1/72
    assert m["eval/fm"] == pytest.approx(1 / 72)
    assert m["eval/fm"] != pytest.approx(1 / 48)  # the sample variance (ddof=1) would be 1/24 / 2
    assert m["eval/wlp"] == 0.5


def test_fedkf_table_ii_example():
    # FedKF's example: accuracies 0.6 / 0.7 / 0.8 give FM = (0.01 + 0 + 0.01) / 3 = 0.00667
    m = _metrics([6, 7, 8], [10, 10, 10])
    assert m["eval/amp"] == pytest.approx(21 / 30)
    assert m["eval/fm"] == pytest.approx(0.02 / 3)
    assert m["eval/wlp"] == pytest.approx(0.6)


def test_unequal_client_sizes_weight_amp_by_samples():
    # client 0: 1/1 = 1.0 on one sample; client 1: 0/9 = 0.0 on nine
    m = _metrics([1, 0], [1, 9])
    assert m["eval/amp"] == pytest.approx(1 / 10)  # the mean accuracy would be 0.5
    assert m["eval/fm"] == pytest.approx(0.25)  # mean 0.5, squared deviations 0.25 and 0.25
    assert m["eval/wlp"] == 0.0


def test_a_client_without_test_samples_counts_for_amp_only():
    # client 1 has no test sample: no accuracy, so it is neither the worst client nor part of the spread
    m = _metrics([3, 0, 1], [4, 0, 2])
    assert m["eval/amp"] == pytest.approx(4 / 6)
    # accuracies 0.75 and 0.5: mean 0.625, squared deviations 1/64 each, population variance 1/64
    assert m["eval/fm"] == pytest.approx(1 / 64)
    assert m["eval/wlp"] == 0.5  # not 0 from the empty client


def test_counts_as_floats_give_the_same_figures():
    # The evaluator counts correct predictions with a weighted bincount, i.e. as floats.
    assert _metrics([3.0, 1.0, 4.0], [4, 2, 8]) == pytest.approx(_metrics([3, 1, 4], [4, 2, 8]))


def test_one_client_has_no_spread():
    m = _metrics([2], [5])
    assert m == pytest.approx({"eval/amp": 0.4, "eval/fm": 0.0, "eval/wlp": 0.4})


def test_no_client_with_test_samples_has_no_fm_or_wlp():
    m = _metrics([0, 0], [0, 0])
    assert math.isnan(m["eval/fm"]) and math.isnan(m["eval/wlp"])


def test_rounds_to_target():
    rounds = [1, 2, 3, 4, 5]
    values = [None, 0.4, math.nan, 0.8, 0.9]  # round 1 not evaluated, round 3 undefined
    assert rounds_to_target(rounds, values, 0.5) == 4
    assert rounds_to_target(rounds, values, 0.4) == 2  # reaching the target counts
    assert rounds_to_target(rounds, values, 0.85) == 5
    assert rounds_to_target(rounds, values, 0.95) is None  # never reached
    assert rounds_to_target([2, 4], [np.float64("nan"), np.float64(0.6)], 0.5) == 4
    assert rounds_to_target([], [], 0.5) is None


def test_evaluator_reports_each_domains_accuracy_on_multi_domain_data():
    """eval/acc_<domain>: the global model on each client domain's share of the global test set; their
    size-weighted mean is eval/accuracy. A model that predicts class 0 is right exactly on the 0 labels."""
    import torch

    from fedray.data.federated import FederatedData
    from fedray.metrics import Evaluator

    class Zero(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.b = torch.nn.Parameter(torch.tensor([1.0, 0.0]))

        def forward(self, x):
            return self.b.expand(x.shape[0], 2)

    test_y = np.array([0, 0, 1, 1, 0, 1, 1, 1, 1, 1])  # domain "a": 4 images (2 zeros); "c": 6 (1 zero)
    data = FederatedData(
        dataset="toy", train_x=np.zeros((4, 1, 2, 2), np.uint8), train_y=np.array([0, 1, 0, 1]),
        test_x=np.zeros((10, 1, 2, 2), np.uint8), test_y=test_y, client_train=[np.array([0, 1]), np.array([2, 3])],
        client_test=[np.array([0]), np.array([2])], num_classes=2, mean=(0.5,), std=(0.5,),
        domains=("a", "b", "c"), test_domain=np.array([0] * 4 + [2] * 6))
    model = Zero()
    m = Evaluator(data, model, torch.device("cpu"), batch_size=3).evaluate(model.state_dict())
    assert m["eval/acc_a"] == 0.5 and m["eval/acc_c"] == 1 / 6 and "eval/acc_b" not in m  # b: the server's
    assert m["eval/accuracy"] == pytest.approx((4 * 0.5 + 6 / 6) / 10)
