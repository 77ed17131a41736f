"""Oort's selection by hand (Lai et al., OSDI 2021): each explored client's utility, the trade-off between a higher
loss and a duration past the preferred T, the exploration share, the cut-off, the pacer, the blacklist; the
statistical utility a client reports; and only what the server knows is read."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedray.errors import ConfigError
from fedray.learning.feedback import statistical_utility
from fedray.learning.training import LocalTraining
from fedray.system.oort import Oort, OortConfig
from tests.conftest import cores, tiny_config


def _oort(n, **cfg):
    return Oort(OortConfig(**cfg), n, seed=0)


def test_utility_by_hand_a_higher_loss_slower_than_t_loses_to_a_lower_loss_within_it():
    """Round 1: clients 0, 1, 2 report U = 10, 30, 20 after 5, 20 and 10 s; client 3's upload never came (the
    server waited 20 s for it). T = the 40th percentile of the known durations [5, 10, 20, 20] = 10 s. At round 2:
    Util = (min(U, clip) - 0.999 min U) / range + sqrt(0.1 ln 2 / 1), and client 1, slower than T, times
    (T / t)^2 = (10 / 20)^2: the highest loss ranks below client 2 (20 within T), above client 0 (the lowest loss)."""
    oort = _oort(4, alpha=2.0, round_percentile=40)
    oort.register(np.array([7, 8, 9, 50]))
    oort.feedback(1, np.arange(4), np.array([0, 1, 2]), np.array([10.0, 30.0, 20.0]), np.array([5.0, 20.0, 10.0]),
                  waited=20.0)
    assert oort.duration.tolist() == [5, 20, 10, 20] and oort.last.tolist() == [1, 1, 1, 0]
    oort.select(2, np.arange(4), 2)
    assert oort.preferred_s == 10.0
    low, span, temporal = 10 * 0.999, 30 - 10 * 0.999, math.sqrt(0.1 * math.log(2) / 1)
    hand = [(10 - low) / span + temporal, ((30 - low) / span + temporal) * (10 / 20) ** 2, (20 - low) / span + temporal]
    got = oort.scores(2, np.array([0, 1, 2]))
    assert got == pytest.approx(hand, rel=1e-12)
    assert got[2] > got[1] > got[0]
    assert got[1] == pytest.approx(1.2633 * 0.25, abs=1e-4)  # the penalty is (T / t)^alpha, not its inverse
    # alpha = 0: no system utility; the highest loss ranks first
    flat = _oort(4, alpha=0.0, round_percentile=40)
    flat.feedback(1, np.arange(4), np.array([0, 1, 2]), np.array([10.0, 30.0, 20.0]), np.array([5.0, 20.0, 10.0]), 20.0)
    flat.select(2, np.arange(4), 2)
    assert np.argmax(flat.scores(2, np.array([0, 1, 2]))) == 1
    # the unexplored client 3 is ranked by its declared size, penalised by the 20 s the server waited for it
    assert oort.penalty(np.array([3]))[0] == pytest.approx((10 / 20) ** 2)


def test_the_exploration_share_holds_and_exploitation_takes_the_rest():
    """eps = 0.27 held fixed: of K = 20, int(20 x 0.27) = 5 (not 5.4 rounded up) are clients not heard from and 15
    explored ones; with only 3 unexplored online, 3 and 17."""
    oort = _oort(100, exploration=0.27, exploration_decay=1.0, exploration_min=0.27)
    oort.register(np.full(100, 10))
    heard = np.arange(0, 100, 5)  # 20 explored clients
    oort.feedback(1, heard, heard, np.linspace(1, 20, 20), np.full(20, 3.0), waited=3.0)
    for r in range(2, 6):
        chosen = oort.select(r, np.arange(100), 20)
        assert chosen.size == 20 and np.unique(chosen).size == 20
        assert np.isin(chosen, heard).sum() == 15 and oort.sim()["sim/oort_explored"] == 5
    few = np.concatenate([heard, [1, 2, 3]])
    chosen = oort.select(6, np.sort(few), 20)
    assert np.isin(chosen, heard).sum() == 17 and np.isin([1, 2, 3], chosen).all()
    assert not np.isin(chosen, np.setdiff1d(np.arange(100), few)).any()  # only the online are selected


def test_the_cut_off_admits_only_clients_near_the_kth_utility():
    """With c = 0.95 and no pool, 3 of 10 explored clients whose utilities fall off sharply after the 3rd are the 3
    exploited every time; FedScale's pool of 10 x 3 lets the others in."""
    utilities = np.array([100.0, 99.0, 98.0, 10, 9, 8, 7, 6, 5, 4])

    def exploited(rounds, **cfg):
        oort = _oort(10, exploration=0.0, exploration_min=0.0, clip=1.0, **cfg)
        oort.feedback(1, np.arange(10), np.arange(10), utilities, np.ones(10), 1.0)
        return {c for r in range(2, rounds) for c in oort.select(r, np.arange(10), 3).tolist()}
    assert exploited(8) == {0, 1, 2}
    assert exploited(30, pool_factor=10) - {0, 1, 2}
    # FedScale's cut-off c = 0.05: every explored client is within 5 % of the 3rd's utility, all may be drawn
    assert exploited(30, cutoff=0.05) - {0, 1, 2}


