"""Node Balance, heuristic mode (paper-model.md §7.6 item 6): local search on the exact objective.

Best-improvement local search: moves transfer a share of one expert between two clusters
(balancing compute, possibly creating a shard) or remove a whole shard (merging it into another
holder, to cut communication). It starts from the repaired EP placement and from a wrap-around
(McNaughton) packing, and ends with a linear program that re-balances the shares on the final
support (:func:`rebalance_shares`; communication depends only on the support).

Tile grid (``NodeBalanceCoefficients.unit``): every start is snapped to whole units
and repaired on the grid, moves transfer whole units (the equalising amount is rounded down and
up), and the re-balancing LP's result is snapped (largest remainder) and repaired on the grid.
[decision] The polished placement is the best, by the exact objective, of the local-search
result and the snapped LP result (repaired when the rounding broke a cap), followed by a second
local-search pass from it when it won; so the heuristic's objective is never worse than the
snapped LP result re-scored.

Speed: each step scores all candidate moves in one compiled scan (O(D) per move, since a move
changes node times and group mass only at its two clusters), with the per-expert gain/loss of
group mass kept in tables refreshed only where a move changed the holder counts; it keeps the
move the original trial-by-trial scan keeps (tested).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
from numba import njit
from numpy.typing import NDArray

from baselines.node_balance.model import (
    OPT_EXTRA,
    NodeBalanceCoefficients,
    is_feasible,
    membership,
    wrap_start,
    exact_objective,
    grid_feasible,
    on_grid,
    repair_placement,
    to_grid,
    tp_start,
)
from hdamoe_env.config.errors import DependencyNotInstalled, InfeasibleError, SolverError

_TOL = 1e-9
_SHARE_EPS = 1e-7  # shares below this are treated as zero (solver noise)


# --------------------------------------------------------------------------------------------
# heuristic (§7.6 item 6)


class _State:
    """Incremental evaluator of the exact objective for the local search."""

    def __init__(self, P: NDArray[np.float64], coeffs: NodeBalanceCoefficients,
                 member: NDArray[np.bool_], group_freqs: NDArray[np.float64]) -> None:
        self.c = coeffs
        self.P = np.array(P, dtype=np.float64, copy=True)
        self.P[self.P < _SHARE_EPS] = 0.0
        self.P /= self.P.sum(axis=1, keepdims=True)
        self.P = to_grid(self.P, coeffs)
        self.fg = np.asarray(group_freqs, dtype=np.float64)
        self.groups_of = [np.flatnonzero(member[:, i]) for i in range(member.shape[1])]
        self.group_ptr = np.zeros(member.shape[1] + 1, dtype=np.int64)
        self.group_ptr[1:] = np.cumsum([g.size for g in self.groups_of])
        self.group_idx = (np.concatenate(self.groups_of).astype(np.int64)
                          if self.groups_of else np.zeros(0, dtype=np.int64))
        self.cnt = (member.astype(np.int32) @ (self.P > 0).astype(np.int32))  # [G, D]
        self.load = coeffs.freqs @ self.P
        self.act = coeffs.active @ self.P
        self.mem = self.P.sum(axis=0)
        self.mass = self.fg @ (self.cnt > 0)
        self.mem_cap = coeffs.mem_cap if coeffs.mem_cap is not None else np.full(
            self.P.shape[1], np.inf)
        self.member = member
        E, D = self.P.shape
        self.gain = np.zeros((E, D))
        self.loss = np.zeros((E, D))
        _gain_loss(np.arange(E, dtype=np.int64), np.arange(D, dtype=np.int64), self.group_ptr,
                   self.group_idx, self.fg, self.cnt, self.gain, self.loss)

    def _refresh(self, i: int, cols: list[int]) -> None:
        """Recompute gain/loss where cnt changed: the experts sharing a group with i, at cols."""
        idx = self.groups_of[i]
        if not cols or idx.size == 0:
            return
        experts = np.flatnonzero(self.member[idx].any(axis=0)).astype(np.int64)
        _gain_loss(experts, np.asarray(cols, dtype=np.int64), self.group_ptr, self.group_idx,
                   self.fg, self.cnt, self.gain, self.loss)

    def node_time(self) -> NDArray[np.float64]:
        return np.maximum(self.c.alpha_us * self.load, self.c.beta_us * self.act)

    def score(self, u: NDArray[np.float64], w: NDArray[np.float64]) -> tuple[float, float]:
        obj = float(u.max() + self.c.comm_factor * w.max())
        ref = max(obj, 1e-12)
        sec = float(((u / ref) ** 8).sum() + ((self.c.comm_factor * w / ref) ** 8).sum())
        return obj, sec

    def current(self) -> tuple[float, float]:
        return self.score(self.node_time(), self.c.kappa_us * self.mass)

    def gain_new(self, i: int, d: int) -> float:
        idx = self.groups_of[i]
        return float(self.fg[idx][self.cnt[idx, d] == 0].sum())

    def loss_remove(self, i: int, c: int) -> float:
        idx = self.groups_of[i]
        return float(self.fg[idx][self.cnt[idx, c] == 1].sum())

    def trial(self, i: int, src: int, dst: int, amount: float
              ) -> tuple[tuple[float, float], NDArray[np.float64], NDArray[np.float64]] | None:
        """Score moving ``amount`` of expert i from src to dst (None if it breaks a cap)."""
        c = self.c
        f, a = c.freqs[i], c.active[i]
        load_d = self.load[dst] + f * amount
        mem_d = self.mem[dst] + amount
        if load_d > c.load_cap + _TOL or mem_d > self.mem_cap[dst] + _TOL:
            return None
        load = self.load.copy()
        act = self.act.copy()
        load[src] -= f * amount
        load[dst] = load_d
        act[src] -= a * amount
        act[dst] += a * amount
        u = np.maximum(c.alpha_us * load, c.beta_us * act)
        mass = self.mass.copy()
        if self.P[i, dst] <= 0:
            mass[dst] += self.gain_new(i, dst)
        if self.P[i, src] - amount <= _SHARE_EPS:
            mass[src] -= self.loss_remove(i, src)
        return self.score(u, c.kappa_us * mass), u, mass

    def apply(self, i: int, src: int, dst: int, amount: float) -> None:
        c = self.c
        full = self.P[i, src] - amount <= _SHARE_EPS
        if full:
            amount = self.P[i, src]
        new = bool(self.P[i, dst] <= 0)
        if new:
            idx = self.groups_of[i]
            self.cnt[idx, dst] += 1
            self.mass[dst] = self.fg @ (self.cnt[:, dst] > 0)
        self.P[i, src] -= amount
        self.P[i, dst] += amount
        if c.unit is not None:                         # keep exact n/U values (no float drift)
            self.P[i] = to_grid(self.P[i], c)
        if full:
            self.P[i, src] = 0.0
            idx = self.groups_of[i]
            self.cnt[idx, src] -= 1
            self.mass[src] = self.fg @ (self.cnt[:, src] > 0)
        self.load = c.freqs @ self.P
        self.act = c.active @ self.P
        self.mem = self.P.sum(axis=0)
        self._refresh(i, ([dst] if new else []) + ([src] if full else []))


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Lexicographic improvement: objective first, then the soft-max tie-breaker."""
    if a[0] < b[0] - 1e-9 * max(1.0, abs(b[0])):
        return True
    return a[0] <= b[0] + 1e-12 * max(1.0, abs(b[0])) and a[1] < b[1] * (1 - 1e-9)


