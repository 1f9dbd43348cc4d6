"""The loop drives any ``Strategy``; records are written as they happen; ``--accelerator``."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from edgetrain_testing import FAST, run_cli
from edgetrain import train
from edgetrain.records import EvalRecord, StepRecord
from edgetrain.train.strategy import StepResult, Strategy


class AllReduceEveryStep(Strategy):
    """Data parallelism by hand: the interface and nothing else (no DDP, no comm package)."""

    name = "allreduce-every-step"

    def setup(self, model):
        self.model = model
        for p in model.parameters():
            dist.broadcast(p.data, src=0)

    def train_step(self, x, y, optimizer):
        optimizer.zero_grad(set_to_none=True)
        out = self.model(x)
        loss_sum = F.cross_entropy(out, y, reduction="sum")
        (loss_sum / self.context.cfg.batch_size).backward()
        started = time.perf_counter()
        for p in self.model.parameters():
            dist.all_reduce(p.grad)  # the sum over devices of each share: the global batch's gradient
        comm_s = time.perf_counter() - started
        optimizer.step()
        return StepResult(loss_sum.item(), int((out.argmax(1) == y).sum()), len(y), comm_s)

    @property
    def eval_model(self):
        return self.model


def _weights(summary):
    state = torch.load(Path(summary["run_dir"]) / "checkpoint.pt", weights_only=True)["model"]
    return {k: v for k, v in state.items() if "running" not in k and "num_batches" not in k}


@pytest.mark.slow
def test_a_strategy_written_outside_the_package_trains_end_to_end_and_matches_ddp(tmp_path):
    cfg = dict(dataset="digits", steps=3, batch_size=32, devices=2, output=str(tmp_path), **FAST)
    mine = train(cfg, strategy=AllReduceEveryStep, run_name="mine")
    ddp = train(cfg, run_name="ddp")
    assert mine["strategy"] == "allreduce-every-step" and ddp["strategy"] == "ddp" and mine["steps"] == 3
    records = [StepRecord.from_dict(json.loads(line))
               for line in (tmp_path / "mine" / "metrics.jsonl").read_text().splitlines()]
    assert [(r.step, r.rank) for r in records] == [(s, r) for s in range(3) for r in range(2)]
    for key, value in _weights(ddp).items():  # the same mathematics as DDP's averaged all-reduce
        assert torch.allclose(_weights(mine)[key], value, rtol=1e-4, atol=1e-6), key


def test_a_killed_run_keeps_the_steps_it_recorded(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "edgetrain", "train", "--devices", "2", "--epochs", "1000",
                             "--batch-size", "16", "--no-eval", "--no-progress", "--no-throttle",
                             "--output", str(tmp_path), "--run-name", "killed"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    live = [tmp_path / "killed" / f"metrics-{rank}.jsonl" for rank in range(2)]
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not all(p.is_file() and len(p.read_text().splitlines()) >= 3
                                                      for p in live):
            assert proc.poll() is None, "the run ended before it was killed"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert not (tmp_path / "killed" / "summary.json").exists()
    for rank, path in enumerate(live):
        records = [StepRecord.from_dict(json.loads(line)) for line in path.read_text().splitlines()]
        assert len(records) >= 3 and {r.rank for r in records} == {rank}
        assert [r.step for r in records] == list(range(len(records)))


def test_evaluations_are_appended_as_they_happen_and_printed_without_a_bar(tmp_path):
    proc = run_cli("train", "--devices", "1", "--epochs", "2", "--batch-size", "512", "--steps", "100",
                   "--no-progress", "--no-throttle", "--accelerator", "cpu", "--output", str(tmp_path),
                   "--run-name", "evals")
    assert proc.returncode == 0, proc.stderr
    assert "epoch 1/2: test accuracy" in proc.stdout and "epoch 2/2: test accuracy" in proc.stdout
    # --steps beyond the epochs: the epochs end the run, and the user is told so once, even without progress
    assert proc.stderr.count("edgetrain: note: --steps 100 ends with --epochs 2 after") == 1, proc.stderr
    evals = [EvalRecord.from_dict(json.loads(line))
             for line in (tmp_path / "evals" / "evals.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "evals" / "summary.json").read_text())
    assert [e.epoch for e in evals] == [0, 1] and [e.to_dict() for e in evals] == summary["evals"]
    assert summary["accelerator"] == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a host without a CUDA GPU")
def test_cuda_without_a_gpu_is_one_line_before_any_device_starts(tmp_path):
    proc = run_cli("train", "--accelerator", "cuda", "--output", str(tmp_path / "runs"))
    assert proc.returncode == 2
    assert proc.stderr.startswith("edgetrain: error: accelerator cuda") and len(proc.stderr.splitlines()) == 1
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_devices_train_on_the_gpu_over_gloo(tmp_path):
    summary = train(dict(dataset="digits", steps=3, batch_size=32, devices=2, accelerator="cuda",
                         output=str(tmp_path), **FAST))
    assert summary["accelerator"].startswith("cuda") and summary["steps"] == 3
    assert summary["train_loss"] == summary["train_loss"]  # not nan


# Every strategy and exchange on a GPU, collectives on gloo. First run on an H200 (benchmarks/gpu_check.sh), six
# of these failed: CPU tensors made beside CUDA ones, gloo's point-to-point with CUDA tensors, torch's device
# mesh picking GPU LOCAL_RANK for emulated devices sharing one GPU.
GPU_RUNS = {
    "topk": dict(compress="topk:0.01"), "powersgd": dict(compress="powersgd:2"), "qsgd": dict(compress="qsgd:8"),
    "sign": dict(compress="sign"), "batchnorm-sync": dict(batchnorm="sync"), "local": dict(sync="local:4"),
    "async": dict(sync="async:2"), "gossip": dict(sync="gossip"),
    "fedavg": dict(sync="fedavg:1", partition="dirichlet:0.5"),
    "tiled": dict(strategy="tiled", grid="2x1"), "fsdp": dict(strategy="fsdp"),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("run", GPU_RUNS, ids=list(GPU_RUNS))
def test_every_strategy_and_exchange_trains_on_the_gpu(tmp_path, run):
    summary = train(dict(dataset="digits", steps=6, batch_size=32, devices=2, accelerator="cuda",
                         output=str(tmp_path), **FAST, **GPU_RUNS[run]))
    assert summary["accelerator"].startswith("cuda") and summary["steps"] == 6
    assert summary["train_loss"] == summary["train_loss"]  # not nan


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pipeline_on_the_gpu_is_refused_in_one_line(tmp_path):
    proc = run_cli("train", "--strategy", "pipeline", "--accelerator", "cuda", "--devices", "2", "--steps", "2",
                   "--no-progress", "--output", str(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert "gloo cannot do with CUDA tensors" in proc.stderr and "Traceback" not in proc.stderr
