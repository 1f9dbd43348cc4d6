"""Round deadlines and partial participation (comm/deadline.py, local_sgd.py's rounds, federated.py)."""
import json
import math
from pathlib import Path

import pytest
import torch

from comm_workers import round_members
from edgetrain import train
from edgetrain.comm.deadline import RoundDeadline, projected_round_time
from edgetrain.config import load_config, resolve
from edgetrain.errors import EdgetrainError
from edgetrain.records import RunSummary, StepRecord
from edgetrain.report.html import headline
from edgetrain.spec import DeadlineSpec, parse_round_deadline
from edgetrain_testing import FAST, on_devices


def test_auto_deadline_is_a_factor_of_the_median_of_recent_rounds_with_a_floor():
    deadline = RoundDeadline(DeadlineSpec(factor=2.0, floor_s=0.05, window=2))
    assert deadline.seconds == math.inf  # nothing measured yet: round 0 waits for everyone
    deadline.observe([0.1, 0.3, 5.0])    # one slow device does not move the median
    assert deadline.seconds == pytest.approx(0.6)
    deadline.observe([0.01, 0.01])
    assert deadline.seconds == pytest.approx(2 * 0.1)  # median of the last two rounds' five times
    deadline.observe([0.001])                           # the first round leaves the window
    assert deadline.seconds == pytest.approx(0.05)     # 2 x 0.01 is below the floor
    restored = RoundDeadline(DeadlineSpec(factor=2.0, floor_s=0.05, window=2))
    restored.load_state_dict(deadline.state_dict())
    assert restored.seconds == deadline.seconds
    assert RoundDeadline(parse_round_deadline("1.5")).seconds == 1.5  # fixed: from round 0


def test_a_late_device_reports_its_projected_round_time():
    assert projected_round_time(0.8, 4, 4, 0.1) == 0.8     # finished: what it took
    assert projected_round_time(0.6, 2, 8, 0.1) == 2.4     # stopped after 2 of 8 steps
    assert projected_round_time(0.0, 0, 8, 0.5) == 4.0     # did none: its last step x H


@pytest.mark.parametrize("text, fix", [("-1", "a number of seconds > 0"), ("soon", "--round-deadline auto"),
                                       ("inf", "seconds > 0")])
def test_bad_deadlines_are_one_line(text, fix):
    with pytest.raises(EdgetrainError, match=fix):
        parse_round_deadline(text)


@pytest.mark.parametrize("options", [dict(), dict(sync="gossip"), dict(sync="async:2"),
                                     dict(strategy="tiled", grid="2x1", devices=2)])
def test_a_deadline_without_rounds_is_refused(options):
    with pytest.raises(EdgetrainError, match="bounds the rounds of --sync local:H and fedavg:E") as e:
        load_config(round_deadline="auto", **options)
    assert "\n" not in str(e.value)


def test_rounds_accept_a_deadline():
    assert resolve(load_config(sync="local:4", round_deadline="auto")).round_deadline == DeadlineSpec()
    spec = resolve(load_config(sync="fedavg:1", partition="iid", round_deadline=2))
    assert spec.round_deadline.seconds == 2.0
    assert resolve(load_config(sync="local:4")).round_deadline is None


SLOW_S = 0.5  # device 2's extra compute per trained step
CASES = [
    # a fixed deadline below the slow device's step: it stops after its first step, then takes none
    {"name": "fixed", "steps": 8, "options": dict(sync="local:4", round_deadline=0.4)},
    # auto: round 0 waits for everyone, then 2x the median round time leaves the slow device out
    {"name": "auto", "steps": 6, "options": dict(sync="local:3", round_deadline="auto")},
    # two of three devices sampled per round; SCAFFOLD's controls over all three
    {"name": "sampled", "steps": 4,
     "options": dict(sync="fedavg:steps=2:scaffold", partition="iid", participation=0.67)},
]


@pytest.fixture(scope="module")
def rounds():
    ranks = on_devices(round_members, 3, CASES, 2, SLOW_S)
    return {case["name"]: [ranks[r][case["name"]] for r in range(3)] for case in CASES}


