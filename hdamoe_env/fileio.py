"""Atomic file writing and JSON conversion of numpy values (the one writer of the package).

Long runs (placement pipelines, benchmarks, sweeps) write every result through ``atomic_write``
(temporary file in the same directory, then ``os.replace``) so an interruption never leaves a
half-written file; readers therefore see either the old or the new content.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np


__all__ = ["atomic_write", "json_default", "write_json"]


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[Any]], Any],
                 mode: str = "w") -> Path:
    """Write a file atomically: ``write(fh)`` fills a temporary file that then replaces ``path``.

    Args:
        path: Destination; parent directories are created.
        write: Callable receiving the open temporary file.
        mode: ``"w"`` (text, newline translation off) or ``"wb"``.

    Returns:
        The destination path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"newline": ""})) as fh:
            write(fh)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def json_default(obj: Any) -> Any:
    """``json.dumps`` hook for numpy arrays and scalars."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    raise TypeError(f"not JSON-serialisable: {type(obj).__name__}")


def write_json(path: str | os.PathLike[str], data: Any, *, sort_keys: bool = False) -> Path:
    """Write ``data`` as indented JSON atomically (numpy values converted)."""
    text = json.dumps(data, indent=1, sort_keys=sort_keys, default=json_default) + "\n"
    return atomic_write(path, lambda fh: fh.write(text))
