"""Plan a cluster before training on it: how long a step takes, how fast it trains, what memory it needs.

``costs.py`` (counted on the real model), ``exchanges.py`` (what a device sends per exchange), ``model.py``
(the analytic model), ``simulation.py`` (a step simulator for thousands of devices), ``strategies.py``
(ddp, fsdp and pipeline side by side), ``config.py`` (from a ``TrainConfig``), ``cli.py``/``report.py``
(``edgetrain plan``). Design and reading order: docs/design/planner.md. Python API::

    from edgetrain.config import load_config
    from edgetrain.plan import plan_inputs, predict_inputs, simulate

    inputs = plan_inputs(load_config(None, model="resnet18", dataset="synthetic", devices=8,
                                     profile="rpi4", link="wifi-20m", batch_size=256))
    pred = predict_inputs(inputs)                  # analytic, every number modelled
    sim = simulate(pred, steps=100, compute_cv=0.05, seed=0)

The names below load on first use (PEP 562): ``costs.py`` needs torch, and ``edgetrain plan``'s flags and
checks answer before torch is imported.
"""
import importlib

# name -> the module it lives in; imported on first access
_LAZY = {
    "PlanInputs": "edgetrain.plan.config", "plan_inputs": "edgetrain.plan.config",
    "predict_inputs": "edgetrain.plan.config",
    "ModelCosts": "edgetrain.plan.costs", "count_costs": "edgetrain.plan.costs",
    "DEFAULT_EFFICIENCY": "edgetrain.plan.model", "Prediction": "edgetrain.plan.model",
    "predict": "edgetrain.plan.model",
    "SimResult": "edgetrain.plan.simulation", "scaling": "edgetrain.plan.simulation",
    "simulate": "edgetrain.plan.simulation",
    "Traffic": "edgetrain.plan.exchanges", "traffic": "edgetrain.plan.exchanges",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
