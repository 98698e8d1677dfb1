"""Atomic file writing, JSON conversion of numpy values, and trace files by path.

Long runs (placement pipelines, benchmarks, sweeps) write every result through ``atomic_write``
(temporary file in the same directory, then ``os.replace``) so an interruption never leaves a
half-written file; readers therefore see either the old or the new content.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

from hdamoe_env.specs import ModelSpec

__all__ = ["atomic_write", "json_default", "load_trace_file", "write_json"]


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


def load_trace_file(path: str | os.PathLike[str], model: ModelSpec | None = None) -> Any:
    """Load a trace file (deprecated alias of ``hdamoe_env.sources.load_trace``).

    Args:
        path: A reference ``.json`` or canonical ``.npz`` trace file.
        model: When given, the reference reader uses its E, k and layer-key offset.

    Raises:
        TraceFormatError: The file does not exist or is malformed (the message names it).
    """
    warnings.warn("hdamoe_env.fileio.load_trace_file is deprecated; use "
                  "hdamoe_env.sources.load_trace", DeprecationWarning, stacklevel=2)
    from hdamoe_env.sources import load_trace

    return load_trace(Path(path), model)
