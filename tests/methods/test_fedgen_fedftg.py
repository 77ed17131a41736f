"""FedGen and FedFTG: each reduces to its base exactly when its distillation is switched off, the generators fit every
model of the zoo, the label weights are shares, the label counts are counted, bad parameters are refused, and the
batched clients of FedGen's regularised rounds give the sequential round."""

import pytest
import torch

from fedray.errors import ConfigError
from fedray.learning.data_free import diversity_loss, label_counts, label_shares
from fedray.methods import load_experiment
from fedray.methods.fedftg import proportional_labels
from fedray.models import MODEL_NAMES, build_model
from fedray.models.conditional import FeatureGenerator, ImageGenerator
from fedray.simulation import run_experiment
from tests.conftest import method_overrides, tiny_config
from tests.vectorized.test_vectorized import _assert_same_weights, _one_round

ROUNDS = 3


def _weights(**kw) -> dict[str, torch.Tensor]:
    return _one_round(False, rounds=ROUNDS, **kw)[0][0]


def _case(name: str, **kw) -> dict:
    return {**method_overrides(name), **kw}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def fedavg_weights():
    return _weights(algorithm__name="fedavg")


def test_fedgen_without_its_terms_trains_fedavg_exactly(fedavg_weights):
    # alpha = beta = 0: the generator is trained, sent and run on every client from round 2, its terms weighted 0;
    # its noise comes from a stream of its own, so the clients' batches and steps are FedAvg's, bit for bit
    off = _weights(**_case("fedgen", algorithm__alpha=0.0, algorithm__beta=0.0))
    assert _same(off, fedavg_weights)
    for on in ({"algorithm__alpha": 1.0, "algorithm__beta": 0.0}, {"algorithm__alpha": 0.0, "algorithm__beta": 1.0}):
        assert not _same(_weights(**_case("fedgen", **on)), fedavg_weights), on  # each term acts


def test_fedftg_without_server_iterations_is_its_base_exactly(fedavg_weights):
    assert _same(_weights(**_case("fedftg", algorithm__iterations=0)), fedavg_weights)
    assert not _same(_weights(**method_overrides("fedftg")), fedavg_weights)  # the fine-tuning moves the model
    prox = _weights(algorithm__name="fedprox", algorithm__mu=0.5)
    assert _same(_weights(**_case("fedftg", algorithm__iterations=0, algorithm__base="fedprox",
                                  algorithm__mu=0.5)), prox)


def test_fedgen_clients_use_the_generator_from_start_round_only():
    from fedray.data import build_federated_data
    from fedray.methods import resolve_experiment
    from fedray.runtime.core import data_spec

    cfg = tiny_config(**_case("fedgen", algorithm__start_round=3))
    algo = resolve_experiment(cfg).build(data_spec(build_federated_data(cfg.data, cfg.seed)))
    state = algo.init_server_state(algo.build_modules())
    assert algo.broadcast(state, 3).generator is None  # no label reported yet: nothing to draw from
    state.labels_seen[:] = True
    assert algo.broadcast(state, 2).generator is None and algo.broadcast(state, 3).generator is not None
    assert algo.weight_at(10.0, 1) == 10.0 and algo.weight_at(10.0, 2) == pytest.approx(9.8)
    assert algo.weight_at(0.0, 50) == 0.0 and algo.weight_at(10.0, 1000) == 1e-4  # the code's floor, not for 0


