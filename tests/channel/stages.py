"""A test-only channel stage with per-client state, importable by Ray workers (a test module's class travels with the
experiment by reference), and the small messages the channel's tests send."""

from __future__ import annotations

import dataclasses
import os

import torch

from fedray.channel.stages import Stage
from fedray.learning.boundary import Payload, Upload, counts_field, model_field


@dataclasses.dataclass
class Sent(Payload):
    weights: dict


@dataclasses.dataclass
class Message(Upload):
    """A model against the payload's weights, values, counts declared as such, a header scalar."""

    weights: dict = model_field(against="weights")
    logits: torch.Tensor = None
    histogram: torch.Tensor = counts_field(default=None)
    num_samples: int = 0


class Counting(Stage):
    """Counts each client's uploads (its channel state) and scales the first values leaf of every upload by
    1 + count / 1000, so that figures depend on the state: a state lost, reset or taken from another client would
    change them. Records the process its client side ran in."""

    name = "counting"
    order = 15  # before compression, as an adversary's or a clip's place: it scales the raw tensors
    per_client = True

    def init_state(self, client_id):
        return {"count": 0, "pid": -1, "client": client_id}

    def client_encode(self, leaves, states, keys):
        for state, (_, client_id) in zip(states, keys):
            assert state["client"] == client_id, "a client was handed another client's channel state"
        counts = torch.tensor([state["count"] + 1 for state in states], dtype=torch.float32)
        for leaf in leaves:
            if leaf.kind == "model":  # one row a client
                leaf.data = leaf.data * (1.0 + counts / 1000.0).reshape(-1, *[1] * (leaf.data.dim() - 1))
                break
        return leaves, [{"count": int(c), "pid": os.getpid(), "client": k[1]} for c, k in zip(counts, keys)]
