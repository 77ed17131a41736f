"""Compression of a message's tensors: quantisation, sparsification, their exact wire size and a real bit-packed
encoding.

- **QSGD** (Alistarh et al., NeurIPS 2017, Sec. 3.1): for a bucket v of ``bucket`` elements and s levels,
  Q_s(v_i) = ||v||_2 sign(v_i) xi_i, with xi_i = l / s or (l + 1) / s, l = floor(|v_i| s / ||v||_2), the upper one with
  probability |v_i| s / ||v||_2 - l: unbiased, E[Q_s(v)] = v, with E||Q_s(v) - v||^2 <= min(d / s^2, sqrt(d) / s)
  ||v||^2 (its Lemma 3.1). b bits an element: a sign bit and b - 1 bits of level, s = 2^(b-1) - 1 (b in 2..16). b = 1
  is the scaled sign sign(v_i) ||v||_1 / d (Karimireddy et al., ICML 2019, EF-SignSGD): biased, one bit an element.
- **Deterministic rounding**: l = round(|v_i| s / ||v||_2), the same encoding; biased.
- **Top-k** keeps the k = ceil(fraction x d) entries of largest magnitude (ties: the lower index); **random-k** keeps k
  entries drawn without replacement from a seeded stream, scaled by d / k so that, without error feedback, the
  message stays unbiased (Stich et al., NeurIPS 2018); with error feedback it is sent unscaled.

Sizes (:func:`wire_bytes`, the one function ``comm/bytes_*`` and the simulated clock use): a quantised tensor is
ceil(n b / 8) bytes of packed values and one scale a bucket (4 bytes as float32, 2 under ``channel.precision``); a
sparse tensor its kept values (as they are sent: raw or quantised) and its positions, either k indices of
ceil(log2 d) bits or a bitmap of d bits, whichever is smaller, packed to whole bytes; random-k's positions are the
receiver's own draw from the 8-byte seed sent with them. :func:`pack` writes exactly that many bytes and
:func:`unpack` reads them back (tests/channel/test_compression.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

SEED_BYTES = 8

# SplitMix64 (Steele, Lea and Flood, OOPSLA 2014): the j-th draw of the stream seeded s is mix(s + (j + 1) g), so
# any element of any stream is computed directly: the draws of a batch of clients are one array operation, and a
# client's draws are the same alone or stacked with others, in process or on Ray
_GOLDEN, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


@dataclass
class Quantized:
    """A flat tensor at ``bits`` bits an element: ``levels`` (int16, in [-s, s]; +-1 for one bit) and one ``scales``
    entry per ``bucket`` elements (the L2 norm; the mean magnitude for one bit). A batch of messages has one row of
    levels and of scales each (:func:`row` takes one out)."""

    levels: torch.Tensor
    scales: torch.Tensor
    bits: int
    bucket: int


@dataclass
class Sparse:
    """k entries of a flat tensor of ``numel``: their ``values`` (a tensor or :class:`Quantized`) and their sorted
    ``indices``; for random-k only the ``seed`` they are drawn from travels (``indices`` is the receiver's draw). A
    batch has one row each and a list of seeds."""

    indices: torch.Tensor
    values: Any
    numel: int
    seed: Any = None


def _mix(seeds: Any, n: int) -> np.ndarray:
    """(messages, n) uint64: the first n draws of the SplitMix64 stream of each seed."""
    s = np.asarray(seeds, dtype=np.uint64).reshape(-1, 1)
    with np.errstate(over="ignore"):
        z = s + np.arange(1, n + 1, dtype=np.uint64)[None, :] * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def uniform(seeds: Any, n: int) -> torch.Tensor:
    """(messages, n) float32 uniform on [0, 1), 24 bits each, from the streams of ``seeds``."""
    return torch.from_numpy((_mix(seeds, n) >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24))


def levels(bits: int) -> int:
    """s = 2^(b-1) - 1: the levels of b bits with a sign bit (1 for the scaled sign)."""
    return max(1, 2 ** (bits - 1) - 1)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``x`` as (messages, elements) float32 rows: a 1-D tensor is one message, a 2-D one a batch."""
    return (x.detach().reshape(1, -1), True) if x.dim() <= 1 else (x.detach(), False)


def _buckets(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """(..., n) as (..., n / bucket, bucket), the last bucket padded with zeros."""
    pad = (-x.shape[-1]) % bucket
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], pad)], dim=-1)
    return x.reshape(*x.shape[:-1], -1, bucket)


