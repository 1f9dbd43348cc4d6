"""The analytic cost model: compute, communication per mode, memory, and clear errors."""
import dataclasses

import pytest

from edgetrain.cluster.links import Link, collective_time
from edgetrain.cluster.profiles import DeviceProfile, DeviceSpec
from edgetrain.comm.accounting import ring_allreduce_bytes
from edgetrain.config import load_config
from edgetrain.errors import EdgetrainError
from edgetrain.plan.config import plan_inputs
from edgetrain.plan.costs import ModelCosts
from edgetrain.plan.model import PredictOptions, predict
from edgetrain.plan.exchanges import traffic
from edgetrain.spec import parse_compress, parse_sync

N = 1_000_000  # parameters of the fake model: one 1000 x 1000 matrix, one DDP bucket
COSTS = ModelCosts(model="fake", input_shape=(3, 32, 32), num_classes=10, params=N, param_bytes=4 * N,
                   buffer_bytes=0, train_flops_per_sample=1e9, forward_flops_per_sample=3e8,
                   activation_bytes_per_sample=2**20, param_shapes=((1000, 1000),), buckets=((0,),))
PI = DeviceProfile("pi", cores=4, gflops=10.0, memory_mb=4096)
LTE = "10mbit:50ms"


def cluster(n: int, profile: DeviceProfile = PI, link: str | None = LTE) -> list[DeviceSpec]:
    return [DeviceSpec(r, profile, None, link) for r in range(n)]


def plan(n: int, sync: str = "sync", compress: str = "none", devices=None, batches=None, **kw):
    devices = devices or cluster(n)
    batches = batches or [16] * len(devices)
    return predict(COSTS, devices, batches, traffic(COSTS, len(devices), parse_sync(sync), parse_compress(compress)),
                   PredictOptions(runtime_mb=100, **kw))


def test_compute_time_is_flops_over_gflops_and_doubling_gflops_halves_it():
    one = plan(1, efficiency=0.5)
    assert one.devices[0].compute_s == pytest.approx(1e9 * 16 / (10e9 * 0.5))
    fast = dataclasses.replace(PI, name="fast", gflops=20.0)
    mixed = plan(2, devices=[DeviceSpec(0, PI, None, LTE), DeviceSpec(1, fast, None, LTE)], efficiency=0.5)
    assert mixed.devices[1].compute_s == pytest.approx(mixed.devices[0].compute_s / 2)
    # the step waits for the slowest device; the fast one waits
    assert mixed.devices[1].wait_s == pytest.approx(mixed.devices[0].compute_s / 2)


def test_one_device_has_no_communication():
    for sync in ("sync", "local:4", "async:2", "gossip"):
        pred = plan(1, sync=sync)
        assert pred.exchange_s == 0 and pred.devices[0].comm_s == 0
        assert pred.step_s == pytest.approx(pred.devices[0].compute_s)


def test_ring_allreduce_time_matches_the_formula_and_the_comm_link_model():
    p, latency, bandwidth = 4, 0.050, 10e6
    pred = plan(p)
    sent = 2 * (p - 1) / p * 4 * N
    # per round: latency, gloo's 80 us, one 1514-byte frame; the payload at 1547 wire bytes per 1448 (framing,
    # ACKs of a ring) (edgetrain.cluster.links)
    def ring(bandwidth):
        return 2 * (p - 1) * (latency + 80e-6 + 1514 * 8 / bandwidth) + sent * 8 / bandwidth * 1547 / 1448
    assert pred.exchange_s == pytest.approx(ring(bandwidth))
    links = [Link(bandwidth, latency)] * p
    assert pred.exchange_s == pytest.approx(collective_time(links, "allreduce", ring_allreduce_bytes(4 * N, p)))
    assert pred.step_s == pytest.approx(pred.devices[0].compute_s + pred.exchange_s)
    # the slowest link taking part bottlenecks every round
    slow = cluster(p)
    slow[2] = dataclasses.replace(slow[2], link="1mbit:50ms")
    assert plan(p, devices=slow).exchange_s == pytest.approx(ring(1e6))


def test_local_sgd_divides_communication_per_step_by_h():
    sync, local = plan(4), plan(4, sync="local:8")
    assert local.exchange_s == pytest.approx(sync.exchange_s)  # one bucket: the same bytes in one collective
    assert local.devices[0].comm_s == pytest.approx(sync.devices[0].comm_s / 8)
    assert local.step_s == pytest.approx(local.devices[0].compute_s + sync.exchange_s / 8)


