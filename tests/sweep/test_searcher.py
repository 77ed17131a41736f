"""The optuna searcher: each proposed setting runs with every seed, TPE is told their mean, in setting order,
so the same spec proposes the same settings however the trials finish; concurrency, failures and resume."""

import pytest
import yaml

from fedray.errors import ConfigError
from fedray.sweep.searcher import VALUE_KEY, SeedAveragedSearch, search_algorithm
from fedray.sweep.spec import concurrency, load_spec, search_plan

TINY = {"data.num_clients": 6, "data.synthetic_train_samples": 600, "data.synthetic_test_samples": 200,
        "federation.clients_per_round": 3, "federation.rounds": 3, "federation.local_steps": 5}


def spec_file(tmp_path, **spec):
    spec.setdefault("base", "synthetic")
    spec["overrides"] = {**TINY, **spec.get("overrides", {})}
    spec.setdefault("search", {"federation.lr": {"loguniform": [0.001, 0.3]},
                               "federation.momentum": {"uniform": [0.0, 0.9]}, "seed": {"grid": [0, 1, 2]}})
    spec.setdefault("searcher", "optuna")
    spec.setdefault("metric", "eval/accuracy")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


class FakeInner:
    """Proposes lr = 0.1 * (n + 1) for setting n and records what it is told."""

    def __init__(self):
        self.told: list[tuple[str, dict | None, bool]] = []

    def suggest(self, setting_id):
        return {"federation.lr": 0.1 * (int(setting_id.split("_")[1]) + 1)}

    def on_trial_complete(self, setting_id, result=None, error=False):
        self.told.append((setting_id, result, error))


def test_each_setting_runs_every_seed_and_its_mean_is_told_once_all_are_done():
    inner = FakeInner()
    s = SeedAveragedSearch(inner, [0, 1, 2], "eval/accuracy", "max", max_concurrent=3, num_settings=2)
    first = [s.suggest(f"t{i}") for i in range(3)]
    assert first == [{"federation.lr": 0.1, "seed": seed} for seed in (0, 1, 2)]
    assert s.suggest("t3") is None  # 3 trials run: the limit
    s.on_trial_complete("t0", {VALUE_KEY: 0.5})
    s.on_trial_complete("t2", {VALUE_KEY: 0.7})
    assert s.suggest("t3") == {"federation.lr": 0.2, "seed": 0}  # setting 1 starts beside setting 0's last seed
    assert inner.told == []  # setting 0 is told once its last seed is done, before setting 2 is proposed
    s.on_trial_complete("t1", {VALUE_KEY: 0.9})
    s.on_trial_complete("t3", None, error=True)  # a failed seed is left out of its setting's mean
    s.suggest("t4"), s.suggest("t5")
    s.on_trial_complete("t4", {VALUE_KEY: 0.2})
    s.on_trial_complete("t5", {"round": 3})  # stopped before any evaluation: no value, left out too
    assert s.suggest("t6") == "FINISHED"
    assert s._tell_through(1)
    assert [(sid, r, e) for sid, r, e in inner.told] == [
        ("setting_0000", {"eval/accuracy": pytest.approx(0.7)}, False),
        ("setting_0001", {"eval/accuracy": pytest.approx(0.2)}, False)]


def test_a_setting_whose_every_seed_failed_is_told_as_failed():
    inner = FakeInner()
    s = SeedAveragedSearch(inner, None, "eval/accuracy", "max", max_concurrent=1, num_settings=2)
    assert s.suggest("a") == {"federation.lr": 0.1}  # no seed dimension: one trial a setting, no seed key
    s.on_trial_complete("a", None, error=True)
    assert s.suggest("b") == {"federation.lr": 0.2}
    assert inner.told == [("setting_0000", None, True)]


def _proposals(spec, order, tmp_path=None):
    """Run the searcher through 6 settings x 3 seeds, 4 trials at once, completing running trials in the
    given order ("first" or "last" started first), with values a function of the proposal."""
    search = search_algorithm(spec, _tune_space(spec), max_concurrent=4, num_samples=6)
    running, proposals, n = [], [], 0
    while True:
        config = search.suggest(f"t{n}")
        if config == "FINISHED" and not running:
            return proposals
        if config not in (None, "FINISHED"):
            proposals.append(config)
            running.append((f"t{n}", config))
            n += 1
            continue
        tid, config = running.pop(0 if order == "first" else -1)
        search.on_trial_complete(tid, {VALUE_KEY: -abs(config["federation.lr"] - 0.05) + 0.01 * config["seed"]})


