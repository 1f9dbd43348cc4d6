"""How devices share a training step: one interface the loop drives, one class per strategy.

Design: docs/design/strategies.md ("The Strategy interface").
"""
from __future__ import annotations

import abc
import dataclasses
import gc
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from edgetrain.comm import build_sync
from edgetrain.comm.accounting import CommStats
from edgetrain.config import TrainConfig
from edgetrain.errors import EdgetrainError
from edgetrain.kinds import named_by_kind, strategy_kind
from edgetrain.models.batchnorm import convert_batchnorm
from edgetrain.models.init import materialise
from edgetrain.privacy.dp import PrivacyPlan, SampleDP, plan_privacy
from edgetrain.spec import DPSpec, RunSpec
from edgetrain.tasks.base import Task
from edgetrain.tasks.classification import ClassificationTask
from edgetrain.tiling import TiledTraining
from edgetrain.train.checkpoint import _check_dcp
from edgetrain.train.evaluation import EvalPass, evaluate_task

# A pooled strategy's optimizer state in its part of a checkpoint (``sharded_state``): one key per parameter
# name and state, so no two devices write the same key with different values.
FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class StrategyContext:
    """What a strategy may know of the run and of this device."""

    cfg: TrainConfig
    spec: RunSpec
    rank: int
    world: int
    local_batch: int                      # this device's share of the global batch (cfg.batch_size)
    input_shape: tuple[int, ...]
    stats: CommStats                      # every byte and collective the strategy's exchanges count
    link: Any = None                      # this device's link from the cluster file (None: the config's)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    steps_per_epoch: int = 0              # steps of one pass over the training set (len(train) // cfg.batch_size)
    task: Task = field(default_factory=ClassificationTask)  # what is learned: the loss, targets, metrics


@dataclass
class StepResult:
    loss_sum: float
    counts: dict | int  # the task's train_counts (summable); an int: a classifier's right answers, {"correct": n}
    samples: int
    comm_s: float
    metrics: dict = field(default_factory=dict)

    @property
    def train_counts(self) -> dict:
        return {"correct": self.counts} if isinstance(self.counts, int) else self.counts


