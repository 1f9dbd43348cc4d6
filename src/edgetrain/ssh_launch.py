"""``edgetrain launch --hosts hosts.yaml -- train ...``: start a real cluster's devices from one machine over SSH.

Design: docs/design/launch.md ("Real hosts over SSH").
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import difflib
import getpass
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import secrets
import shlex
import signal
import sys
from typing import Any

from edgetrain.arguments import non_negative_int, positive_float, positive_int
from edgetrain.cli import build_parser
from edgetrain.config import FIELDS, load_config
from edgetrain.errors import EdgetrainError, Terminated
from edgetrain.yamlfile import read_yaml_mapping

# Imported inside functions: asyncssh (the ssh extra; only the launching machine needs it) and edgetrain.cluster.peers
# (torch), so that the commands answer --help and bad input without them.

NODE_MODULE = "edgetrain.cluster.ssh_node"
DEFAULT_RDZV_PORT = 29400  # torchrun's own default for the c10d endpoint
_STOP_GRACE_S = 15.0  # ssh_node's wait for torchrun to stop before SIGKILL
_STOP_MARGIN_S = 10.0  # on top of it: the session's own exit and the network
# SSH keepalives: a host cut off the network (its link down, no FIN or RST) is noticed after about
# _KEEPALIVE_S x _KEEPALIVE_COUNT seconds rather than TCP's own keepalive (two hours by default).
_KEEPALIVE_S = 5.0
_KEEPALIVE_COUNT = 3
_PROBE_S = 30.0  # on top of --connect-timeout: the host's python starting and reading package metadata
# torchrun's agents share their rendezvous store with the workers by default, but then a node that joins in a
# later round (a host started again) waits for the round's MASTER_ADDR key, which a rank 0 that joined earlier
# never publishes again: the rendezvous times out (torch 2.13, dynamic_rendezvous.next_rendezvous). Without the
# sharing, rank 0 publishes a fresh address every round and its worker serves the store. A host's env: wins.
_TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# The launch options a resume repeats when they are not at their default (--hosts and --run-id it always gives).
_REPEATED_OPTIONS = ("min_hosts", "max_restarts", "rdzv_port", "rdzv_timeout", "rdzv_last_call", "rdzv_keepalive",
                     "connect_timeout")
# What a stopped run's rank 0 prints (train/checkpoint.py, resume_hint): the checkpoint, and its run directory.
_CHECKPOINT_WRITTEN = re.compile(r"checkpoint of step (\d+) written; resume with: edgetrain train --resume (.+)$")
# Checked on each host before anything starts: its versions, and whether it has the node module.
_PROBE = ("import importlib.metadata as m, importlib.util as u, json; "
          "print(json.dumps([m.version('edgetrain'), m.version('torch'), u.find_spec('%s') is not None]))"
          % NODE_MODULE)


@dataclasses.dataclass(frozen=True)
class HostSpec:
    """One entry of hosts.yaml, checked; ``name`` prefixes the host's output."""
    name: str
    address: str
    port: int = 22
    user: str | None = None  # None: this machine's user name (as ssh does)
    key: str | None = None  # None: the SSH agent and ~/.ssh's default keys
    known_hosts: str | None = None  # None: ~/.ssh/known_hosts
    python: str = "python3"
    devices: int = 1
    workdir: str | None = None  # None: the login directory
    env: tuple[tuple[str, str], ...] = ()

    @property
    def where(self) -> str:
        return f"{self.user or getpass.getuser()}@{self.address}:{self.port}"


_HOST_KEYS = {"name": str, "address": str, "port": int, "user": str, "key": str, "known_hosts": str,
              "python": str, "devices": int, "workdir": str, "env": dict}


