"""Node Balance: the per-layer expert-share MILP of HD-MoE, and a fast heuristic.

Implements paper-model.md §7 (paper §V-B1, constraints 5–12) with the open-source recipe of
§7.6. For one MoE layer with activation frequencies f_i [E], co-activation groups G (sets [G, k],
frequencies f_g [G]) and the calibration slope γ, choose shares P [E, D] (rows sum to 1):

    minimise   t_comp + nb_comm_factor · t_comm                     (objective, §7.2)
    (5)  Σ_c P_ic = 1                          (7)  P_ic ≤ Z_ic
    (6)  per_expert: Y_gc ≥ Z_ic ∀ i ∈ g   |   aggregated: |g|·Y_gc ≥ Σ_{i∈g} Z_ic
    (8)  t_comm ≥ κ · (Σ_{g kept} f_g Y_gc + Σ_i φ_i Z_ic)     κ = kappa_a·γ·B·h / BW_end
    (9)  t_comp ≥ α · Σ_i f_i P_ic             α = B·F_e / C
         faithful streaming: t_comp ≥ β · Σ_i a_i P_ic     β = W_e / BW_mem, a_i = 1 − (1 − f_i)^B
    (10) Σ_i P_ic ≤ ρ_mem · E / D   (relative)  and/or  Σ_i W_e P_ic ≤ node_dram_bytes (absolute)
    (11) Σ_i f_i P_ic ≤ (k / D) · (1 + 1 / R_cc)                 (TP-ratio cap)
    symmetry breaking (§7.6 item 3): Σ_i f_i P_ic ≥ Σ_i f_i P_i,c+1

The model is written in µs (§7.4). Scale (§7.6): group compression keeps the smallest set of most
frequent groups covering ``group_mass`` of the frequency mass (at most ``max_groups``) and
accounts for the dropped ones with the per-expert residual φ_i = Σ_{dropped g ∋ i} f_g (default;
an upper bound of the dropped touch mass) or by renormalising the kept f_g — never by plain
truncation. The MILP always starts from a feasible incumbent: TP (P = 1/D, always feasible when
the caps are), a repaired EP placement, or the heuristic's result, whichever has the lowest MILP
objective. Whatever the solver returns, every candidate (MILP incumbent, warm start, heuristic,
TP) is re-scored with the *exact* objective (Eq. 1 + γ·Eq. 2 over all groups, no compression)
and the best is returned; the record says which path produced it.

Heuristic mode (§7.6 item 6) is a best-improvement local search on the exact objective: moves
transfer a share of one expert between two clusters (balancing compute, possibly creating a
shard) or remove a whole shard (merging it into another holder, to cut communication). It
starts from the repaired EP placement and from a wrap-around (McNaughton) packing, and ends with
a linear program that re-balances the shares on the final support (communication depends only on
the support, so this can only help).

Solver: ``make_solver`` is the one place a MILP solver is built (HiGHS through highspy when
installed, else PuLP's bundled CBC). PuLP, highspy and scipy are imported lazily.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from hdamoe_env import perf
from hdamoe_env.errors import ConfigError, DependencyNotInstalled, InfeasibleError, SolverError
from hdamoe_env.profiles import Conventions
from hdamoe_env.specs import HardwareSpec, ModelSpec

__all__ = [
    "COMPRESSION_MODES",
    "NB_MODES",
    "SOLVERS",
    "CompressedGroups",
    "NodeBalanceCoefficients",
    "NodeBalanceResult",
    "compress_groups",
    "exact_objective",
    "heuristic_placement",
    "make_solver",
    "nb_coefficients",
    "node_balance",
    "rebalance_shares",
    "repair_placement",
    "tp_start",
]

log = logging.getLogger(__name__)

NB_MODES = ("milp", "heuristic")
SOLVERS = ("highs", "cbc")
COMPRESSION_MODES = ("residual", "renormalise", "none")
_EXTRA = 'pip install "hdamoe-env[opt]"'
_TOL = 1e-9
_SHARE_EPS = 1e-7  # shares below this are treated as zero (solver noise)


# --------------------------------------------------------------------------------------------
# lazy imports and the solver factory


def _import_pulp() -> Any:
    try:
        import pulp
    except ImportError as exc:
        raise DependencyNotInstalled(f"PuLP is missing (needed by the Node-Balance MILP); run "
                                     f"`{_EXTRA}`, or use mode='heuristic'") from exc
    # dependencies.md §3: PuLP 3.3 warns about its v4 API changes; our calls are the
    # forward-compatible ones, the remaining warnings come from PuLP internals.
    migration = getattr(pulp, "v4_migration", None)
    if migration is not None:
        migration.set_v4_migration_warnings(False)
    return pulp


def _highs_available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def solver_version(name: str) -> str:
    """Return a version string of the named solver (``"highs"`` or ``"cbc"``)."""
    if name == "highs":
        try:
            return f"HiGHS (highspy {importlib.metadata.version('highspy')})"
        except importlib.metadata.PackageNotFoundError:
            return "HiGHS (highspy, version unknown)"
    try:
        pulp_version = importlib.metadata.version("pulp")
    except importlib.metadata.PackageNotFoundError:
        pulp_version = "?"
    return f"CBC (bundled with PuLP {pulp_version})"


def make_solver(name: str | None, time_limit_s: float, gap: float, threads: int = 1, *,
                msg: bool = False, warm_start: bool = False) -> tuple[Any, str]:
    """Build the PuLP MILP solver (the one place a solver is constructed; dependencies.md §3).

    Args:
        name: ``"highs"``, ``"cbc"`` or None/``"auto"`` (HiGHS when highspy is installed, else
            CBC).
        time_limit_s: Wall-clock limit in seconds.
        gap: Relative MIP gap at which the solver may stop (0.05 = 5 %).
        threads: Solver threads. HiGHS fixes its thread count per process: keep it constant
            within one process (dependencies.md §3).
        msg: Show the solver log.
        warm_start: Hand the variables' initial values (``setInitialValue``) to the solver as an
            incumbent.

    Returns:
        ``(solver, resolved_name)``.

    Raises:
        ConfigError: Unknown solver name or invalid limits.
        DependencyNotInstalled: PuLP (or highspy, when ``"highs"`` is requested) is missing.
    """
    pulp = _import_pulp()
    if not (time_limit_s > 0 and math.isfinite(time_limit_s)):
        raise ConfigError(f"time_limit_s must be a positive number of seconds, got {time_limit_s}")
    if not 0 <= gap < 1:
        raise ConfigError(f"mip_gap must be in [0, 1), got {gap}")
    resolved = (name or "auto").lower()
    if resolved == "auto":
        resolved = "highs" if _highs_available() else "cbc"
    if resolved == "highs":
        if not _highs_available():
            raise DependencyNotInstalled(f"solver 'highs' needs highspy; run `{_EXTRA}` or pass "
                                         "solver='cbc'")
        import highspy

        class _HiGHS(pulp.HiGHS):  # type: ignore[misc, name-defined]
            """PuLP's HiGHS interface, plus a MIP start taken from the variables' values."""

            def callSolver(self, lp: Any) -> None:  # noqa: N802 - PuLP's method name
                if warm_start:
                    values = [0.0] * lp.solverModel.getNumCol()
                    for var in lp.variables():
                        if var.varValue is not None:
                            values[var.index] = float(var.varValue)
                    sol = highspy.HighsSolution()
                    sol.col_value = values
                    sol.value_valid = True
                    lp.solverModel.setSolution(sol)
                lp.solverModel.run()

        solver = _HiGHS(msg=msg, timeLimit=float(time_limit_s), gapRel=float(gap),
                        threads=int(threads))
        return solver, "highs"
    if resolved == "cbc":
        solver = pulp.PULP_CBC_CMD(msg=msg, timeLimit=float(time_limit_s), gapRel=float(gap),
                                   threads=int(threads), warmStart=warm_start)
        return solver, "cbc"
    raise ConfigError(f"unknown MILP solver {name!r}; expected one of {list(SOLVERS)} or 'auto'")


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

    def to_dict(self) -> dict[str, Any]:
        """Return the scalar constants as a JSON-serialisable dict."""
        return {"alpha_us": self.alpha_us, "beta_us": self.beta_us, "kappa_us": self.kappa_us,
                "comm_factor": self.comm_factor, "load_cap": self.load_cap,
                "mem_cap": None if self.mem_cap is None else self.mem_cap.tolist(),
                "mem_cap_source": self.mem_cap_source, "gamma": self.gamma,
                "group_constraint": self.group_constraint}


def nb_coefficients(freqs: NDArray[np.float64], *, model: ModelSpec, hw: HardwareSpec,
                    conv: Conventions, gamma: float, batch: int, bw_end_Bps: float,
                    rho_mem: float | None = None,
                    node_dram_bytes: float | NDArray[np.float64] | None = None,
                    num_nodes: int | None = None) -> NodeBalanceCoefficients:
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
    beta = perf.expert_bytes(model, conv) / hw.mem_bw_Bps * 1e6 if conv.weight_streaming else 0.0
    kappa = conv.kappa_a * gamma * B * model.hidden_size / bw_end_Bps * 1e6
    cap = float(perf.tp_ratio_cap(model, hw, conv, D, B, bw_end_Bps))
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
        group_constraint=conv.nb_group_constraint)


def _membership(groups: NDArray[np.int64], num_experts: int) -> NDArray[np.bool_]:
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
    member = _membership(groups, P.shape[0]).astype(np.float64)
    touch = (member @ (P > _SHARE_EPS).astype(np.float64)) > 0         # [G, D]
    mass = np.asarray(group_freqs, dtype=np.float64) @ touch
    load = coeffs.freqs @ P
    node = np.maximum(coeffs.alpha_us * load, coeffs.beta_us * (coeffs.active @ P))
    t_comp = float(node.max())
    t_comm = float(coeffs.kappa_us * mass.max(initial=0.0))
    return {"objective_us": t_comp + coeffs.comm_factor * t_comm, "t_comp_us": t_comp,
            "t_comm_us": t_comm, "max_load": float(load.max()),
            "max_experts": float(P.sum(axis=0).max())}


def _feasible(P: NDArray[np.float64], coeffs: NodeBalanceCoefficients, tol: float = 1e-7) -> bool:
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
        member = _membership(g[drop], num_experts)
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


def _node_time(P: NDArray[np.float64], c: NodeBalanceCoefficients) -> NDArray[np.float64]:
    return np.maximum(c.alpha_us * (c.freqs @ P), c.beta_us * (c.active @ P))


def repair_placement(P: NDArray[np.float64], coeffs: NodeBalanceCoefficients
                     ) -> NDArray[np.float64]:
    """Split shares of over-capacity clusters until caps (10) and (11) hold (§7.6 item 1).

    Repeatedly moves the excess of the most overloaded cluster — first the hottest expert's share
    for the load cap (11), the largest share for the memory cap (10) — to the clusters with the
    most headroom (creating shards). Used to repair an EP start.

    Args:
        P: float [E, D] shares (rows sum to 1).
        coeffs: The coefficients (caps).

    Returns:
        A feasible copy of ``P``.

    Raises:
        InfeasibleError: The caps leave no headroom to move the excess to.
    """
    P0 = np.array(P, dtype=np.float64, copy=True)
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
            return P
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
        if head.sum() <= 1e-12:
            # both caps tight: no single move helps; move the least mass by LP instead
            return _lp_repair(P0, coeffs)
        for d in np.argsort(-head):
            if excess <= 1e-15:
                break
            amount = min(excess, head[d])
            if amount <= 0:
                break
            P[i, c] -= amount
            P[i, d] += amount
            excess -= amount
    return _lp_repair(P0, coeffs)


def _lp_repair(P0: NDArray[np.float64], coeffs: NodeBalanceCoefficients) -> NDArray[np.float64]:
    """Return the feasible shares that move the least share mass off the support of ``P0``."""
    try:
        from scipy.optimize import linprog
        from scipy.sparse import coo_matrix
    except ImportError as exc:
        raise DependencyNotInstalled(f"scipy is missing (start repair); run `{_EXTRA}`") from exc
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
    P[P < _SHARE_EPS] = 0.0
    return P / P.sum(axis=1, keepdims=True)


def _wrap_start(coeffs: NodeBalanceCoefficients, member: NDArray[np.bool_],
                group_freqs: NDArray[np.float64]) -> NDArray[np.float64]:
    """Return a wrap-around (McNaughton) packing: perfect load balance with ≤ D−1 splits.

    The experts are laid out in one sequence and the sequence is cut into D pieces of equal
    load k/D (an expert crossing a cut is split). The order keeps the running weight-streaming
    activity proportional to the running load (so that no cluster collects many cold experts,
    which would make its weight streaming the bottleneck) and, among the experts that keep that
    balance, prefers the one most often co-activated with the previous expert (experts sharing a
    cluster then tend to share groups, which lowers Eq. 2).
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
    return P / P.sum(axis=1, keepdims=True)


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
        self.fg = np.asarray(group_freqs, dtype=np.float64)
        self.groups_of = [np.flatnonzero(member[:, i]) for i in range(member.shape[1])]
        self.count = member.astype(np.int32).T.copy()                      # [E, G] helper
        self.cnt = (member.astype(np.int32) @ (self.P > 0).astype(np.int32))  # [G, D]
        self.load = coeffs.freqs @ self.P
        self.act = coeffs.active @ self.P
        self.mem = self.P.sum(axis=0)
        self.mass = self.fg @ (self.cnt > 0)
        self.mem_cap = coeffs.mem_cap if coeffs.mem_cap is not None else np.full(
            self.P.shape[1], np.inf)

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
        if self.P[i, dst] <= 0:
            idx = self.groups_of[i]
            self.cnt[idx, dst] += 1
            self.mass[dst] = self.fg @ (self.cnt[:, dst] > 0)
        self.P[i, src] -= amount
        self.P[i, dst] += amount
        if full:
            self.P[i, src] = 0.0
            idx = self.groups_of[i]
            self.cnt[idx, src] -= 1
            self.mass[src] = self.fg @ (self.cnt[:, src] > 0)
        self.load = c.freqs @ self.P
        self.act = c.active @ self.P
        self.mem = self.P.sum(axis=0)


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Lexicographic improvement: objective first, then the soft-max tie-breaker."""
    if a[0] < b[0] - 1e-9 * max(1.0, abs(b[0])):
        return True
    return a[0] <= b[0] + 1e-12 * max(1.0, abs(b[0])) and a[1] < b[1] * (1 - 1e-9)


def _candidate_moves(st: _State, u: NDArray[np.float64], w: NDArray[np.float64]
                     ) -> list[tuple[int, int, int, float]]:
    """Moves out of the compute- and the communication-bottleneck clusters."""
    c = st.c
    D = st.P.shape[1]
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
                if 1e-6 < eq < share - 1e-6:
                    moves.append((int(i), src, dst, float(eq)))
    return moves


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
    member = _membership(groups, coeffs.freqs.size)
    fg = np.asarray(group_freqs, dtype=np.float64)
    all_starts: dict[str, NDArray[np.float64]] = {}
    wrap = _wrap_start(coeffs, member, fg)
    if _feasible(wrap, coeffs):
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
    best_P: NDArray[np.float64] | None = None
    best_score = (math.inf, math.inf)
    per_start: dict[str, dict[str, Any]] = {}
    share = math.inf if time_budget_s is None else time_budget_s / len(all_starts)
    timed_out = False
    for k, (name, start) in enumerate(all_starts.items()):
        deadline = t0 + share * (k + 1)
        st = _State(start, coeffs, member, fg)
        score = st.current()
        first = score[0]
        moves = 0
        while moves < max_moves:
            u = st.node_time()
            w = coeffs.kappa_us * st.mass
            best_move = None
            best_trial = score
            for move in _candidate_moves(st, u, w):
                res = st.trial(*move)
                if res is not None and _better(res[0], best_trial):
                    best_trial, best_move = res[0], move
            if best_move is None:
                break
            if time.perf_counter() >= deadline:
                timed_out = True
                break
            st.apply(*best_move)
            score = st.current()
            moves += 1
        P = st.P
        if polish:
            P = _polish(P, coeffs, groups, fg)
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


def _polish(P: NDArray[np.float64], coeffs: NodeBalanceCoefficients, groups: NDArray[np.int64],
            group_freqs: NDArray[np.float64]) -> NDArray[np.float64]:
    """Re-balance shares on the support of P by LP; keep the result only if it is better."""
    try:
        better = rebalance_shares(P > 0, coeffs)
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
        raise DependencyNotInstalled(f"scipy is missing; run `{_EXTRA}`") from exc
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


# --------------------------------------------------------------------------------------------
# MILP


@dataclass
class _Milp:
    prob: Any
    P: dict[tuple[int, int], Any]
    Z: dict[tuple[int, int], Any]
    Y: dict[tuple[int, int], Any]
    t_comp: Any
    t_comm: Any
    num_binaries: int
    num_constraints: int
    build_s: float = 0.0


def _build_milp(coeffs: NodeBalanceCoefficients, comp: CompressedGroups,
                symmetry_breaking: bool) -> _Milp:
    """Write the Node-Balance MILP of §7.3 in PuLP (µs units)."""
    pulp = _import_pulp()
    t0 = time.perf_counter()
    f, a = coeffs.freqs, coeffs.active
    E, D = f.size, coeffs.num_nodes
    prob = pulp.LpProblem("node_balance", pulp.LpMinimize)
    ed = [(i, c) for i in range(E) for c in range(D)]
    P = prob.add_variable_dict("P_%d_%d", ed, lowBound=0, upBound=1)
    Z = prob.add_variable_dict("Z_%d_%d", ed, cat="Binary")
    G = comp.groups.shape[0]
    gd = [(g, c) for g in range(G) for c in range(D)]
    Y = prob.add_variable_dict("Y_%d_%d", gd, cat="Binary") if G else {}
    t_comp = prob.add_variable("t_comp", lowBound=0)
    t_comm = prob.add_variable("t_comm", lowBound=0)
    Aff = pulp.LpAffineExpression
    prob += Aff([(t_comp, 1.0), (t_comm, coeffs.comm_factor)])
    for i in range(E):                                                       # (5)
        prob += Aff([(P[i, c], 1.0) for c in range(D)]) == 1
    for i, c in ed:                                                          # (7)
        prob += Aff([(P[i, c], 1.0), (Z[i, c], -1.0)]) <= 0
    members = [[int(x) for x in row if x >= 0] for row in comp.groups]
    for g, mem in enumerate(members):                                        # (6)
        for c in range(D):
            if coeffs.group_constraint == "per_expert":
                for i in mem:
                    prob += Aff([(Y[g, c], 1.0), (Z[i, c], -1.0)]) >= 0
            else:
                prob += Aff([(Y[g, c], float(len(mem)))] + [(Z[i, c], -1.0) for i in mem]) >= 0
    for c in range(D):
        terms = [(Y[g, c], coeffs.kappa_us * float(comp.freqs[g])) for g in range(G)]
        terms += [(Z[i, c], coeffs.kappa_us * float(comp.phi[i]))
                  for i in range(E) if comp.phi[i] > 0]
        if coeffs.kappa_us > 0:                                              # (8)
            prob += Aff([*terms, (t_comm, -1.0)]) <= 0
        prob += Aff([(P[i, c], coeffs.alpha_us * float(f[i])) for i in range(E)]
                    + [(t_comp, -1.0)]) <= 0                                 # (9)
        if coeffs.beta_us > 0:
            prob += Aff([(P[i, c], coeffs.beta_us * float(a[i])) for i in range(E)]
                        + [(t_comp, -1.0)]) <= 0
        if coeffs.mem_cap is not None:                                       # (10)
            prob += Aff([(P[i, c], 1.0) for i in range(E)]) <= float(coeffs.mem_cap[c])
        prob += Aff([(P[i, c], float(f[i])) for i in range(E)]) <= coeffs.load_cap  # (11)
        if symmetry_breaking and c + 1 < D:                                  # §7.6 item 3
            prob += Aff([(P[i, c], float(f[i])) for i in range(E)]
                        + [(P[i, c + 1], -float(f[i])) for i in range(E)]) >= 0
    return _Milp(prob, P, Z, Y, t_comp, t_comm, num_binaries=E * D + G * D,
                 num_constraints=prob.numConstraints(), build_s=time.perf_counter() - t0)


def _milp_objective(P: NDArray[np.float64], coeffs: NodeBalanceCoefficients,
                    comp: CompressedGroups) -> tuple[float, float, float]:
    """Return (objective, t_comp, t_comm) of shares under the MILP's (compressed) model."""
    Zm = P > _SHARE_EPS
    member = _membership(comp.groups, P.shape[0]).astype(np.float64)
    Ym = (member @ Zm.astype(np.float64)) > 0
    mass = comp.freqs @ Ym + comp.phi @ Zm
    t_comm = float(coeffs.kappa_us * mass.max(initial=0.0))
    t_comp = float(_node_time(P, coeffs).max())
    return t_comp + coeffs.comm_factor * t_comm, t_comp, t_comm


