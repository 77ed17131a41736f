"""The robust aggregation rules (fedray.learning.robust) by hand on tiny tensors, their config keys, and the hook in a
run: each rule's numbers worked out on paper, the mean's bits unchanged, bad keys refused in one line."""

from __future__ import annotations

import math

import pytest
import torch

from fedray.channel.channel import build_channel
from fedray.errors import ConfigError
from fedray.learning.aggregation import WeightedMean
from fedray.learning.robust import (Median, MultiKrum, NormBound, TrimmedMean, build_rule, fltrust, fltrust_scores,
                                    krum_scores, median, multi_krum, norm_bound, trimmed_mean)
from fedray.learning.weights import weighted_average
from fedray.methods import resolve_experiment
from fedray.simulation import run_experiment
from tests.conftest import tiny_config

D = torch.float64


def rows(*vs) -> torch.Tensor:
    return torch.tensor(vs, dtype=D)


# --- the arithmetic ------------------------------------------------------------------------------------------------
def test_median_odd_and_even():
    x = rows([1, 10], [3, -2], [2, 5])
    assert median(x).tolist() == [2, 5]
    x = rows([1, 10], [3, -2], [2, 5], [100, 6])  # even n: the mean of the two middle values
    assert median(x).tolist() == [2.5, 5.5]


def test_trimmed_mean_drops_beta_n_at_each_end_per_coordinate():
    x = rows([1, 0], [2, 100], [3, 4], [4, 5], [-50, 6])
    assert trimmed_mean(x, 0.2).tolist() == [2.0, 5.0]  # floor(0.2*5) = 1: coord 0 keeps 1,2,3; coord 1 keeps 4,5,6
    assert trimmed_mean(x, 0.1).tolist() == x.mean(0).tolist()  # floor(0.5) = 0: the plain mean
    assert trimmed_mean(x, 0.4).tolist() == median(x).tolist()  # floor(2) = 2 each end: the median
    with pytest.raises(ValueError, match="aggregation.beta"):
        trimmed_mean(x, 0.5)


FIVE = rows([0, 0], [1, 0], [0, 1], [1, 1], [10, 10])  # four corners of the unit square and one outlier


def test_krum_scores_and_choice_on_five_vectors_with_an_outlier():
    # f = 1, n = 5: each score sums the n - f - 2 = 2 smallest squared distances to the others.
    # (0,0): to (1,0) 1, (0,1) 1, (1,1) 2, (10,10) 200 -> 1 + 1 = 2; likewise (1,0), (0,1): 2; (1,1): 1 + 1 = 2
    # (10,10): to (1,1) 162, (1,0) 181, (0,1) 181, (0,0) 200 -> 162 + 181 = 343
    assert krum_scores(FIVE, 1).tolist() == [2, 2, 2, 2, 343]
    # a tie among the four corners: the lowest index, (0,0)
    assert multi_krum(FIVE, 1, 1).tolist() == [0, 0]
    # f = 2: 1 neighbour; (1,1)'s nearest is 1 away like the others', the outlier's 162
    assert krum_scores(FIVE, 2).tolist() == [1, 1, 1, 1, 162]
    with pytest.raises(ValueError, match="aggregation.f"):
        krum_scores(FIVE, 3)


def test_multi_krum_averages_the_m_best():
    assert multi_krum(FIVE, 1, 4).tolist() == [0.5, 0.5]  # the four corners, the outlier left out
    assert multi_krum(FIVE, 1, 5).tolist() == FIVE.mean(0).tolist()
    moved = FIVE.clone()
    moved[1] = torch.tensor([0.1, 0.0], dtype=D)  # now (0,0) and (0.1,0) are closest to everything
    # scores (f=1): (0,0): 0.01 + 1 ; (0.1,0): 0.01 + 0.81 ; (0,1): 1 + 1.01 ; (1,1): 1 + 1.81 -> best two: 1, 0
    assert multi_krum(moved, 1, 2).tolist() == pytest.approx([0.05, 0.0])


def test_norm_bound_clips_then_weighted_mean():
    u = rows([3, 4], [0.3, 0.4], [0, -10])  # norms 5, 0.5, 10
    # M = 1: (0.6, 0.8), (0.3, 0.4) unchanged, (0, -1); weights 1, 2, 1 -> ((0.6+0.6+0), (0.8+0.8-1)) / 4
    assert norm_bound(u, [1, 2, 1], 1.0).tolist() == pytest.approx([0.3, 0.15])


