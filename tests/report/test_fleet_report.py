"""edgetrain report reads a Flower fleet's fleet-rounds.jsonl: accuracy against rounds and modelled time, and
each run's totals; a bad line is one error naming the file, the line and the key."""
import base64
import io
import json
import re

import matplotlib.image as mpimg
import pytest

from edgetrain.cli import main


def fleet_run(root, name: str, accuracies: list[float], dropouts: int = 0) -> str:
    """A fleet run's directory as fleet/app.py writes it: one record per round (a modelled clock of 0.9 s
    rounds), the server's evaluation in each."""
    run = root / name
    run.mkdir()
    lines = [{"round": k, "modelled_round_s": 0.9, "modelled_clock_s": 0.9 * k, "devices": 1000, "online": 500,
              "sampled": 20, "aggregated": 20 - dropouts, "dropouts": dropouts, "late": 0,
              "modelled_bytes_down": 20 * 379_000, "bytes_up": (20 - dropouts) * 379_000,
              "measured_train_wall_s": 4.0 + k, "server_loss": 2.0 - a, "server_accuracy": a}
             for k, a in enumerate(accuracies, 1)]
    (run / "fleet-rounds.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(run)


@pytest.mark.slow  # matplotlib: about 2 s on a quiet machine, 8 s at load 37
def test_the_report_draws_fleet_runs_against_rounds_and_modelled_time(tmp_path, capsys):
    runs = [fleet_run(tmp_path, "fedavg-full", [0.2, 0.5, 0.7]), fleet_run(tmp_path, "fedavg-churn", [0.1, 0.3], 4)]
    out = tmp_path / "report.html"
    assert main(["report", *runs, "-o", str(out)]) == 0
    page = out.read_text()
    assert "Fleet rounds" in page and "MODELLED" in page and "server, whole test set" in page
    rows = re.findall(r"<tr><td>(fedavg-\w+)</td><td>(\d+)</td><td>1000</td><td>([\d.]+%)</td>", page)
    assert rows == [("fedavg-full", "3", "70.0%"), ("fedavg-churn", "2", "30.0%")]
    assert "<td>8</td>" in page  # the churn run's dropouts, 4 in each of its 2 rounds
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 1 and mpimg.imread(io.BytesIO(base64.b64decode(images[0])), format="png").shape[1] > 1000


@pytest.mark.slow  # 0.4 s at load 37
def test_a_bad_fleet_record_is_one_line_naming_the_file_and_key(tmp_path, capsys):
    run = tmp_path / "broken"
    run.mkdir()
    (run / "fleet-rounds.jsonl").write_text(json.dumps({"round": 1, "modelled_round_s": "slow"}) + "\n")
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fleet-rounds.jsonl line 1" in err and "modelled_round_s" in err
    assert not (run / "report.html").exists()
