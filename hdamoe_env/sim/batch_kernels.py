"""Compiled per-decode-step tables of the batched analytic twin (paper-model.md §5.2, §5.5).

For a batch of decode steps (every copy of the vector env, every layer), ``step_tables``
counts the tokens per expert n_i (the expert phase of §5.2, the TP latencies) and the sampled
V_c / h of Eq. 2 — max over clusters c of the tokens whose set meets a holder of c — from the
holder bitmasks of each layer, in one pass over the sets. Both are integer counts, so they equal
the evaluator's ``np.bincount`` and ``LayerEvaluator._max_touch`` exactly. Compiled once and
cached on disk (``cache=True``).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numpy.typing import NDArray

__all__ = ["step_tables"]


@njit(cache=True)
def step_tables(sets: NDArray[np.int64], bitmask: NDArray[np.uint64], num_experts: int,
                num_nodes: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Return the expert counts and the sampled V_c peaks of many decode steps.

    Args:
        sets: int64 [n, L, B, k] expert sets (−1 entries are skipped).
        bitmask: uint64 [L, E] holder bitmask of every expert of every layer (D <= 64).
        num_experts: E.
        num_nodes: D.

    Returns:
        ``counts`` float64 [n, L, E] tokens per expert and ``peak`` float64 [n, L]
        max_c |{t : S_t ∩ holders(c) ≠ ∅}|.
    """
    n, num_layers, batch, top_k = sets.shape
    counts = np.zeros((n, num_layers, num_experts))
    peak = np.zeros((n, num_layers))
    touch = np.zeros(num_nodes, dtype=np.int64)
    one = np.uint64(1)
    for j in range(n):
        for layer in range(num_layers):
            touch[:] = 0
            for t in range(batch):
                bits = np.uint64(0)
                for s in range(top_k):
                    e = sets[j, layer, t, s]
                    if e >= 0:
                        counts[j, layer, e] += 1.0
                        bits |= bitmask[layer, e]
                for c in range(num_nodes):
                    if (bits >> np.uint64(c)) & one:
                        touch[c] += 1
            best = 0
            for c in range(num_nodes):
                if touch[c] > best:
                    best = touch[c]
            peak[j, layer] = best
    return counts, peak
