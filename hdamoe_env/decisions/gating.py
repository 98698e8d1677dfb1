"""Hardware-aware gating (HAG): routing scores adjusted by compute and communication penalties.

Implements paper-model.md §11 (paper §V-D):

* §11.2 — the sequential greedy: the B rows of one decode step are processed in batch order; for
  row t every candidate expert i gets the adjusted score
  a_i = s[t, i] + σ·(r_comp·ΔT_comp(i) + r_comm·ΔT_comm(i)), S_t = top-k of a, and the running
  counts n (tokens already assigned in this step) are updated with S_t;
* §11.3 — computation penalties ``marginal_max`` (default: increase of the compute critical path,
  (max_c(L_c + P_ic·w) − max_c L_c)/C with L_c = Σ_j P_jc·n_j·w), ``host_finish`` and
  ``host_load_mean``;
* §11.4 — communication penalties ``dispersion`` (default: |nodes(i)|) and ``new_nodes``
  (|nodes(i) \\ nodes already receiving token t|, experts chosen one at a time);
* §11.5 — selection over all candidates, ``protect_top`` and ``candidate_window`` options, weights
  = the selected experts' ORIGINAL scores post-processed by the model's rule (renormalised over
  the k or not);
* §11.7 — the coefficient defaults found in the authors' artifacts (``default_coefficients``);
* §11.8 — diagnostics: normalised gating entropy and top margin s_(1) − s_(k+1).

The loop over rows is inherent to the algorithm (row t's penalties depend on the choices of rows
< t). It runs in a numba kernel (``_greedy_kernel``, compiled once and cached on disk like the DES
kernel); the pure-Python loop it replaced is kept as ``_greedy_reference``, the oracle the tests
compare it with for exact equality. The penalties are computed once per row from the state
before the row (``new_nodes`` additionally updates the covered nodes after each of the k picks).
Pure functions, numpy and numba only (style.md §2).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.errors import ConfigError, unknown_name

__all__ = [
    "COEFFICIENTS",
    "COMM_PENALTIES",
    "COMP_PENALTIES",
    "GatingResult",
    "default_coefficients",
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


# ------------------------------------------------------------------------------ candidates


@dataclass(frozen=True, eq=False)
class _Candidates:
    """Candidate experts of every row sorted by original score (best first).

    ``ids``/``vals`` hold a prefix of ``prefix`` columns (all candidates when the input is small);
    ``full_row(t)`` returns the complete sorted row for the rare rows whose scan needs more.
    """

    ids: NDArray[np.int64]           # [B, W] prefix, sorted
    vals: NDArray[np.float64]        # [B, W]
    width: int                       # candidates per row in total (after the window)
    raw_ids: NDArray[np.int64] | None
    raw_vals: NDArray[np.float64]

    def full_row(self, t: int) -> tuple[list[int], list[float]]:
        order = np.argsort(-self.raw_vals[t], kind="stable")[:self.width]
        ids = order if self.raw_ids is None else self.raw_ids[t][order]
        return ids.tolist(), self.raw_vals[t][order].tolist()


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
        if raw_ids.size and not _ids_in_range(raw_ids, num_experts):
            raise ConfigError(f"candidate ids must lie in [0, E={num_experts}), got range "
                              f"[{raw_ids.min()}, {raw_ids.max()}]")
    else:
        vals = np.asarray(scores, dtype=np.float64)
        if vals.ndim != 2 or vals.shape[1] != num_experts:
            raise ConfigError(f"scores must have shape [B, E={num_experts}], got {vals.shape}")
        raw_ids = None
    vals = np.ascontiguousarray(vals)
    if not _all_finite(vals):
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
        ids_sorted, vals_sorted = _sort_rows(
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


@njit(cache=True)
def _ids_in_range(ids: NDArray[np.int64], num_experts: int) -> bool:
    """Return whether every id lies in [0, E) (one pass, no temporaries)."""
    for v in ids.ravel():
        if v < 0 or v >= num_experts:
            return False
    return True


@njit(cache=True)
def _all_finite(vals: NDArray[np.float64]) -> bool:
    """Return whether every value is finite (one pass, no temporaries)."""
    for v in vals.ravel():
        if not np.isfinite(v):
            return False
    return True


@njit(cache=True)
def _sort_rows(vals: NDArray[np.float64], raw_ids: NDArray[np.int64], has_ids: bool
               ) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """Sort every row by decreasing score, stably (= ``np.argsort(-vals, kind="stable")``)."""
    num_rows, width = vals.shape
    ids = np.empty((num_rows, width), dtype=np.int64)
    out = np.empty((num_rows, width))
    order = np.empty(width, dtype=np.int64)
    for t in range(num_rows):
        if width <= 32:                  # insertion sort: stable, no allocation
            for j in range(width):
                v = vals[t, j]
                q = j
                while q > 0 and vals[t, order[q - 1]] < v:
                    order[q] = order[q - 1]
                    q -= 1
                order[q] = j
        else:
            order[:] = np.argsort(-vals[t], kind="mergesort")
        for j in range(width):
            p = order[j]
            out[t, j] = vals[t, p]
            ids[t, j] = raw_ids[t, p] if has_ids else p
    return ids, out


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
              comp_penalty: str = "marginal_max") -> tuple[NDArray[np.float64],
                                                            NDArray[np.float64]]:
    """Return ΔT_comp [E] (seconds) and the dispersion |nodes(i)| [E] for counts n (§11.3–11.4).

    L_c = Σ_j P_jc·n_j·w; ``marginal_max``: (max_c (L_c + P_ic·w) − max_c L_c)/C;
    ``host_finish``: max_{c ∈ nodes(i)} (L_c + P_ic·w)/C; ``host_load_mean``:
    Σ_c P_ic·(L_c + P_ic·w)/C. The vectorised form of the penalties the greedy applies row by
    row (for agents, diagnostics and tests).

    Args:
        P_layer: float [E, D] placement shares.
        counts: float [E] tokens already assigned per expert.
        w_flops: Work per (token, expert), FLOP.
        compute_flops: Node throughput C, FLOP/s.
        comp_penalty: One of ``COMP_PENALTIES``.

    Returns:
        ``(dT_comp_s, dispersion)``.
    """
    P = np.asarray(P_layer, dtype=np.float64)
    n = np.asarray(counts, dtype=np.float64)
    if P.ndim != 2 or n.shape != (P.shape[0],):
        raise ConfigError(f"P_layer must be [E, D] and counts [E]; got {P.shape} and {n.shape}")
    if comp_penalty not in COMP_PENALTIES:
        raise unknown_name("computation penalty", comp_penalty, COMP_PENALTIES)
    loads = (n @ P) * w_flops                                    # [D]
    after = loads[None, :] + P * w_flops                         # [E, D]
    if comp_penalty == "marginal_max":
        comp = (after.max(axis=1) - loads.max()) / compute_flops
    elif comp_penalty == "host_finish":
        comp = np.where(P > 0, after, 0.0).max(axis=1) / compute_flops
    else:
        comp = (P * after).sum(axis=1) / compute_flops
    return comp, (P > 0).sum(axis=1).astype(np.float64)


# ------------------------------------------------------------------------------ placement tables

_Holders = list[list[tuple[int, float, float]]]
_PREPARED: dict[tuple[bytes, float], tuple[_Holders, list[float], list[int],
                                         NDArray[np.float64]]] = {}


def _prepared(P: NDArray[np.float64], w: float
              ) -> tuple[_Holders, list[float], list[int], NDArray[np.float64]]:
    """Return per-expert holders [(node, P_ic·w, P_ic)], |nodes(i)|, node bitmasks and P·w.

    Cached by the placement's bytes: a layer's placement is reused for every decode step.
    """
    key = (P.tobytes(), w)
    hit = _PREPARED.get(key)
    if hit is not None:
        return hit
    Pw = P * w
    rows, cols = np.nonzero(P > 0)
    holders: _Holders = [[] for _ in range(P.shape[0])]
    for i, c, wc, share in zip(rows.tolist(), cols.tolist(), Pw[rows, cols].tolist(),
                               P[rows, cols].tolist(), strict=True):
        holders[i].append((c, wc, share))
    dispersion = [float(len(h)) for h in holders]
    masks = [sum(1 << c for c, _, _ in h) for h in holders]
    if len(_PREPARED) >= 256:
        _PREPARED.clear()
    hit = (holders, dispersion, masks, Pw)
    _PREPARED[key] = hit
    return hit


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
) -> GatingResult:
    """Choose every row's k experts with hardware-aware penalties (paper-model.md §11.2–11.5).

    Sequential greedy in batch order with running counts n (start: zero, ``initial_counts``, or
    with ``include_future`` the original top-k counts of all rows minus the current row's):

    ``a_i = s_i + σ·(r_comp·ΔT_comp(i) + r_comm·ΔT_comm(i))``, S_t = top-k of a, n[S_t] += 1,

    with L_c = Σ_j P_jc·n_j·w and, by default, ΔT_comp(i) = (max_c (L_c + P_ic·w) − max_c L_c)/C
    and ΔT_comm(i) = |nodes(i)|. With ``r_comp = r_comm = 0`` the result is exactly the original
    top-k. The paper's coefficients are negative (penalties lower the score). Ties between equal
    adjusted scores go to the better original rank; ties between equal original scores to the
    earlier candidate (expert id for full score rows).

    Cost: one pass over the rows (inherent: row t depends on the choices of rows < t); per row
    only the candidates that can still enter the top-k are evaluated (exact pruning, see
    ``_scan_row``).

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
    fast = _fused_gating(scores, k, P, float(w_flops), float(compute_flops),
                         float(sigma) * float(r_comp), float(sigma) * float(r_comm),
                         comp_penalty, comm_penalty, int(protect_top), candidate_window,
                         include_future, initial_counts, diagnostics, renormalize)
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
            include_future, initial_counts)
    raw_weights = weights
    if renormalize:
        total = weights.sum(axis=1, keepdims=True)
        weights = weights / np.where(total > 0, total, 1.0)
    return _statistics(sets, weights, raw_weights, orig, orig_vals, positions, entropy, margin)


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
            initial_counts: ArrayLike | None
            ) -> tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.int64]]:
    """Run the row loop (compiled kernel); return sets, raw weights and positions, each [B, k].

    Makes exactly the decisions of :func:`_greedy_reference` (same floating-point operations in
    the same order, same tie-breaking), checked by ``tests/hdamoe_env/test_gating.py``.
    """
    Pw, h_ptr, h_node, h_wc, h_share, dispersion = _prepared_arrays(P, w)
    loads = _initial_loads(cands, k, Pw, include_future, initial_counts)
    raw_ids = (np.empty((0, 0), dtype=np.int64) if cands.raw_ids is None
               else np.ascontiguousarray(cands.raw_ids))
    return _greedy_kernel(
        cands.ids, cands.vals, int(cands.width), raw_ids, cands.raw_ids is not None,
        np.ascontiguousarray(cands.raw_vals), k, loads, h_ptr, h_node, h_wc, h_share,
        dispersion, float(rc), float(rm), 1.0 / C, int(protect),
        COMP_PENALTIES.index(comp_penalty), comm_penalty == "new_nodes", bool(include_future))


