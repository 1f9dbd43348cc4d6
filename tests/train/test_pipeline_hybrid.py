"""``--strategy pipeline --pipeline-replicas D`` (train/pipeline.py): S stages x D replicas, each stage's gradients
all-reduced among its replicas through edgetrain's compressors. One device's parameters without compression,
identical replicas and counted bytes with top-k and error feedback, the all-reduce's invariants on 4 devices,
refusals."""
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from edgetrain_testing import NEEDS_POOLED, FAST, DigitsMlp, on_devices

pytestmark = NEEDS_POOLED
from edgetrain import load_checkpoint, train
from edgetrain.cluster.links import round_seconds
from edgetrain.config import TrainConfig, resolve
from edgetrain.data import build_data
from edgetrain.errors import EdgetrainError
from edgetrain.spec import get_link
from edgetrain.train.loop import evaluate

HIDDEN, BATCH, STEPS = DigitsMlp.HIDDEN, 32, 3


def _model():
    torch.manual_seed(0)
    return DigitsMlp()


def _weights(summary):
    return load_checkpoint(summary["run_dir"])["model"]  # checkpoint.pt, or a pipeline's checkpoint/ of parts


# stages "2": stage 0 is Flatten + Linear(64, H), stage 1 the rest
STAGE_PARAMS = (64 * HIDDEN + HIDDEN, HIDDEN * HIDDEN + HIDDEN + HIDDEN * 10 + 10)


