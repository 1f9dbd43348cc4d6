"""The step simulator: agrees with the analytic model without variability, repeats for a seed, scales to 4096."""
import dataclasses

import numpy as np
import pytest

from edgetrain.cluster.links import Link, collective_time
from edgetrain.cluster.profiles import DeviceSpec
from edgetrain.comm.accounting import ring_allreduce_bytes
from edgetrain.plan.simulation import _exchange_times, scaling, simulate

from test_plan_model import LTE, PI, plan

EXACT = dict(compute_cv=0.0, straggler_prob=0.0, jitter=False)


def mixed(n: int) -> list[DeviceSpec]:
    slow = dataclasses.replace(PI, name="slow", gflops=5.0)
    return [DeviceSpec(r, slow if r % 3 == 0 else PI, None, LTE) for r in range(n)]


@pytest.mark.parametrize("sync, devices", [("sync", mixed(5)), ("local:4", mixed(5)), ("gossip", None),
                                           ("gossip:2", None), ("sync", None)])
def test_without_variability_the_simulator_equals_the_analytic_model(sync, devices):
    pred = plan(6, sync=sync, devices=devices)
    result = simulate(pred, steps=40, **EXACT)
    assert result.mean_step_s == pytest.approx(pred.step_s, rel=1e-9)
    assert result.throughput == pytest.approx(pred.throughput, rel=1e-9)
    assert result.to_dict()["comm_fraction"] == pytest.approx(pred.devices[0].comm_s / pred.step_s, rel=1e-9)


@pytest.mark.parametrize("sync", ["async:2", "async:8"])
def test_async_without_variability_matches_up_to_the_first_and_last_round(sync):
    pred = plan(4, sync=sync)
    result = simulate(pred, steps=400, **EXACT)
    assert result.mean_step_s == pytest.approx(pred.step_s, rel=0.02)


def test_deterministic_for_a_seed():
    pred = plan(16, sync="local:4")
    noisy = dict(compute_cv=0.1, straggler_prob=0.05, straggler_factor=3.0, jitter=True)
    a, b = simulate(pred, steps=50, seed=3, **noisy), simulate(pred, steps=50, seed=3, **noisy)
    c = simulate(pred, steps=50, seed=4, **noisy)
    assert np.array_equal(a.step_ends, b.step_ends) and a.to_dict() == b.to_dict()
    assert not np.array_equal(a.step_ends, c.step_ends)
    # variability only ever makes a synchronising step later than its mean
    assert a.mean_step_s > pred.step_s


def test_jitter_sampling_matches_the_comm_link_model():
    p, sent = 4, ring_allreduce_bytes(4_000_000, 4)
    pred = plan(p, devices=[DeviceSpec(r, PI, None, "10mbit:50ms:jitter=20ms") for r in range(p)])
    drawn = _exchange_times(np.random.default_rng(0), pred, 4000, jitter=True)
    links = [Link(10e6, 0.050, 0.020)] * p
    reference = [collective_time(links, "allreduce", sent, seed=s) for s in range(4000)]
    assert drawn.mean() == pytest.approx(np.mean(reference), rel=0.01)
    assert drawn.std() == pytest.approx(np.std(reference), rel=0.1)


def test_stragglers_slow_a_synchronous_cluster_down():
    pred = plan(32)
    calm = simulate(pred, steps=100, compute_cv=0.0, jitter=False)
    stragglers = simulate(pred, steps=100, compute_cv=0.0, straggler_prob=0.05, straggler_factor=4.0, jitter=False)
    assert stragglers.mean_step_s > calm.mean_step_s + pred.devices[0].compute_s  # most steps have one
    assert stragglers.to_dict()["wait_fraction"] > 0


def test_4096_devices_simulate_every_step():
    for sync in ("sync", "gossip", "async:4"):
        pred = plan(4096, sync=sync)
        result = simulate(pred, steps=100, compute_cv=0.05, straggler_prob=0.01)
        assert result.step_ends.shape == (4096, 100)
        assert np.all(np.isfinite(result.step_ends)) and np.all(np.diff(result.step_ends, axis=1) > 0)
        summary = result.to_dict()
        assert summary["devices"] == 4096 and summary["cluster_step_s"]["p99"] >= summary["cluster_step_s"]["p50"]


def test_scaling_rows():
    rows = scaling(lambda n: plan(n), [1, 2, 4, 8], steps=20, **EXACT)
    assert [r.devices for r in rows] == [1, 2, 4, 8]
    assert rows[0].analytic_speedup == 1 and rows[0].comm_fraction == 0
    effs = [r.analytic_efficiency for r in rows]
    assert effs == sorted(effs, reverse=True) and effs[-1] < 1  # communication costs efficiency
    assert all(r.simulated_step_s == pytest.approx(r.analytic_step_s) for r in rows)
