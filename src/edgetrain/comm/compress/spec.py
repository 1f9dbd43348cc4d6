"""The compressor a parsed ``--compress`` spec names (``build_compressor``).

The spec itself (``CompressSpec``, ``parse_compress``, the table of methods
and options) is parsed in ``edgetrain.spec``, without torch; it is imported
here for the callers of this module's old names.
"""
from __future__ import annotations

import torch

from edgetrain.comm.compress.base import Compressor
from edgetrain.comm.compress.cast import HalfCast
from edgetrain.comm.compress.fp32 import NoCompression
from edgetrain.comm.compress.memory import DGCMemory, NoMemory, ResidualMemory
from edgetrain.comm.compress.quantize import QSGD, Int8, LowBit
from edgetrain.comm.compress.randk import RandomK
from edgetrain.comm.compress.sign import MajorityVote, ScaledSign
from edgetrain.comm.compress.threshold import Threshold
from edgetrain.comm.compress.topk import TopK
from edgetrain.errors import EdgetrainError
from edgetrain.spec import METHODS, CompressSpec, Link, parse_compress

__all__ = ["METHODS", "CompressSpec", "build_compressor", "parse_compress"]


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
        bits = int(opts["bits"]) if "bits" in opts else None
        return TopK(arg, warmup_steps=int(opts.get("warmup", 0)), layerwise="layerwise" in opts,
                    compact="compact" in opts, bits=bits), memory
    if name == "quant":
        return LowBit(int(arg or 4)), ResidualMemory() if ef else NoMemory()
    if name == "randk":
        return RandomK(arg, seed=seed), ResidualMemory() if ef else NoMemory()
    if name == "sign":
        if "vote" in opts:
            return MajorityVote(), NoMemory()
        return ScaledSign(), ResidualMemory() if ef else NoMemory()
    if name == "threshold":
        return Threshold(arg or 0.001, link, "strom" if "strom" in opts else "mean"), ResidualMemory()
    raise EdgetrainError(f"{name} is a DDP hook of its own, not a Compressor; it is built by build_hook")
