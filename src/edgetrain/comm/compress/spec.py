"""``--compress`` specs: ``NAME[:ARG][:OPTION]...``.

=================================  =================================================
``none`` (or ``fp32``)             fp32 all-reduce, as plain DDP
``fp16``, ``bf16``                 half-precision all-reduce
``int8``                           linear 8-bit quantization
``qsgd[:LEVELS]``                  stochastic quantization, 1..127 levels (default 127)
``topk:RATIO``                     top-k with error feedback; options ``dgc`` (momentum
                                   correction, ``momentum=0.9``), ``warmup=STEPS`` (DGC's
                                   sparsity ramp), ``layerwise`` (a budget per layer, as
                                   DGC), ``compact`` (fp16 value + 16-bit index
                                   gap: 4 bytes per entry, not 8), ``noef``
``randk:RATIO``                    random-k (shared seed) with error feedback; ``noef``
``sign``                           EF-signSGD (scaled sign, error feedback); ``sign:vote``
                                   for signSGD majority vote
``powersgd[:RANK]``                PyTorch's PowerSGD hook (default rank 2); ``start=ITER``
                                   vanilla all-reduce iterations first (default 10)
``threshold[:TAU]``                Strom's two-step threshold method, ``Wt`` derived
                                   from the device's link (default tau 0.001); entries
                                   decode to their layer's mean, ``strom`` to +-Wt
=================================  =================================================
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from edgetrain.cluster.links import Link
from edgetrain.comm.compress.base import Compressor
from edgetrain.comm.compress.cast import HalfCast
from edgetrain.comm.compress.fp32 import NoCompression
from edgetrain.comm.compress.memory import DGCMemory, NoMemory, ResidualMemory
from edgetrain.comm.compress.quantize import QSGD, Int8
from edgetrain.comm.compress.randk import RandomK
from edgetrain.comm.compress.sign import MajorityVote, ScaledSign
from edgetrain.comm.compress.threshold import Threshold
from edgetrain.comm.compress.topk import TopK
from edgetrain.errors import EdgetrainError

METHODS = ("none", "fp16", "bf16", "int8", "qsgd", "topk", "randk", "sign", "powersgd", "threshold")
_OPTIONS = {
    "none": set(), "fp16": set(), "bf16": set(), "int8": set(), "qsgd": set(),
    "topk": {"dgc", "momentum", "warmup", "noef", "layerwise", "compact"},
    "randk": {"noef"},
    "sign": {"vote", "noef"},
    "powersgd": {"start"},
    "threshold": {"strom"},
}


@dataclass(frozen=True)
class CompressSpec:
    """A parsed ``--compress`` spec."""

    method: str
    arg: float | None = None
    options: dict = field(default_factory=dict)
    text: str = "none"

    @property
    def is_powersgd(self) -> bool:
        return self.method == "powersgd"

    @property
    def is_dgc(self) -> bool:
        return "dgc" in self.options


def parse_compress(text: str | None) -> CompressSpec:
    """Parse and validate a ``--compress`` spec; raise ``EdgetrainError`` with the fix if it is wrong."""
    text = (text or "none").strip().lower()
    name, *rest = text.split(":")
    if name == "fp32":
        name = "none"
    if name not in METHODS:
        raise EdgetrainError(f"unknown compression {name!r} in --compress {text!r}; use one of {', '.join(METHODS)}")
    arg: float | None = None
    options: dict = {}
    for i, token in enumerate(rest):
        key, eq, value = token.partition("=")
        if i == 0 and not eq and _is_number(token):
            arg = float(token)
            continue
        if key not in _OPTIONS[name]:
            allowed = ", ".join(sorted(_OPTIONS[name])) or "none"
            raise EdgetrainError(f"unknown option {token!r} for {name} in --compress {text!r}; options: {allowed}")
        options[key] = _number(value, token, text) if eq else True
    _check(name, arg, options, text)
    return CompressSpec(name, arg, options, text)


def _check(name: str, arg: float | None, options: dict, text: str) -> None:
    if name in ("topk", "randk"):
        if arg is None:
            raise EdgetrainError(f"{name} needs the fraction of entries to keep, e.g. --compress {name}:0.01")
        if not 0 < arg <= 1:
            raise EdgetrainError(f"{name} ratio must be a fraction in (0, 1], got {arg:g} in {text!r}; "
                                 f"e.g. {name}:0.01 keeps 1% of the entries")
    elif name == "qsgd" and arg is not None and not (arg == int(arg) and 1 <= arg <= 127):
        raise EdgetrainError(f"qsgd levels must be an integer in [1, 127], got {arg:g}")
    elif name == "powersgd" and arg is not None and not (arg == int(arg) and arg >= 1):
        raise EdgetrainError(f"powersgd rank must be an integer >= 1, got {arg:g}")
    elif name == "threshold" and arg is not None and not arg > 0:
        raise EdgetrainError(f"threshold tau must be positive, got {arg:g}")
    elif arg is not None and name in ("none", "fp16", "bf16", "int8", "sign"):
        raise EdgetrainError(f"{name} takes no number, got {text!r}")
    if "momentum" in options and not 0 <= options["momentum"] < 1:
        raise EdgetrainError(f"momentum must be in [0, 1), got {options['momentum']:g}")
    if "momentum" in options and "dgc" not in options:
        raise EdgetrainError("momentum= applies to DGC momentum correction: add :dgc, e.g. topk:0.001:dgc:momentum=0.9")
    if "dgc" in options and "noef" in options:
        raise EdgetrainError("dgc keeps its own residual; it cannot be combined with noef")
    for key in ("warmup", "start"):
        if key in options and not (options[key] == int(options[key]) and options[key] >= 0):
            raise EdgetrainError(f"{key}= must be a whole number of steps, got {options[key]:g}")


def build_compressor(spec: CompressSpec, link: Link | None = None, seed: int = 0,
                     rank: int = 0) -> tuple[Compressor, object]:
    """The (compressor, memory) pair for a spec; PowerSGD is not a ``Compressor`` (see ``powersgd.py``).

    ``seed`` must be the same on every device (random-k draws shared indices);
    QSGD's rounding noise is made independent per device from ``rank``.
    """
    name, arg, opts = spec.method, spec.arg, spec.options
    ef = "noef" not in opts
    if name == "none":
        return NoCompression(), NoMemory()
    if name in ("fp16", "bf16"):
        return HalfCast(torch.float16 if name == "fp16" else torch.bfloat16), NoMemory()
    if name == "int8":
        return Int8(), NoMemory()
    if name == "qsgd":
        return QSGD(int(arg or 127), seed=seed * 1_000_003 + rank), NoMemory()
    if name == "topk":
        memory = DGCMemory(opts.get("momentum", 0.9)) if "dgc" in opts else (ResidualMemory() if ef else NoMemory())
        return TopK(arg, warmup_steps=int(opts.get("warmup", 0)), layerwise="layerwise" in opts,
                    compact="compact" in opts), memory
    if name == "randk":
        return RandomK(arg, seed=seed), ResidualMemory() if ef else NoMemory()
    if name == "sign":
        if "vote" in opts:
            return MajorityVote(), NoMemory()
        return ScaledSign(), ResidualMemory() if ef else NoMemory()
    if name == "threshold":
        return Threshold(arg or 0.001, link, "strom" if "strom" in opts else "mean"), ResidualMemory()
    raise EdgetrainError(f"{name} is a DDP hook of its own, not a Compressor; it is built by build_hook")


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
