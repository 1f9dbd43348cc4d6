"""records.py and results.py: every record survives to_dict/from_dict, and a bad file is one line naming the key."""
import json

import pytest

from edgetrain.errors import EdgetrainError
from edgetrain.records import DeviceSummary, EvalRecord, RunSummary, StepRecord
from edgetrain.results import (BENCH_RESULTS, BenchResult, PeakResult, PlanComparison, PlanDeviceGroup, PlanResult,
                               PlanScalingRow, PlanSimulation, PlanStrategy, PlanStrategyDevice)

STEP = dict(step=3, epoch=0, rank=1, loss=2.3, samples=32, samples_per_s=1000.0, step_s=0.032, data_s=0.001,
            compute_s=0.021, comm_s=0.01, comm_busy_s=None, bytes_sent=376744, bytes_recv=376744, cpu_s=0.02,
            lr=0.05, peak_rss_mb=490.5, virtual_s=0.03, virtual_compute_s=0.02, virtual_comm_s=0.0)
DEVICE = dict(rank=0, profile="rpi4", link="lte-10m", local_batch=16, speed=0.5, cores=[0], threads=1,
              samples_per_s=450.0, step_s=0.03, data_s=0.001, compute_s=0.02, comm_s=0.009, cpu_s=0.02,
              comm_busy_s=0.012, bytes_sent=1000, bytes_recv=1000, peak_rss_mb=400.0, throttle_slept_s=0.5,
              throttle_reference_pass_s=0.01, throttle_inflation=1.1, peak_gflops=15.5, peak_source="profile")
EVAL = dict(epoch=0, step=6, test_loss=0.4, test_accuracy=0.9)
ENV = dict(host="h", cpu="c", logical_cpus=2, torch="2.13.0")
BENCHES = {  # one result.json of each bench, with the sections that bench writes
    "peak": dict(rows=[{"kind": "gemm", "n": 64, "threads": 1, "gflops_best": 9.0}], best={"gemm": {"1": 9.0}},
                 per_device=[[{"kind": "gemm"}], [{"kind": "gemm"}]], aggregate=[{"kind": "gemm", "devices": 2}]),
    "batch": dict(profile={"name": "host"}, flops_per_sample={"total_flops": 1e6}, peak_source="measured",
                  rows=[{"batch_size": 8, "status": "ok"}], best=8, largest_fitting_batch=8, limit_hit=None),
    "scaling": dict(rows=[{"devices": 1, "speedup": 1.0}]),
    "stalls": dict(ingestion_samples_per_s=900.5, read_mb_per_s={"cold": 50.0}, rows=[{"workers": 0}],
                   stall_removed_at_workers=None, verdict="no data stall"),
    "counters": dict(available=False, message="perf not found", counts={"task-clock": 1.0}, per_sample={},
                     ratios={}, samples_per_s=100.0, step_s=[0.1, 0.12]),
    "power": dict(energy_source={"kind": "none", "modelled": False}, rows=[{"setting": "1 thread"}], pareto=[]),
    "variability": dict(runs=[{"run": 0, "devices": []}], summary={"cv_across_runs": None}),
}
GROUP = dict(ranks="0-3", count=4, profile="rpi4", gflops=15.5, gflops_source="profile", batch=32, link="lte-10m",
             compute_s=11.4, comm_s=0.3, wait_s=0.0, step_s=11.7, samples_per_s=2.7, memory_mb={"weights": 42.6},
             memory_total_mb=610.0, memory_limit_mb=4096, over_limit=False)
SIM = dict(kind="modelled (simulated)", steps=8, devices=4, mode="local", seed=0, compute_cv=0.05,
           straggler_prob=0.0, straggler_factor=3.0, link_jitter=True, mean_step_s=11.9, throughput_samples_per_s=10.7,
           cluster_step_s={"mean": 11.9, "p50": 11.7, "p99": 14.3}, per_device_step_s={"mean": 11.9},
           compute_fraction=0.96, comm_fraction=0.02, wait_fraction=0.02, wait_s_per_step={"mean": 0.2})
SCALE_ROW = dict(devices=1, analytic_step_s=11.4, analytic_throughput=2.8, simulated_step_s=11.4,
                 simulated_throughput=2.8, simulated_p99_step_s=12.5, comm_fraction=0.0, wait_fraction=0.0,
                 over_limit=False, analytic_speedup=1.0, simulated_speedup=1.0, analytic_efficiency=1.0,
                 simulated_efficiency=1.0)
PREDICTION = dict(kind="modelled", model={"model": "resnet18", "params": 11173962}, traffic={"sync": "local:8"},
                  devices=4, efficiency=0.6, overlap=0.0, runtime_mb=180.0, optimizer="sgd", exchange_s=2.3, step_s=11.7,
                  throughput_samples_per_s=10.9, comm_fraction=0.024, compute_s_max=11.4,
                  memory_total_mb_max=610.0, over_limit_ranks=[], assumptions=["compute = ..."],
                  device_groups=[GROUP])
PLAN = dict(argv=["plan", "--devices", "4"], config={"model": "resnet18", "devices": 4}, prediction=PREDICTION,
            simulation=SIM, scaling={"kind": "modelled", "mode": "weak", "rows": [SCALE_ROW]})


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


