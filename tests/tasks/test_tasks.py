"""Tasks: the interface every strategy drives (tasks/base.py), regression, a task of one's own, --task."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import edgetrain
from edgetrain import train
from edgetrain.data.datasets import DataSplit, TensorSamples, feature_statistics, values_split
from edgetrain.errors import EdgetrainError
from edgetrain.models.sensors import MLP, Conv1DNet
from edgetrain.tasks import build_task
from edgetrain.tasks.base import Evaluator, Metric, Task
from edgetrain.tasks.classification import ClassificationTask
from edgetrain.tasks.regression import RegressionTask

from edgetrain_testing import FAST, run_main


def sensors(n=96, t=12, c=3, k=2, seed=0, dtype=np.float64):
    """Sensor series (N, T, C) whose K targets are linear in their channel means, plus noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, t, c)).astype(dtype)
    y = x.mean(1) @ rng.normal(size=(c, k)) * 10 + 50 + rng.normal(size=(n, k)) * 0.1
    return x, y.astype(dtype)


def sensors_float64(data_dir, seed):
    """A dataset factory giving float64 inputs and targets as a DataSplit of its own (the exactness test)."""
    x, y = (torch.from_numpy(a) for a in sensors())
    mean, std = feature_statistics(x)
    make = lambda a, b: TensorSamples(a, b, mean.double(), std.double())  # noqa: E731
    return DataSplit(make(x[:64], y[:64]), make(x[64:], y[64:]), 2, "sensors64",
                     {"target_mean": y[:64].mean(0).tolist(), "target_std": y[:64].std(0).tolist()})


def weights(summary):
    return torch.load(Path(summary["run_dir"]) / "checkpoint.pt", weights_only=True)["model"]


def test_classification_task_scores_as_before():
    out, y = torch.randn(7, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 0, 1, 2])
    task = ClassificationTask()
    assert task.loss(out, y).item() == pytest.approx(nn.functional.cross_entropy(out, y, reduction="sum").item())
    assert task.train_counts(out, y) == {"correct": int((out.argmax(1) == y).sum())}
    halves = [task.evaluator() for _ in range(2)]
    halves[0].update(out[:3], y[:3]), halves[1].update(out[3:], y[3:])
    merged = type(halves[0]).merge([h.state() for h in halves])
    assert merged["accuracy"] == pytest.approx((out.argmax(1) == y).double().mean().item())
    assert merged["loss"] == pytest.approx(nn.functional.cross_entropy(out, y).item())


def test_regression_loss_is_a_sum_and_metrics_are_in_the_targets_unit():
    task = RegressionTask(mean=[10.0, 0.0], std=[2.0, 1.0])
    out = torch.tensor([[0.5, 1.0], [-1.0, 2.0]], dtype=torch.float64)
    y = torch.tensor([[11.0, 1.0], [8.0, 0.0]], dtype=torch.float64)
    assert task.loss(out, y).item() == pytest.approx(4.0)  # only the last value is off: (2 - 0)^2 standardised
    evaluators = [task.evaluator() for _ in range(2)]
    evaluators[0].update(out[:1], y[:1]), evaluators[1].update(out[1:], y[1:])
    merged = type(evaluators[0]).merge([e.state() for e in evaluators])
    assert merged == pytest.approx({"loss": 2.0, "rmse": 1.0, "mae": 0.5})  # errors (0, 0, 0, 2) in the unit


def test_regression_of_one_target_takes_a_model_output_of_width_one():
    task = RegressionTask(5.0, 1.0)
    out, y = torch.zeros(3, 1), torch.tensor([5.0, 6.0, 4.0])
    assert task.loss(out, y).item() == pytest.approx(2.0)
    task.check(out, y)
    with pytest.raises(EdgetrainError, match=r"outputs of shape \(3,\) per sample .* num_classes=1"):
        task.check(torch.zeros(3, 3), y)
    with pytest.raises(EdgetrainError, match="needs real-valued targets"):
        task.check(out, torch.tensor([1, 2, 3]))


def test_models_for_vectors_and_series():
    assert MLP(10, 2)(torch.randn(4, 10)).shape == (4, 2)
    assert Conv1DNet(3, 2)(torch.randn(4, 12, 3)).shape == (4, 2)
    assert Conv1DNet(3, 2)(torch.randn(4, 40, 3)).shape == (4, 2)  # any series length


