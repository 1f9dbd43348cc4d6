"""The Flower app (edgetrain.fleet): Flower's own Strategy.start, ClientApp dispatch and records, on an
in-process Grid that hands each message to the ClientApp as a SuperNode's runtime does (an exception
becomes an error reply, each node keeps its context.state for the run); the global model must be what a
hand computation with edgetrain's pure functions (corrected_gradient, server_step) gives."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="the fleet extra is not installed (pip install edgetrain[fleet])")

from flwr.app import ConfigRecord, Context, Error, Message, MessageType, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from edgetrain.comm.federated import corrected_gradient, server_optimizer, server_step  # noqa: E402
from edgetrain.comm.params import flatten, unflatten  # noqa: E402
from edgetrain.errors import EdgetrainError  # noqa: E402
from edgetrain.fleet import app as fleet  # noqa: E402
from edgetrain.train.loop import evaluate  # noqa: E402

RUN = {"num-rounds": 2, "local-steps": 5, "batch-size": 16, "lr": 0.1, "partition": "iid",
       "server-opt": "fedavgm:lr=1:momentum=0.9", "min-nodes": 2, "round-timeout": 30.0}


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    """Flower's processes set who they are (Message() reads it): the run and, in turn, the server or a node."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", SUPERLINK_NODE_ID)


class InProcessGrid(Grid):
    """Node ``i`` runs ``apps[i]`` with ``--node-config partition-id=i num-partitions=len(apps)``, in one
    context per node for the whole run (as a SuperNode keeps it): its state carries over between rounds."""

    def __init__(self, apps: list[ClientApp], run_config: dict):
        self.apps, self.run_config, self.rounds = apps, run_config, 0
        self.contexts = [Context(run_id=1, node_id=node, state=RecordDict(), run_config=run_config,
                                 node_config={"partition-id": node, "num-partitions": len(apps)})
                         for node in range(len(apps))]

    def set_run(self, run):
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content=content, message_type=message_type, dst_node_id=dst_node_id, group_id=group_id)

    def get_node_ids(self):
        return list(range(len(self.apps)))

    def push_messages(self, messages):
        raise NotImplementedError("send_and_receive delivers in process")

    def pull_messages(self, message_ids):
        raise NotImplementedError("send_and_receive delivers in process")

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.rounds += any(msg.metadata.message_type == MessageType.TRAIN for msg in messages)
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            TaskIdentity.node_id = node
            try:
                replies.append(self.apps[node](msg, self.contexts[node]))
            except Exception as ex:  # as flwr's run_clientapp: the failure travels back as an error reply
                replies.append(Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, repr(ex)), reply_to=msg))
            finally:
                TaskIdentity.node_id = SUPERLINK_NODE_ID
        return replies


def failing_after(rounds: int) -> ClientApp:
    """A device that trains ``rounds`` rounds and then fails (its ClientApp raises)."""
    app, calls = ClientApp(), []

    @app.train()
    def train(msg, context):
        calls.append(1)
        if len(calls) > rounds:
            raise RuntimeError("device lost its uplink")
        return fleet.train(msg, context)

    return app


def expected_global(run: dict, takes_part, nodes: int = 2) -> torch.Tensor:
    """The global model by hand: each participant's local SGD steps with FedProx's and SCAFFOLD's
    corrections (comm/federated.py), their mean update, edgetrain's server step, SCAFFOLD's control step."""
    spec = fleet.fleet_spec(run)
    data = fleet.load_data(spec)
    model = fleet.global_model(spec, data)
    params = list(model.parameters())
    x = flatten([p.detach() for p in params]).requires_grad_(True)
    opt = server_optimizer(x, spec.server_opt)
    control = torch.zeros_like(x.detach())
    own_controls = [torch.zeros_like(control) for _ in range(nodes)]
    for server_round in range(1, spec.num_rounds + 1):
        updates, control_changes = [], []
        for node in (n for n in range(nodes) if takes_part(n, server_round)):
            _, part = fleet.client_partition(spec, data, {"partition-id": node, "num-partitions": nodes})
            start = x.detach().clone()
            unflatten(start, params)
            sgd = torch.optim.SGD(params, lr=spec.lr)
            rng = np.random.default_rng((spec.seed, server_round, node))
            gradients = []
            for _ in range(spec.local_steps):
                xb, yb = data.train[torch.from_numpy(rng.choice(part, size=spec.batch_size, replace=False))]
                sgd.zero_grad()
                torch.nn.functional.cross_entropy(model(xb), yb).backward()
                gradients.append(flatten([p.grad for p in params]))
                unflatten(corrected_gradient(gradients[-1], flatten([p.detach() for p in params]), start,
                                             spec.prox_mu, control if spec.scaffold else None, own_controls[node]),
                          [p.grad for p in params])
                sgd.step()
            updates.append(start - flatten([p.detach() for p in params]))
            control_changes.append(torch.stack(gradients).mean(0) - own_controls[node])
            own_controls[node] = own_controls[node] + control_changes[-1]
        server_step(x, torch.stack(updates).mean(0), opt)
        control += torch.stack(control_changes).sum(0) / nodes
    return x.detach()


