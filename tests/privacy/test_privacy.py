"""Client-level DP (``privacy.*``): the clip, the noise's scale, the accountant against an independent computation,
the budget's stop, and runs with privacy on resumed exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedray.channel.message import Leaf
from fedray.errors import ConfigError
from fedray.methods import validate_experiment
from fedray.privacy.accounting import amplification, epsilon, last_round
from fedray.privacy.stages import CentralNoise, Clip, LocalNoise
from fedray.simulation import run_experiment
from tests.conftest import cores, tiny_config
from tests.test_every_method import CrashAfter, _Crash, _figures


def _leaves(updates: list[list[float]], values: list[list[float]], reference: list[float]) -> list[Leaf]:
    """A batch of messages: a model leaf (rows ``reference`` + update) and a values leaf."""
    ref = torch.tensor(reference)
    model = torch.stack([ref + torch.tensor(u) for u in updates])
    return [Leaf(("w",), "model", model, torch.float32, tuple(ref.shape), ("w",), ref),
            Leaf(("z",), "values", torch.tensor(values), torch.float32, (len(values[0]),))]


def test_the_clip_scales_each_whole_upload_to_norm_c_keeping_its_direction():
    """Row 0: update (3, 0) and values (4,), norm 5 over both leaves, clipped to C = 1: (0.6, 0) and (0.8,), the
    model leaf back on its reference. Row 1: norm 0.5 <= C, sent as it is."""
    leaves = _leaves([[3.0, 0.0], [0.3, 0.0]], [[4.0], [0.4]], [10.0, -1.0])
    out, _ = Clip(1.0).client_encode(leaves, [None, None], [(1, 0), (1, 1)])
    assert torch.allclose(out[0].data, torch.tensor([[10.6, -1.0], [10.3, -1.0]]))
    assert torch.allclose(out[1].data, torch.tensor([[0.8], [0.4]]))


def test_the_noise_std_is_sigma_c_over_the_fixed_denominator_central_and_sigma_c_per_upload_local():
    """Zero updates from a reference of 3s: central, (sum + N(0, (sigma C)^2)) / m over 200,000 coordinates has std
    sigma C / m (within 1 %) whatever the uploads' count and weights; local, each upload's noise std sigma C, the two
    clients' draws independent, the same when a client is encoded alone."""
    d, sigma, clip, m = 200_000, 2.0, 0.5, 4
    central = CentralNoise(clip, sigma, m, seed=7)
    central.start_step(3)
    ref = {"w": torch.full((d,), 3.0)}
    out = central.mean([ref, ref], [10.0, 1.0], reference=ref)["w"] - 3.0
    assert out.mean().abs() < 0.01 and out.std().item() == pytest.approx(sigma * clip / m, rel=0.01)
    local = LocalNoise(clip, sigma, seed=7)
    leaves = [Leaf(("w",), "model", torch.full((2, d), 3.0), torch.float32, (d,), ("w",), torch.full((d,), 3.0))]
    noised, _ = local.client_encode(leaves, [None, None], [(3, 0), (3, 1)])
    noise = noised[0].data - 3.0
    assert [n.std().item() == pytest.approx(sigma * clip, rel=0.01) for n in noise] == [True, True]
    assert abs(torch.corrcoef(noise)[0, 1].item()) < 0.01
    alone, _ = local.client_encode([Leaf(("w",), "model", torch.full((1, d), 3.0), torch.float32, (d,), ("w",),
                                         torch.full((d,), 3.0))], [None], [(3, 1)])
    assert torch.equal(alone[0].data[0], noised[0].data[1])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # Opacus's PRV takes log(0) at q = 1 on its way