def test_a_late_device_is_left_out_and_the_round_does_not_wait_for_it(rounds):
    fast, _, slow = rounds["fixed"]
    assert slow["trained"] == [True, False, False, False] + [False] * 4
    assert slow["status"] == ["missed_deadline"] * 2 and fast["status"] == ["joined"] * 2
    # without the deadline a round would last 4 x SLOW_S; it ends about when the slow device stopped
    assert max(fast["round_wall_s"]) < 2.5 * SLOW_S, fast["round_wall_s"]
    assert slow["sent"] == [0] * 8 and all(b > 0 for b in (slow["received"][3], slow["received"][7]))
    for r in range(2):
        # the mean over the devices that made it, by hand; every device leaves the round with it
        want = (rounds["fixed"][0]["local"][r] + rounds["fixed"][1]["local"][r]) / 2
        for device in rounds["fixed"]:
            assert torch.allclose(device["after"][r], want, atol=1e-6)
    assert fast["summary"]["round_participation"] == [
        {"joined": 2, "missed_deadline": 0, "not_sampled": 0}, {"joined": 2, "missed_deadline": 0, "not_sampled": 0},
        {"joined": 0, "missed_deadline": 2, "not_sampled": 0}]


def test_the_auto_deadline_follows_the_fleet(rounds):
    fast, _, slow = rounds["auto"]
    assert fast["status"][0] == slow["status"][0] == "joined"  # round 0: no deadline yet
    assert slow["status"][1] == "missed_deadline" and slow["trained"][3:] == [False] * 3
    assert fast["summary"]["round_deadline_last_s"] < SLOW_S
    assert all(torch.equal(d["after"][1], fast["after"][1]) for d in rounds["auto"])


def test_unsampled_devices_neither_train_nor_send_and_scaffold_counts_them_as_zero(rounds):
    devices = rounds["sampled"]
    for r in range(2):
        members = [i for i, d in enumerate(devices) if d["status"][r] == "joined"]
        assert len(members) == 2 and all(devices[i]["status"][r] == "not_sampled" for i in {0, 1, 2} - set(members))
        steps = range(2 * r, 2 * r + 2)
        for i, d in enumerate(devices):
            if i in members:
                assert all(d["trained"][s] for s in steps) and d["sent"][2 * r + 1] > 0
            else:
                assert not any(d["trained"][s] for s in steps) and sum(d["sent"][s] for s in steps) == 0
                assert d["received"][2 * r + 1] > 0  # the members' mean
        want = sum(devices[i]["local"][r] for i in members) / 2
        control_change = sum(devices[i]["own_control"][r] - (devices[i]["own_control"][r - 1] if r else 0)
                             for i in members) / 3  # mean over all three devices, the unsampled one adding 0
        control = (devices[0]["control"][r - 1] if r else 0) + control_change
        for d in devices:
            assert torch.allclose(d["after"][r], want, atol=1e-6)
            assert torch.allclose(d["control"][r], control, atol=1e-6)


@pytest.mark.slow
def test_a_trained_run_records_who_sat_out(tmp_path):
    summary = train(model="small_cnn", dataset="digits", devices=2, steps=4, batch_size=32, partition="iid",
                    sync="fedavg:steps=2", participation=0.5, round_deadline=60, output=str(tmp_path), **FAST)
    run = Path(summary["run_dir"])
    records = [StepRecord.from_dict(json.loads(line)) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        sat_out = record.samples == 0
        assert (record.loss is None) == sat_out and (not sat_out or record.bytes_sent == 0)
    closing = [r for r in records if r.round_status is not None]
    assert sorted(r.round_status for r in closing) == ["joined", "joined", "not_sampled", "not_sampled"]
    assert sum(c["joined"] for c in summary["round_participation"]) == 2
    cols, rows, _ = headline(RunSummary.from_dict(summary))
    assert cols[-1] == "rounds" and {row[-1] for row in rows} <= {"2/0/0", "1/0/1", "0/0/2"}


def test_the_cli_refuses_a_deadline_without_rounds_in_one_line(tmp_path, capsys):
    from edgetrain.cli import main  # in-process: refused before any device starts

    assert main(["train", "--devices", "2", "--output", str(tmp_path), "--round-deadline", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgetrain: error: config key 'round_deadline' 2 bounds the rounds") and err.count("\n") == 1
    assert not any(tmp_path.iterdir())
