"""The pure-Python oracle of hardware-aware gating's compiled row loop (tests only).

``greedy_reference`` is the loop ``hdamoe_env.decisions.gating_kernels.greedy_kernel``
replaced: plain Python over small lists (``RowState``), holders prepared as lists of tuples
(``prepared``). It exists only to check the kernel, so it lives with the tests, which import it
as ``tests.hdamoe_env.decisions.gating_reference`` (``tests`` is a namespace package on pytest's
``pythonpath``). The kernel must make exactly its decisions: the same floating-point operations
in the same order and the same tie-breaking.

Under the tile model (``tile_cost``) the node costs are the evaluator's charged seconds; the
oracle reads a holder's cost after one more token from the kernels' one formula
(``gating_kernels.node_cost_after``, called as plain Python through ``py_func``), which
``test_gating_kernels`` checks against the evaluator's own ``perf.tiled_node_compute``.
"""

from __future__ import annotations

import bisect
import math

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.decisions import gating, gating_kernels

Holders = list[list[tuple[int, float, float]]]
_tile_step = gating_kernels.tile_step.py_func
_node_cost_after = gating_kernels.node_cost_after.py_func


class TileState:
    """Token counts, compute and streaming seconds per node, and per-holder tile tables."""

    def __init__(self, tiles: tuple, holders: Holders, P: NDArray[np.float64]) -> None:
        counts, compute, stream, h_row, h_stream, gemm_s, tile_tokens, _ = tiles
        self.counts = counts.tolist()
        self.compute = compute.tolist()
        self.stream = stream.tolist()
        self.gemm_s, self.tile_tokens = gemm_s, tile_tokens
        # per expert, per holder (same order as ``holders``): (row_s, stream_s)
        flat = list(zip(h_row.tolist(), h_stream.tolist(), strict=True))
        self.tables: list[list[tuple[float, float]]] = []
        pos = 0
        for h in holders:
            self.tables.append(flat[pos:pos + len(h)])
            pos += len(h)

    def after(self, i: int, q: int, c: int) -> float:
        """Holder q (node c) of expert i: its charged seconds after one more token of i."""
        row, strm = self.tables[i][q]
        return _node_cost_after(self.compute[c], self.stream[c], self.counts[i], row,
                                self.gemm_s, strm, self.tile_tokens)


def prepared(P: NDArray[np.float64], w: float
             ) -> tuple[Holders, list[float], list[int], NDArray[np.float64]]:
    """Return per-expert holders [(node, P_ic·w, P_ic)], |nodes(i)|, node bitmasks and P·w.

    The same holders, in the same (node) order, as ``gating._prepared_arrays`` (its CSR arrays).
    """
    Pw = P * w
    rows, cols = np.nonzero(P > 0)
    holders: Holders = [[] for _ in range(P.shape[0])]
    for i, c, wc, share in zip(rows.tolist(), cols.tolist(), Pw[rows, cols].tolist(),
                               P[rows, cols].tolist(), strict=True):
        holders[i].append((c, wc, share))
    dispersion = [float(len(h)) for h in holders]
    masks = [sum(1 << c for c, _, _ in h) for h in holders]
    return holders, dispersion, masks, Pw


def full_row(cands: gating._Candidates, t: int) -> tuple[list[int], list[float]]:
    """Return the complete sorted candidate row t (for rows whose scan ran off the prefix)."""
    order = np.argsort(-cands.raw_vals[t], kind="stable")[:cands.width]
    ids = order if cands.raw_ids is None else cands.raw_ids[t][order]
    return ids.tolist(), cands.raw_vals[t][order].tolist()