def _candidate_moves(st: _State, u: NDArray[np.float64], w: NDArray[np.float64]
                     ) -> list[tuple[int, int, int, float]]:
    """Moves out of the compute- and the communication-bottleneck clusters.

    The reference enumeration: the search scores the same moves, in the same order, with the
    compiled :func:`_best_move` (tested equal to scoring each with :meth:`_State.trial`).
    """
    c = st.c
    D = st.P.shape[1]
    unit = c.unit
    moves: list[tuple[int, int, int, float]] = []
    order_u = np.argsort(-u)
    order_w = np.argsort(-w)
    sources = {int(order_u[0]), int(order_w[0])}
    if D > 1:
        sources.add(int(order_u[1]))
    for src in sources:
        held = np.flatnonzero(st.P[:, src] > 0)
        for i in held:
            share = st.P[i, src]
            f, a = c.freqs[i], c.active[i]
            rate = max(c.alpha_us * f, c.beta_us * a, 1e-12)
            for dst in range(D):
                if dst == src:
                    continue
                moves.append((int(i), src, dst, float(share)))          # move the whole shard
                eq = (u[src] - u[dst]) / (2 * rate)                       # equalise node times
                if unit is None:
                    if 1e-6 < eq < share - 1e-6:
                        moves.append((int(i), src, dst, float(eq)))
                    continue
                if eq <= 1e-6:
                    continue
                lo = math.floor(eq / unit + 1e-9)                         # whole units only
                for n in sorted({max(lo, 1), lo + 1}):
                    if n * unit < share - 1e-9:
                        moves.append((int(i), src, dst, n * unit))
    return moves


