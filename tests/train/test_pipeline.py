"""``--strategy pipeline`` (train/pipeline.py, plan/stages.py): one device's parameters, counted bytes, refusals."""
from pathlib import Path

import pytest
import torch
from torch import nn

from edgetrain_testing import FAST
from edgetrain import train
from edgetrain.config import TrainConfig, resolve
from edgetrain.errors import EdgetrainError
from edgetrain.plan.stages import check_sequential, pipeline_layers, stage_bounds
from edgetrain.spec import PipelineSpec

HIDDEN = 24


class DigitsMlp(nn.Module):
    """No BatchNorm: micro-batches then change nothing but the order of summation."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN),
                                  nn.Tanh(), nn.Linear(HIDDEN, 10))

    def forward(self, x):
        return self.body(x)


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
    return torch.load(Path(summary["run_dir"]) / "checkpoint.pt", weights_only=True)["model"]


@pytest.mark.slow
def test_pipeline_gives_one_devices_parameters_after_k_steps_and_counts_each_cut(tmp_path):
    steps, batch = 3, 32
    cfg = dict(dataset="digits", steps=steps, batch_size=batch, lr=0.1, output=str(tmp_path), **FAST)
    one = _weights(train(cfg, model=_model(), devices=1, run_name="one"))
    runs = {"gpipe": train(cfg, model=_model(), devices=2, strategy="pipeline", microbatches=4, run_name="gpipe"),  # planned
            "1f1b": train(cfg, model=_model(), devices=3, strategy="pipeline", stages="2,4", microbatches=8,
                          pipeline_schedule="1f1b", run_name="1f1b")}
    for name, summary in runs.items():
        assert summary["strategy"] == "pipeline" and summary["steps"] == steps, name
        for key, value in one.items():
            assert torch.allclose(_weights(summary)[key], value, rtol=1e-5, atol=1e-6), (name, key)
    # Each cut carries a (micro-batch x features) fp32 activation forwards and its gradient backwards.
    # Planned over 2 equal devices: the first Linear (the most FLOPs: 64 inputs) alone against the rest,
    # cut after it (HIDDEN features); stages 2,4: after the first Linear and after the second.
    per_cut = 2 * batch * HIDDEN * 4
    assert runs["gpipe"]["bytes_sent_total"] == steps * per_cut
    assert runs["1f1b"]["bytes_sent_total"] == steps * 2 * per_cut
    assert runs["gpipe"]["pipeline"]["stages"] == ["stage 0: layers 0-1 (body.0 .. body.1)",
                                                   "stage 1: layers 2-5 (body.2 .. body.5)"]
    assert runs["gpipe"]["pipeline"]["plan"][-1].startswith("bottleneck stage 0")


@pytest.mark.parametrize("options, message", [
    (dict(link="wifi-20m"), "config key 'link' wifi-20m does not apply to strategy pipeline"),
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
