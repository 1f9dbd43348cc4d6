"""The link model, presets and specs, and the clock arithmetic of the emulator."""
from __future__ import annotations

import time

import pytest

from edgetrain.cluster.links import collective_time
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.config import TrainConfig, load_config, resolve
from edgetrain.errors import EdgetrainError
from edgetrain.spec import PRESETS, Link, get_link, parse_rate, parse_sync, parse_time


def test_presets_as_specified():
    assert PRESETS["wifi-20m"].bandwidth_bps == 20e6 and PRESETS["wifi-20m"].latency_s == 0.005
    assert PRESETS["lte-10m"].bandwidth_bps == 10e6 and PRESETS["lte-10m"].latency_s == 0.050
    wan = PRESETS["wan-intercontinental"]
    assert wan.bandwidth_bps == 100e6 and wan.latency_s == 0.078
    assert get_link("lan-1g").bandwidth_bps == 1e9


def test_inline_and_mapping_specs():
    link = get_link("20mbit:5ms:jitter=1ms:loss=0.01")
    assert (link.bandwidth_bps, link.latency_s, link.jitter_s, link.loss) == (20e6, 0.005, 0.001, 0.01)
    assert get_link({"preset": "lte-10m", "loss": 0.02}).loss == 0.02
    assert get_link({"bandwidth": "1gbit", "latency": "300us"}).latency_s == pytest.approx(3e-4)
    assert get_link(None) is None and get_link("none") is None
    assert parse_rate("2.5Mbit") == 2.5e6 and parse_time("1.5s") == 1.5


@pytest.mark.parametrize("spec, message", [
    ("lte-5g", "unknown link preset 'lte-5g'; use one of lan-1g, wifi-20m, lte-10m, wan-intercontinental"),
    ("20mbit:5ms:loss=2", "loss must be in"), ("fast:5ms", "bad bandwidth"), ("20mbit:soon", "bad time"),
    ("20mbit:5ms:mtu=1500", "bad link option"),
])
def test_bad_links(spec, message):
    with pytest.raises(EdgetrainError, match=message):
        get_link(spec)


def test_time_model_rounds_and_bottleneck():
    lte = Link(10e6, 0.05)
    n = 1_000_000
    # by hand, at 10 Mbit/s = 1.25e6 bytes/s: a round costs the latency, gloo's 80 us and one 1514-byte frame's
    # store-and-forward; the payload goes at 1448 bytes a 1514-byte frame, and in a ring (every device sends
    # while it receives) with half a 66-byte ACK a segment more: 1547 bytes on the wire per 1448 of payload
    per_round = 0.05 + 80e-6 + 1514 / 1.25e6
    ring_payload = n * 1547 / 1448 / 1.25e6
    assert collective_time([lte] * 4, "allreduce", n) == pytest.approx(6 * per_round + ring_payload, rel=1e-12)
    assert collective_time([lte] * 4, "allgather", n) == pytest.approx(3 * per_round + ring_payload, rel=1e-12)
    assert collective_time([lte] * 3, "p2p", n) == pytest.approx(per_round + n * 1514 / 1448 / 1.25e6, rel=1e-12)
    # the figures written out: 6 x 0.0513 + 0.8546 (the payload of a 1 MB all-reduce at 10 Mbit/s: 0.8 s bare)
    assert collective_time([lte] * 4, "allreduce", n) == pytest.approx(1.16244, abs=1e-5)
    # the slowest link taking part sets the pace
    fast = Link(1e9, 0.001)
    assert collective_time([fast, fast, lte, fast], "allreduce", n) == pytest.approx(
        collective_time([lte] * 4, "allreduce", n))
    # the planner's form: distinct links and a device count
    assert collective_time([lte], "allreduce", n, devices=4) == collective_time([lte] * 4, "allreduce", n)
    # loss: expected retransmissions lower the goodput (frames and payload alike)
    lossy = Link(10e6, 0.05, loss=0.2)
    assert collective_time([lossy] * 2, "p2p", n) == pytest.approx(
        0.05 + 80e-6 + (1514 + n * 1514 / 1448) / (1.25e6 * 0.8), rel=1e-12)


