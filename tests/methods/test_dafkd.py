"""DaFKD: Eq. 7 by hand, its zero-denominator guard, the Appendix B teacher by hand, discriminators
persisting per client, Appendix B == main variant, communication bytes of every variant, two-round runs
of every option, the generator's shape and output space, presets and the sweep spec. (Local == Ray, the main and
the private variant, and resumes: tests/test_every_method.py.)"""

from fedray.methods import algorithm_params
import dataclasses
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fedray.errors import ConfigError
from fedray.methods.api import ServerContext
from fedray.methods import resolve_experiment
from fedray.methods import DataSpec
from fedray.methods.dafkd import DaFKD, DaFKDUpload
from fedray.methods.dafkd import losses as dafkd_losses
from fedray.methods.dafkd.types import DaFKDModules
from fedray.methods.dafkd.server import alpha_metrics, correlation_weights, ensemble_teacher
from fedray.load import load_config
from fedray.data import build_federated_data
from fedray.models import build_model
from fedray.models.dcgan import DCGANGenerator
from fedray.runtime import make_runtime
from fedray.runtime.core import data_spec
from fedray.seeding import sample_clients
from fedray.simulation import run_experiment
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[2]
# Small generator and distillation so that a round takes well under a second on one core.
SMALL = {"algorithm__name": "dafkd", "algorithm__generator": "dcgan", "algorithm__gen_width": 8,
         "algorithm__gen_hidden": 32, "algorithm__distill_samples": 48,
         "algorithm__distill_steps": 6, "algorithm__distill_batch_size": 16, "algorithm__distill_lr": 0.05}


def dafkd_config(**overrides):
    return tiny_config(**{**SMALL, **overrides})


def _run_rounds(cfg, rounds: int):
    """Run ``rounds`` rounds on the configured runtime; (global weights, outcomes, client states)."""
    data = build_federated_data(cfg.data, cfg.seed)
    with make_runtime(cfg, data) as rt:
        outcomes = [rt.run_round(r, sample_clients(cfg.seed, r, data.num_clients, cfg.federation.clients_per_round))
                    for r in range(1, rounds + 1)]
        state = rt.export_state()
        server_state, client_states = state.server, state.clients
        return rt.global_weights(), outcomes, server_state, client_states


# --- Eq. 7 and the teacher, by hand ------------------------------------------------------------------


def test_eq7_weights_and_their_statistics_by_hand():
    f = torch.tensor([[0.9, 0.2, 0.5],   # client 1's discriminator on samples 1..3
                      [0.3, 0.2, 0.5],   # client 2
                      [0.6, 0.4, 0.0]])  # client 3
    alpha = correlation_weights(f, eps=1e-12)
    expected = torch.tensor([[0.5, 0.25, 0.5], [1 / 6, 0.25, 0.5], [1 / 3, 0.5, 0.0]])
    assert torch.allclose(alpha, expected, atol=1e-6)
    assert torch.allclose(alpha.sum(0), torch.ones(3))
    m = alpha_metrics(alpha)
    assert m["server/alpha_max_mean"] == pytest.approx((0.5 + 0.5 + 0.5) / 3, abs=1e-6)

    def h(ps):
        return -sum(p * math.log(p) for p in ps if p > 0) / math.log(3)

    assert m["server/alpha_entropy"] == pytest.approx((h([.5, 1 / 6, 1 / 3]) + h([.25, .25, .5]) + h([.5, .5])) / 3,
                                                      abs=1e-5)


def test_zero_denominator_falls_back_to_uniform_weights():
    f = torch.tensor([[0.0, 0.8], [0.0, 0.2]])  # sample 1: every discriminator says "fake" with certainty
    alpha = correlation_weights(f, eps=1e-8)
    assert torch.isfinite(alpha).all()
    assert torch.equal(alpha[:, 0], torch.tensor([0.5, 0.5]))
    assert torch.allclose(alpha[:, 1], torch.tensor([0.8, 0.2]), atol=1e-6)
    assert alpha_metrics(alpha[:, :1])["server/alpha_entropy"] == pytest.approx(1.0)


def test_appendix_b_teacher_by_hand_with_the_zero_guard():
    cfg = dafkd_config(algorithm__private_discriminator=True)
    algo = DaFKD(cfg, None)
    eps = algo.params.alpha_eps
    s1, s2 = torch.tensor([[1.0, 0.0], [0.5, 0.5]]), torch.tensor([[0.0, 1.0], [0.2, 0.8]])
    f1, f2 = torch.tensor([0.75, 0.0]), torch.tensor([0.25, 0.0])
    ups = [DaFKDUpload(weights={}, generator={}, num_samples=1, weighted_outputs=(f + eps).unsqueeze(1) * s,
                       output_weights=f + eps) for s, f in ((s1, f1), (s2, f2))]
    ctx = ServerContext(round=1, seed=0, device=torch.device("cpu"), modules=None)
    teacher, metrics = ensemble_teacher(algo, ups, torch.zeros(2, 1), ctx)
    # sample 1: 0.75 * [1, 0] + 0.25 * [0, 1]; sample 2: both scores 0 -> uniform mean of the two predictions
    assert torch.allclose(teacher, torch.tensor([[0.75, 0.25], [0.35, 0.65]]), atol=1e-6)
    assert metrics["server/alpha_max_mean"] == pytest.approx((0.75 + 0.5) / 2, abs=1e-6)


# --- client state ------------------------------------------------------------------------------------


