"""Hardware-aware gating (HAG): routing scores adjusted by compute and communication penalties.

Implements paper-model.md §11 (paper §V-D):

* §11.2 — the sequential greedy: the B rows of one decode step are processed in batch order; for
  row t every candidate expert i gets the adjusted score
  a_i = s[t, i] + σ·(r_comp·ΔT_comp(i) + r_comm·ΔT_comm(i)), S_t = top-k of a, and the running
  counts n (tokens already assigned in this step) are updated with S_t;
* §11.3 — computation penalties ``marginal_max`` (default: increase of the compute critical path,
  (max_c(L_c + P_ic·w) − max_c L_c)/C with L_c = Σ_j P_jc·n_j·w), ``host_finish`` and
  ``host_load_mean``; with a ``TileCost`` (profiles with the tile model, docs/PHYSICS.md §4) the
  same penalties on the seconds the evaluator charges every node (tile-padded tokens and columns,
  per-GEMM overhead, weight streaming of the shards activated), so a token that fills an open
  token tile costs nothing and one that opens a tile or activates a shard costs all of it;
* §11.4 — communication penalties ``dispersion`` (default: |nodes(i)|) and ``new_nodes``
  (|nodes(i) \\ nodes already receiving token t|, experts chosen one at a time);
* §11.5 — selection over all candidates, ``protect_top`` and ``candidate_window`` options, weights
  = the selected experts' ORIGINAL scores post-processed by the model's rule (renormalised over
  the k or not);
* §11.7 — the coefficient defaults found in the authors' artifacts (``default_coefficients``);
* §11.8 — diagnostics: normalised gating entropy and top margin s_(1) − s_(k+1).

The loop over rows is inherent to the algorithm (row t's penalties depend on the choices of rows
< t). It runs in numba kernels (:mod:`hdamoe_env.decisions.gating_kernels`, compiled once and
cached on disk like the DES kernel); the pure-Python loop they replaced lives with the tests
(``tests/hdamoe_env/decisions/gating_reference.py``), the oracle they are compared with for exact
equality. This module holds the public API, the argument checks, the candidate sort, the
placement tables the kernels read and the statistics. The penalties are computed once per row
from the state before the row (``new_nodes`` additionally updates the covered nodes after each
of the k picks). Pure functions, numpy and numba only (style.md §2).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.cache import BoundedCache
from hdamoe_env.config.errors import ConfigError, unknown_name
from hdamoe_env.decisions.gating_kernels import (Tiles, all_finite, fused_kernel,
                                                 fused_sets_many, fused_sets_many_par,
                                                 greedy_kernel, ids_in_range, kept_counts,
                                                 no_tiles, sort_rows)

__all__ = [
    "COEFFICIENTS",
    "COMM_PENALTIES",
    "COMP_PENALTIES",
    "GatedSetsMany",
    "GatingResult",
    "TileCost",
    "default_coefficients",
    "gated_sets",
    "gating_diagnostics",
    "hardware_aware_gating",
    "penalties",
]

COMP_PENALTIES = ("marginal_max", "host_finish", "host_load_mean")
COMM_PENALTIES = ("dispersion", "new_nodes")

#: §11.7 recommended (r_comp [1/s], r_comm) per model key, in the ``paper`` profile's units
#: (ΔT_comp in seconds with w = 2·h·I). Per-setting exceptions in ``_SETTING_COEFFICIENTS``.
COEFFICIENTS: dict[str, tuple[float, float]] = {
    "deepseek-v2-lite": (-4.5e4, -0.015),
    "mixtral-8x7b": (-1.16e6, -0.03),
    "qwen2-57b-a14b": (-1.3e5, -0.001),
}
_SETTING_COEFFICIENTS: dict[tuple[str, str], tuple[float, float]] = {
    ("deepseek-v2-lite", "10/25"): (-4.5e4, -0.02),
}
#: [decision] Qwen3.5's coefficients are unknown (§11.7 "tune"): Qwen2's are used; models outside
#: the presets use DeepSeek's.
_FALLBACK = {"qwen3.5-35b-a3b": "qwen2-57b-a14b"}


def default_coefficients(model_key: str, setting: str, expert_matrices: int = 1
                         ) -> tuple[tuple[float, float], str]:
    """Return the default (r_comp, r_comm) of a model and setting, in the profile's units (§11.7).

    The published r_comp is per second of ΔT_comp computed with w = 2·h·I (m = 1); with m matrices
    per expert the penalties are m times larger, so r_comp is divided by m to keep the decisions
    (§11.3). r_comm is dimensionless (dispersion counts nodes) and is not rescaled.

    Args:
        model_key: Model preset key (``ModelSpec.key``).
        setting: Compute/bandwidth label such as ``"5/50"``.
        expert_matrices: m of the conventions.

    Returns:
        ``((r_comp, r_comm), source)``; ``source`` says where the values come from (e.g.
        ``"qwen2-57b-a14b (Qwen3.5 unknown)"``).
    """
    key = model_key
    note = key
    if key in _FALLBACK:
        key = _FALLBACK[key]
        note = f"{key} ({model_key}: coefficients unknown, §11.7)"
    elif key not in COEFFICIENTS:
        key = "deepseek-v2-lite"
        note = f"{key} (no coefficients for {model_key!r})"
    r_comp, r_comm = _SETTING_COEFFICIENTS.get((key, setting), COEFFICIENTS[key])
    return (r_comp / expert_matrices, r_comm), note


@dataclass(frozen=True, eq=False)
class GatingResult:
    """Gated expert sets of one decode step and the perturbation statistics (§11.5, §12).

    Attributes:
        sets: int64 [B, k] selected experts per row, ordered by adjusted score (best first).
        weights: float64 [B, k] routing weights of ``sets``: the original scores, renormalised over
            the k when the model does so.
        orig_sets: int64 [B, k] the original top-k (by original score, best first).
        changed_fraction: fraction of rows whose expert set changed.
        changed_choices: fraction of (row, rank) choices replaced, Σ_r replaced_per_rank[r] / k.
        top1_retention: fraction of rows whose original top-1 expert is still selected (set
            membership).
        score_mass_kept: Σ original scores of the selected ÷ Σ original top-k scores (batch sums).
        replaced_per_rank: float64 [k] fraction of rows whose original rank-r expert was dropped.
        entropy: mean normalised gating entropy −Σ s log s / log E over rows (over the given
            candidates only when scores come as candidates), NaN when unavailable.
        top_margin: mean s_(1) − s_(k+1) over rows (NaN with only k candidates).
    """

    sets: NDArray[np.int64]
    weights: NDArray[np.float64]
    orig_sets: NDArray[np.int64]
    changed_fraction: float
    changed_choices: float
    top1_retention: float
    score_mass_kept: float
    replaced_per_rank: NDArray[np.float64]
    entropy: float
    top_margin: float


@dataclass(frozen=True, eq=False)
class TileCost:
    """The per-node expert cost the evaluator charges under the tile model (docs/PHYSICS.md §4).

    A node c with n_i tokens of every expert is charged max(compute_c, stream_c) seconds:

    compute_c = Σ_{i: P_ic > 0} ceil(n_i/T)·T·``row_s[i, c]`` + 1[n_i > 0]·``gemm_s``,
    stream_c = Σ_i 1[n_i > 0]·``stream_s[i, c]``

    (``perf.tiled_node_compute`` and the streaming of ``perf.expert_compute_times`` with the
    step's counts; built from a profile by ``hdamoe_env.sim.online.gating_tile_cost``). The
    gating penalties then charge what one more token changes in these seconds.

    Attributes:
        row_s: float [E, D] seconds per padded token row of every shard,
            ceil(P_ic·I/T_c)·T_c·m·2h/C (0 where c holds no share of i).
        gemm_s: Fixed seconds per active shard, m·o.
        stream_s: float [E, D] weight-streaming seconds of every shard while its expert is
            active, P_ic·W_e/(BW_mem·η) (zeros when the profile does not charge streaming).
        tile_tokens: Token tile T (GEMM rows pad to a multiple of it).
    """

    row_s: NDArray[np.float64]
    gemm_s: float
    stream_s: NDArray[np.float64]
    tile_tokens: int

    def node_times(self, counts: ArrayLike) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Return (compute_c, stream_c) [D] of integer token counts n [E] (the formula above)."""
        n = np.asarray(counts, dtype=np.float64)
        T = self.tile_tokens
        rows = np.ceil(np.maximum(n / T - 1e-9, 0.0)) * T
        active = (n > 0).astype(np.float64)
        compute = rows @ self.row_s + (active @ (self.row_s > 0)) * self.gemm_s
        return compute, active @ self.stream_s

    @functools.cached_property
    def holder_tables(self) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Return (row_s, stream_s) of every shard in holder order (by expert, then node).

        The order of ``gating._prepared_arrays``' holders of a placement whose support is
        ``row_s > 0`` (``check``); computed once per object.
        """
        row_s = np.asarray(self.row_s, dtype=np.float64)
        rows, cols = np.nonzero(row_s > 0)
        return (np.ascontiguousarray(row_s[rows, cols]),
                np.ascontiguousarray(np.asarray(self.stream_s, dtype=np.float64)[rows, cols]))

    def node_cost(self, counts: ArrayLike) -> NDArray[np.float64]:
        """Return the seconds max(compute_c, stream_c) [D] charged every node at counts n."""
        compute, stream = self.node_times(counts)
        return np.maximum(compute, stream)

    def check(self, P: NDArray[np.float64]) -> None:
        """Raise ``ConfigError`` unless the tables match placement ``P`` [E, D]."""
        row_s = np.asarray(self.row_s)
        stream = np.asarray(self.stream_s)
        if row_s.shape != P.shape or stream.shape != P.shape:
            raise ConfigError(f"TileCost tables must have the placement's shape {P.shape}, got "
                              f"{row_s.shape} and {stream.shape}")
        if not np.array_equal(row_s > 0, P > 0):
            raise ConfigError("TileCost.row_s must be positive exactly where P_ic > 0")
        if not (isinstance(self.tile_tokens, int | np.integer) and self.tile_tokens >= 1):
            raise ConfigError(f"TileCost.tile_tokens must be an integer >= 1, got "
                              f"{self.tile_tokens!r}")
        if not (math.isfinite(self.gemm_s) and self.gemm_s >= 0
                and np.isfinite(row_s).all() and np.isfinite(stream).all()
                and (stream >= 0).all()):
            raise ConfigError("TileCost times must be finite and >= 0")


# ------------------------------------------------------------------------------ candidates


@dataclass(frozen=True, eq=False)
class _Candidates:
    """Candidate experts of every row sorted by original score (best first).

    ``ids``/``vals`` hold a prefix of ``prefix`` columns (all candidates when the input is small);
    the rare rows whose scan needs more are sorted whole from ``raw_ids``/``raw_vals``.
    """

    ids: NDArray[np.int64]           # [B, W] prefix, sorted
    vals: NDArray[np.float64]        # [B, W]
    width: int                       # candidates per row in total (after the window)
    raw_ids: NDArray[np.int64] | None
    raw_vals: NDArray[np.float64]


def _candidates(scores: ArrayLike | tuple[ArrayLike, ArrayLike], k: int, num_experts: int,
                window: int | None) -> _Candidates:
    """Validate the scores and sort the candidates of every row (never trust positions, §11.5)."""
    raw_ids: NDArray[np.int64] | None
    if isinstance(scores, tuple):
        if len(scores) != 2:
            raise ConfigError("candidate scores must be a pair (ids [B, k+J], scores [B, k+J])")
        ids_in = np.asarray(scores[0])
        vals = np.asarray(scores[1], dtype=np.float64)
        if ids_in.ndim != 2 or ids_in.shape != vals.shape or not np.issubdtype(ids_in.dtype,
                                                                                np.integer):
            raise ConfigError(f"candidate ids and scores must be integer and float arrays of the "
                              f"same shape [B, C], got {ids_in.shape} ({ids_in.dtype}) and "
                              f"{vals.shape}")
        raw_ids = np.ascontiguousarray(ids_in, dtype=np.int64)     # no copy when int64
        if raw_ids.size and not ids_in_range(raw_ids, num_experts):
            raise ConfigError(f"candidate ids must lie in [0, E={num_experts}), got range "
                              f"[{raw_ids.min()}, {raw_ids.max()}]")
    else:
        vals = np.asarray(scores, dtype=np.float64)
        if vals.ndim != 2 or vals.shape[1] != num_experts:
            raise ConfigError(f"scores must have shape [B, E={num_experts}], got {vals.shape}")
        raw_ids = None
    vals = np.ascontiguousarray(vals)
    if not all_finite(vals):
        raise ConfigError("scores must be finite")
    num_rows, total = vals.shape
    if not (isinstance(k, int | np.integer) and 1 <= k <= total):
        raise ConfigError(f"k must be an integer in [1, {total}] (candidates per row), got {k!r}")
    if window is not None:
        if window < 0:
            raise ConfigError(f"candidate_window must be >= 0 or None, got {window}")
        total = min(total, k + int(window))
    prefix = total if total <= 4 * k + 4 else 3 * k + 2
    if prefix < vals.shape[1]:
        top = np.argpartition(-vals, prefix - 1, axis=1)[:, :prefix]
        sub = np.take_along_axis(vals, top, axis=1)
    else:                                # every candidate: one compiled stable sort per row
        ids_sorted, vals_sorted = sort_rows(
            vals, np.empty((0, 0), dtype=np.int64) if raw_ids is None else raw_ids,
            raw_ids is not None)
        return _Candidates(ids_sorted, vals_sorted, total, raw_ids, vals)
    order = np.argsort(-sub, axis=1, kind="stable")
    pre_vals = np.take_along_axis(sub, order, axis=1)[:, :prefix]
    pos = order if top is None else np.take_along_axis(top, order, axis=1)
    pos = pos[:, :prefix]
    pre_ids = pos if raw_ids is None else np.take_along_axis(raw_ids, pos, axis=1)
    return _Candidates(np.ascontiguousarray(pre_ids, dtype=np.int64),
                       np.ascontiguousarray(pre_vals), total, raw_ids, vals)


def gating_diagnostics(scores: ArrayLike, k: int) -> tuple[float, float]:
    """Return the mean normalised entropy and the mean top margin of router probabilities (§11.8).

    Args:
        scores: float [B, E] router probabilities (rows sum to 1), or [B, C] candidate scores
            (the entropy then covers the candidates only and is normalised by log C).
        k: Top-k.

    Returns:
        ``(entropy, top_margin)``: mean over rows of −Σ s log s / log(width) and of
        s_(1) − s_(k+1); the margin is NaN with fewer than k+1 scores per row.
    """
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] == 0:
        return float("nan"), float("nan")
    width = s.shape[1]
    positive = s > 0
    ent = -(s * np.log(np.where(positive, s, 1.0))).sum(axis=1)
    entropy = float(ent.mean() / math.log(width)) if width > 1 else float("nan")
    if width <= k:
        return entropy, float("nan")
    part = -np.partition(-s, (0, k), axis=1)
    return entropy, float((part[:, 0] - part[:, k]).mean())


def penalties(P_layer: ArrayLike, counts: ArrayLike, w_flops: float, compute_flops: float, *,
              comp_penalty: str = "marginal_max", tile_cost: TileCost | None = None
              ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Return ΔT_comp [E] (seconds) and the dispersion |nodes(i)| [E] for counts n (§11.3–11.4).

    L_c = Σ_j P_jc·n_j·w; ``marginal_max``: (max_c (L_c + P_ic·w) − max_c L_c)/C;
    ``host_finish``: max_{c ∈ nodes(i)} (L_c + P_ic·w)/C; ``host_load_mean``:
    Σ_c P_ic·(L_c + P_ic·w)/C. With ``tile_cost`` the same three on the charged seconds
    T_c(n) = ``tile_cost.node_cost(n)`` in place of L_c/C and T_c(n + e_i) in place of
    (L_c + P_ic·w)/C. The vectorised form of the penalties the greedy applies row by row (for
    agents, diagnostics and tests; the greedy updates the costs incrementally, equal up to
    rounding).

    Args:
        P_layer: float [E, D] placement shares.
        counts: float [E] tokens already assigned per expert (integers with ``tile_cost``).
        w_flops: Work per (token, expert), FLOP.
        compute_flops: Node throughput C, FLOP/s.
        comp_penalty: One of ``COMP_PENALTIES``.
        tile_cost: The evaluator's tile-model node cost, or None for the fluid model.

    Returns:
        ``(dT_comp_s, dispersion)``.
    """
    P = np.asarray(P_layer, dtype=np.float64)
    n = np.asarray(counts, dtype=np.float64)
    if P.ndim != 2 or n.shape != (P.shape[0],):
        raise ConfigError(f"P_layer must be [E, D] and counts [E]; got {P.shape} and {n.shape}")
    if comp_penalty not in COMP_PENALTIES:
        raise unknown_name("computation penalty", comp_penalty, COMP_PENALTIES)
    if tile_cost is not None:
        tile_cost.check(P)
        before = tile_cost.node_cost(n)                                          # [D]
        after = np.stack([tile_cost.node_cost(n + e) for e in np.eye(P.shape[0])])  # [E, D]
        if comp_penalty == "marginal_max":
            comp = after.max(axis=1) - before.max()
        elif comp_penalty == "host_finish":
            comp = np.where(P > 0, after, 0.0).max(axis=1)
        else:
            comp = (P * after).sum(axis=1)
        return comp, (P > 0).sum(axis=1).astype(np.float64)
    loads = (n @ P) * w_flops                                    # [D]
    after = loads[None, :] + P * w_flops                         # [E, D]
    if comp_penalty == "marginal_max":
        comp = (after.max(axis=1) - loads.max()) / compute_flops
    elif comp_penalty == "host_finish":
        comp = np.where(P > 0, after, 0.0).max(axis=1) / compute_flops
    else:
        comp = (P * after).sum(axis=1) / compute_flops
    return comp, (P > 0).sum(axis=1).astype(np.float64)


# ------------------------------------------------------------------------------ the algorithm


def hardware_aware_gating(
    scores: ArrayLike | tuple[ArrayLike, ArrayLike],
    k: int,
    P_layer: ArrayLike,
    w_flops: float,
    compute_flops: float,
    r_comp: float,
    r_comm: float,
    *,
    sigma: float = 1.0,
    comp_penalty: str = "marginal_max",
    comm_penalty: str = "dispersion",
    protect_top: int = 0,
    candidate_window: int | None = None,
    include_future: bool = False,
    renormalize: bool = False,
    initial_counts: ArrayLike | None = None,
    diagnostics: bool = True,
    tile_cost: TileCost | None = None,
) -> GatingResult:
    """Choose every row's k experts with hardware-aware penalties (paper-model.md §11.2–11.5).

    Sequential greedy in batch order with running counts n (start: zero, ``initial_counts``, or
    with ``include_future`` the original top-k counts of all rows minus the current row's):

    ``a_i = s_i + σ·(r_comp·ΔT_comp(i) + r_comm·ΔT_comm(i))``, S_t = top-k of a, n[S_t] += 1,

    with L_c = Σ_j P_jc·n_j·w and, by default, ΔT_comp(i) = (max_c (L_c + P_ic·w) − max_c L_c)/C
    and ΔT_comm(i) = |nodes(i)|. With ``tile_cost`` the node costs are the seconds the
    evaluator charges under the tile model instead of L_c/C (``TileCost``): ΔT_comp(i) =
    max_c T_c(n + e_i) − max_c T_c(n). With ``r_comp = r_comm = 0`` the result is exactly the
    original top-k. The paper's coefficients are negative (penalties lower the score). Ties between equal
    adjusted scores go to the better original rank; ties between equal original scores to the
    earlier candidate (expert id for full score rows).

    Cost: one pass over the rows (inherent: row t depends on the choices of rows < t); per row
    only the candidates that can still enter the top-k are evaluated (exact pruning, see
    ``gating_kernels.scan_row``).

    Args:
        scores: float [B, E] router probabilities of the step's rows (batch order), or a pair
            ``(ids [B, k+J], scores [B, k+J])`` of top-(k+J) candidates (only candidates can be
            selected).
        k: Experts per token.
        P_layer: float [E, D] placement shares of the layer.
        w_flops: Work per (token, expert) w = F_e of the profile, FLOP.
        compute_flops: Node throughput C, FLOP/s.
        r_comp: Computation coefficient, 1/s (applied to ΔT_comp in seconds).
        r_comm: Communication coefficient (applied to a node count).
        sigma: Layer scale σ_l (§11.8).
        comp_penalty: ``"marginal_max"`` (default), ``"host_finish"`` or ``"host_load_mean"``.
        comm_penalty: ``"dispersion"`` (default) or ``"new_nodes"``.
        protect_top: Never drop the m highest original scores of a row (0 = reference, Q21).
        candidate_window: Only original ranks < k + J may enter (None = all candidates).
        include_future: Count the original choices of later rows in n (§11.2 option).
        renormalize: Renormalise the weights over the k selected (Mixtral); else raw scores.
        initial_counts: float [E] tokens already assigned before the first row.
        diagnostics: Compute the entropy and top margin (§11.8); NaN otherwise.
        tile_cost: The evaluator's tile-model node cost of ``P_layer`` (profiles with tiles);
            None = the fluid model (``paper*``). ``initial_counts`` must then be integers.

    Returns:
        The gated sets, weights and perturbation statistics.

    Raises:
        ConfigError: Bad shapes, an unknown penalty, or options out of range.
    """
    P = np.asarray(P_layer, dtype=np.float64)
    if P.ndim != 2:
        raise ConfigError(f"P_layer must have shape [E, D], got {P.shape}")
    num_experts = P.shape[0]
    if comp_penalty not in COMP_PENALTIES:
        raise unknown_name("computation penalty", comp_penalty, COMP_PENALTIES)
    if comm_penalty not in COMM_PENALTIES:
        raise unknown_name("communication penalty", comm_penalty, COMM_PENALTIES)
    if not (compute_flops > 0 and math.isfinite(compute_flops)):
        raise ConfigError(f"compute_flops must be positive, got {compute_flops!r}")
    if not 0 <= protect_top <= k:
        raise ConfigError(f"protect_top must lie in [0, k={k}], got {protect_top}")
    if tile_cost is not None:
        tile_cost.check(P)
    fast = _fused_gating(scores, k, P, float(w_flops), float(compute_flops),
                         float(sigma) * float(r_comp), float(sigma) * float(r_comm),
                         comp_penalty, comm_penalty, int(protect_top), candidate_window,
                         include_future, initial_counts, diagnostics, renormalize, tile_cost)
    if fast is not None:
        return fast
    cands = _candidates(scores, k, num_experts, candidate_window)
    entropy, margin = float("nan"), float("nan")
    if diagnostics:
        raw = cands.raw_vals
        if raw.shape[0] and raw.shape[1] > 1:
            ent = -(raw * np.log(np.maximum(raw, 1e-300))).sum(axis=1)
            entropy = float(ent.mean()) / math.log(raw.shape[1])
        if cands.vals.shape[0] and cands.vals.shape[1] > k:   # sorted prefix holds rank k+1
            margin = float((cands.vals[:, 0] - cands.vals[:, k]).mean())
    num_rows = cands.ids.shape[0]
    orig = np.ascontiguousarray(cands.ids[:, :k])
    orig_vals = cands.vals[:, :k]
    if num_rows == 0 or (r_comp == 0 and r_comm == 0):
        sets, weights = orig.copy(), orig_vals.copy()
        positions = np.broadcast_to(np.arange(k), (num_rows, k))
    else:
        sets, weights, positions = _greedy(
            cands, k, P, float(w_flops), float(compute_flops), float(sigma) * float(r_comp),
            float(sigma) * float(r_comm), comp_penalty, comm_penalty, int(protect_top),
            include_future, initial_counts, tile_cost)
    raw_weights = weights
    if renormalize:
        total = weights.sum(axis=1, keepdims=True)
        weights = weights / np.where(total > 0, total, 1.0)
    return _statistics(sets, weights, raw_weights, orig, orig_vals, positions, entropy, margin)


def _initial_state(cands: _Candidates, k: int, P: NDArray[np.float64], w: float,
                   include_future: bool, initial_counts: ArrayLike | None,
                   tile_cost: TileCost | None) -> tuple[NDArray[np.float64], Tiles]:
    """Return the node costs and the kernels' ``tiles`` state before the first row.

    Fluid: the loads L_c = Σ_j P_jc·n_j·w (``_initial_loads``) and ``no_tiles()``. Tiles: the
    charged seconds max(compute_c, stream_c) of the integer counts n (``TileCost.node_times``)
    and the state (counts, compute, stream, holder tables) behind them.
    """
    Pw = _prepared_arrays(P, w)[0]
    if tile_cost is None:
        return _initial_loads(cands, k, Pw, include_future, initial_counts), no_tiles()
    num_experts = P.shape[0]
    counts = np.zeros(num_experts, dtype=np.int64)
    if initial_counts is not None:
        n0 = np.asarray(initial_counts, dtype=np.float64)
        if n0.shape != (num_experts,):
            raise ConfigError(f"initial_counts must have shape [E={num_experts}], got {n0.shape}")
        if not (np.all(n0 >= 0) and np.array_equal(n0, np.round(n0))):
            raise ConfigError("initial_counts must be integers >= 0 under the tile model")
        counts += n0.astype(np.int64)
    if include_future:
        counts += np.bincount(cands.ids[:, :k].ravel(), minlength=num_experts)
    compute, stream = tile_cost.node_times(counts)
    h_row, h_stream = _prepared_tiles(P, tile_cost)
    tiles: Tiles = (counts, np.ascontiguousarray(compute), np.ascontiguousarray(stream), h_row,
                    h_stream, float(tile_cost.gemm_s), int(tile_cost.tile_tokens), True)
    return np.maximum(compute, stream), tiles


def _prepared_tiles(P: NDArray[np.float64], tile_cost: TileCost
                    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Return the holder tables (row_s, stream_s) in ``_prepared_arrays``' holder order.

    ``tile_cost`` has been checked against ``P`` (same support), so its own holder order is P's.
    """
    return tile_cost.holder_tables


def _initial_loads(cands: _Candidates, k: int, Pw: NDArray[np.float64], include_future: bool,
                   initial_counts: ArrayLike | None) -> NDArray[np.float64]:
    """Return the node loads L_c before the first row (``initial_counts``, ``include_future``)."""
    num_experts, num_nodes = Pw.shape
    loads_arr = np.zeros(num_nodes)
    if initial_counts is not None:
        n0 = np.asarray(initial_counts, dtype=np.float64)
        if n0.shape != (num_experts,):
            raise ConfigError(f"initial_counts must have shape [E={num_experts}], got {n0.shape}")
        loads_arr += n0 @ Pw
    if include_future:
        loads_arr += np.bincount(cands.ids[:, :k].ravel(), minlength=num_experts) @ Pw
    return loads_arr


def _greedy(cands: _Candidates, k: int, P: NDArray[np.float64], w: float, C: float, rc: float,
            rm: float, comp_penalty: str, comm_penalty: str, protect: int, include_future: bool,
            initial_counts: ArrayLike | None, tile_cost: TileCost | None = None
            ) -> tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.int64]]:
    """Run the row loop (compiled kernel); return sets, raw weights and positions, each [B, k].

    Makes exactly the decisions of the pure-Python oracle ``greedy_reference`` (same
    floating-point operations in the same order, same tie-breaking), checked by
    ``tests/hdamoe_env/decisions/test_gating_kernels.py`` against the reference module
    ``tests/hdamoe_env/decisions/gating_reference.py``.
    """
    _, h_ptr, h_node, h_wc, h_share, dispersion = _prepared_arrays(P, w)
    loads, tiles = _initial_state(cands, k, P, w, include_future, initial_counts, tile_cost)
    raw_ids = (np.empty((0, 0), dtype=np.int64) if cands.raw_ids is None
               else np.ascontiguousarray(cands.raw_ids))
    return greedy_kernel(
        cands.ids, cands.vals, int(cands.width), raw_ids, cands.raw_ids is not None,
        np.ascontiguousarray(cands.raw_vals), k, loads, h_ptr, h_node, h_wc, h_share,
        dispersion, float(rc), float(rm), 1.0 / C if tile_cost is None else 1.0, int(protect),
        COMP_PENALTIES.index(comp_penalty), comm_penalty == "new_nodes", bool(include_future),
        tiles)


def _fused_gating(scores: ArrayLike | tuple[ArrayLike, ArrayLike], k: int,
                  P: NDArray[np.float64], w: float, C: float, rc: float, rm: float,
                  comp_penalty: str, comm_penalty: str, protect: int, window: int | None,
                  include_future: bool, initial_counts: ArrayLike | None, diagnostics: bool,
                  renormalize: bool, tile_cost: TileCost | None = None) -> GatingResult | None:
    """The env's common case in one compiled call; None when it does not apply.

    Applies to int64/float64 candidate pairs ``(ids, scores)`` of at most 4k + 4
    columns (sorted whole, no prefix), no window, no ``initial_counts``/``include_future``, no
    diagnostics and non-zero coefficients. It validates, sorts (``gating_kernels.sort_rows``),
    runs the greedy (``greedy_kernel``) and counts the kept ranks in one kernel call
    (``fused_kernel``) and returns exactly what the general path returns (tested field by field:
    the tests replace this function by one that returns None).
    """
    if not (window is None and initial_counts is None and not include_future
            and not diagnostics):
        return None
    out = _fused_call(scores, k, P, w, C, rc, rm, comp_penalty, comm_penalty, protect,
                      tile_cost)
    if out is None:                    # not applicable, or invalid ids or scores
        return None
    sets, weights, positions, sorted_ids, sorted_vals, kept, changed = out
    orig = np.ascontiguousarray(sorted_ids[:, :k])
    orig_vals = sorted_vals[:, :k]
    raw_weights = weights
    if renormalize:
        total = weights.sum(axis=1, keepdims=True)
        weights = weights / np.where(total > 0, total, 1.0)
    return _statistics(sets, weights, raw_weights, orig, orig_vals, positions, float("nan"),
                       float("nan"), (kept, changed))


def _fused_call(scores: ArrayLike | tuple[ArrayLike, ArrayLike], k: int,
                P: NDArray[np.float64], w: float, C: float, rc: float, rm: float,
                comp_penalty: str, comm_penalty: str, protect: int,
                tile_cost: TileCost | None) -> tuple[NDArray[Any], ...] | None:
    """``fused_kernel`` on ``(ids, scores)``; None when the fused path does not apply
    (``_fused_gating``'s conditions on the candidates and coefficients) or the ids or scores
    are invalid (the general path raises)."""
    if not (isinstance(scores, tuple) and len(scores) == 2 and (rc != 0 or rm != 0)):
        return None
    ids, vals = scores
    if not (isinstance(ids, np.ndarray) and isinstance(vals, np.ndarray)
            and ids.dtype == np.int64 and vals.dtype == np.float64 and ids.ndim == 2
            and ids.shape == vals.shape and ids.shape[0] > 0
            and 1 <= k <= ids.shape[1] <= 4 * k + 4):
        return None
    ids, vals = np.ascontiguousarray(ids), np.ascontiguousarray(vals)
    _, h_ptr, h_node, h_wc, h_share, dispersion = _prepared_arrays(P, w)
    if tile_cost is None:
        tiles, inv_c = no_tiles(), 1.0 / C
    else:
        h_row, h_stream = _prepared_tiles(P, tile_cost)
        zeros = np.zeros(P.shape[1])
        tiles = (np.zeros(P.shape[0], dtype=np.int64), zeros, zeros.copy(), h_row, h_stream,
                 float(tile_cost.gemm_s), int(tile_cost.tile_tokens), True)
        inv_c = 1.0
    out: tuple[NDArray[Any], ...] | None = fused_kernel(
        ids, vals, P.shape[0], P.shape[1], k, h_ptr, h_node, h_wc, h_share, dispersion, rc, rm,
        inv_c, protect, COMP_PENALTIES.index(comp_penalty), comm_penalty == "new_nodes", tiles)
    return out


def gated_sets(candidates: tuple[NDArray[np.int64], NDArray[np.float64]], k: int,
               P_layer: NDArray[np.float64], w_flops: float, compute_flops: float,
               r_comp: float, r_comm: float, *, comp_penalty: str = "marginal_max",
               comm_penalty: str = "dispersion", protect_top: int = 0,
               tile_cost: TileCost | None = None) -> NDArray[np.int64] | None:
    """Return only the gated sets [B, k] of ``hardware_aware_gating`` (σ = 1), or None.

    The sets of ``hardware_aware_gating(candidates, k, P_layer, w_flops, compute_flops,
    r_comp, r_comm, comp_penalty=..., comm_penalty=..., protect_top=..., tile_cost=...,
    diagnostics=False)`` without the statistics and the argument checks, from the same compiled
    call (its fused path); for a caller that has validated its arguments once (the batched
    vector env). None when the fused path does not apply (candidates not int64/float64 pairs of
    at most 4k + 4 columns, both coefficients zero, invalid ids or scores): call
    ``hardware_aware_gating`` then.

    Args:
        candidates: ``(ids int64 [B, k+J], scores float64 [B, k+J])`` router candidates.
        k: Experts per token.
        P_layer: float64 [E, D] placement shares of the layer.
        w_flops, compute_flops, r_comp, r_comm: As ``hardware_aware_gating``.
        comp_penalty, comm_penalty, protect_top, tile_cost: As ``hardware_aware_gating``.

    Returns:
        int64 [B, k] the gated sets, or None.
    """
    out = _fused_call(candidates, k, P_layer, float(w_flops), float(compute_flops),
                      float(r_comp), float(r_comm), comp_penalty, comm_penalty,
                      int(protect_top), tile_cost)
    return None if out is None else out[0]


class GatedSetsMany:
    """``gated_sets`` of many (layer, candidates, level) runs in one compiled call.

    The per-layer tables of ``gated_sets`` (holders, dispersion, tile tables) are stacked once
    at construction; ``__call__`` gates every run with ``fused_kernel`` (as ``gated_sets``:
    the same inputs, hence the same sets bit for bit), optionally on numba threads.

    Args:
        P_layers: float64 [E, D] placement shares of every layer.
        k: Experts per token.
        w_flops, compute_flops: As ``hardware_aware_gating``.
        tile_costs: The tile cost of every layer (``gating_tile_cost``), all None (fluid) or
            none None.
        comp_penalty, comm_penalty, protect_top: As ``hardware_aware_gating``.
    """

    def __init__(self, P_layers: list[NDArray[np.float64]], k: int, w_flops: float,
                 compute_flops: float, tile_costs: list[TileCost | None], *,
                 comp_penalty: str = "marginal_max", comm_penalty: str = "dispersion",
                 protect_top: int = 0) -> None:
        L = len(P_layers)
        E, D = P_layers[0].shape
        self.k, self.E, self.D = int(k), E, D
        prepared = [_prepared_arrays(np.asarray(P, dtype=np.float64), float(w_flops))
                    for P in P_layers]
        width = max(1, max(int(p[1][-1]) for p in prepared))
        self.h_ptr = np.stack([p[1] for p in prepared])
        self.h_node = np.zeros((L, width), dtype=np.int64)
        self.h_wc = np.zeros((L, width))
        self.h_share = np.zeros((L, width))
        for layer, p in enumerate(prepared):
            n = int(p[1][-1])
            self.h_node[layer, :n], self.h_wc[layer, :n], self.h_share[layer, :n] = \
                p[2], p[3], p[4]
        self.dispersion = np.stack([p[5] for p in prepared])
        self.tiled = tile_costs[0] is not None
        if any((c is None) == self.tiled for c in tile_costs):
            raise ConfigError("GatedSetsMany: tile costs must be given for every layer or none")
        self.h_row = np.zeros((L, width if self.tiled else 0))
        self.h_stream = np.zeros((L, width if self.tiled else 0))
        self.gemm_s = np.zeros(L)
        self.tile_tokens = np.ones(L, dtype=np.int64)
        for layer, cost in enumerate(tile_costs):
            if cost is not None:
                row, stream = _prepared_tiles(P_layers[layer], cost)
                self.h_row[layer, :row.size], self.h_stream[layer, :stream.size] = row, stream
                self.gemm_s[layer], self.tile_tokens[layer] = float(cost.gemm_s), int(
                    cost.tile_tokens)
        self.inv_c = 1.0 if self.tiled else 1.0 / float(compute_flops)
        self.protect = int(protect_top)
        self.mode = COMP_PENALTIES.index(comp_penalty)
        self.new_nodes = comm_penalty == "new_nodes"

    def __call__(self, ids: NDArray[np.int64], vals: NDArray[np.float64],
                 layers: NDArray[np.int64], r_comp: NDArray[np.float64],
                 r_comm: NDArray[np.float64], *, parallel: bool = False
                 ) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
        """Return the gated sets int64 [n, B, k] and bool [n]: False where ``gated_sets``
        returns None (both coefficients zero, candidates not int64 / float64 of at most
        4k + 4 columns, invalid ids or scores; that run's sets are then unset).

        Args:
            ids, vals: int64 / float64 [n, B, k + J] the runs' router candidates.
            layers: int64 [n] layer of every run.
            r_comp, r_comm: float64 [n] coefficients of every run (level · defaults).
            parallel: Spread the runs over numba's threads (the caller sets the count).
        """
        n = layers.shape[0]
        out = np.empty((n, ids.shape[1] if ids.ndim == 3 else 0, self.k), dtype=np.int64)
        ok = np.zeros(n, dtype=bool)
        if not (ids.ndim == 3 and ids.dtype == np.int64 and vals.dtype == np.float64
                and ids.shape == vals.shape and ids.shape[0] == n and ids.shape[1] > 0
                and 1 <= self.k <= ids.shape[2] <= 4 * self.k + 4):
            return out, ok
        run = (r_comp != 0) | (r_comm != 0)
        if not run.all():
            idx = np.flatnonzero(run)
            sub, sub_ok = self(ids[idx], vals[idx], layers[idx], r_comp[idx], r_comm[idx],
                               parallel=parallel)
            out[idx], ok[idx] = sub, sub_ok
            return out, ok
        kernel = fused_sets_many_par if parallel and n > 1 else fused_sets_many
        kernel(np.ascontiguousarray(ids), np.ascontiguousarray(vals),
               np.ascontiguousarray(layers, dtype=np.int64), self.E, self.D, self.k,
               self.h_ptr, self.h_node, self.h_wc, self.h_share, self.dispersion,
               np.ascontiguousarray(r_comp, dtype=np.float64),
               np.ascontiguousarray(r_comm, dtype=np.float64), self.inv_c, self.protect,
               self.mode, self.new_nodes, self.tiled, self.h_row, self.h_stream, self.gemm_s,
               self.tile_tokens, out, ok)
        return out, ok


_PreparedArrays = tuple[NDArray[np.float64], NDArray[np.int64], NDArray[np.int64],
                        NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]
#: Holder tables by (placement bytes, w). One entry per distinct layer placement gated: a bench
#: run needs one per layer and method (a few hundred), the whole test suite 714 (measured), so
#: 1024 never evicts either working set.
_PREPARED_ARRAYS: BoundedCache[tuple[bytes, float], _PreparedArrays] = BoundedCache(
    1024, name="hdamoe_env.decisions.gating.prepared_arrays")


def _prepared_arrays(P: NDArray[np.float64], w: float) -> _PreparedArrays:
    """Return P·w, the holders of every expert as CSR arrays (ptr, node, P_ic·w, P_ic), |nodes(i)|.

    Holders in (expert, node) order; cached by the placement's bytes (a layer's placement is
    reused for every decode step).
    """
    key = (P.tobytes(), w)
    hit = _PREPARED_ARRAYS.get(key)
    if hit is not None:
        return hit
    Pw = P * w
    rows, cols = np.nonzero(P > 0)                     # row-major: by expert, then node
    ptr = np.zeros(P.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=P.shape[0]), out=ptr[1:])
    hit = (Pw, ptr, cols.astype(np.int64), np.ascontiguousarray(Pw[rows, cols]),
           np.ascontiguousarray(P[rows, cols]), np.diff(ptr).astype(np.float64))
    _PREPARED_ARRAYS.put(key, hit)
    return hit


def _statistics(sets: NDArray[np.int64], weights: NDArray[np.float64],
                raw_weights: NDArray[np.float64], orig: NDArray[np.int64],
                orig_vals: NDArray[np.float64], positions: NDArray[np.int64], entropy: float,
                margin: float, counts: tuple[NDArray[np.float64], int] | None = None
                ) -> GatingResult:
    """Compute the perturbation statistics of §11.5 / §12 for one step.

    Candidate positions are original ranks (sorted best first), so rank r is kept iff position r
    was chosen.
    """
    num_rows, k = sets.shape
    if num_rows == 0:
        return GatingResult(sets, weights, orig, 0.0, 0.0, 1.0, 1.0, np.zeros(k), entropy,
                            margin)
    # counts are exact integers, so count / B equals the mean of the bool arrays bit for bit
    kept_per_rank, changed_rows = (counts if counts is not None else
                                   kept_counts(np.ascontiguousarray(positions, dtype=np.int64)))
    replaced_per_rank = 1.0 - kept_per_rank / num_rows
    top_mass = float(orig_vals.sum())
    return GatingResult(
        sets=sets, weights=weights, orig_sets=orig,
        changed_fraction=float(changed_rows / num_rows),
        changed_choices=float(replaced_per_rank.mean()),
        top1_retention=float(kept_per_rank[0] / num_rows),
        score_mass_kept=float(raw_weights.sum()) / top_mass if top_mass > 0 else 1.0,
        replaced_per_rank=replaced_per_rank,
        entropy=entropy, top_margin=margin)
