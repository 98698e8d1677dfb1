"""Link Balance: the logical→physical mapping of one layer (paper-model.md §8).

Decision (§8.1): a bijection π from the D logical clusters to the D endpoints; endpoint ids are
row·Y + col of the topology's endpoint grid (mesh, torus, and the fat-tree's numbering, §8.4).

Objective (§8.2): the static-task-set DES makespan of the layer's support — one message per group
and source endpoint of size f_g·B·h·b_msg — in one direction (the combine phase), not doubled, in
every profile; ``phases=("dispatch", "combine")`` optimises exactly what the ``faithful``
evaluator charges, at twice the cost per evaluation. Shares do not matter, only which clusters
hold which experts. Aggregators are
logical clusters and do not depend on the mapping, so ``lb_noise = "crn"`` (``faithful``) draws
them once per layer (common random numbers: a deterministic objective); ``"redraw"`` (``paper*``,
quirk Q12) draws them again at every evaluation. The ``mst`` proxy (§8.3) is the
frequency-weighted mean, over groups touching ≥ 2 clusters, of the minimum-spanning-tree length
of the group's endpoints, with distances = hops weighted by inverse relative link bandwidth
(Manhattan distance on a mesh).

Energy objectives (docs/PHYSICS.md §18): the mapping changes two parts of a layer's
energy, the NoC bits and the time the layer takes (static power of every node); DRAM bytes and
MACs do not depend on it. ``objective="energy"`` scores a mapping by both, from the same DES
run: 8·e_hop·Σ_links busy time × bandwidth (= Σ_messages bytes · hops · e_hop, exact whatever
the switching, ``cost.energy.link_byte_hops``) + P_static·D·makespan, in joules;
``objective="edp"`` by that energy × the makespan (J·s: the product of what the mapping
changes, not the layer's EDP). ``mst`` is a latency proxy and accepts only
``objective="latency"``.

Optimisers, behind one interface (``link_balance``), each returning the best *evaluated* mapping
(never worse than the start π0 as evaluated during the search), the history of objective values
and a record naming the optimiser and its budget:

* ``bo`` — Gaussian-process BO with scikit-optimize ``gp_minimize`` (§8.2): 2·D continuous
  coordinates (x_d ∈ [0, X−1], y_d ∈ [0, Y−1]), decoded by a linear assignment
  (``scipy.optimize.linear_sum_assignment``) on the cost |x_d − gx| + |y_d − gy|; ``x0`` = the
  start mapping's coordinates (decodes back to π0 exactly); ``n_calls`` 70, ``n_initial_points``
  10; ``random_state`` from the layer's spawned seed; BLAS limited to one thread
  (``threadpoolctl``); ``acq_optimizer="sampling"`` with 1,000 candidate points. [decision] For
  speed the GP uses one isotropic Matérn-5/2 length scale (times a constant, Gaussian noise,
  ``gp_hedge`` acquisition as in the defaults): the default anisotropic kernel fits 2·D + 2
  hyper-parameters every iteration and made a 70-call run on 4×8 take ≈ 45 s instead of ≈ 6 s
  (``gp_kernel="default"`` restores it).
  Falls back to ``random`` search (flagged) when scikit-optimize is missing.
* ``local`` — swap local search: swap the endpoints of two clusters, keep the swap if the
  objective improves; half of the pairs involve a cluster at an end of the busiest link.
* ``anneal`` — the same moves with acceptance exp(−Δ/T), T₀ = ``t0_factor``·f(π0) [decision: the
  reference's T₀ = 1000 was on a proxy cost of another scale], T ← 0.99·T per step.
* ``random`` — uniformly random permutations from the package RNG.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.noc import linksim
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled

if TYPE_CHECKING:
    from hdamoe_env.sim.simulator import MoESimulator
    from hdamoe_env.noc.topology import Topology

__all__ = [
    "LB_METHODS",
    "LB_OBJECTIVES",
    "PLACE_OBJECTIVES",
    "LinkBalanceResult",
    "MappingObjective",
    "decode_coordinates",
    "endpoint_distances",
    "link_balance",
    "mapping_coordinates",
    "mst_cost",
]

LB_METHODS = ("bo", "local", "anneal", "random")
LB_OBJECTIVES = ("des", "mst")
#: What a placement minimises (``hdamoe place --objective``): the MoE latency (the paper's),
#: the energy of the layer, or energy × delay (docs/PHYSICS.md §18).
PLACE_OBJECTIVES = ("latency", "energy", "edp")
_EXTRA = 'pip install "hdamoe-env[opt]"'


# --------------------------------------------------------------------------------------------
# objectives


def endpoint_distances(topology: Topology) -> NDArray[np.float64]:
    """Return float [N, N] route lengths in hops weighted by inverse relative link bandwidth.

    On a mesh this is the Manhattan distance; on a torus the wrap-around distance; on the
    fat-tree the hop count of the first candidate route (tiers with less bandwidth count more).
    """
    n = topology.num_endpoints
    bw_ref = float(topology.link_bw_Bps.max())
    weight = bw_ref / topology.link_bw_Bps
    dist = np.zeros((n, n))
    for s in range(n):
        for d in range(n):
            if s != d:
                dist[s, d] = float(weight[topology.candidates(s, d)[0]].sum())
    return dist


def _mst_length(points: NDArray[np.int64], dist: NDArray[np.float64]) -> float:
    """Prim's algorithm on the complete graph of ``points`` under ``dist``."""
    m = points.size
    if m < 2:
        return 0.0
    sub = dist[np.ix_(points, points)]
    in_tree = np.zeros(m, dtype=bool)
    in_tree[0] = True
    best = sub[0].copy()
    total = 0.0
    for _ in range(m - 1):
        best_masked = np.where(in_tree, np.inf, best)
        j = int(np.argmin(best_masked))
        total += float(best_masked[j])
        in_tree[j] = True
        best = np.minimum(best, sub[j])
    return total