class Strategy(abc.ABC):
    """One way of training across devices; see docs/design/strategies.md for the order of calls."""

    name = "strategy"
    shard_data = True
    pooled = False  # True: each device holds only its part of the model; checkpoints are every device's part

    def __init__(self, context: StrategyContext):
        self.context = context

    def data_share(self, local_batches: list[int]) -> tuple[list[int], int]:
        """(the shares the global batch is cut into, the index of the one this device reads): the sampler's."""
        c = self.context
        return (local_batches, c.rank) if self.shard_data else ([c.cfg.batch_size], 0)

    def materialise(self, model: nn.Module) -> nn.Module:
        """The model the loop built on the meta device, with what this device holds of it on the device and
        initialised per layer (models/init.py); default: every layer. A model built for real is only moved."""
        return materialise(model, self.context.spec.seed, self.context.device)

    def adapt(self, model: nn.Module) -> nn.Module:
        """The model with its layers changed for this strategy, before the throttle measures it (default: as is)."""
        return model

    @property
    def calibration_batch(self) -> int | None:
        return self.context.local_batch

    @abc.abstractmethod
    def setup(self, model: nn.Module) -> None: ...

    def parameters(self):
        return self.eval_model.parameters()

    @abc.abstractmethod
    def train_step(self, x: torch.Tensor, y: torch.Tensor, optimizer: torch.optim.Optimizer) -> StepResult: ...

    def finish(self) -> None:
        """After the last step, on every device. Calling it again must do nothing."""

    def data_ready(self, samples: int) -> None:
        """The loop built this device's own training data (a partition): ``samples`` of them, before step 0."""

    @property
    @abc.abstractmethod
    def eval_model(self) -> nn.Module: ...

    def evaluate(self, dataset, batch: int | None = None) -> dict[str, float]:
        """``{"loss": mean per sample, <metric name>: value...}`` of the run's task over the whole test set
        ``dataset``, the same on every device (a collective: every device calls it). Default: ``eval_model`` on
        this device's shard, in batches of ``batch`` (default: the device's training batch, so that evaluation
        holds no more activations than a training step), the evaluators' states merged
        (``train.evaluation.evaluate_task``). A strategy may return (mean loss, accuracy) instead (a classifier)."""
        c = self.context
        return evaluate_task(self.eval_model, dataset, c.rank, c.world, c.task,
                             EvalPass(batch or max(1, c.local_batch), c.device, c.spec.timeout_s))

    def summary(self) -> dict:
        return {}

    def make_private(self, dp: DPSpec, sample_rate: float, total_steps: int) -> PrivacyPlan:
        """``--dp``, after ``setup``, every device: train privately from the next step on and return the run's
        ``PrivacyPlan`` (``sample_rate``: a sample's chance to be in one step's batch, the largest over the
        devices). The built-in strategies that cannot refuse it beside their kind (edgetrain.kinds)."""
        raise EdgetrainError(f"strategy {self.name} does not train with --dp; use --strategy ddp, or drop --dp")

    def privacy_events(self) -> int:
        """The steps (or rounds) the accountant has counted so far."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """This device's part of a checkpoint (train/checkpoint.py), beside optimizer and RNG: the model,
        and whatever else the strategy keeps between steps (override both methods to add it)."""
        return {"model": self.eval_model.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Called after ``setup`` when a run resumes."""
        self.eval_model.load_state_dict(state["model"])

    def rebuild(self, rank: int, world: int, local_batch: int) -> None:
        """``setup`` again for a new set of devices (train/elastic.py), on the same model, after the new
        process group is formed; the state comes next, through ``load_state_dict``."""
        self.context = dataclasses.replace(self.context, rank=rank, world=world, local_batch=local_batch)
        self.setup(self.eval_model)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """Rank 0, after ``finish``: the whole model's and optimizer's state for checkpoint.pt (not ``pooled``)."""
        return {"model": self.eval_model.state_dict(), "optimizer": optimizer.state_dict()}

    def sharded_state(self, optimizer: torch.optim.Optimizer, final: bool = False) -> dict:
        """A ``pooled`` strategy, every device: ``{"model": {name: tensor}, "optimizer": {key: value}}``, this
        device's part only, keyed by the whole model's names (the optimizer's flattened as
        ``torch.distributed.checkpoint.state_dict`` does with ``flatten_optimizer_state_dict``: one key per
        parameter and state, so no two devices write the same key with different values). ``final``: after
        ``finish``, for the run's final model."""
        raise NotImplementedError(f"strategy {self.name} holds the whole model on every device: checkpoint_state")

    def load_sharded_state(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        """A ``pooled`` strategy: ``sharded_state``'s dict, read back, into this device's part (after ``setup``)."""
        raise NotImplementedError(f"strategy {self.name} holds the whole model on every device")


@named_by_kind("strategy")
class DataParallel(Strategy):
    """Every device trains a replica on its share of the batch; ``comm.build_sync`` picks how replicas agree
    (sync, local:H, async:S, gossip, fedavg:E; comm/mode.py is the interface it calls).

    Loss scaling: device ``r`` with local batch ``b_r`` back-propagates
    ``sum(losses_r) * world / B``; DDP averages over devices, so every device
    ends up with the gradient of the mean loss over the global batch ``B``,
    whatever the split. That is why N devices reproduce one device step for step.

    ``comm_s`` of a step: the wait after the last gradient bucket was handed
    to the all-reduce until backward returned (the part compute did not
    hide), plus the exchanges of ``after_backward`` and ``after_step``.

    A step the sync mode says this device sits out (``sync.trains``: a round it
    was not sampled for, or past the round's deadline) runs no forward,
    backward or optimizer step: only ``after_step`` (the round's exchange, if
    due), and it scores 0 samples.
    """


    def adapt(self, model: nn.Module) -> nn.Module:
        if self.context.spec.batchnorm == "sync" and self.context.world > 1:
            return convert_batchnorm(model)
        return model

    def setup(self, model: nn.Module) -> None:
        c = self.context
        self.model = model
        self.sync = build_sync(self.model, c.spec, c.rank, c.world, c.stats, c.link, c.steps_per_epoch)
        self.steps = 0
        self.dp: SampleDP | None = None

    def make_private(self, dp: DPSpec, sample_rate: float, total_steps: int) -> PrivacyPlan:
        """DP-SGD (``dp.per_sample``) or DP-FedAvg. DP-SGD with steps in lockstep adds the noise once, on rank 0,
        to the global batch's clipped sum, which the devices then average (``sync.after_backward``): N devices
        are one DP-SGD run of the global batch. Modes that step each device alone add it on every device:
        each device's steps are DP-SGD of its own batch (a device's data is protected by its own noise)."""
        c = self.context
        if dp.per_sample:
            once = self.sync.kind.lockstep
            who = ("each device's share masked (--secure-aggregation)" if c.spec.secure_aggregation else
                   "trusts the devices that sum the gradients")
            guarantee = ("each training sample, the devices' steps together one DP-SGD run of the global batch "
                         f"(noise added once per step); {who}"
                         if once and c.world > 1 else
                         "each training sample, against anyone who sees a device's updates or the model (each "
                         "device's steps are DP-SGD on its own batch, with its own noise)")
            plan = plan_privacy(dp, sample_rate, total_steps, guarantee)
            self.dp = SampleDP(self.model, dp.clip, plan.noise_multiplier, noise_here=not once or c.rank == 0,
                               expected_batch=c.cfg.batch_size / c.world, seed=_noise_seed())
            return plan
        rounds = math.ceil(total_steps / self.sync.period)
        sampled = len(self.sync.sampled_ranks()) / c.world
        who = ("each device's update masked (--secure-aggregation)" if c.spec.secure_aggregation else
               "trusts the devices that sum the updates")
        guarantee = f"each device's whole data (DP-FedAvg: updates clipped, noise added once to the round's sum); {who}"
        plan = plan_privacy(dp, sampled, rounds, guarantee)
        self.sync.privatise_updates(dp.clip, plan.noise_multiplier, _noise_seed())
        return plan

    def privacy_events(self) -> int:
        return self.steps if self.dp is not None else self.sync.averages

    def data_ready(self, samples: int) -> None:
        # federated rounds weighted by sample counts (fedavg:E:weighted) need every device's
        c = self.context
        self.sync.set_samples(samples, c.local_batch * c.world / c.cfg.batch_size)

    def parameters(self):
        return self.model.parameters()

    def train_step(self, x, y, optimizer) -> StepResult:
        c = self.context
        started = time.perf_counter()
        if not self.sync.trains(self.steps):  # not sampled for the round, or past its deadline (comm/local_sgd.py)
            self._after_step(optimizer)
            self.steps += 1
            return StepResult(0.0, {}, 0, time.perf_counter() - started, self.sync.step_metrics())
        collectives = c.stats.snapshot()["collectives"]
        optimizer.zero_grad(set_to_none=True)
        if self.dp is not None:
            self.dp.zero_grad(optimizer)
        out = self.sync.model(x)
        loss_sum = c.task.loss(out, y)
        if self.dp is None:
            (loss_sum * (c.world / c.cfg.batch_size)).backward()
        else:  # each sample's own gradient, clipped and noised: the loss scaling is DP-SGD's division
            loss_sum.backward()
            self.dp.privatise(optimizer)
        t_backward = time.perf_counter()
        self.sync.after_backward(self.steps)
        t_after_backward = time.perf_counter()
        optimizer.step()
        t_optimizer = time.perf_counter()
        self._after_step(optimizer)
        ended = time.perf_counter()
        self.steps += 1
        after = c.stats.snapshot()
        hidden_wait = 0.0
        if after["collectives"] > collectives and started <= after["last_launch"] <= t_backward:
            hidden_wait = t_backward - after["last_launch"]
        comm_s = hidden_wait + (t_after_backward - t_backward) + (ended - t_optimizer)
        return StepResult(loss_sum.item(), c.task.train_counts(out.detach(), y), c.task.batch_size(y), comm_s,
                          self.sync.step_metrics())

    def _after_step(self, optimizer) -> None:
        rounds = self.sync.averages
        self.sync.after_step(self.steps)
        if self.sync.reset_client_optimizer and self.sync.averages != rounds:
            # fedavg:E:reset: the round ended, so the client optimizer starts the next one afresh
            optimizer.state.clear()  # SGD rebuilds its momentum buffer from the next gradient

    def finish(self) -> None:
        self.sync.finish()

    def rebuild(self, rank: int, world: int, local_batch: int) -> None:
        # The old DDP must be gone before the new one wraps the model: its reducer's gradient hooks would
        # otherwise all-reduce over the destroyed group. Error-feedback residuals go with it; the peer's
        # state (load_state_dict) brings the survivors' back, a departed device's are lost.
        self.sync.close()
        self.sync = None
        gc.collect()
        super().rebuild(rank, world, local_batch)

    @property
    def eval_model(self) -> nn.Module:
        return self.model

    def summary(self) -> dict:
        return self.sync.summary()

    def evaluate(self, dataset, batch: int | None = None) -> dict[str, float]:
        self.sync.settle("evaluation")  # the background exchange ended first: evaluation gathers over the group
        return super().evaluate(dataset, batch)

    def state_dict(self) -> dict:
        self.sync.settle("checkpoint")  # before the model is taken: settling may move it
        return {**super().state_dict(), "sync": self.sync.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.sync.load_state_dict(state["sync"])
        self.steps = state["steps"]


def _noise_seed() -> int:
    """The seed of a device's DP noise: drawn from the operating system's secure randomness, never from the run's
    ``--seed`` (config.yaml is no secret: peers that knew it could subtract the noise). A resumed run draws fresh
    noise, which the guarantee allows."""
    return secrets.randbits(63)


@named_by_kind("strategy")
class Tiled(Strategy):
    """Spatial tiles of the first layers, data parallel after them (``tiling.TiledTraining``).

    Every device receives the whole global batch and returns its share of the
    step's accounting, so that summing over devices gives the global batch,
    as in data parallelism. Every BatchNorm gets whole-map or global-batch
    statistics whatever ``batchnorm`` says. No throttle reference pass (the
    tiled section runs collectives inside forward).
    """


    @property
    def calibration_batch(self) -> None:
        return None

    def adapt(self, model: nn.Module) -> nn.Module:
        spec = self.context.spec
        self.tiled = TiledTraining(model, spec.tiling, self.context.input_shape, timeout_s=spec.timeout_s,
                                   task=self.context.task)
        return model

    def setup(self, model: nn.Module) -> None:
        """Nothing more: ``adapt`` already gave every device device 0's parameters."""

    def train_step(self, x, y, optimizer) -> StepResult:
        optimizer.zero_grad(set_to_none=True)
        self.tiled.forward_backward(x, y)
        optimizer.step()
        last, stats = self.tiled.last, self.context.stats
        # no hook threads run in tiled mode: the tally is the tiled section's own
        stats.bytes_sent += sum(last["bytes"].values())
        stats.bytes_recv += last["bytes_recv"]
        stats.comm_s += last["exchange_s"]
        local = last["local"]
        return StepResult(local["loss_sum"], local["counts"], local["samples"], last["exchange_s"])

    @property
    def eval_model(self) -> nn.Module:
        return self.tiled.model

    def summary(self) -> dict:
        return {"sync": "tiled", "tiling": self.tiled.report()}


def registered_strategy(name: str) -> type[Strategy]:
    """The Strategy that ``--strategy name`` trains with: its kind's ``runtime`` (``edgetrain.kinds``), its module
    imported on first use. FSDP2 and torch.distributed.pipelining pull in DTensor and dynamo, 1.3 s of the 3.4 s
    a device spends importing (python -X importtime), which a ddp run never uses."""
    try:
        strategy = strategy_kind(name).load_runtime()
    except ImportError as e:  # FSDP2 (fully_shard and its collectives), which torch 2.4 does not export
        raise EdgetrainError(f"strategy {name} needs a newer torch than this {torch.__version__} ({e}); "
                             f"use --strategy ddp, or install a newer torch (2.13 is tested)") from None
    if strategy.pooled:  # its model is written in parts: checked before training, not after it
        _check_dcp()
    return strategy
