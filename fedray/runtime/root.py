"""FLTrust's server model update g_0 (Cao et al., "FLTrust: Byzantine-robust Federated Learning via Trust
Bootstrapping", NDSS 2021, Algorithms 1-2): each iteration the server trains the global model on its small clean root
dataset with the local training its clients run (ModelUpdate: the same optimizer, learning rate, batch size and local
iterations), and its update g_0 = w_root - w is the direction every client's update is scored against.

Here the server runs the method's own ``client_update`` for a pseudo-client holding the root data (the labelled
``data.server_data``), so g_0 is the update a client holding that data would upload, for any method whose means a
robust rule may replace: the same plan, run alone as a worker runs one client (a lockstep-only plan through the
lockstep engine), at the clients' ``runtime.precision``. The pseudo-client's id is -1 (no client's), its randomness
(run seed, "fltrust", round) alone, and it trains from the model the clients of the step trained from (the current
one asynchronously, where uploads are rebased onto it), so in-process and on Ray, and after a resume, g_0 is the
same. Its model tensors are read off the upload as the channel reads them (:func:`fedray.channel.message.split`: the
fields declared models against a payload field, each with that payload tensor as its reference), so the server needs
no knowledge of the method's upload type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedray.channel.message import split
from fedray.config import ExperimentConfig
from fedray.learning.aggregation import RootUpdate
from fedray.methods import Algorithm, ClientContext
from fedray.methods.api import ModelBank
from fedray.seeding import derive_seed
from fedray.vectorized.engine import run_alone
from fedray.vectorized.precision import local_precision

#: The pseudo-client's id: no registered client's (those are 0..num_clients - 1).
ROOT_CLIENT = -1


@dataclass
class Root:
    """One server step's root training: g_0 as the rule takes it, and the examples it passed through the model (the
    method's ``client_samples`` for the pseudo-client: the server's extra work on the simulated clock)."""

    update: RootUpdate
    samples: int


class RootTraining:
    """Trains the server's pseudo-client on ``algo.server_data``. ``modules``: the method's modules, built for it
    apart from the server's own (a worker's are reused from client to client the same way: weights are loaded from
    the payload each time)."""

    def __init__(self, cfg: ExperimentConfig, algo: Algorithm, modules: Any, device: torch.device,
                 channels_last: bool = False):
        data = algo.server_data
        if data is None or data.y is None:  # the config refuses it (AggregationConfig.check); a bug if it gets here
            raise ValueError("aggregation.rule=fltrust needs labelled data.server_data on the server")
        self.cfg, self.algo, self.modules, self.device = cfg, algo, modules, device
        self.models = ModelBank(algo.spec, device, channels_last)

    def update(self, round_: int, payload: Any) -> Root:
        """g_0 of server step ``round_``: the pseudo-client's upload trained from ``payload`` (the method's broadcast
        of the model the step's uploads are updates of), minus that payload, leaf by leaf in float64."""
        data = self.algo.server_data
        ctx = ClientContext(client_id=ROOT_CLIENT, round=round_, seed=derive_seed(self.cfg.seed, "fltrust", round_),
                            x=data.x, y=data.y, spec=self.algo.spec, fed=self.cfg.federation.at_round(round_),
                            device=self.device, modules=self.modules, architecture=self.cfg.model.name,
                            models=self.models)
        with local_precision(self.cfg.runtime.precision):  # as a worker runs one client alone
            plan = self.algo.client_update(ctx, payload, self.algo.init_client_state(ROOT_CLIENT))
            result = run_alone(ctx, plan, self.cfg.runtime.cuda_graphs)
        _, leaves = split(result.upload, payload)
        update = [(leaf.path, leaf.data.detach().double() - leaf.reference.double()) for leaf in leaves
                  if leaf.kind == "model" and leaf.reference is not None]
        if not update:
            raise RuntimeError(f"aggregation.rule=fltrust: {type(result.upload).__name__} declares no model field "
                               "against the payload (model_field(against=...)), so the server has no update to trust")
        return Root(update, self.algo.client_samples(ctx))


__all__ = ["ROOT_CLIENT", "Root", "RootTraining"]
