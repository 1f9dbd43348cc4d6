"""``--sync`` specs, and which compressors each mode composes with.

=============================================  ===========================================
``sync``                                       synchronous DDP (default); every compressor
``local:H``                                    local SGD, average every ``H`` steps;
``local:H:nesterov[:lr=0.7][:momentum=0.9]``   with DiLoCo's outer Nesterov step; every
                                               compressor but ``powersgd`` and ``dgc``
``async:S``                                    bounded staleness ``S`` steps; every fixed-size
                                               compressor (not ``threshold``, ``powersgd``, ``dgc``)
``gossip[:H]``                                 ring gossip every ``H`` steps (default 1);
                                               ``--compress none`` only
=============================================  ===========================================
"""
from __future__ import annotations

from dataclasses import dataclass

from edgetrain.comm.compress.spec import CompressSpec
from edgetrain.errors import EdgetrainError

MODES = ("sync", "local", "async", "gossip")


@dataclass(frozen=True)
class SyncSpec:
    mode: str
    period: int = 1            # local / gossip: steps between exchanges
    staleness: int = 0         # async: bound in steps
    nesterov: bool = False     # local: DiLoCo outer step
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    text: str = "sync"


def parse_sync(text: str | None) -> SyncSpec:
    """Parse and validate a ``--sync`` spec; raise ``EdgetrainError`` with the fix if it is wrong."""
    text = (text or "sync").strip().lower()
    mode, *rest = text.split(":")
    if mode not in MODES:
        raise EdgetrainError(f"unknown sync mode {mode!r} in --sync {text!r}; use sync, local:H, async:S or gossip")
    if mode == "sync":
        if rest:
            raise EdgetrainError(f"--sync sync takes no arguments, got {text!r}")
        return SyncSpec("sync", text=text)
    number = _int(rest[0], mode, text) if rest else None
    options = rest[1:]
    if mode == "local":
        if number is None:
            raise EdgetrainError("local SGD needs the number of local steps between averages, e.g. --sync local:8")
        if number < 1:
            raise EdgetrainError(f"local SGD period H must be >= 1 step, got {number} in {text!r}; "
                                 "e.g. --sync local:8 averages every 8 steps (local:1 is synchronous averaging)")
        nesterov, lr, momentum = False, 0.7, 0.9
        for opt in options:
            key, eq, value = opt.partition("=")
            if opt == "nesterov":
                nesterov = True
            elif eq and key in ("lr", "momentum"):
                number_value = _float(value, opt, text)
                lr, momentum = (number_value, momentum) if key == "lr" else (lr, number_value)
            else:
                raise EdgetrainError(f"unknown local SGD option {opt!r} in {text!r}; options: nesterov, lr=, momentum=")
        if (lr != 0.7 or momentum != 0.9) and not nesterov:
            raise EdgetrainError("lr= and momentum= set the outer Nesterov step: add :nesterov, "
                                 "e.g. --sync local:8:nesterov:lr=0.7")
        if not lr > 0 or not 0 <= momentum < 1:
            raise EdgetrainError(f"outer lr must be > 0 and momentum in [0, 1), got lr={lr:g}, momentum={momentum:g}")
        return SyncSpec("local", period=number, nesterov=nesterov, outer_lr=lr, outer_momentum=momentum, text=text)
    if options:
        raise EdgetrainError(f"--sync {mode} takes one number at most, got {text!r}")
    if mode == "async":
        if number is None:
            raise EdgetrainError("async needs a staleness bound in steps, e.g. --sync async:4")
        if number < 1:
            raise EdgetrainError(f"async staleness bound must be >= 1 step, got {number}; "
                                 "a bound of 0 is synchronous training: use --sync sync")
        return SyncSpec("async", staleness=number, text=text)
    period = 1 if number is None else number
    if period < 1:
        raise EdgetrainError(f"gossip period must be >= 1 step, got {period}")
    return SyncSpec("gossip", period=period, text=text)


def check_compatible(sync: SyncSpec, compress: CompressSpec) -> None:
    """Refuse combinations that do not make sense, saying why and what works."""
    if sync.mode == "sync":
        return
    if compress.is_powersgd:
        raise EdgetrainError(f"powersgd is a DDP gradient hook and works with --sync sync only, not {sync.text!r}; "
                             "with local/async averaging use topk, randk, sign, int8, qsgd, fp16 or bf16")
    if compress.is_dgc:
        raise EdgetrainError(f"dgc momentum correction applies to gradients (--sync sync), not to the model "
                             f"deltas of {sync.text!r}; drop :dgc")
    if sync.mode == "async" and compress.method == "threshold":
        raise EdgetrainError("threshold sends a variable number of entries, which the non-blocking rounds of "
                             "--sync async cannot carry; use topk, randk or sign with async")
    if sync.mode == "gossip" and compress.method != "none":
        raise EdgetrainError(f"gossip averages full models with neighbours and supports --compress none only, "
                             f"not {compress.text!r} (compressed gossip needs CHOCO-SGD, not implemented)")


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
