"""Your own data: image folders, .npz arrays and registered factories; bad files are one line naming the file."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import edgetrain
from edgetrain.config import load_config
from edgetrain.data import build_data
from edgetrain.data.datasets import DATASETS, DataSplit, TensorImages
from edgetrain.data.partition import split_dataset
from edgetrain.errors import EdgetrainError
from edgetrain.spec import parse_partition
from edgetrain_testing import FAST, run_main


def data(dataset, path, **extra):
    return build_data(load_config(dataset=dataset, data_dir=str(path), **extra))


def write_folder(root: Path, classes=("cat", "dog"), per_class=5, size=(8, 6), mode="RGB"):
    rng = np.random.default_rng(0)
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
            pixels = rng.integers(0, 256, shape, dtype=np.uint8)
            Image.fromarray(pixels, mode).save(root / name / f"{i}.{'png' if i % 2 else 'jpg'}")
    return root


def test_image_folder_one_subfolder_per_class(tmp_path):
    root = write_folder(tmp_path / "pets")
    (root / "cat" / "notes.txt").write_text("not an image: ignored")
    split = data("imagefolder", root)
    assert (len(split.train), len(split.test), split.num_classes, split.input_shape) == (8, 2, 2, (3, 6, 8))
    assert sorted(split.train.labels.tolist() + split.test.labels.tolist()) == [0] * 5 + [1] * 5
    x, y = split.train[0]
    assert x.shape == (3, 6, 8) and x.dtype == torch.float32


def test_image_folder_with_train_and_test_and_greyscale(tmp_path):
    write_folder(tmp_path / "set" / "train", per_class=4, mode="L")
    write_folder(tmp_path / "set" / "test", per_class=2, mode="L")
    split = data("imagefolder", tmp_path / "set")
    assert (len(split.train), len(split.test), split.input_shape) == (8, 4, (1, 6, 8))


def test_bad_image_files_are_named(tmp_path):
    root = write_folder(tmp_path / "pets")
    (root / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(EdgetrainError, match=r"image .*dog/broken.png cannot be read"):
        data("imagefolder", root)
    (root / "dog" / "broken.png").unlink()
    Image.new("RGB", (9, 9)).save(root / "dog" / "big.png")
    with pytest.raises(EdgetrainError, match=r"image .*dog/big.png is 9x9 pixels but .* is 8x6; resize"):
        data("imagefolder", root)
    (root / "dog" / "big.png").unlink()
    (root / "empty").mkdir()
    with pytest.raises(EdgetrainError, match=r"class folder .*empty holds no PNG or JPEG images"):
        data("imagefolder", root)


def test_npz_arrays(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "a.npz", x=rng.integers(0, 256, (20, 5, 5), dtype=np.uint8), y=np.arange(20) % 4)
    split = data("npz", tmp_path / "a.npz")
    assert (len(split.train), len(split.test), split.num_classes, split.input_shape) == (16, 4, 4, (1, 5, 5))
    np.savez(tmp_path / "b.npz", x=rng.random((6, 3, 4, 4), dtype=np.float32), y=np.arange(6) % 2,
             x_test=rng.random((2, 3, 4, 4), dtype=np.float32), y_test=np.array([0, 1]))
    split = data("npz", tmp_path / "b.npz")
    assert (len(split.train), len(split.test), split.input_shape) == (6, 2, (3, 4, 4))


@pytest.mark.parametrize("arrays, message", [
    (dict(x=np.zeros((4, 5, 5))), r"lacks y \(holds x\)"),
    (dict(x=np.zeros((4, 5, 5)), y=np.zeros(3, dtype=int)), "y has shape .*; save 4 integer labels"),
    (dict(x=np.zeros((4, 5, 5)), y=np.zeros(4)), "y has shape .*; save 4 integer labels"),
    (dict(x=np.zeros((4, 5)), y=np.zeros(4, dtype=int)), r"x has shape \(4, 5\)"),
    (dict(x=np.full((4, 5, 5), np.nan), y=np.zeros(4, dtype=int)), "finite float"),
    (dict(x=np.array([None] * 4), y=np.zeros(4, dtype=int)), "cannot be read"),
])
def test_bad_npz_files_are_named(tmp_path, arrays, message):
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(EdgetrainError, match=rf"npz file .*bad.npz.*{message}"):
        data("npz", tmp_path / "bad.npz")


def test_bad_npz_on_the_command_line_is_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    out = tmp_path / "runs"
    result = run_main("train", "--dataset", "npz", "--data-dir", str(tmp_path / "junk.npz"), "--output", str(out))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"edgetrain: error: npz file {tmp_path / 'junk.npz'} cannot be read")
    assert not out.exists()


def tiny_arrays(data_dir, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(40) % 2
    x = (y.view(-1, 1, 1, 1) * 0.8 + torch.rand(40, 1, 6, 6, generator=g) * 0.2)
    return x[:32], y[:32], x[32:], y[32:]


def test_registered_dataset(monkeypatch):
    monkeypatch.setitem(DATASETS, "tiny", tiny_arrays)
    split = build_data(load_config(dataset="tiny"))
    assert (len(split.train), len(split.test), split.num_classes, split.input_shape) == (32, 8, 2, (1, 6, 6))
    with pytest.raises(EdgetrainError, match="is built in"):
        edgetrain.register_dataset("npz", tiny_arrays)
    with pytest.raises(EdgetrainError, match="unknown dataset 'tiney'; known datasets: .*tiny"):
        build_data(load_config(dataset="tiney"))


class RecordingImages(TensorImages):
    """Training images that log every index a device reads, to a file per rank."""

    def __getitem__(self, key):
        with open(Path(os.environ["EDGETRAIN_TEST_READS"]) / f"rank-{os.environ['RANK']}", "a") as f:
            f.write(f"{key[0]}\n")
        return super().__getitem__(key)


def recorded_digits(data_dir, seed):
    split = edgetrain.data.digits(seed)
    t = split.train
    return DataSplit(RecordingImages(t.images, t.labels, t.mean.flatten().tolist(), t.std.flatten().tolist(),
                                     scale=t.scale), split.test, split.num_classes, "recorded")


@pytest.mark.slow
def test_in_a_real_run_each_device_reads_only_its_partition(tmp_path, monkeypatch):
    reads = tmp_path / "reads"
    reads.mkdir()
    monkeypatch.setenv("EDGETRAIN_TEST_READS", str(reads))
    monkeypatch.setitem(DATASETS, "recorded", recorded_digits)
    summary = edgetrain.train(dict(dataset="recorded", devices=2, steps=6, batch_size=32, local_batch="8,24",
                                   partition="shards:2", output=str(tmp_path / "runs"), **FAST))
    labels = edgetrain.data.digits(0).train.labels
    parts = split_dataset(labels, parse_partition("shards:2"), [8, 24], seed=0)
    assert summary["partition"]["sizes"] == [len(p) for p in parts]
    for rank in range(2):
        read = [int(line) for line in (reads / f"rank-{rank}").read_text().split()]
        assert len(read) == 6 * [8, 24][rank]
        assert set(read) <= set(parts[rank].tolist())
    assert json.loads((Path(summary["run_dir"]) / "summary.json").read_text())["dataset"] == "recorded"


def _users_data(tmp_path, kind: str) -> dict:
    if kind == "imagefolder":
        return dict(dataset="imagefolder", data_dir=str(write_folder(tmp_path / "pets", per_class=8, size=(12, 10))),
                    from_storage=True)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "a.npz", x=rng.integers(0, 256, (20, 2, 10, 12), dtype=np.uint8), y=np.arange(20) % 3)
    return dict(dataset="npz", data_dir=str(tmp_path / "a.npz"))


@pytest.mark.parametrize("kind", ["imagefolder", "npz"])
@pytest.mark.parametrize("strategy", [dict(strategy="tiled", grid="1x2"), dict(strategy="pipeline")])
def test_tiled_and_pipeline_take_the_input_shape_from_the_users_data(tmp_path, kind, strategy):
    from edgetrain.config import resolve
    from edgetrain.train.preflight import check_before_launch

    cfg = load_config(**_users_data(tmp_path, kind), devices=2, **strategy)
    data = check_before_launch(cfg, resolve(cfg))  # planned on the data's own shape, not a table of built-ins
    assert tuple(data.input_shape) == ((3, 10, 12) if kind == "imagefolder" else (2, 10, 12))


@pytest.mark.parametrize("kind, strategy", [("imagefolder", dict(strategy="tiled", grid="1x2")),
                                            pytest.param("npz", dict(strategy="pipeline"), marks=pytest.mark.slow)])
def test_tiled_and_pipeline_train_on_the_users_data(tmp_path, kind, strategy):
    summary = edgetrain.train(dict(_users_data(tmp_path, kind), devices=2, steps=2, batch_size=4,
                                   output=str(tmp_path / "out"), **strategy, **FAST))
    assert summary["strategy"] == strategy["strategy"] and summary["steps"] == 2
    assert summary["input_shape"] == ([3, 10, 12] if kind == "imagefolder" else [2, 10, 12])
