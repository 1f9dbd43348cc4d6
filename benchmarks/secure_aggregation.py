"""Secure aggregation's cost per exchange: bytes and time, masked against plain fp32, on 4 emulated devices.

Each of ``--devices`` gloo processes averages a model-sized fp32 vector through ``comm.exchange.average``
(the path of DDP's hook, local SGD's and DiLoCo's outer step and federated rounds), ``--repeats`` times, plain
and with ``--secure-aggregation``'s ``SecureSum``, on a link of ``--link`` in the virtual clock's mode:

* bytes: what each device put on its link per exchange (the ring all-reduce's traffic of its payload);
* link s: the link model's time for that collective (``cluster.links``, modelled);
* host s: the exchange's own work on the host, measured: the exchange's wall time minus the time blocked in the
  real loopback collective (encoding, the masks' ChaCha20 keystreams, decoding); the slowest device's;
* host CPU s: the CPU time of the same work (the calling thread's; gloo's own threads, which move the bytes the
  link model charges for, are not in it): what the work takes on a core of its own, where the wall time also
  holds the waits for a core on a loaded host;
* total: link + host, what the exchange costs on the virtual clock; overhead: masked over plain, minus one;
  ``cpu_`` the same with host CPU s.

Sizes: the privacy benchmark's LeNet (32x32 input), the digits ``small_cnn`` and the CIFAR ResNet-18, counted from
the registry's models. Medians over the repeats after the first (which also agrees the scale).

Usage (from the repository root)::

    PYTHONPATH=src python benchmarks/secure_aggregation.py --devices 4 --link lte-10m --repeats 6 \
        --out benchmarks/results/secure_aggregation.json
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

MODELS = {"lenet": {"image_size": 32}, "small_cnn": {}, "resnet18": {}}


def model_sizes(names: list[str]) -> dict[str, int]:
    from edgetrain.models import build_model

    return {name: sum(p.numel() for p in build_model(name, **MODELS.get(name, {})).parameters()) for name in names}


def one_exchange(x, secure, emulator_args) -> dict:
    from edgetrain.comm.compress import NoCompression, NoMemory
    from edgetrain.comm.emulation import LinkEmulator
    from edgetrain.comm.exchange import Channel, average

    emulator = LinkEmulator(*emulator_args)
    emulator.start_step()
    started, cpu = time.perf_counter(), time.thread_time()
    average(x, Channel(NoCompression(), NoMemory(), emulator, secure=secure), key="params")
    wall, cpu = time.perf_counter() - started, time.thread_time() - cpu
    blocked, modelled = emulator.step_charged()
    return {"bytes": emulator.stats.bytes_sent, "link_s": modelled, "host_s": wall - blocked, "host_cpu_s": cpu}


def device(rank: int, world: int, sizes: dict[str, int], link_text: str, repeats: int) -> dict:
    import torch

    from edgetrain.comm.secagg import SecureSum
    from edgetrain.spec import get_link

    link = get_link(link_text)
    secure = SecureSum.agree(rank, world, None, 120)
    out = {}
    for name, numel in sizes.items():
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * 1e-2
        rows = {"plain": [], "masked": []}
        for r in range(repeats):
            for mode, masks in (("plain", None), ("masked", secure)):
                rows[mode].append(one_exchange(x, masks, ([link] * world, rank, None, "virtual", r)))
        out[name] = rows
    return out


def summarise(per_device: list[dict], sizes: dict[str, int]) -> list[dict]:
    table = []
    for name, numel in sizes.items():
        row = {"model": name, "parameters": numel}
        for mode in ("plain", "masked"):
            runs = list(zip(*(d[name][mode] for d in per_device)))[1:]  # per repeat, every device; first left out
            host = statistics.median(max(d["host_s"] for d in repeat) for repeat in runs)
            cpu = statistics.median(max(d["host_cpu_s"] for d in repeat) for repeat in runs)
            link = statistics.median(max(d["link_s"] for d in repeat) for repeat in runs)
            row[mode] = {"bytes": per_device[0][name][mode][-1]["bytes"], "link_s": round(link, 4),
                         "host_s": round(host, 4), "host_cpu_s": round(cpu, 4), "total_s": round(link + host, 4),
                         "cpu_total_s": round(link + cpu, 4)}
        row["bytes_ratio"] = round(row["masked"]["bytes"] / row["plain"]["bytes"], 4)
        row["time_overhead"] = round(row["masked"]["total_s"] / row["plain"]["total_s"] - 1, 4)
        row["cpu_time_overhead"] = round(row["masked"]["cpu_total_s"] / row["plain"]["cpu_total_s"] - 1, 4)
        table.append(row)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--link", default="lte-10m")
    parser.add_argument("--models", default="lenet,small_cnn,resnet18")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/secure_aggregation.json")
    args = parser.parse_args()
    from edgetrain.cluster.launch import run_group

    sizes = model_sizes(args.models.split(","))
    started = time.perf_counter()
    per_device = run_group(device, args.devices, sizes, args.link, args.repeats, timeout_s=300)
    table = summarise(per_device, sizes)
    for row in table:
        print(json.dumps(row), flush=True)
    meta = {"command": " ".join(sys.argv), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "devices": args.devices, "link": args.link, "repeats": args.repeats, "loadavg": os.getloadavg(),
            "wall_s": round(time.perf_counter() - started, 1), "rows": table}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
