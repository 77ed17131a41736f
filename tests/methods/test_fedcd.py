"""FedCD (Eq. 2 and Eq. 4) and FedDistill: the simplex solver on cases with known optima, equivalence with
isolated training when nothing is distilled, what is communicated, the server steps by hand."""

import math
from pathlib import Path

import pytest
import torch

from fedray.methods import validate_experiment
from fedray.methods.api import ServerContext, ServerSideData
from fedray.methods.fedcd import FedCD, FedCDUpload, simplex_weights
from fedray.methods.feddistill import FedDistill, LabelLogitsUpload, label_means
from fedray.errors import ConfigError
from fedray.simulation import run_experiment
from tests.conftest import tiny_config

HOLDOUT = {"data__server_data__kind": "holdout", "data__server_data__per_class": 10}
FEDCD = {"algorithm__name": "fedcd", "model__client_models": ["lenet5", "resnet8"], **HOLDOUT}


def _figures(result):
    return [{k: v for k, v in row.items() if k.startswith("eval/")} for row in result.history]


# --- Eq. 4 ------------------------------------------------------------------------------------------

def test_a_dominant_client_gets_all_the_weight():
    y = torch.tensor([0, 1, 2, 1, 0, 2])
    good = 8.0 * torch.nn.functional.one_hot(y, 3).double()  # confident and right on every sample
    noise = torch.randn(2, 6, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    gamma, info = simplex_weights(torch.stack([noise[0], good, noise[1]]), y)
    assert gamma[1] == pytest.approx(1.0, abs=1e-6) and gamma.sum() == pytest.approx(1.0)
    assert info["gap"] < 1e-6


def test_two_identical_clients_split_the_weight():
    y = torch.tensor([0, 1, 1, 0])
    good = 3.0 * torch.nn.functional.one_hot(y, 2).double()
    bad = 3.0 * torch.nn.functional.one_hot(1 - y, 2).double()  # confidently wrong: gets nothing
    gamma, _ = simplex_weights(torch.stack([good, good, bad]), y)
    assert gamma.tolist() == pytest.approx([0.5, 0.5, 0.0], abs=1e-6)


def test_complementary_clients_meet_at_the_interior_optimum():
    # Client 0 is right on sample 0 only, client 1 on sample 1 only, symmetrically: by symmetry and
    # convexity the optimum is gamma = (1/2, 1/2), where the objective is ln 2 (both samples at 50/50).
    y = torch.tensor([0, 1])
    z0 = torch.tensor([[2.0, 0.0], [2.0, 0.0]], dtype=torch.float64)
    z1 = torch.tensor([[0.0, 2.0], [0.0, 2.0]], dtype=torch.float64)
    gamma, info = simplex_weights(torch.stack([z0, z1]), y)
    assert gamma.tolist() == pytest.approx([0.5, 0.5], abs=1e-6)
    assert info["ce"] == pytest.approx(math.log(2.0), abs=1e-12)


def test_the_solution_is_no_worse_than_any_vertex_or_the_uniform_average():
    gen = torch.Generator().manual_seed(3)
    z, y = torch.randn(5, 40, 4, generator=gen, dtype=torch.float64) * 3, torch.randint(0, 4, (40,), generator=gen)
    gamma, info = simplex_weights(z, y)
    ce = lambda g: torch.nn.functional.cross_entropy(torch.einsum("n,nbc->bc", g, z), y).item()  # noqa: E731
    candidates = [torch.eye(5, dtype=torch.float64)[j] for j in range(5)] + [torch.full((5,), 0.2, dtype=torch.float64)]
    assert all(info["ce"] <= ce(g) + 1e-9 for g in candidates)
    assert info["ce"] == pytest.approx(ce(gamma)) and info["gap"] < 1e-5


# --- server step ------------------------------------------------------------------------------------

def test_server_step_weights_the_uploaded_logits_by_eq4():
    cfg = validate_experiment(tiny_config(**FEDCD, algorithm__shared_batch=4))
    algo = FedCD(cfg, None)
    y_all = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
    algo.server_data = ServerSideData(x=torch.zeros(10, 1, 16, 16, dtype=torch.uint8), y=y_all)
    idx = algo.shared_indices(1)
    y = y_all[idx]
    good = 5.0 * torch.nn.functional.one_hot(y, 10).float()
    uploads = [FedCDUpload(client_id=3, logits=torch.zeros(4, 10)), FedCDUpload(client_id=7, logits=good)]
    state, metrics = algo.server_update(algo.init_server_state(None), uploads,
                                        ServerContext(round=1, seed=0, device=torch.device("cpu"), modules=None))
    assert torch.equal(state.teacher_idx, idx)
    assert torch.allclose(state.teacher, good, atol=1e-5)  # gamma = (0, 1)
    assert metrics["server/gamma_argmax_client"] == 7 and metrics["server/gamma_max"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["server/teacher_ce"] < metrics["server/uniform_ce"]
    assert algo.broadcast(state, 2).teacher is state.teacher  # next round's teacher is this batch's ensemble
    # the solver's budget from the config: one iteration of SLSQP leaves a gap a loose tolerance accepts
    for over, check in (({"algorithm__gamma_max_iter": 1}, lambda m: m["server/gamma_iterations"] == 1),
                        ({"algorithm__gamma_tol": 0.5}, lambda m: m["server/gamma_iterations"]
                         < metrics["server/gamma_iterations"])):
        short = FedCD(validate_experiment(tiny_config(**FEDCD, algorithm__shared_batch=4, **over)), None)
        short.server_data = algo.server_data
        assert check(short.server_update(short.init_server_state(None), uploads, ServerContext(
            round=1, seed=0, device=torch.device("cpu"), modules=None))[1]), over


def test_the_uniform_teacher_is_the_mean_of_the_clients_logit_tables_by_hand():
    """ensemble=uniform under the mean: the teacher is (z_1 + z_2 + z_3) / 3, gamma 1/3 each (not the tables' sum),
    and its scores are the plain average's."""
    cfg = validate_experiment(tiny_config(**FEDCD, algorithm__shared_batch=4, algorithm__ensemble="uniform"))
    algo = FedCD(cfg, None)
    y_all = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
    algo.server_data = ServerSideData(x=torch.zeros(10, 1, 16, 16, dtype=torch.uint8), y=y_all)
    y = y_all[algo.shared_indices(1)]
    tables = [torch.full((4, 10), 3.0), 6.0 * torch.nn.functional.one_hot(y, 10).float(), torch.zeros(4, 10)]
    uploads = [FedCDUpload(client_id=c, logits=z) for c, z in enumerate(tables)]
    state, metrics = algo.server_update(algo.init_server_state(None), uploads, ServerContext(
        round=1, seed=0, device=torch.device("cpu"), modules=None))
    assert torch.allclose(state.teacher, 1.0 + 2.0 * torch.nn.functional.one_hot(y, 10).float(), atol=1e-6)
    assert state.gamma.tolist() == pytest.approx([1 / 3] * 3)
    assert metrics["server/teacher_ce"] == pytest.approx(metrics["server/uniform_ce"])


def test_the_uniform_teacher_takes_a_robust_rule_over_the_clients_logit_tables():
    """ensemble=uniform under the median: the teacher is the coordinate-wise median of the three clients' tables, a
    forged table (100s) outvoted; server/uniform_* still score the plain average. Eq. 4's teacher refuses the rule."""
    from fedray.errors import ConfigError
    from fedray.learning.robust import build_rule

    cfg = validate_experiment(tiny_config(**FEDCD, algorithm__shared_batch=4, algorithm__ensemble="uniform",
                                          aggregation__rule="median"))
    algo = FedCD(cfg, None)
    y_all = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
    algo.server_data = ServerSideData(x=torch.zeros(10, 1, 16, 16, dtype=torch.uint8), y=y_all)
    y = y_all[algo.shared_indices(1)]
    good = 5.0 * torch.nn.functional.one_hot(y, 10).float()
    tables = [good, good + 1.0, torch.full((4, 10), 100.0)]
    uploads = [FedCDUpload(client_id=c, logits=z) for c, z in enumerate(tables)]
    state, metrics = algo.server_update(algo.init_server_state(None), uploads, ServerContext(
        round=1, seed=0, device=torch.device("cpu"), modules=None, aggregation=build_rule("median")))
    assert torch.equal(state.teacher, good + 1.0)
    plain = torch.stack(tables).double().mean(0)
    assert metrics["server/uniform_ce"] == pytest.approx(float(torch.nn.functional.cross_entropy(plain, y)))
    with pytest.raises(ConfigError, match="aggregation.rule: 'fedcd' takes only the mean here: Eq. 4's teacher"):
        validate_experiment(tiny_config(**FEDCD, aggregation__rule="median"))


def test_shared_batch_is_seeded_and_changes_with_the_round():
    algo = FedCD(validate_experiment(tiny_config(**FEDCD)), None)
    algo.server_data = ServerSideData(x=torch.zeros(100, 1, 16, 16, dtype=torch.uint8), y=torch.zeros(100).long())
    assert torch.equal(algo.shared_indices(2), algo.shared_indices(2)) and len(algo.shared_indices(2)) == 64
    assert not torch.equal(algo.shared_indices(2), algo.shared_indices(3))


# --- runs -------------------------------------------------------------------------------------------

def test_fedcd_without_distillation_is_isolated_training():
    one = {"data__num_clients": 1, "federation__clients_per_round": 1, **HOLDOUT}
    fedcd = run_experiment(tiny_config(algorithm__name="fedcd", algorithm__lambda_kd=0.0, **one), progress=False)
    local = run_experiment(tiny_config(algorithm__name="local", **one), progress=False)
    assert _figures(fedcd) == _figures(local)
    several = {"data__num_clients": 4, "federation__clients_per_round": 2, **HOLDOUT}
    assert _figures(run_experiment(tiny_config(algorithm__name="fedcd", algorithm__lambda_kd=0.0, **several),
                                   progress=False)) == _figures(run_experiment(
        tiny_config(algorithm__name="local", **several), progress=False))


def test_fedcd_communicates_logits_and_indices_only():
    cfg = tiny_config(**FEDCD, algorithm__shared_batch=16, federation__rounds=3)
    result = run_experiment(cfg, progress=False)
    per_round = cfg.federation.clients_per_round
    logits = 16 * 10 * 4  # shared batch x classes x float32
    assert [r["comm/bytes_up"] for r in result.history] == [per_round * (logits + 8)] * 3  # + the sender's id
    down = [per_round * (16 * 8), per_round * (16 * 8 + 16 * 8 + logits), per_round * (16 * 8 + 16 * 8 + logits)]
    assert [r["comm/bytes_down"] for r in result.history] == down  # next indices (+ teacher indices and logits)
    assert result.summary["comm/bytes_setup"] == 100 * 16 * 16 * 6  # 100 validation images to each of 6 clients
    assert result.history[1]["server/teacher_ce"] <= result.history[1]["server/uniform_ce"] + 1e-9


def test_fedcd_needs_labelled_server_data_and_a_batch_that_fits():
    for bad in ({}, {"data__server_data__kind": "holdout", "data__server_data__labelled": False}):
        with pytest.raises(ConfigError) as err:
            validate_experiment(tiny_config(algorithm__name="fedcd", **bad))
        assert err.value.key == "data.server_data.kind"
    with pytest.raises(ConfigError) as err:
        validate_experiment(tiny_config(**FEDCD, algorithm__shared_batch=101))
    assert err.value.key == "algorithm.shared_batch" and "1..100" in str(err.value)


@pytest.mark.parametrize("name", ["fedcd", "feddistill"])
def test_two_round_run_repeats(name):
    """Same seed, same figures, every client of two architectures in every round (learning on the synthetic task:
    tests/test_every_method.py)."""
    cfg = tiny_config(algorithm__name=name, model__client_models=["lenet5", "resnet8"], federation__rounds=2,
                      federation__clients_per_round=6, **(HOLDOUT if name == "fedcd" else {}))
    a, b = run_experiment(cfg, progress=False), run_experiment(cfg, progress=False)
    assert _figures(a) == _figures(b)


# --- FedDistill -------------------------------------------------------------------------------------

def test_label_means_by_hand():
    logits = torch.tensor([[1.0, 0.0], [3.0, 2.0], [0.0, 5.0]])
    means, counts = label_means(logits, torch.tensor([0, 0, 1]), 3)
    assert means.tolist() == [[2.0, 1.0], [0.0, 5.0], [0.0, 0.0]] and counts.tolist() == [2, 1, 0]


def test_feddistill_server_averages_each_label_over_its_holders():
    algo = FedDistill(validate_experiment(tiny_config(algorithm__name="feddistill")), None)
    a = LabelLogitsUpload(logits=torch.tensor([[2.0, 0.0], [0.0, 0.0]]), counts=torch.tensor([3, 0]))
    b = LabelLogitsUpload(logits=torch.tensor([[4.0, 2.0], [1.0, 3.0]]), counts=torch.tensor([1, 5]))
    state, metrics = algo.server_update(algo.init_server_state(None), [a, b],
                                        ServerContext(round=1, seed=0, device=torch.device("cpu"), modules=None))
    assert state.logits.tolist() == [[3.0, 1.0], [1.0, 3.0]]  # label 1 only from b; unweighted by counts
    assert state.present.tolist() == [True, True] and metrics["server/labels_present"] == 2


def test_feddistill_communicates_label_logits_only():
    cfg = tiny_config(algorithm__name="feddistill", federation__rounds=2)
    result = run_experiment(cfg, progress=False)
    up = 10 * 10 * 4 + 10 * 8  # C x C float32 + C int64 counts
    assert [r["comm/bytes_up"] for r in result.history] == [3 * up] * 2
    assert [r["comm/bytes_down"] for r in result.history] == [0, 3 * (10 * 10 * 4 + 10)]


# --- presets ----------------------------------------------------------------------------------------

def test_presets_and_sweep_spec_validate():
    from fedray.methods import load_experiment
    from fedray.sweep.spec import load_spec

    fm = load_experiment("fedcd_fmnist")
    assert len(set(fm.model.client_models)) == fm.data.num_clients == fm.federation.clients_per_round == 10
    cifar = load_experiment("fedcd_cifar100")
    assert cifar.model.client_models == ["resnet8_bn", "resnet14", "resnet20", "resnet32", "resnet44", "resnet50",
                                         "resnet56", "resnet110", "resnet8x4", "resnet32x4"]  # Table I
    assert (cifar.federation.rounds, cifar.federation.batch_size, cifar.federation.weight_decay) == (200, 64, 1e-4)
    assert cifar.data.server_data.per_class == 50
    spec = load_spec(str(Path(__file__).parents[2] / "tune_configs" / "fedcd_lambda_t.yaml"))
    assert spec.metric == "server/teacher_ce"  # selected on the validation set, not the test set


@pytest.mark.slow
def test_cifar100_preset_runs_one_tiny_round_on_cifar_shaped_data():
    from fedray.methods import load_experiment

    cfg = load_experiment("fedcd_cifar100", [
        "data.dataset=synthetic", "data.synthetic_channels=3", "data.synthetic_image_size=32",
        "data.synthetic_num_classes=100", "data.synthetic_train_samples=600", "data.synthetic_test_samples=50",
        "data.server_data.per_class=2", "algorithm.shared_batch=8", "data.alpha=100", "data.min_samples=20",
        "federation.rounds=1", "federation.local_epochs=null", "federation.local_steps=1",
        "federation.batch_size=4", "tracking.enabled=false"])
    result = run_experiment(cfg, progress=False)
    assert result.summary["comm/bytes_up"] == 10 * (8 * 100 * 4 + 8)  # ten users' logits on the shared batch
    assert 0.0 <= result.summary["eval/accuracy"] <= 1.0


# --- Eq. 4 scored on images its gamma was not fit on -------------------------------------------------------------


def test_heldout_scores_apply_last_rounds_gamma_to_the_fresh_images_of_this_rounds_batch():
    from fedray.methods.fedcd import FedCDServerState, FedCDUpload, heldout_scores

    # last round: gamma all on client 7, fit on images 0..3; this round's batch: images 2..5 (2, 3 seen before)
    state = FedCDServerState(gamma=torch.tensor([0.0, 1.0], dtype=torch.float64),
                             gamma_clients=torch.tensor([3, 7]), teacher_idx=torch.tensor([0, 1, 2, 3]))
    idx = torch.tensor([2, 3, 4, 5])
    y = torch.tensor([0, 1, 0, 1])
    right = torch.tensor([[4.0, 0.0], [0.0, 4.0], [4.0, 0.0], [0.0, 4.0]], dtype=torch.float64)
    wrong = right.flip(1)
    uploads = [FedCDUpload(client_id=7, logits=right.float()), FedCDUpload(client_id=3, logits=wrong.float())]
    z = torch.stack([right, wrong])  # upload order: client 7, then 3
    out = heldout_scores(state, uploads, z, y, idx)
    assert out["server/heldout_images"] == 2  # images 4 and 5 only
    assert out["server/teacher_acc_heldout"] == 1.0  # gamma follows the client ids, not the upload order
    assert out["server/uniform_ce_heldout"] > out["server/teacher_ce_heldout"]
    assert out["server/teacher_ce_heldout"] == pytest.approx(float(torch.nn.functional.cross_entropy(right[2:], y[2:])))
    # another set of clients than gamma's, or no fresh image: nothing to score
    assert heldout_scores(state, uploads[:1], z[:1], y, idx) == {}
    assert heldout_scores(state, uploads, z, y, torch.tensor([0, 1, 2, 3])) == {}


def test_a_fedcd_run_logs_the_heldout_scores_from_round_two():
    h = run_experiment(tiny_config(**FEDCD, federation__rounds=3, federation__clients_per_round=6),
                       progress=False).history
    assert "server/teacher_ce_heldout" not in h[0]
    assert all(0 < row["server/heldout_images"] <= 64 for row in h[1:])