def load_hosts(path: str | os.PathLike) -> list[HostSpec]:
    """hosts.yaml as ``HostSpec``s: a list under ``hosts:``, each entry an address or a mapping of
    ``_HOST_KEYS``, with ``defaults:`` under them. Every problem is one line naming the entry and the fix."""
    data = read_yaml_mapping(path, "hosts file")
    for key in data:
        if key not in ("hosts", "defaults"):
            raise EdgetrainError(f"hosts file {path}: unknown key '{key}'; it takes 'hosts' (the list of hosts) "
                                 f"and 'defaults' (keys every host gets)")
    entries = data.get("hosts")
    if not isinstance(entries, list) or not entries:
        raise EdgetrainError(f"hosts file {path} needs 'hosts:', a list of at least one host "
                             f"(an address, or a mapping with 'address:')")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise EdgetrainError(f"hosts file {path}: 'defaults' must be a mapping of host keys, "
                             f"not a {type(defaults).__name__}")
    _check_keys(defaults, f"hosts file {path}, defaults")
    hosts = []
    for index, entry in enumerate(entries, 1):
        entry = {"address": entry} if isinstance(entry, str) else entry
        where = f"hosts file {path}, host {index}"
        if not isinstance(entry, dict):
            raise EdgetrainError(f"{where} must be an address or a mapping with 'address:', not {entry!r}")
        where += f" ({entry.get('name') or entry.get('address')})"
        _check_keys(entry, where)
        hosts.append(_host(dict(defaults, **entry), where))
    names = [h.name for h in hosts]
    for name in names:
        if names.count(name) > 1:
            raise EdgetrainError(f"hosts file {path}: two hosts are named '{name}' (an address and port "
                                 f"appears twice, or a 'name:' does); give each a 'name:' of its own")
    return hosts


def _check_keys(entry: dict, where: str) -> None:
    for key, value in entry.items():
        if key not in _HOST_KEYS:
            close = difflib.get_close_matches(str(key), _HOST_KEYS, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(_HOST_KEYS)}"
            raise EdgetrainError(f"{where}: unknown key '{key}'; {hint}")
        wanted = _HOST_KEYS[key]
        if wanted is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise EdgetrainError(f"{where}: '{key}' must be a whole number, not {value!r}")
        if wanted is str and (not isinstance(value, (str, int, float)) or isinstance(value, bool) or value == ""):
            raise EdgetrainError(f"{where}: '{key}' must be a non-empty string, not {value!r}")
        if wanted is dict and not isinstance(value, dict):
            raise EdgetrainError(f"{where}: 'env' must be a mapping of variable names to values, not {value!r}")


def _host(entry: dict, where: str) -> HostSpec:
    if "address" not in entry:
        raise EdgetrainError(f"{where}: 'address' is missing; give the host's name or IP address")
    text = {k: os.path.expanduser(str(v)) if k in ("key", "known_hosts") else str(v)
            for k, v in entry.items() if _HOST_KEYS[k] is str}
    port, devices = entry.get("port", 22), entry.get("devices", 1)
    if not 1 <= port <= 65535:
        raise EdgetrainError(f"{where}: 'port' must be 1..65535, not {port}")
    if devices < 1:
        raise EdgetrainError(f"{where}: 'devices' must be >= 1 (torchrun's processes on that host), not {devices}")
    for key in ("key", "known_hosts"):
        if key in text and not os.access(text[key], os.R_OK):
            raise EdgetrainError(f"{where}: '{key}' file {text[key]} does not exist or cannot be read here; "
                                 f"give the path of a readable file on this machine")
    env = entry.get("env", {})
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise EdgetrainError(f"{where}: env name {name!r} is not a variable name (letters, digits, _)")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise EdgetrainError(f"{where}: env {name} must be a string or number, not {value!r}")
    address = text["address"]
    name = text.get("name") or (address if port == 22 else f"{address}:{port}")
    return HostSpec(name=name, address=address, port=port, user=text.get("user"), key=text.get("key"),
                    known_hosts=text.get("known_hosts"), python=text.get("python", "python3"), devices=devices,
                    workdir=text.get("workdir"), env=tuple((k, str(v)) for k, v in env.items()))


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """The options of ``edgetrain launch``, checked, with the train command that every host runs."""
    hosts: tuple[HostSpec, ...]
    train_flags: tuple[str, ...]
    cluster_token: str
    min_hosts: int
    max_restarts: int
    rdzv_port: int
    rdzv_timeout: float
    connect_timeout: float
    run_id: str
    rdzv_last_call: float = 30.0  # torchrun's own default for last_call_timeout
    rdzv_keepalive: float = 5.0  # torchrun's own default for keep_alive_interval
    # What a resume repeats: the hosts file and the train command as given, the launch options not at their default
    hosts_file: str = "hosts.yaml"
    command: tuple[str, ...] = ("train",)
    options: tuple[str, ...] = ()


def train_flags(cfg) -> list[str]:
    """``cfg`` (a resolved ``TrainConfig``) as ``edgetrain train`` flags: the keys that differ from their
    defaults, less the token (it goes on stdin) and ``devices`` (torchrun sets the world size)."""
    flags = []
    for name, value in cfg.to_dict().items():
        if value == FIELDS[name].default or name in ("cluster_token", "cluster_token_file", "devices"):
            continue
        flag = name.replace("_", "-")
        flags.append((f"--{flag}" if value else f"--no-{flag}") if isinstance(value, bool) else f"--{flag}={value}")
    return flags


