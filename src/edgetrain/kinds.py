"""Every strategy, sync mode, compressor, task, server optimiser and fleet availability, declared once: one descriptor each
(docs/design/kinds.md).

A descriptor holds what the rest of edgetrain asks of a kind: its name and
how it is written, its parser (into the frozen specs of ``edgetrain.spec``),
its capabilities, its own refusals of a run (``config.resolve`` runs them),
where the code that runs it lives and where its planner model lives, or the
one line that refuses to plan it. Those places are ``"module:attribute"``
strings, imported on first use, so this module stays torch-free and at the
bottom; nothing else names a kind to decide what to do with it, and the runtime classes take their names
from their descriptors (``named_by_kind``).
Declaring a descriptor registers it in ``spec.KINDS``, where the parsers look
names up; ``edgetrain``'s package ``__init__`` imports this module, so every
kind is declared before anything is parsed.
"""
from __future__ import annotations

import difflib
import importlib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from edgetrain.errors import EdgetrainError
from edgetrain.spec import (KINDS, CompressSpec, DPSpec, LaunchSpec, Link, PartitionSpec, PipelineSpec, SyncSpec,
                            _float, _int, parse_duration, parse_stages, parse_tiling)


@dataclass(frozen=True)
class Draft:
    """A run being resolved (``config.resolve``): its config and the options parsed so far, what the kinds'
    refusals look at. ``cfg`` is a ``config.TrainConfig`` (a layer above, so not named here)."""

    cfg: Any
    compress: CompressSpec
    sync: SyncSpec
    partition: PartitionSpec
    link: Link | None
    launch: LaunchSpec
    task: TaskKind | None = None   # the run's task (None: one passed from Python, which has no descriptor)
    dp: DPSpec | None = None       # --dp (None: off)

    @property
    def strategy(self) -> StrategyKind:
        return strategy_kind(self.cfg.strategy)

    @property
    def devices_known(self) -> bool:
        """The config gives the number of devices (not a cluster file, whose devices count after planning, nor
        torchrun, which counts them itself): checks against it can be made before any device starts."""
        return not self.cfg.cluster and not self.launch.torchrun

    def changed(self, key: str) -> bool:
        """Whether config key ``key`` is set to other than its default."""
        default = type(self.cfg).__dataclass_fields__[key].default
        value = getattr(self.cfg, key)
        return (str(value).strip().lower() != str(default)) if isinstance(value, str) else value != default


Check = Callable[[Draft], None]


@dataclass(frozen=True, kw_only=True)
class Kind:
    """What every kind declares. ``runtime`` and ``planner`` are ``"module:attribute"``, loaded on first use."""

    family: ClassVar[str]

    name: str
    usage: str                          # how it is written on the command line, e.g. ``local:H``
    summary: str                        # one line for the reference page
    runtime: str                        # what runs it
    planner: str | None = None          # its planner model (``edgetrain plan``)
    unplanned: str | None = None        # or the line refusing to plan it: the problem and the fix
    checks: tuple[Check, ...] = ()      # its refusals of a whole run, each one line with the fix
    aliases: tuple[str, ...] = ()
    # a concrete use, as written after its flag, then any options it needs on 2 devices (``local:2``, ``tiled
    # --grid 1x2``); left out: its usage, if nothing in it is to be filled in (tests/test_combinations.py)
    example: str = ""

    def __post_init__(self) -> None:
        if (self.planner is None) == (self.unplanned is None):
            raise TypeError(f"{self.family} {self.name} needs a planner model or the line refusing to plan it")
        if self.name in KINDS[self.family]:
            raise TypeError(f"{self.family} {self.name} is declared twice")
        KINDS[self.family][self.name] = self

    @property
    def example_spec(self) -> str:
        """``example``, or the usage without its optional parts when that is concrete; "" when neither is."""
        plain = re.sub(r"\[.*?\]", "", self.usage)
        return self.example or ("" if any(c.isupper() for c in plain) else plain)

    def load_runtime(self) -> Any:
        return _load(self.runtime)

    def check_planned(self) -> None:
        """A kind without a planner model is refused here, in its own line, never planned as another."""
        if self.planner is None:
            raise EdgetrainError(self.unplanned)

    def load_planner(self) -> Any:
        """The planner model (imports it: torch, for most); refused as ``check_planned`` says."""
        self.check_planned()
        return _load(self.planner)

    def check(self, draft: Draft) -> None:
        for check in self.checks:
            check(draft)

    def runtime_attributes(self) -> dict[str, Any]:
        """What its runtime class reads of it, set on the class by ``named_by_kind``."""
        return {"name": self.name, "kind": self}


def _load(where: str) -> Any:
    module, _, attribute = where.partition(":")
    return getattr(importlib.import_module(module), attribute)


# ---------------------------------------------------------------- compressors

@dataclass(frozen=True, kw_only=True)
class CompressKind(Kind):
    """``--compress``: ``runtime`` builds ``(Compressor, memory)`` from ``(spec, link, seed, rank)``, or, for a
    ``hook``, the DDP ``(state, hook)`` from ``(spec, emulator, group)``; ``planner`` gives its traffic
    (``plan/exchanges.py``)."""

    family: ClassVar[str] = "compress"
    options: frozenset[str] = frozenset()
    check_arguments: Callable[[float | None, dict, str], None]
    plain: bool = False        # sends fp32 as plain DDP does: nothing compressed
    hook: bool = False         # a DDP gradient hook of its own, not a Compressor: synchronous steps only
    fixed_size: bool = True    # the same bytes every exchange, whatever the values
    # what a server without the devices' own state lacks to decode its payload ("": a server decodes it)
    server_cannot_decode: str = ""
    # why --secure-aggregation cannot mask its payload ("": fp32 values at coordinates every device shares)
    unmasked: str = ""


def _no_number(name: str) -> Callable[[float | None, dict, str], None]:
    def check(arg, options, text):
        if arg is not None:
            raise EdgetrainError(f"{name} takes no number, got {text!r}")
    return check


def _fraction(name: str) -> Callable[[float | None, dict, str], None]:
    def check(arg, options, text):
        if arg is None:
            raise EdgetrainError(f"{name} needs the fraction of entries to keep, e.g. --compress {name}:0.01")
        if not 0 < arg <= 1:
            raise EdgetrainError(f"{name} ratio must be a fraction in (0, 1], got {arg:g} in --compress {text!r}; "
                                 f"e.g. --compress {name}:0.01 keeps 1% of the entries")
    return check


def _whole_steps(key: str, options: dict, text: str, example: str) -> None:
    if key in options and not (options[key] == int(options[key]) and options[key] >= 0):
        raise EdgetrainError(f"{key}= must be a whole number of steps >= 0, got {options[key]:g} in --compress "
                             f"{text!r}; e.g. --compress {example}")


