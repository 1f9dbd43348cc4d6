"""Typed records of a training run: what the loop writes and the report reads.

Files of a run directory and the record each line or file holds:

- ``metrics.jsonl``: one ``StepRecord`` per device per step, sorted by
  (step, rank) when the run ends; while it runs each device appends its own
  lines to ``metrics-<rank>.jsonl`` (see ``train.loop``);
- ``evals.jsonl``: one ``EvalRecord`` per evaluation, appended as it happens;
- ``evals.jsonl`` of a ``--dp`` run: each evaluation's epsilon so far, and ``summary.json`` the run's
  ``PrivacyRecord``;
- ``membership.jsonl``: one ``MembershipRecord`` per membership change of an
  elastic run (``--min-devices``, train/elastic.py), appended as it happens;
- ``summary.json``: one ``RunSummary`` (with a ``DeviceSummary`` per device,
  its energy an ``EnergyRecord``, and the run's task as a ``TaskRecord``: its
  metrics' names, labels, units).
- a Flower fleet's ``fleet-rounds.jsonl`` (``fleet/app.py``): one ``FleetRoundRecord`` per round, its
  modelled clock beside its measured wall time and its evaluations.

An evaluation's figures are ``EvalRecord.metrics``, keyed by the names the
run's ``TaskRecord`` declares (``MetricRecord``): the report takes a metric's
label, unit and direction from there, never from the key's spelling.

Every record is a dataclass with ``to_dict()`` (JSON-able) and
``from_dict()``, which checks each key's JSON type against the field's
annotation and fails in one line naming the key (``EdgetrainError``).
Fields with a default may be missing (older runs, hand-written summaries);
fields without one are required. Unknown keys are refused, except where the
schema keeps room for them: ``RunSummary.details`` (what the strategy adds to
the summary: sync mode, compression, link, tiling report...) and
``DeviceSummary.details`` (its rated peak), which ``to_dict`` writes flat
beside the typed keys, as the files always held them.

Torch-free, so that reading a run (``edgetrain report``) needs no torch of its own.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from edgetrain.errors import EdgetrainError

JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
               bool: "true or false", type(None): "null"}


def _accepts(hint: Any, value: Any) -> bool:
    """Whether a JSON value fits a field annotation (``float`` takes integers, nothing takes a bool for a number)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (types.UnionType, typing.Union):
        return any(_accepts(a, value) for a in args)
    if hint is type(None):
        return value is None
    if hint in (int, float) and isinstance(value, bool):
        return False
    if hint is float:
        return isinstance(value, (int, float))
    if origin is list:
        return isinstance(value, list) and all(_accepts(args[0], v) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    return isinstance(value, hint)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


class Record:
    """``to_dict``/``from_dict`` for the dataclasses below."""

    # the field that holds keys the schema does not name (written flat), or None: unknown keys are refused
    details_field: ClassVar[str | None] = None
    # optional fields left out of the file while they are None (a strategy that does not measure them)
    omit_when_none: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict:
        out: dict = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name == self.details_field:
                out.update(value)
            elif not (value is None and f.name in self.omit_when_none):
                out[f.name] = _plain(value)
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = ""):
        name = where or cls.__name__
        fix = "re-run it or give another run directory"
        if not isinstance(data, dict):
            raise EdgetrainError(f"{name} must hold a JSON object, not {json_name(data)}; {fix}")
        hints = _hints(cls)
        known = {f.name: f for f in dataclasses.fields(cls) if f.name != cls.details_field}  # type: ignore[arg-type]
        unknown = {k: v for k, v in data.items() if k not in known}
        if unknown and cls.details_field is None:
            raise EdgetrainError(f"{name} has unknown key '{next(iter(unknown))}' (expected keys: "
                                 f"{', '.join(known)}); {fix}")
        values: dict = {}
        for key, f in known.items():
            if key not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise EdgetrainError(f"{name} lacks key '{key}' ({_describe(hints[key])}); {fix}")
                continue
            value, hint = data[key], hints[key]
            if not _accepts(hint, value):
                raise EdgetrainError(f"{name}: key '{key}' must be {_describe(hint)}, not {json_name(value)}; {fix}")
            values[key] = _build(hint, value, f"{name}: key '{key}'")
        if cls.details_field is not None:
            values[cls.details_field] = unknown
        return cls(**values)


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _build(hint: Any, value: Any, where: str) -> Any:
    """Nested records (``list[DeviceSummary]``, ``PlanScaling | None``) become dataclasses; everything else
    stays as JSON gave it."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list and args and _is_record(args[0]):
        return [args[0].from_dict(v, where) for v in value]
    record = next((a for a in (hint, *args) if _is_record(a)), None)
    if record is not None and isinstance(value, dict):
        return record.from_dict(value, where)
    return value


def _is_record(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, Record)


def json_name(value: Any) -> str:
    """What JSON calls ``value``'s type, for one-line errors: "a list", "null"."""
    return JSON_NAMES.get(type(value), type(value).__name__)


