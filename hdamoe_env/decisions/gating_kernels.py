"""Compiled kernels of hardware-aware gating (paper-model.md §11.2–11.5): the row loop and more.

The sequential greedy of §11.2 processes the B rows of a decode step in batch order (row t's
penalties depend on the choices of rows < t), so it is a loop; these numba kernels run it
(``greedy_kernel``, with the per-row scans ``scan_row`` for the ``dispersion`` penalty and
``scan_row_new_nodes`` for ``new_nodes``), sort the candidates (``sort_rows``), validate them
(``ids_in_range``, ``all_finite``), count the kept original ranks (``kept_counts``) and do all
of it in one call for the env's common case (``fused_kernel``). Every kernel is compiled once
and cached on disk (``cache=True``), like the DES kernel.

They make exactly the decisions of the pure-Python oracle kept with the tests
(``tests/hdamoe_env/decisions/gating_reference.py``): the same floating-point operations in the same
order and the same tie-breaking; the tests compare the two for exact equality. The public
entry point and the argument checks are in :mod:`hdamoe_env.decisions.gating`; a kernel trusts
its arguments (CSR holder arrays from ``gating._prepared_arrays``, candidates sorted best first).

Holder arrays (CSR over experts): ``h_ptr`` int64 [E + 1], and per (expert, holder) entry
``h_node`` int64 (the node c), ``h_wc`` float64 (P_ic·w) and ``h_share`` float64 (P_ic);
``dispersion`` float64 [E] = |nodes(i)|. ``mode`` indexes ``gating.COMP_PENALTIES``
(0 ``marginal_max``, 1 ``host_finish``, 2 ``host_load_mean``).

Node costs. Without tiles (``tiles[7]`` False) ``loads`` [D] are the fluid loads
L_c = Σ_j P_jc·n_j·w (FLOP) and one more token of expert i adds ``h_wc`` = P_ic·w to each holder.
With tiles (the evaluator's tile model, docs/PHYSICS.md §4) ``loads`` are the seconds the
evaluator charges each node, max(compute_c, stream_c), and ``tiles`` carries the state behind
them: ``(counts int64 [E], compute float64 [D], stream float64 [D], h_row float64 [H],
h_stream float64 [H], gemm_s, tile_tokens, True)``, where ``h_row`` is the seconds per padded
token row of the shard (ceil(P_ic·I/T_c)·T_c·m·2h/C), ``h_stream`` its weight streaming when the
expert is active (P_ic·W_e/(BW_mem·η), 0 when not charged) and ``gemm_s`` = m·o per active
shard. One more token of expert i then costs a holder what ``tile_step`` says (a whole token
tile when it opens one, nothing when it fills one, plus the GEMM overhead and the streaming when
it activates the shard); ``node_cost_after`` is the one formula of a holder's cost after it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange
from numpy.typing import NDArray

__all__ = ["add_expert", "all_finite", "base_score", "fused_kernel", "fused_sets_many",
           "fused_sets_many_par", "greedy_kernel",
           "holder_after", "ids_in_range", "kept_counts", "no_tiles", "node_cost_after",
           "remove_expert", "scan_row", "scan_row_new_nodes", "sort_rows", "tile_step"]

#: The ``tiles`` tuple of a kernel call (see the module docstring).
Tiles = tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.float64],
              NDArray[np.float64], NDArray[np.float64], float, int, bool]


def no_tiles() -> Tiles:
    """Return the ``tiles`` argument of the fluid model (empty arrays, flag off)."""
    empty = np.zeros(0)
    return (np.zeros(0, dtype=np.int64), empty, empty, empty, empty, 0.0, 1, False)


@njit(cache=True)
def tile_step(n: int, row_s: float, gemm_s: float, tile_tokens: int) -> float:
    """Return the compute seconds token n + 1 of an expert adds to one of its shards.

    The evaluator charges a shard with n tokens ceil(n/T)·T·``row_s`` + 1[n > 0]·``gemm_s``
    (``perf.tiled_node_compute``), so the (n + 1)-th token adds a whole token tile
    T·``row_s`` when n is a multiple of T (it opens a tile) and nothing otherwise; the first
    token also adds the GEMM overhead.
    """
    if n % tile_tokens != 0:
        return 0.0
    step = tile_tokens * row_s
    return step + gemm_s if n == 0 else step


@njit(cache=True)
def node_cost_after(compute_c: float, stream_c: float, n: int, row_s: float, gemm_s: float,
                    stream_j: float, tile_tokens: int) -> float:
    """Return a holder's charged seconds max(compute, stream) after one more token of an expert.

    ``compute_c``/``stream_c`` are the node's compute and weight-streaming seconds before, ``n``
    the expert's tokens before, ``row_s``/``stream_j`` the shard's seconds per padded token row
    and its streaming (added when the token activates the shard, n = 0).
    """
    c = compute_c + tile_step(n, row_s, gemm_s, tile_tokens)
    s = stream_c + stream_j if n == 0 else stream_c
    return c if c >= s else s


@njit(cache=True)
def holder_after(i: int, j: int, loads: NDArray[np.float64], h_node: NDArray[np.int64],
                 h_wc: NDArray[np.float64], tiles: Tiles) -> float:
    """Return holder entry j's node cost after one more token of expert i (fluid or tiles)."""
    if tiles[7]:
        c = h_node[j]
        return node_cost_after(tiles[1][c], tiles[2][c], tiles[0][i], tiles[3][j], tiles[5],
                               tiles[4][j], tiles[6])
    return loads[h_node[j]] + h_wc[j]


