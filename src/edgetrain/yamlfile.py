"""Reading a YAML file that must hold a mapping: config files (``config``) and cluster files
(``cluster.profiles``).

Torch-free and importing nothing of edgetrain but ``errors``, so that every layer can read its YAML
through it without reaching up: a missing file, a directory, bytes that are not UTF-8, bad syntax (with
its line) or a top level that is not a mapping is one line naming the file and what to do.
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from edgetrain.errors import EdgetrainError


def read_yaml_mapping(path: str | os.PathLike, what: str) -> dict:
    path = Path(path)
    if path.is_dir():
        raise EdgetrainError(f"{what} {path} is a directory; give the YAML file in it")
    if not path.is_file():
        raise EdgetrainError(f"{what} {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise EdgetrainError(f"{what} {path} is not a text file (not UTF-8); give a YAML file") from None
    except OSError as e:
        raise EdgetrainError(f"cannot read {what} {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise EdgetrainError(f"{what} {path} is not valid YAML{at}: {getattr(e, 'problem', e)}; "
                             f"fix the syntax there") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise EdgetrainError(f"{what} {path} must be a mapping of keys to values, not a {type(data).__name__}")
    return data
