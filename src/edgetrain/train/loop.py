"""The training every device runs: ``run_worker(plan)`` runs a ``DeviceRun``, in phases, driving a ``Strategy``.

Also the parts it is made of: ``set_up_device`` (rendezvous, admission, cores), ``calibrate_throttle``,
``StepRecorder`` (a step's ``StepRecord``), ``RunWriter`` (the run directory's records and summary). How a
device's run goes, what a step record measures and what the run directory receives:
docs/design/architecture.md ("The device's loop").
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

from edgetrain.cluster.faults import inject_fault
from edgetrain.cluster.launch import loader_worker_init
from edgetrain.cluster.limits import DeviceLimits, device_limits
from edgetrain.cluster.network import choose_gloo_interface, deadline, describe_gloo_interface
from edgetrain.cluster.peers import (admit_peers, all_gather_json, check_rank_environment, gather_json,
                                    local_placement)
from edgetrain.cluster.profiles import DeviceSpec
from edgetrain.cluster.throttle import Throttle, assign_cores, keep_freed_memory, page_faults, peak_rss_mb, pin
from edgetrain.comm.accounting import CommStats
from edgetrain.config import TrainConfig
from edgetrain.data import DataSplit, build_data, register_dataset
from edgetrain.data.dedup import drop_near_duplicates
from edgetrain.data.device_data import build_training_data
from edgetrain.data.cache import attach_cache
from edgetrain.data.partition import PartitionReport, PartitionSampler
from edgetrain.data.storage import LoaderOptions, LoadTimes, TrainingLoader
from edgetrain.errors import EdgetrainError, Terminated
from edgetrain.models import build_model, count_parameters, register_model
from edgetrain.models.batchnorm import local_batchnorm
from edgetrain.models.init import build_on_meta
from edgetrain.privacy.dp import PrivacyPlan
from edgetrain.records import (DeviceSummary, EnergyRecord, EvalRecord, MembershipRecord, PrivacyRecord, RunSummary,
                               StepRecord)
from edgetrain.files import atomic_write, write_json
from edgetrain.tasks import Task, build_task, task_record
from edgetrain.tasks.base import sum_totals
from edgetrain.tasks.flops import achieved, device_peak, training_flops_per_sample
from edgetrain.train.checkpoint import (FINAL_DIR, FINAL_FILE, Checkpointer, Writers, resume_hint, save_final_parts,
                                       save_torch)
from edgetrain.train.elastic import Elastic, FailStop
from edgetrain.train.energy import EnergyMeter, Sensors
from edgetrain.train.evaluation import evaluate  # noqa: F401  (imported from here: fleet/app.py, tests)
from edgetrain.train.resume import LoopCheckpoints, LoopState
from edgetrain.train.run_plan import RunPlan, accelerator_device, phase  # noqa: F401  (phase: tests import it here)
from edgetrain.train.strategy import StepResult, Strategy, StrategyContext, registered_strategy
from edgetrain.train.tensorboard_log import TensorBoardLog, write_missing_devices

# Imported inside functions: rich.progress (rank 0's bar; the other devices start without it).


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


def set_up_device(plan: RunPlan, elastic: Elastic | FailStop | None = None) -> DeviceSetup:
    """Rendezvous and admission (a returning device of an elastic run: admission by its peers), host cores
    and threads, seed, accelerator."""
    cfg, spec = plan.cfg, plan.spec
    device_id = check_rank_environment()[0]
    returning = bool(elastic and elastic.joining)
    # A returning device joins later (run_worker), once its data and model are ready: the members wait for it
    # from its join on. Until then it has no rank (-1: it prints no phase) and no group.
    rank, world = (-1, len(plan.devices)) if returning else init_distributed(cfg, plan.token)
    me = plan.devices[device_id]
    local_rank, local_world = local_placement(rank, world)  # without torchrun: counted per host (cluster/peers)
    speed = plan.speeds[device_id] if cfg.throttle else None
    cores = assign_cores(local_rank, local_world, list(plan.host_cores) if plan.host_cores else None)
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


@dataclass(frozen=True)
class RunOutcome:
    """What rank 0's summary is written from, once the run has ended (``DeviceRun.outcome``)."""
    cfg: TrainConfig
    strategy: Strategy
    optimizer: torch.optim.Optimizer
    data: DataSplit
    params: int
    flops_per_sample: dict
    partition: PartitionReport | None
    task_name: str | None
    world: int
    local_batches: list[int]
    steps: int
    planned_steps: int | None
    wall_s: float
    evals: list[EvalRecord]
    membership: list[MembershipRecord]
    privacy: PrivacyRecord | None = None


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

    def summary(self, run: RunOutcome, per_device: list[DeviceSummary], train_totals) -> dict:
        """Rank 0, last: checkpoint.pt (a pooled strategy's devices wrote checkpoint/ already) and summary.json;
        returns the summary as written."""
        cfg, strategy, data, world, steps, evals = run.cfg, run.strategy, run.data, run.world, run.steps, run.evals
        run_dir = self.run_dir
        for d in per_device:
            d.details.update(achieved(run.flops_per_sample["total_flops"], d.samples_per_s,
                                      d.details.get("peak_gflops")))
        if not strategy.pooled:
            save_torch(run_dir / FINAL_FILE, {**strategy.checkpoint_state(run.optimizer), "step": steps,
                                              "planned_steps": run.planned_steps, "config": cfg.to_dict()})
        step_s = sum(d.step_s for d in per_device) / world
        split = {k: sum(getattr(d, f"{k}_s") for d in per_device) / world for k in ("data", "compute", "comm")}
        last = evals[-1] if evals else None
        bytes_sent = sum(d.bytes_sent for d in per_device)
        task = strategy.context.task
        train_loss, train_counts, train_seen = train_totals
        train_figures = task.train_figures(train_counts, int(train_seen))
        summary = RunSummary(
            run_dir=str(run_dir), model=cfg.model, params=run.params, dataset=data.name,
            input_shape=list(data.input_shape), flops_per_sample=run.flops_per_sample,
            devices=world, profiles=[d.profile for d in per_device], strategy=strategy.name,
            accelerator=str(strategy.context.device), global_batch=cfg.batch_size, local_batches=run.local_batches,
            steps=steps, train_loss=train_loss / train_seen if train_seen else float("nan"),
            train_accuracy=train_figures.get("accuracy"),
            test_loss=last.test_loss if last else None, test_accuracy=last.test_accuracy if last else None,
            evals=evals, membership=run.membership, task=task_record(task, run.task_name),
            train_metrics=train_figures, test_metrics=last.values() if last else None,
            throughput_samples_per_s=sum(d.samples_per_s for d in per_device),
            achieved_gflops=sum(d.details["achieved_gflops"] for d in per_device),
            step_s=step_s, time_split_s=split,
            time_split_fraction={k: v / step_s for k, v in split.items()} if step_s else {},
            bytes_sent_total=bytes_sent, bytes_recv_total=sum(d.bytes_recv for d in per_device),
            bytes_sent_per_step_per_device=bytes_sent / max(steps, 1) / world,
            peak_rss_mb_max=max(d.peak_rss_mb for d in per_device),
            wall_time_s=run.wall_s, batchnorm=strategy.context.spec.batchnorm, per_device=per_device,
            checkpoint=FINAL_DIR if strategy.pooled else FINAL_FILE,
            clipped_boxes=data.details.get("clipped_boxes"), privacy=run.privacy,
            details={**strategy.summary(), **{k: v for k, v in data.details.items() if k != "clipped_boxes"},
                     **({"partition": run.partition.to_dict()} if run.partition else {})},
        ).to_dict()
        write_json(run_dir / "summary.json", summary)
        return summary


