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

Periodic rebalancing of these copies (``eplb-dynamic``) and the NoC cost of its weight moves
are ``baselines.eplb_dynamic``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.errors import ConfigError, InfeasibleError
from hdamoe_env.sim.eplb import balanced_packing, place_copies, replicate
from hdamoe_env.sim.placement import Placement, identity_mapping
from hdamoe_env.config.profiles import Conventions
from hdamoe_env.config.specs import HardwareSpec, ModelSpec

__all__ = [
    "DEFAULT_REDUNDANCY",
    "EplbResult",
    "balanced_packing",
    "eplb",
    "eplb_placement",
    "eplb_slots",
    "expected_node_load",
    "expert_weight_bytes",
    "replicate",
]

#: Slots per node as a multiple of E/D when no memory cap is given (module docstring).
DEFAULT_REDUNDANCY = 1.5
FLOOR_TOLERANCE = 1e-9


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
        caps.append((math.floor(rho_mem * num_experts / num_nodes + FLOOR_TOLERANCE),
                     f"rho_mem={rho_mem} (rho_mem·E/D = {rho_mem * num_experts / num_nodes:.3f}"
                     f"; whole copies need rho_mem >= {need * num_nodes / num_experts:.4g})"))
    if model is not None and hw is not None and conv is not None and hw.node_dram_bytes:
        w_e = expert_weight_bytes(model, conv)
        free = hw.node_dram_bytes - reserved_bytes
        caps.append((math.floor(free / (model.num_moe_layers * w_e) + FLOOR_TOLERANCE),
                     f"node_dram_gib={hw.node_dram_gib} (minus {reserved_bytes / 2**30:.2f} GiB "
                     f"reserved) over L={model.num_moe_layers} layers of "
                     f"{w_e / 2**20:.1f} MiB experts"))
    if not caps:
        return max(need, math.floor(DEFAULT_REDUNDANCY * num_experts / num_nodes
                                    + FLOOR_TOLERANCE))
    slots, why = min(caps)
    if slots < need:
        raise InfeasibleError(f"EPLB places whole experts: E={num_experts} experts on "
                              f"D={num_nodes} nodes need S >= ceil(E/D) = {need} slots per node, "
                              f"but {why} allows S={slots}; raise the memory cap (or use a "
                              "sharded placement such as EP or Node Balance)")
    return slots


# --------------------------------------------------------------------------------------------
# one layer, many layers (the two steps, ``replicate`` and ``balanced_packing``, are
# ``hdamoe_env.sim.eplb``, shared with the drift env)


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
        c, items, bins, fb = place_copies(f[experts], nodes_per_group, S)
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

