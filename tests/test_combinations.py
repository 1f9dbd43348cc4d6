"""The combination matrix: pairwise rows of task x data source x strategy x sync mode x compressor x the extras,
each factor's levels read from the kinds' registry (docs/design/combinations.md).

A row is refused in one line before any device starts, as ``config.resolve`` (every kind's declared refusals)
and the launcher's pre-flight decide, or trains 3 steps on 2 devices (4 with replicas) to a finite headline
metric. The default run checks every refused row in-process and one through the CLI, and trains a fixed seeded
subset of the others in one child process; ``EDGETRAIN_MATRIX=full`` trains them all and sends every refused row
through ``edgetrain train`` (slow).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from edgetrain.config import TrainConfig, resolve
from edgetrain.errors import EdgetrainError
from edgetrain.spec import KINDS, LaunchSpec

# Every family of kinds but the tasks (a factor of their own, with their data) is a factor; its levels are its
# kinds, written in the config key of the family's name, or the one named here.
CONFIG_KEY = {"server_optimizer": "server_opt"}
# Kinds of the Flower fleet's run config, not options of `edgetrain train`: the fleet's own tests combine them
FLEET_ONLY = ("availability",)
FAMILIES = tuple(family for family in KINDS if family != "task" and family not in FLEET_ONLY)
SOURCES = ("memory", "storage", "shards")

# What each task trains on from each source. A source a task has no data of is not a combination (edgetrain data
# pack refuses a regression set: "small enough to train from memory"); a task missing here fails by name.
TASK_DATA: dict[str, dict[str, dict]] = {
    "classification": {"memory": {"dataset": "digits"},
                       "storage": {"dataset": "imagefolder", "from_storage": True, "data_dir": "{folder}"},
                       "shards": {"dataset": "shards", "data_dir": "{folder_shards}"}},
    "regression": {"memory": {"dataset": "diabetes", "model": "mlp"}},
    "detection": {"memory": {"dataset": "shapes", "synthetic_samples": 16},
                  "storage": {"dataset": "yolo", "from_storage": True, "data_dir": "{yolo}"},
                  "shards": {"dataset": "shards", "data_dir": "{yolo_shards}"}},
}
TASK_SETTINGS = {"detection": {"image_size": 32}}


@dataclass(frozen=True)
class Extra:
    """An extra factor, off (its first level) or on: the config keys each sets, the words a refusal of it names,
    what it adds to a row's ``cost``, and the levels of other factors its option belongs to (``needs``: a row
    refused for a pair with it keeps them, so the refusal it meets is the pair's, not the missing owner's)."""
    on: dict
    names: tuple[str, ...]
    off: dict = dataclasses.field(default_factory=dict)
    cost: int = 0
    needs: dict = dataclasses.field(default_factory=dict)


# The extras. One whose "on" sets more devices than BASE's (replicas: 2 of 2 devices) trains in the whole matrix,
# and in one row of the fast tier.
EXTRAS: dict[str, Extra] = {
    "partition": Extra({"partition": "iid"}, ("partition",)),
    "elastic": Extra({"min_devices": 1}, ("min-devices", "elastic")),
    "checkpoint": Extra({"checkpoint_every": 1}, ("checkpoint", "resume"), cost=2),  # on: the run, then its resume
    "link": Extra({"link": "wifi-20m"}, ("link",)),
    "profile": Extra({"profile": "rpi4", "throttle": True}, ("profile", "throttle", "rpi4"), cost=3),
    "batchnorm": Extra({"batchnorm": "sync"}, ("batchnorm",)),
    "workers": Extra({"workers": 1}, ("workers",), cost=1),
    "cache": Extra({"cache_mb": 4.0}, ("cache",)),
    "augment": Extra({"augment": True}, ("augment",), off={"augment": False}),
    "dedup": Extra({"dedup": "on"}, ("dedup",), cost=1),  # a hash of every image
    "optimizer": Extra({"optimizer": "adam"}, ("optimizer", "adam", "momentum"), off={"optimizer": "sgd"}),
    "fsdp_replicas": Extra({"fsdp_replicas": 2, "devices": 4}, ("fsdp_replicas", "fsdp-replicas"), cost=2,
                           needs={"strategy": "fsdp"}),
    "pipeline_replicas": Extra({"pipeline_replicas": 2, "devices": 4}, ("pipeline_replicas", "pipeline-replicas"),
                               cost=2, needs={"strategy": "pipeline"}),
    "secagg": Extra({"secure_aggregation": True}, ("secure-aggregation",)),
    "dp": Extra({"dp": "clip=1.0,noise=1.0"}, ("'dp'", "--dp"), cost=1),  # per-sample gradients
}
# --dp computes per-sample gradients, which BatchNorm has none of: a task's default model with it is refused before
# any device starts (a line of its own, preflight), so a classifier trains the registry's GroupNorm model instead.
# Regression's mlp has no BatchNorm; detection's YOLO models have it and are refused so.
DP_MODELS = {"classification": "small_cnn_gn"}

BASE = {"devices": 2, "steps": 3, "batch_size": 16, "progress": False, "eval": True, "throttle": False,
        "timeout": 60.0, "seed": 0}


# ---------------------------------------------------------------- the levels, from the registry

def example_config(kind) -> dict:
    """A kind's example (``local:2``, ``tiled --grid 1x2``) as config keys; one line naming it if it has none."""
    words = kind.example_spec.split()
    if not words:
        raise AssertionError(f"{kind.family} {kind.name} has no example: add example='...' (its usage with the "
                             f"placeholders filled in) to its descriptor in edgetrain/kinds.py")
    key = CONFIG_KEY.get(kind.family, kind.family)
    if key not in TrainConfig.__dataclass_fields__:
        raise AssertionError(f"kind family {kind.family} has no config key: name it in CONFIG_KEY in "
                             f"{Path(__file__).name}")
    flags = dict(zip(words[1::2], words[2::2]))
    return {key: words[0], **{flag.removeprefix("--").replace("-", "_"): value for flag, value in flags.items()}}