def _check_topk(arg, options, text):
    _fraction("topk")(arg, options, text)
    if "momentum" in options and not 0 <= options["momentum"] < 1:
        raise EdgetrainError(f"momentum= must be in [0, 1), got {options['momentum']:g} in --compress {text!r}; "
                             "e.g. --compress topk:0.001:dgc:momentum=0.9")
    if "momentum" in options and "dgc" not in options:
        raise EdgetrainError("momentum= applies to DGC momentum correction: add :dgc, e.g. topk:0.001:dgc:momentum=0.9")
    if "dgc" in options and "noef" in options:
        raise EdgetrainError("dgc keeps its own residual; it cannot be combined with noef")
    if "bits" in options and not (options["bits"] == int(options["bits"]) and 1 <= options["bits"] <= 8):
        raise EdgetrainError(f"bits= is the bits of a kept value, a whole number from 1 to 8, got {options['bits']:g} "
                             f"in --compress {text!r}; e.g. --compress topk:0.01:bits=2")
    if "bits" in options and "compact" in options:
        raise EdgetrainError("bits= already sends 16-bit positions as compact does, with B-bit values: drop :compact")
    _whole_steps("warmup", options, text, "topk:0.001:dgc:warmup=1000")


def _check_qsgd(arg, options, text):
    if arg is not None and not (arg == int(arg) and 1 <= arg <= 127):
        raise EdgetrainError(f"qsgd levels must be an integer in [1, 127], got {arg:g} in --compress {text!r}; "
                             "e.g. --compress qsgd:127")


def _check_quant(arg, options, text):
    if arg is not None and not (arg == int(arg) and 2 <= arg <= 8):
        raise EdgetrainError(f"quant takes a whole number of bits from 2 to 8, got {arg:g} in --compress {text!r}; "
                             "e.g. --compress quant:4")


def _check_powersgd(arg, options, text):
    if arg is not None and not (arg == int(arg) and arg >= 1):
        raise EdgetrainError(f"powersgd rank must be an integer >= 1, got {arg:g} in --compress {text!r}; "
                             "e.g. --compress powersgd:2")
    _whole_steps("start", options, text, "powersgd:2:start=10")


def _check_threshold(arg, options, text):
    if arg is not None and not arg > 0:
        raise EdgetrainError(f"threshold tau must be positive, got {arg:g} in --compress {text!r}; "
                             "e.g. --compress threshold:0.001")


def _dgc_without_optimizer_momentum(d: Draft) -> None:
    if d.compress.is_dgc and d.cfg.optimizer == "sgd" and d.cfg.momentum > 0:
        raise EdgetrainError(f"--compress {d.compress.text} applies momentum inside the hook (DGC momentum "
                             "correction); set --momentum 0 so that it is not applied twice")


_PAYLOAD = "edgetrain.plan.exchanges:encoded_buckets"   # the real compressor's payload, encoded and measured
_C = "edgetrain.comm.compress."

CompressKind(name="none", usage="none", aliases=("fp32",), summary="fp32 all-reduce, as plain DDP",
             runtime=_C + "fp32:build", planner=_PAYLOAD, check_arguments=_no_number("none"), plain=True)
_HALF = "sends 16-bit floats, and masked fixed point takes 32 bits an entry, fp32's size: nothing would be saved"
_QUANTISED = "quantises each device's values at a scale of its own, so the devices' integers do not add up to the " \
             "sum of their updates"
CompressKind(name="fp16", usage="fp16", summary="half-precision (IEEE fp16) all-reduce",
             runtime=_C + "cast:build_fp16", planner=_PAYLOAD, check_arguments=_no_number("fp16"), unmasked=_HALF)
CompressKind(name="bf16", usage="bf16", summary="half-precision (bfloat16) all-reduce",
             runtime=_C + "cast:build_bf16", planner=_PAYLOAD, check_arguments=_no_number("bf16"), unmasked=_HALF)
CompressKind(name="int8", usage="int8", summary="linear 8-bit quantization",
             runtime=_C + "quantize:build_int8", planner=_PAYLOAD, check_arguments=_no_number("int8"),
             unmasked=_QUANTISED)
CompressKind(name="qsgd", usage="qsgd[:LEVELS]", summary="stochastic quantization, 1..127 levels (default 127)",
             runtime=_C + "quantize:build_qsgd", planner=_PAYLOAD, check_arguments=_check_qsgd, unmasked=_QUANTISED)
CompressKind(name="quant", usage="quant[:BITS]",
             summary="linear BITS-bit quantization (2..8, default 4), packed, with error feedback; noef",
             runtime=_C + "quantize:build_quant", planner=_PAYLOAD, check_arguments=_check_quant,
             options=frozenset({"noef"}), unmasked=_QUANTISED)
CompressKind(name="topk", usage="topk:RATIO", example="topk:0.1",
             summary="top-k with error feedback; options dgc (momentum correction, momentum=0.9), warmup=STEPS "
                     "(DGC's sparsity ramp), layerwise (a budget per layer), compact (fp16 value + 16-bit index "
                     "gap), bits=B (B-bit values and 16-bit gaps: SparseLoCo's 2 bits), noef",
             runtime=_C + "topk:build", planner=_PAYLOAD, check_arguments=_check_topk,
             options=frozenset({"dgc", "momentum", "warmup", "noef", "layerwise", "compact", "bits"}),
             checks=(_dgc_without_optimizer_momentum,),
             unmasked="keeps different coordinates on each device, so masked values would not line up in a sum")
CompressKind(name="randk", usage="randk:RATIO", example="randk:0.1",
             summary="random-k (shared seed) with error feedback; noef",
             runtime=_C + "randk:build", planner=_PAYLOAD, check_arguments=_fraction("randk"),
             options=frozenset({"noef"}), server_cannot_decode="its shared random indices")
CompressKind(name="sign", usage="sign", summary="EF-signSGD (scaled sign, error feedback); sign:vote for signSGD "
                                               "majority vote",
             runtime=_C + "sign:build", planner=_PAYLOAD, check_arguments=_no_number("sign"),
             options=frozenset({"vote", "noef"}), unmasked=_QUANTISED)
CompressKind(name="powersgd", usage="powersgd[:RANK]",
             summary="PyTorch's PowerSGD hook (default rank 2); start=ITER vanilla all-reduce iterations first "
                     "(default 10)",
             runtime=_C + "powersgd:build_hook", planner="edgetrain.plan.exchanges:powersgd_buckets",
             check_arguments=_check_powersgd, options=frozenset({"start"}), hook=True,
             server_cannot_decode="its low-rank state (a DDP hook)",
             unmasked="is a DDP hook of its own whose low-rank factors are computed from each device's gradients "
                      "in the clear")
CompressKind(name="threshold", usage="threshold[:TAU]",
             summary="Strom's two-step threshold method, Wt derived from the device's link (default tau 0.001); "
                     "entries decode to their layer's mean, strom to +-Wt",
             runtime=_C + "threshold:build", check_arguments=_check_threshold, options=frozenset({"strom"}),
             fixed_size=False,
             unmasked="sends a different set and number of entries from each device, which masks cannot line up",
             unplanned="--compress threshold sends as many entries as crossed the threshold, which depends on the "
                       "gradients' values: the planner cannot predict it; measure it with edgetrain train, or plan "
                       "with topk:RATIO at the density you expect")


# ---------------------------------------------------------------- sync modes

