"""Secure aggregation (--secure-aggregation): the masked sum is the plain sum within the fixed-point step, one
device's payload is uniform noise, the refusals are one line, and a run with it trains as the plain one."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from scipy.stats import chisquare
from secagg_workers import secure_sums

from edgetrain import train
from edgetrain.comm import secagg
from edgetrain.config import TrainConfig, resolve
from edgetrain.errors import EdgetrainError
from edgetrain.spec import LaunchSpec
from edgetrain_testing import FAST, on_devices


FP32 = 2.0 ** -23  # fp32's relative rounding


def test_the_masked_sum_is_the_plain_allreduce_within_the_fixed_point_step():
    results = on_devices(secure_sums, 3)
    for r in results:
        for name in ("first", "again", "larger"):
            row = r[name]
            # rounding: half a step per member, then the fp32 the sum is returned in; the step relative to the
            # sum's largest entry far below 1e-6
            assert row["error"] <= 1.5 * row["step"] + FP32 * row["largest"], (name, row)
            assert row["step"] / row["largest"] < 1e-6, (name, row)
            assert row["vs_plain"] <= row["error"] + 1e-5 * row["largest"], (name, row)
            assert row["bytes"] >= r["want_bytes"], (name, row)  # fp32's bytes plus a 512-byte tail, per exchange
        # redone twice: the first exchange (device 2's entries reach 2^6, above the opening guess 2^0) and the
        # 1000x larger one; the second, of the same range, went through once: fp32's bytes and the tail
        assert r["redone"] == 2 and r["again"]["bytes"] == r["want_bytes"]
        assert r["randk_error"] <= 1.5 * r["randk_step"] + FP32 * r["first"]["largest"] and r["nan"]
    assert results[0]["members_error"] <= results[0]["members_step"] + FP32 * results[0]["first"]["largest"]
    assert "members_error" not in results[1]  # not a member: no masks with it, nothing to wait for


def seeded_keys(count: int) -> list[secagg.PairwiseKeys]:
    rng = np.random.default_rng(7)
    keys = [secagg.PairwiseKeys(r, X25519PrivateKey.from_private_bytes(rng.bytes(32))) for r in range(count)]
    for k in keys:
        k.agree([other.public for other in keys])
    return keys


def test_one_devices_masked_payload_is_uniform_and_the_masks_cancel():
    gradient = torch.randn(20_000, generator=torch.Generator().manual_seed(0)) * 1e-2
    exponent, members = secagg.exponent_of(gradient), [0, 1, 2]
    words = secagg.encode(gradient, exponent, len(members))
    keys = seeded_keys(3)
    wire = [secagg.masked(words if r == 0 else np.zeros_like(words), r, members, keys[r], {}) for r in members]
    observed = np.bincount(wire[0].view(np.uint8), minlength=256)
    plain = np.bincount(words.view(np.uint8), minlength=256)
    assert chisquare(observed).pvalue > 1e-3       # bytes of device 0's payload: indistinguishable from uniform
    assert chisquare(plain).pvalue < 1e-12         # its fixed-point words in the clear: far from it
    total = wire[0] + wire[1] + wire[2]            # uint32: wraps mod 2^32, as the int32 all-reduce does
    assert np.array_equal(total, words)


@pytest.mark.parametrize("options, names", [
    ({"strategy": "fsdp"}, "strategy fsdp"),
    ({"sync": "gossip"}, "--sync gossip"),
    ({"sync": "async:2"}, "--sync async:2"),
    ({"compress": "topk:0.1"}, "--compress topk:0.1"),
    ({"compress": "int8"}, "--compress int8"),
    ({"compress": "fp16"}, "--compress fp16"),
    ({"batchnorm": "sync"}, "--batchnorm sync"),
    ({"sync": "fedavg:1", "partition": "iid", "devices": 4, "participation": 0.25}, "participation 0.25"),
])
def test_what_it_cannot_mask_is_refused_in_one_line(options, names):
    with pytest.raises(EdgetrainError) as refused:
        resolve(TrainConfig(**{"devices": 2, **options, "secure_aggregation": True}), LaunchSpec())
    line = str(refused.value)
    assert "\n" not in line and line.startswith("--secure-aggregation") and names in line


@pytest.mark.parametrize("options", [{"sync": "sync"}, {"sync": "diloco:2", "compress": "randk:0.1"},
                                     {"sync": "fedavg:1", "partition": "iid", "round_deadline": "auto",
                                      "participation": 0.5, "devices": 4}])
def test_the_sums_it_masks_are_accepted(options):
    spec = resolve(TrainConfig(**{"devices": 2, **options, "secure_aggregation": True}), LaunchSpec())
    assert spec.secure_aggregation


def test_a_run_with_secure_aggregation_trains_as_the_plain_run(tmp_path):
    cfg = dict(model="small_cnn_gn", dataset="digits", devices=3, steps=4, batch_size=48, sync="local:2",
               output=str(tmp_path), **FAST)
    plain, masked = train(cfg), train(cfg, secure_aggregation=True)
    assert masked["secure_aggregation"]["exchanges"] == 2 and "secure_aggregation" not in plain
    assert masked["bytes_sent_per_device"] > plain["bytes_sent_per_device"]
    assert masked["train_loss"] == pytest.approx(plain["train_loss"], rel=1e-5)
    a = torch.load(f"{plain['run_dir']}/checkpoint.pt", weights_only=True)["model"]
    b = torch.load(f"{masked['run_dir']}/checkpoint.pt", weights_only=True)["model"]
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


def lone_round(secure) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One round of local SGD with a single member (one device): (start, end, its round counts)."""
    from edgetrain.comm.compress import NoCompression, NoMemory
    from edgetrain.comm.emulation import LinkEmulator
    from edgetrain.comm.local_sgd import LocalSGD
    from edgetrain.comm.mode import Averaging

    model = torch.nn.Linear(3, 2)
    mode = LocalSGD(model, 1, LinkEmulator(None, 0), Averaging(0, None, NoCompression(), NoMemory(), secure), 1)
    start = model.weight.detach().clone()
    assert mode.trains(0)
    model(torch.ones(1, 3))
    with torch.no_grad():
        model.weight += 1.0  # the member's local step
    mode.after_step(0)
    return start, model.weight.detach().clone(), mode.round_counts


