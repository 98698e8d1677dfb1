"""Node Balance, the problem (paper-model.md §7.2–7.6): coefficients, exact objective, starts.

The constants of one layer's Node-Balance problem (µs, §7.3–7.4), the exact objective (Eq. 1 +
γ·Eq. 2 over all groups) every candidate is re-scored with, group compression (§7.6 item 2), and
the feasible starting points (TP, repaired EP, the wrap-around packing) shared by the MILP
(:mod:`baselines.node_balance.milp`) and the heuristic (:mod:`baselines.node_balance.heuristic`).

Shard granularity (``Conventions.tile_cols``): with ``tile_cols`` > 1 every share is a
whole number of tile units u = tile_cols / I (``NodeBalanceCoefficients.unit``; helpers
:func:`on_grid`, :func:`grid_feasible`). The repaired and wrap-around starts are on the grid;
the exact TP start (P = 1/D) is the documented exception (``hdamoe_env.sim.placement
.check_tile_grid``). ``tile_cols`` = 1 (``paper*``) keeps the continuous model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.cost import perf
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled, InfeasibleError
from hdamoe_env.sim.placement import share_unit, snap_shares
from hdamoe_env.config.profiles import Conventions
from hdamoe_env.config.specs import HardwareSpec, ModelSpec

COMPRESSION_MODES = ("residual", "renormalise", "none")
#: How to install the optional solvers (the message of ``DependencyNotInstalled``).
OPT_EXTRA = 'pip install "hdamoe-env[opt]"'
_TOL = 1e-9
SHARE_EPS = 1e-7  # shares below this are treated as zero (solver noise)


# --------------------------------------------------------------------------------------------
# coefficients and the exact objective


@dataclass(frozen=True)
class NodeBalanceCoefficients:
    """Constants of one layer's Node-Balance problem, in µs (paper-model.md §7.3–7.4).

    Attributes:
        freqs: float [E] activation frequencies f_i (Σ = k).
        active: float [E] expected activity a_i = 1 − (1 − f_i)^B.
        alpha_us: µs per unit of node load Σ_i f_i P_ic (B·F_e/C), Eq. 1.
        beta_us: µs per unit of Σ_i a_i P_ic (W_e/BW_mem); 0 without weight streaming.
        kappa_us: µs per unit of touch mass Σ_g f_g·1[g touches c] (kappa_a·γ·B·h/BW_end).
        comm_factor: Weight of t_comm in the objective (``nb_comm_factor``: 2 paper*, 1 faithful).
        load_cap: Cap (11) on Σ_i f_i P_ic.
        mem_cap: float [D] cap (10) on Σ_i P_ic (experts per node), or None.
        mem_cap_source: What set ``mem_cap``: ``"rho_mem"``, ``"node_dram_bytes"``, ``"both"``.
        num_nodes: D.
        gamma: γ of the layer.
        group_constraint: ``"per_expert"`` or ``"aggregated"`` form of (6).
        unit: Share unit u = 1/U of the tile grid (every share a multiple), or None for
            continuous shares (``tile_cols`` = 1).
    """

    freqs: NDArray[np.float64]
    active: NDArray[np.float64]
    alpha_us: float
    beta_us: float
    kappa_us: float
    comm_factor: float
    load_cap: float
    mem_cap: NDArray[np.float64] | None
    mem_cap_source: str | None
    num_nodes: int
    gamma: float
    group_constraint: str
    unit: float | None = None

    @property
    def units(self) -> int | None:
        """U = 1/u, the number of tile units of one expert (None when continuous)."""
        return None if self.unit is None else round(1.0 / self.unit)

    def to_dict(self) -> dict[str, Any]:
        """Return the scalar constants as a JSON-serialisable dict."""
        return {"alpha_us": self.alpha_us, "beta_us": self.beta_us, "kappa_us": self.kappa_us,
                "comm_factor": self.comm_factor, "load_cap": self.load_cap,
                "mem_cap": None if self.mem_cap is None else self.mem_cap.tolist(),
                "mem_cap_source": self.mem_cap_source, "gamma": self.gamma,
                "group_constraint": self.group_constraint, "share_unit": self.unit}


def nb_coefficients(freqs: NDArray[np.float64], *, model: ModelSpec, hw: HardwareSpec,
                    conv: Conventions, gamma: float, batch: int, bw_end_Bps: float,
                    rho_mem: float | None = None,
                    node_dram_bytes: float | NDArray[np.float64] | None = None,
                    num_nodes: int | None = None,
                    tp_comm_s: float | None = None) -> NodeBalanceCoefficients:
    """Compute the constants of one layer's Node-Balance problem and check the caps.

    Args:
        freqs: float [E] activation frequencies f_i.
        model: The model (h, I, k, E).
        hw: The hardware (C, BW_mem, D).
        conv: The conventions (m, b_w, kappa_a, streaming, nb_comm_factor, constraint (6) form).
        gamma: Calibration slope γ of the layer (≥ 0).
        batch: Batch size B of the offline optimisation (128).
        bw_end_Bps: Endpoint-side bandwidth BW_end of the topology.
        rho_mem: Relative memory cap ρ_mem of (10), or None.
        node_dram_bytes: Absolute per-node byte budget of this layer's routed-expert weights
            (scalar or float [D]), or None ([decision] variant of (10)).
        num_nodes: D, default ``hw.num_nodes``.
        tp_comm_s: TP's communication time per layer as the evaluator charges it (the
            collective ``MoESimulator.tp_allreduce`` picks), or None: the closed form of
            ``perf.tp_ratio_cap`` (the ring in ``faithful``, the analytic estimate in
            ``paper*``). Sets R_cc = t_comp_TP / tp_comm_s of the TP-ratio cap (11).

    Returns:
        The coefficients.

    Raises:
        ConfigError: Shapes or values are invalid.
        InfeasibleError: The caps cannot be met by any placement (names the numbers).
    """
    f = np.asarray(freqs, dtype=np.float64)
    E = model.num_experts
    if f.shape != (E,):
        raise ConfigError(f"freqs must have shape [E={E}], got {f.shape}")
    if (f < 0).any() or not np.isfinite(f).all():
        raise ConfigError("freqs must be finite and >= 0")
    if not (gamma >= 0 and math.isfinite(gamma)):
        raise ConfigError(f"gamma must be a finite number >= 0, got {gamma}")
    D = hw.num_nodes if num_nodes is None else int(num_nodes)
    B = float(batch)
    active = perf.expected_active(f, B)
    alpha = B * perf.expert_flops(model, conv) / hw.compute_flops * 1e6
    beta = (perf.expert_bytes(model, conv) / perf.effective_mem_bw(hw, conv) * 1e6
            if conv.weight_streaming else 0.0)
    kappa = conv.kappa_a * gamma * B * model.hidden_size / bw_end_Bps * 1e6
    if tp_comm_s is None:
        cap = float(perf.tp_ratio_cap(model, hw, conv, D, B, bw_end_Bps))
    else:
        if not (tp_comm_s > 0 and math.isfinite(tp_comm_s)):
            raise ConfigError(f"tp_comm_s must be a positive number of seconds, got {tp_comm_s}")
        t_comp = float(perf.tp_expert_compute_time(model, hw, conv, B, num_nodes=D))
        cap = model.top_k / D * (1.0 + float(tp_comm_s) / t_comp)
    if D * cap < f.sum() - 1e-9:
        raise InfeasibleError(f"TP-ratio cap {cap:.4f} per node × D={D} nodes = {D * cap:.4f} "
                              f"< Σ f_i = {f.sum():.4f}; no placement meets constraint (11)")
    mem_cap: NDArray[np.float64] | None = None
    source: str | None = None
    if rho_mem is not None:
        if not (rho_mem > 0 and math.isfinite(rho_mem)):
            raise ConfigError(f"rho_mem must be a positive number or None, got {rho_mem}")
        per_node = rho_mem * E / D
        if per_node * D < E - 1e-9:
            raise InfeasibleError(
                f"rho_mem={rho_mem} allows {per_node:.3f} experts per node (= rho_mem·E/D) and "
                f"{per_node * D:.2f} over D={D} nodes, fewer than the E={E} experts to place; "
                "rho_mem must be >= 1")
        mem_cap = np.full(D, per_node)
        source = "rho_mem"
    if node_dram_bytes is not None:
        budget = np.broadcast_to(np.asarray(node_dram_bytes, dtype=np.float64), (D,)).copy()
        w_e = perf.expert_bytes(model, conv)
        experts = budget / w_e
        if (budget < 0).any():
            raise InfeasibleError(f"node_dram_bytes is negative on node "
                                  f"{int(np.argmin(budget))} ({budget.min():.3g} B): the reserved "
                                  "bytes exceed the DRAM capacity")
        if experts.sum() < E - 1e-9:
            raise InfeasibleError(
                f"node DRAM budgets sum to {budget.sum() / 2**30:.3f} GiB for this layer but its "
                f"E={E} routed experts need {E * w_e / 2**30:.3f} GiB (W_e = {w_e / 2**20:.2f} "
                "MiB each); raise node_dram_gib or reduce reserved bytes")
        mem_cap = experts if mem_cap is None else np.minimum(mem_cap, experts)
        source = "node_dram_bytes" if source is None else "both"
    return NodeBalanceCoefficients(
        freqs=f, active=np.asarray(active, dtype=np.float64), alpha_us=float(alpha),
        beta_us=float(beta), kappa_us=float(kappa), comm_factor=float(conv.nb_comm_factor),
        load_cap=cap, mem_cap=mem_cap, mem_cap_source=source, num_nodes=D, gamma=float(gamma),
        group_constraint=conv.nb_group_constraint,
        unit=None if conv.tile_cols == 1 else share_unit(model, conv))


def membership(groups: NDArray[np.int64], num_experts: int) -> NDArray[np.bool_]:
    """Return bool [G, E]: expert i belongs to group g (−1 entries are padding)."""
    g = np.asarray(groups, dtype=np.int64)
    if g.ndim != 2:
        raise ConfigError(f"groups must have shape [G, k], got {g.shape}")
    if g.size and g.max() >= num_experts:
        raise ConfigError(f"groups name expert {int(g.max())} but E={num_experts}")
    member = np.zeros((g.shape[0], num_experts), dtype=bool)
    rows, cols = np.nonzero(g >= 0)
    member[rows, g[rows, cols]] = True
    return member


def exact_objective(P: NDArray[np.float64], coeffs: NodeBalanceCoefficients,
                    groups: NDArray[np.int64], group_freqs: NDArray[np.float64]
                    ) -> dict[str, float]:
    """Score shares with the exact Node-Balance objective (Eq. 1 + γ·Eq. 2, all groups).

    Args:
        P: float [E, D] shares.
        coeffs: The layer's coefficients.
        groups: int [G, k] all co-activation groups of the layer (uncompressed).
        group_freqs: float [G] their frequencies.

    Returns:
        ``objective_us``, ``t_comp_us`` (max node time), ``t_comm_us`` (γ-scaled Eq. 2, before
        the objective factor), ``max_load`` (Σ_i f_i P_ic), ``max_experts`` (Σ_i P_ic).
    """
    P = np.asarray(P, dtype=np.float64)
    member = membership(groups, P.shape[0]).astype(np.float64)
    touch = (member @ (P > SHARE_EPS).astype(np.float64)) > 0         # [G, D]
    mass = np.asarray(group_freqs, dtype=np.float64) @ touch
    load = coeffs.freqs @ P
    node = np.maximum(coeffs.alpha_us * load, coeffs.beta_us * (coeffs.active @ P))
    t_comp = float(node.max())
    t_comm = float(coeffs.kappa_us * mass.max(initial=0.0))
    return {"objective_us": t_comp + coeffs.comm_factor * t_comm, "t_comp_us": t_comp,
            "t_comm_us": t_comm, "max_load": float(load.max()),
            "max_experts": float(P.sum(axis=0).max())}


def on_grid(P: NDArray[np.float64], coeffs: NodeBalanceCoefficients) -> bool:
    """Whether every share is a whole number of units (always True for continuous shares).

    Strict: unlike ``check_tile_grid`` this does not exempt uniform TP rows.
    """
    if coeffs.unit is None:
        return True
    x = np.asarray(P, dtype=np.float64) * coeffs.units
    return bool(np.all(np.abs(x - np.rint(x)) <= 1e-9))


def to_grid(P: NDArray[np.float64], coeffs: NodeBalanceCoefficients) -> NDArray[np.float64]:
    """Return ``P`` with every share set to the exact float n/U of its nearest unit count."""
    if coeffs.unit is None:
        return P
    return np.rint(np.asarray(P, dtype=np.float64) * coeffs.units) / coeffs.units


def grid_feasible(P: NDArray[np.float64], coeffs: NodeBalanceCoefficients
                  ) -> NDArray[np.float64]:
    """Snap ``P`` to the tile grid (largest remainder) and repair the caps on the grid.

    Continuous shares (``coeffs.unit`` None) are returned unchanged.

    Raises:
        InfeasibleError: No on-grid repair meets the caps.
    """
    if coeffs.unit is None:
        return P
    snapped = snap_shares(P, coeffs.unit)
    return snapped if is_feasible(snapped, coeffs) else repair_placement(snapped, coeffs)


def is_feasible(P: NDArray[np.float64], coeffs: NodeBalanceCoefficients, tol: float = 1e-7
                ) -> bool:
    """Return whether shares P [E, D] are rows summing to 1 within the caps (10), (11) and DRAM."""
    if np.abs(P.sum(axis=1) - 1).max() > 1e-6 or (P < -1e-12).any():
        return False
    if (coeffs.freqs @ P > coeffs.load_cap + tol).any():
        return False
    return not (coeffs.mem_cap is not None and (P.sum(axis=0) > coeffs.mem_cap + tol).any())


# --------------------------------------------------------------------------------------------
# group compression (§7.6 item 2)


@dataclass(frozen=True)
class CompressedGroups:
    """Groups kept exactly in the MILP and the account of the dropped ones.

    Attributes:
        groups: int [N, k] kept groups (the most frequent).
        freqs: float [N] their frequencies (renormalised to Σ = 1 in ``renormalise`` mode).
        phi: float [E] residual φ_i = Σ_{dropped g ∋ i} f_g (zeros unless ``residual``).
        kept_mass: Frequency mass of the kept groups before renormalisation.
        num_total: Number of groups before compression.
        mode: ``"residual"``, ``"renormalise"`` or ``"none"``.
    """

    groups: NDArray[np.int64]
    freqs: NDArray[np.float64]
    phi: NDArray[np.float64]
    kept_mass: float
    num_total: int
    mode: str

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable summary."""
        return {"mode": self.mode, "kept": int(self.groups.shape[0]), "total": self.num_total,
                "kept_mass": self.kept_mass, "residual_mass": float(self.phi.sum())}