def _one(data: Any, single: bool) -> Any:
    return row(data, 0) if single else data


def quantize(x: torch.Tensor, bits: int, bucket: int | None, seeds: Any = None) -> Quantized:
    """``x`` (a flat message, or a batch as rows) quantised per bucket (None: the whole message); stochastic (QSGD)
    with ``seeds`` (an int, or one a row), deterministic rounding without."""
    rows, single = _rows(x)
    rows = rows.to(torch.float32)
    n = rows.shape[1]
    size = bucket or max(1, n)
    b = _buckets(rows, size)
    if bits == 1:
        count = torch.full((b.shape[1],), float(size), device=rows.device)
        if b.shape[1]:
            count[-1] = n - size * (b.shape[1] - 1)
        scales = b.abs().sum(-1) / count
        q = torch.where(b < 0, -1, 1).to(torch.int16)
    else:
        s = levels(bits)
        scales = torch.linalg.vector_norm(b, dim=-1)
        ratio = b.abs() * s / scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
        if seeds is None:
            level = torch.round(ratio)
        else:
            low = torch.floor(ratio)
            u = uniform(seeds, b.shape[1] * size).to(rows.device).view_as(ratio)
            level = low + (u < (ratio - low)).to(ratio.dtype)
        q = (torch.sign(b) * level.clamp(max=s)).to(torch.int16)
    return _one(Quantized(q.reshape(rows.shape[0], -1)[:, :n], scales, bits, size), single)


def dequantize(q: Quantized) -> torch.Tensor:
    """The flat float32 tensor ``q`` stands for (a row each for a batch)."""
    n = q.levels.shape[-1]
    b = _buckets(q.levels.to(torch.float32), q.bucket)
    out = b * q.scales.to(torch.float32).unsqueeze(-1)
    out = out if q.bits == 1 else out / levels(q.bits)
    return out.reshape(*q.levels.shape[:-1], -1)[..., :n]


def topk(x: torch.Tensor, fraction: float) -> Sparse:
    """The k = ceil(fraction x d) entries of largest magnitude of each row (ties: the lower index)."""
    rows, single = _rows(x)
    k = keep_count(rows.shape[1], fraction)
    mag = rows.abs()
    if k == 0:
        idx = torch.zeros(rows.shape[0], 0, dtype=torch.int64, device=rows.device)
    else:
        # every magnitude from the k-th largest up (no full sort); where several equal the k-th, the lowest indices
        kth = torch.topk(mag, k, dim=1, sorted=False).values.min(1, keepdim=True).values
        above, tied = mag > kth, mag == kth
        keep = above | (tied & (tied.cumsum(1) <= k - above.sum(1, keepdim=True)))
        idx = torch.nonzero(keep)[:, 1].reshape(rows.shape[0], k)  # row-major: in index order within a row
    return _one(Sparse(idx, rows.gather(1, idx), rows.shape[1]), single)


def randk(x: torch.Tensor, fraction: float, seeds: Any, unbiased: bool) -> Sparse:
    """k = ceil(fraction x d) entries of each row at positions drawn from its seed, scaled by d / k if ``unbiased``."""
    rows, single = _rows(x)
    seeds = [seeds] if single else list(seeds)
    idx = random_positions(rows.shape[1], keep_count(rows.shape[1], fraction), seeds).to(rows.device)
    values = rows.gather(1, idx)
    if unbiased and idx.shape[1]:
        values = values * (rows.shape[1] / idx.shape[1])
    return _one(Sparse(idx, values, rows.shape[1], seeds), single)


