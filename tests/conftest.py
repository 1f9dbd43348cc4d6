import os

import pytest

from edgetrain_testing import CIFAR, REPO

# Subprocesses (the CLI, torchrun) must import this checkout's edgetrain too.
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


@pytest.fixture
def cifar_dir():
    if not (CIFAR / "data_batch_1").is_file():
        pytest.skip(f"CIFAR-10 subset not found at {CIFAR}")
    return CIFAR


@pytest.fixture
def test_hosts(tmp_path):
    """``test_hosts(n, rate=None, ssh=True)``: n hosts as network namespaces with sshd (tests/hosts.py), removed
    after the test whatever its outcome; skips where namespaces cannot be made."""
    import hosts

    why = hosts.unavailable()
    if why:
        pytest.skip(why)
    made = []

    def make(n: int, rate: str | None = None, ssh: bool = True) -> hosts.Hosts:
        made.append(hosts.Hosts(n, tmp_path / f"hosts{len(made)}", rate=rate, ssh=ssh))
        return made[-1]

    try:
        yield make
    finally:
        for h in made:
            h.close()
