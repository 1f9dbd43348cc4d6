"""The training loop every device runs: one short loop driving a ``Strategy``.

``run_worker`` is the body of one device process, whether ``launch_local``
started it or ``torchrun`` did. It is four parts, in order:

- ``set_up_device``: rendezvous and peer admission (cluster token, config
  hash; cluster/peers), host cores and threads, seed, accelerator;
- ``calibrate_throttle``: the throttle's reference pass, one device of a
  host at a time;
- the loop: ``Strategy.train_step`` per batch (train/strategy.py: data
  parallel or tiled; the loop has no branch of its own for either), timed by
  a ``StepRecorder``; batches come from ``data.partition.build_sampler``:
  this device's share of every global batch, or with ``--partition`` its
  own partition only (whose sizes rank 0 prints and the summary keeps), or
  its own file where the cluster file gives one (``data.device_data``);
- a ``RunWriter``: records as they happen (and TensorBoard event files with
  ``--tensorboard``, ``train.tensorboard_log``), then summary and checkpoint.

Rank 0 says each start-up phase in one line on stderr as it begins
(``phase``: rendezvous, peer admission, data, near-duplicate filtering
(``--dedup``, ``data.dedup``), FLOP count, throttle calibration, strategy
set-up, training), unless ``--no-progress``; the
launcher adds the host's speed measurement and the devices' start.

Checkpoints during the run, ``--resume`` and the stop on SIGTERM are
``LoopCheckpoints`` (train/resume.py, over train/checkpoint.py's
``Checkpointer``: what is held, the protocol, what is exact): asked at the
start of every step, before the batch is taken. A resumed run restores every
device's state before the first step and rewrites the records files from the
checkpoint's, so that no step is counted twice. Who trains is the run's
membership (train/elastic.py): ``FailStop``, the devices of the start to the
end, or ``Elastic`` with ``--min-devices``; the loop calls either alike.

Each step's ``StepRecord`` (records.py) says where the time went:

- ``data_s``: waiting for the batch;
- ``comm_s``: waiting on communication that compute did not hide (the
  strategy measures it: ``StepResult.comm_s``);
- ``compute_s``: the rest of the step (forward, backward, optimizer, and the
  duty-cycle sleeps that emulate a slower device);
- ``comm_busy_s``: how long collectives ran in all, hidden or not (the
  ``CommStats`` difference over the step); ``None`` where the strategy cannot
  see its collectives (DDP's own all-reduce, ``comm/sync.py``).

Records as they happen: each device that has the run directory (all of them
on one host; rank 0 alone under torchrun, the others send theirs at the end)
appends its records to ``metrics-<rank>.jsonl`` and flushes every step (one
small write per step), and rank 0 appends each evaluation to ``evals.jsonl``:
a run killed half-way keeps what it did. A run that ends replaces the
per-device files by one ``metrics.jsonl`` sorted by (step, rank).

Accelerator: ``auto`` is ``cuda`` where torch sees a GPU, else ``cpu``; with
several devices on a host, device ``local_rank`` uses GPU ``local_rank % count``.
Model, batches and the strategy's tensors live there; collectives stay on
gloo (which takes CUDA tensors), as Jetson wheels ship without NCCL.

The summary's FLOPs are counted once on rank 0 (``bench.flops``) on the model
actually trained at the input shape actually fed, before training, on a copy
and with the RNG restored, so counting changes nothing in the run. Each
device's achieved GFLOPS is that count x its samples/s, and where it emulated
a profile it is also rated against that profile's peak (``device_peak``).
"""
from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import json
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from edgetrain.bench.flops import achieved, device_peak, training_flops_per_sample
from edgetrain.cluster.faults import inject_fault
from edgetrain.cluster.launch import loader_worker_init
from edgetrain.cluster.limits import DeviceLimits, device_limits
from edgetrain.cluster.network import choose_gloo_interface, deadline, describe_gloo_interface
from edgetrain.cluster.peers import admit_peers, check_rank_environment, gather_json, local_placement
from edgetrain.cluster.profiles import DeviceSpec
from edgetrain.cluster.throttle import Throttle, assign_cores, keep_freed_memory, page_faults, peak_rss_mb, pin
from edgetrain.comm.accounting import CommStats
from edgetrain.config import TrainConfig
from edgetrain.data import DataSplit, build_data, register_dataset
from edgetrain.data.dedup import drop_near_duplicates
from edgetrain.data.device_data import build_training_data
from edgetrain.data.cache import attach_cache
from edgetrain.data.partition import PartitionReport, PartitionSampler
from edgetrain.data.storage import LoadTimes, TrainingLoader
from edgetrain.errors import EdgetrainError, Terminated
from edgetrain.models import build_model, count_parameters, register_model
from edgetrain.models.batchnorm import local_batchnorm
from edgetrain.models.init import build_on_meta
from edgetrain.records import DeviceSummary, EnergyRecord, EvalRecord, MembershipRecord, RunSummary, StepRecord
from edgetrain.report.files import atomic_write, save_torch, write_json
from edgetrain.spec import RunSpec
from edgetrain.tasks import Task, build_task, task_record
from edgetrain.tasks.base import sum_totals
from edgetrain.train.checkpoint import FINAL_DIR, FINAL_FILE, Checkpointer, resume_hint, save_final_parts
from edgetrain.train.elastic import Elastic, FailStop
from edgetrain.train.energy import EnergyMeter
from edgetrain.train.evaluation import evaluate  # noqa: F401  (imported from here: fleet/app.py, tests)
from edgetrain.train.resume import LoopCheckpoints, LoopState
from edgetrain.train.strategy import StepResult, Strategy, StrategyContext, registered_strategy
from edgetrain.train.tensorboard_log import TensorBoardLog, write_missing_devices


