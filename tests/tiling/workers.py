"""What each emulated device runs in the distributed tiling tests (importable by spawned processes)."""
from __future__ import annotations

import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F

from edgetrain.errors import EdgetrainError
from edgetrain.spec import parse_tiling
from edgetrain.tiling import TiledTraining

from .models import batch, build, reference_grads, rel_err


def first_broadcast_to_a_silent_peer(rank: int, world: int, timeout_s: float) -> dict | None:
    """Device 0 builds a 1x2 ``TiledTraining`` (its first collective is the model broadcast); device 1 never
    does and stays up past device 0's deadline."""
    if rank == 1:
        time.sleep(timeout_s + 2)
        return None
    model, shape = build("plain", torch.float32)
    try:
        TiledTraining(model, parse_tiling("1x2", [14]), shape, timeout_s=timeout_s)
    except EdgetrainError as e:
        return {"error": str(e)}
    return {"error": None}


def run(rank: int, world: int, grid: str, cases: list[tuple[str, object, str]], train: tuple | None = None) -> dict:
    """The exactness cases, then optionally ``training(*train)``, in one set of processes."""
    return {"cases": exactness(rank, world, grid, cases),
            "training": training(rank, world, grid, *train) if train else None}


def exactness(rank: int, world: int, grid: str, cases: list[tuple[str, object, str]]) -> list[dict]:
    """One training step per case; errors of loss and every gradient against one device."""
    results = []
    for name, groups, dtype_name in cases:
        dtype = getattr(torch, dtype_name)
        model, shape = build(name, dtype)
        x, y = batch(shape, 5, dtype)  # 5 samples: uneven shares on 2, 3 and 4 devices
        ref_loss, ref = reference_grads(model, x, y)
        tiled = TiledTraining(model, parse_tiling(grid, groups), shape)
        loss, correct, n = tiled.forward_backward(x, y, F.cross_entropy)
        errors = {p_name: rel_err(p.grad, ref[p_name]) for p_name, p in model.named_parameters()}
        worst = max(errors, key=errors.get)
        report = tiled.report()
        json.dumps(report)
        results.append({
            "case": f"{name} groups={groups} {dtype_name}", "groups": report["groups"], "samples": n,
            "loss_err": abs(loss - ref_loss) / abs(ref_loss), "grad_err": errors[worst], "worst": worst,
            "params": len(errors), "bytes": report["bytes_exchanged_per_step"],
            "peak": report["peak_memory_bytes_tiled_section"],
        })
    return results


def training(rank: int, world: int, grid: str, name: str, groups, steps: int) -> dict:
    """``steps`` SGD steps (momentum, weight decay) tiled and on one device; parameter and buffer errors."""
    model, shape = build(name, torch.float32)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    tiled = TiledTraining(model, parse_tiling(grid, groups), shape)
    opt = torch.optim.SGD(tiled.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    losses = []
    for step in range(steps):
        x, y = batch(shape, 6, torch.float32, seed=10 + step)
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        opt.zero_grad()
        loss, _, _ = tiled.forward_backward(x, y, F.cross_entropy)
        opt.step()
        losses.append((loss, ref_loss.item()))
    ref_state = reference.state_dict()
    errors = {k: rel_err(v.double(), ref_state[k].double()) for k, v in model.state_dict().items()
              if v.is_floating_point()}
    tracked = {k: int(v) for k, v in model.state_dict().items() if k.endswith("num_batches_tracked")}
    worst = max(errors, key=errors.get)
    initial = build(name, torch.float32)[0]
    changed = statistics.median(rel_err(p.detach().double(), q.detach().double())
                                for p, q in zip(model.parameters(), initial.parameters()))
    try:
        x, y = batch(shape, world - 1, torch.float32)
        tiled.forward_backward(x, y, F.cross_entropy)
        small_batch_error = ""
    except EdgetrainError as e:
        small_batch_error = str(e)
    return {"worst": worst, "err": errors[worst], "losses": losses, "tracked": tracked, "changed": changed,
            "small_batch_error": small_batch_error}
