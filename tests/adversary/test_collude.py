"""Colluding attacks at the server (fedray/adversary/collude.py) by hand, and Krum against them on a toy problem:
outlying updates (a scaled sign flip) are never chosen, A Little Is Enough's are, as its paper reports."""

from __future__ import annotations

import math

import pytest
import torch

from fedray.adversary.collude import Colluder, lie_z, min_max
from fedray.adversary.config import AdversaryConfig
from fedray.simulation import run_experiment
from tests.adversary.test_forge import Msg
from tests.channel.stages import Sent
from tests.conftest import tiny_config

REF = Sent(weights={"w": torch.tensor([1.0, 1.0])})
UPDATES = [[0.0, 2.0], [2.0, 4.0], [1.0, -1.0], [3.0, 1.0]]  # clients 0 and 1 malicious


def _step(**adv) -> list[torch.Tensor]:
    colluder = Colluder(AdversaryConfig(clients=[0, 1], **adv), frozenset({0, 1}))
    uploads = [Msg(weights={"w": REF.weights["w"] + torch.tensor(u)}, num_samples=5) for u in UPDATES]
    out = colluder(uploads, [0, 1, 2, 3], [REF] * 4)
    assert all(o.num_samples == 5 for o in out)
    return [o.weights["w"] - REF.weights["w"] for o in out]


def test_lies_z_is_the_papers_z_max():
    assert lie_z(10, 2) == pytest.approx(0.2533471, abs=1e-6)  # s = 6 - 2 = 4, Phi^-1(6 / 10)
    assert lie_z(50, 12) == pytest.approx(0.5828415, abs=1e-6)  # s = 26 - 12 = 14, Phi^-1(36 / 50)


@pytest.mark.parametrize("estimate, benign", [("own", [0, 1]), ("omniscient", [2, 3])])
def test_lie_sends_the_mean_minus_z_deviations_of_the_benign_updates(estimate, benign):
    got = _step(attack="lie", estimate=estimate, lie_z=1.5)
    b = torch.tensor([UPDATES[i] for i in benign])
    want = b.mean(0) - 1.5 * b.std(0)  # unbiased deviation, as torch.std
    assert torch.allclose(got[0], want) and torch.allclose(got[1], want)
    assert torch.equal(got[2], torch.tensor(UPDATES[2])) and torch.equal(got[3], torch.tensor(UPDATES[3]))


def test_a_colluding_attack_on_uploads_without_a_model_is_refused_not_run_as_a_no_op():
    from fedray.errors import RunFailure

    with pytest.raises(RunFailure, match="^adversary.attack=lie: this method's upload carries no model"):
        run_experiment(tiny_config(algorithm__name="feddistill", adversary__attack="lie", adversary__clients=[0],
                                   federation__clients_per_round=5, federation__rounds=1), progress=False)


def test_min_max_goes_as_far_as_the_benign_updates_spread():
    """Benign (0, 0) and (2, 0): mu = (1, 0), sigma = (sqrt 2, 0), p = -sigma; the farthest benign update is within
    the largest benign distance 2 while 1 + sqrt(2) gamma <= 2: gamma = 1 / sqrt 2, the update (0, 0)."""
    got = min_max(torch.tensor([[0.0, 0.0], [2.0, 0.0]], dtype=torch.float64), perturbation="std")
    assert torch.allclose(got, torch.zeros(2, dtype=torch.float64), atol=1e-4)
    up = min_max(torch.tensor([[0.0, 0.0], [2.0, 0.0]], dtype=torch.float64), perturbation="unit_vec")  # gamma 1
    assert torch.allclose(up, torch.zeros(2, dtype=torch.float64), atol=1e-4)
    forged = _step(attack="min_max", estimate="omniscient", perturbation="sign")
    b = torch.tensor([UPDATES[2], UPDATES[3]], dtype=torch.float64)
    assert (forged[0].double() - b).norm(dim=1).max() <= torch.cdist(b, b).max() + 1e-4


KRUM = dict(data__num_clients=7, federation__clients_per_round=7, aggregation__rule="krum", aggregation__f=2,
            adversary__clients=[0, 1], federation__rounds=2, federation__local_steps=3)


