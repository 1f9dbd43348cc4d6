import pytest
from torch import nn

from edgetrain.bench import flops


def test_training_flops_of_an_mlp_match_the_formula():
    # digits: 1x8x8 inputs. Forward: 2*(64*32 + 32*10) per sample. Backward: the second layer needs
    # gradients for weight and input (2 * 2*32*10), the first only for its weight (2*64*32).
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32, bias=False), nn.ReLU(), nn.Linear(32, 10, bias=False))
    counted = flops.training_flops_per_sample(model, "digits", batch_size=4)
    assert counted["forward_flops"] == 2 * (64 * 32 + 32 * 10)
    assert counted["backward_flops"] == 2 * 2 * 32 * 10 + 2 * 64 * 32
    assert counted["total_flops"] == counted["forward_flops"] + counted["backward_flops"]
    assert all(p.grad is None for p in model.parameters())


def test_achieved_fraction():
    a = flops.achieved(2e9, 10.0, 40.0)
    assert a["achieved_gflops"] == pytest.approx(20.0)
    assert a["fraction_of_peak"] == pytest.approx(0.5)
    assert flops.achieved(2e9, 10.0, None)["fraction_of_peak"] is None
