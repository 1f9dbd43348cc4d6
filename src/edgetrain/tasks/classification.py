"""Classification: cross-entropy over logits (N, K) against int64 labels (N,), scored by argmax accuracy.

The numbers are those edgetrain computed before tasks existed (``F.cross_entropy`` summed, argmax), so every
classification run and test is unchanged."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from edgetrain.kinds import named_by_kind
from edgetrain.tasks.base import Evaluator, Metric, Task, refuse

ACCURACY = Metric("accuracy", "", True, "accuracy", ".1%")


class ClassificationEvaluator(Evaluator):
    """State: the summable [loss sum, right answers, samples] in float64."""

    def __init__(self):
        self.totals = torch.zeros(3, dtype=torch.float64)

    def update(self, output, target) -> None:
        self.totals += torch.tensor([F.cross_entropy(output, target, reduction="sum").item(),
                                     (output.argmax(1) == target).sum().item(), len(target)], dtype=torch.float64)

    def state(self) -> torch.Tensor:
        return self.totals

    @staticmethod
    def merge(states: list) -> dict[str, float]:
        totals = torch.stack([torch.as_tensor(s, dtype=torch.float64) for s in states]).sum(0)
        n = max(totals[2].item(), 1.0)
        return {"loss": totals[0].item() / n, "accuracy": totals[1].item() / n}


@named_by_kind("task")
class ClassificationTask(Task):
    headline = ACCURACY
    metrics = (ACCURACY,)
    loss_name = "cross-entropy"

    def loss(self, output, target):
        return F.cross_entropy(output, target, reduction="sum")

    def train_counts(self, output, target) -> dict[str, float]:
        return {"correct": int((output.detach().argmax(1) == target).sum())}

    def train_figures(self, counts, samples) -> dict[str, float]:
        return {"accuracy": counts.get("correct", 0) / max(samples, 1)}

    def example_target(self, output):
        return torch.zeros(output.shape[0], dtype=torch.int64, device=output.device)

    def evaluator(self) -> ClassificationEvaluator:
        return ClassificationEvaluator()

    def check(self, output, target) -> None:
        if output.dim() != 2:
            refuse(f"task classification needs logits (N, classes) from the model, but it gives "
                   f"{tuple(output.shape)}", "use a classifier model, or --task regression for other outputs")
        if target.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8) or target.dim() != 1:
            refuse(f"task classification needs integer class labels (N,), but the dataset gives "
                   f"{target.dtype} {tuple(target.shape)}", "use --task regression for real-valued targets")
        if len(target) and int(target.max()) >= output.shape[1]:
            refuse(f"class label {int(target.max())} is beyond the model's {output.shape[1]} outputs",
                   "labels must be 0..K-1 with K the model's number of classes")
