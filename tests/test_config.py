import pytest

from edgetrain_testing import run_cli
from edgetrain.config import FIELDS, TrainConfig, load_config
from edgetrain.errors import EdgetrainError


def test_defaults_are_valid():
    cfg = load_config()
    assert cfg == TrainConfig()


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: resnet18\nbatch_size: 32\nlr: 0.1\naugment: false\n")
    cfg = load_config(path, batch_size="16")
    assert (cfg.model, cfg.batch_size, cfg.lr, cfg.augment) == ("resnet18", 16, 0.1, False)


@pytest.mark.parametrize("values, message", [
    ({"lr_rate": 0.1}, "unknown config key 'lr_rate' in config; did you mean 'lr'?"),
    ({"devices": 0}, "config key 'devices' in config must be >= 1"),
    ({"devices": "four"}, "config key 'devices' in config must be an integer"),
    ({"batch_size": 2.5}, "config key 'batch_size' in config must be an integer"),
    ({"lr": "fast"}, "config key 'lr' in config must be a number"),
    ({"schedule": "linear"}, "config key 'schedule' in config must be one of constant, cosine"),
    ({"augment": "maybe"}, "config key 'augment' in config must be true or false"),
    ({"local_batch": "8,8", "batch_size": 20}, "sums to 16, but batch_size is 20"),
    ({"grid": "2x2"}, "needs strategy tiled"),
])
def test_bad_values_name_the_key(values, message):
    with pytest.raises(EdgetrainError, match=None) as info:
        load_config(values)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(EdgetrainError, match="not valid YAML at line"):
        load_config(path)
    with pytest.raises(EdgetrainError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    path.write_text("- a\n- b\n")
    with pytest.raises(EdgetrainError, match="must be a mapping"):
        load_config(path)


def test_help_lists_every_option():
    out = run_cli("train", "--help").stdout
    for name in FIELDS:
        assert "--" + name.replace("_", "-") in out, name


def test_cli_rejects_bad_input_in_one_line(tmp_path):
    for args, needle in [(("--devices", "0"), "'devices'"), (("--modle", "x"), "unrecognized arguments"),
                         (("--dataset", "cifar10", "--data-dir", str(tmp_path / "nope")), "does not exist")]:
        proc = run_cli("train", *args, "--output", str(tmp_path), timeout=60)
        assert proc.returncode != 0
        assert needle in proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_pipeline_too_deep_for_the_model_is_refused_before_launch_unless_torchrun_counts_the_devices(tmp_path):
    """Under torchrun the devices count themselves, so the stage check waits for them (their own preflight)."""
    from edgetrain.config import TrainConfig, resolve
    from edgetrain.errors import EdgetrainError
    from edgetrain.train.preflight import check_before_launch
    from edgetrain.spec import LaunchSpec

    cfg = TrainConfig(strategy="pipeline", devices=64, model="small_cnn", dataset="digits", output=str(tmp_path))
    with pytest.raises(EdgetrainError, match="too few for 64 pipeline stages"):
        check_before_launch(cfg, resolve(cfg, LaunchSpec(torchrun=False)))
    check_before_launch(cfg, resolve(cfg, LaunchSpec(torchrun=True)))
