"""Starting the devices of a run.

Design: docs/design/launch.md ("Emulated devices").
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import gc
import io
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import reduction
from pathlib import Path
from typing import Any, Callable

import psutil

from edgetrain.cluster.limits import oom_killed
from edgetrain.cluster.membership import JOIN_ENV, ElasticLaunch, Lighthouse
from edgetrain.errors import EdgetrainError, Terminated, raise_on_sigterm

# Imported inside functions: torch, and multiprocessing's forkserver and resource_tracker (with what they import, a
# few ms), so that edgetrain --help, bad input and plan answer without them.

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_STOP_GRACE_S = 5.0  # how long a stopped device may take to clean up before SIGKILL
_TERMINATED = object()  # what a device "returns" when SIGTERM stopped it
_DEVICE_ENV = "EDGETRAIN_LAUNCHER_PID"  # set for the devices only, to the launcher's pid
_UNGUARDED_MAIN_EXIT = 86
_UNGUARDED_MAIN_FIX = ("edgetrain.train was called while a device process imported your script (devices are "
                       "started and re-import it); put the call under an `if __name__ == \"__main__\":` guard")

# Messages that are the echo of another device's failure rather than a cause.
_ECHOES = ("connection closed", "connection reset", "broken pipe", "peer", "timed out", "timeout",
           "terminated", "gloo", "socket")


def refuse_nested_launch() -> None:
    """Stop a run from starting inside a device process that is still importing the user's script."""
    if not getattr(mp.current_process(), "_inheriting", False):  # multiprocessing's own "bootstrapping" flag
        return
    if os.environ.get(_DEVICE_ENV) and _started_by(int(os.environ[_DEVICE_ENV])):
        os._exit(_UNGUARDED_MAIN_EXIT)  # one of our devices: its launcher reports it as one line
    raise EdgetrainError(_UNGUARDED_MAIN_FIX)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _killed(p: mp.process.BaseProcess) -> str:
    """How a device process that a signal ended died: the out-of-memory killer at its memory limit, named with
    the fix, where its memory group says so (``--device-limits cgroup``), else the signal."""
    limit = oom_killed(p.pid) if p.exitcode == -signal.SIGKILL else None
    if limit is None:
        return f"its process was killed by signal {signal.Signals(-p.exitcode).name}"
    return (f"its process was killed (SIGKILL) by the kernel's out-of-memory killer at its memory limit of {limit} "
            f"MiB, page cache included; lower --batch-size, --workers, --prefetch or --cache-mb, or give its "
            f"profile more memory_mb")


def _set_parent_death_signal(sig: signal.Signals) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def _started_by(launcher_pid: int) -> bool:
    """This process's parent is ``launcher_pid`` or the fork server that ``launcher_pid`` started."""
    parent = os.getppid()
    if parent == launcher_pid:
        return True
    try:
        return psutil.Process(parent).ppid() == launcher_pid
    except psutil.Error:
        return False


def _die_with_parent(launcher_pid: int) -> None:
    """Get SIGTERM when the launcher dies, however it dies (elsewhere than Linux: the launcher's cleanup only).

    The device's parent is the launcher's fork server, which ends when the launcher does (multiprocessing
    closes its pipe), so the signal follows the launcher's death."""
    _set_parent_death_signal(signal.SIGTERM)
    if not _started_by(launcher_pid):  # the launcher died before prctl took effect: no signal will come
        os._exit(128 + signal.SIGTERM)


def loader_worker_init(_worker_id: int) -> None:
    """``worker_init_fn`` of a device's DataLoader: the worker dies with its device, and stays quiet when the
    device is stopped in the middle of taking a batch from it (multiprocessing's fd-sharing thread would
    otherwise print an EOFError traceback after edgetrain's one line)."""
    _set_parent_death_signal(signal.SIGKILL)
    sys.excepthook = _quiet_if_peer_vanished


