"""A worker's two paths for a client's work: alone (a Ray task's ``train``) and among others (the in-process
``train_many``) send one client the same message through a channel that reads the payload and hears it, its draws
keyed by the round; and what a client's info tells the runtime."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from fedray.data import build_federated_data
from fedray.runtime.local import LocalRuntime
from tests.conftest import tiny_config


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (type(a) is type(b) and repr(a) == repr(b))  # a skeleton's placeholders: one per packet


def test_one_client_alone_sends_what_it_sends_among_others():
    """Top-k of the update against the payload with error feedback, then the adaptive clip: after round 1 moved the
    clip, round 2's client 0 alone and in train_many sends the same message, carrying the same channel state; a
    client told no clip, or sent no payload to take its update against, would not."""
    cfg = tiny_config(channel__sparsify="topk", channel__fraction=0.1, channel__error_feedback=True,
                      privacy__mechanism="central", privacy__noise_multiplier=0.001, privacy__clip=0.05,
                      privacy__adaptive_clip=True, privacy__clip_lr=1.0, privacy__count_noise=0.01,
                      federation__rounds=2, data__num_clients=4, federation__clients_per_round=4)
    rt = LocalRuntime(cfg, build_federated_data(cfg.data, cfg.seed))
    rt.start(1, [0, 1, 2, 3], 0)
    rt.results([0, 1, 2, 3])
    rt.step(1, [0, 1, 2, 3], [0, 0, 0, 0], None)
    payload = rt.server.payload(1)[0]
    assert rt.worker.channel.heard(payload)["clip"] != 0.05  # the clip moved in round 1
    alone = rt.worker.train(2, 0, payload, None, None)
    among = rt.worker.train_many(2, [0], payload, [None], [None])[0]
    assert _same(alone[0], among[0]) and _same(alone[3], among[3])
    # and both clipped at the clip announced (0.082), not the configured 0.05: the update's norm, 0.068, is between
    sent_from = rt.worker.channel.decode_down(payload).weights
    update = rt.server.channel.decode_up(alone[0], rt.worker.channel.decode_down(payload)).weights
    norm = sum(float((update[k] - sent_from[k]).square().sum()) for k in update) ** 0.5
    assert 0.05 < norm <= rt.worker.channel.heard(payload)["clip"]


def test_a_clients_noise_is_drawn_for_the_round_it_trains_in():
    """Local DP's noise is keyed by (round, client): client 0 trained in round 3 sends its update noised as the
    channel noises it for round 3 (for round 0 it would be another draw)."""
    cfg = tiny_config(privacy__mechanism="local", privacy__clip=1.0, privacy__noise_multiplier=1.0)
    rt = LocalRuntime(cfg, build_federated_data(cfg.data, cfg.seed))
    worker, wire = rt.worker, rt.server.payload(2)[0]
    payload = worker.channel.decode_down(wire)
    update = worker._trained(3, 0, payload, None)[1].upload  # what client 0 trains in round 3, before the channel
    sent = worker.train(3, 0, wire, None)[0]
    assert _same(sent, worker.channel.encode_up(update, payload, None, 0, 3)[0])
    assert not _same(sent, worker.channel.encode_up(update, payload, None, 0, 0)[0])
    assert worker.train_many(3, [], wire, []) == []  # handed no client, a worker sends nothing


@pytest.mark.parametrize("name, has_state", [("fedavg", False), ("scaffold", True)])
def test_a_clients_info_names_it_and_what_it_sent_and_whether_it_left_a_state_to_keep(name, has_state):
    """The runtimes read these keys: a Ray runtime keeps a client's state only where ``has_state`` says it has one
    (SCAFFOLD's control variate; FedAvg's clients keep none), the clock times ``work_samples`` (4 steps of 16)."""
    cfg = tiny_config(algorithm__name=name)
    rt = LocalRuntime(cfg, build_federated_data(cfg.data, cfg.seed))
    sent, state, info, _ = rt.worker.train(1, 2, rt.server.payload(0)[0], None)
    assert (state is not None) == has_state
    assert {k: info[k] for k in ("client", "num_samples", "bytes_up", "has_state", "pid", "work_samples")} == {
        "client": 2, "num_samples": len(rt.worker.data.client_train[2]), "bytes_up": rt.worker.channel.nbytes(sent),
        "has_state": has_state, "pid": os.getpid(), "work_samples": 4 * 16}
