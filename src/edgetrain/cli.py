"""``edgetrain`` command line: ``train``, ``bench``, ``report``, ``plan``, ``launch``, ``data``, ``certs``.

Each subcommand lives beside the code it drives and adds itself here through a
``register(subparsers)`` function, so this file stays a table of contents.
Every parser is an ``edgetrain.arguments.OneLineParser``: bad flags are one
line with a fix and exit status 2, like every other bad input.
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading

from edgetrain.arguments import OneLineParser
from edgetrain.errors import EdgetrainError, Terminated, raise_on_sigterm

SUBCOMMANDS = ("edgetrain.train.cli", "edgetrain.bench.cli", "edgetrain.report.cli", "edgetrain.plan.cli",
               "edgetrain.ssh_launch",
               "edgetrain.data_cli", "edgetrain.certs")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="edgetrain",
        description="Train deep networks across clusters of edge devices, and measure them.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=OneLineParser)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # a real missing dependency, not an absent subcommand
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # SIGTERM (timeout, systemd, docker, batch schedulers) and SIGINT (Ctrl-C, to this process or its whole process
    # group) stop a run alike: every device at its next step, a checkpoint where enabled, one line. SIGINT is
    # caught even where it came ignored (a job started in the background by a script), as it is asked for.
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, raise_on_sigterm) for sig in _STOP_SIGNALS} if on_main_thread else {}
    try:
        return int(args.func(args) or 0)
    except EdgetrainError as e:
        print(f"edgetrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # raised by code that installs Python's default handler again
        print("edgetrain: interrupted (SIGINT); the run was stopped", file=sys.stderr)
        return 128 + signal.SIGINT
    except Terminated as e:
        how_to_resume = f"; {e}" if str(e) else ""  # a run with checkpoints says where it stopped
        print(f"edgetrain: {_STOP_SIGNALS.get(e.signum, 'terminated (SIGTERM)')}; the run was stopped{how_to_resume}",
              file=sys.stderr)
        return 128 + e.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_STOP_SIGNALS = {signal.SIGTERM: "terminated (SIGTERM)", signal.SIGINT: "interrupted (SIGINT)"}  # how each is said


def entry() -> None:
    """The ``edgetrain`` command and ``python -m edgetrain``: ``main``, then the process's exit.

    A device of a real cluster (``RANK`` set: torchrun's worker or the plain recipe) leaves with ``os._exit``
    once its output is flushed: its run's files are closed by then, and a thread still in native code (gloo's,
    the store's, a library's) that meets a finalizing interpreter ends the process in SIGABRT ("terminate
    called without an active exception", seen now and then on real hosts; docs/design/shutdown.md).
    Tests call ``main`` and keep their process.
    """
    code = main()
    if "RANK" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