def _move_arrays(st: _State, u: NDArray[np.float64]
                 ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64],
                            NDArray[np.float64]]:
    """The moves of :func:`_candidate_moves` as arrays (expert, src, dst, amount), same order."""
    c = st.c
    D = st.P.shape[1]
    unit = c.unit
    order_u = np.argsort(-u)
    order_w = np.argsort(-(c.kappa_us * st.mass))
    sources = {int(order_u[0]), int(order_w[0])}
    if D > 1:
        sources.add(int(order_u[1]))
    parts: list[tuple[NDArray[np.int64], ...]] = []
    for src in sources:
        held = np.flatnonzero(st.P[:, src] > 0)
        dst = np.array([d for d in range(D) if d != src], dtype=np.int64)
        if held.size == 0 or dst.size == 0:
            continue
        share = st.P[held, src]
        rate = np.maximum(np.maximum(c.alpha_us * c.freqs[held], c.beta_us * c.active[held]),
                          1e-12)
        eq = (u[src] - u[dst])[None, :] / (2 * rate[:, None])          # [H, D-1]
        H, K = held.size, dst.size
        amt = np.zeros((H, K, 3))
        ok = np.zeros((H, K, 3), dtype=bool)
        amt[:, :, 0] = share[:, None]                                    # the whole shard
        ok[:, :, 0] = True
        if unit is None:
            amt[:, :, 1] = eq
            ok[:, :, 1] = (eq > 1e-6) & (eq < share[:, None] - 1e-6)
        else:
            lo = np.floor(eq / unit + 1e-9)
            pos = eq > 1e-6
            n1 = np.maximum(lo, 1.0)                                     # sorted({max(lo,1), lo+1})
            n2 = lo + 1.0
            amt[:, :, 1] = n1 * unit
            amt[:, :, 2] = n2 * unit
            ok[:, :, 1] = pos & (n1 * unit < share[:, None] - 1e-9)
            ok[:, :, 2] = pos & (n2 != n1) & (n2 * unit < share[:, None] - 1e-9)
        ii = np.broadcast_to(held[:, None, None], ok.shape)[ok]
        dd = np.broadcast_to(dst[None, :, None], ok.shape)[ok]
        parts.append((ii, np.full(ii.size, src, dtype=np.int64), dd, amt[ok]))
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, np.zeros(0)
    return tuple(np.concatenate(x) for x in zip(*parts))  # type: ignore[return-value]


@njit(cache=True)
def _gain_loss(experts: NDArray[np.int64], cols: NDArray[np.int64], ptr: NDArray[np.int64],
               gidx: NDArray[np.int64], fg: NDArray[np.float64], cnt: NDArray[np.int32],
               gain: NDArray[np.float64], loss: NDArray[np.float64]) -> None:
    """Recompute ``gain``/``loss`` [E, D] at ``experts`` × ``cols`` in place.

    gain[i, d]: the group mass cluster d gains by becoming a holder of expert i (groups of i
    it touches no expert of yet); loss[i, d]: what it loses when its last holder of a group
    of i goes (groups of i it touches exactly once).
    """
    for i in experts:
        for d in cols:
            g_sum = 0.0
            l_sum = 0.0
            for q in range(ptr[i], ptr[i + 1]):
                n = cnt[gidx[q], d]
                if n == 0:
                    g_sum += fg[gidx[q]]
                elif n == 1:
                    l_sum += fg[gidx[q]]
            gain[i, d] = g_sum
            loss[i, d] = l_sum


