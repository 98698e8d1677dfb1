"""Routing traces: the data model shared by the simulator, the baselines and the agents.

Implements traces.md §5 (the in-memory form of the canonical trace) and the views of §3.2. A
:class:`RoutingTrace` is data only: NumPy arrays plus a JSON-serialisable ``meta`` dict. Shapes:
L = MoE layers, T = token rows, k = top-k, J = extra router candidates, E = routed experts (from
``meta["E"]``).

This package is the bottom layer of the project (style.md §2): it uses NumPy and the standard
library only and imports nothing from ``hdamoe_env``, ``agents`` or ``baselines``. Model
dimensions come in as plain numbers (E, k, L, layer-key offset) or from a trace's ``meta``.

This module only re-exports. Submodules:

* :mod:`traces.trace` — :class:`RoutingTrace`, ``concatenate``, ``unique_rows`` (§5);
* :mod:`traces.errors` — ``TraceFormatError``, ``UnknownNameError``;
* :mod:`traces.io` — canonical ``.npz`` (format version 1; traces.md §5);
* :mod:`traces.reference` — the reference JSON reader and converter, segment detection
  (traces.md §2, §3.2);
* :mod:`traces.batching` — decode-step formation (§6);
* :mod:`traces.synthetic` — set-level and expert-level generators, score synthesis, noisy-oracle
  predictions (§7);
* :mod:`traces.stats` — skew, co-activation, fluctuation, reuse and predictability statistics (§4).

May import: nothing (NumPy and the standard library only)
"""

from __future__ import annotations

from traces.batching import (
    BATCH_MODES,
    distinct_requests,
    identical,
    make_steps,
    random_rows,
    random_rows_per_layer,
    requests,
    streams,
    take,
    windows,
)
from traces.errors import TraceFormatError, UnknownNameError, unknown_name
from traces.io import load, save
from traces.reference import convert_reference, detect_segments, read_reference_json
from traces.stats import stats_table, trace_stats
from traces.synthetic import (
    GENERATOR_PARAMS,
    MODEL_KEYS,
    generate,
    noisy_oracle_predictions,
    synthesize_scores,
    with_noisy_oracle,
)
from traces.trace import FORMAT_NAME, FORMAT_VERSION, VIEWS, RoutingTrace, concatenate, unique_rows

__all__ = [
    "BATCH_MODES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "GENERATOR_PARAMS",
    "MODEL_KEYS",
    "VIEWS",
    "RoutingTrace",
    "TraceFormatError",
    "UnknownNameError",
    "concatenate",
    "convert_reference",
    "detect_segments",
    "distinct_requests",
    "generate",
    "identical",
    "load",
    "make_steps",
    "noisy_oracle_predictions",
    "random_rows",
    "random_rows_per_layer",
    "read_reference_json",
    "requests",
    "save",
    "streams",
    "synthesize_scores",
    "take",
    "stats_table",
    "trace_stats",
    "unique_rows",
    "unknown_name",
    "windows",
    "with_noisy_oracle",
]