class RowState:
    """Running node loads L_c of the step and the per-row scan (plain Python over small lists).

    Exact pruning: with r_comp <= 0 and r_comm <= 0 every penalty term is <= 0, so
    a_i <= s_i + r_comm·min_j |nodes(j)|; candidates are scanned in original-score order, and once
    k candidates are held a candidate whose bound does not exceed the k-th best adjusted score can
    never enter (ties go to the better original rank), so the scan stops. It typically touches
    k + a few candidates.
    """

    def __init__(self, loads: list[float], holders: Holders, dispersion: list[float],
                 masks: list[int], rc: float, rm: float, inv_c: float, k: int, protect: int,
                 mode: int, new_nodes: bool, tiles: TileState | None = None) -> None:
        self.loads = loads
        self.tiles = tiles
        self.peak = max(loads)
        self.holders, self.dispersion, self.masks = holders, dispersion, masks
        self.rc, self.rm, self.inv_c, self.k, self.protect = rc, rm, inv_c, k, protect
        self.mode, self.new_nodes = mode, new_nodes
        self.prune = rc <= 0 and rm <= 0
        # Tighter bound for the pruning: a_i <= s_i + r_comm·min_i |nodes(i)| (r_comm <= 0).
        self.offset = 0.0 if new_nodes else rm * min(dispersion, default=0.0)

    def _after(self, i: int, q: int, c: int, wc: float) -> float:
        """Holder q (node c, P_ic·w = wc) of expert i: its cost after one more token of i."""
        if self.tiles is None:
            return self.loads[c] + wc
        return self.tiles.after(i, q, c)

    def remove(self, experts: list[int]) -> None:
        """Subtract one token of each expert (``include_future``: the row's original choices)."""
        loads = self.loads
        ts = self.tiles
        if ts is not None:
            for i in experts:
                n = ts.counts[i] - 1
                ts.counts[i] = n
                for (c, _, _), (row, strm) in zip(self.holders[i], ts.tables[i], strict=True):
                    ts.compute[c] = ts.compute[c] - _tile_step(n, row, ts.gemm_s,
                                                               ts.tile_tokens)
                    if n == 0:
                        ts.stream[c] = ts.stream[c] - strm
                    loads[c] = ts.compute[c] if ts.compute[c] >= ts.stream[c] else ts.stream[c]
            self.peak = max(loads)
            return
        for i in experts:
            for c, wc, _ in self.holders[i]:
                loads[c] -= wc
        self.peak = max(loads)

    def add(self, experts: list[int]) -> None:
        """Add one token of each chosen expert to the running loads."""
        loads = self.loads
        peak = self.peak
        ts = self.tiles
        for i in experts:
            if ts is not None:
                n = ts.counts[i]
                for (c, _, _), (row, strm) in zip(self.holders[i], ts.tables[i], strict=True):
                    ts.compute[c] = ts.compute[c] + _tile_step(n, row, ts.gemm_s,
                                                               ts.tile_tokens)
                    if n == 0:
                        ts.stream[c] = ts.stream[c] + strm
                    v = ts.compute[c] if ts.compute[c] >= ts.stream[c] else ts.stream[c]
                    loads[c] = v
                    if v > peak:
                        peak = v
                ts.counts[i] = n + 1
                continue
            for c, wc, _ in self.holders[i]:
                v = loads[c] + wc
                loads[c] = v
                if v > peak:
                    peak = v
        self.peak = peak

    def base(self, i: int, s: float) -> float:
        """Return s + r_comp·ΔT_comp(i) (+ r_comm·|nodes(i)| unless ``new_nodes``)."""
        after = self._after
        if self.mode == 0:                     # marginal_max: increase of the critical path
            top = -math.inf
            for q, (c, wc, _) in enumerate(self.holders[i]):
                v = after(i, q, c, wc)
                if v > top:
                    top = v
            comp = top - self.peak if top > self.peak else 0.0
        elif self.mode == 1:                   # host_finish: finish time of i's busiest host
            comp = 0.0
            for q, (c, wc, _) in enumerate(self.holders[i]):
                v = after(i, q, c, wc)
                if v > comp:
                    comp = v
        else:                                  # host_load_mean: share-weighted host load
            comp = 0.0
            for q, (c, wc, share) in enumerate(self.holders[i]):
                comp += share * after(i, q, c, wc)
        a = s + self.rc * comp * self.inv_c
        return a if self.new_nodes else a + self.rm * self.dispersion[i]

    def scan(self, cand: list[int], sv: list[float], width: int) -> list[int] | None:
        """Return the chosen positions (best adjusted first), or None if ``cand`` is too short."""
        if self.new_nodes:
            return self._scan_new_nodes(cand, sv, width)
        k, protect, prune = self.k, self.protect, self.prune
        inline = self.mode == 0              # marginal_max + dispersion: inlined ``base``
        holders, dispersion = self.holders, self.dispersion
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
                    for q, (c, wc, _) in enumerate(holders[i]):
                        v = self._after(i, q, c, wc)
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


def greedy_reference(cands: gating._Candidates, k: int, P: NDArray[np.float64], w: float, C: float,
                     rc: float, rm: float, comp_penalty: str, comm_penalty: str, protect: int,
                     include_future: bool, initial_counts: ArrayLike | None,
                     tile_cost: gating.TileCost | None = None
                     ) -> tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.int64]]:
    """The pure-Python row loop: the oracle of ``gating._greedy`` (same arguments and result)."""
    holders, dispersion, masks, _ = prepared(P, w)
    loads_arr, tiles = gating._initial_state(cands, k, P, w, include_future, initial_counts,
                                             tile_cost)
    state = RowState(loads_arr.tolist(), holders, dispersion, masks, rc, rm,
                     1.0 / C if tile_cost is None else 1.0, k,
                     protect, gating.COMP_PENALTIES.index(comp_penalty),
                     comm_penalty == "new_nodes",
                     None if tile_cost is None else TileState(tiles, holders, P))
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
            cand, sv = full_row(cands, t)
            picks = state.scan(cand, sv, width)
            assert picks is not None
        state.add([cand[p] for p in picks])
        sets.append([cand[p] for p in picks])
        weights.append([sv[p] for p in picks])
        positions.append(picks)
    return (np.array(sets, dtype=np.int64), np.array(weights, dtype=np.float64),
            np.array(positions, dtype=np.int64))