@njit(cache=True)
def _scan_moves(ii: NDArray[np.int64], src: NDArray[np.int64], dst: NDArray[np.int64],
                amt: NDArray[np.float64], p_src: NDArray[np.float64],
                p_dst: NDArray[np.float64], gain_dst: NDArray[np.float64],
                loss_src: NDArray[np.float64], load: NDArray[np.float64],
                act: NDArray[np.float64], mass: NDArray[np.float64], mem: NDArray[np.float64],
                mem_cap: NDArray[np.float64], freqs: NDArray[np.float64],
                active: NDArray[np.float64], alpha: float, beta: float, kappa: float,
                cf: float, load_cap: float, obj0: float, sec0: float) -> int:
    """Index of the move a first-to-last scan with :func:`_better` keeps, or -1.

    Each move is scored as :meth:`_State.trial` does: the node times and the group mass
    change only at its source and destination, so a move costs O(D) without copies.
    """
    D = load.shape[0]
    best_obj, best_sec = obj0, sec0
    best = -1
    u = np.empty(D)
    w = np.empty(D)
    for m in range(ii.size):
        i, s, t, x = ii[m], src[m], dst[m], amt[m]
        f = freqs[i]
        a = active[i]
        load_d = load[t] + f * x
        if load_d > load_cap + _TOL or mem[t] + x > mem_cap[t] + _TOL:
            continue
        umax = -np.inf
        wmax = -np.inf
        for d in range(D):
            if d == s:
                ud = max(alpha * (load[d] - f * x), beta * (act[d] - a * x))
                md = mass[d] - loss_src[m] if p_src[m] - x <= _SHARE_EPS else mass[d]
            elif d == t:
                ud = max(alpha * load_d, beta * (act[d] + a * x))
                md = mass[d] + gain_dst[m] if p_dst[m] <= 0 else mass[d]
            else:
                ud = max(alpha * load[d], beta * act[d])
                md = mass[d]
            u[d] = ud
            w[d] = cf * (kappa * md)
            umax = max(umax, ud)
            wmax = max(wmax, w[d])
        obj = umax + wmax
        tol = max(1.0, abs(best_obj))
        lower = obj < best_obj - 1e-9 * tol              # _better: objective first,
        if not lower and obj > best_obj + 1e-12 * tol:   # then the tie-breaker on a tie
            continue
        ref = max(obj, 1e-12)
        sec = 0.0
        for d in range(D):
            sec += (u[d] / ref) ** 8
        for d in range(D):
            sec += (w[d] / ref) ** 8
        if lower or sec < best_sec * (1 - 1e-9):
            best_obj, best_sec, best = obj, sec, m
    return best


def _best_move(st: _State, u: NDArray[np.float64], score: tuple[float, float]
               ) -> tuple[int, int, int, float] | None:
    """The improving move chosen by a first-to-last scan with :func:`_better`, or None.

    Equivalent to scoring every move of :func:`_candidate_moves` with :meth:`_State.trial`
    in order and keeping a move when it is :func:`_better` than the best so far (compiled;
    the tie-breaker sums in another order than numpy, which only matters in exact ties).
    """
    ii, src, dst, amt = _move_arrays(st, u)
    if ii.size == 0:
        return None
    c = st.c
    m = _scan_moves(ii, src, dst, amt, st.P[ii, src], st.P[ii, dst], st.gain[ii, dst],
                    st.loss[ii, src], st.load, st.act, st.mass, st.mem,
                    np.asarray(st.mem_cap, dtype=np.float64), c.freqs, c.active,
                    float(c.alpha_us), float(c.beta_us), float(c.kappa_us),
                    float(c.comm_factor), float(c.load_cap), float(score[0]), float(score[1]))
    if m < 0:
        return None
    return int(ii[m]), int(src[m]), int(dst[m]), float(amt[m])