@pytest.mark.slow
def test_two_stages_by_two_replicas_give_one_devices_parameters_and_count_their_bytes(tmp_path):
    cfg = dict(dataset="digits", steps=STEPS, batch_size=BATCH, lr=0.1, output=str(tmp_path), **FAST)
    one = _weights(train(cfg, model=_model(), devices=1, run_name="one"))
    hybrid = train({**cfg, "eval": True}, model=_model(), devices=4, strategy="pipeline", stages="2",
                   pipeline_replicas=2, microbatches=2, run_name="hybrid")
    assert hybrid["pipeline"]["replicas"] == 2 and hybrid["pipeline"]["replica_batch"] == BATCH // 2
    assert hybrid["pipeline"]["replicas_identical"] is True
    for key, value in one.items():
        assert torch.allclose(_weights(hybrid)[key], value, rtol=1e-5, atol=1e-6), key
    # each replica's cut carries its (B/2) x H activations forwards and their gradients backwards: the two
    # replicas together what one pipeline carries for B; each stage device then all-reduces its stage's fp32
    # gradients with its one peer (a ring of 2 sends the payload once)
    cut = 2 * BATCH * HIDDEN * 4
    allreduce = 2 * sum(STAGE_PARAMS) * 4
    assert hybrid["bytes_sent_total"] == STEPS * (cut + allreduce)
    # each replica evaluated its half of the test set through its stages (evaluation is not counted in the
    # bytes above): together the whole test set, scored as its final model whole in one process scores it
    model = DigitsMlp()
    model.load_state_dict(_weights(hybrid))
    loss, accuracy = evaluate(model, build_data(TrainConfig(dataset="digits")).test, rank=0, world=1)
    assert hybrid["test_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert hybrid["test_loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.slow
def test_topk_with_error_feedback_keeps_replicas_identical_and_counts_its_payloads(tmp_path):
    ratio = 0.1
    summary = train(dict(dataset="digits", steps=STEPS, batch_size=BATCH, lr=0.1, output=str(tmp_path), **FAST),
                    model=_model(), devices=4, strategy="pipeline", stages="2", pipeline_replicas=2,
                    microbatches=2, compress=f"topk:{ratio}", link="20mbit:5ms", run_name="topk")
    assert summary["pipeline"]["replicas_identical"] is True and summary["pipeline"]["compress"] == f"topk:{ratio}"
    # top-k is gathered, not summed: each device sends its k (fp32 value, int32 index) pairs to its one peer
    topk = 2 * sum(8 * math.ceil(ratio * n) for n in STAGE_PARAMS)
    assert summary["bytes_sent_total"] == STEPS * (2 * BATCH * HIDDEN * 4 + topk)
    # on the clock: each stage's link carries its replica's 2 M cut transfers (GPipe), then one all-gather round
    # with its peer replica. Stage 0 waits for all of them (its last backward needs the last gradient back), so
    # its step lasts at least that; no clock runs ahead of every step's transfers plus every device's compute
    # (summed over the steps so far: a stage may start a step waiting for another's end of the last one).
    assert summary["link_mode"] == "virtual"
    microbatches, link = 2, get_link("20mbit:5ms")
    # one round each of the link model (its formula: tests/comm/test_comm_links.py): a one-way cut transfer, and
    # the all-gather of the top-k pairs between the two replicas
    transfer = round_seconds(link.latency_s, (BATCH // 2 // microbatches) * HIDDEN * 4, link.goodput_Bps, "p2p")
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    clock, bound = dict.fromkeys(range(4), 0.0), 0.0
    for step in range(STEPS):
        mine = {r["rank"]: r for r in records if r["step"] == step}
        bound += max(m["virtual_comm_s"] for m in mine.values()) + sum(m["virtual_compute_s"] for m in mine.values())
        for rank, r in mine.items():
            gather = round_seconds(link.latency_s, 8 * math.ceil(ratio * STAGE_PARAMS[rank % 2]), link.goodput_Bps,
                                   "allgather")
            assert r["virtual_comm_s"] == pytest.approx(2 * microbatches * transfer + gather)
            assert r["virtual_s"] - clock[rank] >= (r["virtual_comm_s"] if rank % 2 == 0 else gather) - 1e-9
            assert r["virtual_s"] <= bound + 1e-9
        clock = {rank: r["virtual_s"] for rank, r in mine.items()}


def _exchange(rank, world, method):
    """One stage x 2 replicas, in a stage group of its own: each device all-reduces the stage's gradients over 4
    steps, as the hybrid does (the training runs above cover several stage groups side by side)."""
    import torch.distributed as dist

    from edgetrain.comm.accounting import CommStats
    from edgetrain.comm.compress.spec import build_compressor
    from edgetrain.comm.emulation import LinkEmulator
    from edgetrain.spec import parse_compress
    from edgetrain.train.pipeline import allreduce_gradients
    from edgetrain.train.replicas import Channel

    group = dist.new_group([0, 1], backend="gloo")
    torch.manual_seed(0)  # the replicas of a stage start alike
    params = [nn.Parameter(torch.randn(7, 5)), nn.Parameter(torch.randn(11))]
    compressor, memory = build_compressor(parse_compress(method), None, 0, rank)
    emulator = LinkEmulator(None, rank, CommStats())
    fed, means = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64), []
    for step in range(4):
        gen = torch.Generator().manual_seed(100 * rank + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        fed += torch.cat([p.grad.reshape(-1) for p in params]).double()
        allreduce_gradients(params, ("w", "b"), Channel(compressor, memory, emulator, group, [0, 1]))
        means.append(torch.cat([p.grad.reshape(-1) for p in params]).double())
    residual = torch.cat([memory.residuals[name] for name in ("w", "b")]).double()
    return fed, torch.stack(means), residual, emulator.stats.bytes_sent


@pytest.mark.slow
def test_the_replica_all_reduce_keeps_error_feedbacks_invariant_and_gives_every_replica_one_mean():
    (fed0, means0, residual0, sent0), (fed1, means1, residual1, sent1) = on_devices(_exchange, 2, "topk:0.2")
    assert torch.equal(means0, means1)  # both replicas apply the very same gradients
    # sent + residual == sum of inputs, summed over the replicas: D x (the means) + residuals == what was fed
    assert torch.allclose(2 * means0.sum(0) + residual0 + residual1, fed0 + fed1, atol=1e-5)
    assert sent0 == sent1 == 4 * 8 * math.ceil(0.2 * 46)  # 46 entries, k of them as 8-byte pairs, to one peer


@pytest.mark.parametrize("options, message", [
    (dict(compress="topk:0.01"), r"'compress' topk:0.01 does not apply to strategy pipeline.*add --pipeline-replicas"),
    (dict(pipeline_replicas=2, compress="powersgd:2"), "powersgd is a DDP gradient hook"),
    (dict(pipeline_replicas=2, devices=3), "'devices' 3 is not a multiple of pipeline_replicas 2"),
    (dict(pipeline_replicas=3, batch_size=64), "'pipeline_replicas' 3 does not divide batch_size 64"),
    (dict(pipeline_replicas=2, batch_size=64, microbatches=64), r"'microbatches' 64 does not divide a replica's "
                                                                r"batch 32"),
    (dict(pipeline_replicas=2, devices=4, stages="2,4"), "make 3 stages; with 2 replicas that is 6; set --devices 6"),
    (dict(pipeline_replicas=2, devices=4, sync="async:4"), "'sync' async:4 does not apply between the replicas of "
                                                           "strategy pipeline"),
])
def test_hybrid_refuses_what_it_cannot_run(options, message):
    with pytest.raises(EdgetrainError, match=message):
        resolve(TrainConfig(strategy="pipeline", **options))


def test_replicas_need_strategy_pipeline():
    with pytest.raises(EdgetrainError, match="'pipeline_replicas' 2 needs strategy pipeline"):
        resolve(TrainConfig(pipeline_replicas=2, devices=2))
