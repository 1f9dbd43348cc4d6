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
"""
from edgetrain.plan.config import PlanInputs, plan_inputs, predict_inputs
from edgetrain.plan.costs import ModelCosts, count_costs
from edgetrain.plan.model import DEFAULT_EFFICIENCY, Prediction, predict
from edgetrain.plan.simulate import SimResult, scaling, simulate
from edgetrain.plan.traffic import Traffic, traffic

__all__ = ["PlanInputs", "plan_inputs", "predict_inputs", "ModelCosts", "count_costs", "DEFAULT_EFFICIENCY",
           "Prediction", "predict", "SimResult", "scaling", "simulate", "Traffic", "traffic"]
