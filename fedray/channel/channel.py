"""The channel every message between clients and server passes through (see :mod:`fedray.channel`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from fedray.adversary.config import MESSAGE_ATTACKS, UPDATE_ATTACKS
from fedray.channel.compression import row, wire_bytes
from fedray.channel.message import Leaf, join, reference, split
from fedray.channel.stages import Compress, Precision, Stage
from fedray.learning.aggregation import Aggregation, WeightedMean
from fedray.learning.robust import build_rule
from fedray.learning.weights import nbytes


@dataclass
class Packet:
    """A message as it crosses the wire: its skeleton (counts and scalars in place) and its leaves as the stages
    encoded them. Its bytes are the skeleton's and the encoded leaves' (:meth:`Channel.nbytes`); the leaves'
    dtypes and shapes are the header a receiver decodes to, not counted, as a message's structure is not."""

    skeleton: Any
    leaves: list[Leaf]
    #: what listening stages say beside the message (:meth:`Stage.announce` down, :meth:`Stage.tell` up): counted
    side: dict[str, float] = dataclasses.field(default_factory=dict)


class Channel:
    """Stages in their fixed order (:data:`fedray.channel.stages.ORDER`) and the aggregation hook's rule.

    Without stages (the default config) every message passes as it is, at no cost, and its bytes are the
    message's own: the figures of a run without a channel."""

    def __init__(self, stages: Sequence[Stage] = (), aggregation: Aggregation | None = None):
        self.stages = sorted(stages, key=lambda s: s.order)
        self.aggregation = aggregation if aggregation is not None else WeightedMean()

    @property
    def stateful(self) -> bool:
        """Whether a client keeps channel state (some stage's ``per_client``)."""
        return any(s.per_client for s in self.stages)

    def init_state(self, client_id: int) -> dict[str, Any] | None:
        """A client's channel state before its first upload: each stateful stage's, by name."""
        if not self.stateful:
            return None
        return {s.name: s.init_state(client_id) for s in self.stages if s.per_client}

    def init_server_state(self) -> dict[str, Any] | None:
        """The server's channel state before its first broadcast (downlink error feedback), by stage name."""
        states = {s.name: s.init_state(-1) for s in self.stages if s.per_server}
        return states or None

    # --- uplink -------------------------------------------------------------------------------------------------
    def encode_up(self, upload: Any, payload: Any, state: dict[str, Any] | None, client_id: int,
                  round_: int) -> tuple[Any, dict[str, Any] | None]:
        """Client side: (what is sent, the client's new channel state). ``payload``: the payload as this client
        decoded it (the reference of the upload's model fields)."""
        return self.encode_up_many([upload], payload, [state], [client_id], round_)[0]

    def encode_up_many(self, uploads: list[Any], payload: Any, states: list[dict[str, Any] | None],
                       client_ids: list[int], round_: int,
                       heard: dict[str, float] | None = None) -> list[tuple[Any, dict[str, Any] | None]]:
        """:meth:`encode_up` for the clients of a round trained from one payload: uploads of the same layout (their
        leaves' paths, shapes and dtypes) go through each stage stacked, one row a client. ``heard``: what the
        payload's packet announced (:meth:`heard`), read by listening stages."""
        heard = heard or {}
        if not self.stages:
            return list(zip(uploads, states))
        states = [dict(s) if s is not None else self.init_state(c) for s, c in zip(states, client_ids)]
        for stage in self.stages:
            uploads = [stage.client_message(upload, (round_, c)) for upload, c in zip(uploads, client_ids)]
        parts = [split(upload, payload) for upload in uploads]
        batches: dict[tuple, list[int]] = {}
        for i, (_, leaves) in enumerate(parts):
            layout = tuple((leaf.path, leaf.shape, leaf.dtype, leaf.reference is not None) for leaf in leaves)
            batches.setdefault(layout, []).append(i)
        sent: list[Any] = [None] * len(uploads)
        for members in batches.values():
            first = parts[members[0]][1]
            leaves = [dataclasses.replace(leaf, data=torch.stack([parts[i][1][j].data for i in members]))
                      for j, leaf in enumerate(first)]
            keys = [(round_, client_ids[i]) for i in members]
            told: list[dict[str, float]] = [{} for _ in members]
            for stage in self.stages:
                own = [states[i].get(stage.name) if stage.per_client else None for i in members]
                if stage.listens:
                    for said, more in zip(told, stage.tell(leaves, keys, heard)):
                        said.update(more)
                    leaves, own = stage.client_encode(leaves, own, keys, heard=heard)
                else:
                    leaves, own = stage.client_encode(leaves, own, keys)
                if stage.per_client:
                    for i, state in zip(members, own):
                        states[i][stage.name] = state
            for r, i in enumerate(members):
                sent[i] = Packet(parts[i][0], [_row(leaf, r) for leaf in leaves], told[r])
        return list(zip(sent, states))

    def decode_up(self, sent: Any, payload: Any = None) -> Any:
        """Server side: the upload as it arrived. ``payload``: the payload as the client decoded it, whose tensors
        the upload's updates are added back to."""
        return self._decode(sent, "server_decode", payload)

    # --- downlink -----------------------------------------------------------------------------------------------
    def encode_down(self, payload: Any, version: int, state: dict[str, Any] | None = None) -> tuple[Any, Any]:
        """Server side, once per model version: (what is sent to every client, the server's new channel state)."""
        if not self.stages:
            return payload, state
        state = dict(state) if state is not None else self.init_server_state()
        skeleton, leaves = split(payload)
        leaves = [dataclasses.replace(leaf, data=leaf.data.unsqueeze(0)) for leaf in leaves]  # a batch of one
        for stage in self.stages:
            own = [state.get(stage.name) if stage.per_server else None]
            leaves, own = stage.server_encode(leaves, own, [(version,)])
            if stage.per_server:
                state[stage.name] = own[0]
        return Packet(skeleton, [_row(leaf, 0) for leaf in leaves], self.announce(state)), state

    def announce(self, state: dict[str, Any] | None) -> dict[str, float]:
        """What the listening stages would announce from the server's channel state ``state`` (the current clip)."""
        state = state if state is not None else self.init_server_state() or {}
        return {k: v for s in self.stages if s.listens for k, v in s.announce(state.get(s.name)).items()}

    @staticmethod
    def heard(sent: Any) -> dict[str, float]:
        """Client side: what a payload's packet announced (empty without listening stages)."""
        return dict(sent.side) if isinstance(sent, Packet) else {}

    def hear(self, state: dict[str, Any] | None, uploads: list[Any], round_: int) -> dict[str, Any] | None:
        """Server side, after a step: the listening stages' new server state from what the step's uploads (their
        packets as they arrived) told."""
        if not any(s.listens for s in self.stages):
            return state
        state = dict(state) if state is not None else self.init_server_state()
        told = [dict(u.side) if isinstance(u, Packet) else {} for u in uploads]
        for s in self.stages:
            if s.listens:
                state[s.name] = s.hear(state.get(s.name), told, round_)
        return state

    def decode_down(self, sent: Any) -> Any:
        """Client side: the payload as the client decoded it."""
        return self._decode(sent, "client_decode")

    def _decode(self, sent: Any, side: str, payload: Any = None) -> Any:
        """The stages' ``side`` in reverse order over copies of the packet's leaves (a packet may be decoded
        again: a payload by every client of a version, an upload after a retry)."""
        if not isinstance(sent, Packet):
            return sent
        leaves = [leaf.header() for leaf in sent.leaves]
        for leaf in leaves:
            if leaf.relative:
                leaf.reference = reference(payload, leaf.against, leaf.shape)
                if leaf.reference is None:
                    raise RuntimeError(f"an update of {leaf.path} arrived without the payload it is against")
        for stage in reversed(self.stages):
            leaves = getattr(stage, side)(leaves)
        return join(sent.skeleton, leaves)

    @staticmethod
    def nbytes(sent: Any) -> int:
        """The bytes of a message as sent: after the stages (:func:`~fedray.channel.compression.wire_bytes`)."""
        if isinstance(sent, Packet):
            return nbytes(sent.skeleton) + sum(wire_bytes(leaf.data) for leaf in sent.leaves) + 8 * len(sent.side)
        return nbytes(sent)