def compress_groups(groups: NDArray[np.int64], group_freqs: NDArray[np.float64],
                    num_experts: int, *, mass: float = 0.9, max_groups: int = 400,
                    mode: str = "residual", compress_above: int = 100) -> CompressedGroups:
    """Keep the smallest set of most frequent groups covering ``mass`` (at most ``max_groups``).

    Args:
        groups: int [G, k] co-activation groups.
        group_freqs: float [G] frequencies (Σ = 1).
        num_experts: E.
        mass: Frequency mass to cover with kept groups (0.9 = 90 %).
        max_groups: Upper limit on kept groups.
        mode: ``residual`` (default: dropped groups enter (8) through φ_i·Z_ic), ``renormalise``
            (scale kept f_g to Σ = 1) or ``none`` (keep everything).
        compress_above: Keep every group when there are at most this many ([decision]: the
            exact model is cheap for Mixtral-sized problems, §7.6 item 6).

    Returns:
        The compressed groups.

    Raises:
        ConfigError: Unknown mode or invalid limits.
    """
    if mode not in COMPRESSION_MODES:
        raise ConfigError(f"unknown group compression {mode!r}; expected one of "
                          f"{list(COMPRESSION_MODES)} (plain truncation is not offered: it makes "
                          "communication look free, paper-model.md §7.6)")
    g = np.asarray(groups, dtype=np.int64)
    f = np.asarray(group_freqs, dtype=np.float64)
    if f.shape != (g.shape[0],):
        raise ConfigError(f"group_freqs must have shape [G={g.shape[0]}], got {f.shape}")
    total = int(g.shape[0])
    if mode == "none" or total <= compress_above:
        return CompressedGroups(g, f, np.zeros(num_experts), float(f.sum()), total, "none")
    if not 0 < mass <= 1 or max_groups < 1:
        raise ConfigError(f"group_mass must be in (0, 1] and max_groups >= 1, got {mass}, "
                          f"{max_groups}")
    order = np.argsort(-f, kind="stable")
    cum = np.cumsum(f[order])
    need = int(np.searchsorted(cum, mass * f.sum() - 1e-12) + 1)
    n = min(need, max_groups, total)
    keep, drop = order[:n], order[n:]
    kept_mass = float(f[keep].sum())
    phi = np.zeros(num_experts)
    if mode == "residual" and drop.size:
        member = membership(g[drop], num_experts)
        phi = f[drop] @ member
        freqs = f[keep]
    elif mode == "renormalise":
        freqs = f[keep] / kept_mass
    else:
        freqs = f[keep]
    return CompressedGroups(g[keep], freqs, phi, kept_mass, total, mode)


