"""Command-line parsing that fails in one line: the parser class and the value types every subcommand uses.

``OneLineParser`` is the ``argparse.ArgumentParser`` of ``edgetrain`` and of
every subcommand under it (``add_subparsers`` hands its class down). Its
``error`` prints ``edgetrain: error: <problem>; <fix>`` and exits 2 instead
of argparse's usage block; for a misspelt flag the fix is the closest flag
of that subcommand (``difflib``, as for misspelt config keys). ``--help``
still prints the full help.

The ``type=`` functions below reject what argparse's ``int`` and ``float``
let through: zero or negative counts, and ``nan`` / ``inf``, which Python's
``float`` parses and which then poison every number computed from them.
"""
from __future__ import annotations

import argparse
import difflib
import math
import sys
from typing import NoReturn

EXIT_BAD_INPUT = 2


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line with a fix, exit status 2."""

    def parse_known_args(self, args=None, namespace=None):
        # Kept so that error() can find the subcommand a misspelt flag was meant for.
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        problem = " ".join(message.split())
        self.exit(EXIT_BAD_INPUT, f"edgetrain: error: {problem}; {self._fix(problem)}\n")

    def _fix(self, problem: str) -> str:
        parser = self._chosen_subcommand()
        if problem.startswith("unrecognized arguments"):
            unknown = [a.split("=", 1)[0] for a in getattr(self, "_argv", []) if a.startswith("-")
                       and a.split("=", 1)[0] not in parser._option_string_actions]
            flags = [f for f in parser._option_string_actions if f.startswith("--")]
            for flag in unknown:
                close = difflib.get_close_matches(flag, flags, n=1)
                if close:
                    return f"did you mean '{close[0]}'? (see {parser.prog} --help)"
        if problem.startswith("argument -") and "expected one argument" in problem:
            flag = problem.split()[1].rstrip(":").split("/")[-1]
            return f"give it a value; one that starts with '-' is written {flag}=VALUE (see {parser.prog} --help)"
        return f"see {parser.prog} --help"

    def _chosen_subcommand(self) -> argparse.ArgumentParser:
        """The deepest subcommand named in the arguments parsed last (this parser if none)."""
        parser: argparse.ArgumentParser = self
        for arg in getattr(self, "_argv", []):
            subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            if subcommands and arg in subcommands[0].choices:
                parser = subcommands[0].choices[arg]
        return parser


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a count of devices, steps, samples, threads...)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (warm-up steps, loader workers, a seed)."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def finite_float(text: str) -> float:
    """argparse type: a finite number (no nan or inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """argparse type: a finite number in [0, 1]."""
    value = finite_float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text!r}")
    return value
