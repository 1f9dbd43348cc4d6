"""DiLoCo between the replicas of a pooled strategy (train/replicas.py): ``--strategy fsdp --fsdp-replicas R`` and
``--strategy pipeline --pipeline-replicas D`` with ``--sync diloco:H``. The identity (H=1, outer lr 1, no momentum:
the plain pooled run), the outer exchange once per H steps and its bytes, DiLoCo's outer Nesterov step as data
parallelism's, refusals."""
import json
from pathlib import Path

import pytest
import torch

from edgetrain_testing import NEEDS_POOLED, FAST, DigitsMlp

pytestmark = NEEDS_POOLED
from edgetrain import load_checkpoint, train
from edgetrain.config import TrainConfig, resolve
from edgetrain.errors import EdgetrainError

HIDDEN, BATCH = DigitsMlp.HIDDEN, 32
PARAMS = 64 * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN * 10 + 10
IDENTITY = "diloco:1:lr=1:momentum=0"  # the outer step ref - mean(ref - x_r) = mean(x_r)


def _model():
    torch.manual_seed(0)
    return DigitsMlp()


def _weights(summary):
    return load_checkpoint(summary["run_dir"])["model"]


def _records(summary):
    return [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]


def _same(a, b):
    # not bit-exact: the plain run steps x - lr mean(g_r), the outer step ref - mean(ref - x_r); the two differ
    # by fp32 rounding (seen: 6e-8 at most)
    for key, value in a.items():
        assert torch.allclose(b[key], value, rtol=1e-5, atol=1e-6), key


POOLED = {"fsdp": dict(strategy="fsdp", fsdp_replicas=2),
          "pipeline": dict(strategy="pipeline", pipeline_replicas=2, stages="2", microbatches=2)}


@pytest.mark.parametrize("strategy", ["fsdp", "pipeline"])
def test_diloco_every_step_with_outer_lr_1_and_no_momentum_is_the_plain_pooled_run(tmp_path, strategy):
    cfg = dict(dataset="digits", steps=3, batch_size=BATCH, lr=0.1, momentum=0.9, output=str(tmp_path), **FAST,
               **POOLED[strategy])
    plain = train(cfg, model=_model(), devices=4, run_name="plain")
    diloco = train({**cfg, "sync": IDENTITY}, model=_model(), devices=4, run_name="diloco")
    _same(_weights(plain), _weights(diloco))
    if strategy == "fsdp":  # the plain run's sharded replicas all-reduce gradients: one device's parameters
        one = {key: value for key, value in cfg.items() if key not in POOLED[strategy]}
        _same(_weights(train(one, model=_model(), devices=1, run_name="one")), _weights(plain))
    # both send each device's part of the model (fp32) to its one peer replica once per step
    assert ([r["replica_bytes_sent"] for r in _records(plain)] == [r["replica_bytes_sent"] for r in _records(diloco)]
            and all(r["replica_bytes_sent"] > 0 for r in _records(diloco)))


@pytest.mark.slow
def test_fsdp_replicas_with_diloco_4_exchange_once_per_4_steps_as_data_parallel_diloco_does(tmp_path):
    steps, period = 8, 4
    cfg = dict(dataset="digits", steps=steps, batch_size=BATCH, lr=0.1, output=str(tmp_path), sync=f"diloco:{period}",
               **FAST)
    # 2 sharded replicas of 2 devices: replica r reads the half of the batch device r reads in 2-device DDP
    pooled = train({**cfg, **POOLED["fsdp"]}, model=_model(), devices=4, run_name="fsdp")
    ddp = train(cfg, model=_model(), devices=2, run_name="ddp")
    _same(_weights(ddp), _weights(pooled))  # DiLoCo's outer Nesterov step (lr 0.7, momentum 0.9), as local_sgd.py's
    assert pooled["fsdp"]["outer_steps"] == steps // period
    # each device's shard of the pseudo-gradient, fp32, to its one peer replica (a ring of 2 sends it once)
    shard = pooled["fsdp"]["shard_parameters"]
    for r in _records(pooled):
        assert r["replica_bytes_sent"] == (4 * shard if (r["step"] + 1) % period == 0 else 0), r
    # a replica's devices together: the whole pseudo-gradient, fp32, once per H steps
    replica = sum(r["replica_bytes_sent"] for r in _records(pooled) if r["rank"] < 2)
    assert replica == 4 * PARAMS * steps // period