@dataclass(frozen=True, kw_only=True)
class SyncKind(Kind):
    """``--sync``: ``runtime`` builds the ``SyncMode`` from a ``comm.setup.SyncSetup``; ``planner`` gives one
    device's ``Traffic`` (``plan/exchanges.py``), whose ``timing`` says how ``plan/model.py`` and
    ``plan/simulation.py`` turn it into step times: ``lockstep`` (every step waits for the exchange),
    ``periodic`` (an exchange every ``period`` steps) or ``bounded`` (background rounds, staleness bound)."""

    family: ClassVar[str] = "sync"
    parse: Callable[[list[str], str], SyncSpec]
    accepts: Callable[[SyncSpec, CompressSpec], None]   # refuses the compressors it cannot carry
    timing: str
    rounds: bool = False            # rounds of local steps, which --round-deadline can bound
    elastic: bool = False           # survives a device leaving (--min-devices)
    needs_partition: bool = False   # trains each device on its own data
    options: tuple[str, ...] = ()   # config keys only this mode takes
    options_hint: str = ""
    # why --secure-aggregation cannot mask its exchanges ("": each is one sum of every member's dense update)
    unmasked: str = ""
    device_dp: bool = False         # rounds whose device updates --dp level=device clips and noises (DP-FedAvg)

    @property
    def lockstep(self) -> bool:
        return self.timing == "lockstep"


def _parse_sync(rest: list[str], text: str) -> SyncSpec:
    if rest:
        raise EdgetrainError(f"--sync sync takes no arguments, got {text!r}")
    return SyncSpec("sync", text=text)


def _number(rest: list[str], mode: str, text: str) -> int | None:
    return _int(rest[0], mode, text) if rest else None


def _period(rest: list[str], mode: str, text: str) -> int:
    """The H of ``local:H`` / ``diloco:H`` / ``streaming:H``: local steps between two exchanges."""
    name = "local SGD" if mode == "local" else mode
    if not rest:
        raise EdgetrainError(f"{name} needs the number of local steps between averages, e.g. --sync {mode}:8")
    number = _int(rest[0], mode, text)
    if number < 1:
        raise EdgetrainError(f"{name} period H must be >= 1 step, got {number} in --sync {text!r}; "
                             f"e.g. --sync {mode}:8 averages every 8 steps ({mode}:1 averages every step)")
    return number


def _outer(key: str, value: str, opt: str, text: str, values: dict) -> bool:
    """Read an outer-step option (``lr=``, ``momentum=``) into ``values``; False if ``key`` is none."""
    if key not in ("lr", "momentum"):
        return False
    values[key] = _float(value, opt, text)
    return True


def _check_outer(values: dict, text: str, example: str) -> None:
    lr, momentum = values["lr"], values["momentum"]
    if not (lr > 0 and math.isfinite(lr)) or not 0 <= momentum < 1:
        raise EdgetrainError(f"outer lr must be > 0 and momentum in [0, 1), got lr={lr:g}, momentum={momentum:g} "
                             f"in --sync {text!r}; e.g. --sync {example}:lr=0.7:momentum=0.9 (the defaults)")


def _parse_local(rest: list[str], text: str) -> SyncSpec:
    """``local:H[:nesterov][:lr=][:momentum=]``; its alias ``diloco:H[:lr=][:momentum=]`` is the same with
    ``nesterov``, spelt as the papers name it."""
    mode = text.split(":")[0]
    nesterov = mode == "diloco"
    number = _period(rest, mode, text)
    values = {"lr": 0.7, "momentum": 0.9}
    for opt in rest[1:]:
        key, eq, value = opt.partition("=")
        if opt == "nesterov" and mode == "local":
            nesterov = True
        elif not (eq and _outer(key, value, opt, text, values)):
            allowed = "nesterov, lr=, momentum=" if mode == "local" else "lr=, momentum="
            raise EdgetrainError(f"unknown {mode} option {opt!r} in {text!r}; options: {allowed}")
    if (values["lr"], values["momentum"]) != (0.7, 0.9) and not nesterov:
        raise EdgetrainError("lr= and momentum= set the outer Nesterov step: add :nesterov, "
                             "e.g. --sync local:8:nesterov:lr=0.7 (or write diloco:8:lr=0.7)")
    _check_outer(values, text, f"{mode}:{number}" + (":nesterov" if mode == "local" else ""))
    return SyncSpec("local", period=number, nesterov=nesterov, outer_lr=values["lr"],
                    outer_momentum=values["momentum"], text=text)


def _parse_streaming(rest: list[str], text: str) -> SyncSpec:
    """``streaming:H[:fragments=F][:overlap=T][:mix=A][:lr=][:momentum=]`` (comm/streaming.py)."""
    number = _period(rest, "streaming", text)
    values = {"lr": 0.7, "momentum": 0.9, "fragments": 2.0, "overlap": 1.0, "mix": 0.5}
    for opt in rest[1:]:
        key, eq, value = opt.partition("=")
        if eq and key in ("fragments", "overlap", "mix"):
            values[key] = _float(value, opt, text)
        elif not (eq and _outer(key, value, opt, text, values)):
            raise EdgetrainError(f"unknown streaming option {opt!r} in {text!r}; options: fragments=, overlap=, "
                                 "mix=, lr=, momentum=")
    _check_outer(values, text, f"streaming:{number}")
    fragments, overlap = values["fragments"], values["overlap"]
    if fragments != int(fragments) or not 1 <= fragments <= number:
        raise EdgetrainError(f"streaming fragments=F must be a whole number from 1 to H={number} (each fragment "
                             f"is synchronised at its own step of the H), got {fragments:g} in --sync {text!r}; "
                             f"e.g. --sync streaming:{number}:fragments={min(2, number)}")
    if overlap != int(overlap) or not 0 <= overlap < number:
        raise EdgetrainError(f"streaming overlap=T must be a whole number of steps from 0 to H-1={number - 1} (a "
                             f"fragment's exchange must land before its next one starts), got {overlap:g} in --sync "
                             f"{text!r}; e.g. --sync streaming:{number}:overlap={min(1, number - 1)}")
    if not 0 <= values["mix"] <= 1:
        raise EdgetrainError(f"streaming mix=A must be in [0, 1] (the share of the local fragment kept when the "
                             f"averaged one lands), got {values['mix']:g} in --sync {text!r}; e.g. --sync "
                             f"streaming:{number}:mix=0.5")
    return SyncSpec("streaming", period=number, nesterov=True, outer_lr=values["lr"],
                    outer_momentum=values["momentum"], text=text, fragments=int(fragments), overlap=int(overlap),
                    mix=values["mix"])


def _one_number_at_most(rest: list[str], mode: str, text: str) -> int | None:
    if len(rest) > 1:
        raise EdgetrainError(f"--sync {mode} takes one number at most, got {text!r}")
    return _number(rest, mode, text)


def _parse_async(rest: list[str], text: str) -> SyncSpec:
    number = _one_number_at_most(rest, "async", text)
    if number is None:
        raise EdgetrainError("async needs a staleness bound in steps, e.g. --sync async:4")
    if number < 1:
        raise EdgetrainError(f"async staleness bound must be >= 1 step, got {number} in --sync {text!r}; "
                             "e.g. --sync async:4 (a bound of 0 is synchronous training: use --sync sync)")
    return SyncSpec("async", staleness=number, text=text)