@pytest.mark.parametrize("attack, kw, kept", [
    ("sign_flip", {"adversary__scale": 10.0}, 0.0),  # outliers: never Krum's choice
    ("lie", {"adversary__estimate": "omniscient"}, 1.0),  # within the spread, two identical: chosen
])
def test_krum_keeps_lie_and_drops_a_scaled_sign_flip(attack, kw, kept):
    history = run_experiment(tiny_config(adversary__attack=attack, **kw, **KRUM), progress=False).history
    assert [(r["adv/malicious_uploads"], r["adv/malicious_kept"]) for r in history] == [(2.0, kept)] * 2
    assert all(not math.isnan(r["eval/accuracy"]) for r in history)


LOGITS = ("feddistill", "fedcd")  # they upload logits, not models
# no model trained from the payload in their uploads: FedD3A's models start from the clients' own, the isolated
# baseline sends nothing, q-FFL sends a step (values)
REFUSED = {"fedd3a", "fedd3a-heterogeneous", "local", "qffl"}


@pytest.mark.parametrize("case", sorted(__import__("tests.conftest", fromlist=["METHOD_CASES"]).METHOD_CASES))
def test_every_method_runs_two_rounds_under_an_attack_and_a_defence_or_refuses_in_one_line(case):
    """Forged logits for the methods that upload logits, a scaled sign flip for the others; the coordinate median
    where the method's case takes it (FedKF, FedDF included), else the mean."""
    from fedray.errors import ConfigError, RunFailure
    from fedray.methods import get_algorithm
    from tests.conftest import method_config

    name = case.split("-")[0]
    attack = {"adversary__attack": "forge_logits"} if name in LOGITS else {"adversary__attack": "sign_flip",
                                                                           "adversary__scale": 3.0}
    method = get_algorithm(name)
    params = method.parse_params(method_config(case).algorithm.params())
    rule = "median" if "median" in method.robust_rules(params)[0] else "mean"
    try:
        history = run_experiment(method_config(case, federation__rounds=2, federation__local_steps=1,
                                               adversary__clients=[0], aggregation__rule=rule, **attack),
                                 progress=False).history
    except (ConfigError, RunFailure) as e:
        assert case in REFUSED and "\n" not in str(e) and str(e).startswith("adversary.attack="), str(e)
        return
    assert case not in REFUSED and [r["adv/malicious_uploads"] <= 1 for r in history] == [True, True]


def test_feddistills_label_rows_take_the_median_over_the_clients_holding_each_label():
    """Three clients hold label 0, two label 1 (the third's row 1 is zeros and not its to send): under the median
    row 0 is the middle of three, forged logits (client 2's 100s) included; row 1 the mean of the two holders; the
    mean rule gives the holders' mean; Krum is refused in one line."""
    from fedray.errors import ConfigError
    from fedray.learning.robust import build_rule
    from fedray.methods import ServerContext, validate_experiment
    from fedray.methods.feddistill import FedDistill, LabelLogits, LabelLogitsUpload

    algo = FedDistill(validate_experiment(tiny_config(algorithm__name="feddistill", data__synthetic_num_classes=2)),
                      None)
    logits = [torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([[3.0, 0.0], [0.0, 4.0]]),
              torch.tensor([[100.0, 100.0], [0.0, 0.0]])]
    counts = [torch.tensor([5, 1]), torch.tensor([2, 3]), torch.tensor([4, 0])]
    uploads = [LabelLogitsUpload(logits=z, counts=n) for z, n in zip(logits, counts)]

    def table(rule: str) -> list:
        ctx = ServerContext(round=1, seed=0, device=torch.device("cpu"), modules=None, aggregation=build_rule(rule))
        return algo.server_update(LabelLogits(), uploads, ctx)[0].logits.tolist()

    assert table("median") == [[3.0, 0.0], [0.0, 3.0]]  # row 0: medians of (1, 3, 100), (0, 0, 100)
    assert torch.allclose(torch.tensor(table("mean")), torch.tensor([[104 / 3, 100 / 3], [0.0, 3.0]]))
    with pytest.raises(ConfigError, match="aggregation.rule: 'feddistill' takes the rules mean, median, "
                                          "trimmed_mean here: it aggregates per-label logit rows"):
        validate_experiment(tiny_config(algorithm__name="feddistill", aggregation__rule="krum",
                                        federation__clients_per_round=5))