def plan_launch(args: argparse.Namespace) -> LaunchSpec:
    """The launch, validated before any connection: hosts.yaml, the options and the train command."""
    from edgetrain.cluster.peers import cluster_token

    hosts = load_hosts(args.hosts)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if command[:1] != ["train"]:
        given = f"not {shlex.join(command)!r}" if command else "and none was given"
        raise EdgetrainError(f"edgetrain launch runs a train command on the hosts, {given}; write it after --, "
                             f"as in: edgetrain launch --hosts {args.hosts} -- train --epochs 5")
    train_args = build_parser().parse_args(command)
    overrides = {k: v for k, v in vars(train_args).items() if k in FIELDS}
    # As the hosts will see it: torchrun's world is every device of every host (the tiled grid is checked on it).
    overrides["devices"] = sum(h.devices for h in hosts)
    cfg = load_config(train_args.config, **overrides)
    min_hosts = args.min_hosts or len(hosts)
    if min_hosts > len(hosts):
        raise EdgetrainError(f"--min-hosts {min_hosts} is more than the {len(hosts)} host(s) in {args.hosts}; "
                             f"give at most {len(hosts)}")
    if not 1 <= args.rdzv_port <= 65535:
        raise EdgetrainError(f"--rdzv-port must be 1..65535, not {args.rdzv_port}")
    token = cluster_token(cfg.cluster_token, cfg.cluster_token_file, os.environ) or secrets.token_hex(16)
    defaults = vars(build_parser().parse_args(["launch", "--hosts", args.hosts]))
    options = tuple(f"--{name.replace('_', '-')}={getattr(args, name)}" for name in _REPEATED_OPTIONS
                    if getattr(args, name) != defaults[name])
    return LaunchSpec(tuple(hosts), tuple(train_flags(cfg)), token, min_hosts, args.max_restarts, args.rdzv_port,
                      args.rdzv_timeout, args.connect_timeout, args.run_id or f"edgetrain-{secrets.token_hex(4)}",
                      args.rdzv_last_call, args.rdzv_keepalive, args.hosts, tuple(command), options)


def resume_command(spec: LaunchSpec) -> str:
    """The launch that continues this one from its newest checkpoint: the same hosts, options and train command
    (its --checkpoint-every and --output), and the same run id, from which each host's torchrun finds the run
    directory (train/checkpoint.py, "torchrun restarts")."""
    return shlex.join(["edgetrain", "launch", "--hosts", spec.hosts_file, *spec.options, "--run-id", spec.run_id,
                       "--", *spec.command])


