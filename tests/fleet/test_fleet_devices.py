"""Virtual devices of a fleet (fleet/devices.py): the population's shares, the availability models and the
modelled round of a device (torch-free: no training here)."""
import math

import numpy as np
import pytest

from edgetrain.errors import EdgetrainError
from edgetrain.fleet.devices import (ModelledFleet, RoundModel, assign_groups, device_round_s, parse_availability,
                                     parse_population)

POPULATION = "60% rpi4@wifi-20m, 30% smart-speaker-2g@lte-10m, 10% jetson-orin-nano"


def test_a_population_gives_each_group_its_exact_share_in_a_seeded_order():
    groups = parse_population(POPULATION)
    assert [(g.profile.name, g.link.name) for g in groups] == [("rpi4", "wifi-20m"), ("smart-speaker-2g", "lte-10m"),
                                                               ("jetson-orin-nano", "lan-1g")]  # the profile's own
    order = assign_groups(groups, 1000, seed=0)
    assert np.bincount(order).tolist() == [600, 300, 100]
    assert np.array_equal(order, assign_groups(groups, 1000, seed=0))
    assert not np.array_equal(order, assign_groups(groups, 1000, seed=1))


@pytest.mark.parametrize("text, says", [("60% rpi4, 30% jetson-nano", "add up to 90%"),
                                        ("rpi4@wifi-20m", "SHARE% PROFILE"), ("100% host", "no rated GFLOPS"),
                                        ("100% pi9", "unknown device profile"), ("100% rpi4@dialup", "link preset")])
def test_a_bad_population_is_one_line_naming_the_fix(text, says):
    with pytest.raises(EdgetrainError, match=says):
        parse_population(text)


def test_a_device_round_is_its_compute_plus_the_model_down_and_the_update_up():
    (group,) = parse_population("100% rpi4@20mbit:5ms")
    flops, down, up = 15.5e9, 2_000_000, 500_000  # one second of the rpi4's 15.5 GFLOPS
    seconds = device_round_s(group, flops, down, up)
    wire = (down + up) * 8 / 20e6  # the payloads alone on 20 Mbit/s; the model adds framing and latency
    assert 1.0 + wire < seconds < 1.0 + wire * 1.1 + 0.02


def test_diurnal_devices_are_online_their_fraction_of_the_period_at_phases_of_their_own():
    availability = parse_availability("diurnal:1h:0.25", seed=3)
    times = np.arange(0, 3600, 10.0)
    shares = [np.mean([availability.online(d, t) for t in times]) for d in range(50)]
    assert all(abs(s - 0.25) < 0.01 for s in shares)
    online_now = sum(availability.online(d, 0.0) for d in range(400))
    assert 70 < online_now < 130  # a quarter of 400, phases spread over the period
    window = next(availability.window(d, 0.0) for d in range(400) if availability.online(d, 0.0))
    assert window[1] - window[0] == pytest.approx(900.0)


def test_on_off_devices_alternate_spells_with_the_stationary_share_online():
    availability = parse_availability("onoff:30m:10m", seed=0)
    shares = np.mean([[availability.online(d, t) for t in np.arange(0, 40 * 3600, 600.0)] for d in range(40)])
    assert 0.68 < shares < 0.82  # 30 / (30 + 10) = 0.75
    device = next(d for d in range(40) if availability.online(d, 5000.0))
    start, end = availability.window(device, 5000.0)
    assert start <= 5000.0 < end and not availability.online(device, end)  # the spell ends, an off spell follows
    assert availability.offline_at(device, 5000.0, end + 1.0) == end  # a round past its window drops out
    assert availability.offline_at(device, 5000.0, end - 1e-3) is None


def test_a_trace_file_gives_each_device_its_windows_and_unnamed_devices_none(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("# device,start_s,end_s\n0,0,100\n0,200,300\n2,50,60\n")
    availability = parse_availability(f"trace:{trace}", seed=0)
    assert [availability.online(0, t) for t in (0, 99.9, 100, 150, 250, 300)] == [True, True, False, False, True,
                                                                                  False]
    assert availability.offline_at(2, 55.0, 70.0) == 60.0 and availability.offline_at(0, 10.0, 90.0) is None
    assert not any(availability.online(1, t) for t in (0, 55, 250))
    assert parse_availability("always", 0).window(5, 1e9) == (-math.inf, math.inf)


@pytest.mark.parametrize("content, says", [("0,10\n", "not device,start_s,end_s"), ("0,10,5\n", "end_s > start_s"),
                                           ("0,0,10\n0,5,20\n", "overlap")])
def test_a_bad_trace_file_is_one_line_naming_its_line(tmp_path, content, says):
    trace = tmp_path / "trace.csv"
    trace.write_text(content)
    with pytest.raises(EdgetrainError, match=says):
        parse_availability(f"trace:{trace}", seed=0)


@pytest.mark.parametrize("text", ["sometimes", "diurnal:24h", "diurnal:24h:1.5", "onoff:30m", "onoff:-1:5",
                                  "trace:/nonexistent.csv"])
def test_a_bad_availability_is_one_line(text):
    with pytest.raises(EdgetrainError, match="availability|duration|trace"):
        parse_availability(text, seed=0)


def test_sampling_draws_only_online_devices_and_an_empty_round_moves_the_clock():
    (group,) = parse_population("100% rpi4@wifi-20m")
    availability = parse_availability("diurnal:1h:0.3", seed=1)
    modelled = ModelledFleet(RoundModel((group,), availability, None, 1e9, 100_000), seed=0)
    nodes = [900 + 7 * k for k in range(200)]  # node ids are arbitrary; device k is the k-th smallest
    sampled, online = modelled.sample(1, nodes, 20)
    assert len(sampled) == 20 and 30 < online < 90
    assert all(availability.online(modelled.device_of[n], 0.0) for n in sampled)
    record = modelled.settle(1, sampled, online, {n: 50_000 for n in sampled})
    assert record["aggregated"] + record["dropouts"] == 20 and record["modelled_clock_s"] > 0
    empty = modelled.settle(2, [], 0, {})
    assert empty["modelled_round_s"] == 60.0  # nobody online and no deadline: the idle wait
