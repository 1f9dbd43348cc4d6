"""Datasets (CIFAR-10, scikit-learn digits, synthetic), per-device sharding and partitions (``partition.py``),
and a device's own file from the cluster file (``device_data.py``)."""
from edgetrain.data.datasets import (DataSplit, TensorImages, build_data, cifar10, digits, register_dataset,
                                     synthetic, user_datasets)
from edgetrain.data.sampler import GlobalBatchSampler, shard_indices

__all__ = ["DataSplit", "TensorImages", "build_data", "cifar10", "digits", "synthetic", "GlobalBatchSampler",
           "shard_indices", "register_dataset", "user_datasets"]
