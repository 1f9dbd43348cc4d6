"""benchmarks/install_check_arm64.sh: where it cannot run, it says why in one line and exits 2."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "install_check_arm64.sh"


def _run(path_dir: Path, tmp_path: Path, prefix=()):
    return subprocess.run([*prefix, "/bin/bash", str(SCRIPT), str(tmp_path / "root")], capture_output=True,
                          text=True, timeout=30, env={"PATH": str(path_dir), "HOME": str(tmp_path)})


@pytest.mark.skipif(os.geteuid() != 0, reason="the missing-tool check comes after the root check")
def test_missing_debootstrap_is_one_line(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(shutil.which("id"), bin_dir / "id")  # a PATH with id only: no debootstrap, no qemu
    r = _run(bin_dir, tmp_path)
    lines = (r.stdout + r.stderr).splitlines()
    assert r.returncode == 2 and lines == [lines[0]], r.stdout + r.stderr
    assert lines[0].startswith("install_check_arm64: debootstrap not found; apt-get install -y debootstrap")
    assert not (tmp_path / "root").exists()  # nothing made before refusing


def test_not_root_is_one_line(tmp_path):
    # as root: drop to nobody for the run (setpriv, util-linux)
    prefix = () if os.geteuid() != 0 else (shutil.which("setpriv") or pytest.skip("no setpriv to drop root"),
                                           "--reuid=65534", "--regid=65534", "--clear-groups")
    r = _run(Path(shutil.which("id")).parent, tmp_path, prefix)
    assert r.returncode == 2 and (r.stdout + r.stderr).strip() == \
        "install_check_arm64: needs root (debootstrap, chroot and mounts); run it with sudo"