def heuristic_placement(freqs: NDArray[np.float64], groups: NDArray[np.int64],
                        group_freqs: NDArray[np.float64], coeffs: NodeBalanceCoefficients, *,
                        starts: dict[str, NDArray[np.float64]] | None = None,
                        time_budget_s: float | None = None, max_moves: int = 2000,
                        polish: bool = True) -> tuple[NDArray[np.float64], dict[str, Any]]:
    """Run the Node-Balance heuristic (§7.6 item 6) on the exact objective.

    Best-improvement local search from every start (default: the wrap-around packing; callers
    add the repaired EP placement); moves transfer a
    share of one expert from a bottleneck cluster (compute or communication) to another cluster
    (equalising their node times, or moving the whole shard). Every move is scored exactly
    (Eq. 1 + γ·Eq. 2 over all groups) and must keep caps (10) and (11).

    Args:
        freqs: float [E] f_i (must equal ``coeffs.freqs``).
        groups: int [G, k] all groups of the layer.
        group_freqs: float [G] their frequencies.
        coeffs: Coefficients of the layer.
        starts: Named feasible start placements [E, D] (the wrap start is always added).
        time_budget_s: Optional wall-clock safety limit over all starts (each start gets an
            equal share). None (default) keeps the search deterministic: it stops when no move
            improves or after ``max_moves``; a binding time limit makes the result depend on
            machine speed and is flagged in the record.
        max_moves: Move budget per start.
        polish: Re-balance the shares on the final support with an LP (needs scipy; skipped
            when scipy is missing).

    Returns:
        ``(P, info)`` with the best placement found and a record (start used, moves, objective).
    """
    t0 = time.perf_counter()
    member = membership(groups, coeffs.freqs.size)
    fg = np.asarray(group_freqs, dtype=np.float64)
    all_starts: dict[str, NDArray[np.float64]] = {}
    wrap = wrap_start(coeffs, member, fg)
    if is_feasible(wrap, coeffs):
        all_starts["wrap"] = wrap
    else:
        try:
            all_starts["wrap"] = repair_placement(wrap, coeffs)
        except InfeasibleError:
            pass
    for name, start in (starts or {}).items():
        all_starts[name] = np.asarray(start, dtype=np.float64)
    if not all_starts:
        all_starts["tp"] = tp_start(coeffs.freqs.size, coeffs.num_nodes)
    if coeffs.unit is not None:                       # moves keep the grid: start on it
        for name in list(all_starts):
            if on_grid(all_starts[name], coeffs):
                continue
            try:
                all_starts[name] = grid_feasible(all_starts[name], coeffs)
            except InfeasibleError:
                del all_starts[name]
        if not all_starts:
            raise InfeasibleError(f"no start of the Node-Balance heuristic can be put on the tile"
                                  f" grid (unit 1/{coeffs.units}) within the caps; use a finer "
                                  "tile (Conventions.tile_cols)")
    best_P: NDArray[np.float64] | None = None
    best_score = (math.inf, math.inf)
    per_start: dict[str, dict[str, Any]] = {}
    share = math.inf if time_budget_s is None else time_budget_s / len(all_starts)
    timed_out = False
    for k, (name, start) in enumerate(all_starts.items()):
        deadline = t0 + share * (k + 1)
        P, first, moves, hit = _local_search(start, coeffs, member, fg, max_moves, deadline)
        timed_out |= hit
        if polish:
            polished = _polish(P, coeffs, groups, fg)
            if coeffs.unit is not None and polished is not P and moves < max_moves:
                # the snapped LP point won: continue the whole-unit search from it
                polished, _, more, hit = _local_search(polished, coeffs, member, fg,
                                                       max_moves - moves, deadline)
                moves += more
                timed_out |= hit
            P = polished
        final = exact_objective(P, coeffs, groups, fg)["objective_us"]
        per_start[name] = {"start_objective_us": first, "objective_us": final, "moves": moves}
        if final < best_score[0]:
            best_score = (final, 0.0)
            best_P = P
    assert best_P is not None
    best_name = min(per_start, key=lambda n: per_start[n]["objective_us"])
    info = {"starts": per_start, "best_start": best_name, "time_limit_hit": timed_out,
            "objective_us": best_score[0], "wall_s": time.perf_counter() - t0}
    return best_P, info


def _local_search(start: NDArray[np.float64], coeffs: NodeBalanceCoefficients,
                  member: NDArray[np.bool_], fg: NDArray[np.float64], max_moves: int,
                  deadline: float) -> tuple[NDArray[np.float64], float, int, bool]:
    """Best-improvement search from ``start``; return (P, start objective, moves, timed out)."""
    st = _State(start, coeffs, member, fg)
    score = st.current()
    first = score[0]
    moves = 0
    timed_out = False
    while moves < max_moves:
        best_move = _best_move(st, st.node_time(), score)
        if best_move is None:
            break
        if time.perf_counter() >= deadline:
            timed_out = True
            break
        st.apply(*best_move)
        score = st.current()
        moves += 1
    return st.P, first, moves, timed_out


