"""The adversary's client-side stage (fedray/adversary/forge.py): each forgery by hand on a small message, on the
malicious clients' rows only, the same for a client alone or batched; the config's one-line refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fedray.channel.channel import build_channel
from fedray.errors import ConfigError, RunFailure
from fedray.learning.boundary import Upload, counts_field, model_field, values_field
from fedray.seeding import derive_seed
from tests.channel.stages import Sent
from tests.conftest import tiny_config


@dataclasses.dataclass
class Msg(Upload):
    weights: dict = model_field(against="weights")
    logits: torch.Tensor = values_field(default=None)
    label_counts: torch.Tensor = counts_field(default=None)
    num_samples: int = 0


REF = Sent(weights={"w": torch.tensor([0.5, 0.5, 0.5])})


def _msg(shift: float = 0.0) -> Msg:
    return Msg(weights={"w": torch.tensor([1.0, 2.0, 3.0]) + shift},
               logits=torch.tensor([[0.0, 3.0] + [1.0] * 8, [2.0] * 10]) + shift,
               label_counts=torch.tensor([3, 0, 1] + [0] * 7), num_samples=12)


def _sent(attack: str, messages=None, clients=(0, 1), round_=1, **adv) -> list[Msg]:
    channel = build_channel(tiny_config(adversary__attack=attack, adversary__clients=[0],
                                        **{f"adversary__{k}": v for k, v in adv.items()}))
    messages = messages or [_msg(), _msg()]
    sent = channel.encode_up_many(messages, REF, [None] * len(messages), list(clients), round_)
    return [channel.decode_up(s, REF) for s, _ in sent]


def test_sign_flip_and_scale_forge_the_update_against_the_model_sent():
    flipped, honest = _sent("sign_flip", scale=2.0)
    assert torch.equal(flipped.weights["w"], torch.tensor([0.5 - 2 * 0.5, 0.5 - 2 * 1.5, 0.5 - 2 * 2.5]))
    assert torch.equal(honest.weights["w"], _msg().weights["w"])  # client 1 is honest
    assert torch.equal(flipped.logits, _msg().logits) and flipped.num_samples == 12  # only model leaves
    scaled, _ = _sent("scale", scale=3.0)
    assert torch.equal(scaled.weights["w"], torch.tensor([0.5 + 3 * 0.5, 0.5 + 3 * 1.5, 0.5 + 3 * 2.5]))
    with pytest.raises(RunFailure, match="adversary.attack=scale: this method's upload carries no model .* in "
                       "adversary.fields"):  # adversary.fields names no field it sends: refused, not a no-op
        _sent("scale", scale=3.0, fields=["other"])


def test_gaussian_replaces_the_update_by_seeded_noise_the_same_alone_or_batched():
    (alone,) = _sent("gaussian", messages=[_msg()], clients=(0,), noise_std=2.0)
    batched, _ = _sent("gaussian", noise_std=2.0)
    gen = torch.Generator().manual_seed(derive_seed(0, "adversary", "gaussian", 1, 0, 0) % (1 << 63))
    want = REF.weights["w"] + (torch.randn(3, generator=gen, dtype=torch.float64) * 2.0).float()
    assert torch.equal(alone.weights["w"], want) and torch.equal(batched.weights["w"], want)
    (later,) = _sent("gaussian", messages=[_msg()], clients=(0,), round_=2, noise_std=2.0)
    assert not torch.equal(later.weights["w"], want)  # a fresh draw each round


def test_forged_logits_put_the_target_above_every_row_and_keep_the_rest():
    forged, honest = _sent("forge_logits", target=4, logit_margin=1.5)
    want = _msg().logits.clone()
    want[0, 4], want[1, 4] = 3.0 + 1.5, 2.0 + 1.5
    assert torch.equal(forged.logits, want) and forged.logits.argmax(1).tolist() == [4, 4]
    assert torch.equal(honest.logits, _msg().logits)
    assert torch.equal(forged.weights["w"], _msg().weights["w"])  # a model leaf: not logits


def test_inflated_counts_and_forged_histograms_change_only_what_the_client_reports():
    inflated, honest = _sent(attack="inflate_count", count_factor=2.5)
    assert (inflated.num_samples, honest.num_samples) == (30, 12)
    forged, honest = _sent("forge_histogram", target=7)
    assert forged.label_counts.tolist() == [0] * 7 + [4, 0, 0] and honest.label_counts.tolist()[:3] == [3, 0, 1]


@pytest.mark.parametrize("kw, key", [
    (dict(adversary__attack="sign_flip"), "adversary.fraction"),  # no malicious client
    (dict(adversary__fraction=0.2), "adversary.fraction"),  # no attack
    (dict(adversary__attack="scale", adversary__fraction=0.2), "adversary.scale"),  # scale 1: the honest update
    (dict(adversary__attack="gaussian", adversary__fraction=0.2, adversary__scale=2.0), "adversary.scale"),
    (dict(adversary__attack="sign_flip", adversary__clients=[0, 99]), "adversary.clients"),
    (dict(adversary__attack="forge_logits", adversary__fraction=0.2, adversary__target=10), "adversary.target"),
])
def test_malformed_adversaries_are_refused_naming_the_key(kw, key):
    from fedray.methods import validate_experiment

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_experiment(tiny_config(**kw))


def test_a_forged_histogram_reaches_a_server_that_reads_the_set_up_counts():
    """DaFKD's Theorem 1 weights read every client's label counts, sent once before round 1: the malicious
    client's row is its total on the target, the others as counted; its uploads (no histogram) go as they are."""
    from fedray.data import build_federated_data
    from fedray.runtime.server_core import ServerCore
    from fedray.runtime.server_inputs import client_label_counts
    from tests.conftest import DAFKD_TINY
    from fedray.methods import validate_experiment

    cfg = validate_experiment(tiny_config(**DAFKD_TINY, algorithm__name="dafkd", algorithm__alpha_source="theorem1",
                                          algorithm__distill_data="proxy", adversary__attack="forge_histogram",
                                          adversary__clients=[1], adversary__target=2, data__server_data__kind="holdout",
                                          data__server_data__per_class=2, data__server_data__labelled=True))
    data = build_federated_data(cfg.data, cfg.seed)
    want = client_label_counts(data)
    want[1] = 0
    want[1, 2] = client_label_counts(data)[1].sum()
    assert ServerCore(cfg, data, torch.device("cpu")).algo.client_label_counts.tolist() == want.tolist()


