"""Secure aggregation (``--secure-aggregation``): every device masks its update so that only the sum is revealed.

Each device encodes its flat fp32 update in fixed point (integers mod 2^32, a power-of-two scale the members
share), adds one pairwise mask per other member (+ for the lower rank, - for the higher) and the all-reduce sums
the masked integers, wrapping mod 2^32: the masks cancel exactly and the sum of the updates is left. Masks are a
ChaCha20 keystream (``cryptography``) under a key derived by HKDF-SHA256 from the pair's X25519 shared secret
and a per-pair exchange counter; public keys are exchanged once per group over the process group.

Design, the scale's agreement and what is and is not hidden: docs/design/secure-aggregation.md.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from edgetrain.cluster.peers import wait
from edgetrain.comm.accounting import ring_allgather_bytes, ring_allreduce_bytes

MODULUS_BITS = 32                 # the sum wraps mod 2^32: an int32 all-reduce (gloo adds in two's complement)
LOWEST, HIGHEST = -64, 63         # the exponents a scale may take: |x| < 2^e for e in [LOWEST, HIGHEST]
TAIL = HIGHEST - LOWEST + 2       # one-hot of each device's exponent, then its count of non-finite entries
HEADROOM = 2                      # the next exchange's scale leaves room for updates 2^HEADROOM times larger
SLACK = 8                         # redone when the members' largest exponent is more than this below the scale's
KEY_BYTES = 32
_INFO = b"edgetrain secure aggregation v1"


# ---------------------------------------------------------------- keys and masks

@dataclass
class PairwiseKeys:
    """This device's X25519 key pair and the secret it shares with each other device (by rank)."""

    rank: int
    private: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate)
    secrets: dict[int, bytes] = field(default_factory=dict)

    @property
    def public(self) -> bytes:
        return self.private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def agree(self, publics: list[bytes]) -> None:
        """The shared secret with every other device, from their public keys in rank order."""
        if len(set(publics)) != len(publics):
            raise RuntimeError("secure aggregation: two devices sent the same public key")
        self.secrets = {r: self.private.exchange(X25519PublicKey.from_public_bytes(p))
                        for r, p in enumerate(publics) if r != self.rank}


def pair_mask(secret: bytes, counter: int, count: int) -> np.ndarray:
    """``count`` uint32 words of the pair's mask for its ``counter``-th exchange: ChaCha20's keystream under a
    key HKDF derives from the shared secret and the counter (a fresh key per exchange, so the nonce is zero)."""
    key = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
               info=_INFO + counter.to_bytes(8, "little")).derive(secret)
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    return np.frombuffer(stream.update(bytes(4 * count)), dtype=np.uint32)


def exponent_of(x: torch.Tensor) -> int | None:
    """The smallest ``e`` in [LOWEST, HIGHEST] with every ``|x| < 2^e``; None if ``x`` holds a non-finite entry or
    one beyond 2^HIGHEST."""
    top = float(x.abs().max()) if x.numel() else 0.0
    if not math.isfinite(top):
        return None
    e = math.frexp(top)[1] if top > 0 else LOWEST
    return max(LOWEST, e) if e <= HIGHEST else None


def scale_of(exponent: int, members: int) -> float:
    """The power of two entries are multiplied by: ``members`` entries below 2^exponent sum below 2^30 of it, so
    the sum of the rounded integers stays inside int32."""
    return math.ldexp(1.0, 30 - exponent - math.ceil(math.log2(max(members, 1))))


def tail_of(exponent: int | None) -> np.ndarray:
    """What a device appends to its payload: a one-hot of its exponent, or a count of 1 for non-finite entries."""
    tail = np.zeros(TAIL, dtype=np.uint32)
    tail[TAIL - 1 if exponent is None else exponent - LOWEST] = 1
    return tail


def encode(x: torch.Tensor, exponent: int, members: int) -> np.ndarray:
    """``x`` in fixed point at the members' scale, as uint32 (two's complement); entries must be below 2^exponent."""
    q = torch.round(x.detach().double() * scale_of(exponent, members)).to(torch.int64)
    return q.numpy().astype(np.uint32)  # keeps the low 32 bits: the value mod 2^32


def masked(words: np.ndarray, rank: int, members: list[int], keys: PairwiseKeys, counters: dict[int, int]
           ) -> np.ndarray:
    """``words`` plus this device's mask with each other member (mod 2^32); advances each pair's counter."""
    out = words.copy()
    for peer in members:
        if peer == rank:
            continue
        mask = pair_mask(keys.secrets[peer], counters.get(peer, 0), len(out))
        counters[peer] = counters.get(peer, 0) + 1
        (np.add if rank < peer else np.subtract)(out, mask, out=out)  # uint32 wraps: the pair's masks cancel
    return out


