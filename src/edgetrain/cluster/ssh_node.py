"""What ``edgetrain launch`` runs on each host: torchrun under a watcher that stops it when the launcher hangs up.

Run as ``python -m edgetrain.cluster.ssh_node [--workdir DIR] [--grace S] -- TORCHRUN_ARGS...`` in the
SSH session the launcher opened (``edgetrain.ssh_launch``). Protocol on the session's streams:

1. stdin, first line: a JSON object of environment variables for torchrun and its workers (the host's
   ``env:`` from hosts.yaml and ``EDGETRAIN_CLUSTER_TOKEN``). The token travels here, not on the command
   line, so that ``ps`` on the host does not show it. The line must arrive within ``_FIRST_LINE_S``.
2. Then ``python -m torch.distributed.run TORCHRUN_ARGS`` starts in its own process group, with this
   session's stdout and stderr, which the launcher prints with a ``[host]`` prefix.
3. stdin's end (the launcher closed it to stop the run, or its connection dropped: the launcher was
   killed or the network went) or SIGTERM/SIGHUP/SIGINT here: torchrun gets SIGTERM, which it passes on
   to its workers (its own shutdown, 30 s at most); after ``--grace`` seconds whatever is left of torchrun
   and every process under it is SIGKILLed. The workers run in sessions of their own (torchrun starts
   them so), which is why they are found by parentage (psutil, looked up every ``_POLL_S``) and not by
   process group; the same list lets a torchrun that was killed outright (its workers orphaned) be
   cleaned up after.
4. This process exits with torchrun's exit code, or ``128 + signal`` if torchrun was killed by one (the
   launcher reads a code above 128 as "the host's process dropped"), or ``EXIT_HUNG_UP`` when it stopped
   torchrun because stdin ended.

Why a watcher rather than relying on SSH: without a terminal, sshd does not signal the command when the
session closes, so a launcher that vanished would leave torchrun training on every host.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import threading

import psutil

EXIT_HUNG_UP = 129  # 128 + SIGHUP: what a terminal's hang-up would have given
_FIRST_LINE_S = 30.0
_POLL_S = 0.2


def _read_environment() -> dict[str, str]:
    """The first stdin line, a JSON object of strings; waited for at most ``_FIRST_LINE_S``."""
    ready, _, _ = select.select([sys.stdin.buffer], [], [], _FIRST_LINE_S)
    line = sys.stdin.buffer.readline() if ready else b""
    env = json.loads(line or b"null")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise SystemExit(f"edgetrain ssh_node: expected a JSON object of environment variables on the first "
                         f"line of stdin within {_FIRST_LINE_S:.0f} s")
    return env


def _descendants(agent: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(agent.pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill_all(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.kill()  # psutil checks that the pid still is that process, so a reused pid is safe
        except psutil.Error:
            pass


def _stop_tree(agent: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM torchrun (it stops its workers), then SIGKILL what is left of it and its descendants."""
    tree = _descendants(agent)
    agent.terminate()
    try:
        agent.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        tree += _descendants(agent)  # workers restarted since the first look
        agent.kill()
    _kill_all(tree)
    agent.wait(timeout=grace_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgetrain.cluster.ssh_node")
    parser.add_argument("--workdir", help="directory to run torchrun in (default: the login directory)")
    parser.add_argument("--grace", type=float, default=15.0, help="seconds torchrun gets to stop before SIGKILL")
    parser.add_argument("torchrun_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    torchrun_args = args.torchrun_args[1:] if args.torchrun_args[:1] == ["--"] else args.torchrun_args
    env = dict(os.environ, **_read_environment())
    if args.workdir:
        os.chdir(os.path.expanduser(args.workdir))

    hung_up = threading.Event()

    def watch_stdin() -> None:
        # os.read, not sys.stdin: a daemon thread blocked in a buffered read aborts the interpreter's exit
        while os.read(sys.stdin.fileno(), 4096):
            pass
        hung_up.set()

    def on_signal(signum, frame) -> None:
        hung_up.set()

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)
    threading.Thread(target=watch_stdin, daemon=True).start()
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *torchrun_args], env=env,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    workers: list[psutil.Process] = []
    while agent.poll() is None and not hung_up.wait(_POLL_S):
        workers = _descendants(agent) or workers  # known in case torchrun dies without stopping them
    if agent.poll() is None:
        _stop_tree(agent, args.grace)
        return EXIT_HUNG_UP
    _kill_all(workers)  # a torchrun that was killed (SIGKILL, OOM killer) leaves its workers running
    return agent.returncode if agent.returncode >= 0 else 128 - agent.returncode


if __name__ == "__main__":
    sys.exit(main())