_DEADLINE_MARGIN_S = 5.0  # past --timeout, before the rendezvous is ended from outside gloo


def init_distributed(cfg: TrainConfig, cluster_token: str = "") -> tuple[int, int]:
    """Join the run's process group, then admit the peers (same cluster token, same config; see cluster/peers)."""
    rank, world = check_rank_environment()
    if not dist.is_initialized():
        addr = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        chosen = choose_gloo_interface(os.environ.get("MASTER_ADDR"))  # cluster/network.py
        via = f", gloo on {chosen}" if chosen else ""
        phase(cfg, rank, f"rendezvous: {world} device(s) at {addr}{via} (waiting up to {cfg.timeout:g} s)")
        failed = (f"rendezvous at {addr} failed for rank {rank} of {world} within {cfg.timeout:g} s ({{}}); start "
                  f"every device, check MASTER_ADDR/MASTER_PORT, the firewall and the interface gloo uses "
                  f"({describe_gloo_interface()}; set GLOO_SOCKET_IFNAME to the cluster network's), or raise "
                  f"--timeout")
        try:
            # gloo retries a peer's connection with the full timeout each time: bound the whole wait here
            with deadline(cfg.timeout + _DEADLINE_MARGIN_S, failed.format("no answer from every peer")):
                dist.init_process_group("gloo", rank=rank, world_size=world,
                                        timeout=dt.timedelta(seconds=cfg.timeout))
        except (RuntimeError, TimeoutError, ValueError) as e:
            raise EdgetrainError(failed.format(str(e).splitlines()[0])) from None
        phase(cfg, rank, "admitting peers: cluster token and config hash of every device")
        try:
            admit_peers(cfg.to_dict(), cluster_token, rank, world)
        except EdgetrainError:
            # Leave the group before reporting: a process that exits with it alive can abort in C++ teardown
            # ("terminate called without an active exception", SIGABRT) after its one line.
            dist.destroy_process_group()
            raise
    return rank, world


def make_optimizer(cfg: TrainConfig, params, total_steps: int):
    if cfg.optimizer == "adam":
        opt = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.schedule == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(total_steps, 1))
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    return opt, sched


def accelerator_device(accelerator: str, local_rank: int = 0) -> torch.device:
    """The torch device ``--accelerator`` names for this device; one line if it asks for a GPU torch cannot see."""
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise EdgetrainError("accelerator cuda was asked for but torch sees no CUDA GPU on this host "
                             f"(torch {torch.__version__}); use --accelerator cpu or auto")
    if accelerator == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    # Set and initialised now: torch's device mesh (fsdp) would otherwise pick GPU LOCAL_RANK, which emulated
    # devices sharing one GPU do not have
    torch.cuda.set_device(device)
    torch.cuda.init()
    return device


@dataclass
class DeviceSetup:
    device_id: int  # its rank at the start of the run, its identity in records (elastic runs change ranks)
    rank: int
    world: int
    local_rank: int
    local_world: int
    me: DeviceSpec
    speed: float | None
    cores: list[int]
    threads: int
    device: torch.device
    returning: bool = False  # started again in an elastic run, admitted by the devices that went on


