"""``--strategy pipeline`` (train/pipeline.py, pipelining/stages.py): one device's parameters, counted bytes, the
link-charged timeline, refusals."""
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from edgetrain_testing import NEEDS_POOLED, FAST, DigitsMlp, keys_written_by_rank

pytestmark = NEEDS_POOLED
from edgetrain import load_checkpoint, train
from edgetrain.cluster.links import round_seconds
from edgetrain.config import TrainConfig, resolve
from edgetrain.errors import EdgetrainError
from edgetrain.models import register_model
from edgetrain.pipelining.stages import (BACKWARD, FORWARD, check_sequential, pipeline_layers, pipeline_timeline,
                                   schedule_order, stage_bounds)
from edgetrain.spec import PipelineSpec

HIDDEN = DigitsMlp.HIDDEN


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x)) + x


def _model():
    torch.manual_seed(0)  # a fresh, identical model for every run (a 1-device run may train the one it is given)
    return DigitsMlp()


def _weights(summary):
    return load_checkpoint(summary["run_dir"])["model"]  # checkpoint.pt, or a pipeline's checkpoint/ of parts


@pytest.mark.slow
def test_pipeline_gives_one_devices_parameters_after_k_steps_and_counts_each_cut(tmp_path):
    steps, batch = 3, 32
    cfg = dict(dataset="digits", steps=steps, batch_size=batch, lr=0.1, output=str(tmp_path), **FAST)
    one = _weights(train(cfg, model=_model(), devices=1, run_name="one"))
    # gpipe over a slow link (the timeline: below), 1f1b on the host's own network
    runs = {"gpipe": train(cfg, model=_model(), devices=2, strategy="pipeline", microbatches=4, link=SLOW_LINK,
                           run_name="gpipe"),  # planned
            "1f1b": train(cfg, model=_model(), devices=3, strategy="pipeline", stages="2,4", microbatches=8,
                          pipeline_schedule="1f1b", run_name="1f1b")}
    for name, summary in runs.items():
        assert summary["strategy"] == "pipeline" and summary["steps"] == steps, name
        # read back whole by the public loader from every device's part (checkpoint/), model and optimizer
        final = load_checkpoint(summary["run_dir"])
        assert final["model"].keys() == one.keys() and final["step"] == steps, name
        for key, value in one.items():
            assert torch.allclose(final["model"][key], value, rtol=1e-5, atol=1e-6), (name, key)
        assert set(final["optimizer"]["state"]) == {k for k in one if k.endswith(("weight", "bias"))}, name
    # Each cut carries a (micro-batch x features) fp32 activation forwards and its gradient backwards.
    # Planned over 2 equal devices: the first Linear (the most FLOPs: 64 inputs) alone against the rest,
    # cut after it (HIDDEN features); stages 2,4: after the first Linear and after the second.
    per_cut = 2 * batch * HIDDEN * 4
    assert runs["gpipe"]["bytes_sent_total"] == steps * per_cut
    assert runs["1f1b"]["bytes_sent_total"] == steps * 2 * per_cut
    assert runs["gpipe"]["pipeline"]["stages"] == ["stage 0: layers 0-1 (body.0 .. body.1)",
                                                   "stage 1: layers 2-5 (body.2 .. body.5)"]
    # over 1 Mbit/s the cut's transfers, not a stage, bound the step: the planner says so
    assert runs["gpipe"]["pipeline"]["plan"][-1].startswith("bottleneck the link after stage 0")
    assert runs["1f1b"]["link_mode"] == "none" and runs["1f1b"]["comm_time_is"] == "measured"
    _check_gpipe_timeline(runs["gpipe"], microbatches=4, activation_bytes=batch // 4 * HIDDEN * 4)


@pytest.mark.slow
def test_a_model_passed_built_with_odd_widths_pipelines_as_one_device_trains_it(tmp_path):
    def built():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 7, 3), nn.ReLU(), nn.Flatten(), nn.Linear(7 * 6 * 6, 37), nn.Tanh(),
                             nn.Linear(37, 10))

    cfg = dict(dataset="digits", steps=3, batch_size=32, lr=0.1, output=str(tmp_path), **FAST)
    one = _weights(train(cfg, model=built(), devices=1, run_name="one"))
    piped = load_checkpoint(train(cfg, model=built(), devices=2, strategy="pipeline", stages="even",
                                  microbatches=2, run_name="piped")["run_dir"])
    assert piped["model"].keys() == one.keys() and piped["step"] == 3
    initial = built().state_dict()
    for key, value in one.items():
        assert not torch.equal(value, initial[key]), key  # it trained
        assert torch.allclose(piped["model"][key], value, rtol=1e-5, atol=1e-6), key


