"""Differential privacy of a run (``--dp``): DP-SGD on Opacus, and the accountant of both levels.

* ``SampleDP``: DP-SGD (Abadi et al. 2016) with Opacus's own parts: ``GradSampleModule``'s hooks compute each
  sample's gradient, ``DPOptimizer.pre_step`` clips each to the norm ``clip``, sums them, adds Gaussian noise of
  ``noise_multiplier x clip`` and divides by the expected batch. Where the noise is drawn is the strategy's
  choice (``noise_here``): on one device only when the devices' sums are then averaged every step (Opacus's
  ``DistributedDPOptimizer`` does the same), on every device when each steps on its own.
* DP-FedAvg's clipping and noise of device updates live with the federated rounds (``comm/federated.py``).
* ``PrivacyPlan``: the noise multiplier (given, or derived from a target epsilon with Opacus's
  ``get_noise_multiplier``) and epsilon at delta after so many steps or rounds, by Opacus's RDP accountant.

Design, guarantees and their assumptions: docs/how-to/differential-privacy.md.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from edgetrain.errors import EdgetrainError
from edgetrain.records import PrivacyRecord
from edgetrain.spec import DPSpec

# Imported inside functions: opacus (the privacy extra; --dp says so in one line where it is missing).

ACCOUNTANT = "rdp"
# Opacus's RDP search over its fixed orders: at small epsilons the best order is the largest it tries, so its bound
# is looser than it could be (epsilon is overstated, never understated); said once in the docs, not per call
_LARGEST_ALPHA = "Optimal order is the largest alpha"


def _opacus():
    try:
        import opacus  # noqa: F401
    except ImportError:
        raise EdgetrainError("--dp needs Opacus; install it with pip install 'edgetrain[privacy]'") from None


@dataclass(frozen=True)
class PrivacyPlan:
    """A run's privacy: its spec, the sampling rate ``q`` of one accounted event (a step: a sample's chance to be
    in a batch; a round: a device's chance to be sampled), the events the run plans, the noise multiplier."""

    spec: DPSpec
    sample_rate: float
    events: int
    noise_multiplier: float
    guarantee: str    # what the epsilon is about, in words (the report and the summary say it)

    def epsilon(self, events: int) -> float:
        """Epsilon at the spec's delta after ``events`` steps (or rounds), by Opacus's RDP accountant."""
        if events <= 0:
            return 0.0
        if self.noise_multiplier <= 0:
            return math.inf
        return rdp_epsilon([(self.noise_multiplier, self.sample_rate, events)], self.spec.delta)

    def record(self, events: int) -> PrivacyRecord:
        eps = self.epsilon(events)
        return PrivacyRecord(level=self.spec.level, clip=self.spec.clip, noise_multiplier=self.noise_multiplier,
                             delta=self.spec.delta, epsilon=eps if math.isfinite(eps) else None,
                             target_epsilon=self.spec.epsilon, sample_rate=self.sample_rate, events=events,
                             accountant=ACCOUNTANT, guarantee=self.guarantee)

    def describe(self) -> str:
        derived = (f"derived for epsilon {self.spec.epsilon:g}" if self.spec.epsilon is not None else "given")
        what = "DP-SGD" if self.spec.per_sample else "DP-FedAvg"
        unit = "steps" if self.spec.per_sample else "rounds"
        return (f"differential privacy: {what}, clip {self.spec.clip:g}, noise multiplier "
                f"{self.noise_multiplier:.4g} ({derived} at delta {self.spec.delta:g} over {self.events} {unit} at "
                f"sampling rate {self.sample_rate:.4g}); {self.guarantee}")


def rdp_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    """Epsilon at ``delta`` after ``history``'s (noise multiplier, sampling rate, events) by Opacus's RDP accountant
    (which assumes Poisson sampling: fixed-size batches or device samples are the usual approximation)."""
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = list(history)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _LARGEST_ALPHA)
        return float(accountant.get_epsilon(delta=delta))


