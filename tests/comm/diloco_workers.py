"""What each device runs in tests/comm/test_diloco.py (spawned processes import workers by name), and the
single-process references those runs must equal."""
from __future__ import annotations

import torch
from comm_workers import flat_params, run_spec, tiny_data, tiny_model
from torch import nn

LR, MOMENTUM, BATCH = 0.1, 0.9, 32


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = tiny_data(rank)
    i = (step * BATCH) % len(x)
    return x[i:i + BATCH].double(), y[i:i + BATCH]


def inner_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> float:
    x, y = batch(rank, step)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def diloco_runs(rank: int, world: int, cases: list[tuple[str, str, str]], steps: int) -> dict:
    """Train a float64 tiny model with each (name, --sync, --compress) through ``build_sync``."""
    from edgetrain.comm import build_sync

    out = {}
    for name, sync_text, compress in cases:
        model = tiny_model().double()
        sync = build_sync(model, run_spec(sync=sync_text, compress=compress), rank, world)
        opt = torch.optim.SGD(sync.model.parameters(), lr=LR, momentum=MOMENTUM)
        losses = []
        for step in range(steps):
            sync.trains(step)
            losses.append(inner_step(sync.model, opt, rank, step))
            sync.after_backward(step)
            sync.after_step(step)
        before = flat_params(model)
        sync.finish()
        out[name] = {"before": before, "after": flat_params(model), "losses": losses, "summary": sync.summary()}
    return out


def synchronous_sgd(world: int, steps: int) -> torch.Tensor:
    """One model stepped with the mean of the devices' gradients: what synchronous data parallelism computes."""
    model = tiny_model().double()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        opt.zero_grad()
        for rank in range(world):
            x, y = batch(rank, step)
            (nn.functional.cross_entropy(model(x), y) / world).backward()
        opt.step()
    return flat_params(model)


def streaming_reference(world: int, steps: int, period: int, fragments: int, overlap: int, mix: float,
                        outer_lr: float, outer_momentum: float) -> list[torch.Tensor]:
    """Streaming DiLoCo (DiLoCo with fragments=1, overlap=0, mix=0) written out for ``world`` devices in one
    process: every device's model before the final exchange."""
    from edgetrain.comm.streaming import fragment_bounds

    models = [tiny_model().double() for _ in range(world)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in models]
    bounds = fragment_bounds(tuple(p.numel() for p in models[0].parameters()), fragments)

    def fragment(model: nn.Module, p: int) -> torch.Tensor:
        a, b = bounds[p]
        return torch.cat([q.detach().reshape(-1) for q in list(model.parameters())[a:b]])

    def set_fragment(model: nn.Module, p: int, flat: torch.Tensor) -> None:
        a, b = bounds[p]
        offset = 0
        with torch.no_grad():
            for q in list(model.parameters())[a:b]:
                q.copy_(flat[offset:offset + q.numel()].view_as(q))
                offset += q.numel()

    refs = [fragment(models[0], p).clone().requires_grad_(True) for p in range(fragments)]
    outers = [torch.optim.SGD([r], lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0) for r in refs]
    pending: dict[int, tuple[int, torch.Tensor]] = {}
    for step in range(steps):
        for rank, (model, opt) in enumerate(zip(models, opts)):
            inner_step(model, opt, rank, step)
        s = step + 1
        for p in range(fragments):
            if (s + p * period // fragments) % period == 0:
                deltas = [refs[p].detach() - fragment(m, p) for m in models]
                pending[p] = (s + overlap, sum(deltas[1:], deltas[0]) / world)
        for p, (due, mean) in list(pending.items()):
            if due == s:
                refs[p].grad = mean
                outers[p].step()
                refs[p].grad = None
                for m in models:
                    set_fragment(m, p, mix * fragment(m, p) + (1 - mix) * refs[p].detach())
                del pending[p]
    return [flat_params(m) for m in models]