def set_up_device(cfg: TrainConfig, spec: RunSpec, devices: list[DeviceSpec], speeds: list[float | None],
                  cluster_token: str, elastic: Elastic | None = None) -> DeviceSetup:
    """Rendezvous and admission (a returning device of an elastic run: admission by its peers), host cores
    and threads, seed, accelerator."""
    device_id = check_rank_environment()[0]
    returning = bool(elastic and elastic.joining)
    # A returning device joins later (run_worker), once its data and model are ready: the members wait for it
    # from its join on. Until then it has no rank (-1: it prints no phase) and no group.
    rank, world = (-1, len(devices)) if returning else init_distributed(cfg, cluster_token)
    me = devices[device_id]
    local_rank, local_world = local_placement(rank, world)  # without torchrun: counted per host (cluster/peers)
    speed = speeds[device_id] if cfg.throttle else None
    cores = assign_cores(local_rank, local_world)
    if speed is not None:
        # A throttled device needs only ceil(speed) host cores; more threads would burn CPU time
        # in OpenMP spin-waits, which the throttle would then stretch as if it were work.
        cores = cores[:max(1, math.ceil(speed))]
    pin(cores)
    keep_freed_memory()  # activations freed at the end of a step are reused by the next (cluster/throttle.py)
    threads = cfg.threads or (min(len(cores), me.profile.cores) if me.profile.cores else len(cores))
    torch.set_num_threads(threads)
    torch.manual_seed(spec.seed)
    return DeviceSetup(device_id, rank, world, local_rank, local_world, me, speed, cores, threads,
                       accelerator_device(spec.accelerator, local_rank), returning)


def calibrate_throttle(throttle: Throttle | None, model: nn.Module, example: torch.Tensor | None,
                       at: DeviceSetup) -> None:
    """The reference pass (this model, this device's batch, warm and unthrottled), then the duty cycle.

    Every device of a run with a throttled device calls it, an unthrottled one (``throttle`` None) too: the
    turns are collectives, and a cluster may mix throttled profiles with ``host`` devices."""
    if example is not None:
        # One device of each host at a time: devices sharing host cores would otherwise slow
        # each other's reference, and with it the whole run.
        turns = torch.tensor([at.local_world])
        alone = at.world == 1 or at.returning  # a returning device's peers are training: it measures alone
        if not alone:
            dist.all_reduce(turns, op=dist.ReduceOp.MAX)
        for turn in range(int(turns.item())):
            if turn == at.local_rank and throttle:
                # the others wait at the barrier: BatchNorm statistics over the devices would wait for them
                throttle.calibrate(local_batchnorm(model), example)
            if not alone:
                dist.barrier()
    if throttle:
        throttle.attach(model)


class StepRecorder:
    """Times one step (data wait, the strategy's step, CPU), diffs the ``CommStats``, builds its ``StepRecord``."""

    def __init__(self, stats: CommStats, rank: int):
        self.stats, self.rank = stats, rank

    def start(self) -> None:
        self.t0, self.cpu0, self.faults0 = time.perf_counter(), time.process_time(), page_faults()
        self.before = self.stats.snapshot()

    def data_ready(self, load: LoadTimes | None = None) -> None:
        self.t_data = time.perf_counter()
        self.load = load or LoadTimes()

    def finish(self, step: int, epoch: int, result: StepResult, lr: float) -> StepRecord:
        step_s = time.perf_counter() - self.t0
        after = self.stats.snapshot()
        data_s = self.t_data - self.t0
        load = self.load
        extra = {"comm_busy_s": after["comm_s"] - self.before["comm_s"], "read_s": load.read_s,
                 "decode_s": load.decode_s, "storage_items": load.storage_items, "cache_items": load.cache_items,
                 **result.metrics}
        return StepRecord(
            step=step, epoch=epoch, rank=self.rank, loss=result.loss_sum / result.samples if result.samples else None,
            samples=result.samples, samples_per_s=result.samples / step_s, step_s=step_s, data_s=data_s,
            compute_s=max(step_s - data_s - result.comm_s, 0.0), comm_s=result.comm_s,
            bytes_sent=after["bytes_sent"] - self.before["bytes_sent"],
            bytes_recv=after["bytes_recv"] - self.before["bytes_recv"],
            cpu_s=time.process_time() - self.cpu0, lr=lr, peak_rss_mb=peak_rss_mb(),
            page_faults=page_faults() - self.faults0, **extra)