SLOW_LINK, LATENCY, BANDWIDTH = "1mbit:100ms", 0.100, 125_000  # bytes/s; no jitter
FORWARD_S, BACKWARD_S, TRANSFER_S = 1.0, 2.0, 0.5


def _check_gpipe_timeline(summary, microbatches, activation_bytes):
    """Two stages, GPipe, a link whose latency dwarfs compute: each stage's link carries 2 M transfers a step,
    queued on the sender's link, so stage 0's step lasts 2 M transfers plus at most both stages' compute."""
    # one p2p round of the link model (edgetrain.cluster.links; its formula: tests/comm/test_comm_links.py)
    transfer = round_seconds(LATENCY, activation_bytes, BANDWIDTH, "p2p")
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    clock = {0: 0.0, 1: 0.0}
    for step in range(summary["steps"]):
        mine = {r["rank"]: r for r in records if r["step"] == step}
        for r in mine.values():
            assert r["virtual_comm_s"] == pytest.approx(2 * microbatches * transfer)
        elapsed = mine[0]["virtual_s"] - clock[0]
        assert 2 * microbatches * transfer <= elapsed <= (2 * microbatches * transfer + mine[0]["virtual_compute_s"]
                                                          + mine[1]["virtual_compute_s"] + 1e-9)
        clock = {rank: r["virtual_s"] for rank, r in mine.items()}
    assert summary["link_mode"] == "virtual" and summary["virtual_time_max_device_s"] == pytest.approx(clock[0])


def test_the_timeline_shows_the_bubble_and_queues_each_stages_sends():
    # 2 stages, GPipe, 2 micro-batches: forward 1 s, backward 2 s, each transfer 0.5 s. By hand:
    # stage 0: F0 0-1 (a0 arrives 1.5), F1 1-2 (a1 arrives 2.5), then waits for g0; B0 6-8, B1 8-10
    # stage 1: F0 1.5-2.5, F1 2.5-3.5, B0 3.5-5.5 (g0 arrives 6), B1 5.5-7.5 (g1 arrives 8)
    order = schedule_order("gpipe", 0, 2, 2)
    assert order == [(FORWARD, 0), (FORWARD, 1), (BACKWARD, 0), (BACKWARD, 1)]
    actions = [[(kind, chunk, FORWARD_S if kind == FORWARD else BACKWARD_S) for kind, chunk in order]] * 2
    ends, link_s = pipeline_timeline([0.0, 0.0], actions, lambda kind, sender, receiver: TRANSFER_S)
    assert ends == [10.0, 7.5] and link_s == [2.0, 2.0]
    # stage 0 computed 6 s of its 10: the bubble and the transfers on the critical path are the rest;
    # a stage that starts later (its clock ahead) delays the other through the sends
    assert pipeline_timeline([0.0, 3.0], actions, lambda *_: TRANSFER_S)[0] == [11.5, 9.0]


def test_1f1b_order_is_pytorchs():
    # stage 0 of 2, 4 micro-batches: 2 warm-up forwards, one backward and one forward in turn, then the rest
    assert schedule_order("1f1b", 0, 2, 4) == [(FORWARD, 0), (FORWARD, 1), (BACKWARD, 0), (FORWARD, 2),
                                               (BACKWARD, 1), (FORWARD, 3), (BACKWARD, 2), (BACKWARD, 3)]
    assert schedule_order("1f1b", 1, 2, 2) == [(FORWARD, 0), (BACKWARD, 0), (FORWARD, 1), (BACKWARD, 1)]


@pytest.mark.parametrize("options, message", [
    (dict(link="wifi-20m", link_mode="enforced"), "link mode enforced does not apply to strategy pipeline"),
    (dict(batchnorm="sync"), "each BatchNorm lives on one stage"),
    (dict(microbatches=5), "microbatches' 5 does not divide batch_size 64"),
    (dict(stages="4,2"), "increasing layer indices"),
    (dict(stages="2,4", devices=2), "make 3 stages, one per device; set --devices 3"),
    (dict(stages="4,x"), "neither auto, even nor increasing layer indices"),
])
def test_pipeline_refuses_what_it_cannot_run(options, message):
    with pytest.raises(EdgetrainError, match=message):
        resolve(TrainConfig(strategy="pipeline", **options))