@njit(cache=True)
def add_expert(i: int, loads: NDArray[np.float64], peak: float, h_ptr: NDArray[np.int64],
               h_node: NDArray[np.int64], h_wc: NDArray[np.float64], tiles: Tiles) -> float:
    """Add one token of expert i to the node costs (and the tile state); return the new peak."""
    if tiles[7]:
        counts, comp, strm, h_row, h_stream = tiles[0], tiles[1], tiles[2], tiles[3], tiles[4]
        n = counts[i]
        for j in range(h_ptr[i], h_ptr[i + 1]):
            c = h_node[j]
            comp[c] = comp[c] + tile_step(n, h_row[j], tiles[5], tiles[6])
            if n == 0:
                strm[c] = strm[c] + h_stream[j]
            v = comp[c] if comp[c] >= strm[c] else strm[c]
            loads[c] = v
            if v > peak:
                peak = v
        counts[i] = n + 1
        return peak
    for j in range(h_ptr[i], h_ptr[i + 1]):
        v = loads[h_node[j]] + h_wc[j]
        loads[h_node[j]] = v
        if v > peak:
            peak = v
    return peak


@njit(cache=True)
def remove_expert(i: int, loads: NDArray[np.float64], h_ptr: NDArray[np.int64],
                  h_node: NDArray[np.int64], h_wc: NDArray[np.float64], tiles: Tiles) -> None:
    """Remove one token of expert i from the node costs (``include_future``); peak not updated."""
    if tiles[7]:
        counts, comp, strm, h_row, h_stream = tiles[0], tiles[1], tiles[2], tiles[3], tiles[4]
        n = counts[i] - 1
        counts[i] = n
        for j in range(h_ptr[i], h_ptr[i + 1]):
            c = h_node[j]
            comp[c] = comp[c] - tile_step(n, h_row[j], tiles[5], tiles[6])
            if n == 0:
                strm[c] = strm[c] - h_stream[j]
            loads[c] = comp[c] if comp[c] >= strm[c] else strm[c]
        return
    for j in range(h_ptr[i], h_ptr[i + 1]):
        loads[h_node[j]] -= h_wc[j]


@njit(cache=True)
def ids_in_range(ids: NDArray[np.int64], num_experts: int) -> bool:
    """Return whether every id lies in [0, E) (one pass, no temporaries)."""
    for v in ids.ravel():
        if v < 0 or v >= num_experts:
            return False
    return True


@njit(cache=True)
def all_finite(vals: NDArray[np.float64]) -> bool:
    """Return whether every value is finite (one pass, no temporaries)."""
    for v in vals.ravel():
        if not np.isfinite(v):
            return False
    return True


