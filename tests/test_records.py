"""records.py: every record survives to_dict/from_dict, and a bad file is one line naming the key."""
import json

import pytest

from edgetrain.errors import EdgetrainError
from edgetrain.records import DeviceSummary, EvalRecord, RunSummary, StepRecord

STEP = dict(step=3, epoch=0, rank=1, loss=2.3, samples=32, samples_per_s=1000.0, step_s=0.032, data_s=0.001,
            compute_s=0.021, comm_s=0.01, comm_busy_s=None, bytes_sent=376744, bytes_recv=376744, cpu_s=0.02,
            lr=0.05, peak_rss_mb=490.5, virtual_s=0.03, virtual_compute_s=0.02, virtual_comm_s=0.0)
DEVICE = dict(rank=0, profile="rpi4", link="lte-10m", local_batch=16, speed=0.5, cores=[0], threads=1,
              samples_per_s=450.0, step_s=0.03, data_s=0.001, compute_s=0.02, comm_s=0.009, cpu_s=0.02,
              comm_busy_s=0.012, bytes_sent=1000, bytes_recv=1000, peak_rss_mb=400.0, throttle_slept_s=0.5,
              throttle_reference_pass_s=0.01, throttle_inflation=1.1, peak_gflops=15.5, peak_source="profile")
EVAL = dict(epoch=0, step=6, test_loss=0.4, test_accuracy=0.9)


def _round_trip(cls, data):
    """Every key comes back with its value; keys the data left out come back as None (or empty)."""
    record = cls.from_dict(json.loads(json.dumps(data)))
    written = record.to_dict()
    assert {k: written[k] for k in data} == data
    assert cls.from_dict(json.loads(json.dumps(written))) == record
    return record


def test_step_record_round_trips_and_leaves_out_what_the_strategy_did_not_measure():
    assert _round_trip(StepRecord, STEP).virtual_s == 0.03
    tiled = {k: v for k, v in STEP.items() if not k.startswith("virtual")}
    assert "virtual_s" not in StepRecord.from_dict(tiled).to_dict()


def test_eval_and_device_and_run_summaries_round_trip():
    assert _round_trip(EvalRecord, EVAL).test_accuracy == 0.9
    device = _round_trip(DeviceSummary, DEVICE)
    assert device.details == {"peak_gflops": 15.5, "peak_source": "profile"}  # the schema's room for extras
    summary = _round_trip(RunSummary, dict(run_dir="/r", model="small_cnn", steps=6, evals=[EVAL],
                                           per_device=[DEVICE], throughput_samples_per_s=450.0,
                                           sync="local:8", tiling={"grid": "1x2"}))
    assert isinstance(summary.per_device[0], DeviceSummary) and isinstance(summary.evals[0], EvalRecord)
    assert summary.details == {"sync": "local:8", "tiling": {"grid": "1x2"}}


@pytest.mark.parametrize("cls, data, message", [
    (StepRecord, {**STEP, "bogus": 1}, "StepRecord has unknown key 'bogus'"),
    (StepRecord, {**STEP, "samples": "32"}, "StepRecord: key 'samples' must be an integer, not a string"),
    (StepRecord, {**STEP, "loss": True}, "StepRecord: key 'loss' must be a number, not true or false"),
    (EvalRecord, {"epoch": 0}, "EvalRecord lacks key 'step' (an integer)"),
    (RunSummary, {"per_device": [{"rank": 0}], "throughput_samples_per_s": 1.0},
     "RunSummary: key 'per_device' lacks key 'profile'"),
])
def test_a_bad_record_is_one_line_naming_the_key(cls, data, message):
    with pytest.raises(EdgetrainError) as e:
        cls.from_dict(data)
    assert message in str(e.value) and "\n" not in str(e.value)
