"""Checkpoints and --resume (train/checkpoint.py): resumed == uninterrupted, atomic files, last K kept, refusals."""
import json
import os
import time
from pathlib import Path

import pytest
import torch

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from edgetrain import load_checkpoint, train
from edgetrain.comm.compress.memory import DGCMemory, ResidualMemory
from edgetrain.config import load_config
from edgetrain.data import GlobalBatchSampler
from edgetrain.errors import EdgetrainError
from edgetrain.spec import CheckpointSpec
from edgetrain.train import checkpoint
from edgetrain.train.checkpoint import (Checkpointer, check_resumable, check_resume_devices, checkpoint_files,
                                        checkpoint_step, device_state_for, elastic_run_dir)
from edgetrain_testing import FAST, NEEDS_POOLED, run_cli

# 128 synthetic images in global batches of 32: 4 steps an epoch, so step 6 is in the middle of epoch 1.
SMALL = dict(model="small_cnn", dataset="synthetic", image_size=8, synthetic_samples=128, batch_size=32, steps=10,
             lr=0.1, checkpoint_every=3, keep_checkpoints=3, **FAST)


def final_model(run_dir) -> dict:
    return torch.load(Path(run_dir) / "checkpoint.pt", weights_only=True)["model"]


@pytest.mark.slow
@pytest.mark.parametrize("devices, compress, sync", [
    (1, "none", "sync"),
    (2, "topk:0.1", "sync"),         # error-feedback residuals of the DDP hook, per parameter
    (2, "topk:0.1", "local:4"),      # reference model and residuals in the middle of a local period
    (2, "none", "async:1"),          # the round in flight at the checkpoint, applied at the next step
    (2, "topk:0.1:bits=2", "diloco:4"),  # SparseLoCo: outer momentum, residuals of the 2-bit codes
    (2, "quant:4", "streaming:4:fragments=2:overlap=2"),  # an exchange in flight at step 6's checkpoint
    (2, "powersgd:2:start=2", "sync"),  # P, Q, residuals: the resumed first step runs on DDP's first bucket layout
])
def test_resumed_run_ends_as_the_uninterrupted_one(tmp_path, devices, compress, sync):
    _resumed_ends_as_uninterrupted(tmp_path, devices, compress=compress, sync=sync)


@pytest.mark.slow
def test_a_partitioned_run_resumed_mid_walk_ends_as_the_uninterrupted_one(tmp_path):
    # iid halves of 64 samples: device 0 (8 a step) walks one shuffle over two epochs, device 1 (24 a step)
    # starts its next shuffle mid-epoch; step 6's checkpoint is in the middle of both walks
    _resumed_ends_as_uninterrupted(tmp_path, 2, partition="iid", local_batch="8,24")


def _resumed_ends_as_uninterrupted(tmp_path, devices, **options):
    run_dir = Path(train(SMALL, devices=devices, output=str(tmp_path), **options)["run_dir"])
    uninterrupted = final_model(run_dir)
    assert [checkpoint_step(p) for p in checkpoint_files(run_dir)] == [3, 6, 9]
    # As if the run had been killed after step 6's checkpoint: step 9's never happened.
    checkpoint_files(run_dir)[-1].unlink()
    summary = train({"resume": str(run_dir)})
    assert summary["run_dir"] == str(run_dir)
    resumed = final_model(run_dir)
    for name, value in uninterrupted.items():
        assert torch.allclose(value.double(), resumed[name].double(), rtol=0, atol=1e-6), name
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted((r["step"], r["rank"]) for r in lines) == [(s, r) for s in range(10) for r in range(devices)]
    assert summary["steps"] == 10
    assert not list(run_dir.glob("metrics-*.jsonl"))


def test_sampler_resumes_in_the_middle_of_an_epoch():
    whole = GlobalBatchSampler(100, [6, 4], rank=1, seed=3)
    whole.set_epoch(2)
    resumed = GlobalBatchSampler(100, [6, 4], rank=1, seed=3)
    resumed.resume_at(2, 7)
    assert list(resumed) == list(whole)[7:]
    assert len(list(resumed)) == len(resumed)  # the next epoch starts from its first batch again