def _quiet_if_peer_vanished(kind, value, tb) -> None:
    if not issubclass(kind, (EOFError, ConnectionError)):
        sys.__excepthook__(kind, value, tb)


def _loopback_interface() -> str | None:
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return None


class _LauncherStdio:
    """The launcher's stdout and stderr as they are when a device starts, handed to the device.

    A device forked by the fork server would otherwise write to the server's, fixed when it started (for
    a process that runs many trainings, such as a test session, those of the first)."""

    def __reduce__(self):  # pickled while the device starts: DupFd sends the descriptors with it
        handles = []
        for fd in (1, 2):
            try:
                os.fstat(fd)
            except OSError:  # closed in the launcher (e.g. `>&-`): the device keeps the server's
                handles.append(None)
                continue
            handles.append(reduction.DupFd(fd))
        return _LauncherStdio._attach, tuple(handles)

    @staticmethod
    def _attach(out, err) -> None:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:  # None where the fork server started without it
                stream.flush()
        for handle, fd in ((out, 1), (err, 2)):
            if handle is not None:
                received = handle.detach()
                os.dup2(received, fd)
                os.close(received)


@dataclass(frozen=True)
class _Start:
    """What every device process of a launch starts from: the launcher's store ``port`` for ``world`` devices,
    the launcher (``parent_pid``) it dies with, ``target(*args)`` to run, the ``results`` queue it reports on
    and the ``log_dir`` its traceback goes to."""
    world: int
    port: int
    parent_pid: int
    target: Callable
    args: tuple
    results: Any
    log_dir: str | None


def _child(rank: int, start: _Start, joining: bool = False, environ: dict | None = None, stdio: Any = None) -> None:
    world, port, results, log_dir = start.world, start.port, start.results, start.log_dir
    _die_with_parent(start.parent_pid)
    # Its own processes (loader workers) forked from it, as a torchrun worker's are: multiprocessing made the
    # fork server's method this process's default, which would start a server of its own to fork them from.
    mp.set_start_method("fork", force=True)
    if environ is not None:  # the launcher's environment now, not the fork server's from when it started
        os.environ.clear()
        os.environ.update(environ)
    if joining:  # started again in an elastic run: it joins the devices that went on (train/elastic.py)
        os.environ[JOIN_ENV] = "1"
    os.setpgrp()
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    os.environ.setdefault("TORCHELASTIC_RESTART_COUNT", "0")  # torch < 2.6 reads it with the agent store
    loopback = _loopback_interface()
    if loopback:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
    try:
        value = start.target(*start.args)
    except Terminated:
        value = _TERMINATED  # the stack has unwound: its finally blocks ran (temporary files removed)
    except EdgetrainError as e:
        results.put(("error", rank, str(e), True))
        raise SystemExit(2)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which prints one line
        msg = f"{type(e).__name__}: {e}".strip().splitlines()[0]
        if log_dir:
            log = Path(log_dir) / f"device-{rank}.log"
            log.write_text(traceback.format_exc())
            msg += f" (traceback in {log})"
        else:
            traceback.print_exc()
        results.put(("error", rank, msg, False))
        raise SystemExit(1)
    if value is _TERMINATED:
        # The launcher stopped us and reports why. Run what a normal exit runs in Python (the loader's
        # shutdown, multiprocessing's finalizers, which release semaphores the resource tracker would
        # otherwise report as leaked), then leave: the interpreter's own teardown would wait in gloo's
        # destructors for peers that are being stopped too (seconds, until the launcher's SIGKILL).
        gc.collect()  # the loader's iterator, freed with the unwound frames, shuts its workers down
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signal.SIGTERM)
    # From here the device only exits: a SIGTERM now just ends it, without a traceback from an atexit hook.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    results.put(("done", rank, value, True))


def _is_echo(msg: str) -> bool:
    return any(word in msg.lower() for word in _ECHOES)


