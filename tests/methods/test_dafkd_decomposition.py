"""DaFKD decomposed: where Eq. 7's weights come from (alpha_source: discriminator | theorem1 | label_share |
uniform), what is distilled on (distill_data: generated | proxy), the discriminators' negatives (disc_negatives)
and one discriminator head for all clients (disc_head)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedray.errors import ConfigError
from fedray.methods import resolve_experiment
from fedray.methods.dafkd.server import label_share_weights, theorem1_weights
from fedray.simulation import run_experiment
from tests.conftest import method_overrides
from tests.methods.test_dafkd import _run_rounds, dafkd_config

PROXY = {"data__server_data__kind": "holdout", "data__server_data__per_class": 10,
         "data__server_data__labelled": False, "data__server_data__keep_in_training": True}


def test_label_share_weights_are_the_clients_shares_of_each_samples_class():
    counts = torch.tensor([[30, 0, 5],   # client 1's label counts
                           [10, 0, 15],  # client 2
                           [0, 0, 0]])   # client 3 holds none of these classes
    y = torch.tensor([0, 2, 2, 1])
    alpha = label_share_weights(counts, y)
    expected = torch.tensor([[0.75, 0.25, 0.25, 1 / 3], [0.25, 0.75, 0.75, 1 / 3], [0.0, 0.0, 0.0, 1 / 3]])
    assert torch.allclose(alpha, expected)  # class 1: held by no client of the round, so uniform
    assert torch.allclose(alpha.sum(0), torch.ones(4))


def test_theorem1_weights_by_hand_for_three_clients_and_three_classes():
    """f*_k = pi_k(y) / (pi_k(y) + pi(y)), pi the mean of all K clients' class distributions (Appendix C's p),
    normalised over the round's clients (Eq. 7)."""
    counts = torch.tensor([[6, 3, 1],    # pi_0 = (0.6, 0.3, 0.1)
                           [0, 5, 5],    # pi_1 = (0, 0.5, 0.5)
                           [2, 0, 18]])  # pi_2 = (0.1, 0, 0.9): 20 images, weighing as much as the others in pi
    pi = torch.tensor([0.7, 0.8, 1.5], dtype=torch.float64) / 3
    y = torch.tensor([0, 1, 2])
    f = torch.tensor([[0.6 / (0.6 + pi[0]), 0.3 / (0.3 + pi[1]), 0.1 / (0.1 + pi[2])],
                      [0.0, 0.5 / (0.5 + pi[1]), 0.5 / (0.5 + pi[2])],
                      [0.1 / (0.1 + pi[0]), 0.0, 0.9 / (0.9 + pi[2])]], dtype=torch.float64)
    assert torch.allclose(theorem1_weights(counts, [0, 1, 2], y, 1e-12), (f / f.sum(0)).float())
    # a round of clients 0 and 1 only: the same f*, normalised over them; pi still over all three
    assert torch.allclose(theorem1_weights(counts, [0, 1], y, 1e-12), (f[:2] / f[:2].sum(0)).float())
    # flatter than the shares: client 0 holds 3/4 of the round's class-0 images but gets less than 3/4 weight
    shares = label_share_weights(counts[[0, 2]], y)
    assert shares[0, 0] == pytest.approx(0.75) and theorem1_weights(counts, [0, 2], y, 1e-12)[0, 0] < 0.75
    # a class no client of the round holds: uniform
    none = theorem1_weights(torch.tensor([[1, 0], [1, 0], [0, 4]]), [0, 1], torch.tensor([1]), 1e-8)
    assert torch.allclose(none, torch.full((2, 1), 0.5))


