"""Two-process gloo groups on 127.0.0.1: hooks on plain DDP, exact exchanges, link time, sync modes."""
from __future__ import annotations

import pytest
import torch
from comm_workers import (exchange_exactness, link_time_checks, memory_over_reordered_bucket, overlapping_paths,
                          plain_ddp_training, sync_modes)
from edgetrain_testing import on_devices

from edgetrain.comm.accounting import ring_allreduce_bytes

DDP_SPECS = ["none", "fp16", "bf16", "int8", "qsgd", "topk:0.1", "topk:0.05:dgc:warmup=8", "randk:0.25", "sign",
             "sign:vote", "powersgd:1:start=4", "threshold:0.01"]


def test_compressors_train_a_plain_ddp_model():
    ranks = on_devices(plain_ddp_training, 2, DDP_SPECS)
    for spec in DDP_SPECS:
        a, b = ranks[0][spec], ranks[1][spec]
        assert a["last"] < 0.6 * a["first"], f"{spec} did not train: {a['first']:.3f} -> {a['last']:.3f}"
        assert torch.allclose(a["params"], b["params"], atol=1e-6), f"{spec}: devices disagree"
        assert a["bytes"] > 0
    fp32 = ranks[0]["none"]["bytes"]
    assert ranks[0]["fp16"]["bytes"] * 2 == fp32
    assert ranks[0]["topk:0.1"]["bytes"] < fp32 / 2
    # PowerSGD bytes, from the model's shapes: rank-1 P (n) and Q (m) per weight, biases as they are
    steps, vanilla = 40, 4
    full = 20 * 32 + 32 + 32 * 4 + 4
    compressed = [32 + 4, 32 + 4, 20 + 32]  # uncompressed biases, P (32 + 4 rows), Q (20 + 32 columns)
    want = vanilla * ring_allreduce_bytes(4 * full, 2) + (steps - vanilla) * sum(
        ring_allreduce_bytes(4 * n, 2) for n in compressed)
    assert ranks[0]["powersgd:1:start=4"]["bytes"] == want


@pytest.mark.slow
def test_without_a_link_the_allreduce_overlaps_backward_and_bytes_stay_counted():
    ranks = on_devices(overlapping_paths, 2)
    for r in ranks:
        none, fp16 = r["none"], r["fp16"]
        assert none["comm_hook"] is None  # DDP's own all-reduce: nothing of edgetrain's inside backward
        assert none["bytes"] == 3 * ring_allreduce_bytes(4 * none["numel"], 2)
        assert none["summary"]["bytes_per_step_per_device"] == none["summary"]["fp32_allreduce_bytes_per_step"]
        assert none["metrics"]["comm_busy_s"] is None  # not measured on that path, not invented
        assert fp16["bytes"] == 3 * ring_allreduce_bytes(2 * fp16["numel"], 2)
    # rank 0 returned from the hook while rank 1 had not yet started its backward: still in flight
    assert ranks[0]["fp16"]["pending"] == [True] * 3


def test_exchange_is_exact_and_counts_payload_bytes():
    for rank_result in on_devices(exchange_exactness, 2):
        for name, r in rank_result.items():
            assert r["max_error"] <= r["tol"], name
            assert r["bytes"] == r["want_bytes"], name


def test_link_model_matches_enforced_run():
    ranks = on_devices(link_time_checks, 2, "8mbit:60ms")
    for r in ranks:
        # one all-reduce: the enforced wall time is the model's prediction
        assert r["allreduce_wall_s"] == pytest.approx(r["allreduce_model_s"], rel=0.10)
        # a short DDP run: the virtual clock predicts the enforced run's time
        virtual, enforced = r["virtual"]["virtual_time_s"], r["enforced"]["virtual_time_s"]
        assert virtual == pytest.approx(enforced, rel=0.10), (virtual, enforced)
        assert r["enforced_wall_s"] == pytest.approx(enforced, rel=0.10)
        assert r["virtual_wall_s"] < 0.5 * r["enforced_wall_s"]  # virtual mode did not wait
        assert r["virtual"]["comm_time_is"] == "modelled" and r["virtual"]["comm_fraction"] > 0.5


LTE = ("lte-10m", "virtual", 0.0)
SYNC_CASES = [("local:4", "none", *LTE), ("local:4:nesterov", "topk:0.2", *LTE), ("async:2", "none", *LTE),
              ("async:3", "sign", *LTE), ("gossip", "none", *LTE), ("sync", "threshold:0.01", *LTE),
              # SparseLoCo (2-bit top-k of the pseudo-gradient, error feedback) and Streaming DiLoCo at 4 bits
              ("diloco:4:lr=1:momentum=0", "topk:0.05:bits=2", *LTE), ("streaming:4:fragments=2", "quant:4", *LTE),
              # an enforced link and a straggler: device 1 computes 30 ms longer every step
              ("async:2", "none", "40mbit:10ms", "enforced", 0.03)]


def test_sync_modes_train_and_agree():
    ranks = on_devices(sync_modes, 2, SYNC_CASES)
    for case in SYNC_CASES:
        a, b = ranks[0][case], ranks[1][case]
        assert a["last"] < 0.7 * a["first"], f"{case} did not train: {a['first']:.3f} -> {a['last']:.3f}"
        assert torch.allclose(a["params"], b["params"], atol=1e-6), f"{case}: final models differ"
        s = a["summary"]
        assert s["sync_steps"] == 32 and s["virtual_time_s"] > 0 and 0 < s["comm_fraction"] < 1, (case, s)
        # gossip with two devices sends each step what an all-reduce would, plus the final average;
        # async on a fast link completes a round every step
        fewer = case[0] != "gossip" and case[2] == "lte-10m"
        assert s["bytes_sent_per_device"] > 0 and s["compression_ratio"] > (1.5 if fewer else 0.9), (case, s)
        assert {"virtual_s", "virtual_compute_s", "virtual_comm_s"} <= set(a["metrics"])
        if case[0].startswith("async"):
            # never trains on a round older than the bound, even beside a straggler
            bound = int(case[0].split(":")[1])
            assert s["staleness_max"] <= bound and s["rounds"] >= 32 // bound, s
    assert ranks[0][SYNC_CASES[0]]["summary"]["averages"] == 8


EF_SPECS = ["topk:0.01", "topk:0.01:dgc:momentum=0"]


@pytest.mark.slow
def test_error_feedback_follows_parameters_when_ddp_reorders_its_bucket():
    """sum of averaged gradients + what the memories still held == mean of the local sums, per parameter.

    DGC runs at momentum 0, where its accumulation is plain error feedback; its
    momentum is checked under reordering in test_comm_compressors.py.
    """
    ranks = on_devices(memory_over_reordered_bucket, 2, EF_SPECS)
    for spec in EF_SPECS:
        layouts = ranks[0][spec]["layouts"]
        assert len(set(layouts[0])) == len(layouts[0]) == 6 and len(layouts) == 7, "expected one bucket per step"
        assert layouts[1] != layouts[0], "DDP did not reorder its bucket: the test would prove nothing"
        for name, averaged in ranks[0][spec]["averaged"].items():
            want = sum(r[spec]["local"][name] for r in ranks) / len(ranks)
            assert torch.allclose(averaged, want, rtol=1e-4, atol=1e-6), \
                f"{spec}, {name}: off by {(averaged - want).abs().max():.3g}"