def _tune_space(spec):
    from fedray.sweep.runner import _domain

    return {k: _domain(d) for k, d in spec.search.items()}


def test_the_same_spec_proposes_the_same_settings_whichever_trials_finish_first(tmp_path):
    spec = load_spec(spec_file(tmp_path, startup_trials=2, searcher_seed=7))
    a, b = _proposals(spec, "first"), _proposals(spec, "last")
    assert len(a) == 18 and a == b
    assert [c["seed"] for c in a] == [0, 1, 2] * 6
    settings = [tuple(sorted((k, v) for k, v in c.items() if k != "seed")) for c in a]
    assert len(set(settings)) == 6  # TPE proposed six settings, each run with its three seeds
    other = load_spec(spec_file(tmp_path, startup_trials=2, searcher_seed=8))
    assert _proposals(other, "first") != a  # the sampler's seed is what fixes them


def test_a_saved_searcher_restores_and_proposes_what_it_would_have(tmp_path):
    spec = load_spec(spec_file(tmp_path, startup_trials=1))
    one = search_algorithm(spec, _tune_space(spec), max_concurrent=3, num_samples=4)
    for i in range(3):
        one.suggest(f"t{i}")
    for i in range(3):
        one.on_trial_complete(f"t{i}", {VALUE_KEY: 0.1 * i})
    one.save(str(tmp_path / "searcher.pkl"))
    two = search_algorithm(spec, _tune_space(spec), max_concurrent=3, num_samples=4)
    two.restore(str(tmp_path / "searcher.pkl"))
    assert [two.suggest(f"t{i}") for i in range(3, 6)] == [one.suggest(f"t{i}") for i in range(3, 6)]


@pytest.mark.parametrize("search, key, fragment", [
    ({"federation.lr": {"grid": [0.01, 0.1]}}, "search.federation.lr", "{choice: [0.01, 0.1]}"),
    ({"seed": {"grid": [0, 1]}}, "searcher", "besides seed"),
    ({"federation.lr": {"uniform": [0.01, 0.1]}, "seed": {"choice": [0, 1]}}, "search.seed", "{grid: [0, 1, 2]}"),
])
def test_search_spaces_optuna_cannot_run_are_refused_naming_the_key(tmp_path, search, key, fragment):
    with pytest.raises(ConfigError) as e:
        load_spec(spec_file(tmp_path, search=search))
    assert e.value.key == key and fragment in e.value.message


def test_searcher_grid_refuses_a_sampled_dimension_and_the_default_follows_the_space(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_spec(spec_file(tmp_path, searcher="grid"))
    assert e.value.key == "search.federation.lr" and "searcher: random" in e.value.message
    assert load_spec(spec_file(tmp_path, searcher=None)).search_method == "random"
    grids = {"federation.lr": {"grid": [0.1]}, "seed": {"grid": [0, 1]}}
    assert load_spec(spec_file(tmp_path, searcher=None, search=grids)).search_method == "grid"


def test_optuna_runs_as_many_trials_at_once_as_the_cluster_holds_unless_told(tmp_path):
    spec = load_spec(spec_file(tmp_path, trial_cpus=1))
    bundles = [[{"CPU": 1.0}], [{"CPU": 1.0}, {"CPU": 0.5}]]
    assert concurrency(spec, bundles, {"CPU": 4.0}) == 2  # the largest trial (1.5 CPU) twice in 4
    assert concurrency(spec, bundles, {"CPU": 4.0}, max_concurrent=3) == 3
    assert concurrency(spec, [[{"CPU": 1.0, "GPU": 0.5}]], {"CPU": 8.0, "GPU": 1.0}) == 2
    random = load_spec(spec_file(tmp_path, searcher="random"))
    assert concurrency(random, bundles, {"CPU": 4.0}) is None  # grid and random: Tune's own default


def test_the_plan_says_how_settings_are_chosen_and_judged(tmp_path):
    spec = load_spec(spec_file(tmp_path, num_samples=8, startup_trials=3, scheduler={"grace_period": 2}))
    plan = search_plan(spec, at_once=2)
    assert "TPE (sampler seed 0) proposes 8 settings x 3 seeds = 24 trials" in plan
    assert "first 3 drawn at random" in plan and "at most 2 trials at once" in plan
    assert "mean over its seeds [0, 1, 2]" in plan and "last 5 evaluated rounds" in plan and "ASHA" in plan
    grid = load_spec(spec_file(tmp_path, searcher=None, search={"federation.lr": {"grid": [0.1, 0.2]}}))
    assert search_plan(grid).startswith("searcher grid: every combination of the grids, 1 time")
