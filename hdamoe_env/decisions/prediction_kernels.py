"""Compiled kernels of the batched noisy oracle (paper-model.md §10.2, traces.md §7.6).

``noisy_oracle_sets_many`` (``hdamoe_env.decisions.prediction``) predicts the next-layer sets
of many decode steps at once, each with its own generator. Its rejection rounds are sequential
per row (the earlier slot of a row keeps a contested expert), so the per-round work is a loop:
``start_kernel`` marks the replaced slots and builds the forbidden-expert bitmasks,
``round_kernel`` resolves one round of candidate draws. They make exactly the decisions of the
vectorised ``noisy_oracle_sets``: the same floating-point operations on the same uniforms (the
alias draw of ``AliasSampler.sample_uniform``), the forbidden set as of the start of the round,
the first non-forbidden candidate, and a pick already taken in the round by an earlier slot of
the row rejected (the stable sort of the vectorised version); tests compare them for equality.
E <= 64 only (bitmasks); compiled once and cached on disk (``cache=True``).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numpy.typing import NDArray

__all__ = ["round_kernel", "start_kernel"]


@njit(cache=True)
def start_kernel(actual: NDArray[np.int64], u: NDArray[np.float64], acc: NDArray[np.float64],
                 rows_per_problem: int
                 ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.uint64],
                            NDArray[np.int64]]:
    """Mark replaced slots (u >= accuracy of the row) and build the forbidden bitmasks.

    Args:
        actual: int64 [R, k] actual sets (all problems' rows, problem-major).
        u: float64 [R, k] uniforms.
        acc: float64 [rows_per_problem] accuracy per row of a problem.
        rows_per_problem: Rows of one problem.

    Returns:
        ``(rows, cols)`` int64 [S] of the replaced slots in row-major order, ``forbid`` uint64
        [R] and ``pred`` int64 [R, k] (the actual sets with −1 at replaced slots).
    """
    num_rows, top_k = actual.shape
    pred = actual.copy()
    forbid = np.zeros(num_rows, dtype=np.uint64)
    count = 0
    for r in range(num_rows):
        a = acc[r % rows_per_problem]
        bits = np.uint64(0)
        for j in range(top_k):
            bits |= np.uint64(1) << np.uint64(actual[r, j])
            if u[r, j] >= a:
                count += 1
        forbid[r] = bits
    rows = np.empty(count, dtype=np.int64)
    cols = np.empty(count, dtype=np.int64)
    s = 0
    for r in range(num_rows):
        a = acc[r % rows_per_problem]
        for j in range(top_k):
            if u[r, j] >= a:
                rows[s] = r
                cols[s] = j
                pred[r, j] = -1
                s += 1
    return rows, cols, forbid, pred


@njit(cache=True)
def round_kernel(prow: NDArray[np.int64], pcol: NDArray[np.int64], lay: NDArray[np.int64],
                 u: NDArray[np.float64], num_experts: int, prob: NDArray[np.float64],
                 alias: NDArray[np.int64], forbid: NDArray[np.uint64],
                 pred: NDArray[np.int64]) -> NDArray[np.bool_]:
    """Resolve one rejection round of the pending slots; return which were accepted.

    Args:
        prow, pcol: int64 [P] row and column of every pending slot (row-major order, so the
            slots of a row are adjacent).
        lay: int64 [P] layer (alias table) of every pending slot.
        u: float64 [P, m] the round's uniforms, m candidates per slot.
        num_experts: E.
        prob, alias: float64 / int64 [L, E] alias tables (``AliasSampler``).
        forbid: uint64 [R] forbidden experts per row (updated with the accepted picks).
        pred: int64 [R, k] predicted sets (accepted picks written).

    Returns:
        bool [P].
    """
    num_pending, m = u.shape
    accept = np.zeros(num_pending, dtype=np.bool_)
    one = np.uint64(1)
    cur = -1
    taken = np.uint64(0)
    for p in range(num_pending):
        r = prow[p]
        if r != cur:
            if cur >= 0:
                forbid[cur] |= taken
            cur = r
            taken = np.uint64(0)
        f = forbid[r]
        layer = lay[p]
        pick = -1
        for j in range(m):
            v = u[p, j] * num_experts
            col = np.int64(v)
            if col > num_experts - 1:
                col = num_experts - 1
            coin = v - col
            c = col if coin < prob[layer, col] else alias[layer, col]
            if (f >> np.uint64(c)) & one == 0:
                pick = c
                break
        if pick >= 0 and (taken >> np.uint64(pick)) & one == 0:
            accept[p] = True
            taken |= one << np.uint64(pick)
            pred[r, pcol[p]] = pick
    if cur >= 0:
        forbid[cur] |= taken
    return accept


@njit(cache=True)
def count_sets(sets: NDArray[np.int64], num_experts: int) -> NDArray[np.float64]:
    """Return float64 [..., E] the entries of int64 sets [..., B, k] per expert (−1 skipped).

    Integer counts, so equal to the ``np.bincount`` of ``StepPredictor.predict``.
    """
    flat = sets.reshape(-1, sets.shape[-2] * sets.shape[-1])
    out = np.zeros((flat.shape[0], num_experts))
    for g in range(flat.shape[0]):
        for v in flat[g]:
            if v >= 0:
                out[g, v] += 1.0
    return out