def test_epsilon_matches_opacus_like_with_like():
    """The unamplified Gaussian mechanism composed 50 times (sigma 1.2, delta 1e-5): dp-accounting's RDP against
    Opacus's RDP analysis at q = 1, and dp-accounting's PLD against Opacus's PRV accountant, each within 1 %."""
    from opacus.accountants import PRVAccountant
    from opacus.accountants.analysis import rdp as opacus_rdp

    cfg = tiny_config(privacy__mechanism="central", privacy__noise_multiplier=1.2, privacy__accountant="rdp",
                      system__devices="uniform")
    assert not amplification(cfg)[0]  # the simulated system decides who arrives
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    theirs = opacus_rdp.get_privacy_spent(orders=orders, rdp=opacus_rdp.compute_rdp(
        q=1.0, noise_multiplier=1.2, steps=50, orders=orders), delta=1e-5)[0]
    assert epsilon(cfg, 50) == pytest.approx(theirs, rel=0.01)
    prv = PRVAccountant()
    prv.history = [(1.2, 1.0, 50)]
    pld = cfg.model_copy(update={"privacy": cfg.privacy.model_copy(update={"accountant": "pld"})})
    assert epsilon(pld, 50) == pytest.approx(prv.get_epsilon(delta=1e-5, eps_error=0.01), rel=0.01)


def test_amplification_only_for_a_uniform_fixed_size_cohort_and_the_replace_one_sensitivity():
    """6 of 60 clients drawn uniformly a round: amplified (replace-one, the relation sampling without replacement
    assumes), and cheaper than every client every round; local noise and a full cohort are not amplified; epsilon
    grows with the steps from 0."""
    base = dict(privacy__mechanism="central", privacy__noise_multiplier=2.0)
    sampled = tiny_config(**base, data__num_clients=60, federation__clients_per_round=6)
    assert amplification(sampled) == (True, amplification(sampled)[1]) and "replace-one" in amplification(sampled)[1]
    every = tiny_config(**base, data__num_clients=6, federation__clients_per_round=6)
    assert not amplification(every)[0]
    assert not amplification(tiny_config(**{**base, "privacy__mechanism": "local"}))[0]
    assert epsilon(sampled, 10) < epsilon(every, 10)
    assert [epsilon(sampled, t) for t in (0, 1, 2)] == sorted(epsilon(sampled, t) for t in (0, 1, 2))
    assert epsilon(sampled, 0) == 0.0