def _parse_gossip(rest: list[str], text: str) -> SyncSpec:
    number = _one_number_at_most(rest, "gossip", text)
    period = 1 if number is None else number
    if period < 1:
        raise EdgetrainError(f"gossip period must be >= 1 step, got {period} in --sync {text!r}; e.g. --sync gossip:1 "
                             "(every step)")
    return SyncSpec("gossip", period=period, text=text)


def _parse_fedavg(rest: list[str], text: str) -> SyncSpec:
    fix = "e.g. --sync fedavg:1 (one local epoch per round) or fedavg:steps=20"
    if not rest:
        raise EdgetrainError(f"fedavg needs the local work per round; {fix}")
    epochs, period, mu, flags = 0, 0, None, set()
    for i, token in enumerate(rest):
        key, eq, value = token.partition("=")
        if i == 0 and not eq:
            epochs = _int(token, "fedavg", text)
        elif i == 0 and key == "steps":
            period = _int(value, "fedavg", text)
        elif i > 0 and key == "prox" and eq:
            mu = _float(value, token, text)
        elif i > 0 and token in ("scaffold", "weighted", "reset"):
            flags.add(token)
        else:
            raise EdgetrainError(f"unknown fedavg option {token!r} in --sync {text!r}; write fedavg:E or "
                                 "fedavg:steps=H, then optionally :prox=MU, :scaffold, :weighted and :reset")
    if max(epochs, period) < 1:
        raise EdgetrainError(f"fedavg needs at least one local epoch or step per round, got {text!r}; {fix}")
    if mu is not None and not (mu >= 0 and math.isfinite(mu)):
        raise EdgetrainError(f"fedavg prox=MU must be a finite number >= 0, got {mu:g} in --sync {text!r}; "
                             "e.g. --sync fedavg:1:prox=0.01")
    return SyncSpec("fedavg", period=period, local_epochs=epochs, prox_mu=mu, scaffold="scaffold" in flags,
                    weighted="weighted" in flags, reset="reset" in flags, text=text)


def _any_compressor(sync: SyncSpec, compress: CompressSpec) -> None:
    """Synchronous steps carry every compressor, PowerSGD's hook included."""


def _model_deltas(sync: SyncSpec, compress: CompressSpec) -> None:
    """Averages of model deltas: a Compressor, not a gradient hook, and no gradient momentum correction."""
    if compress.kind.hook:
        raise EdgetrainError(f"{compress.method} is a DDP gradient hook and works with --sync sync only, not "
                             f"{sync.text!r}; with local/async averaging use topk, randk, sign, int8, qsgd, fp16 or "
                             "bf16")
    if compress.is_dgc:
        raise EdgetrainError(f"dgc momentum correction applies to gradients (--sync sync), not to the model "
                             f"deltas of {sync.text!r}; drop :dgc")


def _fixed_size_deltas(sync: SyncSpec, compress: CompressSpec) -> None:
    _model_deltas(sync, compress)
    if not compress.kind.fixed_size:
        raise EdgetrainError(f"{compress.method} sends a variable number of entries, which the non-blocking rounds "
                             f"of --sync {sync.mode} cannot carry; use topk, randk, quant or sign with {sync.mode}")


def _uncompressed(sync: SyncSpec, compress: CompressSpec) -> None:
    if not compress.kind.plain:
        raise EdgetrainError(f"gossip averages full models with neighbours and supports --compress none only, "
                             f"not {compress.text!r} (compressed gossip needs CHOCO-SGD, not implemented)")


def check_compatible(sync: SyncSpec, compress: CompressSpec) -> None:
    """Refuse a compressor the sync mode cannot carry, saying why and what works."""
    sync.kind.accepts(sync, compress)


def _own_data(d: Draft) -> None:
    if not d.partition.local and not d.cfg.cluster:  # a cluster file may give devices data (data/device_data.py)
        raise EdgetrainError(f"--sync {d.sync.text} trains each device on its own data, which needs a partition; "
                             "add --partition iid, dirichlet:ALPHA or shards:K")


# --dp (privacy/dp.py): noise added once to a sum protects every device's share only if that share enters the sum
# as it is, its norm bounded by the clipping: a compressor (top-k's choice, a quantiser's rounding, error feedback
# carrying a device's earlier updates into later ones) would leave the devices without noise unprotected.

def _dp_noise_once_on_the_plain_sum(d: Draft) -> None:
    """Synchronous steps: DP-SGD's noise is added once to the global batch's clipped sum (on rank 0)."""
    if d.dp is not None and d.dp.per_sample and not d.compress.kind.plain:
        raise EdgetrainError(f"config key 'dp' {d.dp.text} adds its noise once to the sum of every device's clipped "
                             f"gradients, which --compress {d.compress.text} would change on the devices that add "
                             f"none; use --compress none, or --sync local:H / fedavg:E (each device noises its own "
                             f"steps, and any compressor then only post-processes them)")


def _device_dp_on_plain_updates(d: Draft) -> None:
    """DP-FedAvg: each member's clipped update enters the round's sum as it is, once."""
    if d.dp is None or d.dp.per_sample:
        return
    if not d.compress.kind.plain:
        raise EdgetrainError(f"config key 'dp' {d.dp.text} adds its noise once to the round's sum of clipped "
                             f"updates, which --compress {d.compress.text} would change on the devices that add "
                             f"none; use --compress none")
    if d.sync.scaffold or d.sync.weighted:
        what = "SCAFFOLD's control variates travel unclipped and un-noised" if d.sync.scaffold else \
            "weighting by sample counts scales a device's clipped update past the clipping norm"
        raise EdgetrainError(f"config key 'dp' {d.dp.text} (device level) does not apply to --sync {d.sync.text}: "
                             f"{what}; drop :{'scaffold' if d.sync.scaffold else 'weighted'}")


_T = "edgetrain.plan.exchanges:"
SyncKind(name="sync", usage="sync", summary="synchronous DDP (default); every compressor",
         parse=_parse_sync, accepts=_any_compressor, timing="lockstep", elastic=True,
         checks=(_dp_noise_once_on_the_plain_sum,),
         runtime="edgetrain.comm.sync:build", planner=_T + "synchronous")
SyncKind(name="local", usage="local:H", example="local:2",
         summary="local SGD, average every H steps; local:H:nesterov[:lr=0.7][:momentum=0.9] (or diloco:H[:lr=]"
                 "[:momentum=]) with DiLoCo's outer Nesterov step; every compressor but powersgd and dgc",
         parse=_parse_local, accepts=_model_deltas, timing="periodic", rounds=True, elastic=True, aliases=("diloco",),
         runtime="edgetrain.comm.local_sgd:build", planner=_T + "local_sgd")
SyncKind(name="streaming", usage="streaming:H", example="streaming:2",
         summary="Streaming DiLoCo: the model's fragments (fragments=2) averaged at staggered steps in the "
                 "background, overlap=T steps behind (1), mix=A of the local fragment kept (0.5), lr=, momentum= of "
                 "the outer Nesterov step; async:S's compressors",
         parse=_parse_streaming, accepts=_fixed_size_deltas, timing="background",
         unmasked="averages fragments in background all-reduces that overlap later steps (masking them is not "
                  "implemented)",
         runtime="edgetrain.comm.streaming:build",
         unplanned="the planner does not model --sync streaming (background exchanges of fragments); plan with "
                   "diloco:H for the bytes, or measure with edgetrain train")
