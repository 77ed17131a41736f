"""The algorithm interface: broadcast -> client_update -> server_update.

An algorithm is plain PyTorch and never knows where it runs. The runtime builds its modules once per
process (``build_modules``), hands each client a :class:`ClientContext` with that client's data and
seeded generator, ships the :class:`Payload` down and the :class:`Upload` up, and keeps each client's
private :class:`ClientState` on the client side (it is never passed to ``server_update``). These four
types are the privacy boundary of a method: every method subclasses them with its own dataclasses, so
what crosses between client and server is explicit and typed, and the checkpoint code can save it.

Per-client models: a method whose clients each own a model (possibly of a different architecture,
``model.client_models``) sets ``shared_architecture = False``; the client's weights are its client
state, and ``ctx.own_model()`` is a module of the client's architecture to load them into.
``personalised = True`` makes ``eval/*`` score each client's own model (:meth:`Algorithm.personal_model`)
instead of a global one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from fedray.config import ExperimentConfig
from fedray.errors import ConfigError
from fedray.learning.boundary import (ClientContext, ClientResult, ClientState, DataSpec, DiagnosticProbe, ModelBank,
                                      Payload, PersonalModel, ServerContext, ServerSideData, ServerState, Upload,
                                      local_step_count)
from fedray.learning.training import LocalTraining, is_weights_only, weights_only
from fedray.learning.weights import Weights, clone_weights
from fedray.models import build_model
from fedray.seeding import derive_seed
from fedray.validation import config_error


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


def defining_class(cls: type, name: str) -> type:
    """The class in ``cls``'s MRO whose own body defines ``name`` (what a method's override reaches)."""
    return next(c for c in cls.__mro__ if name in vars(c))


Params = TypeVar("Params", bound=BaseModel)


class Algorithm(ABC, Generic[Params]):
    """Base class of every method. Subclasses set ``name``, ``Params`` and implement the four steps."""

    name: ClassVar[str]
    Params: ClassVar[type[BaseModel]] = NoParams
    #: True for methods that average parameters: every client must train the same architecture, and
    #: ``model.client_models`` naming several is refused before any work.
    shared_architecture: ClassVar[bool] = True
    #: True for methods without a global model: ``eval/*`` scores each client's own model.
    personalised: ClassVar[bool] = False
    #: True for methods whose clients hold the images (never the labels) of the server's data, e.g. FedCD's
    #: shared validation set: they arrive as ``ctx.server_x``, and handing them to every registered client
    #: once is counted in ``comm/bytes_setup``.
    clients_hold_server_images: ClassVar[bool] = False

    def __init__(self, cfg: ExperimentConfig, spec: DataSpec):
        self.cfg = cfg
        self.spec = spec
        self.params: Params = self.parse_params(cfg.algorithm.params())  # type: ignore[assignment]
        #: The server's data (``data.server_data``) on the server's instance; always None on clients.
        self.server_data: ServerSideData | None = None

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        """What the method needs of the rest of the config (e.g. labelled server data); raise
        :class:`ConfigError` naming the key. Called by ``validate_experiment`` before any work."""

    @classmethod
    def parse_params(cls, values: dict[str, Any]) -> BaseModel:
        try:
            return cls.Params.model_validate(values)
        except ValidationError as e:
            err = e.errors()[0]
            if err["type"] == "extra_forbidden":
                allowed = ", ".join(f"algorithm.{k}" for k in cls.Params.model_fields) or "none"
                raise ConfigError("algorithm." + ".".join(map(str, err["loc"])),
                                  f"not a parameter of '{cls.name}'; allowed: {allowed}") from None
            raise config_error(e, cls.Params, "algorithm.") from None

    # --- built once per process -----------------------------------------------------------------
    @abstractmethod
    def build_modules(self) -> Any:
        """The nn.Modules this method needs in a worker or the server; weights are loaded per call."""

    # --- server side -----------------------------------------------------------------------------
    @abstractmethod
    def init_server_state(self, modules: Any) -> ServerState:
        """Round-0 server state; ``modules`` were built under the run's ``init`` seed."""

    @abstractmethod
    def broadcast(self, state: ServerState, round_: int) -> Payload:
        """The payload sent to every client sampled in ``round_`` (put in the object store once)."""

    @abstractmethod
    def server_update(self, state: ServerState, uploads: list[Upload],
                      ctx: ServerContext) -> tuple[ServerState, dict[str, float]]:
        """New server state from this round's uploads (in client-id order) and server metrics."""

    def server_diagnostics(self, ctx: ServerContext, labels: torch.Tensor) -> dict[str, float]:
        """Simulation-only figures of the round just aggregated, from the labels of the server's data that a
        real deployment would not have (``diag/*`` keys). Called by the runtime after ``server_update``
        when the server's data has labels, labelled for the method or not; never feeds back into it."""
        return {}

    def probe_size(self) -> int:
        """Images per client and (x10) from the test set the method's :meth:`probe_diagnostics` wants; 0 (the
        default): none, and the method is never probed."""
        return 0

    def probe_diagnostics(self, ctx: ServerContext, probe: DiagnosticProbe, client_ids: list[int]) -> dict[str, float]:
        """Simulation-only figures (``diag/*``) of the round just aggregated, from real data the method never
        trains on (:class:`DiagnosticProbe`); ``client_ids`` are this round's aggregated clients, in the order
        of the uploads ``server_update`` was given. Never feeds back into the method."""
        return {}

    def global_weights(self, state: ServerState) -> Weights | None:
        """The weights of the global model that ``eval/*`` evaluates; None for personalised methods."""
        return None

    def extra_eval_models(self, state: ServerState) -> dict[str, Weights]:
        """Further models to evaluate every evaluation round, by suffix: ``{"oca": w}`` adds
        ``eval/accuracy_oca``, ``eval/amp_oca``, ... beside the ``global_weights`` figures."""
        return {}

    # --- client side -----------------------------------------------------------------------------
    def init_client_state(self, client_id: int) -> ClientState | None:
        """A client's private state before its first round (None for stateless methods)."""
        return None

    @abstractmethod
    def client_update(self, ctx: ClientContext, payload: Payload, state: ClientState | None) -> ClientResult:
        """Local training from the payload and this client's private state."""

    def local_training(self, ctx: ClientContext, payload: Payload, state: ClientState | None) -> Any:
        """This client's update as a :class:`~fedray.learning.training.LocalTraining` (start weights, loss,
        finish), which the runtime may batch with the round's other clients (``runtime.vectorize``); None
        (the default): the update is not plain local training and ``client_update`` runs it, one client at
        a time. Methods that return one implement ``client_update`` as ``run_local_training`` of it."""
        return None

    def personal_model(self, state: ClientState) -> PersonalModel:
        """Personalised methods: the client's own model inside its state (what ``eval/*`` scores)."""
        raise NotImplementedError(f"{type(self).__name__} has no per-client models")

    def init_personal_model(self, client_id: int) -> PersonalModel:
        """Client ``client_id``'s own model before its first round: its architecture, initialised from
        (run seed, client) alone, so every process and a resumed run draw the same weights."""
        arch = self.cfg.model.client_architecture(client_id)
        with torch.random.fork_rng(devices=[]):  # leaves the global RNG as it was
            torch.manual_seed(derive_seed(self.cfg.seed, "client-model", client_id) % (1 << 63))
            model = build_model(arch, self.spec.input_shape, self.spec.num_classes)
        return PersonalModel(client_id=client_id, architecture=arch, weights=clone_weights(model))


