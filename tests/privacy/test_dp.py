"""--dp: DP-SGD's step against a hand computation, the noise added once for the global batch on two devices, the
accountant's epsilon in a run's records, and the BatchNorm refusal."""
import json
import math

import pytest
import torch
from torch import nn

from edgetrain.config import load_run
from edgetrain.errors import EdgetrainError
from edgetrain.privacy.dp import PrivacyPlan, SampleDP, plan_privacy
from edgetrain.spec import DPSpec, parse_dp

from edgetrain_testing import FAST, on_devices

CLIP, SIGMA = 1.0, 1.5


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def test_a_dp_sgd_step_is_each_sample_clipped_summed_noised_once_and_divided_by_hand():
    model = tiny()
    x, y = torch.randn(5, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 1, 0, 1])
    params = list(model.parameters())
    per_sample = []
    for i in range(len(x)):  # each sample's gradient, by plain autograd
        loss = nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum")
        per_sample.append(torch.autograd.grad(loss, params))
    norms = [math.sqrt(sum(float(g.pow(2).sum()) for g in grads)) for grads in per_sample]
    assert min(norms) < CLIP < max(norms)  # some samples are clipped, some not
    clipped = [sum(g[k] * min(1.0, CLIP / (n + 1e-6)) for g, n in zip(per_sample, norms)) for k in range(len(params))]
    noise = torch.Generator().manual_seed(7)  # the noise Opacus draws: N(0, (sigma clip)^2), parameter by parameter
    expected = [(c + torch.normal(0, SIGMA * CLIP, size=c.shape, generator=noise)) / 2.5 for c in clipped]

    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    private = SampleDP(model, CLIP, SIGMA, noise_here=True, expected_batch=2.5, seed=7)
    private.zero_grad(optimizer)
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    private.privatise(optimizer)
    for p, e in zip(params, expected):
        assert torch.allclose(p.grad, e, atol=1e-6), (p.grad, e)

    quiet = SampleDP(tiny(), CLIP, SIGMA, noise_here=False, expected_batch=2.5, seed=7)  # a device that adds none
    model2 = quiet.hooks._module
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=1.0)
    quiet.zero_grad(optimizer2)
    nn.functional.cross_entropy(model2(x), y, reduction="sum").backward()
    quiet.privatise(optimizer2)
    for p, c in zip(model2.parameters(), clipped):
        assert torch.allclose(p.grad, c / 2.5, atol=1e-6)


def test_dp_parses_into_one_spec_and_refuses_in_one_line():
    assert parse_dp("clip=1.0,epsilon=8") == DPSpec(1.0, epsilon=8.0, text="clip=1.0,epsilon=8")
    assert parse_dp("off") is None and parse_dp("level=device,clip=0.5,noise=1").level == "device"
    for bad in ("clip=1", "clip=1,noise=1,epsilon=2", "noise=1", "clip=-1,noise=1", "clip=1,noise=1,level=x",
                "clip=1,sigma=2"):
        with pytest.raises(EdgetrainError) as e:
            parse_dp(bad)
        assert "--dp" in str(e.value) and "\n" not in str(e.value)


def test_a_target_epsilon_gives_the_noise_whose_epsilon_is_the_target():
    plan = plan_privacy(parse_dp("clip=1,epsilon=3"), 0.02, 500, "test")
    assert 2.8 < plan.epsilon(500) <= 3.0 and plan.epsilon(100) < plan.epsilon(500)
    assert PrivacyPlan(parse_dp("clip=1,noise=0"), 0.1, 10, 0.0, "none").epsilon(10) == math.inf


def noised_steps(rank: int, world: int, noise: float) -> list[torch.Tensor]:
    """One DP-SGD step of the data-parallel strategy on ``world`` devices (``--sync sync``, lr 1, no momentum):
    this device's parameters after the step."""
    from edgetrain.comm.accounting import CommStats
    from edgetrain.train.strategy import DataParallel, StrategyContext

    cfg, spec = load_run(None, devices=world, dp=f"clip={CLIP},noise={noise}", batch_size=8, momentum=0.0,
                         weight_decay=0.0, model="mlp")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(50, 40), nn.Tanh(), nn.Linear(40, 10))
    strategy = DataParallel(StrategyContext(cfg, spec, rank, world, 4, (50,), CommStats()))
    strategy.setup(model)
    strategy.make_private(spec.dp, 0.1, 1)
    data = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 50, generator=data), torch.randint(0, 10, (4,), generator=data)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    strategy.train_step(x, y, optimizer)
    strategy.finish()
    return [p.detach().clone() for p in model.parameters()]