def test_fltrust_scores_and_result_with_the_root_update_given():
    g0 = torch.tensor([1.0, 0.0], dtype=D)  # ||g0|| = 1
    g = rows([2, 0], [1, 1], [-3, 0], [0, 5])
    # cos: 1, 1/sqrt2, -1 -> ReLU 0, 0 (orthogonal)
    assert fltrust_scores(g, g0).tolist() == pytest.approx([1, 1 / math.sqrt(2), 0, 0])
    # rescaled to norm 1: (1,0), (1,1)/sqrt2; sum TS g' = (1,0) + (1/sqrt2)(1/sqrt2, 1/sqrt2) = (1.5, 0.5); / (1 + 1/sqrt2)
    s = 1 + 1 / math.sqrt(2)
    assert fltrust(g, g0).tolist() == pytest.approx([1.5 / s, 0.5 / s])
    assert fltrust(rows([-1, 0]), g0).tolist() == [0, 0]  # no trust at all: the zero update


# --- the hook's rules over weights dicts ---------------------------------------------------------------------------
def models(*values):
    """Weights dicts: a float 'w' (2,), a float 'b' (1,) and an integer buffer."""
    return [{"w": torch.tensor(v[:2], dtype=torch.float32), "b": torch.tensor(v[2:], dtype=torch.float32),
             "n": torch.tensor(7 + i)} for i, v in enumerate(values)]


def test_rules_on_models_keep_layout_dtypes_and_first_integer_buffer():
    ms = models([1, 10, 0], [3, -2, 1], [2, 5, 9])
    out = Median().mean(ms, [5, 1, 1])  # weights ignored
    assert out["w"].tolist() == [2, 5] and out["b"].tolist() == [1] and out["w"].dtype == torch.float32
    assert out["n"].item() == 7
    assert TrimmedMean(0.34).mean(ms, [1, 1, 1])["w"].tolist() == [2, 5]


def test_full_models_equal_the_rule_on_updates_from_one_reference():
    torch.manual_seed(0)
    ref = torch.randn(6, dtype=D)
    xs = ref + torch.randn(7, 6, dtype=D)
    for rule in (lambda x: median(x), lambda x: trimmed_mean(x, 0.2), lambda x: multi_krum(x, 2, 3)):
        assert torch.allclose(rule(xs), ref + rule(xs - ref))


def test_norm_bound_needs_the_reference_and_clips_updates_from_it():
    ref = {"w": torch.tensor([1.0, 1.0]), "n": torch.tensor(0)}
    ms = [{"w": torch.tensor([4.0, 5.0]), "n": torch.tensor(3)}, {"w": torch.tensor([1.3, 1.4]), "n": torch.tensor(4)}]
    with pytest.raises(ValueError, match="reference="):
        NormBound(1.0).mean(ms, [1, 1])
    out = NormBound(1.0).mean(ms, [1, 1], reference=ref)  # updates (3,4) -> (0.6,0.8), (0.3,0.4): mean (0.45, 0.6)
    assert out["w"].tolist() == pytest.approx([1.45, 1.6]) and out["n"].item() == 3


def test_krum_picks_one_model():
    ms = models([0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0], [10, 10, 10])
    assert MultiKrum(1).mean(ms, [1] * 5)["w"].tolist() == [0, 0]


def test_mean_is_todays_weighted_mean_bit_for_bit():
    torch.manual_seed(1)
    ms = [{"w": torch.randn(5, 3), "n": torch.tensor(i)} for i in range(4)]
    coefs = [3.0, 1.0, 7.0, 2.0]
    rule = build_rule("mean")
    assert isinstance(rule, WeightedMean)
    expected = weighted_average(ms, coefs)
    for got in (rule.mean(ms, coefs), rule.mean(ms, coefs, reference=ms[0])):
        assert torch.equal(got["w"], expected["w"]) and torch.equal(got["n"], expected["n"])


# --- the config ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,key", [
    ({"aggregation__rule": "krum", "aggregation__f": 1}, "aggregation.f"),  # tiny: 3 clients a round, 2f+2 = 4
    ({"aggregation__rule": "trimmed_mean", "aggregation__beta": 0.5}, "aggregation.beta"),
    ({"aggregation__rule": "trimmed_mean", "aggregation__beta": 0.7}, "aggregation.beta"),
    ({"aggregation__rule": "nope"}, "aggregation.rule"),
    ({"aggregation__rule": "fltrust"}, "data.server_data.kind"),  # its root data: tests/learning/test_fltrust.py
    ({"aggregation__rule": "norm_bound"}, "aggregation.max_norm"),
    ({"aggregation__beta": 0.2}, "aggregation.beta"),  # read by trimmed_mean only
    ({"aggregation__rule": "multi_krum", "aggregation__f": 0, "aggregation__m": 9}, "aggregation.m"),
])
def test_bad_values_are_refused_in_one_line(overrides, key):
    with pytest.raises(ConfigError) as e:
        tiny_config(**overrides)
    assert e.value.key == key and "\n" not in str(e.value)


