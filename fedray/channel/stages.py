"""The channel's stages. Each has a client side, run where the client runs (its Ray worker, or the in-process
worker; batched clients included), and a server side; uplink and downlink each have an encoder and a decoder.

Stages run in one fixed order, not one a user assembles (:data:`ORDER`): on the way up, an adversary's forgery,
clipping, local noise, compression, then the wire format (``channel.precision``); the server decodes in reverse, and
the aggregation rule or central noise comes after, at the aggregation hook
(:class:`~fedray.learning.aggregation.Aggregation`). On the way down the server encodes a payload once per broadcast
and every client decodes it.

A stage with per-client state (``per_client = True``, e.g. compression's error-feedback residuals) keeps it on the
client side only: the state follows the client's own state (kept when its upload arrives, lost with an upload that
does not, kept by a client not sampled, checkpointed and resumed exactly).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from fedray.channel import compression
from fedray.channel.compression import cast_floats
from fedray.channel.message import Leaf
from fedray.seeding import derive_seed

#: The fixed order of the stages (lower runs first on encoding, last on decoding).
ORDER = {"adversary": 10, "clip": 20, "local_noise": 30, "compress": 40, "precision": 50}


class Stage:
    """A transform of the leaves of every message (:class:`~fedray.channel.message.Leaf`; counts never reach it).
    The defaults do nothing: a stage overrides the sides it acts on.

    Encoders see a batch: each leaf's ``data`` has one row per message (the clients of a round a worker trained
    together, batched or not; one row for the server's payload), with ``states`` and ``keys`` one per row. A
    stage works on the rows at once, so that clients trained in lockstep are encoded without a loop over them, and
    a message's encoding must not depend on the others of its batch: a client alone, stacked with others, in
    process or on Ray sends the same. ``keys`` name the messages for seeded draws: (round, client) on the way up,
    (version,) on the way down. Decoders see one message as it arrived."""

    name: ClassVar[str]
    order: ClassVar[int]
    #: True when the client side keeps state per client (:meth:`init_state`, threaded through :meth:`client_encode`).
    per_client: bool = False
    #: True when the server side keeps state of its own (:meth:`init_state`, threaded through :meth:`server_encode`).
    per_server: bool = False
    #: True when the client side reads what the server announced with the payload (:meth:`announce`: the stage's
    #: ``client_encode`` then takes ``heard``) and tells the server a figure a message (:meth:`tell`), which the
    #: server's side reads after the step (:meth:`hear`): the adaptive clip's current clip and clipped-or-not bit.
    listens: bool = False

    def init_state(self, client_id: int) -> Any:
        """A client's state before its first upload (and the server's before its first broadcast)."""
        return None

    # --- uplink: the client encodes what it sends, the server decodes what arrives ------------------------------
    def client_message(self, message: Any, key: tuple[int, ...]) -> Any:
        """The whole message before the stages split it (its header and counts, which no leaf carries); ``key``:
        (round, client). Only the adversary's stage changes it."""
        return message

    def client_encode(self, leaves: list[Leaf], states: list[Any], keys: list[tuple[int, ...]]) -> tuple[list[Leaf],
                                                                                                          list[Any]]:
        return leaves, states

    def server_decode(self, leaves: list[Leaf]) -> list[Leaf]:
        return leaves

    # --- downlink: the server encodes a payload once per model version, every client decodes it ------------------
    def server_encode(self, leaves: list[Leaf], states: list[Any], keys: list[tuple[int, ...]]) -> tuple[list[Leaf],
                                                                                                          list[Any]]:
        """``states``: the stage's server state (downlink error feedback; None when it keeps none), one row."""
        return leaves, states

    def client_decode(self, leaves: list[Leaf]) -> list[Leaf]:
        return leaves

    # --- what a listening stage says beside the messages (a few numbers, 8 bytes each on the wire) ----------------
    def announce(self, state: Any) -> dict[str, float]:
        """Server side: what every client receives with a payload, from the stage's server state."""
        return {}

    def tell(self, leaves: list[Leaf], keys: list[tuple[int, ...]], heard: dict[str, float]) -> list[dict[str, float]]:
        """Client side, before :meth:`client_encode`: what each message of the batch tells the server."""
        return [{} for _ in keys]

    def hear(self, state: Any, told: list[dict[str, float]], round_: int) -> Any:
        """Server side, after a server step: the stage's new server state from what the step's uploads told."""
        return state


class Identity(Stage):
    """Sends every message as it is: a channel with it gives the figures of a channel without stages."""

    name = "identity"
    order = 0


