"""The method contract (fedray/methods/api.py): its hooks are declared, not inferred; an experiment is resolved once."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from fedray.errors import ConfigError
from fedray.learning.training import LocalTraining, StepwiseTraining, run_update
from fedray.methods import ALGORITHMS, Experiment, resolve_experiment
from fedray.methods.api import Algorithm, ClientResult
from fedray.methods.fedavg import FedAvg
from fedray.methods.fedprox import FedProx
from fedray.methods.registry import get_algorithm
from fedray.simulation import run_experiment
from tests.conftest import built_in_methods, tiny_config


def test_a_local_loss_override_must_declare_whether_it_is_paddable():
    with pytest.raises(TypeError, match="local_loss_paddable"):
        class Unsaid(FedAvg):  # noqa: F841 - defining it is the test
            def local_loss(self, model, x, y, anchor):
                return F.cross_entropy(model(x), y) + model(x).pow(2).mean()  # reads the batch without a row mask

    class Said(FedAvg):
        local_loss_paddable = False

        def local_loss(self, model, x, y, anchor):
            return F.cross_entropy(model(x), y) + model(x).pow(2).mean()

    class Inherits(Said):  # no local_loss of its own: Said's declaration holds
        pass

    assert Said.local_loss_paddable is False and Inherits.local_loss_paddable is False


def test_the_declared_paddability_is_what_the_plan_carries(tiny_runtime):
    rt, ctx, payload = tiny_runtime

    class Unpadded(FedAvg):
        local_loss_paddable = False

        def local_loss(self, model, x, y, anchor):
            return F.cross_entropy(model(x), y)

    assert FedAvg(rt.cfg, rt.worker.algo.spec).client_update(ctx, payload, None).paddable is True
    assert Unpadded(rt.cfg, rt.worker.algo.spec).client_update(ctx, payload, None).paddable is False


def test_every_builtin_method_has_one_client_entry_point():
    """``client_update`` is the only client hook: no second entry point kept in step by hand."""
    for name in ALGORITHMS:
        cls = ALGORITHMS[name]
        assert not hasattr(cls, "local_training"), f"{name} still has local_training"
        assert "client_update" not in cls.__abstractmethods__


def test_run_update_runs_whatever_client_update_returns(tiny_runtime):
    rt, ctx, payload = tiny_runtime
    plan = rt.worker.algo.client_update(ctx, payload, None)
    assert isinstance(plan, LocalTraining)
    result = run_update(ctx, plan)
    assert isinstance(result, ClientResult) and run_update(ctx, result) is result
    with pytest.raises(ValueError, match="alone"):
        run_update(ctx, StepwiseTraining(modules=None, start={}, updates=[], steps=0, inputs=None, finish=None))


@pytest.mark.parametrize("batched", [False, True])
def test_both_plans_finish_with_the_model_and_the_sums_over_the_steps(tiny_runtime, batched):
    """One ``finish(model, trained)`` for both plans: a LocalTraining run alone, or batched (as a StepwiseTraining
    inside the engine), hands its finish the sums of train/loss and of the loss's own figures over the client's
    steps, the steps, and (a LocalTraining's optimizer starting afresh each round) no optimizer state."""
    from fedray.vectorized.engine import train_vectorized

    rt, ctx, payload = tiny_runtime
    plan = rt.worker.algo.client_update(ctx, payload, None)
    seen = []
    inner = plan.finish
    plan.finish = lambda m, trained: seen.append(trained) or inner(m, trained)
    plan.loss = (lambda m, x, y, f=plan.loss: (f(m, x, y), {"train/rows": (y >= 0).sum().float()}))
    (train_vectorized([ctx], [plan]) if batched else [run_update(ctx, plan)])[0]
    (trained,) = seen
    assert trained.steps == ctx.num_local_steps() and trained.optimizer_state == {}
    assert trained.sums["train/rows"] == sum(len(y) for _, y in ctx.batches())
    assert trained.means()["train/loss"] == pytest.approx(trained.sums["train/loss"] / trained.steps)


def test_an_experiment_is_resolved_once_per_run(monkeypatch):
    """The method's parameters are parsed once (by resolve_experiment) and handed down: no Algorithm.__init__,
    runtime or worker parses them or looks the method up by name again."""
    parsed = []
    original = Algorithm.parse_params.__func__

    def counting(cls, values):
        parsed.append(cls.name)
        return original(cls, values)

    monkeypatch.setattr(Algorithm, "parse_params", classmethod(counting))
    exp = resolve_experiment(tiny_config(federation__rounds=1))
    assert isinstance(exp, Experiment) and exp.method is FedAvg and parsed == ["fedavg"]
    monkeypatch.setattr("fedray.methods.registry.get_algorithm", lambda name: pytest.fail("looked up again"))
    run_experiment(exp, progress=False)
    assert parsed == ["fedavg"]
    assert resolve_experiment(exp) is exp


@pytest.fixture
def tiny_runtime():
    from fedray.data import build_federated_data
    from fedray.runtime import make_runtime

    cfg = resolve_experiment(tiny_config()).cfg
    with make_runtime(cfg, build_federated_data(cfg.data, cfg.seed)) as rt:
        ctx, _ = rt.worker._context(1, 3, None)
        yield rt, ctx, rt.server.payload(0)[0]


def test_an_unknown_method_is_refused_naming_the_field_and_the_methods_allowed():
    assert get_algorithm("fedavg") is FedAvg
    with pytest.raises(ConfigError) as err:
        get_algorithm("fedavgg")
    assert err.value.key == "algorithm.name"
    assert "'fedavgg'" in err.value.message and all(name in err.value.message for name in ALGORITHMS)


def test_a_methods_parameters_are_checked_naming_the_field_and_the_fix():
    """An unknown parameter names itself and every parameter the method has; a bad value names its field."""
    assert FedProx.parse_params({"mu": 0.5}).mu == 0.5
    with pytest.raises(ConfigError) as err:
        FedProx.parse_params({"muu": 0.5})
    assert err.value.key == "algorithm.muu"
    assert err.value.message == ("not a parameter of 'fedprox'; "
                                 "allowed: algorithm.report_model, algorithm.cache_init, algorithm.mu")
    with pytest.raises(ConfigError) as err:
        get_algorithm("local").parse_params({"mu": 0.1})  # a method without parameters says so
    assert err.value.message == "not a parameter of 'local'; allowed: none"
    with pytest.raises(ConfigError) as err:
        FedProx.parse_params({"mu": -1})
    assert err.value.key == "algorithm.mu" and "greater than or equal to 0" in err.value.message


def test_asynchronous_support_and_the_cache_hold_only_where_a_class_declares_them():
    """A subclass of FedAvg (FedNova, say: normalised updates, which FedAvg's rebase would get wrong) runs
    synchronously until its own body says otherwise, and keeps no cache unless it declares one."""
    from fedray.methods.api import CacheParams
    from fedray.methods.registry import check_declarations

    class Nova(FedAvg):
        name = "nova"

    assert (Nova.asynchronous, Nova.keeps_cache) == (False, False)
    with pytest.raises(ConfigError) as err:
        check_declarations(Nova, Nova.parse_params({}), tiny_config(federation__mode="async",
                                                                    system__devices="uniform"))
    assert err.value.key == "federation.mode" and "'nova' cannot run async" in err.value.message
    assert "methods that can: fedavg, fedgkd, fedprox, qffl" in err.value.message
    with pytest.raises(ConfigError) as err:  # its parameters take report_model, but it keeps no cache
        check_declarations(Nova, Nova.parse_params({"report_model": "oca"}), tiny_config())
    assert err.value.key == "algorithm.report_model" and "keeps no cache" in err.value.message

    with pytest.raises(TypeError, match="no rebase"):
        class Claims(get_algorithm("dafkd")):  # noqa: F841 - defining it is the test
            asynchronous = True
    with pytest.raises(TypeError, match="CacheParams"):
        class Cached(get_algorithm("scaffold")):  # noqa: F841 - its Params take no cache keys
            keeps_cache = True

    class Both(FedAvg):
        asynchronous = True
        keeps_cache = True

    assert (Both.asynchronous, Both.keeps_cache) == (True, True) and issubclass(Both.Params, CacheParams)


def test_the_methods_that_run_async_declare_it_in_their_own_class():
    built_in = built_in_methods()
    able = {name for name in built_in if ALGORITHMS[name].asynchronous}
    assert able == {"fedavg", "fedprox", "fedgkd", "qffl"}
    assert all("asynchronous" in vars(ALGORITHMS[name]) for name in able)
    assert {name for name in built_in if ALGORITHMS[name].keeps_cache} == {"fedavg", "fedprox", "fedgkd", "fedkf"}


def test_robust_rules_hold_only_where_a_class_declares_its_means():
    """A robust aggregation.rule replaces every hook call of a server step, so a subclass that changes the step (q-FFL's
    ratio of sums, SCAFFOLD's control variate) takes only the mean until its own body says; a method whose calls
    average logits (or a cache of older rounds' models) takes only the rules that read no reference model."""
    from fedray.methods.registry import check_declarations

    class Nova(FedAvg):
        name = "nova"

    assert Nova.robust_means == () and FedAvg.robust_means == ("weights",)
    with pytest.raises(ConfigError) as err:
        check_declarations(Nova, Nova.parse_params({}), tiny_config(aggregation__rule="median"))
    assert err.value.key == "aggregation.rule"
    assert err.value.message.startswith("'nova' takes only the mean here: its class declares no robust_means")
    assert "methods that take median (with their defaults): fedavg, feddf, feddistill, fedgkd, fedkf, fedprox" in \
        err.value.message
    every = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "norm_bound", "fltrust")
    values = every[:5]
    expected = {"fedavg": every, "fedprox": every, "fedgkd": every, "feddf": values, "fedkf": values,
                "feddistill": ("mean", "median", "trimmed_mean")}
    built_in = built_in_methods()
    for name in built_in:
        cls = ALGORITHMS[name]
        rules, why = cls.robust_rules(cls.parse_params({}))
        assert rules == expected.get(name, ("mean",)), name
        assert (why == "") == (rules == every), name  # every refusal says why
    assert {name for name in built_in if ALGORITHMS[name].robust_means} == set(expected) | {"fedcd"}
    assert all("robust_means" in vars(ALGORITHMS[n]) for n in set(expected) | {"fedcd"})
    # FedCD: the uniform teacher takes the rules of values, Eq. 4's fitted one only the mean, saying how to get one
    fedcd = ALGORITHMS["fedcd"]
    assert fedcd.robust_rules(fedcd.parse_params({"ensemble": "uniform"}))[0] == values
    assert "algorithm.ensemble=uniform" in fedcd.robust_rules(fedcd.parse_params({}))[1]


def test_the_cache_with_async_is_refused_in_the_one_place_modes_are_checked():
    with pytest.raises(ConfigError) as err:
        resolve_experiment(tiny_config(algorithm__name="fedgkd", algorithm__report_model="oca",
                                       federation__mode="async", system__devices="uniform"))
    assert err.value.key == "algorithm.report_model" and "report_model=aca" in err.value.message
    assert not hasattr(FedAvg, "check_config") or FedAvg.check_config.__func__ is Algorithm.check_config.__func__