class PersonalisedAlgorithm(Algorithm):
    """Base of the methods whose clients each own a model (:class:`PersonalModel` as client state, any
    architecture, never averaged) and which are evaluated on those models: the isolated baseline, FedCD,
    FedDistill. Subclasses implement broadcast, client_update and server_update."""

    shared_architecture = False
    personalised = True

    def build_modules(self) -> None:
        return None  # a client's model comes from the worker's model bank (ctx.own_model())

    def init_client_state(self, client_id: int) -> PersonalModel:
        return self.init_personal_model(client_id)

    def personal_model(self, state: PersonalModel) -> PersonalModel:
        return state

    def load_own_model(self, ctx: ClientContext, state: PersonalModel) -> torch.nn.Module:
        """This client's module with its own weights loaded (refusing another client's state)."""
        if state.client_id != ctx.client_id:
            raise RuntimeError(f"client {ctx.client_id} received the model of client {state.client_id}")
        model = ctx.own_model()
        model.load_state_dict(state.weights)
        return model

    def own_training(self, ctx: ClientContext, state: PersonalModel, loss, finish, paddable: bool = False) -> Any:
        """A :class:`~fedray.learning.training.LocalTraining` of the client's own model from its state;
        ``finish(model, metrics, new_state)`` builds the result."""
        def own_finish(m: torch.nn.Module, metrics: dict[str, float]) -> ClientResult:
            return finish(m, metrics, self.keep(ctx, state, m))

        model = self.load_own_model(ctx, state)
        return LocalTraining(model=model, start=state.weights, loss=loss, paddable=paddable,
                             finish=weights_only(own_finish) if is_weights_only(finish) else own_finish)

    @staticmethod
    def keep(ctx: ClientContext, state: PersonalModel, model: torch.nn.Module) -> PersonalModel:
        """The client's new state: the weights ``model`` now holds."""
        return PersonalModel(client_id=ctx.client_id, architecture=state.architecture, weights=clone_weights(model))