def test_exploration_samples_among_the_window_of_largest_declared_sizes():
    """All of K = 2 explore 100 unexplored clients of sizes 0..99: sample_window 1 admits exactly the 2 largest
    (98, 99), every round; the default 5 admits the 10 largest, and draws others than those two."""
    def picks(**cfg):
        oort = _oort(100, exploration=1.0, exploration_decay=1.0, exploration_min=1.0, **cfg)
        oort.register(np.arange(100))
        return [oort.select(r, np.arange(100), 2).tolist() for r in range(1, 21)]
    assert all(p == [98, 99] for p in picks(sample_window=1.0))
    wide = {c for p in picks() for c in p}
    assert wide <= set(range(90, 100)) and wide - {98, 99}


@pytest.mark.parametrize("pacer, history, percentile", [
    ("paper", [4, 4, 3, 3], 37.5),  # the last window's utility fell: T relaxes by delta (7.5)
    ("paper", [3, 3, 4, 4], 30.0),  # it rose: T stays
    ("fedscale", [4, 4, 4, 4.2], 37.5),  # changed by 10 % or less: relaxes
    ("fedscale", [1, 1, 7, 7], 22.5),  # changed by 5 times or more: tightens
    ("fedscale", [4, 4, 3, 3], 30.0),
])
def test_the_pacer_moves_t_every_window(pacer, history, percentile):
    oort = _oort(4, pacer=pacer, pacer_step=2, pacer_delta=7.5)
    oort.exploit_utility = list(history[:-1])
    oort.last_pick = {"exploit": np.array([0]), "explore": np.zeros(0, np.int64)}
    oort.reported, oort.utility[0] = np.array([0]), history[-1]
    oort._pace(4)  # round 4: a multiple of the window, two windows of history
    assert len(oort.exploit_utility) == 4 and oort.exploit_utility[-1] == pytest.approx(history[-1], rel=1e-4)
    assert oort.percentile == percentile


def test_the_blacklist_retires_the_most_picked_up_to_its_cap():
    oort = _oort(4, blacklist_rounds=1, blacklist_max=0.5, exploration=0.0, exploration_min=0.0)
    for r in (1, 2):
        oort.feedback(r, np.arange(3), np.arange(3), np.ones(3), np.ones(3), 1.0)
    assert oort.blacklist().tolist() == [0, 1]  # three over the count; two at most (0.5 x 4), lower ids first
    assert set(oort.select(3, np.arange(4), 2).tolist()) == {2, 3}


def test_selection_is_seeded_and_its_state_resumes_exactly():
    def fresh():
        o = _oort(50)
        o.register(np.arange(50) + 1)
        return o

    a, b = fresh(), fresh()
    for r in range(1, 8):
        pa = a.select(r, np.arange(50), 10)
        if r == 4:  # b continues from a checkpoint of a's state
            b = fresh()
            b.load(a_state)
        pb = b.select(r, np.arange(50), 10)
        assert pa.tolist() == pb.tolist()
        for o, p in ((a, pa), (b, pb)):
            o.feedback(r, p, p[:7], np.sin(p[:7]) + 2, p[:7] / 10, waited=5.0)
        a_state = a.state()


