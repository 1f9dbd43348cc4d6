"""Tiling geometry against brute force, in one process: every tile, computed alone from the region
the plan says it needs, must equal the same crop of the untiled computation."""
from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.errors import EdgetrainError
from edgetrain.tiling.grouping import Machine, choose_groups, grouping_cost
from edgetrain.tiling.layers import describe
from edgetrain.tiling.plan import SectionPlan, area
from edgetrain.tiling.regions import Window
from edgetrain.tiling.tiled import Comm, run_units

from .models import BasicBlock


def random_layer(rng: random.Random, c: int) -> nn.Module:
    kind = rng.choice(["conv", "conv", "conv", "maxpool", "avgpool", "pad", "act", "bn", "block"])
    if kind == "conv":
        k, s, d = rng.choice([1, 2, 3, 5]), rng.choice([1, 1, 2, 3]), rng.choice([1, 1, 2])
        padding = rng.choice([0, k // 2, "same" if s == 1 else 1])
        return nn.Conv2d(c, rng.choice([2, 3]), k, s, padding, d, bias=rng.random() < 0.5)
    if kind == "maxpool":
        k = rng.choice([2, 3])
        return nn.MaxPool2d(k, rng.choice([1, 2, k]), rng.choice([0, k // 2]), rng.choice([1, 2]),
                            ceil_mode=rng.random() < 0.5)
    if kind == "avgpool":
        k = rng.choice([2, 3])
        return nn.AvgPool2d(k, rng.choice([1, 2]), rng.choice([0, k // 2]))
    if kind == "pad":
        return nn.ZeroPad2d(tuple(rng.choice([0, 1, 2]) for _ in range(4)))
    if kind == "bn":
        return nn.BatchNorm2d(c)
    if kind == "block":
        return BasicBlock(c, rng.choice([c, 3]), rng.choice([1, 2]))
    return rng.choice([nn.ReLU(), nn.LeakyReLU(0.1), nn.SiLU()])


def check_tiles(layers: list[nn.Module], x: torch.Tensor, grid: tuple[int, int], ends: list[int]) -> None:
    units, c = [], x.shape[1]
    for i, m in enumerate(layers):
        units.append(describe(str(i), m, c))
        c = units[-1].out_channels
    full = [x]
    with torch.no_grad():
        for m in layers:
            full.append(m(full[-1]))
    plan = SectionPlan(units, tuple(x.shape[2:]), grid, x.shape[1])
    comm = Comm()
    for p in range(len(units) + 1):  # ownership partitions every map
        assert sum(area(plan.owned(p, d)) for d in range(plan.devices)) == full[p].shape[2] * full[p].shape[3]
    for a, b in zip([0] + ends[:-1], ends):
        for d in range(plan.devices):
            need = plan.group_input(a, b, d)
            if a > 0:  # what a device holds plus what it receives is exactly what it needs
                received = sum(area(r) for _, r in plan.halo_pieces(a, b, d))
                assert area(plan.owned(a, d)) + received == area(need)
            (r0, r1), (c0, c1) = need
            with torch.no_grad():
                got = run_units(plan.units[a:b], plan.steps(a, b, d, 0), plan.steps(a, b, d, 1),
                                full[a][:, :, r0:r1, c0:c1], comm)
            (r0, r1), (c0, c1) = plan.owned(b, d)
            want = full[b][:, :, r0:r1, c0:c1]
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-12), (layers, grid, ends, a, b, d)


def test_random_stacks_match_brute_force():
    rng = random.Random(0)
    torch.manual_seed(0)
    checked = 0
    for _ in range(60):
        layers, c = [], 3
        for _ in range(rng.randint(2, 6)):
            layers.append(random_layer(rng, c).double().eval())
            c = describe("probe", layers[-1], c).out_channels
        h, w = rng.randint(9, 31), rng.randint(9, 31)
        grid = (rng.randint(1, 3), rng.randint(1, 3))
        n = len(layers)
        cut = sorted(rng.sample(range(1, n), rng.randint(0, n - 1)))
        x = torch.randn(2, 3, h, w, dtype=torch.float64)
        try:
            with torch.no_grad():
                nn.Sequential(*layers)(x)
        except RuntimeError:  # the untiled stack itself shrinks the map to nothing: not a case
            continue
        try:
            check_tiles(layers, x, grid, cut + [n])
        except EdgetrainError as e:  # a map smaller than the grid: the clear error, then skip the case
            assert "larger than the feature map" in str(e) or "empty" in str(e)
            continue
        checked += 1
    assert checked >= 30  # most random cases are feasible; they were all checked


@pytest.mark.parametrize("k,s,p,d,ceil", [(3, 2, 1, 1, True), (2, 2, 0, 1, True), (3, 3, 1, 2, True), (5, 2, 2, 1, False)])
def test_window_out_size_matches_pytorch(k, s, p, d, ceil):
    for n in range(max(d * (k - 1) + 1 - 2 * p, 1), 30):
        got = Window(k, s, p, p, d, ceil).out_size(n)
        want = F.max_pool2d(torch.zeros(1, 1, n, 1), (k, 1), (s, 1), (p, 0), (d, 1), ceil_mode=ceil).shape[2]
        assert got == want, n


def test_uneven_odd_split_with_dropped_row():
    # 23 rows, 3 tiles, and a stride-2 pool that drops the last row: every row still has one owner.
    layers = [nn.Conv2d(1, 2, 3, padding=1).double(), nn.BatchNorm2d(2).double().eval(), nn.MaxPool2d(2),
              nn.Conv2d(2, 2, 3, stride=2, padding=1, dilation=1).double()]
    check_tiles(layers, torch.randn(1, 1, 23, 17, dtype=torch.float64), (3, 2), [2, 4])


def small_plan(grid=(2, 2)) -> SectionPlan:
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
              nn.Conv2d(8, 16, 3, padding=1)]
    units, c = [], 3
    for i, m in enumerate(layers):
        units.append(describe(str(i), m, c))
        c = units[-1].out_channels
    return SectionPlan(units, (32, 32), grid, 3)


def test_auto_grouping_is_the_cheapest_by_exhaustive_search():
    plan = small_plan()
    for machine in (Machine(1e9, 1e6, 1e-3, {}), Machine(1e10, 1e9, 1e-6, {}), Machine(1e8, 1e5, 1e-2, {})):
        ends, why = choose_groups(plan, 4, 4, machine)
        best = min(grouping_cost(plan, list(cut) + [6], 4, 4, machine)["modelled_seconds"]
                   for r in range(6) for cut in itertools.combinations(range(1, 6), r))
        assert grouping_cost(plan, ends, 4, 4, machine)["modelled_seconds"] == pytest.approx(best)
        assert "auto grouping" in why and "one fused group" in why


def test_auto_grouping_trades_recompute_for_messages():
    plan = small_plan()
    slow_link, _ = choose_groups(plan, 4, 4, Machine(1e12, 1e3, 1.0, {}))
    free_link, _ = choose_groups(plan, 4, 4, Machine(1e6, 1e15, 0.0, {}))
    assert slow_link == [6]  # messages cost a second each: fuse everything
    assert len(free_link) > 1  # messages are free: exchange rather than recompute
    assert grouping_cost(plan, free_link, 4, 4, Machine(1e6, 1e15, 0.0, {}))["recompute_overhead_pct"] < \
        grouping_cost(plan, [6], 4, 4, Machine(1e6, 1e15, 0.0, {}))["recompute_overhead_pct"]