def task_names() -> list[str]:
    return list(KINDS["task"])


def factors() -> dict[str, list[str]]:
    """Each factor's levels; the first is the default a refused row's other factors keep."""
    return {"task": task_names(), "source": list(SOURCES),
            **{family: list(KINDS[family]) for family in FAMILIES},
            **{name: ["off", "on"] for name in EXTRAS}}


def expressible(row: dict) -> bool:
    """Whether a (partial) row names data that exists: a task has data from each of its sources only."""
    task, source = row.get("task"), row.get("source")
    return task is None or source is None or source in TASK_DATA.get(task, {})


def row_config(row: dict, paths: dict[str, str] | None = None) -> dict:
    """The config of a row (factors left out: their first level); ``paths``: where the generated data lies."""
    levels = {name: row.get(name, values[0]) for name, values in factors().items()}
    task = levels["task"]
    if task not in TASK_DATA:
        raise AssertionError(f"task {task} has no data in the matrix: add it to TASK_DATA in {Path(__file__).name}")
    data = TASK_DATA[task].get(levels["source"], TASK_DATA[task]["memory"])
    cfg = {**BASE, "task": task, **TASK_SETTINGS.get(task, {}), **data}
    for family in FAMILIES:
        cfg.update(example_config(KINDS[family][levels[family]]))
    for name, extra in EXTRAS.items():
        cfg.update(extra.on if levels[name] == "on" else extra.off)
    if levels["dp"] == "on" and task in DP_MODELS:
        cfg["model"] = DP_MODELS[task]
    if paths is not None and "data_dir" in cfg:
        cfg["data_dir"] = cfg["data_dir"].format(**paths)
    return cfg


_DECIDED: dict[tuple, str | None] = {}


def refusal(row: dict) -> str | None:
    """The line ``config.resolve`` (every kind's declared refusals) gives a row's config, or None: accepted.
    Torch-free and cheap, what the generator asks of every candidate."""
    key = tuple(sorted(row.items()))
    if key not in _DECIDED:
        cfg = row_config(row)
        try:
            resolve(TrainConfig(**cfg), LaunchSpec())
            _DECIDED[key] = None
        except EdgetrainError as e:
            _DECIDED[key] = str(e)
    return _DECIDED[key]


