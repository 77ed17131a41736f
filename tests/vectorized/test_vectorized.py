"""Vectorised clients (``runtime.vectorize``): the batched optimizer against torch.optim, and for every covered
method one round's averaged (or own) weights and 5 rounds' accuracy against the sequential runner."""

from __future__ import annotations

import dataclasses
import sys
from contextlib import contextmanager

import pytest
import torch

from fedray.methods import ALGORITHMS, validate_experiment
from fedray.methods.api import ClientResult
from fedray.methods.fedavg import FedAvg
from fedray.load import load_config
from fedray.data import build_federated_data
from fedray.runtime import make_runtime
from fedray.learning.training import CLIENT_INPUTS, IGNORE_LABEL, OptimSpec, is_weights_only, run_update, weights_only
from fedray.vectorized.stacked_optimizer import StackedOptimizer
from fedray.learning import cuda_graphs
from fedray.data import federated as fed_data
from fedray.vectorized.step_graph import StepGraph
from fedray.vectorized.policy import vectorize_enabled
from fedray.vectorized.round_batches import RoundBatches
from fedray.vectorized.engine import as_stepwise, train_vectorized
from fedray.seeding import sample_clients
from fedray.simulation import run_experiment
from tests.conftest import method_overrides, tiny_config

DAFKD = method_overrides("dafkd")


def _fed(**kw):
    return load_config(None, {f"federation.{k}": v for k, v in kw.items()}).federation


@pytest.mark.parametrize("opt", [dict(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=1e-2),
                                 dict(optimizer="sgd", lr=0.1),
                                 dict(optimizer="adam", lr=1e-2, weight_decay=1e-2)])
def test_stacked_optimizer_follows_torch_optim_per_client_and_masked_clients_stay_put(opt):
    """Client 0 steps every time, client 1 stops early (fewer local steps), client 2 starts late (an update
    it skips in its first steps, as DaFKD's discriminator can): each moves as its own torch optimizer."""
    spec = OptimSpec.of(_fed(**opt))
    torch.manual_seed(0)
    w0 = torch.randn(3, 4, 5)
    grads = [torch.randn(3, 4, 5) for _ in range(4)]
    active = [[True] * 4, [True, True, False, False], [False, True, True, True]]
    stacked = w0.clone().requires_grad_(True)
    sopt = StackedOptimizer({"w": stacked}, {"w": spec})
    for s, g in enumerate(grads):
        stacked.grad = g.clone()
        sopt.step(torch.tensor([a[s] for a in active]))
    for k, steps in enumerate(active):
        w = w0[k].clone().requires_grad_(True)
        topt = (torch.optim.Adam([w], lr=spec.lr, weight_decay=spec.weight_decay) if spec.kind == "adam" else
                torch.optim.SGD([w], lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay))
        for g, on in zip(grads, steps):
            if on:
                w.grad = g[k].clone()
                topt.step()
        torch.testing.assert_close(stacked.detach()[k], w.detach(), rtol=1e-6, atol=1e-7)



@pytest.mark.parametrize("opt", [dict(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=1e-2),
                                 dict(optimizer="sgd", lr=0.1),
                                 dict(optimizer="adam", lr=1e-2, weight_decay=1e-2)])
def test_a_step_of_every_client_is_torch_optims_multi_tensor_step_per_client(opt):
    """Every client active at the same step count (the usual step): the whole parameter group takes
    torch.optim's foreach step, and each client's rows still move as its own optimizer moves it."""
    spec = OptimSpec.of(_fed(**opt))
    torch.manual_seed(2)
    w0 = {"a": torch.randn(3, 4, 5), "b": torch.randn(3, 7)}
    grads = [{k: torch.randn_like(v) for k, v in w0.items()} for _ in range(4)]
    stacked = {k: v.clone().requires_grad_(True) for k, v in w0.items()}
    sopt = StackedOptimizer(stacked, {k: spec for k in stacked})
    for g in grads:
        for k, v in stacked.items():
            v.grad = g[k].clone()
        sopt.step(None)
    assert sopt.multi_tensor_steps == len(grads)
    for c in range(3):
        w = [w0[k][c].clone().requires_grad_(True) for k in w0]
        topt = (torch.optim.Adam(w, lr=spec.lr, weight_decay=spec.weight_decay) if spec.kind == "adam" else
                torch.optim.SGD(w, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay))
        for g in grads:
            for wk, k in zip(w, w0):
                wk.grad = g[k][c].clone()
            topt.step()
        for wk, k in zip(w, w0):
            torch.testing.assert_close(stacked[k].detach()[c], wk.detach(), rtol=1e-6, atol=1e-7)
        if spec.kind == "adam":
            assert sopt.client_state(c)["a"]["step"] == len(grads)
            torch.testing.assert_close(sopt.client_state(c)["a"]["exp_avg_sq"], topt.state[w[0]]["exp_avg_sq"])

def _one_round(vectorize, rounds=1, **kw):
    """The global (or each client's) weights and the clients' figures after round ``rounds`` (the last)."""
    cfg = validate_experiment(tiny_config(runtime__vectorize=vectorize, **kw))
    data = build_federated_data(cfg.data, cfg.seed)
    with make_runtime(cfg, data) as rt:
        assert rt.worker.vectorize is vectorize
        for r in range(1, rounds + 1):
            out = rt.run_round(r, sample_clients(cfg.seed, r, data.num_clients, cfg.federation.clients_per_round))
        weights = rt.global_weights()
        return ({c: w for c, w in weights.items()} if rt.personalised else {0: weights}), out.client_infos


#: a ResNet's BatchNorm over batches of a few rows amplifies float32 rounding: batched and sequential (or eager and
#: replayed) rounds of ResNet-8-BN differ by up to 2e-4 of the weights on the CPUs these tests were written on and
#: by 6.2e-4 on an AVX2 AMD EPYC (family 25 model 1), whose kernels sum in other orders; a client stepped twice or
#: a BatchNorm statistic not put back moves them by ~1e-2
BN_ROUNDING = 1e-3


