"""benchmarks/cache.py's policy simulations, against the closed forms they stand for (docs/benchmarks/storage.md)."""
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

spec = importlib.util.spec_from_file_location("cache_bench", Path(__file__).parents[2] / "benchmarks" / "cache.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def orders(items: int, epochs: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.permutation(items).tolist() for _ in range(epochs)]


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_lru_over_random_epochs_hits_c_plus_1_minus_c_log_1_minus_c(fraction):
    # An item read at fraction u of one epoch and v of the next is still in an LRU cache of fraction c if fewer
    # than c distinct items came between: 1 - u(1 - v) < c, probability c + (1 - c) ln(1 - c).
    items = 4000
    misses = bench.simulate_lru(orders(items, 4), int(fraction * items))
    assert misses[0] == items
    expected = 1 - (fraction + (1 - fraction) * math.log(1 - fraction))
    assert np.mean(misses[1:]) / items == pytest.approx(expected, abs=0.02)


def test_minio_misses_exactly_the_items_it_does_not_hold_after_the_first_epoch():
    items = 1000
    cached = set(range(0, items, 2))
    misses = bench.simulate_minio(orders(items, 3), cached)
    assert misses == [items, items // 2, items // 2]


def test_lru_with_room_for_everything_misses_only_the_first_epoch():
    assert bench.simulate_lru(orders(50, 3), 50) == [50, 0, 0]
