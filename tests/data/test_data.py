import pickle
import shutil

import pytest
import torch

from edgetrain.data import GlobalBatchSampler, cifar10, digits, synthetic
from edgetrain.data.cifar import load_cifar10
from edgetrain.errors import EdgetrainError


def test_reads_the_cifar_subset(cifar_dir):
    (xtr, ytr), (xte, yte) = load_cifar10(cifar_dir)
    assert xtr.shape == (5085, 3, 32, 32) and xtr.dtype == torch.uint8
    assert xte.shape == (1017, 3, 32, 32) and len(yte) == 1017
    assert set(ytr.tolist()) == set(range(10))
    split = cifar10(str(cifar_dir))
    x, y = split.train[(0, 0)]
    assert x.shape == (3, 32, 32) and abs(x.mean().item()) < 2


@pytest.fixture
def cifar_copy(cifar_dir, tmp_path):
    dst = tmp_path / "cifar"
    shutil.copytree(cifar_dir, dst)
    return dst


def test_truncated_batch_is_a_clear_error(cifar_copy):
    path = cifar_copy / "data_batch_3"
    path.write_bytes(path.read_bytes()[: 100_000])
    with pytest.raises(EdgetrainError, match=r"data_batch_3 is corrupt or truncated"):
        load_cifar10(cifar_copy)


def test_wrong_and_missing_files_are_clear_errors(cifar_copy, tmp_path):
    (cifar_copy / "test_batch").write_bytes(b"this is not a pickle at all")
    with pytest.raises(EdgetrainError, match="test_batch is corrupt"):
        load_cifar10(cifar_copy)
    (cifar_copy / "data_batch_2").unlink()
    with pytest.raises(EdgetrainError, match="data_batch_2 is missing"):
        load_cifar10(cifar_copy)
    with pytest.raises(EdgetrainError, match="does not exist"):
        load_cifar10(tmp_path / "nowhere")


def test_wrong_shape_and_hostile_pickles_are_refused(cifar_copy):
    import numpy as np

    with open(cifar_copy / "data_batch_1", "wb") as f:
        pickle.dump({"data": np.zeros((4, 100), np.uint8), "labels": [0, 1, 2, 3]}, f)
    with pytest.raises(EdgetrainError, match=r"shape \(4, 100\)"):
        load_cifar10(cifar_copy)
    with open(cifar_copy / "data_batch_1", "wb") as f:
        pickle.dump(shutil.rmtree, f)  # unpickling would import and call arbitrary code
    with pytest.raises(EdgetrainError, match="refusing to load shutil.rmtree"):
        load_cifar10(cifar_copy)


def test_augmentation_is_keyed_by_sample_not_process(cifar_dir):
    split = cifar10(str(cifar_dir), augment=True, seed=3)
    a, _ = split.train[(7, 2)]
    b, _ = split.train[(7, 2)]
    c, _ = split.train[(7, 3)]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_global_batch_sampler_shards_exactly():
    local = [3, 5, 8]
    samplers = [GlobalBatchSampler(100, local, r, seed=1) for r in range(3)]
    whole = GlobalBatchSampler(100, [16], 0, seed=1)
    for s in samplers + [whole]:
        s.set_epoch(4)
    assert len(whole) == 6 and all(len(s) == 6 for s in samplers)
    for parts, full in zip(zip(*samplers), whole):
        assert sum(parts, []) == full
        assert all(len(p) == b for p, b in zip(parts, local))


def test_digits_and_synthetic():
    d = digits()
    assert len(d.train) == 1437 and len(d.test) == 360 and d.input_shape == (1, 8, 8)
    s = synthetic(64, 16)
    assert s.input_shape == (3, 16, 16) and len(s.test) == 16
