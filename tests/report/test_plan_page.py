"""``edgetrain report`` of plan runs (plan.json), alone and beside training and bench runs."""
import base64
import io
import json
import re
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from edgetrain.cli import main
from edgetrain.results import PlanResult


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory) -> Path:
    """A real ``edgetrain plan`` of a tiny model on 4 emulated Raspberry Pis, with a scaling table."""
    root = tmp_path_factory.mktemp("plans")
    assert main(["plan", "--model", "small_cnn", "--dataset", "synthetic", "--image-size", "8", "--devices", "4",
                 "--profile", "rpi4", "--link", "lte-10m", "--batch-size", "64", "--sync", "local:4",
                 "--compress", "topk:0.01", "--scale", "1,2,4", "--runtime-mb", "200", "--sim-steps", "8",
                 "--output", str(root), "--run-name", "plan"]) == 0
    return root / "plan"


def test_plan_json_is_exactly_its_schema(plan_dir):
    written = json.loads((plan_dir / "plan.json").read_text())
    plan = PlanResult.from_dict(written)  # every key known and of its type
    assert plan.to_dict() == written
    assert [r.devices for r in plan.scaling.rows] == [1, 2, 4] and plan.prediction.device_groups[0].count == 4


def test_a_plan_run_renders_its_prediction_scaling_and_plot(plan_dir, tmp_path, capsys):
    out = tmp_path / "plan.html"
    assert main(["report", str(plan_dir), "-o", str(out)]) == 0
    page = out.read_text()
    plan = PlanResult.from_dict(json.loads((plan_dir / "plan.json").read_text()))
    group = plan.prediction.device_groups[0]
    assert "<h2>plan (modelled)</h2>" in page and "Per device, modelled" in page and "Scaling, modelled" in page
    # the device group's row: its ranks, profile, step time and communication+waiting share of the step
    share = f"{100 * (group.comm_s + group.wait_s) / group.step_s:.1f}%"
    assert re.search(rf"<td>0-3</td><td>4</td><td>rpi4</td>.*<td>{share}</td>", page)
    assert f"step {plan.prediction.step_s:,.3f} s" in page and plan.simulation.describe() in page
    assert page.count("<tr>") >= 1 + 1 + 1 + 3  # header + group, header + 3 scaling rows
    images = re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,([^"]*)"', page)
    assert [alt for alt, _ in images] == ["scaling.png"]
    assert mpimg.imread(io.BytesIO(base64.b64decode(images[0][1])), format="png").shape[0] > 100


def test_train_bench_and_plan_runs_render_on_one_page(plan_dir, tmp_path):
    assert main(["bench", "peak", "--gemm-sizes", "64", "--linpack-sizes", "64", "--threads", "1",
                 "--min-time", "0.01", "--output", str(tmp_path), "--name", "peak"]) == 0
    train = tmp_path / "train-1"
    train.mkdir()
    (train / "summary.json").write_text(json.dumps({
        "run_dir": str(train), "model": "small_cnn", "devices": 1, "throughput_samples_per_s": 900.0,
        "per_device": [{"rank": 0, "profile": "host", "local_batch": 16, "samples_per_s": 900.0}]}))
    out = tmp_path / "mixed.html"
    assert main(["report", str(train), str(tmp_path / "peak"), str(plan_dir), "-o", str(out)]) == 0
    page = out.read_text()
    sections = re.findall(r"<section><h2>([^<]*)</h2>", page)
    assert sections == ["training run", "bench peak", "plan (modelled)"]


def test_a_bad_plan_json_is_one_line_naming_the_key(plan_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    data = json.loads((plan_dir / "plan.json").read_text())
    data["prediction"]["device_groups"][0]["step_s"] = "slow"
    (bad / "plan.json").write_text(json.dumps(data))
    assert main(["report", str(bad), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "plan.json: key 'prediction': key 'device_groups': key 'step_s' must be a number, not a string" in err
    assert not (tmp_path / "r.html").exists()
