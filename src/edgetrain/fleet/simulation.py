"""The fleet on Flower's simulation runtime: the same ServerApp and ClientApp (``fleet/app.py``) on N virtual
SuperNodes run by Ray actors on this machine (``pip install edgetrain[fleet]``, which brings ``flwr[simulation]``).
Design, commands and measurements: docs/tutorials/federated-fleet.md, docs/benchmarks/fleet-simulation.md."""
from __future__ import annotations

import os
from dataclasses import dataclass

from edgetrain.errors import EdgetrainError


@dataclass(frozen=True)
class SimulationResources:
    """What Ray may take: CPUs per virtual device (a fraction packs more actors on a core: ``cores /
    cpus_per_device`` devices train at once, every other device waits for an actor), the CPUs Ray counts
    (default: this machine's), and a cap on its object store so it does not take a share of all memory."""

    cpus_per_device: float = 1.0
    num_cpus: int | None = None
    object_store_mb: int = 256
    temp_dir: str | None = None  # Ray's session files and sockets (default /tmp/ray); keep the path short
    address: str | None = None   # a running Ray cluster ("auto", "HEAD:6379") instead of one of its own
    # added to the actors' niceness. Ray's own default, 15, leaves the processes that train every device at
    # the bottom of a shared machine's queue (nice 19 under a nice-5 run): 0 runs them as this process runs
    worker_niceness: int = 0

    def backend_config(self) -> dict:
        if self.cpus_per_device <= 0:
            raise EdgetrainError(f"cpus per device must be > 0 (e.g. 0.5: two devices a core), got "
                                 f"{self.cpus_per_device!r}")
        if self.address:  # the cluster's own resources; ray.init refuses num_cpus and the store's size then
            return {"client_resources": {"num_cpus": self.cpus_per_device, "num_gpus": 0.0},
                    "init_args": {"address": self.address, "logging_level": "warning", "log_to_driver": True}}
        cpus = self.num_cpus or os.cpu_count() or 1
        if self.cpus_per_device > cpus:
            raise EdgetrainError(f"cpus per device {self.cpus_per_device:g} exceeds the {cpus} CPUs Ray has; "
                                 "lower it")
        if not 0 <= self.worker_niceness <= 19:
            raise EdgetrainError(f"worker niceness must be 0..19 (added to this process's), got {self.worker_niceness!r}")
        init = {"num_cpus": cpus, "num_gpus": 0, "object_store_memory": self.object_store_mb * 2**20,
                "include_dashboard": False, "logging_level": "warning", "log_to_driver": True,
                "_system_config": {"worker_niceness": self.worker_niceness}}
        if self.temp_dir:
            init["_temp_dir"] = self.temp_dir
        return {"client_resources": {"num_cpus": self.cpus_per_device, "num_gpus": 0.0}, "init_args": init}


def simulate(run_config: dict, devices: int, resources: SimulationResources = SimulationResources()) -> None:
    """Run the fleet with ``run_config`` (``fleet.app.DEFAULTS``' keys) on ``devices`` virtual SuperNodes
    (Flower's ``run_simulation``, backend Ray); the records go to the config's ``output-dir``. Ray is shut down
    when it returns (Flower's backend ends its actors and calls ``ray.shutdown``)."""
    if devices < 1:
        raise EdgetrainError(f"a simulated fleet needs at least 1 device, got {devices}")
    from edgetrain.fleet.app import client_partition, fleet_spec, load_data, make_client_app, make_server_app

    spec = fleet_spec(run_config)  # one line for a bad config, before Ray starts
    # a partition that cannot give every device a batch: one line now, not a failing ClientApp every round
    client_partition(spec, load_data(spec), {"partition-id": 0, "num-partitions": devices})
    backend = resources.backend_config()
    try:
        import ray  # noqa: F401  (flwr[simulation])
        from flwr.simulation import run_simulation
    except ImportError:
        raise EdgetrainError("the fleet simulation needs Flower's simulation runtime (Ray); install it with: "
                             "pip install edgetrain[fleet]") from None
    run_simulation(server_app=make_server_app(run_config), client_app=make_client_app(run_config),
                   num_supernodes=devices, backend_name="ray", backend_config=backend)