def test_gossip_talks_to_two_neighbours_whatever_the_cluster_size():
    small, large = plan(8, sync="gossip"), plan(4096, sync="gossip")
    assert small.exchange_s == pytest.approx(large.exchange_s) == pytest.approx(
        0.050 + 80e-6 + (1514 + 2 * 4 * N * 1514 / 1448) * 8 / 10e6)  # one p2p round, framing, no ACK share
    assert plan(4096).exchange_s > 50 * small.exchange_s  # the all-reduce's 2(p-1) latencies grow with p


def test_overlap_hides_communication_behind_compute():
    base, hidden = plan(4), plan(4, overlap=1.0)
    compute = base.devices[0].compute_s
    assert hidden.step_s == pytest.approx(compute + base.exchange_s - min(base.exchange_s, compute))


def test_async_steps_at_compute_speed_until_rounds_are_the_bottleneck():
    pred = plan(4, sync="async:2")
    c, tc = pred.devices[0].compute_s, pred.exchange_s
    assert pred.step_s == pytest.approx(max(c, tc / 2))


def test_memory_parts_and_over_limit_flag():
    small = dataclasses.replace(PI, name="small", memory_mb=64)
    pred = plan(2, devices=[DeviceSpec(0, PI, None, LTE), DeviceSpec(1, small, None, LTE)], optimizer="adam")
    m = pred.devices[0].memory_mb
    mib = 4 * N / 2**20
    assert m["weights"] == pytest.approx(mib) and m["gradients"] == pytest.approx(mib)
    assert m["optimizer"] == pytest.approx(2 * mib)                      # Adam: two moments
    assert m["comm_buffers"] == pytest.approx(mib)                       # DDP's bucket copy
    assert m["activations"] == pytest.approx(16) and m["runtime"] == 100
    assert pred.over_limit == [1] and not pred.devices[0].over_limit
    sgd = plan(1, optimizer="sgd", momentum=0.0)
    assert sgd.devices[0].memory_mb["optimizer"] == 0 and sgd.devices[0].memory_mb["comm_buffers"] == 0


@pytest.mark.parametrize("overrides, message", [
    (dict(profile="nope"), "unknown device profile 'nope'"),
    (dict(devices=4, batch_size=2), "batch_size 2 is smaller than the 4 devices"),
    (dict(compress="threshold"), "cannot predict"),
    (dict(devices=2, profile="host"), "no link"),
])
def test_bad_input_is_one_clear_error(overrides, message):
    cfg = dict(model="small_cnn", dataset="synthetic", image_size=8, devices=2, profile="rpi4", link="lte-10m",
               batch_size=8) | overrides
    if overrides.get("profile") == "host":
        cfg.pop("link")
    with pytest.raises(EdgetrainError, match=message):
        inputs = plan_inputs(load_config(None, **cfg))
        predict(inputs.costs, inputs.devices, inputs.batches, traffic(inputs.costs, len(inputs.devices),
                inputs.spec.sync, inputs.spec.compress), PredictOptions(runtime_mb=100))


def test_efficiency_and_overlap_are_checked():
    with pytest.raises(EdgetrainError, match="efficiency"):
        plan(2, efficiency=0.0)
    with pytest.raises(EdgetrainError, match="overlap"):
        plan(2, overlap=-0.1)


def test_host_profile_devices_share_this_machines_cores_and_plan_says_what_it_leaves_out(monkeypatch):
    from edgetrain.cluster import profiles
    from edgetrain.cluster.profiles import BUILTIN_PROFILES, device_gflops, host_core_gflops
    from edgetrain.plan import model as plan_model

    host = BUILTIN_PROFILES["host"]
    core = host_core_gflops()
    monkeypatch.setattr(profiles.os, "cpu_count", lambda: 4)
    # as the training loop pins them (cluster.throttle.assign_cores): 4 cores // n each, a time share beyond 4
    assert device_gflops(host, 1)[0] == pytest.approx(4 * core)
    assert device_gflops(host, 2)[0] == pytest.approx(2 * core)
    assert device_gflops(host, 3)[0] == pytest.approx(1 * core)
    assert device_gflops(host, 8)[0] == pytest.approx(0.5 * core)
    # a profile with its own rate is not shared
    assert device_gflops(PI, 8)[0] == pytest.approx(device_gflops(PI)[0])
    pred = plan(2, devices=[DeviceSpec(r, host, None, LTE) for r in range(2)])
    assert pred.devices[0].gflops == pytest.approx(2 * core)
    assert plan_model.HOST_PROFILE_ERROR in pred.assumptions
    assert plan_model.HOST_PROFILE_ERROR not in plan(2).assumptions
