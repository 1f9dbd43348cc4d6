"""One statistic throughout: rates from the median step shown beside them, and noisy timings flagged."""
import statistics

import pytest

from edgetrain.bench import common, workload


def test_samples_per_s_is_the_batch_over_the_median_step():
    steps = [0.10, 0.11, 0.09, 0.10, 2.0]  # one stalled step: the mean would say 2.7x slower
    t = common.timing_summary(steps, 32)
    assert t["step_s_median"] == statistics.median(steps)
    assert t["samples_per_s"] == pytest.approx(32 / t["step_s_median"])
    assert not t["noisy"]  # one outlier moves neither the median nor the IQR much


def test_a_timing_that_spreads_is_flagged_noisy():
    t = common.timing_summary([0.1, 0.3, 0.1, 0.3, 0.2], 8)
    assert t["spread"] == pytest.approx(1.0) and t["noisy"]
    assert common.spread_cell(t["spread"], t["noisy"]) == "100% !"
    assert common.relative_spread([1.0]) is None


def test_time_steps_times_until_the_minimum_time_has_passed():
    from torch import nn

    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    out = workload.time_steps(model, 4, steps=2, warmup=0, dataset="digits", threads=1, min_time_s=0.05)
    assert out["steps"] == len(out["step_s"]) >= 2 and sum(out["step_s"]) >= 0.05 * 0.5
    assert out["samples_per_s"] == pytest.approx(4 / statistics.median(out["step_s"]))
    assert out["samples_per_s_mean"] == pytest.approx(4 * out["steps"] / sum(out["step_s"]))
