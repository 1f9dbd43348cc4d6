"""The fleet's privacy options on Flower's own parts (fleet/privacy.py): DP-FedAvg with Flower's client-side
fixed clipping wrapper (clipping and noise of the declared scale, epsilon in the records) and SecAgg+ (its
aggregate equals the plain one within its quantisation step), on the in-process Grid of test_fleet_app and,
marked slow, on Flower's simulation engine."""
import copy
import json
import shutil
import tempfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="the fleet extra is not installed (pip install edgetrain[fleet])")

from flwr.app import Context, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from edgetrain.comm.params import flatten  # noqa: E402
from edgetrain.errors import EdgetrainError  # noqa: E402
from edgetrain.fleet import app as fleet  # noqa: E402
from edgetrain.fleet import privacy  # noqa: E402
from tests.fleet.test_fleet_app import InProcessGrid, final_parameters, task_identity  # noqa: E402,F401

RUN = {"model": "small_cnn_gn", "num-rounds": 1, "local-steps": 3, "batch-size": 16, "lr": 0.1,
       "server-opt": "fedavg", "min-nodes": 4, "round-timeout": 30.0, "fraction-evaluate": 0.0}


class SerialisingGrid(InProcessGrid):
    """Each message gets its own content, as one serialised to a node would (SecAgg+'s workflow sends one
    record to many nodes and its mod consumes keys of it)."""

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for msg in messages:
            msg.content = copy.deepcopy(msg.content)
        return super().send_and_receive(messages, timeout=timeout)


def local_updates(run: dict, nodes: list[int], total: int) -> list[torch.Tensor]:
    """Each device's round-1 update ``x - y_i``, computed by hand with the fleet's own local step."""
    spec = fleet.fleet_spec(run)
    data = fleet.load_data(spec)
    updates = []
    for node in nodes:
        model = fleet.global_model(spec, data)
        part_id, part = fleet.client_partition(spec, data, {"partition-id": node, "num-partitions": total})
        updates.append(fleet.local_update(spec, model, data, part, 1, part_id).update)
    return updates


def run_grid(run: dict, nodes: int) -> tuple[InProcessGrid, list[int]]:
    grid = InProcessGrid([fleet.client_app] * nodes, run)
    sent, deliver = [], grid.send_and_receive
    grid.send_and_receive = lambda messages, **kw: (sent.extend(m.metadata.dst_node_id for m in messages),
                                                    deliver(messages, **kw))[1]
    return grid, sent


def test_dp_clips_each_update_adds_noise_of_the_declared_scale_and_records_epsilon(tmp_path):
    # 4 devices, half sampled: sampling rate 1/2; clip 0.05 (far below the updates' norms: clipping shows);
    # noise z = 0.01: std z C / n = 2.5e-4 on each parameter of the mean
    run = {**RUN, "fraction-train": 0.5, "dp-noise": 0.01, "dp-clip": 0.05, "output-dir": str(tmp_path)}
    grid, sent = run_grid(run, 4)
    final = final_parameters(fleet.run_server(grid, run))
    spec = fleet.fleet_spec(run)
    start = flatten([p.detach() for p in fleet.global_model(spec, fleet.load_data(spec)).parameters()])
    updates = local_updates(run, sorted(sent), 4)
    assert len(sent) == 2 and min(u.norm() for u in updates) > 0.2  # the updates are far above the clip
    clipped = torch.stack([u * min(1.0, 0.05 / float(u.norm())) for u in updates]).mean(0)
    noise = final - (start - clipped)
    assert abs(float(noise.std()) - 0.01 * 0.05 / 2) < 0.1 * 2.5e-4 and abs(float(noise.mean())) < 1e-5
    unclipped = final - (start - torch.stack(updates).mean(0))  # not what the server released
    assert float(unclipped.std()) > 2 * float(noise.std())
    record = json.loads((tmp_path / fleet.ROUNDS_FILE).read_text())
    from opacus.accountants import RDPAccountant
    accountant = RDPAccountant()
    accountant.step(noise_multiplier=0.01, sample_rate=0.5)
    assert record["round"] == 1 and record["dp_sampled"] == 2 and record["dp_nodes"] == 4
    assert record["dp_noise_std"] == pytest.approx(2.5e-4)
    assert record["dp_epsilon"] == pytest.approx(accountant.get_epsilon(1e-5))


