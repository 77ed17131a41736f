"""The channel: every message through its stages, bytes counted after them; ``channel.precision`` by hand on a
three-client round (bytes and simulated transfer times); a stage's per-client state checkpointed, resumed and run
where the client runs; the stages' fixed order."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from fedray.channel.channel import Channel, Packet, build_channel
from fedray.channel.config import ChannelConfig
from fedray.channel.message import split
from fedray.channel.stages import ORDER, Identity, Precision
from fedray.data import build_federated_data
from fedray.methods import resolve_experiment
from fedray.models import build_model
from fedray.simulation import run_experiment
from tests.channel.stages import Counting, Message, Sent
from tests.conftest import LEARNABLE, tiny_config


def _message():
    return Message(weights={"w": torch.tensor([1.0, 2.0 ** -20, 3.14159], dtype=torch.float32),
                             "steps": torch.tensor(7)},
                    logits=torch.tensor([[0.1, 0.2]], dtype=torch.float64),
                    histogram=torch.tensor([1.5, 2.5]), num_samples=12)


def test_fp16_halves_the_floating_tensors_and_leaves_integers_counts_and_headers():
    """By hand: 3 float32 (12 B -> 6 B), 2 float64 logits (16 B -> 4 B as fp16), int64 steps 8 B, the counts
    declared counts stay float32 (8 B), the header scalar 8 B."""
    message, fp16 = _message(), build_channel(tiny_config(channel__precision="fp16"))
    assert Channel.nbytes(message) == 12 + 8 + 16 + 8 + 8
    sent, state = fp16.encode_up(message, Sent(weights={"w": torch.zeros(3)}), None, 0, 1)
    assert isinstance(sent, Packet) and state is None
    assert fp16.nbytes(sent) == 6 + 8 + 4 + 8 + 8
    back = fp16.decode_up(sent)
    assert back.weights["w"].dtype == torch.float32 and back.logits.dtype == torch.float64
    assert torch.equal(back.weights["w"], message.weights["w"].half().float())  # rounded to fp16 and back
    assert back.weights["w"][1] != 0 and back.weights["w"][2] != message.weights["w"][2]
    assert torch.equal(back.weights["steps"], message.weights["steps"]) and back.num_samples == 12
    assert back.histogram is message.histogram  # counts never reach a stage
    down = fp16.decode_down(fp16.encode_down(Sent(weights=message.weights), 0)[0])
    assert torch.equal(down.weights["w"], back.weights["w"])


def test_a_message_splits_into_declared_leaves_with_their_references():
    sent = Sent(weights={"w": torch.ones(3)})
    _, leaves = split(_message(), sent)
    assert [(leaf.path, leaf.kind) for leaf in leaves] == [(("weights", "w"), "model"), (("logits",), "values")]
    assert leaves[0].reference is sent.weights["w"] and leaves[1].reference is None


def test_without_stages_every_message_passes_as_it_is():
    channel, message = Channel(), _message()
    assert channel.encode_up(message, None, None, 0, 1) == (message, None)
    assert channel.decode_up(message) is message and channel.encode_down(message, 0) == (message, None)


def test_stages_run_in_the_fixed_order_whatever_order_they_are_given_in():
    order = [s.name for s in Channel([Precision("fp16"), Counting(), Identity()]).stages]
    assert order == ["identity", "counting", "precision"]
    assert list(ORDER) == ["adversary", "clip", "local_noise", "compress", "precision"]


def _three_client_round(precision):
    cfg = tiny_config(data__num_clients=3, federation__clients_per_round=3, federation__rounds=1,
                      system__devices="uniform", system__compute_sps=100.0, system__up_mbps=8.0,
                      system__down_mbps=16.0, system__latency_ms=0.0, channel__precision=precision,
                      tracking__enabled=False)
    return run_experiment(cfg, progress=False).history[0]


def test_fp16_on_a_three_client_round_by_hand():
    """FedAvg, 3 clients of 200 samples, 4 steps of 16 rows (64 samples each at 100/s), 1 MB/s up, 2 MB/s down, no
    latency: the upload is the model (F floating numbers, I bytes of integers) and its sample count (8 B), the
    payload the model; fp16 halves the 4F bytes of each, and each client's time by 2F / 2e6 + 2F / 1e6 s."""
    cfg = tiny_config()
    model = build_model(cfg.model.name, (1, 16, 16), 10).state_dict()
    floats = sum(t.numel() for t in model.values() if torch.is_floating_point(t))
    ints = sum(t.numel() * t.element_size() for t in model.values() if not torch.is_floating_point(t))
    rows = []
    for precision, size in (("fp32", 4), ("fp16", 2)):
        row = _three_client_round(precision)
        down, up = floats * size + ints, floats * size + ints + 8
        assert row["comm/bytes_down"] == 3 * down and row["comm/bytes_up"] == 3 * up
        assert row["sim/round_s"] == pytest.approx(64 / 100 + down / 2e6 + up / 1e6, rel=1e-12)
        rows.append(row)
    assert rows[0]["sim/round_s"] - rows[1]["sim/round_s"] == pytest.approx(2 * floats / 2e6 + 2 * floats / 1e6,
                                                                            rel=1e-9)