def mst_cost(support: NDArray[np.bool_], groups: NDArray[np.int64],
             group_freqs: NDArray[np.float64], pi: NDArray[np.int64],
             dist: NDArray[np.float64]) -> float:
    """Return the ``mst`` proxy of a mapping (§8.3).

    Frequency-weighted mean, over the groups that touch ≥ 2 clusters, of the MST length of the
    endpoints of the clusters holding (a shard of) any of the group's experts.

    Args:
        support: bool [E, D] holders (P > 0; split experts count on every holder).
        groups: int [G, k].
        group_freqs: float [G].
        pi: int [D] endpoint of every cluster.
        dist: float [N, N] endpoint distances (:func:`endpoint_distances`).
    """
    support = np.asarray(support, dtype=bool)
    pi = np.asarray(pi, dtype=np.int64)
    total = weight = 0.0
    for g, fg in zip(np.asarray(groups, dtype=np.int64), group_freqs, strict=True):
        clusters = np.flatnonzero(support[g[g >= 0]].any(axis=0))
        if clusters.size >= 2:
            total += float(fg) * _mst_length(pi[clusters], dist)
            weight += float(fg)
    return total / weight if weight > 0 else 0.0


class MappingObjective:
    """The Link-Balance objective of one layer: a mapping π [D] → seconds (or proxy units).

    Args:
        sim: Simulator (topology, conventions, hardware, message bytes per token).
        support: bool [E, D] holders of the layer's Node-Balance placement.
        groups: int [G, k] co-activation groups.
        group_freqs: float [G] their frequencies.
        batch: B.
        layer: MoE layer index (enters the route flow keys).
        rng: Generator for the aggregator draws.
        kind: ``"des"`` or ``"mst"``.
        phases: DES phases (default ``("combine",)``, one direction, §8.2).
        agg: Aggregator cluster per group (int [G]); drawn with ``rng`` when None. Used for
            every evaluation under ``lb_noise = "crn"``.
        objective: ``"latency"`` (the makespan, s), ``"energy"`` (the NoC energy of the DES
            run plus the static energy of all nodes over its makespan, J) or ``"edp"`` (that
            energy × the makespan, J·s); ``des`` only.

    Raises:
        ConfigError: Unknown kind or objective, or ``mst`` with an energy objective.
    """

    def __init__(self, sim: MoESimulator, support: NDArray[np.bool_], groups: NDArray[np.int64],
                 group_freqs: NDArray[np.float64], batch: int, layer: int,
                 rng: np.random.Generator, *, kind: str = "des",
                 phases: Sequence[str] | None = None,
                 agg: NDArray[np.int64] | None = None, objective: str = "latency") -> None:
        if kind not in LB_OBJECTIVES:
            raise ConfigError(f"unknown Link-Balance objective {kind!r}; expected one of "
                              f"{list(LB_OBJECTIVES)}")
        if objective not in PLACE_OBJECTIVES:
            raise ConfigError(f"unknown placement objective {objective!r}; expected one of "
                              f"{list(PLACE_OBJECTIVES)}")
        if kind == "mst" and objective != "latency":
            raise ConfigError(f"the mst proxy scores latency only; use kind='des' with "
                              f"objective={objective!r}")
        self.sim = sim
        self.kind = kind
        self.objective = objective
        self.support = np.asarray(support, dtype=bool)
        self.groups = np.asarray(groups, dtype=np.int64)
        self.group_freqs = np.asarray(group_freqs, dtype=np.float64)
        self.layer = int(layer)
        self.rng = rng
        conv = sim.conv
        self.phases = ("combine",) if phases is None else tuple(phases)
        self.redraw = conv.lb_noise == "redraw"
        self.msg = self.group_freqs * batch * sim.msg_bytes
        self.agg = agg if agg is not None else linksim.choose_aggregators(
            self.groups, self.support, conv.aggregator, rng)
        self.holders = linksim.HolderTable.from_shares(self.support)  # re-draws skip validation
        self.dist = endpoint_distances(sim.topology) if kind == "mst" else None
        self.evaluations = 0
        self.last_link_busy: NDArray[np.float64] | None = None
        self._j_per_byte_hop = self._static_w = 0.0
        if objective != "latency":
            from hdamoe_env.cost import energy

            self._j_per_byte_hop = float(energy.noc_energy_j(1.0, sim.energy_spec))
            self._static_w = float(energy.static_energy_j(1.0, sim.hw.num_nodes,
                                                          sim.energy_spec))

    @property
    def deterministic(self) -> bool:
        """Whether equal mappings always score equally (no aggregator re-draws)."""
        return self.kind == "mst" or not self.redraw

    def __call__(self, pi: NDArray[np.int64]) -> float:
        """Return the objective of mapping ``pi`` (``des``: s, J or J·s by ``objective``)."""
        self.evaluations += 1
        pi = np.asarray(pi, dtype=np.int64)
        if self.kind == "mst":
            assert self.dist is not None
            return mst_cost(self.support, self.groups, self.group_freqs, pi, self.dist)
        agg = self.agg
        if self.redraw:
            agg = linksim.choose_aggregators(self.groups, self.holders, self.sim.conv.aggregator,
                                             self.rng)
        conv = self.sim.conv
        res = linksim.simulate_layer_comm(
            self.sim.topology, self.groups, self.msg, self.support, pi, agg, phases=self.phases,
            tie_break=conv.tie_break, hop_latency_s=self.sim.hw.hop_latency_for(conv),
            layer=self.layer, chunks=conv.chunks, alpha_s=conv.msg_alpha_s,
            switching=conv.switching, ni_bw_Bps=conv.ni_bw_for(self.sim.topology.bw_end_Bps),
            ni_latency_s=conv.ni_latency_for(self.sim.hw.hop_latency_for(conv)))
        self.last_link_busy = res.link_busy_s.sum(axis=0)
        if self.objective == "latency":
            return res.total_s
        joules = float(np.dot(self.last_link_busy, self.sim.topology.link_bw_Bps)
                       ) * self._j_per_byte_hop + self._static_w * res.total_s
        return joules if self.objective == "energy" else joules * res.total_s


