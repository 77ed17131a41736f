"""Typed, validated experiment config (read from presets, YAML files and dotted overrides by
:mod:`fedray.load`).

Every key below is a public contract (CLI overrides, presets, Tune search spaces). Unknown keys and bad
values raise :class:`~fedray.errors.ConfigError` naming the dotted key and what is allowed, before any work
starts. Algorithm-specific keys (``algorithm.mu``) are validated by the algorithm's own ``Params`` model.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fedray.errors import ConfigError
from fedray.overrides import flatten
from fedray.paths import absolute_path
from fedray.adversary.config import AdversaryConfig
from fedray.channel.config import ChannelConfig
from fedray.learning.aggregation_config import AggregationConfig
from fedray.privacy.config import PrivacyConfig
from fedray.system import SystemConfig, check_traces
from fedray.system.protocol import schedule_class

DatasetName = Literal["fashion_mnist", "mnist", "emnist", "svhn", "cifar10", "cifar100", "synthetic",
                      "fmnist_domains", "digit5", "office_caltech10", "domainnet"]

#: The domains of each multi-domain dataset, in their canonical order (``data.domains`` picks a subset).
#: ``fmnist_domains`` is built from Fashion-MNIST by fixed transforms (``fedray.data.domains``); the others
#: are read from torchvision ``ImageFolder`` trees, one folder per domain.
DOMAINS: dict[str, tuple[str, ...]] = {
    "fmnist_domains": ("original", "rotated", "inverted", "noisy", "blurred"),
    "digit5": ("mnist", "mnistm", "svhn", "syn", "usps"),
    "office_caltech10": ("amazon", "caltech", "dslr", "webcam"),
    "domainnet": ("clipart", "infograph", "painting", "quickdraw", "real", "sketch"),
}
DOMAIN_PARTITIONS = ("domain", "domain_dirichlet")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerDataConfig(_Strict):
    """Data held by the server (FedCD's shared validation set, FedD3A's / FedDF's unlabelled proxy data).

    It never reaches a client unless a method sends it, and what a method sends is counted in ``comm/*``.
    """

    kind: Literal["none", "holdout", "domain"] = Field(
        default="none", description="holdout: per_class labelled samples per class taken out of the training "
        "set before partitioning; domain: one domain of a multi-domain dataset")
    per_class: int = Field(default=50, ge=1, description="holdout: samples per class (FedCD: 50 on CIFAR-100)")
    keep_in_training: bool = Field(default=False, description="holdout: copy the samples rather than take them out, "
                                   "so the clients' data is unchanged (DaFKD's FedDF: unlabelled training samples "
                                   "as the proxy data)")
    domain: str | None = Field(default=None, description="domain: which one (default: the last of data.domains)")
    labelled: bool | None = Field(default=None, description="whether methods see the labels; default: true for "
                                  "holdout, false for domain (labels are then used by diag/* metrics only)")

    def is_labelled(self) -> bool:
        return self.labelled if self.labelled is not None else self.kind == "holdout"


class DataConfig(_Strict):
    dataset: DatasetName = "fashion_mnist"
    data_dir: str | None = Field(
        default=None,
        description="Root with torchvision's layout; must exist if given. Default: $FEDRAY_DATA_DIR or "
        "~/.cache/fedray/data (Debian's dataset-fashion-mnist is found and used when installed).",
    )
    download: bool = True
    cache: bool = Field(default=True, description="keep decoded torchvision datasets as .npy files, memory-mapped "
                        "by later runs (fedray.data.cache)")
    cache_dir: str | None = Field(default=None, description="where the decoded datasets go; default "
                                  "$FEDRAY_CACHE_DIR or ~/.cache/fedray/decoded (an unwritable folder: a warning, "
                                  "and the run goes on without the cache)")
    partition: Literal["dirichlet", "iid", "shards", "domain", "domain_dirichlet", "central", "on_demand"] = Field(
        default="dirichlet", description="domain: one client per domain (cross-silo); domain_dirichlet: each "
        "domain split over clients_per_domain clients by Dirichlet(alpha) over labels (cross-device); central: one "
        "client holding all the training data (sets num_clients and clients_per_round to 1): the centralised "
        "baseline; on_demand: clients made when sampled or evaluated, each a seeded Dirichlet(alpha) class mixture "
        "and size drawn over the training split with replacement (docs/scale.md)")
    alpha: float = Field(default=0.1, gt=0, description="Dirichlet concentration; smaller = more non-IID")
    num_clients: int = Field(default=20, ge=1)
    min_samples: int = Field(default=10, ge=2, description="Dirichlet: redraw until every client has this many")
    shards_per_client: int = Field(default=2, ge=1)
    test_fraction: float = Field(default=0.2, gt=0, lt=1, description="each client's local test split")
    val_per_class: int = Field(
        default=0, ge=0, description="a validation set of this many samples per class taken out of the training "
        "set before partitioning (never trained on, never seen by a method), scored as val/accuracy: what a sweep "
        "selects on instead of the test set. 0: none")
    domains: list[str] | None = Field(default=None, description="multi-domain datasets: the domains to use "
                                      "(default: all, in the dataset's order)")
    clients_per_domain: int = Field(default=1, ge=1, description="domain_dirichlet: clients per domain")
    image_size: int | None = Field(default=None, ge=8, description="ImageFolder datasets (digit5, "
                                   "office_caltech10, domainnet): images are resized to this square size "
                                   "(default 32)")
    server_data: ServerDataConfig = Field(default_factory=ServerDataConfig)
    emnist_split: Literal["balanced", "byclass", "bymerge", "digits", "letters", "mnist"] = "balanced"
    # synthetic: a learnable image-shaped dataset generated from the seed (for tests and scale runs)
    client_size: int | None = Field(default=None, ge=2, description="on_demand: the mean examples of a client "
                                    "(train and test; log-normal around it); default: the training split over "
                                    "num_clients, at least 2")
    client_size_sigma: float = Field(default=0.5, ge=0, description="on_demand: the log-std of the clients' sizes")
    pseudo_base_clients: int | None = Field(
        default=None, ge=1, description="pseudo-clients: the num_clients clients are made on demand from this many "
        "base clients of the partition, client k being base client k mod this under its own seeded affine warp "
        "(TFF's EMNIST pseudo-clients; docs/scale.md); null: off")
    eval_clients: int = Field(default=100, ge=1, description="clients made on demand (on_demand, "
                              "pseudo_base_clients): the per-client figures (AMP, FM, WLP) are over a seeded sample "
                              "of this many clients, fixed for the run")
    synthetic_train_samples: int | None = Field(
        default=None, ge=10, description="default: max(2000, 60 * num_clients); with clients made on demand "
        "20,000 (on_demand) or max(2000, 60 * pseudo_base_clients)"
    )
    synthetic_test_samples: int = Field(default=1000, ge=10)
    synthetic_num_classes: int = Field(default=10, ge=2)
    synthetic_image_size: int = Field(default=16, ge=8)
    synthetic_channels: int = Field(default=1, ge=1)
    synthetic_noise: float = Field(default=0.3, ge=0, description="synthetic: per-pixel Gaussian noise std on a "
                                   "[0, 1] scale (how hard the task is)")
    synthetic_shift: int = Field(default=2, ge=0, description="synthetic: largest shift of a class template, in "
                                 "pixels each way (0: the templates stay put)")
    synthetic_contrast: float = Field(default=0.22, gt=0, le=0.5, description="synthetic: the templates' std "
                                      "around 0.5 (how far apart the classes are)")

    @field_validator("data_dir", "cache_dir")
    @classmethod
    def _absolute(cls, folder: str | None) -> str | None:
        """Recorded absolute: a run resumed from another folder, a sweep's trials (Tune runs each in a folder of
        its own) and ``config.yaml`` all mean the folder the user named, from wherever it was named."""
        return None if folder is None else absolute_path(folder)

    @property
    def on_demand(self) -> bool:
        """Whether clients are made on demand (the scalable modes: ``partition=on_demand`` or pseudo-clients)."""
        return self.partition == "on_demand" or self.pseudo_base_clients is not None

    def all_domains(self) -> list[str]:
        """The run's domains (``data.domains`` or all of the dataset's); empty for single-domain datasets."""
        return list(self.domains or DOMAINS.get(self.dataset, ()))

    def server_domain(self) -> str | None:
        """The domain held by the server (``server_data.kind=domain``), else None."""
        if self.server_data.kind != "domain":
            return None
        return self.server_data.domain or self.all_domains()[-1]

    def client_domains(self) -> list[str]:
        """The domains clients' data comes from: every domain but the server's."""
        return [x for x in self.all_domains() if x != self.server_domain()]


class ModelConfig(_Strict):
    """Model names are checked against the zoo by :func:`fedray.methods.validate_experiment`."""

    name: str = Field(default="lenet5", description="the global model (and every client's, by default)")
    client_models: list[str] | None = Field(
        default=None, description="per-client architectures, assigned round-robin: client k gets entry "
        "k mod len; absent: every client uses model.name")
    init: str | None = Field(
        default=None, description="start the model (and clients' models of the same architecture) from these "
        "weights: a state dict file (e.g. a run's model.pt) or torchvision:<weights name>; checked for shape "
        "before the run")

    def client_architecture(self, client_id: int) -> str:
        """The architecture client ``client_id`` trains."""
        return self.client_models[client_id % len(self.client_models)] if self.client_models else self.name

    def architectures(self) -> list[str]:
        """The distinct architectures of the run's clients, in first-use order."""
        return list(dict.fromkeys(self.client_models or [self.name]))


class FederationConfig(_Strict):
    rounds: int = Field(default=30, ge=1)
    clients_per_round: int = Field(default=8, ge=1)
    local_steps: int = Field(default=20, ge=1, description="optimizer steps per client per round")
    local_epochs: int | None = Field(
        default=None, ge=1, description="if set, train this many passes over the client's data instead; an "
        "override of local_steps alone unsets it"
    )
    batch_size: int = Field(default=32, ge=1)
    lr: float = Field(default=0.01, gt=0)
    lr_schedule: Literal["constant", "cosine"] = Field(
        default="constant", description="cosine: lr decays over the rounds from lr to lr_min (FedD3A Sec. 4)")
    lr_min: float = Field(default=0.0, ge=0, description="the cosine schedule's last-round lr")
    optimizer: Literal["sgd", "adam"] = "sgd"
    momentum: float = Field(default=0.0, ge=0, lt=1, description="SGD's; Adam has its own (betas 0.9, 0.999)")
    weight_decay: float = Field(default=0.0, ge=0)
    eval_every: int = Field(default=1, ge=1, description="evaluate every N rounds and after the last")
    eval_batch_size: int = Field(default=1024, ge=1)
    diag_every: int = Field(
        default=1, ge=1, description="simulation-only diag/* figures every N rounds and after the last; they are "
        "server time a real deployment would not spend (DaFKD's probe: ~a quarter of a graphed GPU round)")
    mode: str = Field(
        default="sync", description="the schedule (docs/system.md): sync, rounds of fresh uploads; async: buffered "
        "asynchronous aggregation (FedBuff) on the simulated clock, a round is then one server step of buffer_size "
        "uploads; or a schedule registered with fedray.system.register_schedule")
    concurrency: int | None = Field(default=None, ge=1, description="async: clients training at once (default "
                                    "clients_per_round)")
    buffer_size: int | None = Field(default=None, ge=1, description="async: uploads per server step (default "
                                    "clients_per_round)")
    staleness: Literal["none", "polynomial"] = Field(
        default="none", description="async: an upload s server steps old is weighted 1 (none) or 1/sqrt(1+s) "
        "(polynomial, FedBuff's)")

    def in_flight(self) -> int:
        return self.concurrency or self.clients_per_round

    def buffer(self) -> int:
        return self.buffer_size or self.clients_per_round

    def diagnoses(self, round_: int) -> bool:
        """Whether ``round_`` (1-based) computes the simulation-only ``diag/*`` figures (``diag_every``)."""
        return round_ % self.diag_every == 0 or round_ == self.rounds

    def lr_at(self, round_: int) -> float:
        """The local learning rate of ``round_`` (1-based) under ``lr_schedule``."""
        if self.lr_schedule == "constant" or self.rounds <= 1:
            return self.lr
        progress = (round_ - 1) / (self.rounds - 1)
        return self.lr_min + (self.lr - self.lr_min) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def at_round(self, round_: int) -> "FederationConfig":
        """``federation.*`` as the clients of ``round_`` see it: the scheduled learning rate."""
        return self if self.lr_schedule == "constant" else self.model_copy(update={"lr": self.lr_at(round_)})


class RuntimeConfig(_Strict):
    backend: Literal["local", "ray"] = "local"
    num_workers: int | None = Field(
        default=None, ge=1, description="client-worker actors; default: what resources allow, capped by "
        "clients_per_round; = data.num_clients gives every client its own actor"
    )
    num_cpus_per_worker: float = Field(default=1.0, gt=0, description="also torch's thread count")
    num_gpus_per_worker: float = Field(default=0.0, ge=0)
    server_num_cpus: float = Field(default=0.0, ge=0, description="the server actor mostly waits on clients")
    server_num_gpus: float = Field(default=0.0, ge=0)
    server_in_driver: Literal["auto"] | bool = Field(
        default="auto", description="on Ray, run the server in the driver's process rather than an actor of its "
        "own; auto: when it reserves no resources (server_num_cpus = server_num_gpus = 0) and the driver is not a "
        "Ray Client. Same figures; one process fewer to start (fedray/runtime/server_host.py)"
    )
    address: str | None = Field(default=None, description="Ray cluster address; default starts a local one")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    vectorize: Literal["auto"] | bool = Field(
        default="auto", description="train a worker's clients of a round as one batched computation (torch.func.vmap "
        "over stacked weights); auto: on CUDA devices, not on CPUs where it measured slower"
    )
    vectorize_max_clients: int = Field(default=64, ge=1, description="at most this many clients batched at once "
                                       "(memory grows with it)")
    vectorize_min_clients: int = Field(
        default=4, ge=1, description="auto only: a worker with fewer clients in a round trains them one by one "
        "(on an H200, 2 clients batched were slower than sequential, 8 faster; benchmarks/README.md)")
    vectorize_pad: bool = Field(
        default=True, description="batched clients: pad a short batch (a pass ending early) with ignored rows into "
        "the step's one call, for cross-entropy losses and models without BatchNorm; else it is a call of its own")
    cuda_graphs: bool = Field(
        default=True, description="on a GPU: replay the usual local step of batched clients (every client, its "
        "updates, SGD or Adam) and the server's SGD distillation steps (DaFKD, FedDF, FedD3A) as CUDA graphs "
        "instead of issuing their kernels one by one: the same kernels on the same tensors (benchmarks/README.md)")
    precision: Literal["float32", "bf16"] = Field(default="float32", description="the clients' local training: "
        "float32, or bf16 mixed precision (not faster than float32 in DaFKD's ResNet-11 rounds on an H200), "
        "changing the figures beyond float32 rounding (convolutions and linear layers on bfloat16 copies, the "
        "rest float32: fedray/vectorized/precision.py)")
    cpu_channels_last: bool = Field(
        default=False, description="on a CPU, train convolutional models without GroupNorm in the channels-last "
        "layout (training steps 1.17-1.38x, rounds 1.1-1.2x faster on the project's CPU machine); float rounding differs from the "
        "default layout's, so figures differ from recorded ones in their last digits and beyond"
    )
    malloc_tuning: bool = Field(
        default=True, description="on glibc (Linux), processes that train keep up to 256 MiB of the memory they free "
        "for their next batches instead of returning it to the OS at once, which made every large batch's "
        "activations page-fault in again (CPU ResNet-8 rounds 1.2x, evaluations 1.5x faster; fedray/runtime/malloc.py)"
    )
    checkpoint_every: int | None = Field(
        default=None, ge=0, description="write a checkpoint every N rounds (0: never); default every round "
        "up to 100 rounds, else every rounds/100"
    )
    client_state_memory: int | None = Field(
        default=None, ge=1, description="in process: at most this many clients' states (and channel states) in "
        "memory, the least recently used of the others on disk (fedray/learning/store.py); null: all in memory. "
        "On Ray, Ray's object store spills them beyond its memory")
    client_state_dir: str | None = Field(default=None, description="client_state_memory: the folder the states "
                                         "beyond it go to; default a temporary folder of the run's")
    max_client_retries: int = Field(default=2, ge=0, description="reruns of a client whose worker died")
    client_timeout_s: float | None = Field(
        default=None, gt=0, description="drop a client not done this long after its turn on its worker began"
    )

    def checkpoint_interval(self, rounds: int) -> int:
        if self.checkpoint_every is not None:
            return self.checkpoint_every
        return 1 if rounds <= 100 else -(-rounds // 100)


class TrackingConfig(_Strict):
    enabled: bool = True
    uri: str | None = Field(default=None, description="MLflow tracking URI; default $MLFLOW_TRACKING_URI, "
                            "else sqlite:///<cwd>/mlflow.db with artifacts in <cwd>/mlartifacts (a resumed run "
                            "keeps the store it started in); a relative sqlite:/// path is from the cwd")
    experiment: str = Field(default="fedray", min_length=1)
    system_metrics_s: float = Field(default=10.0, ge=0, description="seconds between samples of MLflow's system "
                                    "metrics (CPU, memory, disk, network; GPU when present); 0: none")
    log_model: bool = Field(default=True, description="log the final model as an MLflow PyTorch model (personalised "
                            "methods: every client's model, as one)")


class AlgorithmConfig(BaseModel):
    """``name`` plus the algorithm's own parameters, validated against its ``Params`` model."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    name: str = "fedavg"

    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class ExperimentConfig(_Strict):
    name: str = Field(default="experiment", description="names the default output folder runs/NAME-TIME and the "
                      "MLflow run: a folder name, not a path")
    # every random stream is derived from the seed's 32 bits (fedray/seeding.py): a larger seed would share
    # streams with a smaller one, a negative one is refused by numpy mid-run
    seed: int = Field(default=0, ge=0, le=2**32 - 1)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    federation: FederationConfig = Field(default_factory=FederationConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    system: SystemConfig = Field(default_factory=SystemConfig)
    channel: ChannelConfig = Field(default_factory=ChannelConfig)
    aggregation: AggregationConfig = Field(default_factory=AggregationConfig)
    adversary: AdversaryConfig = Field(default_factory=AdversaryConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> "ExperimentConfig":
        if not self.name or self.name.startswith(".") or any(c in self.name for c in "/\\"):
            # a path here would put runs/NAME-TIME elsewhere (name=../x) or nest it (name=a/b)
            raise ConfigError("name", f"{self.name!r} is not a folder name; not empty, no / or \\, not starting "
                              "with a dot (it names runs/NAME-TIME and the MLflow run)")
        self._check_domains()
        if self.data.partition == "central":  # the partition defines the clients: one, holding everything
            self.data.num_clients = self.federation.clients_per_round = 1
        if self.federation.clients_per_round > self.data.num_clients:
            raise ConfigError(
                "federation.clients_per_round",
                f"{self.federation.clients_per_round} exceeds data.num_clients={self.data.num_clients}; "
                f"allowed: 1..{self.data.num_clients}",
            )
        fed = self.federation
        if fed.lr_schedule == "cosine" and fed.lr_min > fed.lr:
            raise ConfigError("federation.lr_min", f"{fed.lr_min:g} exceeds federation.lr={fed.lr:g}: the cosine "
                              "schedule would raise the lr over the rounds; allowed: 0..lr")
        rt = self.runtime
        if rt.server_in_driver is True and (rt.server_num_cpus > 0 or rt.server_num_gpus > 0):
            raise ConfigError(
                "runtime.server_in_driver",
                f"a server in the driver reserves nothing, but runtime.server_num_cpus={rt.server_num_cpus:g} and "
                f"runtime.server_num_gpus={rt.server_num_gpus:g}; set both to 0, or runtime.server_in_driver=auto "
                "(an actor with those resources)",
            )
        if self.runtime.num_workers is not None and self.runtime.num_workers > self.data.num_clients:
            raise ConfigError(
                "runtime.num_workers",
                f"{self.runtime.num_workers} exceeds data.num_clients={self.data.num_clients}; "
                f"allowed: 1..{self.data.num_clients}",
            )
        self.system.check()
        self.channel.check()
        self.aggregation.check(fed.buffer(), self.data.server_data)  # the uploads of one server step, FLTrust's root
        # its classes and images: with the method's checks (methods/registry.py)
        self.adversary.check(self.data.num_clients, availability=self.system.availability)
        self.privacy.check(self.aggregation.rule, fed.mode)
        schedule_class(fed.mode).check(self)
        check_traces(self.system, self.data.num_clients)
        return self

    def _check_domains(self) -> None:
        """Domains, server data and domain partitions fit the dataset; domain partitions set num_clients."""
        d = self.data
        known = DOMAINS.get(d.dataset)
        if d.domains is not None:
            if known is None:
                raise ConfigError("data.domains", f"{d.dataset} has no domains; multi-domain datasets: "
                                  f"{', '.join(DOMAINS)}")
            bad = [x for x in d.domains if x not in known]
            if bad or not d.domains or len(set(d.domains)) != len(d.domains):
                raise ConfigError("data.domains", f"{d.domains} is not a list of distinct domains of {d.dataset}; "
                                  f"allowed: {', '.join(known)}")
        sd = d.server_data
        if sd.kind == "domain":
            if known is None:
                raise ConfigError("data.server_data.kind", f"'domain' needs a multi-domain data.dataset "
                                  f"({', '.join(DOMAINS)}); {d.dataset} has none (use kind=holdout)")
            if sd.domain is not None and sd.domain not in d.all_domains():
                raise ConfigError("data.server_data.domain", f"{sd.domain!r} is not one of data.domains; "
                                  f"allowed: {', '.join(d.all_domains())}")
        elif sd.domain is not None:
            raise ConfigError("data.server_data.domain", "is only used with data.server_data.kind=domain")
        clients = d.client_domains()
        if d.on_demand and known is not None:
            raise ConfigError("data.partition" if d.partition == "on_demand" else "data.pseudo_base_clients",
                              f"clients made on demand draw from one dataset; {d.dataset} has domains: use a "
                              "single-domain data.dataset")
        if d.pseudo_base_clients is not None:
            if d.partition in ("on_demand", "central"):
                raise ConfigError("data.pseudo_base_clients", f"pseudo-clients warp the base clients of a "
                                  f"partition of the data; data.partition={d.partition} has none: use dirichlet, "
                                  "iid or shards")
            if d.pseudo_base_clients > d.num_clients:
                raise ConfigError("data.pseudo_base_clients", f"{d.pseudo_base_clients} base clients for "
                                  f"{d.num_clients} clients; allowed: 1..data.num_clients")
        if known is not None and not clients:
            raise ConfigError("data.domains", "no domain is left for clients once the server's domain is "
                              "taken; give data.domains at least two domains")
        if d.partition in DOMAIN_PARTITIONS:
            if known is None:
                raise ConfigError("data.partition", f"'{d.partition}' needs a multi-domain data.dataset "
                                  f"({', '.join(DOMAINS)}); {d.dataset} has no domains")
            per = d.clients_per_domain if d.partition == "domain_dirichlet" else 1
            # The partition defines the clients: one per domain (cross-silo) or clients_per_domain per domain.
            if d.num_clients != per * len(clients):
                d.num_clients = per * len(clients)
            if self.federation.clients_per_round > d.num_clients:
                self.federation.clients_per_round = d.num_clients  # cross-silo: every silo takes part

    def flat(self) -> dict[str, Any]:
        """Dotted ``key -> value`` view of the whole config (for MLflow params and reports)."""
        return flatten(self.model_dump(mode="json"))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
