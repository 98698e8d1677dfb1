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

from traces.errors import TraceFormatError
from traces.trace import FORMAT_NAME, FORMAT_VERSION, RoutingTrace

__all__ = ["load", "save"]

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