# --------------------------------------------------------------------------------------------
# encoding


def mapping_coordinates(pi: NDArray[np.int64], coords: NDArray[np.int64]) -> list[float]:
    """Return the BO point [x_0, y_0, x_1, y_1, …] (grid row, column of every cluster)."""
    xy = np.asarray(coords)[np.asarray(pi, dtype=np.int64)]
    return [float(v) for v in xy.reshape(-1)]


def decode_coordinates(point: Sequence[float], coords: NDArray[np.int64]) -> NDArray[np.int64]:
    """Decode 2·D desired coordinates into a mapping by linear assignment (§8.2).

    Args:
        point: [x_0, y_0, …, x_{D−1}, y_{D−1}].
        coords: int [N, 2] (row, col) of every endpoint (N = D).

    Returns:
        int64 [D] permutation: π[d] = endpoint of cluster d.

    Raises:
        DependencyNotInstalled: scipy is missing.
    """
    try:
        from scipy.optimize import linear_sum_assignment
    except ImportError as exc:
        raise DependencyNotInstalled(f"scipy is missing (Link-Balance decoding); run "
                                     f"`{_EXTRA}`") from exc
    want = np.asarray(point, dtype=np.float64).reshape(-1, 2)
    grid = np.asarray(coords, dtype=np.float64)
    cost = np.abs(want[:, None, 0] - grid[None, :, 0]) + np.abs(want[:, None, 1] - grid[None, :, 1])
    rows, cols = linear_sum_assignment(cost)
    pi = np.empty(want.shape[0], dtype=np.int64)
    pi[rows] = cols
    return pi


