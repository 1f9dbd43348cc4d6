"""The fleet on Flower's simulation runtime: the same ServerApp and ClientApp (``fleet/app.py``) on N virtual
SuperNodes run by Ray actors on this machine (``pip install edgetrain[fleet]``, which brings ``flwr[simulation]``).
Design, commands and measurements: docs/tutorials/federated-fleet.md, docs/benchmarks/fleet-simulation.md."""
from __future__ import annotations

import os
from dataclasses import dataclass

from edgetrain.errors import EdgetrainError

# Imported inside functions: edgetrain.fleet.app (torch and flwr), ray and flwr.simulation (the fleet extra):
# the resources are checked in one line before any of them loads.


@dataclass(frozen=True)
class SimulationResources:
    """What Ray may take: CPUs per virtual device (a fraction packs more actors on a core: ``cores /
    cpus_per_device`` devices train at once, every other device waits for an actor), the CPUs Ray counts
    (default: this machine's), and a cap on its object store so it does not take a share of all memory."""

    cpus_per_device: float = 1.0
    num_cpus: int | None = None
    object_store_mb: int = 256
    temp_dir: str | None = None  # Ray's session files and sockets (default /tmp/ray); keep the path short
    # a running Ray cluster ("HEAD:6379", or "auto": the one whose `ray start --temp-dir` is temp_dir) instead of
    # one of its own; the nodes' CPUs, store and actors' niceness are then their own `ray start`'s
    address: str | None = None
    # added to the actors' niceness. Ray's own default, 15, leaves the processes that train every device at
    # the bottom of a shared machine's queue (nice 19 under a nice-5 run): 0 runs them as this process runs
    worker_niceness: int = 0

    def backend_config(self) -> dict:
        if self.cpus_per_device <= 0:
            raise EdgetrainError(f"cpus per device must be > 0 (e.g. 0.5: two devices a core), got "
                                 f"{self.cpus_per_device!r}")
        if self.address:
            return {"client_resources": {"num_cpus": self.cpus_per_device, "num_gpus": 0.0},
                    "init_args": self.cluster_init_args()}
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

    def cluster_init_args(self) -> dict:
        """``ray.init``'s arguments to join the cluster at ``address``. Its CPUs, store size and actors'
        niceness are what its nodes were started with (``ray.init`` refuses CPUs and a store size when joining):
        CPUs or a niceness asked for here are refused rather than dropped (``object_store_mb``, which has a
        default, is left out). The temp dir goes along: with ``"auto"`` Ray reads the address of the cluster
        started with that ``--temp-dir``; without it, the default one's, or failing that any GCS process on
        the machine (another user's included)."""
        if self.num_cpus is not None:
            raise EdgetrainError(f"num_cpus {self.num_cpus} with address {self.address!r}: a cluster's CPUs are "
                                 "its nodes' own; give each node's `ray start --num-cpus N` and leave num_cpus unset")
        if self.worker_niceness:
            raise EdgetrainError(f"worker_niceness {self.worker_niceness} with address {self.address!r}: a cluster's "
                                 f"actors take their nodes' niceness; start each node with "
                                 f"RAY_worker_niceness={self.worker_niceness} ray start ... and leave it 0 here")
        init = {"address": self.address, "logging_level": "warning", "log_to_driver": True}
        if self.temp_dir:
            init["_temp_dir"] = self.temp_dir
        return init


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
