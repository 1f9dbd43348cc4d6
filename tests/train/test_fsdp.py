"""``--strategy fsdp`` (train/fsdp.py): DDP's parameters step for step, counted bytes, charged links, refusals."""
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from edgetrain_testing import NEEDS_POOLED, FAST, on_devices

pytestmark = NEEDS_POOLED
from edgetrain import load_checkpoint, train
from edgetrain.config import TrainConfig, resolve
from edgetrain.errors import EdgetrainError


def _checkpoint(summary):
    return load_checkpoint(summary["run_dir"])  # ddp's checkpoint.pt, fsdp's checkpoint/ of every device's shards


@pytest.mark.slow
def test_fsdp_gives_ddps_parameters_after_k_steps_and_counts_its_bytes(tmp_path):
    cfg = dict(model="small_cnn", dataset="digits", steps=3, batch_size=32, lr=0.1, devices=2,
               output=str(tmp_path), **FAST)
    ddp, fsdp = train(cfg, run_name="ddp"), train(cfg, strategy="fsdp", run_name="fsdp")
    assert fsdp["strategy"] == "fsdp" and fsdp["steps"] == 3
    ddp_state, fsdp_state = _checkpoint(ddp)["model"], _checkpoint(fsdp)["model"]
    assert ddp_state.keys() == fsdp_state.keys()
    for key, value in ddp_state.items():
        if "running" not in key and "num_batches" not in key:  # DDP broadcasts rank 0's statistics each step
            assert torch.allclose(fsdp_state[key], value, rtol=1e-4, atol=1e-6), key
    # Read back whole (every device's shards joined, plain tensors), and so is the optimizer's momentum.
    assert all(type(v) is torch.Tensor for v in fsdp_state.values())
    assert fsdp_state["classifier.weight"].shape == (10, 128)
    momentum = _checkpoint(fsdp)["optimizer"]["state"]
    assert momentum and all(type(s["momentum_buffer"]) is torch.Tensor for s in momentum.values())
    # Per step each device sends (p-1)/p of the fp32 parameters three times: the forward all-gather,
    # the backward all-gather and the gradient reduce-scatter (small_cnn's root holds no parameters).
    params = sum(v.numel() for k, v in fsdp_state.items() if "running" not in k and "num_batches" not in k)
    assert fsdp["bytes_sent_per_step_per_device"] == 3 * params * 4 // 2
    assert all(d["peak_rss_mb"] > 0 for d in fsdp["per_device"])
    assert fsdp["link_mode"] == "none" and fsdp["comm_time_is"] == "measured"  # no --link: host time, as before


def _records(summary):
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.slow
def test_fsdp_charges_every_collective_to_the_link_on_the_device_clock(tmp_path):
    latency, bandwidth = 0.010, 1e6  # 8mbit:10ms, no jitter: each collective is one ring round on 2 devices
    summary = train(dict(model="small_cnn", dataset="digits", steps=2, batch_size=32, lr=0.1, devices=2,
                         output=str(tmp_path), **FAST), strategy="fsdp", link="8mbit:10ms")
    units_with_parameters = summary["fsdp"]["units"] - 1  # small_cnn's root holds none
    steps = {}
    for r in _records(summary):
        # by hand: per unit two all-gathers and a reduce-scatter, each one ring round of the link model: latency,
        # gloo's 80 us and a 1514-byte frame, and the bytes at 1547 on the wire per 1448 (edgetrain.cluster.links)
        per_round = latency + 80e-6 + 1514 / bandwidth
        assert r["virtual_comm_s"] == pytest.approx(3 * units_with_parameters * per_round
                                                    + r["bytes_sent"] * 1547 / 1448 / bandwidth)
        steps.setdefault(r["step"], []).append(r)
    previous = {0: 0.0, 1: 0.0}
    for step in sorted(steps):
        # no overlap: the latest device's clock after its compute, then every collective of the step
        start = max(previous[r["rank"]] + r["virtual_compute_s"] for r in steps[step])
        for r in steps[step]:
            # abs: a device reads its compute when it arrives and again, a few lines later, when it closes the step
            assert r["virtual_s"] == pytest.approx(start + r["virtual_comm_s"], abs=2e-3)
            previous[r["rank"]] = r["virtual_s"]
    assert summary["link_mode"] == "virtual" and summary["virtual_time_max_device_s"] == pytest.approx(
        max(previous.values()))


@pytest.mark.parametrize("key, value", [("compress", "fp16"), ("sync", "local:4")])
def test_fsdp_refuses_options_its_collectives_ignore(key, value):
    with pytest.raises(EdgetrainError, match=f"config key '{key}' .* does not apply to strategy fsdp"):
        resolve(TrainConfig(strategy="fsdp", **{key: value}))