# --------------------------------------------------------------------------------------------
# starts: TP, repaired EP, wrap-around packing


def tp_start(num_experts: int, num_nodes: int) -> NDArray[np.float64]:
    """Return TP shares P = 1/D, shape [E, D] (§7.6 item 1: always feasible when caps are)."""
    return np.full((num_experts, num_nodes), 1.0 / num_nodes)


def node_times(P: NDArray[np.float64], c: NodeBalanceCoefficients) -> NDArray[np.float64]:
    """Return the per-node time [D], µs: max(α·Σ_i f_i·P_ic, β·Σ_i a_i·P_ic) (§7.6)."""
    return np.maximum(c.alpha_us * (c.freqs @ P), c.beta_us * (c.active @ P))


def repair_placement(P: NDArray[np.float64], coeffs: NodeBalanceCoefficients
                     ) -> NDArray[np.float64]:
    """Split shares of over-capacity clusters until caps (10) and (11) hold (§7.6 item 1).

    Repeatedly moves the excess of the most overloaded cluster — first the hottest expert's share
    for the load cap (11), the largest share for the memory cap (10) — to the clusters with the
    most headroom (creating shards). Used to repair an EP start. On the tile grid
    (``coeffs.unit``) the input is snapped first, the excess is rounded up and the headroom down
    to whole units, and the LP fallback's result is snapped and re-checked; when that still
    fails, an integer program in whole units finds the on-grid repair (:func:`_grid_repair`):
    the greedy moves only into free headroom and snapping the LP point breaks exactly full
    memory caps, so without it a tight cap (ρ_mem = 1: every node exactly full) or a coarse
    unit whose only fixes are swaps would look unrepairable although it is not.

    Args:
        P: float [E, D] shares (rows sum to 1).
        coeffs: The coefficients (caps).

    Returns:
        A feasible copy of ``P``.

    Raises:
        InfeasibleError: The caps leave no headroom to move the excess to.
    """
    P0 = np.array(P, dtype=np.float64, copy=True)
    if coeffs.unit is not None:
        P0 = snap_shares(P0, coeffs.unit)
    fixed = _greedy_repair(P0, coeffs)
    if fixed is not None:
        return fixed
    lp = _lp_repair(P0, coeffs)
    if coeffs.unit is None:
        return lp
    # on the grid: snap the LP point and repair its rounding greedily
    fixed = _greedy_repair(snap_shares(lp, coeffs.unit), coeffs)
    if fixed is None:  # swaps and exactly full caps: solve for whole units directly
        fixed = _grid_repair(P0, coeffs)
    if fixed is None:
        raise InfeasibleError(f"cannot repair the start on the tile grid (unit 1/{coeffs.units}):"
                              f" no on-grid placement found that meets the load cap "
                              f"{coeffs.load_cap:.4f} and the memory caps; use a finer tile "
                              "(Conventions.tile_cols) or relax rho_mem")
    return fixed


