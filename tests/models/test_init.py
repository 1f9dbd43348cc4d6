"""models/init.py: a model built on meta, each device materialising only its part, from the same initial weights."""
import pytest
import torch
from torch import nn

from edgetrain_testing import on_devices
from edgetrain.comm.accounting import CommStats
from edgetrain.config import TrainConfig, resolve
from edgetrain.errors import EdgetrainError
from edgetrain.models import build_model
from edgetrain.models.init import build_on_meta, materialise
from edgetrain.train.strategy import StrategyContext, registered_strategy

CPU = torch.device("cpu")


def _whole(seed=0):
    return materialise(build_on_meta(build_model, "small_cnn", 1, 10), seed, CPU)


def test_a_layers_initial_weights_depend_on_the_seed_and_its_name_only():
    whole = dict(_whole().named_parameters())
    # the classifier alone, built with nothing else: the same weights as in the whole model
    alone = materialise(build_on_meta(build_model, "small_cnn", 1, 10), 0, CPU, keep=lambda n: n == "classifier")
    assert all(p.is_meta for n, p in alone.named_parameters() if not n.startswith("classifier"))
    assert torch.equal(alone.classifier.weight, whole["classifier.weight"])
    assert not torch.equal(_whole(seed=1).classifier.weight, whole["classifier.weight"])
    assert not torch.equal(whole["features.0.weight"][:4], whole["features.3.weight"][:4, :1])  # layers differ


def test_a_layer_without_reset_parameters_is_named():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    with pytest.raises(EdgetrainError, match=r"layer '1' \(Scale\) has parameters .* no reset_parameters\(\)"):
        materialise(build_on_meta(lambda: nn.Sequential(nn.Linear(3, 3), Scale())), 0, CPU)


def _held(rank, world):
    """What a device holds of small_cnn after each strategy's setup: {strategy: {name: its tensor (fsdp: a shard)}}."""
    held = {}
    for strategy, options in (("pipeline", dict(stages="4", microbatches=2)), ("fsdp", {})):
        cfg = TrainConfig(model="small_cnn", strategy=strategy, devices=world, batch_size=8, progress=False, **options)
        chosen = registered_strategy(strategy)(StrategyContext(cfg, resolve(cfg), rank, world, 8, (1, 8, 8), CommStats()))
        model = chosen.adapt(chosen.materialise(build_on_meta(build_model, "small_cnn", 1, 10)))
        chosen.setup(model)
        held[strategy] = {name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                          for name, p in model.named_parameters() if not p.is_meta}
    return held


@pytest.mark.slow
def test_each_device_builds_only_its_part_with_the_whole_models_initial_weights():
    whole = dict(_whole(seed=TrainConfig().seed).named_parameters())
    first, second = on_devices(_held, 2)
    # pipeline, stage 0: layers 0-3 (features.0 conv, .1 BatchNorm, .2 ReLU, .3 conv); stage 1 the rest
    stage0, stage1 = first["pipeline"], second["pipeline"]
    assert set(stage0) == {"features.0.weight", "features.1.weight", "features.1.bias", "features.3.weight"}
    assert set(stage0).isdisjoint(stage1) and set(stage0) | set(stage1) == set(whole)
    for name, value in {**stage0, **stage1}.items():
        assert torch.equal(value, whole[name]), name
    # fsdp: every device a half (dim 0) of every parameter
    shard0, shard1 = first["fsdp"], second["fsdp"]
    assert set(shard0) == set(shard1) == set(whole)
    for name, value in whole.items():
        assert shard0[name].numel() < value.numel()
        assert torch.equal(torch.cat([shard0[name], shard1[name]]), value), name
