"""Loading a run's dataset by ``data.dataset``: the torchvision datasets (:mod:`.datasets`), the multi-domain ones
(:mod:`.domains`: Fashion-MNIST's domains; :mod:`.imagefolder`: Digit-5, DomainNet, Office-Caltech from their
folders) and the synthetic one (:mod:`.synthetic`). The loaders know nothing of each other; only this module
knows them all."""

from __future__ import annotations

from fedray.config import DOMAINS, DataConfig
from fedray.data.datasets import TORCHVISION_STATS, RawDataset, load_torchvision
from fedray.data.domains import DomainDataset, is_multi_domain, load_fmnist_domains
from fedray.data.imagefolder import load_imagefolder_domains
from fedray.data.synthetic import make_synthetic
from fedray.errors import DataError


#: The synthetic training split of an ``on_demand`` run: fixed, however many clients it registers
ON_DEMAND_SYNTHETIC = 20_000


def synthetic_train_default(cfg: DataConfig) -> int:
    """``data.synthetic_train_samples``' default: 60 images a client, at least 2,000; with clients made on demand,
    of the base clients (pseudo-clients) or a fixed 20,000 (``on_demand``): the data does not grow with the clients
    registered."""
    if cfg.partition == "on_demand":
        return ON_DEMAND_SYNTHETIC
    return max(2000, 60 * (cfg.pseudo_base_clients or cfg.num_clients))


def load_domains(cfg: DataConfig) -> DomainDataset:
    """Load the run's domains (``cfg.all_domains()``) of the multi-domain ``cfg.dataset``."""
    if cfg.dataset == "fmnist_domains":
        return load_fmnist_domains(cfg)
    return load_imagefolder_domains(cfg)


def load_dataset(cfg: DataConfig, seed: int) -> RawDataset:
    """Load ``cfg.dataset``; the synthetic dataset is generated from ``seed``.

    A multi-domain dataset comes back as its client domains pooled (domain-major); use
    :func:`load_domains` to keep the domains apart.
    """
    if is_multi_domain(cfg.dataset):
        return load_domains(cfg).pooled(cfg.client_domains())
    if cfg.dataset == "synthetic":
        num_train = cfg.synthetic_train_samples or synthetic_train_default(cfg)
        return make_synthetic(
            num_train,
            cfg.synthetic_test_samples,
            cfg.synthetic_num_classes,
            cfg.synthetic_channels,
            cfg.synthetic_image_size,
            seed,
            noise=cfg.synthetic_noise,
            shift=cfg.synthetic_shift,
            contrast=cfg.synthetic_contrast,
        )
    if cfg.dataset not in TORCHVISION_STATS:
        allowed = ", ".join([*TORCHVISION_STATS, "synthetic", *DOMAINS])
        raise DataError("data.dataset", f"unknown dataset {cfg.dataset!r}; allowed: {allowed}")
    return load_torchvision(cfg)
