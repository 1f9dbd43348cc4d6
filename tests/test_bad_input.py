"""Bad input on every command: one line ``edgetrain: error: <problem>; <fix>``, exit 2, nothing left behind.

Most cases call ``edgetrain.cli.main`` in this process (they fail before any
torch work or device); a few run the real CLI in a subprocess end to end.
"""
import json
import os
import pickle
import sys

import numpy as np
import pytest

from edgetrain.cli import main
from edgetrain.spec import parse_compress, parse_sync
from edgetrain_testing import run_cli

# Training flags that keep a run short if a check ever let one through.
QUICK_TRAIN = ["--dataset", "digits", "--steps", "1", "--no-eval", "--no-progress", "--no-throttle", "--timeout", "30"]


@pytest.fixture
def paths(tmp_path):
    """Placeholders for the table: files and run directories of every kind of bad input."""
    p = {"tmp": tmp_path, "out": tmp_path / "out", "file": tmp_path / "a-file"}
    p["file"].write_text("not a directory\n")
    p["binary"] = tmp_path / "binary.yaml"
    p["binary"].write_bytes(b"\x80\x81\xfe binary \x00")
    p["badyaml"] = tmp_path / "bad.yaml"
    p["badyaml"].write_text("model: [unclosed\n")
    p["hybrid"] = tmp_path / "hybrid.yaml"
    p["hybrid"].write_text("strategy: pipeline\ndevices: 4\npipeline_replicas: 2\n")
    p["partial"] = tmp_path / "cifar-partial"
    p["partial"].mkdir()
    (p["partial"] / "data_batch_1").write_bytes(b"")
    for name, filename, content in [("empty", "summary.json", {}), ("listrun", "summary.json", [1, 2]),
                                    ("wrongtype", "summary.json", {"per_device": "x", "throughput_samples_per_s": 1}),
                                    ("unknownbench", "result.json", {"bench": "nosuch", "rows": []}),
                                    ("badrows", "result.json", {"bench": "peak", "rows": [1]}),
                                    ("goodrun", "summary.json", {"per_device": [], "throughput_samples_per_s": 1.0})]:
        (tmp_path / name).mkdir()
        (tmp_path / name / filename).write_text(json.dumps(content))
        p[name] = tmp_path / name
    return p


