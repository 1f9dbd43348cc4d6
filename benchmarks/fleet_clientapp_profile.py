"""One fleet ClientApp call's CPU cost, in this process, as a simulation actor makes it (the steady state: the
dataset and the partitions already built): the CPU milliseconds per call; the same with the model reused and built
anew for each call, alternating; then cProfile's top entries.

Usage (from the repository root)::

    PYTHONPATH=src nice -n 5 python benchmarks/fleet_clientapp_profile.py 40
"""
import cProfile
import pstats
import sys
import time

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from edgetrain.fleet import app as fleet

torch.set_num_threads(1)  # as a Ray actor with one CPU runs it
TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = 1, 1, 0  # what Flower's node process sets
CONFIG = {"model": "small_cnn", "dataset": "synthetic", "image-size": 16, "synthetic-samples": 16000,
          "partition": "iid", "local-steps": 5, "batch-size": 8,
          "population": "60% rpi4@wifi-20m, 40% jetson-orin-nano"}
spec = fleet.fleet_spec(CONFIG)
data = fleet.load_data(spec)
CONTENT = RecordDict({"arrays": fleet.model_record(fleet.global_model(spec, data)),
                      "config": ConfigRecord({"server-round": 1})})


def call(device: int) -> Message:
    msg = Message(content=CONTENT, dst_node_id=device + 1, message_type="train")
    context = Context(run_id=1, node_id=device + 1, node_config={"partition-id": device, "num-partitions": 1000},
                      state=RecordDict(), run_config=CONFIG)
    return fleet.train(msg, context)


if __name__ == "__main__":
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    for device in range(3):  # the first calls build what a process keeps
        call(device)
    start = time.process_time()
    for device in range(calls):
        call(device)
    print(f"{(time.process_time() - start) / calls * 1000:.1f} ms CPU per call ({calls} calls)")
    # the same calls with the model built anew for each (the process's pool emptied first), alternating with
    # calls on the reused one, so that both meet the same load
    spent = {"reused": 0.0, "built per call": 0.0}
    for device in range(calls):
        for way in spent:
            if way == "built per call":
                fleet._IDLE_MODELS.clear()
            start = time.process_time()
            call(device)
            spent[way] += time.process_time() - start
    print("ms CPU per call, alternating: "
          + ", ".join(f"model {way} {s / calls * 1000:.1f}" for way, s in spent.items()))
    cProfile.run(f"for device in range({calls}): call(device)", "/tmp/fleet_clientapp.prof")
    pstats.Stats("/tmp/fleet_clientapp.prof").sort_stats("cumulative").print_stats(25)
