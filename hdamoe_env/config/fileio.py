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

from hdamoe_env.config.errors import OutputPathError
# the readers of input files live in the bottom layer (traces reads traces with them)
from traces.io import check_input_file, loads_json, read_input_bytes, read_json

__all__ = ["apply_umask", "atomic_write", "check_input_file", "check_output_dir",
           "check_output_file", "json_default", "loads_json", "read_input_bytes", "read_json",
           "write_json"]


def _umask() -> int:
    """Return the process umask (read by setting and restoring it; there is no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str | os.PathLike[str], mode: int = 0o666) -> None:
    """Give ``path`` the permissions a plainly created file would have (``mode & ~umask``).

    ``tempfile.mkstemp`` creates files readable by their owner only (0600); files written
    through a temporary file are therefore re-moded before they replace the target.
    """
    os.chmod(path, mode & ~_umask())


def _nearest_existing(path: Path) -> Path:
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def _check_parent(path: Path, what: str) -> None:
    parent = _nearest_existing(path.absolute().parent)
    if not parent.is_dir():
        raise OutputPathError(f"{what} {str(path)!r}: {str(parent)!r} is a file, not a directory; "
                              "expected a path inside a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"{what} {str(path)!r}: directory {str(parent)!r} is not writable; "
                              "choose a path in a writable directory")


def check_output_file(path: str | os.PathLike[str], what: str = "output file", *,
                      parent_must_exist: bool = False) -> Path:
    """Check, before any work starts, that ``path`` can be written as a file.

    Missing parent directories are fine when they can be created (the writer creates them),
    unless ``parent_must_exist``.

    Raises:
        OutputPathError: ``path`` is a directory, its parent is missing (``parent_must_exist``),
            or its nearest existing ancestor is a file or not writable.
    """
    target = Path(path)
    parent = target.absolute().parent
    if parent_must_exist and not parent.is_dir():
        raise OutputPathError(f"{what} {str(target)!r}: directory {str(parent)!r} does not exist "
                              "or is not a directory; create it first or choose another path")
    if target.is_dir():
        raise OutputPathError(f"{what} {str(target)!r} is a directory; expected a file path "
                              f"such as {str(target / 'out.json')!r}")
    _check_parent(target, what)
    if target.exists() and not os.access(target, os.W_OK):
        raise OutputPathError(f"{what} {str(target)!r} is not writable; choose another path")
    return target


def check_output_dir(path: str | os.PathLike[str], what: str = "output directory") -> Path:
    """Check, before any work starts, that ``path`` can be used (or created) as a directory.

    Raises:
        OutputPathError: ``path`` exists and is not a directory, or its nearest existing
            ancestor is a file or not writable.
    """
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise OutputPathError(f"{what} {str(target)!r} is a file; expected a directory (give a "
                              "new or existing directory path)")
    if target.is_dir():
        if not os.access(target, os.W_OK | os.X_OK):
            raise OutputPathError(f"{what} {str(target)!r} is not writable; choose another one")
        return target
    _check_parent(target, what)
    return target


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
    if path.is_dir():
        raise OutputPathError(f"cannot write {str(path)!r}: it is a directory; expected a file "
                              "path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise OutputPathError(f"cannot write {str(path)!r}: a parent is a file, not a directory "
                              f"({exc.filename})") from None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"newline": ""})) as fh:
            write(fh)
        apply_umask(tmp)                   # mkstemp creates 0600; give the file the usual mode
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
