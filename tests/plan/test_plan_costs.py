"""Counted model costs: FLOPs, activation bytes, DDP buckets and payload bytes, checked against hand counts."""
import math

import torch
from torch import nn

from edgetrain.config import load_config
from edgetrain.data import build_data
from edgetrain.plan.costs import count_costs, data_footprint, ddp_buckets
from edgetrain.plan.exchanges import traffic
from edgetrain.spec import parse_compress, parse_sync

SYNC = parse_sync("sync")


def tiny_net() -> nn.Module:
    # 2x6x6 input -> conv 3x3 (no bias) -> 3x4x4 -> ReLU -> flatten 48 -> linear 5
    return nn.Sequential(nn.Conv2d(2, 3, 3, bias=False), nn.ReLU(), nn.Flatten(), nn.Linear(48, 5))


def test_flops_of_a_tiny_conv_net_equal_the_hand_count():
    costs = count_costs(tiny_net(), (2, 6, 6), num_classes=5)
    conv = 2 * (3 * 4 * 4) * (2 * 3 * 3)       # 2 FLOPs per multiply-add, per output element
    linear = 2 * 48 * 5
    assert costs.forward_flops_per_sample == conv + linear
    # backward: the conv's weight gradient only (its input needs no gradient); the linear's input and weight gradients
    assert costs.train_flops_per_sample == 2 * conv + 3 * linear == 4896


def test_activation_bytes_of_a_tiny_net_are_exact():
    costs = count_costs(tiny_net(), (2, 6, 6), num_classes=5)
    saved = (2 * 6 * 6 * 4      # the conv's input
             + 3 * 4 * 4 * 4    # the ReLU's output (the linear saves a view of the same storage: counted once)
             + 5 * 4            # log-softmax output (saved by log_softmax and nll_loss: one storage)
             + 8)               # the int64 target
    total_weight = 4            # nll_loss's scalar, once per batch of 2
    assert costs.activation_bytes_per_sample == saved + total_weight / 2 == 510
    assert costs.param_bytes == (3 * 2 * 9 + 48 * 5 + 5) * 4 and costs.params == 299


def test_activation_bytes_scale_with_width_and_counting_leaves_the_model_unchanged():
    from edgetrain.models import build_model

    model = build_model("small_cnn", 3, 10, width=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    narrow = count_costs(model, (3, 16, 16))
    wide = count_costs(build_model("small_cnn", 3, 10, width=16), (3, 16, 16))
    # the first block's BatchNorm / ReLU outputs dominate and double with the width; the input does not
    assert 1.6 < wide.activation_bytes_per_sample / narrow.activation_bytes_per_sample < 2.0
    assert narrow.activation_bytes_per_sample > 3 * 16 * 16 * 4  # at least the input
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm stats restored


def test_ddp_buckets_cover_every_parameter_once():
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])  # 6 x 257 KiB weights
    buckets = ddp_buckets(model, cap_mb=0.5)
    flat = sorted(i for b in buckets for i in b)
    assert flat == list(range(12)) and len(buckets) > 1
    assert len(ddp_buckets(model)) == 1  # 25 MiB cap: one bucket


def test_payload_bytes_come_from_the_compressors():
    costs = count_costs(tiny_net(), (2, 6, 6), num_classes=5)
    n, p = costs.params, 4
    dense = traffic(costs, p, SYNC, parse_compress("none"))
    assert dense.collectives == (("allreduce", 2 * (p - 1) * 4 * n // p),) and dense.payload_bytes == 4 * n
    assert traffic(costs, p, SYNC, parse_compress("fp16")).payload_bytes == 2 * n
    topk = traffic(costs, p, SYNC, parse_compress("topk:0.1"))
    assert topk.payload_bytes == 8 * math.ceil(0.1 * n)            # value + index per kept entry
    assert topk.collectives == (("allgather", (p - 1) * topk.payload_bytes),)
    assert traffic(costs, p, SYNC, parse_compress("sign")).payload_bytes == 4 + math.ceil(n / 8)
    assert traffic(costs, 1, SYNC, parse_compress("none")).collectives == ()


def test_synthetic_data_footprint_matches_the_built_dataset():
    cfg = load_config(None, dataset="synthetic", image_size=8, synthetic_samples=40)
    shape, classes, size = data_footprint(cfg)
    data = build_data(cfg)
    built = sum(s.images.numel() * s.images.element_size() + s.labels.numel() * s.labels.element_size()
                for s in (data.train, data.test))
    assert shape == data.input_shape and classes == data.num_classes and size == built
