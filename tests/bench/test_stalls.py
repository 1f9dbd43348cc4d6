import statistics

import pytest

from edgetrain.bench import stalls
from edgetrain.cli import main
from edgetrain.errors import EdgetrainError

from bench_helpers import assert_png, read_result


def test_stalls_on_cifar_subset(tmp_path, cifar_dir):
    assert main(["bench", "stalls", "--data-dir", str(cifar_dir), "--model", "small_cnn", "--batch-size", "32",
                 "--epoch-samples", "64", "--max-workers", "1", "--threads", "1",
                 "--output", str(tmp_path), "--name", "s"]) == 0
    result = read_result(tmp_path / "s")
    samples = result["params"]["epoch_samples"]
    assert samples == 64
    rows = result["rows"]
    assert [r["workers"] for r in rows] == [0, 1]
    assert result["ingestion_samples_per_s"] == pytest.approx(
        statistics.median(r["ingestion_samples_per_s"] for r in rows))
    for r in rows:
        ingest = r["epoch_compute_s"]
        assert r["ingestion_samples_per_s"] == pytest.approx(samples / ingest)
        assert r["train_cached_samples_per_s"] == pytest.approx(samples / r["epoch_cached_s"])
        assert r["train_cold_samples_per_s"] == pytest.approx(samples / r["epoch_cold_s"])
        assert r["prep_stall_s"] == pytest.approx(max(0.0, r["epoch_cached_s"] - ingest))
        assert r["fetch_stall_s"] == pytest.approx(max(0.0, r["epoch_cold_s"] - r["epoch_cached_s"]))
        assert r["limiting_stage"] == stalls.limiting_stage(r["ingestion_samples_per_s"], r["prep_samples_per_s"],
                                                            r["fetch_samples_per_s"], 0.05)
    removes = result["stall_removed_at_workers"]
    assert removes is None or rows[removes]["limiting_stage"] == "compute"
    assert result["verdict"]
    assert result["read_mb_per_s"]["cold"] > 0
    assert_png(tmp_path / "s" / "stalls.png")


def test_limiting_stage():
    # rates in samples/s: ingestion, loader cached (prep), loader cold (fetch + prep)
    assert stalls.limiting_stage(100.0, 500.0, 400.0, 0.05) == "compute"
    assert stalls.limiting_stage(100.0, 97.0, 96.0, 0.05) == "compute"  # within the threshold
    assert stalls.limiting_stage(100.0, 50.0, 49.0, 0.05) == "prep"
    assert stalls.limiting_stage(100.0, 500.0, 20.0, 0.05) == "fetch"


def test_reader_gives_normalised_augmented_images(cifar_dir):
    ds = stalls.CifarFiles(stalls.cifar_files(cifar_dir))
    assert len(ds) == sum(ds.lengths) > 0
    x, y = ds[len(ds) - 1]
    assert tuple(x.shape) == (3, 32, 32) and 0 <= y < 10
    assert -3 < float(x.mean()) < 3
    stalls.drop_page_cache(ds.files)  # must not need root


def test_missing_data_dir_is_a_clear_error(tmp_path):
    with pytest.raises(EdgetrainError, match="no CIFAR-10 python-format training files"):
        stalls.cifar_files(tmp_path)