#: Use the one-call compiled path of :func:`_fused_gating` when it applies (tests switch it off
#: to compare with the general path).
_FUSED = True


def _fused_gating(scores: ArrayLike | tuple[ArrayLike, ArrayLike], k: int,
                  P: NDArray[np.float64], w: float, C: float, rc: float, rm: float,
                  comp_penalty: str, comm_penalty: str, protect: int, window: int | None,
                  include_future: bool, initial_counts: ArrayLike | None, diagnostics: bool,
                  renormalize: bool) -> GatingResult | None:
    """The env's common case in one compiled call; None when it does not apply.

    Applies to int64/float64 candidate pairs ``(ids, scores)`` of at most 4k + 4
    columns (sorted whole, no prefix), no window, no ``initial_counts``/``include_future``, no
    diagnostics and non-zero coefficients. It validates, sorts (:func:`_sort_rows`), runs the
    greedy (:func:`_greedy_kernel`) and counts the kept ranks in one kernel call and returns
    exactly what the general path returns (tested field by field).
    """
    if not (_FUSED and isinstance(scores, tuple) and len(scores) == 2 and window is None
            and initial_counts is None and not include_future and not diagnostics
            and (rc != 0 or rm != 0)):
        return None
    ids, vals = scores
    if not (isinstance(ids, np.ndarray) and isinstance(vals, np.ndarray)
            and ids.dtype == np.int64 and vals.dtype == np.float64 and ids.ndim == 2
            and ids.shape == vals.shape and ids.shape[0] > 0
            and 1 <= k <= ids.shape[1] <= 4 * k + 4):
        return None
    ids, vals = np.ascontiguousarray(ids), np.ascontiguousarray(vals)
    _, h_ptr, h_node, h_wc, h_share, dispersion = _prepared_arrays(P, w)
    out = _fused_kernel(ids, vals, P.shape[0], P.shape[1], k, h_ptr, h_node, h_wc, h_share,
                        dispersion, rc, rm, 1.0 / C, protect, COMP_PENALTIES.index(comp_penalty),
                        comm_penalty == "new_nodes")
    if out is None:                    # invalid ids or scores: the general path raises
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