def _row(leaf: Leaf, i: int) -> Leaf:
    """Message ``i`` of a batch's encoded leaf, as its receiver gets it (:meth:`Leaf.header`)."""
    return dataclasses.replace(leaf.header(), data=row(leaf.data, i))


def build_channel(cfg: Any, setup_counts: bool = False, histograms: bool = False) -> Channel:
    """The channel ``cfg.channel`` configures, holding the rule ``cfg.aggregation`` names (``cfg``: the
    ExperimentConfig); ``setup_counts``: the method's clients send their label counts once at set-up; ``histograms``:
    its uploads carry label histograms."""
    stages: list[Stage] = []
    if cfg.adversary.attack in (*UPDATE_ATTACKS, *MESSAGE_ATTACKS):
        from fedray.adversary import malicious_clients
        from fedray.adversary.forge import Forge
        from fedray.data.datasets import input_spec

        stages.append(Forge(cfg.adversary, malicious_clients(cfg), input_spec(cfg.data)[1], cfg.seed, setup_counts))
    p = cfg.privacy
    if p.enabled:
        from fedray.privacy.accounting import count_noise, histogram_noise, noise_multiplier, update_noise_multiplier
        from fedray.privacy.stages import Adaptive, CentralNoise, Clip, LocalNoise

        adaptive = (Adaptive(p.target_quantile, p.clip_lr, count_noise(cfg), cfg.federation.buffer(), cfg.seed)
                    if p.adaptive_clip else None)
        stages.append(Clip(p.clip, adaptive))
        if p.mechanism == "local":
            stages.append(LocalNoise(p.clip, update_noise_multiplier(cfg, histograms), cfg.seed, p.histogram_clip,
                                     histogram_noise(cfg) if histograms else None))
    if cfg.channel.compresses:
        stages.append(Compress(cfg.channel, cfg.seed))
    if cfg.channel.precision != "fp32":
        stages.append(Precision(cfg.channel.precision))
    a = cfg.aggregation
    if p.mechanism == "central":  # the hook's one rule: the noised sum (aggregation.rule=mean, checked)
        return Channel(stages, CentralNoise(p.clip, update_noise_multiplier(cfg), cfg.federation.buffer(), cfg.seed))
    return Channel(stages, build_rule(a.rule, beta=a.beta, f=a.f, m=a.m, max_norm=a.max_norm))


__all__ = ["Channel", "Packet", "build_channel"]
