"""Evaluation within the memory training uses: batches of the device's training batch, not a fixed 256; the
issue's reproduction (a 512 MiB Raspberry Pi Zero 2 W under a real cgroup memory limit) passes."""
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edgetrain.cluster.memory import SavedTensorMeter
from edgetrain.comm.accounting import CommStats
from edgetrain.config import TrainConfig, resolve
from edgetrain.data import synthetic
from edgetrain.models import build_model
from edgetrain.train.strategy import Strategy, StrategyContext
from edgetrain_testing import run_cli

REAL = Path("/sys/fs/cgroup")
HAS_V1 = os.geteuid() == 0 and (REAL / "memory" / "cgroup.procs").is_file()


class Alone(Strategy):
    """One device, the default ``evaluate``: what every strategy but the pipeline evaluates with."""

    def setup(self, model):
        self.model = model

    def train_step(self, x, y, optimizer):
        raise NotImplementedError

    @property
    def eval_model(self):
        return self.model


def _working_set(model, record: list[tuple[int, int]]):
    """Forward hooks: (batch, the most bytes any layer's input and output held together) of each forward pass,
    appended to ``record``. Without gradients a layer's input is freed once the next layer has run, so that is
    what an evaluation pass holds at its peak (activations only)."""
    held: list[int] = []

    def layer(module, args, out):
        held.append(sum(t.numel() * t.element_size() for t in (*args, out) if isinstance(t, torch.Tensor)))

    def whole_pre(module, args):
        held.clear()

    def whole(module, args, out):
        record.append((len(args[0]), max(held)))

    leaves = [m for m in model.modules() if not list(m.children())]
    return ([m.register_forward_hook(layer) for m in leaves] + [model.register_forward_pre_hook(whole_pre),
                                                                 model.register_forward_hook(whole)])


def test_evaluation_holds_no_more_activations_than_a_training_step():
    local_batch = 16
    data = synthetic(640, 16, seed=0)  # a test set of 160: once one batch of 160 (256 at most), now 10 of 16
    model = build_model("small_cnn", in_channels=3)
    context = StrategyContext(TrainConfig(), resolve(TrainConfig()), rank=0, world=1, local_batch=local_batch,
                              input_shape=(3, 16, 16), stats=CommStats())
    strategy = Alone(context)
    strategy.setup(model)
    x, y = next(iter(torch.utils.data.DataLoader(data.train, batch_size=local_batch)))
    params = list(model.parameters()) + list(model.buffers()) + [x]
    with SavedTensorMeter(params) as meter:
        F.cross_entropy(model(x), y).backward()
    training_bytes = meter.bytes

    passes: list[tuple[int, int]] = []
    _working_set(model, passes)
    strategy.evaluate(data.test)
    assert passes and max(batch for batch, _ in passes) <= local_batch, passes
    # what an evaluation pass holds at its peak, against what a training step saves for backward
    assert max(held for _, held in passes) <= training_bytes, (passes, training_bytes)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_V1, reason="needs root and cgroup v1 memory")
def test_a_512_mib_device_evaluates_1280_images_from_storage_within_its_cgroup(tmp_path):
    """The reproduction: killed by the out-of-memory killer at 512 MiB when evaluation took batches of 256."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(4):
        folder = tmp_path / "pics" / f"c{c}"
        folder.mkdir(parents=True)
        for i in range(320):
            Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    proc = run_cli("train", "--dataset", "imagefolder", "--data-dir", str(tmp_path / "pics"), "--from-storage",
                   "--steps", "1", "--batch-size", "16", "--profile", "rpi-zero-2w", "--device-limits", "cgroup",
                   "--no-throttle", "--no-progress", "--output", str(tmp_path / "runs"), timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "test accuracy" in proc.stdout
