"""``edgetrain launch`` over SSH: hosts.yaml validation, a 2-host run and Ctrl-C against an SSH server on 127.0.0.1.

The server is asyncssh's, in a thread of the test: two ports are two "hosts". It runs each command as
sshd does without a terminal: in a shell of its own session, the channel's stdin, stdout and stderr piped
through, stdin closed when the channel closes.
"""
import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import yaml

from edgetrain.cli import build_parser, main
from edgetrain.cluster.launch import _loopback_interface, free_port, is_fork_server
from edgetrain.ssh_launch import HostSpec, LaunchSpec, after_exit, load_hosts, node_command, train_flags
from edgetrain.config import FIELDS, load_config
from edgetrain.errors import EdgetrainError
from edgetrain_testing import run_cli

TRAIN = ["train", "--batch-size", "16", "--no-progress", "--no-eval", "--no-throttle", "--timeout", "30"]


async def _serve_command(process) -> None:
    shell = await asyncio.create_subprocess_shell(process.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                  stderr=subprocess.PIPE, start_new_session=True)

    async def pump_in():
        with contextlib.suppress(Exception):
            while chunk := await process.stdin.read(4096):
                shell.stdin.write(chunk)
                await shell.stdin.drain()
        shell.stdin.close()  # the channel closed: the command sees its stdin end, as under sshd

    async def pump_out(source, sink):
        while chunk := await source.read(4096):
            with contextlib.suppress(Exception):
                sink.write(chunk)

    feeding = asyncio.ensure_future(pump_in())
    await asyncio.gather(pump_out(shell.stdout, process.stdout), pump_out(shell.stderr, process.stderr))
    code = await shell.wait()
    feeding.cancel()
    if code < 0:
        process.exit_with_signal(signal.Signals(-code).name[3:])
    else:
        process.exit(code)


