"""The bottom layer: every string option of a run parsed once into frozen, typed specs (``SyncSpec``,
``CompressSpec``, ``Link``, ``PipelineSpec``, ``TilingSpec``, ``DPSpec``, ``CheckpointSpec``, ``RunSpec``...).

Torch-free, importing nothing of edgetrain but ``errors``; the parsers look kinds up in the tables
``edgetrain.kinds`` fills and know none by name. ``config.resolve`` builds the ``RunSpec`` and is the one
place that refuses combinations that cannot run. Each option's syntax and where it goes: docs/design/specs.md.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from edgetrain.errors import EdgetrainError

# ---------------------------------------------------------------- the kinds

# Each strategy, sync mode, compressor, task and server optimiser is declared once, as a descriptor in
# ``edgetrain.kinds``, which fills these tables when ``edgetrain`` is imported (the package's __init__ imports it): the parsers here
# look a name up in them and know no kind by name (docs/design/kinds.md).
KINDS: dict[str, dict] = {"strategy": {}, "sync": {}, "compress": {}, "task": {}, "server_optimizer": {},
                          "availability": {}}


def usage(family: str) -> str:
    """``sync, local:H, async:S, gossip or fedavg:E``: how each kind of ``family`` is written, for a refusal."""
    # an alias is written as its kind is: diloco:H as local:H
    written = [alias + kind.usage[len(kind.name):] for kind in KINDS[family].values() for alias in
               (kind.name, *kind.aliases)]
    return ", ".join(written[:-1]) + " or " + written[-1] if len(written) > 1 else "".join(written)


def _lookup(family: str, name: str):
    """The descriptor of ``name`` (or of a kind that takes ``name`` as an alias), None if none is declared."""
    kinds = KINDS[family]
    return kinds.get(name) or next((k for k in kinds.values() if name in k.aliases), None)


# ---------------------------------------------------------------- --compress


@dataclass(frozen=True)
class CompressSpec:
    """A parsed ``--compress`` spec."""

    method: str
    arg: float | None = None
    options: Mapping[str, float | bool] = field(default_factory=dict)
    text: str = "none"

    def __post_init__(self) -> None:
        # read-only, so that a frozen spec cannot change under the code that shares it
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def __hash__(self) -> int:  # a mappingproxy is not hashable; the planner caches payloads by spec
        return hash((self.method, self.arg, tuple(sorted(self.options.items())), self.text))

    def __reduce__(self):
        # a mappingproxy does not pickle; devices receive the spec pickled (spawn), so rebuild it from a dict
        return type(self), (self.method, self.arg, dict(self.options), self.text)

    @property
    def kind(self):
        """The compressor's descriptor (``edgetrain.kinds``)."""
        return KINDS["compress"][self.method]

    @property
    def is_powersgd(self) -> bool:
        """A DDP gradient hook of its own (PowerSGD), not a ``Compressor``."""
        return self.kind.hook

    @property
    def is_dgc(self) -> bool:
        return "dgc" in self.options


def parse_compress(text: str | None) -> CompressSpec:
    """Parse and validate a ``--compress`` spec; raise ``EdgetrainError`` with the fix if it is wrong."""
    text = (text or "none").strip().lower()
    name, *rest = text.split(":")
    kind = _lookup("compress", name)
    if kind is None:
        raise EdgetrainError(f"unknown compression {name!r} in --compress {text!r}; use one of "
                             f"{', '.join(KINDS['compress'])}")
    arg: float | None = None
    options: dict = {}
    for i, token in enumerate(rest):
        key, eq, value = token.partition("=")
        if i == 0 and not eq and _is_number(token):
            arg = float(token)
            continue
        if key not in kind.options:
            allowed = ", ".join(sorted(kind.options)) or "none"
            raise EdgetrainError(f"unknown option {token!r} for {kind.name} in --compress {text!r}; options: {allowed}")
        options[key] = _number(value, token, text) if eq else True
    kind.check_arguments(arg, options, text)
    return CompressSpec(kind.name, arg, options, text)