def test_target_epsilon_stops_the_run_finished_after_the_last_round_within_it(tmp_path):
    """A target between epsilon after 2 and after 3 rounds: 2 rounds of 5 run, the second evaluated as the last, the
    run's folder finished with its epsilon column."""
    cfg = tiny_config(privacy__mechanism="central", privacy__noise_multiplier=3.0, federation__rounds=5,
                      federation__eval_every=5)
    target = (epsilon(cfg, 2) + epsilon(cfg, 3)) / 2
    cfg = validate_experiment(tiny_config(privacy__mechanism="central", privacy__noise_multiplier=3.0,
                                          federation__rounds=5, federation__eval_every=5,
                                          privacy__target_epsilon=target))
    assert last_round(cfg) == 2
    result = run_experiment(cfg, tmp_path / "run", progress=False)
    assert [r["round"] for r in result.history] == [1, 2]
    assert result.history[-1]["eval/accuracy"] is not None and result.history[0]["eval/accuracy"] is None
    assert [r["privacy/epsilon"] for r in result.history] == [epsilon(cfg, 1), epsilon(cfg, 2)]
    assert (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize("mechanism,adaptive", [("central", True), ("local", False)])
def test_a_private_run_resumed_gives_the_uninterrupted_history(mechanism, adaptive, tmp_path):
    """The noise's streams and the adaptive clip's server state (checkpointed with the channel's) resume exactly; the
    local case with DP-SGD on Poisson batches too (their draws and noise are each round's client streams)."""
    extra = ({"privacy__adaptive_clip": True, "privacy__count_noise": 1.0} if adaptive else
             {"privacy__sample_clip": 1.0, "privacy__sample_noise": 0.5, "privacy__sample_batches": "poisson"})
    cfg = tiny_config(privacy__mechanism=mechanism, privacy__clip=0.5, privacy__noise_multiplier=0.01,
                      federation__rounds=3, runtime__checkpoint_every=1, **extra)
    whole = run_experiment(cfg, progress=False)
    with pytest.raises(_Crash):
        run_experiment(cfg, tmp_path / "run", progress=False, hooks=[CrashAfter(2)])
    resumed = run_experiment(cfg, tmp_path / "run", progress=False, resume_from=tmp_path / "run")
    assert _figures(resumed.history) == _figures(whole.history)
    plain = run_experiment(tiny_config(federation__rounds=3), progress=False)
    assert whole.history[-1]["eval/accuracy"] != plain.history[-1]["eval/accuracy"] or \
        whole.history[-1]["train/loss"] != plain.history[-1]["train/loss"]  # the mechanism changed the run


def test_central_noise_is_refused_where_a_mean_is_not_of_updates_from_the_model_sent():
    for overrides, key in [({"algorithm__name": "scaffold"}, "privacy.mechanism"),
                           ({"algorithm__report_model": "oca"}, "privacy.mechanism")]:
        with pytest.raises(ConfigError) as e:
            validate_experiment(tiny_config(privacy__mechanism="central", **overrides))
        assert e.value.key == key and "privacy.mechanism=local" in str(e.value) and "\n" not in str(e.value)
    assert math.isinf(epsilon(tiny_config(privacy__mechanism="local", privacy__noise_multiplier=0.0), 1))


@pytest.mark.parametrize("case", ["fedavg", "fedprox", "feddistill", "fedcd", "fedd3a", "fedkf", "dafkd",
                                  "dafkd-private", "fedgen"])
def test_the_methods_run_two_rounds_with_local_noise_on_every_upload(case):
    """Local noise protects every message a method sends through the channel (models, logits, generators,
    discriminators); a loose clip and little noise, so the runs stay finite: every upload arrives and is kept."""
    from tests.conftest import method_config

    history = run_experiment(method_config(case, federation__rounds=2, federation__local_steps=1,
                                           privacy__mechanism="local", privacy__clip=10.0,
                                           privacy__noise_multiplier=1e-4), progress=False).history
    assert [r["health/rejected_updates"] for r in history] == [0.0, 0.0]
    assert [r["privacy/epsilon"] > 0 for r in history] == [True, True]


def test_under_local_noise_sample_counts_are_not_sent_and_label_histograms_are_noised_as_counts():
    """A FedGen upload through the local noise stage: its sample count leaves as 1; its label histogram (30, 40) is
    scaled to norm K = 10 ((6, 8): proportions kept) and noised with std sigma_k K, rounded and floored at 0: over
    4,000 labels of 2,500 each, within K = 10^6, the noise's std is sigma_k K = 500 within 2 %. The accountant's z
    covers both releases: the updates' multiplier is (z^-2 - sigma_k^-2)^-1/2; a histogram of a method that does not
    declare it is refused, as is DaFKD's Theorem 1 oracle (set-up counts)."""
    from fedray.errors import RunFailure
    from fedray.methods.fedavg import LabelCountUpload
    from fedray.privacy.accounting import update_noise_multiplier

    upload = LabelCountUpload(weights={}, num_samples=7, label_counts=torch.tensor([30, 40]))
    quiet = LocalNoise(1.0, 1.0, seed=0, counts_clip=10.0, counts_sigma=1e-9).client_message(upload, (1, 0))
    assert quiet.num_samples == 1 and quiet.label_counts.tolist() == [6, 8] and quiet.label_counts.dtype == torch.int64
    big = LabelCountUpload(weights={}, num_samples=7, label_counts=torch.full((4000,), 2500))
    sent = LocalNoise(1.0, 1.0, seed=0, counts_clip=1e6, counts_sigma=5e-4).client_message(big, (1, 0))
    assert (sent.label_counts.double() - 2500).std().item() == pytest.approx(500, rel=0.02)
    with pytest.raises(RunFailure, match="label histograms its method does not declare"):
        LocalNoise(1.0, 1.0, seed=0).client_message(upload, (1, 0))
    cfg = tiny_config(privacy__mechanism="local", privacy__noise_multiplier=2.0, privacy__histogram_noise=4.0)
    assert update_noise_multiplier(cfg, histograms=True) == pytest.approx((2.0 ** -2 - 4.0 ** -2) ** -0.5)
    assert update_noise_multiplier(cfg) == 2.0
    with pytest.raises(ConfigError, match="^privacy.mechanism: 'dafkd' with these parameters reads every client's"):
        validate_experiment(tiny_config(algorithm__name="dafkd", algorithm__generator="conditional",
                                        algorithm__alpha_source="theorem1", privacy__mechanism="local"))


def test_the_membership_auc_by_hand():
    """Members' losses (0.1, 0.2) against non-members' (0.15, 0.3, 0.3): a lower loss reads as a member; of the 6
    pairs the members win 5 (0.2 loses to 0.15): 5/6. A tie counts half."""
    from fedray.privacy.audit import membership_auc

    assert membership_auc(np.array([0.1, 0.2]), np.array([0.15, 0.3, 0.3])) == pytest.approx(5 / 6)
    assert membership_auc(np.array([0.3]), np.array([0.3])) == 0.5


def test_the_membership_audit_sees_an_overfitted_model_and_not_one_trained_under_strong_dp():
    """Two clients of 30 examples each, 150 local Adam steps a round: the model memorises them (the audit's AUC on
    them against the test set well above 0.5); the same under central noise at a clip of 0.01 learns nothing and the
    audit cannot tell members (AUC within 0.02 of 0.5). Isolated training (each client its own model, audited on
    its own members) memorises them too."""
    base = dict(data__num_clients=2, federation__clients_per_round=2, data__synthetic_train_samples=60,
                federation__local_steps=150, federation__optimizer="adam", federation__lr=0.005,
                privacy__mia_samples=1000)
    plain = run_experiment(tiny_config(**base), progress=False).history
    private = run_experiment(tiny_config(**base, privacy__mechanism="central", privacy__clip=0.01,
                                         privacy__noise_multiplier=1.0), progress=False).history
    assert plain[-1]["diag/mia_auc"] > 0.6
    assert abs(private[-1]["diag/mia_auc"] - 0.5) < 0.02
    own = run_experiment(tiny_config(**base, algorithm__name="local", federation__rounds=1), progress=False).history
    assert own[-1]["diag/mia_auc"] > 0.6


def test_an_auto_noise_multiplier_is_the_smallest_that_keeps_the_run_within_its_target():
    from fedray.privacy.accounting import noise_multiplier

    cfg = validate_experiment(tiny_config(privacy__mechanism="central", privacy__noise_multiplier="auto",
                                          privacy__target_epsilon=4.0, federation__rounds=20, data__num_clients=60,
                                          federation__clients_per_round=6))
    sigma = noise_multiplier(cfg)
    fixed = cfg.model_copy(update={"privacy": cfg.privacy.model_copy(update={"noise_multiplier": sigma * 0.99})})
    assert epsilon(cfg, 20) <= 4.0 < epsilon(fixed, 20) and last_round(cfg) == 20
    with pytest.raises(ConfigError, match="privacy.noise_multiplier: auto derives sigma"):
        tiny_config(privacy__mechanism="central", privacy__noise_multiplier="auto")


def test_the_adaptive_clip_moves_by_the_noised_count_of_clients_within_it():
    """Andrew et al.'s step by hand: 3 of 4 uploads within the clip, no count noise: b = (3 - 4/2) / 4 + 1/2 = 0.75,
    C' = C exp(-0.2 (0.75 - 0.5)); each message tells whether its norm is within the clip the payload announced."""
    from fedray.privacy.stages import Adaptive

    clip = Clip(2.0, Adaptive(quantile=0.5, lr=0.2, count_std=0.0, expected=4, seed=0))
    assert clip.announce(None) == {"clip": 2.0}
    told = [{"clip/within": b} for b in (1.0, 1.0, 1.0, 0.0)]
    assert clip.hear({"clip": 3.0}, told, 1)["clip"] == pytest.approx(3.0 * math.exp(-0.2 * 0.25))
    leaves = _leaves([[3.0, 0.0], [0.3, 0.0]], [[4.0], [0.4]], [10.0, -1.0])
    assert clip.tell(leaves, [(1, 0), (1, 1)], {"clip": 1.0}) == [{"clip/within": 0.0}, {"clip/within": 1.0}]
    assert clip.tell(leaves, [(1, 0), (1, 1)], {"clip": 6.0}) == [{"clip/within": 1.0}, {"clip/within": 1.0}]
    out, _ = clip.client_encode(leaves, [None, None], [(1, 0), (1, 1)], heard={"clip": 0.25})
    # the announced clip, not the start's: norms 5 and 0.5 scaled to 0.25, their values leaf 4 x 0.05, 0.4 x 0.5
    assert torch.allclose(out[1].data, torch.tensor([[0.2], [0.2]]))


def test_with_every_update_within_a_large_clip_the_clip_falls_geometrically_to_the_norms(monkeypatch):
    """From C = 100, above every update: each round the count says all within (b ~ 1), so C shrinks by about
    exp(-eta / 2) a round until it meets the updates' norms; the clip the uploads met is logged (privacy/clip), and
    the server's noise of each step is sigma times that clip, not the start's."""
    from fedray.privacy.stages import CentralNoise

    stds, start_step = [], CentralNoise.start_step

    def recorded(self, round_, announced=None):
        start_step(self, round_, announced)
        stds.append(self.std)

    monkeypatch.setattr(CentralNoise, "start_step", recorded)
    cfg = tiny_config(privacy__mechanism="central", privacy__noise_multiplier=0.001, privacy__clip=100.0,
                      privacy__adaptive_clip=True, privacy__clip_lr=1.0, privacy__count_noise=0.01, federation__rounds=4)
    clips = [r["privacy/clip"] for r in run_experiment(cfg, progress=False).history]
    assert clips[0] == 100.0 and all(0.59 < b / a < 0.63 for a, b in zip(clips, clips[1:]))  # exp(-1/2) = 0.607
    # the model's noise multiplier where the count's noise (std 0.01) takes its share: (sigma^-2 - (2 sigma_b)^-2)^-1/2
    sigma = (0.001 ** -2 - (2 * 0.01) ** -2) ** -0.5
    assert stds == pytest.approx([sigma * c for c in clips], rel=1e-12)
    # the 0.9 quantile: C shrinks by exp(-eta (1 - 0.9)) = 0.905 a round
    high = cfg.model_copy(update={"privacy": cfg.privacy.model_copy(update={"target_quantile": 0.9})})
    clips = [r["privacy/clip"] for r in run_experiment(high, progress=False).history]
    assert clips[0] == 100.0 and all(0.89 < b / a < 0.92 for a, b in zip(clips, clips[1:]))


def _dp_step(model, x, y, clip, noise, batches="passes", seed=0):
    """One DP-SGD step of SGD lr 1 on a flat linear ``model`` through the runtime's engine (x: uint8 rows read as
    x / 255): the gradient it took, start - trained."""
    import torch.nn.functional as F

    from fedray.learning.boundary import ClientContext, ClientResult, DataSpec
    from fedray.learning.training import LocalTraining
    from fedray.privacy.dpsgd import DPSGD
    from fedray.vectorized.engine import run_alone

    cfg = tiny_config(federation__lr=1.0, federation__momentum=0.0, federation__local_steps=1,
                      federation__batch_size=len(y), privacy__sample_clip=clip, privacy__sample_noise=noise,
                      privacy__sample_batches=batches)
    ctx = ClientContext(client_id=0, round=1, seed=seed, x=x, y=y, spec=DataSpec(tuple(x.shape[1:]), 4, 1, (0.0,),
                        (1.0,)), fed=cfg.federation, device=torch.device("cpu"), modules=None,
                        poisson_batches=batches == "poisson")
    start = {k: v.clone() for k, v in model.state_dict().items()}
    plan = LocalTraining(model=model, start=start, loss=lambda m, xb, yb: F.cross_entropy(m(xb.flatten(1)), yb),
                         finish=lambda m, trained: ClientResult(None, None, {"w": m.weight.detach().clone()}))
    trained = run_alone(ctx, plan, dp=DPSGD.of(cfg, [ctx])).metrics["w"]
    return start["weight"] - trained, ctx


def test_dp_sgd_clips_each_examples_gradient_by_hand_and_adds_noise_of_sigma_c_over_b():
    """A linear model under cross-entropy, one step of SGD lr 1 through the engine: with no noise, the step is the
    mean of the examples' own gradients (autograd one example at a time), each scaled to norm at most C; with a clip
    above every norm, the plain batch gradient. With zero inputs every example's gradient of the weight is 0 and the
    noise alone is left: std sigma C / B; with Poisson batches, sigma C over the expected size (q n = B)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4, bias=False)
    x, y = torch.randint(0, 256, (5, 1, 1, 3), dtype=torch.uint8), torch.tensor([0, 1, 2, 3, 0])
    xf = x.float().flatten(1) / 255
    own = []
    for i in range(5):
        model.zero_grad()
        F.cross_entropy(model(xf[i:i + 1]), y[i:i + 1]).backward()
        own.append(model.weight.grad.clone())
    clip = 0.2
    expected = sum(g * min(1.0, clip / g.norm().item()) for g in own) / 5
    start = model.weight.detach().clone()
    got, _ = _dp_step(model, x, y, clip, 0.0)
    assert torch.allclose(got, expected, atol=1e-6) and min(g.norm().item() for g in own) > clip  # every one clipped
    model.weight.data.copy_(start)
    model.zero_grad()
    F.cross_entropy(model(xf), y).backward()
    plain, _ = _dp_step(model, x, y, 1e6, 0.0)
    assert torch.allclose(plain, model.weight.grad, atol=1e-6)
    wide = torch.nn.Linear(500, 400, bias=False)
    zeros, labels = torch.zeros(8, 1, 1, 500, dtype=torch.uint8), torch.zeros(8, dtype=torch.long)
    noise, _ = _dp_step(wide, zeros, labels, 2.0, 3.0, seed=1)
    assert noise.std().item() == pytest.approx(3.0 * 2.0 / 8, rel=0.01)
    poisson, ctx = _dp_step(wide, torch.zeros(64, 1, 1, 500, dtype=torch.uint8),
                            torch.zeros(64, dtype=torch.long), 2.0, 3.0, "poisson", seed=1)
    assert poisson.std().item() == pytest.approx(3.0 * 2.0 / 64, rel=0.01)


@pytest.mark.parametrize("batches, poisson", [("poisson", True), ("passes", False)])
def test_a_worker_gives_its_clients_poisson_batches_only_where_dp_sgd_asks_for_them(batches, poisson):
    _, _, worker = cores(tiny_config(privacy__sample_clip=1.0, privacy__sample_noise=0.5,
                                     privacy__sample_batches=batches))
    assert worker._context(1, 0, None)[0].poisson_batches is poisson


def test_poisson_batches_draw_each_example_at_rate_b_over_n_and_amplify_the_accountant():
    """poisson: each step's batch is every example with probability B / n (400 steps of 16 of 200: sizes average
    16, vary, and every step draws afresh); the accountant composes the Poisson-sampled Gaussian over the client's
    steps, as Opacus's RDP analysis computes it (within 1 %), and far below the same steps without sampling; the
    noise calibrated for a target is the smallest that keeps the worst client within it."""
    from opacus.accountants.analysis import rdp as opacus_rdp

    from fedray.learning.boundary import ClientContext, DataSpec
    from fedray.privacy.dpsgd import sample_accountant, sample_epsilon, sample_noise_for

    fed = tiny_config(federation__local_steps=400, federation__batch_size=16).federation
    ctx = ClientContext(client_id=0, round=1, seed=0, x=torch.zeros(200, 1, 1, 1, dtype=torch.uint8),
                        y=torch.zeros(200, dtype=torch.long), spec=DataSpec((1, 1, 1), 2, 1, (0.0,), (1.0,)), fed=fed,
                        device=torch.device("cpu"), modules=None, poisson_batches=True)
    sizes = torch.tensor([len(i) for i in ctx.batch_plan().index]).float()
    assert sizes.mean().item() == pytest.approx(16, rel=0.05) and sizes.std().item() > 2
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    q, sigma, steps = 0.01, 1.1, 6000
    rdp = opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
    opacus_eps, _ = opacus_rdp.get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)
    assert sample_epsilon(sigma, 1e-5, steps, q) == pytest.approx(opacus_eps, rel=0.01)
    # clients of 200 and 50 with 16 a batch: rates 0.08 and 0.32, the smaller client the worst
    worst = sample_accountant(fed, [200, 50], 1.1, 1e-5, "poisson")
    assert worst(3) == sample_epsilon(1.1, 1e-5, 1200, 0.32) < sample_epsilon(1.1, 1e-5, 1200)
    # sigma for a target: the smallest whose worst client ends within it (dp-accounting's calibration, to 1e-4)
    sigma = sample_noise_for(fed, [200, 50], 1e-5, "poisson", 4.0, 3)
    assert 3.99 < sample_accountant(fed, [200, 50], sigma, 1e-5, "poisson")(3) <= 4.0
    assert sample_accountant(fed, [200, 50], sigma * 0.99, 1e-5, "poisson")(3) > 4.0


@pytest.mark.parametrize("case", ["fedavg", "fedkf", "dafkd", "fedgen"])
def test_dp_sgd_without_noise_and_a_clip_above_every_norm_is_the_plain_training(case):
    """Every update that reads the examples goes through the per-example path: with sigma 0 and a clip no example
    reaches, its gradient is the batch's, so the run's figures are the plain run's, alone and with the clients
    batched (runtime.vectorize); DaFKD's discriminator step splits its generated rows' share over the examples
    (``EXAMPLES``), its generator step and FedKF's run as usual, and FedGen's generated features of each example's
    label go with their example (``Update.paired``)."""
    from tests.conftest import method_config

    plain = run_experiment(method_config(case, federation__rounds=2), progress=False).history
    for vectorize in ("off", "on"):
        loose = run_experiment(method_config(case, federation__rounds=2, runtime__vectorize=vectorize,
                                             privacy__sample_clip=1e6, privacy__sample_noise=0.0),
                               progress=False).history
        for want, got in zip(plain, loose):
            keys = [k for k in want if k.startswith(("train/", "eval/"))]
            assert "train/loss" in keys and (case != "dafkd" or "train/disc_loss" in keys)
            assert {k: got[k] for k in keys} == pytest.approx({k: want[k] for k in keys}, rel=1e-4, abs=1e-5)


def test_dp_sgd_runs_where_the_client_runs_and_accounts_each_examples_batches():
    """4 steps of 16 a round: an example of a client of 100 is in one batch a round, of 50 in one (4 batches a pass),
    of 10 in four (one batch a pass): the most, 4, a round. FedAvg with DP-SGD accounts r rounds as r x that many
    Gaussian releases; noised, the clients batched (runtime.vectorize) give the figures of the clients alone (each
    client's noise its own stream); a BatchNorm model stops in one line."""
    from fedray.data import build_federated_data
    from fedray.errors import RunFailure
    from fedray.privacy.dpsgd import batches_per_example, sample_epsilon
    from tests.conftest import method_config

    cfg = tiny_config(privacy__sample_clip=1.0, privacy__sample_noise=2.0)
    assert batches_per_example(cfg.federation, [100, 50, 10]) == 4 and batches_per_example(cfg.federation, [100]) == 1
    k = batches_per_example(cfg.federation, build_federated_data(cfg.data, cfg.seed).client_sizes().tolist())
    history = run_experiment(cfg, progress=False).history
    assert [r["privacy/sample_epsilon"] for r in history] == [sample_epsilon(2.0, 1e-5, r * k) for r in (1, 2)]
    dafkd = dict(federation__rounds=1, privacy__sample_clip=0.5, privacy__sample_noise=1.0)
    alone = run_experiment(method_config("dafkd", **dafkd), progress=False).history
    batched = run_experiment(method_config("dafkd", **dafkd, runtime__vectorize="on"), progress=False).history
    assert batched[0]["eval/accuracy"] == alone[0]["eval/accuracy"]
    assert batched[0]["train/loss"] == pytest.approx(alone[0]["train/loss"], rel=1e-5)
    with pytest.raises(RunFailure, match=r"^privacy.sample_clip: fedavg's model has BatchNorm"):
        run_experiment(tiny_config(model__name="resnet8_bn", privacy__sample_clip=1.0, federation__rounds=1),
                       progress=False)


def test_a_client_update_that_trains_by_itself_is_refused_dp_sgd_in_one_line():
    """DP-SGD clips each example's gradient inside a training plan: an update trained by the method itself (as
    test_nan_client's is, through run_update) leaves it none to reach."""
    from fedray.errors import RunFailure
    from tests.runtime import faulty

    _, server, worker = cores(tiny_config(algorithm__name=faulty.NaNClient.name, privacy__sample_clip=1.0,
                                          privacy__sample_noise=1.0))
    with pytest.raises(RunFailure) as e:
        worker.train(1, 1, server.payload(0)[0], None)
    assert str(e.value) == ("privacy.sample_clip: test_nan_client's client update trained outside a training plan "
                            "(DaFKD's gradient penalty: algorithm.gp_weight > 0), where DP-SGD cannot reach its "
                            "gradients; drop privacy.sample_clip or that option")


def test_fedcd_with_the_uniform_teacher_takes_central_noise_on_the_clipped_logit_tables():
    """FedCD's uniform teacher is the one mean of its uploads: under central noise, (sum of the clipped tables + noise)
    / m; with no noise and a clip above every table's norm, the plain average's figures; Eq. 4's teacher refuses."""
    fedcd = dict(algorithm__name="fedcd", algorithm__ensemble="uniform", data__server_data__kind="holdout",
                 data__server_data__per_class=2, algorithm__shared_batch=8, federation__clients_per_round=6,
                 federation__rounds=2)
    plain = run_experiment(tiny_config(**fedcd), progress=False).history
    loose = run_experiment(tiny_config(**fedcd, privacy__mechanism="central", privacy__clip=1e9,
                                       privacy__noise_multiplier=0.0), progress=False).history
    noisy = run_experiment(tiny_config(**fedcd, privacy__mechanism="central", privacy__clip=1.0,
                                       privacy__noise_multiplier=5.0), progress=False).history
    assert loose[-1]["server/teacher_acc"] == plain[-1]["server/teacher_acc"]
    assert noisy[-1]["server/teacher_ce"] != plain[-1]["server/teacher_ce"]
    with pytest.raises(ConfigError, match="Eq. 4 fits its weights"):
        validate_experiment(tiny_config(**{**fedcd, "algorithm__ensemble": "optimal"}, privacy__mechanism="central"))