@pytest.fixture(scope="module")
def ssh_hosts(tmp_path_factory):
    """Two SSH servers on 127.0.0.1 and the files a hosts.yaml needs: (ports, client key, known_hosts)."""
    asyncssh = pytest.importorskip("asyncssh")
    keys = tmp_path_factory.mktemp("ssh")
    host_key, client_key = asyncssh.generate_private_key("ssh-ed25519"), asyncssh.generate_private_key("ssh-ed25519")
    client_key.write_private_key(str(keys / "id_ed25519"))
    client_key.write_public_key(str(keys / "authorized_keys"))
    loop = asyncio.new_event_loop()
    started = threading.Event()
    servers = []

    async def start():
        for _ in range(2):
            servers.append(await asyncssh.create_server(
                asyncssh.SSHServer, "127.0.0.1", 0, server_host_keys=[host_key],
                authorized_client_keys=str(keys / "authorized_keys"), process_factory=_serve_command,
                encoding=None))
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert started.wait(30)
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    public = host_key.export_public_key().decode().strip()
    (keys / "known_hosts").write_text("".join(f"[127.0.0.1]:{p} {public}\n" for p in ports))
    yield ports, keys / "id_ed25519", keys / "known_hosts"

    async def shutdown():
        for server in servers:
            server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(shutdown(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def hosts_file(tmp_path, ssh_hosts, **extra) -> str:
    ports, key, known_hosts = ssh_hosts
    defaults = dict(address="127.0.0.1", user="edge", key=str(key), known_hosts=str(known_hosts),
                    python=sys.executable, env={"GLOO_SOCKET_IFNAME": _loopback_interface() or "lo"})
    defaults.update(extra)
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump({"defaults": defaults,
                                    "hosts": [{"name": "a", "port": ports[0]}, {"name": "b", "port": ports[1]}]}))
    return str(path)


def launch_args(hosts: str, *train: str) -> list[str]:
    return ["launch", "--hosts", hosts, "--rdzv-port", str(free_port()), "--connect-timeout", "5",
            "--rdzv-timeout", "60", "--", *TRAIN, *train]


def leftovers() -> list[str]:
    """Processes this test process started through the SSH servers that are still there."""
    names = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(p.cmdline())
            if ("edgetrain" in cmd or "torch.distributed.run" in cmd) and not is_fork_server(p):  # this test process's
                names.append(f"{p.pid} {cmd[:120]}")
    return names


def wait_for_no_leftovers(timeout_s: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    return leftovers()


@pytest.mark.slow
def test_two_hosts_train_and_print_with_their_prefix(tmp_path, ssh_hosts):
    out = tmp_path / "runs"
    r = run_cli(*launch_args(hosts_file(tmp_path, ssh_hosts), "--steps", "3", "--output", str(out),
                             "--run-name", "ssh"), timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "ssh" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["devices"] == 2
    assert any(line.startswith(("[a] ", "[b] ")) and "samples/s" in line for line in r.stdout.splitlines()), r.stdout
    assert "edgetrain: connecting to 2 host(s)" in r.stderr
    assert wait_for_no_leftovers() == []


def start_long_launch(tmp_path, ssh_hosts, *options: str, train: tuple[str, ...] = ()) -> subprocess.Popen:
    """A launch (with ``options``, its train command with ``train``) of a long run on hosts a and b; returned once
    both hosts' workers are up."""
    args = launch_args(hosts_file(tmp_path, ssh_hosts), "--epochs", "1000", "--output", str(tmp_path / "runs"), *train)
    launcher = subprocess.Popen([sys.executable, "-m", "edgetrain", args[0], *options, *args[1:]],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not steps_written(tmp_path / "runs") and time.monotonic() < deadline and launcher.poll() is None:
        time.sleep(0.5)
    if not steps_written(tmp_path / "runs"):
        launcher.kill()
        pytest.fail(f"the run did not start training: launcher exit {launcher.poll()}")
    return launcher


def steps_written(output, runs: int = 1) -> bool:
    """Whether the ``runs``-th run directory under ``output`` has rank 0's record of a step (it trains)."""
    made = sorted(output.iterdir()) if output.is_dir() else []
    metrics = made[runs - 1] / "metrics-0.jsonl" if len(made) >= runs else None
    return metrics is not None and metrics.is_file() and metrics.read_text().count("\n") >= 1


def stop_launch(launcher: subprocess.Popen, sig: signal.Signals) -> tuple[int, list[str]]:
    """Send ``sig`` to a running launch: (its exit code, its stderr's lines)."""
    try:
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    return launcher.returncode, err.splitlines()


@pytest.mark.slow
def test_sigterm_or_ctrl_c_stops_every_host_and_the_printed_command_resumes_the_run(tmp_path, ssh_hosts):
    """SIGTERM stops a launch with checkpoints: every host stops, and the last line says where the checkpoint
    is and the launch that continues the run; that launch, run as printed, goes on from the checkpoint in the
    same run directory, and Ctrl-C stops it the same way (its line just before "interrupted")."""
    launcher = start_long_launch(tmp_path, ssh_hosts, train=("--checkpoint-every", "2"))
    code, lines = stop_launch(launcher, signal.SIGTERM)
    assert code == 143, lines[-20:]
    assert lines[-1].startswith("edgetrain: terminated (SIGTERM); the run was stopped; checkpoint of step"), lines[-5:]
    step, run_dir, command = check_resume_command(lines[-1], lines, tmp_path / "runs")
    assert wait_for_no_leftovers() == []

    resumed = subprocess.Popen([sys.executable, "-m", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)  # "edgetrain launch ...", as printed
    deadline = time.monotonic() + 120
    while not steps_after(run_dir, step) and time.monotonic() < deadline and resumed.poll() is None:
        time.sleep(0.5)
    code, lines = stop_launch(resumed, signal.SIGINT)
    assert code == 130 and lines[-1] == "edgetrain: interrupted (SIGINT); the run was stopped", lines[-20:]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run_dir.name]
    membership = [json.loads(line) for line in (run_dir / "membership.jsonl").read_text().splitlines()]
    assert [(m["cause"], m["step"]) for m in membership] == [("torchrun restart", step)], membership
    again, _, _ = check_resume_command(lines[-2], lines, tmp_path / "runs")
    assert again > step  # it trained on from the checkpoint, and stopped with a newer one
    assert wait_for_no_leftovers() == []


def steps_after(run_dir, step: int) -> bool:
    """Whether a run resumed from ``step`` in ``run_dir`` has trained since: a checkpoint of a later step is there.
    (Not the metrics' lines: until the resumed run rewrites them from its checkpoint, they may still hold the
    stopped run's steps past it, and a Ctrl-C then met devices still starting, with no checkpoint to name.)"""
    from edgetrain.train.checkpoint import checkpoint_files, checkpoint_step

    return any(checkpoint_step(path) > step for path in checkpoint_files(run_dir))


def check_resume_command(said: str, lines: list[str], output) -> tuple[int, object, list[str]]:
    """The launch a stopped run printed (``said``): the same hosts file and run id (the run directory torchrun's
    restarts share, train/checkpoint.py), the train command with the same --checkpoint-every and --output, and
    the checkpoint it names is there. (Its step, its run directory, the command.)"""
    from edgetrain.train.checkpoint import checkpoint_files, checkpoint_step

    step, run_dir = re.search(r"checkpoint of step (\d+) written in (\S+) on host [ab] \(any host may be rank 0 "
                              r"on resuming: each needs that directory, e.g. a shared --output\); resume with: ",
                              said).groups()
    command = shlex.split(said.split("resume with: ", 1)[1])
    assert command[:2] == ["edgetrain", "launch"]
    resumed = build_parser().parse_args(command[1:])
    train = build_parser().parse_args(resumed.command[1:])
    run_id = re.search(r"run id (\S+)$", next(line for line in lines if "c10d rendezvous" in line)).group(1)
    assert resumed.run_id == run_id and run_dir == str(output / f"train-{run_id}")
    assert (str(train.checkpoint_every), train.output) == ("2", str(output))
    assert resumed.hosts == str(output.parent / "hosts.yaml") and resumed.connect_timeout == 5.0
    assert checkpoint_step(checkpoint_files(run_dir)[-1]) == int(step)
    return int(step), output / f"train-{run_id}", command


@pytest.mark.slow
def test_launcher_killed_outright_leaves_nothing_on_the_hosts(tmp_path, ssh_hosts):
    """SIGKILL gives the launcher no chance to stop anything: its connections close, and each host's
    ssh_node reads its stdin's end as the order to stop."""
    launcher = start_long_launch(tmp_path, ssh_hosts)
    launcher.kill()
    launcher.communicate(timeout=30)
    assert wait_for_no_leftovers(60) == []


def kill_torchrun_of_host_b() -> None:
    """SIGKILL host b's torchrun agent (b does not serve the rendezvous: is_host=0), as a crash would."""
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "torch.distributed.run" in " ".join(p.cmdline()) and "is_host=0" in " ".join(p.cmdline()):
                p.kill()
                return
    pytest.fail("host b's torchrun was not found")


@pytest.mark.slow
def test_host_that_drops_stops_every_host_and_is_named(tmp_path, ssh_hosts):
    launcher = start_long_launch(tmp_path, ssh_hosts)
    try:
        kill_torchrun_of_host_b()
        _, err = launcher.communicate(timeout=90)
    finally:
        launcher.kill()
    assert launcher.returncode == 2, err[-3000:]
    assert err.splitlines()[-1].startswith("edgetrain: error: host b failed: its process was killed by SIGKILL")
    assert wait_for_no_leftovers() == []


@pytest.mark.slow
def test_host_that_drops_is_started_again_and_training_goes_on(tmp_path, ssh_hosts):
    # host a regroups once the rendezvous has dropped b's dead torchrun: 3 missed heartbeats, 1 s apart here
    launcher = start_long_launch(tmp_path, ssh_hosts, "--max-restarts", "1", "--rdzv-keepalive", "1")
    try:
        kill_torchrun_of_host_b()
        # torchrun restarts training in a new run directory once both hosts have met again: wait for its steps
        deadline = time.monotonic() + 150
        while not steps_written(tmp_path / "runs", runs=2) and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.5)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert "edgetrain: host b dropped (its process was killed by SIGKILL); starting it again (restart 1 of 1)" in err
    assert launcher.returncode == 130, err[-3000:]  # interrupted while training again, not failed
    assert len(list((tmp_path / "runs").iterdir())) == 2
    assert wait_for_no_leftovers() == []


def test_host_without_edgetrain_is_one_line_naming_it(tmp_path, ssh_hosts):
    r = run_cli(*launch_args(hosts_file(tmp_path, ssh_hosts, python="/nonexistent/python3"), "--steps", "1"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines()[-1].startswith("edgetrain: error: host a: /nonexistent/python3 cannot import "
                                                "edgetrain and torch (exit 127")
    assert "set 'python:' in the hosts file" in r.stderr


@pytest.mark.parametrize("index, restarts, code, signal_name, others, action", [
    (1, 0, 0, None, 1, "done"),
    (1, 0, 1, None, 1, "fail"),  # torchrun gave up (its own restarts spent): starting it again would not help
    (1, 0, 137, None, 1, "restart"),  # its torchrun was SIGKILLed
    (1, 0, None, "KILL", 1, "restart"),  # the remote shell itself was killed
    (1, 0, None, None, 1, "restart"),  # the SSH connection was lost
    (0, 0, 137, None, 1, "fail"),  # the first host served the rendezvous
    (1, 2, 137, None, 1, "leave out"),  # restarts spent, but --min-hosts 1 remain
    (1, 2, 137, None, 0, "fail"),
])
def test_what_happens_when_a_host_ends(index, restarts, code, signal_name, others, action):
    spec = LaunchSpec(hosts=(), train_flags=(), cluster_token="", min_hosts=1, max_restarts=2, rdzv_port=1,
                      rdzv_timeout=1, connect_timeout=1, run_id="x")
    assert after_exit(spec, index, restarts, code, signal_name, others) == action


@pytest.mark.parametrize("code, signal_name, action", [
    (None, None, "leave out"),  # its connection was lost (a partition) after another host finished the run
    (137, None, "leave out"),
    (1, None, "fail"),  # its torchrun failed: still said
])
def test_a_host_dropped_after_the_run_finished_is_no_error(code, signal_name, action):
    spec = LaunchSpec(hosts=(), train_flags=(), cluster_token="", min_hosts=3, max_restarts=0, rdzv_port=1,
                      rdzv_timeout=1, connect_timeout=1, run_id="x")
    assert after_exit(spec, 1, 0, code, signal_name, 0, finished=True) == action


@pytest.mark.parametrize("flags, last_call, keepalive", [
    ([], 30, 5), (["--rdzv-last-call", "7.5", "--rdzv-keepalive", "1"], 8, 1)])
def test_torchrun_rendezvous_waits_are_the_launchs(flags, last_call, keepalive):
    """--rdzv-last-call and --rdzv-keepalive are torchrun's last_call_timeout and keep_alive_interval (whole
    seconds, rounded up; torchrun's own 30 s and 5 s by default)."""
    args = build_parser().parse_args(["launch", "--hosts", "h.yaml", *flags, "--", "train"])
    spec = LaunchSpec(hosts=(HostSpec("a", "10.0.0.1"), HostSpec("b", "10.0.0.2")), train_flags=(),
                      cluster_token="", min_hosts=1, max_restarts=0, rdzv_port=29400, rdzv_timeout=60,
                      connect_timeout=1, run_id="x", rdzv_last_call=args.rdzv_last_call,
                      rdzv_keepalive=args.rdzv_keepalive)
    conf = node_command(spec, 1).split("--rdzv-conf ", 1)[1].split()[0]
    assert conf == f"is_host=0,join_timeout=60,last_call_timeout={last_call},keep_alive_interval={keepalive}"


def test_the_resume_command_repeats_the_launch_with_its_run_id(tmp_path):
    """What a stopped launch prints to go on: its hosts file, the options it changed, the train command as given
    (its --checkpoint-every and --output) and the run id this launch drew."""
    from edgetrain.ssh_launch import plan_launch, resume_command

    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump({"hosts": ["pi1", "pi2"]}))
    args = build_parser().parse_args(["launch", "--hosts", str(path), "--max-restarts", "1", "--", "train",
                                      "--checkpoint-every", "5", "--output", "/shared/runs"])
    spec = plan_launch(args)
    assert resume_command(spec) == (f"edgetrain launch --hosts {path} --max-restarts=1 --run-id {spec.run_id} -- "
                                    f"train --checkpoint-every 5 --output /shared/runs")


def test_train_command_reaches_the_hosts_as_flags_that_give_the_same_config(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"lr": 0.1, "eval": False, "link": "20mbit:5ms", "cluster_token": "s3cret"}))
    cfg = load_config(str(config), steps=7, devices=4)
    flags = train_flags(cfg)
    assert "s3cret" not in " ".join(flags) and not any(f.startswith("--devices") for f in flags)
    again = build_parser().parse_args(["train", *flags])
    assert load_config(None, **{k: v for k, v in vars(again).items() if k in FIELDS}) == \
        dataclasses.replace(cfg, cluster_token=None, devices=1)


def test_launch_without_asyncssh_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "asyncssh"
                        else real_find_spec(name, *a))
    assert main(["launch", "--hosts", str(tmp_path / "hosts.yaml"), "--", "train"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install edgetrain[ssh]" in err


@pytest.mark.parametrize("hosts, complaint", [
    ({"hosts": []}, "needs 'hosts:', a list of at least one host"),
    ({"hosts": ["a"], "extra": 1}, "unknown key 'extra'"),
    ({"hosts": [{"adress": "pi1"}]}, "host 1 (None): unknown key 'adress'; did you mean 'address'?"),
    ({"hosts": [{"name": "pi1"}]}, "host 1 (pi1): 'address' is missing"),
    ({"hosts": ["pi1", {"address": "pi2", "devices": 0}]}, "host 2 (pi2): 'devices' must be >= 1"),
    ({"hosts": [{"address": "pi1", "port": 70000}]}, "'port' must be 1..65535"),
    ({"hosts": [{"address": "pi1", "port": "22"}]}, "'port' must be a whole number, not '22'"),
    ({"hosts": [{"address": "pi1", "key": "/nonexistent/id"}]}, "'key' file /nonexistent/id does not exist"),
    ({"hosts": [{"address": "pi1", "env": {"BAD NAME": "1"}}]}, "env name 'BAD NAME' is not a variable name"),
    ({"hosts": [{"address": "pi1", "env": ["X=1"]}]}, "'env' must be a mapping"),
    ({"hosts": ["pi1", "pi1"]}, "two hosts are named 'pi1'"),
    ({"defaults": {"devices": "two"}, "hosts": ["pi1"]}, "defaults: 'devices' must be a whole number"),
])
def test_bad_hosts_file_is_one_line_naming_the_entry(tmp_path, hosts, complaint):
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump(hosts))
    with pytest.raises(EdgetrainError) as e:
        load_hosts(path)
    assert complaint in str(e.value) and "\n" not in str(e.value)


def test_hosts_file_defaults_apply_and_names_come_from_addresses(tmp_path):
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump({"defaults": {"user": "pi", "devices": 2, "env": {"GLOO_SOCKET_IFNAME": "eth0"}},
                                    "hosts": ["pi1", {"address": "pi1", "port": 2222, "devices": 1},
                                              {"address": "10.0.0.3", "name": "three", "workdir": "~/et"}]}))
    first, second, third = load_hosts(path)
    assert (first.name, first.user, first.devices, first.port) == ("pi1", "pi", 2, 22)
    assert (second.name, second.devices) == ("pi1:2222", 1)
    assert (third.name, third.workdir, third.env) == ("three", "~/et", (("GLOO_SOCKET_IFNAME", "eth0"),))


@pytest.mark.parametrize("train, complaint", [
    (["bench", "peak"], "runs a train command on the hosts, not 'bench peak'"),
    ([], "runs a train command on the hosts, and none was given"),
    (["train", "--lr", "nan"], "'lr' in command line must be a finite number"),
    (["train", "--modle", "x"], "did you mean '--model'?"),
])
def test_bad_launch_is_one_line_before_connecting(tmp_path, capsys, train, complaint):
    # An address nobody answers at (TEST-NET-1): a check after connecting would wait out the 30 s instead.
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump({"hosts": [{"address": "192.0.2.1", "port": 1}]}))
    started = time.monotonic()
    try:
        code = main(["launch", "--hosts", str(path), "--connect-timeout", "30", "--", *train])
    except SystemExit as e:  # the train command's own parser refused it
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and complaint in err, err
    assert time.monotonic() - started < 20
