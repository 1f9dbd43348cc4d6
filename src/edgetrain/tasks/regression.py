"""Regression: real-valued targets (N,) or (N, K); squared error summed over samples, RMSE and MAE.

The model predicts standardised targets: ``(y - mean) / std`` with the training targets' mean and standard
deviation per target (``DataSplit.details``, data/datasets.py ``values_split``), so one learning rate suits a
target in any unit. The loss is the squared error on that scale, summed over samples and targets; RMSE and MAE
are in the target's own unit, on the model's output mapped back (``output * std + mean``), over every target
value of the test set. RMSE is the headline (lower is better)."""
from __future__ import annotations

import math

import torch

from edgetrain.kinds import named_by_kind
from edgetrain.tasks.base import Evaluator, Metric, Task, refuse

RMSE = Metric("rmse", "", False, "RMSE")
MAE = Metric("mae", "", False, "MAE")


class RegressionEvaluator(Evaluator):
    """State: float64 [loss sum, squared error sum, absolute error sum, target values, samples]: summable."""

    def __init__(self, task: "RegressionTask"):
        self.task = task
        self.totals = torch.zeros(5, dtype=torch.float64)

    def update(self, output, target) -> None:
        predicted = self.task.predict(output, target).double()
        error = predicted - target.double().reshape(predicted.shape)
        self.totals += torch.tensor([self.task.loss(output, target).item(), error.pow(2).sum().item(),
                                     error.abs().sum().item(), error.numel(), len(target)], dtype=torch.float64)

    def state(self) -> torch.Tensor:
        return self.totals

    @staticmethod
    def merge(states: list) -> dict[str, float]:
        t = torch.stack([torch.as_tensor(s, dtype=torch.float64) for s in states]).sum(0)
        values, samples = max(t[3].item(), 1.0), max(t[4].item(), 1.0)
        return {"loss": t[0].item() / samples, "rmse": math.sqrt(t[1].item() / values), "mae": t[2].item() / values}


@named_by_kind("task")
class RegressionTask(Task):
    """``mean``/``std``: the training targets' per target (one number, or K), what the model's output is scaled
    by; ``unit``: what RMSE and MAE are in (the report's axis)."""

    headline = RMSE
    metrics = (RMSE, MAE)
    loss_name = "squared error, standardised"

    def __init__(self, mean=0.0, std=1.0, unit: str = ""):
        self.mean = torch.as_tensor(mean, dtype=torch.float64).reshape(-1)
        self.std = torch.as_tensor(std, dtype=torch.float64).reshape(-1)
        if unit:  # the metrics carry the target's unit
            self.headline = Metric("rmse", unit, False, "RMSE")
            self.metrics = (self.headline, Metric("mae", unit, False, "MAE"))

    @classmethod
    def for_data(cls, data) -> "RegressionTask":
        details = getattr(data, "details", None) or {}  # no data (the planner's counts): unscaled
        return cls(details.get("target_mean", 0.0), details.get("target_std", 1.0), details.get("target_unit", ""))

    def _scaled(self, target: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """The target standardised, shaped as the model's output."""
        mean, std = (v.to(output.device, output.dtype) for v in (self.mean, self.std))
        return (target.to(output.dtype).reshape(output.shape) - mean) / std

    def loss(self, output, target):
        return (output - self._scaled(target, output)).pow(2).sum()

    def predict(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The model's output in the target's unit."""
        mean, std = (v.to(output.device, output.dtype) for v in (self.mean, self.std))
        return output * std + mean

    def train_counts(self, output, target) -> dict[str, float]:
        error = self.predict(output.detach(), target).double() - target.double().reshape(output.shape)
        return {"squared_error": error.pow(2).sum().item(), "values": error.numel()}

    def train_figures(self, counts, samples) -> dict[str, float]:
        return {"rmse": math.sqrt(counts["squared_error"] / counts["values"])} if counts.get("values") else {}

    def example_target(self, output):
        return torch.zeros(output.shape[0], *output.shape[1:], dtype=output.dtype, device=output.device)

    def evaluator(self) -> RegressionEvaluator:
        return RegressionEvaluator(self)

    def check(self, output, target) -> None:
        if not torch.is_floating_point(target):
            refuse(f"task regression needs real-valued targets, but the dataset gives {target.dtype} ones",
                   "give float targets, or use --task classification for class labels")
        per_sample = target[0].numel() if len(target) else 1
        if output.dim() < 1 or len(output) != len(target) or output[0].numel() != per_sample:
            refuse(f"the model gives outputs of shape {tuple(output.shape[1:])} per sample but the regression "
                   f"targets have {per_sample} value(s) per sample",
                   f"build the model with num_classes={per_sample} (the dataset's number of targets)")
        if len(self.mean) not in (1, per_sample):
            refuse(f"the task's target mean has {len(self.mean)} values for {per_sample} targets",
                   "give one mean and std per target")

    def check_data(self, data) -> None:
        for part in ("train", "test"):
            targets = getattr(getattr(data, part, None), "labels", None)
            if isinstance(targets, torch.Tensor) and torch.is_floating_point(targets):
                bad = (~torch.isfinite(targets.reshape(len(targets), -1))).any(1).nonzero()
                if len(bad):
                    i = int(bad[0])
                    refuse(f"dataset {data.name}: {part} target of sample {i} is "
                           f"{targets[i].tolist()}", "regression targets must be finite numbers: fix or drop it")
