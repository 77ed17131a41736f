"""Compression by hand: QSGD unbiased within its variance bound, top-k's k largest, random-k's d/k, error feedback
conserving what it does not send, and the exact byte counts of a real bit-packed encoding read back."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fedray.channel import compression as C
from fedray.channel.channel import Channel, build_channel
from fedray.channel.stages import Compress
from fedray.simulation import run_experiment
from tests.channel.stages import Message, Sent
from tests.conftest import tiny_config


def _v(d=64, seed=0):
    return torch.randn(d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_qsgd_is_unbiased_within_its_variance_bound(bits):
    """Over n seeded draws the mean is v to within 3 x bound / n (squared), and the mean squared error is within
    Lemma 3.1's E||Q(v) - v||^2 <= min(d / s^2, sqrt(d) / s) ||v||^2."""
    v, n = _v(), 2000
    d, s = v.numel(), C.levels(bits)
    bound = min(d / s**2, math.sqrt(d) / s) * float(v.norm() ** 2)
    draws = torch.stack([C.dequantize(C.quantize(v, bits, None, i))
                         for i in range(n)])
    assert float(((draws.mean(0) - v) ** 2).sum()) <= 3 * bound / n
    assert float(((draws - v) ** 2).sum(1).mean()) <= bound
    assert torch.equal(C.dequantize(C.quantize(v, bits, None, 7)),
                       C.dequantize(C.quantize(v, bits, None, 7)))


def test_levels_scales_and_the_scaled_sign_by_hand():
    v = torch.tensor([3.0, -4.0, 0.0, 1.0])
    q = C.quantize(v, 2, 2, None)  # s = 1, buckets [3, -4] (norm 5) and [0, 1] (norm 1): round(|v| / norm)
    assert q.levels.tolist() == [1, -1, 0, 1] and q.scales.tolist() == [5.0, 1.0]
    assert C.dequantize(q).tolist() == [5.0, -5.0, 0.0, 1.0]
    sign = C.quantize(v, 1, 2, 0)  # sign x mean magnitude of its bucket
    assert C.dequantize(sign).tolist() == [3.5, -3.5, 0.5, 0.5]


def test_topk_keeps_exactly_the_k_largest_magnitudes_and_randk_scales_by_d_over_k():
    v = torch.tensor([0.1, -5.0, 2.0, 0.0, 3.0, -2.0, 0.5, 1.0])
    kept = C.topk(v, 0.375)  # k = 3
    assert kept.indices.tolist() == [1, 2, 4] and kept.values.tolist() == [-5.0, 2.0, 3.0]  # 2.0 before -2.0: index
    r = C.randk(v, 0.25, 3, unbiased=True)
    assert r.indices.numel() == 2 and torch.equal(r.values, v[r.indices] * 4)
    assert torch.equal(C.random_positions(8, 2, 3), r.indices)
    mean = torch.stack([C.densify(C.randk(v, 0.25, i, unbiased=True), C.randk(v, 0.25, i, unbiased=True).values)
                        for i in range(4000)]).mean(0)
    assert torch.allclose(mean, v, atol=0.25)


def test_a_batch_of_clients_is_encoded_as_each_client_alone():
    """Stacked rows (clients trained in lockstep) give each client the encoding it gets alone: seeded draws,
    top-k's ties, buckets and error feedback's residuals do not depend on the batch."""
    rows = torch.stack([_v(40, seed=i) for i in range(3)])
    rows[1, :8] = 1.0  # ties for top-k
    alone = [C.quantize(r, 4, 16, 10 + i) for i, r in enumerate(rows)]
    batch = C.quantize(rows, 4, 16, [10, 11, 12])
    assert all(torch.equal(C.row(batch, i).levels, q.levels) and torch.equal(C.row(batch, i).scales, q.scales)
               for i, q in enumerate(alone))
    for batch, alone in [(C.topk(rows, 0.1), [C.topk(r, 0.1) for r in rows]),
                         (C.randk(rows, 0.1, [5, 6, 7], True), [C.randk(r, 0.1, 5 + i, True) for i, r in enumerate(rows)])]:
        assert all(torch.equal(C.row(batch, i).indices, s.indices) and torch.equal(C.row(batch, i).values, s.values)
                   for i, s in enumerate(alone))
    channel = _channel(sparsify="topk", fraction=0.2, error_feedback=True, quantize="qsgd", bits=4)
    sent = Sent(weights={"w": torch.zeros(40)})
    uploads = [Message(weights={"w": r}, logits=r[:5]) for r in rows]
    together = channel.encode_up_many(uploads, sent, [None] * 3, [4, 5, 6], 2)
    for (packet, state), upload, cid in zip(together, uploads, [4, 5, 6]):
        one, own = channel.encode_up(upload, sent, None, cid, 2)
        assert C.pack(packet.leaves[0].data) == C.pack(one.leaves[0].data) and Channel.nbytes(packet) == Channel.nbytes(one)
        assert torch.equal(state["compress"]["weights/w"], own["compress"]["weights/w"])
        assert state["compress"]["weights/w"].untyped_storage().nbytes() == 40 * 4  # its own copy, not the batch's