def _greedy_repair(P0: NDArray[np.float64], coeffs: NodeBalanceCoefficients
                   ) -> NDArray[np.float64] | None:
    """Move excess shares to the clusters with most headroom; None when that gets stuck."""
    unit = coeffs.unit
    P = P0.copy()
    f = coeffs.freqs
    D = P.shape[1]
    mem_cap = coeffs.mem_cap if coeffs.mem_cap is not None else np.full(D, np.inf)
    for _ in range(10 * P.size):
        load = f @ P
        mem = P.sum(axis=0)
        over_load = load - coeffs.load_cap
        over_mem = mem - mem_cap
        if over_load.max() <= 1e-12 and over_mem.max() <= 1e-12:
            return to_grid(P, coeffs)
        if over_load.max() > 1e-12:                      # the load cap (11) first
            c = int(np.argmax(over_load))
            held = np.flatnonzero(P[:, c] > 0)
            i = int(held[np.argmax(f[held])])
            if f[i] <= 0:
                continue
            excess = min(P[i, c], over_load[c] / f[i])
        else:
            c = int(np.argmax(over_mem))
            held = np.flatnonzero(P[:, c] > 0)
            i = int(held[np.argmax(P[held, c])])
            excess = min(P[i, c], over_mem[c])
        # headroom of the other clusters for this expert, in share units
        head_load = (coeffs.load_cap - load) / f[i] if f[i] > 0 else np.full(D, np.inf)
        head = np.minimum(head_load, mem_cap - mem)
        head[c] = 0.0
        head = np.maximum(head, 0.0)
        if unit is not None:                              # whole units: excess up, room down
            excess = min(P[i, c], math.ceil(excess / unit - 1e-9) * unit)
            head = np.floor(head / unit + 1e-9) * unit
        if head.sum() <= 1e-12:
            return None   # both caps tight: no single move helps (the caller uses the LP)
        for d in np.argsort(-head):
            if excess <= 1e-15:
                break
            amount = min(excess, head[d])
            if amount <= 0:
                break
            P[i, c] -= amount
            P[i, d] += amount
            excess -= amount
    return None


