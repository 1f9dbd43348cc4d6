"""Federated rounds (--sync fedavg): the aggregation maths without processes, then whole runs against DDP."""
from pathlib import Path

import pytest
import torch
from torch import nn

from edgetrain import train
from edgetrain.comm.accounting import CommStats
from edgetrain.comm.compress.spec import build_compressor
from edgetrain.comm.emulation import LinkEmulator
from edgetrain.comm.federated import (ClientRounds, FederatedAveraging, control_weights, corrected_gradient,
                                      sample_participants, server_optimizer, server_step, update_weights)
from edgetrain.comm.mode import Averaging
from edgetrain.config import load_config, resolve
from edgetrain.errors import EdgetrainError
from edgetrain.spec import parse_compress, parse_server_opt, parse_sync
from edgetrain_testing import FAST


def test_participants_are_sampled_the_same_on_every_device_and_change_by_round():
    rounds = [sample_participants(10, 0.3, seed=1, round_index=r) for r in range(20)]
    assert all(len(p) == 3 and len(set(p)) == 3 and all(0 <= d < 10 for d in p) for p in rounds)
    assert rounds == [sample_participants(10, 0.3, seed=1, round_index=r) for r in range(20)]
    assert len({tuple(p) for p in rounds}) > 5
    assert sample_participants(10, 1.0, 0, 4) == list(range(10))
    assert sample_participants(10, 0.01, 0, 4) != []  # at least one device


def run_server(spec_text, updates, start):
    x = start.clone().requires_grad_(True)
    optimizer = server_optimizer(x, parse_server_opt(spec_text))
    for g in updates:
        server_step(x, g, optimizer)
    return x.detach()


def test_fedavg_server_step_is_the_mean_of_the_client_models():
    x0, clients = torch.randn(7), torch.randn(3, 7)
    assert torch.allclose(run_server("fedavg", [(x0 - clients).mean(0)], x0), clients.mean(0), atol=1e-6)


def test_fedavgm_and_fedadam_follow_their_formulas():
    x0, g1, g2 = torch.randn(5), torch.randn(5), torch.randn(5)
    lr, m = 0.5, 0.8
    x1 = x0 - lr * g1
    want = x1 - lr * (m * g1 + g2)  # v = m v + g; x = x - lr v (Hsu et al. 2019)
    assert torch.allclose(run_server(f"fedavgm:lr={lr}:momentum={m}", [g1, g2], x0), want, atol=1e-6)
    # one Adam step with bias correction: m_hat = g, v_hat = g^2
    eps = 0.001
    want = x0 - 0.1 * g1 / (g1.abs() + eps)
    assert torch.allclose(run_server(f"fedadam:lr=0.1:eps={eps}", [g1], x0), want, atol=1e-6)


def test_prox_and_scaffold_corrections():
    g, y, x, c, ci = (torch.randn(4) for _ in range(5))
    assert torch.equal(corrected_gradient(g, y, x, 0.0, None, None), g)  # FedProx with mu = 0 is FedAvg
    assert torch.allclose(corrected_gradient(g, y, x, 0.1, None, None), g + 0.1 * (y - x))
    assert torch.allclose(corrected_gradient(g, y, x, None, c, ci), g + c - ci)


def test_scaffold_control_is_the_mean_raw_gradient_of_the_round():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    emulator = LinkEmulator(None, 0, CommStats())
    compressor, memory = build_compressor(parse_compress("none"), None, 0, 0)
    fed = FederatedAveraging(model, 1, emulator, Averaging(0, None, compressor, memory), 2, parse_server_opt("fedavg"),
                             ClientRounds(scaffold=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 3)).square().sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()]))
        fed.after_backward(step)
        optimizer.step()
        fed.after_step(step)
    mean = torch.stack(grads).mean(0)
    assert torch.allclose(fed.own_control, mean) and torch.allclose(fed.control, mean)  # one device: c = c_1
    assert fed.summary()["rounds"] == 1


def test_weighted_updates_and_controls_follow_the_sample_counts():
    n, scales, u = [100, 300, 50, 550], [1.0, 1.0, 0.5, 2.0], torch.randn(4, 6)
    members = [0, 1, 3]  # device 2 sat the round out
    w = update_weights(n, scales, members)
    plain_mean = torch.stack([w[i] * u[i] for i in members]).mean(0)  # what the members' exchange computes
    want = sum(n[i] / scales[i] * u[i] for i in members) / sum(n[i] for i in members)  # McMahan's n_k / n
    assert torch.allclose(plain_mean, want, atol=1e-6)
    # equal counts and loss scales: the plain mean, as without :weighted
    assert update_weights([7, 7, 7], [1.0] * 3, [0, 2]) == {0: 1.0, 2: 1.0}
    v = control_weights(n, members)
    step = torch.stack([v[i] * u[i] for i in members]).mean(0) * len(members) / len(n)  # c += |S|/N mean_S
    assert torch.allclose(step, sum(n[i] / sum(n) * u[i] for i in members), atol=1e-6)
    assert parse_sync("fedavg:1:scaffold:weighted").weighted and not parse_sync("fedavg:1").weighted