def test_a_method_with_other_means_refuses_a_robust_rule():
    with pytest.raises(ConfigError) as e:
        resolve_experiment(tiny_config(algorithm__name="scaffold", aggregation__rule="median"))
    assert e.value.key == "aggregation.rule" and "fedavg" in str(e.value) and "\n" not in str(e.value)


def test_the_cache_refuses_a_rule_of_updates_and_gives_each_slot_one_vote_under_a_rule_of_values():
    """The OCA model under the median: every registered client's slot one vote, a never-filled one holding w0 (the
    weighted mean gives w0 its slots' share instead); Krum's choice of the step's uploads survives the call over the
    slots. A rule of updates has no one reference over slots of older rounds: refused, naming report_model."""
    from fedray.learning.cached import init_cache, update_cache
    from fedray.learning.robust import MultiKrum

    with pytest.raises(ConfigError) as e:
        resolve_experiment(tiny_config(aggregation__rule="norm_bound", aggregation__max_norm=1.0,
                                       algorithm__report_model="oca"))
    assert e.value.key == "algorithm.report_model" and "\n" not in str(e.value)
    resolve_experiment(tiny_config(aggregation__rule="median", algorithm__report_model="oca"))  # taken

    def w(v: float) -> dict:
        return {"w": torch.tensor([v])}

    cache = init_cache(w(0.0), num_clients=4)
    one = update_cache(cache, [0], [w(9.0)], [10], build_rule("median"))
    assert one.oca["w"].item() == 0.0  # (9, 0, 0, 0): w0 holds three of four votes
    three = update_cache(cache, [0, 1, 2], [w(1.0), w(2.0), w(10.0)], [10, 10, 10], build_rule("median"))
    assert three.oca["w"].item() == 1.5  # (0, 1, 2, 10): the middle two's mean
    mean = update_cache(cache, [0, 1, 2], [w(1.0), w(2.0), w(10.0)], [10, 10, 10], build_rule("mean"))
    assert mean.oca["w"].item() == pytest.approx(13 / 4)
    krum = MultiKrum(f=0, m=1)
    krum.kept = [2]  # the step's choice among its uploads
    update_cache(cache, [0, 1, 2], [w(1.0), w(2.0), w(10.0)], [10, 10, 10], krum)
    assert krum.kept == [2]


def test_a_two_round_run_with_the_median():
    cfg = tiny_config(aggregation__rule="median", federation__rounds=2, tracking__enabled=False)
    assert isinstance(build_channel(cfg).aggregation, Median)
    history = run_experiment(cfg, progress=False).history
    assert len(history) == 2 and all(math.isfinite(r["eval/accuracy"]) for r in history)
    # the rule is what the server ran: three clients' median is not their weighted mean
    mean = run_experiment(tiny_config(federation__rounds=2, tracking__enabled=False), progress=False).history
    assert history[-1]["train/loss"] != mean[-1]["train/loss"]  # round 2 trains from round 1's aggregate


def test_fedavg_passes_the_broadcast_model_as_reference():
    """norm_bound with a bound no update reaches is the mean up to float rounding, and a tiny bound keeps the model
    where it was: FedAvg's server step hands the rule the model its clients started from."""
    def run(**kw):
        cfg = tiny_config(federation__rounds=2, tracking__enabled=False, **kw)
        return run_experiment(cfg, progress=False).history[-1]["train/loss"]

    mean = run()
    assert run(aggregation__rule="norm_bound", aggregation__max_norm=1e6) == pytest.approx(mean, rel=1e-5)
    frozen = run(aggregation__rule="norm_bound", aggregation__max_norm=1e-12)
    assert frozen != pytest.approx(mean, rel=1e-5)


def test_krum_over_fewer_uploads_than_it_needs_stops_the_run_in_one_line():
    """A step short of uploads (dropouts under a simulated system) cannot run Krum with f = 1: a RunFailure naming
    the keys, not a traceback; with enough uploads it runs."""
    from fedray.errors import RunFailure

    rule = MultiKrum(1, 1)
    few = [torch.tensor([float(i), 0.0]) for i in range(3)]
    with pytest.raises(RunFailure, match="aggregation.f=1") as e:
        rule.mean(few, [1.0] * 3)
    assert not e.value.resumable and "\n" not in str(e.value)
    assert rule.mean(few + [torch.tensor([1.0, 0.0])], [1.0] * 4).tolist() == [1.0, 0.0]
