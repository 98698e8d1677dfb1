"""Online dynamic scheduling: prediction, pre-broadcast budget and selection, dispatch and broadcast
traffic.

Implements paper-model.md §10 (paper §V-C):

* §10.2 — next-layer prediction: a fast noisy oracle (traces.md §7.6 semantics) and predicted
  per-expert counts;
* §10.3–10.4 — the runtime budget (``paper*``: the HD formula, one value per run; ``faithful``:
  t_nm(l−1) + t_comp(l−1) of the layer the broadcast hides behind) and k_b from the α–β
  pipelined-broadcast model with the optimal chunk size c*(m) (``broadcast_slots``,
  ``broadcast_plan``);
* §10.5 — priority detection and repeated selection on the most congested node, with both
  bookkeeping variants of §10.9 (``priority_broadcast``);
* §10.6–10.7 — communication-efficient dispatch of (token, broadcast expert) pairs, replicas for
  one step, the all-k-broadcast case (``dispatch_broadcast``);
* redundant experts of the placement (``Placement.replicas``, production practice, not in the
  paper) — every token of a replicated expert is computed by exactly one copy, chosen by a
  replica rule (``dispatch_replicas``, ``REPLICA_RULES``);
* §10.8 — the pre-broadcast traffic as DES messages on the NoC links (``broadcast_messages``,
  ``simulate_broadcast``). The latency of a layer with dynamic scheduling is evaluated by the
  simulator's ``hdamoe_env.sim.evaluator.LayerEvaluator``.

Everything is numpy plus the package's DES (``des``); no RL (style.md R1). Units are SI.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.cost import broadcast as prebroadcast
from hdamoe_env.noc.des import simulate_messages
from hdamoe_env.config.errors import ConfigError, unknown_name
from hdamoe_env.config.profiles import Conventions
from hdamoe_env.config.specs import HardwareSpec, ModelSpec
from hdamoe_env.noc.topology import Topology


__all__ = [
    "DISPATCH_RULES",
    "REPLICA_RULES",
    "AliasSampler",
    "BroadcastPlan",
    "BroadcastResult",
    "DispatchResult",
    "broadcast_messages",
    "broadcast_plan",
    "broadcast_slots",
    "broadcast_tree",
    "dispatch_broadcast",
    "dispatch_replicas",
    "merge_dispatch",
    "noisy_oracle_sets",
    "priority_broadcast",
    "replica_expected_shares",
    "replica_inputs",
    "simulate_broadcast",
    "valid_fractions",
]

DISPATCH_RULES = ("least_loaded", "first", "home")
#: Rules choosing the copy of a replicated expert that computes a token (``dispatch_replicas``).
REPLICA_RULES = ("least_loaded", "nearest", "round_robin", "shares")


# ------------------------------------------------------------------------------ §10.3–10.4


@dataclass(frozen=True, slots=True)
class BroadcastPlan:
    """The pre-broadcast budget of a layer and what fits into it (§10.3–10.4).

    Attributes:
        budget_s: Time the broadcast may hide behind, seconds.
        k_b: Number of experts that fit, max{m : T_bc*(m) < budget}, capped at ``max_m``.
        payload_bytes: S, bytes per expert.
        depth_hops: H, pipeline depth.
        chunk_bytes: c*(k_b) (c*(1) when k_b = 0), bytes.
        time_s: T_bc*(k_b), seconds (0 when k_b = 0).
    """

    budget_s: float
    k_b: int
    payload_bytes: float
    depth_hops: float
    chunk_bytes: float
    time_s: float


def broadcast_plan(model: ModelSpec, hw: HardwareSpec, conv: Conventions, batch: int,
                   topology_diameter: int | None, t_nm_prev: float | None,
                   t_comp_prev: float | None, max_m: int) -> BroadcastPlan:
    """Return the budget, k_b, payload, depth and chunk size of a pre-broadcast (§10.3–10.4).

    Args:
        model: The model (S from h, I).
        hw: The hardware (D, C, BW, BW_mem).
        conv: The conventions (``bc_budget``, ``bc_payload``, ``bc_depth``, ``broadcast_alpha_s``).
        batch: Tokens per decode step B.
        topology_diameter: Diameter in hops (``bc_depth="diameter"``).
        t_nm_prev: t_nm of the layer the broadcast hides behind (``bc_budget="layer"``), s.
        t_comp_prev: Its expert phase (static evaluator at B), s.
        max_m: Cap on k_b (e.g. the env's ``max_broadcast``, at most E).

    Returns:
        The plan.
    """
    budget = float(prebroadcast.broadcast_budget(model, hw, conv, batch, t_nm_prev, t_comp_prev))
    S = prebroadcast.broadcast_payload(model, conv)
    H = prebroadcast.broadcast_depth(conv, hw.num_nodes, topology_diameter)
    alpha, bw = conv.broadcast_alpha_s, hw.link_bw_Bps
    k_b = prebroadcast.num_broadcast(budget, S, H, alpha, bw, max_m)
    chunk = float(prebroadcast.broadcast_chunk(max(k_b, 1), S, H, alpha, bw))
    time = float(prebroadcast.broadcast_time(k_b, S, H, alpha, bw))
    return BroadcastPlan(budget, k_b, S, H, chunk, time)


def broadcast_slots(model: ModelSpec, hw: HardwareSpec, conv: Conventions, batch: int,
                    topology_diameter: int | None, t_nm_prev: float | None,
                    t_comp_prev: float | None, max_m: int) -> int:
    """Return k_b, the number of experts pre-broadcast for one layer (§10.3).

    ``paper*`` (``bc_budget="hd"``): the HD budget formula, the same for every layer;
    ``faithful`` (``"layer"``): t_nm(l−1) + t_comp(l−1). k_b = max{m : T_bc*(m) < budget} with
    the α–β model at the optimal chunk size. See ``broadcast_plan`` for the arguments.
    """
    return broadcast_plan(model, hw, conv, batch, topology_diameter, t_nm_prev, t_comp_prev,
                          max_m).k_b


# ------------------------------------------------------------------------------ §10.5


def priority_broadcast(P_next: ArrayLike, pred_counts: ArrayLike, w: float, C: float, k_b: int,
                       *, ref_bookkeeping: bool = False, skip_zero_priority: bool = True,
                       token_sets_pred: ArrayLike | None = None) -> list[int]:
    """Choose up to k_b experts to pre-broadcast by priority on the congested node (§10.5, §10.9).

    Each round: predicted loads L̂_c, congested node c* = argmax L̂ (lowest index on ties),
    prio_i = P_{i,c*}·n̂_i·w/C, pick e* = argmax prio (highest id on ties), zero P_{e*,:}.
    Already picked experts are never picked again. Loads per round:

    * ``ref_bookkeeping=True``: Σ_i P_ic·n̂_i·w over the working copy (a picked expert's load
      disappears);
    * ``False``: the same plus the predicted dispatch of the picked experts — the least-loaded
      greedy of §10.6 on the predicted sets ``token_sets_pred``; without sets
      [decision] a picked expert's predicted work is spread evenly over the D nodes.

    Args:
        P_next: float [E, D] placement of the layer the broadcast is for.
        pred_counts: float [E] predicted tokens per expert n̂_i.
        w: Work per (token, expert), FLOP.
        C: Node throughput, FLOP/s.
        k_b: Number of rounds.
        ref_bookkeeping: Reference bookkeeping (see above).
        skip_zero_priority: Stop when the best priority is 0 (``faithful``); otherwise the
            highest unpicked id wins, as in the reference.
        token_sets_pred: int [B, k] predicted sets (``ref_bookkeeping=False``).

    Returns:
        The chosen experts in pick order (at most k_b).
    """
    P = np.array(P_next, dtype=np.float64)
    n = np.asarray(pred_counts, dtype=np.float64)
    if P.ndim != 2 or n.shape != (P.shape[0],):
        raise ConfigError(f"P_next must be [E, D] and pred_counts [E]; got {P.shape} and "
                          f"{n.shape}")
    num_experts, num_nodes = P.shape
    orig = P.copy()
    chosen: list[int] = []
    picked = np.zeros(num_experts, dtype=bool)
    for _ in range(min(int(k_b), num_experts)):
        loads = (n @ P) * w
        if not ref_bookkeeping and chosen:
            if token_sets_pred is not None:
                d = dispatch_broadcast(token_sets_pred, orig, chosen, w)
                loads = loads + d.node_flops
            else:
                loads = loads + n[chosen].sum() * w / num_nodes
        c_star = int(np.argmax(loads))
        prio = P[:, c_star] * n * w / C
        prio[picked] = -np.inf
        best = float(prio.max())
        if best == -np.inf or (skip_zero_priority and best <= 0):
            break
        e = num_experts - 1 - int(np.argmax(prio[::-1]))     # ties: highest expert id
        chosen.append(e)
        picked[e] = True
        P[e, :] = 0.0
    return chosen


# ------------------------------------------------------------------------------ §10.6–10.7


@dataclass(frozen=True, eq=False)
class DispatchResult:
    """Where the (token, broadcast expert) pairs of one layer are computed (§10.6–10.8).

    Attributes:
        nodes: int64 [B, k] node of every (token, slot) whose expert is broadcast, −1 elsewhere.
        node_flops: float64 [D] dispatched work per node, FLOP.
        extra_compute_s: float64 [D] the same in seconds (``node_flops / C``).
        extra_stream_s: float64 [D] weight streaming of the replicas: a node computing at least
            one token of broadcast expert e streams W_e once (``stream_s`` per pair).
        P_layer: float64 [E, D] the placement with the broadcast rows zeroed.
        extra_holders: int64 [B, x] dispatch nodes joining each token's holder set for the DES
            (−1 = none), or None. With ``ref_bookkeeping`` only tokens whose experts are all
            broadcast get them (they have no other holder).
        orphans: bool [B] tokens all of whose k experts are broadcast.
        copies: Replica dispatch only (``dispatch_replicas``): int64 [B, k] the copy of every
            (token, slot) whose expert is replicated — 0 = the primary group, j ≥ 1 = the j-th
            replica node in ascending node order — and −1 elsewhere; ``nodes`` then holds the
            replica node, or the lowest node of the primary group. None for broadcast dispatch.
    """

    nodes: NDArray[np.int64]
    node_flops: NDArray[np.float64]
    extra_compute_s: NDArray[np.float64]
    extra_stream_s: NDArray[np.float64]
    P_layer: NDArray[np.float64]
    extra_holders: NDArray[np.int64] | None
    orphans: NDArray[np.bool_]
    copies: NDArray[np.int64] | None = None


_HOLDER_LISTS: dict[bytes, list[list[int]]] = {}


def _holder_lists(P: NDArray[np.float64]) -> list[list[int]]:
    """Return the ascending holder clusters of every expert (cached by the placement bytes)."""
    key = P.tobytes() + bytes(str(P.shape), "ascii")
    hit = _HOLDER_LISTS.get(key)
    if hit is None:
        rows, cols = np.nonzero(P > 0)
        hit = [[] for _ in range(P.shape[0])]
        for i, c in zip(rows.tolist(), cols.tolist(), strict=True):
            hit[i].append(c)
        if len(_HOLDER_LISTS) >= 256:
            _HOLDER_LISTS.clear()
        _HOLDER_LISTS[key] = hit
    return hit


def dispatch_broadcast(token_sets: ArrayLike, P: ArrayLike, broadcast: Sequence[int], w: float,
                       *, rule: str = "least_loaded", ref_bookkeeping: bool = False,
                       compute_flops: float = 1.0, stream_s: float = 0.0,
                       tile_time: Callable[[NDArray[np.float64]], NDArray[np.float64]] | None
                       = None) -> DispatchResult:
    """Dispatch every (token, broadcast expert) pair to one node (paper-model.md §10.6–10.7).

    Loads start from the non-broadcast experts, L_c = Σ_{i ∉ bc} P_ic·n_i·w (actual counts).
    For each broadcast expert e in broadcast order and each token t with e ∈ S_t in batch order,
    the candidates are ``cand = [c for j in S_t (token order) for c in nodes_orig(j)]`` (original
    placement, duplicates allowed) and

    * ``"least_loaded"`` (the paper's rule): the first candidate with minimal L_c;
    * ``"first"``: the first candidate (the lowest holder of the token's first expert);
    * ``"home"``: the least-loaded of e's own original holders (the replica is ignored);

    then L[c_t] += w. A token all of whose experts are broadcast has no node of its own: its
    candidates are all D nodes (``home``: e's holders) [decision §10.7], and its dispatch nodes
    become its holders for communication. ``ref_bookkeeping`` re-initialises the decision loads
    at each broadcast expert (earlier dispatch increments are dropped, §10.9) and keeps the
    dispatch nodes out of the communication (except for such tokens); the work charged is always
    the sum of all increments.

    Args:
        token_sets: int [B, k] expert sets of the layer being executed (batch order).
        P: float [E, D] original placement of the layer.
        broadcast: Broadcast experts, distinct, in broadcast order.
        w: Work per (token, expert), FLOP.
        rule: ``"least_loaded"``, ``"first"`` or ``"home"``.
        ref_bookkeeping: Reference bookkeeping (above).
        compute_flops: C, FLOP/s, to express the dispatched work in seconds.
        stream_s: Streaming time of one broadcast expert's weights on one node, W_e / BW_mem
            (0 when the profile does not stream weights).
        tile_time: Optional tile model (docs/PHYSICS.md §4): maps the token counts [bc, D] of
            every replica to its seconds (e.g. ``perf.gemm_tile_time`` with I columns); the
            charged ``extra_compute_s`` is then its sum over experts instead of work / C. The
            dispatch decisions still balance the fluid work w.

    Returns:
        The dispatch nodes and what they add to the layer (see ``DispatchResult``).

    Raises:
        ConfigError: Unknown rule, bad shapes, or duplicate / out-of-range broadcast experts.
    """
    if rule not in DISPATCH_RULES:
        raise unknown_name("dispatch rule", rule, DISPATCH_RULES)
    shares = np.ascontiguousarray(P, dtype=np.float64)
    sets = np.asarray(token_sets, dtype=np.int64)
    num_experts, num_nodes = shares.shape
    if sets.ndim != 2:
        raise ConfigError(f"token_sets must have shape [B, k], got {sets.shape}")
    bc = [int(e) for e in broadcast]
    if len(set(bc)) != len(bc) or any(not 0 <= e < num_experts for e in bc):
        raise ConfigError(f"broadcast experts must be distinct ids in [0, {num_experts}), got "
                          f"{bc}")
    num_tokens, top_k = sets.shape
    is_bc = np.zeros(num_experts, dtype=bool)
    is_bc[bc] = True
    P_layer = shares.copy()
    P_layer[is_bc] = 0.0
    nodes = np.full((num_tokens, top_k), -1, dtype=np.int64)
    flops = np.zeros(num_nodes)
    computes = np.zeros((len(bc), num_nodes), dtype=bool)
    replica_tokens = np.zeros((len(bc), num_nodes))
    slot_bc = is_bc[sets]                                        # [B, k]
    orphans = slot_bc.all(axis=1)
    if bc:
        counts = np.bincount(sets.ravel(), minlength=num_experts).astype(np.float64)
        counts[is_bc] = 0.0
        base = ((counts @ shares) * w).tolist()
        holders = _holder_lists(shares)
        loads = list(base)
        work = [0.0] * num_nodes
        all_nodes = list(range(num_nodes))
        rows_of = {e: np.flatnonzero((sets == e).any(axis=1)).tolist() for e in bc}
        set_rows = sets.tolist()
        orphan_rows = orphans.tolist()
        for b, e in enumerate(bc):
            if ref_bookkeeping and b:
                loads = list(base)                               # §10.9: increments dropped
            own = holders[e]
            for t in rows_of[e]:
                row = set_rows[t]
                if rule == "home":
                    cand = own
                elif orphan_rows[t]:
                    cand = all_nodes
                else:
                    cand = [c for j in row for c in holders[j]]
                c_t = cand[0]
                if rule != "first":
                    best = loads[c_t]
                    for c in cand:
                        if loads[c] < best:
                            c_t, best = c, loads[c]
                loads[c_t] += w
                work[c_t] += w
                nodes[t, row.index(e)] = c_t
                computes[b, c_t] = True
                replica_tokens[b, c_t] += 1.0
        flops = np.asarray(work)
    extra_stream = computes.sum(axis=0) * float(stream_s)
    extra_holders = None
    if bc:
        mask = nodes >= 0 if not ref_bookkeeping else (nodes >= 0) & orphans[:, None]
        if mask.any():
            width = int(mask.sum(axis=1).max())
            order = np.argsort(~mask, axis=1, kind="stable")[:, :width]
            picked = np.take_along_axis(nodes, order, axis=1)
            extra_holders = np.where(np.take_along_axis(mask, order, axis=1), picked, -1)
    extra_compute = flops / compute_flops if tile_time is None or not bc \
        else np.asarray(tile_time(replica_tokens), dtype=np.float64).sum(axis=0)
    return DispatchResult(nodes, flops, extra_compute, extra_stream, P_layer,
                          extra_holders, orphans)


# ------------------------------------------------------------------------------ redundant experts


def replica_expected_shares(P: ArrayLike, replicas: ArrayLike | None) -> NDArray[np.float64]:
    """Return the expected share of every expert's work per node when copies split it evenly.

    An expert with n = 1 + Σ_c replicas[i, c] copies puts P_ic / n of its tokens' work on a
    primary node c and 1 / n on each replica node (the expectation of ``round_robin``, and of
    any rule that balances the copies). Rows still sum to 1; without replicas this is ``P``.

    Args:
        P: float [..., E, D] shares of the primary copies.
        replicas: bool [..., E, D] replica mask, or None.

    Returns:
        float64 [..., E, D].
    """
    shares = np.asarray(P, dtype=np.float64)
    if replicas is None:
        return shares
    reps = np.asarray(replicas, dtype=bool)
    copies = 1.0 + reps.sum(axis=-1, keepdims=True)
    out: NDArray[np.float64] = (shares + reps) / copies
    return out


def _largest_remainder(fracs: list[float], total: int) -> list[int]:
    """Split ``total`` items by ``fracs`` (Σ = 1) by largest remainder.

    Floors first, then one more item for each of the largest remainders (ties: the lower index).
    """
    quota = [f * total for f in fracs]
    base = [math.floor(q + 1e-12) for q in quota]
    left = total - sum(base)
    order = sorted(range(len(fracs)), key=lambda j: (-(quota[j] - base[j]), j))
    for j in order[:max(left, 0)]:
        base[j] += 1
    return base


def replica_inputs(token_sets: ArrayLike, P: ArrayLike, replicas: ArrayLike, what: str
                   ) -> tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.bool_]]:
    """Return (sets int64 [B, k], shares float64 [E, D], replicas bool [E, D]) of one layer.

    Raises:
        ConfigError: Shapes that do not fit, naming ``what`` (the caller).
    """
    shares = np.ascontiguousarray(P, dtype=np.float64)
    reps = np.asarray(replicas, dtype=bool)
    sets = np.asarray(token_sets, dtype=np.int64)
    if shares.ndim != 2 or reps.shape != shares.shape or sets.ndim != 2:
        raise ConfigError(f"{what} needs P [E, D], replicas of the same shape and token_sets "
                          f"[B, k]; got {shares.shape}, {reps.shape}, {sets.shape}")
    return sets, shares, reps


def valid_fractions(frac: NDArray[np.float64]) -> bool:
    """Whether every row of per-copy fractions is finite and >= 0, or entirely NaN (that
    expert follows ``least_loaded``): the ``fractions`` accepted by :func:`dispatch_replicas`."""
    nan_rows = np.isnan(frac).all(axis=1)
    rest = frac[~nan_rows]
    return bool(np.isfinite(rest).all() and (rest >= 0).all())


def dispatch_replicas(  # noqa: C901 - four rules in one greedy loop, kept together
        token_sets: ArrayLike, P: ArrayLike, replicas: ArrayLike, w: float, *,
        rule: str = "least_loaded", fractions: ArrayLike | None = None,
        hops: ArrayLike | None = None, pi: ArrayLike | None = None,
        initial_flops: ArrayLike | None = None, compute_flops: float = 1.0,
        stream_s: float = 0.0,
        tile_time: Callable[[NDArray[np.float64], NDArray[np.float64]],
                            NDArray[np.float64]] | None = None) -> DispatchResult:
    """Choose, for every token of a replicated expert, the one copy that computes it.

    A replicated expert e (``replicas[e].any()`` and a non-zero row ``P[e]``; a zero row is a
    broadcast expert, handled by ``dispatch_broadcast``) has copies, in this order: copy 0 =
    the primary group (every cluster with P_ec > 0: one node for a whole expert, several for a
    sharded one) and copy j ≥ 1 = the j-th replica node (ascending). Experts are handled in
    ascending id order, their tokens in batch order. Fluid loads start from the work of the
    experts that are not replicated, L_c = Σ_{i not replicated} P_ic·n_i·w (+ ``initial_flops``,
    e.g. the broadcast dispatch), and a chosen copy adds P_ec·w to every primary node c (the
    primary group) or w to the replica node. Rules:

    * ``"least_loaded"`` (greedy per token, as §10.6): the copy minimising its busiest node
      after the token, max_{c ∈ copy} (L_c + share_c·w); ties: the lower copy index.
    * ``"nearest"`` [decision]: anchors A_t = the clusters holding a share of the token's other
      experts in the returned ``P_layer`` (neither replicated nor broadcast) plus the nodes of
      the copies already chosen for the token's other replicated experts. A node x of a copy
      costs 0 if x ∈ A_t (its message is pre-combined with one the token sends anyway), else the
      mean hop count from x to the anchors (the expected distance to the aggregator, which is
      drawn among the holders); a copy costs the sum over its nodes (one message per node). The
      copy of least cost wins; ties (always when A_t is empty) are broken by ``least_loaded``,
      then by the lower copy index. Hops: ``hops[pi[x], pi[a]]``.
    * ``"round_robin"``: the j-th token of e (batch order) goes to copy j mod (number of
      copies).
    * ``"shares"``: ``fractions[e]`` gives the fraction of e's tokens per copy — column 0 the
      primary group, column 1 + c the replica on node c (ignored where there is none;
      renormalised over the copies; all zero means even; a row that is entirely NaN leaves
      that expert's tokens to ``"least_loaded"``). The n_e tokens are split by largest
      remainder (floors, then the largest fractional parts, ties to the lower copy) and assigned
      in batch order: the first q_0 tokens to copy 0, the next q_1 to copy 1, and so on. This is
      the rule a learned policy sets.

    Charged work: the primary group computes its n_p tokens share-wise (node c: P_ec·n_p·w, or
    under the tile model ``tile_time(n_p, P_ec)`` — the shard's GEMMs, docs/PHYSICS.md §4), a
    replica node computes the whole expert (``tile_time(n_r, 1)``, I columns). Weight streaming:
    a copy that computes at least one token streams its weights once (P_ec·``stream_s`` on a
    primary node, ``stream_s`` on a replica node). Communication: every node of a chosen copy
    joins the token's holder set (``extra_holders``); a token all of whose experts are
    replicated or broadcast aggregates on one of them (``linksim.choose_aggregators``).

    Args:
        token_sets: int [B, k] expert sets of the layer (batch order).
        P: float [E, D] shares of the layer (broadcast rows already zeroed).
        replicas: bool [E, D] replica mask of the layer.
        w: Work per (token, expert), FLOP.
        rule: One of ``REPLICA_RULES``.
        fractions: float [E, 1 + D] per-copy fractions (``"shares"`` only).
        hops: int [N, N] hop counts between endpoints (``"nearest"`` only,
            ``Topology.hop_counts``).
        pi: int [D] endpoint of every cluster (``"nearest"``; identity by default).
        initial_flops: float [D] work already on every node (FLOP) before the replicated
            experts, e.g. the broadcast dispatch.
        compute_flops: C, FLOP/s (fluid charge).
        stream_s: W_e / BW_mem, seconds (0 without weight streaming).
        tile_time: Optional tile model: maps (tokens [R, D], shares [R, D]) to seconds [R, D]
            of a shard holding ``share`` of an expert (1 = a whole replica) with that many
            tokens; the charged ``extra_compute_s`` is then its sum over the copies.

    Returns:
        A ``DispatchResult``: ``P_layer`` with the replicated rows zeroed, the charged
        ``extra_compute_s`` / ``extra_stream_s`` [D], ``extra_holders`` [B, x] and ``copies``.

    Raises:
        ConfigError: Unknown rule, bad shapes, or a rule's input missing.
    """
    if rule not in REPLICA_RULES:
        raise unknown_name("replica rule", rule, REPLICA_RULES)
    sets, shares, reps = replica_inputs(token_sets, P, replicas, "dispatch_replicas")
    num_experts, num_nodes = shares.shape
    num_tokens, top_k = sets.shape
    frac = None
    if rule == "shares":
        if fractions is None:
            raise ConfigError("replica rule 'shares' needs fractions [E, 1 + D] (column 0 the "
                              "primary copy, 1 + c the replica on node c)")
        frac = np.asarray(fractions, dtype=np.float64)
        if frac.shape != (num_experts, 1 + num_nodes) or not valid_fractions(frac):
            raise ConfigError(f"fractions must be finite, >= 0 (or a whole row NaN: that expert "
                              f"follows least_loaded) and of shape [E, 1 + D] = "
                              f"{(num_experts, 1 + num_nodes)}, got shape {frac.shape}")
    hop = None
    if rule == "nearest":
        if hops is None:
            raise ConfigError("replica rule 'nearest' needs hops [N, N] "
                              "(Topology.hop_counts())")
        mapping = np.arange(num_nodes) if pi is None else np.asarray(pi, dtype=np.int64)
        hop = np.asarray(hops, dtype=np.float64)[np.ix_(mapping, mapping)].tolist()
    held = shares.sum(axis=1) > 0
    rep_experts = np.flatnonzero(reps.any(axis=1) & held)
    P_layer = shares.copy()
    P_layer[rep_experts] = 0.0
    nodes = np.full((num_tokens, top_k), -1, dtype=np.int64)
    copies_of = np.full((num_tokens, top_k), -1, dtype=np.int64)
    R = rep_experts.size
    primary_tokens = np.zeros(R)
    replica_tokens = np.zeros((R, num_nodes))
    flops = np.zeros(num_nodes)
    chosen_nodes: list[list[int]] = [[] for _ in range(num_tokens)]
    if R:
        counts = np.bincount(sets.ravel(), minlength=num_experts).astype(np.float64)
        counts[rep_experts] = 0.0
        base = (counts @ P_layer) * w
        if initial_flops is not None:
            base = base + np.asarray(initial_flops, dtype=np.float64)
        loads = base.tolist()
        work = [0.0] * num_nodes
        anchors_of: list[list[int]] | None = None
        if rule == "nearest":
            holders = _holder_lists(P_layer)
            anchors_of = [sorted({c for j in row for c in holders[j]})
                          for row in sets.tolist()]
        set_rows = sets.tolist()
        for r, e in enumerate(rep_experts.tolist()):
            group = np.flatnonzero(shares[e] > 0).tolist()
            group_share = [float(shares[e, c]) for c in group]
            rep_nodes = np.flatnonzero(reps[e]).tolist()
            cands: list[tuple[list[int], list[float]]] = [(group, group_share)]
            cands += [([c], [1.0]) for c in rep_nodes]
            rows = np.flatnonzero((sets == e).any(axis=1)).tolist()
            plan: list[int] | None = None
            if rule == "round_robin":
                plan = [j % len(cands) for j in range(len(rows))]
            elif rule == "shares" and not np.isnan(frac[e, 0]):    # NaN row: least_loaded
                assert frac is not None
                f = [float(frac[e, 0])] + [float(frac[e, 1 + c]) for c in rep_nodes]
                tot = sum(f)
                f = [v / tot for v in f] if tot > 0 else [1.0 / len(cands)] * len(cands)
                quota = _largest_remainder(f, len(rows))
                plan = [j for j, q in enumerate(quota) for _ in range(q)]
            for pos, t in enumerate(rows):
                if plan is not None:
                    pick = plan[pos]
                else:
                    peak = [max(loads[c] + s * w for c, s in zip(cn, sh, strict=True))
                            for cn, sh in cands]
                    if rule == "nearest":
                        assert anchors_of is not None and hop is not None
                        anchors = sorted(set(anchors_of[t]).union(chosen_nodes[t]))
                        cost = []
                        for cn, _ in cands:
                            total = 0.0
                            for x in cn:
                                if anchors and x not in anchors:
                                    hx = hop[x]
                                    total += sum(hx[a] for a in anchors) / len(anchors)
                            cost.append(total)
                    else:
                        cost = [0.0] * len(cands)
                    pick = min(range(len(cands)), key=lambda j: (cost[j], peak[j], j))
                cn, sh = cands[pick]
                for c, s in zip(cn, sh, strict=True):
                    loads[c] += s * w
                    work[c] += s * w
                chosen_nodes[t].extend(cn)
                slot = set_rows[t].index(e)
                copies_of[t, slot] = pick
                nodes[t, slot] = cn[0]
                if pick == 0:
                    primary_tokens[r] += 1.0
                else:
                    replica_tokens[r, cn[0]] += 1.0
        flops = np.asarray(work)
    prim_shares = shares[rep_experts]                                  # [R, D]
    prim_active = (primary_tokens > 0)[:, None] & (prim_shares > 0)
    extra_stream = (np.where(prim_active, prim_shares, 0.0).sum(axis=0)
                    + (replica_tokens > 0).sum(axis=0)) * float(stream_s)
    if tile_time is None or not R:
        extra_compute = flops / compute_flops
    else:
        prim_t = np.where(prim_shares > 0, primary_tokens[:, None], 0.0)
        extra_compute = (np.asarray(tile_time(prim_t, prim_shares), dtype=np.float64).sum(axis=0)
                         + np.asarray(tile_time(replica_tokens, np.ones_like(replica_tokens)),
                                      dtype=np.float64).sum(axis=0))
    extra_holders = None
    width = max((len(x) for x in chosen_nodes), default=0)
    if width:
        extra_holders = np.full((num_tokens, width), -1, dtype=np.int64)
        for t, xs in enumerate(chosen_nodes):
            extra_holders[t, :len(xs)] = xs
    orphans = ~(P_layer.sum(axis=1) > 0)[sets].any(axis=1)
    return DispatchResult(nodes, flops, extra_compute, extra_stream, P_layer, extra_holders,
                          orphans, copies_of)


def merge_dispatch(first: DispatchResult, second: DispatchResult) -> DispatchResult:
    """Merge a broadcast dispatch and the replica dispatch that followed it (same layer).

    ``second`` was computed on ``first.P_layer``; the merged result has ``second.P_layer``
    (both kinds of rows zeroed), the summed work and streaming, both sets of extra holders side
    by side, ``first.nodes`` where it is set and ``second.nodes`` elsewhere, and
    ``second.copies``.
    """
    holders = [h for h in (first.extra_holders, second.extra_holders) if h is not None]
    extra = None if not holders else (holders[0] if len(holders) == 1 else
                                      np.concatenate(holders, axis=1))
    nodes = np.where(first.nodes >= 0, first.nodes, second.nodes)
    return DispatchResult(nodes, first.node_flops + second.node_flops,
                          first.extra_compute_s + second.extra_compute_s,
                          first.extra_stream_s + second.extra_stream_s, second.P_layer, extra,
                          second.orphans, second.copies)


# ------------------------------------------------------------------------------ §10.2 prediction


class AliasSampler:
    """Exact O(1) sampling of experts ∝ popularity p_l (Walker/Vose alias tables, one per layer).

    Args:
        shares: float [E] or [L, E] non-negative popularity (each row with a positive sum).
    """

    def __init__(self, shares: ArrayLike) -> None:
        p = np.atleast_2d(np.asarray(shares, dtype=np.float64))
        if p.ndim != 2 or (p < 0).any() or not (p.sum(axis=1) > 0).all():
            raise ConfigError("shares must be a non-negative [E] or [L, E] array with positive "
                              "row sums")
        self.num_layers, self.num_experts = p.shape
        self.prob = np.ones(p.shape)
        self.alias = np.tile(np.arange(self.num_experts), (self.num_layers, 1))
        for layer in range(self.num_layers):
            self._build(layer, p[layer] / p[layer].sum())

    def _build(self, layer: int, p: NDArray[np.float64]) -> None:
        scaled = (p * self.num_experts).tolist()
        small = [i for i, v in enumerate(scaled) if v < 1.0]
        large = [i for i, v in enumerate(scaled) if v >= 1.0]
        prob, alias = self.prob[layer], self.alias[layer]
        while small and large:
            s_i, l_i = small.pop(), large.pop()
            prob[s_i] = scaled[s_i]
            alias[s_i] = l_i
            scaled[l_i] = scaled[l_i] + scaled[s_i] - 1.0
            (small if scaled[l_i] < 1.0 else large).append(l_i)
        for i in small + large:                       # numerical leftovers: probability 1
            prob[i] = 1.0

    def sample(self, layers: NDArray[np.int64] | None, size: int, rng: np.random.Generator
               ) -> NDArray[np.int64]:
        """Return int64 [R, size] experts drawn ∝ p of each row's layer.

        Args:
            layers: int64 [R] layer of every row (zeros for 1-D shares); None draws one row of
                layer 0.
            size: Draws per row.
            rng: Generator. One uniform per draw: its integer part (× E) picks the column, its
                fraction flips the column's coin.
        """
        rows = 1 if layers is None else layers.size
        v = rng.random((rows, size)) * self.num_experts
        col = v.astype(np.int64)
        np.minimum(col, self.num_experts - 1, out=col)
        coin = v - col
        flat = col if layers is None else col + (layers * self.num_experts)[:, None]
        keep = coin < self.prob.ravel().take(flat)
        return np.where(keep, col, self.alias.ravel().take(flat))


def noisy_oracle_sets(actual: NDArray[np.int64], acc: float | NDArray[np.float64],
                      sampler: AliasSampler, rng: np.random.Generator, *,
                      layer_of_row: NDArray[np.int64] | None = None, oversample: int = 3
                      ) -> NDArray[np.int64]:
    """Predict sets with a noisy oracle (traces.md §7.6 semantics, vectorised).

    Every expert of a row's actual set is kept with probability acc and otherwise replaced by an
    expert drawn ∝ p_l from those not in the actual set, never twice in a row. Rejection
    sampling, exact: in every round each pending replaced slot draws ``oversample`` candidates
    ∝ p and takes the first not in the actual set nor among the row's accepted replacements;
    when two pending slots of a row pick the same expert the earlier slot keeps it and the other
    draws again. The expected overlap |S ∩ Ŝ|/k is exactly acc. Rows of several layers can be
    predicted in one call.

    Args:
        actual: int64 [N, k] actual sets.
        acc: Accuracy in [0, 1], scalar or float [N] per row.
        sampler: Popularity sampler (one layer, or per layer with ``layer_of_row``).
        rng: Generator.
        layer_of_row: int64 [N] layer of every row (default: layer 0 of the sampler).
        oversample: Candidates drawn per pending slot and round.

    Returns:
        int64 [N, k] predicted sets.
    """
    num_rows, top_k = actual.shape
    pred = actual.copy()
    accuracy = np.asarray(acc, dtype=np.float64)
    replace = rng.random((num_rows, top_k)) >= (accuracy if accuracy.ndim == 0
                                                 else accuracy[:, None])
    rows, cols = np.nonzero(replace)                  # row-major: slots in column order
    if rows.size == 0:
        return pred
    num_experts = sampler.num_experts
    lay = (np.zeros(rows.size, dtype=np.int64) if layer_of_row is None
           else np.asarray(layer_of_row, dtype=np.int64)[rows])
    pred[rows, cols] = -1
    pending = np.arange(rows.size)
    small = num_experts <= 64
    one = np.uint64(1)
    if small:                                         # forbidden experts as row bitmasks
        forbid = np.bitwise_or.reduce(np.left_shift(one, actual.astype(np.uint64)), axis=1)
    for _ in range(64):
        r = rows[pending]
        cand = sampler.sample(lay[pending], oversample, rng)               # [P, m]
        # Forbidden: the actual set and the replacements accepted so far.
        if small:
            member = (np.right_shift(forbid[r][:, None], cand.astype(np.uint64)) & one) \
                .astype(bool)
        else:
            taken = np.concatenate([actual[r], pred[r]], axis=1)
            member = (taken[:, None, :] == cand[:, :, None]).any(axis=2)
        ok = ~member.all(axis=1)
        pick = cand[np.arange(pending.size), np.argmax(~member, axis=1)]
        key = np.where(ok, r * num_experts + pick, -1 - np.arange(pending.size))
        order = np.argsort(key, kind="stable")       # stable: the earlier slot of a row wins
        dup = np.zeros(pending.size, dtype=bool)
        dup[order[1:]] = key[order][1:] == key[order][:-1]
        accept = ok & ~dup
        pred[r[accept], cols[pending[accept]]] = pick[accept]
        if small:
            np.bitwise_or.at(forbid, r[accept], np.left_shift(one, pick[accept].astype(
                np.uint64)))
        pending = pending[~accept]
        if pending.size == 0:
            return pred
    for slot in pending.tolist():                    # pathological popularity: uniform fallback
        t = int(rows[slot])
        allowed = np.setdiff1d(np.arange(num_experts), np.concatenate([actual[t], pred[t]]))
        pred[t, int(cols[slot])] = int(rng.choice(allowed))
    return pred


# ------------------------------------------------------------------------------ broadcast traffic


def broadcast_tree(topology: Topology, source: int) -> tuple[NDArray[np.int64],
                                                             NDArray[np.int64]]:
    """Return the broadcast tree of a source endpoint: parent [N] and depth [N] (source: −1, 0).

    [decision] The parent of endpoint v is the last endpoint before v on the topology's route
    source → v (the source itself when the route passes only switches). On a mesh or torus with
    dimension-ordered routing this is the dimension-ordered spanning tree (the source's row, then
    every column; depth ≤ diameter), whose edges are single links; on the fat-tree it is a star
    (the switches do not replicate).
    """
    n = topology.num_endpoints
    parent = np.full(n, -1, dtype=np.int64)
    for v in range(n):
        if v == source:
            continue
        route = topology.route(source, v)
        prev = source
        for link in route[:-1]:
            u = int(topology.link_dst[link])
            if u < n:
                prev = u
        parent[v] = prev
    depth = np.zeros(n, dtype=np.int64)
    for v in range(n):
        d, u = 0, v
        while u != source:
            u = int(parent[u])
            d += 1
            if d > n:
                raise ConfigError("broadcast tree has a cycle; the topology's routes are not "
                                  "prefix-consistent")
        depth[v] = d
    return parent, depth


@dataclass(frozen=True, eq=False)
class BroadcastMessages:
    """DES messages of a pre-broadcast (inputs of ``des.simulate_messages``).

    Attributes:
        src: int64 [M] sending endpoint. dst: int64 [M] receiving endpoint.
        size_bytes: float64 [M] chunk bytes plus the start-up α expressed as bytes (α·BW).
        ready_s: float64 [M] release times of the contention-free pipeline schedule.
        expert: int64 [M] broadcast expert of every message.
        chunks: chunks per expert. chunk_bytes: payload per chunk.
    """

    src: NDArray[np.int64]
    dst: NDArray[np.int64]
    size_bytes: NDArray[np.float64]
    ready_s: NDArray[np.float64]
    expert: NDArray[np.int64]
    chunks: int
    chunk_bytes: float


def broadcast_messages(topology: Topology, P_layer: ArrayLike, experts: Sequence[int],
                       S_bytes: float, chunks: int, *, pi: ArrayLike | None = None,
                       alpha_s: float = 0.0, hop_latency_s: float = 0.0,
                       trees: dict[int, tuple[NDArray[np.int64], NDArray[np.int64]]] | None = None
                       ) -> BroadcastMessages:
    """Build the DES messages of a chunk-pipelined tree broadcast of every expert (§10.4, §10.8).

    [decision] Scheme. Every broadcast expert e is sent whole (S bytes) from one holder — the
    cluster with its largest share (lowest id on ties), at endpoint pi[c] — to every other
    endpoint along ``broadcast_tree``: each tree edge (parent → child) forwards every chunk once
    (store-and-forward per chunk). The S bytes are cut into ``chunks`` equal chunks; a chunk
    message costs α + c/BW on its link (α as α·BW extra bytes), and chunk j of the edge into a
    node at depth d is released at (j + d − 1)·(α + c/BW + hop latency): the contention-free
    pipeline schedule, whose makespan for one expert on a path of depth H is
    (S/c + H − 1)·(α + c/BW) ≈ T_bc(c) of the α–β model. The DES then serialises everything that
    shares a link (several experts, crossing trees). Approximation: a chunk delayed by
    contention does not delay its forwarding (release times are fixed), so downstream delays are
    not propagated; the bandwidth term (m·S/BW on the busiest link) is captured.

    Args:
        topology: The NoC.
        P_layer: float [E, D] original placement shares of the layer (source holders).
        experts: Broadcast experts.
        S_bytes: Payload per expert, bytes.
        chunks: Chunks per expert (>= 1).
        pi: int [D] endpoint of every cluster (identity by default).
        alpha_s: Start-up latency per chunk message, seconds.
        hop_latency_s: The DES hop latency (added to the schedule's slot).
        trees: Optional cache {source endpoint: broadcast_tree(...)}.

    Returns:
        The messages, expert-major, then edge, then chunk.
    """
    shares = np.asarray(P_layer, dtype=np.float64)
    n = topology.num_endpoints
    mapping = np.arange(n) if pi is None else np.asarray(pi, dtype=np.int64)
    chunks = int(chunks)
    if chunks < 1:
        raise ConfigError(f"chunks must be >= 1, got {chunks}")
    bw = topology.bw_end_Bps
    chunk = float(S_bytes) / chunks
    size = chunk + alpha_s * bw
    slot = size / bw + hop_latency_s
    src_l, dst_l, ready_l, exp_l = [], [], [], []
    j = np.arange(chunks, dtype=np.float64)
    for e in experts:
        cluster = int(np.argmax(shares[int(e)]))
        source = int(mapping[cluster])
        tree = None if trees is None else trees.get(source)
        if tree is None:
            tree = broadcast_tree(topology, source)
            if trees is not None:
                trees[source] = tree
        parent, depth = tree
        child = np.flatnonzero(parent >= 0)
        src_l.append(np.repeat(parent[child], chunks))
        dst_l.append(np.repeat(child, chunks))
        ready_l.append(((j[None, :] + depth[child][:, None] - 1) * slot).ravel())
        exp_l.append(np.full(child.size * chunks, int(e), dtype=np.int64))
    if not src_l:
        empty_i = np.zeros(0, dtype=np.int64)
        return BroadcastMessages(empty_i, empty_i, np.zeros(0), np.zeros(0), empty_i, chunks,
                                 chunk)
    src = np.concatenate(src_l)
    return BroadcastMessages(src, np.concatenate(dst_l), np.full(src.size, size),
                             np.concatenate(ready_l), np.concatenate(exp_l), chunks, chunk)


@dataclass(frozen=True, eq=False)
class BroadcastResult:
    """Simulated pre-broadcast traffic of one layer.

    Attributes:
        makespan_s: Finish time of the last chunk, seconds (0 when nothing is broadcast).
        link_busy_s: float64 [num_links] busy time per directed link, seconds.
        num_messages: Number of DES messages.
        chunks: Chunks per expert simulated.
        chunk_bytes: Payload per simulated chunk.
    """

    makespan_s: float
    link_busy_s: NDArray[np.float64]
    num_messages: int
    chunks: int
    chunk_bytes: float


def simulate_broadcast(topology: Topology, P_layer: ArrayLike, experts: Sequence[int],
                       S_bytes: float, chunk_bytes: float, *, pi: ArrayLike | None = None,
                       alpha_s: float = 0.0, hop_latency_s: float = 0.0,
                       tie_break: str = "fifo", max_messages: int = 20_000,
                       trees: dict[int, tuple[NDArray[np.int64], NDArray[np.int64]]] | None = None
                       ) -> BroadcastResult:
    """Simulate the pre-broadcast of ``experts`` on idle links with the DES (§10.8).

    Chunks per expert = ⌈S / chunk_bytes⌉ (the caller passes c*(m) of the α–β model); to bound
    the cost the count is reduced so that at most ``max_messages`` messages are simulated
    ([decision]; larger chunks overstate the pipeline fill by (H − 1)·(c_sim − c)/BW).

    Args:
        topology: The NoC.
        P_layer: float [E, D] original shares of the layer.
        experts: Broadcast experts.
        S_bytes: Payload per expert, bytes.
        chunk_bytes: Target chunk size, bytes.
        pi: int [D] cluster → endpoint.
        alpha_s: Start-up latency per message, seconds.
        hop_latency_s: DES hop latency, seconds.
        tie_break: DES tie rule.
        max_messages: Cap on the number of messages.
        trees: Optional broadcast-tree cache.

    Returns:
        Makespan and per-link busy time.
    """
    experts = list(experts)
    if not experts:
        return BroadcastResult(0.0, np.zeros(topology.num_links), 0, 0, 0.0)
    if not chunk_bytes > 0:
        raise ConfigError(f"chunk_bytes must be positive, got {chunk_bytes!r}")
    chunks = max(1, math.ceil(float(S_bytes) / float(chunk_bytes)))
    per_chunk = len(experts) * (topology.num_endpoints - 1)
    chunks = max(1, min(chunks, max_messages // max(per_chunk, 1)))
    msgs = broadcast_messages(topology, P_layer, experts, S_bytes, chunks, pi=pi,
                              alpha_s=alpha_s, hop_latency_s=hop_latency_s, trees=trees)
    des = simulate_messages(topology, msgs.src, msgs.dst, msgs.size_bytes, msgs.ready_s,
                                    tie_break=tie_break, hop_latency_s=hop_latency_s)
    return BroadcastResult(des.makespan_s, des.link_busy_s, int(msgs.src.size), chunks,
                           msgs.chunk_bytes)