def test_a_theorem1_run_weighs_by_every_clients_counts_sent_once(monkeypatch):
    """The server holds every registered client's label counts from the start (counted in comm/bytes_setup, not
    in each round's uploads), and weighs the round's clients by them at the generated samples' classes."""
    from fedray.methods.dafkd import server

    seen = {}
    original = server.theorem1_weights

    def spy(counts, client_ids, y, eps):
        seen.update(counts=counts.clone(), ids=list(client_ids), y=y.clone())
        return original(counts, client_ids, y, eps)

    monkeypatch.setattr(server, "theorem1_weights", spy)
    cfg = dafkd_config(algorithm__generator="conditional", algorithm__alpha_source="theorem1")
    label = dafkd_config(algorithm__generator="conditional", algorithm__alpha_source="label_share")
    result, shares = run_experiment(cfg, progress=False), run_experiment(label, progress=False)
    every = torch.stack([torch.bincount(torch.as_tensor(_client_labels(cfg, c)), minlength=10)
                         for c in range(cfg.data.num_clients)])
    assert torch.equal(seen["counts"].cpu(), every) and seen["ids"] == _round_clients(cfg, 2)
    assert seen["y"].tolist() == (torch.arange(48) % 10).tolist()
    assert result.summary["comm/bytes_setup"] == cfg.data.num_clients * 10 * 8
    assert shares.summary.get("comm/bytes_setup", 0) == 0
    # its uploads: a client id where label_share sends ten counts
    k = cfg.federation.clients_per_round
    assert shares.history[0]["comm/bytes_up"] - result.history[0]["comm/bytes_up"] == k * (8 * 10 - 8)
    entropy = [r["server/alpha_entropy"] for r in (result.history[-1], shares.history[-1])]
    assert entropy[0] < 0.99 and entropy[0] != entropy[1]  # not uniform, and not the shares


def test_an_oracle_run_weighs_the_generated_classes_by_the_uploaded_label_counts(monkeypatch):
    """The server's teacher weights on round 2 are the label-count shares of the sampled clients at the
    conditional generator's classes; the counts go up with the uploads and are counted in bytes."""
    from fedray.methods.dafkd import server

    seen = {}
    original = server.label_share_weights

    def spy(counts, y):
        seen["counts"], seen["y"], seen["alpha"] = counts.clone(), y.clone(), original(counts, y)
        return seen["alpha"]

    monkeypatch.setattr(server, "label_share_weights", spy)
    cfg = dafkd_config(algorithm__generator="conditional", algorithm__alpha_source="label_share")
    base = dafkd_config(algorithm__generator="conditional", algorithm__alpha_source="discriminator")
    result, reference = run_experiment(cfg, progress=False), run_experiment(base, progress=False)
    assert seen["y"].tolist() == (torch.arange(48) % 10).tolist()  # distill_samples=48, every class in turn
    data_counts = torch.stack([torch.bincount(torch.as_tensor(_client_labels(cfg, c)), minlength=10)
                               for c in _round_clients(cfg, 2)])
    assert torch.equal(seen["counts"], data_counts)
    k = cfg.federation.clients_per_round
    disc_head = (84 + 1) * 4  # the discriminator head, which the oracle does not need
    assert result.history[0]["comm/bytes_up"] == reference.history[0]["comm/bytes_up"] - k * disc_head + k * 8 * 10
    assert result.history[-1]["server/alpha_entropy"] < 0.99  # non-IID shares: far from uniform
    # the teacher's reading of the generated samples against the classes they were generated for
    assert 0 <= result.history[-1]["server/teacher_label_agreement"] <= 1
    assert "server/teacher_label_agreement" not in run_experiment(dafkd_config(), progress=False).history[-1]


def _round_clients(cfg, round_):
    from fedray.data import build_federated_data
    from fedray.seeding import sample_clients

    data = build_federated_data(cfg.data, cfg.seed)
    return sample_clients(cfg.seed, round_, data.num_clients, cfg.federation.clients_per_round)


def _client_labels(cfg, client):
    from fedray.data import build_federated_data

    data = build_federated_data(cfg.data, cfg.seed)
    return data.train_y[data.client_train[client]]


def test_uniform_source_is_the_no_correlation_ablation():
    uniform = run_experiment(dafkd_config(algorithm__alpha_source="uniform"), progress=False).history
    no_corr = run_experiment(dafkd_config(algorithm__correlation=False), progress=False).history
    assert uniform[-1]["eval/accuracy"] == no_corr[-1]["eval/accuracy"]
    assert uniform[-1]["comm/bytes_up"] == no_corr[-1]["comm/bytes_up"]
    assert uniform[-1]["server/alpha_entropy"] == pytest.approx(1.0)


