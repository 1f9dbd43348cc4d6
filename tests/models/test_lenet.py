import torch

from edgetrain.models import build_model, count_parameters


def test_lenet_is_the_dlg_papers_network_at_32x32_and_takes_other_sizes():
    model = build_model("lenet")
    assert count_parameters(model) == 15_826  # 3 convolutions of 12 channels, 5x5, and 768 -> 10
    assert isinstance(model.features[1], torch.nn.Sigmoid)
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 10)
    assert build_model("lenet", in_channels=1)(torch.rand(2, 1, 8, 8)).shape == (2, 10)
