import pytest
from torch import nn

from edgetrain.tasks import flops


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


def test_flops_are_counted_at_the_real_input_shape():
    # small_cnn's convolutions scale with the pixels and its pooling is adaptive: 64x64 costs 4x 32x32
    # in every layer but the classifier (a few thousand flops of 230 million).
    from edgetrain.models import build_model

    model = build_model("small_cnn", 3, 10)
    at_32 = flops.training_flops_per_sample(model, input_shape=(3, 32, 32), num_classes=10)
    at_64 = flops.training_flops_per_sample(model, input_shape=(3, 64, 64), num_classes=10)
    assert at_32["input_shape"] == [3, 32, 32] and at_64["input_shape"] == [3, 64, 64]
    assert at_64["total_flops"] / at_32["total_flops"] == pytest.approx(4, rel=1e-4)


def test_counting_leaves_the_model_and_the_random_stream_untouched():
    import torch

    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.Flatten(), nn.Linear(144, 10))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    flops.training_flops_per_sample(model, "digits")
    assert torch.equal(torch.rand(3), expected)  # the run's random stream goes on as if nothing was counted
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # BatchNorm statistics too
    assert all(p.grad is None for p in model.parameters())


def test_an_emulated_device_is_rated_against_its_own_profile():
    from edgetrain.cluster.profiles import DeviceProfile, get_profile

    rpi4 = flops.device_peak(get_profile("rpi4"), speed=0.37)
    assert rpi4["peak_gflops"] == 15.5 and rpi4["peak_modelled"] and "rpi4" in rpi4["peak_source"]
    assert flops.device_peak(get_profile("rpi4"), speed=None) is None  # unthrottled: it ran at host speed
    own = flops.device_peak(DeviceProfile("half", speed=0.5), speed=0.5, host_core_gflops=lambda: 40.0)
    assert own["peak_gflops"] == 20.0 and own["peak_source"].startswith("modelled")


def test_a_rate_above_the_peak_is_flagged():
    from edgetrain.bench.common import percent_of_peak

    above = flops.achieved(2e9, 30.0, 40.0)
    assert above["fraction_of_peak"] == pytest.approx(1.5) and above["above_peak"]
    assert percent_of_peak(above["fraction_of_peak"]) == "150.0% !"
    assert not flops.achieved(2e9, 10.0, 40.0)["above_peak"] and percent_of_peak(0.5) == "50.0%"