def _assert_same_weights(a: dict, b: dict, adam: bool = False, batchnorm: bool = False) -> None:
    """Max relative difference <= 1e-4 over the model (max |a - b| / max |a| across all its floats), and each
    tensor within float rounding: BatchNorm biases ~1e-3 from zero differ by ~1e-7 between batched and single
    convolutions, a large relative but a rounding-sized absolute difference. ``batchnorm`` (a ResNet's BatchNorm over
    small batches) holds the model to BN_ROUNDING instead and lets each element differ by that share of the model's
    largest value: the rounding BatchNorm amplifies reaches every element of a convolution, its small ones included
    (5.5e-4 in a first convolution whose largest is 0.33).

    ``adam``: Adam's step m / (sqrt(v) + eps) has the size of lr whatever the gradient's, so where a gradient is
    near zero (a BatchNorm bias) rounding moves the step by a share of lr, not of the gradient. Measured on an
    AMD EPYC (AVX-512): ResNet-8-BN's DaFKD round with Adam at lr 1e-3 differed by 1.2e-3 of a bias tensor's
    largest value (3.5e-6), the same round with SGD by 1.2e-6. Each tensor is then held to 1 % of its own
    scale: a real error (a step too many or too few, a wrong mask) moves such a bias by lr, a third of it here.
    """
    assert a.keys() == b.keys()
    rel = BN_ROUNDING if batchnorm else 1e-4
    for cid in a:
        keys = [k for k in a[cid] if torch.is_floating_point(a[cid][k])]
        diff = max(float((a[cid][k].double() - b[cid][k].double()).abs().max()) for k in keys)
        scale = max(float(a[cid][k].double().abs().max()) for k in keys)
        assert diff / scale <= rel, (cid, diff / scale)
        for k in a[cid]:
            own = float(a[cid][k].double().abs().max()) if adam and torch.is_floating_point(a[cid][k]) else 0.0
            torch.testing.assert_close(b[cid][k], a[cid][k], rtol=rel, atol=max(
                2e-6, 1e-2 * own if adam else 0.0, rel * scale if batchnorm else 0.0))


COVERED = {
    "fedavg_sgd_momentum": method_overrides("fedavg-momentum"),
    "fedavg_adam": dict(federation__optimizer="adam", federation__lr=1e-3, federation__weight_decay=1e-3),
    # BatchNorm models in batches of 12 (client 3's 35 samples end a pass on 11): a pass ending on a 3-sample batch
    # (batches of 16) amplifies rounding ~100x within two steps, so far that the batched and the sequential rounding
    # differ by 1e-5 on some CPUs (AVX-512 here) and not on others - no longer a check of the batching
    "fedavg_batchnorm": dict(model__name="resnet8_bn", federation__momentum=0.9, federation__batch_size=12),
    # batches of 30: 3 of the 4 steps split by a short batch, so the round is padded with BatchNorm masked to the
    # real rows (vectorized.PAD_BATCHNORM_FROM)
    "fedavg_batchnorm_padded": dict(model__name="resnet8_bn", federation__momentum=0.9, federation__batch_size=30),
    "fedavg_unequal_epochs": dict(federation__local_epochs=1, federation__batch_size=48),  # phases, short batches
    # 12, 32 and 20 steps: three phases, Adam's state and the step counts carried from one to the next
    "fedavg_unequal_epochs_adam": dict(federation__local_epochs=4, federation__optimizer="adam", federation__lr=1e-3,
                                       federation__weight_decay=1e-3),
    # every method's own settings (METHOD_CASES in tests/conftest.py); their one round batched vs sequential is checked
    # for every method by tests/test_every_method.py, the other entries' here
    **{name: method_overrides(name) for name in ("fedprox", "qffl", "fedgkd", "fedcd", "feddistill", "fedd3a")},
    "local_heterogeneous": method_overrides("local"),  # lenet5 and resnet8_bn
    "fedd3a_heterogeneous": method_overrides("fedd3a-heterogeneous"),
    "fedkf_warmup": dict(algorithm__name="fedkf", algorithm__warmup_rounds=1),
    # LeNet-5 student: the DAFL generator's convolution biases sit before BatchNorm, so their true gradient is 0
    # and what they get is rounding noise (~1e-13), which Adam's first step turns into +-lr moves whose sign
    # depends on the rounding; with a BatchNorm student this grows ~6x per local step (1e-4 after 4 steps),
    # between any two ways of rounding, batched or not.
    "fedkf": method_overrides("fedkf"),
    "dafkd": DAFKD,
    "dafkd_conditional_bn_adam": dict(DAFKD, algorithm__generator="conditional", model__name="resnet8_bn",
                                      federation__optimizer="adam", federation__lr=1e-3, federation__weight_decay=1e-4,
                                      federation__batch_size=12),
    "dafkd_unequal_gan_epochs": dict(**DAFKD, federation__local_epochs=2, federation__batch_size=48,
                                     algorithm__gan_local_epochs=1),  # D/G stop at different steps per client
    # client 3's 35 samples end a pass on a one-sample batch: the conditional generator's BatchNorm1d still gets
    # two generated samples (fedray.methods.dafkd.losses.fake_count)
    "dafkd_one_sample_batch": dict(DAFKD, algorithm__generator="conditional", federation__batch_size=17),
    # padded (3 of 4 steps split): the noise too, the generator's BatchNorm and the losses over the drawn rows only;
    # batches of 34 end client 3's passes on one sample, padded to 34 rows, its noise (2 rows) to 34 (more padded
    # rounds: test_a_padded_round_is_exact_in_double_precision)
    "dafkd_padded_one_sample": dict(DAFKD, algorithm__generator="conditional", federation__batch_size=34),
    # the class term (an extension): G's loss gains the classifier's cross-entropy over the drawn rows only, logged
    # apart; batches of 34 as above, so the noise is padded
    "dafkd_class_term": dict(DAFKD, algorithm__generator="conditional", algorithm__gen_class_weight=0.5,
                             federation__batch_size=34),
}