SyncKind(name="async", usage="async:S", example="async:1",
         summary="bounded staleness S steps; every fixed-size compressor (not threshold, powersgd, dgc)",
         parse=_parse_async, accepts=_fixed_size_deltas, timing="bounded",
         unmasked="all-reduces in the background under a staleness bound (masking that is not implemented)",
         runtime="edgetrain.comm.asynchronous:build", planner=_T + "bounded_staleness")
SyncKind(name="gossip", usage="gossip",
         summary="ring gossip every H steps (gossip[:H], default 1); --compress none only",
         parse=_parse_gossip, accepts=_uncompressed, timing="periodic",
         unmasked="averages with ring neighbours, not one sum over every device, so pairwise masks would not cancel",
         runtime="edgetrain.comm.gossip:build", planner=_T + "gossip")
SyncKind(name="fedavg", usage="fedavg:E", example="fedavg:steps=2",
         summary="federated rounds of E local epochs (fedavg:steps=H: H steps); :prox=MU (FedProx), :scaffold, "
                 ":weighted (by sample counts), :reset (client optimizer each round); local:H's compressors; needs "
                 "--partition",
         parse=_parse_fedavg, accepts=_model_deltas, timing="periodic", rounds=True, needs_partition=True,
         options=("server_opt", "participation"), options_hint="applies to federated rounds only; add --sync fedavg:E",
         device_dp=True, checks=(_own_data, _device_dp_on_plain_updates), runtime="edgetrain.comm.federated:build",
         planner=_T + "federated")


def check_secure_aggregation(d: Draft) -> None:
    """``--secure-aggregation``'s refusals, from the chosen kinds' capabilities: it masks the sums of every
    member's dense update (``comm/secagg.py``; docs/design/secure-aggregation.md)."""
    flag, cfg = "--secure-aggregation", d.cfg
    maskable = " or ".join(k.usage for k in SYNC_KINDS.values() if not k.unmasked)
    if d.strategy.own_exchanges is not None:
        raise EdgetrainError(f"{flag} masks the sums of --sync, and strategy {cfg.strategy}'s "
                             f"{d.strategy.own_exchanges} are exchanges of its own, sent in the clear; use "
                             f"--strategy ddp or drop {flag}")
    if d.sync.kind.unmasked:
        raise EdgetrainError(f"{flag} cannot mask --sync {d.sync.text}, which {d.sync.kind.unmasked}; use --sync "
                             f"{maskable}, or drop {flag}")
    if d.compress.kind.unmasked:
        raise EdgetrainError(f"{flag} cannot mask --compress {d.compress.text}, which {d.compress.kind.unmasked}; "
                             f"use --compress none or randk:RATIO (coordinates every device shares), or drop {flag}")
    if cfg.batchnorm == "sync":
        raise EdgetrainError(f"{flag} hides each device's update, and --batchnorm sync all-reduces each device's "
                             f"batch statistics in the clear at every forward; use --batchnorm local or a "
                             f"GroupNorm model (small_cnn_gn)")
    sampled = max(1, round(cfg.participation * cfg.devices))
    if d.devices_known and cfg.devices > 1 and "participation" in d.sync.kind.options and sampled < 2:
        raise EdgetrainError(f"{flag} with participation {cfg.participation:g} of {cfg.devices} devices samples one "
                             f"device a round, whose update would be the aggregate itself; sample at least 2 "
                             f"(--participation {2 / cfg.devices:.2g} or more)")


# ---------------------------------------------------------------- strategies

@dataclass(frozen=True, kw_only=True)
class StrategyKind(Kind):
    """``--strategy``: ``runtime`` is its ``train.strategy.Strategy`` subclass; ``planner`` its per-strategy
    prediction ``(inputs, prediction, microbatches, schedule) -> PlanStrategy`` (``plan/strategies.py``)."""

    family: ClassVar[str] = "strategy"
    shards_batch: bool = True        # each device reads its share of the global batch (else the whole batch)
    pooled: bool = False             # each device holds only its part of the model
    elastic: bool = False            # a device may leave and the others go on (--min-devices)
    own_exchanges: str | None = None  # its exchanges are its own (not --sync / --compress): what they are
    options: tuple[str, ...] = ()    # config keys only this strategy takes
    spec: Callable[[Draft], dict] = lambda draft: {}   # the RunSpec fields it parses from its options

    def runtime_attributes(self) -> dict[str, Any]:
        return {**super().runtime_attributes(), "shard_data": self.shards_batch, "pooled": self.pooled}


def _exchanges_of_its_own(d: Draft, between_replicas: bool = False, compress_fix: str = "",
                          sync_fix: str = "") -> None:
    """Options that would change exchanges this strategy does not make are refused, not silently ignored
    (``between_replicas``: its replicas exchange through --compress as --sync says, train/replicas.py)."""
    for key, text, ignored in (("compress", d.compress.text, not d.compress.kind.plain and not between_replicas),
                               ("sync", d.sync.text, not d.sync.kind.lockstep and not between_replicas)):
        if ignored:
            fix = {"compress": compress_fix, "sync": sync_fix}[key] or "; drop --" + key
            raise EdgetrainError(f"config key '{key}' {text} does not apply to strategy {d.cfg.strategy}, whose "
                                 f"{d.strategy.own_exchanges} are uncompressed and synchronous{fix} "
                                 f"or use --strategy ddp")


def _tiled_checks(d: Draft) -> None:
    _exchanges_of_its_own(d)
    if d.link is not None:
        raise EdgetrainError(f"config key 'link' {d.cfg.link} does not apply to strategy tiled, which does not "
                             f"emulate links (its exchanges run on the host's network); drop --link or use "
                             f"--strategy ddp")


def _tiling(d: Draft) -> dict:
    cfg = d.cfg
    tiling = parse_tiling(cfg.grid, cfg.groups)
    if d.devices_known and cfg.devices != tiling.devices:
        raise EdgetrainError(f"config key 'devices' is {cfg.devices} but grid {cfg.grid} needs {tiling.devices} "
                             f"devices, one per tile; set --devices {tiling.devices}")
    return {"tiling": tiling}


# Between the replicas of a pooled strategy (train/replicas.py): gradients every step, or DiLoCo's outer step.
_BETWEEN_REPLICAS = ("sync", "local")


