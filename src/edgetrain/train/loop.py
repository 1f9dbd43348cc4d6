"""The training loop every device runs.

``run_worker`` is the body of one device process, whether ``launch_local``
spawned it or ``torchrun`` did. Each step it records where its time went:

- ``data_s``: waiting for the batch;
- ``comm_s``: waiting on communication: after the last gradient bucket was
  handed to the all-reduce until backward returned (the part of the
  all-reduce that compute did not hide), plus any exchange the sync mode does
  between steps;
- ``compute_s``: the rest of the step (forward, backward, optimizer, and the
  duty-cycle sleeps that emulate a slower device);
- ``comm_busy_s``: how long collectives ran in all, hidden or not; ``None``
  where the sync mode cannot see its collectives (DDP's own all-reduce,
  ``comm/sync.py``).

Loss scaling: device ``r`` with local batch ``b_r`` back-propagates
``sum(losses_r) * world / B``; DDP averages over devices, so every device ends
up with the gradient of the mean loss over the global batch ``B``, whatever
the split. That is why N devices reproduce one device step for step.

The summary's FLOPs are counted once on rank 0 (``bench.flops``) on the model
actually trained at the input shape actually fed, before training, on a copy
and with the RNG restored, so counting changes nothing in the run. Each
device's achieved GFLOPS is that count x its samples/s, and where it emulated
a profile it is also rated against that profile's peak (``device_peak``).
"""
from __future__ import annotations

import datetime as dt
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset

from edgetrain.bench.flops import achieved, device_peak, training_flops_per_sample
from edgetrain.cluster.launch import loader_worker_init
from edgetrain.cluster.peers import admit_peers, check_rank_environment, gather_json
from edgetrain.cluster.profiles import DeviceSpec
from edgetrain.cluster.throttle import Throttle, assign_cores, peak_rss_mb, pin
from edgetrain.comm import build_sync
from edgetrain.comm.accounting import CommStats
from edgetrain.config import TrainConfig
from edgetrain.data import GlobalBatchSampler, build_data, shard_indices
from edgetrain.errors import EdgetrainError
from edgetrain.models import build_model, count_parameters, register_model
from edgetrain.models.batchnorm import convert_batchnorm
from edgetrain.report.files import atomic_write, save_torch, write_json
from edgetrain.spec import RunSpec
from edgetrain.tiling import TiledSync, TiledTraining


def init_distributed(cfg: TrainConfig, cluster_token: str = "") -> tuple[int, int]:
    """Join the run's process group, then admit the peers (same cluster token, same config; see cluster/peers)."""
    rank, world = check_rank_environment()
    if not dist.is_initialized():
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world,
                                    timeout=dt.timedelta(seconds=cfg.timeout))
        except (RuntimeError, TimeoutError, ValueError) as e:
            addr = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise EdgetrainError(f"rendezvous at {addr} failed for rank {rank} of {world} within {cfg.timeout:g} s "
                                 f"({str(e).splitlines()[0]}); start every device, check MASTER_ADDR/MASTER_PORT "
                                 f"and the firewall, or raise --timeout") from None
        admit_peers(cfg.to_dict(), cluster_token, rank, world)
    return rank, world


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


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