def _root_cause(failures: list[tuple[int, str, bool]], silent: dict[int, str] | None = None) -> tuple[int, str]:
    """The failure most likely to be the cause: a clean error or a death, before echoes of it.

    ``silent`` maps the devices still running without a word to their process status: when every
    report is an echo (peers timing out), the lowest silent device is the one they waited for.
    """
    def rank_key(f):
        rank, msg, clear = f
        return (not clear, _is_echo(msg), rank)

    rank, msg, _ = min(failures, key=rank_key)
    if not _is_echo(msg) or not silent:
        return rank, msg
    stopped = [r for r, status in silent.items() if status == psutil.STATUS_STOPPED]
    if stopped:
        return stopped[0], "its process was stopped (SIGSTOP?) and its peers timed out waiting for it"
    # A running device that said nothing is only the likely culprit if several peers timed out on it:
    # with two devices, the silent one may just be slower to report its own timeout.
    if len(silent) == 1 and len(failures) >= 2:
        return min(silent), "its process stopped answering (hung?) and its peers timed out waiting for it"
    return rank, msg


def _stop(procs: list, finished: bool) -> None:
    """Stop every device and what it started: SIGCONT + SIGTERM, a grace period, then SIGKILL to its group.

    ``finished``: every device reported its result, so let them exit by themselves first."""
    for p in procs:
        p.join(timeout=_STOP_GRACE_S if finished else 0)
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            p.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 0.0))
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)  # the device if it is still there, and its loader workers
        p.join(timeout=5)


def _status(proc) -> str:
    try:
        return psutil.Process(proc.pid).status()
    except psutil.Error:
        return "gone"