@njit(cache=True)
def sort_rows(vals: NDArray[np.float64], raw_ids: NDArray[np.int64], has_ids: bool
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


@njit(cache=True)
def base_score(i: int, s: float, loads: NDArray[np.float64], peak: float,
               h_ptr: NDArray[np.int64], h_node: NDArray[np.int64], h_wc: NDArray[np.float64],
               h_share: NDArray[np.float64], dispersion: NDArray[np.float64], rc: float,
               rm: float, inv_c: float, mode: int, new_nodes: bool, tiles: Tiles) -> float:
    """Return s + r_comp·ΔT_comp(i) (+ r_comm·|nodes(i)| unless ``new_nodes``) (§11.3–11.4).

    The oracle's ``RowState.base``; ``loads`` [D] are the running node costs (fluid loads L_c
    or tile-model seconds, see the module docstring), ``peak`` their maximum.
    """
    if mode == 0:
        top = -np.inf
        for j in range(h_ptr[i], h_ptr[i + 1]):
            v = holder_after(i, j, loads, h_node, h_wc, tiles)
            if v > top:
                top = v
        comp = top - peak if top > peak else 0.0
    elif mode == 1:
        comp = 0.0
        for j in range(h_ptr[i], h_ptr[i + 1]):
            v = holder_after(i, j, loads, h_node, h_wc, tiles)
            if v > comp:
                comp = v
    else:
        comp = 0.0
        for j in range(h_ptr[i], h_ptr[i + 1]):
            comp += h_share[j] * holder_after(i, j, loads, h_node, h_wc, tiles)
    a = s + rc * comp * inv_c
    return a if new_nodes else a + rm * dispersion[i]


@njit(cache=True)
def scan_row(cand: NDArray[np.int64], sv: NDArray[np.float64], width: int, k: int,
             loads: NDArray[np.float64], peak: float, h_ptr: NDArray[np.int64],
             h_node: NDArray[np.int64], h_wc: NDArray[np.float64],
             h_share: NDArray[np.float64], dispersion: NDArray[np.float64], rc: float,
             rm: float, inv_c: float, protect: int, mode: int, prune: bool, offset: float,
             out: NDArray[np.int64], top_a: NDArray[np.float64],
             top_p: NDArray[np.int64], tiles: Tiles) -> bool:
    """Choose one row's k candidates (dispersion penalty); False when ``cand`` is too short.

    The oracle's ``RowState.scan``: candidates in original-score order, exact pruning once k
    are held (with r_comp <= 0 and r_comm <= 0 a candidate whose score plus ``offset`` does not
    exceed the k-th best adjusted score cannot enter). ``out`` [k] receives the chosen
    positions, best adjusted first.

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
                    v = holder_after(i, j, loads, h_node, h_wc, tiles)
                    if v > best:
                        best = v
                a = s + rm * dispersion[i]
                if best > peak:
                    a += rc_c * (best - peak)
            else:
                a = base_score(i, s, loads, peak, h_ptr, h_node, h_wc, h_share, dispersion,
                               rc, rm, inv_c, mode, False, tiles)
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
def scan_row_new_nodes(cand: NDArray[np.int64], sv: NDArray[np.float64], width: int, k: int,
                       loads: NDArray[np.float64], peak: float, h_ptr: NDArray[np.int64],
                       h_node: NDArray[np.int64], h_wc: NDArray[np.float64],
                       h_share: NDArray[np.float64], dispersion: NDArray[np.float64],
                       rc: float, rm: float, inv_c: float, protect: int, mode: int,
                       prune: bool, covered: NDArray[np.bool_], out: NDArray[np.int64],
                       bases: NDArray[np.float64], taken: NDArray[np.bool_],
                       tiles: Tiles) -> bool:
    """Choose one row's k candidates one at a time with ΔT_comm = |nodes(i) \\ covered| (§11.4).

    The oracle's ``RowState._scan_new_nodes``; False when ``cand`` is a too-short prefix.

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
                b = base_score(i, sv[pos], loads, peak, h_ptr, h_node, h_wc, h_share,
                               dispersion, rc, rm, inv_c, mode, True, tiles)
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
def greedy_kernel(ids: NDArray[np.int64], vals: NDArray[np.float64], width: int,
                  raw_ids: NDArray[np.int64], has_raw_ids: bool, raw_vals: NDArray[np.float64],
                  k: int, loads: NDArray[np.float64], h_ptr: NDArray[np.int64],
                  h_node: NDArray[np.int64], h_wc: NDArray[np.float64],
                  h_share: NDArray[np.float64], dispersion: NDArray[np.float64], rc: float,
                  rm: float, inv_c: float, protect: int, mode: int, new_nodes: bool,
                  include_future: bool, tiles: Tiles
                  ) -> tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.int64]]:
    """Run the greedy over all rows; return sets, raw weights and positions, each [B, k].

    The compiled row loop of the oracle's ``greedy_reference`` (``RowState``). ``ids``/``vals``
    [B, W] are the sorted candidate prefixes of ``width`` candidates per row in total; a row
    whose scan runs off its prefix is redone on the whole row of ``raw_ids``/``raw_vals``
    (sorted stably here). ``loads`` [D] are the node costs before the first row and ``tiles``
    the tile state behind them (neither is modified).
    """
    num_rows = ids.shape[0]
    sets = np.empty((num_rows, k), dtype=np.int64)
    weights = np.empty((num_rows, k))
    positions = np.empty((num_rows, k), dtype=np.int64)
    loads = loads.copy()
    tiles = (tiles[0].copy(), tiles[1].copy(), tiles[2].copy(), tiles[3], tiles[4], tiles[5],
             tiles[6], tiles[7])
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
                remove_expert(cand[q], loads, h_ptr, h_node, h_wc, tiles)
            peak = loads.max()
        for _attempt in range(2):
            if new_nodes:
                ok = scan_row_new_nodes(cand, sv, width, k, loads, peak, h_ptr, h_node, h_wc,
                                        h_share, dispersion, rc, rm, inv_c, protect, mode,
                                        prune, covered, picks, bases, taken, tiles)
            else:
                ok = scan_row(cand, sv, width, k, loads, peak, h_ptr, h_node, h_wc, h_share,
                              dispersion, rc, rm, inv_c, protect, mode, prune, offset, picks,
                              top_a, top_p, tiles)
            if ok:
                break
            # the prefix was not enough: the whole row, sorted stably (the oracle's ``full_row``)
            order = np.argsort(-raw_vals[t], kind="mergesort")[:width]
            sv = raw_vals[t][order]
            cand = raw_ids[t][order] if has_raw_ids else order.astype(np.int64)
        for q in range(k):
            p = picks[q]
            i = cand[p]
            sets[t, q] = i
            weights[t, q] = sv[p]
            positions[t, q] = p
            # add_expert(i, loads, peak, ...) written out: a compiled call with its nine
            # arrays as arguments cost more than the body (inlined, the kernel takes about
            # half the time; same results). numba's inline="always" on add_expert does not
            # recover it: fused_kernel 0.20-0.21 s against 0.14-0.15 s written out, 416 calls
            # of `hdamoe bench --methods hda-moe --seeds 0,1 --steps 8` under cProfile
            if tiles[7]:
                counts, comp, strm, h_row, h_stream = (tiles[0], tiles[1], tiles[2], tiles[3],
                                                       tiles[4])
                n = counts[i]
                for j in range(h_ptr[i], h_ptr[i + 1]):
                    c = h_node[j]
                    comp[c] = comp[c] + tile_step(n, h_row[j], tiles[5], tiles[6])
                    if n == 0:
                        strm[c] = strm[c] + h_stream[j]
                    v = comp[c] if comp[c] >= strm[c] else strm[c]
                    loads[c] = v
                    if v > peak:
                        peak = v
                counts[i] = n + 1
            else:
                for j in range(h_ptr[i], h_ptr[i + 1]):
                    v = loads[h_node[j]] + h_wc[j]
                    loads[h_node[j]] = v
                    if v > peak:
                        peak = v
    return sets, weights, positions