def _between_replicas(d: Draft, key: str, what: str, alone: str) -> None:
    """With replicas (config key ``key`` > 1) the devices holding the same ``what`` in different replicas exchange
    through --compress, every step (sync) or every H steps (local:H / diloco:H); without (``alone``: what the run
    then is), nothing crosses."""
    replicas = getattr(d.cfg, key) > 1
    flag = "--" + key.replace("_", "-")
    add = f"add {flag} D for D replicas whose devices holding the same {what} exchange"
    _exchanges_of_its_own(d, between_replicas=replicas,
                          compress_fix=f" ({alone}: nothing to all-reduce); {add} compressed, drop --compress",
                          sync_fix=f" ({alone}: nothing between replicas to synchronise); {add} as --sync says "
                                   f"(sync or diloco:H), drop --sync")
    if not replicas:
        return
    if d.sync.mode not in _BETWEEN_REPLICAS:
        raise EdgetrainError(f"config key 'sync' {d.sync.text} does not apply between the replicas of strategy "
                             f"{d.cfg.strategy}, whose devices holding the same {what} all-reduce its gradients "
                             f"every step (sync) or DiLoCo's pseudo-gradient every H steps; use --sync sync or "
                             f"diloco:H")
    if d.compress.kind.hook:
        raise EdgetrainError(f"config key 'compress' {d.compress.method} is a DDP gradient hook, which the replicas "
                             f"of strategy {d.cfg.strategy} do not use; with {flag} use topk, randk, sign, threshold, "
                             f"int8, qsgd, fp16 or bf16")


def _fsdp_checks(d: Draft) -> None:
    _between_replicas(d, "fsdp_replicas", "shard", "one sharded replica")


def _fsdp(d: Draft) -> dict:
    replicas = d.cfg.fsdp_replicas
    if d.devices_known and d.cfg.devices % replicas:  # else the devices check it, knowing their number
        raise EdgetrainError(f"config key 'devices' {d.cfg.devices} is not a multiple of fsdp_replicas {replicas} "
                             f"(devices = shards x replicas); set --devices to a multiple of {replicas}")
    return {"fsdp_replicas": replicas}


def _pipeline_checks(d: Draft) -> None:
    # A hybrid pipeline (--pipeline-replicas D > 1) exchanges each stage's gradients (or DiLoCo's pseudo-gradient)
    # among its D replicas through edgetrain's compressors (comm/exchange.py): --compress applies there, and only there.
    _between_replicas(d, "pipeline_replicas", "stage", "a single pipeline")
    if d.cfg.link_mode == "enforced":
        raise EdgetrainError("link mode enforced does not apply to strategy pipeline, whose sends are charged on a "
                             "timeline of micro-batches (train/pipeline.py); use --link-mode virtual")


def _pipeline(d: Draft) -> dict:
    cfg = d.cfg
    replicas = cfg.pipeline_replicas
    pipeline = PipelineSpec(parse_stages(cfg.stages), cfg.microbatches, cfg.pipeline_schedule,
                            planned=cfg.stages.strip().lower() == "auto", replicas=replicas)
    if cfg.batchnorm == "sync":
        raise EdgetrainError("config key 'batchnorm' sync does not apply to strategy pipeline: each BatchNorm lives "
                             "on one stage and normalises each micro-batch; use --batchnorm local")
    if cfg.batch_size % replicas:
        raise EdgetrainError(f"config key 'pipeline_replicas' {replicas} does not divide batch_size {cfg.batch_size} "
                             f"(each replica trains on batch_size / {replicas}); pick a divisor of it")
    per_replica = cfg.batch_size // replicas
    if per_replica % cfg.microbatches:
        of = f"batch_size {cfg.batch_size}" if replicas == 1 else f"a replica's batch {per_replica} (batch_size / " \
                                                                   f"pipeline_replicas)"
        raise EdgetrainError(f"config key 'microbatches' {cfg.microbatches} does not divide {of}; pick a divisor "
                             f"of it")
    if d.devices_known and cfg.devices % replicas:  # else the devices check it, knowing their number
        raise EdgetrainError(f"config key 'devices' {cfg.devices} is not a multiple of pipeline_replicas {replicas} "
                             f"(devices = stages x replicas); set --devices to a multiple of {replicas}")
    if d.devices_known and pipeline.stages is not None and cfg.devices != pipeline.stages * replicas:
        per = (", one per device" if replicas == 1
               else f"; with {replicas} replicas that is {pipeline.stages * replicas}")
        raise EdgetrainError(f"config key 'devices' is {cfg.devices} but stages {cfg.stages} make {pipeline.stages} "
                             f"stages{per}; set --devices {pipeline.stages * replicas}")
    return {"pipeline": pipeline}


def _refuses_dp(why: str) -> Check:
    """``--dp`` clips each sample's whole gradient: a strategy whose devices each hold part of it refuses it."""
    def check(d: Draft) -> None:
        if d.dp is not None:
            raise EdgetrainError(f"config key 'dp' {d.dp.text} does not apply to strategy {d.cfg.strategy}: {why}; "
                                 f"use --strategy ddp")
    return check


_DP_TILED = _refuses_dp("a sample's gradient is summed over its tiles on every device, never whole on one, so it "
                        "cannot be clipped per sample")
_DP_POOLED = _refuses_dp("each device holds part of the parameters, so a sample's gradient norm spans devices and "
                         "per-sample clipping would need an exchange per sample (not built)")


_S = "edgetrain.plan.strategies:"
StrategyKind(name="ddp", usage="ddp", summary="data parallel: every device a replica on its share of the batch, "
                                              "replicas agreeing as --sync and --compress say",
             runtime="edgetrain.train.strategy:DataParallel", planner=_S + "ddp_strategy", elastic=True)
StrategyKind(name="tiled", usage="tiled", example="tiled --grid 1x2",
             summary="spatial tiles of the early layers over a device grid (--grid, --groups), data parallel after "
                     "them; every device reads the whole batch",
             runtime="edgetrain.train.strategy:Tiled", shards_batch=False,
             own_exchanges="halo, feature-map and gradient exchanges", options=("grid", "groups"),
             checks=(_tiled_checks, _DP_TILED), spec=_tiling,
             unplanned="edgetrain plan has no model of strategy tiled (its halo and feature-map exchanges are not "
                       "modelled); measure it with edgetrain train --strategy tiled, or plan ddp, fsdp or pipeline")
StrategyKind(name="fsdp", usage="fsdp", summary="parameters, gradients and optimizer state sharded over the devices "
                                                "(FSDP2); --fsdp-replicas R: R sharded replicas, --sync sync or "
                                                "diloco:H between them",
             runtime="edgetrain.train.fsdp:FullyShardedDataParallel", planner=_S + "fsdp_strategy", pooled=True,
             own_exchanges="parameter all-gathers and gradient reduce-scatters", options=("fsdp_replicas",),
             checks=(_fsdp_checks, _DP_POOLED), spec=_fsdp)
StrategyKind(name="pipeline", usage="pipeline",
             summary="the model's layers split into stages, one per device (--stages, --microbatches, "
                     "--pipeline-schedule, --pipeline-replicas); every device reads the whole batch",
             runtime="edgetrain.train.pipeline:Pipeline", planner=_S + "pipeline_strategy", shards_batch=False,
             pooled=True, own_exchanges="activation and gradient sends between stages",
             options=("stages", "pipeline_replicas"), checks=(_pipeline_checks, _DP_POOLED), spec=_pipeline)


# ---------------------------------------------------------------- tasks

