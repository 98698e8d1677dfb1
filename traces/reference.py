"""The authors' reference JSON traces: reader, converter and segment detection.

Implements traces.md §2.1–2.3 (the authors' plain, prediction and gating-simulation JSON files)
and the segment detection of §3.2, which recovers the request structure of the Mixtral traces
(10 generation calls per file, a shared prompt prefix, turn-2 replays of turn 1) and fills
``req_id``/``conv_id``/``turn``/``pos``/``keep``/``unique``.

Reference traces are MIT-licensed data of other authors (traces.md §1): they are read from a path
given by the caller and never copied into the package repository; a converted ``.npz`` carries the
NOTICE text (when found next to the source files) in ``meta["source"]["notice"]`` and must stay
outside the repository as well.

:func:`convert_reference` writes the canonical ``.npz`` of :mod:`traces.io`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from traces.errors import TraceFormatError, unknown_name
from traces.io import loads_json, package_version, read_input_bytes, save, utc_now
from traces.trace import FORMAT_NAME, FORMAT_VERSION, RoutingTrace

__all__ = [
    "REFERENCE_MODELS",
    "convert_reference",
    "detect_segments",
    "read_reference_json",
]

# Package model key -> (E, k, layer-key offset) of the reference traces (traces.md §2, §3.1;
# paper-model.md §2.1). Plain numbers so that this layer needs no ModelSpec.
REFERENCE_MODELS: dict[str, tuple[int, int, int]] = {
    "mixtral-8x7b": (8, 2, 0),
    "deepseek-v2-lite": (64, 6, 1),
    "qwen2-57b-a14b": (64, 8, 0),
    "qwen3.5-35b-a3b": (256, 8, 0),
}
_SEGMENT_WINDOW = 5


def _guess_model(path: Path) -> str | None:
    """Infer the package model key from a reference file path (traces.md §3.1 layout)."""
    text = str(path).lower()
    name = path.name.lower()
    if "mixtral" in text:
        return "mixtral-8x7b"
    if "deepseek" in text or "/ds/" in text.replace(os.sep, "/") or name.startswith("ds_"):
        return "deepseek-v2-lite"
    if re.search(r"qwen3\.?5", text):
        return "qwen3.5-35b-a3b"
    if "qwen" in text:
        return "qwen2-57b-a14b"
    return None


def _relative_source(path: Path) -> str:
    """Return the path below a ``reference-traces`` directory, else the file name."""
    parts = path.resolve().parts
    if "reference-traces" in parts:
        index = len(parts) - 1 - parts[::-1].index("reference-traces")
        return "/".join(parts[index + 1 :])
    return path.name


def _find_notice(path: Path) -> str | None:
    """Return the text of a NOTICE file in the file's directory or up to two levels above."""
    directory = path.resolve().parent
    for candidate in (directory, *list(directory.parents)[:2]):
        notice = candidate / "NOTICE"
        if notice.is_file():
            return notice.read_text(encoding="utf-8", errors="replace")
    return None


def _layers_mapping(
    document: Any, source: str
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None, str]:
    """Split a reference JSON document into (routing, original routing, predictions, kind)."""
    if not isinstance(document, dict):
        raise TraceFormatError(
            f"{source}: top level must be a JSON object of layer keys, got "
            f"{type(document).__name__}"
        )
    wrapper_keys = {
        "original_selected_experts",
        "selected_experts",
        "predict_experts",
        "original_predict_experts",
        "simulation_meta",
    }
    if not wrapper_keys & set(document):
        return document, None, None, "plain"
    if "original_predict_experts" in document:
        raise TraceFormatError(
            f"{source}: adaptive traces (traces.md §2.4, one nesting level per "
            "forward call) are not supported by read_reference_json"
        )
    selected = document.get("selected_experts")
    original = document.get("original_selected_experts")
    predicted = document.get("predict_experts")
    for key in ("selected_experts", "original_selected_experts", "predict_experts"):
        if key in document and not isinstance(document[key], dict):
            raise TraceFormatError(
                f"{source}: {key!r} must be an object of layer keys, got "
                f"{type(document[key]).__name__}"
            )
    if selected is None and original is None:
        raise TraceFormatError(
            f"{source}: neither 'selected_experts' nor "
            "'original_selected_experts' found; expected a plain trace "
            "(§2.1) or a prediction / gating-simulation wrapper (§2.2–2.3)"
        )
    if selected is not None and original is not None:
        return selected, original, predicted, "gating_simulation"  # topk = gated routing
    if selected is not None:
        return selected, None, predicted, "prediction" if predicted is not None else "selected"
    assert original is not None
    return original, None, predicted, "original_selected"


