"""Draw the benchmark pages' plots from what the benchmarks wrote in benchmarks/results/ (nothing typed in).

Run from the repository root: ``python docs/images/make_plots.py``; it rewrites docs/images/bench-*.png.
"""
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path("benchmarks/results")
OUT = Path("docs/images")


def scaling() -> None:
    data = json.loads((RESULTS / "scaling.json").read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    host = data["host"]
    left.plot([r["devices"] for r in host], [r["samples_per_s"] for r in host], "o-")
    left.set(xlabel="host devices (2 cores)", ylabel="samples/s (measured)", title="weak scaling, ResNet-18 (width 32)",
             xticks=[r["devices"] for r in host])
    ratios = defaultdict(list)
    for round_ in data["rpi4"]["rounds"]:
        for d in round_["devices"]:
            ratios[f"{d['devices']} dev., rank {d['rank']}"].append(d["speed_ratio"])
    names = list(ratios)
    for i, name in enumerate(names):
        right.plot([i] * len(ratios[name]), ratios[name], "o", color="tab:blue", alpha=0.6)
    right.axhspan(0.9, 1.1, color="tab:green", alpha=0.12, label="target: within 10%")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set(xticks=range(len(names)), ylabel="measured / profile speed", title="emulated rpi4, one dot per round")
    right.set_xticklabels(names, rotation=20, fontsize=8)
    right.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "bench-scaling.png", dpi=110)


def tiling() -> None:
    data = json.loads((RESULTS / "tiling.json").read_text())
    grids = list(data["memory"])
    per_device = [[b / 2**20 for b in data["memory"][g]["peak_memory_bytes_tiled_section"]] for g in grids]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    bars = ax.bar(grids, [max(d) for d in per_device], color="tab:blue", alpha=0.5, label="the largest device")
    ax.bar_label(bars, fmt="%.1f MiB")
    for i, devices in enumerate(per_device):
        ax.plot([i] * len(devices), devices, "o", color="tab:blue", label="each device" if i == 0 else None)
    ax.legend(fontsize=8)
    ax.set(xlabel="tile grid", ylabel="peak memory per device, MiB", title="tiled section, YOLOv2-tiny 416x416, batch 8")
    fig.tight_layout()
    fig.savefig(OUT / "bench-tiling.png", dpi=110)


def federated() -> None:
    rows = json.loads((RESULTS / "federated.json").read_text())["results"]
    by_method = defaultdict(dict)
    for r in rows:
        by_method[r["method"]][r["seed"]] = 100 * r["test_accuracy"]
    methods = sorted(by_method, key=lambda m: -sum(by_method[m].values()) / len(by_method[m]))
    fig, ax = plt.subplots(figsize=(10, 4))
    for i, m in enumerate(methods):
        seeds = by_method[m]
        ax.plot([i] * len(seeds), list(seeds.values()), "o", color="tab:blue", alpha=0.55)
        ax.plot([i - 0.3, i + 0.3], [sum(seeds.values()) / len(seeds)] * 2, color="black", lw=1.5)
    ax.set_xticks(range(len(methods)))
    ax.set_xticklabels(methods, rotation=40, ha="right", fontsize=8)
    ax.set(ylabel="test accuracy, % (measured)",
           title="10 clients, Dirichlet 0.5, 15 rounds: one dot per seed, bar = mean over the seeds run")
    fig.tight_layout()
    fig.savefig(OUT / "bench-federated.png", dpi=110)


if __name__ == "__main__":
    scaling()
    tiling()
    federated()