def test_fedgen_batched_clients_give_the_sequential_regularised_round():
    # round 2 is the first whose clients train with the generator (a StepwiseTraining); batches of 12 end a client's
    # pass on a short batch, padded in the batched step, its rows left out of the KL term's mean. (LeNet-5: with a
    # BatchNorm model FedAvg's own batched and sequential rounds drift apart by ~5e-4 over two rounds at this lr.)
    kw = _case("fedgen", federation__batch_size=12)
    seq, seq_infos = _one_round(False, rounds=2, **kw)
    vec, vec_infos = _one_round(True, rounds=2, **kw)
    _assert_same_weights(seq, vec)
    for a, b in zip(seq_infos, vec_infos):
        assert a["client"] == b["client"]
        for key in ("train/loss", "train/gen_ce", "train/gen_kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), key


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_generators_fit_every_model_of_the_zoo(shape):
    y = torch.tensor([0, 3, 9, 1])
    images = ImageGenerator(16, 10, shape, width=4)(torch.randn(4, 16), y)
    assert images.shape == (4, *shape)
    for name in MODEL_NAMES:
        torch.manual_seed(0)
        model = build_model(name, shape, 10).eval()
        feats = FeatureGenerator(8, 10, model.feature_dim, hidden=16)(torch.rand(4, 8), y)
        assert feats.shape == (4, model.feature_dim), name
        assert model.head(feats).shape == (4, 10), name  # FedGen's teachers read the features with their head
        assert model(images).shape == (4, 10), name  # FedFTG's teachers and student read the images


def test_label_shares_sum_to_one_for_every_held_label():
    counts = torch.tensor([[5, 0, 1, 0], [5, 3, 0, 0], [0, 1, 3, 0]])
    shares, held = label_shares(counts)
    assert held.tolist() == [True, True, True, False]
    torch.testing.assert_close(shares.sum(0), torch.tensor([1.0, 1.0, 1.0, 0.0]))
    torch.testing.assert_close(shares[:, 1], torch.tensor([0.0, 0.75, 0.25]))
    assert label_counts(torch.tensor([2, 2, 0]), 4).tolist() == [1, 0, 2, 0]


def test_proportional_labels_follow_the_class_totals():
    labels = proportional_labels(torch.tensor([30, 0, 10, 60]), 50, torch.Generator().manual_seed(0))
    assert torch.bincount(labels, minlength=4).tolist() == [15, 0, 5, 30]


def test_diversity_falls_as_outputs_spread():
    noise = torch.randn(8, 4)
    assert float(diversity_loss(noise, torch.zeros(8, 3))) == pytest.approx(1.0)
    assert float(diversity_loss(noise, noise.repeat(1, 2))) < 0.5


@pytest.mark.parametrize("name", ["fedgen", "fedftg"])
def test_label_counts_go_up_and_are_counted(name):
    rounds = 2
    base = run_experiment(tiny_config(federation__rounds=rounds, tracking__enabled=False), progress=False)
    own = run_experiment(tiny_config(**method_overrides(name), federation__rounds=rounds, tracking__enabled=False),
                         progress=False)
    clients, classes = 3, 10  # tiny_config: 3 clients a round, 10 classes
    extra = own.summary["comm/bytes_up"] - base.summary["comm/bytes_up"]
    assert extra == rounds * clients * classes * 8  # an int64 count per class, per client and round


@pytest.mark.parametrize("key,value", [("algorithm.gen_server_batch_size", 1), ("algorithm.noise", "laplace"),
                                       ("algorithm.decay", 1.5), ("algorithm.gen_steps", -1)])
def test_fedgen_refuses_bad_parameters_naming_the_key(key, value):
    with pytest.raises(ConfigError) as err:
        load_experiment("fedgen_fmnist", {key: value})
    assert key in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("key,value", [("algorithm.base", "scaffold"), ("algorithm.iterations", -1),
                                       ("algorithm.student_lr", 0), ("algorithm.lr_decay", 2.0)])
def test_fedftg_refuses_bad_parameters_naming_the_key(key, value):
    with pytest.raises(ConfigError) as err:
        load_experiment("fedftg_fmnist", {key: value})
    assert key in str(err.value) and "\n" not in str(err.value)



def test_fedgen_counts_the_round_batches_labels_when_asked():
    from fedray.learning.boundary import ClientContext, DataSpec
    from fedray.methods.fedgen import counted_upload

    fed = tiny_config(federation__local_steps=3, federation__batch_size=4).federation
    y = torch.tensor([0] * 10 + [1] * 30)
    ctx = ClientContext(client_id=0, round=1, seed=0, x=torch.zeros(40, 1, 16, 16, dtype=torch.uint8), y=y,
                        spec=DataSpec((1, 16, 16), 3, 1, (0.5,), (0.25,)), fed=fed, device=torch.device("cpu"),
                        modules=None)
    assert counted_upload(ctx, {}, 3).label_counts.tolist() == [10, 30, 0]  # the paper: the client's data
    drawn = y[torch.cat(ctx.batch_plan().index)]
    by_batches = counted_upload(ctx, {}, 3, of_batches=True).label_counts
    assert by_batches.sum() == 12 and by_batches.tolist() == torch.bincount(drawn, minlength=3).tolist()


@pytest.mark.parametrize("name,key", [("fedgen", "algorithm.gen_server_batch_size"),
                                      ("fedftg", "algorithm.batch_size")])
def test_a_one_sample_generator_batch_is_refused_naming_the_key(name, key):
    with pytest.raises(ConfigError) as err:
        load_experiment(f"{name}_fmnist", {"federation.batch_size": 1})
    assert err.value.key == key
    load_experiment(f"{name}_fmnist", {"federation.batch_size": 1, key: 16})  # its own batch: fine