def _channel(**keys):
    return build_channel(tiny_config(**{f"channel__{k}": v for k, v in keys.items()}))


@pytest.mark.parametrize("keys", [dict(sparsify="topk", fraction=0.1, error_feedback=True),
                                  dict(quantize="qsgd", bits=2, error_feedback=True),
                                  dict(sparsify="randk", fraction=0.2, error_feedback=True, quantize="round")])
def test_error_feedback_sends_over_the_rounds_what_came_in_less_what_it_keeps(keys):
    """sum_t sent_t + e_T = sum_t x_t, a model sent as its update against the payload and added back on arrival."""
    channel, sent = _channel(**keys), Sent(weights={"w": torch.zeros(50)})
    state, got, came = None, torch.zeros(50), torch.zeros(50)
    for t in range(5):
        x = _v(50, seed=t)
        packet, state = channel.encode_up(Message(weights={"w": x}, logits=x[:3]), sent, state, 0, t + 1)
        got += channel.decode_up(packet, sent).weights["w"]
        came += x
    residual = state["compress"]["weights/w"]
    assert torch.allclose(got + residual, came, atol=1e-5) and float(residual.abs().sum()) > 0


def test_a_model_is_compressed_as_its_update_against_what_the_client_was_sent():
    channel = _channel(quantize="round", bits=2, bucket=4)
    base = torch.tensor([10.0, 10.0, 10.0, 10.0])
    packet, _ = channel.encode_up(Message(weights={"w": base + torch.tensor([3.0, -4.0, 0.0, 0.0])}),
                                  Sent(weights={"w": base}), None, 0, 1)
    assert C.dequantize(packet.leaves[0].data).tolist() == [5.0, -5.0, 0.0, 0.0]  # the update's levels
    assert channel.decode_up(packet, Sent(weights={"w": base})).weights["w"].tolist() == [15.0, 5.0, 10.0, 10.0]


