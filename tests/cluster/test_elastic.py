"""Elastic membership of emulated devices (--min-devices, train/elastic.py, cluster/membership.py)."""
import json
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from edgetrain import train
from edgetrain.cluster.launch import Deadline, launch_local
from edgetrain.cluster.membership import CHANGES_KEY, ElasticLaunch
from edgetrain.cluster.peers import cut_connections
from edgetrain.config import load_config, resolve, with_device_count
from edgetrain.errors import EdgetrainError
from edgetrain.records import RunSummary
from edgetrain.spec import FaultSpec, parse_fault
from edgetrain.train.strategy import DataParallel
from edgetrain_testing import FAST, run_main

KILL_STEP, STEPS = 5, 24
SMALL = dict(dataset="synthetic", image_size=8, synthetic_samples=1024, batch_size=30, steps=STEPS, lr=0.05,
             devices=3, min_devices=2, compress="topk:0.2", **FAST)
PARAMS_ENV = "EDGETRAIN_TEST_PARAMS_DIR"


class GatedNet(nn.Module):
    """A tiny CNN whose devices, a few steps after the kill, wait (at most 120 s) until the killed device,
    started again, has asked to join (the launcher's change counter: 1 for the leave, 1 for the join): the
    rejoin then happens while steps remain, however slowly processes start here. A returning device asks only
    once its data and model are ready (train/loop.py), so the gate cannot open earlier than that."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))

    def forward(self, x):
        self.calls += 1
        if self.calls == KILL_STEP + 2:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=30))
            deadline = time.monotonic() + 120
            while store.add(CHANGES_KEY, 0) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        return self.body(x)


class KeepsParams(DataParallel):
    """Data parallel, and each device leaves its final parameters where the test reads them."""

    def finish(self) -> None:
        super().finish()
        torch.save(self.model.state_dict(), Path(os.environ[PARAMS_ENV]) / f"device-{os.environ['RANK']}.pt")


@pytest.mark.slow
def test_a_killed_device_leaves_the_others_go_on_and_it_rejoins_identical(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGETRAIN_FAULT", f"kill:rank=1:step={KILL_STEP}:back=0")
    monkeypatch.setenv(PARAMS_ENV, str(tmp_path))
    summary = train(SMALL, model=GatedNet(), strategy=KeepsParams, output=str(tmp_path),
                    run_name="elastic")
    run_dir = tmp_path / "elastic"
    assert summary["steps"] == STEPS
    changes = [json.loads(line) for line in (run_dir / "membership.jsonl").read_text().splitlines()]
    assert [(c["kind"], c["devices"], c["world"], c["state_from"]) for c in changes] == [
        ("leave", [1], 2, "peer"), ("join", [1], 3, "peer")]
    # A device forked from the fork server is back in milliseconds: it may join at the very step it left.
    assert changes[0]["step"] == KILL_STEP and KILL_STEP <= changes[1]["step"] < STEPS
    assert all(c["took_s"] < 10 for c in changes), changes  # measured on the device that sent the state
    assert [m.to_dict() for m in RunSummary.from_dict(summary).membership] == changes
    # The loss curve goes on: device 0 ran every step once; device 1 until the kill and again after it joined.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["rank"] == 0] == list(range(STEPS))
    steps_of_1 = [r["step"] for r in records if r["rank"] == 1]
    assert steps_of_1 == list(range(KILL_STEP)) + list(range(changes[1]["step"], STEPS))
    # Whole batches after the change too: the global batch re-split over 2, then 3 devices.
    for step in range(STEPS):
        assert sum(r["samples"] for r in records if r["step"] == step) == 30, step
    final = {d: torch.load(tmp_path / f"device-{d}.pt", weights_only=True) for d in range(3)}
    for name, value in final[0].items():
        assert torch.equal(value, final[1][name]) and torch.equal(value, final[2][name]), name


@pytest.mark.slow
def test_every_survivor_notices_a_death_at_once_not_after_the_timeout(tmp_path, monkeypatch):
    """4 devices: the two not next to the dead one in gloo's ring used to wait in their collective for the whole
    --timeout (measured: 36.9 s for 40 tiny steps with --timeout 30, against 7.6 s); the watcher cuts them loose."""
    monkeypatch.setenv("EDGETRAIN_FAULT", "kill:rank=3:step=5")
    summary = train(dict(SMALL, devices=4, batch_size=32, steps=12, timeout=60, compress="none"),
                    output=str(tmp_path), run_name="fast")
    changes = [json.loads(line) for line in (tmp_path / "fast" / "membership.jsonl").read_text().splitlines()]
    assert [(c["kind"], c["devices"], c["world"]) for c in changes] == [("leave", [3], 3)]
    assert summary["steps"] == 12 and summary["wall_time_s"] < 30, summary["wall_time_s"]  # not --timeout 60


def test_cutting_connections_wakes_a_blocked_reader_and_spares_the_store():
    import socket
    with socket.create_server(("127.0.0.1", 0)) as store_server, socket.create_server(("127.0.0.1", 0)) as peer:
        store_port = store_server.getsockname()[1]
        to_store, to_peer = (socket.create_connection(("127.0.0.1", store_port)),
                             socket.create_connection(("127.0.0.1", peer.getsockname()[1])))
        peer_end, _ = peer.accept()
        store_end, _ = store_server.accept()
        with to_store, to_peer, peer_end, store_end:
            received = []
            reader = threading.Thread(target=lambda: received.append(to_peer.recv(1)))
            reader.start()
            assert cut_connections(keep_port=store_port) >= 2  # both ends of the peer connection live here
            reader.join(timeout=5)
            assert received == [b""] and peer_end.recv(1) == b""  # both ends see it closed at once
            to_store.sendall(b"x")
            assert store_end.recv(1) == b"x"  # the store's connection still works


def _dies_unless_first() -> None:
    if os.environ["RANK"] != "0":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)  # the launcher stops it: fewer than --min-devices remain


def test_fewer_devices_than_min_devices_stop_the_run_in_one_line():
    with pytest.raises(EdgetrainError) as failure:  # a survivor left waiting would end in the deadline's line
        launch_local(3, _dies_unless_first, (), ["device 0 (host)", "device 1 (rpi4)", "device 2 (rpi4)"],
                     deadline=Deadline(120), elastic=ElasticLaunch(min_devices=2, local_batches=(1, 1, 1), timeout_s=5))
    assert str(failure.value) == ("lost device 1 (rpi4), device 2 (rpi4); 1 of 3 devices remain, fewer than "
                                  "--min-devices 2, so the run stopped; lower --min-devices or keep the devices up")


def test_min_devices_is_parsed_once_and_refused_where_it_cannot_apply(monkeypatch):
    monkeypatch.delenv("EDGETRAIN_FAULT", raising=False)
    assert resolve(load_config(devices=3, min_devices=2)).min_devices == 2
    assert resolve(load_config(devices=3, min_devices=3)).min_devices is None  # all devices: fail-stop
    assert resolve(load_config(devices=3)).min_devices is None
    refused = {
        "more than the 3 devices": dict(min_devices=4),
        "strategy tiled splits": dict(min_devices=2, strategy="tiled", grid="1x3"),
        "--sync async:2 is not elastic yet": dict(min_devices=2, sync="async:2"),
        "restore from a peer, not from checkpoints": dict(min_devices=2, checkpoint_every=5),
        "--partition iid would lose": dict(min_devices=2, partition="iid"),
        "local_batch 10,10,12 cannot be re-split": dict(min_devices=2, batch_size=32, local_batch="10,10,12"),
    }
    for message, options in refused.items():
        with pytest.raises(EdgetrainError, match=message):
            load_config(devices=3, **options)
    with pytest.raises(EdgetrainError, match="must be >= 1"):
        load_config(devices=3, min_devices=0)


def test_a_fault_may_bring_its_device_back_in_an_elastic_run_only(monkeypatch):
    assert parse_fault("kill:rank=1:step=5:back=20") == FaultSpec("kill", 1, 5, 20.0)
    for bad in ("stop:rank=1:step=5:back=2", "kill:rank=1:step=5:back=soon", "kill:rank=1:step=5:back=-1"):
        with pytest.raises(EdgetrainError, match="must be ACTION:rank=R:step=S"):
            parse_fault(bad)
    monkeypatch.setenv("EDGETRAIN_FAULT", "kill:rank=1:step=5:back=20")
    with pytest.raises(EdgetrainError, match="which needs an elastic run; add --min-devices below --devices"):
        load_config(devices=3)
    assert resolve(load_config(devices=3, min_devices=2)).faults[0].back_s == 20.0


def test_membership_changes_are_drawn_on_the_training_curves():
    from edgetrain.report import plots, training

    summary = RunSummary.from_dict({"per_device": [], "throughput_samples_per_s": 1.0, "membership": [
        {"wall_s": 1.0, "step": 5, "kind": "leave", "devices": [1], "world": 2, "state_from": "peer", "took_s": 1.2},
        {"wall_s": 9.0, "step": 9, "kind": "join", "devices": [1], "world": 3, "state_from": "peer", "took_s": 2.0}]})
    assert training.curves("run", summary, [], []).changes == [(5, "leave"), (9, "join")]
    run = plots.RunCurves("run", [1, 2, 3], [1.0, 0.9, 0.8], [0.1, 0.2, 0.3], None, [], [], [], [(2, "leave")])
    figure = plots.plot_training_curves([run])
    lines = [line for ax in figure.axes for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert [list(line.get_xdata()) for line in lines] == [[2, 2], [2, 2], [0.2, 0.2], [0.2, 0.2]]


@pytest.mark.slow
def test_a_comeback_is_checked_against_the_cluster_files_device_count(tmp_path, monkeypatch):
    cluster = tmp_path / "c.yaml"
    cluster.write_text("devices:\n  - {profile: host, count: 3}\n")
    monkeypatch.setenv("EDGETRAIN_FAULT", "kill:rank=1:step=1000:back=3")  # past the run's end: never fires
    run = ["train", "--cluster", str(cluster), "--steps", "3", "--batch-size", "30", "--no-eval", "--no-progress",
           "--no-throttle", "--output", str(tmp_path / "runs")]
    # 2 of the file's 3 devices (--devices is left at its default, 1): elastic, so the comeback is accepted
    done = run_main(*run, "--min-devices", "2")
    assert done.returncode == 0, done.stderr
    assert json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())["steps"] == 3
    # all 3: fail-stop, where no device comes back
    refused = run_main(*run, "--min-devices", "3")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        f"edgetrain: error: EDGETRAIN_FAULT brings device 1 back after 3 s, which needs an elastic run; add "
        f"--min-devices below the 3 devices of cluster file {cluster} or drop :back=")
    too_many = run_main(*run, "--min-devices", "4")
    assert too_many.returncode == 2 and "--min-devices 4 is more than the 3 devices of the run" in too_many.stderr
    assert len(list((tmp_path / "runs").iterdir())) == 1  # the refused runs left nothing behind


def test_min_devices_against_a_cluster_file_waits_for_its_count(tmp_path, monkeypatch):
    monkeypatch.delenv("EDGETRAIN_FAULT", raising=False)
    cluster = tmp_path / "c.yaml"
    cluster.write_text("devices:\n  - {profile: host, count: 3}\n")
    cfg = load_config(cluster=str(cluster), min_devices=3)  # --devices: its default, 1, which the file replaces
    assert with_device_count(cfg, resolve(cfg), 3).min_devices is None  # all the file's devices: fail-stop
    cfg = load_config(cluster=str(cluster), min_devices=2, strategy="fsdp")
    with pytest.raises(EdgetrainError, match="strategy fsdp splits the model"):
        with_device_count(cfg, resolve(cfg), 3)
