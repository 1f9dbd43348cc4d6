"""``edgetrain plan`` end to end: tables, plan.json and the scaling plot; bad input is one line and exit 2."""
import json

import pytest

from edgetrain.cli import main
from edgetrain.errors import EdgetrainError
from edgetrain.plan.cli import parse_scale, parse_stragglers

from edgetrain_testing import run_main


def test_plan_prints_tables_and_writes_json_and_png(tmp_path):
    proc = run_main("plan", "--model", "small_cnn", "--dataset", "synthetic", "--image-size", "8", "--devices", "4",
                    "--profile", "rpi4", "--link", "lte-10m", "--batch-size", "64", "--compress", "topk:0.01",
                    "--sync", "local:4", "--scale", "1,2,4,...,64", "--runtime-mb", "200", "--sim-steps", "18",
                    "--output", str(tmp_path), "--run-name", "p")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "per device, modelled" in out and "simulated" in out and "scaling, modelled" in out
    result = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert result["kind"] == result["prediction"]["kind"] == "modelled"
    assert result["simulation"]["kind"].startswith("modelled") and result["scaling"]["kind"] == "modelled"
    assert [r["devices"] for r in result["scaling"]["rows"]] == [1, 2, 4, 8, 16, 32, 64]
    assert result["prediction"]["traffic"]["compress"] == "topk:0.01"
    assert result["simulation"]["steps"] == 20  # local:4 simulates whole periods
    assert len(result["prediction"]["per_device"]) == 4
    assert (tmp_path / "p" / "scaling.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (["--profile", "nope"], "unknown device profile 'nope'"),
    (["--batch-size", "2"], "smaller than the 4 devices"),
    (["--scale", "1,2,..."], "bad --scale"),
    (["--compress", "threshold"], "cannot predict"),
    (["--stragglers", "0.5:0.5"], "slowdown >= 1"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    base = ["plan", "--model", "small_cnn", "--dataset", "synthetic", "--image-size", "8", "--devices", "4",
            "--profile", "rpi4", "--batch-size", "8", "--runtime-mb", "200", "--output", str(tmp_path)]
    assert main([*base, *args]) == 2  # the CLI's entry point, in this process
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())  # nothing written


def test_scale_and_straggler_parsing():
    assert parse_scale("1,2,4,...,4096")[-1] == 4096 and len(parse_scale("1,2,4,...,4096")) == 13
    assert parse_scale("1,3,9") == [1, 3, 9]
    assert parse_scale("2,4,...,20") == [2, 4, 8, 16, 20]
    for bad in ("", "4,2", "0,1", "1,1,...,8", "a,b"):
        with pytest.raises(EdgetrainError):
            parse_scale(bad)
    assert parse_stragglers("0.01:3") == (0.01, 3.0) and parse_stragglers("0.1") == (0.1, 3.0)
    with pytest.raises(EdgetrainError):
        parse_stragglers("2")
