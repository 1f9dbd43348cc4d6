import base64
import io
import json
import re
import subprocess
import tempfile
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from edgetrain.cli import main

CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[Path]:
    """A bench run with a real sensor-less power sweep, a peak run, and a training run's summary."""
    root = tmp_path_factory.mktemp("runs")
    assert main(["bench", "peak", "--gemm-sizes", "64,128", "--linpack-sizes", "64", "--threads", "1",
                 "--min-time", "0.01", "--output", str(root), "--name", "peak"]) == 0
    assert main(["bench", "power", "--model", "small_cnn", "--dataset", "digits", "--threads", "1,2", "--batch-size", "8", "--steps", "2",
                 "--power-model", "2.7,1.2", "--output", str(root), "--name", "power"]) == 0
    train = root / "train-1"  # the shape edgetrain train writes: summary.json beside its plots
    train.mkdir()
    (train / "summary.json").write_text(json.dumps({
        "run_dir": str(train), "model": "small_cnn", "dataset": "digits", "devices": 2, "throughput_samples_per_s": 900.0,
        "flops_per_sample": _small_cnn_flops(),
        "test_accuracy": 0.61, "per_device": [
            {"rank": r, "profile": "host", "local_batch": 16, "samples_per_s": 450.0, "peak_rss_mb": 400.0 + r,
             "data_s": 1.0, "compute_s": 6.0, "comm_s": 3.0, "bytes_sent": 2 ** 20, "bytes_recv": 2 ** 20}
            for r in range(2)]}))
    return [root / "peak", root / "power", train]


def _small_cnn_flops() -> dict:
    from edgetrain.bench import workload
    from edgetrain.tasks import flops

    return flops.training_flops_per_sample(workload.build_model("small_cnn", "digits"), "digits")


def _train_run(root: Path, name: str, **summary) -> Path:
    run = root / name
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"run_dir": str(run), "devices": 1, **summary}))
    return run


def test_devices_are_rated_against_their_own_profile_and_a_rate_above_it_is_flagged(tmp_path):
    from edgetrain.report.html import render

    device = {"rank": 0, "profile": "rpi4", "local_batch": 8, "samples_per_s": 100.0, "achieved_gflops": 18.6,
              "peak_gflops": 15.5, "peak_modelled": True, "fraction_of_peak": 1.2, "above_peak": True,
              "peak_source": "profile rpi4: 15.5 GFLOPS as the profile declares it (nominal, not measured here)"}
    run = _train_run(tmp_path, "rpi4", model="small_cnn", dataset="synthetic", throughput_samples_per_s=100.0,
                     flops_per_sample={"total_flops": 1.86e8, "input_shape": [3, 64, 64]}, per_device=[device])
    page = render([run])
    assert "120.0% !" in page and "which a correct count cannot reach" in page  # flagged, not bare
    assert "at 3x64x64" in page and "of the 15.5 GFLOPS its devices are rated at (modelled" in page
    assert "rated GFLOPS of rpi4: profile rpi4: 15.5 GFLOPS" in page


def test_a_summary_without_its_own_flop_count_shows_no_guessed_gflops(tmp_path):
    from edgetrain.report.html import render

    # Before, the report recounted small_cnn at 32x32 for any run, whatever it had trained.
    run = _train_run(tmp_path, "old", model="small_cnn", dataset="synthetic", throughput_samples_per_s=100.0,
                     per_device=[])
    assert "achieved" not in render([run])


def _images(page: str) -> list[bytes]:
    srcs = re.findall(r'<img[^>]*\bsrc="([^"]*)"', page)
    assert len(srcs) == page.count("<img")
    out = []
    for src in srcs:
        assert src.startswith("data:image/png;base64,"), src[:40]
        out.append(base64.b64decode(src.split(",", 1)[1], validate=True))
    return out