@torch.no_grad()
def evaluate(model: nn.Module, dataset, rank: int, world: int, batch: int = 256) -> tuple[float, float]:
    """(mean loss, accuracy) over the whole test set, each device taking a shard."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    loader = DataLoader(Subset(dataset, shard_indices(len(dataset), rank, world)), batch_size=batch)
    for x, y in loader:
        out = model(x)
        totals += torch.tensor([F.cross_entropy(out, y, reduction="sum").item(),
                                (out.argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(totals)
    model.train(was_training)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def run_worker(cfg: TrainConfig, spec: RunSpec, devices: list[DeviceSpec], local_batches: list[int],
               speeds: list[float | None], run_dir: str | None, user_model: nn.Module | None = None,
               registered: dict | None = None, cluster_token: str = "") -> dict | None:
    """Train on this device; rank 0 returns the run summary, the others None."""
    started = time.perf_counter()
    for name, factory in (registered or {}).items():
        register_model(name, factory)
    rank, world = init_distributed(cfg, cluster_token)
    me = devices[rank]
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    speed = speeds[rank] if cfg.throttle else None
    cores = assign_cores(local_rank, local_world)
    if speed is not None:
        # A throttled device needs only ceil(speed) host cores; more threads would burn CPU time
        # in OpenMP spin-waits, which the throttle would then stretch as if it were work.
        cores = cores[:max(1, math.ceil(speed))]
    pin(cores)
    threads = cfg.threads or (min(len(cores), me.profile.cores) if me.profile.cores else len(cores))
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)

    data = build_data(cfg)
    model = user_model if user_model is not None else build_model(cfg.model, data.input_shape[0], data.num_classes)
    params = count_parameters(model)
    # The model actually trained at the input shape actually fed (counted on a copy, RNG untouched).
    flops_per_sample = training_flops_per_sample(model, input_shape=data.input_shape,
                                                 num_classes=data.num_classes) if rank == 0 else None
    tiled = None
    if cfg.strategy == "tiled":
        # Spatial tiles of the first layers, data parallel after them; every BatchNorm gets
        # whole-map or global-batch statistics whatever cfg.batchnorm says.
        tiled = TiledTraining(model, spec.tiling, data.input_shape, timeout_s=spec.timeout_s)
    elif cfg.batchnorm == "sync" and world > 1:
        model = convert_batchnorm(model)
    throttle = Throttle(speed) if speed is not None else None
    if throttle:
        if not tiled:  # the reference pass: this model, this device's batch, warm and unthrottled
            example = torch.randn(local_batches[rank], *data.input_shape)
            # One device of each host at a time: devices sharing host cores would otherwise slow
            # each other's reference, and with it the whole run.
            turns = torch.tensor([local_world])
            if world > 1:
                dist.all_reduce(turns, op=dist.ReduceOp.MAX)
            for turn in range(int(turns.item())):
                if turn == local_rank:
                    throttle.calibrate(model, example)
                if world > 1:
                    dist.barrier()
        throttle.attach(model)

    stats = CommStats()
    sync = TiledSync(tiled, stats) if tiled else build_sync(model, spec, rank, world, stats, me.link)
    # Tiled training gives every device the whole global batch (TiledTraining.shard_data is False).
    sampler = GlobalBatchSampler(len(data.train), [cfg.batch_size] if tiled else local_batches,
                                 0 if tiled else rank, cfg.seed)
    if len(sampler) == 0:
        raise EdgetrainError(f"batch_size {cfg.batch_size} is larger than the {len(data.train)} training images of "
                             f"{data.name}; lower batch_size")
    loader = DataLoader(data.train, batch_sampler=sampler, num_workers=cfg.workers,
                        persistent_workers=cfg.workers > 0, timeout=cfg.timeout if cfg.workers > 0 else 0,
                        worker_init_fn=loader_worker_init if cfg.workers > 0 else None)
    total_steps = min(cfg.steps or math.inf, cfg.epochs * len(sampler))
    epochs = math.ceil(total_steps / len(sampler))
    optimizer, scheduler = make_optimizer(cfg, model.parameters(), int(total_steps))

    bar = _progress(cfg, rank, int(total_steps))
    records: list[dict] = []
    evals: list[dict] = []
    step, limit_mb = 0, me.profile.memory_mb
    ema_loss = None
    epoch_loss = epoch_correct = epoch_seen = 0.0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        epoch_loss = epoch_correct = epoch_seen = 0.0
        batches = iter(loader)
        while step < total_steps:
            t0, cpu0 = time.perf_counter(), time.process_time()
            try:
                x, y = next(batches)
            except StopIteration:
                break
            t_data = time.perf_counter()
            before = stats.snapshot()
            optimizer.zero_grad(set_to_none=True)
            if tiled:  # this device's share of the batch: loss summed over it, correct, samples
                loss_value, correct, n = sync.step(x, y, F.cross_entropy)
            else:
                out = sync.model(x)
                loss_sum = F.cross_entropy(out, y, reduction="sum")
                (loss_sum * (world / cfg.batch_size)).backward()
                loss_value, correct, n = loss_sum.item(), (out.detach().argmax(1) == y).sum().item(), len(y)
            t_bwd = time.perf_counter()
            sync.after_backward(step)
            t_after_bwd = time.perf_counter()
            optimizer.step()
            scheduler.step()
            t_opt = time.perf_counter()
            sync.after_step(step)
            t_end = time.perf_counter()
            after = stats.snapshot()

            hidden_wait = 0.0
            if after["collectives"] > before["collectives"] and t_data <= after["last_launch"] <= t_bwd:
                hidden_wait = t_bwd - after["last_launch"]
            comm_s = hidden_wait + (t_after_bwd - t_bwd) + (t_end - t_opt)
            if tiled:
                comm_s = sync.exchange_s
            step_s = t_end - t0
            epoch_loss += loss_value
            epoch_correct += correct
            epoch_seen += n
            rss = peak_rss_mb()
            record = {"step": step, "epoch": epoch, "rank": rank, "loss": loss_value / max(n, 1),
                      "samples": n, "samples_per_s": n / step_s, "step_s": step_s, "data_s": t_data - t0,
                      "compute_s": max(step_s - (t_data - t0) - comm_s, 0.0), "comm_s": comm_s,
                      "comm_busy_s": after["comm_s"] - before["comm_s"],
                      "bytes_sent": after["bytes_sent"] - before["bytes_sent"],
                      "bytes_recv": after["bytes_recv"] - before["bytes_recv"],
                      "cpu_s": time.process_time() - cpu0, "lr": scheduler.get_last_lr()[0], "peak_rss_mb": rss, **sync.step_metrics()}
            records.append(record)
            step += 1
            if limit_mb is not None and rss > limit_mb:
                raise EdgetrainError(f"{me.label} ran out of memory: peak {rss:.0f} MiB > its {limit_mb} MiB "
                                     f"at step {step}; lower batch_size or give the profile more memory_mb")
            ema_loss = record["loss"] if ema_loss is None else 0.9 * ema_loss + 0.1 * record["loss"]
            if bar:
                bar.update(step, epoch, ema_loss, epoch_correct / max(epoch_seen, 1),
                           cfg.batch_size / step_s)
        if step >= total_steps or epoch == epochs - 1:
            sync.finish()  # the mode's last exchange: every device now holds the same model
        if cfg.eval:
            test_loss, test_acc = evaluate(unwrap(sync.model), data.test, rank, world)
            evals.append({"epoch": epoch, "step": step, "test_loss": test_loss, "test_accuracy": test_acc})
            if bar:
                bar.note(f"epoch {epoch + 1}/{epochs}: test accuracy {test_acc:.1%}, loss {test_loss:.3f}")
        if step >= total_steps:
            break
    if bar:
        bar.close()
    sync.finish()  # no-op if the last epoch already called it

    train_totals = torch.tensor([epoch_loss, epoch_correct, epoch_seen], dtype=torch.float64)
    mine = _device_summary(records, rank, me, local_batches[rank], speed, cores, threads, throttle)
    if world > 1:
        dist.all_reduce(train_totals)
        gathered = gather_json((records, mine), dst=0)  # JSON, not pickles: see cluster/peers
    else:
        gathered = [(records, mine)]
    summary = None
    if rank == 0:
        summary = _write_outputs(cfg, Path(run_dir), unwrap(sync.model), optimizer, gathered, train_totals, evals,
                                 params, data, world, local_batches, step, sync, time.perf_counter() - started,
                                 flops_per_sample)
    dist.barrier()
    dist.destroy_process_group()
    return summary


def _device_summary(records, rank, me: DeviceSpec, local_batch, speed, cores, threads, throttle) -> dict:
    timed = records[1:] or records  # the first step pays one-off costs (allocations, DDP set-up)
    total = sum(r["step_s"] for r in timed) or float("nan")
    return {"rank": rank, "profile": me.profile.name, "link": me.link, "local_batch": local_batch,
            "speed": speed, "cores": cores, "threads": threads,
            "samples_per_s": sum(r["samples"] for r in timed) / total,
            "step_s": total / len(timed),
            **{k: sum(r[k] for r in timed) / len(timed) for k in ("data_s", "compute_s", "comm_s", "cpu_s")},
            # None where the sync mode could not measure it (DDP's own all-reduce)
            "comm_busy_s": None if any(r["comm_busy_s"] is None for r in timed)
            else sum(r["comm_busy_s"] for r in timed) / len(timed),
            "bytes_sent": sum(r["bytes_sent"] for r in records), "bytes_recv": sum(r["bytes_recv"] for r in records),
            "peak_rss_mb": max((r["peak_rss_mb"] for r in records), default=peak_rss_mb()),
            "throttle_slept_s": throttle.slept if throttle else 0.0,
            # Measured: CPU time of a warm unthrottled forward + backward pass, and how much more the throttled
            # ones cost (median); the throttle divides charged CPU time by the latter.
            "throttle_reference_pass_s": throttle.reference_cpu if throttle else None,
            "throttle_inflation": statistics.median(throttle.inflations) if throttle and throttle.inflations else None,
            # The peak this device is rated against: its profile's where it emulated one (see bench.flops).
            **(device_peak(me.profile, speed) or {})}


def _write_outputs(cfg, run_dir: Path, model, optimizer, gathered, train_totals, evals, params, data, world,
                   local_batches, steps, sync, wall_s, flops_per_sample) -> dict:
    records = sorted((r for recs, _ in gathered for r in recs), key=lambda r: (r["step"], r["rank"]))
    with atomic_write(run_dir / "metrics.jsonl") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    per_device = [d for _, d in gathered]
    for d in per_device:
        d.update(achieved(flops_per_sample["total_flops"], d["samples_per_s"], d.get("peak_gflops")))
    save_torch(run_dir / "checkpoint.pt", {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                           "step": steps, "config": cfg.to_dict()})
    step_s = sum(d["step_s"] for d in per_device) / world
    split = {k: sum(d[f"{k}_s"] for d in per_device) / world for k in ("data", "compute", "comm")}
    last = evals[-1] if evals else {}
    bytes_sent = sum(d["bytes_sent"] for d in per_device)
    summary = {
        "run_dir": str(run_dir), "model": cfg.model, "params": params, "dataset": data.name,
        "input_shape": list(data.input_shape), "flops_per_sample": flops_per_sample,
        "devices": world, "profiles": [d["profile"] for d in per_device],
        "global_batch": cfg.batch_size, "local_batches": local_batches, "steps": steps,
        "train_loss": (train_totals[0] / train_totals[2]).item(),
        "train_accuracy": (train_totals[1] / train_totals[2]).item(),
        "test_loss": last.get("test_loss"), "test_accuracy": last.get("test_accuracy"), "evals": evals,
        "throughput_samples_per_s": sum(d["samples_per_s"] for d in per_device),
        "achieved_gflops": sum(d["achieved_gflops"] for d in per_device),
        "step_s": step_s, "time_split_s": split,
        "time_split_fraction": {k: v / step_s for k, v in split.items()} if step_s else {},
        "bytes_sent_total": bytes_sent, "bytes_recv_total": sum(d["bytes_recv"] for d in per_device),
        "bytes_sent_per_step_per_device": bytes_sent / max(steps, 1) / world,
        "peak_rss_mb_max": max(d["peak_rss_mb"] for d in per_device),
        "wall_time_s": wall_s, "batchnorm": cfg.batchnorm,
        **sync.summary(),
        "per_device": per_device, "checkpoint": "checkpoint.pt",
    }
    write_json(run_dir / "summary.json", summary)
    return summary


class _Bar:
    """Rank 0's progress bar (rich)."""

    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
        self.task = self.progress.add_task("train", total=total, info="")
        self.progress.start()

    def update(self, step, epoch, loss, acc, rate):
        self.progress.update(self.task, completed=step,
                             info=f"epoch {epoch + 1}  loss {loss:.3f}  acc {acc:.1%}  {rate:,.0f} samples/s")

    def note(self, text: str):
        self.progress.console.print(text)

    def close(self):
        self.progress.stop()


def _progress(cfg, rank, total):
    return _Bar(total) if cfg.progress and rank == 0 else None