def _lp_repair(P0: NDArray[np.float64], coeffs: NodeBalanceCoefficients) -> NDArray[np.float64]:
    """Return the feasible shares that move the least share mass off the support of ``P0``."""
    try:
        from scipy.optimize import linprog
        from scipy.sparse import coo_matrix
    except ImportError as exc:
        raise DependencyNotInstalled(f"scipy is missing (start repair); run `{OPT_EXTRA}`") from exc
    E, D = P0.shape
    n = E * D
    cost = np.where(P0.reshape(-1) > 0, 0.0, 1.0) + 1e-6 * np.abs(P0.reshape(-1) - 1.0 / D)
    ii, cc = np.divmod(np.arange(n), D)
    rows = [cc]
    vals = [coeffs.freqs[ii]]
    ub = [np.full(D, coeffs.load_cap)]
    if coeffs.mem_cap is not None:
        rows.append(cc + D)
        vals.append(np.ones(n))
        ub.append(coeffs.mem_cap)
    A_ub = coo_matrix((np.concatenate(vals),
                       (np.concatenate(rows), np.tile(np.arange(n), len(rows)))),
                      shape=(D * len(rows), n)).tocsr()
    A_eq = coo_matrix((np.ones(n), (ii, np.arange(n))), shape=(E, n)).tocsr()
    res = linprog(cost, A_ub=A_ub, b_ub=np.concatenate(ub), A_eq=A_eq, b_eq=np.ones(E),
                  bounds=(0, 1), method="highs")
    if res.status != 0:
        raise InfeasibleError(f"cannot repair the start: no placement meets the load cap "
                              f"{coeffs.load_cap:.4f} and the memory caps "
                              f"{None if coeffs.mem_cap is None else coeffs.mem_cap.tolist()}")
    P = res.x.reshape(E, D)
    P[P < SHARE_EPS] = 0.0
    return P / P.sum(axis=1, keepdims=True)