@pytest.mark.parametrize("memory", [ResidualMemory(), DGCMemory()])
def test_error_feedback_memory_survives_a_checkpoint(memory):
    x = torch.randn(10)
    memory.update(memory.compensate(x, "params"), torch.zeros(10), "params")
    copy = type(memory)()
    copy.load_state_dict(torch.load(_saved(memory.state_dict()), weights_only=True))
    y = torch.randn(10)
    assert torch.equal(copy.compensate(y, "params"), memory.compensate(y, "params"))


def _saved(obj):
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    checkpoints = Checkpointer(CheckpointSpec(every_steps=1, keep=2), str(tmp_path), rank=0, world=1, timeout_s=5)
    for step in (1, 2, 3):
        checkpoints.save(step, {"step": step}, {"weights": torch.ones(3) * step})
    assert [checkpoint_step(p) for p in checkpoint_files(tmp_path)] == [2, 3]


def test_a_checkpoint_is_due_every_n_steps_and_after_s_seconds(tmp_path, monkeypatch):
    by_steps = Checkpointer(CheckpointSpec(every_steps=3), str(tmp_path), rank=0, world=1, timeout_s=5)
    assert [s for s in range(10) if by_steps.due(s, start_step=0)] == [3, 6, 9]
    by_time = Checkpointer(CheckpointSpec(every_s=60.0), str(tmp_path), rank=0, world=1, timeout_s=5)
    assert not by_time.due(1, start_step=0)
    clock = time.monotonic() + 61
    monkeypatch.setattr(time, "monotonic", lambda: clock)
    assert by_time.due(2, start_step=0)


def test_a_write_that_dies_half_way_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    checkpoints = Checkpointer(CheckpointSpec(every_steps=1, keep=2), str(tmp_path), rank=0, world=1, timeout_s=5)
    checkpoints.save(1, {"step": 1}, {"weights": torch.ones(3)})
    real_save = torch.save

    def dies_half_way(obj, f, *args, **kwargs):
        if hasattr(f, "fileno"):  # the checkpoint file, not the in-memory serialisation of a device's state
            f.write(b"half a checkpoint")
            raise KeyboardInterrupt  # as a kill would, in the middle of the write
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save(2, {"step": 2}, {"weights": torch.ones(3)})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000001.pt"]  # no temporary either
    assert torch.load(checkpoint_files(tmp_path)[0], weights_only=True)["step"] == 1