def test_proxy_distillation_never_reads_the_servers_labels():
    """The same run with the server's images labelled and unlabelled ends with the same weights: the labels,
    visible to the method in the first, are never read (the discriminators weigh). Distilling on the proxy
    images is not distilling on generated ones."""
    unlabelled = dafkd_config(algorithm__distill_data="proxy", **PROXY)
    labelled = dafkd_config(algorithm__distill_data="proxy", **{**PROXY, "data__server_data__labelled": True})
    a, b = _run_rounds(unlabelled, 2)[0], _run_rounds(labelled, 2)[0]
    assert all(torch.equal(a[k], b[k]) for k in a)
    generated = _run_rounds(dafkd_config(algorithm__distill_data="generated", **PROXY), 2)[0]
    assert not all(torch.equal(a[k], generated[k]) for k in a)


def test_proxy_images_are_drawn_from_the_servers_data_anew_each_round():
    cfg = dafkd_config(algorithm__distill_data="proxy", **PROXY)
    from fedray.data import build_federated_data
    from fedray.runtime.core import data_spec
    from fedray.runtime.server_inputs import server_side_data

    data = build_federated_data(cfg.data, cfg.seed)
    algo = resolve_experiment(cfg).build(data_spec(data))
    algo.server_data = server_side_data(data, torch.device("cpu"))
    assert algo.server_data.y is None  # unlabelled: the runtime never hands the method the labels
    x1, y1 = algo.distillation_data(None, None, 1, torch.device("cpu"))
    x2, _ = algo.distillation_data(None, None, 2, torch.device("cpu"))
    assert x1.shape == (48, 1, 16, 16) and y1 is None and not torch.equal(x1, x2)
    assert torch.equal(x1, algo.distillation_data(None, None, 1, torch.device("cpu"))[0])  # seeded per round


def test_an_averaged_head_is_the_mean_of_the_uploaded_heads_and_every_client_starts_from_it():
    cfg = dafkd_config(algorithm__disc_head="averaged", algorithm__aggregation="uniform")
    _, outcomes, server_state, client_states = _run_rounds(cfg, 2)
    assert server_state.disc is not None
    own = _run_rounds(dafkd_config(algorithm__disc_head="own"), 2)[2]
    assert own.disc is None  # the paper's: no head at the server
    # every client the last round trained ended from the same start; their heads' mean is the server's
    heads = [client_states[c].disc for c in _round_clients(cfg, 2)]
    mean = {k: torch.stack([h[k] for h in heads]).mean(0) for k in heads[0]}
    assert all(torch.allclose(mean[k], server_state.disc[k], atol=1e-6) for k in mean)
    # the start itself: with D trained in round 1 only, a client's round-2 head is the one it started from, which is
    # round 1's average (the server's head), not the head it left in round 1 (a client of both rounds shows it)
    frozen = dafkd_config(algorithm__disc_head="averaged", algorithm__aggregation="uniform",
                          algorithm__disc_train_rounds=1)
    _, _, after_1, states_1 = _run_rounds(frozen, 1)
    _, _, _, states_2 = _run_rounds(frozen, 2)
    both = sorted(set(_round_clients(frozen, 1)) & set(_round_clients(frozen, 2)))
    assert both
    for c in _round_clients(frozen, 2):
        assert all(torch.equal(states_2[c].disc[k], after_1.disc[k]) for k in after_1.disc)
    assert not all(torch.equal(states_1[c].disc[k], after_1.disc[k]) for c in both for k in after_1.disc)


@pytest.mark.parametrize("over, key", [
    ({"algorithm__alpha_source": "label_share"}, "algorithm.alpha_source"),  # dcgan samples have no class
    ({"algorithm__alpha_source": "theorem1"}, "algorithm.alpha_source"),
    ({"algorithm__alpha_source": "label_share", "algorithm__distill_data": "proxy", **PROXY},
     "algorithm.alpha_source"),
    ({"algorithm__distill_data": "proxy"}, "data.server_data.kind"),
    ({"algorithm__private_discriminator": True, "algorithm__alpha_source": "uniform"},
     "algorithm.private_discriminator"),
    ({"algorithm__correlation": False, "algorithm__alpha_source": "theorem1", "algorithm__generator": "conditional"},
     "algorithm.alpha_source"),
    ({"algorithm__disc_head": "averaged", "algorithm__sharing": False}, "algorithm.disc_head"),
])
def test_combinations_that_cannot_run_are_refused_naming_the_key(over, key):
    with pytest.raises(ConfigError) as e:
        resolve_experiment(dafkd_config(**over))
    assert e.value.key == key