# ---------------------------------------------------------------- pairwise rows

Pair = tuple[tuple[str, str], tuple[str, str]]


def pairs(row: dict, names: list[str]) -> set[Pair]:
    present = [n for n in names if n in row]
    return {((a, row[a]), (b, row[b])) for i, a in enumerate(present) for b in present[i + 1:]}


@dataclass(frozen=True)
class Row:
    levels: tuple[tuple[str, str], ...]
    accepted: bool
    pair: Pair | None = None          # a refused row: the pair it was made for (its other factors at default)

    @property
    def values(self) -> dict:
        return dict(self.levels)

    @property
    def id(self) -> str:
        v = self.values
        extras = "+".join(n for n in EXTRAS if v[n] == "on") or "plain"
        kinds = "-".join(v[family] for family in FAMILIES if family in v)
        return f"{v['task']}-{v['source']}-{kinds}-{extras}"


def all_pairs(levels: dict[str, list[str]], allowed: Callable[[dict], bool], refused: Callable[[dict], str | None],
              seed: int = 0, tries: int = 6, needs: Callable[[dict], dict] = lambda pair: {}) -> list[Row]:
    """Greedy all-pairs (AETG) aware of refusals: a pair counts as covered by a row that is accepted; a pair no
    candidate could cover so gets a row of its own, the pair and every other factor at its first level (or at the
    level ``needs(pair)`` names: what one of the two belongs to), which exercises the refusal. Rows are built
    factor by factor, each level chosen to keep the row accepted and cover the most uncovered pairs.
    Deterministic for a seed."""
    names, rng = list(levels), random.Random(seed)
    universe = sorted(p for i, a in enumerate(names) for b in names[i + 1:] for x in levels[a] for y in levels[b]
                      if allowed({a: x, b: y}) for p in [((a, x), (b, y))])
    uncovered, rows = set(universe), []

    def score(row: dict) -> tuple[bool, int]:
        return allowed(row) and refused(row) is None, len(pairs(row, names) & uncovered)

    while uncovered:
        best, best_score = None, (False, 0)
        for _ in range(tries):
            (a, x), (b, y) = rng.choice(sorted(uncovered))
            row = {a: x, b: y}
            rest = [n for n in names if n not in row]
            rng.shuffle(rest)
            for name in rest:
                row[name] = max(levels[name], key=lambda v: score({**row, name: v}))
            if score(row) > best_score:
                best, best_score = row, score(row)
        if best is not None and best_score[0] and best_score[1]:
            uncovered -= pairs(best, names)
            rows.append(Row(tuple((n, best[n]) for n in names), True))
            continue
        pair = min(uncovered)  # nothing accepted covers it: the pair, the rest at their defaults (or needs)
        row = {**{n: levels[n][0] for n in names}, **needs(dict(pair)), **dict(pair)}
        uncovered.discard(pair)
        if not allowed(row):
            continue
        accepted, levels_of_row = refused(row) is None, tuple((n, row[n]) for n in names)
        if accepted:
            uncovered -= pairs(row, names)
        if all(r.levels != levels_of_row for r in rows):  # a pair of a default level: another's row already
            rows.append(Row(levels_of_row, accepted, None if accepted else pair))
    return rows


def needed_levels(pair: dict) -> dict:
    """The levels of other factors that the pair's extras belong to (``Extra.needs``)."""
    return {name: level for factor, value in pair.items() if factor in EXTRAS and value == "on"
            for name, level in EXTRAS[factor].needs.items()}


def matrix(seed: int = 0) -> list[Row]:
    return all_pairs(factors(), expressible, refusal, seed=seed, needs=needed_levels)


@functools.cache
def rows() -> list[Row]:
    """The matrix of this checkout's kinds (made when the tests are collected, not in the fast rows' child)."""
    return matrix()


# ---------------------------------------------------------------- defects known and being fixed elsewhere