@pytest.mark.parametrize("bench", sorted(BENCHES))
def test_each_bench_result_round_trips_as_its_own_class(bench):
    data = {"bench": bench, "environment": ENV, "params": {"threads": 1}, "notes": ["n"], "run_dir": "/r",
            **BENCHES[bench]}
    result = _round_trip(BenchResult, data)
    assert type(result) is BENCH_RESULTS[bench] and result.name == bench and result.environment == ENV
    assert _round_trip(type(result), data) == result


def test_a_plan_result_round_trips_with_typed_groups_simulation_and_scaling():
    plan = _round_trip(PlanResult, PLAN)
    assert isinstance(plan.prediction.device_groups[0], PlanDeviceGroup)
    assert isinstance(plan.simulation, PlanSimulation) and isinstance(plan.scaling.rows[0], PlanScalingRow)
    assert "per_device" not in plan.to_dict()["prediction"]  # left out above 1,024 devices, not written as null
    assert _round_trip(PlanResult, {**PLAN, "scaling": None}).scaling is None  # a plan without --scale


STAGE = dict(rank=1, profile="smart-speaker-2g", role="stage 1: layers 4-12", compute_s=0.8, comm_s=1.2, step_s=2.0,
             memory_mb={"weights": 1.5, "runtime": 312.0}, memory_total_mb=313.5, memory_limit_mb=2048,
             over_limit=False, sent_bytes_per_step=16777216)
COMPARISON = dict(link="lte-10m", recommended="pipeline", reason="pipeline: it fits every device",
                  strategies=[dict(strategy="pipeline", fits=True, step_s=2.0, throughput_samples_per_s=32.0,
                                   memory_total_mb_max=313.5, sent_bytes_per_step_max=16777216, bubble_fraction=0.2,
                                   devices=[STAGE], notes=["gpipe"]),
                              dict(strategy="fsdp", fits=False, refused="cannot be cut")])


def test_a_plan_result_round_trips_with_its_strategy_comparison():
    plan = PlanResult.from_dict(json.loads(json.dumps({**PLAN, "strategies": COMPARISON})))
    assert PlanResult.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan  # defaults written, read back
    assert plan.to_dict()["strategies"]["strategies"][0]["devices"] == [STAGE]
    assert isinstance(plan.strategies, PlanComparison) and isinstance(plan.strategies.strategies[0], PlanStrategy)
    assert isinstance(plan.strategies.strategies[0].devices[0], PlanStrategyDevice)
    refused = plan.strategies.strategies[1]
    assert refused.step_s is None and refused.devices == [] and refused.describe() == "fsdp: refused: cannot be cut"
    assert _round_trip(PlanResult, PLAN).strategies is None  # a plan without --strategy: the file as before


@pytest.mark.parametrize("cls, data, message", [
    (BenchResult, {"bench": "nosuch", "rows": []}, "BenchResult: key 'bench' must name a bench (peak, batch, "),
    (BenchResult, ["peak"], "BenchResult must hold a JSON object, not a list"),
    (BenchResult, {"bench": "peak", "rows": [1]}, "PeakResult: key 'rows' must be a list of objects, not a list"),
    (BenchResult, {"bench": "stalls", "rows": [], "verdict": "v"}, "lacks key 'ingestion_samples_per_s' (a number)"),
    (BenchResult, {"bench": "scaling", "rows": [], "bogus": 1}, "ScalingResult has unknown key 'bogus'"),
    (PeakResult, {"bench": "batch", "rows": []}, "PeakResult: key 'bench' must name a bench (peak), not 'batch'"),
    (PlanResult, {**PLAN, "simulation": {**SIM, "steps": 8.5}}, "key 'simulation': key 'steps' must be an integer"),
    (PlanResult, {**PLAN, "prediction": {**PREDICTION, "device_groups": [{**GROUP, "ranks": [0, 1]}]}},
     "key 'device_groups': key 'ranks' must be a string, not a list"),
    (PlanResult, {**PLAN, "scaling": {"rows": [{**SCALE_ROW, "speedup": 1}]}}, "has unknown key 'speedup'"),
    (PlanResult, {**PLAN, "strategies": {**COMPARISON, "strategies": [{**COMPARISON["strategies"][0], "fits": "yes"}]}},
     "key 'strategies': key 'fits' must be true or false"),
    (StepRecord, {**STEP, "bogus": 1}, "StepRecord has unknown key 'bogus'"),
    (StepRecord, {**STEP, "samples": "32"}, "StepRecord: key 'samples' must be an integer, not a string"),
    (StepRecord, {**STEP, "loss": True}, "StepRecord: key 'loss' must be a number or null, not true or false"),
    (EvalRecord, {"epoch": 0}, "EvalRecord lacks key 'step' (an integer)"),
    (RunSummary, {"per_device": [{"rank": 0}], "throughput_samples_per_s": 1.0},
     "RunSummary: key 'per_device' lacks key 'profile'"),
])
def test_a_bad_record_is_one_line_naming_the_key(cls, data, message):
    with pytest.raises(EdgetrainError) as e:
        cls.from_dict(data)
    assert message in str(e.value) and "\n" not in str(e.value)