def decode(total: np.ndarray, exponent: int, members: int) -> torch.Tensor:
    """The fp32 sum of the members' entries from the wrapped sum of their fixed-point words."""
    signed = total.view(np.int32).astype(np.float64)
    return torch.from_numpy(signed / scale_of(exponent, members)).float()


def step_of(exponent: int, members: int) -> float:
    """The fixed-point step of an exchange: the sum is exact to ``members / 2`` of it."""
    return 1.0 / scale_of(exponent, members)


# ---------------------------------------------------------------- the exchange

class SecureSum:
    """The masked sum of a flat fp32 tensor over a group, in place of its all-reduce (``exchange.average``).

    The members agree on the scale without a collective of its own: each exchange uses the scale the last
    exchange of the same tensor among the same members left (2^HEADROOM above its largest entry), and every
    payload ends with a one-hot of its device's exponent, whose masked sum tells every member the largest one.
    An exchange whose scale was too small (an entry would wrap) or far too large (precision lost) is redone at
    the scale that sum gives: rare after the first exchange of a tensor."""

    def __init__(self, keys: PairwiseKeys, timeout_s: float, key_bytes_sent: int = 0):
        self.keys = keys
        self.timeout_s = timeout_s
        self.key_bytes_sent = key_bytes_sent   # this device's share of the key exchange, for the summary
        self.counters: dict[int, int] = {}
        self.exponents: dict[tuple, int] = {}
        self.exchanges = 0
        self.redone = 0
        self.mask_s = 0.0
        self.last_step = 0.0

    @classmethod
    def agree(cls, rank: int, world: int, group, timeout_s: float) -> SecureSum:
        """Every device of ``group`` (global ranks 0..world-1) calls this: public keys are all-gathered once."""
        keys = PairwiseKeys(rank)
        mine = torch.frombuffer(bytearray(keys.public), dtype=torch.uint8)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        wait(dist.all_gather(everyone, mine, group=group, async_op=True), timeout_s,
             "secure aggregation key exchange")
        keys.agree([bytes(t.tolist()) for t in everyone])
        return cls(keys, timeout_s, ring_allgather_bytes(KEY_BYTES, world))

    def sum(self, x: torch.Tensor, members: list[int], key: object, emulator, group, peers=None) -> torch.Tensor:
        """The sum of every member's ``x`` (flat fp32), each device having sent only its masked words.
        ``members``: the global ranks of ``group``, in order; ``key``: names the tensor (its scale's history)."""
        history = (key, tuple(members))
        exponent, mine = self.exponents.get(history, 0), exponent_of(x)
        while True:
            total = self._masked_allreduce(x, exponent, mine, members, emulator, group, peers)
            counts = total[-TAIL:]
            if counts[-1]:  # a member's update holds inf or nan: so does the sum, as a plain all-reduce's would
                return torch.full_like(x, float("nan"))
            top = LOWEST + int(np.flatnonzero(counts[:-1]).max())
            if exponent - SLACK <= top <= exponent:
                break
            exponent = top  # the largest member's exponent: no entry wraps, no precision lost; redo
            self.redone += 1
        self.exponents[history] = min(HIGHEST, top + HEADROOM)
        self.exchanges += 1
        self.last_step = step_of(exponent, len(members))
        return decode(total[:-TAIL], exponent, len(members))

    def _masked_allreduce(self, x, exponent, mine, members, emulator, group, peers) -> np.ndarray:
        started = time.perf_counter()
        inside = mine is not None and mine <= exponent
        words = np.concatenate([encode(x, exponent, len(members)) if inside else np.zeros(x.numel(), np.uint32),
                                tail_of(mine)])
        buf = torch.from_numpy(masked(words, self.keys.rank, members, self.keys, self.counters).view(np.int32))
        self.mask_s += time.perf_counter() - started

        def collective() -> None:
            wait(dist.all_reduce(buf, group=group, async_op=True), self.timeout_s, "secure aggregation all-reduce")

        emulator.run("allreduce", ring_allreduce_bytes(buf.numel() * buf.element_size(), len(members)), collective,
                     peers)
        return buf.numpy().view(np.uint32)

    def summary(self) -> dict:
        return {"exchanges": self.exchanges, "redone": self.redone, "masking_s": round(self.mask_s, 6),
                "key_exchange_bytes_sent": self.key_bytes_sent, "fixed_point_bits": MODULUS_BITS,
                "last_fixed_point_step": self.last_step}

