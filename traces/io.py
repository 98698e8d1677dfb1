"""Trace files: the canonical ``.npz`` format (traces.md §5).

Format version 1: ``numpy.savez_compressed``, read with ``allow_pickle=False``, validated on
load. :func:`save` writes atomically and records the trace id; :func:`load` checks the format
tag, the version, the required arrays and the trace id. The authors' reference JSON files are
read by :mod:`traces.reference`, which converts them into this format.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from traces.errors import InputFileError, TraceFormatError
from traces.trace import FORMAT_NAME, FORMAT_VERSION, RoutingTrace

__all__ = ["MAX_INPUT_BYTES", "MAX_JSON_DEPTH", "check_input_file", "json_depth", "load",
           "loads_json", "max_input_bytes", "read_input_bytes", "read_json", "save"]

#: Largest input file read (``HDAMOE_MAX_INPUT_BYTES`` overrides; hdamoe_env.config.limits).
MAX_INPUT_BYTES = 2**30
#: Deepest nesting accepted in a JSON input (traces nest 3 levels, records 4).
MAX_JSON_DEPTH = 64
_CHUNK = 1 << 24
_BRACKET_STEP = np.zeros(256, np.int8)
_BRACKET_STEP[[0x5B, 0x7B]] = 1          # [ {
_BRACKET_STEP[[0x5D, 0x7D]] = -1         # ] }


def max_input_bytes() -> int:
    """Return the input size cap: ``$HDAMOE_MAX_INPUT_BYTES`` or :data:`MAX_INPUT_BYTES`."""
    try:
        value = int(os.environ.get("HDAMOE_MAX_INPUT_BYTES", ""))
    except ValueError:
        return MAX_INPUT_BYTES
    return value if value > 0 else MAX_INPUT_BYTES


def check_input_file(path: str | os.PathLike[str], what: str = "input file",
                     max_bytes: int | None = None) -> Path:
    """Check, without opening it, that ``path`` is a regular file no larger than the cap.

    A FIFO would block a reader forever and a device such as ``/dev/zero`` never ends; both are
    refused here, before any read.

    Args:
        path: The file.
        what: What the file is, for the message (``"--trace"``, ``"placement"``).
        max_bytes: Size cap (None: ``$HDAMOE_MAX_INPUT_BYTES`` or :data:`MAX_INPUT_BYTES`).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        InputFileError: Missing, not a regular file, or larger than the cap.
    """
    target = Path(path)
    try:
        info = target.stat()
    except FileNotFoundError:
        raise InputFileError(f"{what} {str(target)!r} does not exist; check the path") from None
    except OSError as exc:
        raise InputFileError(f"{what} {str(target)!r} cannot be read ({exc.strerror})") from None
    import stat

    if stat.S_ISDIR(info.st_mode):
        raise InputFileError(f"{what} {str(target)!r} is a directory; expected a file")
    if not stat.S_ISREG(info.st_mode):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(info.st_mode) else
                "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode) else
                "a socket" if stat.S_ISSOCK(info.st_mode) else "not a regular file")
        raise InputFileError(f"{what} {str(target)!r} is {kind}; expected a regular file (copy "
                             "the data into a file first)")
    cap = max_input_bytes() if max_bytes is None else int(max_bytes)
    if info.st_size > cap:
        raise InputFileError(f"{what} {str(target)!r} has {info.st_size} bytes, more than the "
                             f"input cap of {cap} bytes; set HDAMOE_MAX_INPUT_BYTES to read it")
    return target


def read_input_bytes(path: str | os.PathLike[str], what: str = "input file",
                     max_bytes: int | None = None) -> bytes:
    """Return the bytes of a regular file of at most the size cap (checked before reading).

    Raises:
        InputFileError: As :func:`check_input_file`, or the file grew past the cap while read.
    """
    target = check_input_file(path, what, max_bytes)
    cap = max_input_bytes() if max_bytes is None else int(max_bytes)
    try:
        with open(target, "rb") as fh:
            data = fh.read(cap + 1)
    except OSError as exc:
        raise InputFileError(f"{what} {str(target)!r} cannot be read ({exc.strerror})") from None
    if len(data) > cap:
        raise InputFileError(f"{what} {str(target)!r} is larger than the input cap of {cap} "
                             "bytes; set HDAMOE_MAX_INPUT_BYTES to read it")
    return data


def json_depth(data: bytes | str) -> int:
    """Return an upper bound of the nesting depth of a JSON text, without recursion.

    Counts brackets in chunks with NumPy (brackets inside strings count too, so the bound can
    only be too high); when it exceeds :data:`MAX_JSON_DEPTH` the exact depth is computed by a
    scan that skips strings.
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    depth, peak = 0, 0
    for start in range(0, len(raw), _CHUNK):
        chunk = np.frombuffer(raw, np.uint8, count=min(_CHUNK, len(raw) - start), offset=start)
        step = _BRACKET_STEP[chunk]
        if step.any():
            levels = np.cumsum(step, dtype=np.int32) + depth
            peak = max(peak, int(levels.max()))
            depth = int(levels[-1])
    if peak <= MAX_JSON_DEPTH:
        return peak
    import re

    depth, peak = 0, 0
    for token in re.finditer(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', raw):
        ch = token.group()
        if ch in (b"[", b"{"):
            depth += 1
            peak = max(peak, depth)
        elif ch in (b"]", b"}"):
            depth -= 1
    return peak


def loads_json(data: bytes | str, what: str = "JSON input", max_depth: int | None = None) -> Any:
    """Parse JSON whose nesting is at most ``max_depth`` (checked first, without recursion).

    Raises:
        InputFileError: Nested deeper than ``max_depth`` (default :data:`MAX_JSON_DEPTH`).
        json.JSONDecodeError, UnicodeDecodeError: Invalid JSON (the caller words the message).
    """
    limit = MAX_JSON_DEPTH if max_depth is None else int(max_depth)
    depth = json_depth(data)
    if depth > limit:
        raise InputFileError(f"{what} nests {depth} levels deep; at most {limit} are accepted "
                             "(no file of this package nests deeper)")
    try:
        return json.loads(data)
    except RecursionError:
        raise InputFileError(f"{what} nests too deeply to parse") from None


def read_json(path: str | os.PathLike[str], what: str = "JSON file") -> Any:
    """Read a JSON file with the size, type and depth checks of this module.

    Raises:
        InputFileError: Not a regular file, too large or too deep.
        TraceFormatError: Not valid JSON (line and column in the message).
    """
    data = read_input_bytes(path, what)
    try:
        return loads_json(data, f"{what} {str(path)!r}")
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{what} {str(path)!r}: invalid JSON at line {exc.lineno} column "
                               f"{exc.colno}: {exc.msg}") from None
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{what} {str(path)!r}: not UTF-8 text ({exc})") from None