@dataclass(frozen=True, kw_only=True)
class TaskKind(Kind):
    """``--task``: what a model learns (its loss, metrics and targets). ``runtime`` is its ``tasks.base.Task``
    subclass; ``planner`` the cost count that takes its loss (``plan/costs.py``). A task passed from Python
    (``edgetrain.train(task=MyTask())``) has no descriptor: it is recorded as ``module:QualName`` and runs under
    every strategy whose needs it meets (``tasks.build_task``). Design notes: docs/how-to/tasks.md."""

    family: ClassVar[str] = "task"
    default_dataset: str                # what `--task NAME` trains on when no dataset is given
    default_model: str                  # and with which model
    implied_by: tuple[str, ...] = ()    # built-in datasets whose runs are this task when --task is not given
    strategies: tuple[str, ...] = ("ddp", "tiled", "fsdp", "pipeline")  # the strategies that can run it
    why_not: str = ""                   # what a refused strategy is told (the reason, then the fix)
    # the launcher checks the data and one batch through the model before any device starts (Task.check_data,
    # Task.check); classification skips it: its data is today's, checked as it always was, and CIFAR-10 is
    # not read twice
    check_batch: bool = True
    targets: str = "labels"             # what the built-in file formats (npz, csv) read as targets: "labels"
                                        # (integer classes) or "values" (real numbers); "own": the task's datasets
    # further config values `--task NAME` brings for keys the user did not give (detection: the resolution,
    # optimiser and schedule its default model learns the default dataset with)
    settings: tuple[tuple[str, object], ...] = ()

    def check_strategy(self, strategy: str) -> None:
        if strategy not in self.strategies:
            raise EdgetrainError(f"task {self.name} cannot run under strategy {strategy}{self.why_not}; use "
                                 f"--strategy {' or '.join(self.strategies)}")


def _runs_under_the_strategy(d: Draft) -> None:
    d.task.check_strategy(d.cfg.strategy)


def _no_images_to_dedup(d: Draft) -> None:
    if d.cfg.dedup != "off":
        raise EdgetrainError(f"config key 'dedup' {d.cfg.dedup} drops near-duplicate images, and task {d.task.name}'s "
                             "samples are feature vectors or series; drop --dedup")


_TASK_COSTS = "edgetrain.plan.costs:count_costs"   # the planner's counts take the task's loss (Task.example_target)
TaskKind(name="classification", usage="classification", summary="one class per sample: cross-entropy, accuracy",
         runtime="edgetrain.tasks.classification:ClassificationTask", planner=_TASK_COSTS,
         default_dataset="digits", default_model="small_cnn",
         implied_by=("digits", "cifar10", "synthetic", "imagefolder", "npz"), check_batch=False,
         checks=(_runs_under_the_strategy,))
TaskKind(name="regression", usage="regression",
         summary="real-valued targets (N,) or (N, K): squared error summed over samples, RMSE and MAE",
         runtime="edgetrain.tasks.regression:RegressionTask", planner=_TASK_COSTS,
         default_dataset="diabetes", default_model="mlp", implied_by=("diabetes",),
         strategies=("ddp", "fsdp", "pipeline"), targets="values",
         why_not=" (tiles are of images (C, H, W) and its inputs are feature vectors or series)",
         checks=(_runs_under_the_strategy, _no_images_to_dedup))
TaskKind(name="detection", usage="detection",
         summary="objects in images: boxes and classes per image, YOLOv2 loss, mAP by COCOeval",
         runtime="edgetrain.tasks.detection:DetectionTask", planner=_TASK_COSTS,
         default_dataset="shapes", default_model="yolov2_tiny_small", implied_by=("shapes", "yolo", "coco"),
         targets="own", settings=(("image_size", 128), ("epochs", 8), ("batch_size", 32), ("optimizer", "adam"),
                                  ("lr", 0.001), ("weight_decay", 0.0)),
         checks=(_runs_under_the_strategy,))

DEFAULT_TASK = "classification"


def is_user_task(name: str) -> bool:
    """A task passed from Python, recorded as ``module:QualName``."""
    return ":" in name