def _loopback_store(world: int):
    """A rendezvous store served by this process on 127.0.0.1 only; (store, port)."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(world * 4)
    port, fd = listener.getsockname()[1], listener.detach()
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=fd)
    except NotImplementedError:  # torch < 2.6: its libuv store takes no listening socket; the legacy one does
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=fd,
                              use_libuv=False)
    return store, store.port


# Imported once by the fork server, so that a device starts with them loaded: they cost a fresh interpreter
# about 3 s of CPU (torch about 1.5, torch._dynamo, which torch's optimizers and dispatch modes import on
# first use, about 1.3), which on a 2-core host emulating several devices was most of a short run's time.
# Only what every device imports anyway (the pipeline and fsdp strategies add 2.5 MiB of RSS), so a
# device's measured memory is what it would be on its own; not scikit-learn (digits: the launcher loads
# it, train/__init__.py). Nothing here may start a thread or OpenMP's pool: the devices are forked from it.
DEVICE_IMPORTS = ["torch", "torch._dynamo", "torch.distributed", "edgetrain.train.loop", "edgetrain.train.pipeline",
                  "edgetrain.train.fsdp", "edgetrain.comm"]  # also idle_process_mb's baseline
_PRELOAD = ["edgetrain.cluster.fork_server", *DEVICE_IMPORTS]


@functools.lru_cache(maxsize=1)
def idle_process_mb() -> float:
    """RSS (MiB) of an idle device process, measured now: a fresh Python process that imported what the
    devices' fork server imports (``cluster.launch.DEVICE_IMPORTS``: torch, torch._dynamo, which torch's
    optimizers import on first use, and edgetrain's training code)."""
    # what imports here (an older torch lacks FSDP2: train/fsdp.py does not import, the fork server skips it too)
    code = (f"import importlib, psutil\nfor m in {DEVICE_IMPORTS!r}:\n    try: importlib.import_module(m)\n"
            f"    except ImportError: pass\nprint(psutil.Process().memory_info().rss / 2**20)")
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        return float(out.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        raise EdgetrainError("could not measure the RSS of an idle edgetrain process; "
                             "pass --runtime-mb to give the runtime baseline yourself") from None


def _device_context():
    """multiprocessing's fork server, started once per launching process with ``_PRELOAD`` imported.

    Forked from a clean, single-threaded server (not from the launcher, which may hold threads, a gloo
    store and a big model), a device starts in milliseconds instead of seconds. It gets the launcher's
    environment and stdout/stderr as they are at its start (``_child``), as a spawned process would."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def is_fork_server(process: psutil.Process) -> bool:
    """``process`` is multiprocessing's fork server or resource tracker: helpers of the launching process that
    end with it, not devices (a device, forked from the server, is the server's child)."""
    try:
        command = " ".join(process.cmdline())
        parent = process.parent()
        parent_command = " ".join(parent.cmdline()) if parent else ""
    except psutil.Error:
        return False
    return "resource_tracker" in command or ("multiprocessing.forkserver" in command
                                             and "multiprocessing.forkserver" not in parent_command)


def device_processes(launcher: psutil.Process) -> list[psutil.Process]:
    """The device processes ``launcher`` started (children of its fork server), in start order."""
    found = []
    try:
        children = launcher.children()
    except psutil.Error:
        return []
    for child in children:
        if is_fork_server(child):
            with contextlib.suppress(psutil.Error):
                found += child.children()
        else:  # started some other way (none today); kept so that a test sees it
            found.append(child)
    return sorted(found, key=lambda p: p.create_time())


def _quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (shared by the devices) with its stderr on /dev/null.

    A device that outlives its stop grace is SIGKILLed with its loader's queues still registered; the
    tracker then unlinks those semaphores, as it should, but also prints a "leaked semaphore objects"
    warning after the run's one-line error. Only that warning goes: the clean-up still happens. A tracker
    already running (an earlier run in this process) is kept as it is.
    """
    from multiprocessing import resource_tracker

    if getattr(resource_tracker._resource_tracker, "_fd", None) is not None:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@dataclass(frozen=True)
class Deadline:
    """When ``launch_local`` stops its devices: those still running ``s`` after the start (None: no deadline),
    reported in one line ending with ``fix``; the others ``failure_grace_s`` after a device failed."""
    s: float | None = None
    fix: str = "give it more time"
    failure_grace_s: float = 1.0


def launch_local(world: int, target: Callable, args: tuple, labels: list[str], log_dir: str | None = None,
                 deadline: Deadline = Deadline(), elastic: ElasticLaunch | None = None) -> list[Any]:
    """Run ``target(*args)`` in ``world`` device processes; return their results in rank order.

    A device that fails with an unexpected exception leaves its traceback in ``log_dir/device-<rank>.log``
    (without ``log_dir`` it prints it). Devices still running at the ``deadline`` are stopped and reported in
    one line.

    ``elastic``: a device whose process ends without a word (killed, unplugged) is no failure while
    ``elastic.min_devices`` remain; the ``Lighthouse`` (cluster/membership.py) tells the others, who go on
    without it, and the device is started again ``elastic.back_s`` later if set. Its result is ``None``.
    """
    try:
        pickle.dumps(args)
    except Exception as e:  # noqa: BLE001
        raise EdgetrainError(f"the model or config cannot be sent to the device processes ({e}); "
                             f"define your model class at module level of an importable file") from None
    run = _LocalDevices(world, target, args, labels, log_dir, elastic)
    try:
        _start(run.procs)
        while run.unfinished():
            run.receive()
            run.check_exits()
            if run.should_stop(deadline.failure_grace_s, deadline.s):
                break
    finally:
        run.stop()
    return run.outcome(deadline.s, deadline.fix)


class _LocalDevices:
    """``launch_local``'s device processes and what the launcher has heard of them so far."""

    def __init__(self, world: int, target: Callable, args: tuple, labels: list[str], log_dir: str | None,
                 elastic: ElasticLaunch | None):
        self.world, self.target, self.args, self.labels, self.log_dir = world, target, args, labels, log_dir
        self.elastic = elastic
        self.store, self.port = _loopback_store(world)
        self.ctx = _device_context()
        _quiet_resource_tracker()
        self.results = self.ctx.Queue()
        self.procs = [self.device(r) for r in range(world)]
        self.lighthouse = Lighthouse(self.store, world, elastic, labels) if elastic else None
        self.down: set[int] = self.lighthouse.down if self.lighthouse else set()  # lost in an elastic run
        self.restarts: dict[int, float] = {}  # elastic: device -> when to start it again
        self.elastic_end: str | None = None
        self.done: dict[int, Any] = {}
        self.failures: list[tuple[int, str, bool]] = []
        self.first_failure: float | None = None
        self.silent: dict[int, str] = {}
        self.late: list[int] = []
        self.started = time.monotonic()

    def device(self, rank: int, joining: bool = False):
        environ = {**os.environ, _DEVICE_ENV: str(os.getpid())}
        start = _Start(self.world, self.port, os.getpid(), self.target, self.args, self.results, self.log_dir)
        return self.ctx.Process(target=_child, args=(rank, start, joining, environ, _LauncherStdio()),
                                name=f"edgetrain-device-{rank}")

    def unfinished(self) -> list[int]:
        """Devices still to report; in an elastic run, of the current members (a device started again and
        not admitted yet is stopped with the rest when they are done)."""
        return [r for r in range(self.world) if r not in self.done and r not in self.down
                and (self.lighthouse is None or r in self.lighthouse.members)]

    def failed(self, rank: int) -> bool:
        return any(f[0] == rank for f in self.failures)

    def receive(self) -> None:
        try:
            kind, rank, value, clear = self.results.get(timeout=0.2)
        except queue.Empty:
            return
        if kind == "done":
            self.done[rank] = value
        else:
            self.failures.append((rank, value, clear))

    def check_exits(self) -> None:
        """A device whose process ended without its result: lost (elastic) or failed, said how."""
        for rank, p in enumerate(self.procs):
            if rank in self.done or rank in self.down or p.exitcode in (None, 0) or self.failed(rank):
                continue
            if self.lighthouse:  # ended without a word: the others go on without it
                self.elastic_end = self.elastic_end or self.lighthouse.lost(rank)
                if self.elastic.back_s is not None:
                    self.restarts[rank] = time.monotonic() + self.elastic.back_s
                continue
            # Give a dying process a moment to deliver its message.
            if self.first_failure is None or time.monotonic() - self.first_failure > 0.3:
                how = (_killed(p) if p.exitcode < 0 else _UNGUARDED_MAIN_FIX if p.exitcode == _UNGUARDED_MAIN_EXIT
                       else f"its process exited with code {p.exitcode}")
                self.failures.append((rank, how, True))

    def should_stop(self, grace_s: float, deadline_s: float | None) -> bool:
        """Whether to stop waiting: an elastic run's end, a failure's grace over, the deadline passed."""
        if self.lighthouse and not self.elastic_end:
            self.elastic_end = _membership(self.lighthouse, self.procs, self.done, self.restarts, self.device)
        if self.elastic_end:
            return True
        if self.failures and self.first_failure is None:
            self.first_failure = time.monotonic()
        if self.first_failure is not None and time.monotonic() - self.first_failure > grace_s:
            self.silent = {rank: _status(p) for rank, p in enumerate(self.procs)
                           if rank not in self.done and p.is_alive() and not self.failed(rank)}
            return True
        if deadline_s is not None and not self.failures and time.monotonic() - self.started > deadline_s:
            self.late = [r for r in range(self.world) if r not in self.done]
            return True
        missing = self.unfinished()
        if all(p.exitcode is not None for p in self.procs) and missing and not self.failures:
            # Everyone exited but a result went missing (e.g. the queue's feeder died).
            self.failures.append((missing[0], "exited without reporting a result", True))
            self.first_failure = time.monotonic() - grace_s
        return False

    def stop(self) -> None:
        lighthouse, procs = self.lighthouse, self.procs
        waiting = [p for r, p in enumerate(procs) if r not in self.done and lighthouse and r not in lighthouse.members]
        _stop([p for p in waiting if p.pid is not None], finished=False)  # started again, never admitted
        _stop([p for p in procs if p.pid is not None and p not in waiting], finished=not self.unfinished())
        self.results.close()
        self.results.join_thread()
        self.store = None  # closes the rendezvous port (the lighthouse's reference goes with this object)

    def outcome(self, deadline_s: float | None, deadline_fix: str) -> list[Any]:
        """The results in rank order, or the one line that says why there are none."""
        labels = self.labels
        if self.elastic_end:
            raise EdgetrainError(self.elastic_end)
        if self.failures:
            rank, msg = _root_cause(self.failures, self.silent)
            raise EdgetrainError(f"{labels[rank]} failed: {msg}; the other devices were stopped")
        if self.late:
            raise EdgetrainError(f"{', '.join(labels[r] for r in self.late)} did not finish within {deadline_s:g} s "
                                 f"and {'were' if len(self.late) > 1 else 'was'} stopped; {deadline_fix}")
        return [self.done.get(r) for r in range(self.world)]


def _start_fork_server() -> None:
    """multiprocessing's fork server (for ``_device_context``), spawned with SIGINT blocked, which it inherits: a
    Ctrl-C while it imports ``_PRELOAD`` (seconds) is the launcher's to handle, not a traceback of the server's
    (which ignores SIGINT only once it has imported them). Blocked, not ignored, here: a Ctrl-C in that instant
    reaches the launcher when it is unblocked."""
    from multiprocessing import forkserver

    blocked = threading.current_thread() is threading.main_thread()
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _start(procs: list) -> None:
    os.environ[_DEVICE_ENV] = str(os.getpid())  # the devices inherit the environment at start
    try:
        _start_fork_server()
        for p in procs:
            p.start()
    finally:
        del os.environ[_DEVICE_ENV]


def _membership(lighthouse: Lighthouse, procs: list, done: dict, restarts: dict[int, float],
                device: Callable) -> str | None:
    """An elastic run's turn of the launcher's loop: start lost devices again when due, let the lighthouse
    decide a generation, stop the members it left out; the run's last line if too few devices remain."""
    for rank, when in list(restarts.items()):
        if time.monotonic() >= when and len(done) == 0:  # not once the others are finishing
            del restarts[rank]
            lighthouse.restarting(rank)
            procs[rank] = device(rank, joining=True)
            _start([procs[rank]])
    left_out, end = lighthouse.poll({r for r, p in enumerate(procs) if p.is_alive() and r not in done})
    _stop([procs[r] for r in left_out], finished=False)  # their exit is then seen as lost, like any other
    return end


def _in_gloo_group(fn: Callable, args: tuple, timeout_s: float, threads: int | None) -> bytes:
    """A ``run_group`` device: join the launcher's gloo group, run ``fn``, leave; the result as bytes."""
    import torch
    import torch.distributed as dist

    if threads:
        torch.set_num_threads(threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()  # a process that exits inside a group can abort in C++ teardown
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def run_group(fn: Callable, world: int, *args: Any, timeout_s: float = 120.0, threads: int | None = 1,
              deadline_s: float | None = None, deadline_fix: str = "give it more time") -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` emulated devices in one gloo group; the return values by rank.

    ``fn`` must be importable by name (defined at module level). ``timeout_s`` bounds the rendezvous and
    every collective of the group, ``threads`` sets each device's torch threads (``None``: leave them),
    ``deadline_s`` the whole run (see ``launch_local``). A device that fails stops the others and is
    named in one ``EdgetrainError``; nothing it started is left running.
    """
    import torch

    results = launch_local(world, _in_gloo_group, (fn, args, timeout_s, threads),
                           [f"device {r}" for r in range(world)], deadline=Deadline(deadline_s, deadline_fix))
    return [torch.load(io.BytesIO(r), weights_only=False) for r in results]  # our own devices' pickles