def _is_number(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return False


def _number(value: str, token: str, text: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise EdgetrainError(f"option {token!r} in {text!r} needs a number") from None


# ---------------------------------------------------------------- --sync


@dataclass(frozen=True)
class SyncSpec:
    mode: str
    period: int = 1            # local / gossip / fedavg:steps=H: steps between exchanges
    staleness: int = 0         # async: bound in steps
    nesterov: bool = False     # local: DiLoCo outer step
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    text: str = "sync"
    local_epochs: int = 0      # fedavg:E: a round is E epochs of local steps (0: ``period`` steps)
    prox_mu: float | None = None   # fedavg:...:prox=MU: FedProx's proximal term (None: not FedProx)
    scaffold: bool = False     # fedavg:...:scaffold: SCAFFOLD's control variates
    weighted: bool = False     # fedavg:...:weighted: updates weighted by the devices' sample counts (McMahan's n_k/n)
    reset: bool = False        # fedavg:...:reset: a fresh client optimizer (no momentum carried over) each round
    fragments: int = 1         # streaming: fragments of the model, each synchronised at its own step of the H
    overlap: int = 0           # streaming: inner steps a fragment's exchange runs behind before it is applied
    mix: float = 0.0           # streaming: share of the local fragment kept when the averaged one is applied

    @property
    def kind(self):
        """The sync mode's descriptor (``edgetrain.kinds``)."""
        return KINDS["sync"][self.mode]


def parse_sync(text: str | None) -> SyncSpec:
    """Parse and validate a ``--sync`` spec; raise ``EdgetrainError`` with the fix if it is wrong."""
    text = (text or "sync").strip().lower()
    mode, *rest = text.split(":")
    kind = _lookup("sync", mode)
    if kind is None:
        raise EdgetrainError(f"unknown sync mode {mode!r} in --sync {text!r}; use {usage('sync')}")
    return kind.parse(rest, text)


@dataclass(frozen=True)
class ServerOptSpec:
    """``--server-opt``: how the server steps the global model with ``global - mean(client models)``."""

    name: str = "fedavg"
    lr: float = 1.0
    momentum: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 0.001
    text: str = "fedavg"

    @property
    def kind(self):
        """The server optimiser's descriptor (``edgetrain.kinds``)."""
        return KINDS["server_optimizer"][self.name]


def parse_server_opt(text: str | None) -> ServerOptSpec:
    """Parse ``fedavg``, ``fedavgm[:lr=..][:momentum=..]`` or ``fedadam[:lr=..][:beta1=..][:beta2=..][:eps=..]``."""
    text = (text or "fedavg").strip().lower()
    name, *rest = text.split(":")
    kind = _lookup("server_optimizer", name)
    if kind is None:
        raise EdgetrainError(f"unknown server optimizer {name!r} in --server-opt {text!r}; use "
                             f"{usage('server_optimizer')}")
    values = dict(kind.defaults)
    for token in rest:
        key, eq, value = token.partition("=")
        if not eq or key not in values:
            allowed = ", ".join(f"{k}=" for k in values) or "none"
            raise EdgetrainError(f"unknown option {token!r} for {name} in --server-opt {text!r}; options: {allowed}")
        try:
            values[key] = float(value)
        except ValueError:
            raise EdgetrainError(f"option {token!r} in --server-opt {text!r} needs a number") from None
    if not (values.get("lr", 1.0) > 0 and math.isfinite(values.get("lr", 1.0)) and values.get("eps", 1.0) > 0
            and all(0 <= values.get(k, 0.0) < 1 for k in ("momentum", "beta1", "beta2"))):
        raise EdgetrainError(f"--server-opt {text!r} is out of range; give lr > 0, eps > 0 and momentum, beta1, "
                             "beta2 in [0, 1)")
    return ServerOptSpec(name, text=text, **values)


def _int(token: str, mode: str, text: str) -> int:
    try:
        return int(token)
    except ValueError:
        raise EdgetrainError(f"--sync {mode} needs a whole number of steps, got {token!r} in {text!r}") from None


def _float(value: str, opt: str, text: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise EdgetrainError(f"option {opt!r} in --sync {text!r} needs a number") from None

# ---------------------------------------------------------------- --partition

PARTITIONS = ("none", "iid", "dirichlet", "shards")


@dataclass(frozen=True)
class PartitionSpec:
    """``--partition``: ``none`` (one shared dataset), ``iid``, ``dirichlet:ALPHA`` or ``shards:K`` per device."""

    kind: str = "none"
    alpha: float | None = None   # dirichlet: concentration (small: each device holds few classes)
    shards: int | None = None    # shards: label-sorted shards per device (McMahan et al. 2017)
    text: str = "none"

    @property
    def local(self) -> bool:
        """Whether each device holds its own part of the data (any kind but ``none``)."""
        return self.kind != "none"

    @property
    def by_label(self) -> bool:
        """Whether the split reads class labels (``dirichlet``, ``shards``: label skew), not only counts."""
        return self.kind in ("dirichlet", "shards")


def parse_partition(text: str | None) -> PartitionSpec:
    """Parse and validate a ``--partition`` spec; raise ``EdgetrainError`` with the fix if it is wrong."""
    text = (text or "none").strip().lower()
    kind, *rest = text.split(":")
    if kind not in PARTITIONS:
        raise EdgetrainError(f"unknown partition {kind!r} in --partition {text!r}; use none, iid, "
                             "dirichlet:ALPHA (e.g. dirichlet:0.5) or shards:K (e.g. shards:2)")
    if kind in ("none", "iid"):
        if rest:
            raise EdgetrainError(f"--partition {kind} takes no argument, got {text!r}")
        return PartitionSpec(kind, text=text)
    if len(rest) != 1:
        example = "dirichlet:0.5" if kind == "dirichlet" else "shards:2"
        raise EdgetrainError(f"--partition {kind} needs one number, e.g. {example}; got {text!r}")
    if kind == "dirichlet":
        alpha = float(rest[0]) if _is_number(rest[0]) else math.nan
        if not (alpha > 0 and math.isfinite(alpha)):
            raise EdgetrainError(f"dirichlet alpha must be a finite number > 0, got {rest[0]!r}; e.g. dirichlet:0.5 "
                                 "(smaller: more skewed labels per device)")
        return PartitionSpec(kind, alpha=alpha, text=text)
    shards = int(rest[0]) if rest[0].isdigit() else 0
    if shards < 1:
        raise EdgetrainError(f"shards:K needs a whole number K >= 1 of shards per device, got {rest[0]!r}; "
                             "e.g. shards:2")
    return PartitionSpec(kind, shards=shards, text=text)


# ---------------------------------------------------------------- availability (a simulated fleet's devices)

_DURATION = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str, what: str) -> float:
    """``"90s"``, ``"20m"``, ``"12h"`` or plain seconds -> seconds (> 0)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise EdgetrainError(f"bad {what} {text!r}; write a positive duration like 90s, 20m or 12h")
    return float(m.group(1)) * _DURATION[m.group(2) or "s"]


@dataclass(frozen=True)
class AvailabilitySpec:
    """A parsed ``availability`` (when a simulated fleet's devices are online): its kind's name and the arguments
    its kind parsed (durations in seconds, a fraction, a trace file's path)."""

    name: str = "always"
    args: tuple = ()
    text: str = "always"

    @property
    def kind(self):
        """The availability's descriptor (``edgetrain.kinds``)."""
        return KINDS["availability"][self.name]


def availability_spec(text: str | None) -> AvailabilitySpec:
    """Parse ``always``, ``diurnal:PERIOD:FRACTION``, ``onoff:MEAN_ON:MEAN_OFF`` or ``trace:PATH``: the kind by its
    name, its arguments by the kind (``AvailabilityKind.parse_arguments``)."""
    text = (text or "always").strip()
    name, _, rest = text.partition(":")
    kind = _lookup("availability", name.lower())
    if kind is None:
        raise EdgetrainError(f"bad availability {text!r}; use {usage('availability')}")
    return AvailabilitySpec(kind.name, kind.parse_arguments(rest, text), text)


# ---------------------------------------------------------------- links

LINK_MODES = ("virtual", "enforced")

@dataclass(frozen=True)
class Link:
    """One device's network link. ``bandwidth_bps`` in bits per second, times in seconds."""

    bandwidth_bps: float
    latency_s: float
    jitter_s: float = 0.0
    loss: float = 0.0
    name: str = ""

    def __post_init__(self) -> None:
        if not (self.bandwidth_bps > 0 and math.isfinite(self.bandwidth_bps)):
            raise EdgetrainError(f"link bandwidth must be a positive number of bits/s, got {self.bandwidth_bps}")
        if not (self.latency_s >= 0 and self.jitter_s >= 0):
            raise EdgetrainError(f"link latency and jitter must be >= 0, got {self.latency_s}, {self.jitter_s}")
        if not 0 <= self.loss < 1:
            raise EdgetrainError(f"link loss must be a probability in [0, 1), got {self.loss}")

    @property
    def goodput_Bps(self) -> float:
        """The link's rate in bytes per second after expected retransmissions. Frames, headers included: the
        payload a collective moves is less by its TCP/IP/Ethernet framing (``edgetrain.cluster.links``)."""
        return self.bandwidth_bps / 8 * (1 - self.loss)

    def describe(self) -> str:
        text = f"{_fmt_bits(self.bandwidth_bps)}, {self.latency_s * 1e3:g} ms"
        if self.jitter_s:
            text += f", jitter {self.jitter_s * 1e3:g} ms"
        if self.loss:
            text += f", loss {self.loss:g}"
        return f"{self.name} ({text})" if self.name else text


PRESETS: dict[str, Link] = {
    "lan-1g": Link(1e9, 0.0002, name="lan-1g"),
    "wifi-20m": Link(20e6, 0.005, jitter_s=0.001, name="wifi-20m"),
    "lte-10m": Link(10e6, 0.050, jitter_s=0.005, name="lte-10m"),
    # Shanghai-Boston is about 11,700 km; light in fibre needs ~58 ms, in vacuum 39 ms.
    # 78 ms one way is the figure the issue asks for (twice the vacuum time).
    "wan-intercontinental": Link(100e6, 0.078, name="wan-intercontinental"),
}

_RATE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def get_link(spec: str | Link | dict | None) -> Link | None:
    """A ``Link`` from a preset name, an inline spec, a mapping (cluster file) or a ``Link``.

    ``None``, ``""`` and ``"none"`` mean no emulation (the host's own network).
    Inline: ``BANDWIDTH:LATENCY[:jitter=T][:loss=P]``, e.g. ``20mbit:5ms:jitter=1ms:loss=0.01``.
    Mapping: ``{preset: lte-10m}`` or ``{bandwidth: 20mbit, latency: 5ms, jitter: 1ms, loss: 0.01}``.
    """
    if spec is None or isinstance(spec, Link):
        return spec
    if isinstance(spec, dict):
        return _link_from_mapping(spec)
    if not isinstance(spec, str):
        raise EdgetrainError(f"a link is a preset name or a spec string, got {type(spec).__name__}")
    text = spec.strip().lower()
    if text in ("", "none"):
        return None
    if text in PRESETS:
        return PRESETS[text]
    if ":" not in text:
        raise EdgetrainError(f"unknown link preset {spec!r}; use one of {', '.join(PRESETS)} "
                             "or an inline spec like 20mbit:5ms:jitter=1ms:loss=0.01")
    parts = text.split(":")
    options: dict[str, str] = {}
    for part in parts[2:]:
        key, eq, value = part.partition("=")
        if not eq or key not in ("jitter", "loss"):
            raise EdgetrainError(f"bad link option {part!r} in {spec!r}; options are jitter=TIME and loss=P")
        options[key] = value
    return Link(bandwidth_bps=parse_rate(parts[0]), latency_s=parse_time(parts[1]),
                jitter_s=parse_time(options.get("jitter", "0s")), loss=_parse_prob(options.get("loss", "0")),
                name=text)


def _link_from_mapping(spec: dict) -> Link | None:
    known = {"preset", "bandwidth", "latency", "jitter", "loss"}
    unknown = set(spec) - known
    if unknown:
        raise EdgetrainError(f"unknown link field(s) {sorted(unknown)}; use {sorted(known)}")
    if "preset" in spec:
        base = get_link(str(spec["preset"]))
        if base is None:
            return None
    elif "bandwidth" in spec and "latency" in spec:
        base = Link(parse_rate(str(spec["bandwidth"])), parse_time(str(spec["latency"])))
    else:
        raise EdgetrainError("a link needs either 'preset' or both 'bandwidth' and 'latency'")
    return Link(
        bandwidth_bps=parse_rate(str(spec["bandwidth"])) if "bandwidth" in spec else base.bandwidth_bps,
        latency_s=parse_time(str(spec["latency"])) if "latency" in spec else base.latency_s,
        jitter_s=parse_time(str(spec["jitter"])) if "jitter" in spec else base.jitter_s,
        loss=_parse_prob(str(spec["loss"])) if "loss" in spec else base.loss,
        name=str(spec.get("preset", "")),
    )


def parse_rate(text: str) -> float:
    """``"20mbit"`` -> 20e6 bits per second (``kbit``, ``mbit``, ``gbit``; ``mbps`` means the same)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]+)\s*", text.lower())
    if not m or m.group(2) not in _RATE:
        raise EdgetrainError(f"bad bandwidth {text!r}; write it like 20mbit, 500kbit or 1gbit")
    value = float(m.group(1)) * _RATE[m.group(2)]
    if value <= 0:
        raise EdgetrainError(f"bandwidth must be positive, got {text!r}")
    return value


def parse_time(text: str) -> float:
    """``"5ms"`` -> 0.005 seconds (``s``, ``ms``, ``us``)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]+)\s*", text.lower())
    if not m or m.group(2) not in _TIME:
        raise EdgetrainError(f"bad time {text!r}; write it like 5ms, 0.2s or 300us")
    return float(m.group(1)) * _TIME[m.group(2)]


def _parse_prob(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise EdgetrainError(f"bad loss {text!r}; write a probability like 0.01") from None
    if not 0 <= value < 1:
        raise EdgetrainError(f"loss must be in [0, 1), got {text!r}")
    return value


def _fmt_bits(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


# ---------------------------------------------------------------- tiling

def parse_grid(text: str | tuple[int, int] | list[int]) -> tuple[int, int]:
    """``"2x2"`` -> ``(2, 2)`` (rows x cols)."""
    if isinstance(text, (tuple, list)) and len(text) == 2 and all(isinstance(v, int) for v in text):
        rows, cols = text
    else:
        m = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", str(text))
        if not m:
            raise EdgetrainError(f"grid {text!r} is not ROWSxCOLS, e.g. '2x2' or '1x3'")
        rows, cols = int(m.group(1)), int(m.group(2))
    if rows < 1 or cols < 1:
        raise EdgetrainError(f"grid {text!r} needs at least one row and one column, e.g. '2x2'")
    return rows, cols


def parse_groups(groups: str | list[int] | tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The group ends as layer indices (``"4,8"``, ``[4, 8]``), or ``None`` for ``"auto"``."""
    if groups is None:
        return None
    if isinstance(groups, str):
        text = groups.strip().lower()
        if text == "auto":
            return None
        try:
            groups = [int(g) for g in text.replace(" ", "").strip("[]").split(",") if g]
        except ValueError:
            raise EdgetrainError(f"groups {groups!r} is neither 'auto' nor a comma-separated list of layer indices "
                                 f"such as '4,8' (groups end before layers 4 and 8; 8 ends the tiled section)") from None
    ends = tuple(int(g) for g in groups)
    if not ends or any(b <= a for a, b in zip((0,) + ends, ends)):
        raise EdgetrainError(f"groups {list(groups)} must be increasing positive layer indices, e.g. [4, 8]: the "
                             f"groups end before those layers and the last one ends the tiled section")
    return ends


@dataclass(frozen=True)
class TilingSpec:
    """``--strategy tiled``: the device grid (rows, cols) and the group ends (``None``: chosen automatically)."""

    grid: tuple[int, int]
    groups: tuple[int, ...] | None = None

    @property
    def devices(self) -> int:
        return self.grid[0] * self.grid[1]


def parse_tiling(grid: str | tuple[int, int] | list[int], groups: str | list[int] | tuple[int, ...] | None = "auto"
                 ) -> TilingSpec:
    return TilingSpec(parse_grid(grid), parse_groups(groups))


# ---------------------------------------------------------------- pipeline

PIPELINE_SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class PipelineSpec:
    """``--strategy pipeline``: where stages start (``None``: split evenly, or planned), micro-batches, schedule.

    ``starts`` are layer indices (the model's layers in forward order, ``pipelining.stages.pipeline_layers``):
    ``--stages 4,8`` gives stage 0 the layers 0-3, stage 1 the layers 4-7 and stage 2 the rest.
    ``replicas`` D > 1 runs D such pipelines side by side (hybrid: devices = stages x D, device ``rank`` is
    stage ``rank % S`` of replica ``rank // S``), each on ``B / D`` of the global batch, the D devices of a
    stage all-reducing its gradients through ``--compress`` (train/pipeline.py).
    """

    starts: tuple[int, ...] | None
    microbatches: int
    schedule: str               # PIPELINE_SCHEDULES
    planned: bool = False       # --stages auto: the split planner (pipelining.split) chooses ``starts`` on the devices
    replicas: int = 1           # --pipeline-replicas: pipelines side by side, each stage's gradients all-reduced

    @property
    def stages(self) -> int | None:
        return None if self.starts is None else len(self.starts) + 1


def parse_stages(text: str) -> tuple[int, ...] | None:
    """``"auto"``, ``"even"`` -> ``None``; ``"4,8"`` -> ``(4, 8)``, the layers at which stages 1, 2, ... start."""
    text = str(text).strip().lower()
    if text in ("auto", "even"):
        return None
    try:
        starts = tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError:
        starts = ()
    if not starts or starts[0] < 1 or any(b <= a for a, b in zip(starts, starts[1:])):
        raise EdgetrainError(f"config key 'stages' {text!r} is neither auto, even nor increasing layer indices >= 1 "
                             f"such as '4,8' (stage 1 starts at layer 4, stage 2 at layer 8)")
    return starts


# ---------------------------------------------------------------- round deadline

@dataclass(frozen=True)
class DeadlineSpec:
    """``--round-deadline``: how long a round of local steps may take on a device's clock (comm/deadline.py).

    ``seconds`` fixes it; ``None`` is ``auto``: ``factor`` x the median of the
    sampled devices' round times over the last ``window`` rounds, at least ``floor_s``.
    """

    seconds: float | None = None
    factor: float = 2.0
    floor_s: float = 0.05
    window: int = 5
    text: str = "auto"


def parse_round_deadline(text: str | float | None) -> DeadlineSpec | None:
    """``off`` (or None) -> None; ``auto`` -> the adaptive deadline; ``SECONDS`` (> 0) -> a fixed one."""
    value = str(text if text is not None else "off").strip().lower()
    if value in ("off", "none", "no", "false"):
        return None
    if value == "auto":
        return DeadlineSpec()
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise EdgetrainError(f"round deadline {text!r} is not off, auto or a number of seconds > 0; e.g. "
                             "--round-deadline auto (2x the median round time) or --round-deadline 1.5")
    return DeadlineSpec(seconds=seconds, text=value)


# ---------------------------------------------------------------- EDGETRAIN_FAULT

FAULT_ENV = "EDGETRAIN_FAULT"
FAULT_ACTIONS = ("kill", "stop", "disconnect")


@dataclass(frozen=True)
class FaultSpec:
    """A fault to inject (``cluster/faults.py``): ``action`` on device ``rank`` at the start of step ``step``;
    ``back_s``: the launcher starts the killed device again that many seconds later (elastic runs only)."""

    action: str   # FAULT_ACTIONS
    rank: int
    step: int
    back_s: float | None = None


def parse_fault(text: str | None) -> FaultSpec | None:
    """``EDGETRAIN_FAULT=kill|stop|disconnect:rank=R:step=S[:back=SECONDS]`` (empty or unset: no fault)."""
    if not text or not text.strip():
        return None
    usage = (f"{FAULT_ENV}={text!r} must be ACTION:rank=R:step=S with ACTION kill, stop or disconnect, "
             f"e.g. kill:rank=1:step=5 (kill may add :back=SECONDS)")
    action, *rest = text.strip().lower().split(":")
    fields = dict(part.partition("=")[::2] for part in rest)
    optional = ["back"] if action == "kill" and "back" in fields else []
    if action not in FAULT_ACTIONS or sorted(fields) != sorted(["rank", "step", *optional]) \
            or len(rest) != 2 + len(optional):
        raise EdgetrainError(usage)
    try:
        rank, step = int(fields["rank"]), int(fields["step"])
        back_s = float(fields["back"]) if optional else None
    except ValueError:
        raise EdgetrainError(usage) from None
    if rank < 0 or step < 0 or (back_s is not None and not back_s >= 0):
        raise EdgetrainError(f"{usage} (rank, step and back >= 0)")
    return FaultSpec(action, rank, step, back_s)


def parse_faults(text: str | None) -> tuple[FaultSpec, ...]:
    """``EDGETRAIN_FAULT=FAULT[;FAULT...]``, each as ``parse_fault`` reads it (empty or unset: none).

    A device can do only one fault at a step, and the launcher starts every lost device again after one
    delay (``ElasticLaunch.back_s``), so two faults of one device at one step, or kills with different
    ``back``, are refused."""
    faults = tuple(parse_fault(part) for part in (text or "").split(";") if part.strip())
    where = [(f.rank, f.step) for f in faults]
    if len(set(where)) < len(where):
        raise EdgetrainError(f"{FAULT_ENV}={text!r} gives one device two faults at one step; keep one of them")
    if len({f.back_s for f in faults if f.back_s is not None}) > 1:
        raise EdgetrainError(f"{FAULT_ENV}={text!r} brings killed devices back after different delays; "
                             f"give every kill the same :back=SECONDS")
    return faults


def back_after_s(faults: tuple[FaultSpec, ...]) -> float | None:
    """How long after a device is lost the launcher starts it again (None: never); one value, see above."""
    return next((f.back_s for f in faults if f.back_s is not None), None)


@dataclass(frozen=True)
class LaunchSpec:
    """How this process was started: what the launcher reads from its environment (``launch_spec``) and hands
    to ``config.resolve``, which reads no environment of its own."""

    torchrun: bool = False               # started by torchrun (WORLD_SIZE set): it, not the config, counts devices
    faults: tuple[FaultSpec, ...] = ()   # EDGETRAIN_FAULT


def launch_spec(environ: Mapping[str, str]) -> LaunchSpec:
    """The ``LaunchSpec`` of a process whose environment is ``environ`` (``os.environ``, for the launcher)."""
    return LaunchSpec("WORLD_SIZE" in environ, parse_faults(environ.get(FAULT_ENV)))


# ---------------------------------------------------------------- --dp

DP_LEVELS = ("sample", "device")
DP_DEFAULT_DELTA = 1e-5
DP_USAGE = ("--dp clip=C,epsilon=E or clip=C,noise=SIGMA[,delta=D][,level=sample|device], e.g. --dp clip=1.0,"
            "epsilon=8 (the noise derived for the run) or --dp clip=1.0,noise=1.1")


@dataclass(frozen=True)
class DPSpec:
    """``--dp``: differential privacy (privacy/dp.py). ``level`` ``sample``: DP-SGD, each sample's gradient
    clipped to ``clip`` and Gaussian noise of ``noise`` x ``clip`` added to each step's sum; ``device``:
    DP-FedAvg, each device's round update clipped to ``clip`` and the noise added once to the round's sum.
    Exactly one of ``epsilon`` (the target: the noise multiplier is derived for the run) and ``noise`` (the
    multiplier) is set; ``delta`` is the guarantee's delta."""

    clip: float
    epsilon: float | None = None
    noise: float | None = None
    delta: float = DP_DEFAULT_DELTA
    level: str = "sample"
    text: str = ""

    @property
    def per_sample(self) -> bool:
        return self.level == "sample"


def parse_dp(text: str | None) -> DPSpec | None:
    """``off`` (or None) -> None; else ``clip=C`` and ``epsilon=E`` or ``noise=SIGMA``, optionally ``delta=D`` and
    ``level=sample|device``, comma- or colon-separated."""
    value = str(text if text is not None else "off").strip().lower()
    if value in ("off", "none", "no", "false", ""):
        return None
    fields: dict[str, str] = {}
    for token in re.split(r"[,:]", value):
        key, eq, number = token.strip().partition("=")
        if not eq or key not in ("clip", "epsilon", "noise", "delta", "level") or key in fields:
            raise EdgetrainError(f"--dp {text!r}: {'repeated' if key in fields else 'unknown'} option {token!r}; "
                                 f"write {DP_USAGE}")
        fields[key] = number.strip()
    level = fields.pop("level", "sample")
    if level not in DP_LEVELS:
        raise EdgetrainError(f"--dp level={level} is neither sample (DP-SGD) nor device (DP-FedAvg); e.g. --dp "
                             "level=device,clip=0.5,noise=1.0 with --sync fedavg:E")
    numbers = {k: _dp_number(k, v, text) for k, v in fields.items()}
    if "clip" not in numbers or ("epsilon" in numbers) == ("noise" in numbers):
        raise EdgetrainError(f"--dp {text!r} needs a clipping norm and exactly one of epsilon= (a target) and noise= "
                             f"(a noise multiplier); write {DP_USAGE}")
    if numbers["clip"] <= 0 or numbers.get("epsilon", 1.0) <= 0 or numbers.get("noise", 1.0) < 0 \
            or not 0 < numbers.get("delta", DP_DEFAULT_DELTA) < 1:
        raise EdgetrainError(f"--dp {text!r} is out of range: clip > 0, epsilon > 0, noise >= 0 and delta in (0, 1); "
                             f"e.g. --dp clip=1.0,epsilon=8")
    return DPSpec(numbers["clip"], numbers.get("epsilon"), numbers.get("noise"),
                  numbers.get("delta", DP_DEFAULT_DELTA), level, value)


def _dp_number(key: str, value: str, text: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise EdgetrainError(f"--dp {key}= needs a finite number, got {value!r} in {text!r}; write {DP_USAGE}")
    return number


# ---------------------------------------------------------------- dedup

# ``--dedup``: a perceptual hash of HASH_BITS bits per image (data/dedup.py); images whose hashes differ in at
# most ``threshold`` bits are near duplicates. Half the bits is what unrelated images differ by on average.
DEDUP_HASH_BITS = 144
DEDUP_DEFAULT_THRESHOLD = 36
DEDUP_MAX_THRESHOLD = DEDUP_HASH_BITS // 2


@dataclass(frozen=True)
class DedupSpec:
    """``--dedup``: drop training images within ``threshold`` bits (Hamming) of an earlier image's hash."""

    threshold: int = DEDUP_DEFAULT_THRESHOLD


def parse_dedup(text: str | int | None) -> DedupSpec | None:
    """``off`` (or None) -> None; ``on`` -> the default threshold; ``N`` -> at most N differing bits."""
    value = str(text if text is not None else "off").strip().lower()
    if value in ("off", "none", "false", "no"):
        return None
    if value in ("on", "true", "yes"):
        return DedupSpec()
    if not value.isdigit() or int(value) > DEDUP_MAX_THRESHOLD:
        raise EdgetrainError(f"dedup {text!r} is not off, on or a Hamming distance 0..{DEDUP_MAX_THRESHOLD} (bits of "
                             f"the {DEDUP_HASH_BITS}-bit image hash); e.g. --dedup on (= {DEDUP_DEFAULT_THRESHOLD})")
    return DedupSpec(int(value))


# ---------------------------------------------------------------- --local-batch

# The nominal input shape (channels, height, width) and classes of the built-in image sets, known without
# reading them: benches feed synthetic tensors of that shape, pre-launch checks size a split with it.
DATASET_SHAPES: dict[str, tuple[tuple[int, int, int], int]] = {
    "cifar10": ((3, 32, 32), 10),
    "synthetic": ((3, 32, 32), 10),
    "digits": ((1, 8, 8), 10),
}


def dataset_shape(dataset: str) -> tuple[tuple[int, int, int], int]:
    try:
        return DATASET_SHAPES[dataset]
    except KeyError:
        raise EdgetrainError(f"unknown dataset {dataset!r}; choose one of {sorted(DATASET_SHAPES)}") from None


LOCAL_BATCH_RULES = ("even", "balanced")


def parse_local_batch(text: str, batch_size: int | None = None) -> str | tuple[int, ...]:
    """``even`` or ``balanced`` (split by the devices' speed), else every device's batch (``16,16,32``), which
    must sum to ``batch_size`` when it is given."""
    if text in LOCAL_BATCH_RULES:
        return text
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise EdgetrainError(f"config key 'local_batch' must be even, balanced or a list like 16,16,32, "
                             f"not {text!r}") from None
    if any(s < 1 for s in sizes):
        raise EdgetrainError(f"config key 'local_batch' needs every device's batch >= 1, not {text!r}")
    if batch_size is not None and sum(sizes) != batch_size:
        raise EdgetrainError(f"config key 'local_batch' {text} sums to {sum(sizes)}, "
                             f"but batch_size is {batch_size}; make them agree")
    return sizes


# ---------------------------------------------------------------- the run

@dataclass(frozen=True)
class CheckpointSpec:
    """``--checkpoint-every N``, ``--keep-checkpoints K``, ``--resume RUN_DIR`` (train/checkpoint.py)."""

    every_steps: int | None = None   # None: no checkpoints every N steps
    keep: int = 2                    # the newest K checkpoints stay; older ones are removed
    resume_dir: str | None = None    # the run directory to continue, None for a new run
    every_s: float | None = None     # also (or only) every S seconds of rank 0's wall time

    @property
    def enabled(self) -> bool:
        """Checkpoints are written during the run (and SIGTERM stops with one)."""
        return self.every_steps is not None or self.every_s is not None


@dataclass(frozen=True)
class RunSpec:
    """Everything below the config needs to know about a run, parsed and checked (``config.resolve``).

    Refused there, each with the fix, by the kinds' own checks (``edgetrain.kinds``) and those of the run as
    a whole: compressors a sync mode cannot carry (``kinds.check_compatible``); ``batchnorm: sync`` with a mode other
    than ``sync``; DGC with optimizer momentum (applied twice); with
    ``strategy: tiled`` any ``compress``, ``sync`` or ``link`` (tiled training
    exchanges halos, feature maps and gradients uncompressed and unemulated,
    step by step); with ``strategy: fsdp`` or ``pipeline`` without replicas a ``compress`` or ``sync``
    (PyTorch's own collectives, counted but not compressed), ``link_mode: enforced`` with
    ``pipeline``, a ``partition`` with ``pipeline``; ``pipeline_replicas`` D > 1 (hybrid) and
    ``fsdp_replicas`` R > 1 take ``sync`` (gradients every step) or ``local:H`` / ``diloco:H`` (DiLoCo's
    outer step) between the replicas and a ``compress`` (PowerSGD excepted), and refuse other sync modes
    and devices that are not a multiple of D (R); a D that does not divide the batch and micro-batches
    that do not divide B / D;
    ``grid`` or ``groups`` without ``strategy: tiled``;
    ``partition`` with ``strategy: tiled`` (every device reads the whole
    batch); ``sync: fedavg`` without a ``partition`` (federated devices train on
    their own data) nor a cluster file (whose devices' ``data`` the launcher
    checks: data/device_data.py); ``server_opt`` or ``participation`` without ``sync: fedavg``;
    ``round_deadline`` without ``sync: local`` or ``fedavg`` (no rounds to bound);
    ``tensorboard`` where the tensorboard package is not installed; ``secure_aggregation`` with what it cannot mask
    (``kinds.check_secure_aggregation``); ``dp`` with strategy tiled, fsdp or pipeline
    (a sample's gradient is never whole on one device), with ``sync: sync`` and a compressor (the noise is
    added once to the plain sum), at level device without a sync mode of ``device_dp`` (fedavg) or with
    SCAFFOLD, weights or a compressor, and with ``min_devices``.
    """

    compress: CompressSpec
    sync: SyncSpec
    link: Link | None            # every device's link unless the cluster file gives its own; None: not emulated
    link_mode: str               # LINK_MODES
    strategy: str                # a strategy's name (edgetrain.kinds)
    tiling: TilingSpec | None    # set exactly when strategy is tiled
    timeout_s: float             # wait for a peer (rendezvous and every collective) at most this long
    seed: int
    accelerator: str             # auto, cpu or cuda; passed through to the training loop
    batchnorm: str = "local"     # local or sync (DDP's broadcast of buffers is off with sync)
    pipeline: PipelineSpec | None = None  # set exactly when strategy is pipeline
    fsdp_replicas: int = 1       # --fsdp-replicas R: R sharded replicas (devices = shards x R), exchanging as --sync
    partition: PartitionSpec = PartitionSpec()     # each device's own data, or one shared dataset
    server_opt: ServerOptSpec = ServerOptSpec()    # fedavg rounds: the server's step
    participation: float = 1.0   # fedavg rounds: fraction of devices sampled per round
    round_deadline: DeadlineSpec | None = None  # local / fedavg rounds: leave late devices out (None: off)
    checkpoint: CheckpointSpec = CheckpointSpec()
    faults: tuple[FaultSpec, ...] = ()  # from EDGETRAIN_FAULT, for tests and chaos runs
    torchrun: bool = False       # started by torchrun (LaunchSpec): it, not the config, counts the devices
    min_devices: int | None = None  # elastic membership (train/elastic.py) below all devices; None: fail-stop
    tensorboard: bool = False    # rank 0 also writes TensorBoard event files (train.tensorboard_log)
    dedup: DedupSpec | None = None  # drop near-duplicate training images first (data/dedup.py)
    task: str | None = None      # the task trained: --task, else the one the dataset implies (edgetrain.kinds);
                                 # a task passed from Python as ``module:QualName``. Set by ``config.resolve``
    local_batch: str | tuple[int, ...] = "even"   # --local-batch: even, balanced or every device's batch
    secure_aggregation: bool = False  # mask every device's update in the sums of --sync (comm/secagg.py)
    dp: DPSpec | None = None     # --dp: differential privacy (DP-SGD or DP-FedAvg); None: off
