"""Nodes of a real cluster: rank environment, cluster token, config agreement, no pickles on the wire."""
import os
import re
import subprocess
import sys
import time

import pytest

from edgetrain.cluster.launch import free_port
from edgetrain.cluster.peers import check_rank_environment, cluster_token
from edgetrain.errors import EdgetrainError
from edgetrain_testing import REPO

NODE_ARGS = ["train", "--steps", "2", "--batch-size", "8", "--no-progress", "--no-eval", "--no-throttle"]


def start_nodes(tmp_path, per_rank: list[list[str]], world: int, timeout_s: float = 20, env_extra=None,
                only_rank: int | None = None):
    """Start ``edgetrain train`` as ranks 0..len(per_rank)-1 of ``world`` (the documented env-var recipe),
    or only ``only_rank`` of them; return (exit code, stderr) of each."""
    port = str(free_port())
    procs = []
    for rank, extra in enumerate(per_rank):
        if only_rank is not None and rank != only_rank:
            continue
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, **(env_extra or {}))
        procs.append(subprocess.Popen([sys.executable, "-m", "edgetrain", *NODE_ARGS, "--timeout", str(timeout_s),
                                       "--output", str(tmp_path / f"node{rank}"), *extra],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout_s + 60)
        finally:
            p.kill()
        results.append((p.returncode, err))
    return results


@pytest.mark.parametrize("env, complaint", [
    (dict(RANK="2", WORLD_SIZE="2"), "RANK='2' must be 0..1"),
    (dict(RANK="-1", WORLD_SIZE="2"), "RANK='-1' must be 0..1"),
    (dict(RANK="0", WORLD_SIZE="two"), "WORLD_SIZE='two' is not an integer"),
    (dict(RANK="0", WORLD_SIZE="0"), "WORLD_SIZE='0' must be >= 1"),
    (dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="-3"), "LOCAL_RANK=-3 must be >= 0"),
])
def test_bad_rank_environment_is_one_line(monkeypatch, env, complaint):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(EdgetrainError) as e:
        check_rank_environment()
    assert complaint in str(e.value)


def test_rank_out_of_range_fails_at_once_from_the_cli(tmp_path):
    env = dict(os.environ, RANK="5", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    r = subprocess.run([sys.executable, "-m", "edgetrain", *NODE_ARGS, "--timeout", "60",
                        "--output", str(tmp_path / "bad")], env=env, capture_output=True, text=True, timeout=50)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "RANK='5' must be 0..1" in r.stderr
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_node_whose_master_never_arrives_ends_within_timeout_with_one_line(tmp_path):
    started = time.monotonic()
    results = start_nodes(tmp_path, [[], []], world=2, timeout_s=5, only_rank=1)
    [(code, err)] = results
    assert code == 2 and err.count("\n") == 1, err
    assert "rendezvous at 127.0.0.1" in err and "within 5 s" in err
    assert time.monotonic() - started < 5 + 30  # the timeout plus interpreter and torch start-up


def test_torchrun_recipe_with_rdzv_timeout_ends_within_it(tmp_path):
    """torchrun's agent meets its peers before edgetrain starts: ``--rdzv-conf timeout=`` bounds that wait
    (its own output, not edgetrain's one line: docs/how-to/launch.md says so)."""
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                        "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                        "--rdzv-conf", "timeout=5", "-m", "edgetrain", *NODE_ARGS, "--timeout", "5",
                        "--output", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "1/2 clients joined" in r.stderr
    assert time.monotonic() - started < 5 + 30


def test_different_cluster_tokens_fail_on_every_node_with_one_line(tmp_path):
    results = start_nodes(tmp_path, [["--cluster-token", "s3cret-a"], ["--cluster-token", "s3cret-b"]], world=2)
    for code, err in results:
        assert code == 2 and err.count("\n") == 1, err
        assert "cluster token that does not match" in err and "s3cret" not in err
    assert not list((tmp_path / "node0").iterdir())  # refused before training: no run directory left


def test_a_node_without_a_token_is_told_so(tmp_path, monkeypatch):
    monkeypatch.delenv("EDGETRAIN_CLUSTER_TOKEN", raising=False)
    (code0, err0), (code1, err1) = start_nodes(tmp_path, [["--cluster-token", "s3cret"], []], world=2)
    assert code0 == code1 == 2, (err0, err1)
    assert "device(s) 1 have no cluster token" in err0 and err0.count("\n") == 1, err0
    assert "this device (rank 1) has no cluster token" in err1 and err1.count("\n") == 1, err1


def test_token_from_environment_matches_flag_and_is_not_written(tmp_path):
    results = start_nodes(tmp_path, [["--cluster-token", "s3cret"], []], world=2,
                          env_extra={"EDGETRAIN_CLUSTER_TOKEN": "s3cret"})
    assert [code for code, _ in results] == [0, 0], results
    run_dir = next((tmp_path / "node0").iterdir())
    assert "devices: 2" in (run_dir / "config.yaml").read_text()  # WORLD_SIZE, not --devices' default
    for name in ("config.yaml", "summary.json"):
        assert "s3cret" not in (run_dir / name).read_text()


def test_different_configs_name_the_first_differing_key(tmp_path):
    results = start_nodes(tmp_path, [["--lr", "0.05"], ["--lr", "0.1"]], world=2)
    for code, err in results:
        assert code == 2 and err.count("\n") == 1, err
        assert "config differs" in err and "at key 'lr'" in err


def test_no_pickle_based_collective_in_the_package():
    pickled = re.compile(r"\b(all_gather|gather|broadcast|scatter|send|recv)_object(_list)?\(")
    offenders = [f"{path.relative_to(REPO)}:{n}" for path in (REPO / "src" / "edgetrain").rglob("*.py")
                 for n, line in enumerate(path.read_text().splitlines(), 1) if pickled.search(line)]
    assert offenders == []


def test_token_from_a_file_matches_the_environment_and_stays_out_of_ps(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    results = start_nodes(tmp_path, [["--cluster-token-file", str(token_file)], []], world=2,
                          env_extra={"EDGETRAIN_CLUSTER_TOKEN": "s3cret"})
    assert [code for code, _ in results] == [0, 0], results
    run_dir = next((tmp_path / "node0").iterdir())
    for name in ("config.yaml", "summary.json"):
        assert "s3cret" not in (run_dir / name).read_text()


def test_cluster_token_sources_and_their_refusals(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-file\nignored\n")
    env = {"EDGETRAIN_CLUSTER_TOKEN": "from-env"}
    assert cluster_token(None, str(token_file), env) == "from-file"
    assert cluster_token("from-flag", None, env) == "from-flag"
    assert cluster_token(None, None, env) == "from-env" and cluster_token(None, None, {}) == ""
    with pytest.raises(EdgetrainError, match="not both"):
        cluster_token("a", str(token_file), {})
    with pytest.raises(EdgetrainError, match=r"cannot read --cluster-token-file .*missing"):
        cluster_token(None, str(tmp_path / "missing"), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(EdgetrainError, match="is empty; write the token on its first line"):
        cluster_token(None, str(tmp_path / "empty"), {})


def test_the_token_flag_says_it_is_visible_to_other_users():
    from edgetrain.config import FIELDS

    assert "VISIBLE TO OTHER USERS" in FIELDS["cluster_token"].metadata["help"]
    assert "--cluster-token-file" in FIELDS["cluster_token"].metadata["help"]
