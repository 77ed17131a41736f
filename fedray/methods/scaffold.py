"""SCAFFOLD (Karimireddy et al., 2020, Algorithm 1 with option II): local SGD corrected by control variates.

Each client i keeps a control variate c_i, the server c; both start at zero. A sampled client starts from the global
x and takes K local steps y_i <- y_i - eta_l (g_i(y_i) - c_i + c) (Alg. 1 line 10): here the loss CE + <c - c_i, y>,
whose gradient adds the correction c - c_i, handed to the loss as the client's own input (``client_inputs``), so
the vectorised runtime batches the clients' corrections with their weights. Option II (line 12):
c_i+ = c_i - c + (x - y_i) / (K eta_l). A client uploads y_i and Delta c_i = c_i+ - c_i; the server (lines 16-17):
x <- x + eta_g (1/|S|) sum_i (y_i - x) and c <- c + (|S| / N) (1/|S|) sum_i Delta c_i. Both directions carry a model
and a control variate: twice FedAvg's bytes, as the paper says.

Where the paper is silent: the means over S are uniform, as in Alg. 1 (FedAvg here weighs by samples); with
``federation.momentum`` > 0 the correction enters SGD's momentum buffer with the gradient (it is a term of the
loss), and option II still divides by K eta_l, the paper's formula (with momentum beta the step is ~eta_l/(1 - beta)
long, so c_i+ then over-estimates the mean gradient by about 1/(1 - beta)); weight decay is part of g_i; buffers
(BatchNorm's statistics) have no control variate and move as the weights do. Adam is refused: line 10 is an SGD step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from fedray.methods.api import (ClientContext, ClientResult, ClientState, ConfigError, LocalTraining, ServerContext,
                                Trained, Weights, clone_weights, model_field, values_field, weights_only)
from fedray.methods.fedavg import FedAvg, ModelPayload, ModelState, ModelUpload, Modules


class ScaffoldParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    server_lr: float = Field(default=1.0, gt=0, description="eta_g, the server's step along the mean update (Alg. 1 "
                             "line 16; 1: the mean of the clients' models)")


@dataclass
class ScaffoldState(ModelState):
    control: Weights | None = None  # c, one tensor per parameter


@dataclass
class ScaffoldPayload(ModelPayload):
    control: Weights = model_field(against=None)  # c


@dataclass
class ScaffoldUpload(ModelUpload):
    control_delta: Weights = values_field()  # Delta c_i = c_i+ - c_i: a change already, sent as it is


@dataclass
class ScaffoldClientState(ClientState):
    control: Weights  # c_i


class Scaffold(FedAvg):
    name = "scaffold"
    synchronous_because = "its server control variate averages one round's corrections"
    Params = ScaffoldParams
    mean_only_because = ("its server step also averages the clients' control variates, which a rule over models would "
                         "leave inconsistent with the model it keeps")

    @classmethod
    def check_config(cls, cfg, params) -> None:
        if cfg.federation.optimizer != "sgd":
            raise ConfigError("federation.optimizer", "SCAFFOLD corrects an SGD step (Alg. 1 line 10): use "
                              "federation.optimizer=sgd")

    def init_server_state(self, modules: Modules) -> ScaffoldState:
        zeros = {k: torch.zeros_like(p, device="cpu") for k, p in modules.model.named_parameters()}
        return ScaffoldState(weights=clone_weights(modules.model), control=zeros)

    def broadcast(self, state: ScaffoldState, round_: int) -> ScaffoldPayload:
        return ScaffoldPayload(weights=state.weights, control=state.control)

    @staticmethod
    def corrected_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, correction: Weights):
        """CE + <c - c_i, y>: the gradient of the second term is Alg. 1 line 10's correction c - c_i."""
        ce = F.cross_entropy(model(x), y)
        linear = sum((p * correction[k]).sum() for k, p in model.named_parameters())
        return ce + linear, {"train/ce": ce}

    def client_update(self, ctx: ClientContext[Modules], payload: ScaffoldPayload,
                      state: ScaffoldClientState | None) -> LocalTraining:
        c, x = payload.control, payload.weights
        c_i = state.control if state is not None else {k: torch.zeros_like(v) for k, v in c.items()}
        scale = 1.0 / (ctx.num_local_steps() * ctx.fed.lr)  # 1 / (K eta_l), option II

        @weights_only
        def finish(m: torch.nn.Module, trained: Trained) -> ClientResult:
            y = clone_weights(m)
            new = {k: c_i[k] - c[k] + (x[k] - y[k]) * scale for k in c}  # option II (line 12)
            delta = {k: new[k] - c_i[k] for k in c}
            upload = ScaffoldUpload(weights=y, num_samples=ctx.num_samples, control_delta=delta)
            return ClientResult(upload, ScaffoldClientState(control=new), trained.means())

        correction = {k: (c[k] - c_i[k]).to(ctx.device) for k in c}
        return LocalTraining(model=ctx.modules.model, start=x, loss=self.corrected_loss, finish=finish,
                             paddable=True, client_inputs=correction)  # the linear term does not read the batch

    def server_update(self, state: ScaffoldState, uploads: list[ScaffoldUpload],
                      ctx: ServerContext) -> tuple[ScaffoldState, dict[str, float]]:
        mean = ctx.aggregation.mean([u.weights for u in uploads], [1.0] * len(uploads))
        eta = self.params.server_lr
        weights = {k: state.weights[k] + eta * (v - state.weights[k]) if v.is_floating_point() else v
                   for k, v in mean.items()}  # line 16
        delta = ctx.aggregation.mean([u.control_delta for u in uploads], [1.0] * len(uploads))
        share = len(uploads) / self.spec.num_clients  # |S| / N, line 17
        control = {k: state.control[k] + share * delta[k] for k in state.control}
        norm = float(torch.sqrt(sum((v.double() ** 2).sum() for v in control.values())))
        return ScaffoldState(weights=weights, control=control), {"server/control_norm": norm}