class Precision(Stage):
    """``channel.precision``: every floating tensor of every message, both ways, cast to ``fp16`` or ``bf16`` for
    the wire and back to its own dtype on arrival (round to nearest even); after compression, its scales and kept
    values. Bytes of float32 tensors halve; integer tensors and scalars are unchanged."""

    name = "precision"
    order = ORDER["precision"]
    WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

    def __init__(self, precision: str):
        self.wire = self.WIRE_DTYPES[precision]

    def _encode(self, leaves: list[Leaf], states: list[Any], keys: list) -> tuple[list[Leaf], list[Any]]:
        for leaf in leaves:
            leaf.data = cast_floats(leaf.data, self.wire)
        return leaves, states

    def _decode(self, leaves: list[Leaf]) -> list[Leaf]:
        for leaf in leaves:
            leaf.data = cast_floats(leaf.data, leaf.dtype)
        return leaves

    client_encode = server_encode = _encode
    server_decode = client_decode = _decode


class Compress(Stage):
    """``channel.quantize`` / ``channel.sparsify`` (:mod:`fedray.channel.compression`) on the directions
    ``channel.compress_on`` names. A model leaf with its reference in the payload is sent as its update against it
    (the receiver adds the reference back); every other leaf as its values. With ``channel.error_feedback`` the part
    not sent is kept and added to the next message of the same leaf (Stich et al. 2018; Karimireddy et al. 2019): on
    the uplink per client (client state), on the downlink at the server (server state)."""

    name = "compress"
    order = ORDER["compress"]

    def __init__(self, cfg: Any, seed: int):
        self.quantize, self.bits, self.bucket = cfg.quantize, cfg.bits, cfg.bucket
        self.sparsify, self.fraction, self.feedback = cfg.sparsify, cfg.fraction, cfg.error_feedback
        self.up, self.down = cfg.compress_on in ("up", "both"), cfg.compress_on in ("down", "both")
        self.seed = seed
        self.per_client, self.per_server = self.feedback and self.up, self.feedback and self.down

    def init_state(self, client_id: int) -> dict[str, torch.Tensor] | None:
        return {} if self.feedback else None

    def _compress(self, x: torch.Tensor, positions: list[int], draws: list[int] | None) -> Any:
        """The rows of ``x`` compressed: random-k's positions from ``positions``, QSGD's draws from ``draws``."""
        if self.sparsify == "none":
            return compression.quantize(x, self.bits, self.bucket, draws)
        if self.sparsify == "topk":
            kept = compression.topk(x, self.fraction)
        else:
            kept = compression.randk(x, self.fraction, positions, unbiased=not self.feedback)
        if self.quantize != "none":
            kept.values = compression.quantize(kept.values, self.bits, self.bucket, draws)
        return kept

    @staticmethod
    def _decompress(data: Any) -> torch.Tensor:
        if isinstance(data, compression.Sparse):
            values = data.values
            values = compression.dequantize(values) if isinstance(values, compression.Quantized) else values
            return compression.densify(data, values.to(torch.float32))
        return compression.dequantize(data)

    def _encode(self, leaves: list[Leaf], states: list[dict | None], keys: list[tuple[int, ...]],
                direction: str) -> tuple[list[Leaf], list[dict | None]]:
        n = len(keys)
        states = [dict(s) if s is not None else None for s in states]
        # one seed a message (run seed, direction, its key), one stream a leaf: QSGD's draws from seed + 2i + 1,
        # random-k's positions from seed + 2i for the i-th leaf in walk order
        seeds = [derive_seed(self.seed, "compress", direction, *key) % (1 << 62) for key in keys]
        for i, leaf in enumerate(leaves):
            x = leaf.data.detach().reshape(n, -1).to(torch.float32)
            if leaf.reference is not None:
                x = x - leaf.reference.detach().reshape(1, -1).to(x)
                leaf.relative = True
            name = _path_name(leaf.path)
            if self.feedback:
                x = x + torch.stack([s[name].to(x) if name in s else x.new_zeros(x.shape[1]) for s in states])
            sent = self._compress(x, [s + 2 * i for s in seeds],
                                  [s + 2 * i + 1 for s in seeds] if self.quantize == "qsgd" else None)
            if self.feedback:
                # each client's own copy: a checkpoint of a view would save the whole batch
                for state, residual in zip(states, (x - self._decompress(sent)).unbind()):
                    state[name] = residual.clone()
            leaf.data = sent
        return leaves, states

    def _decode(self, leaves: list[Leaf]) -> list[Leaf]:
        for leaf in leaves:
            x = self._decompress(leaf.data).reshape(leaf.shape)
            if leaf.relative:
                x = x + leaf.reference.to(torch.float32)
            leaf.data = x.to(leaf.dtype)
        return leaves

    def client_encode(self, leaves, states, keys):
        return self._encode(leaves, states, keys, "up") if self.up else (leaves, states)

    def server_decode(self, leaves):
        return self._decode(leaves) if self.up else leaves

    def server_encode(self, leaves, states, keys):
        return self._encode(leaves, states, keys, "down") if self.down else (leaves, states)

    def client_decode(self, leaves):
        return self._decode(leaves) if self.down else leaves


def _path_name(path: tuple) -> str:
    """A leaf's path as one string key (checkpointed state has str keys)."""
    return "/".join(map(str, path))


__all__ = ["Compress", "Identity", "ORDER", "Precision", "Stage"]
