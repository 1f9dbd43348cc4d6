"""bench stalls on training's loader: workers x storage x cold/warm page cache (bench/stalls.py)."""
import pytest

from edgetrain.bench import stalls
from edgetrain.cli import main
from edgetrain.errors import EdgetrainError

from bench_helpers import assert_png, read_result


@pytest.mark.slow
def test_stalls_over_workers_storage_and_page_cache(tmp_path):
    assert main(["bench", "stalls", "--model", "small_cnn", "--batch-size", "16", "--epoch-samples", "48",
                 "--workers", "0,1", "--storages", "sd-card,nvme", "--threads", "1",
                 "--output", str(tmp_path), "--name", "s"]) == 0
    result = read_result(tmp_path / "s")
    rows = result["rows"]
    assert [(r["storage"], r["workers"], r["cache"]) for r in rows] == [
        (s, w, c) for s in ("sd-card", "nvme") for w in (0, 1) for c in ("cold", "warm")]
    for r in rows:
        assert r["train_samples_per_s"] == pytest.approx(48 / r["epoch_s"])
        assert 0 <= r["stall_fraction"] == pytest.approx(r["stall_s"] / r["epoch_s"])
        assert r["read_ms_per_batch"] > 0 and r["decode_ms_per_batch"] > 0
        assert r["limiting_stage"] in ("compute", "fetch", "prep")
    assert "sd-card with 1 worker(s) trains at" in result["verdict"]
    assert result["params"]["data_dir"] == "generated image folder"
    assert not list(tmp_path.glob("stalls-data-*"))  # the generated folder is removed
    assert_png(tmp_path / "s" / "stalls.png")


def test_limiting_stage():
    # rates in samples/s: ingestion, loader cached (prep), loader cold (fetch + prep)
    assert stalls.limiting_stage(100.0, 500.0, 400.0, 0.05) == "compute"
    assert stalls.limiting_stage(100.0, 97.0, 96.0, 0.05) == "compute"  # within the threshold
    assert stalls.limiting_stage(100.0, 50.0, 49.0, 0.05) == "prep"
    assert stalls.limiting_stage(100.0, 500.0, 20.0, 0.05) == "fetch"


def test_unknown_storage_and_too_few_images_are_clear_errors(tmp_path):
    with pytest.raises(EdgetrainError, match="unknown storage 'floppy'"):
        stalls.run(None, storages=("floppy",), output=str(tmp_path))
    folder = stalls.generated_folder(tmp_path / "f", 20)
    with pytest.raises(EdgetrainError, match="--epoch-samples must be between"):
        stalls.run(str(folder), epoch_samples=512, output=str(tmp_path))