class RunWriter:
    """The run directory's files: records as they happen, then metrics.jsonl, checkpoint and summary.

    A device without the run directory (``run_dir`` None: ranks > 0 under torchrun) writes nothing.
    ``tensorboard``: TensorBoard event files beside them (``train.tensorboard_log``).
    """

    def __init__(self, run_dir: str | None, rank: int, tensorboard: bool = False):
        self.run_dir = Path(run_dir) if run_dir else None
        self.rank = rank
        self._metrics = open(self.live_metrics(rank), "a", encoding="utf-8") if self.run_dir else None
        self.tensorboard = tensorboard
        self._events = TensorBoardLog(self.run_dir, rank) if tensorboard and self.run_dir else None

    def live_metrics(self, rank: int) -> Path:
        return self.run_dir / f"metrics-{rank}.jsonl"

    def step(self, record: StepRecord) -> None:
        if self._metrics:
            self._metrics.write(json.dumps(record.to_dict()) + "\n")
            self._metrics.flush()  # a killed run keeps its steps; one small write per step
        if self._events:
            self._events.step(record)

    def evaluation(self, record: EvalRecord) -> None:
        """Rank 0's (the loop calls it there)."""
        if self.run_dir:
            with open(self.run_dir / "evals.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(record.to_dict()) + "\n")
            if self._events:
                self._events.evaluation(record)

    def restart(self, records: list[StepRecord], evals: list[EvalRecord]) -> None:
        """A resumed run: the records files hold exactly the checkpoint's records (a killed run may have
        written steps after its last checkpoint), and new ones are appended after them."""
        if not self._metrics:
            return
        self._metrics.close()
        with atomic_write(self.live_metrics(self.rank)) as f:
            f.writelines(json.dumps(r.to_dict()) + "\n" for r in records)
        self._metrics = open(self.live_metrics(self.rank), "a", encoding="utf-8")
        if self.rank == 0 and (evals or (self.run_dir / "evals.jsonl").exists()):
            with atomic_write(self.run_dir / "evals.jsonl") as f:
                f.writelines(json.dumps(e.to_dict()) + "\n" for e in evals)

    def close(self) -> None:
        if self._metrics:
            self._metrics.close()
            self._metrics = None
        if self._events:
            self._events.close()
            self._events = None

    def metrics(self, records: list[StepRecord], world: int) -> None:
        """Rank 0, after every device closed its file: one sorted metrics.jsonl replaces the per-device ones."""
        with atomic_write(self.run_dir / "metrics.jsonl") as f:
            for r in sorted(records, key=lambda r: (r.step, r.rank)):
                f.write(json.dumps(r.to_dict()) + "\n")
        for live in self.run_dir.glob("metrics-*.jsonl"):  # devices a resume with fewer left behind too
            live.unlink(missing_ok=True)
        if self.tensorboard:
            write_missing_devices(self.run_dir, records, world)

    def summary(self, cfg: TrainConfig, strategy: Strategy, optimizer, per_device: list[DeviceSummary], train_totals,
                evals: list[EvalRecord], params, data, world, local_batches, steps, wall_s, flops_per_sample,
                partition: PartitionReport | None = None, membership: list[MembershipRecord] | None = None,
                planned_steps: int | None = None, task_name: str | None = None) -> dict:
        """Rank 0, last: checkpoint.pt (a pooled strategy's devices wrote checkpoint/ already) and summary.json;
        returns the summary as written."""
        run_dir = self.run_dir
        for d in per_device:
            d.details.update(achieved(flops_per_sample["total_flops"], d.samples_per_s, d.details.get("peak_gflops")))
        if not strategy.pooled:
            save_torch(run_dir / FINAL_FILE, {**strategy.checkpoint_state(optimizer), "step": steps,
                                              "planned_steps": planned_steps, "config": cfg.to_dict()})
        step_s = sum(d.step_s for d in per_device) / world
        split = {k: sum(getattr(d, f"{k}_s") for d in per_device) / world for k in ("data", "compute", "comm")}
        last = evals[-1] if evals else None
        bytes_sent = sum(d.bytes_sent for d in per_device)
        task = strategy.context.task
        train_loss, train_counts, train_seen = train_totals
        train_figures = task.train_figures(train_counts, int(train_seen))
        summary = RunSummary(
            run_dir=str(run_dir), model=cfg.model, params=params, dataset=data.name,
            input_shape=list(data.input_shape), flops_per_sample=flops_per_sample,
            devices=world, profiles=[d.profile for d in per_device], strategy=strategy.name,
            accelerator=str(strategy.context.device), global_batch=cfg.batch_size, local_batches=local_batches,
            steps=steps, train_loss=train_loss / train_seen if train_seen else float("nan"),
            train_accuracy=train_figures.get("accuracy"),
            test_loss=last.test_loss if last else None, test_accuracy=last.test_accuracy if last else None,
            evals=evals, membership=membership or [], task=task_record(task, task_name),
            train_metrics=train_figures, test_metrics=last.values() if last else None,
            throughput_samples_per_s=sum(d.samples_per_s for d in per_device),
            achieved_gflops=sum(d.details["achieved_gflops"] for d in per_device),
            step_s=step_s, time_split_s=split,
            time_split_fraction={k: v / step_s for k, v in split.items()} if step_s else {},
            bytes_sent_total=bytes_sent, bytes_recv_total=sum(d.bytes_recv for d in per_device),
            bytes_sent_per_step_per_device=bytes_sent / max(steps, 1) / world,
            peak_rss_mb_max=max(d.peak_rss_mb for d in per_device),
            wall_time_s=wall_s, batchnorm=strategy.context.spec.batchnorm, per_device=per_device,
            checkpoint=FINAL_DIR if strategy.pooled else FINAL_FILE,
            clipped_boxes=data.details.get("clipped_boxes"),
            details={**strategy.summary(), **{k: v for k, v in data.details.items() if k != "clipped_boxes"},
                     **({"partition": partition.to_dict()} if partition else {})},
        ).to_dict()
        write_json(run_dir / "summary.json", summary)
        return summary


def run_worker(cfg: TrainConfig, spec: RunSpec, devices: list[DeviceSpec], *args, **kwargs) -> dict | None:
    """Train on this device (``train_device``) inside the memory and storage limits ``--device-limits`` asks for
    (cluster/limits.py), removed whatever ends it."""
    me = devices[check_rank_environment()[0]]
    limits = device_limits(cfg.device_limits, me.label, me.profile.memory_mb, cfg.storage or me.profile.storage,
                           me.data or cfg.data_dir)
    try:
        return train_device(cfg, spec, devices, *args, limits=limits, **kwargs)
    finally:
        if limits is not None:
            limits.close()


def train_device(cfg: TrainConfig, spec: RunSpec, devices: list[DeviceSpec], local_batches: list[int],
                 speeds: list[float | None], run_dir: str | None, user_model: nn.Module | None = None,
                 registered: dict | None = None, cluster_token: str = "",
                 strategy_class: type[Strategy] | None = None, datasets: dict | None = None,
                 loaded: DataSplit | None = None, user_task: Task | None = None,
                 limits: DeviceLimits | None = None) -> dict | None:
    """Train on this device; rank 0 returns the run summary, the others None.

    ``strategy_class``: a ``Strategy`` to train with instead of ``registered_strategy(spec.strategy)``;
    ``registered`` and ``datasets``: models and datasets registered in the launching process; ``loaded``:
    the dataset as the launching process loaded it (else this device loads it); ``user_task``: a ``Task`` passed
    from Python (else the run's built-in task, ``--task`` or the one the dataset implies).
    """
    started = time.perf_counter()
    # A device that sits out the first steps (rounds it is no member of, comm/local_sgd.py) steps the schedule
    # before its optimizer has stepped, which is intended: every device keeps the same learning rate per step.
    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step()` before `optimizer.step()`")
    if user_model is not None:
        # Our own copy before anything else: multiprocessing pickles the model with torch's reducers, which hand
        # every device (and the caller) the same shared-memory storage, so the devices would all train one tensor.
        user_model = copy.deepcopy(user_model)
    for name, factory in (registered or {}).items():
        register_model(name, factory)
    for name, factory in (datasets or {}).items():
        register_dataset(name, factory)
    # who trains (train/elastic.py): the devices of the start to the end, or as many as remain and come back
    membership = Elastic(spec, devices, local_batches, run_dir) if spec.min_devices else FailStop(spec, local_batches)
    at = set_up_device(cfg, spec, devices, speeds, cluster_token, membership)
    rank = at.rank
    if limits is not None and limits.fallbacks and rank == 0:
        print(f"edgetrain: note: --device-limits cgroup falls back on this host ({'; '.join(limits.fallbacks)}); "
              "memory is checked by peak RSS only and storage reads are not throttled where it says so",
              file=sys.stderr, flush=True)

    phase(cfg, rank, f"loading data: {cfg.dataset}")
    # Our own copy, as for the model: multiprocessing hands every device the launcher's tensors in shared memory.
    data = copy.deepcopy(loaded) if loaded is not None else build_data(cfg, spec.task)
    if spec.dedup is not None:
        phase(cfg, rank, f"dropping near-duplicate training images (pHash within {spec.dedup.threshold} bits; "
                         "reads every training image)")
        data, dedup = drop_near_duplicates(data, spec.dedup)
        if rank == 0:
            print(dedup.describe(), flush=True)
    # On the meta device (no storage): the strategy materialises only what this device holds (models/init.py).
    model = user_model if user_model is not None else build_on_meta(build_model, cfg.model, data.in_channels,
                                                                     data.num_classes)
    params = count_parameters(model)
    task = copy.deepcopy(user_task) if user_task is not None else build_task(spec.task, data)
    # The model actually trained at the input shape actually fed (counted on a copy, RNG untouched).
    phase(cfg, rank, f"counting FLOPs: {cfg.model} at {'x'.join(map(str, data.input_shape))}")
    # a real batch of the test set: its targets' structure (boxes) is what the FLOPs count; the training set is
    # left to its sampler (a dataset may log or stream what it is asked for)
    examples = data.test if len(data.test) else data.train
    flops_per_sample = training_flops_per_sample(model, input_shape=data.input_shape,
                                                 num_classes=data.num_classes, task=task,
                                                 example=task.collate([examples[i] for i in range(min(2, len(examples)))])
                                                 ) if rank == 0 or membership.reports_anywhere else None
    if at.returning:  # ready to train: admitted at the members' next step (train/elastic.py)
        rank, world = membership.join()
        at = dataclasses.replace(at, rank=rank, world=world)
    rank, world, local_batches = at.rank, at.world, membership.local_batches
    checkpoints = LoopCheckpoints(Checkpointer(spec.checkpoint, run_dir, rank, world, spec.timeout_s),
                                  cfg.to_dict(), at.device)
    stats = CommStats()
    strategy = (strategy_class or registered_strategy(spec.strategy))(StrategyContext(
        cfg, spec, rank, world, local_batches[rank], tuple(data.input_shape), stats, at.me.link, at.device,
        steps_per_epoch=len(data.train) // cfg.batch_size, task=task))
    model = strategy.adapt(strategy.materialise(model))
    throttle = Throttle(at.speed) if at.speed is not None else None
    if cfg.throttle and any(speed is not None for speed in speeds):  # the same on every device: all take part
        phase(cfg, rank, "calibrating the throttle: a reference pass per device, one device of this host at a time")
        batch = strategy.calibration_batch
        checkpoints.keep_calibration(throttle)
        calibrate_throttle(throttle, model, None if batch is None or checkpoints.resumed else
                           torch.randn(batch, *data.input_shape, device=at.device), at)
    phase(cfg, rank, f"setting up strategy {strategy.name}")
    strategy.setup(model)

    train_set, sampler, partition = build_training_data(data, at.me, spec.partition,
                                                        *strategy.data_share(local_batches), spec.seed)
    if partition is not None and rank == 0:
        print(partition.describe(), flush=True)
    if isinstance(sampler, PartitionSampler):  # a device's own data: federated rounds may weight by its size
        strategy.data_ready(len(sampler.indices))
    if len(sampler) == 0:
        raise EdgetrainError(f"batch_size {cfg.batch_size} is larger than the {len(data.train)} training images of "
                             f"{data.name}; lower batch_size")
    cache = attach_cache(train_set, cfg.cache_mb, spec.seed + at.device_id, cfg.cache_dir)
    if cache is not None and rank == 0:
        print(f"{at.me.label}: MinIO cache of {cfg.cache_mb:g} MB holds {cache.describe()} training items",
              flush=True)
    elif cfg.cache_mb > 0 and rank == 0:
        print(f"edgetrain: note: --cache-mb caches datasets on storage (shards, --from-storage); {data.name} is in "
              "memory already", file=sys.stderr, flush=True)
    loader = TrainingLoader(train_set, sampler, task.collate, cfg.workers, cfg.prefetch, cfg.timeout, at.me.label,
                            pin_memory=at.device.type == "cuda", worker_init_fn=loader_worker_init)
    total_steps = min(cfg.steps or math.inf, cfg.epochs * len(sampler))
    epochs = math.ceil(total_steps / len(sampler))
    optimizer, scheduler = make_optimizer(cfg, strategy.parameters(), int(total_steps))

    writer = RunWriter(run_dir, at.device_id, spec.tensorboard)
    phase(cfg, rank, f"training: {int(total_steps)} steps, {epochs} epoch(s)")
    recorder = StepRecorder(stats, at.device_id)
    bar = _progress(cfg, rank, int(total_steps))
    state = LoopState(started, planned_steps=int(total_steps))
    # Checked against peak RSS unless the kernel holds the device to its memory (--device-limits cgroup): RSS
    # counts the pages this process shares with the launcher (torch itself), which the cgroup does not.
    limit_mb = None if limits is not None and limits.memory_bound else at.me.profile.memory_mb
    checkpoints.restore(state, strategy, optimizer, scheduler, writer)
    # a returning device of an elastic run receives the current state here
    state.step, state.epoch, state.evals = membership.start(strategy, optimizer, scheduler, sampler, loader,
                                                            state.step, state.epoch, state.evals)
    checkpoints.resumed_step = state.step
    checkpoints.files.catch_sigterm()
    # joules of the training steps (train/energy.py): a sensor's, shared by CPU time where devices share a host
    energy = EnergyMeter(at.me.profile, at.me.profile.cores or at.threads, at.local_world > 1,
                         power_file=cfg.power_file)
    energy.start()
    first_record = len(state.records)
    for epoch in range(state.epoch, epochs):
        state.epoch = epoch
        sampler.set_epoch(epoch)
        if checkpoints.resumes_in(state):
            sampler.resume_at(epoch, state.step - epoch * len(sampler))
        else:
            state.new_epoch()
        batches = iter(loader)
        while state.step < total_steps:
            if checkpoints.save_if_due(state, strategy, optimizer, scheduler, throttle):
                break  # SIGTERM: stopped with this checkpoint
            inject_fault(membership.faults, at.device_id, state.step, spec.timeout_s)  # EDGETRAIN_FAULT
            recorder.start()
            try:
                membership.boundary(state.step, epoch, state.evals)
                x, y = next(batches)
                x, y = x.to(at.device, non_blocking=True), task.to_device(y, at.device)
                recorder.data_ready(batches.last)
                result = strategy.train_step(x, y, optimizer)
            except StopIteration:
                break
            except membership.failures as e:  # a device left or joined: the step is done again
                rank, world, local_batches, batches, state.step = membership.reform(e, epoch)
                continue
            scheduler.step()
            record = recorder.finish(state.step, epoch, result, scheduler.get_last_lr()[0])
            writer.step(record)
            state.count(record, result)
            if limit_mb is not None and record.peak_rss_mb > limit_mb:
                raise EdgetrainError(f"{at.me.label} ran out of memory: peak {record.peak_rss_mb:.0f} MiB > its "
                                     f"{limit_mb} MiB at step {state.step}; lower batch_size or give the profile "
                                     f"more memory_mb")
            if bar and state.ema_loss is not None:
                bar.update(state.step, epoch, state.ema_loss,
                           figures_text(task, task.train_figures(state.totals[1], int(state.totals[2]))),
                           cfg.batch_size / record.step_s)
        if checkpoints.stopped:
            break
        if state.step >= total_steps or epoch == epochs - 1:
            strategy.finish()  # the last exchange: every device now holds the same model
        if cfg.eval:
            metrics = strategy.evaluate(data.test)
            if isinstance(metrics, tuple):  # a strategy of one's own may give a classifier's (loss, accuracy)
                metrics = {"loss": metrics[0], "accuracy": metrics[1]}
            test_loss = metrics.pop("loss")
            state.evals.append(EvalRecord(epoch=epoch, step=state.step, test_loss=test_loss,
                                          test_accuracy=metrics.get("accuracy"), metrics=metrics))
            if rank == 0:
                writer.evaluation(state.evals[-1])
            headline = task.headline
            _note(bar, rank, f"epoch {epoch + 1}/{epochs}: test {headline.label or headline.name} "
                             f"{headline.format(metrics[headline.name])}, loss {test_loss:.3f}")
        if state.step >= total_steps:
            break
    checkpoints.files.release_sigterm()
    energy_record = energy.stop(sum(r.samples for r in state.records[first_record:]))
    if bar:
        bar.close()
    strategy.finish()  # no-op if the last epoch already called it
    writer.close()
    if strategy.pooled:  # every device writes its own part of the final model: RUN_DIR/checkpoint/
        save_final_parts(run_dir, strategy.sharded_state(optimizer, final=True), state.step, cfg.to_dict(), rank,
                         world, spec.timeout_s, planned_steps=state.planned_steps)
    task_name = spec.task
    summary = _end_of_run(cfg, state, at, strategy, optimizer, writer, membership, checkpoints, throttle, devices,
                          rank, world, local_batches, params, data, flops_per_sample, partition, task_name,
                          energy_record, limits)
    dist.barrier()
    dist.destroy_process_group()
    if checkpoints.stopped:
        raise Terminated(resume_hint(run_dir) if run_dir else "", checkpoints.files.stop_signal)
    return summary


def _end_of_run(cfg: TrainConfig, state: LoopState, at: DeviceSetup, strategy: Strategy, optimizer, writer: RunWriter,
                membership, checkpoints: LoopCheckpoints, throttle: Throttle | None, devices: list[DeviceSpec],
                rank: int, world: int, local_batches: list[int], params: int, data: DataSplit, flops_per_sample,
                partition: PartitionReport | None, task_name: str | None,
                energy: EnergyRecord | None = None, limits: DeviceLimits | None = None) -> dict | None:
    """Every device: its summary and records to rank 0, which writes metrics.jsonl, checkpoint.pt and
    summary.json; rank 0 returns the summary, the others None."""
    limit_mb = None if limits is not None and limits.memory_bound else at.me.profile.memory_mb
    train_totals = tuple(state.totals)
    mine = dataclasses.replace(_device_summary(state.records, at, local_batches[rank], throttle, cfg.workers),
                               energy=energy)
    if limits is not None:
        mine.details["limits"] = limits.describe()
    if limit_mb is not None and mine.run_peak_rss_mb > limit_mb:
        # Warned, not raised: training is done and the final model is written; but a real device of this size
        # would not have survived the end of the run (its evaluation, the final exchange or checkpoint), and
        # the summary says so (run_peak_rss_mb) rather than only the steps' peak.
        print(f"edgetrain: warning: {at.me.label} went over its memory at the end of the run: peak "
              f"{mine.run_peak_rss_mb:.0f} MiB > its {limit_mb} MiB after the final exchange and checkpoint "
              f"({strategy.name}); "
              f"its training steps peaked at {mine.peak_rss_mb:.0f} MiB", file=sys.stderr, flush=True)
    if world > 1:  # rank 0's summary needs them (JSON: the counts are a dict of the task's own keys)
        everyone = gather_json(list(train_totals), dst=0)
        train_totals = sum_totals(everyone) if everyone is not None else train_totals
        # JSON, not pickles: see cluster/peers
        gathered = gather_json(([r.to_dict() for r in state.records], mine.to_dict()), dst=0)
    else:
        gathered = [([r.to_dict() for r in state.records], mine.to_dict())]
    if rank != 0:
        return None
    all_records = membership.all_records([records for records, _ in gathered] + [checkpoints.files.departed_records])
    writer.metrics(all_records, max([len(devices), *(r.rank + 1 for r in all_records)]))
    per_device = [DeviceSummary.from_dict(d) for _, d in gathered]
    return writer.summary(cfg, strategy, optimizer, per_device, train_totals, state.evals, params, data, world,
                          local_batches, state.step, time.perf_counter() - state.started, flops_per_sample,
                          partition, membership.history(), planned_steps=state.planned_steps, task_name=task_name)


def phase(cfg: TrainConfig, rank: int, text: str) -> None:
    """A start-up phase on rank 0, one line on stderr as it begins (not with --no-progress)."""
    if cfg.progress and rank == 0:
        print(f"edgetrain: {text}", file=sys.stderr, flush=True)


def _note(bar, rank: int, text: str) -> None:
    """An epoch line on rank 0: above the progress bar, or alone with --no-progress."""
    if bar:
        bar.note(text)
    elif rank == 0:
        print(text, flush=True)


def _device_summary(records: list[StepRecord], at: DeviceSetup, local_batch: int,
                    throttle: Throttle | None, workers: int = 0) -> DeviceSummary:
    timed = records[1:] or records  # the first step pays one-off costs (allocations, DDP set-up)
    total = sum(r.step_s for r in timed) or float("nan")

    def mean(name: str) -> float:
        return sum(getattr(r, name) for r in timed) / len(timed)

    def per_epoch(name: str) -> float | None:  # every step, the first included: an epoch's reads are all of them
        counted = [r for r in records if getattr(r, name) is not None]
        return sum(getattr(r, name) for r in counted) / len({r.epoch for r in counted}) if counted else None

    loaded = all(r.read_s is not None for r in timed)

    return DeviceSummary(
        rank=at.device_id, profile=at.me.profile.name, link=at.me.link, local_batch=local_batch,
        speed=at.speed, cores=list(at.cores), threads=at.threads,
        samples_per_s=sum(r.samples for r in timed) / total, step_s=total / len(timed),
        data_s=mean("data_s"), compute_s=mean("compute_s"), comm_s=mean("comm_s"), cpu_s=mean("cpu_s"),
        page_faults=mean("page_faults"),
        # None where the strategy could not measure it (DDP's own all-reduce)
        comm_busy_s=None if any(r.comm_busy_s is None for r in timed) else mean("comm_busy_s"),
        bytes_sent=sum(r.bytes_sent for r in records), bytes_recv=sum(r.bytes_recv for r in records),
        peak_rss_mb=max((r.peak_rss_mb for r in records), default=peak_rss_mb()),
        run_peak_rss_mb=peak_rss_mb(),  # called after strategy.finish() and the final checkpoint's write
        throttle_slept_s=throttle.slept if throttle else 0.0,
        # Measured: CPU time of a warm unthrottled forward + backward pass, and how much more the throttled
        # ones cost (median); the throttle divides charged CPU time by the latter.
        throttle_reference_pass_s=throttle.reference_cpu if throttle else None,
        throttle_inflation=statistics.median(throttle.inflations) if throttle and throttle.inflations else None,
        read_s=mean("read_s") if loaded else None, decode_s=mean("decode_s") if loaded else None, workers=workers,
        storage_items_per_epoch=per_epoch("storage_items"), cache_items_per_epoch=per_epoch("cache_items"),
        # The peak this device is rated against: its profile's where it emulated one (see bench.flops).
        details=dict(device_peak(at.me.profile, at.speed) or {}))


class _Bar:
    """Rank 0's progress bar (rich)."""

    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
        self.task = self.progress.add_task("train", total=total, info="")
        self.progress.start()

    def update(self, step, epoch, loss, figures: str, rate):
        self.progress.update(self.task, completed=step,
                             info=f"epoch {epoch + 1}  loss {loss:.3f}  {figures}{rate:,.0f} samples/s")

    def note(self, text: str):
        self.progress.console.print(text)

    def close(self):
        self.progress.stop()


def figures_text(task: Task, figures: dict) -> str:
    """The progress bar's train figures: ``acc 91.2%  `` for a classifier (its metrics' own formats)."""
    shown = []
    for name, value in figures.items():
        metric = task.metric(name)
        label = "acc" if name == "accuracy" else (metric.label or name) if metric else name
        shown.append(f"{label} {metric.format(value) if metric else format(value, '.4g')}  ")
    return "".join(shown)


def _progress(cfg, rank, total):
    return _Bar(total) if cfg.progress and rank == 0 else None