# --------------------------------------------------------------------------------------------
# optimisers


@dataclass(frozen=True)
class LinkBalanceResult:
    """Result of Link Balance for one layer.

    Attributes:
        pi: int64 [D] best evaluated mapping.
        objective: Its objective value (seconds for ``des``).
        x0_objective: Objective of the start mapping as evaluated during the search.
        history: Objective of every evaluation in order (the first is the start).
        record: Optimiser name, budget, evaluations, wall time, fallback flags.
    """

    pi: NDArray[np.int64]
    objective: float
    x0_objective: float
    history: list[float] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)


class _Tracker:
    """Evaluate mappings, cache deterministic ones, remember the best."""

    def __init__(self, objective: Callable[[NDArray[np.int64]], float], cache: bool) -> None:
        self.objective = objective
        self.cache: dict[bytes, float] | None = {} if cache else None
        self.history: list[float] = []
        self.best_pi: NDArray[np.int64] | None = None
        self.best = math.inf

    def __call__(self, pi: NDArray[np.int64]) -> float:
        key = np.asarray(pi, dtype=np.int64).tobytes()
        if self.cache is not None and key in self.cache:
            value = self.cache[key]
        else:
            value = float(self.objective(pi))
            if self.cache is not None:
                self.cache[key] = value
        self.history.append(value)
        if value < self.best:
            self.best = value
            self.best_pi = np.array(pi, dtype=np.int64)
        return value


def _seed_int(seed: int | np.random.SeedSequence) -> int:
    ss = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
    return int(ss.generate_state(1)[0] % (2**31 - 1))


def _swap_pair(rng: np.random.Generator, D: int, objective: Any, pi: NDArray[np.int64],
               topology: Topology | None) -> tuple[int, int]:
    """Draw two clusters to swap: uniform, or (half the time) one at the busiest link."""
    busy = getattr(objective, "last_link_busy", None)
    if topology is not None and busy is not None and busy.size and rng.random() < 0.5:
        link = int(np.argmax(busy))
        ends = [int(topology.link_src[link]), int(topology.link_dst[link])]
        ends = [e for e in ends if e < D]
        if ends:
            endpoint = ends[int(rng.integers(len(ends)))]
            a = int(np.flatnonzero(pi == endpoint)[0])
            b = int(rng.integers(D - 1))
            return a, b + (b >= a)
    a, b = rng.choice(D, size=2, replace=False)
    return int(a), int(b)


