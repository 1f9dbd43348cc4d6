"""Plan a cluster before training on it: how long a step takes, how fast it trains, what memory it needs.

Read in this order:

* ``costs.py``: what a sample costs the model, counted on the real model
  (FLOPs with ``FlopCounterMode``, saved activations, parameter bytes, DDP buckets);
* ``traffic.py``: what a device sends per exchange for a ``--sync`` / ``--compress``
  pair, from the real compressors' payloads;
* ``model.py``: the analytic cost model (compute, communication over the link
  model, step time per sync mode, memory per device);
* ``simulate.py``: a numpy step simulator with compute variability, stragglers
  and link jitter, fast enough for thousands of devices; scaling curves;
* ``split.py`` / ``stages.py``: where a pipeline cuts the model (the split planner);
* ``strategies.py``: fsdp's and the pipeline's memory, step time and bytes beside
  data parallelism's, and which strategy a cluster should use;
* ``config.py``: from a ``TrainConfig`` to the above; ``cli.py`` / ``report.py``:
  ``edgetrain plan``.

Python API::

    from edgetrain.config import load_config
    from edgetrain.plan import plan_inputs, predict_inputs, simulate

    inputs = plan_inputs(load_config(None, model="resnet18", dataset="synthetic", devices=8,
                                     profile="rpi4", link="wifi-20m", batch_size=256))
    pred = predict_inputs(inputs)                  # analytic, every number modelled
    sim = simulate(pred, steps=100, compute_cv=0.05, seed=0)
    print(pred.step_s, sim.mean_step_s, sim.to_dict()["cluster_step_s"]["p99"])

The names below are loaded on first use (PEP 562 module ``__getattr__``): ``costs.py`` counts on the real model
with torch, and ``edgetrain plan``'s flags, ``--help`` and the config's checks answer before torch is imported.
"""
import importlib
import sys
import types

# name -> the module it lives in; imported on first access
_LAZY = {
    "PlanInputs": "edgetrain.plan.config", "plan_inputs": "edgetrain.plan.config",
    "predict_inputs": "edgetrain.plan.config",
    "ModelCosts": "edgetrain.plan.costs", "count_costs": "edgetrain.plan.costs",
    "DEFAULT_EFFICIENCY": "edgetrain.plan.model", "Prediction": "edgetrain.plan.model",
    "predict": "edgetrain.plan.model",
    "SimResult": "edgetrain.plan.simulate", "scaling": "edgetrain.plan.simulate", "simulate": "edgetrain.plan.simulate",
    "Traffic": "edgetrain.plan.traffic", "traffic": "edgetrain.plan.traffic",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # the function simulate (traffic), not the submodule that importing it bound here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # Importing the submodule plan.simulate (plan.traffic) binds it here once it has run; the function of
        # that name is what edgetrain.plan.simulate means, as when the package imported it eagerly.
        if name in _LAZY and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
