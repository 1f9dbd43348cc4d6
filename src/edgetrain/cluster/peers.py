"""What devices check about each other before training, and how they exchange Python values.

Design: docs/design/launch.md ("Peers and the rendezvous").
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping

import psutil
import torch
import torch.distributed as dist

from edgetrain.errors import EdgetrainError

TOKEN_ENV = "EDGETRAIN_CLUSTER_TOKEN"
# Keys that are each node's own business: where its files are, how it reports, how long it waits.
NODE_LOCAL_KEYS = frozenset({"data_dir", "output", "run_name", "progress", "workers", "threads", "devices",
                             "timeout", "cluster_token", "cluster_token_file", "power_file", "tensorboard",
                             "resume"})  # rank 0 alone reads the checkpoint (a torchrun restart: only its node)
_DIGEST_BYTES = 32


def cluster_token(token: str | None, token_file: str | None, environ: Mapping[str, str]) -> str:
    """The cluster token from ``--cluster-token``, ``--cluster-token-file`` (its first line) or the
    environment, in that order; "" where none is given. One line if the file cannot be read or is empty."""
    if token and token_file:
        raise EdgetrainError("give the cluster token once: --cluster-token or --cluster-token-file, not both")
    if token_file:
        try:
            lines = Path(token_file).expanduser().read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise EdgetrainError(f"cannot read --cluster-token-file {token_file} ({e.strerror or e}); give a "
                                 f"readable file whose first line is the token") from None
        if not lines or not lines[0].strip():
            raise EdgetrainError(f"--cluster-token-file {token_file} is empty; write the token on its first line")
        return lines[0].strip()
    return token or environ.get(TOKEN_ENV, "")


def check_rank_environment() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment variables, each checked; one clear line if wrong."""
    def integer(name: str) -> int | None:
        text = os.environ.get(name)
        if text is None:
            return None
        try:
            return int(text)
        except ValueError:
            raise EdgetrainError(f"environment variable {name}={text!r} is not an integer; "
                                 f"start the device with torchrun or set {name} to a whole number") from None

    world, rank, local_rank = integer("WORLD_SIZE"), integer("RANK"), integer("LOCAL_RANK")
    if world is None or world < 1:
        raise EdgetrainError(f"environment variable WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} must be >= 1: "
                             f"the number of devices in the run")
    if rank is None or not 0 <= rank < world:
        raise EdgetrainError(f"environment variable RANK={os.environ.get('RANK')!r} must be 0..{world - 1} "
                             f"(WORLD_SIZE is {world}); give every device its own rank")
    if local_rank is not None and local_rank < 0:
        raise EdgetrainError(f"environment variable LOCAL_RANK={local_rank} must be >= 0")
    return rank, world


def wait(pending: dist.Work | torch.futures.Future, timeout_s: float, what: str) -> Any:
    """Wait at most ``timeout_s`` for a collective's ``Work`` or ``Future``; the future's value (``None`` for a Work).

    A timeout raises one ``EdgetrainError`` naming ``what``; other failures are raised unchanged.
    """
    cause = None
    try:
        if isinstance(pending, dist.Work):
            pending.wait(timeout=timedelta(seconds=timeout_s))  # gloo's own timeout, raised as a RuntimeError
            return None
        done = threading.Event()
        pending.add_done_callback(lambda _: done.set())
        if done.wait(timeout_s):
            return pending.value()
    except RuntimeError as e:
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        cause = e
    raise EdgetrainError(f"{what} timed out after {timeout_s:g} s: a device stopped responding or is far slower "
                         f"than the rest; check the other devices' logs, or raise --timeout if it is only slow"
                         ) from cause


def cut_connections(keep_port: int) -> int:
    """Shut down this process's TCP connections except those to or from ``keep_port`` (the rendezvous store):
    its gloo pairs. Every collective waiting on them, here and at the peer's end, fails at once with gloo's
    "Connection closed by peer" instead of waiting out the group's timeout. How many were cut.

    Why not ``ProcessGroup.abort``: in torch 2.13 neither gloo's ``abort`` nor ``shutdown`` wakes a pending
    collective, and ``destroy_process_group`` leaves the sockets open while DDP's reducer holds the group
    (measured: the peers waited the full timeout in each case). The socket is shut down through a duplicate of
    its descriptor, so gloo still owns (and later closes) the original."""
    cut = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.fd < 0 or not conn.raddr or keep_port in (conn.raddr.port, conn.laddr.port):
            continue
        try:
            duplicate = socket.fromfd(conn.fd, conn.family, socket.SOCK_STREAM)
        except OSError:  # closed since the listing
            continue
        try:
            duplicate.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            pass
        finally:
            duplicate.close()
    return cut


def _all_lengths(payload: bytes, group=None) -> list[int]:
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(lengths, torch.tensor([len(payload)], dtype=torch.int64), group=group)
    return [int(n.item()) for n in lengths]


def all_gather_bytes(payload: bytes, group=None) -> list[bytes]:
    lengths = _all_lengths(payload, group)
    padded = [torch.zeros(max(lengths), dtype=torch.uint8) for _ in lengths]
    dist.all_gather(padded, _to_tensor(payload, max(lengths)), group=group)
    return [t[:n].numpy().tobytes() for t, n in zip(padded, lengths)]


def broadcast_bytes(payload: bytes, src: int, timeout_s: float, what: str) -> bytes:
    """``src``'s ``payload`` on every device (the others pass anything): its length, then the bytes;
    each collective bounded by ``wait``."""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    wait(dist.broadcast(length, src=src, async_op=True), timeout_s, what)
    buffer = _to_tensor(payload if dist.get_rank() == src else b"", int(length.item()))
    wait(dist.broadcast(buffer, src=src, async_op=True), timeout_s, what)
    return buffer.numpy().tobytes()


