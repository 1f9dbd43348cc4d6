"""The spec layer: options parsed once into frozen specs, refused in one place, imported without torch."""
from __future__ import annotations

import ast
import dataclasses
import functools
import itertools
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from edgetrain.config import TrainConfig, load_config, resolve
from edgetrain.errors import EdgetrainError
from edgetrain.spec import PRESETS, RunSpec, TilingSpec, parse_compress, parse_tiling

from edgetrain_testing import FAST, run_cli, run_main

SRC = Path(__file__).resolve().parents[1] / "src" / "edgetrain"


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A source file's tree, parsed once for all the structure tests."""
    return ast.parse(path.read_text())


def edgetrain_imports(path: Path) -> set[str]:
    """Every edgetrain module a file imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m == "edgetrain" or m.startswith("edgetrain.") or m == "torch"
            or m.startswith("torch.")}


def test_spec_imports_nothing_of_edgetrain_but_errors():
    assert edgetrain_imports(SRC / "spec.py") == {"edgetrain.errors"}


def test_config_imports_only_the_spec_layer():
    assert edgetrain_imports(SRC / "config.py") == {"edgetrain.errors", "edgetrain.kinds", "edgetrain.spec",
                                                    "edgetrain.yamlfile"}


# The layering docs/design/architecture.md ("Where a change goes") states. The bottom: torch-free, importing only itself.
BOTTOM = ("errors", "spec", "kinds", "records", "results", "yamlfile", "files")
# A package and the packages above it that it must not import.
ABOVE = {
    **dict.fromkeys(("cluster", "comm", "data", "models", "pipelining", "tiling"),
                    {"config", "bench", "plan", "report", "train", "privacy", "cli", "preflight", "ssh_launch",
                     "data_cli"}),
    # the gradient-inversion attack: builds observers' views from models, comm and data, and is used by nothing
    "privacy": {"config", "bench", "plan", "report", "train", "cli", "preflight", "ssh_launch", "data_cli"},
    "report": {"bench", "plan", "train"},  # renders runs from the bottom layer's schemas
    "bench": {"plan", "train"},  # runs the trainer as a process (trainer_runs), never imports it
    "plan": {"bench", "train"},
    "train": {"bench", "plan"},  # what the trainer shares with them sits below all three
}


# Every top-level module and package in tiers, lowest first: a module imports only its own tier and those below,
# at its top or inside a function (the names in kinds.py's loaders are strings, imported where a kind is used).
TIERS = (
    {*BOTTOM, "arguments"},
    {"config", "cluster"},
    {"comm", "data", "models", "pipelining"},
    {"tasks"},  # a task's loss and metrics over the models' outputs; the one FLOP counter takes the task's loss
    {"tiling"},
    {"privacy"},
    {"report"},
    {"bench", "plan", "train"},  # side by side: none imports another (ABOVE); train's pre-launch checks included
    {"fleet", "cli", "ssh_launch", "data_cli", "certs", "__init__", "__main__"},
)


def edgetrain_units(path: Path) -> set[str]:
    """The top-level edgetrain modules and packages a file imports: ``edgetrain.cluster.links`` -> cluster."""
    return {m.split(".")[1] for m in edgetrain_imports(path) if m.startswith("edgetrain.")}


def test_the_bottom_layer_imports_only_itself():
    for name in BOTTOM:
        path = SRC / f"{name}.py"
        assert edgetrain_units(path) <= set(BOTTOM) and "torch" not in edgetrain_imports(path), name


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_no_package_imports_one_above_it(package):
    for path in sorted((SRC / package).rglob("*.py")):
        upward = edgetrain_units(path) & ABOVE[package]
        assert not upward, f"{path.relative_to(SRC)} imports {sorted(upward)}, above {package}"


def test_every_module_has_a_tier():
    units = {p.name.removesuffix(".py") for p in SRC.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert units == set().union(*TIERS)


def test_no_module_imports_a_tier_above_its_own():
    tier = {unit: i for i, units in enumerate(TIERS) for unit in units}
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        unit = path.relative_to(SRC).parts[0].removesuffix(".py")
        upward += [f"{path.relative_to(SRC)} imports edgetrain.{other}" for other in sorted(edgetrain_units(path))
                   if tier[other] > tier[unit]]
    assert upward == []


SPINE = [*sorted((SRC / "train").glob("*.py")), SRC / "cluster" / "launch.py", SRC / "config.py",
         *sorted((SRC / "bench").glob("*.py")), *sorted((SRC / "plan").glob("*.py"))]


def test_the_run_spine_has_no_function_over_sixty_lines():
    """The trainer, the launcher, the config, the benches and the planner stay in small functions: a new
    capability goes into the phase, kind or strategy it belongs to (docs/design/architecture.md, "A run's
    spine"), a bench's or a plan's into a named step, not a longer function."""
    long = [f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in SPINE for node in ast.walk(parsed(path))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert long == []


def parameter_counts() -> dict[str, int]:
    """Every function in src/ over seven parameters (``self`` and ``cls`` not counted; ``*args``/``**kw`` neither)."""
    counts = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(parsed(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                n = len([p for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")])
                if n > 7:
                    counts[f"{path.relative_to(SRC)}:{node.name}"] = n
    return counts


# Not grouped yet: each of these may only leave the list (the test fails when one is fixed and still listed).
# A bench's run takes one keyword per option of its command (tests and benchmarks call it so).
OVER_SEVEN_PARAMETERS = {
    "bench/batch.py:run", "bench/counters.py:run", "bench/power.py:run", "bench/stalls.py:run",
    "bench/variability.py:run", "bench/workload.py:time_steps", "bench/workload.py:measure_steps_isolated",
    "data/storage.py:__init__", "fleet/app.py:local_update",
}


def test_no_function_takes_more_than_seven_parameters():
    """More are grouped into the frozen specs, the RunPlan or a small dataclass of what belongs together
    (``checkpoint.Writers``, ``energy.Sensors``, ``launch.Deadline``, ``detection.RegionScales``)."""
    counts = parameter_counts()
    assert sorted(set(counts) - OVER_SEVEN_PARAMETERS) == []
    assert sorted(OVER_SEVEN_PARAMETERS - set(counts)) == [], "grouped now: take it off the list"


# Docstrings still carrying design prose (records.py and results.py list their schemas). May only shrink.
LONG_DOCSTRINGS = {"records.py", "results.py"}


def test_module_docstrings_are_short_and_point_to_the_design():
    """What a module is for and where to look, in a few lines; the design prose lives in docs/design/."""
    long = {str(path.relative_to(SRC)) for path in SRC.rglob("*.py")
            if len((ast.get_docstring(parsed(path), clean=False) or "").splitlines()) > 25}
    assert sorted(long - LONG_DOCSTRINGS) == []
    assert sorted(LONG_DOCSTRINGS - long) == [], "short now: take it off the list"


def function_imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """The import statements inside a file's functions (each once, nested functions included)."""
    functions = [fn for fn in ast.walk(parsed(path)) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found = {node.lineno: node for fn in functions for node in ast.walk(fn)
             if isinstance(node, (ast.Import, ast.ImportFrom))}
    return list(found.values())


def imported_names(node: ast.Import | ast.ImportFrom) -> set[str]:
    """What a statement imports: ``from edgetrain.report import plots`` -> edgetrain.report.plots (a module), else
    the module it imports from."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    names = set()
    for alias in node.names:
        module = f"{node.module}.{alias.name}"
        where = SRC.joinpath(*module.split(".")[1:])
        names.add(module if where.with_suffix(".py").is_file() or (where / "__init__.py").is_file() else node.module)
    return names


LAZY_COMMENT = "# Imported inside functions:"


def lazy_comment(path: Path) -> list[str]:
    """Each ``# Imported inside functions:`` comment of a file, its continuation lines joined."""
    lines, said = path.read_text().splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith(LAZY_COMMENT):
            rest = itertools.takewhile(lambda s: s.startswith("# "), lines[i + 1:])
            said.append(" ".join([line, *(s[2:] for s in rest)]))
    return said


def test_a_module_says_once_why_it_imports_inside_functions():
    """Imports inside functions only where start-up needs them (torch, matplotlib and the extras out of
    ``edgetrain --help``, bad input and the torch-free modules): one comment near the top imports says which and
    why, and names every package other than edgetrain that a function imports."""
    unsaid, stale, unnamed = set(), [], []
    for path in sorted(SRC.rglob("*.py")):
        name, lazy, said = str(path.relative_to(SRC)), function_imports(path), lazy_comment(path)
        roots = {m.split(".")[0] for node in lazy for m in imported_names(node)} - {"edgetrain"}
        if lazy and not said:
            unsaid.add(name)
        elif len(said) > 1 or (said and not lazy):
            stale.append(f"{name}: {len(said)} comments, {len(lazy)} imports inside functions")
        unnamed += [f"{name}: {root}" for root in sorted(roots) if said and not re.search(rf"\b{root}\b", said[0])]
    assert stale == []
    assert unnamed == [], "name it in the module's comment, with why it is imported inside functions"
    assert sorted(unsaid) == [], "say why once: a '# Imported inside functions:' comment naming what and why"


# The edgetrain modules each module imports inside a function, kept out of its start-up (torch, matplotlib, a cycle);
# the rest are at the module's top, where they show the dependency graph. May only shrink.
LAZY_EDGETRAIN_IMPORTS = {
    "bench/batch.py": {"edgetrain.report.plots", "edgetrain.tasks.flops"},
    "bench/cli.py": {"edgetrain.data.cifar", "edgetrain.models"},
    "bench/counters.py": {"edgetrain.report.plots"},
    "bench/peak.py": {"edgetrain.cluster.peers", "edgetrain.report.plots"},
    "bench/power.py": {"edgetrain.report.plots"},
    "bench/scaling.py": {"edgetrain.report.plots"},
    "bench/stalls.py": {"edgetrain.data.sampler", "edgetrain.data.shards", "edgetrain.data.storage", "edgetrain.models",
                        "edgetrain.report.plots", "edgetrain.tasks.classification"},
    "bench/variability.py": {"edgetrain.report.plots"},
    "bench/workload.py": {"edgetrain.cluster.throttle", "edgetrain.models", "edgetrain.tasks.classification"},
    "comm/setup.py": {"edgetrain.comm.secagg"},
    "data_cli.py": {"edgetrain.data", "edgetrain.data.dedup", "edgetrain.data.shards", "edgetrain.train.preflight"},
    "fleet/simulation.py": {"edgetrain.fleet.app"},
    "plan/cli.py": {"edgetrain.plan.config", "edgetrain.plan.report", "edgetrain.plan.simulation",
                    "edgetrain.plan.strategies"},
    "privacy/observe.py": {"edgetrain.comm.secagg"},
    "report/cli.py": {"edgetrain.report.html"},
    "report/fleet.py": {"edgetrain.report.plots"},
    "report/html.py": {"edgetrain.report.plots"},
    "report/training.py": {"edgetrain.report.plots"},
    "ssh_launch.py": {"edgetrain.cluster.peers"},
    "tiling/layers.py": {"edgetrain.tiling"},
    "train/__init__.py": {"edgetrain.cluster.peers", "edgetrain.data", "edgetrain.data.datasets", "edgetrain.tasks",
                          "edgetrain.train.checkpoint", "edgetrain.train.loop"},
    "train/cli.py": {"edgetrain.report.tables"},
    "train/run_plan.py": {"edgetrain.cluster.peers", "edgetrain.data", "edgetrain.data.datasets",
                          "edgetrain.data.device_data", "edgetrain.data.partition", "edgetrain.data.storage",
                          "edgetrain.models", "edgetrain.train.checkpoint", "edgetrain.train.preflight"},
}


def test_edgetrain_modules_are_imported_inside_functions_only_where_listed():
    found = {str(path.relative_to(SRC)): {m for node in function_imports(path) for m in imported_names(node)
                                         if m.startswith("edgetrain.")} for path in sorted(SRC.rglob("*.py"))}
    found = {name: modules for name, modules in found.items() if modules}
    new = sorted(f"{name}: {m}" for name, modules in found.items()
                 for m in modules - LAZY_EDGETRAIN_IMPORTS.get(name, set()))
    assert new == [], "import it at the module's top (or say why not in its LAZY_COMMENT, and list it here)"
    hoisted = sorted(f"{name}: {m}" for name, modules in LAZY_EDGETRAIN_IMPORTS.items()
                     for m in modules - found.get(name, set()))
    assert hoisted == [], "at the top now: take it off the list"


def test_importing_edgetrain_config_spec_and_html_leaves_torch_out():
    code = ("import sys, edgetrain, edgetrain.config, edgetrain.spec, edgetrain.report.html, edgetrain.results, "
            "edgetrain.report.plan_page; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_edgetrain_train_is_the_function_whatever_was_imported_first():
    """A plain module (no class swapped in to catch the subpackage's binding): the function is bound after it."""
    code = ("import edgetrain.train.loop, edgetrain, edgetrain.train.checkpoint; "
            "print(callable(edgetrain.train), edgetrain.train.__module__, edgetrain.TrainConfig.__name__, "
            "type(edgetrain).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "edgetrain.train", "TrainConfig", "module"]


def test_resolve_parses_every_option_into_frozen_specs():
    spec = resolve(load_config(None, compress="topk:0.01:dgc", momentum=0, sync="sync", link="lte-10m", timeout=45,
                               seed=3))
    assert isinstance(spec, RunSpec)
    assert spec.compress.method == "topk" and spec.compress.is_dgc and spec.sync.mode == "sync"
    assert spec.link == PRESETS["lte-10m"] and spec.timeout_s == 45 and spec.seed == 3
    assert spec.strategy == "ddp" and spec.tiling is None
    for obj, name in ((spec, "timeout_s"), (spec.compress, "arg"), (spec.sync, "period"), (spec.link, "loss")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, 1)
    with pytest.raises(TypeError):
        spec.compress.options["dgc"] = False  # the options of a frozen spec are read-only too


def test_resolve_gives_a_tiling_spec_for_tiled():
    spec = resolve(load_config(None, strategy="tiled", grid="1x2", groups="4,8", devices=2))
    assert spec.tiling == TilingSpec((1, 2), (4, 8)) and spec.tiling.devices == 2
    assert parse_tiling("2x2", "auto") == TilingSpec((2, 2), None)


def test_run_spec_survives_pickling_to_the_devices():
    spec = resolve(load_config(None, compress="topk:0.01:warmup=5", sync="local:4:nesterov", link="wifi-20m"))
    again = pickle.loads(pickle.dumps(spec))
    assert again == spec and dict(again.compress.options) == {"warmup": 5.0}
    assert hash(parse_compress("topk:0.01:compact")) == hash(parse_compress("topk:0.01:compact"))


@pytest.mark.parametrize("overrides, message", [
    (dict(compress="topk:0.01"), "config key 'compress' topk:0.01 does not apply to strategy tiled.*drop --compress"),
    (dict(sync="local:4"), "config key 'sync' local:4 does not apply to strategy tiled.*drop --sync"),
    (dict(link="lte-10m"), "config key 'link' lte-10m does not apply to strategy tiled.*drop --link"),
])
def test_tiled_refuses_what_it_would_ignore(overrides, message):
    with pytest.raises(EdgetrainError, match=message):
        load_config(None, strategy="tiled", grid="1x2", devices=2, **overrides)


@pytest.mark.parametrize("overrides, message", [
    (dict(grid="2x2"), "config key 'grid' 2x2 needs strategy tiled"),
    (dict(groups="4,8"), "config key 'groups' 4,8 needs strategy tiled"),
])
def test_tiling_options_without_tiled_are_refused(overrides, message):
    with pytest.raises(EdgetrainError, match=message):
        load_config(None, **overrides)


def test_resolve_checks_a_config_built_by_hand():
    with pytest.raises(EdgetrainError, match="needs the fraction of entries"):
        resolve(TrainConfig(compress="topk"))


def test_cli_refuses_tiled_with_a_link_in_one_line(tmp_path):
    out = tmp_path / "runs"
    proc = run_cli("train", "--strategy", "tiled", "--grid", "1x2", "--devices", "2", "--link", "lte-10m",
                   "--output", str(out), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "edgetrain: error: config key 'link' lte-10m does not apply to strategy tiled, which does not emulate links "
        "(its exchanges run on the host's network); drop --link or use --strategy ddp"]
    assert not out.exists()


def test_cli_trains_with_compression_on_two_devices(tmp_path):
    flags = [f"--{k.replace('_', '-')}" if v is True else f"--no-{k}" if v is False else f"--{k}={v}"
             for k, v in FAST.items()]
    proc = run_main("train", "--devices", "2", "--steps", "3", "--compress", "topk:0.01", "--sync", "sync",
                    "--dataset", "synthetic", "--synthetic-samples", "128", "--batch-size", "16", *flags,
                    "--output", str(tmp_path), "--run-name", "topk")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "topk" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["compress"] == "topk:0.01" and summary["compression_ratio"] > 10