def test_the_former_name_oracle_loads_as_label_share():
    """Configs (and the checkpoints that hold them) written when label_share was called oracle still load."""
    assert resolve_experiment(dafkd_config(algorithm__alpha_source="oracle", algorithm__generator="conditional")
                              ).params.alpha_source == "label_share"


def test_oracle_on_labelled_proxy_images_runs():
    cfg = dafkd_config(algorithm__alpha_source="label_share", algorithm__distill_data="proxy",
                       **{**PROXY, "data__server_data__labelled": True})
    h = run_experiment(cfg, progress=False).history
    assert h[-1]["server/alpha_entropy"] < 0.99 and "server/disc_score_mean" not in h[-1]


def test_pooled_images_are_drawn_from_the_mixture_of_the_clients_each_weighing_one_kth():
    from fedray.methods.api import PooledImages

    images = np.arange(100, dtype=np.uint8).reshape(100, 1, 1, 1)
    pooled = PooledImages(images, [np.array([0]), np.arange(1, 100)])  # a client of 1 image, one of 99
    drawn = pooled.draw(4000, torch.Generator().manual_seed(0)).flatten()
    assert drawn.dtype == torch.uint8 and 0.45 < float((drawn == 0).float().mean()) < 0.55  # p's centroid, not 1 %


def test_pooled_negatives_train_the_discriminators_on_real_images_of_p_batched_as_alone(monkeypatch):
    """disc_negatives=pooled (a diagnostic): Eq. 2's negatives are real images drawn from every client's data; the
    batched plan gives the sequential client's figures (float64, two rounds of every client), and the default
    draws none."""
    from fedray.learning.boundary import PooledImages
    from tests.test_every_method import VECTORISED
    from tests.vectorized.test_vectorized import _max_relative_difference, _one_round, float64_runs

    drawn = []
    original = PooledImages.draw
    monkeypatch.setattr(PooledImages, "draw",
                        lambda self, n, rng: drawn.append(len(self.clients)) or original(self, n, rng))
    plain = run_experiment(dafkd_config(), progress=False).history
    assert not drawn and plain[-1]["train/disc_acc_fake"] >= 0
    kw = {**method_overrides("dafkd"), **VECTORISED, "algorithm__disc_negatives": "pooled",
          "algorithm__diag_samples": 0}
    with float64_runs(monkeypatch):
        seq_w, seq_info = _one_round(False, rounds=2, **kw)
        vec_w, vec_info = _one_round(True, rounds=2, **kw)
        generated = _one_round(False, rounds=2, **{**kw, "algorithm__disc_negatives": "generated"})[1]
    assert set(drawn) == {6} and all("vec/groups_per_step" in info for info in vec_info)  # every client's images
    assert [i["train/disc_loss"] for i in seq_info] != [i["train/disc_loss"] for i in generated]
    for c in seq_w:
        assert _max_relative_difference(seq_w[c], vec_w[c]) < 1e-9, c
    for s, v in zip(seq_info, vec_info, strict=True):
        assert v["train/disc_loss"] == pytest.approx(s["train/disc_loss"], rel=1e-9)


# --- disc_negatives_grad=detached: the negatives train the discriminator head, never the classifier ------------------


def _modules(**over):
    """A tiny DaFKD (tiny_config's synthetic data and model) and its built modules."""
    from fedray.data import build_federated_data
    from fedray.runtime.core import data_spec

    cfg = dafkd_config(**over)
    algo = resolve_experiment(cfg).build(data_spec(build_federated_data(cfg.data, cfg.seed)))
    return algo, algo.build_modules()


