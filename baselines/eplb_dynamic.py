"""Dynamic EPLB: periodic rebalancing of redundant experts and the NoC cost of its weight moves.

The method ``eplb-dynamic`` (:func:`eplb_dynamic`): every N steps EPLB re-runs on the
loads of the last N steps. Node labels of a new assignment are interchangeable (within a node
group), so [decision] they are relabelled by a maximum-overlap assignment with the old holdings
(Hungarian method, scipy); then a copy the new placement keeps on a node is not moved, every new
copy is one move (expert, source node holding it in the old placement — the one fewest hops away
when a topology is given —, destination node), and copies the new placement drops are discarded
for free. :func:`move_messages` / :func:`simulate_moves` turn the moves into DES messages of
W_e bytes each (``hdamoe_env.noc.des.simulate_messages``) so a benchmark can charge their makespan.

The copies, their replication and packing are those of ``baselines.eplb``; the env wrapper that
rebalances inside an episode is ``baselines.rebalance.EplbRebalanceWrapper``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from baselines.eplb import FLOOR_TOLERANCE, EplbResult, eplb, eplb_placement, replicate
from hdamoe_env.noc.des import DesResult, simulate_messages
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled
from hdamoe_env.sim.placement import Placement, identity_mapping
from hdamoe_env.noc.topology import Topology

__all__ = [
    "REBALANCE_MODES",
    "EplbSchedule",
    "Move",
    "apply_moves",
    "check_rebalance_options",
    "eplb_dynamic",
    "move_messages",
    "plan_moves",
    "rebalance",
    "result_of",
    "simulate_moves",
]


# --------------------------------------------------------------------------------------------
# dynamic rebalancing


@dataclass(frozen=True, slots=True)
class Move:
    """One whole-expert weight copy between nodes (logical cluster ids)."""

    layer: int
    expert: int
    src: int
    dst: int


def _relabel(old: NDArray[np.bool_], new: NDArray[np.bool_], G: int) -> NDArray[np.bool_]:
    """Permute the node labels of ``new`` [E, D] (within node groups) to overlap ``old`` most."""
    try:
        from scipy.optimize import linear_sum_assignment
    except ImportError as exc:  # pragma: no cover - scipy ships with the opt extra
        raise DependencyNotInstalled('scipy is missing; run `pip install "hdamoe-env[opt]"`'
                                     ) from exc
    D = old.shape[1]
    overlap = new.T.astype(np.int64) @ old.astype(np.int64)     # [new node, old node]
    block = np.arange(D) // (D // G)
    overlap = np.where(block[:, None] == block[None, :], overlap, -(old.size + 1))
    rows, cols = linear_sum_assignment(overlap, maximize=True)
    out = np.zeros_like(new)
    out[:, cols] = new[:, rows]
    return out


def plan_moves(old_holds: ArrayLike, new_holds: ArrayLike, *, topology: Topology | None = None,
               pi: ArrayLike | None = None) -> list[Move]:
    """Return the weight moves that turn ``old_holds`` into ``new_holds`` (copies kept in place).

    Every copy in ``new`` but not in ``old`` is one move from a node holding the expert in
    ``old``: the one with the fewest hops to the destination when ``topology`` is given (ties:
    the lower node), else the lowest-numbered one. Copies in ``old`` but not in ``new`` are
    dropped (no message).

    Args:
        old_holds: bool [L, E, D] copies before.
        new_holds: bool [L, E, D] copies after (every expert has ≥ 1 copy in both).
        topology: Optional NoC for the nearest source.
        pi: int [L, D] cluster → endpoint (None: identity).

    Returns:
        The moves, ordered by layer, expert, destination.
    """
    old = np.asarray(old_holds, dtype=bool)
    new = np.asarray(new_holds, dtype=bool)
    if old.shape != new.shape or old.ndim != 3:
        raise ConfigError(f"old and new holdings must both be bool [L, E, D], got {old.shape} "
                          f"and {new.shape}")
    L, _, D = old.shape
    mapping = identity_mapping(L, D) if pi is None else np.asarray(pi, dtype=np.int64)
    moves: list[Move] = []
    for layer, expert, dst in np.argwhere(new & ~old):
        sources = np.flatnonzero(old[layer, expert])
        if sources.size == 0:
            raise ConfigError(f"expert {expert} of layer {layer} has no copy in the old "
                              "placement; every expert must be held before and after")
        src = int(sources[0])
        if topology is not None:
            hops = [topology.route(int(mapping[layer, s]), int(mapping[layer, dst])).size
                    for s in sources]
            src = int(sources[int(np.argmin(hops))])
        moves.append(Move(int(layer), int(expert), src, int(dst)))
    return moves


def apply_moves(old_holds: ArrayLike, moves: Sequence[Move], drop: ArrayLike) -> NDArray[np.bool_]:
    """Return the holdings after ``moves`` (copies added) and ``drop`` (bool [L, E, D] removed).

    Raises:
        ConfigError: A move's source does not hold the expert or its destination already does.
    """
    holds = np.array(old_holds, dtype=bool)
    before = holds.copy()
    for m in moves:
        if not before[m.layer, m.expert, m.src] or holds[m.layer, m.expert, m.dst]:
            raise ConfigError(f"invalid move {m}: the source must hold the expert and the "
                              "destination must not")
        holds[m.layer, m.expert, m.dst] = True
    return holds & ~np.asarray(drop, dtype=bool)


@dataclass(frozen=True)
class EplbSchedule:
    """Placements of periodic EPLB rebalancing and the moves between them.

    Attributes:
        starts: Step at which each placement takes effect (starts[0] = 0).
        placements: One placement per start.
        results: The :class:`EplbResult` of each placement.
        moves: ``moves[k]`` turns placement k into placement k + 1 (len = len(placements) − 1).
    """

    starts: tuple[int, ...]
    placements: tuple[Placement, ...]
    results: tuple[EplbResult, ...]
    moves: tuple[tuple[Move, ...], ...]


REBALANCE_MODES = ("incremental", "full")


def check_rebalance_options(mode: str, min_gain: float) -> None:
    """Validate a rebalance mode and gain threshold (:func:`rebalance`).

    Raises:
        ConfigError: Unknown mode, or min_gain outside [0, 1).
    """
    if mode not in REBALANCE_MODES:
        raise ConfigError(f"unknown rebalance mode {mode!r}; expected one of "
                          f"{list(REBALANCE_MODES)}")
    if not 0.0 <= float(min_gain) < 1.0:
        raise ConfigError(f"min_gain={min_gain!r} must lie in [0, 1) (a relative load drop)")


def _node_loads(holds: NDArray[np.bool_], per_copy: NDArray[np.float64]) -> NDArray[np.float64]:
    out: NDArray[np.float64] = per_copy @ holds.astype(np.float64)
    return out


def _free_slot_for(holds: NDArray[np.bool_], i: int, S: int, load: NDArray[np.float64]) -> bool:
    """Move one copy of another expert j from a full node lacking i to a free node lacking j.

    The free slots all sit on nodes that already hold expert i; this relocation (one extra
    move) opens a slot where i may go. Returns False when no such j exists.
    """
    used = holds.sum(axis=0)
    free = np.flatnonzero(used < S)
    full = np.flatnonzero((used >= S) & ~holds[i])
    for dst in free[np.argsort(load[free], kind="stable")]:
        for src in full[np.argsort(load[full], kind="stable")]:
            for j in np.flatnonzero(holds[:, src] & ~holds[:, dst]):
                holds[j, src], holds[j, dst] = False, True
                return True
    return False


def _incremental_layer(old: NDArray[np.bool_], f: NDArray[np.float64], S: int, max_swaps: int,
                       min_gain: float) -> NDArray[np.bool_]:
    """One layer of the incremental rebalance (:func:`eplb_dynamic`, ``mode="incremental"``).

    Returns the new holdings [E, D]; ``old`` itself when the gain is below ``min_gain``.
    """
    E, D = old.shape
    c_old = old.sum(axis=1)
    max_before = float(_node_loads(old, f / c_old).max())
    c_new = replicate(f, int(c_old.sum()), D)
    holds = old.copy()
    w = f / c_new                                              # target load per copy
    # 1. drop surplus copies, each from the most loaded node holding one
    for i in np.flatnonzero(c_old > c_new):
        for _ in range(int(c_old[i] - c_new[i])):
            load = _node_loads(holds, w)
            nodes = np.flatnonzero(holds[i])
            holds[i, nodes[int(np.argmax(load[nodes]))]] = False
    # 2. add the missing copies, heaviest first, each to the least-loaded node with a free slot
    add = np.flatnonzero(c_new > c_old)
    for i in add[np.lexsort((add, -w[add]))]:
        for _ in range(int(c_new[i] - c_old[i])):
            load = _node_loads(holds, w)
            ok = (holds.sum(axis=0) < S) & ~holds[i]
            if not ok.any() and not _free_slot_for(holds, i, S, load):
                return old                                     # no valid slot: keep the old
            ok = (holds.sum(axis=0) < S) & ~holds[i]
            holds[i, int(np.argmin(np.where(ok, load, np.inf)))] = True
    # 3. greedy swaps between the most and the least loaded node while the maximum drops
    for _ in range(int(max_swaps)):
        load = _node_loads(holds, w)
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        a_list = np.flatnonzero(holds[:, hi] & ~holds[:, lo])
        b_list = np.flatnonzero(holds[:, lo] & ~holds[:, hi])
        if a_list.size == 0:
            break
        best, pair = load[hi], None
        for a in a_list:                                       # move a (and b back, if any)
            for b in [-1, *b_list.tolist()]:
                wb = 0.0 if b < 0 else w[b]
                if b < 0 and holds[:, lo].sum() >= S:
                    continue
                peak = max(load[hi] - w[a] + wb, load[lo] + w[a] - wb)
                if peak < best - FLOOR_TOLERANCE:
                    best, pair = peak, (int(a), int(b))
        if pair is None:
            break
        a, b = pair
        holds[a, hi], holds[a, lo] = False, True
        if b >= 0:
            holds[b, lo], holds[b, hi] = False, True
    max_after = float(_node_loads(holds, w).max())
    if max_before <= 0 or (max_before - max_after) / max_before < min_gain:
        return old
    return holds


def rebalance(current: EplbResult, loads: ArrayLike, *, mode: str = "incremental",
              min_gain: float = 0.02, max_swaps: int = 4,
              num_expert_groups: int | None = None) -> EplbResult:
    """Re-place the copies of ``current`` for new loads (one rebalance of :func:`eplb_dynamic`).

    Args:
        current: The copies in effect.
        loads: float [L, E] loads of the last window.
        mode: ``"incremental"`` or ``"full"`` (:func:`eplb_dynamic`).
        min_gain: Incremental: smallest relative drop of a layer's max node load worth moving.
        max_swaps: Incremental: greedy move/swap rounds per layer.
        num_expert_groups: Full mode: as :func:`eplb`.

    Returns:
        The new copies (same S and node groups); :func:`plan_moves` gives the weight moves.

    Raises:
        ConfigError: Unknown mode, min_gain outside [0, 1) or loads of the wrong shape.
    """
    check_rebalance_options(mode, min_gain)
    window = np.asarray(loads, dtype=np.float64)
    window = window[None, :] if window.ndim == 1 else window
    old = current.holds
    if window.shape != old.shape[:2] or not np.all(np.isfinite(window)) or (window < 0).any():
        raise ConfigError(f"rebalance loads must be finite, >= 0, of shape {old.shape[:2]}; "
                          f"got shape {np.shape(loads)}")
    S, G = int(current.slots_per_node), int(current.num_node_groups)
    if mode == "incremental" and G == 1:
        holds = np.stack([_incremental_layer(old[layer], window[layer], S, int(max_swaps),
                                             float(min_gain)) for layer in range(old.shape[0])])
        return EplbResult(holds.sum(axis=2).astype(np.int64), holds, window.copy(), S, G,
                          current.node_group_of_expert)
    res = eplb(window, old.shape[2], S, num_node_groups=G, num_expert_groups=num_expert_groups)
    holds = np.stack([_relabel(old[layer], res.holds[layer], G) for layer in range(old.shape[0])])
    return EplbResult(res.counts, holds, res.loads, S, G, res.node_group_of_expert,
                      res.fallback_layers)


def result_of(placement: Placement, loads: ArrayLike | None = None) -> EplbResult:
    """Return the :class:`EplbResult` view of a placement of whole copies (e.g. ``"eplb"``).

    Args:
        placement: A placement whose experts are whole (one-hot P) plus ``replicas``.
        loads: float [L, E] loads to record (None: zeros).

    Raises:
        ConfigError: A sharded expert (a P row that is not one-hot).
    """
    P = placement.P
    if not np.all((P == 0) | (P == 1)):
        raise ConfigError(f"placement {placement.method!r} has sharded experts; EPLB "
                          "rebalancing needs whole copies (an 'eplb' placement)")
    holds = P > 0 if placement.replicas is None else (P > 0) | placement.replicas
    L, E, D = holds.shape
    S = int(placement.meta.get("slots_per_node", int(holds.sum(axis=1).max())))
    G = int(placement.meta.get("num_node_groups", 1))
    f = np.zeros((L, E)) if loads is None else np.asarray(loads, dtype=np.float64)
    return EplbResult(holds.sum(axis=2).astype(np.int64), holds, f, S, G,
                      np.zeros((L, E), dtype=np.int64))


def eplb_dynamic(step_counts: ArrayLike, period: int, num_nodes: int, slots_per_node: int, *,
                 initial_loads: ArrayLike | None = None, num_node_groups: int = 1,
                 num_expert_groups: int | None = None, topology: Topology | None = None,
                 mode: str = "incremental", min_gain: float = 0.02, max_swaps: int = 4
                 ) -> EplbSchedule:
    """Rebalance with EPLB every ``period`` steps on the loads of the last ``period`` steps.

    The placement for steps [0, N) comes from ``initial_loads`` (None: the first window,
    i.e. an oracle start); at every step t = N, 2N, ... < T a new placement is computed from
    ``step_counts[t − N:t]`` and charged with the moves from the previous one.

    Modes:

    * ``"full"``: EPLB from scratch, relabelled to keep copies in place (module docstring).
      Re-running the packing on a new window moves most copies (DeepSeek-V2-Lite, S = 3:
      ≈ 1,500 of 2,496 copies per rebalance, ≈ 30 ms of NoC time).
    * ``"incremental"`` (default) [decision]: per layer, start from the current copies; the
      copy counts are re-derived by the replication rule on the window's loads; surplus copies
      are dropped from the most loaded nodes holding them, missing copies go to the least-loaded
      nodes with a free slot (heaviest expert first), then up to ``max_swaps`` greedy moves /
      swaps between the most and the least loaded node lower the maximum further. A layer keeps
      its old copies unless its expected max node load drops by at least ``min_gain``
      (relative), so a steady load moves nothing. Only for one node group (G = 1); with G > 1
      the full mode is used.

    Args:
        step_counts: float [T, L, E] (or [T, E]) tokens per expert in every step.
        period: N, steps between rebalances (>= 1).
        num_nodes: D.
        slots_per_node: S.
        initial_loads: float [L, E] loads of the first placement.
        num_node_groups: As :func:`eplb`.
        num_expert_groups: As :func:`eplb`.
        topology: Optional NoC, for choosing the nearest move source.
        mode: ``"incremental"`` or ``"full"``.
        min_gain: Incremental: smallest relative drop of a layer's max node load that is worth
            moving weights for.
        max_swaps: Incremental: greedy move/swap rounds per layer and rebalance.

    Returns:
        The schedule.

    Raises:
        ConfigError: Bad shapes, period < 1, unknown mode or min_gain outside [0, 1).
    """
    counts = np.asarray(step_counts, dtype=np.float64)
    counts = counts[:, None, :] if counts.ndim == 2 else counts
    if counts.ndim != 3 or counts.shape[0] < 1:
        raise ConfigError(f"step_counts must be [T, L, E] or [T, E], got {np.shape(step_counts)}")
    if int(period) < 1:
        raise ConfigError(f"period must be >= 1 step, got {period!r}")
    check_rebalance_options(mode, min_gain)
    N, T = int(period), counts.shape[0]
    kw = {"num_node_groups": num_node_groups, "num_expert_groups": num_expert_groups}
    first = counts[:N].sum(axis=0) if initial_loads is None else initial_loads
    results = [eplb(first, num_nodes, slots_per_node, **kw)]
    starts, all_moves = [0], []
    for t in range(N, T, N):
        res = rebalance(results[-1], counts[t - N:t].sum(axis=0), mode=mode, min_gain=min_gain,
                        max_swaps=max_swaps, num_expert_groups=num_expert_groups)
        all_moves.append(tuple(plan_moves(results[-1].holds, res.holds, topology=topology)))
        results.append(res)
        starts.append(t)
    placements = tuple(eplb_placement(r, method="eplb-dynamic", start_step=s, period=N,
                                      rebalance_mode=mode)
                       for r, s in zip(results, starts, strict=True))
    return EplbSchedule(tuple(starts), placements, tuple(results), tuple(all_moves))


# --------------------------------------------------------------------------------------------
# the cost of the moves on the NoC


def move_messages(moves: Sequence[Move], expert_bytes: float, pi: ArrayLike | None = None
                  ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64]]:
    """Return the DES messages of the moves: (src endpoints, dst endpoints, bytes = W_e).

    Args:
        moves: The moves.
        expert_bytes: W_e (:func:`expert_weight_bytes`).
        pi: int [L, D] cluster → endpoint (None: identity).

    Returns:
        int64 [M], int64 [M], float64 [M].
    """
    src = np.array([m.src for m in moves], dtype=np.int64)
    dst = np.array([m.dst for m in moves], dtype=np.int64)
    if pi is not None and moves:
        mapping = np.asarray(pi, dtype=np.int64)
        layers = np.array([m.layer for m in moves], dtype=np.int64)
        src, dst = mapping[layers, src], mapping[layers, dst]
    return src, dst, np.full(src.size, float(expert_bytes))


def simulate_moves(topology: Topology, moves: Sequence[Move], expert_bytes: float, *,
                   pi: ArrayLike | None = None, hop_latency_s: float = 0.0, chunks: int = 1,
                   tie_break: str = "fifo", switching: str = "store_and_forward",
                   ni_bw_Bps: float | None = None,
                   ni_latency_s: float | None = None) -> DesResult:
    """Simulate all moves of one rebalance at once on the NoC with the message DES (§6.3).

    Args:
        topology: The NoC.
        moves: The moves (all layers of one rebalance, all ready at time 0).
        expert_bytes: W_e per move.
        pi: int [L, D] cluster → endpoint (None: identity).
        hop_latency_s: DES hop latency.
        chunks: Split every expert into this many pipelined messages (store-and-forward of a
            whole expert overstates multi-hop moves).
        tie_break: DES tie rule.
        switching: DES switching, ``"store_and_forward"`` or ``"cut_through"``
            (``hdamoe_env.noc.des``; pass the profile's ``conv.switching``).
        ni_bw_Bps: Network-interface port bandwidth (one injection and one ejection port per
            node, ``des.simulate_messages``), or None; pass ``conv.ni_bw_for(BW_end)``.
        ni_latency_s: Port latency, seconds (None: the hop latency); pass
            ``conv.ni_latency_for(hop_latency_s)``.

    Returns:
        The DES result; ``makespan_s`` is the time the rebalance occupies the links.
    """
    src, dst, size = move_messages(moves, expert_bytes, pi)
    return simulate_messages(topology, src, dst, size, tie_break=tie_break,
                             hop_latency_s=hop_latency_s, chunks=chunks, switching=switching,
                             ni_bw_Bps=ni_bw_Bps, ni_latency_s=ni_latency_s)
