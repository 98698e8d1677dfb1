"""EPLB: redundant-expert placement by load, as production MoE serving does it (not in the paper).

Written from the published description of DeepSeek's expert-parallelism load balancer (EPLB);
no code of that repository is used. Vocabulary: a *node* here is one NMP node (a logical cluster
of paper-model.md §1; EPLB's "GPU"), a *node group* a set of nodes that are close in the NoC (a
mesh row or a fat-tree pod; EPLB's "server node"), a *physical expert* one whole copy of a routed
expert, and S the number of physical-expert *slots* per node and layer.

The algorithm, per MoE layer, on the expert loads f [E] (long-term activation frequencies or
counts; only ratios matter):

1. **Replication.** Every expert gets one copy; then, while fewer than D·S copies exist, one more
   copy goes to the expert with the largest load per copy f_i / c_i (ties: the lower expert id).
   [decision] An expert never gets more copies than there are nodes to hold them (D, or the
   nodes of its node group), because no node holds two copies of one expert; when every expert
   has reached that cap (S > E) the remaining slots stay empty.
2. **Balanced packing.** The physical experts, each of load f_i / c_i, are taken in descending
   load (ties: lower expert id); each goes to the least-loaded node (ties: lower node id) that
   still has a free slot and holds no copy of the same expert. Copies of one expert have equal
   loads and are therefore consecutive, so the rule amounts to giving expert i the c_i
   least-loaded nodes with a free slot. [decision] When fewer than c_i nodes have a free slot,
   a copy already placed on a full node that lacks expert i is moved to a free node that lacks
   it (repair swap); if no such swap exists, the layer falls back to the round-robin assignment
   (copy p of the expert-major list on node p mod D: always valid because c_i ≤ D) and the
   result records it. Neither happens on the cases measured in this package.
3. **Hierarchical variant** (``num_node_groups`` > 1): the expert groups (a model's
   group-limited routing groups; [decision] singletons when the model has none, as every model
   of this package) are first packed to node groups by balanced packing with the same number of
   groups per node group (load of a group = Σ of its experts); then steps 1–2 run inside every
   node group with its experts, its D / G nodes and the same S. Every copy of an expert then
   stays inside its node group. With only one node group this is EPLB's global policy.

From the copies a :class:`~hdamoe_env.sim.placement.Placement` (method ``"eplb"``) is built: P is
one-hot at the expert's *primary* copy, [decision] the lowest-numbered node holding a copy, and
``replicas`` marks the other copies. [decision] The mapping is the identity (cluster c on
endpoint c): node groups are contiguous blocks of D / G clusters, which under the identity are
the rows of the mesh (endpoint = row·Y + col) when G = X, so the hierarchical variant keeps an
expert's copies in one mesh row; with G = 1 the choice does not matter for the balance.

Slot budget (paper-model.md §7.3 (10)): with the relative cap ρ_mem a node may hold ρ_mem·E/D
experts per layer, so S = ⌊ρ_mem·E/D⌋; with the absolute cap ``HardwareSpec.node_dram_gib`` a
node holds S whole experts in every one of the L layers, S = ⌊(DRAM − reserved) / (L·W_e)⌋; with
both, the smaller. Whole copies need S ≥ ⌈E/D⌉, otherwise :class:`InfeasibleError`. Without any
cap :data:`DEFAULT_REDUNDANCY` gives S = max(⌈E/D⌉, ⌊1.5·E/D⌋) [decision] (DeepSeek-V2-Lite on
4×8: S = 3, 96 physical experts, 32 redundant; Mixtral: S = 1, 32 physical experts, every
expert ≥ 1 copy and on average 4).

Dynamic variant (``eplb-dynamic``, :func:`eplb_dynamic`): every N steps EPLB re-runs on the
loads of the last N steps. Node labels of a new assignment are interchangeable (within a node
group), so [decision] they are relabelled by a maximum-overlap assignment with the old holdings
(Hungarian method, scipy); then a copy the new placement keeps on a node is not moved, every new
copy is one move (expert, source node holding it in the old placement — the one fewest hops away
when a topology is given —, destination node), and copies the new placement drops are discarded
for free. :func:`move_messages` / :func:`simulate_moves` turn the moves into DES messages of
W_e bytes each (``hdamoe_env.noc.des.simulate_messages``) so a benchmark can charge their makespan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.noc.des import DesResult, simulate_messages
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled, InfeasibleError
from hdamoe_env.sim.placement import Placement, identity_mapping
from hdamoe_env.config.profiles import Conventions
from hdamoe_env.config.specs import HardwareSpec, ModelSpec
from hdamoe_env.noc.topology import Topology

__all__ = [
    "DEFAULT_REDUNDANCY",
    "EplbResult",
    "EplbSchedule",
    "Move",
    "REBALANCE_MODES",
    "apply_moves",
    "balanced_packing",
    "check_rebalance_options",
    "eplb",
    "eplb_dynamic",
    "eplb_placement",
    "eplb_slots",
    "expected_node_load",
    "expert_weight_bytes",
    "move_messages",
    "plan_moves",
    "rebalance",
    "replicate",
    "result_of",
    "simulate_moves",
]

#: Slots per node as a multiple of E/D when no memory cap is given (module docstring).
DEFAULT_REDUNDANCY = 1.5
_EPS = 1e-9


# --------------------------------------------------------------------------------------------
# slot budget


def expert_weight_bytes(model: ModelSpec, conv: Conventions) -> float:
    """Return W_e = m·h·I·b_w, the bytes of one routed expert under the profile."""
    return float(conv.expert_matrices * model.hidden_size * model.expert_intermediate * conv.b_w)


def eplb_slots(num_experts: int, num_nodes: int, *, rho_mem: float | None = None,
               model: ModelSpec | None = None, hw: HardwareSpec | None = None,
               conv: Conventions | None = None, reserved_bytes: float = 0.0) -> int:
    """Return the slot budget S (whole experts per node and layer) allowed by the memory caps.

    Args:
        num_experts: E.
        num_nodes: D.
        rho_mem: Relative cap of §7.3 (10): S = ⌊ρ_mem·E/D⌋ (None: off).
        model: With ``hw`` and ``conv``: the absolute cap from ``hw.node_dram_gib`` (when set),
            S = ⌊(DRAM − reserved_bytes) / (L·W_e)⌋.
        hw: Hardware (``node_dram_gib``).
        conv: Profile (W_e).
        reserved_bytes: Non-expert bytes per node (attention weights, KV cache).

    Returns:
        S ≥ ⌈E/D⌉; without any cap max(⌈E/D⌉, ⌊DEFAULT_REDUNDANCY·E/D⌋).

    Raises:
        InfeasibleError: A cap allows fewer than ⌈E/D⌉ whole experts per node.
    """
    if num_experts < 1 or num_nodes < 1:
        raise ConfigError(f"eplb_slots needs E >= 1 and D >= 1, got E={num_experts}, "
                          f"D={num_nodes}")
    need = math.ceil(num_experts / num_nodes)
    caps: list[tuple[int, str]] = []
    if rho_mem is not None:
        if not rho_mem > 0:
            raise ConfigError(f"rho_mem must be positive or None, got {rho_mem!r}")
        caps.append((math.floor(rho_mem * num_experts / num_nodes + _EPS),
                     f"rho_mem={rho_mem} (rho_mem·E/D = {rho_mem * num_experts / num_nodes:.3f}"
                     f"; whole copies need rho_mem >= {need * num_nodes / num_experts:.4g})"))
    if model is not None and hw is not None and conv is not None and hw.node_dram_bytes:
        w_e = expert_weight_bytes(model, conv)
        free = hw.node_dram_bytes - reserved_bytes
        caps.append((math.floor(free / (model.num_moe_layers * w_e) + _EPS),
                     f"node_dram_gib={hw.node_dram_gib} (minus {reserved_bytes / 2**30:.2f} GiB "
                     f"reserved) over L={model.num_moe_layers} layers of "
                     f"{w_e / 2**20:.1f} MiB experts"))
    if not caps:
        return max(need, math.floor(DEFAULT_REDUNDANCY * num_experts / num_nodes + _EPS))
    slots, why = min(caps)
    if slots < need:
        raise InfeasibleError(f"EPLB places whole experts: E={num_experts} experts on "
                              f"D={num_nodes} nodes need S >= ceil(E/D) = {need} slots per node, "
                              f"but {why} allows S={slots}; raise the memory cap (or use a "
                              "sharded placement such as EP or Node Balance)")
    return slots


# --------------------------------------------------------------------------------------------
# the two steps


def replicate(loads: ArrayLike, num_physical: int, max_copies: int) -> NDArray[np.int64]:
    """Return the copy count of every expert: greedy replication by load per copy (step 1).

    Args:
        loads: float [E] expert loads (>= 0).
        num_physical: Physical experts to create (>= E).
        max_copies: Cap on the copies of one expert (the nodes that could hold them).

    Returns:
        int64 [E] counts c_i ≥ 1, Σ c_i = min(num_physical, E·max_copies).
    """
    f = np.asarray(loads, dtype=np.float64)
    counts = np.ones(f.size, dtype=np.int64)
    target = min(int(num_physical), f.size * int(max_copies))
    for _ in range(target - f.size):
        per_copy = np.where(counts < max_copies, f / counts, -np.inf)
        counts[int(np.argmax(per_copy))] += 1       # argmax: first maximum = lower expert id
    return counts


def balanced_packing(item_loads: ArrayLike, num_bins: int, capacity: int,
                     item_keys: ArrayLike | None = None) -> tuple[NDArray[np.int64], bool]:
    """Pack items to bins: heaviest first, each to the least-loaded bin with room (step 2).

    Args:
        item_loads: float [N] item loads.
        num_bins: Number of bins (nodes or node groups).
        capacity: Items per bin at most (N ≤ num_bins·capacity).
        item_keys: int [N] expert id of every item: two items with the same key never share a
            bin (None: all distinct). Items with one key must have equal loads (copies).

    Returns:
        (int64 [N] bin of every item, True when the round-robin fallback was used).

    Raises:
        InfeasibleError: More items than slots, or more items of one key than bins.
    """
    w = np.asarray(item_loads, dtype=np.float64)
    n = w.size
    keys = np.arange(n) if item_keys is None else np.asarray(item_keys, dtype=np.int64)
    if n > num_bins * capacity:
        raise InfeasibleError(f"{n} items do not fit in {num_bins} bins of {capacity} slots; "
                              "raise the slot budget S")
    _, key_index, key_count = np.unique(keys, return_inverse=True, return_counts=True)
    if key_count.size and key_count.max() > num_bins:
        raise InfeasibleError(f"an expert has {key_count.max()} copies but only {num_bins} "
                              "nodes can hold one each; cap the copies at the node count")
    order = np.lexsort((keys, -w))                     # descending load, then key
    bin_of = np.full(n, -1, dtype=np.int64)
    load = np.zeros(num_bins)
    used = np.zeros(num_bins, dtype=np.int64)
    holds = np.zeros((key_count.size, num_bins), dtype=bool)
    for item in order:
        k = key_index[item]
        ok = (used < capacity) & ~holds[k]
        if not ok.any() and not _repair(bin_of, key_index, w, holds, load, used, capacity, k):
            # [decision] documented fallback: the always-valid round-robin layout
            grouped = np.argsort(key_index, kind="stable")
            out = np.empty(n, dtype=np.int64)
            out[grouped] = np.arange(n, dtype=np.int64) % num_bins
            return out, True
        ok = (used < capacity) & ~holds[k]
        b = int(np.argmin(np.where(ok, load, np.inf)))  # first minimum = lower bin id
        bin_of[item] = b
        load[b] += w[item]
        used[b] += 1
        holds[k, b] = True
    return bin_of, False


def _repair(bin_of: NDArray[np.int64], key_index: NDArray[np.int64], w: NDArray[np.float64],
            holds: NDArray[np.bool_], load: NDArray[np.float64], used: NDArray[np.int64],
            capacity: int, k: int) -> bool:
    """Free a slot for key ``k``: move a placed item from a full bin lacking k to a free bin."""
    free_bins = np.flatnonzero(used < capacity)
    full_bins = np.flatnonzero((used >= capacity) & ~holds[k])
    for dst in free_bins[np.argsort(load[free_bins], kind="stable")]:
        for src in full_bins[np.argsort(load[full_bins], kind="stable")]:
            for item in np.flatnonzero(bin_of == src):
                j = key_index[item]
                if holds[j, dst]:
                    continue
                bin_of[item] = dst
                load[src] -= w[item]
                load[dst] += w[item]
                used[src] -= 1
                used[dst] += 1
                holds[j, src], holds[j, dst] = False, True
                return True
    return False


# --------------------------------------------------------------------------------------------
# one layer, many layers


@dataclass(frozen=True)
class EplbResult:
    """Copies of every expert on every node, per layer.

    Attributes:
        counts: int64 [L, E] copies per expert (Σ_i ≤ D·S).
        holds: bool [L, E, D] ``holds[l, i, c]``: node c holds a whole copy of expert i.
        loads: float64 [L, E] the loads the assignment was computed from.
        slots_per_node: S.
        num_node_groups: G (1: global policy).
        node_group_of_expert: int64 [L, E] node group of every expert (all 0 when G = 1).
        fallback_layers: Layers where the round-robin fallback was used.
    """

    counts: NDArray[np.int64]
    holds: NDArray[np.bool_]
    loads: NDArray[np.float64]
    slots_per_node: int
    num_node_groups: int
    node_group_of_expert: NDArray[np.int64]
    fallback_layers: tuple[int, ...] = ()

    def node_load(self) -> NDArray[np.float64]:
        """Return float64 [L, D]: expected load per node, Σ_i holds·f_i / c_i."""
        per_copy = self.loads / self.counts
        out: NDArray[np.float64] = np.einsum("lec,le->lc", self.holds.astype(np.float64),
                                             per_copy)
        return out


def _check_groups(E: int, D: int, num_node_groups: int, num_expert_groups: int | None) -> int:
    G = int(num_node_groups)
    if G < 1 or D % G:
        raise ConfigError(f"num_node_groups={num_node_groups} must be >= 1 and divide the "
                          f"D={D} nodes (e.g. the mesh rows)")
    groups = E if num_expert_groups is None else int(num_expert_groups)
    if groups < 1 or E % groups or groups % G:
        raise ConfigError(f"num_expert_groups={num_expert_groups} must divide E={E} and be a "
                          f"multiple of num_node_groups={G}; use None (one group per expert)")
    return groups


def _eplb_layer(f: NDArray[np.float64], D: int, S: int, G: int, groups: int
                ) -> tuple[NDArray[np.int64], NDArray[np.bool_], NDArray[np.int64], bool]:
    E = f.size
    group_size = E // groups
    group_load = f.reshape(groups, group_size).sum(axis=1)
    group_bin, _ = balanced_packing(group_load, G, groups // G)
    node_group = np.repeat(group_bin, group_size)            # [E]
    counts = np.zeros(E, dtype=np.int64)
    holds = np.zeros((E, D), dtype=bool)
    nodes_per_group = D // G
    fell_back = False
    for g in range(G):
        experts = np.flatnonzero(node_group == g)
        c = replicate(f[experts], nodes_per_group * S, nodes_per_group)
        items = np.repeat(np.arange(experts.size), c)
        item_load = (f[experts] / c)[items]
        bins, fb = balanced_packing(item_load, nodes_per_group, S, items)
        fell_back |= fb
        counts[experts] = c
        holds[experts[items], g * nodes_per_group + bins] = True
    return counts, holds, node_group, fell_back


def eplb(loads: ArrayLike, num_nodes: int, slots_per_node: int, *, num_node_groups: int = 1,
         num_expert_groups: int | None = None) -> EplbResult:
    """Run EPLB (replication + balanced packing, optionally hierarchical) on every layer.

    Args:
        loads: float [L, E] (or [E] for one layer) expert loads ≥ 0, e.g. f_i of the trace.
        num_nodes: D.
        slots_per_node: S, physical experts per node and layer (:func:`eplb_slots`).
        num_node_groups: G node groups of D / G consecutive nodes (1 = global policy).
        num_expert_groups: Expert groups of E / groups consecutive experts, packed whole to
            node groups (None: one group per expert).

    Returns:
        The copies per expert and node (:class:`EplbResult`).

    Raises:
        InfeasibleError: D·S < E (fewer slots than experts).
        ConfigError: Bad loads, S < 1, or groups that do not divide E and D.
    """
    f = np.asarray(loads, dtype=np.float64)
    f = f[None, :] if f.ndim == 1 else f
    if f.ndim != 2 or f.shape[1] < 1 or not np.all(np.isfinite(f)) or (f < 0).any():
        raise ConfigError(f"EPLB loads must be finite, >= 0, of shape [L, E] or [E]; got shape "
                          f"{np.shape(loads)}")
    L, E = f.shape
    D, S = int(num_nodes), int(slots_per_node)
    if D < 1 or S < 1:
        raise ConfigError(f"EPLB needs D >= 1 nodes and S >= 1 slots, got D={D}, S={S}")
    if D * S < E:
        raise InfeasibleError(f"EPLB: D·S = {D}·{S} = {D * S} physical slots < E={E} experts; "
                              f"every expert needs one whole copy: raise S to ceil(E/D) = "
                              f"{math.ceil(E / D)} (a larger memory cap) or use more nodes")
    groups = _check_groups(E, D, num_node_groups, num_expert_groups)
    counts = np.zeros((L, E), dtype=np.int64)
    holds = np.zeros((L, E, D), dtype=bool)
    node_group = np.zeros((L, E), dtype=np.int64)
    fallback = []
    for layer in range(L):
        c, h, g, fb = _eplb_layer(f[layer], D, S, int(num_node_groups), groups)
        counts[layer], holds[layer], node_group[layer] = c, h, g
        if fb:
            fallback.append(layer)
    return EplbResult(counts, holds, f.copy(), S, int(num_node_groups), node_group,
                      tuple(fallback))


# --------------------------------------------------------------------------------------------
# placement and measurement


def eplb_placement(result: EplbResult, *, pi: ArrayLike | None = None, method: str = "eplb",
                   **meta: Any) -> Placement:
    """Build the ``Placement``: P one-hot at each expert's primary copy, replicas elsewhere.

    The primary copy is the lowest-numbered node holding the expert [decision].

    Args:
        result: An :func:`eplb` result.
        pi: int [L, D] mapping (None: identity, module docstring).
        method: The placement's method name.
        **meta: Extra metadata (JSON-serialisable).

    Returns:
        The placement (``replicas`` None when no expert has a second copy).
    """
    holds = result.holds
    L, E, D = holds.shape
    primary = np.argmax(holds, axis=2)                         # first True
    P = np.zeros((L, E, D))
    np.put_along_axis(P, primary[..., None], 1.0, axis=2)
    replicas = holds & (P == 0)
    mapping = identity_mapping(L, D) if pi is None else np.asarray(pi, dtype=np.int64)
    info = {"slots_per_node": result.slots_per_node, "num_node_groups": result.num_node_groups,
            "physical_experts_per_layer": int(result.counts[0].sum()) if L else 0,
            "fallback_layers": list(result.fallback_layers), **meta}
    return Placement(P=P, pi=mapping, method=method, meta=info, replicas=replicas)


def expected_node_load(placement: Placement, loads: ArrayLike) -> NDArray[np.float64]:
    """Return the expected load of every node when each copy serves an equal share of tokens.

    Node c of layer l gets Σ_i f_i · (P[l, i, c] + replicas[l, i, c]) / copies[l, i]: the
    primary copy's token share is split over its shards by P (EP, Node Balance), and every
    copy of a replicated expert serves 1/copies of its tokens.

    Args:
        placement: Any placement.
        loads: float [L, E] expert loads (e.g. frequencies f_i).

    Returns:
        float64 [L, D].
    """
    f = np.asarray(loads, dtype=np.float64)
    held = placement.P + (0.0 if placement.replicas is None else placement.replicas)
    out: NDArray[np.float64] = np.einsum("lec,le->lc", held, f / placement.copies())
    return out


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
                if peak < best - _EPS:
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
                   tie_break: str = "fifo") -> DesResult:
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

    Returns:
        The DES result; ``makespan_s`` is the time the rebalance occupies the links.
    """
    src, dst, size = move_messages(moves, expert_bytes, pi)
    return simulate_messages(topology, src, dst, size, tie_break=tie_break,
                             hop_latency_s=hop_latency_s, chunks=chunks)