def _learnable(**overrides):
    learnable = {k.replace(".", "__"): v for k, v in LEARNABLE.items()}
    return tiny_config(**{**learnable, "federation__rounds": 3, "tracking__enabled": False, **overrides})


def test_fp16_learns_the_synthetic_task_and_resumes_to_the_same_figures(tmp_path):
    from tests.test_every_method import LEARNS_ABOVE, CrashAfter, _Crash

    cfg = _learnable(channel__precision="fp16", runtime__checkpoint_every=1)
    data = build_federated_data(cfg.data, cfg.seed)
    whole = run_experiment(cfg, tmp_path / "whole", progress=False, data=data)
    assert whole.history[-1]["eval/accuracy"] >= LEARNS_ABOVE
    with pytest.raises(_Crash):
        run_experiment(cfg, tmp_path / "cut", progress=False, hooks=[CrashAfter(1)], data=data)
    resumed = run_experiment(cfg, tmp_path / "cut", progress=False, resume_from=tmp_path / "cut", data=data)
    assert _figures(resumed.history) == _figures(whole.history)


def _figures(history):
    return [{k: v for k, v in row.items() if not k.startswith("time/") and k != "health/dropped_clients"}
            for row in history]


def _counting(cfg):
    """``cfg``'s experiment with the counting stage added to the stages its config builds."""
    return dataclasses.replace(resolve_experiment(cfg), channel=Channel([*build_channel(cfg).stages, Counting()]))


