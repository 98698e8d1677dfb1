"""Atomic file writing and JSON conversion of numpy values (the one writer of the package).

Long runs (placement pipelines, benchmarks, sweeps) write every result through ``atomic_write``
(temporary file in the same directory, then ``os.replace``) so an interruption never leaves a
half-written file; readers therefore see either the old or the new content.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from hdamoe_env.config.errors import LockedError, OutputPathError
# the readers of input files live in the bottom layer (traces reads traces with them)
from traces.io import check_input_file, loads_json, read_input_bytes, read_json

__all__ = ["apply_umask", "atomic_write", "check_input_file", "check_output_dir",
           "check_output_file", "json_default", "loads_json", "lock_path", "output_lock",
           "read_input_bytes", "read_json", "write_json"]

#: Suffix of the lock file beside a locked output (outside a directory: its contents stay ours).
LOCK_SUFFIX = ".hdamoe-lock"


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


def lock_path(path: str | os.PathLike[str], kind: str) -> Path:
    """Return the lock file of an output: ``.NAME.hdamoe-lock`` beside the directory or file.

    Args:
        path: The output.
        kind: ``"dir"`` or ``"file"`` (both locks live beside the output, in its parent).
    """
    path = Path(os.path.abspath(path))
    del kind                               # one naming for both: a dir and a file never share it
    return path.with_name(f".{path.name}{LOCK_SUFFIX}")


def _acquire(target: Path, kind: str, command: str) -> tuple[int, Path]:
    import fcntl

    lock = lock_path(target, kind)
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = json.loads(os.read(fd, 4096).decode() or "{}")
            except ValueError:
                holder = {}
            os.close(fd)
            raise LockedError(
                f"{'directory' if kind == 'dir' else 'file'} {str(target)!r} is being written by "
                f"another process (pid {holder.get('pid', '?')} on {holder.get('host', '?')}, "
                f"since {holder.get('started', '?')}: {holder.get('command', '?')}); wait for it "
                "to finish or choose another output") from None
        # the holder before us may have unlinked the file we opened: lock the live one only
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    info = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(info).encode())
    return fd, lock


@contextlib.contextmanager
def output_lock(outputs: Iterable[tuple[str | os.PathLike[str], str]],
                command: str | None = None) -> Iterator[None]:
    """Hold an advisory lock (``fcntl.flock``) on each output while the block runs.

    A second process asking for the same output is refused at once, with a message naming the
    first (pid, host, start time, command). The lock files are removed on exit; a crashed
    holder's lock is released by the kernel, so a stale file never blocks.

    Args:
        outputs: ``(path, kind)`` pairs, kind ``"dir"`` or ``"file"``.
        command: The command line recorded in the lock (default: ``sys.argv``).

    Raises:
        LockedError: An output is locked by another process.
    """
    text = command if command is not None else " ".join(sys.argv)
    held: list[tuple[int, Path]] = []
    try:
        seen = set()
        for path, kind in outputs:
            key = (os.path.abspath(path), kind)
            if key not in seen:
                seen.add(key)
                held.append(_acquire(Path(path), kind, text))
        yield
    finally:
        for fd, lock in reversed(held):
            with contextlib.suppress(OSError):
                os.unlink(lock)
            os.close(fd)
