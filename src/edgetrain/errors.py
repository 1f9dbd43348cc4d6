"""The one exception type users see.

Anything raised as ``EdgetrainError`` is a problem with the user's input or
environment. The CLI prints its message as a single line and exits non-zero;
everything else is a bug and keeps its traceback.
"""


class EdgetrainError(Exception):
    """A clear, single-line problem with a fix in its message."""


class Terminated(BaseException):
    """SIGTERM, raised in the main thread by ``raise_on_sigterm`` so that cleanup runs as for Ctrl-C."""


def raise_on_sigterm(signum=None, frame=None) -> None:
    """Signal handler: turn SIGTERM into ``Terminated`` (install with ``signal.signal``)."""
    raise Terminated()
