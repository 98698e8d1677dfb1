"""The routing-trace data model: ``RoutingTrace`` (arrays + metadata) and row helpers.

Implements traces.md §5 (the in-memory form of the canonical trace) and the views of §3.2. A
:class:`RoutingTrace` is data only: NumPy arrays plus a JSON-serialisable ``meta`` dict. Shapes:
L = MoE layers, T = token rows, k = top-k, J = extra router candidates, E = routed experts (from
``meta["E"]``). Reading and writing files live in :mod:`traces.io` (``load``, ``save``) and
:mod:`traces.reference` (the reference JSON reader), which import this module.

Uses NumPy and the standard library only (style.md §2: ``traces`` is the bottom layer).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from numpy.typing import NDArray

from traces.errors import TraceFormatError, unknown_name

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "VIEWS", "RoutingTrace", "concatenate", "unique_rows"]

FORMAT_NAME = "hdamoe-trace"
FORMAT_VERSION = 1
VIEWS: tuple[str, ...] = ("content", "unique", "raw")

# Arrays hashed into the trace id, in this order (traces.md §5: topk_ids, keep, req_id, and
# cand_*, pred_ids when present).
_TRACE_ID_ARRAYS: tuple[str, ...] = (
    "topk_ids",
    "keep",
    "req_id",
    "cand_ids",
    "cand_scores",
    "pred_ids",
)



def _readonly(array: NDArray[Any]) -> NDArray[Any]:
    """Return a read-only view (the caller's array keeps its own flags)."""
    view = array.view()
    view.flags.writeable = False
    return view


def _as_ids(name: str, value: Any, ndim: int, source: str) -> NDArray[np.int16]:
    """Convert an id array to int16 without silent wrap-around."""
    array = np.asarray(value)
    if array.ndim != ndim:
        raise TraceFormatError(
            f"{source}: array {name!r} must have {ndim} dimensions, got shape {array.shape}"
        )
    if array.dtype.kind not in "iu":
        raise TraceFormatError(
            f"{source}: array {name!r} must hold integers, got dtype {array.dtype}"
        )
    if array.dtype != np.int16:
        if array.size and (int(array.min()) < -1 or int(array.max()) > np.iinfo(np.int16).max):
            raise TraceFormatError(
                f"{source}: array {name!r} has values outside [-1, 32767] "
                f"(min {int(array.min())}, max {int(array.max())}); expert "
                "ids must fit int16"
            )
        array = array.astype(np.int16)
    return _readonly(array)


def _as_vector(
    name: str, value: Any, dtype: type[np.generic], length: int, source: str
) -> NDArray[Any]:
    """Convert a per-row array to ``dtype`` and check its length T."""
    array = np.asarray(value)
    if array.shape != (length,):
        raise TraceFormatError(
            f"{source}: array {name!r} must have shape ({length},) (one entry "
            f"per token row), got {array.shape}"
        )
    if dtype is np.bool_:
        if array.dtype != np.bool_:
            raise TraceFormatError(
                f"{source}: array {name!r} must be boolean, got dtype {array.dtype}"
            )
    else:
        if array.dtype.kind not in "iu":
            raise TraceFormatError(
                f"{source}: array {name!r} must hold integers, got dtype {array.dtype}"
            )
        info = np.iinfo(dtype)  # type: ignore[type-var]
        if array.size and (int(array.min()) < info.min or int(array.max()) > info.max):
            raise TraceFormatError(
                f"{source}: array {name!r} has values outside the range of "
                f"{np.dtype(dtype).name} (min {int(array.min())}, max "
                f"{int(array.max())})"
            )
        array = array.astype(dtype, copy=False)
    return _readonly(array)


def _first_bad_row(bad: NDArray[np.bool_]) -> tuple[int, int]:
    """Return (layer, row) of the first True entry of a [L, T] mask."""
    flat = int(np.flatnonzero(bad.ravel())[0])
    return divmod(flat, bad.shape[1])


@dataclass(frozen=True, eq=False)
class RoutingTrace:
    """A routing trace: per MoE layer and token row, the experts the router selected.

    Arrays are stored read-only with the dtypes of traces.md §5 (inputs are converted). Only cheap
    structural checks (dimensions, lengths, dtypes, ``meta`` consistency) run on construction;
    :meth:`validate` checks the content and is called by :func:`traces.load` and the reference
    reader.

    Attributes:
        topk_ids: int16 [L, T, k], the routing the simulator uses; rank order (top-1 first) when
            ``meta["ids_rank_ordered"]`` is true.
        req_id: int32 [T], request (one generation call / turn); its rows are contiguous.
        pos: int32 [T], position of the row within its request (0-based).
        phase: uint8 [T], 0 prompt/prefill, 1 generated/decode, 2 unknown.
        keep: bool [T], content-view mask (new computation, shared prefix excluded).
        meta: JSON-serialisable metadata (traces.md §5); ``meta["E"]`` is required.
        orig_topk_ids: int16 [L, T, k] or None, the original top-k when ``topk_ids`` was modified.
        cand_ids: int16 [L, T, k+J] or None, top-(k+J) experts by original router score, rank order.
        cand_scores: float16/float32 [L, T, k+J] or None, the scores of ``cand_ids``.
        pred_ids: int16 [L, T, k] or None, prediction for layer l made at layer l−1 (layer 0 −1).
        conv_id: int32 [T] or None, conversation (the turns of one question share it).
        turn: int16 [T] or None, turn number within the conversation (0-based).
        unique: bool [T] or None, unique-view mask (shared prefix once).
        step_id: int32 [T] or None, decode-step index when recorded with B > 1 (−1 otherwise).
        slot: int16 [T] or None, batch row within the step (−1 otherwise).
    """

    topk_ids: NDArray[np.int16]
    req_id: NDArray[np.int32]
    pos: NDArray[np.int32]
    phase: NDArray[np.uint8]
    keep: NDArray[np.bool_]
    meta: dict[str, Any] = field(default_factory=dict)
    orig_topk_ids: NDArray[np.int16] | None = None
    cand_ids: NDArray[np.int16] | None = None
    cand_scores: NDArray[np.floating[Any]] | None = None
    pred_ids: NDArray[np.int16] | None = None
    conv_id: NDArray[np.int32] | None = None
    turn: NDArray[np.int16] | None = None
    unique: NDArray[np.bool_] | None = None
    step_id: NDArray[np.int32] | None = None
    slot: NDArray[np.int16] | None = None

    def __post_init__(self) -> None:
        """Convert dtypes, check shapes and fill the structural ``meta`` keys."""
        source = "RoutingTrace"
        setter = object.__setattr__  # frozen dataclass: normalise fields once, here
        topk = _as_ids("topk_ids", self.topk_ids, 3, source)
        num_layers, num_tokens, top_k = topk.shape
        if num_layers < 1 or num_tokens < 1 or top_k < 1:
            raise TraceFormatError(
                f"{source}: array 'topk_ids' must have shape [L, T, k] with "
                f"L, T, k >= 1, got {topk.shape}"
            )
        setter(self, "topk_ids", topk)
        meta = dict(self.meta)
        if "E" not in meta:
            raise TraceFormatError(
                f"{source}: meta['E'] (number of routed experts) is required; "
                "pass meta={'E': ...}"
            )
        num_experts = meta["E"]
        if (
            not isinstance(num_experts, int | np.integer)
            or isinstance(num_experts, bool)
            or num_experts < top_k
        ):
            raise TraceFormatError(
                f"{source}: meta['E'] must be an integer >= k={top_k}, got {num_experts!r}"
            )
        meta["E"] = int(num_experts)
        for key, actual in (("L", num_layers), ("k", top_k)):
            if meta.get(key) is not None and int(meta[key]) != actual:
                raise TraceFormatError(
                    f"{source}: meta[{key!r}]={meta[key]} disagrees with "
                    f"topk_ids of shape {topk.shape} (expected {actual})"
                )
            meta[key] = actual
        for name in ("orig_topk_ids", "pred_ids"):
            value = getattr(self, name)
            if value is not None:
                ids = _as_ids(name, value, 3, source)
                if ids.shape != topk.shape:
                    raise TraceFormatError(
                        f"{source}: array {name!r} must have the shape of "
                        f"topk_ids {topk.shape}, got {ids.shape}"
                    )
                setter(self, name, ids)
        self._init_candidates(meta, source)
        for name, dtype, required in (
            ("req_id", np.int32, True),
            ("pos", np.int32, True),
            ("phase", np.uint8, True),
            ("keep", np.bool_, True),
            ("conv_id", np.int32, False),
            ("turn", np.int16, False),
            ("unique", np.bool_, False),
            ("step_id", np.int32, False),
            ("slot", np.int16, False),
        ):
            value = getattr(self, name)
            if value is None:
                if required:
                    raise TraceFormatError(f"{source}: array {name!r} is required")
                continue
            setter(self, name, _as_vector(name, value, dtype, num_tokens, source))
        meta.setdefault("format", FORMAT_NAME)
        meta.setdefault("format_version", FORMAT_VERSION)
        meta.setdefault("ids_rank_ordered", None)
        meta.setdefault("score_kind", None)
        meta.setdefault("predictor", None)
        setter(self, "meta", meta)

    def _init_candidates(self, meta: dict[str, Any], source: str) -> None:
        """Convert and check ``cand_ids``/``cand_scores``; set ``meta['J']``."""
        if (self.cand_ids is None) != (self.cand_scores is None):
            raise TraceFormatError(
                f"{source}: 'cand_ids' and 'cand_scores' must be given together (traces.md §5)"
            )
        if self.cand_ids is None or self.cand_scores is None:
            meta["J"] = 0
            return
        num_layers, num_tokens, top_k = self.topk_ids.shape
        cand = _as_ids("cand_ids", self.cand_ids, 3, source)
        if cand.shape[:2] != (num_layers, num_tokens) or cand.shape[2] < top_k:
            raise TraceFormatError(
                f"{source}: array 'cand_ids' must have shape "
                f"[{num_layers}, {num_tokens}, k+J] with J >= 0, got "
                f"{cand.shape}"
            )
        scores = np.asarray(self.cand_scores)
        if scores.shape != cand.shape:
            raise TraceFormatError(
                f"{source}: array 'cand_scores' must have the shape of "
                f"cand_ids {cand.shape}, got {scores.shape}"
            )
        if scores.dtype not in (np.float16, np.float32):
            if scores.dtype.kind != "f":
                raise TraceFormatError(
                    f"{source}: array 'cand_scores' must be float16 or "
                    f"float32, got dtype {scores.dtype}"
                )
            scores = scores.astype(np.float32)
        object.__setattr__(self, "cand_ids", cand)
        object.__setattr__(self, "cand_scores", _readonly(scores))
        extra = cand.shape[2] - top_k
        if meta.get("J") is not None and int(meta["J"]) != extra:
            raise TraceFormatError(
                f"{source}: meta['J']={meta['J']} disagrees with cand_ids of "
                f"shape {cand.shape} (expected {extra})"
            )
        meta["J"] = extra

    # ------------------------------------------------------------------ dimensions

    @property
    def num_layers(self) -> int:
        """L, the number of MoE layers."""
        return int(self.topk_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """T, the number of token rows (raw view)."""
        return int(self.topk_ids.shape[1])

    @property
    def top_k(self) -> int:
        """K, the experts per token."""
        return int(self.topk_ids.shape[2])

    @property
    def num_experts(self) -> int:
        """E, the routed experts per layer (``meta["E"]``)."""
        return int(self.meta["E"])

    @property
    def num_candidates(self) -> int:
        """K+J, the router candidates per row (k when no candidates are stored)."""
        return self.top_k if self.cand_ids is None else int(self.cand_ids.shape[2])

    def array_items(self) -> list[tuple[str, NDArray[Any]]]:
        """Return the (name, array) pairs of every array present, in field order."""
        items = []
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if item.name != "meta" and value is not None:
                items.append((item.name, value))
        return items

    # ------------------------------------------------------------------ identity

    @cached_property
    def trace_id(self) -> str:
        """SHA-256 (hex) over ``topk_ids``, ``keep``, ``req_id`` and ``cand_*``/``pred_ids``.

        Each array contributes its name, little-endian dtype string, shape and C-order bytes, in
        the order topk_ids, keep, req_id, cand_ids, cand_scores, pred_ids (absent arrays are
        skipped). Metadata does not enter the id (traces.md §5).
        """
        digest = hashlib.sha256()
        for name in _TRACE_ID_ARRAYS:
            array = getattr(self, name)
            if array is None:
                continue
            canonical = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
            digest.update(f"{name}|{canonical.dtype.str}|{canonical.shape}|".encode())
            digest.update(canonical.tobytes())
        return digest.hexdigest()

    # ------------------------------------------------------------------ validation

    def validate(self, source: str = "RoutingTrace") -> None:
        """Check the content of every array (traces.md §5 "Validate on load").

        Checks: ids in [0, E) and k distinct ids per row (``topk_ids``, ``orig_topk_ids``,
        ``cand_ids``); the first k candidates are the original top-k as a set; ``pred_ids`` in
        [−1, E) with distinct non-negative ids; finite scores; ``phase`` in {0, 1, 2}; every
        ``req_id`` value forms one contiguous run in which ``pos`` increases by one.

        Args:
            source: Name used in error messages (usually the file path).

        Raises:
            TraceFormatError: Naming ``source``, the array, the layer and the first offending row.
        """
        num_experts = self.num_experts
        for name in ("topk_ids", "orig_topk_ids", "cand_ids"):
            ids = getattr(self, name)
            if ids is not None:
                _check_id_rows(ids, num_experts, name, source, allow_missing=False)
        if self.pred_ids is not None:
            _check_id_rows(self.pred_ids, num_experts, "pred_ids", source, allow_missing=True)
        if self.cand_ids is not None and self.cand_scores is not None:
            reference = self.orig_topk_ids if self.orig_topk_ids is not None else self.topk_ids
            ref_name = "orig_topk_ids" if self.orig_topk_ids is not None else "topk_ids"
            head = np.sort(self.cand_ids[:, :, : self.top_k], axis=2)
            bad = (head != np.sort(reference, axis=2)).any(axis=2)
            if bad.any():
                layer, row = _first_bad_row(bad)
                raise TraceFormatError(
                    f"{source}: array 'cand_ids' layer {layer} row {row}: the first k="
                    f"{self.top_k} candidates {self.cand_ids[layer, row, : self.top_k].tolist()} "
                    f"are not the set of {ref_name} {reference[layer, row].tolist()}; expected "
                    "the original top-k first (traces.md §5)"
                )
            finite = np.isfinite(self.cand_scores)
            if not finite.all():
                layer, row = _first_bad_row(~finite.all(axis=2))
                raise TraceFormatError(
                    f"{source}: array 'cand_scores' layer {layer} row {row}: "
                    "non-finite score; expected finite router scores"
                )
            if self.meta.get("score_kind") == "softmax_all":
                scores = self.cand_scores
                bad = ((scores < 0) | (scores > 1 + 1e-3)).any(axis=2)
                if bad.any():
                    layer, row = _first_bad_row(bad)
                    raise TraceFormatError(
                        f"{source}: array 'cand_scores' layer {layer} row {row}: scores "
                        f"{scores[layer, row].tolist()} outside [0, 1]; score_kind "
                        "'softmax_all' means softmax probabilities (traces.md §5)"
                    )
        bad_phase = np.flatnonzero(self.phase > 2)
        if bad_phase.size:
            row = int(bad_phase[0])
            raise TraceFormatError(
                f"{source}: array 'phase' row {row}: value "
                f"{int(self.phase[row])}; expected 0 (prefill), 1 (decode) or "
                "2 (unknown)"
            )
        _check_request_runs(self.req_id, self.pos, source)

    # ------------------------------------------------------------------ views

    def view(self, name: str = "content") -> NDArray[np.int64]:
        """Return the row indices of a view (traces.md §3.2), ascending.

        Args:
            name: "raw" (all rows), "unique" (shared prefix once; falls back to the content view
                when the trace has no ``unique`` mask) or "content" (``keep``).

        Returns:
            int64 [T_view] row indices.

        Raises:
            UnknownNameError: For an unknown view name.
        """
        if name == "raw":
            return np.arange(self.num_tokens, dtype=np.int64)
        if name == "content":
            return np.flatnonzero(self.keep).astype(np.int64)
        if name == "unique":
            mask = self.unique if self.unique is not None else self.keep
            return np.flatnonzero(mask).astype(np.int64)
        raise unknown_name("view", name, VIEWS)

    def group_ids(self) -> NDArray[np.int64]:
        """Return the request-group id of every row: ``conv_id`` when present, else ``req_id``.

        Returns:
            int64 [T].
        """
        source = self.conv_id if self.conv_id is not None else self.req_id
        return source.astype(np.int64)

    # ------------------------------------------------------------------ frequencies

    def _rows(self, rows: NDArray[np.integer[Any]] | None) -> NDArray[np.int64] | slice:
        if rows is None:
            return slice(None)
        return np.asarray(rows, dtype=np.int64)

    def layer_frequencies(
        self, layer: int, rows: NDArray[np.integer[Any]] | None = None
    ) -> NDArray[np.float64]:
        """Return the activation frequencies f_i of one layer (paper-model.md §1).

        Args:
            layer: MoE layer index in [0, L).
            rows: Row indices to count (default: all rows).

        Returns:
            float64 [E]: tokens routed to expert i ÷ tokens; sums to k.
        """
        ids = self.topk_ids[layer, self._rows(rows)]
        counts = np.bincount(ids.ravel(), minlength=self.num_experts)
        return counts.astype(np.float64) / max(ids.shape[0], 1)

    def groups(
        self, layer: int, rows: NDArray[np.integer[Any]] | None = None
    ) -> tuple[NDArray[np.int16], NDArray[np.float64]]:
        """Return the co-activation groups of one layer and their frequencies (paper-model.md §1).

        Args:
            layer: MoE layer index in [0, L).
            rows: Row indices to count (default: all rows).

        Returns:
            ``(sets, f_g)``: int16 [G, k], the distinct sorted top-k sets in lexicographic order,
            and float64 [G], their frequencies (tokens with that set ÷ tokens; sums to 1).
        """
        ids = np.sort(self.topk_ids[layer, self._rows(rows)], axis=1)
        sets, inverse, counts = unique_rows(ids)
        del inverse
        return sets, counts.astype(np.float64) / max(ids.shape[0], 1)

    def replace(self, **changes: Any) -> RoutingTrace:
        """Return a copy with some fields replaced (``dataclasses.replace``; meta is copied)."""
        if "meta" not in changes:
            changes["meta"] = dict(self.meta)
        return dataclasses.replace(self, **changes)


def concatenate(parts: Iterable[RoutingTrace]) -> RoutingTrace:
    """Concatenate traces of the same model along the token axis (e.g. the six categories).

    Request and conversation ids are renumbered so they stay distinct (each part's ids are
    offset by the count of the previous parts). Optional arrays are kept only when every part
    has them. ``meta`` is the first part's, with ``parts`` listing each part's trace id, category
    and row count.

    Args:
        parts: Traces with equal L, k, E and candidate width.

    Returns:
        The concatenated trace.

    Raises:
        TraceFormatError: When the parts disagree in L, k, E or J.
    """
    items = list(parts)
    if not items:
        raise TraceFormatError("concatenate: no traces given")
    first = items[0]
    for index, item in enumerate(items[1:], start=1):
        if (item.num_layers, item.top_k, item.num_experts, item.num_candidates) != (
            first.num_layers,
            first.top_k,
            first.num_experts,
            first.num_candidates,
        ):
            raise TraceFormatError(
                f"concatenate: part {index} has (L, k, E, k+J) = ({item.num_layers}, "
                f"{item.top_k}, {item.num_experts}, {item.num_candidates}) but part 0 has "
                f"({first.num_layers}, {first.top_k}, {first.num_experts}, "
                f"{first.num_candidates}); expected traces of the same model"
            )
    changes: dict[str, Any] = {}
    req_offset = conv_offset = 0
    req_parts, conv_parts = [], []
    for item in items:
        req_parts.append(item.req_id.astype(np.int64) - int(item.req_id.min()) + req_offset)
        req_offset = int(req_parts[-1].max()) + 1
        conv = item.group_ids()
        conv_parts.append(conv - int(conv.min()) + conv_offset)
        conv_offset = int(conv_parts[-1].max()) + 1
    changes["req_id"] = np.concatenate(req_parts).astype(np.int32)
    changes["conv_id"] = np.concatenate(conv_parts).astype(np.int32)
    for item_field in dataclasses.fields(RoutingTrace):
        name = item_field.name
        if name in ("meta", "req_id", "conv_id"):
            continue
        values = [getattr(item, name) for item in items]
        if any(value is None for value in values):
            if name in ("cand_ids", "cand_scores"):
                changes["cand_ids"] = changes["cand_scores"] = None
            elif name not in changes:
                changes[name] = None
            continue
        if (
            name in ("cand_ids", "cand_scores")
            and "cand_ids" in changes
            and changes["cand_ids"] is None
        ):
            continue
        axis = 1 if values[0].ndim == 3 else 0
        changes[name] = np.concatenate(values, axis=axis)
    meta = dict(first.meta)
    meta.pop("segments", None)
    meta["parts"] = [
        {"trace_id": item.trace_id, "category": item.meta.get("category"), "rows": item.num_tokens}
        for item in items
    ]
    meta["category"] = "+".join(str(item.meta.get("category")) for item in items)
    return RoutingTrace(meta=meta, **changes)


def unique_rows(
    rows: NDArray[np.integer[Any]],
) -> tuple[NDArray[np.int16], NDArray[np.int64], NDArray[np.int64]]:
    """Return the distinct rows of an id matrix, lexicographically ordered.

    Rows are encoded in one int64 key (mixed radix E) when that fits, which is much faster than
    ``np.unique(axis=0)``.

    Args:
        rows: int [N, k] non-negative ids (already sorted within rows when sets are meant).

    Returns:
        ``(unique [G, k] int16, inverse [N] int64, counts [G] int64)``.
    """
    rows = np.asarray(rows)
    num_rows, width = rows.shape
    if num_rows == 0:
        return (np.zeros((0, width), np.int16), np.zeros(0, np.int64), np.zeros(0, np.int64))
    radix = int(rows.max()) + 1
    if width * np.log2(max(radix, 2)) < 62:
        weights = radix ** np.arange(width - 1, -1, -1, dtype=np.int64)
        keys = rows.astype(np.int64) @ weights
        uniq_keys, first, inverse, counts = np.unique(
            keys, return_index=True, return_inverse=True, return_counts=True
        )
        del uniq_keys
        uniq = rows[first]
    else:
        uniq, inverse, counts = np.unique(rows, axis=0, return_inverse=True, return_counts=True)
    return uniq.astype(np.int16), inverse.astype(np.int64).ravel(), counts.astype(np.int64)


def _check_id_rows(
    ids: NDArray[np.int16], num_experts: int, name: str, source: str, *, allow_missing: bool
) -> None:
    """Check ids in range and distinct within rows; −1 allowed (as "no id") when requested."""
    low = -1 if allow_missing else 0
    bad: NDArray[np.bool_] = np.asarray(((ids < low) | (ids >= num_experts)).any(axis=2))
    if bad.any():
        layer, row = _first_bad_row(bad)
        values = ids[layer, row].tolist()
        expected = "[-1, E)" if allow_missing else "[0, E)"
        raise TraceFormatError(
            f"{source}: array {name!r} layer {layer} row {row}: ids {values} "
            f"out of range; expected ids in {expected} with E={num_experts}"
        )
    ordered = np.sort(ids, axis=2)
    same = ordered[:, :, 1:] == ordered[:, :, :-1]
    if allow_missing:
        same &= ordered[:, :, 1:] >= 0
    dup = same.any(axis=2)
    if dup.any():
        layer, row = _first_bad_row(dup)
        raise TraceFormatError(
            f"{source}: array {name!r} layer {layer} row {row}: duplicate "
            f"expert ids {ids[layer, row].tolist()}; expected "
            f"{ids.shape[2]} distinct ids per row"
        )


def _check_request_runs(req_id: NDArray[np.int32], pos: NDArray[np.int32], source: str) -> None:
    """Check that every request id forms one contiguous run with ``pos`` increasing by one."""
    change = np.flatnonzero(req_id[1:] != req_id[:-1]) + 1
    run_starts = np.concatenate(([0], change))
    run_values = req_id[run_starts]
    uniq, first = np.unique(run_values, return_index=True)
    if uniq.size != run_values.size:
        seen = np.zeros(run_values.size, dtype=bool)
        seen[first] = True
        repeat = int(np.flatnonzero(~seen)[0])
        row = int(run_starts[repeat])
        raise TraceFormatError(
            f"{source}: array 'req_id' row {row}: request {int(req_id[row])} "
            "starts a second run; expected the rows of every request to be "
            "contiguous"
        )
    if (pos < 0).any():
        row = int(np.flatnonzero(pos < 0)[0])
        raise TraceFormatError(
            f"{source}: array 'pos' row {row}: negative position "
            f"{int(pos[row])}; expected positions >= 0"
        )
    step = np.diff(pos.astype(np.int64))
    inside = np.ones(pos.size - 1, dtype=bool)
    inside[change - 1] = False
    bad = np.flatnonzero(inside & (step != 1))
    if bad.size:
        row = int(bad[0]) + 1
        raise TraceFormatError(
            f"{source}: array 'pos' row {row}: position {int(pos[row])} after "
            f"{int(pos[row - 1])} within request {int(req_id[row])}; expected "
            "positions to increase by one within a request"
        )