def plan_privacy(spec: DPSpec, sample_rate: float, events: int, guarantee: str) -> PrivacyPlan:
    """The run's ``PrivacyPlan``: ``spec.noise``, or the smallest multiplier whose epsilon after ``events`` at
    ``sample_rate`` stays within ``spec.epsilon`` (Opacus's search)."""
    _opacus()
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sampling rate must be in (0, 1], got {sample_rate}")
    noise = spec.noise
    if noise is None:
        from opacus.accountants.utils import get_noise_multiplier

        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", _LARGEST_ALPHA)
                noise = get_noise_multiplier(target_epsilon=spec.epsilon, target_delta=spec.delta,
                                             sample_rate=sample_rate, steps=max(events, 1), accountant=ACCOUNTANT)
        except ValueError as e:
            raise EdgetrainError(f"--dp {spec.text}: no noise multiplier reaches epsilon {spec.epsilon:g} at delta "
                                 f"{spec.delta:g} over {events} events at sampling rate {sample_rate:.4g} ({e}); "
                                 "raise epsilon or train fewer steps") from None
    return PrivacyPlan(spec, sample_rate, events, float(noise), guarantee)


def batchnorm_refusal(model: nn.Module, name: str) -> str | None:
    """The one line refusing ``--dp`` for a model Opacus cannot compute per-sample gradients of (BatchNorm mixes the
    samples of a batch), or None."""
    _opacus()
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if not errors:
        return None
    norms = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)})
    if norms:
        return (f"--dp clips each sample's gradient, but model {name} has {', '.join(norms)}, which mixes the "
                "samples of a batch (no per-sample gradient exists); use a model with GroupNorm, e.g. --model "
                "small_cnn_gn, or lenet")
    return f"--dp cannot compute per-sample gradients of model {name}: {str(errors[0]).splitlines()[0]}"


class SampleDP:
    """DP-SGD on one device: Opacus's per-sample gradient hooks on ``model`` and its ``DPOptimizer`` over the run's
    optimizer. The model is not wrapped (its state dict keeps its names): the hooks sit on its layers.

    Per step: ``zero_grad``; forward and backward of the loss summed over the batch (not scaled); ``privatise``:
    each sample's gradient clipped to ``clip``, summed, noise ``N(0, (sigma clip)^2)`` added where ``noise_here``,
    divided by ``expected_batch``; the strategy then exchanges the gradients (or not) and steps."""

    def __init__(self, model: nn.Module, clip: float, noise_multiplier: float, noise_here: bool,
                 expected_batch: float, seed: int):
        _opacus()
        from opacus import GradSampleModule

        self.hooks = GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=True)
        # Opacus's hooks fire on the first layer, whose input (the batch) needs no gradient: torch warns each step
        warnings.filterwarnings("ignore", "Full backward hook is firing when gradients are computed with respect "
                                          "to module outputs since no inputs require gradients")
        self.clip, self.noise_multiplier, self.noise_here = clip, noise_multiplier, noise_here
        self.expected_batch = expected_batch
        # on the parameters' device: Opacus draws the noise there with this generator
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._optimizer = None
        self._wrapped = None

    def _dp_optimizer(self, optimizer: torch.optim.Optimizer):
        if self._wrapped is not optimizer:
            from opacus.optimizers import DPOptimizer

            self._optimizer = DPOptimizer(optimizer, noise_multiplier=self.noise_multiplier if self.noise_here else 0.0,
                                          max_grad_norm=self.clip, expected_batch_size=self.expected_batch,
                                          loss_reduction="mean", generator=self.generator)
            self._wrapped = optimizer
        return self._optimizer

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients and per-sample gradients cleared (the run's ``zero_grad`` leaves the latter)."""
        self._dp_optimizer(optimizer).zero_grad(set_to_none=True)

    def privatise(self, optimizer: torch.optim.Optimizer) -> None:
        """``p.grad`` = (clipped per-sample sum + this device's noise) / expected batch."""
        self._dp_optimizer(optimizer).pre_step()

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
