"""The Flower fleet trains and evaluates the run's task: regression rounds, scored by the task's metrics."""
import pytest
import torch

pytest.importorskip("flwr", reason="the fleet extra is not installed (pip install edgetrain[fleet])")

from edgetrain.errors import EdgetrainError  # noqa: E402
from edgetrain.fleet import app as fleet  # noqa: E402
from edgetrain.train.evaluation import evaluate_task  # noqa: E402

from test_fleet_app import RUN, InProcessGrid, task_identity  # noqa: E402,F401  (the fixture is autouse)


def test_regression_rounds_are_scored_by_the_tasks_metrics(tmp_path):
    run = {**RUN, "task": "regression", "dataset": "diabetes", "model": "mlp", "num-rounds": 2, "lr": 0.05,
           "server-opt": "fedavg", "output-dir": str(tmp_path / "fleet")}
    result = fleet.run_server(InProcessGrid([fleet.client_app, fleet.client_app], run), run)
    spec = fleet.fleet_spec(run)
    data = fleet.load_data(spec)
    model = fleet.global_model(spec, data)
    model.load_state_dict(torch.load(tmp_path / "fleet" / fleet.MODEL_FILE))
    whole = evaluate_task(model, data.test, 0, 1, fleet.fleet_task(spec, data))
    last = result.evaluate_metrics_clientapp[2]
    # both devices evaluated their own test splits, which cover the test set: the weighted mean is the whole set's
    assert last["eval-loss"] == pytest.approx(whole["loss"], rel=1e-6)
    assert last["eval-mae"] == pytest.approx(whole["mae"], rel=1e-6)
    assert "eval-accuracy" not in last and whole["rmse"] < 78  # below predicting the mean (the targets' std)


def test_an_unknown_fleet_task_is_one_line():
    with pytest.raises(EdgetrainError, match="unknown task 'ranking'"):
        fleet.fleet_spec({"task": "ranking"})