@pytest.mark.parametrize("strategy", ["fsdp", pytest.param("pipeline", marks=pytest.mark.slow)])
def test_a_run_with_diloco_between_replicas_resumes_mid_round_as_the_uninterrupted_one(tmp_path, strategy):
    # a checkpoint at step 3 of rounds of 4: the replicas differ there (parameters and inner momentum), and each
    # device's error feedback (SparseLoCo's top-k), DiLoCo's reference and outer momentum are its own
    cfg = dict(dataset="digits", steps=6, batch_size=BATCH, lr=0.1, momentum=0.9, output=str(tmp_path),
               sync="diloco:4", compress="topk:0.1:bits=2", checkpoint_every=3, **FAST, **POOLED[strategy])
    summary = train({**cfg, "link": "20mbit:5ms"}, model=_model(), devices=4, run_name="run")
    uninterrupted = _weights(summary)
    assert summary[strategy]["outer_steps"] == 2  # at step 4, and the last 2 steps at the end
    # on the device clock, the outer exchange is charged to the step that makes it, and to no other
    for rank in range(4):
        comm = [r["virtual_comm_s"] for r in _records(summary) if r["rank"] == rank]
        assert comm[0] == comm[1] == comm[2] == comm[4] == comm[5] < comm[3], comm
    resumed = train({"resume": summary["run_dir"]}, model=_model())
    assert resumed["steps"] == 6
    for key, value in _weights(resumed).items():
        assert torch.equal(uninterrupted[key], value), key


@pytest.mark.parametrize("options, message", [
    (dict(strategy="fsdp", sync="diloco:4"), r"'sync' diloco:4 does not apply to strategy fsdp.*one sharded replica"
                                             r".*add --fsdp-replicas D"),
    (dict(strategy="fsdp", compress="topk:0.1"), r"'compress' topk:0.1 does not apply to strategy fsdp"),
    (dict(strategy="fsdp", fsdp_replicas=2, devices=4, sync="async:2"), "'sync' async:2 does not apply between the "
                                                                        "replicas of strategy fsdp"),
    (dict(strategy="pipeline", pipeline_replicas=2, devices=4, sync="gossip"), "'sync' gossip does not apply between"),
    (dict(strategy="fsdp", fsdp_replicas=2, devices=3), "'devices' 3 is not a multiple of fsdp_replicas 2"),
    (dict(strategy="fsdp", fsdp_replicas=2, devices=4, compress="powersgd:2"), "powersgd is a DDP gradient hook"),
    (dict(fsdp_replicas=2, devices=4), "'fsdp_replicas' 2 needs strategy fsdp"),
])
def test_replicas_refuse_what_they_cannot_run(options, message):
    with pytest.raises(EdgetrainError, match=message):
        resolve(TrainConfig(**options))


@pytest.mark.parametrize("strategy", ["fsdp", "pipeline"])
def test_replicas_take_diloco_and_sparseloco_between_them(strategy):
    options = {k: v for k, v in POOLED[strategy].items() if k != "stages"}
    spec = resolve(TrainConfig(devices=4, sync="diloco:4", compress="topk:0.03:bits=2", **options))
    assert spec.sync.period == 4 and spec.sync.nesterov and spec.compress.text == "topk:0.03:bits=2"


def test_plan_refuses_fsdp_replicas_in_one_line(tmp_path, capsys):
    from edgetrain.cli import main

    config = tmp_path / "run.yaml"
    config.write_text("strategy: fsdp\nfsdp_replicas: 2\ndevices: 4\n")
    assert main(["plan", "--config", str(config), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "config key 'fsdp_replicas' 2: edgetrain plan does not model sharded replicas" in err
    assert len(err.strip().splitlines()) == 1
