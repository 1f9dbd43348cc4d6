"""Each kind declared once (edgetrain.kinds): the contract every descriptor keeps, and the planner dispatching
through the descriptors (fedavg planned as rounds, a strategy without a model refused, not planned as another)."""
import dataclasses
import inspect
import re
import sys

import pytest

from edgetrain.config import load_config, resolve
from edgetrain.errors import EdgetrainError
from edgetrain.kinds import (COMPRESS_KINDS, SERVER_OPT_KINDS, STRATEGY_KINDS, SYNC_KINDS, TASK_KINDS, CompressKind,
                             ServerOptKind, StrategyKind, TaskKind, all_kinds, strategy_kind, task_kind)
from edgetrain.spec import KINDS, LaunchSpec, availability_spec, parse_compress, parse_server_opt, parse_sync

from edgetrain_testing import FAST, _pooled_unsupported, run_main

# each family's parser, from how a kind is written back to its descriptor
PARSERS = {"strategy": strategy_kind, "task": task_kind, "sync": lambda text: parse_sync(text).kind,
           "compress": lambda text: parse_compress(text).kind,
           "server_optimizer": lambda text: parse_server_opt(text).kind,
           "availability": lambda text: availability_spec(text).kind}
# the parameters of each family's builder (a strategy's and a task's runtime is its class)
BUILDERS = {"sync": ["setup"], "compress": ["spec", "link", "seed", "rank"], "server_optimizer": ["global_model", "spec"]}


def written(kind) -> str:
    """``kind.usage`` with its numbers given and its optional parts left out: ``local:H`` -> ``local:2``."""
    text = re.sub(r"\[.*\]", "", kind.usage)
    text = re.sub(r":(RATIO|H|S|E)\b", lambda m: ":0.1" if m.group(1) == "RATIO" else ":2", text)
    return kind.example if re.search(r"[A-Z]", text) else text  # values of its own (durations): its example


def test_every_family_is_in_the_contract():
    assert set(KINDS) == set(PARSERS) and set(BUILDERS) < set(KINDS)
    assert [type(k) for k in all_kinds()].count(TaskKind) == len(TASK_KINDS) == 3
    assert [type(k) for k in all_kinds()].count(ServerOptKind) == len(SERVER_OPT_KINDS) == 3


@pytest.mark.parametrize("kind", all_kinds(), ids=lambda k: f"{k.family}-{k.name}")
def test_every_kind_has_a_parser_a_runtime_a_planner_model_or_a_refusal_and_a_reference_row(kind):
    assert kind.summary and kind.usage.startswith(kind.name)  # the reference row, and how it is written
    assert PARSERS[kind.family](written(kind)) is kind
    if isinstance(kind, StrategyKind) and kind.pooled and _pooled_unsupported() is not None:
        from edgetrain.train.strategy import registered_strategy

        with pytest.raises(EdgetrainError, match=r"install a newer torch \(2\.13 is tested\)$"):
            registered_strategy(kind.name)  # an older torch (2.4): refused in one line, its runtime not loadable
        pytest.skip(f"{_pooled_unsupported()}: strategy {kind.name} refused (its runtime is checked on a newer torch)")
    runtime = kind.load_runtime()
    if kind.family in BUILDERS:
        expected = BUILDERS[kind.family][:3] if getattr(kind, "hook", False) else BUILDERS[kind.family]
        assert len(inspect.signature(runtime).parameters) == len(expected)
        # the classes it builds take their name from it, none spells it
        named = [c for c in vars(sys.modules[runtime.__module__]).values()
                 if isinstance(c, type) and c.__dict__.get("kind") is kind]
        assert all(c.name == kind.name for c in named) and (named or kind.family != "sync")
    else:
        # the runtime class is this kind, and what the loop reads of it is the descriptor's
        assert (runtime.name, runtime.kind) == (kind.name, kind)
    if isinstance(kind, StrategyKind):
        assert (runtime.shard_data, runtime.pooled) == (kind.shards_batch, kind.pooled)
        assert callable(kind.spec)
    if isinstance(kind, CompressKind) and not kind.hook:
        from edgetrain.comm.compress.spec import build_compressor

        compressor, _ = build_compressor(parse_compress(written(kind)))
        assert compressor.kind is kind and compressor.fixed_size == kind.fixed_size  # capabilities: the kind's
    if kind.planner is not None:
        assert callable(kind.load_planner())
    else:
        with pytest.raises(EdgetrainError) as refused:
            kind.load_planner()
        assert str(refused.value) == kind.unplanned and "\n" not in kind.unplanned and ";" in kind.unplanned


