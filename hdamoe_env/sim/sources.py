"""Routing-trace sources: the one loader that turns a trace spec into a ``RoutingTrace``.

Implements the trace inputs of paper-model.md §5.7 (the evaluators consume concrete routing) with
the trace formats and generators of traces.md: ``"synthetic"`` (the built-in generators of
traces.md §7, with a generic expert-level fallback for models without fitted parameters
[decision]), a reference JSON file (traces.md §3, read with the model's E, k and layer-key
offset) or a canonical ``.npz`` file (traces.md §5). Every caller — the env, the CLI, the bench
and the placement pipeline — loads through ``load_trace``; where they differ (number of rows,
predictions) the difference is an explicit argument at the call site.

The router scores gating needs are trace data too: ``with_router_scores`` returns a trace that
carries router candidates, synthesising them (traces.md §7.5) for a trace that records none, and
``step_candidates`` gathers the candidates of one decode step's rows.

The core converts a ``ModelSpec`` into the plain numbers ``traces`` needs here, at the boundary
(style.md §2).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.config.cache import BoundedCache
from hdamoe_env.config.errors import ConfigError, TraceFormatError
from hdamoe_env.config.run import check_trace_skew
from hdamoe_env.config.specs import ModelSpec
from traces import RoutingTrace, load, read_reference_json, synthetic

__all__ = ["GENERIC_GENERATOR", "check_skew_applies", "check_trace_skew", "load_trace",
           "step_candidates", "with_router_scores"]

logger = logging.getLogger(__name__)

#: Generic expert-level generator parameters for models without fitted ones [decision].
GENERIC_GENERATOR: dict[str, float] = {"zipf_s": 0.7, "gamma": 0.1, "kappa": 150.0,
                                       "kappa_block": 160.0}

#: Synthetic traces by (model shape, generator arguments, skew). A bench run uses one or two,
#: the whole test suite 29 (measured), so 32 never evicts either working set while bounding
#: memory (a DeepSeek-sized trace of 8192 rows with scores is about 18 MB).
_TRACE_CACHE: BoundedCache[tuple[Any, ...], RoutingTrace] = BoundedCache(
    32, name="hdamoe_env.sim.sources.synthetic_traces")


def _synthetic(model: ModelSpec, seed: int, requests: int | None, tokens: int | None,
               predictor: str | None, skew: float) -> RoutingTrace:
    """Generate (and cache per process) the synthetic trace of a model (traces.md §7)."""
    key = (model.key, model.num_moe_layers, model.num_experts, model.top_k, requests, tokens,
           seed, predictor, skew)
    hit = _TRACE_CACHE.get(key)
    if hit is not None:
        return hit
    preset = synthetic.model_params(model.key) if model.key in synthetic.MODEL_KEYS else None
    if preset is not None and (preset["L"], preset["E"], preset["k"]) == (
            model.num_moe_layers, model.num_experts, model.top_k):
        trace = synthetic.generate(model.key, n_requests=requests, n_tokens=tokens, seed=seed,
                                   predictor=predictor, skew=skew)
    else:
        params = dict(GENERIC_GENERATOR, E=model.num_experts, k=model.top_k,
                      L=model.num_moe_layers, clusters=max(2, min(16, model.num_experts)))
        trace = synthetic.generate("deepseek-v2-lite", n_requests=requests, n_tokens=tokens,
                                   seed=seed, predictor=predictor, params=params,
                                   J=min(model.top_k, model.num_experts - model.top_k),
                                   skew=skew)
    return _TRACE_CACHE.put(key, trace)


def check_skew_applies(spec: Any, skew: float) -> None:
    """Check that a trace skew τ can describe the trace ``spec``.

    τ = 1 fits every trace. τ != 1 fits ``"synthetic"`` (generated with it) and a loaded
    ``RoutingTrace`` whose generator recorded that τ (``meta["generator"]["skew"]``, as the
    bench passes the trace it loaded once to every env); files and other traces are rejected.

    Raises:
        ConfigError: τ != 1 for a trace it does not describe (the message names both).
    """
    if skew == 1.0 or (isinstance(spec, str) and spec == "synthetic"):
        return
    if isinstance(spec, RoutingTrace):
        generator = spec.meta.get("generator") or {}
        recorded = generator.get("skew", 1.0) if isinstance(generator, dict) else 1.0
        if float(recorded) == skew:
            return
        what = f"the trace {spec.trace_id[:12]} (generated with skew {float(recorded):g})"
    else:
        what = f"the trace {str(spec)!r}"
    raise ConfigError(f"trace_skew={skew:g} reshapes the synthetic generator's popularity and "
                      f"cannot apply to {what}; use trace='synthetic' or trace_skew=1")


def _from_file(path: Path, model: ModelSpec | None) -> RoutingTrace:
    """Read a reference ``.json`` (with the model's E, k, layer offset) or a canonical ``.npz``."""
    if not path.exists():
        raise TraceFormatError(f"trace file {str(path)!r} does not exist; pass a .json reference "
                               "trace, a .hdtrace.npz file, or 'synthetic'")
    if path.suffix == ".json":
        if model is None:
            return read_reference_json(path)
        return read_reference_json(path, model_key=model.key, E=model.num_experts,
                                   k=model.top_k, layer_key_offset=model.layer_key_offset)
    return load(path)


def load_trace(spec: str | os.PathLike[str] | RoutingTrace, model: ModelSpec | None, *,
               seed: int = 0, requests: int | None = None, tokens: int | None = None,
               predictor: str | None = None, skew: float = 1.0) -> RoutingTrace:
    """Return the routing trace named by ``spec`` for ``model``.

    Args:
        spec: ``"synthetic"`` (generated), a path to a reference ``.json`` or canonical ``.npz``
            trace, or a ``RoutingTrace`` (returned as is).
        model: The model. Synthetic traces are generated for its shape (L, E, k): with the fitted
            generator of its preset when one matches, otherwise with ``GENERIC_GENERATOR``
            [decision]. A reference JSON file is read with its E, k and layer-key offset (None:
            the reader's defaults; synthetic traces need a model).
        seed: Seed of the synthetic trace.
        requests: Synthetic: number of requests (None: the generator's default).
        tokens: Synthetic: total rows (None: the generator's default).
        predictor: Synthetic: ``"noisy_oracle"`` also records predicted sets (``pred_ids``,
            traces.md §7.6); None records none.
        skew: Synthetic: skew power τ of the expert popularity (``traces.synthetic``: p ← p^τ;
            1 = the fitted generator). Files take only 1; a ``RoutingTrace`` only the skew it
            was generated with (see :func:`check_skew_applies`).

    Returns:
        The trace. Synthetic traces are cached per process by (model shape, arguments, skew).

    Raises:
        TraceFormatError: The file does not exist or is malformed (the message names it).
        ConfigError: ``spec`` is of another type, ``"synthetic"`` without a model, ``skew`` not
            finite and > 0, or ``skew`` != 1 for a trace that is not synthetic.
    """
    skew = check_trace_skew(skew)
    check_skew_applies(spec, skew)
    if isinstance(spec, RoutingTrace):
        return spec
    if isinstance(spec, str) and spec == "synthetic":
        if model is None:
            raise ConfigError("trace 'synthetic' needs a model to generate routing for")
        return _synthetic(model, int(seed), requests, tokens, predictor, skew)
    if isinstance(spec, str | os.PathLike):
        return _from_file(Path(spec), model)
    raise ConfigError(f"trace must be 'synthetic', a RoutingTrace or a path, got "
                      f"{type(spec).__name__}")


def with_router_scores(trace: RoutingTrace, seed: int) -> RoutingTrace:
    """Return ``trace`` if it records router candidates, else a copy with synthesised ones.

    Gating re-ranks the router's candidates; a trace of expert ids alone (a reference trace, or
    a synthetic one generated without scores) gets scores consistent with its sets from
    ``traces.synthetic.synthesize_scores`` (traces.md §7.5; ``meta["score_kind"]`` =
    ``"synthetic"``), and gating results on it are indicative only.

    Args:
        trace: The routing trace.
        seed: Seed of the score synthesis (``np.random.default_rng(seed)``).

    Returns:
        A trace with ``cand_ids`` and ``cand_scores``.
    """
    if trace.cand_ids is not None:
        return trace
    logger.info("trace %s has no router scores: synthesising them (traces.md §7.5); "
                "gating results are indicative only", trace.trace_id)
    return synthetic.synthesize_scores(trace, np.random.default_rng(seed))


def step_candidates(trace: RoutingTrace, rows: NDArray[np.integer]
                    ) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """Return the router candidates of one decode step's rows, every layer at once.

    Args:
        trace: A trace with router candidates (``with_router_scores``).
        rows: int [B] the step's trace rows (batch order).

    Returns:
        (ids int64 [L, B, k + J], scores float64 [L, B, k + J]), C-contiguous: the arrays
        gating works on.
    """
    assert trace.cand_ids is not None and trace.cand_scores is not None
    return (np.ascontiguousarray(trace.cand_ids[:, rows], dtype=np.int64),
            np.ascontiguousarray(trace.cand_scores[:, rows], dtype=np.float64))