def _layer_order(
    layers: Mapping[str, Any], source: str, what: str, offset: int | None
) -> tuple[list[str], int]:
    """Return the layer keys in MoE-layer order and the key offset; check contiguity."""
    numbers = []
    for key in layers:
        # ASCII digits only: str.isdigit() accepts e.g. '١' or '²', which int() maps elsewhere
        if (not isinstance(key, str) or not key.isascii() or not key.isdigit()
                or str(int(key)) != key):      # '00', '01' would not map back to their key
            raise TraceFormatError(
                f"{source}: {what}key {key!r} is not a decimal layer key; "
                "expected keys '0', '1', ..."
            )
        numbers.append(int(key))
    if not numbers:
        raise TraceFormatError(f"{source}: {what}no layer keys found")
    numbers.sort()
    first = numbers[0]
    if offset is not None and first != offset:
        raise TraceFormatError(
            f"{source}: {what}layer keys start at {first!r} but "
            f"layer_key_offset={offset}; expected the first key "
            f"{str(offset)!r}"
        )
    for index, number in enumerate(numbers):
        if number != first + index:
            raise TraceFormatError(
                f"{source}: {what}layer keys are not contiguous: key "
                f"{str(first + index)!r} is missing (next key present: "
                f"{str(number)!r}); expected keys {first}..{numbers[-1]} "
                "without gaps"
            )
    return [str(number) for number in numbers], first


def _rows_array(rows: Any, source: str, what: str, key: str, top_k: int | None) -> NDArray[Any]:
    """Convert one layer's list of rows into an int64 [T, k] array with precise errors."""
    if not isinstance(rows, list) or not rows:
        raise TraceFormatError(
            f"{source}: {what}layer key {key!r}: expected a non-empty list of "
            f"token rows, got {type(rows).__name__}"
            + (" of length 0" if isinstance(rows, list) else "")
        )
    array: NDArray[Any] | None
    try:
        array = np.asarray(rows)
    except (ValueError, TypeError):
        array = None
    expected_k = (
        top_k if top_k is not None else (len(rows[0]) if isinstance(rows[0], list) else None)
    )
    if array is not None and array.dtype.kind in "iu" and _has_bools(rows):
        array = None                       # JSON true/false are not expert ids (find the row)
    if (
        array is None
        or array.ndim != 2
        or array.dtype.kind not in "iu"
        or (expected_k is not None and array.shape[1] != expected_k)
    ):
        for index, row in enumerate(rows):
            if not isinstance(row, list):
                raise TraceFormatError(
                    f"{source}: {what}layer key {key!r} row {index}: expected "
                    f"a list of expert ids, got {row!r}"
                )
            if expected_k is not None and len(row) != expected_k:
                raise TraceFormatError(
                    f"{source}: {what}layer key {key!r} row {index}: {len(row)}"
                    f" ids {row}; expected k={expected_k} ids per row"
                )
            for value in row:
                if not isinstance(value, int) or isinstance(value, bool):
                    raise TraceFormatError(
                        f"{source}: {what}layer key {key!r} row {index}: id "
                        f"{value!r} is not an integer"
                    )
        raise TraceFormatError(
            f"{source}: {what}layer key {key!r}: rows do not form an integer [T, k] table"
        )
    return array.astype(np.int64, copy=False)


def _has_bools(rows: list[Any]) -> bool:
    """True when a JSON true/false hides among the ids (numpy would read them as 1/0)."""
    return any(type(v) is bool for row in rows if isinstance(row, list) for v in row)


def _check_rows(array: NDArray[Any], num_experts: int, source: str, what: str, key: str) -> None:
    bad = np.flatnonzero(((array < 0) | (array >= num_experts)).any(axis=1))
    if bad.size:
        row = int(bad[0])
        raise TraceFormatError(
            f"{source}: {what}layer key {key!r} row {row}: ids "
            f"{array[row].tolist()} out of range; expected ids in [0, "
            f"{num_experts}) (E={num_experts})"
        )
    ordered = np.sort(array, axis=1)
    dup = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
    if dup.size:
        row = int(dup[0])
        raise TraceFormatError(
            f"{source}: {what}layer key {key!r} row {row}: duplicate expert "
            f"ids {array[row].tolist()}; expected {array.shape[1]} distinct "
            "ids per row"
        )


