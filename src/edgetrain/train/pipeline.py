"""``--strategy pipeline``: the model's layers split into stages, one stage per device, micro-batched;
with ``--pipeline-replicas D``, D such pipelines whose stages all-reduce their gradients, or with
``--sync diloco:H`` DiLoCo's pseudo-gradient every H steps (hybrid).

PyTorch's ``torch.distributed.pipelining`` runs the schedule; every device holds, evaluates and
checkpoints its own stage only.

Design: docs/design/pipeline.md
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.data import DataLoader, Subset

from edgetrain.cluster.peers import all_gather_json
from edgetrain.cluster.launch import idle_process_mb
from edgetrain.cluster.profiles import device_gflops, device_links, plan_devices
from edgetrain.comm import device_clock
from edgetrain.comm.compress.spec import build_compressor
from edgetrain.data import shard_indices
from edgetrain.errors import EdgetrainError
from edgetrain.kinds import named_by_kind
from edgetrain.models.init import META, is_meta, materialise
from edgetrain.pipelining.split import (PipelineStep, StageDevice, layer_costs, optimizer_copies, p2p_seconds,
                                        plan_split)
from edgetrain.pipelining.stages import (BACKWARD, FORWARD, describe_stages, pipeline_layers, pipeline_timeline,
                                   stage_bounds)
from edgetrain.spec import get_link
from edgetrain.train.evaluation import gathered_metrics
from edgetrain.train.fsdp import clock_summary
from edgetrain.train.replicas import (  # noqa: F401 (allreduce_gradients: the hybrid's, imported from here)
    Channel, ReplicaExchange, allreduce_gradients, load_replica_part, replica_part)
from edgetrain.train.strategy import FLAT_OPTIMIZER, StepResult, Strategy

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class TimedStage(PipelineStage):
    """A ``PipelineStage`` that sums the seconds of its own forward and backward compute and keeps, for the
    step's timeline, each one as ``[FORWARD or BACKWARD, micro-batch, seconds]`` in the order it ran."""

    compute_s = 0.0

    def _timed(self, kind: int, run, chunk: int, *args, **kwargs):
        started = time.perf_counter()
        try:
            return run(chunk, *args, **kwargs)
        finally:
            seconds = time.perf_counter() - started
            self.compute_s += seconds
            self.actions.append([kind, chunk, seconds])

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        return self._timed(FORWARD, super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        return self._timed(BACKWARD, super().backward_one_chunk, bwd_chunk_id, *args, **kwargs)


def _nbytes(tensors) -> int:
    tensors = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@named_by_kind("strategy")
class Pipeline(Strategy):
    """The model's layers in stages over the devices (``torch.distributed.pipelining``)."""

    # every stage gets its replica's whole batch; the schedule cuts it into micro-batches

    def data_share(self, local_batches: list[int]) -> tuple[list[int], int]:
        # the global batch is cut into one share per replica: every stage of replica r reads share r
        replicas = self.context.spec.pipeline.replicas
        return [self.context.cfg.batch_size // replicas] * replicas, self.context.rank // self._stages()

    def _stages(self) -> int:
        """S, the stages of one pipeline: the devices over the replicas (one line if they do not divide)."""
        c, replicas = self.context, self.context.spec.pipeline.replicas
        if c.world % replicas:
            raise EdgetrainError(f"the run has {c.world} devices, not a multiple of pipeline_replicas {replicas} "
                                 f"(devices = stages x replicas); use a multiple of {replicas} devices")
        return c.world // replicas

    @property
    def calibration_batch(self) -> None:
        return None  # a stage alone is not the model the throttle would time

    def materialise(self, model: nn.Module) -> nn.Module:
        if self.context.device.type == "cuda":  # seen on an H200: gloo's writev of device memory aborts
            raise EdgetrainError("pipeline stages send activations point to point, which gloo cannot do with CUDA "
                                 "tensors; use --accelerator cpu for --strategy pipeline")
        # stays on meta (a model built for real is moved): setup materialises this device's stage only
        return materialise(model, self.context.spec.seed, self.context.device, keep=lambda name: False)

    def setup(self, model: nn.Module) -> None:
        c = self.context
        pipeline = c.spec.pipeline
        if not any(is_meta(m) for m in model.modules()):  # a model passed built: every device starts from device 0's
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
        self.whole = model
        self.layers = pipeline_layers(model)
        self.plan: list[str] = []
        # Rank layout: replica r is the pipeline of devices r*S .. r*S+S-1, so device rank is stage rank % S of
        # replica rank // S (replica 0 is the devices of a run without replicas, and its stage s is device s).
        self.replicas, self.stages = pipeline.replicas, self._stages()
        self.stage_index, self.replica = c.rank % self.stages, c.rank // self.stages
        self.replica_batch = c.cfg.batch_size // self.replicas
        self.pipe_group = self.stage_group = None  # None: the default group (one pipeline, no all-reduce)
        if self.replicas > 1:
            self._make_groups()
        if pipeline.planned:
            pipeline = dataclasses.replace(pipeline, starts=self._planned_starts())
        self.bounds = stage_bounds(pipeline, self.layers, self.stages)
        first, end = self.bounds[self.stage_index]
        stage_input, stage_output = self._boundary_examples(first, end, self.replica_batch // pipeline.microbatches)
        self.input_shape, self.input_dtype = tuple(stage_input.shape[1:]), stage_input.dtype  # one sample's
        mine = [name for name, _ in self.layers[first:end]]
        # this stage's layers only; the others stay on meta (no device ever receives them)
        materialise(model, c.spec.seed, c.device, keep=lambda name: any(name == layer or name.startswith(layer + ".")
                                                                         for layer in mine))
        self.stage_module = nn.Sequential(*(layer for _, layer in self.layers[first:end]))
        self.is_first, self.is_last = self.stage_index == 0, self.stage_index == self.stages - 1
        self.sent = self.received = 0
        self.stage_module.register_forward_hook(self._count_bytes)
        self.stage = TimedStage(self.stage_module, self.stage_index, self.stages, c.device,
                                input_args=stage_input, output_args=stage_output, group=self.pipe_group)
        self.stage.actions = []
        self.output_bytes = 0 if self.is_last else _nbytes(stage_output)  # one micro-batch's activation
        self.clock = device_clock(self.whole, c.spec, c.rank, c.world, c.stats, c.link, "pipeline")
        self.between = self._between_replicas()
        self.exchange = (0.0, 0.0)  # this step's all-reduce: (seconds computing: encode, decode; modelled link s)
        self.replicas_identical: bool | None = None
        self.schedule = SCHEDULES[pipeline.schedule](self.stage, n_microbatches=pipeline.microbatches,
                                                     loss_fn=self._loss_fn(), scale_grads=False)
        self.finished = False

    def _between_replicas(self) -> ReplicaExchange | None:
        """With replicas: gradients every step (--sync sync), or DiLoCo's pseudo-gradient every H steps, between
        the replicas of this stage."""
        if self.replicas <= 1:
            return None
        c = self.context
        # error feedback keyed per parameter name (compress/memory.py); a shared seed: random-k draws the
        # same indices on every replica of the stage
        link = get_link(c.link) if c.link is not None else c.spec.link
        compressor, memory = build_compressor(c.spec.compress, link, c.spec.seed, c.rank)
        names = tuple(name for name, _ in self.stage_module.named_parameters())
        return ReplicaExchange(list(self.stage_module.parameters()), lambda t: t, names, c.spec.sync,
                               Channel(compressor, memory, self.clock.emulator, self.stage_group, self.stage_ranks))

    def _loss_fn(self):
        """The schedule's loss, summed over micro-batches: the mean loss over this replica's batch."""
        c = self.context
        # each replica's loss is its own batch's sum / its batch; the all-reduce averages over the D replicas,
        # so the gradient is the mean loss's over the global batch B = D x replica batch
        scale = 1.0 / self.replica_batch

        def loss_fn(out, positions):
            # the schedule cuts tensors only: it hands the micro-batch's positions in the batch, and the task
            # takes those samples of the target, whatever its structure (train_step)
            started = time.perf_counter()
            target = c.task.take(self.target, slice(int(positions[0]), int(positions[-1]) + 1))
            loss = c.task.loss(out, target) * scale
            self.stage.actions[-1][2] += time.perf_counter() - started  # part of the forward just timed
            return loss
        return loss_fn

    def _make_groups(self) -> None:
        """One gloo group per replica (its pipeline's sends) and one per stage (its D devices' all-reduce).

        Every device creates every group, in the same order, as ``dist.new_group`` requires."""
        c, stages, replicas = self.context, self.stages, self.replicas
        timeout = dt.timedelta(seconds=c.spec.timeout_s)
        for r in range(replicas):
            group = dist.new_group([r * stages + s for s in range(stages)], backend="gloo", timeout=timeout)
            if r == self.replica:
                self.pipe_group = group
        for s in range(stages):
            group = dist.new_group([r * stages + s for r in range(replicas)], backend="gloo", timeout=timeout)
            if s == self.stage_index:
                self.stage_group = group
        self.stage_ranks = [r * stages + self.stage_index for r in range(replicas)]

    def _planned_starts(self) -> tuple[int, ...]:
        """Rank 0 plans the split (pipelining.split) and prints why; every device receives the same stage starts.

        With replicas, every pipeline gets the same split: stage s is planned for the weakest of its D devices
        (least GFLOPS, memory and memory bandwidth) and each cut for the slowest of the D links across it, on a
        replica's batch (B / D)."""
        c, S, D = self.context, self.stages, self.replicas
        starts = torch.zeros(S - 1, dtype=torch.int64)
        if c.rank == 0:
            cfg = c.cfg
            specs = plan_devices(cfg, c.world)
            devices = []
            for s in range(S):
                mine = [specs[r * S + s] for r in range(D)]
                rated = [(device_gflops(d.profile)[0], d.profile.memory_mb, d.profile.memory_gbps) for d in mine]
                devices.append(StageDevice(" / ".join(d.label for d in mine), min(g for g, _, _ in rated),
                                           _least(m for _, m, _ in rated), _least(b for _, _, b in rated)))
            links = device_links(specs)  # what the run's link emulator charges, as edgetrain plan models it
            step = PipelineStep(self.replica_batch, c.spec.pipeline.microbatches, c.spec.pipeline.schedule,
                                optimizer_copies(cfg.optimizer, cfg.momentum), idle_process_mb())
            plan = plan_split(layer_costs(self.layers, c.input_shape), devices, step, what=f"model {cfg.model}",
                              transfer_s=lambda s, nbytes: max(p2p_seconds(links, r * S + s - 1, r * S + s, nbytes)
                                                               for r in range(D)))
            self.plan = plan.explain()
            print("pipeline stages planned (pipelining/split.py):\n  " + "\n  ".join(self.plan), flush=True)
            starts = torch.tensor(plan.starts, dtype=torch.int64)
        dist.broadcast(starts, src=0)
        return tuple(int(v) for v in starts)

    @torch.no_grad()
    def _boundary_examples(self, first: int, end: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensors of the shapes this stage receives and sends, from one sample through the layers in eval mode.

        Given to ``PipelineStage``, they spare it the shape-inference forward it would otherwise run at the
        first step, which would feed empty (uninitialised) activations through later stages' BatchNorm.
        A model still on the meta device gives the shapes without computing.
        """
        was_training = self.whole.training
        self.whole.eval()  # BatchNorm's running statistics stay as they are
        c = self.context
        on_meta = any(is_meta(m) for m in self.whole.modules())
        activation = torch.zeros(1, *c.input_shape, device=META if on_meta else c.device)
        for index, (_, layer) in enumerate(self.layers[:end]):
            if index == first:
                stage_input = activation
            activation = layer(activation)
        self.whole.train(was_training)
        # requires_grad: gradients flow back across every cut (the first stage's input is the images)
        return (torch.empty(microbatch, *stage_input.shape[1:], dtype=stage_input.dtype,
                            device=c.device).requires_grad_(first > 0),
                torch.empty(microbatch, *activation.shape[1:], dtype=activation.dtype, device=c.device).requires_grad_())

    def _count_bytes(self, module, inputs, output) -> None:
        # Forward: the output goes to the next stage; backward: the input's gradient goes to the previous one.
        if torch.is_grad_enabled():
            self.sent += (0 if self.is_last else _nbytes(output)) + (0 if self.is_first else _nbytes(inputs))
            self.received += (0 if self.is_first else _nbytes(inputs)) + (0 if self.is_last else _nbytes(output))

    def parameters(self):
        return self.stage_module.parameters()

    def train_step(self, x, y, optimizer) -> StepResult:
        c = self.context
        self.clock.emulator.start_step()
        self.stage.actions = []
        self.exchange = (0.0, 0.0)  # no exchange between replicas yet this step (DiLoCo: most steps have none)
        optimizer.zero_grad(set_to_none=True)
        sent, received, compute = self.sent, self.received, self.stage.compute_s
        losses: list[torch.Tensor] = []
        started = time.perf_counter()
        # the first stage feeds the images, the last one scores the targets
        self.target = y
        positions = torch.arange(c.task.batch_size(y)) if self.is_last else None
        out = self.schedule.step(*((x,) if self.is_first else ()),
                                 **(dict(target=positions, losses=losses) if self.is_last else {}))
        ended = time.perf_counter()
        comm_s = max(0.0, ended - started - (self.stage.compute_s - compute))
        c.stats.record(self.sent - sent, self.received - received, 0, comm_s)
        replica_bytes = c.stats.snapshot()["bytes_sent"]
        if self.between is not None and self.between.every_step_gradients:
            comm_s += self._exchange(self.between.after_backward)
        optimizer_started = time.perf_counter()
        optimizer.step()
        optimizer_s = time.perf_counter() - optimizer_started
        if self.between is not None and not self.between.every_step_gradients:
            comm_s += self._exchange(self.between.after_step)  # every H steps, DiLoCo's outer step, after the inner
        metrics = {"comm_busy_s": None, **self._close_step(optimizer_s)}
        if self.replicas > 1:
            metrics["replica_bytes_sent"] = c.stats.snapshot()["bytes_sent"] - replica_bytes
        if not self.is_last:
            return StepResult(0.0, {}, 0, comm_s, metrics)
        loss_sum = float(sum(loss.item() for loss in losses)) * self.replica_batch
        return StepResult(loss_sum, c.task.train_counts(out.detach(), y), c.task.batch_size(y), comm_s, metrics)

    def _exchange(self, run) -> float:
        """The exchange between replicas ``run`` makes (``ReplicaExchange``), its compute (encode, decode) and
        modelled link seconds kept for the step's clock; returns the seconds it took."""
        started = time.perf_counter()
        _, compute_s, model_s = self.between.timed(run)
        self.exchange = (compute_s, model_s)
        return time.perf_counter() - started

    def _close_step(self, optimizer_s: float) -> dict:
        """The device clock after this step: host time without links, else the timeline's (module docstring)."""
        emulator = self.clock.emulator
        if not emulator.virtual:
            step = emulator.finish_step()
        else:
            exchange_compute, exchange_model = self.exchange
            mine = torch.tensor([emulator.virtual_s, optimizer_s, self.output_bytes, exchange_compute,
                                 *(v for action in self.stage.actions for v in action)], dtype=torch.float64)
            everyone = [torch.empty_like(mine) for _ in range(self.context.world)]
            dist.all_gather(everyone, mine)  # the same length everywhere: 2 M actions per stage
            starts, optimizer_seconds, output_bytes, exchange_s = ([float(t[i]) for t in everyone] for i in range(4))
            actions = [[(int(a[0]), int(a[1]), float(a[2])) for a in t[4:].view(-1, 3)] for t in everyone]
            S, s, rank = self.stages, self.stage_index, self.context.rank
            ready = []  # per replica: when its device of this stage is ready to all-reduce (or, alone, done)
            for r in range(self.replicas):  # every device replays every replica's timeline: the same jitter draws
                ranks = [r * S + i for i in range(S)]

                def transfer_s(kind: int, sender: int, receiver: int, ranks=ranks) -> float:
                    nbytes = output_bytes[ranks[min(sender, receiver)]]  # the activation at the cut, or its gradient
                    return emulator.model_time("p2p", int(nbytes), peers=[ranks[sender], ranks[receiver]])

                ends, link_s = pipeline_timeline([starts[g] for g in ranks], [actions[g] for g in ranks], transfer_s)
                ready.append(ends[s] + exchange_s[ranks[s]])
                if r == self.replica:
                    my_link_s = link_s[s]
            # the all-reduce among the stage's replicas starts when the last of them is ready (none: no wait),
            # lasts its modelled time, then the optimizer steps
            step = emulator.close_step_at(max(ready) + exchange_model + optimizer_seconds[rank],
                                          sum(a[2] for a in actions[rank]) + exchange_compute + optimizer_seconds[rank],
                                          my_link_s + exchange_model)
        return {"virtual_s": step["virtual_s"], "virtual_compute_s": step["compute_s"],
                "virtual_comm_s": step["comm_model_s"]}

    @torch.no_grad()
    def evaluate(self, dataset, batch: int = 256) -> dict[str, float]:
        """The task's metrics over the whole test set, pipelined: no device holds more than its stage.

        Every device of replica ``r`` walks the same shard (``shard_indices`` by replica, not by rank) in batches
        of the replica's training batch (``batch`` is not used: a stage's activations stay those of a training
        step's size or less); each stage, in eval mode (BatchNorm: its running statistics), runs its layers on
        what the previous stage sent (the first: the images) and sends the result to the next one, point to
        point over the replica's group; the last scores the outputs against its own copy of the targets in the
        task's evaluator, whose states every device gathers and merges (the other stages have none). Not
        training: nothing is
        counted in the byte tallies (``_count_bytes`` counts only with gradients on) nor charged to the links
        or the device clock."""
        c = self.context
        was_training = self.stage_module.training
        self.stage_module.eval()
        evaluator = c.task.evaluator() if self.is_last else None
        shard = Subset(dataset, shard_indices(len(dataset), self.replica, self.replicas))
        for x, y in DataLoader(shard, batch_size=self.replica_batch, collate_fn=c.task.collate):
            if self.is_first:
                activation = x.to(c.device)
            else:  # the previous stage of this replica is the previous rank (layout: module docstring)
                activation = torch.empty(len(x), *self.input_shape, dtype=self.input_dtype, device=c.device)
                dist.recv(activation, src=c.rank - 1, group=self.pipe_group)
            out = self.stage_module(activation)
            if self.is_last:
                evaluator.update(out, c.task.to_device(y, c.device))
            else:
                dist.send(out.contiguous(), dst=c.rank + 1, group=self.pipe_group)
        self.stage_module.train(was_training)
        return gathered_metrics(evaluator, c.world, type(c.task.evaluator()).merge)

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self.between is not None:
            self.clock.emulator.start_step()
            self.between.finish()  # the steps since the last outer step: the replicas end with the same model
            self.clock.emulator.finish_step(count=False)
        if self.replicas > 1 and self.replicas_identical is None:
            self.replicas_identical = self._replicas_agree()
        self.clock.finish()  # nothing is gathered: every device writes its own stage (sharded_state)

    def _replicas_agree(self) -> bool:
        """Whether every stage's D replicas hold bit-identical parameters (every device: one all-gather).

        They should: each applies the same averaged gradient (the all-reduce's decoded mean is computed the same
        way on every replica) through the same optimizer from the same start. Each replica evaluates with
        its own stages, so a difference would otherwise show only in the test scores."""
        digest = hashlib.sha256()
        for p in self.stage_module.parameters():
            digest.update(p.detach().cpu().contiguous().numpy().tobytes())
        everyone = all_gather_json([self.stage_index, digest.hexdigest()])
        return all(len({d for s, d in everyone if s == stage}) == 1 for stage in range(self.stages))

    @property
    def eval_model(self) -> nn.Module:
        # the whole model as this device holds it: its stage's layers, the others' on meta (``evaluate`` runs
        # the stages instead)
        return self.whole

    def state_dict(self) -> dict:
        return {}  # this stage's layers and optimizer state are its part of the checkpoint: sharded_state

    def load_state_dict(self, state: dict) -> None:
        pass  # this stage's layers and optimizer state come back through load_sharded_state

    def sharded_state(self, optimizer, final: bool = False) -> dict:
        # this stage's layers under their names in the whole model, and its optimizer's state by those names
        first, end = self.bounds[self.stage_index]
        model = {f"{name}.{key}": value for name, layer in self.layers[first:end]
                 for key, value in layer.state_dict().items()}
        return {"model": model, "optimizer": get_optimizer_state_dict(self.whole, optimizer, options=FLAT_OPTIMIZER),
                **replica_part(self.between, optimizer, final)}

    def load_sharded_state(self, state: dict, optimizer) -> None:
        self.whole.load_state_dict(state["model"], strict=False)  # this stage's layers only
        set_optimizer_state_dict(self.whole, optimizer, state["optimizer"], options=FLAT_OPTIMIZER)
        load_replica_part(self.between, state, optimizer)

    def summary(self) -> dict:
        p = self.context.spec.pipeline
        hybrid = {} if self.replicas == 1 else {
            "compress": self.context.spec.compress.text, "replica_batch": self.replica_batch,
            "layout": "device rank = replica x stages + stage", "replicas_identical": self.replicas_identical,
            "sync": self.context.spec.sync.text, **(self.between.summary() if self.between else {})}
        return {**clock_summary(self.clock), "sync": "pipeline",
                "pipeline": {"schedule": p.schedule, "microbatches": p.microbatches, "replicas": self.replicas,
                             "stages": describe_stages(self.layers, self.bounds), "plan": self.plan, **hybrid}}


def _least(values):
    """The smallest of the values that are given (None: no limit, or not rated), else None."""
    given = [v for v in values if v is not None]
    return min(given) if given else None