def run_worker(plan: RunPlan) -> dict | None:
    """Train on this device (``DeviceRun``) inside the memory and storage limits ``--device-limits`` asks for
    (cluster/limits.py), removed whatever ends it."""
    cfg = plan.cfg
    me = plan.devices[check_rank_environment()[0]]
    limits = device_limits(cfg.device_limits, me.label, me.profile.memory_mb, cfg.storage or me.profile.storage,
                           me.data or cfg.data_dir)
    try:
        return DeviceRun(plan, limits).run()
    finally:
        if limits is not None:
            limits.close()


class DeviceRun:
    """One device's run of a ``RunPlan``, in phases (``run`` calls them in order); rank 0's ``run`` returns the
    run summary, the others None.

    ``start``: the user's parts registered, membership, rendezvous and admission, cores, seed, accelerator;
    ``load``: data, model (on the meta device), task, FLOPs; ``build_strategy``: the strategy, the model
    materialised and adapted, the throttle calibrated; ``prepare_loop``: this device's batches, optimizer,
    records, a resume's state; ``loop``: epochs of ``Strategy.train_step``; ``finish``: the final exchange,
    checkpoint, records and summary.
    """

    def __init__(self, plan: RunPlan, limits: DeviceLimits | None = None):
        self.plan, self.cfg, self.spec, self.limits = plan, plan.cfg, plan.spec, limits
        self.started = time.perf_counter()

    def run(self) -> dict | None:
        self.start()
        self.load()
        self.build_strategy()
        self.prepare_loop()
        self.loop()
        return self.finish()

    def start(self) -> None:
        plan, spec = self.plan, self.spec
        # A device that sits out the first steps (rounds it is no member of, comm/local_sgd.py) steps the schedule
        # before its optimizer has stepped, which is intended: every device keeps the same learning rate per step.
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step()` before `optimizer.step()`")
        # Our own copy before anything else: multiprocessing pickles the model with torch's reducers, which hand
        # every device (and the caller) the same shared-memory storage, so the devices would all train one tensor.
        self.user_model = copy.deepcopy(plan.user.model) if plan.user.model is not None else None
        for name, factory in plan.user.models.items():
            register_model(name, factory)
        for name, factory in plan.user.datasets.items():
            register_dataset(name, factory)
        # who trains (train/elastic.py): the devices of the start to the end, or as many as remain and come back
        devices, local_batches = list(plan.devices), list(plan.local_batches)
        self.membership = (Elastic(spec, devices, local_batches, plan.run_dir) if spec.min_devices
                           else FailStop(spec, local_batches))
        self.at = set_up_device(plan, self.membership)
        self.rank = self.at.rank
        if self.limits is not None and self.limits.fallbacks and self.rank == 0:
            print(f"edgetrain: note: --device-limits cgroup falls back on this host "
                  f"({'; '.join(self.limits.fallbacks)}); memory is checked by peak RSS only and storage reads are "
                  "not throttled where it says so", file=sys.stderr, flush=True)

    def load(self) -> None:
        cfg, spec, rank = self.cfg, self.spec, self.rank
        phase(cfg, rank, f"loading data: {cfg.dataset}")
        # Our own copy, as for the model: multiprocessing hands every device the launcher's tensors in shared memory.
        data = copy.deepcopy(self.plan.data) if self.plan.data is not None else build_data(cfg, spec.task)
        if spec.dedup is not None:
            phase(cfg, rank, f"dropping near-duplicate training images (pHash within {spec.dedup.threshold} bits; "
                             "reads every training image)")
            data, dedup = drop_near_duplicates(data, spec.dedup)
            if rank == 0:
                print(dedup.describe(), flush=True)
        self.data = data
        # On the meta device (no storage): the strategy materialises only what this device holds (models/init.py).
        self.model = self.user_model if self.user_model is not None else build_on_meta(
            build_model, cfg.model, data.in_channels, data.num_classes)
        self.params = count_parameters(self.model)
        user_task = self.plan.user.task
        self.task = copy.deepcopy(user_task) if user_task is not None else build_task(spec.task, data)
        self.flops_per_sample = self._count_flops() if rank == 0 or self.membership.reports_anywhere else None

    def _count_flops(self) -> dict:
        """The model actually trained at the input shape actually fed (counted on a copy, RNG untouched)."""
        data, task = self.data, self.task
        phase(self.cfg, self.rank, f"counting FLOPs: {self.cfg.model} at {'x'.join(map(str, data.input_shape))}")
        # a real batch of the test set: its targets' structure (boxes) is what the FLOPs count; the training set
        # is left to its sampler (a dataset may log or stream what it is asked for)
        examples = data.test if len(data.test) else data.train
        example = task.collate([examples[i] for i in range(min(2, len(examples)))])
        return training_flops_per_sample(self.model, input_shape=data.input_shape, num_classes=data.num_classes,
                                         task=task, example=example)

    def build_strategy(self) -> None:
        plan, cfg, spec = self.plan, self.cfg, self.spec
        if self.at.returning:  # ready to train: admitted at the members' next step (train/elastic.py)
            rank, world = self.membership.join()
            self.at = dataclasses.replace(self.at, rank=rank, world=world)
        at = self.at
        self.rank, self.world, self.local_batches = at.rank, at.world, self.membership.local_batches
        self.checkpoints = LoopCheckpoints(Checkpointer(spec.checkpoint, plan.run_dir, self.rank, self.world,
                                                        spec.timeout_s), cfg.to_dict(), at.device)
        self.stats = CommStats()
        strategy_class = plan.user.strategy or registered_strategy(spec.strategy)
        self.strategy = strategy = strategy_class(StrategyContext(
            cfg, spec, self.rank, self.world, self.local_batches[self.rank], tuple(self.data.input_shape),
            self.stats, at.me.link, at.device, steps_per_epoch=len(self.data.train) // cfg.batch_size,
            task=self.task))
        self.model = strategy.adapt(strategy.materialise(self.model))
        self.throttle = Throttle(at.speed) if at.speed is not None else None
        if cfg.throttle and any(speed is not None for speed in plan.speeds):  # the same on every device: all take part
            phase(cfg, self.rank, "calibrating the throttle: a reference pass per device, one device of this host "
                                  "at a time")
            batch = strategy.calibration_batch
            self.checkpoints.keep_calibration(self.throttle)
            calibrate_throttle(self.throttle, self.model, None if batch is None or self.checkpoints.resumed else
                               torch.randn(batch, *self.data.input_shape, device=at.device), at)
        phase(cfg, self.rank, f"setting up strategy {strategy.name}")
        strategy.setup(self.model)

    def _batches(self) -> None:
        """This device's share of the data (its own partition or file, ``data.device_data``) and its loader."""
        cfg, spec, at, data, rank = self.cfg, self.spec, self.at, self.data, self.rank
        train_set, self.sampler, self.partition = build_training_data(
            data, at.me, spec.partition, *self.strategy.data_share(self.local_batches), spec.seed)
        if self.partition is not None and rank == 0:
            print(self.partition.describe(), flush=True)
        if isinstance(self.sampler, PartitionSampler):  # a device's own data: federated rounds may weight by its size
            self.strategy.data_ready(len(self.sampler.indices))
        if len(self.sampler) == 0:
            raise EdgetrainError(f"batch_size {cfg.batch_size} is larger than the {len(data.train)} training images "
                                 f"of {data.name}; lower batch_size")
        cache = attach_cache(train_set, cfg.cache_mb, spec.seed + at.device_id, cfg.cache_dir)
        if cache is not None and rank == 0:
            print(f"{at.me.label}: MinIO cache of {cfg.cache_mb:g} MB holds {cache.describe()} training items",
                  flush=True)
        elif cfg.cache_mb > 0 and rank == 0:
            print(f"edgetrain: note: --cache-mb caches datasets on storage (shards, --from-storage); {data.name} is "
                  "in memory already", file=sys.stderr, flush=True)
        self.loader = TrainingLoader(train_set, self.sampler, self.task.collate, at.me.label,
                                     LoaderOptions(cfg.workers, cfg.prefetch, cfg.timeout, at.device.type == "cuda",
                                                   loader_worker_init))

    def prepare_loop(self) -> None:
        cfg, at, rank = self.cfg, self.at, self.rank
        self._batches()
        self.total_steps = int(min(cfg.steps or math.inf, cfg.epochs * len(self.sampler)))
        self.epochs = math.ceil(self.total_steps / len(self.sampler))
        if cfg.steps and cfg.steps > self.total_steps and rank == 0:  # said even with --no-progress: fewer steps
            print(f"edgetrain: note: --steps {cfg.steps} ends with --epochs {cfg.epochs} after {self.total_steps} "
                  f"steps ({len(self.sampler)} an epoch); raise --epochs to run them all", file=sys.stderr, flush=True)
        self.optimizer, self.scheduler = make_optimizer(cfg, self.strategy.parameters(), self.total_steps)
        self.privacy = self._make_private()
        self.writer = RunWriter(self.plan.run_dir, at.device_id, self.spec.tensorboard)
        phase(cfg, rank, f"training: {self.total_steps} steps, {self.epochs} epoch(s)")
        self.recorder = StepRecorder(self.stats, at.device_id)
        self.bar = _progress(cfg, rank, self.total_steps)
        state = self.state = LoopState(self.started, planned_steps=self.total_steps)
        self.checkpoints.restore(state, self.strategy, self.optimizer, self.scheduler, self.writer)
        # a returning device of an elastic run receives the current state here
        self.membership.start(self)
        self.checkpoints.resumed_step = state.step
        self.checkpoints.files.catch_sigterm()
        # joules of the training steps (train/energy.py): a sensor's, shared by CPU time where devices share a host
        self.energy = EnergyMeter(at.me.profile, at.me.profile.cores or at.threads, at.local_world > 1,
                                  sensors=Sensors(power_file=cfg.power_file))
        self.energy.start()
        self.first_record = len(state.records)

    def _make_private(self) -> PrivacyPlan | None:
        """``--dp``: the strategy trains privately; the plan says the noise and counts epsilon (privacy/dp.py).
        A sample's chance to be in a step's batch is ``1 / steps per epoch`` on its device, the largest over the
        devices (a collective: every device agrees on it, hence on a derived noise multiplier)."""
        dp = self.spec.dp
        if dp is None:
            return None
        rate = 1 / len(self.sampler)
        if self.world > 1:
            rate = max(all_gather_json(rate))
        plan = self.strategy.make_private(dp, min(rate, 1.0), self.total_steps)
        phase(self.cfg, self.rank, plan.describe())
        return plan

    def memory_limit_mb(self) -> int | None:
        """Checked against peak RSS unless the kernel holds the device to its memory (--device-limits cgroup):
        RSS counts the pages this process shares with the launcher (torch itself), which the cgroup does not."""
        return None if self.limits is not None and self.limits.memory_bound else self.at.me.profile.memory_mb

    def loop(self) -> None:
        """Epochs of steps, each epoch ending in the last exchange (the final epoch) and an evaluation."""
        state, sampler, checkpoints = self.state, self.sampler, self.checkpoints
        for epoch in range(state.epoch, self.epochs):
            state.epoch = epoch
            sampler.set_epoch(epoch)
            if checkpoints.resumes_in(state):
                sampler.resume_at(epoch, state.step - epoch * len(sampler))
            else:
                state.new_epoch()
            self.epoch_steps(epoch)
            if checkpoints.stopped:
                break
            if state.step >= self.total_steps or epoch == self.epochs - 1:
                self.strategy.finish()  # the last exchange: every device now holds the same model
            if self.cfg.eval:
                self.evaluate(epoch)
            if state.step >= self.total_steps:
                break

    def epoch_steps(self, epoch: int) -> None:
        """One epoch's steps: a due checkpoint first (SIGTERM: stopped with it), then the batch and the step."""
        state, strategy, membership = self.state, self.strategy, self.membership
        batches = iter(self.loader)
        while state.step < self.total_steps:
            if self.checkpoints.save_if_due(state, strategy, self.optimizer, self.scheduler, self.throttle):
                break  # SIGTERM: stopped with this checkpoint
            inject_fault(membership.faults, self.at.device_id, state.step, self.spec.timeout_s)  # EDGETRAIN_FAULT
            self.recorder.start()
            try:
                membership.boundary(state.step, epoch, state.evals)
                x, y = next(batches)
                x, y = x.to(self.at.device, non_blocking=True), self.task.to_device(y, self.at.device)
                self.recorder.data_ready(batches.last)
                result = strategy.train_step(x, y, self.optimizer)
            except StopIteration:
                break
            except membership.failures as e:  # a device left or joined: the step is done again
                self.rank, self.world, self.local_batches, batches, state.step = membership.reform(e, epoch)
                continue
            self.count(epoch, result)

    def count(self, epoch: int, result: StepResult) -> None:
        """A step done: its record written and counted, this device's memory checked, the bar moved."""
        state = self.state
        self.scheduler.step()
        record = self.recorder.finish(state.step, epoch, result, self.scheduler.get_last_lr()[0])
        self.writer.step(record)
        state.count(record, result)
        limit_mb = self.memory_limit_mb()
        if limit_mb is not None and record.peak_rss_mb > limit_mb:
            raise EdgetrainError(f"{self.at.me.label} ran out of memory: peak {record.peak_rss_mb:.0f} MiB > its "
                                 f"{limit_mb} MiB at step {state.step}; lower batch_size or give the profile "
                                 f"more memory_mb")
        if self.bar and state.ema_loss is not None:
            self.bar.update(state.step, epoch, state.ema_loss, figures_text(
                self.task, self.task.train_figures(state.totals[1], int(state.totals[2]))),
                self.cfg.batch_size / record.step_s)

    def evaluate(self, epoch: int) -> None:
        state = self.state
        metrics = self.strategy.evaluate(self.data.test)
        if isinstance(metrics, tuple):  # a strategy of one's own may give a classifier's (loss, accuracy)
            metrics = {"loss": metrics[0], "accuracy": metrics[1]}
        test_loss = metrics.pop("loss")
        epsilon = self.privacy.epsilon(self.strategy.privacy_events()) if self.privacy else math.nan
        state.evals.append(EvalRecord(epoch=epoch, step=state.step, test_loss=test_loss,
                                      test_accuracy=metrics.get("accuracy"), metrics=metrics,
                                      epsilon=epsilon if math.isfinite(epsilon) else None))
        if self.rank == 0:
            self.writer.evaluation(state.evals[-1])
        headline = self.task.headline
        spent = "" if self.privacy is None else f", epsilon {epsilon:.3g} (delta {self.privacy.spec.delta:g})"
        _note(self.bar, self.rank, f"epoch {epoch + 1}/{self.epochs}: test {headline.label or headline.name} "
                                   f"{headline.format(metrics[headline.name])}, loss {test_loss:.3f}{spent}")

    def finish(self) -> dict | None:
        """The final exchange and model, every device's records and summary to rank 0, the group left."""
        state, strategy, checkpoints, run_dir = self.state, self.strategy, self.checkpoints, self.plan.run_dir
        checkpoints.files.release_sigterm()
        energy = self.energy.stop(sum(r.samples for r in state.records[self.first_record:]))
        if self.bar:
            self.bar.close()
        strategy.finish()  # no-op if the last epoch already called it
        self.writer.close()
        if strategy.pooled:  # every device writes its own part of the final model: RUN_DIR/checkpoint/
            save_final_parts(run_dir, strategy.sharded_state(self.optimizer, final=True), state.step,
                             self.cfg.to_dict(), Writers(self.rank, self.world, self.spec.timeout_s),
                             planned_steps=state.planned_steps)
        summary = self.end_of_run(energy)
        dist.barrier()
        dist.destroy_process_group()
        if checkpoints.stopped:
            raise Terminated(resume_hint(run_dir) if run_dir else "", checkpoints.files.stop_signal)
        return summary

    def end_of_run(self, energy: EnergyRecord | None) -> dict | None:
        """Every device: its summary and records to rank 0, which writes metrics.jsonl, checkpoint.pt and
        summary.json; rank 0 returns the summary, the others None."""
        state, rank = self.state, self.rank
        mine = self.device_summary(energy)
        train_totals = tuple(state.totals)
        if self.world > 1:  # rank 0's summary needs them (JSON: the counts are a dict of the task's own keys)
            everyone = gather_json(list(train_totals), dst=0)
            train_totals = sum_totals(everyone) if everyone is not None else train_totals
            # JSON, not pickles: see cluster/peers
            gathered = gather_json(([r.to_dict() for r in state.records], mine.to_dict()), dst=0)
        else:
            gathered = [([r.to_dict() for r in state.records], mine.to_dict())]
        if rank != 0:
            return None
        all_records = self.membership.all_records([records for records, _ in gathered]
                                                  + [self.checkpoints.files.departed_records])
        self.writer.metrics(all_records, max([len(self.plan.devices), *(r.rank + 1 for r in all_records)]))
        per_device = [DeviceSummary.from_dict(d) for _, d in gathered]
        return self.writer.summary(self.outcome(), per_device, train_totals)

    def device_summary(self, energy: EnergyRecord | None) -> DeviceSummary:
        """This device's summary; a warning where it went over its memory after the training steps."""
        at, limit_mb = self.at, self.memory_limit_mb()
        mine = dataclasses.replace(_device_summary(self.state.records, at, self.local_batches[self.rank],
                                                   self.throttle, self.cfg.workers), energy=energy)
        if self.limits is not None:
            mine.details["limits"] = self.limits.describe()
        if limit_mb is not None and mine.run_peak_rss_mb > limit_mb:
            # Warned, not raised: training is done and the final model is written; but a real device of this size
            # would not have survived the end of the run (its evaluation, the final exchange or checkpoint), and
            # the summary says so (run_peak_rss_mb) rather than only the steps' peak.
            print(f"edgetrain: warning: {at.me.label} went over its memory at the end of the run: peak "
                  f"{mine.run_peak_rss_mb:.0f} MiB > its {limit_mb} MiB after the final exchange and checkpoint "
                  f"({self.strategy.name}); "
                  f"its training steps peaked at {mine.peak_rss_mb:.0f} MiB", file=sys.stderr, flush=True)
        return mine

    def outcome(self) -> RunOutcome:
        state = self.state
        return RunOutcome(self.cfg, self.strategy, self.optimizer, self.data, self.params, self.flops_per_sample,
                          self.partition, self.spec.task, self.world, self.local_batches, state.step,
                          state.planned_steps, time.perf_counter() - state.started, state.evals,
                          self.membership.history() or [],
                          self.privacy.record(self.strategy.privacy_events()) if self.privacy else None)


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
        # The peak this device is rated against: its profile's where it emulated one (see tasks/flops.py).
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