@njit(cache=True)
def _fused_kernel(ids: NDArray[np.int64], vals: NDArray[np.float64], num_experts: int,
                  num_nodes: int, k: int,
                  h_ptr: NDArray[np.int64], h_node: NDArray[np.int64],
                  h_wc: NDArray[np.float64], h_share: NDArray[np.float64],
                  dispersion: NDArray[np.float64], rc: float, rm: float, inv_c: float,
                  protect: int, mode: int, new_nodes: bool) -> Any:
    """Validate, sort, gate and count in one call (:func:`_fused_gating`); None if invalid."""
    if not _ids_in_range(ids, num_experts) or not _all_finite(vals):
        return None
    sorted_ids, sorted_vals = _sort_rows(vals, ids, True)
    width = ids.shape[1]
    loads = np.zeros(num_nodes)
    sets, weights, positions = _greedy_kernel(
        sorted_ids, sorted_vals, width, ids, True, vals, k, loads, h_ptr, h_node, h_wc,
        h_share, dispersion, rc, rm, inv_c, protect, mode, new_nodes, False)
    kept, changed = _kept_counts(positions)
    return sets, weights, positions, sorted_ids, sorted_vals, kept, changed


def _greedy_reference(cands: _Candidates, k: int, P: NDArray[np.float64], w: float, C: float,
                      rc: float, rm: float, comp_penalty: str, comm_penalty: str, protect: int,
                      include_future: bool, initial_counts: ArrayLike | None
                      ) -> tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.int64]]:
    """The pure-Python row loop: the oracle of :func:`_greedy` (tests only)."""
    holders, dispersion, masks, Pw = _prepared(P, w)
    loads_arr = _initial_loads(cands, k, Pw, include_future, initial_counts)
    state = _RowState(loads_arr.tolist(), holders, dispersion, masks, rc, rm, 1.0 / C, k,
                      protect, COMP_PENALTIES.index(comp_penalty), comm_penalty == "new_nodes")
    id_rows = cands.ids.tolist()
    val_rows = cands.vals.tolist()
    width = cands.width
    sets: list[list[int]] = []
    weights: list[list[float]] = []
    positions: list[list[int]] = []
    for t in range(len(id_rows)):
        cand, sv = id_rows[t], val_rows[t]
        if include_future:
            state.remove(cand[:k])
        picks = state.scan(cand, sv, width)
        if picks is None:                      # the prefix was not enough: use the whole row
            cand, sv = cands.full_row(t)
            picks = state.scan(cand, sv, width)
            assert picks is not None
        state.add([cand[p] for p in picks])
        sets.append([cand[p] for p in picks])
        weights.append([sv[p] for p in picks])
        positions.append(picks)
    return (np.array(sets, dtype=np.int64), np.array(weights, dtype=np.float64),
            np.array(positions, dtype=np.int64))