def _grid_repair(P0: NDArray[np.float64], coeffs: NodeBalanceCoefficients, *,
                 time_limit_s: float = 10.0) -> NDArray[np.float64] | None:
    """Return on-grid shares meeting the caps that move the fewest units off ``P0``'s support.

    An integer program over n_ic ∈ {0, …, U} tile units (share P_ic = n_ic / U): Σ_c n_ic = U
    per expert, Σ_i f_i n_ic ≤ U·cap (11) and Σ_i n_ic ≤ ⌊U·mem_cap_c⌋ (10) per cluster,
    minimising the units placed where ``P0`` is zero. Solved by HiGHS through
    ``scipy.optimize.milp`` with a time limit [decision: 10 s; a DeepSeek layer takes < 2 s].

    Returns:
        float [E, D] shares on the grid, or None when no feasible point was found.
    """
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError as exc:
        raise DependencyNotInstalled(f"scipy is missing (start repair); run `{OPT_EXTRA}`") from exc
    units = coeffs.units
    assert units is not None
    E, D = P0.shape
    n = E * D
    ii, cc = np.divmod(np.arange(n), D)
    cols = np.arange(n)
    constraints = [
        LinearConstraint(coo_matrix((np.ones(n), (ii, cols)), shape=(E, n)).tocsr(), units, units),
        LinearConstraint(coo_matrix((coeffs.freqs[ii], (cc, cols)), shape=(D, n)).tocsr(),
                         -np.inf, coeffs.load_cap * units + _TOL)]
    if coeffs.mem_cap is not None:
        constraints.append(LinearConstraint(
            coo_matrix((np.ones(n), (cc, cols)), shape=(D, n)).tocsr(), -np.inf,
            np.floor(coeffs.mem_cap * units + 1e-9)))
    cost = np.where(P0.reshape(-1) > 0, 0.0, 1.0)
    res = milp(cost, integrality=np.ones(n), bounds=Bounds(0, units), constraints=constraints,
               options={"time_limit": time_limit_s})
    if res.x is None:
        return None
    P = np.rint(res.x).reshape(E, D) / units
    return P if is_feasible(P, coeffs) else None