@dataclass(frozen=True)
class Known:
    applies: Callable[[dict], bool]   # of a row's config
    reason: str


def _on_storage(cfg):
    return cfg.get("from_storage", False) or cfg["dataset"] == "shards"


# Each entry: a predicate of a row's config and the defect. The integrator deletes an entry as its fix lands
# (strict xfail: a row that passes fails the test until its entry goes).
KNOWN_BROKEN: tuple[Known, ...] = ()


def known_broken(cfg: dict) -> Known | None:
    return next((k for k in KNOWN_BROKEN if k.applies(cfg)), None)


# ---------------------------------------------------------------- running a row

@dataclass
class Outcome:
    verdict: str        # trained, refused, failed
    line: str = ""      # the refusal, the failure, or the headline
    value: float | None = None


def headline(summary: dict) -> tuple[str, float | None]:
    task = summary.get("task") or {"headline": "accuracy"}
    value = (summary.get("test_metrics") or {}).get(task["headline"], summary.get("test_accuracy"))
    return task["headline"], value


def judge_summary(summary: dict | None) -> Outcome:
    if summary is None:
        return Outcome("failed", "no summary")
    name, value = headline(summary)
    if value is None or not math.isfinite(value):
        return Outcome("failed", f"headline {name} is {value!r}, not a finite number")
    return Outcome("trained", f"{name} {value:.4g}", value)


def run_in_process(cfg: dict, output: Path) -> Outcome:
    """One row through ``edgetrain.train`` in this process (the fast tier's many rows share its fork server)."""
    import traceback

    import edgetrain

    run_dir = output / cfg["run_name"]
    try:
        summary = edgetrain.train(cfg)
        if cfg.get("checkpoint_every"):
            summary = edgetrain.train({"resume": str(run_dir), "progress": False})
    except EdgetrainError as e:
        line = str(e)
        if run_dir.exists():
            return Outcome("failed", f"refused after the devices started: {line}")
        return Outcome("refused", line)
    except Exception as e:  # noqa: BLE001 - a crash is what the matrix is for
        return Outcome("failed", "".join(traceback.format_exception_only(e)).strip().splitlines()[-1])
    return judge_summary(summary)


