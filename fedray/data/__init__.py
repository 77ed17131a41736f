"""Datasets (torchvision loaders on offline roots, Debian's Fashion-MNIST, synthetic), partitioners,
and :class:`FederatedData`. See ``fedray/data/datasets.py`` for where data is looked for."""

from fedray.data.datasets import (
    DEBIAN_FASHION_MNIST,
    RawDataset,
    debian_fashion_mnist_dir,
    display_name,
    load_dataset,
    resolve_root,
)
from fedray.data.federated import FederatedData, build_federated_data, partition, to_float
from fedray.data.partition import partition_dirichlet, partition_iid, partition_shards, split_train_test
from fedray.data.plot import partition_summary, plot_partition
from fedray.data.synthetic import make_synthetic

__all__ = [
    "DEBIAN_FASHION_MNIST",
    "FederatedData",
    "RawDataset",
    "build_federated_data",
    "debian_fashion_mnist_dir",
    "display_name",
    "load_dataset",
    "make_synthetic",
    "partition",
    "partition_dirichlet",
    "partition_iid",
    "partition_shards",
    "partition_summary",
    "plot_partition",
    "resolve_root",
    "split_train_test",
    "to_float",
]
