"""Detection under every strategy: tiled, ddp, pipeline and fsdp give one device's training; resume is exact."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from edgetrain import load_checkpoint, train
from edgetrain.data.detection import shapes
from edgetrain.models import register_model
from edgetrain.models.yolo_tiny import VOC_ANCHORS, YoloV2Tiny
from edgetrain.spec import parse_tiling
from edgetrain.tasks.detection import DetectionTask
from edgetrain.tiling import TiledTraining
from edgetrain.train.checkpoint import checkpoint_files, checkpoint_step

from edgetrain_testing import FAST, on_devices

NARROW = (4, 4, 8, 8, 8, 8, 8, 8)
SHAPE = (3, 96, 96)


def narrow_yolo(num_classes: int = 3, in_channels: int = 3, **_) -> YoloV2Tiny:
    return YoloV2Tiny(num_classes, in_channels, NARROW)


class Float64Yolo(nn.Module):
    """The narrow detector in float64, fed the trainer's float32 images: N-device runs compare to 1e-10."""

    def __init__(self):
        super().__init__()
        self.net = narrow_yolo().double()

    def forward(self, x):
        return self.net(x.double())


def darknet_without_batchnorm(num_classes: int = 3, in_channels: int = 3, **_) -> nn.Sequential:
    """The Darknet stack and YOLOv2 head without BatchNorm: micro-batches and shards then change only the order of
    summation, so pipeline and fsdp compare with ddp to float32 rounding."""
    layers, c = [], in_channels
    for i, w in enumerate(NARROW):
        layers += [nn.Conv2d(c, w, 3, padding=1), nn.LeakyReLU(0.1)]
        layers += [nn.MaxPool2d(2, 2)] if i < 5 else [nn.ZeroPad2d((0, 1, 0, 1)), nn.MaxPool2d(2, 1)] if i == 5 else []
        c = w
    return nn.Sequential(*layers, nn.Conv2d(c, len(VOC_ANCHORS) * (5 + num_classes), 1))


def tiled_three_steps(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    data = shapes(18, SHAPE[1], seed=1)
    task = DetectionTask(3, image_size=SHAPE[1:])
    model = narrow_yolo().double()
    reference, initial = copy.deepcopy(model), copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    tiled = TiledTraining(model, parse_tiling("2x2"), SHAPE, task=task)
    opt = torch.optim.SGD(tiled.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    losses = []
    for step in range(3):
        # 6 images a step, shared 1, 2, 1, 2 by the four devices after the tiled section
        x, y = task.collate([data.train[i] for i in range(6 * step, 6 * step + 6)])
        x, y = x.double(), y.double()
        ref_opt.zero_grad()
        ref_loss = task.loss(reference(x), y) / len(x)
        ref_loss.backward()
        ref_opt.step()
        opt.zero_grad()
        loss, _, _ = tiled.forward_backward(x, y)
        opt.step()
        losses.append((loss, ref_loss.item()))
    ref = dict(reference.state_dict())
    mine = dict(model.state_dict())
    err = max((mine[k] - ref[k]).abs().max().item() for k in ref if ref[k].is_floating_point())
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), initial.parameters()))
    return {"err": err, "losses": losses, "moved": moved, "groups": tiled.report()["groups"]}


@pytest.mark.slow
def test_tiled_2x2_trains_the_detector_as_one_device_float64():
    results = on_devices(tiled_three_steps, 4)
    for r in results:
        assert r["err"] <= 1e-10, r  # every parameter and BatchNorm buffer after 3 steps
        assert r["moved"] > 1e-3, r
        for loss, ref_loss in r["losses"]:
            assert loss == pytest.approx(ref_loss, rel=1e-12)


RUN = dict(FAST, dataset="shapes", image_size=64, synthetic_samples=48, batch_size=8, steps=3, optimizer="sgd",
           lr=0.01, momentum=0.9, weight_decay=5e-4)


def final_model(summary) -> dict:
    return load_checkpoint(summary["run_dir"])["model"]  # checkpoint.pt, or a pooled run's checkpoint/ of parts


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


@pytest.mark.slow
def test_ddp_on_two_devices_trains_the_detector_as_one_float64(tmp_path):
    torch.manual_seed(0)
    model = Float64Yolo()
    one = train(dict(RUN, devices=1, output=str(tmp_path), run_name="one"), model=model)
    two = train(dict(RUN, devices=2, batchnorm="sync", output=str(tmp_path), run_name="two"), model=model)
    assert one["steps"] == two["steps"] == 3 and two["task"]["name"] == "detection"
    a, b = final_model(one), final_model(two)
    assert next(iter(a.values())).dtype == torch.float64
    assert max_diff(a, b) <= 1e-10
    assert max_diff(a, model.state_dict()) > 1e-4  # it trained


@pytest.mark.slow
def test_pipeline_and_fsdp_train_a_detector_as_ddp_float32(tmp_path):
    register_model("darknet_no_bn", darknet_without_batchnorm)
    run = dict(RUN, model="darknet_no_bn", devices=2, output=str(tmp_path))
    ddp = final_model(train(dict(run, run_name="ddp")))
    assert max_diff(ddp, final_model(train(dict(run, steps=1, run_name="one-step")))) > 1e-4  # steps move it
    for strategy, extra in (("pipeline", dict(microbatches=2, stages="even")), ("fsdp", {})):
        other = train(dict(run, strategy=strategy, run_name=strategy, **extra))
        assert other["steps"] == 3 and other["strategy"] == strategy
        assert max_diff(ddp, final_model(other)) <= 1e-6, strategy


@pytest.mark.slow
def test_the_tiled_strategy_trains_a_detector_as_one_device(tmp_path):
    """End to end through the trainer (targets cut into shares by the task), float32."""
    register_model("narrow_yolo", narrow_yolo)
    run = dict(RUN, model="narrow_yolo", image_size=96, output=str(tmp_path))
    tiled = train(dict(run, devices=2, strategy="tiled", grid="1x2", run_name="tiled"))
    one = train(dict(run, devices=1, run_name="one"))
    assert tiled["tiling"]["grid"] == "1x2" and tiled["task"]["name"] == "detection"
    assert tiled["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5)
    assert max_diff(final_model(tiled), final_model(one)) <= 1e-5


@pytest.mark.slow
def test_resumed_detection_run_ends_as_the_uninterrupted_one(tmp_path):
    run = dict(RUN, model="yolov2_tiny_small", task="detection", devices=2, steps=6, optimizer="adam", lr=0.001,
               checkpoint_every=2, keep_checkpoints=3, output=str(tmp_path))
    summary = train(run)
    run_dir = Path(summary["run_dir"])
    uninterrupted = final_model(summary)
    assert [checkpoint_step(p) for p in checkpoint_files(run_dir)] == [2, 4]
    checkpoint_files(run_dir)[-1].unlink()  # as if killed after step 2's checkpoint
    resumed = train({"resume": str(run_dir)})
    assert resumed["steps"] == 6
    for name, value in uninterrupted.items():
        assert torch.equal(value, final_model(resumed)[name]), name