@pytest.mark.parametrize("text, message", [
    ("fedavg", "needs the local work per round"), ("fedavg:0", "at least one local epoch"),
    ("fedavg:steps=x", "whole number"), ("fedavg:1:prox=-1", "prox=MU must be"), ("fedavg:1:fast", "unknown fedavg"),
])
def test_bad_fedavg_specs(text, message):
    with pytest.raises(EdgetrainError, match=message):
        parse_sync(text)


def test_federated_options_need_each_other():
    with pytest.raises(EdgetrainError, match="add --partition"):
        load_config(sync="fedavg:1")
    with pytest.raises(EdgetrainError, match="applies to federated rounds only"):
        load_config(participation=0.5)
    with pytest.raises(EdgetrainError, match="applies to federated rounds only"):
        load_config(server_opt="fedadam")
    with pytest.raises(EdgetrainError, match=r"in \(0, 1\]"):
        load_config(sync="fedavg:1", partition="iid", participation=0)
    with pytest.raises(EdgetrainError, match="unknown option 'beta1=0.5' for fedavgm"):
        parse_server_opt("fedavgm:beta1=0.5")
    with pytest.raises(EdgetrainError, match="works with --sync sync only"):
        load_config(sync="fedavg:1", partition="iid", compress="powersgd")
    spec = resolve(load_config(sync="fedavg:steps=5:prox=0.01:scaffold", partition="dirichlet:0.5",
                               participation=0.5, server_opt="fedadam:lr=0.03"))
    assert (spec.sync.period, spec.sync.prox_mu, spec.sync.scaffold) == (5, 0.01, True)
    assert spec.server_opt.name == "fedadam" and spec.server_opt.lr == 0.03 and spec.participation == 0.5


def parameters(summary):
    state = torch.load(Path(summary["run_dir"]) / "checkpoint.pt", weights_only=True)["model"]
    # BatchNorm running statistics differ by design (DDP broadcasts rank 0's; fedavg averages them at the end)
    return {k: v for k, v in state.items() if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5), k


@pytest.mark.slow
def test_fedavg_with_one_local_step_is_data_parallel_and_fedprox_mu_0_is_fedavg(tmp_path):
    cfg = dict(model="small_cnn", dataset="digits", devices=2, steps=4, batch_size=32, local_batch="8,24", lr=0.1,
               partition="iid", output=str(tmp_path), **FAST)
    ddp = parameters(train(cfg))
    fedavg = train(cfg, sync="fedavg:steps=1")
    assert fedavg["rounds"] == 4 and fedavg["sync"] == "fedavg:steps=1"
    assert_same(ddp, parameters(fedavg))
    # two local steps per round: not DDP any more, but the proximal term with mu = 0 changes nothing
    two = parameters(train(cfg, sync="fedavg:steps=2"))
    assert not torch.allclose(two["classifier.weight"], ddp["classifier.weight"], rtol=1e-4, atol=1e-5)
    assert_same(two, parameters(train(cfg, sync="fedavg:steps=2:prox=0")))
    # a fresh client optimizer each round of one step: SGD's first step has no momentum, so DDP without it
    reset = parameters(train(cfg, sync="fedavg:steps=1:reset"))
    assert_same(parameters(train(cfg, momentum=0.0)), reset)
    assert not torch.allclose(reset["classifier.weight"], ddp["classifier.weight"], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_weighted_fedavg_gathers_the_partition_sizes_and_changes_the_model(tmp_path):
    cfg = dict(model="small_cnn", dataset="digits", devices=2, steps=4, batch_size=32, lr=0.1,
               partition="dirichlet:0.3", output=str(tmp_path), **FAST)
    plain = train(cfg, sync="fedavg:steps=2")
    weighted = train(cfg, sync="fedavg:steps=2:weighted")
    assert weighted["weighted"] and not plain["weighted"] and weighted["rounds"] == 2
    sizes = weighted["partition"]["sizes"]
    assert sizes[0] != sizes[1]  # so the weights differ from the plain mean's
    a, b = parameters(plain), parameters(weighted)
    assert not torch.allclose(a["classifier.weight"], b["classifier.weight"], rtol=1e-4, atol=1e-5)