# the entries that are a method's own case (fedavg-momentum, fedprox, ...): tests/test_every_method.py's
EVERY_METHOD = {"fedavg_sgd_momentum", "fedprox", "qffl", "fedgkd", "local_heterogeneous", "fedcd", "feddistill",
                "fedd3a", "fedd3a_heterogeneous", "fedkf", "dafkd"}


@pytest.mark.parametrize("name", [name for name in COVERED if name not in EVERY_METHOD])
def test_one_vectorised_round_equals_the_sequential_one(name):
    seq_w, seq_info = _one_round(False, **COVERED[name])
    vec_w, vec_info = _one_round(True, **COVERED[name])
    _assert_same_weights(seq_w, vec_w, adam=COVERED[name].get("federation__optimizer") == "adam",
                         batchnorm=COVERED[name].get("model__name") == "resnet8_bn")
    for s, v in zip(seq_info, vec_info):
        assert s["client"] == v["client"] and s["bytes_up"] == v["bytes_up"]
        # every figure a client logs, under the same names, to the same values
        assert {k for k in s if k.startswith("train/")} == {k for k in v if k.startswith("train/")}
        for key in (k for k in s if k.startswith("train/")):
            assert v[key] == pytest.approx(s[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("name", ["fedavg_batchnorm_padded", "dafkd"])
def test_a_bf16_round_batched_equals_the_sequential_one_to_bf16_rounding(name):
    """runtime.precision=bf16 reaches local training both ways (the weights move ~1e-3 off the float32 round's),
    and the batched round equals the sequential one to bfloat16's rounding (8 bits of mantissa: ~4e-3)."""
    float32, _ = _one_round(False, **COVERED[name])
    seq, seq_info = _one_round(False, runtime__precision="bf16", **COVERED[name])
    vec, vec_info = _one_round(True, runtime__precision="bf16", **COVERED[name])
    assert _max_relative_difference(float32[0], seq[0]) > 1e-4 and _max_relative_difference(float32[0], vec[0]) > 1e-4
    assert _max_relative_difference(seq[0], vec[0]) <= 1e-2
    assert all(t.dtype in (torch.float32, torch.int64) for t in vec[0].values())
    for s, v in zip(seq_info, vec_info):
        assert v["train/loss"] == pytest.approx(s["train/loss"], rel=1e-3)


@pytest.mark.parametrize("kw, per_step", [
    # clients 3, 4, 5 hold 35, 114 and 70 samples: in 4 steps of 16 only client 3's third batch is short (3
    # samples). LeNet-5 and cross-entropy: padded with ignored rows into the step's one call
    (dict(), 1.0),
    # not padded, the short batch is a call of its own: 5 calls over 4 steps
    (dict(runtime__vectorize_pad=False), 1.25),
    # BatchNorm with 1 of 4 steps split: not worth masking its statistics to the real rows, so not padded
    (dict(model__name="resnet8_bn"), 1.25),
    # batches of 30 (35: 30, 5, 30, 5; 70: 30, 30, 10, 30; 114: 30, 30, 30, 24): 3 of 4 steps split, padded
    (dict(model__name="resnet8_bn", federation__batch_size=30), 1.0),
    (dict(model__name="resnet8_bn", federation__batch_size=30, runtime__vectorize_pad=False), 2.0),
    (dict(algorithm__name="fedgkd"), 1.0),  # its distillation term averages over the real rows as well
    (dict(federation__batch_size=5), 1.0),  # 35, 114, 70: 4 full batches of 5 each
])
def test_each_client_reports_how_many_vmapped_calls_a_lockstep_step_took(kw, per_step):
    _, infos = _one_round(True, **kw)
    assert [i["client"] for i in infos] == [3, 4, 5]
    assert [i["vec/groups_per_step"] for i in infos] == [per_step] * 3


def test_batched_inputs_are_each_clients_batches_and_padded_rows_are_ignored():
    """The lockstep gathers a step's batches of all clients at once; client by client they are the batches the
    sequential runner iterates, and a short batch padded to the step's longest has its extra rows labelled
    IGNORE_LABEL (images: rows of the same client)."""
    cfg = validate_experiment(tiny_config(federation__local_epochs=2, federation__batch_size=16))
    data = build_federated_data(cfg.data, cfg.seed)
    with make_runtime(cfg, data) as rt:
        ctxs = [rt.worker._context(1, c, None)[0] for c in (3, 5)]  # 35 and 70 samples: 6 and 10 steps
    plans = [as_stepwise(c, rt.worker.algo.client_update(c, rt.worker.algo.broadcast(rt.server.state, 1), None))
             for c in ctxs]
    for pad in (False, True):
        rows = RoundBatches(plans, torch.device("cpu"), pad)
        for i, (ctx, plan) in enumerate(zip(ctxs, plans)):
            seen = []
            for s, (x, y) in enumerate(ctx.batches()):
                group, members = rows.groups[s][i]
                got = rows.inputs(s, members)
                row = members.index(i)
                n = len(y)
                torch.testing.assert_close(got["x"][row, :n], x, rtol=0, atol=0)
                assert torch.equal(got["y"][row, :n], y)
                assert (got["y"][row, n:] == IGNORE_LABEL).all()
                assert pad or len(got["y"][row]) == n
                seen.append(plan.batches.index[s])
            # each pass over the client's data is a permutation of its rows
            per_pass = -(-ctx.num_samples // 16)
            for p in range(2):
                assert sorted(torch.cat(seen[p * per_pass:(p + 1) * per_pass]).tolist()) == list(range(ctx.num_samples))
        assert len(rows.groups) == 10 and all(len(step) == (2 if s < 6 else 1) for s, step in enumerate(rows.groups))


def _plans(cfg, client_ids):
    """(runtime, contexts, plans) of round 1 for ``client_ids``, built as a worker builds them."""
    data = build_federated_data(cfg.data, cfg.seed)
    rt = make_runtime(cfg, data)
    algo = rt.worker.algo
    ctxs, plans = [], []
    for c in client_ids:
        ctx, state = rt.worker._context(1, c, None)
        ctxs.append(ctx)
        plans.append(algo.client_update(ctx, rt.server.payload(0)[0], state))
    return rt, ctxs, plans


@pytest.mark.parametrize("pad", [False, True])
def test_each_client_reads_its_own_client_inputs_batched_as_alone(pad):
    """A plan's ``client_inputs`` reach each client's loss as that client's own, stacked once for the round: three
    clients pulled each its own way (a scalar of their own times the sum of the weights) over 6, 3 and 5 steps
    (phases, short batches; padded or not) end batched where each ends alone, and where the pull is not shared."""
    cfg = validate_experiment(tiny_config(federation__local_epochs=1, federation__batch_size=16))
    rt, ctxs, plans = _plans(cfg, [1, 3, 5])
    with rt:
        def pulled(ctx, plan, weight):
            plain = as_stepwise(ctx, plan)
            inner = plain.updates[0].loss

            def loss(mods, inp, flags):
                out, aux = inner(mods, inp, flags)
                return out + inp[CLIENT_INPUTS]["pull"] * sum(p.sum() for p in mods["model"].parameters()), aux
            return dataclasses.replace(plain, updates=[dataclasses.replace(plain.updates[0], loss=loss)],
                                       client_inputs={"pull": torch.tensor(weight)})

        weights = (0.0, 0.5, -0.5)
        batched = train_vectorized(ctxs, [pulled(c, p, w) for c, p, w in zip(ctxs, plans, weights)], pad=pad)
        alone = [train_vectorized([c], [pulled(c, p, w)])[0] for c, p, w in zip(ctxs, plans, weights)]
        shared = train_vectorized([ctxs[1]], [pulled(ctxs[1], plans[1], 0.0)])[0]
    assert [c.num_local_steps() for c in ctxs] != [ctxs[0].num_local_steps()] * 3
    for b, a in zip(batched, alone):
        assert _max_relative_difference(a.upload.weights, b.upload.weights) < 1e-5
    assert _max_relative_difference(shared.upload.weights, batched[1].upload.weights) > 1e-3


@pytest.mark.parametrize("kw, marked", [
    *[(COVERED[name], True) for name in ("fedavg_sgd_momentum", "fedprox", "qffl", "fedgkd", "fedkf_warmup",
                                         "local_heterogeneous", "fedd3a", "fedd3a_heterogeneous", "dafkd")],
    (COVERED["fedcd"], False), (COVERED["feddistill"], False),  # their finish runs the model (shared-batch logits)
    (dict(DAFKD, algorithm__private_discriminator=True), False)])  # runs the modules on the distillation set
def test_finishes_that_only_copy_the_weights_say_so(kw, marked):
    rt, _, plans = _plans(validate_experiment(tiny_config(**kw)), [3, 4])
    with rt:
        assert [is_weights_only(p.finish) for p in plans] == [marked] * 2


def test_a_subclass_upload_is_made_from_the_trained_weights_so_the_finish_stays_weights_only():
    """make_upload is handed the client's trained weights, never the module: an override cannot read the model
    behind the batched runner's back, and FedAvg's finish may always take the weights-only path."""
    given = []

    class Probing(FedAvg):
        def make_upload(self, ctx, weights):
            given.append(weights)
            return super().make_upload(ctx, weights)

    cfg = validate_experiment(tiny_config())
    rt, ctxs, plans = _plans(cfg, [3])
    with rt:
        plan = Probing(cfg, rt.worker.algo.spec).client_update(ctxs[0], rt.server.payload(0)[0], None)
        assert is_weights_only(plan.finish)
        result = run_update(ctxs[0], plan)
    assert len(given) == 1 and result.upload.weights is given[0]
    assert set(given[0]) == set(plan.model.state_dict()) and all(isinstance(v, torch.Tensor) for v in given[0].values())


def test_a_weights_only_finish_gets_each_clients_weights_from_one_host_copy():
    """Batched, FedAvg's finish is handed a stand-in holding the client's trained weights (not the module loaded
    with them), with the same upload as the module path; the upload's tensors own their memory (pickled, an
    upload is one model, not the round's stacked copy)."""
    cfg = validate_experiment(tiny_config(runtime__vectorize=True, model__name="resnet8_bn"))
    uploads, given = [], []
    for marked in (True, False):
        rt, ctxs, plans = _plans(cfg, [3, 4, 5])
        with rt:
            for p in plans:
                inner = p.finish
                p.finish = (lambda m, trained, f=inner: given.append((marked, m)) or f(m, trained))
                if marked:
                    weights_only(p.finish)
            uploads.append([r.upload.weights for r in train_vectorized(ctxs, plans)])
    assert all(isinstance(m, torch.nn.Module) is not marked for marked, m in given)
    for a, b in zip(*uploads):
        assert list(a) == list(b)  # state_dict order
        assert all(torch.equal(a[k], b[k]) for k in a)
        for t in a.values():
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    first = next(iter(uploads[0][0]))
    assert not torch.equal(uploads[0][0][first], uploads[0][1][first])  # each client's own weights


def test_stacked_optimizer_continues_a_saved_state_as_torch_optim_does():
    """FedKF's generator keeps its Adam moments across rounds: one client continues a saved state (3 steps
    taken), another starts fresh; each then moves as a torch.optim.Adam loaded with that state."""
    spec = OptimSpec("adam", 1e-2, betas=(0.5, 0.999))
    torch.manual_seed(1)
    w0, m0, v0 = torch.randn(2, 6), torch.randn(6) * 0.1, torch.rand(6) * 0.01
    grads = [torch.randn(2, 6) for _ in range(3)]
    stacked = w0.clone().requires_grad_(True)
    sopt = StackedOptimizer({"g.w": stacked}, {"g.w": spec})
    sopt.load([{"g.w": {"step": 3, "exp_avg": m0, "exp_avg_sq": v0}}, {}])
    for g in grads:
        stacked.grad = g.clone()
        sopt.step(None)
    for k in range(2):
        w = w0[k].clone().requires_grad_(True)
        topt = torch.optim.Adam([w], lr=spec.lr, betas=spec.betas)
        if k == 0:
            saved = topt.state_dict()
            saved["state"] = {0: {"step": torch.tensor(3.0), "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}}
            topt.load_state_dict(saved)
        for g in grads:
            w.grad = g[k].clone()
            topt.step()
        torch.testing.assert_close(stacked.detach()[k], w.detach(), rtol=1e-6, atol=1e-7)
        kept = sopt.client_state(k)["g.w"]
        assert kept["step"] == (6 if k == 0 else 3)
        torch.testing.assert_close(kept["exp_avg"], topt.state[w]["exp_avg"], rtol=1e-6, atol=1e-8)


def test_fedkf_generators_carry_their_adam_state_into_the_next_round_when_batched():
    states, weights = [], []
    for vec in (False, True):
        cfg = validate_experiment(tiny_config(runtime__vectorize=vec, algorithm__name="fedkf", data__num_clients=3,
                                              federation__clients_per_round=3, federation__local_steps=3))
        data = build_federated_data(cfg.data, cfg.seed)
        with make_runtime(cfg, data) as rt:
            for r in (1, 2):
                rt.run_round(r, [0, 1, 2])
            states.append(rt.export_state().clients)
            weights.append({0: rt.global_weights()})
    for cid, seq in states[0].items():
        vec = states[1][cid]
        assert vec.rounds == seq.rounds == 2 and vec.adam_step == seq.adam_step == 6
        assert vec.adam_exp_avg.keys() == seq.adam_exp_avg.keys() == dict(vec.weights).keys() - {
            k for k in vec.weights if "running" in k or "num_batches" in k}
    _assert_same_weights(weights[0], weights[1])


def test_second_round_distils_too():
    """FedCD and FedDistill send a teacher from round 2 on: a KD loss batched over clients matches too."""
    for name in ("fedcd", "feddistill"):
        results = [run_experiment(tiny_config(runtime__vectorize=v, federation__rounds=2, **COVERED[name]),
                                  progress=False) for v in (False, True)]
        last = [r.history[-1] for r in results]
        assert last[1]["train/loss"] == pytest.approx(last[0]["train/loss"], rel=1e-4)
        assert "train/kd_loss" not in last[0] or last[1]["train/kd_loss"] == pytest.approx(last[0]["train/kd_loss"],
                                                                                          rel=1e-4)


@pytest.mark.parametrize("name", ["fedavg_batchnorm", "fedprox", "local_heterogeneous", "fedkf", "dafkd"])
def test_five_vectorised_rounds_reach_the_sequential_accuracy(name):
    acc = [run_experiment(tiny_config(runtime__vectorize=v, federation__rounds=5, **COVERED[name]),
                          progress=False).summary["eval/accuracy"] for v in (False, True)]
    assert abs(acc[1] - acc[0]) <= 0.005 + 1e-9, acc  # half a point: one test image of the tiny set's 200


def test_a_step_that_cannot_be_batched_runs_sequentially_under_vectorize():
    """DaFKD with the gradient penalty (a gradient inside the loss) has no batched form: vectorize=true runs it
    one client at a time, with the same numbers."""
    cfg = dict(**DAFKD, algorithm__gp_weight=0.3, federation__local_steps=2, federation__rounds=1)
    runs = [run_experiment(tiny_config(runtime__vectorize=v, **cfg), progress=False) for v in (False, True)]
    untimed = [{k: v for k, v in run.history[-1].items() if not k.startswith("time/")} for run in runs]
    assert untimed[0] == untimed[1]


def test_auto_vectorises_on_cuda_only_and_a_subclass_changing_the_update_is_never_bypassed():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert vectorize_enabled("auto", cuda) and not vectorize_enabled("auto", cpu)
    assert vectorize_enabled(True, cpu) and not vectorize_enabled(False, cuda)
    assert tiny_config(runtime__vectorize="true").runtime.vectorize is True

    class Altered(FedAvg):  # changes the update after its parent's training: runs as written, never batched past
        name = "test_altered"

        def client_update(self, ctx, payload, state):
            result = run_update(ctx, super().client_update(ctx, payload, state))
            return ClientResult(result.upload, None, {**result.metrics, "test/altered": 1.0})

    cfg = validate_experiment(tiny_config(runtime__vectorize=True, federation__rounds=1))
    with make_runtime(cfg, build_federated_data(cfg.data, cfg.seed)) as rt:
        rt.worker.algo = Altered(cfg, rt.worker.algo.spec)
        rt.worker.vectorize_min = 1
        done = rt.worker.train_many(1, [3, 4], rt.server.payload(0)[0], [None, None])
    assert [info["test/altered"] for _, _, info, _ in done] == [1.0, 1.0]


@pytest.mark.parametrize("setting, min_clients, batched, said", [
    ("auto", 4, False, ", vectorised clients (from 4 per worker)"),
    ("auto", 3, True, ", vectorised clients (from 3 per worker)"),
    (True, 4, True, ", vectorised clients")])
def test_auto_trains_too_few_clients_one_by_one(monkeypatch, setting, min_clients, batched, said):
    import fedray.runtime.core as core

    calls = []
    monkeypatch.setattr(core, "train_vectorized", lambda ctxs, plans, **kw: calls.append(len(ctxs)) or
                        train_vectorized(ctxs, plans, **kw))
    cfg = validate_experiment(tiny_config(runtime__vectorize=setting, runtime__vectorize_min_clients=min_clients))
    data = build_federated_data(cfg.data, cfg.seed)
    with make_runtime(cfg, data) as rt:
        rt.worker.vectorize = True  # as on a CUDA device, where auto turns it on
        assert rt.describe().endswith(said)
        rt.run_round(1, sample_clients(cfg.seed, 1, data.num_clients, cfg.federation.clients_per_round))
    assert calls == ([3] if batched else [])  # the round's 3 clients, batched or one by one


@pytest.mark.ray
def test_ray_batches_a_workers_clients_with_the_in_process_numbers(ray_local):
    """One local epoch of batch 30 over unequal clients (2-4 steps): a worker's round runs as phases, the one whose
    step is split padded under BatchNorm, in a Ray actor as in-process."""
    cfg = dict(runtime__vectorize=True, model__name="resnet8_bn", federation__rounds=2, federation__local_epochs=1,
               federation__batch_size=30)
    local = run_experiment(tiny_config(**cfg), progress=False)
    on_ray = run_experiment(tiny_config(runtime__backend="ray", runtime__num_workers=2, **cfg), progress=False)
    for a, b in zip(local.history, on_ray.history):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4)
        assert b["eval/accuracy"] == pytest.approx(a["eval/accuracy"], abs=0.01)


@pytest.mark.parametrize("kw, replayed", [
    (dict(), 0.5),  # 4 steps: 2 eager, then captured and replayed twice
    (COVERED["fedavg_sgd_momentum"], 0.5),
    (COVERED["fedprox"], 0.5),
    (dict(federation__local_steps=3), 0.0),  # one step left after the warm-up: not worth a capture
    (COVERED["fedavg_adam"], 0.5),  # Adam: its step counts on the device (on the host on a CPU)
    (COVERED["fedavg_batchnorm"], 0.0),  # client 3's short third batch, unpadded under BatchNorm, splits step 2
    # 35, 114, 70 samples in batches of 48: the third step is client 4's alone
    (COVERED["fedavg_unequal_epochs"], 0.0),
    (COVERED["fedkf"], 0.0),  # step 2 split by client 3's short batch (the generator's BatchNorm), then one left
    # batches of 5 are all full: two updates a step (Adam for the generator), noise drawn on the host
    (dict(COVERED["fedkf"], federation__batch_size=5), 0.5),
    (dict(COVERED["dafkd"], federation__batch_size=5), 0.5),
    (dict(COVERED["dafkd_conditional_bn_adam"], federation__batch_size=5), 0.5),  # and the generator's labels
    (dict(COVERED["dafkd"], federation__batch_size=5, runtime__precision="bf16"), 0.5),  # the casts replayed too
])
def test_a_step_replayed_from_the_graph_gives_the_eager_numbers(graphs_on_cpu, kw, replayed):
    eager_w, eager_info = _one_round(True, runtime__cuda_graphs=False, **kw)
    graph_w, graph_info = _one_round(True, **kw)
    for cid in eager_w:
        assert all(torch.equal(eager_w[cid][k], graph_w[cid][k]) for k in eager_w[cid])
    for e, g in zip(eager_info, graph_info):
        assert g["train/loss"] == e["train/loss"] and g["vec/groups_per_step"] == e["vec/groups_per_step"]
        assert g.get("vec/graph_steps") == replayed and "vec/graph_steps" not in e


def test_a_plan_without_a_run_of_its_own_replays_its_steps_from_the_graph_when_trained_alone(graphs_on_cpu,
                                                                                               monkeypatch):
    """runtime.vectorize=false: a plan with no sequential run of its own (DaFKD's, its ``alone`` taken away, as a
    user's method may write it) goes through the engine one client at a time (``ClientWorkerCore._alone``), its
    steps replayed from the graph as in a batched round, to the eager numbers."""
    import dataclasses

    from fedray.methods.dafkd.method import DaFKD

    with_its_run = DaFKD.client_update
    monkeypatch.setattr(DaFKD, "client_update", lambda self, ctx, payload, state: dataclasses.replace(
        with_its_run(self, ctx, payload, state), alone=None))
    kw = dict(COVERED["dafkd"], federation__batch_size=5)
    eager_w, eager_info = _one_round(False, runtime__cuda_graphs=False, **kw)
    graph_w, graph_info = _one_round(False, **kw)
    for cid in eager_w:
        assert all(torch.equal(eager_w[cid][k], graph_w[cid][k]) for k in eager_w[cid])
    assert [g.get("vec/graph_steps") for g in graph_info] == [0.5] * len(graph_info)
    assert not any("vec/graph_steps" in e for e in eager_info)


def test_a_step_that_does_not_fit_the_graph_runs_eagerly_and_the_graph_is_kept(graphs_on_cpu):
    """8 steps of batch 16, unpadded, over 35, 114 and 70 samples: client 3's batches 2 and 5 are short, client
    5's batch 4 and client 4's batch 7, and each splits its step. Steps 0 and 1 are the warm-up, 2 splits, 3 is
    captured and replayed, 4 and 5 split and run eagerly, 6 is replayed again."""
    kw = dict(federation__local_steps=8, runtime__vectorize_pad=False)
    eager_w, _ = _one_round(True, runtime__cuda_graphs=False, **kw)
    graph_w, infos = _one_round(True, **kw)
    for cid in eager_w:
        assert all(torch.equal(eager_w[cid][k], graph_w[cid][k]) for k in eager_w[cid])
    assert [i["vec/graph_steps"] for i in infos] == [2 / 8] * 3


def test_the_graph_is_dropped_once_an_eager_step_replaced_the_optimizer_state(graphs_on_cpu):
    class Opt:  # a stand-in for StackedOptimizer: uniform, its state one tensor
        def __init__(self):
            self.state, self.counted = [torch.zeros(2)], 0

        def uniform(self):
            return True

        def state_tensors(self):
            return self.state

        def count(self, left_out=None):
            self.counted += 1

    ran = []
    graph, opt = StepGraph(torch.device("cpu"), lambda key, inp: ran.append(inp["index"].tolist())), Opt()
    steps = [graph.step(("flags",), {"index": torch.tensor([s])}, [opt], 10 - s) for s in range(4)]
    assert steps == [False, False, True, True] and ran == [[2], [3]] and opt.counted == 2
    opt.state = [torch.zeros(2)]  # as a parameter first stepped after the capture gets new state
    assert not graph.step(("flags",), {"index": torch.tensor([4])}, [opt], 6) and graph.graph.dropped
    assert ran == [[2], [3]] and opt.counted == 2


def test_a_step_that_cannot_be_captured_runs_eagerly_with_a_warning(monkeypatch, caplog):
    def refuse(body, stream):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "GRAPH_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(cuda_graphs, "capture", refuse)
    eager_w, _ = _one_round(True, runtime__cuda_graphs=False)
    with caplog.at_level("WARNING", logger="fedray"):
        graph_w, infos = _one_round(True)
    assert all(torch.equal(eager_w[0][k], graph_w[0][k]) for k in eager_w[0])
    assert [i["vec/graph_steps"] for i in infos] == [0.0] * 3
    assert "could not be captured as a CUDA graph" in caplog.text and "not permitted" in caplog.text


def test_no_graph_on_a_cpu():
    _, infos = _one_round(True)
    assert all("vec/graph_steps" not in i for i in infos)


@contextmanager
def float64_runs(monkeypatch):
    """Runs in float64 inside: models built in it and every method's normalised batches (each fedray module's
    ``to_float``, patched, restored by ``monkeypatch``)."""
    to_float = fed_data.to_float
    list(ALGORITHMS.values())  # every method's module imported now, so each one's to_float is patched and restored
    for module in [m for n, m in sys.modules.items() if n.startswith("fedray.") and vars(m).get("to_float") is to_float]:
        monkeypatch.setattr(module, "to_float", lambda x, mean, std: to_float(x, mean, std).double())
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


def _max_relative_difference(a: dict, b: dict) -> float:
    """max |a - b| / max |a| over the floats of two models' weights."""
    keys = [k for k in a if torch.is_floating_point(a[k])]
    return (max(float((a[k].double() - b[k].double()).abs().max()) for k in keys)
            / max(float(a[k].double().abs().max()) for k in keys))


@pytest.mark.parametrize("kw, tolerance", [
    (dict(runtime__vectorize_pad=False, federation__momentum=0.9, federation__weight_decay=1e-3), 1e-6),
    (dict(runtime__vectorize_pad=False, federation__optimizer="adam", federation__lr=1e-3), 1e-6),
    # two updates a step, Adam for the generator (BatchNorm), noise drawn on the host (unpadded: padded, the round
    # would be one group a step)
    (dict(COVERED["dafkd"], runtime__vectorize_pad=False), 1e-6),
    # a ResNet's BatchNorm over 5-row batches amplifies rounding (BN_ROUNDING) here too (unpadded: padded, this
    # round would be one group a step, as the next test shows)
    (dict(model__name="resnet8_bn", federation__momentum=0.9, federation__weight_decay=1e-3,
          runtime__vectorize_pad=False), BN_ROUNDING),
])
def test_a_masked_graph_replays_split_steps_with_the_eager_numbers(graphs_on_cpu, kw, tolerance):
    """Batches of 30 over 35, 114 and 70 samples, unpadded: steps 1, 2, 3, 5 and 7 of 8 are split by a short
    batch, so the round's graph is masked. Steps 0 and 1 are the warm-up; from step 2 every step is replayed, the
    clients of a split step's short batches put back and then stepped eagerly. The replay runs the other clients
    in a larger vmapped call than the eager step's group: the same numbers up to float rounding."""
    kw = dict(kw, federation__local_steps=8, federation__batch_size=30)
    eager_w, eager_info = _one_round(True, runtime__cuda_graphs=False, **kw)
    graph_w, graph_info = _one_round(True, **kw)
    for cid in eager_w:
        assert _max_relative_difference(eager_w[cid], graph_w[cid]) <= tolerance
        assert all(torch.equal(eager_w[cid][k], graph_w[cid][k]) for k in eager_w[cid] if "num_batches" in k)
    for e, g in zip(eager_info, graph_info):
        assert g["train/loss"] == pytest.approx(e["train/loss"], rel=10 * tolerance)
        assert g["vec/groups_per_step"] == e["vec/groups_per_step"] > 1.5 and g["vec/graph_steps"] == 6 / 8


@pytest.mark.parametrize("kw", [dict(model__name="resnet8_bn", federation__momentum=0.9), DAFKD])
def test_a_padded_batchnorm_round_is_one_call_a_step_and_replays_as_a_plain_graph(graphs_on_cpu, kw):
    """The batches of the test above, padded: its BatchNorm layers normalise by the real rows, each step is one
    vmapped call, and every step from the third is replayed by the plain graph, with the eager steps' numbers."""
    kw = dict(kw, federation__local_steps=8, federation__batch_size=30)
    eager_w, eager_info = _one_round(True, runtime__cuda_graphs=False, **kw)
    graph_w, graph_info = _one_round(True, **kw)
    assert all(torch.equal(eager_w[0][k], graph_w[0][k]) for k in eager_w[0])
    assert [i["vec/groups_per_step"] for i in eager_info] == [1.0] * 3
    assert [(i["vec/groups_per_step"], i["vec/graph_steps"]) for i in graph_info] == [(1.0, 6 / 8)] * 3
    # the padding's BatchNorm masking is the round's only: the worker's modules are plain BatchNorm again
    data = build_federated_data(validate_experiment(tiny_config(**kw)).data, 0)
    with make_runtime(validate_experiment(tiny_config(runtime__vectorize=True, **kw)), data) as rt:
        rt.run_round(1, [3, 4, 5])
        modules = rt.worker.modules
        norms = [m for part in (modules.model, getattr(modules, "generator", modules.model)) for m in part.modules()
                 if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        assert norms and not any("forward" in vars(m) for m in norms)


@pytest.mark.parametrize("kw", [
    COVERED["fedavg_batchnorm_padded"],
    *[dict(DAFKD, algorithm__diag_samples=0, federation__batch_size=30, **extra) for extra in (
        {},  # LeNet-5, the DCGAN generator's BatchNorm
        dict(algorithm__generator="conditional", algorithm__sharing=False),  # a discriminator of its own
        dict(algorithm__generator="conditional", model__name="resnet8_bn", federation__optimizer="adam",
             federation__lr=1e-3))],
    dict(COVERED["dafkd_padded_one_sample"], algorithm__diag_samples=0),
    # FedKF: the DAFL generator's BatchNorm makes a round of 3 split steps in 4 padded; in float32 these batches of 30
    # put it 2e-4 from the sequential runner, padded or not (the generator's bias noise, see COVERED["fedkf"])
    *[dict(algorithm__name="fedkf", algorithm__gen_width=16, federation__batch_size=30, **extra)
      for extra in ({}, dict(model__name="resnet8_bn"))],
    # FedGKD: its distillation term's mean over the real rows (the padded ones copy a real image, so their KL is not 0)
    *[dict(algorithm__name="fedgkd", federation__batch_size=30, **extra) for extra in ({}, dict(model__name="resnet8_bn"))],
    # FedD3A's heterogeneous clients distil from the global model, FedDistill's (round 2) from the label logits
    dict(COVERED["fedd3a_heterogeneous"], federation__batch_size=30),
    dict(COVERED["feddistill"], federation__batch_size=30, rounds=2),
    # phases (clients done early, 12, 32 and 20 steps): weights, optimizer state and sums carried between them
    *[dict(kw, federation__local_epochs=4, federation__batch_size=16, federation__momentum=0.9) for kw in (
        dict(model__name="resnet8_bn"), dict(DAFKD, algorithm__diag_samples=0))],
    # the second local epoch without the GAN (gan_local_epochs=1): its steps mask the classifier's BatchNorm alone
    pytest.param(dict(DAFKD, algorithm__diag_samples=0, model__name="resnet8_bn", federation__batch_size=30,
                      federation__local_epochs=2, algorithm__gan_local_epochs=1), id="dafkd_bn_past_its_gan_epochs")])
def test_a_padded_round_is_exact_in_double_precision(monkeypatch, kw):
    """In float32 a padded round sits 1e-7-1e-4 from the sequential one, as far as BatchNorm over a few rows
    amplifies rounding (an unpadded vectorised round too); in float64 the amplified rounding is ~1e-16, so a padded
    row that leaks into a real one (statistics, a loss's mean, a discriminator's count) would show. (DaFKD's
    diag/* probe holds float32 images: off.)"""
    with float64_runs(monkeypatch):
        seq_w, seq_info = _one_round(False, **kw)
        vec_w, vec_info = _one_round(True, **kw)
    if "algorithm__gan_local_epochs" not in kw:  # there, clients in and out of their GAN epoch split steps by flags
        assert [i["vec/groups_per_step"] for i in vec_info] == [1.0 if "federation__local_epochs" not in kw else 35 / 32] * 3
    for c in seq_w:
        assert all(v.dtype == torch.float64 for v in seq_w[c].values() if torch.is_floating_point(v))
        assert _max_relative_difference(seq_w[c], vec_w[c]) < 1e-12
    for s, v in zip(seq_info, vec_info):
        assert all(v[k] == pytest.approx(s[k], rel=1e-12) for k in s if k.startswith("train/")), (s, v)


@pytest.mark.parametrize("kw, replayed, calls", [
    # each phase one call a step; the last phase's two 2-row batches do not fit its graph: 10 + 6 + 8 replayed
    (dict(federation__momentum=0.9), 24, 32),
    # BatchNorm: 7 of phase 1's 12 steps split, so it is padded; 3 of phase 2's 8, so it is not (3 calls more)
    (dict(model__name="resnet8_bn"), 21, 35),
    (DAFKD, 21, 35)])
def test_clients_done_early_leave_the_others_a_lockstep_and_a_graph_of_their_own(graphs_on_cpu, kw, replayed, calls):
    """4 local epochs of batch 16 over 35, 114 and 70 samples: 12, 32 and 20 steps. The round runs as three phases
    (3 clients for 12 steps, 2 for 8, 1 for 12), each replayed from a graph of its own after two eager steps. (As
    one lockstep, the finished clients masked, a graph replayed 10 of the 32 steps, and 3 under BatchNorm.) Each
    client's figures and weights are those of its eager steps, and within rounding those of the sequential runner."""
    kw = dict(kw, federation__local_epochs=4, federation__batch_size=16)
    eager_w, eager_info = _one_round(True, runtime__cuda_graphs=False, **kw)
    graph_w, graph_info = _one_round(True, **kw)
    assert all(torch.equal(eager_w[0][k], graph_w[0][k]) for k in eager_w[0])
    assert [(i["vec/graph_steps"], i["vec/groups_per_step"]) for i in graph_info] == [(replayed / 32, calls / 32)] * 3
    assert [i["train/loss"] for i in graph_info] == [i["train/loss"] for i in eager_info]
    if kw.get("model__name") == "resnet8_bn":  # 32 steps of BatchNorm on 3-row batches amplify rounding to 3e-3,
        return  # so its phases are checked against the sequential runner in float64 (the next test)
    seq_w, seq_info = _one_round(False, **kw)
    assert _max_relative_difference(seq_w[0], eager_w[0]) <= 1e-4
    for s, v in zip(seq_info, eager_info):
        assert s["client"] == v["client"]
        assert all(v[k] == pytest.approx(s[k], rel=1e-4) for k in s if k.startswith("train/")), (s, v)