def link_balance(objective: Callable[[NDArray[np.int64]], float], pi0: NDArray[np.int64],
                 coords: NDArray[np.int64], *, method: str = "bo", n_calls: int = 70,
                 n_initial_points: int = 10, seed: int | np.random.SeedSequence = 0,
                 acq_optimizer: str = "sampling", n_points: int = 1000,
                 gp_kernel: str = "isotropic", t0_factor: float = 0.05,
                 cooling: float = 0.99, topology: Topology | None = None) -> LinkBalanceResult:
    """Optimise the logical→physical mapping of one layer (§8.2–8.3).

    Args:
        objective: Mapping → cost (a :class:`MappingObjective`, or any callable).
        pi0: int [D] start mapping (the random mapping of the γ fit).
        coords: int [D, 2] grid (row, col) of every endpoint.
        method: ``"bo"``, ``"local"``, ``"anneal"`` or ``"random"``.
        n_calls: Evaluation budget, the start included (70 in the paper).
        n_initial_points: Random points before the GP model is used (BO).
        seed: Seed of the optimiser (a spawned per-layer stream).
        acq_optimizer: scikit-optimize acquisition optimiser (``"sampling"`` or ``"lbfgs"``).
        n_points: Candidate points of the acquisition optimiser.
        gp_kernel: ``"isotropic"`` (one Matérn length scale) or ``"default"`` (skopt's).
        t0_factor: Annealing T₀ as a fraction of f(π0).
        cooling: Annealing factor per step.
        topology: Enables busiest-link-targeted swaps in ``local``/``anneal``.

    Returns:
        The best evaluated mapping with the history and the record.

    Raises:
        ConfigError: Unknown method or invalid budget.
    """
    if method not in LB_METHODS:
        raise ConfigError(f"unknown Link-Balance method {method!r}; expected one of "
                          f"{list(LB_METHODS)}")
    if n_calls < 1:
        raise ConfigError(f"n_calls must be >= 1, got {n_calls}")
    pi0 = np.asarray(pi0, dtype=np.int64)
    D = pi0.size
    coords = np.asarray(coords, dtype=np.int64)
    if coords.shape != (D, 2) or not np.array_equal(np.sort(pi0), np.arange(D)):
        raise ConfigError(f"pi0 must be a permutation of 0..{D - 1} and coords [D, 2]; got "
                          f"pi0 {pi0.tolist()} and coords {coords.shape}")
    t_start = time.perf_counter()
    deterministic = bool(getattr(objective, "deterministic", True))
    track = _Tracker(objective, cache=deterministic)
    rng = np.random.default_rng(seed)
    record: dict[str, Any] = {"method": method, "optimiser": method, "n_calls": int(n_calls),
                              "objective_kind": getattr(objective, "kind", "custom"),
                              "objective": getattr(objective, "objective", "latency"),
                              "deterministic_objective": deterministic, "flags": []}
    x0_value = track(pi0)
    if D < 2 or n_calls == 1:
        pass
    elif method == "bo":
        try:
            _bayesian(track, pi0, coords, n_calls, n_initial_points, seed, acq_optimizer,
                      n_points, gp_kernel, record)
        except DependencyNotInstalled as exc:
            record["flags"].append(f"scikit-optimize unavailable ({exc}); random-search fallback")
            record["optimiser"] = "random"
            _random_search(track, D, n_calls - 1, rng)
    elif method == "random":
        _random_search(track, D, n_calls - 1, rng)
    else:
        _swap_search(track, objective, pi0, n_calls - 1, rng, anneal=method == "anneal",
                     t0=t0_factor * x0_value, cooling=cooling, topology=topology)
    assert track.best_pi is not None
    record.update(evaluations=len(track.history), wall_s=time.perf_counter() - t_start,
                  x0_objective=x0_value, best_objective=track.best,
                  improvement=(x0_value - track.best) / x0_value if x0_value > 0 else 0.0)
    return LinkBalanceResult(track.best_pi, track.best, x0_value, list(track.history), record)


