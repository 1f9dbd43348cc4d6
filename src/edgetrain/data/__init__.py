"""Datasets (CIFAR-10, scikit-learn digits, synthetic), per-device sharding and partitions (``partition.py``)."""
from edgetrain.data.datasets import DataSplit, TensorImages, build_data, cifar10, digits, synthetic
from edgetrain.data.sampler import GlobalBatchSampler, shard_indices

__all__ = ["DataSplit", "TensorImages", "build_data", "cifar10", "digits", "synthetic", "GlobalBatchSampler",
           "shard_indices"]
