"""mkdocs hook: the command-line reference and the device profiles, generated at build time from the code.

Every page may hold the marker ``<!-- edgetrain-cli-reference -->``; the hook replaces it with one
section per command and subcommand of ``edgetrain.cli.build_parser()``. Options of ``edgetrain train``
(and of the commands that reuse them, such as ``plan``) come from ``TrainConfig``'s field metadata
(``edgetrain.config.FIELDS``: default, help, choices, minimum), the others from their argparse
definitions, so nothing here is written twice: an option added in the code appears on the next build.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

MARKER = "<!-- edgetrain-cli-reference -->"
PROFILES_MARKER = "<!-- edgetrain-profiles -->"


def _edgetrain_on_path(config) -> None:
    src = Path(config.config_file_path).resolve().parent / "src"
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _default(action: argparse.Action, fields: dict) -> str:
    import dataclasses

    if action.dest in fields:
        value = fields[action.dest].default
        if value is dataclasses.MISSING:
            return ""
        if isinstance(value, bool):
            return "on" if value else "off"
        return _code("none" if value is None else str(value))
    if action.default in (None, argparse.SUPPRESS) or isinstance(action, (argparse._HelpAction,
                                                                            argparse._VersionAction)):
        return ""
    if isinstance(action.default, (list, tuple)):
        return _code(",".join(str(v) for v in action.default))
    return _code(str(action.default))


def _help(action: argparse.Action, fields: dict) -> str:
    if action.dest in fields:
        meta = fields[action.dest].metadata
        text = meta["help"]
        if meta.get("min") is not None:
            text += f" (at least {meta['min']})"
        return _cell(text)
    text = action.help or ""
    if "%(" in text:
        try:
            text = text % {"default": action.default, "prog": "", "choices": action.choices,
                           "metavar": action.metavar, "dest": action.dest}
        except (KeyError, TypeError, ValueError):
            pass
    return _cell(text)


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        name = action.metavar or action.dest
        return f"`{name}`"
    names = list(action.option_strings)
    if isinstance(action, argparse.BooleanOptionalAction):
        names = [n for n in names if not n.startswith("--no-")]
        return " ".join(f"`{n}` / `--no-{n[2:]}`" for n in names)
    metavar = action.metavar
    if metavar is None and action.nargs != 0:
        metavar = "|".join(map(str, action.choices)) if action.choices else action.dest.upper()
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    # a pipe, even inside a code span, would end the table cell
    return ", ".join(f"`{n} {metavar}`".replace("|", "\\|") if action.nargs != 0 else f"`{n}`" for n in names)


def _sections(parser: argparse.ArgumentParser, path: list[str], fields: dict, level: int) -> list[str]:
    out: list[str] = []
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    options = [a for a in parser._actions if not isinstance(a, (argparse._SubParsersAction, argparse._HelpAction))]
    if path:
        out.append(f"{'#' * level} `{' '.join(path)}`\n")
        description = parser.description or ""
        if description:
            out.append(_cell(description) + "\n")
    if options:
        out.append("| option | default | what |\n|---|---|---|")
        for action in options:
            out.append(f"| {_flags(action)} | {_default(action, fields)} | {_help(action, fields)} |")
        out.append("")
    for sub in subparsers:
        helps = {c.dest: c.help for c in sub._choices_actions}
        for name, child in sub.choices.items():
            if not child.description and helps.get(name):
                child.description = helps[name][:1].upper() + helps[name][1:] + "."
            out.extend(_sections(child, [*path, name], fields, min(level + 1, 4)))
    return out


def render_reference() -> str:
    from edgetrain.cli import build_parser
    from edgetrain.config import FIELDS

    top = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in top._choices_actions}
    out: list[str] = []
    for name, parser in top.choices.items():
        if not parser.description and helps.get(name):
            parser.description = helps[name][:1].upper() + helps[name][1:] + "."
        out.extend(_sections(parser, ["edgetrain", name], FIELDS, 2))
    return "\n".join(out)


def render_profiles() -> str:
    """The built-in device profiles as a table, from ``edgetrain.cluster.profiles.BUILTIN_PROFILES``."""
    from edgetrain.cluster.profiles import BUILTIN_PROFILES

    def value(x, unit="", none="-"):
        return none if x is None else f"{x:,}{unit}" if isinstance(x, int) else f"{x:g}{unit}"

    out = ["| profile | cores | GFLOPS | memory | memory GB/s | link | power model (modelled) | what |",
           "|---|---|---|---|---|---|---|---|"]
    for name, p in BUILTIN_PROFILES.items():
        cores = value(p.cores, none="the host's share")
        power = "-" if p.idle_w is None or p.core_w is None else f"{p.idle_w:g} W + {p.core_w:g} W/core"
        out.append(f"| `{name}` | {cores} | "
                   f"{value(p.gflops, none='unthrottled')} | {value(p.memory_mb, ' MiB', 'no limit')} | "
                   f"{value(p.memory_gbps)} | {p.link or 'none'} | {power} | {_cell(p.description)} |")
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown and PROFILES_MARKER not in markdown:
        return markdown
    _edgetrain_on_path(config)
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, render_reference())
    if PROFILES_MARKER in markdown:
        markdown = markdown.replace(PROFILES_MARKER, render_profiles())
    return markdown
