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

``noisy_step`` fuses both with the draws for one decode step of the batched env: it calls
numpy's PCG64 ``next_double`` directly on a generator's state (:func:`generator_state`), the
values ``Generator.random`` returns, in the single env's order.
"""

from __future__ import annotations

import ctypes

import llvmlite.binding as llvm
import numpy as np
from numba import njit, types
from numpy.typing import NDArray

__all__ = ["count_sets", "gather_sets", "generator_state", "noisy_step", "round_kernel",
           "start_kernel"]

#: PCG64's ``next_double`` (numpy's C function, the one ``Generator.random`` calls per value),
#: registered under a fixed symbol name so that kernels calling it stay cacheable on disk; a
#: kernel passes it the address of a generator's PCG64 state (:func:`generator_state`).
_NEXT_DOUBLE = "hdamoe_env_pcg64_next_double"
llvm.add_symbol(_NEXT_DOUBLE, ctypes.cast(np.random.PCG64(0).ctypes.next_double,
                                          ctypes.c_void_p).value)
next_double = types.ExternalFunction(_NEXT_DOUBLE, types.float64(types.uintp))


def generator_state(rng: np.random.Generator) -> int | None:
    """Return the address of ``rng``'s PCG64 state for :data:`next_double` (None: another bit
    generator). The generator must outlive every kernel call given the address; the kernel
    advances its stream exactly as ``rng.random`` would (the same C function)."""
    bit_gen = rng.bit_generator
    if type(bit_gen) is not np.random.PCG64:
        return None
    return int(bit_gen.ctypes.state_address)


@njit(cache=True)
def start_kernel(actual: NDArray[np.int64], u: NDArray[np.float64], acc: NDArray[np.float64],
                 layer_of_row: NDArray[np.int64], num_problems: int):  # noqa: ANN201 - 6-tuple
    """Mark replaced slots (u >= accuracy of the row) and build the forbidden bitmasks.

    Args:
        actual: int64 [n·N, k] actual sets (all problems' rows, problem-major).
        u: float64 [n·N, k] uniforms.
        acc: float64 [N] accuracy per row of a problem.
        layer_of_row: int64 [N] layer (alias table) per row of a problem.
        num_problems: n.

    Returns:
        The pending slots in row-major order — ``rows``, ``cols``, ``lay``, ``problem`` int64
        [S] — then ``forbid`` uint64 [n·N] and ``pred`` int64 [n·N, k] (the actual sets with
        −1 at replaced slots).
    """
    total_rows, top_k = actual.shape
    num_rows = total_rows // num_problems
    pred = actual.copy()
    forbid = np.zeros(total_rows, dtype=np.uint64)
    count = 0
    for r in range(total_rows):
        bits = np.uint64(0)
        for j in range(top_k):
            bits |= np.uint64(1) << np.uint64(actual[r, j])
        forbid[r] = bits
    for p in range(num_problems):
        for q in range(num_rows):
            a = acc[q]
            r = p * num_rows + q
            for j in range(top_k):
                if u[r, j] >= a:
                    count += 1
    rows = np.empty(count, dtype=np.int64)
    cols = np.empty(count, dtype=np.int64)
    lay = np.empty(count, dtype=np.int64)
    problem = np.empty(count, dtype=np.int64)
    s = 0
    for p in range(num_problems):
        for q in range(num_rows):
            a = acc[q]
            r = p * num_rows + q
            for j in range(top_k):
                if u[r, j] >= a:
                    rows[s] = r
                    cols[s] = j
                    lay[s] = layer_of_row[q]
                    problem[s] = p
                    pred[r, j] = -1
                    s += 1
    return rows, cols, lay, problem, forbid, pred


@njit(cache=True)
def round_kernel(prow: NDArray[np.int64], pcol: NDArray[np.int64], lay: NDArray[np.int64],
                 problem: NDArray[np.int64], count: int, u: NDArray[np.float64],
                 num_experts: int, prob: NDArray[np.float64], alias: NDArray[np.int64],
                 forbid: NDArray[np.uint64], pred: NDArray[np.int64],
                 per_problem: NDArray[np.int64]) -> int:
    """Resolve one rejection round of the pending slots; compact them; return how many remain.

    Args:
        prow, pcol, lay, problem: int64 [>= count] row, column, layer (alias table) and
            problem of the first ``count`` entries, the pending slots in row-major order (the
            slots of a row adjacent); compacted in place to the slots still pending.
        count: Pending slots.
        u: float64 [count, m] the round's uniforms, m candidates per slot.
        num_experts: E.
        prob, alias: float64 / int64 [L, E] alias tables (``AliasSampler``).
        forbid: uint64 [rows] forbidden experts per row (updated with the accepted picks).
        pred: int64 [rows, k] predicted sets (accepted picks written).
        per_problem: int64 [n] pending slots per problem (updated).

    Returns:
        The number of slots still pending.
    """
    m = u.shape[1]
    one = np.uint64(1)
    cur = -1
    taken = np.uint64(0)
    keep = 0
    for p in range(count):
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
            taken |= one << np.uint64(pick)
            pred[r, pcol[p]] = pick
            per_problem[problem[p]] -= 1
        else:
            prow[keep] = r
            pcol[keep] = pcol[p]
            lay[keep] = layer
            problem[keep] = problem[p]
            keep += 1
    if cur >= 0:
        forbid[cur] |= taken
    return keep


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


@njit(cache=True)
def gather_sets(routing_t: NDArray[np.integer], rows: NDArray[np.int64],
                out: NDArray[np.int64]) -> None:
    """Write the decode step's sets ``routing[:, rows, :]`` (int64 [L, B, k]) into ``out``.

    Args:
        routing_t: int [T, L, k] the trace's routing token-major (``routing.transpose(1, 0, 2)``,
            C-contiguous: a token's layers are adjacent, so a step reads B short runs).
        rows: int64 [B] the step's rows.
        out: int64 [L, B, k] output.
    """
    num_layers, batch, top_k = out.shape
    for b in range(batch):
        r = rows[b]
        for layer in range(num_layers):
            for s in range(top_k):
                out[layer, b, s] = routing_t[r, layer, s]


@njit(cache=True)
def noisy_step(sets: NDArray[np.int64], state: int, acc: NDArray[np.float64],
               layer_of_row: NDArray[np.int64], prob: NDArray[np.float64],
               alias: NDArray[np.int64], num_experts: int, oversample: int,
               pred_out: NDArray[np.int64], counts_out: NDArray[np.float64]
               ):  # noqa: ANN201 - 3-tuple
    """Predict layers 1..L−1 of one decode step with draws from ``gen``: ``noisy_oracle_sets``
    (``StepPredictor.predict``) fused into one pass per round.

    The draws, one :data:`next_double` of the generator state ``state`` (``generator_state``)
    per value, i.e. ``rng.random()``: the [(L−1)·B, k] uniforms of the replacement
    decisions in row-major order, then per rejection round (at most 64) ``oversample`` values
    per pending slot in slot order — the values and stream position of the single env's
    ``rng.random(shape)`` calls. The decisions are those of ``start_kernel`` /
    ``round_kernel`` (the forbidden set as of the start of the round, the first candidate not
    in it, a pick taken earlier in the round by the same row rejected); tests compare the
    batched env with the single env for equality.

    Args:
        sets: int64 [L, B, k] the step's actual sets (C-contiguous).
        state: Address of the copy's PCG64 state (``generator_state``).
        acc: float64 [(L−1)·B] accuracy per predicted row (``StepPredictor.row_acc``).
        layer_of_row: int64 [(L−1)·B] alias table per predicted row.
        prob, alias: The alias tables (``AliasSampler``).
        num_experts: E (<= 64).
        oversample: Candidates per pending slot and round.
        pred_out: int64 [L, B, k] output (C-contiguous): the predicted sets (−1 at layer 0).
        counts_out: float64 [L, E] output, zero on entry: predicted tokens per expert.

    Returns:
        ``(count, rows, cols)``: the slots still pending after 64 rounds (pathological
        popularity; the caller draws their uniform fallback) as rows / columns of
        ``pred_out[1:].reshape(-1, k)``, the first ``count`` entries.
    """
    num_layers, batch, top_k = sets.shape
    pred_out[0] = -1
    if num_layers == 1:
        return 0, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    num_rows = (num_layers - 1) * batch
    actual = sets[1:].reshape(num_rows, top_k)
    pred = pred_out[1:].reshape(num_rows, top_k)
    prow = np.empty(num_rows * top_k, dtype=np.int64)
    pcol = np.empty(num_rows * top_k, dtype=np.int64)
    forbid = np.empty(num_rows, dtype=np.uint64)
    one = np.uint64(1)
    count = 0
    for q in range(num_rows):
        a = acc[q]
        bits = np.uint64(0)
        for j in range(top_k):          # branch-free: the replace coin is unpredictable
            e = actual[q, j]
            bits |= one << np.uint64(e)
            replace = np.int64(next_double(state) >= a)
            pred[q, j] = e - replace * (e + 1)       # -1 when replaced
            prow[count] = q
            pcol[count] = j
            count += replace
        forbid[q] = bits
    rounds = 0
    while count > 0 and rounds < 64:
        cur = -1
        taken = np.uint64(0)
        keep = 0
        for p in range(count):
            r = prow[p]
            if r != cur:
                if cur >= 0:
                    forbid[cur] |= taken
                cur = r
                taken = np.uint64(0)
            f = forbid[r]
            layer = layer_of_row[r]
            pick = -1
            for _ in range(oversample):
                v = next_double(state) * num_experts
                if pick < 0:
                    col = np.int64(v)
                    if col > num_experts - 1:
                        col = num_experts - 1
                    coin = v - col
                    c = col if coin < prob[layer, col] else alias[layer, col]
                    if (f >> np.uint64(c)) & one == 0:
                        pick = c
            if pick >= 0 and (taken >> np.uint64(pick)) & one == 0:
                taken |= one << np.uint64(pick)
                pred[r, pcol[p]] = pick
            else:
                prow[keep] = r
                pcol[keep] = pcol[p]
                keep += 1
        if cur >= 0:
            forbid[cur] |= taken
        count = keep
        rounds += 1
    for layer in range(1, num_layers):
        for b in range(batch):
            for s in range(top_k):
                e = pred_out[layer, b, s]
                if e >= 0:
                    counts_out[layer, e] += 1.0
    return count, prow, pcol
