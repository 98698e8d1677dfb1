"""Compiled per-decode-step tables of the batched analytic twin (paper-model.md §5.2, §5.5).

For a batch of decode steps (every copy of the vector env, every layer), ``step_tables``
counts the tokens per expert n_i (the expert phase of §5.2, the TP latencies) and the sampled
V_c / h of Eq. 2 — max over clusters c of the tokens whose set meets a holder of c — from the
holder lists of each layer (``holder_csr``), in one pass over the sets. Both are integer counts, so they equal
the evaluator's ``np.bincount`` and ``LayerEvaluator._max_touch`` exactly. Compiled once and
cached on disk (``cache=True``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from numpy.typing import NDArray

from hdamoe_env.decisions.prediction_kernels import gather_sets, noisy_step

__all__ = ["form_steps", "form_steps_par", "gather_tables", "holder_csr", "step_table_one",
           "step_tables"]


@njit(cache=True, inline="always")
def _mark_holders(bits: np.uint64, lo: int, hi: int, nodes: NDArray[np.int64],
                  touch: NDArray[np.int64]) -> np.uint64:
    """Count one token at every holder cluster ``nodes[lo:hi]`` not yet in ``bits`` (the
    clusters this token already touches); return the updated bit set."""
    for h in range(lo, hi):
        bit = np.uint64(1) << np.uint64(nodes[h])
        if bits & bit == 0:
            bits |= bit
            touch[nodes[h]] += 1
    return bits


@njit(cache=True)
def step_tables(sets: NDArray[np.int64], h_ptr: NDArray[np.int64], h_node: NDArray[np.int64],
                num_experts: int, num_nodes: int
                ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Return the expert counts and the sampled V_c peaks of many decode steps.

    Args:
        sets: int64 [n, L, B, k] expert sets (−1 entries are skipped).
        h_ptr: int64 [L, E + 1] CSR pointers of the holder clusters of every expert of every
            layer (P_ic > 0).
        h_node: int64 [L, H] the holder clusters (row ``layer``, entries ``h_ptr[layer, e]``
            to ``h_ptr[layer, e + 1]``).
        num_experts: E.
        num_nodes: D (<= 64).

    Returns:
        ``counts`` float64 [n, L, E] tokens per expert and ``peak`` float64 [n, L]
        max_c |{t : S_t ∩ holders(c) ≠ ∅}|.
    """
    n, num_layers = sets.shape[:2]
    counts = np.zeros((n, num_layers, num_experts))
    peak = np.zeros((n, num_layers))
    for j in range(n):
        step_table_one(sets[j], h_ptr, h_node, num_nodes, counts[j], peak[j])
    return counts, peak


@njit(cache=True)
def step_table_one(sets: NDArray[np.int64], h_ptr: NDArray[np.int64], h_node: NDArray[np.int64],
                   num_nodes: int, counts: NDArray[np.float64], peak: NDArray[np.float64]
                   ) -> None:
    """``step_tables`` of one decode step, written into ``counts`` [L, E] (zeroed) and
    ``peak`` [L].

    Args:
        sets: int64 [L, B, k] expert sets (−1 entries are skipped).
        h_ptr, h_node: The holder arrays (``holder_csr``).
        num_nodes: D (<= 64).
        counts: float64 [L, E] output, zero on entry.
        peak: float64 [L] output.
    """
    num_layers, batch, top_k = sets.shape
    touch = np.zeros(num_nodes, dtype=np.int64)
    for layer in range(num_layers):
        touch[:] = 0
        for t in range(batch):
            bits = np.uint64(0)
            for s in range(top_k):
                e = sets[layer, t, s]
                if e >= 0:
                    counts[layer, e] += 1.0
                    bits = _mark_holders(bits, h_ptr[layer, e], h_ptr[layer, e + 1],
                                         h_node[layer], touch)
        best = 0
        for c in range(num_nodes):
            if touch[c] > best:
                best = touch[c]
        peak[layer] = best