def keep_count(numel: int, fraction: float) -> int:
    """k = ceil(fraction x d), at least one entry of a non-empty tensor."""
    return min(numel, max(1, math.ceil(fraction * numel - 1e-9)))


def random_positions(numel: int, k: int, seeds: Any) -> torch.Tensor:
    """The k sorted positions random-k keeps: the k smallest of the seed's first ``numel`` draws (all distinct), the
    sender's and the receiver's draw; (k,) for one seed, (seeds, k) for a list."""
    z = _mix(seeds, numel)
    idx = np.argpartition(z, k - 1, axis=1)[:, :k] if 0 < k < numel else np.tile(np.arange(k), (z.shape[0], 1))
    idx = torch.from_numpy(np.sort(idx, axis=1).astype(np.int64))
    return idx[0] if np.ndim(seeds) == 0 else idx


def densify(s: Sparse, values: torch.Tensor) -> torch.Tensor:
    """The flat tensor (a row each for a batch) with ``values`` at ``s``'s positions, zeros elsewhere."""
    out = values.new_zeros(*s.indices.shape[:-1], s.numel)
    return out.scatter_(-1, s.indices, values)


def row(data: Any, i: int) -> Any:
    """Message ``i`` of a batch's encoding (a tensor, :class:`Quantized` or :class:`Sparse` with one row each), in
    tensors of its own: a view would carry the whole batch's storage when pickled or checkpointed."""
    if isinstance(data, torch.Tensor):
        return data[i].clone()
    if isinstance(data, Quantized):
        return replace(data, levels=data.levels[i].clone(), scales=data.scales[i].clone())
    if isinstance(data, Sparse):
        return Sparse(data.indices[i].clone(), row(data.values, i), data.numel,
                      None if data.seed is None else data.seed[i])
    return data


# --- sizes and the bit-packed encoding -------------------------------------------------------------------------
def _index_bits(numel: int) -> int:
    return max(1, math.ceil(math.log2(numel))) if numel > 1 else 1


def position_bytes(s: Sparse) -> int:
    """Bytes of a sparse tensor's positions: the seed (random-k), else the smaller of k indices of ceil(log2 d) bits
    and a d-bit bitmap."""
    if s.seed is not None:
        return SEED_BYTES
    k = s.indices.numel()
    return min(math.ceil(k * _index_bits(s.numel) / 8), math.ceil(s.numel / 8))


def wire_bytes(data: Any) -> int:
    """Bytes ``data`` takes on the wire: a tensor its elements, a :class:`Quantized` its packed values and scales, a
    :class:`Sparse` its values and positions. The one size function of the channel."""
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    if isinstance(data, Quantized):
        return math.ceil(data.levels.numel() * data.bits / 8) + wire_bytes(data.scales)
    if isinstance(data, Sparse):
        return wire_bytes(data.values) + position_bytes(data)
    if isinstance(data, (tuple, list)):
        return sum(wire_bytes(d) for d in data)
    return 0


def _bits_of(values: np.ndarray, width: int) -> np.ndarray:
    """(n, width) bits of non-negative integers, most significant first."""
    shifts = np.arange(width - 1, -1, -1, dtype=np.int64)
    return ((values.astype(np.int64)[:, None] >> shifts) & 1).astype(np.uint8)


def _from_bits(bits: np.ndarray, width: int) -> np.ndarray:
    weights = (1 << np.arange(width - 1, -1, -1, dtype=np.int64))
    return (bits.reshape(-1, width).astype(np.int64) * weights).sum(1)


