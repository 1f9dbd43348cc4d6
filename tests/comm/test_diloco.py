"""The DiLoCo family (comm/local_sgd.py's outer step, comm/streaming.py) against references written out by hand."""
from __future__ import annotations

import re

import pytest
import torch
from diloco_workers import diloco_runs, streaming_reference, synchronous_sgd
from edgetrain_testing import on_devices

from edgetrain.comm.streaming import fragment_bounds
from edgetrain.errors import EdgetrainError
from edgetrain.spec import parse_sync

STEPS = 10
CASES = [("diloco1", "diloco:1:lr=1:momentum=0", "none"),
         ("diloco3", "diloco:3", "none"),
         ("stream1", "streaming:3:fragments=1:overlap=0:mix=0", "none"),
         ("stream3", "streaming:4:fragments=3:overlap=1:mix=0.5:lr=0.5:momentum=0.8", "none")]


@pytest.fixture(scope="module")
def runs():
    return on_devices(diloco_runs, 2, CASES, STEPS)


def test_h1_diloco_with_outer_lr_1_and_no_momentum_is_synchronous_sgd(runs):
    expected = synchronous_sgd(2, STEPS)
    for rank in (0, 1):
        got = runs[rank]["diloco1"]["before"]
        assert got.dtype == torch.float64
        assert torch.allclose(got, expected, rtol=0, atol=1e-12), (got - expected).abs().max()


def test_diloco_takes_the_outer_nesterov_step_on_the_mean_pseudo_gradient(runs):
    expected = streaming_reference(2, STEPS, period=3, fragments=1, overlap=0, mix=0.0, outer_lr=0.7,
                                   outer_momentum=0.9)
    for rank in (0, 1):
        assert torch.allclose(runs[rank]["diloco3"]["before"], expected[rank], rtol=0, atol=1e-12)
    # and the outer step matters: these models are not the plain average's
    assert not torch.allclose(runs[0]["diloco3"]["before"], synchronous_sgd(2, STEPS), atol=1e-3)


def test_streaming_with_one_fragment_and_no_overlap_is_diloco(runs):
    for rank in (0, 1):
        stream, diloco = runs[rank]["stream1"], runs[rank]["diloco3"]
        assert torch.allclose(stream["before"], diloco["before"], rtol=0, atol=1e-12)
        assert torch.allclose(stream["after"], diloco["after"], rtol=0, atol=1e-12)


def test_streaming_fragments_overlap_and_mix_as_written_out(runs):
    expected = streaming_reference(2, STEPS, period=4, fragments=3, overlap=1, mix=0.5, outer_lr=0.5,
                                   outer_momentum=0.8)
    for rank in (0, 1):
        assert torch.allclose(runs[rank]["stream3"]["before"], expected[rank], rtol=0, atol=1e-12)
    assert not torch.allclose(expected[0], expected[1])  # the devices differ between exchanges...
    assert torch.equal(runs[0]["stream3"]["after"], runs[1]["stream3"]["after"])  # ...and agree at the end
    s = runs[0]["stream3"]["summary"]
    # fragment 0 goes at steps 4 and 8, fragment 1 at 3 and 7, fragment 2 at 2, 6 and 10 (that one is applied in
    # finish), then one final round for each fragment (mix > 0 leaves every device's own share in each)
    assert s["fragments"] == 3 and sum(s["fragment_params"]) == sum(p.numel() for p in fragment_sizes())
    assert s["exchanges"] == 7 + 3
    # bytes from the payloads: each exchange all-reduces its fragment in fp64 (8 bytes a value; with two devices a
    # ring all-reduce sends the payload once): fragments 0 and 1 twice and fragment 2 three times, all once more
    f0, f1, f2 = s["fragment_params"]
    assert s["bytes_sent_per_device"] == 8 * (3 * f0 + 3 * f1 + 4 * f2)


def fragment_sizes():
    from comm_workers import tiny_model
    return list(tiny_model().parameters())


