"""Helpers of the trace tests (a uniquely named module, imported by the test files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

import traces


def make_trace(
    sets: np.ndarray, *, E: int, req_lengths: list[int] | None = None, **kwargs: Any
) -> traces.RoutingTrace:
    """Build a RoutingTrace from ids [L, T, k] with one request per entry of req_lengths."""
    sets = np.asarray(sets)
    num_tokens = sets.shape[1]
    lengths = req_lengths or [num_tokens]
    req = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    pos = np.arange(num_tokens) - starts[req]
    fields: dict[str, Any] = dict(
        topk_ids=sets,
        req_id=req,
        pos=pos,
        phase=np.ones(num_tokens, np.uint8),
        keep=np.ones(num_tokens, bool),
        meta={"E": E},
    )
    fields.update(kwargs)
    return traces.RoutingTrace(**fields)


def write_json(directory: Path, name: str, document: Any) -> Path:
    path = directory / name
    path.write_text(json.dumps(document))
    return path