def test_discriminator_head_persists_per_client_and_is_never_averaged():
    cfg = dafkd_config(data__num_clients=6, federation__clients_per_round=3, federation__local_steps=2)
    data = build_federated_data(cfg.data, cfg.seed)
    algo = DaFKD(cfg, data_spec(data))
    init = {c: algo.init_client_state(c) for c in range(6)}
    counts: Counter = Counter()
    with make_runtime(cfg, data) as rt:
        before: dict[int, torch.Tensor] = {}
        for r in range(1, 6):
            ids = sample_clients(cfg.seed, r, 6, 3)
            outcome = rt.run_round(r, ids)
            states = rt.export_state().clients
            counts.update(ids)
            for c, st in states.items():
                assert st.client_id == c and st.rounds == counts[c]
                assert set(st.disc) == {"weight", "bias"} and st.disc["weight"].shape == (1, 84)  # Linear(84, 1)
                if c in ids:  # trained this round: the head moved, from where this client left it
                    assert not torch.equal(st.disc["weight"], before.get(c, init[c].disc["weight"]))
                else:
                    assert torch.equal(st.disc["weight"], before[c])
                before[c] = st.disc["weight"].clone()
            assert all("train/disc_acc_real" in i and "train/disc_acc_fake" in i for i in outcome.client_infos)
    # distinct clients start from distinct (seeded) heads
    assert not torch.equal(init[0].disc["weight"], init[1].disc["weight"])
    assert torch.equal(init[0].disc["weight"], DaFKD(cfg, data_spec(data)).init_client_state(0).disc["weight"])