@njit(cache=True)
def fused_kernel(ids: NDArray[np.int64], vals: NDArray[np.float64], num_experts: int,
                 num_nodes: int, k: int,
                 h_ptr: NDArray[np.int64], h_node: NDArray[np.int64],
                 h_wc: NDArray[np.float64], h_share: NDArray[np.float64],
                 dispersion: NDArray[np.float64], rc: float, rm: float, inv_c: float,
                 protect: int, mode: int, new_nodes: bool, tiles: Tiles) -> Any:
    """Validate, sort, gate and count in one call (``gating._fused_gating``); None if invalid.

    Returns:
        ``(sets, weights, positions, sorted_ids, sorted_vals, kept, changed)``, or None when an
        id lies outside [0, E) or a score is not finite (the caller's general path raises).
    """
    if not ids_in_range(ids, num_experts) or not all_finite(vals):
        return None
    sorted_ids, sorted_vals = sort_rows(vals, ids, True)
    width = ids.shape[1]
    loads = np.zeros(num_nodes)
    sets, weights, positions = greedy_kernel(
        sorted_ids, sorted_vals, width, ids, True, vals, k, loads, h_ptr, h_node, h_wc,
        h_share, dispersion, rc, rm, inv_c, protect, mode, new_nodes, False, tiles)
    kept, changed = kept_counts(positions)
    return sets, weights, positions, sorted_ids, sorted_vals, kept, changed


@njit(cache=True)
def kept_counts(positions: NDArray[np.int64]) -> tuple[NDArray[np.float64], int]:
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


