"""Stopping an emulated run from outside: SIGTERM, SIGKILL of the launcher, a stopped device."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from edgetrain.cluster.launch import device_processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux only")

LONG_RUN = ["train", "--devices", "2", "--epochs", "1000", "--batch-size", "16", "--no-progress", "--no-eval",
            "--no-throttle", "--workers", "1"]


@pytest.fixture
def started():
    """Everything the test started, killed at the end whatever the test asserted."""
    procs: list[psutil.Process] = []
    yield procs
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()


def start_run(tmp_path, started, *extra: str, launcher: tuple[str, ...] = ("-m", "edgetrain"), session: bool = False
              ) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """Start a long emulated run; return it once both devices train (each has its loader worker).
    ``session``: the launcher leads a process group of its own, started with SIGINT ignored (as a script's
    background job is: Python then installs no handler of its own)."""
    proc = subprocess.Popen([sys.executable, *launcher, *LONG_RUN, "--output", str(tmp_path), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=session,
                            preexec_fn=_ignore_sigint if session else None)
    launcher = psutil.Process(proc.pid)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        devices = device_processes(launcher)
        if len(devices) == 2 and all(_safe_children(d) for d in devices):
            descendants = launcher.children(recursive=True)
            started.extend([launcher, *descendants])
            return proc, descendants
        if proc.poll() is not None:
            pytest.fail(f"the run ended early: {proc.stderr.read()}")
        time.sleep(0.2)
    started.extend([launcher, *launcher.children(recursive=True)])
    pytest.fail("the devices did not start within 90 s")


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _safe_children(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children()
    except psutil.Error:
        return []


def assert_all_gone(procs: list[psutil.Process], within_s: float) -> None:
    _, alive = psutil.wait_procs(procs, timeout=within_s)
    alive = [p for p in alive if _status(p) not in (psutil.STATUS_ZOMBIE, None)]  # a zombie only awaits reaping
    assert alive == [], f"still running after {within_s} s: {alive}"


def _status(p: psutil.Process) -> str | None:
    try:
        return p.status()
    except psutil.Error:
        return None


@pytest.mark.slow
def test_sigterm_stops_the_run_with_one_line_and_no_leftovers(tmp_path, started):
    proc, descendants = start_run(tmp_path, started)
    listening = [c.laddr.ip for p in [psutil.Process(proc.pid), *descendants] for c in p.net_connections("inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening and set(listening) == {"127.0.0.1"}, listening  # the store and gloo: loopback only
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143
    assert err == "edgetrain: terminated (SIGTERM); the run was stopped\n"  # no resource-tracker warnings either
    assert_all_gone(descendants, within_s=5)


@pytest.mark.slow
def test_sigterm_with_checkpoints_on_stops_with_a_checkpoint_summary_and_how_to_resume(tmp_path, started):
    proc, descendants = start_run(tmp_path, started, "--checkpoint-every", "100000", "--run-name", "r")
    run_dir = tmp_path / "r"
    live, deadline = run_dir / "metrics-1.jsonl", time.monotonic() + 60
    while not (live.exists() and live.stat().st_size):  # device 1 has trained a step
        assert time.monotonic() < deadline, "no step was trained within 60 s"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143
    step = int(err.split("checkpoint of step ")[1].split()[0])
    assert err == (f"edgetrain: terminated (SIGTERM); the run was stopped; checkpoint of step {step} written; "
                   f"resume with: edgetrain train --resume {run_dir}\n")
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step-{step:08d}.pt"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == step and (run_dir / "metrics.jsonl").read_text().count("\n") == 2 * step
    assert_all_gone(descendants, within_s=5)


@pytest.mark.slow
def test_devices_killed_after_the_grace_leave_no_tracker_warning(tmp_path, started):
    """A device that outlives the stop grace is SIGKILLed with its loader's semaphores still registered; the
    resource tracker cleans them up without printing a warning after the one line (22 were reported before)."""
    script = tmp_path / "no_grace.py"
    script.write_text("import sys\nimport edgetrain.cluster.launch as launch\nfrom edgetrain.cli import main\n"
                      "launch._STOP_GRACE_S = 0.0  # SIGKILL at once after SIGTERM\n"
                      "if __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))\n")
    proc, descendants = start_run(tmp_path, started, launcher=(str(script),))
    time.sleep(2)  # the loaders are iterating: their queues are registered with the tracker
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)  # stderr closes when the tracker, which shares it, has exited too
    assert proc.returncode == 143
    assert err == "edgetrain: terminated (SIGTERM); the run was stopped\n"
    assert_all_gone(descendants, within_s=5)


def test_killed_launcher_takes_its_devices_and_loader_workers_along(tmp_path, started):
    proc, descendants = start_run(tmp_path, started)
    proc.kill()
    proc.wait(timeout=10)
    assert_all_gone(descendants, within_s=10)


@pytest.mark.slow
def test_stopped_device_is_blamed_not_the_peer_that_timed_out(tmp_path, started):
    proc, descendants = start_run(tmp_path, started, "--timeout", "5")
    os.kill(_device(proc, 1).pid, signal.SIGSTOP)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and err.count("\n") == 1, err
    assert err.startswith("edgetrain: error: device 1 (host) failed: its process was stopped"), err
    assert_all_gone(descendants, within_s=5)


def _device(proc: subprocess.Popen, rank: int) -> psutil.Process:
    """The launcher starts device 0 first, so in start order its devices are ranks 0, 1, ..."""
    return device_processes(psutil.Process(proc.pid))[rank]


@pytest.mark.parametrize("failures, silent, blamed", [
    ([(0, "RuntimeError: Timed out waiting 5000ms for recv", False)], {1: psutil.STATUS_STOPPED}, 1),
    ([(0, "timed out", False), (2, "timed out", False)], {1: psutil.STATUS_RUNNING}, 1),
    # two devices: the silent one may only be slower to report; the device that timed out keeps the blame
    ([(1, "RuntimeError: DataLoader timed out after 30 seconds", False)], {0: psutil.STATUS_SLEEPING}, 1),
    ([(1, "ValueError: bad weights", False)], {0: psutil.STATUS_STOPPED}, 1),  # a real error is never an echo
])
def test_root_cause_blames_the_silent_stopped_device_only_when_all_reports_are_echoes(failures, silent, blamed):
    from edgetrain.cluster.launch import _root_cause

    assert _root_cause(failures, silent)[0] == blamed


@pytest.mark.slow
def test_the_model_left_by_a_killed_launchers_devices_is_loaded_as_partial(tmp_path, started, capsys):
    from edgetrain import load_checkpoint

    proc, descendants = start_run(tmp_path, started, "--checkpoint-every", "100000", "--run-name", "r")
    run_dir = tmp_path / "r"
    live, deadline = run_dir / "metrics-1.jsonl", time.monotonic() + 60
    while not (live.exists() and live.stat().st_size):  # device 1 has trained a step
        assert time.monotonic() < deadline, "no step was trained within 60 s"
        time.sleep(0.2)
    proc.kill()  # the devices get SIGTERM (parent-death signal): they stop with a checkpoint and the model so far
    proc.wait(timeout=10)
    assert_all_gone(descendants, within_s=30)
    state = load_checkpoint(run_dir)
    planned = 1000 * (1437 // 16)  # --epochs 1000 of digits' 1437 training images in batches of 16
    assert 0 < state["step"] < planned and state["planned_steps"] == planned and state["partial"]
    assert capsys.readouterr().err == (
        f"edgetrain: warning: {run_dir / 'checkpoint.pt'} is a partial run's model: step {state['step']} of the "
        f"{planned} planned (the run stopped before its end); continue it with edgetrain train --resume RUN_DIR\n")


@pytest.mark.slow
@pytest.mark.parametrize("to_group", [False, True], ids=["launcher", "process-group"])
def test_ctrl_c_stops_the_run_as_sigterm_does_with_a_checkpoint(tmp_path, started, to_group):
    """SIGINT to the launcher alone, or to its whole process group as a terminal's Ctrl-C sends it: every device
    stops at its next step with a checkpoint, one line, exit status 130, nothing left running. The launcher
    leads a process group of its own, started with SIGINT ignored, as `edgetrain train ... &` in a script is:
    the run went on to its end that way."""
    proc, descendants = start_run(tmp_path, started, "--checkpoint-every", "100000", "--run-name", "r",
                                  session=True)
    run_dir = tmp_path / "r"
    live, deadline = run_dir / "metrics-1.jsonl", time.monotonic() + 60
    while not (live.exists() and live.stat().st_size):  # device 1 has trained a step
        assert time.monotonic() < deadline, "no step was trained within 60 s"
        time.sleep(0.2)
    if to_group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    step = int(err.split("checkpoint of step ")[1].split()[0])
    assert err == (f"edgetrain: interrupted (SIGINT); the run was stopped; checkpoint of step {step} written; "
                   f"resume with: edgetrain train --resume {run_dir}\n")
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step-{step:08d}.pt"]
    assert_all_gone(descendants, within_s=5)