def test_fragment_bounds_cut_whole_parameters_about_evenly():
    assert fragment_bounds((10, 10, 10, 10), 2) == [(0, 2), (2, 4)]
    assert fragment_bounds((100, 1, 1, 100), 2) == [(0, 2), (2, 4)]
    assert fragment_bounds((5, 1000, 5), 3) == [(0, 1), (1, 2), (2, 3)]
    assert fragment_bounds((640, 32, 128, 4), 1) == [(0, 4)]
    with pytest.raises(ValueError):
        fragment_bounds((1, 2), 3)


@pytest.mark.parametrize("text, message", [
    ("diloco", "needs the number of local steps"), ("diloco:4:nesterov", "unknown diloco option"),
    ("diloco:4:lr=0", "outer lr must be > 0"), ("streaming:4:fragments=5", "from 1 to H=4"),
    ("streaming:4:overlap=4", "from 0 to H-1=3"), ("streaming:4:mix=2", "mix=A must be in [0, 1]"),
    ("streaming:4:bogus", "unknown streaming option")])
def test_bad_diloco_specs_say_what_to_write(text, message):
    with pytest.raises(EdgetrainError, match=re.escape(message)):
        parse_sync(text)


def test_diloco_is_local_sgd_with_the_outer_step():
    assert parse_sync("diloco:8:lr=1:momentum=0") == parse_sync("local:8:nesterov:lr=1:momentum=0").__class__(
        "local", period=8, nesterov=True, outer_lr=1.0, outer_momentum=0.0, text="diloco:8:lr=1:momentum=0")


@pytest.mark.parametrize("options, message", [
    (dict(round_deadline="auto"), "does not have"),              # no rounds for a deadline to close
    (dict(devices=2, min_devices=1), "is not elastic yet"),      # elastic membership: refused in one line
    (dict(compress="threshold:0.01"), "cannot carry"),           # background exchanges need a fixed payload size
])
def test_streaming_refuses_what_it_cannot_do(options, message):
    from edgetrain.config import load_config, resolve

    with pytest.raises(EdgetrainError, match=message):
        resolve(load_config(None, sync="streaming:4", **options))


def test_diloco_benchmark_help_lists_its_methods():
    import subprocess
    import sys

    from edgetrain_testing import REPO

    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "diloco.py"), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "sparseloco32-8%" in done.stdout and "peer-diloco16" in done.stdout


def test_diloco_benchmark_models_and_its_twin_against_peer_line():
    """benchmarks/diloco.py's --model choices build what its comment says, and each edgetrain twin is compared with
    its torchft peer paired by seed (the mean difference and both one-sided bounds), only where both ran."""
    import importlib.util
    import sys

    from edgetrain_testing import REPO

    spec = importlib.util.spec_from_file_location("diloco_bench", REPO / "benchmarks" / "diloco.py")
    bench = importlib.util.module_from_spec(spec)
    argv, sys.argv = sys.argv, ["diloco.py"]
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.argv = argv
    sizes = {name: sum(p.numel() for p in factory().parameters()) for name, factory in bench.MODELS.items()}
    assert sizes == {"edgecnn": 288_554, "mlp": 411_146}
    assert bench.MODELS["mlp"]()(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    rows = [{"label": label, "seed": seed, "accuracy": acc} for label, seed, acc in [
        ("diloco16", 0, 0.50), ("peer-diloco16", 0, 0.49), ("diloco16", 1, 0.47), ("peer-diloco16", 1, 0.47),
        ("diloco16", 2, 0.52), ("peer-diloco16", 2, 0.50), ("streaming16", 0, 0.4)]]
    lines = bench.versus_peers(rows, ["fp32", "diloco16", "peer-diloco16", "streaming16", "peer-streaming16"],
                               [0, 1, 2])
    assert len(lines) == 1 and lines[0].startswith("diloco16 - peer-diloco16, paired over seeds [0, 1, 2]: +1.00")
    low = 1.0 - 2.919986 * 1.0 / 3 ** 0.5  # t(0.95, 2 df) x sd 1 point / sqrt(3)
    assert f"bounds {low:+.2f} / {2 - low:+.2f}" in lines[0]