def task_kind(name: str) -> TaskKind:
    """The descriptor of a built-in task, or one line naming the known ones."""
    tasks = KINDS["task"]
    if name in tasks:
        return tasks[name]
    if is_user_task(name):
        cls = name.rsplit(":", 1)[1].rsplit(".", 1)[-1]
        raise EdgetrainError(f"task '{name}' is your own Task from an earlier run and a config cannot rebuild it; "
                             f"pass it again with edgetrain.train(config, task={cls}(...))")
    close = difflib.get_close_matches(name, tasks, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise EdgetrainError(f"unknown task '{name}'; {hint}known tasks: {', '.join(tasks)} (or pass your own "
                         f"with edgetrain.train(task=MyTask()))")


def implied_task(dataset: str) -> str:
    """The task a run of ``dataset`` trains when ``--task`` is not given (a dataset you registered: classification
    unless its factory's run names a task)."""
    return next((k.name for k in KINDS["task"].values() if dataset in k.implied_by), DEFAULT_TASK)


def run_task(task: str | None, dataset: str) -> str:
    """The task a run trains: ``task`` as given, else the one ``dataset`` implies. ``config.resolve`` asks this
    once per run and the ``RunSpec`` carries the answer (``RunSpec.task``)."""
    return task or implied_task(dataset)


def task_defaults(task: str | None, given: set[str] | frozenset[str], dataset: str | None = None) -> dict[str, object]:
    """The config values a built-in task implies for the keys the user did not give (``given``): its dataset,
    its model and its ``settings``. The task is ``--task``, else the one ``dataset`` implies (``implied_by``: a
    YOLO folder brings detection's model and resolution as ``--task detection`` does); ``{}`` for a task passed
    from Python, or with neither."""
    task = task or (implied_task(dataset) if dataset else None)
    if not task or is_user_task(task):
        return {}
    kind = task_kind(task)
    implied = {"dataset": kind.default_dataset, "model": kind.default_model, **dict(kind.settings)}
    return {k: v for k, v in implied.items() if k not in given}


def task_targets(task: str) -> str:
    """What a run of the resolved ``task`` has as targets (its ``targets``); a task passed from Python: class
    labels unless its dataset is its own (a registered factory, which gives the targets it likes)."""
    return "labels" if is_user_task(task) else task_kind(task).targets


def target_kind(cfg) -> str:
    """``task_targets`` of a ``TrainConfig`` not resolved into a ``RunSpec`` (``edgetrain data``)."""
    return task_targets(run_task(cfg.task, cfg.dataset))


# ---------------------------------------------------------------- server optimisers

@dataclass(frozen=True, kw_only=True)
class ServerOptKind(Kind):
    """``--server-opt`` (federated rounds): how the server steps the global model with the pseudo-gradient
    ``global - mean(client models)``. ``runtime`` builds the ``torch.optim.Optimizer`` over the flat global model
    from ``(global_model, ServerOptSpec)``; ``planner`` counts its state (``plan/exchanges.py``)."""

    family: ClassVar[str] = "server_optimizer"
    defaults: tuple[tuple[str, float], ...] = ()   # its options (``lr=``, ...) and their values when not given
    state_copies: int = 0                          # model-sized buffers of its state: what the planner counts


_SERVER = "edgetrain.comm.federated:"
_SERVER_STATE = "edgetrain.plan.exchanges:server_state_copies"
ServerOptKind(name="fedavg", usage="fedavg", summary="the mean of the client models (default)",
              runtime=_SERVER + "sgd_server", planner=_SERVER_STATE)
ServerOptKind(name="fedavgm", usage="fedavgm[:lr=1:momentum=0.9]",
              summary="server momentum on the mean update (Hsu et al. 2019): SGD with momentum",
              runtime=_SERVER + "sgd_server", planner=_SERVER_STATE,
              defaults=(("lr", 1.0), ("momentum", 0.9)), state_copies=1)
ServerOptKind(name="fedadam", usage="fedadam[:lr=0.01:beta1=0.9:beta2=0.99:eps=0.001]",
              summary="Adam on the mean update (Reddi et al. 2021)",
              runtime=_SERVER + "adam_server", planner=_SERVER_STATE,
              defaults=(("lr", 0.01), ("beta1", 0.9), ("beta2", 0.99), ("eps", 0.001)), state_copies=2)


# ---------------------------------------------------------------- availability of a simulated fleet

def _no_arguments(rest: str, text: str) -> tuple:
    if rest:
        raise EdgetrainError(f"availability {text!r}: always takes no argument; write always")
    return ()


def _two(rest: str, text: str, example: str) -> tuple[str, str]:
    parts = rest.split(":")
    if len(parts) != 2 or not all(p.strip() for p in parts):
        raise EdgetrainError(f"availability {text!r} needs two values, e.g. {example}")
    return parts[0], parts[1]


def _diurnal_arguments(rest: str, text: str) -> tuple[float, float]:
    period, fraction = _two(rest, text, "diurnal:24h:0.4")
    share = float(fraction) if re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", fraction) else -1.0
    if not 0.0 < share <= 1.0:
        raise EdgetrainError(f"availability {text!r}: the online fraction must be in (0, 1], e.g. diurnal:24h:0.4")
    return parse_duration(period, "diurnal period"), share


def _onoff_arguments(rest: str, text: str) -> tuple[float, float]:
    on, off = _two(rest, text, "onoff:30m:10m")
    return parse_duration(on, "mean online time"), parse_duration(off, "mean offline time")


def _trace_arguments(rest: str, text: str) -> tuple[str]:
    if not rest.strip():
        raise EdgetrainError(f"availability {text!r} needs the trace file: trace:PATH (CSV device,start_s,end_s)")
    return (rest.strip(),)


@dataclass(frozen=True, kw_only=True)
class AvailabilityKind(Kind):
    """``availability`` (a simulated fleet, ``fleet/devices.py``): when each virtual device is online. Its
    ``runtime`` is the class that answers "online at modelled time t?", built from the parsed spec and the seed
    (``from_spec``); ``parse_arguments`` checks what follows its name, one line for a bad value."""

    family: ClassVar[str] = "availability"
    parse_arguments: Callable[[str, str], tuple] = _no_arguments
    churns: bool = True   # devices go offline (so a modelled clock, a population, is needed to say when)


_AVAILABILITY = "edgetrain.fleet.devices:"
_UNPLANNED_AVAILABILITY = ("edgetrain plan models every device online; simulate availability with the fleet on "
                           "Flower's simulation runtime (edgetrain.fleet.simulation, run-config availability)")
AvailabilityKind(name="always", usage="always", summary="every device online all the time (default)",
                 runtime=_AVAILABILITY + "Always", unplanned=_UNPLANNED_AVAILABILITY, churns=False)
AvailabilityKind(name="diurnal", usage="diurnal:PERIOD:FRACTION", example="diurnal:24h:0.4",
                 summary="online for FRACTION of each PERIOD, at a phase of its own per device",
                 runtime=_AVAILABILITY + "Diurnal", unplanned=_UNPLANNED_AVAILABILITY,
                 parse_arguments=_diurnal_arguments)
AvailabilityKind(name="onoff", usage="onoff:MEAN_ON:MEAN_OFF", example="onoff:30m:10m",
                 summary="alternating online and offline spells of exponential lengths",
                 runtime=_AVAILABILITY + "OnOff", unplanned=_UNPLANNED_AVAILABILITY, parse_arguments=_onoff_arguments)
AvailabilityKind(name="trace", usage="trace:PATH", example="trace:windows.csv",
                 summary="online windows read from a CSV file of device,start_s,end_s lines",
                 runtime=_AVAILABILITY + "Trace", unplanned=_UNPLANNED_AVAILABILITY, parse_arguments=_trace_arguments)


# ---------------------------------------------------------------- runtime classes

def named_by_kind(family: str, builder: str | None = None) -> Callable[[type], type]:
    """Class decorator: the runtime class of a kind takes its ``name``, ``kind`` and what else it reads of its
    descriptor (``Kind.runtime_attributes``) from the descriptor whose ``runtime`` is this class, or ``builder``,
    the function of the class's module that builds it."""
    def name(cls: type) -> type:
        where = f"{cls.__module__}:{builder or cls.__qualname__}"
        found = [kind for kind in KINDS[family].values() if kind.runtime == where]
        if len(found) != 1:
            raise TypeError(f"{cls.__qualname__}: {len(found)} {family} kinds have runtime {where}, not one")
        for key, value in found[0].runtime_attributes().items():
            setattr(cls, key, value)
        return cls
    return name


# ---------------------------------------------------------------- lookups

STRATEGIES: tuple[str, ...] = tuple(KINDS["strategy"])
SYNC_MODES: tuple[str, ...] = tuple(KINDS["sync"])
METHODS: tuple[str, ...] = tuple(KINDS["compress"])
STRATEGY_KINDS: dict[str, StrategyKind] = KINDS["strategy"]
SYNC_KINDS: dict[str, SyncKind] = KINDS["sync"]
COMPRESS_KINDS: dict[str, CompressKind] = KINDS["compress"]
TASK_KINDS: dict[str, TaskKind] = KINDS["task"]
SERVER_OPT_KINDS: dict[str, ServerOptKind] = KINDS["server_optimizer"]
AVAILABILITY_KINDS: dict[str, AvailabilityKind] = KINDS["availability"]


def strategy_kind(name: str) -> StrategyKind:
    """The descriptor of strategy ``name``; an unknown one is refused in one line."""
    kind = STRATEGY_KINDS.get(name)
    if kind is None:
        raise EdgetrainError(f"unknown strategy {name!r}; use one of {', '.join(STRATEGIES)}")
    return kind


def owner(key: str, family: str) -> Kind | None:
    """The kind of ``family`` that alone takes config key ``key`` (None: a key of every kind)."""
    return next((k for k in KINDS[family].values() if key in k.options), None)


def all_kinds() -> list[Kind]:
    return [kind for family in KINDS.values() for kind in family.values()]


def reference_table(family: str) -> str:
    """The reference page's table of ``family``'s kinds (markdown): how each is written, what it is, and
    whether ``edgetrain plan`` models it."""
    rows = [f"| `{kind.usage}` | {kind.summary} | {'yes' if kind.planner else 'no'} |"
            for kind in KINDS[family].values()]
    return "\n".join(["| written | what it is | planned |", "| --- | --- | --- |", *rows])
