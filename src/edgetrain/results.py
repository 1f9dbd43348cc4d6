"""Typed results of ``edgetrain bench`` and ``edgetrain plan``: what they write and the report reads.

Files and the record each holds:

- ``RUN_DIR/result.json`` of a bench: one ``BenchResult``, the subclass its
  ``"bench"`` key names (``PeakResult`` for ``"peak"``...). Every bench
  shares ``environment`` (where the numbers were taken), ``params`` (what it
  was asked), ``notes`` and ``run_dir``; each adds its own sections. Rows of
  measurements stay JSON objects (``list[dict]``): their columns differ per
  bench and sweep, and the report shows them as written;
- ``RUN_DIR/plan.json`` of a plan: one ``PlanResult``, with the prediction
  (``PlanPrediction``: the analytic model, merged device groups as
  ``PlanDeviceGroup``), the simulation (``PlanSimulation``) and, with
  ``--scale``, the scaling table (``PlanScaling`` of ``PlanScalingRow``);
  with ``--strategy fsdp|pipeline|compare``, the strategies side by side
  (``PlanComparison`` of ``PlanStrategy`` of ``PlanStrategyDevice``).
  Every number in it is modelled except the model costs, which are counted.

Same rules as ``records`` (whose ``Record`` base these use): ``to_dict()``
is JSON-able, ``from_dict()`` checks every key's JSON type and fails in one
line naming the file and the key; unknown keys are refused, fields with a
default may be missing. ``BenchResult.from_dict`` picks the subclass from
the ``"bench"`` key and refuses a bench it does not know.

Torch-free, at the bottom layer beside ``records``: bench and plan write
these, report reads them, and none of them imports another for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from edgetrain.errors import EdgetrainError
from edgetrain.records import Record, json_name

FIX = "re-run it or give another run directory"
BENCH_FILE = "result.json"
PLAN_FILE = "plan.json"


@dataclass(kw_only=True)
class BenchResult(Record):
    """``result.json`` of one bench run; ``name`` is written as its ``"bench"`` key."""

    name: ClassVar[str] = ""
    environment: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    run_dir: str | None = None

    omit_when_none: ClassVar[tuple[str, ...]] = ("run_dir",)

    def to_dict(self) -> dict:
        return {"bench": self.name, **super().to_dict()}

    @classmethod
    def from_dict(cls, data: Any, where: str = ""):
        name = where or cls.__name__
        if not isinstance(data, dict):
            raise EdgetrainError(f"{name} must hold a JSON object, not {json_name(data)}; {FIX}")
        bench = data.get("bench")
        kind = BENCH_RESULTS.get(bench) if isinstance(bench, str) else None
        if kind is None or (cls is not BenchResult and kind is not cls):
            names = ", ".join(BENCH_RESULTS) if cls is BenchResult else cls.name
            raise EdgetrainError(f"{name}: key 'bench' must name a bench ({names}), not {bench!r}; {FIX}")
        rest = {k: v for k, v in data.items() if k != "bench"}
        return super(BenchResult, kind).from_dict(rest, where or kind.__name__)


@dataclass(kw_only=True)
class PeakResult(BenchResult):
    """GEMM and LINPACK rows (device 0's where several ran at once), best GFLOPS by kind and threads."""

    name: ClassVar[str] = "peak"
    rows: list[dict]
    best: dict = field(default_factory=dict)
    per_device: list[list[dict]] | None = None
    aggregate: list[dict] = field(default_factory=list)


@dataclass(kw_only=True)
class BatchResult(BenchResult):
    name: ClassVar[str] = "batch"
    profile: dict
    flops_per_sample: dict
    peak_source: str
    rows: list[dict]
    best: int | None
    largest_fitting_batch: int | None
    limit_hit: dict | None = None


@dataclass(kw_only=True)
class ScalingResult(BenchResult):
    name: ClassVar[str] = "scaling"
    rows: list[dict]


@dataclass(kw_only=True)
class StallsResult(BenchResult):
    name: ClassVar[str] = "stalls"
    ingestion_samples_per_s: float
    read_mb_per_s: dict = field(default_factory=dict)  # older results (the bench's own CIFAR reader)
    rows: list[dict]  # per storage x workers x page cache (cold, warm): bench/stalls.py
    stall_removed_at_workers: int | None = None
    verdict: str


@dataclass(kw_only=True)
class CountersResult(BenchResult):
    name: ClassVar[str] = "counters"
    available: bool = False
    message: str = ""
    counts: dict
    per_sample: dict
    ratios: dict
    samples_per_s: float | None = None
    step_s: list[float] = field(default_factory=list)


@dataclass(kw_only=True)
class PowerResult(BenchResult):
    name: ClassVar[str] = "power"
    energy_source: dict
    rows: list[dict]
    pareto: list[dict]


@dataclass(kw_only=True)
class VariabilityResult(BenchResult):
    name: ClassVar[str] = "variability"
    runs: list[dict]
    summary: dict


BENCH_RESULTS: dict[str, type[BenchResult]] = {c.name: c for c in (
    PeakResult, BatchResult, ScalingResult, StallsResult, CountersResult, PowerResult, VariabilityResult)}


@dataclass(kw_only=True)
class PlanDevice(Record):
    """What the analytic model predicts for one device (``plan.model.DevicePrediction`` adds its rank)."""

    profile: str
    gflops: float
    gflops_source: str
    batch: int
    link: str
    compute_s: float
    comm_s: float                 # exposed communication per step
    wait_s: float                 # idle, waiting for slower devices (or an async round)
    step_s: float
    samples_per_s: float
    memory_mb: dict               # the parts, MiB
    memory_total_mb: float
    memory_limit_mb: int | None
    over_limit: bool


@dataclass(kw_only=True)
class PlanDeviceGroup(PlanDevice):
    """Devices whose predictions are the same, merged into one row (``ranks``: "0-3,7")."""

    ranks: str
    count: int


@dataclass(kw_only=True)
class PlanPrediction(Record):
    """The analytic model of one cluster (``plan.model.Prediction.to_dict``) and its device groups."""

    kind: str = "modelled"
    model: dict
    traffic: dict
    devices: int
    efficiency: float
    overlap: float
    runtime_mb: float
    optimizer: str
    exchange_s: float
    step_s: float
    throughput_samples_per_s: float
    comm_fraction: float
    compute_s_max: float
    memory_total_mb_max: float
    over_limit_ranks: list[int] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    per_device: list[dict] | None = None  # left out above 1,024 devices
    device_groups: list[PlanDeviceGroup]

    omit_when_none: ClassVar[tuple[str, ...]] = ("per_device",)


@dataclass(kw_only=True)
class PlanSimulation(Record):
    """The step simulator's summary (``plan.simulation.SimResult.to_dict``)."""

    kind: str = "modelled (simulated)"
    steps: int
    devices: int
    mode: str
    seed: int
    compute_cv: float
    straggler_prob: float
    straggler_factor: float
    link_jitter: bool
    mean_step_s: float
    throughput_samples_per_s: float
    cluster_step_s: dict
    per_device_step_s: dict
    compute_fraction: float
    comm_fraction: float
    wait_fraction: float
    wait_s_per_step: dict

    def describe(self) -> str:
        """The simulation in one line, as ``edgetrain plan`` prints it and ``edgetrain report`` shows it."""
        s = self.cluster_step_s
        stragglers = (f", stragglers p={self.straggler_prob:g} x{self.straggler_factor:g}"
                      if self.straggler_prob else "")
        return (f"simulated ({self.steps} steps, compute CV {self.compute_cv:g}{stragglers}, "
                f"link jitter {'on' if self.link_jitter else 'off'}, seed {self.seed}): "
                f"step mean {s['mean']:,.3f} s, p50 {s['p50']:,.3f} s, p99 {s['p99']:,.3f} s, "
                f"throughput {self.throughput_samples_per_s:,.2f} samples/s; time: compute "
                f"{self.compute_fraction:.1%}, communication {self.comm_fraction:.1%}, "
                f"waiting {self.wait_fraction:.1%}")


@dataclass(kw_only=True)
class PlanScalingRow(Record):
    """One device count of ``--scale``: analytic and simulated step time, speedup and efficiency."""

    devices: int
    analytic_step_s: float
    analytic_throughput: float
    simulated_step_s: float
    simulated_throughput: float
    simulated_p99_step_s: float
    comm_fraction: float          # simulated
    wait_fraction: float          # simulated
    over_limit: bool
    analytic_speedup: float
    simulated_speedup: float
    analytic_efficiency: float
    simulated_efficiency: float


@dataclass(kw_only=True)
class PlanScaling(Record):
    kind: str = "modelled"
    mode: str = "weak"
    rows: list[PlanScalingRow]


@dataclass(kw_only=True)
class PlanStrategyDevice(Record):
    """One device under one strategy (``plan.strategies``): its role, time, memory and bytes, modelled."""

    rank: int
    profile: str
    role: str                     # "shard 1/4 of every unit", "stage 1: layers 3-5 (...)", "batch 32"
    compute_s: float
    comm_s: float                 # communication and, for a pipeline, the bubble
    step_s: float
    memory_mb: dict               # the parts, MiB
    memory_total_mb: float
    memory_limit_mb: float | None
    over_limit: bool
    sent_bytes_per_step: int


@dataclass(kw_only=True)
class PlanStrategy(Record):
    """One strategy's prediction (``--strategy ddp|fsdp|pipeline``), or why it cannot run (``refused``)."""

    kind: str = "modelled"
    strategy: str
    fits: bool                    # every device within its memory limit
    refused: str | None = None    # one line: why it does not fit or cannot run here
    step_s: float | None = None
    throughput_samples_per_s: float | None = None
    memory_total_mb_max: float | None = None
    sent_bytes_per_step_max: int | None = None
    bubble_fraction: float | None = None  # pipeline: (S-1)/(M+S-1)
    devices: list[PlanStrategyDevice] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """The strategy in one line, as ``edgetrain plan`` prints it and ``edgetrain report`` shows it."""
        if self.step_s is None:
            return f"{self.strategy}: refused: {self.refused}"
        bubble = "" if self.bubble_fraction is None else f", bubble {self.bubble_fraction:.1%}"
        return (f"{self.strategy}: step {self.step_s:,.3f} s, {self.throughput_samples_per_s:,.2f} samples/s, "
                f"memory up to {self.memory_total_mb_max:,.0f} MiB per device, "
                f"{self.sent_bytes_per_step_max / 1e6:,.3f} MB sent per device per step{bubble}"
                + (f"; refused: {self.refused}" if self.refused else ""))


@dataclass(kw_only=True)
class PlanComparison(Record):
    """The strategies planned side by side and, for ``--strategy compare``, the one recommended and why."""

    kind: str = "modelled"
    link: str
    strategies: list[PlanStrategy]
    recommended: str | None = None
    reason: str = ""


@dataclass(kw_only=True)
class PlanResult(Record):
    """``plan.json``: what was planned (``config``, ``argv``) and what the model and simulator predict."""

    kind: str = "modelled"
    note: str = "predictions of the analytic model and the simulator; only the model costs are counted"
    argv: list[str] = field(default_factory=list)
    config: dict
    prediction: PlanPrediction
    simulation: PlanSimulation
    scaling: PlanScaling | None = None
    strategies: PlanComparison | None = None   # --strategy fsdp, pipeline or compare