@pytest.mark.parametrize("grad", ["detached", "shared"])
def test_detached_negatives_leave_the_extractors_gradient_untouched(grad):
    """Eq. 9's gradient (CE + Eq. 2) w.r.t. the classifier, the same real batch against two sets of negatives (random
    images, then zeros): with ``detached`` the classifier's gradient is the same (it learns from its own images only),
    with ``shared`` the negatives move the extractor; the discriminator head learns from them either way."""
    from fedray.methods.dafkd.losses import disc_loss

    algo, m = _modules(algorithm__disc_negatives_grad=grad)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, *algo.spec.input_shape, generator=gen)
    y = torch.randint(algo.spec.num_classes, (8,), generator=gen)

    def grads(fake: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        m.model.zero_grad(set_to_none=True)
        m.disc.zero_grad(set_to_none=True)
        feats = m.model.features(x)
        (F.cross_entropy(m.model.head(feats), y) + disc_loss(algo.params, m, x, feats, fake)[0]).backward()
        return [p.grad.clone() for p in m.model.parameters()], [p.grad.clone() for p in m.disc.parameters()]

    (model_a, head_a), (model_b, head_b) = grads(torch.randn(8, *algo.spec.input_shape, generator=gen)), \
        grads(torch.zeros(8, *algo.spec.input_shape))
    same = all(torch.equal(a, b) for a, b in zip(model_a, model_b, strict=True))
    assert same is (grad == "detached")
    assert not all(torch.equal(a, b) for a, b in zip(head_a, head_b, strict=True))


@pytest.mark.parametrize("vectorize, gp", [(False, 0.0), (True, 0.0), (False, 0.3)])
def test_a_detached_round_trains_the_same_classifiers_whatever_the_pooled_images(monkeypatch, vectorize, gp):
    """One round of one SGD step a client, per client and batched (and with the gradient penalty, whose mixes of real
    and pooled images train the head only): the pooled images replaced by zeros leave every classifier the same with
    ``detached`` (the server's plain average, no distillation, shows them) and change them with ``shared``."""
    from fedray.learning.boundary import PooledImages
    from tests.vectorized.test_vectorized import _one_round

    original = PooledImages.draw
    zeros = {"on": False}
    monkeypatch.setattr(PooledImages, "draw", lambda self, n, rng: (lambda d: torch.zeros_like(d) if zeros["on"]
                                                                    else d)(original(self, n, rng)))
    kw = {**method_overrides("dafkd"), "algorithm__disc_negatives": "pooled", "algorithm__diag_samples": 0,
          "algorithm__alpha_source": "uniform", "algorithm__distill_steps": 0, "algorithm__gp_weight": gp,
          "federation__local_steps": 1, "federation__momentum": 0.0, "federation__weight_decay": 0.0}

    def classifiers(grad: str, zero: bool) -> dict[str, torch.Tensor]:
        zeros["on"] = zero
        return _one_round(vectorize, **{**kw, "algorithm__disc_negatives_grad": grad})[0][0]

    for grad in ("detached", "shared"):
        a, b = classifiers(grad, False), classifiers(grad, True)
        assert all(torch.equal(a[k], b[k]) for k in a) is (grad == "detached"), grad


@pytest.mark.parametrize("negatives", ["pooled", "generated"])
def test_detached_negatives_batched_give_the_sequential_round(monkeypatch, negatives):
    """disc_negatives_grad=detached, pooled or generated negatives: the batched plan gives the sequential client's
    weights and figures (float64, two rounds of every client), and detaching changes the run."""
    from tests.test_every_method import VECTORISED
    from tests.vectorized.test_vectorized import _max_relative_difference, _one_round, float64_runs

    kw = {**method_overrides("dafkd"), **VECTORISED, "algorithm__disc_negatives": negatives,
          "algorithm__disc_negatives_grad": "detached", "algorithm__diag_samples": 0}
    with float64_runs(monkeypatch):
        seq_w, seq_info = _one_round(False, rounds=2, **kw)
        vec_w, vec_info = _one_round(True, rounds=2, **kw)
        shared_w = _one_round(False, rounds=2, **{**kw, "algorithm__disc_negatives_grad": "shared"})[0]
    assert all("vec/groups_per_step" in info for info in vec_info)
    assert max(_max_relative_difference(seq_w[c], shared_w[c]) for c in seq_w) > 1e-6
    for c in seq_w:
        assert _max_relative_difference(seq_w[c], vec_w[c]) < 1e-9, c
    for s, v in zip(seq_info, vec_info, strict=True):
        assert v["train/disc_loss"] == pytest.approx(s["train/disc_loss"], rel=1e-9)


def test_detached_negatives_need_the_shared_extractor():
    with pytest.raises(ConfigError) as e:
        resolve_experiment(dafkd_config(algorithm__disc_negatives_grad="detached", algorithm__sharing=False))
    assert e.value.key == "algorithm.disc_negatives_grad"
