"""Static baselines: TP, EP and the compute-balanced hybrid TP-EP placement.

Implements paper-model.md §9.1–9.3. TP and EP are data constructors of the core
(``hdamoe_env.sim.placement``) and are re-exported here so that every baseline is reachable from
``baselines``.

Compute-balanced hybrid (§9.3, paper §VI-A2). The mesh is split into R = rows_split × cols_split
equal rectangles — (2, 4) for R = 8, (1, 2) for R = 2 — numbered row-major (4×8 → eight 2×2
regions or two 4×4 regions; 4×4 with R = 8 → eight 2×1 regions; 8×8 → eight 4×2 regions). Every
expert is assigned to one region by a small balance MILP (E·R binaries Z_ir, minimise
max_r Σ_i f_i Z_ir, 60 s limit, 5 % gap; a greedy longest-processing-time assignment when PuLP is
missing, which also serves as the MILP's warm start) and is TP-split evenly over the D/R clusters
of its region. Logical cluster c sits on endpoint c (identity mapping), so the clusters of a
region are exactly the cells of its rectangle.

Evaluation (§9.3):

* ``hybrid_eval = "des"`` (``faithful``): the ordinary static DES of §6 on the full mesh
  (``MoESimulator.layer_static``). Every node of a region holds a shard of each of the region's
  experts, so it sends its partial sum to the token's aggregator; that reduction at the
  aggregator *is* the intra-region reduction, so no second all-reduce is added.
* ``hybrid_eval = "ref"`` (``paper*``): 2 × [DES over one representative cluster per region (the
  same relative cell in every region, drawn at random; the other clusters hold nothing, so only
  inter-region traffic is simulated) + the analytic t_comm of Eq. 2 for the hybrid placement].
  The DES part uses the profile's MoE-communication rule (``2xcombine`` in ``paper*`` already
  doubles the combine makespan) and the analytic part is doubled explicitly. With
  ``hybrid_ref_slip`` the analytic term of the Node-Balance placement is used instead (quirk
  Q13); the caller passes that support.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.cost import perf
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled, SolverError
from hdamoe_env.sim.placement import Placement, expert_parallel, identity_mapping, tensor_parallel

if TYPE_CHECKING:
    from hdamoe_env.sim.simulator import MoESimulator

__all__ = [
    "REGION_SPLITS",
    "HybridLayer",
    "balance_regions",
    "evaluate_hybrid",
    "expert_parallel",
    "hybrid_layer",
    "hybrid_placement",
    "lpt_regions",
    "region_map",
    "region_split",
    "tensor_parallel",
]

#: rows_split × cols_split of the hybrid regions per R (paper-model.md §9.3).
REGION_SPLITS: dict[int, tuple[int, int]] = {1: (1, 1), 2: (1, 2), 4: (2, 2), 8: (2, 4),
                                             16: (4, 4)}


def region_split(num_regions: int) -> tuple[int, int]:
    """Return (rows_split, cols_split) for R regions ((2, 4) for 8, (1, 2) for 2).

    Raises:
        ConfigError: R has no defined split.
    """
    try:
        return REGION_SPLITS[int(num_regions)]
    except KeyError:
        raise ConfigError(f"no hybrid region split for R={num_regions}; expected one of "
                          f"{sorted(REGION_SPLITS)}") from None


def region_map(mesh_shape: tuple[int, int], num_regions: int) -> NDArray[np.int64]:
    """Return the region id of every endpoint, int64 [X·Y] (row-major endpoints and regions).

    Args:
        mesh_shape: (X, Y) endpoint grid.
        num_regions: R.

    Raises:
        ConfigError: The grid cannot be cut into R equal rectangles.
    """
    X, Y = (int(v) for v in mesh_shape)
    rs, cs = region_split(num_regions)
    if X % rs or Y % cs:
        raise ConfigError(f"a {X}x{Y} grid cannot be cut into {rs}x{cs} equal regions "
                          f"(R={num_regions}); use a mesh whose rows divide by {rs} and columns "
                          f"by {cs}")
    h, w = X // rs, Y // cs
    rows, cols = np.divmod(np.arange(X * Y), Y)
    return ((rows // h) * cs + cols // w).astype(np.int64)


def lpt_regions(freqs: NDArray[np.float64], num_regions: int) -> NDArray[np.int64]:
    """Greedy longest-processing-time assignment of experts to regions, int64 [E]."""
    f = np.asarray(freqs, dtype=np.float64)
    load = np.zeros(num_regions)
    assign = np.empty(f.size, dtype=np.int64)
    for i in np.argsort(-f, kind="stable"):
        r = int(np.argmin(load))
        assign[i] = r
        load[r] += f[i]
    return assign


def balance_regions(freqs: NDArray[np.float64], num_regions: int, *, time_limit_s: float = 60.0,
                    mip_gap: float = 0.05, solver: str | None = None, method: str = "milp",
                    threads: int = 1) -> tuple[NDArray[np.int64], dict[str, Any]]:
    """Assign experts to regions balancing Σ_i f_i per region (§9.3).

    The MILP has binaries Z_ir (Σ_r Z_ir = 1) and minimises t ≥ Σ_i f_i Z_ir; region loads are
    ordered (symmetry breaking: the regions are interchangeable for compute balance) and the LPT
    assignment is the warm start. Without PuLP (or with ``method="lpt"``) the LPT assignment is
    returned.

    Args:
        freqs: float [E] activation frequencies.
        num_regions: R.
        time_limit_s: MILP time limit.
        mip_gap: Relative MIP gap.
        solver: ``"highs"``, ``"cbc"`` or None (auto).
        method: ``"milp"`` or ``"lpt"``.
        threads: Solver threads.

    Returns:
        ``(region_of_expert int64 [E], record)``.
    """
    f = np.asarray(freqs, dtype=np.float64)
    E, R = f.size, int(num_regions)
    t0 = time.perf_counter()
    lpt = lpt_regions(f, R)
    lpt_obj = float(np.bincount(lpt, weights=f, minlength=R).max())
    bound = max(f.sum() / R, float(f.max(initial=0.0)))
    record: dict[str, Any] = {"method": "lpt", "lpt_max_load": lpt_obj, "lower_bound": bound}
    if method not in ("milp", "lpt"):
        raise ConfigError(f"unknown region-balance method {method!r}; expected 'milp' or 'lpt'")
    if method == "lpt" or R == 1 or lpt_obj <= bound * (1 + 1e-12):
        record.update(max_load=lpt_obj, wall_s=time.perf_counter() - t0,
                      note="LPT meets the lower bound" if method == "milp" else "")
        return _order_regions(lpt, f, R), record
    try:
        from baselines.node_balance.milp import import_pulp, make_solver, solver_version

        pulp = import_pulp()
    except DependencyNotInstalled:
        record.update(max_load=lpt_obj, wall_s=time.perf_counter() - t0,
                      note="PuLP missing: greedy LPT fallback")
        return _order_regions(lpt, f, R), record
    prob = pulp.LpProblem("hybrid_regions", pulp.LpMinimize)
    idx = [(i, r) for i in range(E) for r in range(R)]
    Z = prob.add_variable_dict("Z_%d_%d", idx, cat="Binary")
    t = prob.add_variable("t", lowBound=0)
    Aff = pulp.LpAffineExpression
    prob += Aff([(t, 1.0)])
    for i in range(E):
        prob += Aff([(Z[i, r], 1.0) for r in range(R)]) == 1
    for r in range(R):
        prob += Aff([(Z[i, r], float(f[i])) for i in range(E)] + [(t, -1.0)]) <= 0
        if r + 1 < R:
            prob += Aff([(Z[i, r], float(f[i])) for i in range(E)]
                        + [(Z[i, r + 1], -float(f[i])) for i in range(E)]) >= 0
    start = _order_regions(lpt, f, R)
    for i, r in idx:
        Z[i, r].setInitialValue(int(start[i] == r))
    t.setInitialValue(lpt_obj * (1 + 1e-9))
    slv, name = make_solver(solver, time_limit_s, mip_gap, threads, warm_start=True)
    try:
        prob.solve(slv)
    except Exception as exc:  # PuLP solver failure
        raise SolverError(f"{solver_version(name)} failed on the hybrid region MILP: {exc}") \
            from exc
    status = int(prob.sol_status)
    record.update(method="milp", solver=name, solver_version=solver_version(name),
                  sol_status=status)
    if status in (1, 2):
        assign = np.array([max(range(R), key=lambda r, i=i: Z[i, r].varValue or 0.0)
                           for i in range(E)], dtype=np.int64)
        obj = float(np.bincount(assign, weights=f, minlength=R).max())
        if obj <= lpt_obj + 1e-12:
            record.update(max_load=obj, wall_s=time.perf_counter() - t0)
            return _order_regions(assign, f, R), record
    record.update(max_load=lpt_obj, wall_s=time.perf_counter() - t0,
                  note="MILP gave no better incumbent: LPT")
    return start, record


def _order_regions(assign: NDArray[np.int64], f: NDArray[np.float64], R: int) -> NDArray[np.int64]:
    """Relabel regions by decreasing load (a canonical form; loads are what matter)."""
    load = np.bincount(assign, weights=f, minlength=R)
    order = np.argsort(-load, kind="stable")
    relabel = np.empty(R, dtype=np.int64)
    relabel[order] = np.arange(R)
    return relabel[assign]


@dataclass(frozen=True)
class HybridLayer:
    """The hybrid placement of one layer.

    Attributes:
        P_layer: float [E, D] shares (1/(D/R) on the clusters of the expert's region).
        pi_layer: int64 [D] identity mapping.
        region_of_expert: int64 [E].
        region_of_cluster: int64 [D].
        record: balance record (method, max region load, solver status, ...).
    """

    P_layer: NDArray[np.float64]
    pi_layer: NDArray[np.int64]
    region_of_expert: NDArray[np.int64]
    region_of_cluster: NDArray[np.int64]
    record: dict[str, Any]


def hybrid_layer(freqs: NDArray[np.float64], mesh_shape: tuple[int, int], num_regions: int, *,
                 time_limit_s: float = 60.0, mip_gap: float = 0.05, solver: str | None = None,
                 method: str = "milp", unit: float | None = None) -> HybridLayer:
    """Build the compute-balanced hybrid placement of one layer (§9.3).

    Inside its region an expert is split into n = D/R equal parts. On the tile grid (``unit``
    u = 1/U) a part must be whole tiles: when n does not divide U, every node of the
    region gets ⌊U/n⌋ units and U mod n of them one more; [decision] the extra units of the
    region's experts (taken by decreasing f_i) go to the nodes with the lowest f-weighted load
    so far (ties: the lower cluster), so that the rounding does not pile up on one node.

    Args:
        freqs: float [E] activation frequencies.
        mesh_shape: (X, Y) endpoint grid.
        num_regions: R (``ModelSpec.hybrid_regions``).
        time_limit_s: Balance-MILP time limit (60 s in the reference).
        mip_gap: Balance-MILP gap (5 %).
        solver: MILP solver name or None.
        method: ``"milp"`` or ``"lpt"``.
        unit: Share unit of the tile grid (``hdamoe_env.sim.placement.share_unit``), or None for
            exact 1/n parts (``tile_cols`` = 1).
    """
    regions = region_map(mesh_shape, num_regions)
    assign, record = balance_regions(freqs, num_regions, time_limit_s=time_limit_s,
                                     mip_gap=mip_gap, solver=solver, method=method)
    D = regions.size
    member = regions[None, :] == assign[:, None]                       # [E, D]
    P = member / member.sum(axis=1, keepdims=True)
    if unit is not None:
        P = _tile_region_shares(np.asarray(freqs, dtype=np.float64), member, unit, P)
    record = {**record, "num_regions": int(num_regions),
              "region_split": list(region_split(num_regions)),
              "clusters_per_region": D // int(num_regions)}
    return HybridLayer(P, np.arange(D, dtype=np.int64), assign, regions, record)


def _tile_region_shares(f: NDArray[np.float64], member: NDArray[np.bool_], unit: float,
                        P: NDArray[np.float64]) -> NDArray[np.float64]:
    """Split every expert over its region's n clusters in whole units (see :func:`hybrid_layer`)."""
    U = round(1.0 / unit)
    n = int(member[0].sum())
    base, extra = divmod(U, n)
    if extra == 0:
        return P
    out = np.zeros_like(P)
    load = np.zeros(P.shape[1])
    for i in np.argsort(-f, kind="stable"):
        nodes = np.flatnonzero(member[i])
        units = np.full(nodes.size, base)
        units[np.argsort(load[nodes], kind="stable")[:extra]] += 1
        out[i, nodes] = units / U
        load[nodes] += f[i] * units / U
    return out


def hybrid_placement(freqs_per_layer: list[NDArray[np.float64]], mesh_shape: tuple[int, int],
                     num_regions: int, **kwargs: Any) -> Placement:
    """Build the hybrid placement of every layer (identity mappings).

    Args:
        freqs_per_layer: L arrays float [E].
        mesh_shape: (X, Y).
        num_regions: R.
        **kwargs: Passed to :func:`hybrid_layer`.
    """
    layers = [hybrid_layer(f, mesh_shape, num_regions, **kwargs) for f in freqs_per_layer]
    P = np.stack([h.P_layer for h in layers])
    pi = identity_mapping(len(layers), P.shape[2])
    return Placement(P=P, pi=pi, method="hybrid",
                     meta={"hybrid": [h.record for h in layers],
                           "region_of_expert": [h.region_of_expert.tolist() for h in layers]})


def layer_placement(P_layer: NDArray[np.float64], pi_layer: NDArray[np.int64], layer: int,
                    method: str, *, allreduce: bool = False) -> Placement:
    """Wrap one layer's arrays in a placement of ``layer + 1`` layers (for ``layer_static``).

    ``allreduce`` marks the layer as an all-reduce (tile-aligned TP) layer.
    """
    E, D = P_layer.shape
    P = np.full((layer + 1, E, D), 1.0 / D)
    P[layer] = P_layer
    pi = identity_mapping(layer + 1, D)
    pi[layer] = pi_layer
    red = None
    if allreduce:
        red = np.zeros(layer + 1, dtype=bool)
        red[layer] = True
    return Placement(P=P, pi=pi, method=method, allreduce=red)


def evaluate_hybrid(sim: MoESimulator, hybrid: HybridLayer, layer: int,
                    freqs: NDArray[np.float64], groups: NDArray[np.int64],
                    group_freqs: NDArray[np.float64], batch: int, *, rng: np.random.Generator,
                    slip_support: NDArray[np.bool_] | None = None) -> dict[str, Any]:
    """Evaluate the hybrid placement of one layer with the profile's ``hybrid_eval`` (§9.3).

    Args:
        sim: Simulator (model, hardware, topology, conventions).
        hybrid: The layer's hybrid placement.
        layer: MoE layer index.
        freqs: float [E] f_i.
        groups: int [G, k] co-activation groups.
        group_freqs: float [G] f_g.
        batch: B.
        rng: Generator (aggregators; representative cell in ``ref`` mode).
        slip_support: bool [E, D] Node-Balance support for ``hybrid_ref_slip`` (Q13).

    Returns:
        ``compute_us``, ``comm_us``, ``total_us`` (t_comp + t_comm_moe), ``nm_us`` and details.

    Raises:
        ConfigError: ``hybrid_ref_slip`` is set but ``slip_support`` is missing.
    """
    conv = sim.conv
    groups = np.asarray(groups, dtype=np.int64)
    full = layer_placement(hybrid.P_layer, hybrid.pi_layer, layer, "hybrid")
    if conv.hybrid_eval == "des":
        res = sim.layer_static(full, layer, freqs, groups, group_freqs, batch, rng=rng)
        return {"compute_us": res.t_comp_s * 1e6, "comm_us": res.t_comm_moe_s * 1e6,
                "total_us": (res.t_comp_s + res.t_comm_moe_s) * 1e6, "nm_us": res.t_nm_s * 1e6,
                "dispatch_us": res.t_dispatch_s * 1e6, "combine_us": res.t_combine_s * 1e6,
                "eval": "des"}
    # "ref": representative-cluster DES plus the analytic term (§9.3)
    X, Y = sim.topology.grid_shape
    R = int(hybrid.region_of_cluster.max()) + 1
    rs, cs = region_split(R)
    h, w = X // rs, Y // cs
    dr, dc = int(rng.integers(h)), int(rng.integers(w))
    reps = np.array([(a * h + dr) * Y + (b * w + dc) for a in range(rs) for b in range(cs)])
    E, D = hybrid.P_layer.shape
    P_rep = np.zeros((E, D))
    P_rep[np.arange(E), reps[hybrid.region_of_expert]] = 1.0
    rep = sim.layer_static(layer_placement(P_rep, hybrid.pi_layer, layer, "hybrid-rep"), layer,
                           freqs, groups, group_freqs, batch, rng=rng)
    t_comp = float(perf.t_comp_static(hybrid.P_layer, freqs, batch, sim.model, sim.hw, conv))
    support = hybrid.P_layer > 0
    if conv.hybrid_ref_slip:
        if slip_support is None:
            raise ConfigError("hybrid_ref_slip=True needs the Node-Balance support "
                              "(slip_support)")
        support = np.asarray(slip_support, dtype=bool)
    t_an, _ = perf.analytic_comm_static(support, groups, group_freqs, batch,
                                        sim.model.hidden_size, conv.kappa_a,
                                        sim.topology.bw_end_Bps)
    comm = rep.t_comm_moe_s + 2.0 * t_an
    return {"compute_us": t_comp * 1e6, "comm_us": comm * 1e6,
            "total_us": (t_comp + comm) * 1e6, "nm_us": sim.nonmoe(batch, layer).total_s * 1e6,
            "rep_des_us": rep.t_comm_moe_s * 1e6, "analytic_us": 2.0 * t_an * 1e6,
            "rep_cell": [dr, dc], "slip": bool(conv.hybrid_ref_slip), "eval": "ref"}
