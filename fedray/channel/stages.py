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

from fedray.channel.message import Leaf

#: The fixed order of the stages (lower runs first on encoding, last on decoding).
ORDER = {"adversary": 10, "clip": 20, "local_noise": 30, "compress": 40, "precision": 50}


class Stage:
    """A transform of the leaves of every message (:class:`~fedray.channel.message.Leaf`; counts never reach it).
    The defaults do nothing: a stage overrides the sides it acts on."""

    name: ClassVar[str]
    order: ClassVar[int]
    #: True when the client side keeps state per client (:meth:`init_state`, threaded through :meth:`client_encode`).
    per_client: ClassVar[bool] = False

    def init_state(self, client_id: int) -> Any:
        """A client's state before its first upload."""
        return None

    # --- uplink: the client encodes what it sends, the server decodes what arrives ------------------------------
    def client_encode(self, leaves: list[Leaf], state: Any, client_id: int) -> tuple[list[Leaf], Any]:
        return leaves, state

    def server_decode(self, leaves: list[Leaf]) -> list[Leaf]:
        return leaves

    # --- downlink: the server encodes a payload once per broadcast, every client decodes it ----------------------
    def server_encode(self, leaves: list[Leaf]) -> list[Leaf]:
        return leaves

    def client_decode(self, leaves: list[Leaf]) -> list[Leaf]:
        return leaves


class Identity(Stage):
    """Sends every message as it is: a channel with it gives the figures of a channel without stages."""

    name = "identity"
    order = 0


def _cast(data: Any, dtype: torch.dtype) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if torch.is_floating_point(data) else data
    if isinstance(data, tuple):
        return tuple(_cast(d, dtype) for d in data)
    return data


class Precision(Stage):
    """``channel.precision``: every floating tensor of every message, both ways, cast to ``fp16`` or ``bf16`` for
    the wire and back to its own dtype on arrival (round to nearest even). Bytes of float32 tensors halve; integer
    tensors and scalars are unchanged."""

    name = "precision"
    order = ORDER["precision"]
    WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

    def __init__(self, precision: str):
        self.wire = self.WIRE_DTYPES[precision]

    def _encode(self, leaves: list[Leaf]) -> list[Leaf]:
        for leaf in leaves:
            leaf.data = _cast(leaf.data, self.wire)
        return leaves

    def _decode(self, leaves: list[Leaf]) -> list[Leaf]:
        for leaf in leaves:
            leaf.data = _cast(leaf.data, leaf.dtype)
        return leaves

    def client_encode(self, leaves, state, client_id):
        return self._encode(leaves), state

    server_decode = _decode
    server_encode = _encode
    client_decode = _decode


__all__ = ["Identity", "ORDER", "Precision", "Stage"]
