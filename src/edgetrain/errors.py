"""The one exception type users see.

Anything raised as ``EdgetrainError`` is a problem with the user's input or
environment. The CLI prints its message as a single line and exits non-zero;
everything else is a bug and keeps its traceback.
"""
import signal


class EdgetrainError(Exception):
    """A clear, single-line problem with a fix in its message."""


class Terminated(BaseException):
    """A stop signal, SIGTERM or SIGINT (Ctrl-C), raised in the main thread by ``raise_on_sigterm`` so that
    cleanup runs and the run stops the same way for both; ``signum`` says which (the exit status is 128 + it)."""

    def __init__(self, message: str = "", signum: int = signal.SIGTERM):
        super().__init__(message)
        self.signum = signum


def raise_on_sigterm(signum=signal.SIGTERM, frame=None) -> None:
    """Signal handler: turn SIGTERM (or SIGINT, where installed for it) into ``Terminated``."""
    raise Terminated(signum=signum)