# Optional arrays of format version 1 with their dtypes (traces.md §5). Unknown arrays in a file
# are ignored by the reader.
_REQUIRED_ARRAYS = ("topk_ids", "req_id", "pos", "phase", "keep", "meta")
_OPTIONAL_ARRAYS = (
    "orig_topk_ids",
    "cand_ids",
    "cand_scores",
    "pred_ids",
    "conv_id",
    "turn",
    "unique",
    "step_id",
    "slot",
)


def package_version() -> str:
    try:
        return metadata.version("hdamoe-env")
    except metadata.PackageNotFoundError:
        return "unknown"


def utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------------------- .npz


def save(trace: RoutingTrace, path: str | os.PathLike[str]) -> Path:
    """Write a trace as canonical ``.npz`` (format version 1), atomically.

    The file is written to a temporary file in the target directory and moved into place with
    ``os.replace``, so readers never see a partial file. ``meta`` is stored as UTF-8 JSON bytes
    (uint8); ``created_by``/``created_utc`` are added when absent and the trace id is recorded in
    ``meta["trace_id"]`` (checked by :func:`load`).

    Args:
        trace: The trace to write.
        path: Target path (suggested suffix ``.hdtrace.npz``); written exactly as given.

    Returns:
        The path written.
    """
    target = Path(path)
    meta = dict(trace.meta)
    meta["format"] = FORMAT_NAME
    meta["format_version"] = FORMAT_VERSION
    meta.setdefault("created_by", f"hdamoe-env {package_version()}")
    meta.setdefault("created_utc", utc_now())
    meta["trace_id"] = trace.trace_id
    try:
        meta_bytes = json.dumps(meta, sort_keys=True, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise TraceFormatError(
            f"{target}: meta is not JSON-serialisable ({exc}); keep meta to "
            "plain str/int/float/bool/None/list/dict values"
        ) from exc
    arrays: dict[str, NDArray[Any]] = dict(trace.array_items())
    arrays["meta"] = np.frombuffer(meta_bytes, dtype=np.uint8)
    directory = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise TraceFormatError(f"{target}: is a directory; expected a file path such as "
                               f"{target / 'trace.hdtrace.npz'}")
    if not directory.is_dir():
        raise TraceFormatError(f"{target}: directory {directory} does not exist or is not a "
                               "directory; create it first or choose another path")
    handle, temp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(handle, "wb") as stream:
            np.savez_compressed(stream, **arrays)  # type: ignore[arg-type]
        # mkstemp creates 0600; give the file the mode a plainly created file would have
        mask = os.umask(0o022)
        os.umask(mask)
        os.chmod(temp_name, 0o666 & ~mask)
        os.replace(temp_name, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_name)
        raise
    return target


def load(path: str | os.PathLike[str]) -> RoutingTrace:
    """Read and validate a canonical ``.npz`` trace (traces.md §5).

    Args:
        path: A file written by :func:`save` (or any writer of format version 1).

    Returns:
        The validated trace.

    Raises:
        TraceFormatError: When the file is not a readable ``.npz``, is not an hdamoe trace, has a
            ``format_version`` newer than 1, lacks a required array or fails validation. The
            message names the file, the array, the layer and the first offending row.
    """
    source = str(path)
    check_input_file(path, "trace")
    try:
        with np.load(path, allow_pickle=False) as archive:
            names = set(archive.files)
            missing = [name for name in _REQUIRED_ARRAYS if name not in names]
            if missing:
                raise TraceFormatError(
                    f"{source}: required array(s) {missing} missing; an "
                    f"hdamoe trace needs {list(_REQUIRED_ARRAYS)}"
                )
            meta = _decode_meta(archive["meta"], source)
            arrays = {
                name: archive[name]
                for name in (*_REQUIRED_ARRAYS, *_OPTIONAL_ARRAYS)
                if name in names and name != "meta"
            }
    except TraceFormatError:
        raise
    except Exception as exc:  # noqa: BLE001 - damaged archives raise anything (zlib, zipfile)
        raise TraceFormatError(
            f"{source}: cannot read as .npz ({type(exc).__name__}: {exc}); "
            "expected a file written by traces.save"
        ) from exc
    stored_id = meta.pop("trace_id", None)
    try:
        trace = RoutingTrace(meta=meta, **arrays)
    except TraceFormatError as exc:
        raise TraceFormatError(str(exc).replace("RoutingTrace:", f"{source}:", 1)) from None
    trace.validate(source)
    if stored_id is not None and stored_id != trace.trace_id:
        raise TraceFormatError(
            f"{source}: stored trace_id {stored_id} does not match the "
            f"arrays (computed {trace.trace_id}); the file was modified or "
            "corrupted"
        )
    return trace


def _decode_meta(raw: NDArray[Any], source: str) -> dict[str, Any]:
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise TraceFormatError(
            f"{source}: array 'meta' must be uint8 [n] (UTF-8 JSON bytes), "
            f"got dtype {raw.dtype} shape {raw.shape}"
        )
    try:
        meta = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceFormatError(f"{source}: array 'meta' is not UTF-8 JSON ({exc})") from exc
    if not isinstance(meta, dict):
        raise TraceFormatError(
            f"{source}: array 'meta' must hold a JSON object, got {type(meta).__name__}"
        )
    if meta.get("format") != FORMAT_NAME:
        raise TraceFormatError(
            f"{source}: meta['format']={meta.get('format')!r}; expected {FORMAT_NAME!r}"
        )
    version = meta.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise TraceFormatError(
            f"{source}: meta['format_version']={version!r}; expected a positive integer"
        )
    if version > FORMAT_VERSION:
        raise TraceFormatError(
            f"{source}: format_version {version} is newer than this reader "
            f"supports ({FORMAT_VERSION}); upgrade hdamoe-env"
        )
    return meta
