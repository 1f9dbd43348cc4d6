"""Tiled training on emulated devices (spawned processes, gloo) equals training on one device."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.errors import EdgetrainError
from edgetrain.spec import parse_grid, parse_tiling
from edgetrain.tiling import TiledTraining

from edgetrain_testing import on_devices
from .models import PLAIN_SHAPE, batch, build, plain_net, reference_grads, rel_err
from .workers import first_broadcast_to_a_silent_peer, run

# (model, groups, dtype): one fused group, several groups, residual blocks tiled, auto, float32.
CASES = {
    "1x2": [("plain", [14], "float64"), ("plain", [3, 7, 11, 14], "float64"), ("resnet", [3, 5], "float64"),
            ("yolo", "auto", "float32")],
    "2x1": [("plain", [14], "float64"), ("plain", [4, 10, 14], "float64"), ("resnet", "auto", "float64")],
    "2x2": [("plain", [14], "float64"), ("plain", list(range(1, 15)), "float32"), ("resnet", [3, 5], "float64"),
            ("plain", "auto", "float64"), ("resnet18", "auto", "float64"), ("resnet18", [3, 5, 7], "float64")],
    "1x3": [("plain", [14], "float64"), ("plain", [7, 14], "float64"), ("resnet", [3, 5], "float32")],
}


@pytest.mark.parametrize("grid", list(CASES))
def test_loss_and_gradients_equal_single_device(grid):
    """One step per case; on 2x2 the same processes then train 3 steps (checked below)."""
    rows, cols = parse_grid(grid)
    results = on_devices(run, rows * cols, grid, CASES[grid], ("resnet", [3, 5], 3) if grid == "2x2" else None)
    for device in results:
        for r in device["cases"]:
            tolerance = 1e-9 if "float64" in r["case"] else 1e-4
            assert r["loss_err"] <= tolerance, r
            assert r["grad_err"] <= tolerance, r  # the worst of all parameters
            assert r["samples"] == 5
            assert r["bytes"] > 0 and all(p > 0 for p in r["peak"])
    assert any(len(r["groups"]) > 1 for r in results[0]["cases"]), "some case must exchange halos between groups"
    if grid == "2x2":
        check_k_steps(results[0]["training"])


def check_k_steps(r: dict) -> None:
    """Training k steps gives the same parameters (and BatchNorm buffers) as training on one device."""
    assert r["err"] <= 1e-4, r  # every parameter and BatchNorm buffer, float32
    assert r["changed"] > 1e-3, r  # the parameters did move, so the comparison means something
    assert set(r["tracked"].values()) == {3}
    assert "at least 4" in r["small_batch_error"]
    for loss, ref_loss in r["losses"]:
        assert loss == pytest.approx(ref_loss, rel=1e-5)


def test_one_device_grid_needs_no_process_group():
    model, shape = build("plain", torch.float64)
    x, y = batch(shape, 3, torch.float64)
    ref_loss, ref = reference_grads(model, x, y)
    tiled = TiledTraining(model, parse_tiling("1x1", "auto"), shape)
    loss, correct, n = tiled.forward_backward(x, y, F.cross_entropy)
    assert n == 3 and 0 <= correct <= 3
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    for name, p in model.named_parameters():
        assert rel_err(p.grad, ref[name]) < 1e-12, name
    report = tiled.report()
    assert report["recompute_overhead_pct"] == pytest.approx(0.0)
    assert report["peak_memory_bytes_tiled_section"][0] > 0


@pytest.mark.parametrize("text,want", [("2x2", (2, 2)), ("1x3", (1, 3)), (" 3X1 ", (3, 1))])
def test_parse_grid(text, want):
    assert parse_grid(text) == want


@pytest.mark.parametrize("text", ["2", "2x", "0x2", "axb", "2x2x2", ""])
def test_parse_grid_rejects(text):
    with pytest.raises(EdgetrainError, match="grid"):
        parse_grid(text)


@pytest.mark.parametrize("groups,match", [
    ([15], r"'14' \(AdaptiveAvgPool2d\) cannot be tiled"),  # adaptive pooling in the tiled section
    ([17], r"'14' \(AdaptiveAvgPool2d\)"),  # the first untileable layer is named, not the Linear after it
    ([30], "past the model's 17 layers"),
    ([5, 3], "increasing"),
    ("4;8", "neither 'auto' nor"),
])
def test_impossible_groups_are_one_clear_error(groups, match):
    with pytest.raises(EdgetrainError, match=match):
        TiledTraining(plain_net(), parse_tiling("1x1", groups), PLAIN_SHAPE)


def test_linear_and_dropout_in_the_tiled_section_are_named():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 21 * 17, 2))
    with pytest.raises(EdgetrainError, match=r"'1' \(Flatten\) cannot be tiled"):
        TiledTraining(model, parse_tiling("1x1", [2]), PLAIN_SHAPE)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Dropout(0.5), nn.Flatten())
    with pytest.raises(EdgetrainError, match=r"'1' \(Dropout\).*random mask"):
        TiledTraining(model, parse_tiling("1x1", [2]), PLAIN_SHAPE)


def test_grid_larger_than_the_feature_map_names_the_layer():
    # The plain net's maps end at 6x5: five columns cannot be shared by eight tiles.
    with pytest.raises(EdgetrainError, match=r"grid 1x8 is larger than the feature map after layer '\d+'"):
        TiledTraining(plain_net(), parse_tiling("1x8", [14]), PLAIN_SHAPE)
    with pytest.raises(EdgetrainError, match="larger than the feature map"):
        TiledTraining(plain_net(), parse_tiling("30x1", [3]), PLAIN_SHAPE)


def test_grid_must_match_the_devices_running():
    with pytest.raises(EdgetrainError, match="grid 1x2 needs 2 devices but 1 are running"):
        TiledTraining(plain_net(), parse_tiling("1x2", [14]), PLAIN_SHAPE)


def test_wrong_input_shape_is_one_clear_error():
    tiled = TiledTraining(plain_net(), parse_tiling("1x1", [14]), PLAIN_SHAPE)
    with pytest.raises(EdgetrainError, match="does not match input_shape"):
        tiled.forward_backward(torch.randn(2, 3, 24, 19), torch.zeros(2, dtype=torch.long), F.cross_entropy)


def test_a_silent_peer_is_one_line_naming_the_tiled_collective():
    # the model broadcast waited on gloo's Work directly: its timeout was a raw C++ RuntimeError
    device0, _ = on_devices(first_broadcast_to_a_silent_peer, 2, 1.0)
    assert device0["error"] is not None and "\n" not in device0["error"]
    assert device0["error"].startswith("tiled training: initial model broadcast timed out after 1 s")
    assert "raise --timeout" in device0["error"]


def test_collectives_wait_as_long_as_the_run_timeout():
    # --timeout bounds every tiled exchange (it was a fixed 300 s whatever the run said)
    tiled = TiledTraining(plain_net(), parse_tiling("1x1", [14]), PLAIN_SHAPE, timeout_s=7)
    assert tiled.comm.timeout_s == 7