def test_secagg_plus_gives_the_plain_mean_within_its_quantisation_and_survives_a_lost_device():
    # device 3 takes part in the key exchange, then its training fails: SecAgg+ rebuilds its masks from the
    # others' shares (3 of them >= threshold 2) and the aggregate is the other three's plain mean (their updates
    # by hand) within two of SecAgg+'s quantisation steps (the all-devices case against a plain run: the slow
    # simulation test below)
    run = {**RUN, "fraction-train": 1.0, "secure-aggregation": True, "secagg-clip-range": 1.0}
    lost = ClientApp(mods=[privacy.privacy_mod(lambda context: fleet.fleet_spec(context.run_config))])
    lost.train()(lambda msg, context: (_ for _ in ()).throw(RuntimeError("device lost its uplink")))
    grid = SerialisingGrid([fleet.client_app] * 3 + [lost], run)
    grid.set_run(SimpleNamespace(run_id=1))
    strategy = fleet.secure_strategy(fleet.fleet_spec(run))
    privacy.run_secure_server(grid, Context(run_id=1, node_id=0, state=RecordDict(), run_config=run,
                                            node_config={}), strategy)
    spec = fleet.fleet_spec(run)
    start = flatten([p.detach() for p in fleet.global_model(spec, fleet.load_data(spec)).parameters()])
    expected = start - torch.stack(local_updates(run, [0, 1, 2], 4)).mean(0)
    secure = flatten([p.detach() for p in strategy.params])
    assert float((secure - expected).abs().max()) <= 2 * 2 * 1.0 / 4194304
    assert strategy.records[0]["secagg_aggregated"] == 3 and strategy.records[0]["secagg_failures"] >= 1


@pytest.mark.parametrize("run_config, message", [
    ({"dp-noise": -1.0}, "dp-noise must be >= 0"),
    ({"dp-noise": 1.0, "model": "small_cnn"}, "has BatchNorm statistics"),
    ({"dp-noise": 1.0, "model": "small_cnn_gn", "compress": "int8"}, "needs the dense model update"),
    ({"dp-noise": 1.0, "model": "small_cnn_gn", "server-opt": "fedadam"}, "set server-opt='fedavg'"),
    ({"dp-noise": 1.0, "secure-aggregation": True}, "together are not supported"),
    ({"secure-aggregation": True, "secagg-threshold": 3}, "below secagg-shares"),
    ({"secure-aggregation": True, "model": "small_cnn_gn"}, "fraction-evaluate=0"),
])
def test_bad_privacy_run_config_is_one_clear_error(run_config, message):
    with pytest.raises(EdgetrainError, match=message):
        fleet.fleet_spec(run_config)


@pytest.mark.slow  # one run of Ray with 4 virtual devices, one round
def test_secagg_plus_on_the_simulation_engine_equals_the_plain_aggregate(tmp_path):
    pytest.importorskip("ray", reason="the simulation runtime is not installed (pip install edgetrain[fleet])")
    from edgetrain.fleet.simulation import SimulationResources, simulate
    ray_dir = tempfile.mkdtemp(prefix="et-ray-")  # short: Ray's socket paths must fit 107 bytes
    try:
        run = {**RUN, "fraction-train": 1.0, "secure-aggregation": True, "secagg-clip-range": 1.0,
               "output-dir": str(tmp_path)}
        simulate(run, 4, SimulationResources(cpus_per_device=1.0, num_cpus=2, object_store_mb=100,
                                             temp_dir=ray_dir))
        # the plain aggregate: the four devices' updates by hand, with the fleet's own local step
        spec = fleet.fleet_spec(run)
        model = fleet.global_model(spec, fleet.load_data(spec))
        start = flatten([p.detach() for p in model.parameters()])
        state = torch.load(tmp_path / fleet.MODEL_FILE)
        secure = flatten([state[name] for name, _ in model.named_parameters()])
        plain = start - torch.stack(local_updates(run, [0, 1, 2, 3], 4)).mean(0)
        assert float((secure - plain).abs().max()) <= 2 * 2 * 1.0 / 4194304
        record = json.loads((tmp_path / fleet.ROUNDS_FILE).read_text())
        assert record["secagg_aggregated"] == 4 and record["secagg_failures"] == 0
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
