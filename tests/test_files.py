"""Run directories stay under --output, files get ordinary modes, killed writes leave nothing behind."""
import os
import stat
import subprocess
import sys

import pytest

from edgetrain.cli import main
from edgetrain.errors import EdgetrainError
from edgetrain.files import atomic_write, new_run_dir, remove_stale_temps, write_json, write_yaml
from edgetrain_testing import run_cli


@pytest.mark.parametrize("name", ["../x", "../../x", "a/b", "..", ".", "/tmp/signals-security-abs"])
def test_run_name_that_is_a_path_is_refused(tmp_path, name):
    with pytest.raises(EdgetrainError, match="plain directory name"):
        new_run_dir(tmp_path / "out", name)
    assert not (tmp_path / "out").exists() and not (tmp_path / "x").exists()


@pytest.mark.parametrize("cli", [
    ["train", "--devices", "1", "--steps", "1", "--run-name", "../../escaped"],
    ["plan", "--devices", "2", "--link", "lan-1g", "--run-name", "../../escaped"],
    ["bench", "scaling", "--devices", "1", "--steps", "1", "--name", "../../escaped"],
])
def test_clis_refuse_a_run_name_outside_output(tmp_path, cli):
    out = tmp_path / "a" / "b" / "runs"
    r = run_cli(*cli, "--output", str(out), cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("edgetrain: error: run name '../../escaped'")
    assert not (tmp_path / "a" / "escaped").exists() and not out.exists()


def test_written_files_have_the_umask_mode_not_0600(tmp_path):
    # A fresh interpreter, so the umask set here does not leak into other tests.
    code = ("import os, sys; os.umask(0o022); from edgetrain.files import write_json, write_yaml; "
            "write_json(sys.argv[1] + '/summary.json', {}); write_yaml(sys.argv[1] + '/config.yaml', {})")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60)
    for name in ("summary.json", "config.yaml"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644


def test_failed_write_leaves_neither_file_nor_temporary(tmp_path):
    with pytest.raises(RuntimeError), atomic_write(tmp_path / "checkpoint.pt", "wb") as f:
        f.write(b"half")
        raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []


def test_stale_temporaries_of_dead_writers_are_removed_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True, timeout=60)
    stale = tmp_path / f".checkpoint.pt.{dead.stdout.strip()}.abc123.tmp"
    live = tmp_path / f".summary.json.{os.getpid()}.def456.tmp"
    stale.write_bytes(b"partial")
    live.write_bytes(b"being written")
    write_json(tmp_path / "other.json", {})
    assert remove_stale_temps(tmp_path) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "other.json"])


def test_run_without_summary_is_reported_as_incomplete(tmp_path, capsys):
    write_yaml(tmp_path / "config.yaml", {"model": "small_cnn"})
    (tmp_path / ".checkpoint.pt.999999999.abc.tmp").write_bytes(b"partial")  # no such pid
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is an incomplete run" in err and "removed 1 partial file" in err
    assert not (tmp_path / ".checkpoint.pt.999999999.abc.tmp").exists()
