"""FedD3A (Eq. 5-8) and FedDF: teacher weights and both server steps by hand, the client's projector, what is
communicated, homogeneous and heterogeneous runs, early stopping, diagnostics, and the presets on fabricated images."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from fedray.methods import DataSpec, ServerContext, load_experiment, validate_experiment
from fedray.methods.api import ServerSideData
from fedray.methods.fedd3a import weights_for
from fedray.learning.subspace import projector
from fedray.data import build_federated_data
from fedray.data.federated import to_float
from fedray.errors import ConfigError
from fedray.runtime import make_runtime
from fedray.seeding import derive_seed
from fedray.simulation import run_experiment
from tests.conftest import tiny_config

SERVER = {"data__server_data__kind": "holdout", "data__server_data__per_class": 10,
          "data__server_data__labelled": False}


def _eval(result):
    return [{k: v for k, v in row.items() if k.startswith(("eval/", "diag/"))} for row in result.history]


def test_teacher_weights_by_hand():
    r = torch.tensor([[0.9, 0.1], [0.5, 0.5]], dtype=torch.float64)
    soft = weights_for("soft", r, 0)
    # row 0: (r - mean) / std = (+-0.4) / (0.4 * sqrt 2) = +-1/sqrt 2 -> softmax; row 1: equal -> uniform
    z = 1 / math.sqrt(2)
    assert soft[0].tolist() == pytest.approx([math.exp(z) / (math.exp(z) + math.exp(-z)),
                                             math.exp(-z) / (math.exp(z) + math.exp(-z))])
    assert soft[1].tolist() == pytest.approx([0.5, 0.5])
    assert weights_for("onehot", r, 0)[0].tolist() == [1.0, 0.0]
    assert weights_for("avg", r, 0).tolist() == [[0.5, 0.5], [0.5, 0.5]]
    rnd = weights_for("random", r, 7)
    assert torch.equal(rnd, weights_for("random", r, 7)) and rnd.sum(1).tolist() == pytest.approx([1.0, 1.0])


def test_client_projector_is_eq5_over_the_clients_batches():
    cfg = validate_experiment(tiny_config(algorithm__name="fedd3a", algorithm__proj_a=0.5, **SERVER))
    data = build_federated_data(cfg.data, cfg.seed)
    with make_runtime(cfg, data) as rt:
        payload, _ = rt.server.payload(0)
        upload, _, info, _ = rt.worker.train(1, 2, payload, None)
        model = rt.worker.modules.model
        model.load_state_dict(payload.weights)
        model.eval()
        ctx_x = torch.from_numpy(data.train_x[data.client_train[2]])
        seed = derive_seed(derive_seed(cfg.seed, "client", 1, 2), "fedd3a/projector")  # the client's stream
        perm = torch.randperm(len(ctx_x), generator=torch.Generator().manual_seed(seed % (1 << 63)))
        with torch.no_grad():
            feats = model.features(to_float(ctx_x[perm], data.mean, data.std))
    expected = projector(feats, 0.5, batch_size=cfg.federation.batch_size).float()
    assert torch.allclose(upload.projector, expected, atol=1e-6)
    eig = torch.linalg.eigvalsh(upload.projector.double())
    assert eig.min() > -1e-6 and eig.max() < 1.0
    d = model.feature_dim
    n_weights = sum(v.numel() * v.element_size() for v in upload.weights.values())
    assert info["bytes_up"] == n_weights + d * d * 4 + 8  # model + P_k (float32) + the sample count


@pytest.mark.parametrize("extra", [{}, {"model__client_models": ["lenet5", "resnet8"]}], ids=["homogeneous", "heterogeneous"])
def test_two_round_run_repeats_and_reports_its_mechanism(extra):
    cfg = tiny_config(algorithm__name="fedd3a", federation__rounds=2, federation__local_steps=10, **SERVER, **extra)
    a, b = run_experiment(cfg, progress=False), run_experiment(cfg, progress=False)
    assert _eval(a) == _eval(b)
    row = a.history[-1]
    assert 0 <= row["server/alpha_entropy"] <= 1 and 1 / 3 <= row["server/alpha_max_mean"] <= 1
    # the server's data has labels in the simulation (hidden from the method): every weighting is scored
    assert {f"diag/teacher_acc_{k}" for k in ("soft", "onehot", "avg", "random", "best_single")} <= set(row)
    assert 0 <= row["diag/student_acc_start"] <= 1 and 0 <= row["diag/student_acc"] <= 1


def test_weightings_change_the_teacher_not_the_clients():
    base = dict(algorithm__name="fedd3a", federation__rounds=1, federation__local_steps=15, **SERVER)
    runs = {w: run_experiment(tiny_config(**base, algorithm__weighting=w), progress=False).history[0]
            for w in ("soft", "avg", "onehot")}
    assert runs["soft"]["train/loss"] == runs["avg"]["train/loss"]  # round 1: same clients
    assert runs["soft"]["diag/teacher_acc_soft"] == runs["avg"]["diag/teacher_acc_soft"]
    assert runs["soft"]["diag/student_acc_start"] == runs["avg"]["diag/student_acc_start"]  # the same average
    assert runs["soft"]["server/alpha_entropy"] < runs["avg"]["server/alpha_entropy"] == pytest.approx(1.0)
    # one teacher per sample: every row one-hot, entropy 0 and the largest weight 1
    assert runs["onehot"]["server/alpha_entropy"] == 0.0 and runs["onehot"]["server/alpha_max_mean"] == 1.0


def test_feddf_distils_the_mean_logits_with_early_stopping():
    cfg = tiny_config(algorithm__name="feddf", federation__rounds=2, algorithm__distill_epochs=50,
                      algorithm__patience=1, algorithm__eval_every=2, algorithm__val_fraction=0.2, **SERVER)
    result = run_experiment(cfg, progress=False)
    row = result.history[-1]
    max_steps = 50 * math.ceil(80 / 128)  # 100 server images, 20 held out, batch 128: one step a pass
    assert row["server/distill_steps"] < max_steps  # stopped early
    assert 0 <= row["server/val_agreement"] <= 1
    uploads = 2 * cfg.federation.clients_per_round  # FedAvg's traffic only: the model, + the sample count up
    assert result.summary["comm/bytes_up"] == result.summary["comm/bytes_down"] + 8 * uploads
    # simulation-only: the ensemble's, the average's and the student's accuracy on the server's data
    assert {"diag/teacher_acc", "diag/student_acc_start", "diag/student_acc"} <= row.keys()
    assert all(0 <= row[k] <= 1 for k in ("diag/teacher_acc", "diag/student_acc_start", "diag/student_acc"))


# --- server steps by hand --------------------------------------------------------------------------------
# Models whose every parameter is 0 but the head's bias b: their logits are b on any image (features are 0, or
# anything: the head's weight is 0). The student starts from the sample-weighted average, so its logits are the
# average bias; the first distillation step's loss, T^2 KL(teacher || softmax(student / T)), is then a number by hand.

SPEC = DataSpec(input_shape=(1, 16, 16), num_classes=10, num_clients=6, mean=(0.5,), std=(0.25,))


def _with_head_bias(weights, bias, keep_backbone=False):
    """``weights`` with the head's weight 0 and its bias ``bias`` (a list, padded with 0 to 10 classes); every other
    parameter 0 too unless ``keep_backbone``."""
    out = {k: (v.clone() if keep_backbone else torch.zeros_like(v)) for k, v in weights.items()}
    out["head.weight"] = torch.zeros_like(weights["head.weight"])
    out["head.bias"] = torch.tensor(bias + [0.0] * (10 - len(bias)))
    return out


def _softmax(z):
    e = [math.exp(v) for v in z]
    return [v / sum(e) for v in e]


def _kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def test_feddf_server_step_distils_the_softmax_of_the_mean_logits_into_the_average():
    """FedDF's teacher is softmax(mean_k logits_k / T), each client's model weighing the same (not its sample
    count, not the mean of the clients' softmaxes); its student starts from FedAvg's sample-weighted average."""
    from fedray.methods.fedavg import ModelUpload
    from fedray.methods.feddf import FedDF

    t = 2.0
    cfg = validate_experiment(tiny_config(algorithm__name="feddf", algorithm__temperature=t, algorithm__patience=0,
                                          algorithm__distill_epochs=1, **SERVER))
    algo = FedDF(cfg, SPEC)
    algo.server_data = ServerSideData(x=torch.full((8, 1, 16, 16), 200, dtype=torch.uint8), y=None)
    modules = algo.build_modules()
    state = algo.init_server_state(modules)
    assert set(state.weights) >= {"head.weight", "head.bias"}
    a, b = _with_head_bias(state.weights, [2.0, 0.0]), _with_head_bias(state.weights, [0.0, 4.0])
    new, metrics = algo.server_update(state, [ModelUpload(a, num_samples=1), ModelUpload(b, num_samples=3)],
                                      ServerContext(round=1, seed=0, device=torch.device("cpu"), modules=modules))
    teacher = _softmax([0.5 * 2 / t, 0.5 * 4 / t] + [0.0] * 8)  # mean logits (1, 2, 0, ...) / T
    student = _softmax([(1 * 2 + 3 * 0) / 4 / t, (1 * 0 + 3 * 4) / 4 / t] + [0.0] * 8)  # average bias (0.5, 3) / T
    # 8 images in batches of 128: one step, and its loss is the first
    assert metrics["server/distill_steps"] == 1
    assert metrics["server/kd_loss_first"] == pytest.approx(t * t * _kl(teacher, student), rel=1e-5)
    # what the wrong teachers would have given: the sample-weighted mean of the logits is the student itself,
    # the mean of the softmaxes another distribution
    softmaxes = [(p + q) / 2 for p, q in zip(_softmax([1.0] + [0.0] * 9), _softmax([0.0, 2.0] + [0.0] * 8))]
    assert _kl(softmaxes, student) != pytest.approx(_kl(teacher, student), rel=1e-3)
    moved = [k for k in new.weights if not torch.equal(new.weights[k], (a[k] * 1 + b[k] * 3) / 4)]
    assert "head.bias" in moved  # trained from the average for its one step


def test_feddf_under_the_median_takes_it_for_the_students_start_and_for_the_teacher():
    """Three uploads whose logits are their head biases, the third forged (100 on class 0): under the median the
    student starts from the coordinate median of the models (bias (2, 0): the middle of (2, 0, 100) and of (0, 4, 0)),
    and the teacher is softmax of the median of the logits (the same (2, 0) / T): its first KD loss is 0, where the
    mean's teacher would be dominated by the forged logit. Norm bounding is refused for FedDF in one line."""
    from fedray.errors import ConfigError
    from fedray.learning.robust import build_rule
    from fedray.methods.fedavg import ModelUpload
    from fedray.methods.feddf import FedDF

    t = 2.0
    cfg = validate_experiment(tiny_config(algorithm__name="feddf", algorithm__temperature=t, algorithm__patience=0,
                                          algorithm__distill_epochs=1, aggregation__rule="median", **SERVER))
    algo = FedDF(cfg, SPEC)
    algo.server_data = ServerSideData(x=torch.full((8, 1, 16, 16), 200, dtype=torch.uint8), y=None)
    modules = algo.build_modules()
    state = algo.init_server_state(modules)
    biases = ([2.0, 0.0], [0.0, 4.0], [100.0, 0.0])
    uploads = [ModelUpload(_with_head_bias(state.weights, b), num_samples=n) for b, n in zip(biases, (1, 3, 9))]
    ctx = ServerContext(round=1, seed=0, device=torch.device("cpu"), modules=modules, aggregation=build_rule("median"))
    new, metrics = algo.server_update(state, uploads, ctx)
    assert metrics["server/kd_loss_first"] == pytest.approx(0.0, abs=1e-6)  # the student's start is the teacher
    assert algo._round[1]["head.bias"].tolist() == [2.0] + [0.0] * 9
    assert torch.allclose(algo._round[0], torch.tensor([_softmax([2.0 / t] + [0.0] * 9)] * 8))
    with pytest.raises(ConfigError, match="aggregation.rule: 'feddf' takes the rules mean, median, trimmed_mean, "
                                          "krum, multi_krum here: its teacher"):
        validate_experiment(tiny_config(algorithm__name="feddf", aggregation__rule="norm_bound",
                                        aggregation__max_norm=1.0, **SERVER))


@pytest.mark.parametrize("direction", ["teacher_student", "student_teacher"])
def test_fedd3a_server_step_weights_each_teacher_by_eq6_and_mixes_their_softmaxes_by_eq7(direction):
    """Two clients: P_1 = I keeps every feature (r_1 = cos(u, u) = 1), P_2 = 0 none (r_2 = 0, by definition), so
    Eq. 6 gives alpha = softmax((r - mean r) / std r) = softmax(1/sqrt 2, -1/sqrt 2) on every image, and Eq. 7's
    teacher is alpha_1 softmax(b_1 / T) + alpha_2 softmax(b_2 / T). Eq. 8's loss is KL(teacher || student), or
    with kl_direction=student_teacher the order its text writes, KL(student || teacher)."""
    from fedray.methods.fedd3a import FedD3A, FedD3AUpload

    t = 2.0
    cfg = validate_experiment(tiny_config(algorithm__name="fedd3a", algorithm__temperature=t,
                                          algorithm__distill_epochs=1, algorithm__kl_direction=direction, **SERVER))
    algo = FedD3A(cfg, SPEC)
    algo.server_data = ServerSideData(x=torch.full((8, 1, 16, 16), 200, dtype=torch.uint8), y=None)
    modules = algo.build_modules()
    state = algo.init_server_state(modules)  # its backbone B: the initial model's
    modules.model.load_state_dict(state.weights)
    with torch.no_grad():
        feats = modules.model.features(torch.full((1, 1, 16, 16), (200 / 255 - 0.5) / 0.25))
    assert feats.abs().sum() > 0  # u != 0: cos(u, P u) is defined
    d = feats.shape[1]
    ups = [FedD3AUpload(weights=_with_head_bias(state.weights, bias, keep_backbone=True), architecture="lenet5",
                        num_samples=n, projector=p)
           for bias, n, p in (([2.0, 0.0], 1, torch.eye(d)), ([0.0, 4.0], 3, torch.zeros(d, d)))]
    _, metrics = algo.server_update(state, ups, ServerContext(round=1, seed=0, device=torch.device("cpu"),
                                                              modules=modules))
    z = 1 / math.sqrt(2)  # r = (1, 0): mean 1/2, sample std 1/sqrt 2
    alpha = _softmax([z, -z])
    teacher = [alpha[0] * p + alpha[1] * q
               for p, q in zip(_softmax([2 / t] + [0.0] * 9), _softmax([0.0, 4 / t] + [0.0] * 8))]
    student = _softmax([0.5 / t, 3 / t] + [0.0] * 8)  # the sample-weighted average's bias (0.5, 3)
    assert metrics["server/r_mean"] == pytest.approx(0.5)
    assert metrics["server/alpha_max_mean"] == pytest.approx(alpha[0])
    h = -sum(a * math.log(a) for a in alpha) / math.log(2)
    assert metrics["server/alpha_entropy"] == pytest.approx(h)
    kl = _kl(teacher, student) if direction == "teacher_student" else _kl(student, teacher)
    assert metrics["server/kd_loss_first"] == pytest.approx(t * t * kl, rel=1e-5)


def test_the_servers_distillation_lr_follows_the_clients_schedule(monkeypatch):
    """With federation.lr_schedule=cosine the server's distill_lr is scaled as the clients' lr is, each round."""
    import fedray.methods.fedd3a as fedd3a

    seen = []
    original = fedd3a.distil
    monkeypatch.setattr(fedd3a, "distil", lambda *a, **k: seen.append(a[5].lr) or original(*a, **k))
    cfg = tiny_config(algorithm__name="fedd3a", algorithm__distill_lr=0.1, federation__lr=0.05,
                      federation__lr_schedule="cosine", federation__lr_min=0.005, federation__rounds=3, **SERVER)
    run_experiment(cfg, progress=False)
    fed = cfg.federation
    assert seen == pytest.approx([0.1 * fed.lr_at(r) / fed.lr for r in (1, 2, 3)])
    assert seen[0] == pytest.approx(0.1) and seen[-1] == pytest.approx(0.01)


def test_random_weighting_draws_fresh_noise_each_round(monkeypatch):
    import fedray.methods.fedd3a as fedd3a

    drawn = {}  # seed -> the random weights drawn with it (the diagnostics redraw the round's, with its seed)
    original = fedd3a.weights_for

    def spy(kind, r, seed):
        out = original(kind, r, seed)
        if kind == "random":
            drawn[seed] = out
        return out

    monkeypatch.setattr(fedd3a, "weights_for", spy)
    run_experiment(tiny_config(algorithm__name="fedd3a", algorithm__weighting="random", federation__rounds=2,
                               **SERVER), progress=False)
    first, second = drawn.values()  # one seed a round
    assert first.shape == second.shape and not torch.allclose(first, second)


@pytest.mark.parametrize("name", ["fedd3a", "feddf"])
def test_methods_need_server_data(name):
    with pytest.raises(ConfigError) as err:
        validate_experiment(tiny_config(algorithm__name=name))
    assert err.value.key == "data.server_data.kind"


def test_cosine_learning_rate_schedule():
    fed = tiny_config(federation__rounds=5, federation__lr=0.01, federation__lr_schedule="cosine",
                      federation__lr_min=0.0001).federation
    assert fed.lr_at(1) == pytest.approx(0.01) and fed.lr_at(5) == pytest.approx(0.0001)
    assert fed.lr_at(3) == pytest.approx(0.0001 + 0.0099 * 0.5)
    assert tiny_config().federation.lr_at(4) == tiny_config().federation.lr


# --- presets ----------------------------------------------------------------------------------------

def _fabricate(root, dataset, domains, classes=("0", "1", "2"), per_class=4, size=12):
    rng = np.random.default_rng(0)
    for d in domains:
        for c in classes:
            for i in range(per_class):
                path = root / dataset / d / c / f"{i}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(path)
    return root


@pytest.mark.parametrize("preset, dataset, domains, model", [
    ("fedd3a_digit5", "digit5", ["mnist", "svhn", "usps"], "lenet5"),
    ("fedd3a_domainnet", "domainnet", ["clipart", "sketch", "real"], "resnet8"),
])
def test_paper_presets_run_one_tiny_round_on_fabricated_images(preset, dataset, domains, model, tmp_path):
    root = _fabricate(tmp_path / "data", dataset, domains)
    cfg = load_experiment(preset, [f"data.data_dir={root}", f"data.domains=[{','.join(domains)}]",
                                   f"model.name={model}", "data.image_size=16", "federation.rounds=1",
                                   "federation.batch_size=4", "algorithm.distill_batch_size=4",
                                   "tracking.enabled=false"])
    assert cfg.data.server_data.domain == domains[-1] and cfg.data.num_clients == 2  # one client per other domain
    result = run_experiment(cfg, progress=False)
    assert 0.0 <= result.summary["eval/accuracy"] <= 1.0 and result.history[0]["server/distill_steps"] >= 1


def test_presets_and_sweep_spec_validate():
    from pathlib import Path

    from fedray.sweep.spec import load_spec

    fm = load_experiment("fedd3a_fmnist_domains")
    assert (fm.data.num_clients, fm.data.server_data.domain, fm.federation.lr_schedule) == (4, "blurred", "cosine")
    for preset, arch in (("fedd3a_digit5", "resnet18"), ("fedd3a_domainnet", "resnet50")):
        cfg = load_experiment(preset)
        assert cfg.model.name == arch and cfg.federation.batch_size == 256 and cfg.federation.rounds == 30
    spec = load_spec(str(Path(__file__).parents[2] / "tune_configs" / "fedd3a_proj_a.yaml"))
    assert spec.metric == "diag/teacher_acc_soft"  # not the test set


def test_identical_clients_give_the_same_teacher_under_every_weighting():
    from fedray.methods.api import ServerContext
    from fedray.methods.fedd3a import FedD3AUpload

    cfg = validate_experiment(tiny_config(algorithm__name="fedd3a", **SERVER))
    data = build_federated_data(cfg.data, cfg.seed)
    with make_runtime(cfg, data) as rt:
        payload, _ = rt.server.payload(0)
        upload, _, _, _ = rt.worker.train(1, 0, payload, None)
        twin = FedD3AUpload(weights=upload.weights, architecture=upload.architecture,
                            num_samples=upload.num_samples, projector=upload.projector)
        server = rt.server
        ctx = ServerContext(round=1, seed=0, device=torch.device("cpu"), modules=server.modules)
        server.algo.server_update(server.state, [upload, twin, upload], ctx)
        diag = server.algo.server_diagnostics(ctx, server.server_labels)
        assert server.algo._round is None  # the round's teacher is let go once scored
    accs = {diag[f"diag/teacher_acc_{k}"] for k in ("soft", "onehot", "avg", "random", "best_single")}
    assert len(accs) == 1  # one teacher, however it is weighted


def test_an_undiagnosed_round_keeps_nothing_for_the_diagnostics():
    cfg = tiny_config(algorithm__name="fedd3a", federation__rounds=3, federation__diag_every=2, **SERVER)
    data = build_federated_data(cfg.data, cfg.seed)
    diagnosed = []
    with make_runtime(cfg, data) as rt:
        for r in (1, 2):
            diagnosed.append(any(k.startswith("diag/") for k in rt.run_round(r, [0, 1, 2]).server_metrics))
            assert rt.server.algo._round is None  # round 1's teacher never held, round 2's let go once scored
    assert diagnosed == [False, True]


@pytest.mark.parametrize("name, extra, graphed", [
    ("feddf", dict(algorithm__distill_epochs=20, algorithm__patience=2, algorithm__eval_every=3,
                   algorithm__val_fraction=0.2, algorithm__distill_optimizer="sgd"), True),  # evaluations between
    ("feddf", dict(algorithm__distill_epochs=6), False),  # the paper's Adam (host step counts): never captured
    ("fedd3a", dict(algorithm__distill_epochs=6), True)])
def test_server_distillation_replayed_as_a_cuda_graph_gives_the_eager_numbers(graphs_on_cpu, name, extra, graphed):
    """The server's distillation steps with ``runtime.cuda_graphs`` (on the CPU a stand-in replay under the capture's
    rules, tests/conftest.py): after 2 eager steps and the capture, replays, with the eager run's weights and
    figures (losses, early-stopping agreement and step)."""
    runs = [run_experiment(tiny_config(algorithm__name=name, federation__rounds=2, runtime__cuda_graphs=graphs,
                                       **SERVER, **extra), progress=False) for graphs in (False, True)]
    untimed = [[{k: v for k, v in row.items() if not k.startswith("time/")} for row in r.history] for r in runs]
    assert untimed[0] == untimed[1] and "server/kd_loss_last" in untimed[1][-1]
    assert (len(graphs_on_cpu) > 0) == graphed


@pytest.mark.parametrize("name", ["feddf", "fedd3a"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_server_distils_with_the_configured_optimizer(name, optimizer):
    """algorithm.distill_optimizer reaches FedDF's and FedD3A's distillation settings (what each optimizer's step
    is: tests/learning/test_proxy_distill.py, by hand)."""
    from fedray.methods import resolve_experiment

    cfg = tiny_config(algorithm__name=name, algorithm__distill_optimizer=optimizer, **SERVER)
    algo = resolve_experiment(cfg).build(DataSpec((1, 16, 16), 10, 6, (0.5,), (0.25,)))
    assert (algo.settings() if name == "feddf" else algo.settings(1)).optimizer == optimizer