def _endpoint(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def node_command(spec: LaunchSpec, index: int) -> str:
    """The shell command that starts host ``index``'s share of the run (its environment goes on stdin)."""
    host, first = spec.hosts[index], spec.hosts[0]
    nnodes = str(len(spec.hosts)) if spec.min_hosts == len(spec.hosts) else f"{spec.min_hosts}:{len(spec.hosts)}"
    torchrun = ["--nnodes", nnodes, "--nproc-per-node", str(host.devices), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", _endpoint(first.address, spec.rdzv_port), "--rdzv-id", spec.run_id,
                "--rdzv-conf", f"is_host={int(index == 0)},join_timeout={math.ceil(spec.rdzv_timeout)},"
                                f"last_call_timeout={math.ceil(spec.rdzv_last_call)},"
                                f"keep_alive_interval={math.ceil(spec.rdzv_keepalive)}",
                "--max-restarts", str(spec.max_restarts), "--local-addr", host.address,
                "-m", "edgetrain", "train", *spec.train_flags]
    workdir = ["--workdir", host.workdir] if host.workdir else []
    return shlex.join([host.python, "-m", NODE_MODULE, *workdir, "--grace", str(_STOP_GRACE_S), "--", *torchrun])


def describe_exit(code: int | None, signal_name: str | None) -> str:
    if signal_name:
        return f"its process was killed by SIG{signal_name}"
    if code is None:
        return "its SSH connection was lost"
    if code > 128 and code - 128 in signal.Signals._value2member_map_:
        return f"its process was killed by {signal.Signals(code - 128).name}"
    return f"torchrun exited with code {code}"


def dropped(code: int | None, signal_name: str | None) -> bool:
    """A host whose process was killed or lost (worth starting again), not one whose torchrun gave up."""
    return signal_name is not None or code is None or code > 128


def after_exit(spec: LaunchSpec, index: int, restarts: int, code: int | None, signal_name: str | None,
               others_running: int, finished: bool = False) -> str:
    """What to do when host ``index``'s process ended: "done", "restart", "leave out" or "fail" (the rules
    of docs/design/launch.md's step 4). ``finished``: another host's torchrun already exited 0, so the run
    is complete (torchrun succeeds only then): a host dropped now is left out, not restarted or blamed."""
    if code == 0 and signal_name is None:
        return "done"
    if finished and dropped(code, signal_name):
        return "leave out"
    if not dropped(code, signal_name) or index == 0:  # torchrun gave up, or the rendezvous store went with it
        return "fail"
    if restarts < spec.max_restarts:
        return "restart"
    return "leave out" if others_running >= spec.min_hosts else "fail"


class _Host:
    """One host's SSH connection and the run's process on it (restarted in place)."""

    def __init__(self, spec: LaunchSpec, index: int):
        self.spec, self.index, self.host = spec, index, spec.hosts[index]
        self.conn = None
        self.process = None
        self.last_error = ""
        self.restarts = 0
        self.quiet = False
        self.checkpoint: tuple[int, str] | None = None  # (step, run directory) its rank 0 said it stopped with

    async def connect(self) -> None:
        import asyncssh

        h = self.host
        options: dict[str, Any] = dict(port=h.port, username=h.user or getpass.getuser(),
                                       connect_timeout=self.spec.connect_timeout, keepalive_interval=_KEEPALIVE_S,
                                       keepalive_count_max=_KEEPALIVE_COUNT)
        if h.key:
            options["client_keys"] = [h.key]
        if h.known_hosts:
            options["known_hosts"] = h.known_hosts
        try:
            self.conn = await asyncio.wait_for(asyncssh.connect(h.address, **options), self.spec.connect_timeout + 5)
        except (OSError, asyncssh.Error, asyncio.TimeoutError, ValueError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise EdgetrainError(f"cannot connect to host {h.name} ({h.where}): {reason}; check its address, "
                                 f"port, user, key and known_hosts in the hosts file, or raise "
                                 f"--connect-timeout") from None

    async def probe(self) -> tuple[str, str]:
        """(edgetrain, torch) versions of the host's python; one line if it cannot start the node module."""
        import asyncssh

        h = self.host
        try:
            result = await asyncio.wait_for(self.conn.run(shlex.join([h.python, "-c", _PROBE])),
                                            self.spec.connect_timeout + _PROBE_S)
        except (OSError, asyncssh.Error, asyncio.TimeoutError) as e:
            raise EdgetrainError(f"host {h.name}: checking its edgetrain failed ({str(e) or type(e).__name__}); "
                                 f"check that the host answers, or raise --connect-timeout") from None
        try:
            edgetrain_version, torch_version, has_node = json.loads(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError, TypeError):
            detail = (result.stderr or "").strip().splitlines()
            raise EdgetrainError(f"host {h.name}: {h.python} cannot import edgetrain and torch "
                                 f"(exit {result.exit_status}: {detail[-1] if detail else 'no output'}); install "
                                 f"edgetrain there or set 'python:' in the hosts file to the interpreter that has "
                                 f"it") from None
        if not has_node:
            raise EdgetrainError(f"host {h.name}: its edgetrain {edgetrain_version} has no {NODE_MODULE}; "
                                 f"install this version of edgetrain there")
        return edgetrain_version, torch_version

    async def start(self) -> None:
        env = dict(_TORCHRUN_ENV, **dict(self.host.env), EDGETRAIN_CLUSTER_TOKEN=self.spec.cluster_token)
        self.process = await self.conn.create_process(node_command(self.spec, self.index), encoding="utf-8",
                                                      errors="replace")
        self.process.stdin.write(json.dumps(env) + "\n")

    async def run(self) -> tuple[int | None, str | None]:
        """Start the host's process, print its output with its prefix; (exit code, signal name) when it ends."""
        import asyncssh

        try:
            if self.conn is None:
                await self.connect()
            await self.start()
            await asyncio.gather(self._relay(self.process.stdout, sys.stdout),
                                 self._relay(self.process.stderr, sys.stderr))
            await self.process.wait_closed()
        except (OSError, asyncssh.Error, EdgetrainError) as e:
            self.last_error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self.close()
            return None, None
        exit_signal = self.process.exit_signal
        if self.process.exit_status is None and exit_signal is None:  # the channel closed without an exit
            self.close()
        return self.process.exit_status, exit_signal[0] if exit_signal else None

    async def _relay(self, stream, out) -> None:
        async for line in stream:
            line = line.rstrip("\n")
            written = _CHECKPOINT_WRITTEN.search(line)
            if written:
                self.checkpoint = int(written.group(1)), written.group(2).strip()
            if self.quiet:  # stopping: torchrun's and the workers' shutdown reports are not shown
                continue
            if line.strip():
                self.last_error = line.strip()
            print(f"[{self.host.name}] {line}", file=out, flush=True)

    async def stop(self) -> None:
        """Close the process's stdin (ssh_node stops torchrun), wait for it (bounded), then hang up."""
        if self.process is not None and self.process.exit_status is None:
            with contextlib.suppress(Exception):
                self.process.stdin.write_eof()
                await asyncio.wait_for(self.process.wait_closed(), _STOP_GRACE_S + _STOP_MARGIN_S)
        self.close()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _say(text: str) -> None:
    print(f"edgetrain: {text}", file=sys.stderr, flush=True)


async def _launch(spec: LaunchSpec) -> None:
    hosts = [_Host(spec, i) for i in range(len(spec.hosts))]
    stop_reason: asyncio.Future = asyncio.get_running_loop().create_future()
    loop = asyncio.get_running_loop()
    for sig, exc in ((signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated)):
        with contextlib.suppress(ValueError, RuntimeError):  # not the main thread: the caller handles signals
            loop.add_signal_handler(sig, lambda e=exc: stop_reason.done() or stop_reason.set_result(e))
    running: dict[asyncio.Task, _Host] = {}
    stopped_by: BaseException | None = None
    try:
        _say(f"connecting to {len(hosts)} host(s): {', '.join(h.host.where for h in hosts)}")
        await _first_of(_on_every_host([h.connect() for h in hosts]), stop_reason)
        versions = await _first_of(_on_every_host([h.probe() for h in hosts]), stop_reason)
        _check_versions(hosts, versions)
        first = spec.hosts[0]
        _say(f"starting torchrun on {', '.join(f'{h.name} ({h.devices} device(s))' for h in spec.hosts)}; "
             f"c10d rendezvous at {_endpoint(first.address, spec.rdzv_port)}, run id {spec.run_id}")
        running = {asyncio.ensure_future(h.run()): h for h in hosts}
        finished = False
        while running:
            done, _ = await asyncio.wait([*running, stop_reason], return_when=asyncio.FIRST_COMPLETED)
            if stop_reason in done:
                raise stop_reason.result()()
            for task in done:
                host = running.pop(task)
                code, signal_name = task.result()
                why = describe_exit(code, signal_name)
                action = after_exit(spec, host.index, host.restarts, code, signal_name, len(running), finished)
                finished = finished or action == "done"
                if action == "restart":
                    host.restarts += 1
                    _say(f"host {host.host.name} dropped ({why}); starting it again "
                         f"(restart {host.restarts} of {spec.max_restarts})")
                    running[asyncio.ensure_future(host.run())] = host
                elif action == "leave out" and finished:
                    _say(f"host {host.host.name} dropped ({why}) after the run finished on the others")
                elif action == "leave out":
                    _say(f"host {host.host.name} dropped ({why}); going on with the other {len(running)} "
                         f"host(s) (--min-hosts {spec.min_hosts})")
                elif action == "fail":
                    last = f" (last line: {host.last_error})" if host.last_error else ""
                    raise EdgetrainError(f"host {host.host.name} failed: {why}{last}; the other hosts were stopped")
    except (KeyboardInterrupt, Terminated, EdgetrainError) as stop:
        stopped_by = stop
        raise
    finally:
        # Ctrl-C, SIGTERM or a host's failure: the one line that says why is the launcher's (or the failed
        # host's last line, quoted in it); the stopped hosts' tracebacks (torchrun's SignalException, the
        # workers' failed collectives: about 75 lines on three hosts) are not.
        for h in hosts:
            h.quiet = True
        await asyncio.gather(*(h.stop() for h in hosts))
        if running:  # what the hosts said as they stopped, to its end (a checkpoint written), then no more
            await asyncio.wait(running, timeout=_STOP_MARGIN_S)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if stopped_by is not None:
            _with_resume_command(stopped_by, spec, hosts)


def _with_resume_command(stop: BaseException, spec: LaunchSpec, hosts: list[_Host]) -> None:
    """A run that stopped with a checkpoint says how to go on, as a local run does: in the error's line, after
    "terminated", or (Ctrl-C) on the line before "interrupted". Raises the stop's exception with it."""
    said = [h for h in hosts if h.checkpoint]
    if not said:
        return
    host = max(said, key=lambda h: h.checkpoint[0])  # the newest, if a restart of the run stopped with one too
    step, run_dir = host.checkpoint
    shared = " (any host may be rank 0 on resuming: each needs that directory, e.g. a shared --output)" \
        if len(hosts) > 1 else ""
    hint = (f"checkpoint of step {step} written in {run_dir} on host {host.host.name}{shared}; resume with: "
            f"{resume_command(spec)}")
    if isinstance(stop, Terminated):
        raise Terminated(hint) from None
    if isinstance(stop, EdgetrainError):
        raise EdgetrainError(f"{stop}; {hint}") from None
    _say(hint)


async def _on_every_host(steps: list) -> list:
    """Run one step on every host at once; if some fail, raise the first host's error (in hosts.yaml order)."""
    results = await asyncio.gather(*steps, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


async def _first_of(work: asyncio.Future, stop_reason: asyncio.Future):
    """``work``'s result, unless a stop signal comes first (then its exception; ``work`` is cancelled)."""
    work = asyncio.ensure_future(work)
    await asyncio.wait([work, stop_reason], return_when=asyncio.FIRST_COMPLETED)
    if not work.done():
        work.cancel()
        raise stop_reason.result()()
    return work.result()


def _check_versions(hosts: list[_Host], versions: list[tuple[str, str]]) -> None:
    mine = {"edgetrain": importlib.metadata.version("edgetrain") if _installed("edgetrain") else None,
            "torch": importlib.metadata.version("torch") if _installed("torch") else None}
    for host, (edgetrain_version, torch_version) in zip(hosts, versions):
        theirs = {"edgetrain": edgetrain_version, "torch": torch_version}
        differing = [f"{name} {theirs[name]} (here {mine[name]})" for name in theirs
                     if mine[name] and theirs[name] != mine[name]]
        if differing:
            _say(f"host {host.host.name} has {' and '.join(differing)}; the run goes on if the hosts agree "
                 f"with each other")


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def register(sub) -> None:
    p = sub.add_parser("launch", help="start a train command on the hosts of a real cluster over SSH (torchrun)",
                       description="Start `edgetrain train` under torchrun on every host of hosts.yaml over SSH, "
                                   "print each host's output with a [host] prefix, stop all on Ctrl-C. Example: "
                                   "edgetrain launch --hosts hosts.yaml -- train --epochs 5",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hosts", metavar="FILE", required=True, help="YAML file listing the hosts (see docs/how-to/launch.md)")
    p.add_argument("--min-hosts", type=positive_int, default=None,
                   help="elastic: train on as few as this many hosts (torchrun --nnodes MIN:N; default: all)")
    p.add_argument("--max-restarts", type=non_negative_int, default=0,
                   help="times torchrun restarts failed workers, and times a dropped host is started again")
    p.add_argument("--rdzv-port", type=positive_int, default=DEFAULT_RDZV_PORT,
                   help="port of the c10d rendezvous store on the first host")
    p.add_argument("--rdzv-timeout", type=positive_float, default=120.0,
                   help="seconds torchrun waits for the hosts to meet (join_timeout)")
    p.add_argument("--rdzv-last-call", type=positive_float, default=30.0,
                   help="with --min-hosts: seconds torchrun waits for the other hosts once the minimum has met, "
                        "before it trains without them (last_call_timeout); each regrouping after a lost host waits "
                        "this long")
    p.add_argument("--rdzv-keepalive", type=positive_float, default=5.0,
                   help="seconds between torchrun's rendezvous heartbeats (keep_alive_interval): a host whose torchrun "
                        "died is dropped from the rendezvous after 3 missed ones, and the others regroup only then")
    p.add_argument("--connect-timeout", type=positive_float, default=10.0, help="seconds to wait for each SSH connection")
    p.add_argument("--run-id", help="rendezvous id of the run (default: a fresh random one)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- train [train flags]: what every host runs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("asyncssh") is None:
        raise EdgetrainError("edgetrain launch needs the asyncssh package, which is not installed; "
                             "pip install edgetrain[ssh] (or pip install asyncssh)")
    spec = plan_launch(args)
    asyncio.run(_launch(spec))
    return 0