def _parse_layers(
    layers: Mapping[str, Any],
    source: str,
    what: str,
    offset: int | None,
    top_k: int | None,
    num_tokens: int | None,
) -> tuple[list[str], int, list[NDArray[Any]]]:
    """Parse every layer of one routing object into int64 [T, k] arrays (ragged checks)."""
    keys, first = _layer_order(layers, source, what, offset)
    arrays: list[NDArray[Any]] = []
    for key in keys:
        array = _rows_array(layers[key], source, what, key, top_k)
        if top_k is None:
            top_k = array.shape[1]
        if num_tokens is None:
            num_tokens = array.shape[0]
        elif array.shape[0] != num_tokens:
            raise TraceFormatError(
                f"{source}: {what}layer key {key!r} has {array.shape[0]} rows "
                f"but layer key {keys[0]!r} has {num_tokens}; expected the same "
                f"T in every layer (first row index missing or extra: "
                f"{min(array.shape[0], num_tokens)})"
            )
        arrays.append(array)
    return keys, first, arrays


def detect_segments(
    layer0_ids: NDArray[np.integer[Any]], window: int = _SEGMENT_WINDOW
) -> dict[str, Any]:
    """Recover the generation calls of a concatenated reference trace (traces.md §3.2).

    The sorted layer-0 sets of the first ``window`` rows form a signature; every position where
    the same sets recur starts a segment. The prefix is the longest common layer-0 prefix of all
    segments (0 with a single segment); segments 2q and 2q+1 are turns 0 and 1 of conversation q,
    and the replay length of a pair is the longest common layer-0 prefix of its two segments.

    Args:
        layer0_ids: int [T, k] layer-0 routing.
        window: Signature length w (5 in traces.md).

    Returns:
        A JSON-serialisable dict: ``window``, ``starts``, ``lengths``, ``prefix`` and ``replay``
        (one entry per complete turn pair).
    """
    sets = np.sort(np.asarray(layer0_ids), axis=1)
    num_tokens = sets.shape[0]
    starts = [0]
    if num_tokens >= 2 * window:
        match = np.ones(num_tokens - window + 1, dtype=bool)
        for offset in range(window):
            match &= (sets[offset : num_tokens - window + 1 + offset] == sets[offset]).all(axis=1)
        for position in np.flatnonzero(match)[1:]:
            if position >= starts[-1] + window:
                starts.append(int(position))
    bounds = [*starts, num_tokens]
    lengths = [bounds[i + 1] - bounds[i] for i in range(len(starts))]

    def common_prefix(a: int, b: int) -> int:
        size = min(lengths[a], lengths[b])
        diff = (sets[starts[a] : starts[a] + size] != sets[starts[b] : starts[b] + size]).any(
            axis=1
        )
        hits = np.flatnonzero(diff)
        return int(hits[0]) if hits.size else size

    prefix = min((common_prefix(0, s) for s in range(1, len(starts))), default=0)
    replay = [common_prefix(2 * q, 2 * q + 1) for q in range(len(starts) // 2)]
    return {
        "window": window,
        "starts": starts,
        "lengths": lengths,
        "prefix": prefix,
        "replay": replay,
    }


def _request_arrays(segments: Mapping[str, Any], num_tokens: int) -> dict[str, NDArray[Any]]:
    """Fill req_id/conv_id/turn/pos/keep/unique from detected segments (traces.md §3.2, §5)."""
    starts, lengths = segments["starts"], segments["lengths"]
    prefix, replay = int(segments["prefix"]), segments["replay"]
    req_id = np.repeat(np.arange(len(starts), dtype=np.int32), lengths)
    pos = (np.arange(num_tokens) - np.repeat(np.asarray(starts), lengths)).astype(np.int32)
    conv_id = (req_id // 2).astype(np.int32)
    turn = (req_id % 2).astype(np.int16)
    new_from = np.empty(len(starts), dtype=np.int64)  # first new row (segment-relative)
    for segment in range(len(starts)):
        if segment % 2 == 1 and segment // 2 < len(replay):
            new_from[segment] = max(int(replay[segment // 2]), prefix)
        else:
            new_from[segment] = prefix
    keep = pos >= np.repeat(new_from, lengths)
    unique = keep.copy()
    unique[:prefix] = True  # the shared prefix once (segment 0)
    return {
        "req_id": req_id,
        "conv_id": conv_id,
        "turn": turn,
        "pos": pos,
        "keep": keep,
        "unique": unique,
    }


def _parse_wrapped(
    original: Mapping[str, Any] | None,
    predicted: Mapping[str, Any] | None,
    keys: list[str],
    source: str,
    top_k: int,
    num_tokens: int,
) -> tuple[list[NDArray[Any]] | None, dict[str, NDArray[Any]]]:
    """Parse the original routing and the predictions of a wrapper (traces.md §2.2–2.3)."""
    orig_layers = None
    if original is not None:
        orig_keys, _, orig_layers = _parse_layers(
            original, source, "original_selected_experts ", int(keys[0]), top_k, num_tokens
        )
        if orig_keys != keys:
            raise TraceFormatError(
                f"{source}: original_selected_experts has layer keys "
                f"{orig_keys[0]}..{orig_keys[-1]} but selected_experts has "
                f"{keys[0]}..{keys[-1]}; expected the same keys"
            )
    pred_layers: dict[str, NDArray[Any]] = {}
    if predicted is not None:
        pred_keys, _, parsed = _parse_layers(
            predicted, source, "predict_experts ", None, top_k, num_tokens
        )
        unknown = sorted(set(pred_keys) - set(keys), key=int)
        if unknown:
            raise TraceFormatError(
                f"{source}: predict_experts layer key {unknown[0]!r} has no "
                f"routing layer; expected keys within {keys[0]}..{keys[-1]}"
            )
        pred_layers = dict(zip(pred_keys, parsed, strict=True))
    return orig_layers, pred_layers


def _reference_meta(
    file_path: Path,
    raw: bytes,
    model: str | None,
    inferred: bool,
    num_experts: int,
    keys: list[str],
    kind: str,
    segments: dict[str, Any],
    has_predictions: bool,
) -> dict[str, Any]:
    """Build the ``meta`` of a trace read from reference JSON (traces.md §5)."""
    category = re.match(r"experts_([A-Za-z]+)_", file_path.name)
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "model": model,
        "model_inferred_from_path": inferred and model is not None,
        "E": num_experts,
        "L": len(keys),
        "J": 0,
        "moe_layer_keys": keys,
        "ids_rank_ordered": None,
        "score_kind": None,
        "predictor": {"kind": "gate_next_layer", "source": "reference_json"}
        if has_predictions
        else None,
        "source": {
            "kind": "reference_json",
            "file": _relative_source(file_path),
            "sha256": hashlib.sha256(raw).hexdigest(),
            "json_kind": kind,
            "repository": None,
            "commit": None,
            "license": "MIT",
            "notice": _find_notice(file_path),
        },
        "category": category.group(1) if category else None,
        "dataset": "mt-bench",
        "segments": segments,
        "created_by": f"hdamoe-env {package_version()}",
        "created_utc": utc_now(),
    }


def read_reference_json(
    path: str | os.PathLike[str],
    *,
    model_key: str | None = None,
    E: int | None = None,
    k: int | None = None,
    layer_key_offset: int | None = None,
    segment_detection: bool = True,
    num_layers: int | None = None,
) -> RoutingTrace:
    """Read one of the authors' JSON traces (traces.md §2.1–2.3) into a validated trace.

    Plain files (``{"0": rows, ...}``) give ``topk_ids``. Wrappers: ``original_selected_experts``
    alone gives ``topk_ids``; with ``selected_experts`` as well (gating simulation), the gated
    ``selected_experts`` become ``topk_ids`` and the original routing ``orig_topk_ids``;
    ``predict_experts`` fill ``pred_ids`` (layers without predictions get −1). Rows are treated as
    sets (``meta["ids_rank_ordered"]`` = null). Request structure comes from
    :func:`detect_segments`; ``phase`` is 2 (unknown) for every row.

    Args:
        path: The JSON file.
        model_key: Package model key ("mixtral-8x7b", "deepseek-v2-lite", "qwen2-57b-a14b",
            "qwen3.5-35b-a3b"); inferred from the path when omitted. It supplies the defaults of
            ``E``, ``k`` and ``layer_key_offset``.
        E: Routed experts; default from the model, else max id + 1.
        k: Experts per row; default from the model, else the length of the first row.
        layer_key_offset: Layer key of MoE layer 0 (DeepSeek 1); default from the model, else the
            smallest key.
        segment_detection: Recover requests with traces.md §3.2 (otherwise one request, every row
            kept).
        num_layers: Expected number of MoE layers (the model's); a file with another count is
            refused.

    Returns:
        The trace; ``meta`` records the source file, its SHA-256, the licence, the category parsed
        from the file name, the layer keys and the detected segments.

    Raises:
        TraceFormatError: For invalid JSON, a wrong row length, ids out of range, duplicate ids in
            a row, layers with different row counts or non-contiguous layer keys; the message
            names the file, the layer key and the row index.
        UnknownNameError: For an unknown ``model_key``.
    """
    file_path = Path(path)
    source = str(file_path)
    raw = read_input_bytes(file_path, "trace")
    try:
        document = loads_json(raw, f"trace {source!r}")
    except json.JSONDecodeError as exc:
        raise TraceFormatError(
            f"{source}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from exc
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{source}: not UTF-8 text ({exc})") from exc
    if model_key is not None and model_key not in REFERENCE_MODELS:
        raise unknown_name("model key", model_key, REFERENCE_MODELS)
    inferred = model_key is None
    model = model_key if model_key is not None else _guess_model(file_path)
    if model is not None:
        model_e, model_k, model_offset = REFERENCE_MODELS[model]
        E = model_e if E is None else E
        k = model_k if k is None else k
        layer_key_offset = model_offset if layer_key_offset is None else layer_key_offset

    routing, original, predicted, kind = _layers_mapping(document, source)
    what = (
        ""
        if kind == "plain"
        else (
            "selected_experts "
            if kind in ("gating_simulation", "prediction", "selected")
            else "original_selected_experts "
        )
    )
    keys, _, layers = _parse_layers(routing, source, what, layer_key_offset, k, None)
    if num_layers is not None and len(keys) != num_layers:
        raise TraceFormatError(
            f"{source}: {what}has {len(keys)} MoE layers (keys {keys[0]}..{keys[-1]}) but "
            f"the model has {num_layers}; expected layer keys "
            f"{layer_key_offset or 0}..{(layer_key_offset or 0) + num_layers - 1}; check "
            "--model or the file"
        )
    num_tokens, top_k = layers[0].shape
    orig_layers, pred_layers = _parse_wrapped(original, predicted, keys, source, top_k, num_tokens)
    if E is None:
        candidates = [*layers, *(orig_layers or []), *pred_layers.values()]
        E = int(max(int(a.max()) for a in candidates)) + 1
    for key, array in zip(keys, layers, strict=True):
        _check_rows(array, E, source, what, key)
    for key, array in zip(keys, orig_layers or [], strict=False):
        _check_rows(array, E, source, "original_selected_experts ", key)
    for key, array in pred_layers.items():
        _check_rows(array, E, source, "predict_experts ", key)

    topk_ids = np.stack(layers).astype(np.int16)
    segments = (
        detect_segments(topk_ids[0])
        if segment_detection
        else {"window": None, "starts": [0], "lengths": [num_tokens], "prefix": 0, "replay": []}
    )
    request = _request_arrays(segments, num_tokens)
    pred_ids = None
    if pred_layers:
        pred_ids = np.full_like(topk_ids, -1)
        for index, key in enumerate(keys):
            if key in pred_layers:
                pred_ids[index] = pred_layers[key]
    meta = _reference_meta(
        file_path, raw, model, inferred, int(E), keys, kind, segments, bool(pred_layers)
    )
    trace = RoutingTrace(
        topk_ids=topk_ids,
        orig_topk_ids=np.stack(orig_layers).astype(np.int16) if orig_layers else None,
        pred_ids=pred_ids,
        phase=np.full(num_tokens, 2, dtype=np.uint8),
        meta=meta,
        **request,
    )
    trace.validate(source)
    return trace


def convert_reference(
    json_path: str | os.PathLike[str], out_path: str | os.PathLike[str], **kwargs: Any
) -> RoutingTrace:
    """Convert a reference JSON trace into the canonical ``.npz`` (traces.md §5).

    The output redistributes trace content: it carries the NOTICE text in
    ``meta["source"]["notice"]`` (when a NOTICE file is found next to the source) and must be kept
    outside the package repository (traces.md §1).

    Args:
        json_path: The reference JSON file.
        out_path: Target ``.npz`` path.
        **kwargs: Passed to :func:`read_reference_json` (``model_key``, ``E``, ``k``,
            ``layer_key_offset``, ``segment_detection``).

    Returns:
        The converted trace (as written).
    """
    trace = read_reference_json(json_path, **kwargs)
    save(trace, out_path)
    return trace