_PREPARED_ARRAYS: dict[tuple[bytes, float], tuple[NDArray[np.float64], NDArray[np.int64],
                                                  NDArray[np.int64], NDArray[np.float64],
                                                  NDArray[np.float64], NDArray[np.float64]]] = {}


def _prepared_arrays(P: NDArray[np.float64], w: float
                     ) -> tuple[NDArray[np.float64], NDArray[np.int64], NDArray[np.int64],
                                NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """Return P·w, the holders of every expert as CSR arrays (ptr, node, P_ic·w, P_ic), |nodes(i)|.

    The same holders, in the same (node) order, as :func:`_prepared`; cached by the placement's
    bytes.
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
    if len(_PREPARED_ARRAYS) >= 256:
        _PREPARED_ARRAYS.clear()
    _PREPARED_ARRAYS[key] = hit
    return hit


@njit(cache=True)
def _base_score(i: int, s: float, loads: NDArray[np.float64], peak: float,
                h_ptr: NDArray[np.int64], h_node: NDArray[np.int64], h_wc: NDArray[np.float64],
                h_share: NDArray[np.float64], dispersion: NDArray[np.float64], rc: float,
                rm: float, inv_c: float, mode: int, new_nodes: bool) -> float:
    """``_RowState.base``: s + r_comp·ΔT_comp(i) (+ r_comm·|nodes(i)| unless ``new_nodes``)."""
    if mode == 0:
        top = -np.inf
        for j in range(h_ptr[i], h_ptr[i + 1]):
            v = loads[h_node[j]] + h_wc[j]
            if v > top:
                top = v
        comp = top - peak if top > peak else 0.0
    elif mode == 1:
        comp = 0.0
        for j in range(h_ptr[i], h_ptr[i + 1]):
            v = loads[h_node[j]] + h_wc[j]
            if v > comp:
                comp = v
    else:
        comp = 0.0
        for j in range(h_ptr[i], h_ptr[i + 1]):
            comp += h_share[j] * (loads[h_node[j]] + h_wc[j])
    a = s + rc * comp * inv_c
    return a if new_nodes else a + rm * dispersion[i]


@njit(cache=True)
def _scan_row(cand: NDArray[np.int64], sv: NDArray[np.float64], width: int, k: int,
              loads: NDArray[np.float64], peak: float, h_ptr: NDArray[np.int64],
              h_node: NDArray[np.int64], h_wc: NDArray[np.float64],
              h_share: NDArray[np.float64], dispersion: NDArray[np.float64], rc: float,
              rm: float, inv_c: float, protect: int, mode: int, prune: bool, offset: float,
              out: NDArray[np.int64], top_a: NDArray[np.float64],
              top_p: NDArray[np.int64]) -> bool:
    """``_RowState.scan`` (dispersion penalty); False when ``cand`` is a too-short prefix.

    ``top_a``/``top_p`` [k] are work buffers: −a ascending with its position (= best first).
    """
    held = 0
    kth = -np.inf
    rc_c = rc * inv_c
    stop = min(width, sv.shape[0])
    pos = 0
    broke = False
    while pos < stop:
        s = sv[pos]
        if pos < protect:
            a = np.inf
        else:
            if prune and s + offset <= kth:
                broke = True
                break
            i = cand[pos]
            if mode == 0:
                best = -np.inf
                for j in range(h_ptr[i], h_ptr[i + 1]):
                    v = loads[h_node[j]] + h_wc[j]
                    if v > best:
                        best = v
                a = s + rm * dispersion[i]
                if best > peak:
                    a += rc_c * (best - peak)
            else:
                a = _base_score(i, s, loads, peak, h_ptr, h_node, h_wc, h_share, dispersion,
                                rc, rm, inv_c, mode, False)
        na = -a
        if held < k or na < top_a[k - 1] or (na == top_a[k - 1] and pos < top_p[k - 1]):
            n = held if held < k else k - 1          # insert (na, pos) into the sorted prefix
            q = n
            while q > 0 and (top_a[q - 1] > na or (top_a[q - 1] == na and top_p[q - 1] > pos)):
                top_a[q] = top_a[q - 1]
                top_p[q] = top_p[q - 1]
                q -= 1
            top_a[q] = na
            top_p[q] = pos
            if held < k:
                held += 1
            if held == k:
                kth = -top_a[k - 1]
        pos += 1
    if not broke and stop < width:
        return False
    for q in range(k):
        out[q] = top_p[q]
    return True


@njit(cache=True)
def _scan_row_new_nodes(cand: NDArray[np.int64], sv: NDArray[np.float64], width: int, k: int,
                        loads: NDArray[np.float64], peak: float, h_ptr: NDArray[np.int64],
                        h_node: NDArray[np.int64], h_wc: NDArray[np.float64],
                        h_share: NDArray[np.float64], dispersion: NDArray[np.float64],
                        rc: float, rm: float, inv_c: float, protect: int, mode: int,
                        prune: bool, covered: NDArray[np.bool_], out: NDArray[np.int64],
                        bases: NDArray[np.float64], taken: NDArray[np.bool_]) -> bool:
    """``_RowState._scan_new_nodes``; False when ``cand`` is a too-short prefix.

    ``bases``/``taken`` are work buffers of at least ``min(width, len(sv))`` entries.
    """
    taken[:] = False
    n_bases = 0
    covered[:] = False
    for pick in range(k):
        best_a = -np.inf
        best_pos = -1
        for pos in range(n_bases):
            if not taken[pos]:
                i = cand[pos]
                fresh = 0
                for j in range(h_ptr[i], h_ptr[i + 1]):
                    if not covered[h_node[j]]:
                        fresh += 1
                a = bases[pos] + rm * fresh
                if a > best_a:
                    best_a = a
                    best_pos = pos
        while n_bases < width:
            pos = n_bases
            if pos == sv.shape[0]:
                return False
            if prune and best_pos >= 0 and pos >= protect and sv[pos] <= best_a:
                break
            i = cand[pos]
            if pos < protect:
                b = np.inf
            else:
                b = _base_score(i, sv[pos], loads, peak, h_ptr, h_node, h_wc, h_share,
                                dispersion, rc, rm, inv_c, mode, True)
            bases[pos] = b
            n_bases += 1
            fresh = 0
            for j in range(h_ptr[i], h_ptr[i + 1]):
                if not covered[h_node[j]]:
                    fresh += 1
            a = b + rm * fresh
            if a > best_a:
                best_a = a
                best_pos = pos
        out[pick] = best_pos
        taken[best_pos] = True
        i = cand[best_pos]
        for j in range(h_ptr[i], h_ptr[i + 1]):
            covered[h_node[j]] = True
    return True


@njit(cache=True)
def _greedy_kernel(ids: NDArray[np.int64], vals: NDArray[np.float64], width: int,
                   raw_ids: NDArray[np.int64], has_raw_ids: bool, raw_vals: NDArray[np.float64],
                   k: int, loads: NDArray[np.float64], h_ptr: NDArray[np.int64],
                   h_node: NDArray[np.int64], h_wc: NDArray[np.float64],
                   h_share: NDArray[np.float64], dispersion: NDArray[np.float64], rc: float,
                   rm: float, inv_c: float, protect: int, mode: int, new_nodes: bool,
                   include_future: bool
                   ) -> tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.int64]]:
    """The row loop of :func:`_greedy_reference` (``_RowState``), compiled."""
    num_rows = ids.shape[0]
    sets = np.empty((num_rows, k), dtype=np.int64)
    weights = np.empty((num_rows, k))
    positions = np.empty((num_rows, k), dtype=np.int64)
    loads = loads.copy()
    peak = loads.max() if loads.shape[0] else -np.inf
    prune = rc <= 0 and rm <= 0
    offset = 0.0
    if not new_nodes and dispersion.shape[0]:
        offset = rm * dispersion.min()
    covered = np.zeros(loads.shape[0], dtype=np.bool_)
    picks = np.empty(k, dtype=np.int64)
    top_a = np.empty(k)
    top_p = np.empty(k, dtype=np.int64)
    n_buf = max(width, ids.shape[1])
    bases = np.empty(n_buf)
    taken = np.zeros(n_buf, dtype=np.bool_)
    for t in range(num_rows):
        cand = ids[t]
        sv = vals[t]
        if include_future:                                  # remove the row's own choices
            for q in range(k):
                i = cand[q]
                for j in range(h_ptr[i], h_ptr[i + 1]):
                    loads[h_node[j]] -= h_wc[j]
            peak = loads.max()
        for _attempt in range(2):
            if new_nodes:
                ok = _scan_row_new_nodes(cand, sv, width, k, loads, peak, h_ptr, h_node, h_wc,
                                         h_share, dispersion, rc, rm, inv_c, protect, mode,
                                         prune, covered, picks, bases, taken)
            else:
                ok = _scan_row(cand, sv, width, k, loads, peak, h_ptr, h_node, h_wc, h_share,
                               dispersion, rc, rm, inv_c, protect, mode, prune, offset, picks,
                               top_a, top_p)
            if ok:
                break
            # the prefix was not enough: the whole row, sorted stably (``_Candidates.full_row``)
            order = np.argsort(-raw_vals[t], kind="mergesort")[:width]
            sv = raw_vals[t][order]
            cand = raw_ids[t][order] if has_raw_ids else order.astype(np.int64)
        for q in range(k):
            p = picks[q]
            i = cand[p]
            sets[t, q] = i
            weights[t, q] = sv[p]
            positions[t, q] = p
            for j in range(h_ptr[i], h_ptr[i + 1]):
                v = loads[h_node[j]] + h_wc[j]
                loads[h_node[j]] = v
                if v > peak:
                    peak = v
    return sets, weights, positions


class _RowState:
    """Running node loads L_c of the step and the per-row scan (plain Python over small lists).

    Exact pruning: with r_comp <= 0 and r_comm <= 0 every penalty term is <= 0, so
    a_i <= s_i + r_comm·min_j |nodes(j)|; candidates are scanned in original-score order, and once
    k candidates are held a candidate whose bound does not exceed the k-th best adjusted score can
    never enter (ties go to the better original rank), so the scan stops. It typically touches
    k + a few candidates.
    """

    def __init__(self, loads: list[float], holders: _Holders, dispersion: list[float],
                 masks: list[int], rc: float, rm: float, inv_c: float, k: int, protect: int,
                 mode: int, new_nodes: bool) -> None:
        self.loads = loads
        self.peak = max(loads)
        self.holders, self.dispersion, self.masks = holders, dispersion, masks
        self.rc, self.rm, self.inv_c, self.k, self.protect = rc, rm, inv_c, k, protect
        self.mode, self.new_nodes = mode, new_nodes
        self.prune = rc <= 0 and rm <= 0
        # Tighter bound for the pruning: a_i <= s_i + r_comm·min_i |nodes(i)| (r_comm <= 0).
        self.offset = 0.0 if new_nodes else rm * min(dispersion, default=0.0)

    def remove(self, experts: list[int]) -> None:
        """Subtract one token of each expert (``include_future``: the row's original choices)."""
        loads = self.loads
        for i in experts:
            for c, wc, _ in self.holders[i]:
                loads[c] -= wc
        self.peak = max(loads)

    def add(self, experts: list[int]) -> None:
        """Add one token of each chosen expert to the running loads."""
        loads = self.loads
        peak = self.peak
        for i in experts:
            for c, wc, _ in self.holders[i]:
                v = loads[c] + wc
                loads[c] = v
                if v > peak:
                    peak = v
        self.peak = peak

    def base(self, i: int, s: float) -> float:
        """Return s + r_comp·ΔT_comp(i) (+ r_comm·|nodes(i)| unless ``new_nodes``)."""
        loads = self.loads
        if self.mode == 0:                     # marginal_max: increase of the critical path
            top = -math.inf
            for c, wc, _ in self.holders[i]:
                v = loads[c] + wc
                if v > top:
                    top = v
            comp = top - self.peak if top > self.peak else 0.0
        elif self.mode == 1:                   # host_finish: finish time of i's busiest host
            comp = 0.0
            for c, wc, _ in self.holders[i]:
                v = loads[c] + wc
                if v > comp:
                    comp = v
        else:                                  # host_load_mean: share-weighted host load
            comp = 0.0
            for c, wc, share in self.holders[i]:
                comp += share * (loads[c] + wc)
        a = s + self.rc * comp * self.inv_c
        return a if self.new_nodes else a + self.rm * self.dispersion[i]

    def scan(self, cand: list[int], sv: list[float], width: int) -> list[int] | None:
        """Return the chosen positions (best adjusted first), or None if ``cand`` is too short."""
        if self.new_nodes:
            return self._scan_new_nodes(cand, sv, width)
        k, protect, prune = self.k, self.protect, self.prune
        inline = self.mode == 0              # marginal_max + dispersion: inlined ``base``
        loads, holders, dispersion = self.loads, self.holders, self.dispersion
        peak, rc_c, rm, offset = self.peak, self.rc * self.inv_c, self.rm, self.offset
        top: list[tuple[float, int]] = []    # (−a, pos) ascending = best first
        held = 0
        kth = -math.inf
        stop = min(width, len(sv))
        pos = 0
        while pos < stop:
            s = sv[pos]
            if pos < protect:
                a = math.inf
            else:
                if prune and s + offset <= kth:
                    break
                i = cand[pos]
                if inline:
                    best = -math.inf
                    for c, wc, _ in holders[i]:
                        v = loads[c] + wc
                        if v > best:
                            best = v
                    a = s + rm * dispersion[i]
                    if best > peak:
                        a += rc_c * (best - peak)
                else:
                    a = self.base(i, s)
            key = (-a, pos)
            if held < k:
                bisect.insort(top, key)
                held += 1
                if held == k:
                    kth = -top[-1][0]
            elif key < top[-1]:
                top.pop()
                bisect.insort(top, key)
                kth = -top[-1][0]
            pos += 1
        else:
            if stop < width:                 # ran off a prefix without a decision
                return None
        return [p for _, p in top]

    def _scan_new_nodes(self, cand: list[int], sv: list[float], width: int) -> list[int] | None:
        """Choose k candidates one at a time with ΔT_comm = |nodes(i) \\ covered| (§11.4).

        ``covered`` are the nodes of the picks so far; candidates are evaluated lazily in
        original order (a candidate whose original score does not exceed the best adjusted
        score so far cannot win the pick, by the same bound as ``scan``).
        """
        rm, masks = self.rm, self.masks
        bases: list[float] = []
        taken: set[int] = set()
        covered = 0
        picks: list[int] = []
        for _ in range(self.k):
            best_a, best_pos = -math.inf, -1
            for pos, b in enumerate(bases):
                if pos not in taken:
                    a = b + rm * (masks[cand[pos]] & ~covered).bit_count()
                    if a > best_a:
                        best_a, best_pos = a, pos
            while len(bases) < width:
                pos = len(bases)
                if pos == len(sv):
                    return None
                if self.prune and best_pos >= 0 and pos >= self.protect and sv[pos] <= best_a:
                    break
                b = math.inf if pos < self.protect else self.base(cand[pos], sv[pos])
                bases.append(b)
                a = b + rm * (masks[cand[pos]] & ~covered).bit_count()
                if a > best_a:
                    best_a, best_pos = a, pos
            picks.append(best_pos)
            taken.add(best_pos)
            covered |= masks[cand[best_pos]]
        return picks


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
                                   _kept_counts(np.ascontiguousarray(positions, dtype=np.int64)))
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


@njit(cache=True)
def _kept_counts(positions: NDArray[np.int64]) -> tuple[NDArray[np.float64], int]:
    """Return per original rank r < k the rows that kept it, and the rows whose set changed.

    Candidate positions are original ranks, so rank r is kept iff position r was chosen.
    """
    num_rows, k = positions.shape
    kept = np.zeros(k)
    changed = 0
    for t in range(num_rows):
        n_kept = 0
        for r in range(k):
            for q in range(k):
                if positions[t, q] == r:
                    kept[r] += 1.0
                    n_kept += 1
                    break
        if n_kept < k:
            changed += 1
    return kept, changed
