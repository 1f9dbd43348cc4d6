"""The planner at scale: a small cluster plans exactly as before the vectorisation, a large one in bounded time.

``small_cluster_before.json`` holds ``small_cluster_outputs`` as computed by the
planner before it was vectorised (commit 6b931f5, per-device Python loops), its
time figures recomputed once when the link model gained TCP/IP framing, ACKs and
gloo's per-round cost (only times changed: splits, memory and groups' members did not):
regenerate it only on purpose, with ``python tests/plan/test_plan_scale.py OUT.json``.
"""
import json
import math
import sys
import time
from pathlib import Path

import pytest

from edgetrain.cluster.profiles import plan_devices, split_batch
from edgetrain.config import load_config
from edgetrain.plan.config import plan_inputs, predict_inputs
from edgetrain.plan.report import device_groups
from edgetrain.plan.simulation import scaling, simulate

from test_plan_model import COSTS

BEFORE = Path(__file__).with_name("small_cluster_before.json")

# speeds, not GFLOPS: a balanced split then does not depend on this host's measured core
SPEEDS = """
profiles:
  slow: {speed: 0.3}
  mid: {speed: 0.45}
  fast: {speed: 1.7}
devices:
  - mid
  - {profile: fast, count: 3}
  - {profile: slow, count: 2}
  - mid
"""
# GFLOPS, not speeds: compute times then do not depend on this host's measured core either
CLUSTER = """
profiles:
  slow: {base: rpi4, gflops: 4.0}
  fast: {base: jetson-nano, gflops: 30.0}
devices:
  - rpi4
  - {profile: fast, count: 3, link: wifi-20m}
  - {profile: slow, count: 2}
  - jetson-nano
"""


def small_cluster_outputs(tmp: Path) -> dict:
    """Batch splits, predictions, device groups, simulations and scaling rows of a 7-device mixed cluster."""
    speeds, cluster = tmp / "speeds.yaml", tmp / "cluster.yaml"
    speeds.write_text(SPEEDS)
    cluster.write_text(CLUSTER)
    out = {}
    for local_batch, batch in (("even", 100), ("balanced", 100), ("balanced", 1003), ("even", 7), ("balanced", 7)):
        cfg = load_config(cluster=str(speeds), batch_size=batch, local_batch=local_batch)
        out[f"split {local_batch} {batch}"] = split_batch(cfg, plan_devices(cfg))
    for sync in ("sync", "local:4", "gossip", "async:2"):
        inputs = plan_inputs(load_config(cluster=str(cluster), batch_size=112, sync=sync), costs=COSTS)
        pred = predict_inputs(inputs, runtime_mb=100)
        d = pred.to_dict()
        out[sync] = {
            "prediction": {k: d[k] for k in ("exchange_s", "step_s", "throughput_samples_per_s", "comm_fraction",
                                             "compute_s_max", "memory_total_mb_max")},
            "per_device": [[r["batch"], r["compute_s"], r["step_s"], r["wait_s"], r["link"]] for r in d["per_device"]],
            "groups": [g.to_dict() for g in device_groups(pred)],
            "simulation": simulate(pred, steps=12, compute_cv=0.1, straggler_prob=0.05, jitter=True, seed=3).to_dict(),
            "simulation_without_jitter": simulate(pred, steps=12, compute_cv=0.1, jitter=False, seed=3).to_dict(),
            "scaling": [r.to_dict() for r in scaling(lambda n: predict_inputs(inputs, n, runtime_mb=100),
                                                     [1, 2, 7, 13], 8, seed=1)],
        }
    return json.loads(json.dumps(out))  # as stored: tuples become lists


def assert_same(got, want, where="") -> None:
    """Equal, floats to 1e-12 relative: sums of equal round times are now products, not sums."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-15), f"{where}: {got!r} != {want!r}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def test_small_cluster_plans_as_before(tmp_path):
    assert_same(small_cluster_outputs(tmp_path), json.loads(BEFORE.read_text()))


@pytest.mark.parametrize("sync", ["sync", "local:4"])
def test_100k_devices_plan_in_seconds(sync):
    """Once quadratic (39 s for --devices 100000), now linear. CPU time: other load on the host does not count."""
    cfg = load_config(devices=100_000, profile="rpi4", link="lte-10m", batch_size=1_600_000, sync=sync)
    started = time.process_time()
    pred = predict_inputs(plan_inputs(cfg, costs=COSTS), runtime_mb=100)
    result = simulate(pred, steps=20, seed=0)
    groups = device_groups(pred)
    spent = time.process_time() - started
    assert len(pred.devices) == 100_000 and len(groups) == 1 and groups[0].count == 100_000
    assert result.mean_step_s >= pred.step_s  # jitter and compute noise only ever delay a synchronising step
    assert spent < 8.0, f"planning 100,000 devices took {spent:.1f} s of CPU time"


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        Path(sys.argv[1]).write_text(json.dumps(small_cluster_outputs(Path(tmp)), indent=1) + "\n")