def test_report_is_self_contained_with_decodable_pngs(runs, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", *map(str, runs), "-o", str(out)]) == 0
    page = out.read_text()
    assert "http://" not in page and "https://" not in page  # nothing fetched from elsewhere
    pngs = _images(page)
    # peak.png, power.png and the training run's time split; no radar: a peak, a power and a training run share
    # fewer than 3 measured axes; no curves: the training run has no metrics.jsonl or evaluations
    assert len(pngs) == 3 and "Training curves" not in page
    for png in pngs:
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        img = mpimg.imread(io.BytesIO(png), format="png")
        assert img.shape[0] > 100 and img.shape[1] > 100
    assert "Comparison" in page and "no radar chart: they share" in page and "radar chart\"" not in page
    assert "modelled" in page.lower()  # the power run's energy is labelled as modelled
    assert "training run" in page and "61.0%" in page
    # the training run's achieved GFLOPS, set against the peak run shown beside it
    peak = max(r["gflops_best"] for r in json.loads((runs[0] / "result.json").read_text())["rows"]
               if r["kind"] == "gemm")
    per_sample = _small_cnn_flops()["total_flops"]
    gflops = per_sample * 900.0 / 1e9
    assert "GFLOP per training sample of small_cnn at 1x8x8" in page
    assert f"achieved {gflops:.2f} GFLOPS" in page
    assert f"= {100 * gflops / peak:.1f}% of the {peak:.1f} GFLOPS peak" in page


def test_the_radar_shows_only_the_axes_every_run_measured(tmp_path):
    from edgetrain.report.html import render

    def device(r):
        return {"rank": r, "profile": "host", "local_batch": 16, "samples_per_s": 450.0, "peak_rss_mb": 400.0,
                "data_s": 1.0, "compute_s": 6.0, "comm_s": 3.0, "bytes_sent": 1, "bytes_recv": 1}
    runs = [_train_run(tmp_path, f"t{i}", model="small_cnn", dataset="digits", throughput_samples_per_s=900.0 + i,
                       test_accuracy=0.6 + i / 100, time_split_fraction={"comm": 0.3}, per_device=[device(0)])
            for i in range(3)]
    page = render(runs)
    assert page.count('alt="radar chart"') == 1
    assert "the radar shows the 4 axes every one of them measured" in page  # all but energy
    page = render(runs[:1] + [_train_run(tmp_path, "bare", model="small_cnn", dataset="digits",
                                         throughput_samples_per_s=10.0, per_device=[])])
    assert 'alt="radar chart"' not in page and "no radar chart: they share 1 measured axis/axes (throughput)" in page


def test_radar_scores_best_is_one_and_missing_is_none():
    from edgetrain.report.html import radar_scores

    scores = dict(radar_scores([("a", {"throughput": 10.0, "memory": 200.0}),
                                ("b", {"throughput": 5.0, "memory": 100.0, "accuracy": 0.5})]))
    # axes: throughput, memory, energy, communication, accuracy
    assert scores["a"] == [1.0, 0.5, None, None, None]
    assert scores["b"] == [0.5, 1.0, None, None, 1.0]


def test_not_a_run_dir_is_one_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not an edgetrain run directory" in err


@pytest.mark.skipif(not CHROMIUM.exists(), reason="headless Chromium (/usr/bin/chromium) is not installed; "
                                                  "install Debian's chromium package to run this check")
def test_report_renders_in_headless_chromium_without_broken_images(runs, tmp_path):
    out = tmp_path / "report.html"
    assert main(["report", *map(str, runs), "-o", str(out)]) == 0
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run([str(CHROMIUM), *flags, f"--user-data-dir={profile}", "--dump-dom", out.as_uri()],
                             capture_output=True, text=True, timeout=120).stdout
    n_img = out.read_text().count("<img")
    assert 'data-broken-images="0"' in dom, "the page's load check found broken images (or did not run)"
    assert dom.count('data-loaded="yes"') == n_img and 'data-loaded="no"' not in dom
    # The check itself must see a broken image: corrupt one and look again.
    broken = tmp_path / "broken.html"
    broken.write_text(out.read_text().replace("data:image/png;base64,", "data:image/png;base64,AAAA", 1))
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run([str(CHROMIUM), *flags, f"--user-data-dir={profile}", "--dump-dom", broken.as_uri()],
                             capture_output=True, text=True, timeout=120).stdout
    assert 'data-broken-images="1"' in dom
    shot = tmp_path / "shot.png"
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([str(CHROMIUM), *flags, f"--user-data-dir={profile}", "--window-size=1280,2400",
                        f"--screenshot={shot}", out.as_uri()], capture_output=True, timeout=120)
    assert mpimg.imread(shot).shape[:2] == (2400, 1280)
