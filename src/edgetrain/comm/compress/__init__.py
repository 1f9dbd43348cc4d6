"""Gradient compressors (GRACE-style Compressor / Memory split) and the ``--compress`` parser."""
from edgetrain.comm.compress.base import Compressor, Payload, unpack
from edgetrain.comm.compress.cast import HalfCast
from edgetrain.comm.compress.fp32 import NoCompression
from edgetrain.comm.compress.memory import DGCMemory, NoMemory, ResidualMemory
from edgetrain.comm.compress.quantize import QSGD, Int8, LowBit
from edgetrain.comm.compress.randk import RandomK
from edgetrain.comm.compress.sign import MajorityVote, ScaledSign
from edgetrain.comm.compress.spec import METHODS, CompressSpec, build_compressor, parse_compress
from edgetrain.comm.compress.threshold import Threshold, link_threshold
from edgetrain.comm.compress.topk import TopK

__all__ = [
    "Compressor", "Payload", "unpack", "HalfCast", "NoCompression", "DGCMemory", "NoMemory", "ResidualMemory",
    "QSGD", "Int8", "LowBit", "RandomK", "MajorityVote", "ScaledSign", "METHODS", "CompressSpec", "build_compressor",
    "parse_compress", "Threshold", "link_threshold", "TopK",
]
