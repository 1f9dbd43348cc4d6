"""The one exception type users see.

Anything raised as ``EdgetrainError`` is a problem with the user's input or
environment. The CLI prints its message as a single line and exits non-zero;
everything else is a bug and keeps its traceback.
"""


class EdgetrainError(Exception):
    """A clear, single-line problem with a fix in its message."""