def cli_flags(cfg: dict) -> list[str]:
    flags = []
    for key, value in cfg.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def run_cli_row(cfg: dict, output: Path, timeout_s: float) -> Outcome:
    """One row through ``edgetrain train`` in a fresh interpreter: exit 2 with one line and no run directory, or
    exit 0 and a finite headline in summary.json; bounded by ``timeout_s``."""
    run_dir = output / cfg["run_name"]
    commands = [cli_flags(cfg)]
    if cfg.get("checkpoint_every"):
        commands.append(["--resume", str(run_dir), "--no-progress"])
    for flags in commands:
        try:
            done = subprocess.run([sys.executable, "-m", "edgetrain", "train", *flags], capture_output=True,
                                  text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return Outcome("failed", f"no answer within {timeout_s:g} s (a hang)")
        err = done.stderr.strip().splitlines()
        if done.returncode == 2:
            if "Traceback" in done.stderr or len(err) != 1:
                return Outcome("failed", f"exit 2 in {len(err)} lines: {' | '.join(err[-3:])}")
            if run_dir.exists() and flags is commands[0]:
                return Outcome("failed", f"refused after the devices started: {err[0]}")
            return Outcome("refused", err[0].removeprefix("edgetrain: error: "))
        if done.returncode != 0:
            return Outcome("failed", f"exit {done.returncode}: {' | '.join(err[-3:]) or done.stdout[-300:]}")
    summary = run_dir / "summary.json"
    return judge_summary(json.loads(summary.read_text()) if summary.is_file() else None)


def run_batch(configs: list[dict], output: Path, per_row_s: float) -> dict[str, Outcome]:
    """Rows through ``edgetrain.train`` in one child process, which shares its fork server among them; a row
    that gives no outcome within ``per_row_s`` is a hang: the child and its devices are killed, the rest go on
    in a new one. Outcomes by run name."""
    import signal

    child = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_combinations; "
             f"test_combinations.run_rows(sys.stdin.read(), sys.argv[1])")
    outcomes: dict[str, Outcome] = {}
    while len(outcomes) < len(configs):
        rest = [c for c in configs if c["run_name"] not in outcomes]
        proc = subprocess.Popen([sys.executable, "-c", child, str(output)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        proc.stdin.write(json.dumps(rest).encode())
        proc.stdin.close()
        lines = _lines(proc.stdout.fileno(), per_row_s)
        for cfg in rest:
            line = next(lines, None)
            if line is None:
                why = f"no outcome within {per_row_s:g} s (a hang)" if proc.poll() is None else "its process died"
                outcomes[cfg["run_name"]] = Outcome("failed", why)
                break
            record = json.loads(line)
            outcomes[record["run_name"]] = Outcome(record["verdict"], record["line"], record["value"])
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and any device it left
        except ProcessLookupError:
            pass
        proc.wait()
        proc.stdout.close()
    return outcomes


def _lines(fd: int, within_s: float):
    """The lines read from ``fd``, each within ``within_s`` of the one before; ends at a silence or the end."""
    import selectors

    buffer = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            while b"\n" not in buffer:
                chunk = os.read(fd, 1 << 16) if sel.select(within_s) else b""
                if not chunk:
                    return
                buffer += chunk
            line, buffer = buffer.split(b"\n", 1)
            yield line.decode()


def wrong_blame(row: Row, line: str) -> str | None:
    """Why a refusal blames the wrong thing, or None: a lookup that failed ('unknown ...'), or, for a row made
    for one refused pair, a line naming neither of its two factors."""
    if re.search(r"\bunknown\b", line, re.I):
        return "a lookup that failed, not a refusal declared beside a kind"
    if row.pair is None:
        return None
    words = []
    for name, level in row.pair:
        words += list(EXTRAS[name].names) if name in EXTRAS else [level]
        words += list(TASK_DATA.get(level, {}).get("memory", {}).values()) if name == "task" else []
        words += [TASK_DATA[row.values["task"]].get(level, {}).get("dataset", level)] if name == "source" else []
    if not any(w.lower() in line.lower() for w in words if isinstance(w, str)):
        return f"names none of {', '.join(f'{n}={v}' for n, v in row.pair)}"
    return None


def check(row: Row, outcome: Outcome) -> None:
    """The matrix's verdict on one row, in one assertion line."""
    assert outcome.verdict != "failed", f"{row.id}: {outcome.line}"
    if outcome.verdict == "refused":
        blame = wrong_blame(row, outcome.line)
        assert blame is None, f"{row.id}: refusal {blame}: {outcome.line}"
        assert "\n" not in outcome.line.strip(), f"{row.id}: a refusal of more than one line: {outcome.line}"
    else:
        assert row.accepted, f"{row.id}: trained, but resolve refuses it: {refusal(row.values)}"


# ---------------------------------------------------------------- the data rows train on

def make_data(root: Path) -> dict[str, str]:
    """A tiny image folder, YOLO folder and their shards (and digits' and the YOLO set's), under ``root``."""
    import numpy as np
    from PIL import Image

    from edgetrain.data.datasets import digits
    from edgetrain.data.detection import shapes_image
    from edgetrain.data.shards import pack
    from edgetrain.data.storage import yolo_on_storage

    rng = np.random.default_rng(0)
    folder, yolo = root / "folder", root / "yolo"
    for c in range(3):
        (folder / f"c{c}").mkdir(parents=True)
        template = rng.integers(0, 255, (12, 12, 3))
        for k in range(16):
            a = np.clip(template * 0.6 + rng.integers(0, 255, (12, 12, 3)) * 0.4, 0, 255).astype(np.uint8)
            Image.fromarray(a).save(folder / f"c{c}" / f"{k:03d}.png")
    (yolo / "images").mkdir(parents=True)
    (yolo / "labels").mkdir()
    for k in range(24):
        image, boxes = shapes_image(np.random.default_rng(k), 32)
        Image.fromarray(image.transpose(1, 2, 0)).save(yolo / "images" / f"{k:03d}.png")
        # edges kept inside the image: a label whose box ends past 1.0 is another defect (see KNOWN_BROKEN)
        lines = [f"{int(b[0])} {b[1]:.4f} {b[2]:.4f} {min(b[3], 2 * min(b[1], 1 - b[1])):.4f} "
                 f"{min(b[4], 2 * min(b[2], 1 - b[2])):.4f}\n" for b in boxes]
        (yolo / "labels" / f"{k:03d}.txt").write_text("".join(lines))
    pack(digits(0), root / "folder_shards")
    pack(yolo_on_storage(yolo, 32, seed=0), root / "yolo_shards", detection=True)
    return {"folder": str(folder), "yolo": str(yolo), "folder_shards": str(root / "folder_shards"),
            "yolo_shards": str(root / "yolo_shards")}


def named_config(row: Row, paths: dict, output: Path) -> dict:
    return {**row_config(row.values, paths), "output": str(output), "run_name": re.sub(r"[^\w.-]", "_", row.id)}


# ---------------------------------------------------------------- the fast tier

FAST_BUDGET = 7   # the default run's rows on BASE's devices, in the units of ``cost``


def cost(row: Row) -> int:
    """A row's rough cost: one unit a run, more for a detector, a pooled model and each extra's ``cost`` (a throttled
    profile, a resume, replicas, a hash of every image, a loader worker)."""
    v = row.values
    return (1 + 2 * (v["task"] == "detection") + KINDS["strategy"][v["strategy"]].pooled
            + sum(extra.cost for name, extra in EXTRAS.items() if v[name] == "on"))


def wide(row: Row) -> bool:
    """Whether a row trains on more devices than BASE's (replicas)."""
    return row_config(row.values)["devices"] > BASE["devices"]


@functools.cache
def fast_rows() -> list[Row]:
    """A fixed seeded subset of the accepted rows on BASE's devices within ``FAST_BUDGET``, one of each task first;
    then the cheapest row on more devices, the one of them the default run trains."""
    candidates = [r for r in rows() if r.accepted]
    random.Random(1).shuffle(candidates)
    chosen, spent = [], 0
    for first in (True, False):
        for row in sorted(candidates, key=cost) if first else candidates:
            novel = all(c.values["task"] != row.values["task"] for c in chosen)
            if (not wide(row) and row not in chosen and (novel or not first)
                    and spent + cost(row) <= FAST_BUDGET):
                chosen.append(row)
                spent += cost(row)
    return chosen + sorted(filter(wide, candidates), key=cost)[:1]


# Each row's bound in a batch (a row silent longer is a hang), and a refused row's through the CLI (each command).
FAST_ROW_S, FULL_ROW_S, CLI_ROW_S = 180, 300, 120


def batch_timeout(rows: list[Row], per_row_s: float) -> float:
    """The limit of a test of a batch: its fixture, in the first test, waits for every row (trained, or refused
    through the CLI, resumed with checkpoints on), each within its bound; and makes the data first."""
    return 120 + sum(per_row_s if r.accepted else 2 * CLI_ROW_S for r in rows)


def marked(rows: list[Row], per_row_s: float) -> list:
    params, limit = [], pytest.mark.timeout(batch_timeout(rows, per_row_s))
    for row in rows:
        known = known_broken(row_config(row.values))
        marks = [pytest.mark.xfail(strict=True, reason=known.reason)] if known else []
        params.append(pytest.param(row, id=row.id, marks=[*marks, limit]))
    return params


def test_every_kind_has_an_example_that_parses_as_itself():
    from edgetrain.kinds import strategy_kind
    from edgetrain.spec import parse_compress, parse_server_opt, parse_sync

    parse = {"strategy": strategy_kind, "sync": lambda text: parse_sync(text).kind,
             "compress": lambda text: parse_compress(text).kind,
             "server_optimizer": lambda text: parse_server_opt(text).kind}
    for family in FAMILIES:
        assert family in parse, f"kind family {family} has no parser in this test: add it to parse"
        for kind in KINDS[family].values():
            cfg = example_config(kind)
            assert parse[family](cfg[CONFIG_KEY.get(family, family)]) is kind, (family, kind.name, kind.example_spec)
            TrainConfig(**{**BASE, **cfg})  # its options are config keys
    for task in task_names():
        row_config({"task": task})  # a task without data in the matrix fails by name


def test_the_rows_cover_every_pair_and_every_kind():
    levels = factors()
    names = list(levels)
    covered = set().union(*(pairs(r.values, names) for r in rows()))
    wanted = {p for i, a in enumerate(names) for b in names[i + 1:] for x in levels[a] for y in levels[b]
              if expressible({a: x, b: y}) for p in [((a, x), (b, y))]}
    assert wanted <= covered, sorted(wanted - covered)[:5]
    trained = {(n, v) for r in rows() if r.accepted for n, v in r.values.items()}
    assert {("compress", c) for c in KINDS["compress"]} | {("sync", s) for s in KINDS["sync"]} <= trained


def test_the_generator_is_seeded_and_keeps_refused_pairs_apart():
    levels = {"a": ["0", "1", "2"], "b": ["0", "1"], "c": ["0", "1"]}
    refused = lambda row: "a2 with b1" if (row.get("a"), row.get("b")) == ("2", "1") else None  # noqa: E731
    made = all_pairs(levels, lambda row: True, refused, seed=3)
    assert made == all_pairs(levels, lambda row: True, refused, seed=3)
    assert [r.values for r in made if not r.accepted] == [{"a": "2", "b": "1", "c": "0"}]
    names = list(levels)
    wanted = {p for i, a in enumerate(names) for b in names[i + 1:] for x in levels[a] for y in levels[b]
              for p in [((a, x), (b, y))]} - {(("a", "2"), ("b", "1"))}
    assert wanted <= set().union(*(pairs(r.values, names) for r in made if r.accepted))


def test_a_refused_pair_keeps_the_level_its_extra_belongs_to():
    # "opt" is an option of owner y (refused with x); with y it is refused beside a=1: that row is the pair's
    levels = {"a": ["0", "1"], "owner": ["x", "y"], "opt": ["off", "on"]}

    def refused(row):
        if row.get("opt") == "on":
            return "opt needs owner y" if row.get("owner", "x") != "y" else "opt with a=1" if row.get("a") == "1" \
                else None
        return None

    made = all_pairs(levels, lambda row: True, refused, needs=lambda pair: {"owner": "y"} if "opt" in pair else {})
    assert {"a": "1", "owner": "y", "opt": "on"} in [r.values for r in made if not r.accepted]
    assert {"a": "0", "owner": "x", "opt": "on"} in [r.values for r in made if not r.accepted]  # the owner's pair
    # the matrix's replicas: a sync mode they cannot run between them is refused with their strategy
    row = next(r for r in rows() if r.pair == (("sync", "async"), ("fsdp_replicas", "on")))
    assert row.values["strategy"] == "fsdp" and "between the replicas" in refusal(row.values)


def test_a_kind_declared_later_joins_the_matrix():
    from edgetrain.kinds import CompressKind

    try:
        CompressKind(name="matrix_probe", usage="matrix_probe:RATIO", summary="a probe", runtime="x:y",
                     planner="x:y", check_arguments=lambda *a: None)
        assert "matrix_probe" in factors()["compress"]
        with pytest.raises(AssertionError, match="compress matrix_probe has no example"):
            row_config({"compress": "matrix_probe"})
    finally:
        KINDS["compress"].pop("matrix_probe", None)


def test_a_refused_row_is_refused_in_one_line_naming_its_pair(row):
    line = refusal(row.values)
    assert line is not None and "\n" not in line
    check(row, Outcome("refused", line))


def test_a_refused_row_through_the_cli_is_one_line_and_no_run_directory(tmp_path):
    row = next(r for r in rows() if not r.accepted and r.values["task"] == "classification")
    outcome = run_cli_row(named_config(row, {}, tmp_path), tmp_path, timeout_s=120)
    assert outcome.verdict == "refused" and outcome.line == refusal(row.values), outcome
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def fast_outcomes(tmp_path_factory):
    """The fast rows trained in one child process (its own fork server), each bounded."""
    root = tmp_path_factory.mktemp("matrix")
    paths = make_data(root / "data")
    return run_batch([named_config(r, paths, root / "runs") for r in fast_rows()], root / "runs",
                     per_row_s=FAST_ROW_S)


def test_a_fast_row_trains_or_is_refused_before_any_device(row, fast_outcomes):
    name = re.sub(r"[^\w.-]", "_", row.id)
    check(row, fast_outcomes.get(name, Outcome("failed", "no outcome (the batch stopped before it)")))


# ---------------------------------------------------------------- the whole matrix (opt-in)

FULL = os.environ.get("EDGETRAIN_MATRIX") == "full"


@pytest.fixture(scope="module")
def full_outcomes(tmp_path_factory):
    """Every row resolve accepts, trained in batches as the fast rows; the refused ones go through the CLI."""
    root = tmp_path_factory.mktemp("matrix_full")
    paths = make_data(root / "data")
    configs = {r.id: named_config(r, paths, root / "runs") for r in rows()}
    trained = run_batch([configs[r.id] for r in rows() if r.accepted], root / "runs", per_row_s=FULL_ROW_S)
    return {r.id: trained[configs[r.id]["run_name"]] if r.accepted else
            run_cli_row(configs[r.id], root / "runs", timeout_s=CLI_ROW_S) for r in rows()}


@pytest.mark.slow
def test_every_row(row, full_outcomes):
    check(row, full_outcomes[row.id])


def row_params(test, full: bool) -> list | None:
    """The rows of a test of rows, or None for another test."""
    of_test = {
        test_a_refused_row_is_refused_in_one_line_naming_its_pair:
            lambda: [pytest.param(r, id=r.id) for r in rows() if not r.accepted],
        test_a_fast_row_trains_or_is_refused_before_any_device: lambda: marked(fast_rows(), FAST_ROW_S),
        test_every_row: lambda: marked(rows(), FULL_ROW_S) if full else [
            pytest.param(None, id="all", marks=pytest.mark.skip(reason="the whole matrix: EDGETRAIN_MATRIX=full"))],
    }
    return of_test[test]() if test in of_test else None


def pytest_generate_tests(metafunc):
    """The rows of each test of rows, made as the tests are collected (not when ``run_batch``'s child imports this
    module to train them)."""
    params = row_params(metafunc.function, FULL)
    if params is not None:
        metafunc.parametrize("row", params)


def test_a_test_that_waits_for_its_batch_is_bounded_by_its_rows_not_by_one_tests_timeout(pytestconfig):
    # the first test of a batch waits in its fixture for every row: the whole matrix takes far longer than the
    # suite's timeout of one test, and the fast rows may too on a loaded host
    default = float(pytestconfig.getini("timeout") or 0)
    for test, per_row_s in ((test_every_row, FULL_ROW_S), (test_a_fast_row_trains_or_is_refused_before_any_device,
                                                           FAST_ROW_S)):
        params = row_params(test, full=True)
        need = sum(per_row_s if row.accepted else 2 * CLI_ROW_S for row in (p.values[0] for p in params))
        for param in params:
            limit = next((m.args[0] for m in param.marks if m.name == "timeout"), default)
            assert limit >= need, (test.__name__, limit, need)


def run_rows(configs: str, output: str) -> None:
    """``run_batch``'s child: each config through ``edgetrain.train``, one JSON line of its outcome on stdout,
    where nothing else goes (what the runs print goes to stderr)."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for cfg in json.loads(configs):
        started = time.monotonic()
        outcome = run_in_process(cfg, Path(output))
        print(json.dumps({"run_name": cfg["run_name"], "wall_s": round(time.monotonic() - started, 1),
                          **dataclasses.asdict(outcome)}), file=out, flush=True)