def test_the_reported_utility_is_the_starting_models_losses_by_hand():
    """U = |B| sqrt(mean over B of CE^2) of the model the client starts from (its start weights, not the module's)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    start = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    x = torch.randint(0, 256, (7, 1, 2, 2), dtype=torch.uint8)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    plan = LocalTraining(model=model, start=start, loss=None, finish=None)
    got = statistical_utility(plan, x, y, (0.5,), (0.25,), batch_size=3)
    model.load_state_dict(start)
    with torch.no_grad():
        ce = F.cross_entropy(model((x.float() / 255 - 0.5) / 0.25), y, reduction="none")
    assert got == pytest.approx(7 * math.sqrt(float((ce ** 2).mean())), rel=1e-6)


def _oort_cores(**overrides):
    """A run's data and its server and worker cores under system.selection=oort, in this process."""
    return cores(tiny_config(data__num_clients=4, system__devices="uniform", system__selection="oort", **overrides))


def test_a_worker_under_oort_sends_the_utility_of_the_model_it_was_sent_with_its_upload():
    """The worker measures U on its own data with the payload's weights (before training) and reports it in the
    upload's info, which the clock hands to Oort."""
    from fedray.system.oort import UTILITY

    data, server, worker = _oort_cores()
    payload, _ = server.payload(0)
    info = worker.train(1, 1, payload, None)[2]
    model = server.algo.build_modules().model
    model.load_state_dict(payload.weights)
    x, y = (torch.from_numpy(a) for a in data.client_data(1))
    (mean,), (std,) = server.algo.spec.mean, server.algo.spec.std
    with torch.no_grad():
        ce = F.cross_entropy(model((x.float() / 255 - mean) / std), y.long(), reduction="none")
    assert info[UTILITY] == pytest.approx(len(y) * math.sqrt(float((ce ** 2).mean())), rel=1e-6)


def test_a_client_update_that_trains_by_itself_leaves_no_model_to_measure_and_is_refused_in_one_line():
    from fedray.errors import RunFailure
    from tests.runtime import faulty  # test_nan_client returns its result trained (run_update): no starting model

    _, server, worker = _oort_cores(algorithm__name=faulty.NaNClient.name)
    with pytest.raises(RunFailure) as e:
        worker.train(1, 1, server.payload(0)[0], None)
    assert str(e.value) == ("system.selection=oort: test_nan_client's client update gave no model to measure the "
                            "client's losses on; use system.selection=uniform")


def test_a_run_selects_by_oort_and_its_keys_are_checked():
    """In a run the worker reports U with each upload and the clock feeds it to Oort; its figures reach history.
    Oort's keys are refused without it, and Oort without a clock or under FedBuff."""
    from fedray.simulation import run_experiment

    cfg = tiny_config(federation__rounds=3, data__num_clients=8, federation__clients_per_round=2,
                      system__devices="heterogeneous", system__selection="oort", system__overcommit=1.5)
    run = run_experiment(cfg, progress=False)
    first = run.history[0]
    assert first["sim/oort_explored"] == 3 and "sim/oort_preferred_s" not in first  # nothing known yet: no T
    assert run.history[1]["sim/oort_preferred_s"] > 0 and run.history[1]["sim/oort_explored"] < 3
    for overrides, key in [({"system__oort__alpha": 1.0}, "system.oort.alpha"),
                           ({"system__selection": "oort"}, "system.selection"),
                           ({"system__selection": "oort", "system__devices": "uniform", "federation__mode": "async"},
                            "system.selection")]:
        with pytest.raises(ConfigError) as e:
            from fedray.methods import resolve_experiment

            resolve_experiment(tiny_config(**overrides))
        assert e.value.key == key, e.value


# --- every boundary and constant of the selector, by hand ------------------------------------------------------------


def _timed(n, durations, utilities=None, **cfg):
    """An Oort of ``n`` clients of which 0..len(durations)-1 reported in round 1 after ``durations``."""
    oort = _oort(n, **cfg)
    heard = np.arange(len(durations))
    oort.feedback(1, heard, heard, np.ones(heard.size) if utilities is None else np.asarray(utilities, float),
                  np.asarray(durations, float), waited=max(durations))
    return oort


