"""Datasets (torchvision loaders on offline roots, Debian's Fashion-MNIST, synthetic, multi-domain),
partitioners, server-side data and :class:`FederatedData`. ``fedray/data/loading.py`` finds a dataset's loader by
``data.dataset``; ``fedray/data/datasets.py`` says where data is looked for, ``fedray/data/domains.py`` builds
``fmnist_domains`` and ``fedray/data/imagefolder.py`` reads the ImageFolder layout of ``digit5``,
``office_caltech10`` and ``domainnet``."""

from fedray.data.datasets import (
    DEBIAN_FASHION_MNIST,
    RawDataset,
    debian_fashion_mnist_dir,
    display_name,
    resolve_root,
)
from fedray.data.domains import (
    FMNIST_DOMAINS,
    DomainDataset,
    DomainSplit,
    fmnist_domain_shares,
    fmnist_domain_transform,
)
from fedray.data.federated import FederatedData, ServerData, build_federated_data, partition, to_float
from fedray.data.imagefolder import IMAGEFOLDER_DATASETS, load_imagefolder_domains
from fedray.data.loading import load_dataset, load_domains
from fedray.data.partition import (
    partition_by_domain,
    partition_dirichlet,
    partition_domain_dirichlet,
    partition_iid,
    partition_shards,
    select_holdout,
    split_train_test,
)
from fedray.data.plot import partition_summary, plot_partition
from fedray.data.synthetic import make_synthetic

__all__ = [
    "DEBIAN_FASHION_MNIST",
    "FMNIST_DOMAINS",
    "IMAGEFOLDER_DATASETS",
    "DomainDataset",
    "DomainSplit",
    "FederatedData",
    "RawDataset",
    "ServerData",
    "build_federated_data",
    "debian_fashion_mnist_dir",
    "display_name",
    "fmnist_domain_shares",
    "fmnist_domain_transform",
    "load_dataset",
    "load_domains",
    "load_imagefolder_domains",
    "make_synthetic",
    "partition",
    "partition_by_domain",
    "partition_dirichlet",
    "partition_domain_dirichlet",
    "partition_iid",
    "partition_shards",
    "partition_summary",
    "plot_partition",
    "resolve_root",
    "select_holdout",
    "split_train_test",
    "to_float",
]