def final_parameters(result) -> torch.Tensor:
    """The global model's parameters (its record also holds BatchNorm statistics)."""
    state = result.arrays.to_torch_state_dict()
    spec = fleet.fleet_spec({})
    names = [name for name, _ in fleet.global_model(spec, fleet.load_data(spec)).named_parameters()]
    return flatten([state[name] for name in names])


def test_flower_rounds_equal_edgetrains_server_step_and_lower_the_loss():
    result = fleet.run_server(InProcessGrid([fleet.client_app, fleet.client_app], RUN), RUN)
    final = final_parameters(result)
    torch.testing.assert_close(final, expected_global(RUN, lambda node, r: True), rtol=0, atol=1e-6)
    spec = fleet.fleet_spec(RUN)
    data = fleet.load_data(spec)
    model = fleet.global_model(spec, data)
    x, y = data.test[torch.arange(len(data.test))]
    before = torch.nn.functional.cross_entropy(model.eval()(x), y).item()
    fleet.load_global(model, result.arrays)
    after = torch.nn.functional.cross_entropy(model.eval()(x), y).item()
    assert after < before - 0.02, (before, after)  # measured: 2.304 -> 2.272 (seeded)
    assert sorted(result.train_metrics_clientapp) == [1, 2]


def test_a_client_that_fails_is_dropped_from_the_round_and_the_run_goes_on():
    grid = InProcessGrid([fleet.client_app, failing_after(1)], RUN)
    result = fleet.run_server(grid, RUN)
    assert grid.rounds == 2
    final = final_parameters(result)
    torch.testing.assert_close(final, expected_global(RUN, lambda node, r: node == 0 or r == 1), rtol=0, atol=1e-6)


def test_compressed_updates_are_decoded_on_the_server():
    run = {**RUN, "num-rounds": 1, "compress": "fp16", "server-opt": "fedavg"}
    result = fleet.run_server(InProcessGrid([fleet.client_app, fleet.client_app], run), run)
    payload_bytes = result.train_metrics_clientapp[1]["payload-bytes"]
    numel = final_parameters(result).numel()
    assert payload_bytes == 2 * numel  # fp16 on the wire
    exact = expected_global({**run, "compress": "none"}, lambda node, r: True)
    final = final_parameters(result)
    assert not torch.equal(final, exact)  # the fp16 rounding reached the model...
    torch.testing.assert_close(final, exact, rtol=0, atol=1e-3)  # ...and nothing else


@pytest.mark.parametrize("compress", ["none", "fp16", "bf16", "int8", "qsgd", "topk:0.1", "sign", "threshold"])
def test_every_decodable_compressor_crosses_the_wire_as_edgetrain_decodes_it(compress):
    spec = fleet.fleet_spec({"compress": compress})
    client, direct = fleet.compressor_for(spec, 1, 0)[0], fleet.compressor_for(spec, 1, 0)[0]  # same noise (QSGD)
    update = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    wire = fleet.to_wire(client, update)
    payload = direct.encode(update)
    assert wire.dtype == np.uint8 and wire.nbytes == payload.nbytes
    server = fleet.compressor_for(spec)[0]
    torch.testing.assert_close(fleet.from_wire(server, wire, update.numel()), direct.decode(payload), rtol=0, atol=0)


@pytest.mark.parametrize("correction", [{"prox-mu": 1.0}, {"scaffold": True}], ids=["fedprox", "scaffold"])
def test_fedprox_and_scaffold_rounds_equal_a_hand_computation(correction):
    # 3 nodes, the last one fails in round 2: SCAFFOLD's control then steps by sum_S / N with |S| = 2 < N = 3
    run = {**RUN, **correction, "server-opt": "fedavg", "fraction-evaluate": 0.0, "min-nodes": 3}
    grid = InProcessGrid([fleet.client_app, fleet.client_app, failing_after(1)], run)
    final = final_parameters(fleet.run_server(grid, run))
    takes_part = lambda node, r: node < 2 or r == 1  # noqa: E731
    # SCAFFOLD single-threaded (torch's thread count as earlier tests leave it) differs from the hand loop by
    # up to 1.03e-5 in 1% of the elements, with two threads not at all: not yet explained, so the bound is
    # 3e-5 there (a wrong control step moves the model by more than 1e-4, checked below)
    atol = 3e-5 if correction.get("scaffold") else 1e-6
    torch.testing.assert_close(final, expected_global(run, takes_part, nodes=3), rtol=0, atol=atol)
    plain = expected_global({**run, "prox-mu": 0.0, "scaffold": False}, takes_part, nodes=3)
    assert (final - plain).abs().max() > 1e-4  # the correction changed the model, beyond the tolerance


