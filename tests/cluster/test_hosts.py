"""Training across separate hosts: network namespaces with their own addresses and an sshd each (tests/hosts.py).

What breaks between real hosts and not on 127.0.0.1: the interface gloo advertises (this machine's hostname
resolves to 127.0.0.1, as a Raspberry Pi's does to 127.0.1.1), the cores a process alone on its host gets,
bounded waits when a peer cannot be reached, and exits after a run. The recipes here are the ones
docs/tutorials/raspberry-pi-cluster.md gives.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgetrain_testing import REPO

TRAIN = ["-m", "edgetrain", "train", "--batch-size", "16", "--no-progress", "--no-eval", "--no-throttle"]
TOKEN = "test-hosts-token"
TUTORIAL = REPO / "docs" / "tutorials" / "raspberry-pi-cluster.md"
ENCRYPTION = REPO / "docs" / "how-to" / "encryption-in-transit.md"
# The tutorial's training flags, which the tests replace by a short run's
DOC_FLAGS = ("--model resnet18 --dataset cifar10 --data-dir ~/cifar-10-batches-py --batch-size 128 --epochs 10 "
             "--timeout 120")


def recipe(name: str, flags: str = "", page: Path = TUTORIAL) -> str:
    """The tutorial's (or ``page``'s) bash block marked ``<!-- recipe: name -->``, continuation lines joined, its
    training flags (``DOC_FLAGS``) replaced by ``flags``."""
    text = page.read_text()
    marker = f"<!-- recipe: {name} -->\n```bash\n"
    assert marker in text, f"{page.name} has no recipe {name!r}"
    block = text.split(marker, 1)[1].split("```", 1)[0].replace("\\\n", " ")
    if flags:
        joined = re.sub(r" +", " ", block)
        assert DOC_FLAGS in joined, f"recipe {name!r} does not train with the tutorial's flags"
        block = joined.replace(DOC_FLAGS, flags)
    return block


def recipe_env(hosts, tmp_path, i: int) -> dict:
    """Host ``i``'s shell for a recipe: FIRST, ME, RANK; HOME with the cluster token; ``edgetrain`` and
    ``torchrun`` on PATH as this interpreter's; no GLOO_SOCKET_IFNAME (a fresh Pi has none)."""
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    if not bin_dir.exists():
        home.mkdir()
        (home / ".edgetrain-token").write_text(TOKEN + "\n")
        bin_dir.mkdir()
        for name, module in (("edgetrain", "edgetrain"), ("torchrun", "torch.distributed.run")):
            (bin_dir / name).write_text(f"#!/bin/sh\nexec {sys.executable} -m {module} \"$@\"\n")
            (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "EDGETRAIN_CLUSTER_TOKEN")}
    env.update(FIRST=hosts.addresses[0], ME=hosts.addresses[i], RANK=str(i), HOME=str(home),
               PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env["PATH"]]))
    return env