@pytest.mark.parametrize("percentile, preferred", [(40, 3.0), (99, 5.0), (100, math.inf)])
def test_t_is_the_percentiles_entry_of_the_sorted_durations_and_unbounded_at_100(percentile, preferred):
    """Durations 5, 1, 4, 2, 3 sorted: T is entry min(int(5 p / 100), 4): p = 40 -> entry 2 (3 s), p = 99 -> entry 4
    (5 s, the last, not one before it); p = 100: no T at all (no penalty, no figure)."""
    oort = _timed(6, [5, 1, 4, 2, 3], round_percentile=percentile)
    oort.select(2, np.arange(6), 2)
    assert oort.preferred_s == preferred
    assert oort.sim().get("sim/oort_preferred_s", math.inf) == preferred


def test_eps_decays_by_its_factor_each_round_down_to_its_floor():
    oort = _oort(10, exploration=0.5, exploration_decay=0.5, exploration_min=0.1)
    seen = []
    for r in (1, 2, 3):
        oort.select(r, np.arange(10), 2)
        seen.append(oort.sim()["sim/oort_exploration"])
    assert seen == [0.25, 0.125, 0.1]


def test_the_penalty_at_t_itself_is_none_and_below_a_second_it_is_still_t_over_t():
    """T = 0.2 s (the 40th percentile of 0.1, 0.2, 0.5): the client of 0.2 s is not slower than T; the one of 0.5 s
    is penalised by (0.2 / 0.5)^2 even though both are under a second (the floor on t is 1e-4 s, not 1 s)."""
    oort = _timed(3, [0.1, 0.2, 0.5], round_percentile=40, alpha=2.0)
    oort.select(2, np.arange(3), 1)
    assert oort.preferred_s == 0.2
    assert oort.penalty(np.arange(3)) == pytest.approx([1.0, 1.0, (0.2 / 0.5) ** 2], rel=1e-12)


def test_scores_clip_at_the_quantile_ignore_zero_utilities_and_divide_the_temporal_term_by_the_last_round():
    """Utilities 0, 0.5, 2, 4, 8 (client 0's zero is no positive utility): clip = 0.5 -> positive entry
    int(4 x 0.5) = 2 (4.0); low = 0.999 x 0.5; clients last heard in round 2, scored at round 5: the temporal term
    is sqrt(0.1 ln 5 / 2)."""
    oort = _oort(5, clip=0.5, round_percentile=100)
    oort.feedback(2, np.arange(5), np.arange(5), np.array([0.0, 0.5, 2.0, 4.0, 8.0]), np.ones(5), 1.0)
    low, clip = 0.999 * 0.5, 4.0
    temporal = math.sqrt(0.1 * math.log(5) / 2)
    hand = [abs((min(u, clip) - low) / (clip * 0 + 8.0 - low) + temporal) for u in (0.0, 0.5, 2.0, 4.0, 8.0)]
    assert oort.scores(5, np.arange(5)) == pytest.approx(hand, rel=1e-12)


def test_equal_utilities_span_a_thousandth_of_their_value_and_all_zero_utilities_score_only_the_temporal_term():
    oort = _oort(3, round_percentile=100)
    oort.feedback(1, np.arange(3), np.arange(3), np.ones(3), np.ones(3), 1.0)
    temporal = math.sqrt(0.1 * math.log(2))
    # (1 - 0.999) / max(1 - 0.999, 1e-4) = 1: the range is the thousandth, not the floor
    assert oort.scores(2, np.arange(3)) == pytest.approx([1 + temporal] * 3, rel=1e-9)
    zero = _oort(3, round_percentile=100)
    zero.feedback(1, np.arange(3), np.arange(3), np.zeros(3), np.ones(3), 1.0)
    assert zero.scores(2, np.arange(3)) == pytest.approx([temporal] * 3, rel=1e-12)