def _sorted_for_symmetry(P: NDArray[np.float64], coeffs: NodeBalanceCoefficients
                         ) -> NDArray[np.float64]:
    """Permute clusters by decreasing load, as the symmetry-breaking rows require."""
    order = np.argsort(-(coeffs.freqs @ P), kind="stable")
    return P[:, order]


def _set_start(m: _Milp, P: NDArray[np.float64], coeffs: NodeBalanceCoefficients,
               comp: CompressedGroups) -> None:
    E, D = P.shape
    Zm = P > _SHARE_EPS
    member = _membership(comp.groups, E).astype(np.float64)
    Ym = (member @ Zm.astype(np.float64)) > 0
    Pc = np.where(Zm, P, 0.0)
    for i in range(E):
        for c in range(D):
            m.P[i, c].setInitialValue(float(Pc[i, c]))
            m.Z[i, c].setInitialValue(int(Zm[i, c]))
    for (g, c), var in m.Y.items():
        var.setInitialValue(int(Ym[g, c]))
    _, t_comp, t_comm = _milp_objective(P, coeffs, comp)
    m.t_comp.setInitialValue(t_comp * (1 + 1e-9))
    m.t_comm.setInitialValue(t_comm * (1 + 1e-9))


def _solve_milp(coeffs: NodeBalanceCoefficients, comp: CompressedGroups,
                start: NDArray[np.float64] | None, *, solver: str | None, time_limit_s: float,
                mip_gap: float, threads: int, symmetry_breaking: bool
                ) -> tuple[NDArray[np.float64] | None, dict[str, Any]]:
    """Build and solve the MILP; return the incumbent shares (or None) and the solver record."""
    m = _build_milp(coeffs, comp, symmetry_breaking)
    if start is not None:
        _set_start(m, _sorted_for_symmetry(start, coeffs) if symmetry_breaking else start,
                   coeffs, comp)
    budget = max(1.0, time_limit_s - m.build_s)
    slv, name = make_solver(solver, budget, mip_gap, threads, warm_start=start is not None)
    t0 = time.perf_counter()
    try:
        m.prob.solve(slv)
    except Exception as exc:  # PuLP raises PulpSolverError (and others) for solver failures
        raise SolverError(f"{solver_version(name)} failed on the Node-Balance MILP: {exc}") from exc
    wall = time.perf_counter() - t0
    sol_status = int(m.prob.sol_status)
    record: dict[str, Any] = {
        "solver": name, "solver_version": solver_version(name), "sol_status": sol_status,
        "status": {1: "optimal", 2: "feasible", 0: "no-solution"}.get(
            sol_status, "infeasible" if sol_status < 0 else str(sol_status)),
        "lp_status": int(m.prob.status), "build_s": m.build_s, "solve_s": wall,
        "time_limit_s": budget, "mip_gap_target": mip_gap, "threads": threads,
        "num_binaries": m.num_binaries, "num_constraints": m.num_constraints,
        "objective_us": None, "bound_us": None, "gap": None,
    }
    if name == "highs":
        try:
            info = m.prob.solverModel.getInfo()
            record["bound_us"] = float(info.mip_dual_bound)
            record["gap"] = float(info.mip_gap)
            record["objective_us"] = float(info.objective_function_value)
        except Exception:  # noqa: BLE001 - informational only
            pass
    if sol_status not in (1, 2):
        return None, record
    if record["objective_us"] is None:
        record["objective_us"] = float(pulp_value(m.prob.objective))
    E, D = coeffs.freqs.size, coeffs.num_nodes
    P = np.array([[m.P[i, c].varValue or 0.0 for c in range(D)] for i in range(E)])
    P = np.clip(P, 0.0, 1.0)
    P[P < _SHARE_EPS] = 0.0
    rows = P.sum(axis=1, keepdims=True)
    if (rows <= 0).any():
        return None, record
    return P / rows, record


