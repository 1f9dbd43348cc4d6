"""--partition: per-device splits of the training set, and a sampler that reads only a device's own part."""
import math

import numpy as np
import pytest
from torch.utils.data import DataLoader

from edgetrain.config import load_config
from edgetrain.data import digits
from edgetrain.data.partition import PartitionSampler, build_sampler, label_entropy, split_dataset
from edgetrain.errors import EdgetrainError
from edgetrain.spec import parse_partition
from edgetrain_testing import run_main

LABELS = np.repeat(np.arange(10), 100)  # 1000 samples, 100 per class
SPECS = ["iid", "dirichlet:0.1", "dirichlet:1", "dirichlet:100", "shards:1", "shards:3"]


@pytest.mark.parametrize("text", SPECS)
def test_partitions_are_disjoint_and_cover_the_dataset(text):
    parts = split_dataset(LABELS, parse_partition(text), [8] * 5, seed=3)
    joined = np.concatenate(parts)
    assert len(joined) == len(LABELS) and np.array_equal(np.sort(joined), np.arange(len(LABELS)))
    assert all(len(p) >= 8 for p in parts)


@pytest.mark.parametrize("text", SPECS)
def test_partitions_are_reproducible_from_the_seed(text):
    spec = parse_partition(text)
    a, b = (split_dataset(LABELS, spec, [8] * 5, seed=7) for _ in range(2))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    other = split_dataset(LABELS, spec, [8] * 5, seed=8)
    assert not all(np.array_equal(x, y) for x, y in zip(a, other))


def mean_entropy(text, seed=0):
    parts = split_dataset(LABELS, parse_partition(text), [1] * 5, seed=seed)
    return np.mean([label_entropy(np.bincount(LABELS[p], minlength=10)) for p in parts])


def test_partitions_follow_the_requested_skew():
    assert mean_entropy("iid") > 3.2  # near log2(10) = 3.32: every class on every device
    # smaller alpha, fewer classes per device, in every seed tried
    for seed in range(3):
        assert mean_entropy("dirichlet:0.1", seed) < mean_entropy("dirichlet:1", seed) < mean_entropy("dirichlet:100", seed)
    assert mean_entropy("dirichlet:100") > 3.2
    # one label-sorted shard of 200 samples per device: exactly two classes each
    for p in split_dataset(LABELS, parse_partition("shards:1"), [1] * 5, seed=0):
        assert len(np.unique(LABELS[p])) == 2


class Recording:
    """A dataset that records every index a loader reads."""

    def __init__(self, size):
        self.size, self.read = size, []

    def __len__(self):
        return self.size

    def __getitem__(self, key):
        index, _epoch = key
        self.read.append(index)
        return index


def test_a_device_reads_only_its_partition():
    labels = digits().train.labels
    spec, batches = parse_partition("dirichlet:0.5"), [16, 16, 32]
    parts = split_dataset(labels, spec, batches, seed=0)
    for rank in range(3):
        dataset = Recording(len(labels))
        sampler, report = build_sampler(labels, spec, batches, rank, seed=0)  # as the training loop builds it
        steps = 0
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for batch in DataLoader(dataset, batch_sampler=sampler):
                assert len(batch) == batches[rank]
                steps += 1
        assert steps == 2 * (len(labels) // 64)  # the data-parallel epoch length, on every device
        assert set(dataset.read) <= set(parts[rank].tolist())
        assert report.sizes == [len(p) for p in parts]


def test_a_small_partition_is_passed_over_more_than_once_in_a_fresh_order():
    sampler = PartitionSampler(np.arange(10), local_batch=4, steps_per_epoch=5, rank=0, seed=0)
    seen = [i for batch in sampler for i, _ in batch]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert seen[:10] != seen[10:20]


@pytest.mark.parametrize("text, message", [
    ("dirichlet", "needs one number"), ("dirichlet:0", "alpha must be a finite number > 0"),
    ("dirichlet:nan", "alpha must be"), ("shards:0", "K >= 1"), ("shards:1.5", "K >= 1"), ("iid:2", "no argument"),
    ("noniid", "unknown partition"),
])
def test_bad_partition_specs_are_one_line_errors(text, message):
    with pytest.raises(EdgetrainError, match=message):
        load_config(partition=text)


def test_partition_does_not_apply_to_tiled_training():
    with pytest.raises(EdgetrainError, match="does not apply to strategy tiled"):
        load_config(partition="iid", strategy="tiled", grid="1x2", devices=2)


def test_a_device_left_short_of_a_batch_is_refused_before_any_device_starts(tmp_path):
    # alpha 0.001 gives each of the 10 classes almost wholly to one device: 6 of 16 devices get nothing
    out = tmp_path / "runs"
    result = run_main("train", "--devices", "16", "--batch-size", "256", "--partition", "dirichlet:0.001",
                      "--output", str(out), "--no-progress", "--no-throttle")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "edgetrain: error: --partition dirichlet:0.001 left a device fewer samples than its local batch in 100 "
        "draws; raise alpha, or lower --devices or --batch-size"]
    assert not out.exists()


def test_a_resumed_partition_sampler_continues_where_the_epoch_was():
    """A resumed run (train/checkpoint.py) starts mid-epoch: the batches after the checkpoint, then whole epochs."""
    sampler = PartitionSampler(np.arange(40), local_batch=4, steps_per_epoch=6, rank=1, seed=3)
    sampler.set_epoch(2)
    whole = list(sampler)
    sampler.resume_at(2, 4)
    assert list(sampler) == whole[4:]
    assert list(sampler) == whole  # the next pass over the same epoch is whole again


@pytest.mark.parametrize("text", ["dirichlet:0.5", "shards:2", "iid"])
def test_every_sample_of_every_partition_is_drawn_before_any_is_drawn_again(text):
    # digits, 4 devices of local batch 16: 22 steps of 16 samples an epoch, where dirichlet:0.5 gives device 3
    # 447 samples, so it needs 2 epochs to see them all; a shuffle's walk must carry over into the next epoch
    labels = digits(0).train.labels
    parts = split_dataset(labels, parse_partition(text), [16] * 4, seed=0)
    for rank, part in enumerate(parts):
        sampler, _ = build_sampler(labels, parse_partition(text), [16] * 4, rank, seed=0)
        per_epoch = len(sampler) * 16
        epochs = math.ceil(len(part) / per_epoch)
        drawn = []
        for epoch in range(epochs + 2):
            sampler.set_epoch(epoch)
            drawn += [i for batch in sampler for i, _ in batch]
        assert set(drawn[:epochs * per_epoch]) == set(part.tolist()), (rank, len(part), per_epoch)
        for start in range(0, len(drawn) - len(part) + 1, len(part)):  # each pass: the whole partition once
            assert sorted(drawn[start:start + len(part)]) == part.tolist(), (rank, start)


def test_a_partition_sampler_started_again_mid_run_continues_its_walk():
    """A resumed run is a new process: a fresh sampler told the epoch and batch draws what the first would have."""
    first = PartitionSampler(np.arange(37), local_batch=4, steps_per_epoch=6, rank=1, seed=3)
    uninterrupted = []
    for epoch in range(4):
        first.set_epoch(epoch)
        uninterrupted += list(first)
    again = PartitionSampler(np.arange(37), local_batch=4, steps_per_epoch=6, rank=1, seed=3)
    again.resume_at(1, 5)
    resumed = list(again)
    for epoch in (2, 3):
        again.set_epoch(epoch)
        resumed += list(again)
    assert resumed == uninterrupted[6 + 5:]