def test_the_reference_tables_have_a_row_per_kind():
    from edgetrain.kinds import reference_table

    for family in KINDS:
        rows = reference_table(family).splitlines()[2:]
        assert [row.split("`")[1] for row in rows] == [k.usage for k in KINDS[family].values()]
    assert "| `threshold[:TAU]` | Strom's two-step threshold method" in reference_table("compress")
    assert reference_table("compress").count("| no |") == 1 and reference_table("strategy").count("| no |") == 1


def test_the_registry_is_the_parsers_table_and_a_kind_is_declared_once():
    assert KINDS["strategy"] is STRATEGY_KINDS and KINDS["sync"] is SYNC_KINDS and KINDS["compress"] is COMPRESS_KINDS
    assert KINDS["task"] is TASK_KINDS and KINDS["server_optimizer"] is SERVER_OPT_KINDS
    with pytest.raises(TypeError, match="declared twice"):
        dataclasses.replace(SYNC_KINDS["gossip"])
    with pytest.raises(TypeError, match="declared twice"):
        dataclasses.replace(TASK_KINDS["regression"])
    with pytest.raises(TypeError, match="needs a planner model or the line refusing to plan it"):
        dataclasses.replace(SYNC_KINDS["gossip"], name="gossip2", planner=None)
    assert "gossip2" not in SYNC_KINDS
    with pytest.raises(EdgetrainError, match="use sync, local:H, diloco:H, streaming:H, async:S, gossip or fedavg:E"):
        parse_sync("ring:2")
    with pytest.raises(EdgetrainError, match=r"unknown server optimizer 'sgd' in --server-opt 'sgd'; use fedavg, "
                                             r"fedavgm\[:lr=1:momentum=0.9\] or fedadam\["):
        parse_server_opt("sgd")


def test_a_run_parses_its_sync_and_task_once_and_reads_its_config_file_once(tmp_path, monkeypatch):
    """The launcher resolves the options once (config.load_run) and hands the RunSpec to the devices: nothing
    after it parses --sync again or asks which task the run trains, and the YAML file is read once. (The
    devices themselves are not started: what they are handed is checked.)"""
    import edgetrain.config
    import edgetrain.kinds
    import edgetrain.yamlfile
    from edgetrain import train

    launcher = sys.modules["edgetrain.train"]  # the package (``edgetrain.train`` is also the function)

    calls = {"sync": 0, "task": 0, "yaml": 0}

    def counting(what, real):
        def count(*args, **kwargs):
            calls[what] += 1
            return real(*args, **kwargs)
        return count

    handed = []
    monkeypatch.setattr(launcher, "launch_local", lambda n, worker, args, *rest, **kw: handed.append(args) or [None])
    count_task = counting("task", edgetrain.kinds.run_task)
    monkeypatch.setattr(edgetrain.kinds, "run_task", count_task)
    monkeypatch.setattr(edgetrain.config, "run_task", count_task)
    count_yaml = counting("yaml", edgetrain.yamlfile.read_yaml_mapping)
    monkeypatch.setattr(edgetrain.yamlfile, "read_yaml_mapping", count_yaml)
    monkeypatch.setattr(edgetrain.config, "read_yaml_mapping", count_yaml)
    local, parse = SYNC_KINDS["local"], SYNC_KINDS["local"].parse
    object.__setattr__(local, "parse", counting("sync", parse))  # a frozen descriptor: put back below
    try:
        config = tmp_path / "run.yaml"
        config.write_text("sync: local:2\ndataset: synthetic\nsynthetic_samples: 64\nimage_size: 8\n"
                          "batchnorm: local\n")
        train(str(config), steps=2, batch_size=8, devices=2, output=str(tmp_path / "runs"), **FAST)
    finally:
        object.__setattr__(local, "parse", parse)
    assert calls == {"sync": 1, "task": 1, "yaml": 1}
    (plan,) = handed[0]  # the devices are handed one RunPlan (train/run_plan.py)
    cfg, spec = plan.cfg, plan.spec
    assert (spec.sync.period, spec.task, spec.local_batch, spec.batchnorm) == (2, "classification", "even", "local")


