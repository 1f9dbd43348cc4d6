"""The DiLoCo family against fp32 DDP and a peer (torchft), on the CIFAR-10 subset; then on a shaped 10 Mbit/s link.

Part 1, the frontier. Every method trains the model ``--model`` names (MODELS:
benchmarks/compression.py's EdgeCNN, or the registry's ``mlp`` on the
flattened images, whose parameters sit in fully connected layers)
from the same initialisation (``torch.manual_seed(seed)``) on the same data
order with ``edgetrain.train``: 4 emulated devices on one host, global batch
128, lr 0.02 cosine, 8 epochs, each device's link ``10mbit:0ms`` in
virtual-clock mode (measured compute + modelled link time). Per method and
seed: final test accuracy (measured), bytes the busiest device sent (counted
from the payloads handed to gloo), their ratio to fp32 DDP's, the mean step
time on this host (wall time of a training step, its loopback exchanges
included; the peer's likewise) and the virtual time to the
target accuracy (0.9 x fp32's final accuracy on that seed). ``peer-*`` rows
are torchft's DiLoCo (benchmarks/torchft_peer.py) on the same model, data,
batches in the same order and 4 devices; their bytes are counted from the
tensors torchft hands to its gloo all-reduce. Each peer row is also compared
paired with its edgetrain twin (PEERS). ``--steps`` stops every run early (a
whole number of periods: both libraries end on an outer step). The accuracy target is judged paired by seed as
benchmarks/paired.py reads it: the one-sided 95% lower bound of (method -
fp32) must be >= -1.0 point. The plot (``--plot``) is accuracy against bytes
per device.

Part 2 (``--link-methods``), measured on a real link: 4 network namespaces on
a bridge, each device's veth shaped to 10 Mbit/s both ways by ``tc tbf``
(benchmarks/shaped_link.py; this kernel has no netem: no added delay, no
loss). Each method trains there with no emulation (``link: none``: every
byte crosses the shaped link, every second is measured: the clock is the
training steps' wall time), and again on loopback in virtual mode with link
``10mbit:0ms``, whose clock is the prediction. Printed: each run's time to
fp32's target (0.9 x fp32's final accuracy on the shaped link), measured and
predicted, and their ratio.

Usage (from the repository root; part 2 needs root)::

    PYTHONPATH=src python benchmarks/diloco.py --seeds 0,1 --torchft-path /tmp/tft --torchft-path /tmp/tft-deps
    PYTHONPATH=src python benchmarks/diloco.py --methods fp32,sparseloco16 --seeds 0 --link-methods fp32,sparseloco16 \\
        --link-epochs 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "src")]

from functools import partial  # noqa: E402

from compression import EdgeCNN  # noqa: E402
from paired import lower_bound  # noqa: E402

from edgetrain.models import build_model  # noqa: E402
from edgetrain.files import atomic_write, write_json  # noqa: E402
from edgetrain.train import train  # noqa: E402

DATA = ROOT.parent / "shared/data/cifar10-subset/cifar-10-batches-py"
LINK = "10mbit:0ms"

# --model: EdgeCNN (288,554 parameters, ~3.1 M multiply-adds an image: compute-heavy for its size) or the
# registry's two-hidden-layer MLP on the flattened 3x32x32 image (411,146 parameters, ~0.41 M multiply-adds an
# image: all of them in fully connected layers, so a step costs little compute for the bytes it sends).
MODELS = {"edgecnn": EdgeCNN,
          "mlp": partial(build_model, "mlp", in_channels=3 * 32 * 32, num_classes=10, hidden=128)}

# label: (--compress, --sync). fp32 ring all-reduce sends 6 bytes per parameter and step per device (4
# devices); an H-step period divides that by H, and an all-gathered payload of b bytes per parameter costs
# 3 b. topk:R:bits=2 is about 2.25 R bytes a parameter (2-bit value, 16-bit gap), quant:B B/8.
METHODS: dict[str, tuple[str, str]] = {
    "fp32": ("none", "sync"),
    "local16": ("none", "local:16"),
    "diloco16": ("none", "diloco:16"),
    "diloco64": ("none", "diloco:64"),
    # SparseLoCo: error feedback takes the place of the outer momentum (its paper's outer step is plain SGD)
    "sparseloco16": ("topk:0.02:bits=2", "diloco:16:lr=1:momentum=0"),
    "sparseloco16-nesterov": ("topk:0.02:bits=2", "diloco:16"),
    "sparseloco8": ("topk:0.01:bits=2", "diloco:8:lr=1:momentum=0"),
    # after the first seed's rows: longer periods with 2-bit outer gradients (quant:2 is 3 levels a value, 2 bits)
    "diloco32": ("none", "diloco:32"),
    "diloco32-q2": ("quant:2", "diloco:32"),
    "diloco48-q2": ("quant:2", "diloco:48"),
    "sparseloco32-8%": ("topk:0.08:bits=2", "diloco:32"),
    "streaming32-q2": ("quant:2", "streaming:32:fragments=4:overlap=1"),
    # after the second batch: 4-bit outer gradients over 32 steps; SparseLoCo with an outer lr of 2
    "diloco32-q4": ("quant:4", "diloco:32"),
    "sparseloco16-lr2": ("topk:0.02:bits=2", "diloco:16:lr=2:momentum=0"),
    # after the third: a larger outer step still, and the 8% / 32-step SparseLoCo with it
    "sparseloco16-lr3": ("topk:0.02:bits=2", "diloco:16:lr=3:momentum=0"),
    "sparseloco32-8%-lr2": ("topk:0.08:bits=2", "diloco:32:lr=2:momentum=0"),
    "streaming16": ("quant:4", "streaming:16:fragments=4:overlap=1"),
    "streaming16-sparse": ("topk:0.02:bits=2", "streaming:16:fragments=4:overlap=1:lr=1:momentum=0"),
}
# label: torchft_peer.py options
PEERS: dict[str, list[str]] = {
    "peer-diloco16": ["--sync-every", "16"],
    # torchft's bucketised all-reduce: one flat tensor, as edgetrain's (the same sums in the same order)
    "peer-diloco16-flat": ["--sync-every", "16", "--flat"],
    "peer-streaming16": ["--sync-every", "16", "--fragments", "4", "--overlap", "1", "--mix", "0.5"],
}
# peer: its edgetrain twin, compared paired by seed
TWINS = {"peer-diloco16": "diloco16", "peer-diloco16-flat": "diloco16", "peer-streaming16": "streaming16"}


def config(label: str, args, seed: int, out: Path, link: str | None, epochs: int, steps: int | None = None) -> dict:
    compress, sync = METHODS[label]
    return dict(dataset="cifar10", data_dir=str(args.data_dir), augment=False, devices=args.devices, epochs=epochs,
                batch_size=args.batch_size, lr=args.lr, schedule="cosine", seed=seed, compress=compress, sync=sync,
                link=link, link_mode="virtual", output=str(out), run_name=f"{label}-seed{seed}", progress=False,
                timeout=600, threads=1, throttle=False, steps=steps)  # one thread a device, as on loopback


def curve(run_dir: Path, summary: dict) -> list[tuple[float, float]]:
    """(clock at the end of each epoch's last step, test accuracy after it): the run's slowest device."""
    clock: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        clock[r["step"]] = max(clock.get(r["step"], 0.0), r["virtual_s"])
    return [(clock[e["step"] - 1], e["test_accuracy"]) for e in summary["evals"]]


def row(label: str, seed: int, summary: dict, run_dir: Path, wall: float) -> dict:
    return {"label": label, "seed": seed, "accuracy": summary["test_accuracy"],
            "bytes_per_device": summary["bytes_sent_max_device"], "steps": summary["steps"],
            "step_s": summary["step_s"], "wall_s": wall, "curve": curve(run_dir, summary),
            "virtual_s": summary.get("virtual_time_max_device_s")}


def run_edgetrain(label: str, args, seed: int, out: Path) -> dict:
    started = time.perf_counter()
    torch.manual_seed(seed)
    summary = train(config(label, args, seed, out, LINK, args.epochs, args.steps), model=MODELS[args.model]())
    return row(label, seed, summary, Path(summary["run_dir"]), time.perf_counter() - started)


def run_peer(label: str, args, seed: int) -> dict:
    cmd = [sys.executable, str(HERE / "torchft_peer.py"), "--devices", str(args.devices), "--epochs", str(args.epochs),
           "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--seed", str(seed),
           "--data-dir", str(args.data_dir), "--model", args.model, *PEERS[label]]
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    for path in args.torchft_path:
        cmd += ["--torchft-path", path]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{label} failed ({done.returncode}):\n{tail}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    return {"label": label, "seed": seed, "accuracy": r["accuracy"], "bytes_per_device": r["bytes_per_device"],
            "steps": r["steps"], "step_s": r["step_s_mean"], "wall_s": r["wall_s"], "curve": [], "virtual_s": None,
            "peer_accuracies": r["accuracies"]}


def time_to(points: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, acc in points if acc >= target), None)


def table(rows: list[dict], labels: list[str], seeds: list[int]) -> tuple[str, dict]:
    by = {(r["label"], r["seed"]): r for r in rows}
    fp32 = {s: by[("fp32", s)] for s in seeds if ("fp32", s) in by}
    lines = [f"{'method':22} {'compress':18} {'sync':44} {'n':>2} {'acc %':>7} {'vs fp32 (LCB)':>17} {'MB/device':>10} "
             f"{'ratio':>7} {'step s':>7} {'t->target s':>11}"]
    stats = {}
    for label in labels:
        runs = [by[(label, s)] for s in seeds if (label, s) in by]
        if not runs:
            continue
        acc = np.mean([r["accuracy"] for r in runs]) * 100
        diffs = [(by[(label, s)]["accuracy"] - fp32[s]["accuracy"]) * 100 for s in seeds
                 if (label, s) in by and s in fp32]
        lcb = lower_bound(diffs)
        mb = np.mean([r["bytes_per_device"] for r in runs]) / 1e6
        ratio = np.mean([fp32[r["seed"]]["bytes_per_device"] / r["bytes_per_device"] for r in runs if r["seed"] in fp32])
        ttt = [time_to(r["curve"], 0.9 * fp32[r["seed"]]["accuracy"]) for r in runs if r["seed"] in fp32]
        ttt_text = "-" if not ttt or any(t is None for t in ttt) else f"{np.mean(ttt):.1f}"
        compress, sync = METHODS.get(label, ("(torchft)", " ".join(PEERS.get(label, []))))
        lines.append(f"{label:22} {compress:18} {sync:44} {len(runs):2} {acc:7.2f} {np.mean(diffs):+7.2f} ({lcb:+6.2f}) "
                     f"{mb:10.3f} {ratio:6.0f}x {np.mean([r['step_s'] for r in runs]):7.3f} {ttt_text:>11}")
        stats[label] = {"accuracy": acc, "diff_mean": float(np.mean(diffs)) if diffs else None, "diff_lcb": lcb,
                        "diffs": diffs, "mb_per_device": mb, "ratio": ratio, "seeds": [r["seed"] for r in runs]}
    return "\n".join(lines), stats


def versus_peers(rows: list[dict], labels: list[str], seeds: list[int]) -> list[str]:
    """Each edgetrain twin against its peer, paired by seed: mean difference in points and its 95% lower bound."""
    by = {(r["label"], r["seed"]): r for r in rows}
    lines = []
    for peer, twin in TWINS.items():
        both = [s for s in seeds if (peer, s) in by and (twin, s) in by]
        if peer not in labels or twin not in labels or not both:
            continue
        diffs = [100 * (by[(twin, s)]["accuracy"] - by[(peer, s)]["accuracy"]) for s in both]
        lines.append(f"{twin} - {peer}, paired over seeds {both}: {np.mean(diffs):+.2f} points (one-sided 95% "
                     f"bounds {lower_bound(diffs):+.2f} / {0.0 - lower_bound([-d for d in diffs]):+.2f}; each seed "
                     f"{', '.join(f'{d:+.2f}' for d in diffs)})")
    return lines


def plot(stats: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, (label, s) in enumerate(stats.items()):
        marker = "s" if label.startswith("peer") else "o"
        ax.scatter(s["mb_per_device"], s["accuracy"], marker=marker, s=40, color=plt.get_cmap("tab10")(i % 10))
        ax.annotate(f"{label} ({s['ratio']:.0f}x)", (s["mb_per_device"], s["accuracy"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    fp32 = stats.get("fp32")
    if fp32:
        ax.axhline(fp32["accuracy"] - 1.0, color="grey", linestyle=":", label="fp32 - 1 point")
        ax.legend(fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("MB sent per device (counted from payloads), log scale")
    ax.set_ylabel("test accuracy, % (mean over seeds)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)


# ------------------------------------------------------------------ part 2: the shaped link

def shaped_run(label: str, args, seed: int, out: Path, hosts) -> dict:
    """One run on the shaped hosts: device i in namespace i, rank 0's address the rendezvous, no emulation."""
    cfg = config(label, args, seed, out, None, args.link_epochs)
    cfg["run_name"] = f"{label}-seed{seed}-shaped"
    cfg_path = out / f"{cfg['run_name']}.json"
    cfg_path.write_text(json.dumps(cfg))
    env = dict(os.environ, WORLD_SIZE=str(args.devices), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR=hosts.addresses[0], MASTER_PORT="29533", GLOO_SOCKET_IFNAME="eth0",
               TORCHELASTIC_RUN_ID=cfg["run_name"], PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    started = time.perf_counter()
    procs = [subprocess.Popen(hosts.command(i, [sys.executable, str(Path(__file__).resolve()), "--rank-worker",
                                                str(cfg_path), args.model]),
                              env=dict(env, RANK=str(i)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(args.devices)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=1800)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    wall = time.perf_counter() - started
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{label} on the shaped link failed:\n" + "\n".join(o[-2000:] for o in outputs))
    run_dir = out / cfg["run_name"]
    summary = json.loads((run_dir / "summary.json").read_text())
    return row(label, seed, summary, run_dir, wall)


def collect(paths: list[Path], labels: list[str]) -> tuple[list[dict], list[str]]:
    """Rows of earlier runs of this script: from its results .json files (peers included) and from finished run
    directories (``LABEL-seedN/summary.json``) under the given directories; the first row of a (label, seed)
    wins. Unfinished runs are left out."""
    rows: dict[tuple[str, int], dict] = {}
    for path in paths:
        if path.suffix == ".json":
            for r in json.loads(path.read_text())["rows"]:
                rows.setdefault((r["label"], r["seed"]), r)
            continue
        for summary_path in sorted(path.glob("*-seed*/summary.json")):
            label, _, seed = summary_path.parent.name.rpartition("-seed")
            if label in labels and seed.isdigit():
                summary = json.loads(summary_path.read_text())
                wall = summary.get("wall_time_s", 0.0)
                rows.setdefault((label, int(seed)), row(label, int(seed), summary, summary_path.parent, wall))
    return list(rows.values()), []


def rank_worker(cfg_path: str, model: str = "edgecnn") -> int:
    cfg = json.loads(Path(cfg_path).read_text())
    torch.manual_seed(cfg["seed"])
    train(cfg, model=MODELS[model]())
    return 0


def link_part(args, out: Path, lines: list[str]) -> dict:
    from shaped_link import ShapedHosts

    results = {"measured": [], "predicted": []}
    with ShapedHosts(args.devices, "10mbit") as hosts:
        for seed in args.seeds:
            for label in args.link_methods:
                r = shaped_run(label, args, seed, out, hosts)
                results["measured"].append(r)
                print(f"  shaped   {label:22} seed {seed}  acc {100 * r['accuracy']:.2f}%  clock {r['curve'][-1][0]:.1f} s "
                      f"(wall {r['wall_s']:.0f} s)  sent {r['bytes_per_device'] / 1e6:.3f} MB", flush=True)
    for seed in args.seeds:
        for label in args.link_methods:
            started = time.perf_counter()
            torch.manual_seed(seed)
            cfg = config(label, args, seed, out, LINK, args.link_epochs)
            cfg["run_name"] += "-predicted"
            summary = train(cfg, model=MODELS[args.model]())
            r = row(label, seed, summary, Path(summary["run_dir"]), time.perf_counter() - started)
            results["predicted"].append(r)
            print(f"  virtual  {label:22} seed {seed}  acc {100 * r['accuracy']:.2f}%  clock {r['curve'][-1][0]:.1f} s",
                  flush=True)
    lines.append(f"\nshaped link: 4 namespaces, tc tbf 10mbit each way on every veth (no netem: no delay, no loss), "
                 f"model {args.model}, {args.link_epochs} epochs; target = 0.9 x fp32's final accuracy on the shaped "
                 f"link, same seed")
    lines.append(f"{'method':22} {'seed':>4} {'acc shaped':>10} {'acc virt':>9} {'t->target measured':>19} "
                 f"{'predicted':>10} {'ratio':>6} {'end measured':>13} {'predicted':>10} {'ratio':>6}")
    measured = {(r["label"], r["seed"]): r for r in results["measured"]}
    predicted = {(r["label"], r["seed"]): r for r in results["predicted"]}
    for (label, seed), m in measured.items():
        p = predicted[(label, seed)]
        base = measured.get(("fp32", seed))
        target = 0.9 * base["accuracy"] if base else None
        tm = time_to(m["curve"], target) if target else None
        tp = time_to(p["curve"], target) if target else None
        em, ep = m["curve"][-1][0], p["curve"][-1][0]
        fmt = lambda t: "-" if t is None else f"{t:.1f}"  # noqa: E731
        ratio = f"{tm / tp:.2f}" if tm and tp else "-"
        lines.append(f"{label:22} {seed:4} {100 * m['accuracy']:9.2f}% {100 * p['accuracy']:8.2f}% {fmt(tm):>19} "
                     f"{fmt(tp):>10} {ratio:>6} {em:13.1f} {ep:10.1f} {em / ep:6.2f}")
        m["time_to_target_s"], p["time_to_target_s"] = tm, tp
    for seed in args.seeds:
        base = measured.get(("fp32", seed))
        for label in args.link_methods:
            if label != "fp32" and base and base.get("time_to_target_s") and measured[(label, seed)].get(
                    "time_to_target_s"):
                speedup = base["time_to_target_s"] / measured[(label, seed)]["time_to_target_s"]
                lines.append(f"  seed {seed}: {label} reaches fp32's target {speedup:.1f}x sooner than fp32 on the "
                             f"shaped link (measured; target >= 30x)")
    return results


def main() -> int:
    if len(sys.argv) in (3, 4) and sys.argv[1] == "--rank-worker":
        return rank_worker(*sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    every = list(METHODS) + list(PEERS)
    choices = ", ".join(every).replace("%", "%%")  # argparse formats help with %: "sparseloco32-8%" must be escaped
    p.add_argument("--methods", default=",".join(every), help=f"comma-separated, from: {choices}")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--steps", type=int, default=None,
                   help="stop every frontier run (and the peer's) after this many steps: the cosine schedule's length")
    p.add_argument("--model", choices=sorted(MODELS), default="edgecnn")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=128, help="global batch")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--data-dir", type=Path, default=DATA)
    p.add_argument("--torchft-path", action="append", default=[], help="where torchft and its dependencies are")
    p.add_argument("--link-methods", default="", help="also run these on the shaped 10 Mbit/s link (needs root)")
    p.add_argument("--link-epochs", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="run directories (default: a temporary directory)")
    p.add_argument("--results", type=Path, default=HERE / "results" / "diloco")
    p.add_argument("--collect", type=Path, nargs="*", default=[],
                   help="rows of earlier runs to reuse: their results .json files and run directories' parents")
    p.add_argument("--collect-only", action="store_true", help="run none of the frontier's missing rows")
    args = p.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    labels = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.link_methods = [m.strip() for m in args.link_methods.split(",") if m.strip()]
    unknown = [m for m in labels + args.link_methods if m not in every or m in PEERS and m in args.link_methods]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {', '.join(every)} (peers not on the shaped link)")
    if "fp32" not in labels:
        labels.insert(0, "fp32")
    if args.link_methods and "fp32" not in args.link_methods:
        args.link_methods.insert(0, "fp32")
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-diloco-"))
    out.mkdir(parents=True, exist_ok=True)
    rows, failures = collect(args.collect, labels) if args.collect else ([], [])
    have = {(r["label"], r["seed"]) for r in rows}
    print(f"model {args.model}, 4 devices, {args.epochs} epochs (steps {args.steps or 'all'}), batch {args.batch_size}, "
          f"lr {args.lr} cosine, link {LINK} (virtual), "
          f"seeds {args.seeds}, data {args.data_dir}; runs in {out}", flush=True)
    for seed in args.seeds:
        for label in labels:
            if (label, seed) in have or args.collect_only:  # collected from an earlier run of this script
                continue
            try:
                r = run_peer(label, args, seed) if label in PEERS else run_edgetrain(label, args, seed, out)
            except Exception as e:  # one method failing (the peer's import, say) leaves the others' rows
                failures.append(f"{label} seed {seed}: {type(e).__name__}: {str(e).strip().splitlines()[-1]}")
                print(f"  {label:22} seed {seed}  FAILED: {failures[-1]}", flush=True)
                continue
            rows.append(r)
            print(f"  {label:22} seed {seed}  acc {100 * r['accuracy']:.2f}%  sent {r['bytes_per_device'] / 1e6:9.3f} "
                  f"MB/device  step {r['step_s']:.3f} s  (wall {r['wall_s']:.0f} s)", flush=True)
    text, stats = table(rows, labels, args.seeds)
    lines = [text, f"\nseeds {args.seeds} ({len(args.seeds)}; the target asks for >= 5); vs fp32: mean paired "
                   f"difference in points and its one-sided 95% lower bound (LCB; -inf with one seed)"]
    lines += [f"failed: {f}" for f in failures]
    lines += versus_peers(rows, labels, args.seeds)
    meeting = {k: v for k, v in stats.items() if k != "fp32" and v["diff_lcb"] >= -1.0}
    by_mean = {k: v for k, v in stats.items() if k != "fp32" and v["diff_mean"] is not None and v["diff_mean"] >= -1.0}
    for name, pool in (("LCB >= -1 point", meeting), ("mean >= -1 point", by_mean)):
        if pool:
            best = max(pool, key=lambda k: pool[k]["ratio"])
            lines.append(f"best bytes ratio with {name}: {best}, {pool[best]['ratio']:.0f}x fewer bytes than fp32 "
                         f"(target >= 300x), {pool[best]['diff_mean']:+.2f} points (LCB {pool[best]['diff_lcb']:+.2f})")
        else:
            lines.append(f"no method has {name}")
    link = link_part(args, out, lines) if args.link_methods else None
    report = "\n".join(lines)
    print("\n" + report)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.results.with_suffix(".json"), {"rows": rows, "stats": stats, "link": link,
                                                   "args": {k: str(v) for k, v in vars(args).items()}})
    with atomic_write(args.results.with_suffix(".txt"), "w") as f:
        f.write(report + "\n")
    if len(stats) > 1:
        plot(stats, args.results.with_name(args.results.name + "_frontier.png"),
             f"CIFAR-10 subset, 4 devices, {args.epochs} epochs: accuracy (mean over each method's seeds, n in the "
             f"table) vs bytes per device")
    return 0


if __name__ == "__main__":
    sys.exit(main())
