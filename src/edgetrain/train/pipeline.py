"""``--strategy pipeline``: the model's layers split into stages, one stage per device, micro-batched.

PyTorch's own engine runs it: ``torch.distributed.pipelining`` (a
``PipelineStage`` per device and a ``ScheduleGPipe`` or ``Schedule1F1B``),
whose activations and gradients travel point to point over gloo. Device ``s``
holds the layers ``plan.stages.stage_bounds`` gives stage ``s``: from
``--stages 4,8`` or ``even``, or, with ``--stages auto`` (default), from the
split planner (``plan.split``: counted per-layer FLOPs and memory against
each device's rated GFLOPS and memory limit), which rank 0 runs, prints and
broadcasts. ``plan.stages.check_sequential`` has checked before any device
started that the model can be cut between its layers. Every device receives the whole global batch (the first
stage reads the images, the last the labels); the schedule cuts it into
``--microbatches`` M equal micro-batches:

- ``gpipe``: every micro-batch forward, then every backward; a stage holds
  the activations of all M micro-batches at once;
- ``1f1b``: after a warm-up, one forward then one backward, so a stage holds
  at most ``stages - s`` micro-batches' activations.

Exactness: the last stage's loss is ``sum(cross-entropy) / B`` over each
micro-batch and the schedule does not rescale (``scale_grads=False``), so the
gradients summed over micro-batches are those of the mean loss over the
global batch ``B``: the same as one device on the same batch, for a model
without BatchNorm (tests/train/test_pipeline.py). **With BatchNorm** they
differ: each BatchNorm normalises each micro-batch with that micro-batch's
own statistics (``B/M`` samples, not ``B``) and updates its running
statistics M times per step, as data parallelism with local BatchNorm does
per device; ``--batchnorm sync`` is refused (one stage holds each layer).

Accounting: the last stage scores the batch (loss, accuracy, samples); the
other stages report zero samples, so sums over devices give the global
batch. Bytes are what each stage hands to the schedule to send: its output
activation per micro-batch forwards (all stages but the last) and the
gradient of its input backwards (all but the first), each the size of the
tensor, fp32; received bytes the converse. ``comm_s`` is the step's time in
the schedule less this stage's forward and backward compute: waiting for
sends, receives and the pipeline's bubble (``comm_busy_s`` is not measured).

Evaluation and checkpoint: every device builds the whole model (from the
run's seed, so identical) and trains only its stage; before an evaluation
and at ``finish`` each stage's owner broadcasts its layers' parameters and
buffers, so every device evaluates the whole, current model on its shard of
the test set, and rank 0 checkpoints it.

Limits: every device keeps the whole model's weights (the other stages'
ones unused between evaluations), so its peak RSS is not yet the pooled
saving (freeing them is the next step); ``--link``, ``--compress`` and
``--sync`` are refused (the sends do not pass through the link emulation);
one stage per device (no stage replicas yet).
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from edgetrain.cluster.profiles import plan_devices
from edgetrain.plan.model import device_gflops, idle_process_mb
from edgetrain.plan.split import StageDevice, layer_costs, plan_split
from edgetrain.plan.stages import describe_stages, pipeline_layers, stage_bounds
from edgetrain.train.strategy import STRATEGIES, StepResult, Strategy

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class TimedStage(PipelineStage):
    """A ``PipelineStage`` that sums the seconds of its own forward and backward compute."""

    compute_s = 0.0

    def _timed(self, run, *args, **kwargs):
        started = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            self.compute_s += time.perf_counter() - started

    def forward_one_chunk(self, *args, **kwargs):
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_one_chunk, *args, **kwargs)


def _nbytes(tensors) -> int:
    tensors = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class Pipeline(Strategy):
    """The model's layers in stages over the devices (``torch.distributed.pipelining``)."""

    name = "pipeline"
    shard_data = False  # every stage gets the whole global batch; the schedule cuts it into micro-batches

    @property
    def calibration_batch(self) -> None:
        return None  # a stage alone is not the model the throttle would time

    def setup(self, model: nn.Module) -> None:
        c = self.context
        pipeline = c.spec.pipeline
        for tensor in [*model.parameters(), *model.buffers()]:  # every device starts from device 0's model
            dist.broadcast(tensor.data, src=0)
        self.whole = model
        self.layers = pipeline_layers(model)
        self.plan: list[str] = []
        if pipeline.planned:
            pipeline = dataclasses.replace(pipeline, starts=self._planned_starts())
        self.bounds = stage_bounds(pipeline, self.layers, c.world)
        first, end = self.bounds[c.rank]
        self.stage_module = nn.Sequential(*(layer for _, layer in self.layers[first:end]))
        self.is_first, self.is_last = c.rank == 0, c.rank == c.world - 1
        self.sent = self.received = 0
        self.stage_module.register_forward_hook(self._count_bytes)
        stage_input, stage_output = self._boundary_examples(first, end, c.cfg.batch_size // pipeline.microbatches)
        self.stage = TimedStage(self.stage_module, c.rank, c.world, c.device,
                                input_args=stage_input, output_args=stage_output)
        scale = 1.0 / c.cfg.batch_size

        def loss_fn(out, target):  # summed over micro-batches: the mean loss over the global batch
            return F.cross_entropy(out, target, reduction="sum") * scale

        self.schedule = SCHEDULES[pipeline.schedule](self.stage, n_microbatches=pipeline.microbatches,
                                                     loss_fn=loss_fn, scale_grads=False)
        self.stale = False  # whether other stages' layers changed since this device last gathered them
        self.finished = False

    def _planned_starts(self) -> tuple[int, ...]:
        """Rank 0 plans the split (plan.split) and prints why; every device receives the same stage starts."""
        c = self.context
        starts = torch.zeros(c.world - 1, dtype=torch.int64)
        if c.rank == 0:
            cfg = c.cfg
            devices = [StageDevice(d.label, device_gflops(d.profile)[0], d.profile.memory_mb)
                       for d in plan_devices(cfg, c.world)]
            copies = 2 if cfg.optimizer == "adam" else int(cfg.momentum > 0)
            plan = plan_split(layer_costs(self.layers, c.input_shape), devices, cfg.batch_size,
                              c.spec.pipeline.microbatches, c.spec.pipeline.schedule, copies,
                              fixed_mb=idle_process_mb(), what=f"model {cfg.model}")
            self.plan = plan.explain()
            print("pipeline stages planned (plan/split.py):\n  " + "\n  ".join(self.plan), flush=True)
            starts = torch.tensor(plan.starts, dtype=torch.int64)
        dist.broadcast(starts, src=0)
        return tuple(int(v) for v in starts)

    @torch.no_grad()
    def _boundary_examples(self, first: int, end: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensors of the shapes this stage receives and sends, from one sample through the layers in eval mode.

        Given to ``PipelineStage``, they spare it the shape-inference forward it would otherwise run at the
        first step, which would feed empty (uninitialised) activations through later stages' BatchNorm.
        """
        was_training = self.whole.training
        self.whole.eval()  # BatchNorm's running statistics stay as they are
        c = self.context
        activation = torch.zeros(1, *c.input_shape, device=c.device)
        for index, (_, layer) in enumerate(self.layers[:end]):
            if index == first:
                stage_input = activation
            activation = layer(activation)
        self.whole.train(was_training)
        # requires_grad: gradients flow back across every cut (the first stage's input is the images)
        return (stage_input.new_empty(microbatch, *stage_input.shape[1:]).requires_grad_(first > 0),
                activation.new_empty(microbatch, *activation.shape[1:]).requires_grad_())

    def _count_bytes(self, module, inputs, output) -> None:
        # Forward: the output goes to the next stage; backward: the input's gradient goes to the previous one.
        if torch.is_grad_enabled():
            self.sent += (0 if self.is_last else _nbytes(output)) + (0 if self.is_first else _nbytes(inputs))
            self.received += (0 if self.is_first else _nbytes(inputs)) + (0 if self.is_last else _nbytes(output))

    def parameters(self):
        return self.stage_module.parameters()

    def train_step(self, x, y, optimizer) -> StepResult:
        c = self.context
        optimizer.zero_grad(set_to_none=True)
        sent, received, compute = self.sent, self.received, self.stage.compute_s
        losses: list[torch.Tensor] = []
        started = time.perf_counter()
        # the first stage feeds the images, the last one scores the labels
        out = self.schedule.step(*((x,) if self.is_first else ()),
                                 **(dict(target=y, losses=losses) if self.is_last else {}))
        comm_s = max(0.0, time.perf_counter() - started - (self.stage.compute_s - compute))
        c.stats.record(self.sent - sent, self.received - received, 0, comm_s)
        optimizer.step()
        self.stale = True
        if not self.is_last:
            return StepResult(0.0, 0, 0, comm_s, {"comm_busy_s": None})
        loss_sum = float(sum(loss.item() for loss in losses)) * c.cfg.batch_size
        return StepResult(loss_sum, int((out.detach().argmax(1) == y).sum()), len(y), comm_s, {"comm_busy_s": None})

    def gather(self) -> None:
        """Every stage's owner broadcasts its layers' state: every device then holds the whole, current model."""
        if not self.stale:
            return
        for stage, (first, end) in enumerate(self.bounds):
            for _, layer in self.layers[first:end]:
                for tensor in [*layer.parameters(), *layer.buffers()]:
                    dist.broadcast(tensor.data, src=stage)
        self.stale = False

    def finish(self) -> None:
        self.gather()

    @property
    def eval_model(self) -> nn.Module:
        return _GatheredForEvaluation(self)

    def checkpoint_state(self, optimizer) -> dict:
        # the optimizer state is this stage's (rank 0's): whole models, per-stage optimizers
        return {"model": self.whole.state_dict(), "optimizer": optimizer.state_dict()}

    def summary(self) -> dict:
        p = self.context.spec.pipeline
        return {"sync": "pipeline", "pipeline": {"schedule": p.schedule, "microbatches": p.microbatches,
                                                 "stages": describe_stages(self.layers, self.bounds),
                                                 "plan": self.plan}}


class _GatheredForEvaluation(nn.Module):
    """The whole model, gathered from the stages at the first forward after training changed it.

    ``train.loop.evaluate`` calls forward as often on every device, so the gather (a collective) meets.
    """

    def __init__(self, strategy: Pipeline):
        super().__init__()
        self.whole = strategy.whole
        self._strategy = [strategy]  # in a list: not a submodule

    def forward(self, x):
        self._strategy[0].gather()
        return self.whole(x)


STRATEGIES[Pipeline.name] = Pipeline
