"""The compressor a parsed ``--compress`` spec names (``build_compressor``).

The spec itself (``CompressSpec``, ``parse_compress``) is parsed in ``edgetrain.spec`` and each method is
declared in ``edgetrain.kinds`` (its options, its checks, the builder in its own module here), all without
torch; they are imported here for the callers of this module's old names.
"""
from __future__ import annotations

from edgetrain.comm.compress.base import Compressor
from edgetrain.errors import EdgetrainError
from edgetrain.kinds import METHODS
from edgetrain.spec import CompressSpec, Link, parse_compress

__all__ = ["METHODS", "CompressSpec", "build_compressor", "parse_compress"]


def build_compressor(spec: CompressSpec, link: Link | None = None, seed: int = 0,
                     rank: int = 0) -> tuple[Compressor, object]:
    """The (compressor, memory) pair for a spec, built by its kind's module; a DDP hook of its own (PowerSGD) is
    not a ``Compressor`` (``comm.setup.build_hook`` builds it).

    ``seed`` must be the same on every device (random-k draws shared indices);
    QSGD's rounding noise is made independent per device from ``rank``.
    """
    if spec.kind.hook:
        raise EdgetrainError(f"{spec.method} is a DDP hook of its own, not a Compressor; it is built by build_hook")
    return spec.kind.load_runtime()(spec, link, seed, rank)