def test_stages_need_strategy_pipeline():
    for stages in ("4", "even"):
        with pytest.raises(EdgetrainError, match=f"'stages' {stages} needs strategy pipeline"):
            resolve(TrainConfig(stages=stages))


def test_a_model_whose_forward_is_not_its_layers_in_order_is_refused_naming_them():
    with pytest.raises(EdgetrainError, match=r"cannot be cut into pipeline stages: .*\(a, b\)"):
        check_sequential(Residual(), torch.randn(2, 4))
    check_sequential(DigitsMlp(), torch.randn(2, 1, 8, 8))  # a sequence: accepted


def test_a_stage_past_the_last_layer_is_named():
    layers = pipeline_layers(DigitsMlp())
    assert stage_bounds(PipelineSpec(None, 1, "gpipe"), layers, 3) == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(EdgetrainError, match="cannot start at layer 6: .*the last is body.5"):
        stage_bounds(PipelineSpec((2, 6), 1, "gpipe"), layers, 3)
    with pytest.raises(EdgetrainError, match=r"stage 1 \(layers 2-2: body.2\) has no parameters to train"):
        stage_bounds(PipelineSpec((2, 3), 1, "gpipe"), layers, 3)
    with pytest.raises(EdgetrainError, match="6 layers, too few for 7 pipeline stages"):
        stage_bounds(PipelineSpec(None, 1, "gpipe"), layers, 7)


def test_one_stage_is_the_whole_model():
    layers = pipeline_layers(DigitsMlp())
    for starts in (None, ()):  # even, and what the planner gives one device
        assert stage_bounds(PipelineSpec(starts, 1, "gpipe"), layers, 1) == [(0, 6)]


BIG = 4096  # a BIG x BIG fp32 layer is 64 MiB: past glibc's mmap threshold, so receiving one shows in VmHWM


class TwoBigLayers(nn.Module):
    """With stages "4": stage 0 holds Linear(64, BIG) and one BIG x BIG layer, stage 1 the other and the head."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, BIG), nn.ReLU(), nn.Linear(BIG, BIG), nn.ReLU(),
                                  nn.Linear(BIG, BIG), nn.ReLU(), nn.Linear(BIG, num_classes))

    def forward(self, x):
        return self.body(x)


@pytest.mark.slow
def test_at_the_end_each_device_writes_its_own_stage_and_receives_no_other(tmp_path):
    # Built by name, so each device builds it on meta and materialises its own stage only (models/init.py).
    register_model("two_big_layers", TwoBigLayers)
    # One micro-batch and no weight decay: a step then makes no layer-sized temporaries (accumulating a second
    # micro-batch's gradient, SGD's weight-decay term), which would hide a received layer under the steps' peak.
    summary = train(dict(model="two_big_layers", dataset="digits", steps=2, batch_size=16, microbatches=1, lr=0.01,
                         weight_decay=0.0, output=str(tmp_path), **FAST), devices=2, strategy="pipeline", stages="4")
    layer_mb = BIG * BIG * 4 / 2**20
    # Neither device received the other's BIG x BIG layer at the end (before: rank 0 gathered every stage for
    # checkpoint.pt, 65 MiB more); each wrote its own stage into checkpoint/ (torch.distributed.checkpoint).
    for device in summary["per_device"]:
        assert device["run_peak_rss_mb"] < device["peak_rss_mb"] + layer_mb / 2, device["rank"]
    written = keys_written_by_rank(Path(summary["run_dir"]) / summary["checkpoint"])
    stage = {0: ("body.1.", "body.3."), 1: ("body.5.", "body.7.")}
    assert set(written) == {0, 1}
    for rank, keys in written.items():  # the model and its optimizer state: this device's stage's only
        assert keys and all(any(p in key for p in stage[rank]) for key in keys), (rank, keys)
    weights = _weights(summary)
    assert [tuple(weights[f"body.{i}.weight"].shape) for i in (1, 3, 5, 7)] == [(BIG, 64), (BIG, BIG), (BIG, BIG),
                                                                               (10, BIG)]
    assert all(torch.isfinite(w).all() and w.abs().sum() > 0 for w in weights.values())


class NamedDigitsMlp(DigitsMlp):
    """DigitsMlp as ``build_model`` builds a registered model (by name: every device holds its stage only)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()