class _WholePart:
    """A pooled strategy's two hooks over a plain module on one device (whose part is all of it)."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.model = nn.Linear(3, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.model(torch.randn(4, 3)).sum().backward()
        self.optimizer.step()  # momentum to keep

    def sharded_state(self, optimizer, final=False):
        model, optim = get_state_dict(self.model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
        return {"model": model, "optimizer": optim}

    def load_sharded_state(self, state, optimizer):
        set_state_dict(self.model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(flatten_optimizer_state_dict=True))


@NEEDS_POOLED
def test_a_pooled_write_killed_half_way_leaves_the_previous_checkpoint_usable(tmp_path, monkeypatch):
    writer = Checkpointer(CheckpointSpec(every_steps=1, keep=2), str(tmp_path), rank=0, world=1, timeout_s=5)
    saved = _WholePart(0)
    writer.save(1, {"step": 1}, {"note": "step 1"}, saved.sharded_state(saved.optimizer))
    real_save = checkpoint.save_torch

    def killed_before_the_rename(path, obj):
        if path.name == "run.pt":  # every device's part is written, the directory not renamed yet
            raise KeyboardInterrupt
        real_save(path, obj)

    monkeypatch.setattr(checkpoint, "save_torch", killed_before_the_rename)
    later = _WholePart(1)
    with pytest.raises(KeyboardInterrupt):
        writer.save(2, {"step": 2}, {"note": "step 2"}, later.sharded_state(later.optimizer))
    monkeypatch.setattr(checkpoint, "save_torch", real_save)
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [".step-00000002.tmp", "step-00000001"]
    assert [checkpoint_step(p) for p in checkpoint_files(tmp_path)] == [1]
    # Resuming removes the half-written parts and reads step 1's back into place, model and momentum.
    reader = Checkpointer(CheckpointSpec(resume_dir=str(tmp_path)), None, rank=0, world=1, timeout_s=5)
    run_state, mine = reader.load()
    assert run_state["step"] == 1 and mine["note"] == "step 1"
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000001"]
    resumed = _WholePart(2)
    reader.load_sharded(resumed, resumed.optimizer, mine)
    for a, b in zip([*saved.model.parameters(), *saved.optimizer.state.values()],
                    [*resumed.model.parameters(), *resumed.optimizer.state.values()]):
        a, b = (a["momentum_buffer"], b["momentum_buffer"]) if isinstance(a, dict) else (a, b)
        assert torch.equal(a, b)
    # The public loader reads a directory of parts whole, with the optimizer's state by parameter name.
    whole = load_checkpoint(folder / "step-00000001")
    assert torch.equal(whole["model"]["weight"], saved.model.weight) and whole["step"] == 1
    assert torch.equal(whole["optimizer"]["state"]["bias"]["momentum_buffer"],
                       saved.optimizer.state[saved.model.bias]["momentum_buffer"])
    assert whole["optimizer"]["param_groups"][0]["params"] == ["weight", "bias"]
    assert whole["optimizer"]["param_groups"][0]["lr"] == 0.1


def test_load_checkpoint_of_a_run_that_did_not_finish_is_one_line(tmp_path):
    with pytest.raises(EdgetrainError, match=r"holds no final checkpoint .*: the run did not finish; resume it"):
        load_checkpoint(tmp_path)


def test_resume_refuses_an_option_that_changes_the_training(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("lr: 0.05\ndevices: 2\n")
    assert load_config(resume=str(run_dir), progress=False, timeout=10).devices == 2  # how it is watched: fine
    assert load_config(resume=str(run_dir), devices=3).devices == 3  # the global batch is re-split over them
    with pytest.raises(EdgetrainError, match=r"option 'lr' is 0.1 but the run in .* was trained with 0.05; "
                                             r".*drop --lr"):
        load_config(resume=str(run_dir), lr=0.1)
    with pytest.raises(EdgetrainError, match="no checkpoint to resume from"):
        check_resumable(run_dir)


def test_resume_of_a_directory_that_is_no_run_is_one_line(tmp_path):
    done = run_cli("train", "--resume", str(tmp_path / "nothing"), timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("edgetrain: error: --resume ") and done.stderr.count("\n") == 1, done.stderr
    assert "not a run directory" in done.stderr


def test_resume_reads_the_newest_whole_checkpoint_and_removes_a_killed_writers_temporary(tmp_path):
    writer = Checkpointer(CheckpointSpec(every_steps=1), str(tmp_path), rank=0, world=1, timeout_s=5)
    writer.save(1, {"step": 1}, {"weights": torch.ones(3)})
    killed_write = tmp_path / "checkpoints" / ".step-00000002.pt.999999999.x1y2.tmp"  # pid 999999999: gone
    killed_write.write_bytes(b"half a checkpoint")
    reader = Checkpointer(CheckpointSpec(resume_dir=str(tmp_path)), None, rank=0, world=1, timeout_s=5)
    run_state, mine = reader.load()
    assert run_state["step"] == 1 and torch.equal(mine["weights"], torch.ones(3))
    assert not killed_write.exists()


@pytest.mark.slow
def test_resumed_on_fewer_devices_ends_as_the_uninterrupted_run(tmp_path):
    # Cross-device BatchNorm: 2 devices then compute what 1 device does with the same global batch, so the
    # run resumed on 1 device must end where the 2-device run did if batch, learning rate and sampler
    # position were carried over right.
    run_dir = Path(train(SMALL, devices=2, batchnorm="sync", output=str(tmp_path))["run_dir"])
    uninterrupted = final_model(run_dir)
    checkpoint_files(run_dir)[-1].unlink()  # killed after step 6's checkpoint
    stopped = time.time() - 50  # as if it had stood still 50 s (a host lost, torchrun restarting)
    for f in [*run_dir.glob("metrics-*.jsonl"), *checkpoint_files(run_dir)]:
        os.utime(f, (stopped, stopped))
    assert checkpoint.last_activity(run_dir) == pytest.approx(stopped)
    summary = train({"resume": str(run_dir), "devices": 1})
    assert summary["devices"] == 1 and summary["steps"] == 10
    resumed = final_model(run_dir)
    for name, value in uninterrupted.items():
        assert torch.allclose(value.double(), resumed[name].double(), rtol=0, atol=1e-6), name
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # device 1's steps before the checkpoint stay in the metrics
    assert sorted((r["step"], r["rank"]) for r in lines) == sorted([(s, r) for s in range(6) for r in range(2)]
                                                                   + [(s, 0) for s in range(6, 10)])
    membership = [json.loads(line) for line in (run_dir / "membership.jsonl").read_text().splitlines()]
    assert [{k: m[k] for k in ("step", "kind", "devices", "world", "state_from", "cause")} for m in membership] == [
        {"step": 6, "kind": "leave", "devices": [1], "world": 1, "state_from": "checkpoint", "cause": "resume"}]
    # the outage is the 50 s the run stood still, not the fraction of a second reading the checkpoint took
    assert 50 <= membership[0]["outage_s"] < 50 + 120 and membership[0]["took_s"] < 10, membership


def _device(rank: int, residual: float) -> dict:
    """A device's checkpoint entry as the loop writes it, with an error-feedback residual."""
    return {"strategy": {"model": {"w": torch.full((2,), float(rank))},
                         "sync": {"codec": {"compressor": {}, "memory": {"residual": {"params": torch.ones(2) * residual}}}}},
            "optimizer": {"rank": rank}, "rng": {"rank": rank}, "records": [{"rank": rank}],
            "epoch_totals": [1.0 + rank, 2.0, 3.0], "throttle": {"rank": rank}, "ema_loss": 0.5}


