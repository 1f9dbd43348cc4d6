"""A task of one's own: the 90th percentile of a sensor's next reading (pinball loss), trained by edgetrain.

Run: PYTHONPATH=src python examples/own_task.py   (docs/how-to/tasks.md shows its output)
"""
import numpy as np
import torch

import edgetrain
from edgetrain import Evaluator, Metric, Task
from edgetrain.data.datasets import split_indices, values_split
from edgetrain.models.sensors import Conv1DNet

Q = 0.9  # the quantile: 90% of readings should fall at or below the prediction


class Quantile(Task):
    name = "quantile"
    headline = Metric("coverage", "", True, "coverage", ".1%")
    metrics = (headline, Metric("pinball", "°C", False, "pinball loss"))
    loss_name = "pinball loss"

    def loss(self, output, target):  # summed over the batch's samples, as every Task's
        error = target - output[:, 0]
        return torch.maximum(Q * error, (Q - 1) * error).sum()

    def train_counts(self, output, target):
        return {"covered": float((target <= output[:, 0]).sum())}

    def train_figures(self, counts, samples):
        return {"coverage": counts.get("covered", 0) / max(samples, 1)}

    def evaluator(self):
        return QuantileEvaluator(self)


class QuantileEvaluator(Evaluator):
    def __init__(self, task):
        self.task, self.totals = task, torch.zeros(3, dtype=torch.float64)

    def update(self, output, target):
        self.totals += torch.tensor([self.task.loss(output, target).item(), float((target <= output[:, 0]).sum()),
                                     len(target)], dtype=torch.float64)

    def state(self):  # summable: every device's is added
        return self.totals

    @staticmethod
    def merge(states):
        loss, covered, n = torch.stack(states).sum(0).tolist()
        return {"loss": loss / n, "pinball": loss / n, "coverage": covered / n}


def readings(data_dir, seed):
    """Half an hour of three sensors (temperature, humidity, light) a minute apart; the target is the
    temperature's change over the next ten minutes (°C), which drifts with light and has heavy-tailed noise."""
    rng = np.random.default_rng(seed)
    n, t = 2000, 30
    light = np.cumsum(rng.normal(size=(n, t)), axis=1) / 5
    humidity = rng.normal(size=(n, t))
    temperature = np.cumsum(0.1 * light + rng.normal(scale=0.1, size=(n, t)), axis=1)
    x = np.stack([temperature, humidity, light], axis=-1)
    y = 0.5 * light[:, -5:].mean(1) + rng.standard_t(3, size=n) * 0.3
    return values_split(x, y, *split_indices(n, seed), name="readings")


if __name__ == "__main__":
    summary = edgetrain.train(model=Conv1DNet(3, 1), task=Quantile(), dataset=readings, devices=2, epochs=4,
                              batch_size=64, lr=0.02, throttle=False, output="runs")
    print(summary["task"]["name"], summary["test_metrics"])