def _polish(P: NDArray[np.float64], coeffs: NodeBalanceCoefficients, groups: NDArray[np.int64],
            group_freqs: NDArray[np.float64]) -> NDArray[np.float64]:
    """Re-balance shares on the support of P by LP; keep the result only if it is better.

    On the tile grid the LP result is snapped (largest remainder) and, if the rounding broke a
    cap, repaired on the grid; it is kept only if its exact objective beats ``P``'s.
    """
    try:
        better = rebalance_shares(P > 0, coeffs)
        better = grid_feasible(better, coeffs)
    except (DependencyNotInstalled, SolverError, InfeasibleError):
        return P
    old = exact_objective(P, coeffs, groups, group_freqs)["objective_us"]
    new = exact_objective(better, coeffs, groups, group_freqs)["objective_us"]
    return better if new < old - 1e-9 else P


def rebalance_shares(support: NDArray[np.bool_], coeffs: NodeBalanceCoefficients
                     ) -> NDArray[np.float64]:
    """Return the shares on a fixed support that minimise the max node time (an LP).

    Communication (Eq. 2) depends only on the support, so for a fixed support the optimal
    shares minimise t = max_c max(α·Σ_i f_i P_ic, β·Σ_i a_i P_ic) subject to (5), (10), (11).

    Args:
        support: bool [E, D] allowed holders (every row non-empty).
        coeffs: The coefficients.

    Returns:
        float [E, D] shares, zero outside the support.

    Raises:
        DependencyNotInstalled: scipy is missing.
        InfeasibleError: The caps cannot be met on this support.
    """
    try:
        from scipy.optimize import linprog
        from scipy.sparse import coo_matrix
    except ImportError as exc:
        raise DependencyNotInstalled(f"scipy is missing; run `{OPT_EXTRA}`") from exc
    sup = np.asarray(support, dtype=bool)
    E, D = sup.shape
    ii, cc = np.nonzero(sup)
    n = ii.size
    t_col = n
    f, a = coeffs.freqs, coeffs.active
    rows, cols, vals, ub = [], [], [], []
    r = 0
    # α·Σ f_i P_ic − t ≤ 0 ; β·Σ a_i P_ic − t ≤ 0 ; Σ f_i P_ic ≤ cap ; Σ P_ic ≤ mem_cap
    for node in range(D):
        sel = np.flatnonzero(cc == node)
        for coef, bound, with_t in ((coeffs.alpha_us * f, 0.0, True),
                                    (coeffs.beta_us * a, 0.0, True),
                                    (f, coeffs.load_cap, False)):
            if with_t and not np.any(coef):
                continue
            rows.extend([r] * sel.size)
            cols.extend(sel.tolist())
            vals.extend(coef[ii[sel]].tolist())
            if with_t:
                rows.append(r)
                cols.append(t_col)
                vals.append(-1.0)
            ub.append(bound)
            r += 1
        if coeffs.mem_cap is not None:
            rows.extend([r] * sel.size)
            cols.extend(sel.tolist())
            vals.extend([1.0] * sel.size)
            ub.append(float(coeffs.mem_cap[node]))
            r += 1
    A_ub = coo_matrix((vals, (rows, cols)), shape=(r, n + 1)).tocsr()
    A_eq = coo_matrix((np.ones(n), (ii, np.arange(n))), shape=(E, n + 1)).tocsr()
    cost = np.zeros(n + 1)
    cost[t_col] = 1.0
    res = linprog(cost, A_ub=A_ub, b_ub=np.array(ub), A_eq=A_eq, b_eq=np.ones(E),
                  bounds=[(0, 1)] * n + [(0, None)], method="highs")
    if res.status == 2:
        raise InfeasibleError("the caps cannot be met on this support")
    if res.status != 0:
        raise SolverError(f"share LP failed: {res.message}")
    P = np.zeros((E, D))
    P[ii, cc] = res.x[:n]
    P[P < _SHARE_EPS] = 0.0
    return P / P.sum(axis=1, keepdims=True)