def test_npz_and_csv_regression_readers(tmp_path):
    from edgetrain.config import TrainConfig
    from edgetrain.data import build_data

    x, y = sensors(n=30, k=1)
    np.savez(tmp_path / "s.npz", x=x, y=y[:, 0])
    data = build_data(TrainConfig(dataset="npz", data_dir=str(tmp_path / "s.npz"), task="regression"))
    assert data.input_shape == (12, 3) and data.num_classes == 1 and data.in_channels == 3
    assert len(data.train) == 24 and len(data.test) == 6 and data.train.labels.dtype == torch.float32
    rows = ["a,b,y"] + [f"{i},{i * 2},{i * 3.5}" for i in range(10)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    table = build_data(TrainConfig(dataset="csv", data_dir=str(tmp_path / "t.csv"), task="regression"))
    assert table.input_shape == (2,) and table.num_classes == 1 and len(table.train) == 8
    assert table.details["target_mean"][0] == pytest.approx(table.train.labels.double().mean().item())


@pytest.mark.parametrize("body, match", [
    ("a,y\n1,2\n2,nan\n3,4\n4,5\n5,6\n", r"t\.csv: target y is \[nan\] at line 3; regression targets must be finite"),
    ("a,y\n1,2\n2,x\n", r"t\.csv line 3: 'x' is not a number"),
    ("a,b\n1,2\n", r"names no target column; name the target column y"),
    ("a,y\n1,2,3\n", r"t\.csv line 2: 3 values but the header has 2 columns"),
])
def test_bad_csv_is_one_line_naming_file_and_line(tmp_path, body, match):
    (tmp_path / "t.csv").write_text(body)
    with pytest.raises(EdgetrainError, match=match) as refused:
        train(task="regression", dataset="csv", data_dir=str(tmp_path / "t.csv"), output=str(tmp_path / "runs"),
              **FAST)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "runs").exists()  # refused before the run directory and any device


@pytest.mark.slow
def test_bad_npz_targets_and_a_model_that_does_not_fit_are_refused_before_any_device(tmp_path):
    x, y = sensors(n=20, k=2)
    y[7, 1] = np.inf
    np.savez(tmp_path / "inf.npz", x=x, y=y)
    proc = run_main("train", "--task", "regression", "--dataset", "npz", "--data-dir", str(tmp_path / "inf.npz"),
                    "--model", "conv1d", "--output", str(tmp_path / "runs"), "--no-progress")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "target y is [" in proc.stderr and "at sample 7" in proc.stderr, proc.stderr
    y[7, 1] = 0.0
    np.savez(tmp_path / "ok.npz", x=x, y=y)
    with pytest.raises(EdgetrainError, match=r"model small_cnn cannot take the npz inputs of shape \(12, 3\)"):
        train(task="regression", dataset="npz", data_dir=str(tmp_path / "ok.npz"), model="small_cnn",
              output=str(tmp_path / "runs"), **FAST)
    with pytest.raises(EdgetrainError, match=r"outputs of shape \(1,\) per sample but the regression targets have 2"):
        train(task="regression", dataset="npz", data_dir=str(tmp_path / "ok.npz"), model=Conv1DNet(3, 1),
              output=str(tmp_path / "runs"), **FAST)
    assert not (tmp_path / "runs").exists()


def test_a_strategy_that_cannot_run_a_task_refuses_it_in_one_line(tmp_path):
    with pytest.raises(EdgetrainError, match=r"task regression cannot run under strategy tiled .*; use --strategy "
                                             r"ddp or fsdp or pipeline"):
        train(task="regression", strategy="tiled", grid="1x2", devices=2, output=str(tmp_path), **FAST)
    with pytest.raises(EdgetrainError, match=r"--partition dirichlet:0.5 skews class labels, which task regression"):
        train(task="regression", partition="dirichlet:0.5", sync="fedavg:1", devices=2, output=str(tmp_path), **FAST)
    with pytest.raises(EdgetrainError, match=r"unknown task 'segmentation'; known tasks: classification"):
        train(task="segmentation", output=str(tmp_path), **FAST)
    assert not list(tmp_path.iterdir())