def _argv(argv: list[str], paths: dict) -> list[str]:
    return [a.format(**paths) for a in argv]


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    """``edgetrain ARGV`` in this process: (exit status, stderr)."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse exits from inside parse_args
        code = e.code
    return code, capsys.readouterr().err


def assert_one_line_error(code: int, err: str, expected: str) -> None:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("edgetrain: error: "), err
    assert "; " in lines[0], f"no fix after the problem: {err}"
    assert expected in lines[0], err
    assert code == 2, err


TRAIN = [
    (["--lr", "nan"], "config key 'lr' in command line must be a finite number"),
    (["--timeout", "inf"], "config key 'timeout' in command line must be a finite number"),
    (["--momentum=-inf"], "config key 'momentum' in command line must be a finite number"),
    (["--output", "{file}"], "exists and is not one"),
    (["--output", "{file}/runs"], "exists and is not one"),
    (["--output", "/proc/edgetrain-test"], "kernel pseudo-filesystem"),
    (["--config", "{binary}"], "is not a text file"),
    (["--config", "{tmp}"], "is a directory"),
    (["--config", "{badyaml}"], "is not valid YAML at line"),
    (["--link", "-5mbit:5ms"], "argument --link: expected one argument; give it a value; one that starts with '-' is "
                               "written --link=VALUE"),
    (["--link=-5mbit:5ms"], "bad bandwidth '-5mbit'"),
    (["--modle", "x"], "unrecognized arguments: --modle x; did you mean '--model'?"),
    (["--batch-size", "many"], "config key 'batch_size' in command line must be an integer"),
    (["--model", "resnet19"], "unknown model 'resnet19'; did you mean 'resnet18'?"),
    (["--dataset", "cifar10"], "config key 'data_dir' is required with dataset cifar10"),
    (["--dataset", "imagenet"], "unknown dataset 'imagenet'; known datasets: digits, cifar10, synthetic, imagefolder, "
                                "npz (register your own with edgetrain.register_dataset)"),
    (["--dataset", "npz"], "config key 'data_dir' is required with dataset npz"),
    (["--sync", "fedavg:1"], "--sync fedavg:1 trains each device on its own data, which needs a partition; add --partition"),
    (["--partition", "dirichlet:0"], "dirichlet alpha must be a finite number > 0"),
    (["--strategy", "pipeline", "--partition", "iid"], "config key 'partition' iid does not apply to strategy pipeline"),
    (["--strategy", "pipeline", "--devices", "3", "--pipeline-replicas", "2"],
     "config key 'devices' 3 is not a multiple of pipeline_replicas 2"),
    (["--strategy", "pipeline", "--compress", "topk:0.01"], "(a single pipeline: nothing to all-reduce); add "
                                                             "--pipeline-replicas D"),
    (["--dataset", "cifar10", "--data-dir", "{tmp}/nope"], "does not exist"),
    (["--dataset", "cifar10", "--data-dir", "{partial}"], "data_batch_2, data_batch_3, data_batch_4, data_batch_5, "
                                                          "test_batch are missing"),
    (["--strategy", "tiled", "--grid", "8x8", "--devices", "64"], "grid 8x8 is larger than the feature map"),
    (["--dataset", "shards", "--data-dir", "{tmp}", "--dedup", "on"],
     "hashes the training images held in memory, which a dataset on storage (shards) does not hold"),
    (["--dataset", "imagefolder", "--data-dir", "{tmp}", "--from-storage", "--dedup", "on"],
     "a dataset on storage (--from-storage) does not hold; drop --dedup"),
    (["--task", "regression", "--dedup", "on"], "task regression's samples are feature vectors or series"),
]


@pytest.mark.parametrize("argv, expected", TRAIN)
def test_train_bad_input_is_one_line_before_any_device(argv, expected, paths, capsys):
    # QUICK_TRAIN first: the case's own --dataset wins.
    code, err = run_main(["train", *QUICK_TRAIN, "--output", str(paths["out"]), *_argv(argv, paths)], capsys)
    assert_one_line_error(code, err, expected)
    assert not paths["out"].exists(), "a run directory was made for bad input"


@pytest.mark.parametrize("strategy, older", [("fsdp", "no FSDP2"), ("pipeline", "no no_dist in DCP's save")])
def test_a_strategy_this_torch_lacks_is_one_line_before_any_device(strategy, older, paths, capsys, monkeypatch):
    # A torch as old as 2.4 (the lowest of the range, a Jetson's): simulated here, run for real on 2.4.1
    # (docs/how-to/install-on-devices.md). Refused by the launcher, not by each device after the run directory.
    if strategy == "fsdp":
        monkeypatch.setitem(sys.modules, "edgetrain.train.fsdp", None)  # its import fails as on torch 2.4
    else:
        import torch.distributed.checkpoint as dcp

        monkeypatch.setattr(dcp, "save", lambda state_dict, *, checkpoint_id=None: None)
    code, err = run_main(["train", *QUICK_TRAIN, "--devices", "2", "--strategy", strategy,
                          "--output", str(paths["out"])], capsys)
    assert_one_line_error(code, err, "use --strategy ddp, or install a newer torch (2.13 is tested)")
    assert "device 0" not in err and not paths["out"].exists(), err


OTHERS = [
    ([], "the following arguments are required: COMMAND"),
    (["bench", "nosuch"], "invalid choice: 'nosuch'"),
    (["bench", "peak", "--devices", "0"], "argument --devices: must be >= 1, got 0"),
    (["bench", "peak", "--min-time", "-1"], "argument --min-time: must be >= 0"),
    (["bench", "peak", "--min-time", "nan"], "argument --min-time: must be a finite number"),
    (["bench", "peak", "--devcies", "2"], "did you mean '--devices'?"),
    (["bench", "peak", "--output", "{file}"], "exists and is not one"),
    (["bench", "variability", "--output", "/proc/edgetrain-test"], "kernel pseudo-filesystem"),
    (["bench", "counters", "--batch-size", "0"], "argument --batch-size: must be >= 1"),
    (["bench", "batch", "--threads", "0"], "argument --threads: must be >= 1"),
    (["bench", "batch", "--memory-limit-mb", "inf"], "argument --memory-limit-mb: must be a finite number"),
    (["bench", "batch", "--dataset", "imagenet"], "invalid choice: 'imagenet'"),
    (["bench", "batch", "--model", "nosuch"], "unknown model 'nosuch'"),
    (["bench", "stalls", "--data-dir", "{tmp}/nope"], "does not exist"),
    (["bench", "scaling", "--config", "{badyaml}"], "is not valid YAML at line"),
    (["bench", "scaling", "--config", "{binary}"], "is not a text file"),
    (["bench", "scaling", "--model", "nosuch"], "unknown model 'nosuch'"),
    (["plan", "--runtime-mb", "-5"], "argument --runtime-mb: must be >= 0"),
    (["plan", "--compute-cv", "nan"], "argument --compute-cv: must be a finite number"),
    (["plan", "--overlap", "2"], "argument --overlap: must be between 0 and 1"),
    (["plan", "--stragglers", "0.1:nan"], "the slowdown >= 1 (finite)"),
    (["plan", "--output", "{file}"], "exists and is not one"),
    (["plan", "--lr", "0.1"], "unrecognized arguments: --lr 0.1"),
    (["plan", "--config", "{hybrid}", "--strategy", "pipeline"], "edgetrain plan does not model pipeline replicas yet"),
    (["report"], "the following arguments are required: RUN_DIR"),
    (["report", "{empty}"], "summary.json lacks key 'per_device'"),
    (["report", "{listrun}"], "summary.json must hold a JSON object, not a list"),
    (["report", "{wrongtype}"], "summary.json: key 'per_device' must be a list of objects, not a string"),
    (["report", "{unknownbench}"], "result.json: key 'bench' must name a bench"),
    (["report", "{badrows}"], "result.json: key 'rows' must be a list of objects"),
    (["report", "{goodrun}", "-o", "/proc/edgetrain-test.html"], "kernel pseudo-filesystem"),
    (["report", "{goodrun}", "-o", "{file}/report.html"], "exists and is not one"),
    (["report", "{goodrun}", "-o", "{tmp}"], "is a directory"),
]


@pytest.mark.parametrize("argv, expected", OTHERS)
def test_bench_plan_report_bad_input_is_one_line(argv, expected, paths, capsys):
    before = sorted(paths["tmp"].rglob("*"))
    output = ["--output", str(paths["out"])] if argv[:1] in (["bench"], ["plan"]) and "--output" not in argv else []
    code, err = run_main(_argv(argv, paths) + output, capsys)
    assert_one_line_error(code, err, expected)
    assert sorted(paths["tmp"].rglob("*")) == before, "bad input created files"


def test_every_float_config_key_rejects_nan_and_inf():
    from edgetrain.config import FIELDS, _base_type, load_config
    from edgetrain.errors import EdgetrainError

    float_keys = [k for k in FIELDS if _base_type(k)[0] is float]
    assert float_keys
    for key in float_keys:
        for bad in (float("nan"), float("inf"), "-inf", "NaN"):
            with pytest.raises(EdgetrainError, match=f"config key '{key}' in config must be a finite number"):
                load_config({key: bad})


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to any directory")
def test_unwritable_output_is_refused(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    code, err = run_main(["train", *QUICK_TRAIN, "--output", str(locked / "runs")], capsys)
    assert_one_line_error(code, err, "is not writable")
    code, err = run_main(["report", str(tmp_path), "-o", str(locked / "r.html")], capsys)
    assert_one_line_error(code, err, "is not writable")


def test_help_is_still_the_full_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "peak", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    assert out.startswith("usage: edgetrain bench peak") and "--min-time" in out and "--output" in out


def test_protocol_5_cifar_batch_loads(tmp_path):
    from edgetrain.data.cifar import read_batch

    data = np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072)
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": data, b"labels": [3, 7]}, protocol=5))
    images, labels = read_batch(path)
    assert images.shape == (2, 3, 32, 32) and labels.tolist() == [3, 7]
    assert np.array_equal(images.reshape(2, 3072), data)


def test_plan_cifar10_needs_no_data_dir(tmp_path, capsys):
    code = main(["plan", "--dataset", "cifar10", "--model", "small_cnn", "--runtime-mb", "300", "--sim-steps", "5",
                 "--output", str(tmp_path), "--run-name", "p"])
    assert code == 0, capsys.readouterr().err
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    # 60,000 images of 3x32x32 uint8 and an int64 label each, as data.cifar loads them
    assert plan["prediction"]["model"]["dataset_bytes"] == 60_000 * (3 * 32 * 32 + 8)


@pytest.mark.parametrize("argv, expected", [
    (["train", "--lr", "nan"], "must be a finite number"),
    (["train", "--link", "-5mbit:5ms"], "expected one argument"),
    (["bench", "counters", "--batch-size", "0"], "must be >= 1"),
    (["report", "{empty}"], "lacks key 'per_device'"),
])
def test_cli_end_to_end_one_line(argv, expected, paths):
    proc = run_cli(*_argv(argv, paths), "--output" if argv[0] != "report" else "-o", str(paths["out"]), timeout=60)
    assert_one_line_error(proc.returncode, proc.stderr, expected)
    assert not paths["out"].exists()


# Every out-of-range --sync or --compress value: one line naming the option and a value it accepts.
RANGES = [("--sync", "diloco:8:momentum=1.5"), ("--sync", "local:8:nesterov:lr=0"), ("--sync", "streaming:8:lr=-1"),
          ("--sync", "streaming:8:fragments=9"), ("--sync", "streaming:8:overlap=8"), ("--sync", "streaming:8:mix=2"),
          ("--sync", "gossip:0"), ("--sync", "async:0"), ("--sync", "fedavg:1:prox=-1"), ("--sync", "local:0"),
          ("--compress", "topk:2"), ("--compress", "randk:0"), ("--compress", "topk:0.1:dgc:momentum=1"),
          ("--compress", "topk:0.1:bits=9"), ("--compress", "topk:0.1:warmup=-1"), ("--compress", "qsgd:0"),
          ("--compress", "quant:1"), ("--compress", "powersgd:0"), ("--compress", "powersgd:2:start=-1"),
          ("--compress", "threshold:-1")]


@pytest.mark.parametrize("option, value", RANGES)
def test_an_out_of_range_sync_or_compress_value_names_the_option_and_a_valid_one(option, value, paths, capsys):
    code, err = run_main(["train", *QUICK_TRAIN, "--output", str(paths["out"]), option, value], capsys)
    assert_one_line_error(code, err, f"{option} '{value}'")
    example = err.split("e.g. ", 1)[1].split(" (")[0].strip().split()
    assert example[0] == option, err
    parse = {"--sync": parse_sync, "--compress": parse_compress}[option]
    parse(example[1])  # the value it suggests parses