@pytest.mark.parametrize("scores, n, cfg, admitted", [
    ([10, 9.5, 9.5, 9.4, 1], 2, {}, 4),  # cut 0.95 x 9.5 = 9.025: 10, 9.5, 9.5 and 9.4 are in, 1 is not
    ([10, 9.5, 9.025, 9.0, 1], 2, {}, 3),  # a score exactly at the cut is admitted
    ([10, 9.5, 9.0, 1, 1], 3, {"cutoff": 1.0}, 3),  # at least n, whatever the cut
    ([10, 5, 1, 1, 1, 1, 1], 2, {"pool_factor": 1.5}, 3),  # FedScale's pool: ceil(1.5 x 2) = 3
    ([10, 5, 1], 2, {"pool_factor": 10}, 3),  # the pool is capped at the candidates
], ids=["cut", "at-the-cut", "at-least-n", "pool", "pool-capped"])
def test_exploitation_admits_scores_at_or_above_the_cut_off_times_the_nth(scores, n, cfg, admitted):
    assert _oort(1, **cfg).admitted(np.array(scores, float), n) == admitted


def test_pure_exploitation_selects_exactly_k_and_exploration_weighs_by_size_times_penalty():
    """exploration 0: K = 2 clients, none of them an explorer (client 0 is not added); among two unexplored clients
    of equal declared size, the one the server already waited long for (penalised) loses a window of 1."""
    oort = _oort(6, exploration=0.0, exploration_min=0.0, cutoff=1.0)
    oort.feedback(1, np.arange(1, 6), np.arange(1, 6), np.arange(1.0, 6.0), np.ones(5), 1.0)
    chosen = oort.select(2, np.arange(1, 6), 2)
    assert chosen.tolist() == [4, 5] and oort.sim()["sim/oort_explored"] == 0
    fresh = _oort(4, exploration=1.0, exploration_decay=1.0, exploration_min=1.0, sample_window=1.0,
                  round_percentile=50)
    fresh.register(np.array([5, 5, 5, 5]))
    fresh.feedback(1, np.array([0, 1, 2]), np.array([0, 1]), np.ones(2), np.array([1.0, 2.0]), waited=10.0)
    fresh.last[:] = 0  # clients 0 and 1 as if their reports were lost: all four unexplored, 2 known slow
    for r in range(2, 6):
        assert fresh.select(r, np.array([2, 3]), 1).tolist() == [3]


def test_a_round_that_takes_every_online_client_counts_those_heard_from_in_any_round_as_exploited():
    oort = _oort(4)
    oort.feedback(1, np.array([0]), np.array([0]), np.ones(1), np.ones(1), 1.0)
    oort.take_all(np.array([0, 1, 2]))
    assert oort.last_pick["exploit"].tolist() == [0] and oort.last_pick["explore"].tolist() == [1, 2]


def test_a_zero_weight_is_drawn_only_when_the_others_are_taken():
    for seed in range(20):
        rng = np.random.default_rng(seed)
        assert Oort._draw(np.array([7, 8]), np.array([0.0, 5.0]), 1, rng).tolist() == [8]
    assert sorted(Oort._draw(np.array([7, 8]), np.array([0.0, 5.0]), 2, np.random.default_rng(0)).tolist()) == [7, 8]


def test_the_blacklist_holds_counts_above_its_bound_the_most_picked_first():
    oort = _oort(8, blacklist_rounds=2, blacklist_max=0.25)
    oort.picked[:] = [2, 5, 3, 4, 0, 0, 0, 0]
    assert oort.blacklist().tolist() == [1, 3]  # of 5, 4, 3 the 2 (0.25 x 8) most picked
    oort.cfg.blacklist_max = 1.0
    assert oort.blacklist().tolist() == [1, 2, 3]  # client 0, picked exactly 2 times, is not above 2
    oort.feedback(1, np.array([4, 5]), np.array([4]), np.ones(1), np.ones(1), 1.0)
    assert oort.picked[4:6].tolist() == [1, 0]  # one count a round it arrived in


def test_feedback_gives_a_silent_client_at_least_the_time_waited():
    """Client 0 was measured at 3 s and client 1 at 30 s; in round 2 neither arrives within the 10 s waited: 0's
    duration becomes 10 (at least that), 1's stays 30, and never-timed client 2's becomes 10."""
    oort = _timed(4, [3.0, 30.0])
    oort.feedback(2, np.array([0, 1, 2]), np.array([], dtype=np.int64), np.ones(0), np.ones(0), waited=10.0)
    assert oort.duration[:3].tolist() == [10.0, 30.0, 10.0] and oort.timed[:3].all() and not oort.timed[3]