def test_task_implied_by_the_dataset_and_its_defaults():
    from edgetrain.kinds import implied_task, task_defaults

    assert implied_task("digits") == "classification" and implied_task("diabetes") == "regression"
    assert task_defaults("regression", set()) == {"dataset": "diabetes", "model": "mlp"}
    assert task_defaults("regression", {"dataset"}) == {"model": "mlp"}
    assert task_defaults(None, set()) == {} and task_defaults("tests:Mine", set()) == {}
    # a dataset that implies a task brings that task's model and settings, as the task given by name does
    assert task_defaults(None, {"dataset"}, "yolo") == {k: v for k, v in task_defaults("detection", set()).items()
                                                         if k != "dataset"}
    assert task_defaults(None, {"dataset", "model"}, "diabetes") == {}
    assert task_defaults(None, {"dataset"}, "digits") == {"model": "small_cnn"}


@pytest.mark.slow
def test_regression_runs_out_of_the_box_and_records_its_metrics(tmp_path):
    summary = train(task="regression", epochs=2, devices=2, output=str(tmp_path), progress=False, throttle=False)
    assert summary["dataset"] == "diabetes" and summary["model"] == "mlp" and summary["test_accuracy"] is None
    assert summary["task"]["name"] == "regression" and summary["task"]["headline"] == "rmse"
    assert [m["name"] for m in summary["task"]["metrics"]] == ["rmse", "mae"]
    assert summary["test_metrics"]["rmse"] < 75  # diabetes targets: std 78 (predicting the mean), ~55 linear
    evals = [json.loads(line) for line in (Path(summary["run_dir"]) / "evals.jsonl").read_text().splitlines()]
    assert [sorted(e["metrics"]) for e in evals] == [["mae", "rmse"]] * 2
    assert evals[-1]["metrics"]["rmse"] == summary["test_metrics"]["rmse"]


@pytest.mark.slow
def test_regression_on_n_devices_equals_one_device_in_float64(tmp_path):
    cfg = dict(task="regression", steps=4, batch_size=16, lr=0.05, output=str(tmp_path), **FAST)
    torch.manual_seed(0)
    model = Conv1DNet(3, 2).double()
    one = weights(train(cfg, model=model, dataset=sensors_float64, devices=1))
    for devices in (2, 4):
        many = weights(train(cfg, model=model, dataset=sensors_float64, devices=devices))
        assert one.keys() == many.keys()
        for name in one:
            assert one[name].dtype == torch.float64
            assert (one[name] - many[name]).abs().max().item() < 1e-10, name
    moved = weights(train(cfg, model=model, dataset=sensors_float64, devices=1, steps=5))
    assert max((moved[k] - one[k]).abs().max().item() for k in one) > 1e-6  # the bound is far below a step


@pytest.mark.slow
def test_resume_of_a_regression_run_is_exact(tmp_path):
    """354 diabetes samples in batches of 64: 5 steps an epoch, so step 6's checkpoint is in epoch 1."""
    from edgetrain.train.checkpoint import checkpoint_files

    cfg = dict(task="regression", batch_size=64, steps=9, checkpoint_every=3, keep_checkpoints=3, devices=2,
               output=str(tmp_path), **{**FAST, "eval": True})
    summary = train(cfg)
    run_dir = Path(summary["run_dir"])
    uninterrupted = weights(summary)
    checkpoint_files(run_dir)[-1].unlink()  # as if killed after step 6's checkpoint
    resumed = train({"resume": str(run_dir)})
    for name, value in uninterrupted.items():
        assert torch.equal(value, weights(resumed)[name]), name
    assert resumed["test_metrics"] == summary["test_metrics"] and resumed["train_metrics"] == summary["train_metrics"]
    assert resumed["train_loss"] == pytest.approx(summary["train_loss"], rel=1e-12)


# -- a task of one's own: weighted absolute error, its targets (value, weight) pairs --------------------------
class WeightedL1(Task):
    """Median regression with a weight per sample: the targets are a structure of the task's own."""

    name = "weighted-l1"
    headline = Metric("wmae", "mm", False, "weighted MAE")
    metrics = (headline,)

    def collate(self, samples):
        return torch.stack([x for x, _ in samples]), {"value": torch.stack([t[0] for _, t in samples]),
                                                      "weight": torch.stack([t[1] for _, t in samples])}

    def batch_size(self, target):
        return len(target["value"])

    def to_device(self, target, device):
        return {k: v.to(device) for k, v in target.items()}

    def take(self, target, index):
        return {k: v[index] for k, v in target.items()}

    def loss(self, output, target):
        return (target["weight"] * (output[:, 0] - target["value"]).abs()).sum()

    def evaluator(self):
        return WeightedL1Evaluator(self)


