"""Gradient inversion: rebuild a device's training images from what an observer of its traffic sees.

Two attackers, both written here from the papers:

* ``ig``: Inverting Gradients (Geiping, Bauermeister, Droege and Moeller,
  "Inverting Gradients - How easy is it to break privacy in federated
  learning?", NeurIPS 2020): Adam on dummy images minimising
  ``1 - cos(simulated update, observed update)`` plus a total-variation
  prior, with the signed gradient, step decay at 3/8, 5/8 and 7/8 of the
  iterations, and pixels kept in [0, 1]. A multi-step update (FedAvg,
  DiLoCo) is simulated by unrolling the device's local SGD steps, as the
  paper does for federated averaging.
* ``dlg``: Deep Leakage from Gradients (Zhu, Liu and Han, NeurIPS 2019):
  L-BFGS on the squared distance between the updates (relative to the
  observed update's squared norm, so that small updates do not stop L-BFGS
  at its absolute tolerances).

Labels: for one image, read from the last layer's update as iDLG does (Zhao,
Mopuri and Bilen, "iDLG: Improved Deep Leakage from Gradients", 2020): with
cross-entropy the weight gradient of row ``i`` is ``(p_i - y_i) h`` with
``h >= 0`` after a Sigmoid or ReLU, so only the true class's row is negative.
For larger batches the attacker is given the labels (the papers' usual
assumption, in the attacker's favour).

Only the coordinates the observer received enter the match (``received``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from edgetrain.privacy.observe import LocalTraining, ObservedUpdate

METHODS = ("ig", "dlg")


@dataclass(frozen=True)
class AttackConfig:
    """``iterations``: Adam steps (``ig``) or L-BFGS iterations (``dlg``, 20 per step, pixels clamped between)."""

    method: str = "ig"
    iterations: int = 300
    lr: float = 0.1
    tv_weight: float = 1e-4
    seed: int = 0
    restarts: int = 1  # from different random images; the one whose update matches best is kept


def recover_label(model: nn.Module, observed: ObservedUpdate) -> int:
    """iDLG: the class whose row of the last linear layer's weight update sums negative (the smallest sum)."""
    params = list(model.parameters())
    last = max(i for i, p in enumerate(params) if p.dim() == 2)
    start = sum(p.numel() for p in params[:last])
    rows = observed.values[start:start + params[last].numel()].view_as(params[last])
    return int(rows.sum(dim=1).argmin())


def simulate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, training: LocalTraining) -> torch.Tensor:
    """The update ``training`` makes from ``images`` (``start - end``), differentiable in ``images``."""
    params = dict(model.named_parameters())
    start = list(params.values())
    current, velocity = start, None
    for _ in range(training.steps):
        logits = functional_call(model, dict(zip(params, current)), (images,))
        grads = torch.autograd.grad(nn.functional.cross_entropy(logits, labels), current, create_graph=True)
        velocity = grads if velocity is None else [training.momentum * v + g for v, g in zip(velocity, grads)]
        current = [p - training.lr * v for p, v in zip(current, velocity)]
    return torch.cat([(s - c).reshape(-1) for s, c in zip(start, current)])


def total_variation(images: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference between neighbouring pixels (anisotropic TV)."""
    return ((images[..., 1:, :] - images[..., :-1, :]).abs().mean()
            + (images[..., :, 1:] - images[..., :, :-1]).abs().mean())


def _cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return 1 - (a * b).sum() / (a.norm() * b.norm() + 1e-12)


def invert(model: nn.Module, observed: ObservedUpdate, shape: tuple[int, ...], labels: torch.Tensor | None = None,
           config: AttackConfig = AttackConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    """(images in [0, 1] of ``shape`` (N, C, H, W), their labels) reconstructed from ``observed``.

    ``model`` holds the weights the device started from (public: the last global model). ``labels``: given to
    the attacker, or None to recover them (one image only)."""
    if config.method not in METHODS:
        raise ValueError(f"attack method must be one of {METHODS}, got {config.method!r}")
    if labels is None:
        if shape[0] != 1:
            raise ValueError("labels can be recovered for one image only; pass them for a larger batch")
        labels = torch.tensor([recover_label(model, observed)])
    model = copy.deepcopy(model)  # BatchNorm's running statistics move while we attack
    model.train()
    attempts = [_attempt(model, observed, shape, labels, config, config.seed + r) for r in range(config.restarts)]
    best = min(attempts, key=lambda attempt: attempt[1])[0]
    return best, labels


def _attempt(model: nn.Module, observed: ObservedUpdate, shape: tuple[int, ...], labels: torch.Tensor,
             config: AttackConfig, seed: int) -> tuple[torch.Tensor, float]:
    """(images from one random start, how far their update stays from the observed one)."""
    dummy = torch.rand(shape, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
    target = observed.values.detach()
    seen = observed.received

    def mismatch() -> torch.Tensor:
        update = simulate(model, dummy, labels, observed.training)
        ours, theirs = (update, target) if seen is None else (update[seen], target[seen])
        if config.method == "dlg":
            return (ours - theirs).pow(2).sum() / theirs.pow(2).sum()  # relative: L-BFGS's tolerances are absolute
        return _cosine_distance(ours, theirs) + config.tv_weight * total_variation(dummy)

    run = _run_ig if config.method == "ig" else _run_dlg
    run(dummy, mismatch, config)
    with torch.no_grad():
        dummy.clamp_(0, 1)
    final = float(mismatch().detach())
    return dummy.detach(), final if final == final else float("inf")  # NaN: the worst


def _run_ig(dummy: torch.Tensor, mismatch, config: AttackConfig) -> None:
    optimizer = torch.optim.Adam([dummy], lr=config.lr)
    n = config.iterations
    schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, [3 * n // 8, 5 * n // 8, 7 * n // 8], gamma=0.1)
    for _ in range(n):
        optimizer.zero_grad()
        loss = mismatch()
        dummy.grad, = torch.autograd.grad(loss, dummy)
        dummy.grad.sign_()
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            dummy.clamp_(0, 1)


def _run_dlg(dummy: torch.Tensor, mismatch, config: AttackConfig) -> None:
    inner = 20  # L-BFGS iterations per step; the pixels are clamped to [0, 1] between steps
    optimizer = torch.optim.LBFGS([dummy], lr=1, max_iter=inner, history_size=100,
                                  line_search_fn="strong_wolfe", tolerance_grad=0, tolerance_change=0)

    def closure():
        optimizer.zero_grad()
        loss = mismatch()
        dummy.grad, = torch.autograd.grad(loss, dummy)
        return loss

    for _ in range(max(1, config.iterations // inner)):
        optimizer.step(closure)
        with torch.no_grad():
            dummy.clamp_(0, 1)