def test_the_pacer_records_from_round_2_and_moves_only_on_its_window():
    """No record in round 1 (nothing exploited yet); from round 2 one a round. W = 2: the pacer looks at rounds 6
    and 8 (multiples of W with two windows of history), never at 2, 4, 7 or 9, and compares the last W entries with
    the W just before them, not with older ones."""
    def schedule(pacer):
        oort = _oort(4, pacer=pacer, pacer_step=2, pacer_delta=10.0, round_percentile=30)
        oort._pace(1)
        assert oort.exploit_utility == []
        oort.last_pick = {"exploit": np.array([0]), "explore": np.zeros(0, np.int64)}
        oort.reported = np.array([0])
        percentiles = []
        utilities = [1.0, 20.0, 20.0, 9.0, 8.0, 8.0, 9.0, 5.0]
        for r, u in zip(range(2, 10), utilities):
            oort.utility[0] = u
            oort._pace(r)
            percentiles.append(oort.percentile)
        assert oort.exploit_utility == pytest.approx(utilities, rel=1e-4)
        return percentiles
    # round 6: [20, 20] then [9, 8]: fell, T relaxes; round 8: [9, 8] then [8, 9]: the same (the older 20s are not
    # in the window), T stays
    assert schedule("paper") == [30, 30, 30, 30, 40, 40, 40, 40]
    # FedScale's: round 6 changed by 23 of 40 (neither within 10 % nor 5-fold): stays; round 8 by 0: relaxes
    assert schedule("fedscale") == [30, 30, 30, 30, 30, 30, 40, 40]


@pytest.mark.parametrize("pacer, history, start, percentile", [
    ("paper", [4, 4, 4, 4], 30.0, 30.0),  # the same utility: T stays
    ("paper", [4, 4, 3, 3], 97.5, 100.0),  # relaxed up to 100, not past it
    ("fedscale", [10, 10, 9, 9], 30.0, 37.5),  # exactly 10 % less: relaxes
    ("fedscale", [1, 1, 6, 6], 30.0, 22.5),  # exactly 5-fold more (|12 - 2| = 5 x 2): tightens
    ("fedscale", [1, 1, 4.5, 4.5], 30.0, 30.0),  # 4.5-fold: stays
    ("fedscale", [4, 4, 4.2, 4.2], 97.5, 100.0),
], ids=["paper-equal", "paper-cap", "fedscale-10pc", "fedscale-5x", "fedscale-4.5x", "fedscale-cap"])
def test_the_pacers_thresholds_at_their_boundaries(pacer, history, start, percentile):
    oort = _oort(4, pacer=pacer, pacer_step=2, pacer_delta=7.5, round_percentile=start)
    oort.exploit_utility = list(history[:-1])
    oort.last_pick = {"exploit": np.array([0]), "explore": np.zeros(0, np.int64)}
    oort.reported, oort.utility[0] = np.array([0]), history[-1] * (1 + 1e-4)  # the mean divides by 1 + 1e-4
    oort._pace(4)
    assert oort.percentile == percentile


def test_a_fresh_oort_has_picked_and_heard_from_no_one_and_its_state_says_so():
    """Before round 1 (a checkpoint taken then, a round's figures read then): nobody exploited, explored or
    reported."""
    oort = _oort(4)
    state = oort.state()
    assert (state["exploit"].size, state["explore"].size, state["reported"].size) == (0, 0, 0)
    assert oort.sim() == {"sim/oort_explored": 0.0, "sim/oort_exploration": 0.9}
    copy = _oort(4)
    copy.load(state)
    assert copy.sim() == oort.sim() and copy.reported.size == 0


def test_a_selection_of_explored_clients_only_is_integer_client_ids():
    """Every client explored: exploration takes none, and the ids (the clock indexes its arrays with them) stay
    integers."""
    oort = _oort(4, exploration=0.0, exploration_min=0.0)
    oort.feedback(1, np.arange(4), np.arange(4), np.array([1.0, 2.0, 3.0, 4.0]), np.ones(4), 1.0)
    chosen = oort.select(2, np.arange(4), 2)
    assert chosen.dtype.kind == "i" and oort.last_pick["explore"].size == 0 and chosen.size == 2