def pulp_value(expr: Any) -> float:
    """Return the value of a PuLP expression (None → nan)."""
    value = expr.value()
    return float("nan") if value is None else float(value)


# --------------------------------------------------------------------------------------------
# public entry point


@dataclass(frozen=True)
class NodeBalanceResult:
    """Result of Node Balance for one layer.

    Attributes:
        P_layer: float [E, D] shares (rows sum to 1).
        record: JSON-serialisable record: mode, path (``milp-optimal``, ``milp-feasible``,
            ``warm-start``, ``heuristic``), solver name/version/status/objective/bound/gap, wall
            time, compression, exact objective and its parts, flags.
    """

    P_layer: NDArray[np.float64]
    record: dict[str, Any] = field(default_factory=dict)


def _ep_start(num_experts: int, num_nodes: int, rng: np.random.Generator) -> NDArray[np.float64]:
    from hdamoe_env.placement import expert_parallel

    return expert_parallel(1, num_experts, num_nodes, rng).P[0]


def _feasible_tp(coeffs: NodeBalanceCoefficients) -> NDArray[np.float64]:
    """Return TP if it meets the caps, else a feasible LP point (per-node DRAM budgets)."""
    P = tp_start(coeffs.freqs.size, coeffs.num_nodes)
    if _feasible(P, coeffs):
        return P
    try:
        return rebalance_shares(np.ones_like(P, dtype=bool), coeffs)
    except InfeasibleError:
        raise InfeasibleError(
            f"no placement meets the caps: load cap {coeffs.load_cap:.4f} per node, memory caps "
            f"{None if coeffs.mem_cap is None else np.round(coeffs.mem_cap, 3).tolist()} experts "
            "per node") from None


