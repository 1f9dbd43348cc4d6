"""Run directories and atomic file writes.

Every file edgetrain writes goes through ``atomic_write``: a crash or a
killed worker leaves either the old file or the new one, never half of one.
The new file is written to a hidden temporary beside the target,
``.<name>.<writer pid>.<random>.tmp``, and renamed over it. An exception (also
SIGTERM, which devices turn into one) removes the temporary; SIGKILL cannot, so
``remove_stale_temps`` deletes the temporaries whose writer process is gone.
Files get the mode an ordinary ``open`` would give (``0o666`` less the umask),
not ``mkstemp``'s private ``0o600``.

Run directories are made only under the output directory: ``new_run_dir``
refuses a name that is a path (``../x``, ``/abs``), so ``--run-name`` and
``--name`` cannot write anywhere else.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import psutil
import yaml

from edgetrain.errors import EdgetrainError

TEMP_SUFFIX = ".tmp"

@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[Any]:
    """Open a temporary file beside ``path``; on success fsync and rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it; put it straight back
    os.umask(mask)
    return mask


def remove_stale_temps(directory: str | os.PathLike) -> list[Path]:
    """Delete ``atomic_write`` temporaries in ``directory`` left by writers that were killed; return them."""
    removed = []
    for tmp in Path(directory).glob(f".*{TEMP_SUFFIX}"):
        pid = tmp.name[:-len(TEMP_SUFFIX)].split(".")[-2]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            removed.append(tmp)
    return removed


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_write(path) as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=_jsonable)
        f.write("\n")


def write_yaml(path: str | os.PathLike, obj: Any) -> None:
    with atomic_write(path) as f:
        yaml.safe_dump(obj, f, sort_keys=False)


def _jsonable(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"cannot write {type(o).__name__} to JSON")


def new_run_dir(root: str | os.PathLike, name: str | None, prefix: str = "train") -> Path:
    """A fresh directory ``root/<name or prefix-timestamp>``; never reuses an existing one."""
    root = Path(root)
    if name is not None and (not name or name in (".", "..") or Path(name).name != name
                             or (os.altsep and os.altsep in name)):
        raise EdgetrainError(f"run name {name!r} must be a plain directory name (no '/', '..' or absolute path): "
                             f"it is made under the output directory {root}; use --output to choose where")
    base = name or f"{prefix}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    path = root / base
    n = 1
    while path.exists():
        n += 1
        path = root / f"{base}-{n}"
    path.mkdir(parents=True)
    return path


class JsonlWriter:
    """Appends one JSON object per line; each line is flushed whole."""

    def __init__(self, path: str | os.PathLike):
        self._f = open(path, "a", buffering=1)

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, default=_jsonable) + "\n")

    def close(self) -> None:
        self._f.close()