def test_resolve_takes_the_launch_from_the_launcher_not_from_the_environment():
    cfg = load_config(None, strategy="tiled", grid="1x2", devices=2)
    cfg.devices = 1  # under torchrun, torchrun counts the devices, not the config
    with pytest.raises(EdgetrainError, match="needs 2 devices, one per tile"):
        resolve(cfg, LaunchSpec())
    assert resolve(cfg, LaunchSpec(torchrun=True)).tiling.devices == 2


FED = ["--model", "small_cnn", "--dataset", "synthetic", "--synthetic-samples", "256", "--image-size", "8",
       "--devices", "4", "--profile", "rpi4", "--link", "lte-10m", "--batch-size", "32", "--runtime-mb", "100"]


def test_fedavg_is_planned_as_rounds_of_local_steps(tmp_path):
    from edgetrain.plan.config import plan_inputs, predict_inputs

    config = tmp_path / "fed.yaml"
    config.write_text("sync: fedavg:1\npartition: dirichlet:0.5\ndevices: 4\n")
    # once a ZeroDivisionError traceback: fedavg was planned as async with a staleness of 0
    proc = run_main("plan", "--config", str(config), *FED, "--output", str(tmp_path), "--run-name", "fed")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exchange every 8 steps" in proc.stdout  # a round: one epoch of 256 // 32 local steps
    cfg = load_config(str(config), model="small_cnn", dataset="synthetic", synthetic_samples=256, image_size=8,
                      profile="rpi4", link="lte-10m", batch_size=32)
    inputs = plan_inputs(cfg)
    fed = predict_inputs(inputs, runtime_mb=100)
    local_spec = dataclasses.replace(inputs.spec, sync=parse_sync("local:8"))
    local = predict_inputs(dataclasses.replace(inputs, spec=local_spec), runtime_mb=100)
    assert (fed.traffic.mode, fed.traffic.period) == ("fedavg", 8)
    assert fed.traffic.collectives == local.traffic.collectives and fed.step_s == pytest.approx(local.step_s)
    c_max = max(d.compute_s for d in fed.devices)
    assert fed.step_s == pytest.approx(c_max + fed.exchange_s / 8)
    scaffold = predict_inputs(dataclasses.replace(inputs, spec=dataclasses.replace(
        inputs.spec, sync=parse_sync("fedavg:steps=8:scaffold"))), runtime_mb=100)
    assert scaffold.traffic.bytes_per_exchange == 2 * fed.traffic.bytes_per_exchange  # the controls' exchange


def test_sampled_federated_rounds_are_refused_by_the_planner_in_one_line(tmp_path):
    config = tmp_path / "fed.yaml"
    config.write_text("sync: fedavg:steps=4\npartition: iid\nparticipation: 0.5\n")
    proc = run_main("plan", "--config", str(config), *FED, "--output", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("edgetrain: error: edgetrain plan models federated rounds in which every device "
                                  "takes part, not participation 0.5;")


def test_a_strategy_without_a_planner_model_is_refused_never_planned_as_another(tmp_path):
    from edgetrain.plan.config import plan_inputs, predict_inputs
    from edgetrain.plan.strategies import compare

    proc = run_main("plan", *FED, "--strategy", "tiled", "--output", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr == f"edgetrain: error: {STRATEGY_KINDS['tiled'].unplanned}\n"
    assert not list(tmp_path.iterdir())
    cfg = load_config(None, model="small_cnn", dataset="synthetic", synthetic_samples=64, image_size=8, devices=2,
                      profile="rpi4", link="lte-10m", batch_size=8)
    inputs = plan_inputs(cfg)
    pred = predict_inputs(inputs, runtime_mb=100)
    with pytest.raises(EdgetrainError, match="unknown strategy 'hybrid'; use one of ddp, tiled, fsdp, pipeline"):
        compare(inputs, pred, ("hybrid",), 2, "gpipe")  # once planned as a pipeline
    rows = compare(inputs, pred, ("ddp", "tiled"), 2, "gpipe").strategies
    assert [(r.strategy, r.fits, r.refused) for r in rows][1] == ("tiled", False, STRATEGY_KINDS["tiled"].unplanned)