def three_runs(rank: int, world: int) -> tuple:
    return noised_steps(rank, world, SIGMA), noised_steps(rank, world, 0.0), noised_steps(rank, world, SIGMA)


def test_two_devices_add_the_noise_once_for_the_global_batch():
    """The devices' models stay identical, and the noise in the step is one draw of N(0, (sigma clip)^2) over the
    global batch of 8: twice that variance would be noise added on both devices. A second run of the same config
    (same --seed) draws other noise: the seed in config.yaml, which every peer knows, must not give it away."""
    (noised0, plain0, again0), (noised1, plain1, again1) = on_devices(three_runs, 2)
    assert all(torch.equal(a, b) for a, b in zip(again0, again1))
    assert not any(torch.equal(a, b) for a, b in zip(noised0, again0))
    assert all(torch.equal(a, b) for a, b in zip(noised0, noised1))
    assert all(torch.equal(a, b) for a, b in zip(plain0, plain1))
    # the same data, initial model and clipping: the difference of the two runs is the noise alone, - z / 8
    noise = torch.cat([(p - n).reshape(-1) for p, n in zip(plain0, noised0)]) * 8 / CLIP
    variance = float(noise.var())
    assert noise.numel() > 2000
    assert 0.85 * SIGMA ** 2 < variance < 1.15 * SIGMA ** 2, variance


def test_a_run_records_its_epsilon_in_every_evaluation_and_the_summary(tmp_path):
    import edgetrain
    from opacus.accountants import RDPAccountant

    summary = edgetrain.train({**FAST, "eval": True, "devices": 1, "model": "small_cnn_gn", "epochs": 2, "steps": 4,
                               "batch_size": 512, "dp": "clip=1.0,noise=1.0", "output": str(tmp_path),
                               "run_name": "dp"})
    privacy = summary["privacy"]
    accountant = RDPAccountant()
    accountant.history = [(1.0, privacy["sample_rate"], 4)]
    assert privacy["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5))
    assert privacy["events"] == 4 and privacy["level"] == "sample" and privacy["noise_multiplier"] == 1.0
    evals = [json.loads(line) for line in (tmp_path / "dp" / "evals.jsonl").read_text().splitlines()]
    assert len(evals) == 2 and 0 < evals[0]["epsilon"] < evals[1]["epsilon"] == pytest.approx(privacy["epsilon"])
    assert [e["epsilon"] for e in summary["evals"]] == [e["epsilon"] for e in evals]
    from edgetrain.report.html import render  # the report shows the guarantee

    assert f"epsilon {privacy['epsilon']:.3g} at delta 1e-05 after 4 steps" in render([tmp_path / "dp"])


def test_a_model_with_batchnorm_is_refused_in_one_line_with_the_fix_before_any_device(tmp_path):
    """In process (the CLI prints an EdgetrainError as its one line, exit 2: tests/test_bad_input.py)."""
    import edgetrain

    with pytest.raises(EdgetrainError) as refused:
        edgetrain.train({**FAST, "devices": 2, "model": "small_cnn", "dp": "clip=1,epsilon=8",
                         "output": str(tmp_path)})
    line = str(refused.value)
    assert "\n" not in line and "BatchNorm2d" in line and "--model small_cnn_gn" in line, line
    assert not any(tmp_path.iterdir())


def test_dp_fedavg_clips_a_device_update_and_only_one_device_adds_the_noise():
    from edgetrain.comm.federated import clipped_update

    update = torch.full((4000,), 0.1)   # norm 6.32
    quiet, shortened = clipped_update(update, 0.5, 2.0, torch.Generator().manual_seed(0), noise_here=False)
    assert shortened and float(quiet.norm()) == pytest.approx(0.5, rel=1e-5) and torch.allclose(quiet, update * 0.5 / 6.3246,
                                                                                       rtol=1e-4)
    small, shortened = clipped_update(update * 0.01, 0.5, 2.0, torch.Generator().manual_seed(0), noise_here=False)
    assert not shortened and torch.equal(small, update * 0.01)
    noised, _ = clipped_update(update, 0.5, 2.0, torch.Generator().manual_seed(0), noise_here=True)
    assert float((noised - quiet).std()) == pytest.approx(2.0 * 0.5, rel=0.05)