def _random_search(track: _Tracker, D: int, budget: int, rng: np.random.Generator) -> None:
    for _ in range(budget):
        track(rng.permutation(D).astype(np.int64))


def _swap_search(track: _Tracker, objective: Any, pi0: NDArray[np.int64], budget: int,
                 rng: np.random.Generator, *, anneal: bool, t0: float, cooling: float,
                 topology: Topology | None) -> None:
    D = pi0.size
    current = pi0.copy()
    current_value = track.history[0]
    temperature = t0
    for _ in range(budget):
        a, b = _swap_pair(rng, D, objective, current, topology)
        cand = current.copy()
        cand[a], cand[b] = cand[b], cand[a]
        value = track(cand)
        delta = value - current_value
        accept = delta < 0 or (anneal and temperature > 0
                               and rng.random() < math.exp(-delta / temperature))
        if accept:
            current, current_value = cand, value
        temperature *= cooling


def _bayesian(track: _Tracker, pi0: NDArray[np.int64], coords: NDArray[np.int64], n_calls: int,
              n_initial_points: int, seed: int | np.random.SeedSequence, acq_optimizer: str,
              n_points: int, gp_kernel: str, record: dict[str, Any]) -> None:
    try:
        import skopt
        from skopt.space import Real
    except ImportError as exc:
        raise DependencyNotInstalled(f"scikit-optimize is missing; run `{_EXTRA}`") from exc
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl comes with scikit-learn
        threadpool_limits = None
    X = int(coords[:, 0].max()) if coords.size else 0
    Y = int(coords[:, 1].max()) if coords.size else 0
    dims = []
    for _ in range(pi0.size):
        dims.append(Real(0.0, float(max(X, 1)), name=None))
        dims.append(Real(0.0, float(max(Y, 1)), name=None))
    x0 = mapping_coordinates(pi0, coords)

    def func(point: list[float]) -> float:
        return track(decode_coordinates(point, coords))

    random_state = _seed_int(seed)
    # x0 is evaluated by the tracker already (first history entry); hand its value to skopt so
    # that the budget is x0 + n_initial_points random + model-guided points = n_calls.
    kwargs = dict(dimensions=dims, n_calls=max(n_calls - 1, 1),
                  n_initial_points=min(n_initial_points, max(n_calls - 1, 1)), x0=[x0],
                  y0=[track.history[0]], random_state=random_state, acq_optimizer=acq_optimizer,
                  n_points=int(n_points))
    if gp_kernel == "isotropic":
        from skopt.learning import GaussianProcessRegressor
        from skopt.learning.gaussian_process.kernels import ConstantKernel, Matern

        kernel = ConstantKernel(1.0, (0.01, 1000.0)) * Matern(
            length_scale=1.0, length_scale_bounds=(0.01, 100.0), nu=2.5)
        kwargs["base_estimator"] = GaussianProcessRegressor(
            kernel=kernel, normalize_y=True, noise="gaussian", n_restarts_optimizer=2,
            random_state=random_state)
    elif gp_kernel != "default":
        raise ConfigError(f"gp_kernel={gp_kernel!r}; expected 'isotropic' or 'default'")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "objective has been evaluated at point before"
        if threadpool_limits is not None:
            with threadpool_limits(1):
                skopt.gp_minimize(func, **kwargs)
        else:
            skopt.gp_minimize(func, **kwargs)
    record.update(random_state=random_state, acq_optimizer=acq_optimizer, n_points=int(n_points),
                  gp_kernel=gp_kernel, n_initial_points=int(n_initial_points))