def _is_plain(value) -> bool:
    if dataclasses.is_dataclass(value):
        return all(_is_plain(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, (torch.Tensor, int, float, str, bool))


@pytest.mark.parametrize("variant", [{}, {"algorithm__sharing": False, "algorithm__private_discriminator": True,
                                          "algorithm__eval_average": True}])
def test_state_payload_and_upload_are_plain_typed_data(variant):
    cfg = dafkd_config(**variant)
    data = build_federated_data(cfg.data, cfg.seed)
    with make_runtime(cfg, data) as rt:
        rt.run_round(1, [0, 1, 2])
        state = rt.export_state()
        server_state, client_states = state.server, state.clients
        payload = rt.server.payload(1)[0]
        upload = rt.worker.train(2, 0, payload, client_states[0])[0]
    for obj in (server_state, payload, upload, *client_states.values()):
        assert dataclasses.is_dataclass(obj) and _is_plain(obj), obj


# --- Appendix B reproduces the main variant --------------------------------------------------------------


@pytest.mark.parametrize("extra", [{}, {"algorithm__ensemble": "logits", "algorithm__sharing": False}])
def test_private_discriminator_gives_the_main_variants_model(extra):
    common = {"algorithm__eval_average": True, "algorithm__distill_lr": 0.5, **extra}  # a visible distillation step
    main_cfg = dafkd_config(**common)
    priv_cfg = dafkd_config(algorithm__private_discriminator=True, **common)
    w_main, out_main, state_main, _ = _run_rounds(main_cfg, 2)
    w_priv, out_priv, state_priv, _ = _run_rounds(priv_cfg, 2)
    # the distillation really moved the model away from the plain average ...
    assert max(float((state_main.weights[k] - state_main.average[k]).abs().max()) for k in w_main) > 1e-4
    # ... and both variants end with the same model, up to floating-point error
    for k in w_main:
        assert torch.allclose(w_main[k], w_priv[k], atol=1e-5, rtol=1e-4), k
    for a, b in zip(out_main, out_priv):
        for key in ("server/alpha_max_mean", "server/alpha_entropy", "server/kd_loss"):
            assert a.server_metrics[key] == pytest.approx(b.server_metrics[key], rel=1e-4, abs=1e-6)
    # only the private variant's clients need (and are sent) the seed of the distillation noise
    assert DaFKD(priv_cfg, None).broadcast(state_priv, 3).distill_seed is not None
    assert DaFKD(main_cfg, None).broadcast(state_main, 3).distill_seed is None


# --- communication -----------------------------------------------------------------------------------------


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


@pytest.mark.parametrize("variant", ["main", "no_sharing", "no_correlation", "private", "private_no_correlation"])
def test_comm_bytes_are_the_sizes_of_what_is_sent(variant):
    over = {"main": {}, "no_sharing": {"algorithm__sharing": False},
            "no_correlation": {"algorithm__correlation": False},
            "private": {"algorithm__private_discriminator": True},
            "private_no_correlation": {"algorithm__private_discriminator": True, "algorithm__correlation": False}}
    cfg = dafkd_config(federation__rounds=1, **over[variant])
    shape, classes, n = (1, 16, 16), 10, algorithm_params(cfg).distill_samples
    model = build_model("lenet5", shape, classes)
    down = _bytes(model) + _bytes(DCGANGenerator(100, shape, 8))  # classifier + generator
    up = down + 8  # + num_samples
    extra = {"main": (model.feature_dim + 1) * 4,  # the discriminator head Linear(84, 1)
             "no_sharing": _bytes(build_model("lenet5", shape, 1)),  # the whole separate discriminator
             "no_correlation": 0,  # the server needs no discriminator
             "private": n * classes * 4 + n * 4,  # (f + eps) * s_k and f + eps on the distillation set
             "private_no_correlation": n * classes * 4}[variant]
    if variant.startswith("private"):
        down += 8  # the shared distillation-noise seed
    row = run_experiment(cfg, progress=False).history[0]
    k = cfg.federation.clients_per_round
    assert row["comm/bytes_down"] == down * k
    assert row["comm/bytes_up"] == (up + extra) * k


# --- every option runs ---------------------------------------------------------------------------------------

OPTIONS = {
    "default": {},
    "no_sharing": {"algorithm__sharing": False},
    "no_correlation": {"algorithm__correlation": False},
    "private": {"algorithm__private_discriminator": True},
    "logits": {"algorithm__ensemble": "logits", "algorithm__temperature": 3.0},
    "authors_code": {"algorithm__aggregation": "samples", "algorithm__gp_weight": 0.3, "algorithm__ensemble": "logits",
                     "algorithm__disc_train_rounds": 1, "algorithm__gen_train_rounds": 1,
                     "algorithm__distill_start_round": 2, "algorithm__distill_optimizer": "adam",
                     "algorithm__distill_lr": 1e-4, "federation__optimizer": "adam", "federation__lr": 0.001},
    "minimax": {"algorithm__gen_loss": "minimax", "algorithm__eval_average": True},
    "conditional": {"algorithm__generator": "conditional"},
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_two_round_run_of_every_option(option):
    result = run_experiment(dafkd_config(**OPTIONS[option]), progress=False)
    h = result.history
    assert [row["round"] for row in h] == [1, 2]
    assert all(math.isfinite(row["eval/accuracy"]) for row in h)
    last = h[-1]
    assert 0 <= last["server/alpha_max_mean"] <= 1 and math.isfinite(last["server/kd_loss"])
    if option == "no_correlation":
        assert last["server/alpha_entropy"] == pytest.approx(1.0) and "server/disc_score_mean" not in last
    if option == "minimax":
        assert "eval/accuracy_avg" in last
    if option == "authors_code":  # round 2: no adversarial training any more
        assert "train/disc_acc_real" in h[0] and "train/disc_acc_real" not in last
        assert "server/kd_loss" not in h[0]
    else:
        assert 0 <= last["train/disc_acc_real"] <= 1 and 0 <= last["train/disc_acc_fake"] <= 1


# --- generator, presets, sweep spec ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32), (1, 16, 16), (3, 12, 20), (1, 15, 14)])
def test_generator_follows_the_datasets_shape_and_normalised_range(shape):
    mean, std = (0.3,) * shape[0], (0.4,) * shape[0]
    gen = DCGANGenerator(100, shape, 8, mean, std)
    with torch.no_grad():
        x = gen(torch.randn(5, 100))
    assert tuple(x.shape) == (5, *shape)
    lo, hi = (0 - 0.3) / 0.4, (1 - 0.3) / 0.4  # pixels in [0, 1], normalised like the real images
    assert float(x.min()) >= lo - 1e-6 and float(x.max()) <= hi + 1e-6
    assert all(name.startswith("net.") for name in gen.state_dict())  # mean/std are config, not state


def _layout(gen):
    return [(c.in_channels, c.out_channels, c.kernel_size, c.stride) for c in gen.modules()
            if isinstance(c, torch.nn.ConvTranspose2d)]


def test_authors_dcgan_on_32x32_and_the_mnist_layout_on_28x28():
    assert _layout(DCGANGenerator(100, (3, 32, 32), 64)) == [
        (100, 256, (4, 4), (1, 1)), (256, 128, (4, 4), (2, 2)), (128, 64, (4, 4), (2, 2)), (64, 3, (4, 4), (2, 2))]
    # 1x1 -> 4x4 -> 7x7 (3x3 kernel: 2n - 1) -> 14x14 -> 28x28
    assert _layout(DCGANGenerator(100, (1, 28, 28), 16)) == [
        (100, 64, (4, 4), (1, 1)), (64, 32, (3, 3), (2, 2)), (32, 16, (4, 4), (2, 2)), (16, 1, (4, 4), (2, 2))]


def test_presets_and_sweep_spec_validate():
    from fedray.sweep.spec import load_spec

    fm = load_config("dafkd_fmnist")
    assert (fm.model.name, fm.algorithm.name, fm.federation.rounds, fm.federation.clients_per_round) == \
        ("lenet5", "dafkd", 60, 8)
    rn = load_config("dafkd_resnet11")  # the paper's Sec. 4.1: E = 20 local epochs, not steps
    assert rn.model.name == "resnet11" and algorithm_params(rn).gen_width == 64 and rn.federation.local_epochs == 20
    au = load_config("dafkd_fmnist_authors")
    ap = algorithm_params(au)
    assert (au.federation.lr, ap.gen_lr, ap.disc_lr, ap.distill_lr, ap.temperature) == (1e-4,) * 4 + (20.0,)
    assert (ap.distill_samples // ap.distill_batch_size, ap.distill_steps * ap.distill_batch_size // ap.distill_samples) \
        == (40, 40)  # 40 passes over 40 generated batches of 32
    assert (ap.disc_train_rounds, ap.gen_train_rounds, ap.gan_local_epochs, ap.gp_weight) == (3, 5, 5, 0.3)
    assert (ap.kd_reduction, ap.aggregation, au.federation.local_epochs) == ("mean", "samples", 20)
    # the authors' trainer: no weight decay on the classifier (nor the discriminator), their --wd on the generator
    assert (au.federation.weight_decay, ap.gen_weight_decay) == (0.0, 1e-4)
    spec_path = ROOT / "tune_configs" / "dafkd_distill.yaml"
    assert spec_path.read_text().startswith("#")
    spec = load_spec(spec_path)
    assert {"algorithm.distill_lr", "algorithm.temperature"} <= set(spec.search)


@pytest.mark.parametrize("gp_weight", [0.0, 0.3])
def test_generated_images_never_enter_batchnorm_running_statistics(gp_weight):
    """After a client update, every BatchNorm layer's running statistics are the momentum average of the
    real batches' statistics alone: the fakes of the discriminator, generator and gradient-penalty steps
    pass through the same extractor but leave them as they are."""
    from fedray.runtime.core import ClientWorkerCore
    from fedray.runtime.server_core import ServerCore

    cfg = dafkd_config(model__name="resnet8_bn", federation__local_steps=3, algorithm__gp_weight=gp_weight)
    data = build_federated_data(cfg.data, cfg.seed)
    server = ServerCore(cfg, data, torch.device("cpu"))
    worker = ClientWorkerCore(cfg, data, torch.device("cpu"))
    layers = [m for m in worker.modules.model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    seen: dict[torch.nn.Module, list[torch.Tensor]] = {bn: [] for bn in layers}

    def record(bn, args):  # what a BatchNorm that updates its running statistics is given
        if bn.training and bn.track_running_stats:
            seen[bn].append(args[0].detach().clone())

    hooks = [bn.register_forward_pre_hook(record) for bn in layers]
    try:
        payload, _ = server.payload(0)
        upload, _, _, _ = worker.train(1, 0, payload, None)
    finally:
        for h in hooks:
            h.remove()
    names = {m: n for n, m in worker.modules.model.named_modules()}
    for bn in layers:
        assert len(seen[bn]) == 3  # one real batch per local step, nothing else
        mean, var = payload.weights[f"{names[bn]}.running_mean"].clone(), payload.weights[f"{names[bn]}.running_var"].clone()
        for x in seen[bn]:
            mean = 0.9 * mean + 0.1 * x.mean((0, 2, 3))
            var = 0.9 * var + 0.1 * x.var((0, 2, 3), unbiased=True)
        assert torch.allclose(upload.weights[f"{names[bn]}.running_mean"], mean, atol=1e-5)
        assert torch.allclose(upload.weights[f"{names[bn]}.running_var"], var, atol=1e-5)
        assert int(upload.weights[f"{names[bn]}.num_batches_tracked"]) == 3


def test_gan_trains_only_in_its_first_local_epochs():
    """gan_local_epochs=1 of 3: the generator and discriminator a client uploads are those of a one-epoch
    round (same batches, same noise); only the classifier trains on in epochs 2-3."""
    from fedray.runtime.core import ClientWorkerCore
    from fedray.runtime.server_core import ServerCore

    def upload(**kw):
        cfg = dafkd_config(federation__local_epochs=kw.pop("epochs"), federation__batch_size=50, **kw)
        data = build_federated_data(cfg.data, cfg.seed)
        payload, _ = ServerCore(cfg, data, torch.device("cpu")).payload(0)
        up, state, _, _ = ClientWorkerCore(cfg, data, torch.device("cpu")).train(1, 0, payload, None)
        return up, state

    limited, lim_state = upload(epochs=3, algorithm__gan_local_epochs=1)
    one, one_state = upload(epochs=1)
    for k in one.generator:
        assert torch.equal(limited.generator[k], one.generator[k]), k
    for k in one_state.disc:
        assert torch.equal(lim_state.disc[k], one_state.disc[k]), k
    assert any(not torch.equal(limited.weights[k], one.weights[k]) for k in one.weights)  # the classifier went on


def test_authors_kl_reduction_averages_over_classes_too():
    from fedray.methods.dafkd.server import distil

    losses, classes = {}, None
    for reduction in ("batchmean", "mean"):
        cfg = dafkd_config(algorithm__distill_steps=1, algorithm__kd_reduction=reduction)
        algo = DaFKD(cfg, data_spec(build_federated_data(cfg.data, cfg.seed)))
        classes = algo.spec.num_classes
        torch.manual_seed(0)
        modules = algo.build_modules()
        start = {k: v.clone() for k, v in modules.model.state_dict().items()}
        x = torch.randn(16, *algo.spec.input_shape)
        teacher = torch.softmax(torch.randn(16, classes), 1)
        ctx = ServerContext(round=1, seed=1, device=torch.device("cpu"), modules=modules)
        losses[reduction] = distil(algo, start, x, teacher, ctx)[1]["server/kd_loss"]
    assert losses["mean"] == pytest.approx(losses["batchmean"] / classes, rel=1e-5)


def test_mechanism_diagnostics_by_hand():
    """Two clients, two test images of classes 0 and 1. Client 0 holds class 0 and predicts 0 for both;
    client 1 holds class 1 and predicts 1 for both. Discriminators that say 'mine' for the own client's
    class make Eq. 7 pick the right expert (accuracy 1), the uniform ensemble ties and falls to class 0 (0.5),
    the label-share oracle picks the expert (1), as do Theorem 1's weights."""
    from fedray.methods.dafkd.server import _auc, mechanism_figures

    assert _auc(torch.tensor([0.9, 0.8]), torch.tensor([0.1, 0.8])) == pytest.approx(0.875)  # 3 wins, 1 tie of 4
    s = torch.tensor([[[1.0, 0.0], [1.0, 0.0]],   # client 0: class 0 for both images
                      [[0.0, 1.0], [0.0, 1.0]]])  # client 1: class 1 for both
    f = torch.tensor([[0.9, 0.1],                 # client 0's discriminator: image 0 is its own
                      [0.1, 0.9]])
    f_own = [[torch.tensor([0.9, 0.8]), torch.tensor([0.2, 0.1])],   # f_0 on client 0's / client 1's images
             [torch.tensor([0.3, 0.4]), torch.tensor([0.6, 0.7])]]   # f_1 on them
    counts = torch.tensor([[50.0, 0.0], [0.0, 50.0]])  # image i's class: client 0 holds class 0 only
    y = torch.tensor([0, 1])
    theorem1 = torch.tensor([[0.6, 0.4], [0.4, 0.6]])  # Eq. 7 at Theorem 1's optimum leans on the expert
    d = mechanism_figures(s, f, f_own, counts, y, 1e-8, theorem1)
    assert d["diag/domain_auc"] == pytest.approx(1.0)
    assert d["diag/ens_acc_eq7"] == 1.0 and d["diag/ens_acc_label_share"] == 1.0 and d["diag/ens_acc_uniform"] == 0.5
    assert d["diag/ens_acc_theorem1"] == 1.0
    assert mechanism_figures(s, f, f_own, counts, y, 1e-8, theorem1.flip(0))["diag/ens_acc_theorem1"] == 0.0
    assert d["diag/alpha_entropy_real"] == pytest.approx(0.469, abs=1e-3)  # H(0.9, 0.1) / log 2
    flipped = mechanism_figures(s, f.flip(0), [f_own[1], f_own[0]], counts, y, 1e-8, theorem1)
    assert flipped["diag/ens_acc_eq7"] == 0.0 and flipped["diag/domain_auc"] == pytest.approx(0.0)


def test_diagnostics_are_logged_each_round_and_leave_the_model_unchanged():
    cfg = dafkd_config(algorithm__diag_samples=20)
    with_diag = run_experiment(cfg, progress=False)
    without = run_experiment(dafkd_config(algorithm__diag_samples=0), progress=False)
    keys = ("diag/domain_auc", "diag/alpha_entropy_real", "diag/ens_acc_eq7", "diag/ens_acc_uniform",
            "diag/ens_acc_theorem1", "diag/ens_acc_label_share")
    for row in with_diag.history:
        assert all(0.0 <= row[k] <= 1.0 for k in keys), row
    assert not any(k in row for row in without.history for k in keys)
    for k in ("eval/accuracy", "train/loss", "server/kd_loss"):  # diagnostics never feed back into the method
        assert [r.get(k) for r in with_diag.history] == [r.get(k) for r in without.history], k
    # federation.diag_every: every 2nd round and the last; the rounds diagnosed give the same figures
    sparse = run_experiment(dafkd_config(algorithm__diag_samples=20, federation__rounds=3, federation__diag_every=2),
                            progress=False).history
    assert [all(k in row for k in keys) for row in sparse] == [False, True, True]
    assert not any(k in sparse[0] for k in keys)
    assert {k: sparse[1][k] for k in keys} == {k: with_diag.history[1][k] for k in keys}
    # an undiagnosed round's uploads are not held on to until the next round's arrive
    cfg = dafkd_config(algorithm__diag_samples=20, federation__rounds=3, federation__diag_every=2)
    data = build_federated_data(cfg.data, cfg.seed)
    with make_runtime(cfg, data) as rt:
        for r in (1, 2):
            rt.run_round(r, sample_clients(cfg.seed, r, data.num_clients, cfg.federation.clients_per_round))
            assert rt.server.algo._round_uploads is None


def test_conditional_generator_images_depend_on_the_label_and_distillation_sets_are_balanced():
    """The label steers the image (nothing here says the image shows that class: the fixed reader measures that,
    tests/test_reader.py, ``diag/reader_agreement``)."""
    from fedray.models.dcgan import ConditionalGenerator

    torch.manual_seed(0)
    gen = ConditionalGenerator(100, 10, (1, 28, 28), hidden=32, mean=(0.2860,), std=(0.3530,)).eval()
    z = torch.randn(4, 100)
    a, b = gen(z, torch.tensor([0, 1, 2, 3])), gen(z, torch.tensor([5, 1, 2, 3]))
    assert a.shape == (4, 1, 28, 28)
    assert not torch.equal(a[0], b[0]) and torch.equal(a[1:], b[1:])  # the label steers the image
    lo, hi = (0 - 0.2860) / 0.3530, (1 - 0.2860) / 0.3530  # tanh read as [0, 1] pixels, then normalised
    assert a.min() >= lo - 1e-5 and a.max() <= hi + 1e-5
    with pytest.raises(ValueError, match="needs labels"):
        gen(z)
    cfg = dafkd_config(algorithm__generator="conditional", algorithm__distill_samples=40)
    algo = DaFKD(cfg, data_spec(build_federated_data(cfg.data, cfg.seed)))
    modules = algo.build_modules()
    seen = []
    modules.generator.register_forward_hook(lambda mod, args, out: seen.append(args[1]))
    algo.distillation_set(modules, {k: v.clone() for k, v in modules.generator.state_dict().items()}, 7,
                          torch.device("cpu"))
    assert torch.bincount(torch.cat(seen), minlength=10).tolist() == [4] * 10  # every class equally often


@pytest.mark.parametrize("optimizer, replays", [("sgd", 4), ("adam", 0)])
def test_distillation_replayed_as_a_cuda_graph_gives_the_eager_numbers(graphs_on_cpu, optimizer, replays):
    """Eq. 8's steps with ``runtime.cuda_graphs`` (on the CPU, a "replay" calling the captured step again, under
    the capture's rules: the bookkeeping of inputs, outputs and warm-up): 6 steps, 2 eager, 1 captured, then
    replays, the same weights and kd losses as eager steps; fedray's Adam (host step counts) is never captured."""
    runs = []
    for graphs in (False, True):
        cfg = dafkd_config(algorithm__distill_optimizer=optimizer, runtime__cuda_graphs=graphs,
                           runtime__vectorize=False, algorithm__diag_samples=0)
        weights, outcomes, _, _ = _run_rounds(cfg, 1)
        runs.append((weights, outcomes[0].server_metrics))
    (eager_w, eager_m), (graph_w, graph_m) = runs
    assert all(torch.equal(eager_w[k], graph_w[k]) for k in eager_w) and "server/kd_loss_last" in graph_m
    assert {k: v for k, v in graph_m.items() if k.startswith("server/")} == \
        {k: v for k, v in eager_m.items() if k.startswith("server/")}
    assert len(graphs_on_cpu) == replays


# --- the adversarial losses (Eq. 2, Eq. 3) by hand ------------------------------------------------------------


class _MeanFeature(torch.nn.Module):
    """A classifier stand-in whose one feature is the image's mean pixel: a discriminator head reads it directly."""

    def features(self, x):
        return x.flatten(1).mean(1, keepdim=True)


class _FixedImages(torch.nn.Module):
    """A generator stand-in that draws the image it holds, whatever the noise and label."""

    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def forward(self, z, labels=None):
        return torch.full((z.shape[0], 1, 4, 4), self.value)


SPEC_DAFKD = DataSpec(input_shape=(1, 4, 4), num_classes=10, num_clients=4, mean=(0.5,), std=(0.25,))
SPEC_TINY = DataSpec(input_shape=(1, 16, 16), num_classes=10, num_clients=6, mean=(0.5,), std=(0.25,))


def _adversarial(scale: float, **params):
    algo = DaFKD(dafkd_config(**params), SPEC_DAFKD)
    head = torch.nn.Linear(1, 1)
    with torch.no_grad():
        head.weight.fill_(scale)
        head.bias.zero_()
    return algo, DaFKDModules(model=_MeanFeature(), generator=_FixedImages(1.0), disc=head)




def test_the_discriminator_loss_is_eq2_by_hand_real_labelled_1_generated_0():
    """Eq. 2 over the n real and n_hat generated samples: -(sum log f(x) + sum log(1 - f(G(z)))) / (n + n_hat). A
    discriminator that already separates them (real images of mean +1 read at logit +40, generated ones of mean -1
    at -40) has a loss near 0; with the targets swapped it would be near 40."""
    real, fake = torch.ones(3, 1, 4, 4), -torch.ones(2, 1, 4, 4)
    algo, m = _adversarial(40.0)
    loss, d_real, d_fake = dafkd_losses.disc_loss(algo.params, m, real, m.model.features(real), fake)
    assert float(loss.detach()) < 1e-6 and d_real.tolist() == [40.0] * 3 and d_fake.tolist() == [-40.0] * 2
    algo, m = _adversarial(0.7)  # a discriminator half sure: the loss by hand
    loss, _, _ = dafkd_losses.disc_loss(algo.params, m, real, m.model.features(real), fake)
    f_real, f_fake = torch.sigmoid(torch.tensor(0.7)), torch.sigmoid(torch.tensor(-0.7))
    assert float(loss.detach()) == pytest.approx(float(-(3 * f_real.log() + 2 * (1 - f_fake).log()) / 5), rel=1e-5)


@pytest.mark.parametrize("gen_loss", ["nonsaturating", "minimax"])
def test_the_generator_loss_is_eq3_by_hand_and_falls_as_its_samples_pass_for_real(gen_loss):
    """Eq. 3 (minimax): mean log(1 - f(G(z))); non-saturating: -mean log f(G(z)). Both fall as the discriminator
    reads the generated samples as real."""
    algo, m = _adversarial(0.7, algorithm__gen_loss=gen_loss)
    z = torch.randn(4, 8)
    values = []
    for image in (-1.0, 1.0):  # the discriminator reads -1 as generated (f < 1/2), +1 as real
        m.generator = _FixedImages(image)
        f = torch.sigmoid(torch.tensor(0.7 * image))
        expected = (1 - f).log() if gen_loss == "minimax" else -f.log()
        values.append(float(dafkd_losses.gen_loss(algo.params, m, z, None)[0].detach()))
        assert values[-1] == pytest.approx(float(expected), rel=1e-5)
    assert values[1] < values[0]


def test_the_class_term_is_the_classifiers_cross_entropy_on_the_asked_class_and_moves_only_the_generator():
    """gen_class_weight (an extension): Eq. 3 + w CE(classifier(G(z, y)), y), by hand; the term alone moves the
    generator, and its target is the asked class (another class gives another value). Off (0): Eq. 3 alone."""
    from fedray.models.base import frozen_bn_stats

    algo = DaFKD(dafkd_config(algorithm__generator="conditional", algorithm__gen_class_weight=0.5), SPEC_TINY)
    plain = DaFKD(dafkd_config(algorithm__generator="conditional"), SPEC_TINY)
    torch.manual_seed(0)
    m = algo.build_modules()
    z, y = torch.randn(6, algo.params.noise_dim), torch.tensor([0, 1, 2, 3, 4, 5])
    total, visible = dafkd_losses.gen_loss(algo.params, m, z, y)
    adversarial, none = dafkd_losses.gen_loss(plain.params, m, z, y)
    with frozen_bn_stats(m.model):
        by_hand = F.cross_entropy(m.model(m.generator(z, y)), y)
    assert none is None and float(visible.detach()) == pytest.approx(float(by_hand.detach()), rel=1e-5)
    assert float(total.detach()) == pytest.approx(float(adversarial.detach()) + 0.5 * float(by_hand.detach()), rel=1e-5)
    wrong = dafkd_losses.gen_loss(algo.params, m, z, (y + 1) % 10)[1]  # the target is the asked class
    assert abs(float(wrong.detach()) - float(visible.detach())) > 1e-3
    gen_params = list(m.generator.parameters())
    grads = torch.autograd.grad(visible, gen_params + list(m.model.parameters()), allow_unused=True)
    assert any(g is not None and g.abs().sum() > 0 for g in grads[: len(gen_params)])  # the term moves G
    with pytest.raises(ConfigError) as e:  # a dcgan sample has no asked class
        resolve_experiment(dafkd_config(algorithm__gen_class_weight=0.5))
    assert e.value.key == "algorithm.gen_class_weight"


def test_a_run_with_the_class_term_logs_it_and_one_without_is_unchanged():
    on = run_experiment(dafkd_config(algorithm__generator="conditional", algorithm__gen_class_weight=1.0),
                        progress=False).history
    off = run_experiment(dafkd_config(algorithm__generator="conditional"), progress=False).history
    zero = run_experiment(dafkd_config(algorithm__generator="conditional", algorithm__gen_class_weight=0.0),
                          progress=False).history
    assert all(row["train/gen_class_loss"] > 0 for row in on) and not any("train/gen_class_loss" in r for r in off)
    assert [r["train/gen_loss"] for r in on] != [r["train/gen_loss"] for r in off]
    strip = lambda h: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in h]  # noqa: E731
    assert strip(zero) == strip(off)


@pytest.mark.parametrize("sharing", [True, False])
@pytest.mark.parametrize("gen_loss", ["nonsaturating", "minimax"])
def test_the_adversarial_losses_of_a_padded_batch_are_those_of_its_real_rows(sharing, gen_loss):
    """The batched runtime pads a short batch with rows that do not count (``batch_rows``): Eq. 2 and Eq. 3 on a
    padded batch, BatchNorm made row-aware as that runtime makes it, equal the losses of the real rows alone, for
    the shared head and for the separate discriminator network (whose BatchNorm reads the real images itself)."""
    from fedray.models.base import batch_rows, row_masked_batchnorm

    algo = DaFKD(dafkd_config(model__name="resnet8_bn", algorithm__sharing=sharing, algorithm__gen_loss=gen_loss),
                 SPEC_TINY)
    torch.manual_seed(0)
    m = algo.build_modules()
    x, fake, z = torch.randn(6, 1, 16, 16), torch.randn(6, 1, 16, 16), torch.randn(6, algo.params.noise_dim)
    real_rows, fake_rows = torch.arange(6) < 4, torch.arange(6) < 3
    alone, _, _ = dafkd_losses.disc_loss(algo.params, m, x[:4], m.model.features(x[:4]), fake[:3])
    gen_alone = dafkd_losses.gen_loss(algo.params, m, z[:3], None)[0]
    layers = torch.nn.ModuleList([m.model, m.generator, m.disc])
    with row_masked_batchnorm(layers):
        with batch_rows(real_rows):
            feats = m.model.features(x)
        padded, d_real, d_fake = dafkd_losses.disc_loss(algo.params, m, x, feats, fake, real_rows, fake_rows)
        gen_padded = dafkd_losses.gen_loss(algo.params, m, z, None, fake_rows)[0]
    torch.testing.assert_close(padded, alone, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gen_padded, gen_alone, rtol=1e-4, atol=1e-6)
    assert d_real.shape == (6,) and d_fake.shape == (6,)


def test_eq8s_batches_go_through_the_distillation_set_without_replacement(monkeypatch):
    """Eq. 8's minibatches: each pass of n / B steps sees every one of the n distillation samples once, and the next
    pass draws a new order (a seeded reshuffle)."""
    from fedray.methods.dafkd import server

    seen: list[list[int]] = []

    class Recording(server.KDSteps):
        def step(self, idx, steps_left=None):
            seen.append(idx.tolist())
            return super().step(idx, steps_left)

    monkeypatch.setattr(server, "KDSteps", Recording)
    cfg = dafkd_config(algorithm__distill_steps=8, algorithm__distill_samples=16, algorithm__distill_batch_size=4)
    algo = DaFKD(cfg, SPEC_TINY)
    modules = algo.build_modules()
    algo.server_update(algo.init_server_state(modules), _other_uploads(algo, (10, 10)),
                       ServerContext(1, 0, torch.device("cpu"), modules))
    first, second = sum(seen[:4], []), sum(seen[4:], [])
    assert len(seen) == 8 and all(len(b) == 4 for b in seen)
    assert sorted(first) == list(range(16)) and sorted(second) == list(range(16)) and first != second


@pytest.mark.parametrize("case", ["dafkd", "dafkd-private"])
def test_local_steps_teach_the_discriminators_to_read_real_images_as_real(case):
    """On the learnable synthetic task (real images far from a fresh generator's), after one round of local steps
    every client's discriminator reads more than half of its real images as real (``train/disc_acc_real``) and
    tells real from generated better than chance (their mean accuracy): trained backwards, with the targets
    swapped, it reads almost none of either. (The generated ones may pass for real more often than not: the
    generator wins this short game at times.)"""
    from tests.conftest import LEARNABLE, method_overrides
    from tests.vectorized.test_vectorized import _one_round

    learnable = {k.replace(".", "__"): v for k, v in LEARNABLE.items()}
    _, infos = _one_round(False, **{**method_overrides(case), **learnable, "federation__local_steps": 20})
    for info in infos:
        real, fake = info["train/disc_acc_real"], info["train/disc_acc_fake"]
        assert real > 0.5 and (real + fake) / 2 > 0.5, (info["client"], real, fake)


def _other_uploads(algo: DaFKD, sizes: tuple[int, ...], head_scale: float = 1.0) -> list[DaFKDUpload]:
    """One upload per size, each of freshly drawn modules (seeded), the classifier's head scaled by ``head_scale``."""
    from fedray.learning.weights import clone_weights

    uploads = []
    for k, n in enumerate(sizes):
        torch.manual_seed(7 + k)
        other = algo.build_modules()
        with torch.no_grad():
            other.model.head.weight.mul_(head_scale)
        uploads.append(DaFKDUpload(weights=clone_weights(other.model), generator=clone_weights(other.generator),
                                   num_samples=n, disc=clone_weights(other.disc)))
    return uploads


@pytest.mark.parametrize("aggregation", ["uniform", "samples"])
def test_the_server_step_is_eq6_eq4_eq7_and_one_eq8_step_by_hand(aggregation):
    """Two uploads of other weights: the student starts from Eq. 6's average (uniform, or by samples), the generator
    is Eq. 4's; on the distillation set drawn from the broadcast generator, each client's classifier s_k (softmax at
    T) and discriminator f_k (sigmoid of the head on the classifier's features) give Eq. 7's weights
    alpha_k = f_k / sum_j f_j and the teacher sum_k alpha_k s_k; Eq. 8 is one SGD step (momentum's first step is
    plain) of KL(teacher || softmax(student / T)) T^2 over the whole set."""
    cfg = dafkd_config(algorithm__distill_steps=1, algorithm__distill_samples=16, algorithm__distill_batch_size=16,
                       algorithm__temperature=2.0, algorithm__aggregation=aggregation)
    algo = DaFKD(cfg, SPEC_TINY)
    modules = algo.build_modules()
    state = algo.init_server_state(modules)
    uploads = _other_uploads(algo, (10, 30), head_scale=30.0)  # confident teachers: KL's two directions differ
    coefs = [1.0, 1.0] if aggregation == "uniform" else [10.0, 30.0]
    new, metrics = algo.server_update(state, uploads, ServerContext(1, 0, torch.device("cpu"), modules))

    def mean(key, part):
        return (coefs[0] * getattr(uploads[0], part)[key] + coefs[1] * getattr(uploads[1], part)[key]) / sum(coefs)

    for key in uploads[0].generator:
        if uploads[0].generator[key].is_floating_point():
            torch.testing.assert_close(new.generator[key], mean(key, "generator"))  # Eq. 4
    x = algo.distillation_set(modules, state.generator, algo.distill_seed(1), torch.device("cpu"))
    model, disc = modules.model, modules.disc
    s, f = [], []
    with torch.no_grad():
        for u in uploads:
            model.load_state_dict(u.weights)
            disc.load_state_dict(u.disc)
            model.eval()
            feats = model.features(x)
            s.append(torch.softmax(model.head(feats) / 2.0, dim=1))
            f.append(torch.sigmoid(disc(feats).squeeze(1)))
    f = torch.stack(f) + algo.params.alpha_eps  # Eq. 7, guarded: every f_k + eps
    alpha = f / f.sum(0)
    teacher = alpha[0].unsqueeze(1) * s[0] + alpha[1].unsqueeze(1) * s[1]
    average = {k: mean(k, "weights") for k in uploads[0].weights}  # Eq. 6
    model.load_state_dict(average)
    model.eval()
    model.zero_grad(set_to_none=True)
    p = teacher
    kl = (p * (p.log() - torch.log_softmax(model(x) / 2.0, dim=1))).sum(1).mean() * 4.0  # Eq. 8
    kl.backward()
    assert metrics["server/kd_loss"] == pytest.approx(float(kl.detach()), rel=1e-3)  # a small KL: rounding shows
    lr = algo.params.distill_lr
    for name, prm in model.named_parameters():
        torch.testing.assert_close(new.weights[name], average[name] - lr * prm.grad, rtol=1e-5, atol=1e-7)


def test_eq7s_guard_adds_eps_to_every_score():
    f = torch.tensor([[0.9, 0.0], [0.1, 0.0]])
    alpha = correlation_weights(f, eps=0.5)
    assert torch.allclose(alpha, torch.tensor([[1.4 / 2.0, 0.5], [0.6 / 2.0, 0.5]]), atol=1e-6)


def test_appendix_b_teacher_and_its_score_with_a_visible_eps():
    """Appendix B with eps = 0.5: the clients upload (f_k + eps) s_k and f_k + eps; the teacher is their ratio of
    sums, and server/disc_score_mean the mean of the f_k themselves."""
    algo = DaFKD(dafkd_config(algorithm__private_discriminator=True, algorithm__alpha_eps=0.5), None)
    s1, s2 = torch.tensor([[1.0, 0.0], [0.5, 0.5]]), torch.tensor([[0.0, 1.0], [0.2, 0.8]])
    f1, f2 = torch.tensor([0.75, 0.0]), torch.tensor([0.25, 0.0])
    ups = [DaFKDUpload(weights={}, generator={}, num_samples=1, weighted_outputs=(f + 0.5).unsqueeze(1) * s,
                       output_weights=f + 0.5) for s, f in ((s1, f1), (s2, f2))]
    ctx = ServerContext(round=1, seed=0, device=torch.device("cpu"), modules=None)
    teacher, metrics = ensemble_teacher(algo, ups, torch.zeros(2, 1), ctx)
    assert torch.allclose(teacher, torch.tensor([[1.25 / 2, 0.75 / 2], [0.35, 0.65]]), atol=1e-6)
    assert metrics["server/disc_score_mean"] == pytest.approx(0.25, abs=1e-6)


def test_eq8_with_adam_takes_the_asked_learning_rate():
    """distill_optimizer=adam (the authors' code): one distillation step moves each weight by distill_lr."""
    cfg = dafkd_config(algorithm__distill_steps=1, algorithm__distill_optimizer="adam", algorithm__distill_lr=0.05)
    algo = DaFKD(cfg, SPEC_TINY)
    modules = algo.build_modules()
    state = algo.init_server_state(modules)
    uploads = _other_uploads(algo, (10, 10))
    new, _ = algo.server_update(state, uploads, ServerContext(1, 0, torch.device("cpu"), modules))
    average = {k: (uploads[0].weights[k] + uploads[1].weights[k]) / 2 for k in uploads[0].weights}
    moved = max(float((new.weights[k] - average[k]).abs().max()) for k in average if average[k].is_floating_point())
    assert moved == pytest.approx(0.05, rel=1e-3)


@pytest.mark.parametrize("vectorize", [False, True])
def test_the_generators_weight_decay_is_its_own_when_set(vectorize):
    """gen_weight_decay: None is federation.weight_decay (the same run as naming it); another value gives another
    generator, per client and batched."""
    kw = {"federation__weight_decay": 1e-3, "runtime__vectorize": vectorize}
    runs = [_run_rounds(dafkd_config(**kw, algorithm__distill_steps=0, **over), 1)
            for over in ({}, {"algorithm__gen_weight_decay": 1e-3}, {"algorithm__gen_weight_decay": 0.5})]
    (_, _, s0, _), (_, _, s1, _), (_, _, s2, _) = runs
    assert all(torch.equal(s0.generator[k], s1.generator[k]) for k in s0.generator)
    assert not all(torch.equal(s0.generator[k], s2.generator[k]) for k in s0.generator)


def test_the_generators_and_discriminators_steps_take_their_configured_lrs():
    """algorithm.gen_lr: after one local step, Adam's first, each generator parameter has moved by at most gen_lr,
    the largest by gen_lr itself. algorithm.disc_lr: the head's steps are the federation's SGD at disc_lr, so doubling
    disc_lr doubles the head's first move."""
    from fedray.learning.training import run_update
    from tests.methods.plans import client_step

    heads = []
    for disc_lr in (0.03, 0.06):
        with client_step(**{**SMALL, "algorithm__gen_lr": 0.02, "algorithm__disc_lr": disc_lr,
                            "federation__local_steps": 1}) as s:
            result = run_update(s.ctx, s.plan)
            names = [k for k, _ in s.ctx.modules.generator.named_parameters()]
            step = max(float((result.upload.generator[k] - s.payload.generator[k]).abs().max()) for k in names)
            assert step == pytest.approx(0.02, rel=1e-3) and step <= 0.02 + 1e-6  # float32 parameters
            heads.append(torch.cat([(result.state.disc[k] - s.state.disc[k]).flatten()
                                    for k, _ in s.ctx.modules.disc.named_parameters()]))
    # two SGD updates move the head in a step (the classifier's loss, then Eq. 2's), the second from where the
    # first left it: doubled to within the first-order change of the second's gradient
    assert heads[0].abs().max() > 0 and torch.allclose(heads[1], 2 * heads[0], rtol=0.02, atol=1e-6)


@pytest.mark.parametrize("ensemble", ["probs", "logits"])
def test_a_clients_soft_outputs_are_its_tempered_probabilities_or_its_logits(ensemble):
    """algorithm.ensemble: what Eq. 7's ensemble sums, s_k(x) = softmax(z_k(x) / T) (probs, the paper) or z_k(x)
    (logits, the authors' code), for the classifier loaded in the modules (eval mode)."""
    algo = DaFKD(dafkd_config(algorithm__ensemble=ensemble, algorithm__temperature=2.0), SPEC_TINY)
    modules = algo.build_modules()
    x = torch.randn(5, *SPEC_TINY.input_shape, generator=torch.Generator().manual_seed(0))
    s, f = algo.client_outputs(modules, x)
    with torch.no_grad():
        z = modules.model(x)
    want = torch.softmax(z / 2.0, dim=1) if ensemble == "probs" else z
    assert torch.allclose(s, want, atol=1e-6) and f.shape == (5,) and ((f > 0) & (f < 1)).all()