def _evaluate_sharded(rank, world):
    from torch.distributed.fsdp import fully_shard

    from edgetrain.train.loop import evaluate

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.Linear(4, 3))
    for module in (model[1], model[2], model):  # units under the root gather their parameters at every forward
        fully_shard(module)
    data = TensorDataset(torch.randn(5, 1, 2, 2), torch.tensor([0, 1, 2, 0, 1]))
    # shards of 3 and 2 samples in batches of 2: two passes against one unless evaluate evens them out
    return evaluate(model, data, rank, world, batch=2)


def test_evaluation_of_a_sharded_model_does_not_hang_on_uneven_shards():
    first, second = on_devices(_evaluate_sharded, 2)
    assert first == second and 0 <= first[1] <= 1


def _built_model(widths: str, batchnorm: bool) -> nn.Module:
    """Odd widths: first dimensions 7 and 37, which 2 devices cannot shard evenly; even: an MLP 64-32-10."""
    torch.manual_seed(0)  # the same fresh model for every run (a 1-device run may train the one it is given)
    if widths == "even":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    norm = [nn.BatchNorm2d(7)] if batchnorm else []
    return nn.Sequential(nn.Conv2d(1, 7, 3), *norm, nn.ReLU(), nn.Flatten(), nn.Linear(7 * 6 * 6, 37), nn.Tanh(),
                         nn.Linear(37, 10))


@pytest.mark.slow
@pytest.mark.parametrize("widths, batchnorm", [("odd", False), ("odd", True), ("even", False)])
def test_a_model_passed_built_trains_under_fsdp_from_its_own_weights(tmp_path, widths, batchnorm):
    # Without BatchNorm the batch split changes nothing but the order of summation: one device is the reference.
    # With it (--batchnorm local) each device normalises with its own statistics, as DDP on as many devices does.
    cfg = dict(dataset="digits", steps=3, batch_size=32, lr=0.1, output=str(tmp_path), **FAST)
    reference = train(cfg, model=_built_model(widths, batchnorm), devices=2 if batchnorm else 1, run_name="ddp")
    fsdp = train(cfg, model=_built_model(widths, batchnorm), devices=2, strategy="fsdp", run_name="fsdp")
    expected, got = _checkpoint(reference), _checkpoint(fsdp)
    assert not expected["partial"] and not got["partial"] and got["step"] == got["planned_steps"] == 3  # finished
    expected, got = expected["model"], got["model"]
    assert expected.keys() == got.keys() and fsdp["steps"] == 3
    initial = _built_model(widths, batchnorm).state_dict()
    for key, value in expected.items():
        assert not torch.equal(value, initial[key]) or "num_batches" in key, key  # it trained
        # the registered path's tolerance (test_fsdp_gives_ddps_parameters_after_k_steps_and_counts_its_bytes)
        assert torch.allclose(got[key], value, rtol=1e-4, atol=1e-6), key


def _set_up_from_own_weights(rank, world):
    """Each device passes its own differently initialised model (as a script's processes might under torchrun):
    after setup every device holds its part of device 0's weights, whole (full_tensor gathers fsdp's shards)."""
    from edgetrain.comm.accounting import CommStats
    from edgetrain.train.strategy import StrategyContext, registered_strategy

    held = {}
    for strategy, options in (("fsdp", {}), ("pipeline", dict(stages="even", microbatches=2))):
        cfg = TrainConfig(strategy=strategy, devices=world, batch_size=8, progress=False, **options)
        chosen = registered_strategy(strategy)(StrategyContext(cfg, resolve(cfg), rank, world, 8, (1, 8, 8),
                                                               CommStats()))
        model = _built_model("odd", batchnorm=strategy == "fsdp")  # a pipeline's BatchNorm: --batchnorm local
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                tensor.add_(rank)
        chosen.setup(chosen.adapt(chosen.materialise(model)))
        held[strategy] = {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
                          for name, t in [*model.named_parameters(), *model.named_buffers()]}
    return held


def test_a_model_passed_built_is_sharded_from_device_0s_whole_weights():
    for held in on_devices(_set_up_from_own_weights, 2):
        for strategy, batchnorm in (("fsdp", True), ("pipeline", False)):
            device0 = _built_model("odd", batchnorm).state_dict()
            assert held[strategy].keys() == device0.keys(), strategy
            for name, value in device0.items():
                assert torch.equal(held[strategy][name], value), (strategy, name)
