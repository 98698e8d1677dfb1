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

Shard granularity: with ``Conventions.tile_cols`` > 1 every share is a whole number
of tile units u = tile_cols / I = 1/U. The MILP's share variables are then integers n_ic ∈
{0..U} with P_ic = n_ic / U (constraint (7) becomes n_ic ≤ U·Z_ic, (5) Σ_c n_ic = U); the
heuristic moves whole units; the warm start is an on-grid candidate (the exact TP start is not
on the grid when U is not a multiple of D: it stays a *candidate*, legal as the documented
uniform-row exception of ``hdamoe_env.sim.placement.check_tile_grid``, but is snapped and repaired
before it can be a MIP start). ``tile_cols`` = 1 (``paper*``) keeps the continuous model.

Solver: ``make_solver`` is the one place a MILP solver is built (HiGHS through highspy when
installed, else PuLP's bundled CBC). PuLP, highspy and scipy are imported lazily.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from baselines.node_balance.heuristic import heuristic_placement, rebalance_shares
from baselines.node_balance.model import (
    OPT_EXTRA,
    SHARE_EPS,
    COMPRESSION_MODES,
    CompressedGroups,
    NodeBalanceCoefficients,
    is_feasible,
    membership,
    node_times,
    compress_groups,
    exact_objective,
    grid_feasible,
    nb_coefficients,
    on_grid,
    repair_placement,
    tp_start,
)
from hdamoe_env.config.errors import (ConfigError, DependencyNotInstalled, InfeasibleError,
                                      SolverError)
from hdamoe_env.config.profiles import Conventions
from hdamoe_env.config.specs import HardwareSpec, ModelSpec

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


# --------------------------------------------------------------------------------------------
# lazy imports and the solver factory


def import_pulp() -> Any:
    """Import PuLP lazily (style.md R12).

    Raises:
        DependencyNotInstalled: PuLP is missing (the message names the extra).
    """
    try:
        import pulp
    except ImportError as exc:
        raise DependencyNotInstalled(f"PuLP is missing (needed by the Node-Balance MILP); run "
                                     f"`{OPT_EXTRA}`, or use mode='heuristic'") from exc
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


@contextlib.contextmanager
def _solver_stdout(show: bool) -> Iterator[None]:
    """Keep a native solver's prints off stdout: to stderr when ``show``, else discarded.

    HiGHS prints its banner from C++ on file descriptor 1 when a ``Highs`` object is built, even
    with ``output_flag`` off (dependencies.md §3), so ``sys.stdout`` redirection cannot catch it;
    fd 1 is pointed at stderr or ``/dev/null`` for the duration and restored after.
    """
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:                      # no fd 1 (embedded interpreters): nothing to protect
        yield
        return
    target = os.dup(2) if show else os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(target, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(target)


def make_solver(name: str | None, time_limit_s: float, gap: float, threads: int = 1, *,
                msg: bool | None = None, warm_start: bool = False) -> tuple[Any, str]:
    """Build the PuLP MILP solver (the one place a solver is constructed; dependencies.md §3).

    Args:
        name: ``"highs"``, ``"cbc"`` or None/``"auto"`` (HiGHS when highspy is installed, else
            CBC).
        time_limit_s: Wall-clock limit in seconds.
        gap: Relative MIP gap at which the solver may stop (0.05 = 5 %).
        threads: Solver threads. HiGHS fixes its thread count per process: keep it constant
            within one process (dependencies.md §3).
        msg: Show the solver log (on stderr; never on stdout). None: show it when this
            module's logger is enabled for DEBUG (``hdamoe -vv``).
        warm_start: Hand the variables' initial values (``setInitialValue``) to the solver as an
            incumbent.

    Returns:
        ``(solver, resolved_name)``.

    Raises:
        ConfigError: Unknown solver name or invalid limits.
        DependencyNotInstalled: PuLP (or highspy, when ``"highs"`` is requested) is missing.
    """
    pulp = import_pulp()
    if not (time_limit_s > 0 and math.isfinite(time_limit_s)):
        raise ConfigError(f"time_limit_s must be a positive number of seconds, got {time_limit_s}")
    if not 0 <= gap < 1:
        raise ConfigError(f"mip_gap must be in [0, 1), got {gap}")
    if msg is None:
        msg = log.isEnabledFor(logging.DEBUG)
    resolved = (name or "auto").lower()
    if resolved == "auto":
        resolved = "highs" if _highs_available() else "cbc"
    if resolved == "highs":
        if not _highs_available():
            raise DependencyNotInstalled(f"solver 'highs' needs highspy; run `{OPT_EXTRA}` or pass "
                                         "solver='cbc'")
        import highspy

        class _HiGHS(pulp.HiGHS):  # type: ignore[misc, name-defined]
            """PuLP's HiGHS interface, plus a MIP start taken from the variables' values."""

            def createAndConfigureSolver(self, lp: Any) -> None:  # PuLP's method name
                with _solver_stdout(bool(msg)):          # the banner comes with Highs()
                    super().createAndConfigureSolver(lp)
                if msg:                                  # the log (output_flag on) to stderr
                    lp.solverModel.setOptionValue("log_to_console", True)

            def callSolver(self, lp: Any) -> None:  # noqa: N802 - PuLP's method name
                with _solver_stdout(bool(msg)):
                    self._run(lp)

            def _run(self, lp: Any) -> None:
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
    """Write the Node-Balance MILP of §7.3 in PuLP (µs units).

    On the tile grid (``coeffs.unit``) the share variables ``P[i, c]`` are integers n_ic ∈
    {0..U} counting units (P_ic = n_ic / U): every coefficient of a share is multiplied by
    s = 1/U, (5) reads Σ_c n_ic = U and (7) n_ic ≤ U·Z_ic. Continuous: s = 1, U = 1.
    """
    pulp = import_pulp()
    t0 = time.perf_counter()
    f, a = coeffs.freqs, coeffs.active
    E, D = f.size, coeffs.num_nodes
    U = coeffs.units or 1
    s = 1.0 / U if coeffs.unit is not None else 1.0
    prob = pulp.LpProblem("node_balance", pulp.LpMinimize)
    ed = [(i, c) for i in range(E) for c in range(D)]
    if coeffs.unit is None:
        P = prob.add_variable_dict("P_%d_%d", ed, lowBound=0, upBound=1)
    else:
        P = prob.add_variable_dict("P_%d_%d", ed, lowBound=0, upBound=U, cat="Integer")
    Z = prob.add_variable_dict("Z_%d_%d", ed, cat="Binary")
    G = comp.groups.shape[0]
    gd = [(g, c) for g in range(G) for c in range(D)]
    Y = prob.add_variable_dict("Y_%d_%d", gd, cat="Binary") if G else {}
    t_comp = prob.add_variable("t_comp", lowBound=0)
    t_comm = prob.add_variable("t_comm", lowBound=0)
    Aff = pulp.LpAffineExpression
    prob += Aff([(t_comp, 1.0), (t_comm, coeffs.comm_factor)])
    for i in range(E):                                                       # (5)
        prob += Aff([(P[i, c], 1.0) for c in range(D)]) == U
    for i, c in ed:                                                          # (7)
        prob += Aff([(P[i, c], 1.0), (Z[i, c], -float(U))]) <= 0
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
        prob += Aff([(P[i, c], coeffs.alpha_us * float(f[i]) * s) for i in range(E)]
                    + [(t_comp, -1.0)]) <= 0                                 # (9)
        if coeffs.beta_us > 0:
            prob += Aff([(P[i, c], coeffs.beta_us * float(a[i]) * s) for i in range(E)]
                        + [(t_comp, -1.0)]) <= 0
        if coeffs.mem_cap is not None:                                       # (10)
            prob += Aff([(P[i, c], s) for i in range(E)]) <= float(coeffs.mem_cap[c])
        prob += Aff([(P[i, c], float(f[i]) * s) for i in range(E)]) <= coeffs.load_cap  # (11)
        if symmetry_breaking and c + 1 < D:                                  # §7.6 item 3
            prob += Aff([(P[i, c], float(f[i]) * s) for i in range(E)]
                        + [(P[i, c + 1], -float(f[i]) * s) for i in range(E)]) >= 0
    return _Milp(prob, P, Z, Y, t_comp, t_comm, num_binaries=E * D + G * D,
                 num_constraints=prob.numConstraints(), build_s=time.perf_counter() - t0)


def _milp_objective(P: NDArray[np.float64], coeffs: NodeBalanceCoefficients,
                    comp: CompressedGroups) -> tuple[float, float, float]:
    """Return (objective, t_comp, t_comm) of shares under the MILP's (compressed) model."""
    Zm = P > SHARE_EPS
    member = membership(comp.groups, P.shape[0]).astype(np.float64)
    Ym = (member @ Zm.astype(np.float64)) > 0
    mass = comp.freqs @ Ym + comp.phi @ Zm
    t_comm = float(coeffs.kappa_us * mass.max(initial=0.0))
    t_comp = float(node_times(P, coeffs).max())
    return t_comp + coeffs.comm_factor * t_comm, t_comp, t_comm


def _sorted_for_symmetry(P: NDArray[np.float64], coeffs: NodeBalanceCoefficients
                         ) -> NDArray[np.float64]:
    """Permute clusters by decreasing load, as the symmetry-breaking rows require."""
    order = np.argsort(-(coeffs.freqs @ P), kind="stable")
    return P[:, order]


def _set_start(m: _Milp, P: NDArray[np.float64], coeffs: NodeBalanceCoefficients,
               comp: CompressedGroups) -> None:
    E, D = P.shape
    Zm = P > SHARE_EPS
    member = membership(comp.groups, E).astype(np.float64)
    Ym = (member @ Zm.astype(np.float64)) > 0
    Pc = np.where(Zm, P, 0.0)
    if coeffs.unit is not None:
        Pc = np.rint(Pc * coeffs.units)                                    # unit counts n_ic
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
    if coeffs.unit is not None:                    # unit counts → exact n/U shares
        n = np.clip(np.rint(P), 0, coeffs.units)
        if (n.sum(axis=1) != coeffs.units).any():
            return None, record
        return n / coeffs.units, record
    P = np.clip(P, 0.0, 1.0)
    P[P < SHARE_EPS] = 0.0
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
    from hdamoe_env.sim.placement import expert_parallel

    return expert_parallel(1, num_experts, num_nodes, rng).P[0]


def _feasible_tp(coeffs: NodeBalanceCoefficients) -> NDArray[np.float64]:
    """Return TP if it meets the caps, else a feasible LP point (per-node DRAM budgets)."""
    P = tp_start(coeffs.freqs.size, coeffs.num_nodes)
    if is_feasible(P, coeffs):
        return P
    try:
        return grid_feasible(rebalance_shares(np.ones_like(P, dtype=bool), coeffs), coeffs)
    except InfeasibleError:
        raise InfeasibleError(
            f"no placement meets the caps: load cap {coeffs.load_cap:.4f} per node, memory caps "
            f"{None if coeffs.mem_cap is None else np.round(coeffs.mem_cap, 3).tolist()} experts "
            "per node") from None


def _grid_pool(pool: dict[str, NDArray[np.float64]], coeffs: NodeBalanceCoefficients
               ) -> dict[str, NDArray[np.float64]]:
    """Return the MIP-start candidates on the tile grid (off-grid ones snapped and repaired)."""
    out: dict[str, NDArray[np.float64]] = {}
    for name, P in pool.items():
        if on_grid(P, coeffs):
            out[name] = P
            continue
        try:
            out[f"{name}-snapped"] = grid_feasible(P, coeffs)
        except InfeasibleError:
            continue
    return out


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
                 heuristic_time_s: float | None = None, threads: int = 1,
                 tp_comm_s: float | None = None) -> NodeBalanceResult:
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
        tp_comm_s: TP's communication time as the evaluator charges it, for R_cc of the
            TP-ratio cap (``model.nb_coefficients``), or None for the profile's closed form.

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
                             node_dram_bytes=node_dram_bytes, tp_comm_s=tp_comm_s)
    groups = np.asarray(groups, dtype=np.int64)
    group_freqs = np.asarray(group_freqs, dtype=np.float64)
    E, D = model.num_experts, coeffs.num_nodes
    tp = _feasible_tp(coeffs)
    rng = np.random.default_rng(seed)
    ep_raw = ep_start if ep_start is not None else _ep_start(E, D, rng)
    flags: list[str] = []
    try:
        ep = repair_placement(ep_raw, coeffs)
    except InfeasibleError:
        if coeffs.unit is None:
            raise
        # the tile grid can make a tight load cap unreachable by the repair: fall back to TP
        flags.append(f"EP start cannot be repaired on the tile grid 1/{coeffs.units}: TP used")
        ep = tp
    candidates: dict[str, NDArray[np.float64]] = {"tp": tp, "ep-repaired": ep}
    record: dict[str, Any] = {"mode": mode, "coefficients": coeffs.to_dict(),
                              "num_groups": int(groups.shape[0])}
    need_heuristic = mode == "heuristic" or warm_start in ("auto", "heuristic")
    if need_heuristic:
        try:
            P_h, h_info = heuristic_placement(freqs, groups, group_freqs, coeffs,
                                              starts={"ep-repaired": ep},
                                              time_budget_s=heuristic_time_s)
        except InfeasibleError as exc:
            if coeffs.unit is None:
                raise
            flags.append(f"heuristic found no start on the tile grid: {exc}")
        else:
            if h_info["time_limit_hit"]:
                flags.append("heuristic stopped by its time limit (result depends on machine "
                             "speed)")
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
            # a MIP start must be on the tile grid: snap (and repair) the others
            pool = _grid_pool(pool, coeffs)
            scored = {n: _milp_objective(p, coeffs, comp)[0] for n, p in pool.items()}
            if scored:
                start_name = min(scored, key=scored.__getitem__)
                start = pool[start_name]
                candidates.setdefault(start_name, start)
                record["warm_start"] = {"source": start_name,
                                        "milp_objective_us": scored[start_name]}
            else:
                flags.append("no warm start on the tile grid: the MILP starts without one")
        remaining = max(1.0, time_limit_s - (time.perf_counter() - t_start))
        milp_P, rec = _solve_milp(coeffs, comp, start, solver=solver, time_limit_s=remaining,
                                  mip_gap=mip_gap, threads=threads,
                                  symmetry_breaking=symmetry_breaking)
        record["solver"] = rec
        if milp_P is None:
            flags.append(f"milp-no-incumbent (status {rec['status']}): fell back")
        elif not is_feasible(milp_P, coeffs, tol=1e-6):
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
    if not is_feasible(P_best, coeffs, tol=1e-6):  # internal invariant
        raise SolverError(f"Node Balance produced a placement that violates the caps ({path})")
    if not (on_grid(P_best, coeffs) or best == "tp"):  # internal invariant (TP: the exception)
        raise SolverError(f"Node Balance produced shares off the tile grid 1/{coeffs.units} "
                          f"({path})")
    return NodeBalanceResult(P_layer=P_best, record=record)