def test_another_device_count_starts_from_device_0_and_drops_per_device_state():
    saved = [_device(0, 1.0), _device(1, 2.0)]
    fewer, dropped = device_state_for(saved, rank=0, world=1)
    assert torch.equal(fewer["strategy"]["model"]["w"], torch.zeros(2)) and fewer["optimizer"] == {"rank": 0}
    assert fewer["strategy"]["sync"]["codec"]["memory"] == {"residual": {}}
    assert fewer["epoch_totals"] == [3.0, 4.0, 6.0]  # the epoch's running totals of both devices, on rank 0
    assert dropped == ["error-feedback residuals", "the RNG state of device(s) 1"]
    added, dropped = device_state_for(saved, rank=2, world=3)
    assert added["rng"] is None and added["records"] == [] and added["epoch_totals"] == [0.0, 0.0, 0.0]
    assert added["throttle"] == {"rank": 0} and added["optimizer"] == {"rank": 0}
    assert dropped == ["error-feedback residuals"]
    assert saved[1]["strategy"]["sync"]["codec"]["memory"]["residual"]  # the checkpoint itself is left alone


def test_a_partitioned_run_resumes_only_on_as_many_devices(tmp_path):
    writer = Checkpointer(CheckpointSpec(every_steps=1), str(tmp_path), rank=0, world=1, timeout_s=5)
    writer.save(1, {"step": 1}, {"weights": torch.ones(3)})
    check_resume_devices(tmp_path, devices=1, partitioned=True)
    check_resume_devices(tmp_path, devices=2, partitioned=False)
    with pytest.raises(EdgetrainError, match=r"written by 1 devices, each with its own partition .* --devices 1"):
        check_resume_devices(tmp_path, devices=2, partitioned=True)