def run_recipe(hosts, tmp_path, name, flags="", only=None, **popen):
    """The recipe on every host (or ``only`` those), in bash, started at once; the processes."""
    script = recipe(name, flags)
    return [hosts.popen(i, ["bash", "-euc", script], env=recipe_env(hosts, tmp_path, i), cwd=tmp_path,
                        **({"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True} | popen))
            for i in (only if only is not None else range(len(hosts.names)))]


def short_run(out, steps=3, timeout=30):
    return (f"--batch-size 16 --no-progress --no-eval --no-throttle --steps {steps} --timeout {timeout} "
            f"--output {out}")


def plain_recipe(hosts, out, steps=3, timeout=30, env=None, per_host_env=None, extra=()):
    """The plain recipe on every host: ``RANK=i WORLD_SIZE=N MASTER_ADDR=<host 0> edgetrain train``."""
    procs = []
    for i in range(len(hosts.names)):
        e = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}  # as on a fresh host
        e.update(RANK=str(i), WORLD_SIZE=str(len(hosts.names)), MASTER_ADDR=hosts.addresses[0], MASTER_PORT="29500",
                 EDGETRAIN_CLUSTER_TOKEN=TOKEN, **(env or {}), **(per_host_env or {}).get(i, {}))
        procs.append(hosts.popen(i, [sys.executable, *TRAIN, "--steps", str(steps), "--timeout", str(timeout),
                                     "--output", str(out), *extra],
                                 env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs, timeout):
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            err += "\n<killed by the test after its timeout>"
        results.append((p.returncode, out, err))
    return results


def summary(out):
    (path,) = out.glob("*/summary.json")
    return json.loads(path.read_text())


@pytest.mark.slow
def test_plain_recipe_uses_every_core_and_finds_the_interface(test_hosts, tmp_path):
    """The tutorial's plain recipe on three hosts, no GLOO_SOCKET_IFNAME (the hostname resolves to loopback
    here, as a Pi's does): gloo is put on the interface that reaches MASTER_ADDR, and each process, alone on
    its host, uses all the host's cores."""
    hosts = test_hosts(3, ssh=False)
    results = finish(run_recipe(hosts, tmp_path, "plain", short_run(tmp_path / "runs")), 180)
    for code, out, err in results:
        assert code == 0, err[-3000:]
    devices = summary(tmp_path / "runs")["per_device"]
    cores = sorted(os.sched_getaffinity(0))
    assert [d["cores"] for d in devices] == [cores] * 3
    assert [d["threads"] for d in devices] == [len(cores)] * 3


@pytest.mark.slow
def test_torchrun_elastic_recipe_trains_across_hosts(test_hosts, tmp_path):
    """The tutorial's hand-started torchrun c10d recipe (is_host, --local-addr, no shared store) on three
    hosts: every torchrun exits 0 and rank 0's host wrote the run."""
    hosts = test_hosts(3, ssh=False)
    results = finish(run_recipe(hosts, tmp_path, "torchrun", short_run(tmp_path / "runs")), 240)
    for code, out, err in results:
        assert code == 0, (out + err)[-3000:]
    assert len(summary(tmp_path / "runs")["per_device"]) == 3


@pytest.mark.slow
def test_timeout_bounds_every_rank_and_names_the_interface(test_hosts, tmp_path):
    """gloo on loopback (GLOO_SOCKET_IFNAME=lo, what a hostname mapped to 127.0.1.1 gives): the peers cannot
    reach each other. Every rank ends within
    --timeout plus a bound (gloo alone retries four times as long) with one line naming GLOO_SOCKET_IFNAME."""
    hosts = test_hosts(2, ssh=False)
    timeout = 10
    started = time.monotonic()
    procs = plain_recipe(hosts, tmp_path / "runs", timeout=timeout, env={"GLOO_SOCKET_IFNAME": "lo"})
    results = finish(procs, 150)
    took = time.monotonic() - started
    for code, out, err in results:
        assert code == 2, err[-3000:]
        lines = [line for line in err.splitlines() if line.startswith("edgetrain: error:")]
        assert lines and "GLOO_SOCKET_IFNAME" in lines[-1], err[-3000:]
        assert "Traceback" not in err
    assert took < timeout + 35, f"took {took:.0f} s for --timeout {timeout}"


def launch(hosts, tmp_path, *flags, train=(), launcher_host=0, **popen):
    """``edgetrain launch --hosts hosts.yaml ...`` started on ``launcher_host`` (the hosts' first, as from a Pi)."""
    yaml_path = hosts.hosts_yaml(tmp_path / "hosts.yaml", tmp_path)
    argv = [sys.executable, "-m", "edgetrain", "launch", "--hosts", str(yaml_path), *flags, "--",
            *TRAIN[2:], *train, "--output", str(tmp_path / "runs")]
    return hosts.popen(launcher_host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


class Lines:
    """A process's stdout and stderr read as they come, each line with the time it arrived."""

    def __init__(self, proc):
        import threading

        self.lines: list[tuple[float, str, str]] = []
        self.readers = [threading.Thread(target=self._read, args=(stream, name), daemon=True)
                        for stream, name in ((proc.stdout, "out"), (proc.stderr, "err"))]
        for r in self.readers:
            r.start()

    def _read(self, stream, name):
        for line in stream:
            self.lines.append((time.monotonic(), name, line.rstrip("\n")))

    def text(self, name=None):
        return "\n".join(line for _, n, line in self.lines if name in (None, n))

    def first(self, needle):
        return next((t for t, _, line in self.lines if needle in line), None)

    def join(self):
        for r in self.readers:
            r.join(timeout=10)


def metric_lines(runs):
    return max((len(p.read_text().splitlines()) for p in runs.glob("*/metrics-*.jsonl")), default=0)


@pytest.mark.slow
def test_launch_ends_after_a_partition(test_hosts, tmp_path):
    """Three hosts, --min-hosts 2; host 2's link goes down mid-run (no FIN, no RST). The other two re-form
    and finish; the launcher notices the dead SSH connection by its keepalives, leaves host 2 out and
    ends with the run (before: it waited on TCP's two-hour keepalive). The two regroup once torchrun's
    rendezvous has dropped host 2 (3 missed heartbeats, 1 s apart here: --rdzv-keepalive; 5 s by default)
    and after its last call, 5 s here (--rdzv-last-call; 30 s by default), as all three met at the start
    well within it."""
    hosts = test_hosts(3)
    proc = launch(hosts, tmp_path, "--min-hosts", "2", "--max-restarts", "1", "--connect-timeout", "5",
                  "--rdzv-last-call", "5", "--rdzv-keepalive", "1", train=["--steps", "16", "--timeout", "10"])
    lines = Lines(proc)
    deadline = time.monotonic() + 120
    while metric_lines(tmp_path / "runs") < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, lines.text()
    hosts.cut(2)
    try:
        proc.wait(timeout=200)
    except subprocess.TimeoutExpired:
        proc.kill()
    ended = time.monotonic()
    lines.join()
    assert proc.returncode == 0, lines.text()[-4000:]
    assert "host h2 dropped (its SSH connection was lost)" in lines.text("err")
    finished = lines.first("samples/s") and max(t for t, _, line in lines.lines if "samples/s" in line)
    assert finished and ended - finished < 30, lines.text()[-4000:]


@pytest.mark.slow
def test_a_peers_death_is_one_line(test_hosts, tmp_path):
    """Plain recipe, host 1's process killed mid-run (SIGKILL: it says nothing): host 0 says one line, not
    gloo's traceback, and leaves no half-run behind (exit 2)."""
    hosts = test_hosts(2, ssh=False)
    procs = plain_recipe(hosts, tmp_path / "runs", steps=400, timeout=15)
    deadline = time.monotonic() + 120
    while metric_lines(tmp_path / "runs") < 3 and time.monotonic() < deadline and procs[0].poll() is None:
        time.sleep(0.2)
    procs[1].kill()
    (code, out, err), _ = finish(procs, 90)
    assert code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("edgetrain: error:")]
    assert len(errors) == 1 and "a peer device stopped answering" in errors[0], err[-3000:]


@pytest.mark.slow
def test_ctrl_c_under_launch_is_one_line(test_hosts, tmp_path):
    """Ctrl-C (SIGINT) to the launcher mid-run: it stops every host and says one line; the hosts' shutdown
    tracebacks (torchrun's SignalException, the workers') are not printed."""
    import signal

    hosts = test_hosts(2)
    proc = launch(hosts, tmp_path, "--connect-timeout", "5", train=["--steps", "400", "--timeout", "15"])
    lines = Lines(proc)
    deadline = time.monotonic() + 120
    while metric_lines(tmp_path / "runs") < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, lines.text()
    signalled = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    lines.join()
    after = [line for t, _, line in lines.lines if t >= signalled and line.strip()]
    assert proc.returncode == 130, lines.text()[-3000:]
    assert after == ["edgetrain: interrupted (SIGINT); the run was stopped"], "\n".join(after)[-3000:]
    assert hosts.wait_idle(1, 20), f"left running on host 1: {hosts.leftovers(1)}"


def flower_refusal(hosts, tmp_path, i: int, name: str, node_flags: str, port: int) -> tuple[subprocess.Popen, Path]:
    """A SuperNode on host ``i`` that the fleet must refuse (its own runtime port), in a session of its own (the
    SuperExec it starts outlives it); the process and its log."""
    log = tmp_path / f"{name}.log"
    script = (f"exec flower-supernode {node_flags} --superlink $FIRST:9091 --port {port} --max-retries 3 "
              f"--max-wait-time 20 --node-config 'partition-id=0 num-partitions=3'")
    proc = hosts.popen(i, ["bash", "-euc", script], env=recipe_env(hosts, tmp_path, i), cwd=tmp_path,
                       stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def wait_for_line(log: Path, needle: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while needle not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    return needle in log.read_text()


@pytest.mark.slow
def test_flower_recipe_across_hosts_bounds_a_dead_node(test_hosts, tmp_path):
    """The tutorial's Flower fleet with TLS and SuperNode authentication: certificates from `edgetrain certs
    make`, a SuperLink on host 0 (--host its address), the three SuperNodes' keys registered with `flwr
    supernode register`, a SuperNode on each host, `flwr run` from host 0. Beside them on host 1, a SuperNode
    with an unregistered key and one given another CA are both refused, and no plaintext HTTP crosses host
    1's link. Host 2's link goes down after its SuperNode registered: the round ends within round-timeout
    (30 s here, the tutorial's 120: a live node's ClientApp needs about 7 s of CPU, so it replies in about
    12 s on a quiet 2-core machine; Flower's own bound would be 600 s) with the other two hosts' results,
    and the run finishes."""
    pytest.importorskip("flwr", reason="the fleet extra is not installed (pip install edgetrain[fleet])")
    from edgetrain.certs import make_files, write_new_directory

    hosts = test_hosts(3, ssh=False)
    flwr_home = tmp_path / "flwr"
    flwr_home.mkdir()
    made = hosts.run(0, ["bash", "-euc", recipe("fleet-certs")], env=recipe_env(hosts, tmp_path, 0), cwd=tmp_path,
                     timeout=60)
    assert made.returncode == 0, made.stderr
    write_new_directory(tmp_path / "other-fleet", make_files([hosts.addresses[0]], 1))  # a stranger's CA and key
    (flwr_home / "config.toml").write_text(f'[superlink]\ndefault = "fleet"\n\n[superlink.fleet]\n'
                                           f'address = "{hosts.addresses[0]}:9091"\n'
                                           f'root-certificates = "{tmp_path / "fleet-certs" / "ca.crt"}"\n')
    flwr_env = {i: dict(recipe_env(hosts, tmp_path, i), FLWR_HOME=str(flwr_home)) for i in range(3)}
    link_log = tmp_path / "superlink.log"
    wire = hosts.capture(1)
    hosts.popen(0, ["bash", "-euc", recipe("superlink")], env=flwr_env[0], cwd=tmp_path,
                stdout=link_log.open("w"), stderr=subprocess.STDOUT)
    hosts._wait_port(0, 9091, 60)
    registered = hosts.run(0, ["bash", "-euc", recipe("register")], env=flwr_env[0], cwd=tmp_path, timeout=120)
    assert registered.stdout.count("registered successfully") == 3, registered.stdout + registered.stderr
    for i in range(3):
        hosts.popen(i, ["bash", "-euc", recipe("supernode")], env=flwr_env[i], cwd=tmp_path,
                    stdout=(tmp_path / f"node{i}.log").open("w"), stderr=subprocess.STDOUT)
    refused = [flower_refusal(hosts, tmp_path, 1, "unregistered", "--root-certificates fleet-certs/ca.crt "
                              "--auth-supernode-private-key other-fleet/node-0.key", 9095),
               flower_refusal(hosts, tmp_path, 1, "wrong-ca", "--root-certificates other-fleet/ca.crt "
                              "--auth-supernode-private-key fleet-certs/node-1.key", 9096)]
    deadline = time.monotonic() + 90
    while link_log.read_text().count("Activated node_id") < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert link_log.read_text().count("Activated node_id") == 3, link_log.read_text()[-2000:]
    for (proc, log), refusal in zip(refused, ["[code: 2004] Failed to activate SuperNode",
                                              "[SSL: CERTIFICATE_VERIFY_FAILED]"]):
        assert wait_for_line(log, refusal, 90), log.read_text()[-2000:]
        os.killpg(proc.pid, signal.SIGKILL)  # and its SuperExec, which would retry its SuperNode for long
        proc.wait(timeout=10)
    hosts.cut(2)
    script = recipe("flwr-run")
    assert "num-rounds=2" in script and "round-timeout=120.0" in script
    round_timeout = 30
    script = script.replace("num-rounds=2", "num-rounds=1").replace(
        "round-timeout=120.0", f"round-timeout={round_timeout:.1f} fraction-evaluate=0.0")
    started = time.monotonic()
    run = hosts.run(0, ["bash", "-euc", script], timeout=200, env=flwr_env[0], cwd=REPO)
    took = time.monotonic() - started
    seen = wire.stop()
    log = run.stdout + run.stderr
    assert "Strategy execution finished" in log, log[-3000:]
    assert "aggregate_train: Received 2 results" in log, log[-3000:]
    assert took < round_timeout + 60, f"flwr run took {took:.0f} s for round-timeout {round_timeout} s"
    assert link_log.read_text().count("Activated node_id") == 3, link_log.read_text()[-2000:]
    assert wire.drops == 0 and len(seen) > 100_000, (wire.drops, len(seen))
    assert b"/v1/fleet/" not in seen and b"HTTP/1.1" not in seen


def ssh_bytes(frames: list[bytes]) -> int:
    """Bytes of TCP port 22 (IPv4 over Ethernet) among captured frames."""
    total = 0
    for f in frames:
        if len(f) > 34 and f[12:14] == b"\x08\x00" and f[23] == 6:
            ports = f[14 + (f[14] & 0xF) * 4:][:4]
            if b"\x00\x16" in (ports[:2], ports[2:]):
                total += len(f)
    return total


def test_gloo_through_an_ssh_tunnel_is_not_readable_on_the_link(test_hosts, tmp_path):
    """docs/how-to/encryption-in-transit.md's SSH tunnel recipe on hosts 1 and 2 (a star through host 0), then
    host 1's update all-reduced on a gloo group over eth0 and on one over the tunnels: on host 1's link the
    first is there in the clear and the second is not, while SSH carried more than its size."""
    from hosts import _free_subnet

    hosts = test_hosts(3)
    vpn = f"10.213.{_free_subnet()}"  # the tunnels' addresses, in the test hosts' range
    ssh = tmp_path / "bin" / "ssh"
    recipe_env(hosts, tmp_path, 0)  # makes bin/
    ssh.write_text(f"#!/bin/sh\nexec /usr/bin/ssh -i {hosts.key} -o UserKnownHostsFile={hosts.known_hosts} "
                   f"-o StrictHostKeyChecking=yes -o BatchMode=yes -o ConnectTimeout=10 \"$@\"\n")
    ssh.chmod(0o755)
    assert hosts.run(0, ["sysctl", "-w", "net.ipv4.ip_forward=1"], timeout=10).returncode == 0
    for i in (1, 2):
        log = tmp_path / f"tunnel{i}.log"
        made = hosts.popen(i, ["bash", "-euc", recipe("ssh-tunnel", page=ENCRYPTION)],
                           env=dict(recipe_env(hosts, tmp_path, i), VPN=vpn), stdout=log.open("w"),
                           stderr=subprocess.STDOUT)
        assert made.wait(timeout=60) == 0, log.read_text()
    wire = hosts.capture(1)
    groups = [f"{hosts.addresses[0]}:29511:eth0:PLAIN UPDATE OF THE DEVICE ON HOST 1",
              f"{vpn}.1:29512:tun{{i}}:TUNNELLED UPDATE OF THE DEVICE ON HOST1"]
    procs = [hosts.popen(i, [sys.executable, str(Path(__file__).parent / "gloo_marker.py"), str(i), "3",
                             *[g.replace("{i}", str(max(i, 1))) for g in groups]],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(3)]
    results = finish(procs, 120)
    seen = wire.stop()
    outputs = "\n".join(f"host {i}: {out[-1500:]}" for i, (_, out, _) in enumerate(results))
    assert all(code == 0 and out.count("ok") == 2 for code, out, _ in results), outputs
    assert wire.drops == 0, f"the capture missed {wire.drops} frames"
    assert b"PLAIN UPDATE OF THE DEVICE ON HOST 1" in seen
    assert b"TUNNELLED UPDATE" not in seen
    assert ssh_bytes(wire.frames) > 2 * 32 * 1024, ssh_bytes(wire.frames)