@pytest.mark.parametrize("data, size", [
    (C.quantize(_v(10), 4, None, None), math.ceil(10 * 4 / 8) + 4),
    (C.quantize(_v(10), 1, 4, 0), math.ceil(10 / 8) + 3 * 4),
    (C.topk(_v(1000), 0.01), 10 * 4 + math.ceil(10 * 10 / 8)),  # 10 indices of ceil(log2 1000) = 10 bits
    (C.topk(_v(16), 0.5), 8 * 4 + 16 // 8),  # a bitmap (2 B) beats 8 indices of 4 bits (4 B)
    (C.randk(_v(1000), 0.01, 5, True), 10 * 4 + 8),  # the positions: the seed
])
def test_byte_counts_by_hand_equal_a_real_bit_packed_encoding_read_back(data, size):
    assert C.wire_bytes(data) == size
    raw = C.pack(data)
    assert len(raw) == size
    back = C.unpack(raw, data)
    assert type(back) is type(data)
    for f in dataclasses.fields(data):
        a, b = getattr(data, f.name), getattr(back, f.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else (
            C.pack(a) == C.pack(b) if isinstance(a, C.Quantized) else a == b), f.name


def test_sparse_quantised_values_pack_and_a_message_counts_its_leaves():
    kept = C.topk(_v(1000), 0.01)
    kept.values = C.quantize(kept.values, 8, None, None)
    assert len(C.pack(kept)) == C.wire_bytes(kept) == 10 + 4 + math.ceil(100 / 8)
    channel = _channel(quantize="qsgd", bits=8, bucket=None)
    packet, _ = channel.encode_up(Message(weights={"w": _v(100)}, logits=_v(20)), Sent(weights={"w": _v(100, 1)}),
                                  None, 0, 1)
    assert Channel.nbytes(packet) == (100 + 4) + (20 + 4) + 8  # and the header's sample count


@pytest.mark.parametrize("keys, key, fragment", [
    (dict(bits=4), "channel.bits", "only read with channel.quantize"),
    (dict(quantize="round", bits=1), "channel.bits", "allowed: 2..16"),
    (dict(quantize="qsgd", bits=17), "channel.bits", "less than or equal to 16"),
    (dict(fraction=0.1), "channel.fraction", "only read with channel.sparsify"),
    (dict(sparsify="topk", fraction=0), "channel.fraction", "greater than 0"),
    (dict(error_feedback=True), "channel.error_feedback", "set channel.quantize or channel.sparsify"),
    (dict(compress_on="down"), "channel.compress_on", "set channel.quantize or channel.sparsify"),
])
def test_a_bad_channel_key_is_refused_naming_it(keys, key, fragment):
    from fedray.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        _channel(**keys)
    assert e.value.key == key and fragment in e.value.message, e.value


def test_the_stage_is_built_from_the_config_in_its_place():
    channel = _channel(quantize="qsgd", precision="fp16", error_feedback=True, compress_on="both")
    assert [type(s) for s in channel.stages][0] is Compress and [s.name for s in channel.stages] == ["compress",
                                                                                                      "precision"]
    assert channel.stateful and channel.init_server_state() == {"compress": {}}


# --- every method through the compressed channel ---------------------------------------------------------------
# qsgd at 8 bits both ways with fp16 scales and raw values (every stage but sparsification), and top-10 % with error
# feedback on the uploads, its kept values rounded to 8 bits (sparsification, rounding, error feedback)
COMPRESSED = {
    "qsgd8-both-fp16": dict(channel__quantize="qsgd", channel__bits=8, channel__compress_on="both",
                            channel__precision="fp16"),
    "top10-ef-round8": dict(channel__sparsify="topk", channel__fraction=0.1, channel__error_feedback=True,
                            channel__quantize="round", channel__bits=8),
}
# Above chance (0.1 over 10 classes) by a margin in 3 rounds: 8-bit as the uncompressed runs (within 0.11 of them
# for every method); top-10 % sends a tenth of each update a round, and the slowest (SCAFFOLD's control variates and
# FedD3A's projectors sparsified too) reach 0.2: a channel that lost the updates stays at chance
FLOOR = {"qsgd8-both-fp16": 0.25, "top10-ef-round8": 0.15}


def _method_cases():
    from tests.conftest import built_in_methods

    return sorted(built_in_methods())


@pytest.mark.parametrize("compressed", sorted(COMPRESSED))
@pytest.mark.parametrize("method", _method_cases())
def test_every_method_learns_through_a_compressed_channel(method, compressed):
    """Every registered method, 3 rounds of the every-method tests' learnable task through the channel: above chance
    (the isolated baseline sends nothing)."""
    from tests.test_every_method import _config, _data

    result = run_experiment(_config(method, **COMPRESSED[compressed]), progress=False, data=_data(method))
    last = result.history[-1]
    assert last["eval/accuracy"] >= FLOOR[compressed], (method, compressed, last["eval/accuracy"])
    assert all(math.isfinite(row["eval/accuracy"]) for row in result.history)
    assert (result.summary["comm/bytes_up"] == 0) == (method == "local")


def test_compress_on_chooses_the_direction_whose_bytes_shrink():
    """8-bit QSGD on one direction: ``up`` shrinks only comm/bytes_up, ``down`` only comm/bytes_down, ``both`` both;
    the other direction's bytes are exactly those of no channel."""
    plain = run_experiment(tiny_config(federation__rounds=1, channel__quantize="none", channel__sparsify="none"),
                           progress=False).history[0]
    rows = {d: run_experiment(tiny_config(federation__rounds=1, channel__quantize="qsgd", channel__bits=8,
                                          channel__compress_on=d), progress=False).history[0]
            for d in ("up", "down", "both")}
    up, down = "comm/bytes_up", "comm/bytes_down"
    assert rows["up"][up] < plain[up] / 3 and rows["up"][down] == plain[down]
    assert rows["down"][down] < plain[down] / 3 and rows["down"][up] == plain[up]
    assert (rows["both"][up], rows["both"][down]) == (rows["up"][up], rows["down"][down])