def test_a_round_of_one_member_is_dropped_not_revealed():
    start, end, counts = lone_round(secure=object())  # any SecureSum: a lone member never reaches it
    assert torch.equal(start, end) and counts["dropped_alone"] == 1 and counts["joined"] == 0
    start, end, counts = lone_round(secure=None)
    assert torch.equal(end, start + 1.0) and counts["joined"] == 1 and "dropped_alone" not in counts


@pytest.mark.slow
def test_a_device_killed_mid_run_leaves_and_the_others_agree_new_keys(tmp_path, monkeypatch):
    """--min-devices: the masked exchange in flight fails on every survivor, none is unmasked, the group re-forms
    with 3 devices that agree new keys and go on from the start-of-step state."""
    monkeypatch.setenv("EDGETRAIN_FAULT", "kill:rank=3:step=5")
    summary = train(dict(dataset="synthetic", image_size=8, synthetic_samples=1024, batch_size=32, steps=12,
                         devices=4, min_devices=2, secure_aggregation=True, model="small_cnn_gn", timeout=60,
                         **{k: v for k, v in FAST.items() if k != "timeout"}),
                    output=str(tmp_path), run_name="left")
    changes = [json.loads(line) for line in (tmp_path / "left" / "membership.jsonl").read_text().splitlines()]
    assert [(c["kind"], c["devices"], c["world"]) for c in changes] == [("leave", [3], 3)]
    assert summary["steps"] == 12 and math.isfinite(summary["train_loss"])
    assert summary["secure_aggregation"]["key_exchange_bytes_sent"] == 64  # the last generation's: 3 devices