def holder_csr(support: NDArray[np.bool_]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Return the ``step_tables`` holder arrays (h_ptr [L, E + 1], h_node [L, H]) of bool
    [L, E, D] holder masks (rows padded to the longest layer)."""
    num_layers, num_experts, _ = support.shape
    per = support.sum(axis=2)                                             # [L, E]
    h_ptr = np.zeros((num_layers, num_experts + 1), dtype=np.int64)
    h_ptr[:, 1:] = np.cumsum(per, axis=1)
    h_node = np.zeros((num_layers, max(int(h_ptr[:, -1].max(initial=0)), 1)), dtype=np.int64)
    for layer in range(num_layers):
        e_idx, c_idx = np.nonzero(support[layer])                          # row-major: by expert
        h_node[layer, :c_idx.size] = c_idx
    return h_ptr, h_node


@njit(cache=True)
def gather_tables(routing_t: NDArray[np.integer], rows: NDArray[np.int64],
                  h_ptr: NDArray[np.int64], h_node: NDArray[np.int64], num_nodes: int,
                  sets: NDArray[np.int64], counts: NDArray[np.float64],
                  peak: NDArray[np.float64]) -> None:
    """Gather one decode step's sets and count them in one pass (``step_table_one`` fused with
    ``prediction_kernels.gather_sets``).

    Args:
        routing_t: int [T, L, k] the trace's routing, token-major.
        rows: int64 [B] the step's rows.
        h_ptr, h_node: The holder arrays (``holder_csr``).
        num_nodes: D (<= 64).
        sets: int64 [L, B, k] output, the step's sets.
        counts: float64 [L, E] output: tokens per expert.
        peak: float64 [L] output: max over clusters of the tokens whose set meets a holder.
    """
    num_layers, batch, top_k = sets.shape
    touch = np.zeros((num_layers, num_nodes), dtype=np.int64)
    counts[:] = 0.0
    for b in range(batch):
        r = rows[b]
        for layer in range(num_layers):
            bits = np.uint64(0)
            for s in range(top_k):
                e = np.int64(routing_t[r, layer, s])
                sets[layer, b, s] = e
                counts[layer, e] += 1.0
                bits = _mark_holders(bits, h_ptr[layer, e], h_ptr[layer, e + 1], h_node[layer],
                                     touch[layer])
    for layer in range(num_layers):
        best = 0
        for c in range(num_nodes):
            if touch[layer, c] > best:
                best = touch[layer, c]
        peak[layer] = best


@njit(cache=True)
def form_steps(routing_t: NDArray[np.integer], rows: NDArray[np.int64], idx: NDArray[np.int64],
               states: NDArray[np.uint64], start: int, acc: NDArray[np.float64],
               layer_of_row: NDArray[np.int64], prob: NDArray[np.float64],
               alias: NDArray[np.int64], num_experts: int, oversample: int,
               h_ptr: NDArray[np.int64], h_node: NDArray[np.int64], num_nodes: int,
               tables: bool, sets: NDArray[np.int64], counts: NDArray[np.float64],
               peak: NDArray[np.float64], pred: NDArray[np.int64],
               pred_counts: NDArray[np.float64]):  # noqa: ANN201 - 4-tuple
    """Form the decode steps of copies ``idx[start:]`` of the batched env in one call.

    Per copy j (in order): its sets (``gather_tables`` with ``tables``, else ``gather_sets``)
    and its noisy-oracle predictions (``prediction_kernels.noisy_step``, drawing from the PCG64
    state at ``states[j]``), written to row ``idx[j]`` of the outputs.

    Args:
        routing_t: int [T, L, k] the routing, token-major.
        rows: int64 [n, B] every copy's trace rows.
        idx: int64 [n] output row of every copy.
        states: uint64 [n] every copy's PCG64 state address (``generator_state``).
        start: First copy to form.
        acc, layer_of_row, prob, alias, num_experts, oversample: The predictor
            (``noisy_step``).
        h_ptr, h_node, num_nodes: The holder arrays (``holder_csr``; unused without
            ``tables``).
        tables: Also count the experts and the V_c peaks (the analytic twin).
        sets, counts, peak, pred, pred_counts: Outputs [N, L, B, k], [N, L, E], [N, L],
            [N, L, B, k], [N, L, E].

    Returns:
        ``(stop, count, prow, pcol)``: ``stop`` = n when every copy is formed; otherwise copy
        ``stop`` left ``count`` slots pending after 64 rounds (``noisy_step``'s rows /
        columns); the caller draws their fallback and calls again from ``stop + 1``.
    """
    n = rows.shape[0]
    for j in range(start, n):
        count, prow, pcol = _form_one(routing_t, rows[j], idx[j], states[j], acc, layer_of_row,
                                      prob, alias, num_experts, oversample, h_ptr, h_node,
                                      num_nodes, tables, sets, counts, peak, pred, pred_counts)
        if count:
            return j, count, prow, pcol
    return n, 0, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)


@njit(cache=True, parallel=True)
def form_steps_par(routing_t: NDArray[np.integer], rows: NDArray[np.int64],
                   idx: NDArray[np.int64], states: NDArray[np.uint64], acc: NDArray[np.float64],
                   layer_of_row: NDArray[np.int64], prob: NDArray[np.float64],
                   alias: NDArray[np.int64], num_experts: int, oversample: int,
                   h_ptr: NDArray[np.int64], h_node: NDArray[np.int64], num_nodes: int,
                   tables: bool, sets: NDArray[np.int64], counts: NDArray[np.float64],
                   peak: NDArray[np.float64], pred: NDArray[np.int64],
                   pred_counts: NDArray[np.float64]) -> NDArray[np.bool_]:
    """``form_steps`` of every copy, the copies spread over numba's threads (``prange``).

    Copy j writes only row ``idx[j]`` of the outputs and draws only from the state at
    ``states[j]``, with ``form_steps``'s arithmetic, so every copy's rows and stream equal the
    serial call's. The addresses (and the rows ``idx``) must be distinct. A copy whose
    predictions need the fallback (``form_steps`` would stop there) is flagged instead: its
    outputs are incomplete and its generator advanced, so the caller restores the generator
    and forms that copy again with ``form_steps``.

    Returns:
        bool [n]: the flagged copies.
    """
    n = rows.shape[0]
    pending = np.zeros(n, dtype=np.bool_)
    for j in prange(n):
        count, _, _ = _form_one(routing_t, rows[j], idx[j], states[j], acc, layer_of_row, prob,
                                alias, num_experts, oversample, h_ptr, h_node, num_nodes,
                                tables, sets, counts, peak, pred, pred_counts)
        pending[j] = count > 0
    return pending


@njit(cache=True)
def _form_one(routing_t: NDArray[np.integer], rows: NDArray[np.int64], i: int, state: np.uint64,
              acc: NDArray[np.float64], layer_of_row: NDArray[np.int64],
              prob: NDArray[np.float64], alias: NDArray[np.int64], num_experts: int,
              oversample: int, h_ptr: NDArray[np.int64], h_node: NDArray[np.int64],
              num_nodes: int, tables: bool, sets: NDArray[np.int64],
              counts: NDArray[np.float64], peak: NDArray[np.float64], pred: NDArray[np.int64],
              pred_counts: NDArray[np.float64]):  # noqa: ANN202 - 3-tuple
    """Form one copy's decode step into row ``i`` (the body of ``form_steps``); return
    ``noisy_step``'s ``(count, prow, pcol)``."""
    if tables:
        gather_tables(routing_t, rows, h_ptr, h_node, num_nodes, sets[i], counts[i], peak[i])
    else:
        gather_sets(routing_t, rows, sets[i])
    pred_counts[i] = 0.0
    return noisy_step(sets[i], state, acc, layer_of_row, prob, alias, num_experts, oversample,
                      pred[i], pred_counts[i])
