"""What the step loop carries (``LoopState``) and the checkpoints it is saved to and resumed from.

``LoopCheckpoints`` is the loop's side of ``checkpoint.Checkpointer`` (the protocol, what is held and what
is exact: train/checkpoint.py): it restores a resumed run's state into the strategy, optimizer, scheduler,
records and RNG before the first step, and saves it at the start of a step when a checkpoint is due.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from edgetrain.cluster.throttle import Throttle
from edgetrain.records import EvalRecord, StepRecord
from edgetrain.tasks.base import add_counts, as_counts
from edgetrain.train.checkpoint import Checkpointer, rng_state, set_rng_state
from edgetrain.train.strategy import StepResult, Strategy


@dataclass
class LoopState:
    """What the step loop carries from step to step, and what a checkpoint keeps of it."""

    started: float                  # perf_counter at the run's start (a resumed run's: moved back by its wall time)
    step: int = 0
    epoch: int = 0
    records: list[StepRecord] = field(default_factory=list)
    evals: list[EvalRecord] = field(default_factory=list)
    totals: list = field(default_factory=lambda: [0.0, {}, 0.0])  # this epoch's loss sum, task counts, samples
    ema_loss: float | None = None
    planned_steps: int = 0          # the steps the run is to train, written with every checkpoint

    def new_epoch(self) -> None:
        self.totals = [0.0, {}, 0.0]

    def count(self, record: StepRecord, result: StepResult) -> None:
        """A step done: its record kept, this epoch's totals and the smoothed loss moved on."""
        self.records.append(record)
        loss, counts, seen = self.totals
        self.totals = [loss + result.loss_sum, add_counts(counts, result.train_counts), seen + result.samples]
        self.step += 1
        if record.loss is not None:  # None: a step this device sat out (a round it is no member of)
            self.ema_loss = record.loss if self.ema_loss is None else 0.9 * self.ema_loss + 0.1 * record.loss


def throttle_state(throttle: Throttle | None) -> dict | None:
    """The throttle's calibration, which a resumed device keeps instead of measuring again."""
    if throttle is None:
        return None
    return {k: getattr(throttle, k) for k in ("reference_cpu", "reference_batch", "reference_gradients",
                                              "inflation", "inflations", "slept")}


class LoopCheckpoints:
    """One device's checkpoints as the loop sees them: ``Checkpointer``'s files, the loop's state in them."""

    def __init__(self, checkpointer: Checkpointer, config: dict, device: torch.device):
        self.files, self.config, self.device = checkpointer, config, device
        self.run_state, self.mine = checkpointer.load()  # (None, None) for a new run
        self.resumed_step = 0

    @property
    def resumed(self) -> bool:
        return self.mine is not None

    @property
    def stopped(self) -> bool:
        """SIGTERM stopped the run with a checkpoint."""
        return self.files.stopped

    def keep_calibration(self, throttle: Throttle | None) -> None:
        """A resumed device keeps its throttle's calibration (it measures no reference pass again)."""
        if self.mine and throttle:
            vars(throttle).update(self.mine["throttle"])

    def restore(self, state: LoopState, strategy: Strategy, optimizer, scheduler, writer) -> None:
        """A resumed run: every device's state as its checkpoint holds it (after ``setup``; ``pooled``
        strategies read their part from the checkpoint's directory, a collective). Nothing for a new run."""
        mine, run_state = self.mine, self.run_state
        if not mine:
            return
        strategy.load_state_dict(mine["strategy"])
        if strategy.pooled:
            self.files.load_sharded(strategy, optimizer, mine)
        else:
            optimizer.load_state_dict(mine["optimizer"])
        scheduler.load_state_dict(mine["scheduler"])
        state.records = [StepRecord.from_dict(r) for r in mine["records"]]
        state.evals = [EvalRecord.from_dict(e) for e in run_state["evals"]]
        writer.restart(state.records, state.evals)
        loss, counts, seen = mine["epoch_totals"]
        state.totals = [loss, as_counts(counts), seen]
        state.ema_loss, state.step, state.epoch = mine["ema_loss"], run_state["step"], run_state["epoch"]
        state.started -= run_state["wall_s"]  # the summary's wall time covers the whole run
        set_rng_state(mine["rng"], self.device)  # last: nothing above may draw from it

    def resumes_in(self, state: LoopState) -> bool:
        """Whether the epoch starting now continues the one the checkpoint was taken in."""
        return self.resumed and state.step == self.resumed_step

    def save_if_due(self, state: LoopState, strategy: Strategy, optimizer, scheduler,
                    throttle: Throttle | None) -> bool:
        """At the start of ``state.step``: a checkpoint if one is due (every device agrees). True: SIGTERM asked
        the run to stop, and it stops here with this checkpoint."""
        if not self.files.due(state.step, self.resumed_step):
            return False
        self.files.save(state.step, {
            "step": state.step, "planned_steps": state.planned_steps, "epoch": state.epoch,
            "evals": [e.to_dict() for e in state.evals],
            "wall_s": time.perf_counter() - state.started, "config": self.config}, {
            "strategy": strategy.state_dict(),
            # a pooled strategy's optimizer state is in its part (sharded_state), not in every device's
            **({} if strategy.pooled else {"optimizer": optimizer.state_dict()}),
            "scheduler": scheduler.state_dict(), "rng": rng_state(self.device),
            "records": [r.to_dict() for r in state.records],
            "epoch_totals": [state.totals[0], dict(state.totals[1]), state.totals[2]],
            "ema_loss": state.ema_loss, "throttle": throttle_state(throttle)},
            strategy.sharded_state(optimizer) if strategy.pooled else None)
        return self.files.stopped