def test_declared_sizes_registered_again_leave_an_explored_clients_utility():
    """A resumed run registers the clients' sizes again: only the unexplored take them."""
    oort = _oort(3)
    oort.register(np.array([10, 20, 30]))
    oort.feedback(1, np.array([1]), np.array([1]), np.array([2.5]), np.ones(1), 1.0)
    oort.register(np.array([11, 21, 31]))
    assert oort.utility.tolist() == [11.0, 2.5, 31.0]


def test_exploitation_taking_its_whole_pool_leaves_the_rounds_stream_to_exploration():
    """Two explored clients and k - n_explore = 2 exploited: both are taken without a draw, so exploration's draw
    among the four fresh clients is the one a round of exploration alone makes (same seed, same round)."""
    for round_ in range(2, 12):
        both = _oort(6, exploration=0.5, exploration_decay=1.0, exploration_min=0.5, sample_window=4.0)
        both.register(np.array([0, 0, 5, 6, 7, 8]))
        both.feedback(1, np.array([0, 1]), np.array([0, 1]), np.array([1.0, 2.0]), np.ones(2), 1.0)
        alone = _oort(6, exploration=1.0, exploration_decay=1.0, exploration_min=1.0, sample_window=4.0)
        alone.register(np.array([0, 0, 5, 6, 7, 8]))
        picked = both.select(round_, np.arange(6), 3)
        assert sorted(both.last_pick["exploit"].tolist()) == [0, 1] and picked.size == 3
        assert both.last_pick["explore"].tolist() == alone.select(round_, np.arange(2, 6), 1).tolist()


def test_a_round_draws_afresh():
    """The same state selecting in different rounds: the draws are seeded by the round, not repeated."""
    picks = set()
    for round_ in range(2, 22):
        oort = _oort(4, exploration=1.0, exploration_decay=1.0, exploration_min=1.0)
        oort.register(np.array([5, 5, 5, 5]))
        picks.add(tuple(oort.select(round_, np.arange(4), 1).tolist()))
    assert len(picks) > 1


def test_the_rounds_hand_each_clients_reported_utility_to_oort():
    from fedray.system.oort import UTILITY
    from fedray.system.rounds import ClockRounds

    cfg = tiny_config(data__num_clients=6, federation__clients_per_round=2, system__devices="uniform",
                      system__selection="oort")
    rounds = ClockRounds(cfg, 6)
    rounds.register(np.full(6, 10))
    chosen = rounds.select(1)
    arrived = rounds.admit(chosen, [{"work_samples": 10, "bytes_up": 0, UTILITY: 3.0 + c} for c in chosen],
                           [0] * len(chosen))
    assert arrived == chosen and rounds.clock.oort.utility[arrived].tolist() == [3.0 + c for c in arrived]
    # and each one's measured duration: its t_k, all of which the server waited for (everyone arrived)
    durations = rounds.clock.oort.duration[arrived]
    assert (durations > 0).all() and durations.tolist() == rounds.clock.busy_s[arrived].tolist()


def test_a_clock_round_that_takes_every_online_client_asks_oort_for_no_selection():
    """Three clients online, three wanted: the round takes them all without Oort's selection (no score consulted, its
    exploration share not decayed), the never-heard counted as explored, then, once heard, as exploited."""
    from fedray.system.oort import UTILITY
    from fedray.system.rounds import ClockRounds

    cfg = tiny_config(data__num_clients=3, federation__clients_per_round=3, system__devices="uniform",
                      system__selection="oort")
    rounds = ClockRounds(cfg, 3)
    rounds.register(np.full(3, 10))
    oort = rounds.clock.oort
    eps = oort.eps
    chosen = rounds.select(1)
    assert chosen == [0, 1, 2] and oort.eps == eps
    assert oort.last_pick["exploit"].tolist() == [] and oort.last_pick["explore"].tolist() == [0, 1, 2]
    rounds.admit(chosen, [{"work_samples": 10, "bytes_up": 0, UTILITY: 1.0} for _ in chosen], [0] * 3)
    rounds.clock.end_round(0)
    assert rounds.select(2) == [0, 1, 2] and oort.eps == eps
    assert oort.last_pick["exploit"].tolist() == [0, 1, 2] and oort.last_pick["explore"].tolist() == []
