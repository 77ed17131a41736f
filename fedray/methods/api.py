"""The method contract: what a federated method implements, what it may override, and nothing else.

A method is plain PyTorch and never knows where it runs. Each round the runtime calls, in this order::

    payload = broadcast(state, round)                         # server -> every sampled client (comm/bytes_down)
    update  = client_update(ctx, payload, client_state)       # on a client: a ClientResult, or a training plan
    state, metrics = server_update(state, uploads, server_ctx)  # uploads in client-id order (comm/bytes_up)

**A method must implement** (abstract below): ``name`` (its ``algorithm.name``), ``build_modules`` (its
nn.Modules, built once per process), ``init_server_state``, ``broadcast``, ``client_update`` and
``server_update``. The types that cross the client/server boundary are its own dataclasses subclassing
:class:`Payload` (down), :class:`Upload` (up), :class:`ClientState` (kept by the client, never shown to the server)
and :class:`ServerState`: the privacy boundary is explicit, and checkpoints save them without pickle.

**One import**: a method file imports fedray only from this module and from the method it subclasses
(``tests/methods/test_one_import.py``). Everything the contract is lives here (``CONTRACT``: the base classes, the
boundary types and the declarations of their fields for the channel, the contexts, the training plans, weight
arithmetic, ``ConfigError``), and what the methods share beyond it is re-exported (``SHARED``: the learning helpers,
the models' parts and generators, the data's normalisation); nothing of where a method runs.

**The one client entry point**, ``client_update``, returns either a finished :class:`ClientResult` or a training
plan (:class:`~fedray.learning.training.LocalTraining`: start weights, a loss, a finish that builds the result;
:class:`~fedray.learning.training.StepwiseTraining` for several modules and updates per step). A plan lets the
runtime train the round's clients one at a time or batched (``runtime.vectorize``) with the same numbers.

**What a method declares** is one section of :class:`Algorithm`, read before any work by the registry
(``resolve_experiment``, the one place where the modes a method supports are checked) or the runtime: the class
flags ``name``, ``Params``, ``shared_architecture``, ``personalised``, ``clients_hold_server_images``,
``asynchronous`` with ``synchronous_because``, ``keeps_cache`` and ``robust_means`` (the last three only for the class
whose own body declares them), and the declaration hooks ``check_config``, ``uploads_label_counts``, ``sends_label_counts``, ``probe_size``,
``wants_pooled_images``, ``wants_reader``.

**A method may override** (defaults below): ``init_client_state``, ``global_weights`` and ``extra_eval_models``
(what ``eval/*`` scores), ``personal_model`` (personalised methods), ``client_samples`` and ``server_samples`` (the
work the simulated system times, ``system.*``), ``rebase`` (FedBuff's asynchronous server steps), and the
simulation-only diagnostics ``server_diagnostics`` / ``probe_diagnostics`` (``diag/*``, never fed back). Every mean
over the clients' uploads in ``server_update`` goes through ``ctx.aggregation.mean``
(:mod:`fedray.learning.aggregation`); calls over models trained from the broadcast model pass it as ``reference``.

**Families share a base with explicit hooks**: local-SGD methods subclass :class:`fedray.methods.fedavg.FedAvg`
(hooks ``make_anchor``, ``local_loss`` with ``local_loss_paddable``, ``make_upload``); methods whose clients each own
a model subclass :class:`PersonalisedAlgorithm` (``own_training``); server-side distillation over proxy data builds
on :mod:`fedray.learning.proxy_distill` (FedDF, FedD3A).

Per-client models: a method whose clients each own a model (possibly of a different architecture,
``model.client_models``) sets ``shared_architecture = False``; the client's weights are its client state, and
``ctx.own_model()`` is a module of the client's architecture to load them into. ``personalised = True`` makes
``eval/*`` score each client's own model (:meth:`Algorithm.personal_model`) instead of a global one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from fedray.config import ExperimentConfig
from fedray.errors import ConfigError
from fedray.learning.boundary import (ClientContext, ClientResult, ClientState, DataSpec, DiagnosticProbe, ModelBank,
                                      Payload, PersonalModel, PooledImages, ServerContext, ServerSideData, ServerState,
                                      Upload, batch_plan_rows, counts_field, local_step_count, model_field,
                                      values_field)
from fedray.learning.training import (CLIENT_INPUTS, EXAMPLES, IGNORE_LABEL, ClientUpdate, LocalTraining, OptimSpec,
                                       StepwiseTraining, Trained, Update, is_weights_only, make_optimizer, module_dict,
                                       row_mean, run_update, split_loss, weights_only)
from fedray.learning.aggregation import WeightedMean
from fedray.learning.robust import ALL_RULES, VALUE_RULES
from fedray.learning.weights import Weights, clone_weights, weighted_average
from fedray.models import build_model
from fedray.models.init import apply_init
from fedray.seeding import derive_rng, derive_seed
from fedray.validation import config_error

# What the methods share beyond the contract, re-exported so that a method file imports fedray from this module alone
from fedray.data.datasets import input_spec
from fedray.data.federated import to_device, to_float
from fedray.learning import optim
from fedray.learning.cached import CacheParams, ModelCache, init_cache, update_cache
from fedray.learning.data_free import check_generator_batch, diversity_loss, label_counts, label_shares
from fedray.learning.distill import KDSteps, kd_kl, kl_rows, normalised_entropy, soft_targets
from fedray.learning.ensemble import stacked_outputs
from fedray.learning.proxy_distill import DistillSettings, distil, run_in_batches, teacher_logits
from fedray.learning.store import client_states
from fedray.learning.subspace import projection_cosine, projector, subspace_weights
from fedray.models import FedModel
from fedray.models.base import batch_rows, frozen_bn_stats
from fedray.models.conditional import FeatureGenerator, ImageGenerator
from fedray.models.dafl import DAFLGenerator
from fedray.models.dcgan import ConditionalGenerator, DCGANGenerator, separate_discriminator


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


Params = TypeVar("Params", bound=BaseModel)
Modules = TypeVar("Modules")


class Algorithm(ABC, Generic[Params, Modules]):
    """Base class of every method (module docstring: what to implement, what to override). ``Params``: the type of
    ``self.params``; ``Modules``: what ``build_modules`` returns and ``ctx.modules`` holds."""

    # --- declarations: what a method says about itself, read before any work ----------------------------------
    # Read by the registry (resolve_experiment) or the runtime, never inferred from what a class overrides.
    # ``asynchronous``, ``keeps_cache`` and ``robust_means`` hold only for the class whose own body declares them: a
    # subclass's server step changes what its parent's rebase, cache or hook calls would mean, so it says again
    # (Algorithm.__init_subclass__).

    #: ``algorithm.name``: the registry's key.
    name: ClassVar[str]
    #: ``algorithm.*``: a pydantic model, parsed and checked once by ``resolve_experiment`` (:meth:`parse_params`).
    Params: ClassVar[type[BaseModel]] = NoParams
    #: True for methods that average parameters: every client must train the same architecture, and
    #: ``model.client_models`` naming several is refused before any work (``resolve_experiment``).
    shared_architecture: ClassVar[bool] = True
    #: True for methods without a global model: the runtime's ``eval/*`` scores each client's own model
    #: (:meth:`personal_model`) where the clients' states are.
    personalised: ClassVar[bool] = False
    #: True for methods whose clients hold the images (never the labels) of the server's data, e.g. FedCD's
    #: shared validation set: the runtime hands them over as ``ctx.server_x``, once to every registered client,
    #: counted in ``comm/bytes_setup``.
    clients_hold_server_images: ClassVar[bool] = False
    #: True (declared in the class's own body) for methods whose server step can take uploads trained from older
    #: models, one by one as they arrive (``federation.mode=async``, FedBuff): their :meth:`rebase` turns such an
    #: upload into one the server step takes beside fresh ones. ``resolve_experiment`` refuses async for the
    #: others, giving ``synchronous_because`` as the reason.
    asynchronous: ClassVar[bool] = False
    synchronous_because: ClassVar[str] = "it declares no rebase of its uploads onto a newer model"
    #: True (declared in the class's own body) for methods that keep FedKF's cached-model aggregation (T1,
    #: :mod:`fedray.learning.cached`): their ``Params`` must take ``algorithm.report_model`` and ``cache_init``
    #: (:class:`~fedray.learning.cached.CacheParams`), checked when the class is defined; ``resolve_experiment``
    #: refuses those keys to a method that keeps no cache and the cache's OCA model with ``federation.mode=async``.
    keeps_cache: ClassVar[bool] = False
    #: The calls of ``ctx.aggregation.mean`` in the server step (declared in the class's own body), by what they
    #: average, when a robust rule (``aggregation.rule`` other than mean, :mod:`fedray.learning.robust`) may replace
    #: every one of them: models trained from the broadcast model, passed as ``reference``, or values of one kind
    #: across the clients (logits; :meth:`robust_rules` then says which rules). Empty (the default): some call
    #: averages what a robust rule must not touch (label histograms, a ratio of sums, a control variate), and
    #: ``resolve_experiment`` refuses any rule but mean.
    robust_means: ClassVar[tuple[str, ...]] = ()
    #: Why a method declaring no ``robust_means`` takes only the mean: the reason of the one-line refusal.
    mean_only_because: ClassVar[str] = ("its class declares no robust_means: no mean of its server step is declared "
                                        "one a robust rule may replace")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for flag, unset in (("asynchronous", False), ("keeps_cache", False), ("robust_means", ())):
            if flag not in cls.__dict__:
                setattr(cls, flag, unset)
        if cls.asynchronous and cls.rebase is Algorithm.rebase:
            raise TypeError(f"{cls.__qualname__} declares asynchronous = True but has no rebase: implement "
                            "rebase(upload, sent, current, weight)")
        if cls.keeps_cache and not issubclass(cls.Params, CacheParams):
            raise TypeError(f"{cls.__qualname__} declares keeps_cache = True, so its Params must take "
                            "algorithm.report_model and cache_init: subclass fedray.methods.api.CacheParams")

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, params: BaseModel) -> None:
        """What the method needs of the rest of the config (e.g. labelled server data), given its parsed
        ``params``; raise :class:`ConfigError` naming the key. Called by ``resolve_experiment`` before any work,
        after the rules of the declarations above."""

    @classmethod
    def robust_rules(cls, params: BaseModel) -> tuple[tuple[str, ...], str]:
        """The ``aggregation.rule`` values a run of the method with ``params`` takes, and why no other (the reason
        ``resolve_experiment``'s one-line refusal gives). By default every rule when the class declares
        ``robust_means``, else the mean alone; a method whose hook calls average values (logits) narrows it to
        :data:`~fedray.learning.robust.VALUE_RULES`, the rules that read no reference model."""
        if cls.robust_means:
            return ALL_RULES, ""
        return ("mean",), cls.mean_only_because

    @classmethod
    def caches(cls, params: BaseModel) -> bool:
        """Whether a run with ``params`` keeps FedKF's T1 cache (:mod:`fedray.learning.cached`): by default a class
        that declares ``keeps_cache``, when the OCA model is asked for (``report_model=oca``; plain FedAvg stays
        exactly FedAvg)."""
        return cls.keeps_cache and getattr(params, "report_model", None) == "oca"

    @classmethod
    def central_noise_refused(cls, params: BaseModel) -> str | None:
        """Why a run with ``params`` cannot take ``privacy.mechanism=central`` (the hook's mean replaced by the
        noised sum of the clipped uploads over a fixed denominator), or None when it can. By default it can when every
        hook call is a mean of models trained from the broadcast model (the rules of updates apply) and no cache of
        uploads outlives the step (the OCA model would average them unnoised)."""
        if cls.caches(params):
            return "its cache's OCA model would average the clipped uploads unnoised"
        if "norm_bound" not in cls.robust_rules(params)[0]:
            return ("its server step reads the uploads beyond one mean of updates (a teacher, per-sample weights, a "
                    "ratio of sums, control variates), which the noise would not cover")
        return None

    @classmethod
    def uploads_label_counts(cls, params: BaseModel) -> bool:
        """True when the clients' uploads carry label histograms (integer tensors of fields declared counts): under
        local DP they are sent noised, a second release the accountant covers (docs/privacy.md)."""
        return False

    @classmethod
    def sends_label_counts(cls, params: BaseModel) -> bool:
        """True when every registered client sends its training label counts once before round 1, counted in
        ``comm/bytes_setup``: the runtime gathers them as :attr:`client_label_counts` on the server's instance
        (e.g. DaFKD's oracle of Theorem 1's weights)."""
        return False

    def probe_size(self) -> int:
        """Images per client and (x10) from the test set that the runtime draws for :meth:`probe_diagnostics`; 0
        (the default): none, and the method is never probed."""
        return 0

    def wants_pooled_images(self) -> bool:
        """True when a simulation-only diagnostic of the client update reads every client's images: the runtime
        hands them over as ``ctx.pooled`` (:class:`~fedray.learning.boundary.PooledImages`), an upper bound that
        breaks privacy, never a method."""
        return False

    def wants_reader(self) -> bool:
        """True when :meth:`probe_diagnostics` scores generated samples with the fixed reader (:mod:`fedray.reader`,
        trained once per dataset, then cached): the runtime's probe then holds it as ``probe.reader``."""
        return False

    # --- the run's instance ---------------------------------------------------------------------------------
    def __init__(self, cfg: ExperimentConfig, spec: DataSpec, params: BaseModel | None = None):
        """``params``: this run's parsed ``algorithm.*`` (the resolved experiment's); parsed from ``cfg`` when None."""
        self.cfg = cfg
        self.spec = spec
        if params is None:
            params = self.parse_params(cfg.algorithm.params())
        self.params: Params = params  # type: ignore[assignment]
        #: The server's data (``data.server_data``) on the server's instance; always None on clients.
        self.server_data: ServerSideData | None = None
        #: Every registered client's training label counts (num_clients, num_classes), int64, on the server's
        #: instance of a method whose :meth:`sends_label_counts` says so (else None).
        self.client_label_counts: torch.Tensor | None = None

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
    def build_modules(self) -> Modules:
        """The nn.Modules this method needs in a worker or the server (a small dataclass of them), built once per
        process; weights are loaded per call. ``ctx.modules`` is what this returned."""

    # --- server side -----------------------------------------------------------------------------
    @abstractmethod
    def init_server_state(self, modules: Modules) -> ServerState:
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
    def client_update(self, ctx: ClientContext[Modules], payload: Payload, state: ClientState | None) -> ClientUpdate:
        """This client's update from the payload and its private state: a finished :class:`ClientResult`, or a
        training plan (:class:`LocalTraining`, :class:`StepwiseTraining`) that the runtime runs for this client
        alone or batched with the round's other clients (``runtime.vectorize``). To run it by itself (tests, a
        subclass that post-processes its parent's result): :func:`fedray.learning.training.run_update`."""

    def rebase(self, upload: Upload, sent: Payload, current: ServerState, weight: float) -> Upload:
        """``federation.mode=async``: ``upload``, trained from the payload ``sent`` some server steps ago, as an
        upload the server update can take beside fresh ones on the ``current`` state, its change weighted by
        ``weight`` (the staleness weight, 1 when fresh or with ``federation.staleness=none``). Methods that declare
        ``asynchronous = True`` implement it (or inherit one they checked is right for their uploads)."""
        raise NotImplementedError(f"{type(self).__name__} does not run async")

    # --- the simulated system (system.*) ------------------------------------------------------------
    def client_samples(self, ctx: ClientContext[Modules]) -> int:
        """The training examples this client's work of the round passes through its models: the compute term of its
        simulated time (``system.*``). Default: the rows of its mini-batches over its local steps. A method whose
        local steps also run generated batches (through a generator, a discriminator) adds those rows."""
        return batch_plan_rows(ctx.num_samples, ctx.fed.batch_size, ctx.num_local_steps())

    def server_samples(self, uploads: int) -> int:
        """The examples the server's own work of a round on ``uploads`` uploads passes through its models
        (distillation, generator training, teachers' labels), timed by ``system.server_sps``; 0 (the default):
        aggregation by averaging takes no time."""
        return 0

    # --- per-client models (personalised = True, or shared_architecture = False) ---------------------------
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
        if arch == self.cfg.model.name:  # model.init: every model of the global architecture starts from it
            apply_init(model, self.cfg.model.init, arch, self.spec.input_shape, self.spec.num_classes)
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

    def own_training(self, ctx: ClientContext, state: PersonalModel, loss, finish,
                     paddable: bool = False) -> LocalTraining:
        """A :class:`~fedray.learning.training.LocalTraining` of the client's own model from its state;
        ``finish(model, metrics, new_state)`` builds the result from the trained model, the figures' means over
        the steps and the client's new state."""
        def own_finish(m: torch.nn.Module, trained: Trained) -> ClientResult:
            return finish(m, trained.means(), self.keep(ctx, state, m))

        model = self.load_own_model(ctx, state)
        return LocalTraining(model=model, start=state.weights, loss=loss, paddable=paddable,
                             finish=weights_only(own_finish) if is_weights_only(finish) else own_finish)

    @staticmethod
    def keep(ctx: ClientContext, state: PersonalModel, model: torch.nn.Module) -> PersonalModel:
        """The client's new state: the weights ``model`` now holds."""
        return PersonalModel(client_id=ctx.client_id, architecture=state.architecture, weights=clone_weights(model))


def require_server_data(name: str, cfg: ExperimentConfig) -> None:
    """``check_config`` of a method that distils on data held by the server (FedDF, FedD3A, DaFKD's proxy data)."""
    if cfg.data.server_data.kind == "none":
        raise ConfigError("data.server_data.kind", f"{name} distils on data held by the server: set "
                          "data.server_data.kind=domain (a multi-domain dataset) or holdout")


# The contract: the base classes and what crosses the boundary (with the declarations of its fields), the contexts,
# the training plans and their parts, weights and their arithmetic, the config and its error.
CONTRACT = ["Algorithm", "CLIENT_INPUTS", "ClientContext", "ClientResult", "ClientState", "ClientUpdate", "ConfigError",
            "DataSpec", "DiagnosticProbe", "EXAMPLES", "ExperimentConfig", "IGNORE_LABEL", "LocalTraining", "ModelBank",
            "NoParams", "OptimSpec", "Payload", "PersonalModel", "PersonalisedAlgorithm", "PooledImages",
            "ServerContext", "ServerSideData", "ServerState", "StepwiseTraining", "Trained", "Update", "Upload",
            "Weights", "batch_plan_rows", "clone_weights", "counts_field", "derive_rng", "derive_seed",
            "is_weights_only", "local_step_count", "make_optimizer", "model_field", "module_dict",
            "require_server_data", "row_mean", "run_update", "split_loss", "values_field", "weighted_average",
            "weights_only"]
# What the methods share beyond it: the learning helpers, the models' parts and generators, the data's normalisation.
SHARED = ["CacheParams", "ConditionalGenerator", "DAFLGenerator", "DCGANGenerator", "DistillSettings",
          "FeatureGenerator", "FedModel", "ImageGenerator", "KDSteps", "ModelCache", "batch_rows",
          "build_model", "check_generator_batch", "client_states", "distil", "diversity_loss", "frozen_bn_stats",
          "init_cache", "input_spec", "kd_kl", "kl_rows", "label_counts", "label_shares",
          "normalised_entropy", "optim", "projection_cosine", "projector", "run_in_batches",
          "separate_discriminator", "soft_targets", "stacked_outputs", "subspace_weights", "teacher_logits",
          "to_device", "to_float", "update_cache", "VALUE_RULES", "WeightedMean"]
__all__ = CONTRACT + SHARED