def all_gather_json(value: Any, group=None) -> list[Any]:
    """Every device's ``value`` (JSON-able), in rank order, on every device."""
    return [json.loads(b) for b in all_gather_bytes(json.dumps(value).encode(), group)]


def gather_json(value: Any, dst: int = 0) -> list[Any] | None:
    """Every device's ``value`` (JSON-able) in rank order on ``dst``; ``None`` elsewhere."""
    payload = json.dumps(value).encode()
    lengths = _all_lengths(payload)
    mine = dist.get_rank() == dst
    padded = [torch.zeros(max(lengths), dtype=torch.uint8) for _ in lengths] if mine else None
    dist.gather(_to_tensor(payload, max(lengths)), padded, dst=dst)
    if not mine:
        return None
    return [json.loads(t[:n].numpy().tobytes()) for t, n in zip(padded, lengths)]


def _to_tensor(payload: bytes, length: int) -> torch.Tensor:
    out = torch.zeros(length, dtype=torch.uint8)
    if payload:
        out[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return out


def peer_failure(error: BaseException, rank: int, timeout_s: float) -> str | None:
    """One line for a collective that failed because a peer died or stopped answering (gloo's own error:
    a connection closed or reset, a timed-out send or receive), or None for any other error. Under torchrun
    or the plain recipe no launcher is there to pick the device that failed first, so each survivor says
    this rather than gloo's traceback."""
    text = str(error).strip()
    if not isinstance(error, (RuntimeError, dist.DistError)) or not any(
            mark in text for mark in ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
                                      "Broken pipe", "Timed out waiting")):
        return None
    detail = text.splitlines()[0].split("] ", 1)[-1]  # gloo's source path cut
    return (f"device {rank}: a peer device stopped answering during the run ({detail}); the device that failed "
            f"first says why in its own output (a killed or lost host says nothing): restart the run there, or "
            f"raise --timeout ({timeout_s:g} s) if it was only slow")


def host_identity() -> str:
    """This machine (its boot id) and network namespace: devices that share both share this host's cores."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            machine = f.read().strip()
    except OSError:  # not Linux
        machine = socket.gethostname()
    try:
        namespace = os.readlink("/proc/self/ns/net")
    except OSError:
        namespace = ""
    return f"{machine}/{namespace}"


def local_placement(rank: int, world: int) -> tuple[int, int]:
    """(this device's index among the devices on its host, how many there are).

    torchrun and the local launcher say it (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``). Without them (the plain
    ``RANK=`` recipe, one process per host) it is counted: the devices all-gather ``host_identity`` (a
    collective, right after admission), so a process alone on its host gets all its cores, and several
    started by hand on one host share them."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world == 1 or rank < 0 or not dist.is_initialized():
        return 0, 1
    hosts = all_gather_json(host_identity())
    return hosts[:rank].count(hosts[rank]), hosts.count(hosts[rank])


def admit_peers(config: dict, cluster_token: str, rank: int, world: int) -> None:
    """Check that every device has this device's cluster token and config (collectives: all devices call it)."""
    if world == 1:
        return
    nonce = torch.zeros(_DIGEST_BYTES, dtype=torch.uint8)
    if rank == 0:
        nonce = _to_tensor(secrets.token_bytes(_DIGEST_BYTES), _DIGEST_BYTES)
    dist.broadcast(nonce, src=0)
    key = cluster_token.encode()

    def answer(r: int) -> bytes:
        return hmac.new(key, bytes(nonce.tolist()) + r.to_bytes(8, "big"), hashlib.sha256).digest()

    answers = _all_gather_digest(answer(rank))
    strangers = [r for r, got in enumerate(answers) if not hmac.compare_digest(got, answer(r))]
    if strangers and not cluster_token:
        raise EdgetrainError(f"this device (rank {rank}) has no cluster token and its peers have one; set "
                             f"{TOKEN_ENV} (or --cluster-token) to the cluster's token on this node")
    tokenless = [r for r in strangers if hmac.compare_digest(answers[r], hmac.new(
        b"", bytes(nonce.tolist()) + r.to_bytes(8, "big"), hashlib.sha256).digest())]
    if strangers and tokenless == strangers:
        raise EdgetrainError(f"device(s) {', '.join(map(str, strangers))} have no cluster token (this device, rank "
                             f"{rank}, has one); set {TOKEN_ENV} (or --cluster-token) on every node")
    if strangers:
        raise EdgetrainError(f"device(s) {', '.join(map(str, strangers))} gave a cluster token that does not match "
                             f"this device's (rank {rank}); start every node with the same --cluster-token "
                             f"or {TOKEN_ENV}")

    shared = {k: v for k, v in config.items() if k not in NODE_LOCAL_KEYS}
    digest = hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).digest()
    if all(d == digest for d in _all_gather_digest(digest)):
        return
    configs = all_gather_json(shared)
    for other, theirs in enumerate(configs):
        differing = [k for k in shared if theirs.get(k) != shared[k]] + sorted(set(theirs) - set(shared))
        if differing:
            key = differing[0]
            raise EdgetrainError(f"device {other}'s config differs from this device's (rank {rank}) at key '{key}': "
                                 f"{theirs.get(key)!r} there, {shared.get(key)!r} here; start every node with "
                                 f"the same config")


def _all_gather_digest(digest: bytes) -> list[bytes]:
    world = dist.get_world_size()
    out = [torch.zeros(_DIGEST_BYTES, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, _to_tensor(digest, _DIGEST_BYTES))
    return [bytes(t.tolist()) for t in out]
