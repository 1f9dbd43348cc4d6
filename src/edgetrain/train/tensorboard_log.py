"""TensorBoard event files of a run (``--tensorboard``), written with torch's own ``SummaryWriter``.

Layout: ``<run>/tensorboard/rank-<r>/``, one TensorBoard run per device, so
that ``tensorboard --logdir <run>/tensorboard`` overlays the devices (and
``--logdir runs`` several runs). As with ``metrics-<rank>.jsonl``, every
device that has the run directory writes its own steps as they happen (all of
them on one host; rank 0 alone under torchrun), and rank 0 writes the
evaluations; at the end rank 0 writes the steps of the devices that had no
run directory from the records they sent it. A killed run keeps what was
flushed (``SummaryWriter`` flushes every ``FLUSH_S`` seconds and at close).

Scalars, against the number of steps done (``StepRecord.step + 1``, as
``EvalRecord.step`` counts them), each the device's own measurement:

- ``train/loss`` (the device's share of the batch), ``train/samples_per_s``,
  ``train/lr``;
- ``time/step_s``, ``time/data_s``, ``time/compute_s``, ``time/comm_s``
  (the loop's split, see ``train.loop``) and, where the sync mode keeps a
  device clock, ``time/device_clock_s`` (modelled on a virtual link);
- ``comm/bytes_sent``, ``comm/bytes_recv``; ``memory/peak_rss_mb``;
- rank 0 only: ``eval/loss`` and ``eval/<metric>`` of the task (a classifier: ``eval/accuracy``) on the whole
  test set.

Accuracy is the test set's: a step's training accuracy is not in its record.
"""
from __future__ import annotations

from pathlib import Path

from edgetrain.records import EvalRecord, StepRecord

# Imported inside functions: torch.utils.tensorboard (torch, and the tensorboard extra; only --tensorboard runs need
# it).

FLUSH_S = 5  # seconds between flushes: a killed run loses at most this much (SummaryWriter's default is 120)
STEP_SCALARS = {  # tag: StepRecord field
    "train/loss": "loss", "train/samples_per_s": "samples_per_s", "train/lr": "lr",
    "time/step_s": "step_s", "time/data_s": "data_s", "time/compute_s": "compute_s", "time/comm_s": "comm_s",
    "time/device_clock_s": "virtual_s",
    "comm/bytes_sent": "bytes_sent", "comm/bytes_recv": "bytes_recv", "memory/peak_rss_mb": "peak_rss_mb",
}


def device_dir(run_dir: Path, rank: int) -> Path:
    return run_dir / "tensorboard" / f"rank-{rank}"


class TensorBoardLog:
    """One device's event files."""

    def __init__(self, run_dir: Path, rank: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(device_dir(run_dir, rank)), flush_secs=FLUSH_S)

    def step(self, record: StepRecord) -> None:
        for tag, name in STEP_SCALARS.items():
            value = getattr(record, name)
            if value is not None:
                self.writer.add_scalar(tag, value, record.step + 1)

    def evaluation(self, record: EvalRecord) -> None:
        self.writer.add_scalar("eval/loss", record.test_loss, record.step)
        for name, value in record.values().items():  # a classifier's: eval/accuracy, as before tasks
            self.writer.add_scalar(f"eval/{name}", value, record.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def write_missing_devices(run_dir: Path, records: list[StepRecord], world: int) -> None:
    """Rank 0, at the end: event files for the devices that had no run directory (torchrun's other ranks)."""
    for rank in range(world):
        if not device_dir(run_dir, rank).exists():
            log = TensorBoardLog(run_dir, rank)
            for record in records:
                if record.rank == rank:
                    log.step(record)
            log.close()