def wrap_start(coeffs: NodeBalanceCoefficients, member: NDArray[np.bool_],
               group_freqs: NDArray[np.float64]) -> NDArray[np.float64]:
    """Return a wrap-around (McNaughton) packing: perfect load balance with ≤ D−1 splits.

    The experts are laid out in one sequence and the sequence is cut into D pieces of equal
    load k/D (an expert crossing a cut is split). The order keeps the running weight-streaming
    activity proportional to the running load (so that no cluster collects many cold experts,
    which would make its weight streaming the bottleneck) and, among the experts that keep that
    balance, prefers the one most often co-activated with the previous expert (experts sharing a
    cluster then tend to share groups, which lowers Eq. 2). On the tile grid the cuts are
    rounded to whole units (largest remainder per expert).
    """
    f, a = coeffs.freqs, coeffs.active
    E, D = f.size, coeffs.num_nodes
    pair = (member.T * group_freqs) @ member.astype(np.float64)          # [E, E]
    np.fill_diagonal(pair, -1.0)
    total_f, total_a = max(f.sum(), 1e-12), max(a.sum(), 1e-12)
    left = np.ones(E, dtype=bool)
    order: list[int] = []
    cum_f = cum_a = 0.0
    while left.any():
        cand = np.flatnonzero(left)
        dev = np.abs((cum_f + f[cand]) / total_f - (cum_a + a[cand]) / total_a)
        if not order:
            nxt = int(cand[np.argmax(f[cand])])
        else:
            good = cand[dev <= dev.min() + 0.5 / E]
            nxt = int(good[np.argmax(pair[order[-1], good] + 1e-9 * f[good])])
        order.append(nxt)
        left[nxt] = False
        cum_f += f[nxt]
        cum_a += a[nxt]
    target = total_f / D
    P = np.zeros((E, D))
    c, room = 0, target
    for i in order:
        rest = 1.0
        while rest > 1e-12:
            if f[i] <= 0:
                P[i, c] += rest
                break
            take = rest if c == D - 1 else min(rest, room / f[i])
            P[i, c] += take
            rest -= take
            room -= take * f[i]
            if room <= 1e-12 * target and c < D - 1:
                c, room = c + 1, target
    P[P < 1e-12] = 0.0
    P = P / P.sum(axis=1, keepdims=True)
    # on the tile grid: round every split to whole units (callers repair the caps if needed)
    return P if coeffs.unit is None else snap_shares(P, coeffs.unit)