class DigitsBatchNormMlp(nn.Module):
    """DigitsMlp with a BatchNorm after each hidden Linear: evaluation must use its running statistics."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        hidden = HIDDEN
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                  nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.Tanh(),
                                  nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.body(x)


def _evaluated_whole(summary, model: nn.Module) -> tuple[float, float]:
    """(loss, accuracy) of the run's final model, read back whole into ``model``, over the whole test set here."""
    from edgetrain.data import build_data
    from edgetrain.train.loop import evaluate

    model.load_state_dict(load_checkpoint(summary["run_dir"])["model"])
    return evaluate(model, build_data(TrainConfig(dataset="digits")).test, rank=0, world=1)


@pytest.mark.slow
@pytest.mark.parametrize("name, architecture, options", [
    ("eval_digits_mlp", NamedDigitsMlp, dict(devices=3, stages="2,4", microbatches=4)),
    ("eval_digits_bn_mlp", DigitsBatchNormMlp, dict(devices=2, stages="3", microbatches=2, pipeline_schedule="1f1b")),
])
def test_pipelined_evaluation_scores_the_final_model_as_one_device_does(tmp_path, name, architecture, options):
    register_model(name, architecture)  # built by name: every device holds its stage only, evaluation included
    # 20 samples per replica batch: the test set (not a multiple of it) ends in a partial batch
    summary = train(dict(model=name, dataset="digits", steps=3, batch_size=20, lr=0.1, output=str(tmp_path),
                         **{**FAST, "eval": True}), strategy="pipeline", **options)
    loss, accuracy = _evaluated_whole(summary, architecture())
    assert summary["test_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert summary["test_loss"] == pytest.approx(loss, rel=1e-5)
    assert summary["bytes_sent_total"] == 3 * 2 * 20 * HIDDEN * 4 * (2 if name == "eval_digits_mlp" else 1)


@pytest.mark.slow
def test_an_evaluating_pipeline_device_receives_no_other_stage(tmp_path):
    # As test_at_the_end_each_device_writes_its_own_stage_and_receives_no_other, with an evaluation at the end:
    # a gathered model would put the other stage's BIG x BIG layer (64 MiB) on each device.
    register_model("two_big_layers", TwoBigLayers)
    summary = train(dict(model="two_big_layers", dataset="digits", steps=2, batch_size=16, microbatches=1, lr=0.01,
                         weight_decay=0.0, output=str(tmp_path), **{**FAST, "eval": True}),
                    devices=2, strategy="pipeline", stages="4")
    assert summary["test_accuracy"] is not None
    layer_mb = BIG * BIG * 4 / 2**20
    for device in summary["per_device"]:
        assert device["run_peak_rss_mb"] < device["peak_rss_mb"] + layer_mb / 2, device["rank"]


@pytest.mark.slow
def test_an_evaluation_between_epochs_changes_nothing_in_training(tmp_path):
    # Stage modules back in train mode, BatchNorm's running statistics untouched, no bytes counted: two epochs
    # with an evaluation after each end on the weights (running statistics included) of two epochs without.
    register_model("eval_digits_bn_mlp", DigitsBatchNormMlp)
    cfg = dict(model="eval_digits_bn_mlp", dataset="digits", epochs=2, batch_size=256, lr=0.1,
               output=str(tmp_path), **FAST)
    runs = {evaluating: train({**cfg, "eval": evaluating}, devices=2, strategy="pipeline", stages="3",
                              microbatches=2, run_name=f"eval-{evaluating}") for evaluating in (False, True)}
    assert [e["epoch"] for e in runs[True]["evals"]] == [0, 1] and not runs[False]["evals"]
    assert runs[True]["bytes_sent_total"] == runs[False]["bytes_sent_total"]
    evaluated, plain = _weights(runs[True]), _weights(runs[False])
    assert evaluated.keys() == plain.keys()
    for key, value in plain.items():
        assert torch.equal(evaluated[key], value), key