def test_torchrun_restarts_share_one_run_directory_named_by_the_run_id(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job/7")
    assert elastic_run_dir(str(tmp_path), None) == tmp_path / "train-job_7"
    assert elastic_run_dir(str(tmp_path), "mine") == tmp_path / "mine"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id: no job to recognise
    assert elastic_run_dir(str(tmp_path), None) is None


class _Bucket:
    """What ``PowerSGDHookState.follow_layout`` reads of DDP's ``GradBucket``."""

    def __init__(self, index, params):
        self._index, self._params = index, params

    def index(self):
        return self._index

    def parameters(self):
        return self._params


def test_powersgd_state_follows_its_parameters_into_another_bucket_layout():
    from edgetrain.comm.compress.powersgd import PowerSGDHookState

    weight, bias, head = (torch.nn.Parameter(torch.zeros(shape)) for shape in ((16, 12), (16,), (10, 16)))
    state = PowerSGDHookState(rank=2)
    state.follow_layout(_Bucket(0, [weight, bias, head]))
    # As PyTorch's hook leaves one bucket: a residual per gradient entry; P (n x 2) and Q (m x 2) per matrix
    # it compresses (weight, head; not bias), in that order.
    error, p, q = torch.arange(16 * 12 + 16 + 160.0), torch.arange(32 + 20.0), torch.arange(24 + 32.0)
    state.psgd.error_dict[0], state.psgd.p_memory_dict[0], state.psgd.q_memory_dict[0] = error, p, q
    # Through a checkpoint, then DDP's other layout: two buckets, in another order.
    names = {id(weight): "weight", id(bias): "bias", id(head): "head"}
    saved = torch.load(_saved(state.state_dict(names)), weights_only=True)
    state.load_state_dict(saved, {name: i for i, name in names.items()})
    state.follow_layout(_Bucket(0, [head]))
    state.follow_layout(_Bucket(1, [bias, weight]))
    assert torch.equal(state.psgd.error_dict[0], error[208:])
    assert torch.equal(state.psgd.error_dict[1], torch.cat([error[192:208], error[:192]]))
    assert torch.equal(state.psgd.p_memory_dict[0], p[32:]) and torch.equal(state.psgd.q_memory_dict[0], q[24:])
    assert torch.equal(state.psgd.p_memory_dict[1], p[:32]) and torch.equal(state.psgd.q_memory_dict[1], q[:24])
    # and back to one bucket within the same process
    state.follow_layout(_Bucket(0, [weight, bias, head]))
    assert torch.equal(state.psgd.error_dict[0], error) and torch.equal(state.psgd.p_memory_dict[0], p)
    assert 1 not in state.psgd.error_dict


@NEEDS_POOLED
def test_load_checkpoint_says_whether_a_pooled_runs_model_is_partial(tmp_path, capsys):
    from edgetrain.train.checkpoint import Writers, save_final_parts

    sharded = {"model": {"weight": torch.ones(3)}, "optimizer": {}}
    save_final_parts(tmp_path / "stopped", sharded, 4, {}, Writers(rank=0, world=1, timeout_s=10), planned_steps=10)
    save_final_parts(tmp_path / "done", sharded, 10, {}, Writers(rank=0, world=1, timeout_s=10), planned_steps=10)
    stopped, done = load_checkpoint(tmp_path / "stopped"), load_checkpoint(tmp_path / "done")
    assert stopped["partial"] and (stopped["step"], stopped["planned_steps"]) == (4, 10)
    assert not done["partial"] and torch.equal(done["model"]["weight"], torch.ones(3))
    assert capsys.readouterr().err == (
        f"edgetrain: warning: {tmp_path / 'stopped' / 'checkpoint'} is a partial run's model: step 4 of the 10 "
        f"planned (the run stopped before its end); continue it with edgetrain train --resume RUN_DIR\n")