def test_the_most_available_clients_are_the_ones_online_longest(tmp_path):
    """Online seconds over the first 100 s, by hand: client 3 all of it, client 1 60 s (two intervals), client 0
    30 s, client 2 30 s (the tie goes to the lower id), client 4 never; two of five malicious: 3 and 1."""
    from fedray.adversary import malicious_clients
    from fedray.system.clock import online_seconds

    trace = tmp_path / "online.csv"
    trace.write_text("client,start_s,end_s\n0,0,30\n1,10,40\n1,50,80\n2,70,100\n3,0,500\n")
    cfg = tiny_config(data__num_clients=5, federation__clients_per_round=2, system__devices="uniform",
                      system__availability="trace", system__availability_trace=str(trace), adversary__attack="scale",
                      adversary__scale=2.0, adversary__fraction=0.4, adversary__choose="most_available",
                      adversary__horizon_s=100.0)
    assert online_seconds(cfg.system, 5, cfg.seed, 100.0).tolist() == [30.0, 60.0, 30.0, 100.0, 0.0]
    assert malicious_clients(cfg) == {1, 3}
    assert malicious_clients(cfg.model_copy(update={"adversary": cfg.adversary.model_copy(
        update={"fraction": 0.6})})) == {0, 1, 3}
    # choose=random (the default): round(0.4 x 5) = 2 drawn by the run's seed alone, whatever the trace says
    drawn = cfg.model_copy(update={"adversary": cfg.adversary.model_copy(update={"choose": "random"})})
    want = set(np.random.default_rng(derive_seed(0, "adversary")).choice(5, size=2, replace=False).tolist())
    assert malicious_clients(drawn) == want and len({frozenset(malicious_clients(drawn.model_copy(
        update={"seed": s}))) for s in range(8)}) > 1
    with pytest.raises(ConfigError, match="adversary.choose: most_available ranks"):
        tiny_config(adversary__attack="scale", adversary__scale=2.0, adversary__fraction=0.4,
                    adversary__choose="most_available")
    with pytest.raises(ConfigError, match="adversary.horizon_s: is only read"):
        tiny_config(adversary__attack="scale", adversary__scale=2.0, adversary__fraction=0.4, adversary__horizon_s=5.0)