def node_balance(freqs: NDArray[np.float64], groups: NDArray[np.int64],
                 group_freqs: NDArray[np.float64], *, model: ModelSpec, hw: HardwareSpec,
                 conv: Conventions, gamma: float, batch: int, bw_end_Bps: float,
                 rho_mem: float | None = None,
                 node_dram_bytes: float | NDArray[np.float64] | None = None,
                 mode: str = "milp", time_limit_s: float = 10.0, mip_gap: float = 0.05,
                 solver: str | None = None, seed: int | np.random.SeedSequence = 0,
                 ep_start: NDArray[np.float64] | None = None, warm_start: str = "auto",
                 group_mass: float = 0.9, max_groups: int = 400,
                 compression: str = "residual", symmetry_breaking: bool = True,
                 heuristic_time_s: float | None = None, threads: int = 1) -> NodeBalanceResult:
    """Solve Node Balance for one layer (paper-model.md §7).

    Args:
        freqs: float [E] activation frequencies f_i (Σ = k).
        groups: int [G, k] co-activation groups (distinct sorted top-k sets).
        group_freqs: float [G] their frequencies (Σ = 1).
        model: The model.
        hw: The hardware.
        conv: The conventions (objective factor, constraint (6) form, streaming).
        gamma: γ of the layer (calibrate.fit_gamma).
        batch: Batch size of the optimisation (128).
        bw_end_Bps: Endpoint-side bandwidth of the topology.
        rho_mem: Relative memory cap (10), or None.
        node_dram_bytes: Absolute byte budget per node for this layer's expert weights (scalar or
            [D]), or None.
        mode: ``"milp"`` (MILP, heuristic as warm start and fallback) or ``"heuristic"``.
        time_limit_s: Wall-clock budget of ``milp`` mode: the heuristic warm start, model
            building and the solve (the solver gets what remains, at least 1 s).
        mip_gap: Relative MIP gap.
        solver: ``"highs"``, ``"cbc"`` or None (auto).
        seed: Seed of the EP start (when ``ep_start`` is not given).
        ep_start: float [E, D] EP shares to start from (repaired to the caps).
        warm_start: ``"auto"`` (best of TP, repaired EP and heuristic by MILP objective),
            ``"tp"``, ``"ep"``, ``"heuristic"`` or ``"none"``.
        group_mass: Frequency mass kept exactly by group compression.
        max_groups: Upper limit of kept groups.
        compression: ``"residual"``, ``"renormalise"`` or ``"none"``.
        symmetry_breaking: Add the load-ordering rows of §7.6 item 3.
        heuristic_time_s: Optional wall-clock limit of the heuristic (default None: move budget
            only, deterministic).
        threads: Solver threads (keep constant per process for HiGHS).

    Returns:
        Shares and the record.

    Raises:
        ConfigError: Invalid arguments.
        InfeasibleError: The caps are infeasible (raised before solving, with the numbers).
        DependencyNotInstalled: ``mode="milp"`` without PuLP.
    """
    t_start = time.perf_counter()
    if mode not in NB_MODES:
        raise ConfigError(f"unknown Node-Balance mode {mode!r}; expected one of {list(NB_MODES)}")
    if warm_start not in ("auto", "tp", "ep", "heuristic", "none"):
        raise ConfigError(f"warm_start={warm_start!r}; expected 'auto', 'tp', 'ep', 'heuristic' "
                          "or 'none'")
    coeffs = nb_coefficients(freqs, model=model, hw=hw, conv=conv, gamma=gamma, batch=batch,
                             bw_end_Bps=bw_end_Bps, rho_mem=rho_mem,
                             node_dram_bytes=node_dram_bytes)
    groups = np.asarray(groups, dtype=np.int64)
    group_freqs = np.asarray(group_freqs, dtype=np.float64)
    E, D = model.num_experts, coeffs.num_nodes
    tp = _feasible_tp(coeffs)
    rng = np.random.default_rng(seed)
    ep_raw = ep_start if ep_start is not None else _ep_start(E, D, rng)
    ep = repair_placement(ep_raw, coeffs)
    flags: list[str] = []
    candidates: dict[str, NDArray[np.float64]] = {"tp": tp, "ep-repaired": ep}
    record: dict[str, Any] = {"mode": mode, "coefficients": coeffs.to_dict(),
                              "num_groups": int(groups.shape[0])}
    need_heuristic = mode == "heuristic" or warm_start in ("auto", "heuristic")
    if need_heuristic:
        P_h, h_info = heuristic_placement(freqs, groups, group_freqs, coeffs,
                                          starts={"ep-repaired": ep},
                                          time_budget_s=heuristic_time_s)
        if h_info["time_limit_hit"]:
            flags.append("heuristic stopped by its time limit (result depends on machine speed)")
        candidates["heuristic"] = P_h
        record["heuristic"] = h_info
    milp_P = None
    if mode == "milp":
        comp = compress_groups(groups, group_freqs, E, mass=group_mass, max_groups=max_groups,
                               mode=compression)
        record["compression"] = comp.to_dict()
        start = None
        if warm_start != "none":
            pool = {"auto": candidates, "tp": {"tp": tp}, "ep": {"ep-repaired": ep},
                    "heuristic": {"heuristic": candidates.get("heuristic", tp)}}[warm_start]
            scored = {n: _milp_objective(p, coeffs, comp)[0] for n, p in pool.items()}
            start_name = min(scored, key=scored.__getitem__)
            start = pool[start_name]
            record["warm_start"] = {"source": start_name, "milp_objective_us": scored[start_name]}
        remaining = max(1.0, time_limit_s - (time.perf_counter() - t_start))
        milp_P, rec = _solve_milp(coeffs, comp, start, solver=solver, time_limit_s=remaining,
                                  mip_gap=mip_gap, threads=threads,
                                  symmetry_breaking=symmetry_breaking)
        record["solver"] = rec
        if milp_P is None:
            flags.append(f"milp-no-incumbent (status {rec['status']}): fell back")
        elif not _feasible(milp_P, coeffs, tol=1e-6):
            flags.append("milp-incumbent-violates-caps: discarded")
            milp_P = None
        else:
            candidates["milp"] = milp_P
    scores = {n: exact_objective(p, coeffs, groups, group_freqs) for n, p in candidates.items()}
    best = min(scores, key=lambda n: (scores[n]["objective_us"], n != "milp"))
    if mode == "milp" and milp_P is not None and best != "milp":
        # the MILP incumbent is at least as good as its start under the MILP's own (compressed)
        # objective; prefer it when the exact objectives tie
        if scores["milp"]["objective_us"] <= scores[best]["objective_us"] + 1e-9:
            best = "milp"
    ws = record.get("warm_start", {}).get("source")
    if best == "milp":
        improved = ws is None or scores["milp"]["objective_us"] < (
            scores[ws]["objective_us"] - 1e-6 * max(1.0, scores[ws]["objective_us"]))
        if record["solver"]["sol_status"] == 1:
            path = "milp-optimal"          # proven within the gap (possibly the start itself)
        else:
            path = "milp-feasible" if improved else "warm-start"
    elif mode == "milp" and best == ws:
        path = "warm-start"
    else:
        path = "heuristic" if best == "heuristic" else best
        if mode == "milp":
            flags.append(f"exact objective preferred candidate {best!r} over the MILP incumbent")
    P_best = candidates[best]
    record.update({"path": path, "candidate": best,
                   "candidates": {n: s["objective_us"] for n, s in scores.items()},
                   **{k: v for k, v in scores[best].items()},
                   "wall_s": time.perf_counter() - t_start, "flags": flags})
    for flag in flags:
        log.warning("Node Balance: %s", flag)
    if not _feasible(P_best, coeffs, tol=1e-6):  # internal invariant
        raise SolverError(f"Node Balance produced a placement that violates the caps ({path})")
    return NodeBalanceResult(P_layer=P_best, record=record)