class WeightedL1Evaluator(Evaluator):
    def __init__(self, task):
        self.task, self.totals = task, torch.zeros(3, dtype=torch.float64)

    def update(self, output, target):
        self.totals += torch.tensor([self.task.loss(output, target).item(), target["weight"].sum().item(),
                                     len(target["value"])], dtype=torch.float64)

    def state(self):
        return self.totals

    @staticmethod
    def merge(states):
        loss, weight, n = torch.stack(states).sum(0).tolist()
        return {"loss": loss / n, "wmae": loss / weight}


class WeightedPairs(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    @property
    def shape(self):
        return tuple(self.x.shape[1:])

    def __getitem__(self, key):
        i = key[0] if isinstance(key, tuple) else key
        return self.x[i], (self.y[i], torch.tensor(1.0 + (i % 2)))


def weighted_sensors(data_dir, seed):
    x, y = sensors(n=96, k=1, dtype=np.float32)
    x, y = torch.from_numpy(x), torch.from_numpy(y[:, 0] - 50)
    return DataSplit(WeightedPairs(x[:80], y[:80]), WeightedPairs(x[80:], y[80:]), 1, "weighted")


def test_a_task_of_ones_own_trains_from_python_with_targets_of_its_own_structure(tmp_path):
    summary = edgetrain.train(model=Conv1DNet(3, 1), task=WeightedL1(), dataset=weighted_sensors, devices=2,
                              epochs=3, batch_size=16, lr=0.02, output=str(tmp_path), progress=False, throttle=False)
    assert summary["task"]["name"] == f"{__name__}:WeightedL1" and summary["task"]["headline"] == "wmae"
    assert summary["task"]["metrics"] == [{"name": "wmae", "unit": "mm", "higher_is_better": False,
                                           "label": "weighted MAE", "fmt": ".4g"}]
    evals = summary["evals"]
    assert len(evals) == 3 and evals[-1]["metrics"]["wmae"] < evals[0]["metrics"]["wmae"]  # it learns
    config = (Path(summary["run_dir"]) / "config.yaml").read_text()
    assert f"task: {__name__}:WeightedL1" in config and "dataset: weighted_sensors" in config
    from edgetrain.data.datasets import DATASETS

    assert "weighted_sensors" not in DATASETS  # registered for that run only


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["pipeline", "fsdp"])
def test_regression_under_pipeline_and_fsdp_matches_ddp(tmp_path, strategy):
    cfg = dict(task="regression", steps=3, batch_size=32, devices=2, output=str(tmp_path), **{**FAST, "eval": True})
    ddp = train(cfg, run_name="ddp")
    other = train(cfg, strategy=strategy, run_name=strategy)
    theirs, ours = (edgetrain.load_checkpoint(s["run_dir"])["model"] for s in (other, ddp))
    for name, value in ours.items():
        assert torch.allclose(theirs[name], value, rtol=0, atol=1e-6), name
    assert other["test_metrics"] == pytest.approx(ddp["test_metrics"], rel=1e-5)


def test_a_yaml_config_naming_a_task_brings_its_default_dataset_but_keeps_the_keys_it_gives(tmp_path):
    (tmp_path / "run.yaml").write_text("task: regression\nmodel: small_cnn\n")
    with pytest.raises(EdgetrainError, match=r"model small_cnn cannot take the diabetes inputs of shape \(10,\)"):
        train(str(tmp_path / "run.yaml"), output=str(tmp_path / "runs"), **FAST)


def test_the_task_layer_imports_nothing_above_it():
    import ast

    src = Path(edgetrain.__file__).parent
    above = {"config", "bench", "plan", "report", "train", "cli", "preflight", "ssh_launch", "data_cli", "fleet"}
    for path in sorted((src / "tasks").rglob("*.py")):
        found = {n.module.split(".")[1] for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("edgetrain.")}
        assert not found & above, f"{path.name} imports {sorted(found & above)}"
    kinds = ast.parse((src / "kinds.py").read_text())  # the tasks' descriptors
    assert {n.module for n in ast.walk(kinds) if isinstance(n, ast.ImportFrom) and n.module
            and n.module.startswith("edgetrain")} == {"edgetrain.errors", "edgetrain.spec"}  # torch-free, the bottom
