"""Compiled kernels of the dispatch loops (``dispatch_replicas`` and ``dispatch_broadcast``).

``dispatch_replicas`` chooses, token by token (experts in ascending id order, their tokens in
batch order), which copy of a replicated expert computes the token; under ``least_loaded`` each
choice depends on the loads the earlier ones left, so it is a loop. ``replica_kernel`` runs it
for the rules whose choice needs no anchors (``least_loaded``, and ``round_robin`` /
``shares`` through a precomputed plan); ``nearest`` stays in Python. It performs the same
floating-point operations in the same order and breaks ties the same way (the lower copy
index), so its results equal the Python loop's bit for bit (tested against it).
``broadcast_kernel`` is the same for the (token, broadcast expert) pairs of
``dispatch_broadcast`` (every rule; ties to the first candidate). Compiled once and cached on
disk (``cache=True``), like the DES kernel.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numpy.typing import NDArray

__all__ = ["broadcast_kernel", "replica_kernel"]


@njit(cache=True)
def replica_kernel(sets: NDArray[np.int64], shares: NDArray[np.float64],
                   reps: NDArray[np.bool_], rep_experts: NDArray[np.int64],
                   loads: NDArray[np.float64], w: float, plan: NDArray[np.int64],
                   plan_ofs: NDArray[np.int64], has_plan: NDArray[np.bool_], width: int
                   ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64],
                              NDArray[np.float64], NDArray[np.float64], NDArray[np.int64],
                              NDArray[np.int64]]:  # pragma: no cover - compiled
    """Assign every token of every replicated expert to one copy (module docstring).

    Args:
        sets: int64 [B, k] expert sets (batch order).
        shares: float64 [E, D] shares P (the primary group of e: every c with P_ec > 0).
        reps: bool [E, D] replica mask.
        rep_experts: int64 [R] the replicated experts, ascending.
        loads: float64 [D] the loads before the replicated experts (updated in place).
        w: Work per (token, expert).
        plan: int64 flat copy index per token of the experts that follow a plan.
        plan_ofs: int64 [R] start of expert r's plan in ``plan``.
        has_plan: bool [R] whether expert r follows its plan (else ``least_loaded``).
        width: Upper bound of the nodes a token's chosen copies add (columns of ``chosen``).

    Returns:
        ``(nodes [B, k], copies [B, k], work [D], primary_tokens [R], replica_tokens [R, D],
        chosen [B, width], n_chosen [B])``: the first node of the chosen copy and its index
        per (token, slot) (-1 where not replicated), the work charged per node, the tokens of
        each primary group and replica node, and each token's chosen nodes in order.
    """
    B, k = sets.shape
    D = shares.shape[1]
    R = rep_experts.size
    nodes = np.full((B, k), -1, dtype=np.int64)
    copies = np.full((B, k), -1, dtype=np.int64)
    work = np.zeros(D)
    primary_tokens = np.zeros(R)
    replica_tokens = np.zeros((R, D))
    chosen = np.full((B, width), -1, dtype=np.int64)
    n_chosen = np.zeros(B, dtype=np.int64)
    group = np.empty(D, dtype=np.int64)
    gshare = np.empty(D)
    rep_nodes = np.empty(D, dtype=np.int64)
    for r in range(R):
        e = rep_experts[r]
        ng = 0
        nr = 0
        for c in range(D):
            if shares[e, c] > 0:
                group[ng] = c
                gshare[ng] = shares[e, c]
                ng += 1
            if reps[e, c]:
                rep_nodes[nr] = c
                nr += 1
        pos = 0
        for t in range(B):
            slot = -1
            for j in range(k):
                if sets[t, j] == e:
                    slot = j
                    break
            if slot < 0:
                continue
            if has_plan[r]:
                pick = plan[plan_ofs[r] + pos]
            else:
                pick = 0
                best = loads[group[0]] + gshare[0] * w
                for i in range(1, ng):
                    v = loads[group[i]] + gshare[i] * w
                    if v > best:
                        best = v
                for j in range(nr):
                    v = loads[rep_nodes[j]] + 1.0 * w
                    if v < best:
                        best = v
                        pick = j + 1
            pos += 1
            if pick == 0:
                for i in range(ng):
                    c = group[i]
                    loads[c] += gshare[i] * w
                    work[c] += gshare[i] * w
                    chosen[t, n_chosen[t]] = c
                    n_chosen[t] += 1
                nodes[t, slot] = group[0]
                primary_tokens[r] += 1.0
            else:
                c = rep_nodes[pick - 1]
                loads[c] += 1.0 * w
                work[c] += 1.0 * w
                chosen[t, n_chosen[t]] = c
                n_chosen[t] += 1
                nodes[t, slot] = c
                replica_tokens[r, c] += 1.0
            copies[t, slot] = pick
    return nodes, copies, work, primary_tokens, replica_tokens, chosen, n_chosen


@njit(cache=True)
def broadcast_kernel(sets: NDArray[np.int64], bc: NDArray[np.int64], h_ptr: NDArray[np.int64],
                     h_node: NDArray[np.int64], base: NDArray[np.float64], w: float, rule: int,
                     tiled: bool, delta: NDArray[np.float64], ref_bookkeeping: bool,
                     orphans: NDArray[np.bool_], nodes: NDArray[np.int64],
                     work: NDArray[np.float64], computes: NDArray[np.bool_],
                     replica_tokens: NDArray[np.float64]) -> bool:
    """The dispatch loop of ``dispatch.dispatch_broadcast`` (rule 0 ``least_loaded``, 1
    ``first``, 2 ``home``): for every broadcast expert in order and its tokens in batch order,
    the candidate with the earliest finish (tile-aware: ``tiled``, ``delta`` [B + 1]) or the
    lowest load, ties to the first candidate; fills ``nodes`` [B, k] (−1 elsewhere), ``work``
    [D], ``computes`` / ``replica_tokens`` [m, D] (zeroed by the caller). The holders of
    expert i are ``h_node[h_ptr[i]:h_ptr[i + 1]]``, ascending. The same floating-point
    operations in the same order as the Python loop (``dispatch._broadcast_python``).
    Returns False, with outputs partly written, when a token has no candidate (the Python
    loop raises there)."""
    num_tokens, top_k = sets.shape
    num_nodes = base.shape[0]
    loads = base.copy()
    tok = np.zeros(num_nodes, dtype=np.int64)
    cand = np.empty(max(top_k * num_nodes, num_nodes), dtype=np.int64)
    for b in range(bc.shape[0]):
        e = bc[b]
        if ref_bookkeeping and b > 0:
            loads[:] = base                                      # §10.9: increments dropped
        tok[:] = 0
        for t in range(num_tokens):
            slot = -1
            for s in range(top_k):
                if sets[t, s] == e:
                    slot = s
                    break
            if slot < 0:
                continue
            n = 0
            if rule == 2:
                for q in range(h_ptr[e], h_ptr[e + 1]):
                    cand[n] = h_node[q]
                    n += 1
            elif orphans[t]:
                for c in range(num_nodes):
                    cand[n] = c
                    n += 1
            else:
                for s in range(top_k):
                    j = sets[t, s]
                    for q in range(h_ptr[j], h_ptr[j + 1]):
                        cand[n] = h_node[q]
                        n += 1
            if n == 0:
                return False
            c_t = cand[0]
            if tiled and rule != 1:
                best = loads[c_t] + delta[tok[c_t]]
                for q in range(n):
                    c = cand[q]
                    finish = loads[c] + delta[tok[c]]
                    if finish < best:
                        c_t = c
                        best = finish
                loads[c_t] = best
                tok[c_t] += 1
            elif rule != 1:
                best = loads[c_t]
                for q in range(n):
                    c = cand[q]
                    if loads[c] < best:
                        c_t = c
                        best = loads[c]
                loads[c_t] += w
            else:
                if tiled:
                    loads[c_t] += delta[tok[c_t]]
                    tok[c_t] += 1
                else:
                    loads[c_t] += w
            work[c_t] += w
            nodes[t, slot] = c_t
            computes[b, c_t] = True
            replica_tokens[b, c_t] += 1.0
    return True
