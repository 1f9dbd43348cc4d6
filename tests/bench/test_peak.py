import pytest
import torch

from edgetrain.bench import peak
from edgetrain.cli import main
from edgetrain.errors import EdgetrainError

from bench_helpers import assert_png, read_result


def test_peak_writes_consistent_gflops(tmp_path):
    assert main(["bench", "peak", "--gemm-sizes", "64,128", "--linpack-sizes", "64,96", "--threads", "1",
                 "--min-time", "0.01", "--output", str(tmp_path), "--name", "p"]) == 0
    result = read_result(tmp_path / "p")
    assert {(r["kind"], r["n"]) for r in result["rows"]} == {("gemm", 64), ("gemm", 128), ("linpack", 64),
                                                             ("linpack", 96)}
    for r in result["rows"]:
        flops = 2 * r["n"] ** 3 if r["kind"] == "gemm" else 2 / 3 * r["n"] ** 3 + 2 * r["n"] ** 2
        assert r["flops"] == pytest.approx(flops)
        assert r["gflops_best"] == pytest.approx(flops / r["best_s"] / 1e9)
        assert r["gflops_best"] >= r["gflops_median"] > 0
        if r["kind"] == "linpack":
            assert 0 <= r["max_scaled_residual"] < peak.RESIDUAL_THRESHOLD
    assert result["best"]["gemm"]["1"] == max(r["gflops_best"] for r in result["rows"] if r["kind"] == "gemm")
    assert_png(tmp_path / "p" / "peak.png")


def test_linpack_residual_check_fails_loudly_on_a_wrong_solve():
    def corrupted(a, b):
        x = torch.linalg.solve(a, b)
        x[3] += 1e-6 * x.abs().max()  # one wrong component, far beyond rounding error
        return x

    with pytest.raises(peak.ResidualCheckError, match="residual check failed"):
        peak.linpack(64, 1, min_time_s=0.0, min_repeats=1, solve=corrupted)
    assert issubclass(peak.ResidualCheckError, EdgetrainError)
    ok = peak.linpack(64, 1, min_time_s=0.0, min_repeats=1)
    assert ok["max_scaled_residual"] < 1


def test_residual_of_a_nan_solution_fails():
    a = torch.eye(4, dtype=torch.float64)
    b = torch.ones(4, 1, dtype=torch.float64)
    with pytest.raises(peak.ResidualCheckError):
        peak.check_residual(a, torch.full((4, 1), float("nan"), dtype=torch.float64), b)


def test_concurrent_devices_aggregate_is_the_sum(tmp_path):
    assert main(["bench", "peak", "--gemm-sizes", "64", "--linpack-sizes", "64", "--threads", "1",
                 "--min-time", "0.01", "--devices", "2", "--output", str(tmp_path), "--name", "p2"]) == 0
    result = read_result(tmp_path / "p2")
    assert result["params"]["devices"] == 2 and len(result["per_device"]) == 2
    for i, agg in enumerate(result["aggregate"]):
        per = [dev[i]["gflops_median"] for dev in result["per_device"]]
        assert agg["gflops_median_sum"] == pytest.approx(sum(per))
        assert agg["per_device_gflops_median"] == pytest.approx(per)


def test_bad_sizes_are_one_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "peak", "--gemm-sizes", "abc"])
    assert e.value.code == 2
    assert "expected comma-separated integers, got 'abc'" in capsys.readouterr().err