@njit(cache=True)
def _fused_sets_run(j: int, ids: NDArray[np.int64], vals: NDArray[np.float64],
                    layers: NDArray[np.int64], num_experts: int, num_nodes: int, k: int,
                    h_ptr: NDArray[np.int64], h_node: NDArray[np.int64],
                    h_wc: NDArray[np.float64], h_share: NDArray[np.float64],
                    dispersion: NDArray[np.float64], rc: NDArray[np.float64],
                    rm: NDArray[np.float64], inv_c: float, protect: int, mode: int,
                    new_nodes: bool, tiled: bool, h_row: NDArray[np.float64],
                    h_stream: NDArray[np.float64], gemm_s: NDArray[np.float64],
                    tile_tokens: NDArray[np.int64], out: NDArray[np.int64],
                    ok: NDArray[np.bool_]) -> None:
    """Run j of ``fused_sets_many``: the sets of ``fused_kernel`` (its validation, sort and
    greedy, without the kept counts) on the run's candidates and layer tables."""
    layer = layers[j]
    if not ids_in_range(ids[j], num_experts) or not all_finite(vals[j]):
        ok[j] = False
        return
    nnz = h_ptr[layer, num_experts]
    tiles = (np.zeros(num_experts, dtype=np.int64), np.zeros(num_nodes), np.zeros(num_nodes),
             h_row[layer, :nnz], h_stream[layer, :nnz], gemm_s[layer], tile_tokens[layer],
             tiled)
    sorted_ids, sorted_vals = sort_rows(vals[j], ids[j], True)
    loads = np.zeros(num_nodes)
    sets, _, _ = greedy_kernel(
        sorted_ids, sorted_vals, ids.shape[2], ids[j], True, vals[j], k, loads, h_ptr[layer],
        h_node[layer, :nnz], h_wc[layer, :nnz], h_share[layer, :nnz], dispersion[layer], rc[j],
        rm[j], inv_c, protect, mode, new_nodes, False, tiles)
    out[j] = sets
    ok[j] = True


@njit(cache=True)
def fused_sets_many(ids: NDArray[np.int64], vals: NDArray[np.float64], layers: NDArray[np.int64],
                    num_experts: int, num_nodes: int, k: int, h_ptr: NDArray[np.int64],
                    h_node: NDArray[np.int64], h_wc: NDArray[np.float64],
                    h_share: NDArray[np.float64], dispersion: NDArray[np.float64],
                    rc: NDArray[np.float64], rm: NDArray[np.float64], inv_c: float,
                    protect: int, mode: int, new_nodes: bool, tiled: bool,
                    h_row: NDArray[np.float64], h_stream: NDArray[np.float64],
                    gemm_s: NDArray[np.float64], tile_tokens: NDArray[np.int64],
                    out: NDArray[np.int64], ok: NDArray[np.bool_]) -> None:
    """``fused_kernel``'s gated sets of n runs (``gating.gated_sets_many``): run j gates
    ``ids[j]`` / ``vals[j]`` [B, W] with the tables of layer ``layers[j]`` (holder CSR rows
    ``h_ptr[l]`` [E + 1] into ``h_node[l]`` / ``h_wc[l]`` / ``h_share[l]``, padded;
    ``dispersion[l]``; tile tables ``h_row[l]`` / ``h_stream[l]``, ``gemm_s[l]``,
    ``tile_tokens[l]`` when ``tiled``) and coefficients ``rc[j]``, ``rm[j]``; writes
    ``out[j]`` [B, k] and ``ok[j]`` (False: invalid ids or scores)."""
    for j in range(layers.shape[0]):
        _fused_sets_run(j, ids, vals, layers, num_experts, num_nodes, k, h_ptr, h_node, h_wc,
                        h_share, dispersion, rc, rm, inv_c, protect, mode, new_nodes, tiled,
                        h_row, h_stream, gemm_s, tile_tokens, out, ok)


@njit(cache=True, parallel=True)
def fused_sets_many_par(ids: NDArray[np.int64], vals: NDArray[np.float64],
                        layers: NDArray[np.int64], num_experts: int, num_nodes: int, k: int,
                        h_ptr: NDArray[np.int64], h_node: NDArray[np.int64],
                        h_wc: NDArray[np.float64], h_share: NDArray[np.float64],
                        dispersion: NDArray[np.float64], rc: NDArray[np.float64],
                        rm: NDArray[np.float64], inv_c: float, protect: int, mode: int,
                        new_nodes: bool, tiled: bool, h_row: NDArray[np.float64],
                        h_stream: NDArray[np.float64], gemm_s: NDArray[np.float64],
                        tile_tokens: NDArray[np.int64], out: NDArray[np.int64],
                        ok: NDArray[np.bool_]) -> None:
    """``fused_sets_many`` with the runs spread over numba's threads (``prange``): run j reads
    shared tables and writes only ``out[j]`` / ``ok[j]``, so the results equal the serial
    kernel's."""
    for j in prange(layers.shape[0]):
        _fused_sets_run(j, ids, vals, layers, num_experts, num_nodes, k, h_ptr, h_node, h_wc,
                        h_share, dispersion, rc, rm, inv_c, protect, mode, new_nodes, tiled,
                        h_row, h_stream, gemm_s, tile_tokens, out, ok)