def test_an_identity_stage_gives_the_figures_of_no_channel():
    cfg = _learnable(federation__rounds=2)
    data = build_federated_data(cfg.data, cfg.seed)
    plain = run_experiment(cfg, progress=False, data=data)
    wrapped = run_experiment(dataclasses.replace(resolve_experiment(cfg), channel=Channel([Identity()])),
                             progress=False, data=data)
    assert _figures(wrapped.history) == _figures(plain.history)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stages_client_state_is_kept_by_its_client_and_resumed_exactly(mode, tmp_path):
    """The counting stage's state follows the client: a resumed run gives the uninterrupted run's figures (with the
    state reset or lost, the scaled uploads would differ; so would error feedback's residuals), and each client's
    count is the uploads of its that arrived."""
    from fedray.record.checkpoint import load_checkpoint
    from tests.test_every_method import CrashAfter, _Crash

    extra = {"federation__mode": "async", "system__devices": "heterogeneous", "federation__concurrency": 4,
             "federation__buffer_size": 2} if mode == "async" else {}
    # and error feedback both ways: the clients' residuals and the server's, and the payloads in flight re-encoded
    extra.update(channel__sparsify="topk", channel__fraction=0.2, channel__error_feedback=True,
                 channel__compress_on="both", channel__quantize="qsgd")
    cfg = _learnable(runtime__checkpoint_every=1, **extra)
    data = build_federated_data(cfg.data, cfg.seed)
    whole = run_experiment(_counting(cfg), tmp_path / "whole", progress=False, data=data)
    plain = run_experiment(cfg.model_copy(update={"channel": ChannelConfig()}), progress=False, data=data)
    assert _figures(whole.history) != _figures(plain.history)  # the stage acts
    with pytest.raises(_Crash):
        run_experiment(_counting(cfg), tmp_path / "cut", progress=False, hooks=[CrashAfter(2)], data=data)
    resumed = run_experiment(_counting(cfg), tmp_path / "cut", progress=False, resume_from=tmp_path / "cut",
                             data=data)
    assert _figures(resumed.history) == _figures(whole.history)
    states = load_checkpoint(tmp_path / "whole")["channel_states"]
    assert all(s["counting"]["client"] == c for c, s in states.items())
    per_step = 2 if mode == "async" else cfg.federation.clients_per_round  # the uploads a step aggregates
    assert sum(s["counting"]["count"] for s in states.values()) == per_step * cfg.federation.rounds


@pytest.mark.ray
def test_on_ray_the_stages_client_side_runs_in_the_workers_and_gives_the_in_process_figures(ray_local, tmp_path):
    """Top-10 % with error feedback both ways (its kept values at 8 bits by QSGD's seeded draws), fp16 and the
    counting stage's per-client state on Ray (two workers, the server in an actor), interrupted and resumed there
    (one worker, the server in the driver): every figure is the in-process run's, and each client's state was last
    written by a worker process, never the driver. Under privacy too: the adaptive clip announced with each payload
    reaches the workers, their clipped-or-not bits the server's actor, central noise is drawn there, and DP-SGD's on
    the workers: the clips of every round included."""
    from fedray.record.checkpoint import load_checkpoint
    from tests.test_every_method import CrashAfter, _Crash

    wire = dict(channel__precision="fp16", channel__sparsify="topk", channel__fraction=0.1, channel__quantize="qsgd",
                channel__error_feedback=True, channel__compress_on="both", runtime__checkpoint_every=1,
                privacy__mechanism="central", privacy__clip=0.5, privacy__noise_multiplier=0.01,
                privacy__adaptive_clip=True, privacy__count_noise=1.0, privacy__sample_clip=1.0,
                privacy__sample_noise=0.5)
    cfg = _learnable(**wire)
    data = build_federated_data(cfg.data, cfg.seed)
    local = run_experiment(_counting(cfg), progress=False, data=data)
    on_ray = _learnable(**wire, runtime__backend="ray", runtime__num_workers=2, runtime__server_in_driver=False)
    with pytest.raises(_Crash):
        run_experiment(_counting(on_ray), tmp_path / "run", progress=False, hooks=[CrashAfter(2)], data=data)
    saved = load_checkpoint(tmp_path / "run")
    pids = {s["counting"]["pid"] for s in saved["channel_states"].values()}
    assert pids and os.getpid() not in pids and -1 not in pids
    assert all(s["compress"] for s in saved["channel_states"].values()) and saved["server_channel_state"]["compress"]
    # resumed on one fresh worker with the server in the driver: fewer actors to start, the same figures
    again = _learnable(**wire, runtime__backend="ray", runtime__num_workers=1)
    resumed = run_experiment(_counting(again), tmp_path / "run", progress=False, resume_from=tmp_path / "run",
                             data=data)
    assert _figures(resumed.history) == _figures(local.history)
    assert not math.isnan(resumed.history[-1]["eval/accuracy"])
    assert local.history[1]["privacy/clip"] != local.history[0]["privacy/clip"]