def pack(data: Any) -> bytes:
    """The bytes :func:`wire_bytes` counts, as a real encoding: packed values, then scales or positions."""
    if isinstance(data, torch.Tensor):
        return data.detach().contiguous().numpy().tobytes()
    if isinstance(data, Quantized):
        lv = data.levels.numpy().astype(np.int64)
        if data.bits == 1:
            bits = (lv < 0).astype(np.uint8)[:, None]
        else:
            bits = np.concatenate([(lv < 0).astype(np.uint8)[:, None], _bits_of(np.abs(lv), data.bits - 1)], axis=1)
        return np.packbits(bits.reshape(-1)).tobytes() + pack(data.scales)
    if isinstance(data, Sparse):
        if data.seed is not None:
            where = int(data.seed).to_bytes(SEED_BYTES, "little")
        else:
            k, width = data.indices.numel(), _index_bits(data.numel)
            if math.ceil(k * width / 8) <= math.ceil(data.numel / 8):
                where = np.packbits(_bits_of(data.indices.numpy(), width).reshape(-1)).tobytes()
            else:
                mask = np.zeros(data.numel, dtype=np.uint8)
                mask[data.indices.numpy()] = 1
                where = np.packbits(mask).tobytes()
        return pack(data.values) + where
    raise TypeError(f"cannot pack a {type(data).__name__}")


def unpack(raw: bytes, like: Any) -> Any:
    """Read back what :func:`pack` wrote; ``like`` gives the header (shapes, dtypes, bits, k) a receiver knows."""
    if isinstance(like, torch.Tensor):
        arr = np.frombuffer(raw, dtype=like.numpy().dtype, count=like.numel()).copy()
        return torch.from_numpy(arr).reshape(like.shape)
    if isinstance(like, Quantized):
        n, b = like.levels.numel(), like.bits
        body = math.ceil(n * b / 8)
        bits = np.unpackbits(np.frombuffer(raw[:body], dtype=np.uint8))[: n * b].reshape(n, b)
        sign = np.where(bits[:, 0] == 1, -1, 1)
        mag = np.ones(n, dtype=np.int64) if b == 1 else _from_bits(bits[:, 1:], b - 1)
        lv = torch.from_numpy((sign * mag).astype(np.int16))
        return Quantized(lv, unpack(raw[body:], like.scales), b, like.bucket)
    if isinstance(like, Sparse):
        size = wire_bytes(like.values)
        values, where = unpack(raw[:size], like.values), raw[size:]
        if like.seed is not None:
            seed = int.from_bytes(where[:SEED_BYTES], "little")
            return Sparse(random_positions(like.numel, like.indices.numel(), seed), values, like.numel, seed)
        k, width = like.indices.numel(), _index_bits(like.numel)
        if math.ceil(k * width / 8) <= math.ceil(like.numel / 8):
            idx = _from_bits(np.unpackbits(np.frombuffer(where, dtype=np.uint8))[: k * width], width)
        else:
            idx = np.flatnonzero(np.unpackbits(np.frombuffer(where, dtype=np.uint8))[: like.numel])
        return Sparse(torch.from_numpy(idx.astype(np.int64)), values, like.numel)
    raise TypeError(f"cannot unpack a {type(like).__name__}")


def cast_floats(data: Any, dtype: torch.dtype) -> Any:
    """``data`` with every floating tensor in it (a tensor, a :class:`Quantized`'s scales, a :class:`Sparse`'s
    values) cast to ``dtype``: the precision stage composes with compression."""
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if torch.is_floating_point(data) else data
    if isinstance(data, Quantized):
        return replace(data, scales=cast_floats(data.scales, dtype))
    if isinstance(data, Sparse):
        return replace(data, values=cast_floats(data.values, dtype))
    if isinstance(data, tuple):
        return tuple(cast_floats(d, dtype) for d in data)
    return data


__all__ = ["Quantized", "Sparse", "cast_floats", "densify", "dequantize", "keep_count", "levels", "pack",
           "position_bytes", "quantize", "randk", "random_positions", "row", "topk", "uniform", "unpack", "wire_bytes"]