def test_wire_framing_constants():
    from edgetrain.cluster import links

    # MTU 1500 less IPv4 (20), TCP (20) and timestamps (12) headers; 14 bytes of Ethernet header on top
    assert (links.MSS, links.FRAME_BYTES, links.ACK_BYTES) == (1448, 1514, 66)
    assert links.wire_bytes_per_byte("p2p") == pytest.approx(1.045580, abs=1e-6)
    assert links.wire_bytes_per_byte("allreduce") == links.wire_bytes_per_byte("allgather") == pytest.approx(
        1.068370, abs=1e-6)


def test_jitter_is_seeded():
    jittery = Link(10e6, 0.05, jitter_s=0.01)
    a = collective_time([jittery] * 4, "allreduce", 1000, seed=7)
    assert a == collective_time([jittery] * 4, "allreduce", 1000, seed=7)
    assert a != collective_time([jittery] * 4, "allreduce", 1000, seed=8)
    assert a > 0


def test_virtual_clock_adds_compute_and_modelled_comm():
    link = Link(8e6, 0.1)  # 1 MB/s
    emu = LinkEmulator([link, link], rank=0, mode="virtual")
    emu.start_step()
    time.sleep(0.02)  # compute
    emu.run("allreduce", 500_000, lambda: time.sleep(0.05))  # real collective on the host: not compute
    emu.arrive()
    step = emu.finish_step(ready_s=None)
    # the link model (test_time_model_rounds_and_bottleneck): 2 rounds of latency, gloo's 80 us and a frame;
    # 500 kB with framing and ACKs at 1 MB/s
    modelled = 2 * (0.1 + 80e-6 + 1514 / 1e6) + 500_000 * 1547 / 1448 / 1e6
    assert step["comm_model_s"] == pytest.approx(modelled, rel=1e-12)
    assert 0.015 < step["compute_s"] < 0.045
    assert emu.virtual_s == pytest.approx(step["compute_s"] + modelled)
    assert emu.stats.bytes_sent == 500_000
    # a later device: the next step starts when the slowest one arrived
    emu.start_step()
    step = emu.finish_step(ready_s=10.0)
    assert emu.virtual_s == pytest.approx(10.0)


def test_enforced_clock_waits_for_the_link():
    link = Link(8e6, 0.05)
    emu = LinkEmulator([link, link], rank=0, mode="enforced")
    started = time.perf_counter()
    emu.start_step()
    emu.run("p2p", 100_000, lambda: None)  # 0.05 + 0.1 s
    emu.finish_step()
    assert 0.15 <= time.perf_counter() - started < 0.25
    assert emu.virtual_s == pytest.approx(time.perf_counter() - started, abs=0.02)


@pytest.mark.parametrize("spec, message", [
    ("local:0", "H must be >= 1"), ("local", "needs the number of local steps"), ("async:0", "use --sync sync"),
    ("gossip:0", ">= 1"), ("ring", "unknown sync mode"), ("local:8:lr=0.5", "add :nesterov"),
])
def test_bad_sync_specs(spec, message):
    with pytest.raises(EdgetrainError, match=message):
        parse_sync(spec)


@pytest.mark.parametrize("kw, message", [
    (dict(compress="powersgd", sync="local:8"), "works with --sync sync only"),
    (dict(compress="topk:0.01:dgc", sync="async:2"), "drop :dgc"),
    (dict(compress="threshold", sync="async:2"), "variable number"),
    (dict(compress="topk:0.01", sync="gossip"), "none only"),
    (dict(link="moon-1k"), "unknown link preset"),
    (dict(link_mode="real"), "link mode must be one of"),
])
def test_resolve_refuses(kw, message):
    with pytest.raises(EdgetrainError, match=message):
        resolve(TrainConfig(**kw))  # not load_config: its per-key checks would catch link_mode first


def test_resolve_accepts_the_issue_example():
    spec = resolve(load_config(None, compress="topk:0.01", sync="local:8", link="lte-10m"))
    assert (spec.compress.method, spec.compress.arg, spec.sync.mode, spec.sync.period) == ("topk", 0.01, "local", 8)
    assert spec.link == PRESETS["lte-10m"]