def _describe(hint: Any) -> str:
    """A field's annotation in JSON's words: ``float | None`` -> "a number or null"."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    args = typing.get_args(hint)
    if origin is list and args and _describe(args[0]) in PLURALS:
        return f"a list of {PLURALS[_describe(args[0])]}"
    if origin is not None:
        hint = origin
    if dataclasses.is_dataclass(hint):
        hint = dict
    return JSON_NAMES.get(hint, "any value")


PLURALS = {"an object": "objects", "a list": "lists", "a string": "strings", "an integer": "integers",
           "a number": "numbers"}


@dataclass
class StepRecord(Record):
    """One device's step: a line of ``metrics.jsonl``. Times in seconds, measured on the device.

    ``comm_busy_s`` is None where the strategy cannot see its collectives;
    the ``virtual_*`` fields are the device clock's (modelled in virtual link
    mode), ``staleness`` (async) and ``local_steps`` (local SGD) only where
    the sync mode has them. ``round_status`` (local SGD and federated rounds,
    at a round's last step): ``joined``, ``missed_deadline`` or ``not_sampled`` (or ``dropped_alone``: the
    round's only member under secure aggregation, whose update alone would have been the aggregate).
    A step the device sat out (not sampled, or past the round's deadline) has
    0 samples and ``loss`` None.
    """

    step: int
    epoch: int
    rank: int
    loss: float | None
    samples: int
    samples_per_s: float
    step_s: float
    data_s: float
    compute_s: float
    comm_s: float
    comm_busy_s: float | None
    bytes_sent: int
    bytes_recv: int
    cpu_s: float
    lr: float
    peak_rss_mb: float
    page_faults: int | None = None
    virtual_s: float | None = None
    virtual_compute_s: float | None = None
    virtual_comm_s: float | None = None
    staleness: int | None = None
    local_steps: int | None = None
    round_status: str | None = None
    read_s: float | None = None         # the batch's items: reading them (storage or cache), summed over items
    decode_s: float | None = None       # ... decoding, augmenting, normalising and collating them
    storage_items: int | None = None    # items of the batch read from storage
    cache_items: int | None = None      # items of the batch served by the --cache-mb cache
    replica_bytes_sent: int | None = None  # pooled strategies with replicas: of bytes_sent, those to other replicas

    omit_when_none: ClassVar[tuple[str, ...]] = ("page_faults", "virtual_s", "virtual_compute_s", "virtual_comm_s",
                                                 "staleness", "local_steps", "round_status", "read_s", "decode_s",
                                                 "storage_items", "cache_items", "replica_bytes_sent")


class MetricText:
    """How a metric is named and printed, for ``MetricRecord`` and ``tasks.base.Metric`` (which have ``name``,
    ``unit``, ``label`` and ``fmt``)."""

    @property
    def title(self) -> str:
        text = self.label or self.name
        return f"{text} ({self.unit})" if self.unit else text

    def format(self, value: float) -> str:
        return f"{format(value, self.fmt)}{' ' + self.unit if self.unit else ''}"


@dataclass
class MetricRecord(MetricText, Record):
    """One metric a task reports (``tasks.base.Metric``): ``name`` keys it in ``EvalRecord.metrics``, ``label``
    and ``unit`` are what a plot's axis says (unit ``""``: a fraction of 1), ``fmt`` how a value is printed."""

    name: str
    unit: str = ""
    higher_is_better: bool = True
    label: str = ""
    fmt: str = ".4g"


@dataclass
class TaskRecord(Record):
    """What a run learned: the task's name (a built-in kind, or ``module:QualName`` for one passed from Python),
    its headline metric's name and every metric it reports."""

    name: str
    headline: str
    metrics: list[MetricRecord] = field(default_factory=list)
    loss: str = ""       # what the loss is, for a plot's axis ("cross-entropy")

    def metric(self, name: str) -> MetricRecord | None:
        return next((m for m in self.metrics if m.name == name), None)

    @property
    def headline_metric(self) -> MetricRecord | None:
        return self.metric(self.headline)


# What a run before tasks learned: a classifier scored by accuracy.
CLASSIFICATION = TaskRecord("classification", "accuracy",
                            [MetricRecord("accuracy", "", True, "accuracy", ".1%")], "cross-entropy")


@dataclass
class EvalRecord(Record):
    """One evaluation on the whole test set (a line of ``evals.jsonl``, and ``RunSummary.evals``).

    ``metrics``: every metric of the run's task by its name (``TaskRecord``); ``test_accuracy`` is a
    classifier's accuracy (None for other tasks), as runs before tasks wrote it."""

    epoch: int
    step: int
    test_loss: float
    test_accuracy: float | None = None
    metrics: dict[str, float] | None = None   # None: a run before tasks (its test_accuracy says it all)
    epsilon: float | None = None   # --dp: the privacy spent so far, at the run's delta (PrivacyRecord)

    omit_when_none: ClassVar[tuple[str, ...]] = ("metrics", "epsilon")

    def values(self) -> dict[str, float]:
        """Every metric of the evaluation by name (a run before tasks: its accuracy)."""
        if self.metrics is not None:
            return dict(self.metrics)
        return {} if self.test_accuracy is None else {"accuracy": self.test_accuracy}


@dataclass
class PrivacyRecord(Record):
    """``--dp`` (privacy/dp.py): the guarantee a run's training gives, as its accountant reports it.

    ``level``: ``sample`` (DP-SGD: a training sample's influence) or ``device`` (DP-FedAvg: a device's whole
    data). ``events``: the steps (sample) or rounds (device) accounted; ``sample_rate``: the chance of a sample
    (a device) to be in one; ``epsilon``: at ``delta`` after them (None: no noise, no guarantee);
    ``guarantee``: who it protects against what, in words."""

    level: str
    clip: float
    noise_multiplier: float
    delta: float
    epsilon: float | None
    sample_rate: float
    events: int
    accountant: str
    guarantee: str
    target_epsilon: float | None = None   # --dp epsilon=E: the target the noise multiplier was derived for

    def describe(self) -> str:
        eps = "infinite (no noise)" if self.epsilon is None else f"{self.epsilon:.3g}"
        unit = "steps" if self.level == "sample" else "rounds"
        return (f"differential privacy ({self.level} level): epsilon {eps} at delta {self.delta:g} after "
                f"{self.events} {unit} (noise multiplier {self.noise_multiplier:.4g}, clip {self.clip:g}, sampling "
                f"rate {self.sample_rate:.4g}, {self.accountant.upper()} accountant); {self.guarantee}")


@dataclass
class MembershipRecord(Record):
    """A device set change of an elastic run (a line of ``membership.jsonl``, and ``RunSummary.membership``).

    ``step``: the step the new set runs first (a failed step is redone, not counted twice); ``devices``: the
    devices that left or joined, by their rank at the start of the run; ``state_from``: ``peer`` (a
    survivor's memory) or ``checkpoint`` (a resume: ``--resume`` or a torchrun restart, whose ``cause``
    says which); ``took_s``: from the change being noticed to the state restored, measured on the new
    set's rank 0 (for a resume: only reading and spreading the checkpoint, a fraction of a second);
    ``outage_s`` (a resume only): how long training stood still, wall clock from the last step or checkpoint
    the stopped run wrote (its files' times) to the state restored, the restart and the torchrun/host
    recovery included. A peer change has none: it is noticed within a watcher poll (0.2 s) of the death,
    so ``took_s`` is its outage.
    """

    wall_s: float
    step: int
    kind: str            # leave, join, or restart (a resume on as many devices)
    devices: list[int]
    world: int           # devices training after the change
    state_from: str
    took_s: float
    cause: str = ""      # a resume's: "resume" or "torchrun restart"
    outage_s: float | None = None

    omit_when_none: ClassVar[tuple[str, ...]] = ("outage_s",)


@dataclass
class EnergyRecord(Record):
    """A device's energy over its training steps (``train/energy.py``; design: docs/how-to/energy.md).

    ``measured``: from a sensor (RAPL, Jetson INA3221, a ``--power-file``), else modelled from the device
    profile's power model (``idle_w + core_w x cores``). ``source`` says which, in words, and is what every
    table prints. ``host_share``: where the sensor meters the whole host and several devices share it, the
    fraction of the host's busy CPU time this device used over the window, by which the sensor's joules
    were multiplied; None where the sensor's joules are all this device's.
    """

    source: str
    measured: bool
    joules: float
    seconds: float
    samples: int
    joules_per_sample: float | None    # None: no sample trained in the window
    watts: float | None                # average power over the window
    host_share: float | None = None

    @classmethod
    def of(cls, source: str, measured: bool, joules: float, seconds: float, samples: int,
           host_share: float | None = None) -> "EnergyRecord":
        return cls(source, measured, joules, seconds, samples, joules / samples if samples else None,
                   joules / seconds if seconds > 0 else None, host_share)


@dataclass(kw_only=True)
class DeviceSummary(Record):
    """One device's means per step after the first (which pays one-off costs), and its totals.

    ``details``: its rated peak (``tasks.flops.device_peak``) and what it
    achieved against it (``tasks.flops.achieved``), where known.

    ``peak_rss_mb``: the highest peak resident set (VmHWM) at the end of a
    training step, what a profile's memory limit is checked against during
    the run; ``run_peak_rss_mb``: VmHWM after the strategy's final exchange
    (``finish``) and the final checkpoint (a pipeline's or fsdp's devices each
    write their own part of it), so the whole run up to the summary.
    """

    rank: int
    profile: str
    link: str | dict | None = None
    local_batch: int
    speed: float | None = None
    cores: list[int] | None = None
    threads: int | None = None
    samples_per_s: float
    step_s: float | None = None
    data_s: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    cpu_s: float | None = None
    comm_busy_s: float | None = None
    bytes_sent: int | None = None
    bytes_recv: int | None = None
    peak_rss_mb: float | None = None
    run_peak_rss_mb: float | None = None
    page_faults: float | None = None
    throttle_slept_s: float | None = None
    throttle_reference_pass_s: float | None = None
    throttle_inflation: float | None = None
    read_s: float | None = None          # per step: the loader's reading of the batch's items (see StepRecord)
    decode_s: float | None = None        # per step: its decoding, augmenting and collating them
    workers: int | None = None           # data-loader worker processes
    storage_items_per_epoch: float | None = None  # items read from storage per epoch (the first one included)
    cache_items_per_epoch: float | None = None    # items the --cache-mb cache served per epoch
    energy: EnergyRecord | None = None   # None: no sensor and no power model in the profile (or an older run)
    details: dict = field(default_factory=dict)

    details_field: ClassVar[str | None] = "details"
    omit_when_none: ClassVar[tuple[str, ...]] = ("page_faults", "run_peak_rss_mb", "energy", "read_s", "decode_s",
                                                 "workers", "storage_items_per_epoch", "cache_items_per_epoch")


@dataclass(kw_only=True)
class RunSummary(Record):
    """``summary.json``: the run as a whole. Only ``per_device`` and the throughput are required, so that
    the report reads summaries written by hand or by older versions.

    ``details``: what the strategy adds (``Strategy.summary``), written flat.
    """

    run_dir: str | None = None
    model: str | None = None
    params: int | None = None
    dataset: str | None = None
    input_shape: list[int] | None = None
    flops_per_sample: dict | None = None
    devices: int | None = None
    profiles: list[str] | None = None
    strategy: str | None = None
    accelerator: str | None = None
    global_batch: int | None = None
    local_batches: list[int] | None = None
    steps: int | None = None
    train_loss: float | None = None
    train_accuracy: float | None = None
    test_loss: float | None = None
    test_accuracy: float | None = None
    evals: list[EvalRecord] = field(default_factory=list)
    membership: list[MembershipRecord] = field(default_factory=list)
    task: TaskRecord | None = None                  # what was learned; None: a classifier (runs before tasks)
    train_metrics: dict[str, float] | None = None   # the task's train figures over the last epoch
    test_metrics: dict[str, float] | None = None    # the last evaluation's metrics (EvalRecord.metrics)
    per_device: list[DeviceSummary]
    throughput_samples_per_s: float
    achieved_gflops: float | None = None
    step_s: float | None = None
    time_split_s: dict | None = None
    time_split_fraction: dict | None = None
    bytes_sent_total: int | None = None
    bytes_recv_total: int | None = None
    bytes_sent_per_step_per_device: float | None = None
    peak_rss_mb_max: float | None = None
    wall_time_s: float | None = None
    batchnorm: str | None = None
    energy_j_per_epoch: float | None = None
    details: dict = field(default_factory=dict)
    checkpoint: str | None = None
    clipped_boxes: int | None = None    # detection labels whose box passed the image's edge, clipped to it
    privacy: PrivacyRecord | None = None  # --dp: the guarantee of the run

    details_field: ClassVar[str | None] = "details"
    omit_when_none: ClassVar[tuple[str, ...]] = ("energy_j_per_epoch", "task", "train_metrics", "test_metrics",
                                                 "clipped_boxes", "privacy")


def modelled_throughput(s: RunSummary) -> dict | None:
    """A run on emulated links in virtual mode, as its devices' clocks saw it; None for any other run.

    The slowest device's clock bounds the run (synchronous steps wait for it): step time is its virtual
    time over the steps, throughput the global batch over that; ``comm_fraction`` is rank 0's share of
    time not computing (transfers and waits), as ``comm.emulation`` reports it.
    """
    d = s.details
    if (d.get("link_mode") != "virtual" or not d.get("virtual_time_max_device_s") or not d.get("sync_steps")
            or not s.global_batch):
        return None
    step_s = d["virtual_time_max_device_s"] / d["sync_steps"]
    return {"step_s": step_s, "samples_per_s": s.global_batch / step_s, "comm_fraction": d.get("comm_fraction", 0.0)}


def stall_what_ifs(d: DeviceSummary, cores: int | None = None) -> dict | None:
    """DS-Analyzer's what-ifs for one device, modelled from its measured means per step (None without them).

    The device's step is its busy time ``C`` (step - data wait) plus the stall (``data_s``). Its loader does
    ``R`` seconds of reading and ``D`` of decoding per batch. With no workers the training process does both
    in the step: step = C + stall. With ``w`` workers, each preparing whole batches in parallel, a batch is
    ready every (R + D) / w seconds, so the step is max(C, (R + D) / w) once the pipeline runs. The what-ifs
    replace R by 0 (the data cached in memory) or w by 2w (1 for none) in that model; ``cores`` caps the
    parallel workers (they share the host's cores with training: the model ignores that contention)."""
    if d.read_s is None or d.decode_s is None or d.step_s is None or d.data_s is None or d.workers is None:
        return None
    busy = max(d.step_s - d.data_s, 0.0)
    cap = cores or 10 ** 6

    def step(read: float, workers: int) -> float:
        if workers == 0:
            return busy + max(d.data_s - (d.read_s - read), 0.0)
        return max(busy, (read + d.decode_s) / min(workers, cap))

    more = 1 if d.workers == 0 else 2 * d.workers
    return {"stall_share": d.data_s / d.step_s if d.step_s else 0.0, "step_s": d.step_s,
            "cached_step_s": step(0.0, d.workers), "more_workers": more,
            "more_workers_step_s": step(d.read_s, more)}


@dataclass
class FleetRoundRecord(Record):
    """One round of a Flower fleet with a modelled clock (a line of ``fleet-rounds.jsonl``): who was online,
    sampled, aggregated, dropped out or late, the round's modelled time and the clock after it, the bytes (down:
    modelled, the global model to each sampled device; up: the payloads delivered), this machine's measured wall
    time of the round's training, and its evaluations in ``scores``: ``server_<metric>`` (the global model on
    the whole test set, on the server), ``federated_eval-<metric>`` (the devices' own test splits)."""

    round: int
    modelled_round_s: float
    modelled_clock_s: float
    devices: int
    online: int
    sampled: int
    aggregated: int
    dropouts: int
    late: int
    modelled_bytes_down: int
    bytes_up: int
    measured_train_wall_s: float | None = None
    scores: dict[str, float] = field(default_factory=dict)

    details_field: ClassVar[str | None] = "scores"