def test_error_feedback_carries_what_a_round_did_not_send_to_the_next():
    run = {**RUN, "compress": "topk:0.1"}
    spec = fleet.fleet_spec(run)
    data = fleet.load_data(spec)
    model = fleet.global_model(spec, data)
    _, part = fleet.client_partition(spec, data, {"partition-id": 0, "num-partitions": 2})
    context = Context(run_id=1, node_id=0, state=RecordDict(), run_config=run,
                      node_config={"partition-id": 0, "num-partitions": 2})
    numel = sum(p.numel() for p in model.parameters())
    sent, updates = [], []
    for server_round in (1, 2):  # the same global model both times: only the device's state differs
        msg = Message(RecordDict({"arrays": fleet.model_record(model),
                                  "config": ConfigRecord({"server-round": server_round})}),
                      dst_node_id=0, message_type=MessageType.TRAIN)
        wire = fleet.train(msg, context).content["arrays"][fleet.UPDATE].numpy()
        sent.append(fleet.from_wire(fleet.compressor_for(spec)[0], wire, numel))
        updates.append(fleet.local_update(spec, fleet.global_model(spec, data), data, part, server_round, 0).update)
    residual = context.state[fleet.STATE].to_torch_state_dict()["residuals/update"]
    assert (sent[0] != 0).sum() == (sent[1] != 0).sum() < numel // 5  # top 10% went, the rest waited
    torch.testing.assert_close(sent[0] + sent[1] + residual, updates[0] + updates[1], rtol=0, atol=1e-6)


def test_federated_evaluation_and_the_saved_model_are_the_global_models(tmp_path):
    run = {**RUN, "num-rounds": 1, "output-dir": str(tmp_path / "fleet")}
    result = fleet.run_server(InProcessGrid([fleet.client_app, fleet.client_app], run), run)
    spec = fleet.fleet_spec(run)
    data = fleet.load_data(spec)
    model = fleet.global_model(spec, data)
    saved = torch.load(tmp_path / "fleet" / fleet.MODEL_FILE)
    assert saved.keys() == model.state_dict().keys()
    for name, tensor in result.arrays.to_torch_state_dict().items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0)
    model.load_state_dict(saved)
    loss, accuracy = evaluate(model, data.test, rank=0, world=1)
    # both devices evaluated their own test splits, which cover the test set: the weighted mean is the whole set's
    assert result.evaluate_metrics_clientapp[1]["eval-accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert result.evaluate_metrics_clientapp[1]["eval-loss"] == pytest.approx(loss, rel=1e-6)
    assert not torch.equal(saved["features.1.running_mean"], torch.zeros(32))  # the clients' statistics


@pytest.mark.parametrize("run_config, message", [
    ({"rounds": 2}, "unknown run-config key 'rounds'"),
    ({"compress": "randk:0.1"}, "cannot decode it"),
    ({"partition": "none"}, "gives no device its own data"),
    ({"local-steps": 0}, "local-steps must be a whole number >= 1"),
    ({"lr": "fast"}, "lr must be a number, got 'fast'"),
    ({"num-rounds": 2.5}, "num-rounds must be a whole number, got 2.5"),
    ({"model": "resnet81"}, "unknown model 'resnet81'"),
    ({"prox-mu": -0.1}, "prox-mu must be >= 0"),
    ({"fraction-evaluate": 1.5}, "fraction-evaluate must be in"),
    ({"scaffold": "yes"}, "scaffold must be a true or false"),
    ({"output-dir": "/proc/fleet"}, "output-dir /proc/fleet is under /proc"),
])
def test_bad_run_config_is_one_clear_error(run_config, message):
    with pytest.raises(EdgetrainError, match=message):
        fleet.fleet_spec(run_config)


def test_without_flower_the_import_names_the_extra():
    hide_flower = ("import sys; sys.modules['flwr'] = None\n"
                   "try:\n import edgetrain.fleet\nexcept Exception as e: print(type(e).__name__, e)")
    out = subprocess.run([sys.executable, "-c", hide_flower], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == ("EdgetrainError edgetrain.fleet needs Flower (flwr), which is not installed; "
                                  "install it with: pip install edgetrain[fleet]"), out.stderr


def test_sampling_picks_online_devices_and_a_dropouts_update_is_not_aggregated(tmp_path):
    # device 0 always online; device 1 online at t=0 but only for 10 ms, so in round 1 it is sampled and drops
    # out mid-round (its round takes longer: the model down and up on lte-10m), in round 2 it is offline;
    # device 2 is never online. Only device 0's updates may reach the model.
    trace = tmp_path / "trace.csv"
    trace.write_text("# device,start_s,end_s\n0,0,1e9\n1,0,0.01\n")
    run = {**RUN, "server-opt": "fedavg", "fraction-evaluate": 0.0, "min-nodes": 3, "output-dir": str(tmp_path),
           "population": "100% rpi4@lte-10m", "availability": f"trace:{trace}"}
    grid = InProcessGrid([fleet.client_app] * 3, run)
    sent = []
    deliver = grid.send_and_receive
    grid.send_and_receive = lambda messages, **kw: (sent.extend(m.metadata.dst_node_id for m in messages),
                                                    deliver(messages, **kw))[1]
    final = final_parameters(fleet.run_server(grid, run))
    assert sorted(sent) == [0, 0, 1]  # round 1: the two online; round 2: device 0; device 2 never
    # without SCAFFOLD or error feedback a device keeps nothing model-sized (a simulation holds every device's)
    assert len(grid.contexts[0].state[fleet.STATE]) == 0
    torch.testing.assert_close(final, expected_global(run, lambda node, r: node == 0, nodes=3), rtol=0, atol=1e-6)
    records = [json.loads(line) for line in (tmp_path / fleet.ROUNDS_FILE).read_text().splitlines()]
    assert [(r["online"], r["sampled"], r["dropouts"], r["aggregated"]) for r in records] == [(2, 2, 1, 1),
                                                                                           (1, 1, 0, 1)]
    # the round waits for device 0 (longer than device 1's 10 ms before it dropped); the clock adds up
    assert records[0]["modelled_round_s"] > 0.05 and records[1]["modelled_clock_s"] == pytest.approx(
        records[0]["modelled_round_s"] + records[1]["modelled_round_s"])


def test_a_device_that_would_miss_the_round_deadline_is_left_out(tmp_path):
    # jetson-orin-nano on lan-1g finishes in milliseconds, smart speakers on lte-10m take far longer: a 50 ms
    # deadline keeps the jetsons only, and the round lasts the deadline (the server waits it out)
    run = {**RUN, "num-rounds": 1, "server-opt": "fedavg", "fraction-evaluate": 0.0, "min-nodes": 4,
           "output-dir": str(tmp_path), "population": "50% jetson-orin-nano@lan-1g, 50% smart-speaker-2g@lte-10m",
           "round-deadline": 0.05}
    spec = fleet.fleet_spec(run)
    modelled = fleet.modelled_fleet(spec, fleet.global_model(spec, fleet.load_data(spec)))
    modelled.online([0, 1, 2, 3])  # numbers the devices and gives them their groups, as the strategy's does
    fast = [n for n in range(4) if modelled.device_s(n, 376_740) < 0.05]  # 376,740: small_cnn's update bytes
    assert len(fast) == 2
    final = final_parameters(fleet.run_server(InProcessGrid([fleet.client_app] * 4, run), run))
    torch.testing.assert_close(final, expected_global(run, lambda node, r: node in fast, nodes=4), rtol=0, atol=1e-6)
    (record,) = [json.loads(line) for line in (tmp_path / fleet.ROUNDS_FILE).read_text().splitlines()]
    assert (record["late"], record["aggregated"], record["modelled_round_s"]) == (2, 2, 0.05)


def test_a_device_reuses_its_model_and_trains_as_on_a_fresh_one(monkeypatch):
    """The model is built once per process, not per call (a simulation's actor runs many devices' rounds); a call
    on the reused model, which the call before it trained, replies bit for bit as one on a freshly built model
    and leaves torch's generator where a fresh build does."""
    spec = fleet.fleet_spec(RUN)
    data = fleet.load_data(spec)
    content = RecordDict({"arrays": fleet.model_record(fleet.global_model(spec, data)),
                          "config": ConfigRecord({"server-round": 1})})
    builds, build = [], fleet.build_model
    monkeypatch.setattr(fleet, "build_model", lambda *args: builds.append(args) or build(*args))
    monkeypatch.setattr(fleet, "_IDLE_MODELS", {}, raising=False)  # this process's models so far: none
    monkeypatch.setattr(fleet, "_RNG_AFTER_BUILD", {}, raising=False)

    def call(node: int) -> tuple[dict, torch.Tensor]:
        context = Context(run_id=1, node_id=node, state=RecordDict(), run_config=RUN,
                          node_config={"partition-id": node, "num-partitions": 2})
        reply = fleet.train(Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN), context)
        return {name: array.numpy() for name, array in reply.content["arrays"].items()}, torch.get_rng_state()

    call(0)
    reused, reused_rng = call(1)
    assert len(builds) == 1
    fleet._IDLE_MODELS.clear()
    fresh, fresh_rng = call(1)
    assert len(builds) == 2 and reused.keys() == fresh.keys()
    assert all(np.array_equal(reused[name], fresh[name]) for name in fresh) and torch.equal(reused_rng, fresh_rng)
