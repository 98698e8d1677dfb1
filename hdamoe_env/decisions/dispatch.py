"""Dispatch of the tokens of copied experts: broadcast copies and redundant replicas.

Implements paper-model.md §10.6–10.7 (paper §V-C) and the redundant experts of a placement:

* §10.6–10.7 — communication-efficient dispatch of (token, broadcast expert) pairs to one node
  each, replicas for one step, the all-k-broadcast case (``dispatch_broadcast``,
  ``DISPATCH_RULES``), with both bookkeeping variants of §10.9;
* redundant experts of the placement (``Placement.replicas``, production practice, not in the
  paper) — every token of a replicated expert is computed by exactly one copy, chosen by a
  replica rule (``dispatch_replicas``, ``REPLICA_RULES``); ``merge_dispatch`` joins the two
  dispatches of one layer.

Which experts are broadcast is chosen in ``hdamoe_env.decisions.broadcast``; what the
dispatched work costs is charged by the simulator's ``hdamoe_env.sim.evaluator.LayerEvaluator``.
Pure numpy, no RL (style.md R1). Units are SI.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.cache import BoundedCache
from hdamoe_env.config.errors import ConfigError, unknown_name

__all__ = [
    "DISPATCH_RULES",
    "REPLICA_RULES",
    "DispatchResult",
    "dispatch_broadcast",
    "dispatch_replicas",
    "merge_dispatch",
    "replica_expected_shares",
    "replica_inputs",
    "valid_fractions",
]

#: Rules placing the (token, broadcast expert) pairs (``dispatch_broadcast``, §10.6).
DISPATCH_RULES = ("least_loaded", "first", "home")
#: Rules choosing the copy of a replicated expert that computes a token (``dispatch_replicas``).
REPLICA_RULES = ("least_loaded", "nearest", "round_robin", "shares")


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


#: Holder clusters per expert, by placement bytes and shape. One entry per distinct layer
#: placement (and per broadcast-zeroed variant the ``nearest`` rule sees): a bench run needs at
#: most one per layer and method, the whole test suite 18 (measured), so 1024 never evicts.
_HOLDER_LISTS: BoundedCache[bytes, list[list[int]]] = BoundedCache(
    1024, name="hdamoe_env.decisions.dispatch.holder_lists")


def _holder_lists(P: NDArray[np.float64]) -> list[list[int]]:
    """Return the ascending holder clusters of every expert (cached by the placement bytes).

    Args:
        P: float64 [E, D] placement shares of one layer.

    Returns:
        E lists of the clusters c with P[i, c] > 0, ascending. The lists are shared with the
        cache: read them, never modify them.
    """
    key = P.tobytes() + bytes(str(P.shape), "ascii")
    hit = _HOLDER_LISTS.get(key)
    if hit is None:
        rows, cols = np.nonzero(P > 0)
        hit = [[] for _ in range(P.shape[0])]
        for i, c in zip(rows.tolist(), cols.tolist(), strict=True):
            hit[i].append(c)
        _HOLDER_LISTS.put(key, hit)
    return hit


def dispatch_broadcast(token_sets: ArrayLike, P: ArrayLike, broadcast: Sequence[int], w: float,
                       *, rule: str = "least_loaded", ref_bookkeeping: bool = False,
                       compute_flops: float = 1.0, stream_s: float = 0.0,
                       tile_time: Callable[[NDArray[np.float64]], NDArray[np.float64]] | None
                       = None, base_s: ArrayLike | None = None) -> DispatchResult:
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
            charged ``extra_compute_s`` is then its sum over experts instead of work / C.
            With ``base_s`` as well, the decisions are tile-aware too (below).
        base_s: float [D] seconds of the non-broadcast experts on every node under the same
            tile model (the evaluator's compute of the zeroed placement). With ``tile_time``
            the rules ``least_loaded`` and ``home`` then work in seconds: the loads start at
            ``base_s`` and a token goes to the candidate with the earliest finish
            L_c + Δ_c, where Δ_c = tile_time(t_c + 1) − tile_time(t_c) is what one more token
            costs the replica of e on c (a whole token tile and the GEMM overhead when it
            opens a tile, nothing when it fills one); ties: the first candidate. Without it
            the decisions balance the fluid work w.

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
        tiled = tile_time is not None and base_s is not None
        if tiled:
            assert tile_time is not None and base_s is not None
            base = np.asarray(base_s, dtype=np.float64).tolist()
            steps = np.arange(num_tokens + 2, dtype=np.float64)
            one = np.asarray(tile_time(steps[:, None]), dtype=np.float64)[:, 0]
            delta = np.diff(one).tolist()                        # cost of token t + 1
        flops = _dispatch_loop(sets, bc, shares, holders, base, float(w), rule, tiled,
                               delta if tiled else None, ref_bookkeeping, orphans, nodes,
                               computes, replica_tokens)
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


def _dispatch_loop(sets: NDArray[np.int64], bc: list[int], shares: NDArray[np.float64],
                   holders: list[list[int]], base: list[float], w: float, rule: str,
                   tiled: bool, delta: list[float] | None, ref_bookkeeping: bool,
                   orphans: NDArray[np.bool_], nodes: NDArray[np.int64],
                   computes: NDArray[np.bool_], replica_tokens: NDArray[np.float64]
                   ) -> NDArray[np.float64]:
    """The dispatch loop of ``dispatch_broadcast`` by ``dispatch_kernels.broadcast_kernel``
    (the Python loop when a token has no candidate: it raises as before); fills ``nodes``,
    ``computes`` and ``replica_tokens``; returns the work per node [D]."""
    from hdamoe_env.decisions.dispatch_kernels import broadcast_kernel

    num_nodes = shares.shape[1]
    lengths = [len(h) for h in holders]
    h_ptr = np.zeros(len(holders) + 1, dtype=np.int64)
    h_ptr[1:] = np.cumsum(lengths)
    h_node = np.fromiter((c for h in holders for c in h), dtype=np.int64, count=int(h_ptr[-1]))
    work = np.zeros(num_nodes)
    ok = broadcast_kernel(sets, np.array(bc, dtype=np.int64), h_ptr, h_node,
                          np.array(base, dtype=np.float64), float(w), DISPATCH_RULES.index(rule),
                          tiled, np.array(delta if delta is not None else [], dtype=np.float64),
                          ref_bookkeeping, orphans, nodes, work, computes, replica_tokens)
    if ok:
        return work
    nodes[:] = -1
    computes[:] = False
    replica_tokens[:] = 0.0
    return _broadcast_python(sets, bc, holders, base, w, rule, tiled, delta, ref_bookkeeping,
                             orphans, nodes, computes, replica_tokens)


def _broadcast_python(sets: NDArray[np.int64], bc: list[int], holders: list[list[int]],
                      base: list[float], w: float, rule: str, tiled: bool,
                      delta: list[float] | None, ref_bookkeeping: bool,
                      orphans: NDArray[np.bool_], nodes: NDArray[np.int64],
                      computes: NDArray[np.bool_], replica_tokens: NDArray[np.float64]
                      ) -> NDArray[np.float64]:
    """The dispatch loop of ``dispatch_broadcast`` in Python (the reference of
    ``dispatch_kernels.broadcast_kernel``, tested against it); arguments as
    :func:`_dispatch_loop`."""
    num_nodes = len(base)
    steps: list[float] = delta if delta is not None else []      # read only when tiled
    tok = [[0] * num_nodes for _ in bc]
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
            if tiled and rule != "first":
                counts_b = tok[b]
                best = loads[c_t] + steps[counts_b[c_t]]
                for c in cand:
                    finish = loads[c] + steps[counts_b[c]]
                    if finish < best:
                        c_t, best = c, finish
                loads[c_t] = best
                counts_b[c_t] += 1
            elif rule != "first":
                best = loads[c_t]
                for c in cand:
                    if loads[c] < best:
                        c_t, best = c, loads[c]
                loads[c_t] += w
            else:
                loads[c_t] += w if not tiled else steps[tok[b][c_t]]
                if tiled:
                    tok[b][c_t] += 1
            work[c_t] += w
            nodes[t, row.index(e)] = c_t
            computes[b, c_t] = True
            replica_tokens[b, c_t] += 1.0
    return np.asarray(work)


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


def dispatch_replicas(  # noqa: C901 - the checks of four rules, then their assignment
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
    R = rep_experts.size
    if R:
        counts = np.bincount(sets.ravel(), minlength=num_experts).astype(np.float64)
        counts[rep_experts] = 0.0
        base = (counts @ P_layer) * w
        if initial_flops is not None:
            base = base + np.asarray(initial_flops, dtype=np.float64)
        plans = _copy_plans(sets, reps, rep_experts, rule, frac)
        if rule == "nearest":
            assert hop is not None
            out = _assign_python(sets, shares, reps, rep_experts, base, float(w), plans,
                                 P_layer, hop)
        else:
            out = _assign_compiled(sets, shares, reps, rep_experts, base, float(w), plans)
        nodes, copies_of, flops, primary_tokens, replica_tokens, extra_holders = out
    else:
        nodes = np.full((num_tokens, top_k), -1, dtype=np.int64)
        copies_of = np.full((num_tokens, top_k), -1, dtype=np.int64)
        flops = np.zeros(num_nodes)
        primary_tokens, replica_tokens = np.zeros(0), np.zeros((0, num_nodes))
        extra_holders = None
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
    orphans = ~(P_layer.sum(axis=1) > 0)[sets].any(axis=1)
    return DispatchResult(nodes, flops, extra_compute, extra_stream, P_layer, extra_holders,
                          orphans, copies_of)


#: What the assignment of :func:`dispatch_replicas` returns: ``nodes`` [B, k], ``copies``
#: [B, k], the work per node [D], the tokens of each primary group [R] and replica node
#: [R, D], and the extra holders [B, x] (None when no token chose a copy).
_Assignment = tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64],
                    NDArray[np.float64], NDArray[np.float64], "NDArray[np.int64] | None"]


def _copy_plans(sets: NDArray[np.int64], reps: NDArray[np.bool_],
                rep_experts: NDArray[np.int64], rule: str,
                frac: NDArray[np.float64] | None) -> list[list[int] | None]:
    """The copy of every token (batch order) of each replicated expert under ``round_robin``
    and ``shares`` (None: the expert follows ``least_loaded`` / ``nearest``)."""
    if rule not in ("round_robin", "shares"):
        return [None] * rep_experts.size
    plans: list[list[int] | None] = []
    for e in rep_experts.tolist():
        n_copies = 1 + int(reps[e].sum())
        n_rows = int((sets == e).any(axis=1).sum())
        plan: list[int] | None = None
        if rule == "round_robin":
            plan = [j % n_copies for j in range(n_rows)]
        else:
            assert frac is not None
            if not np.isnan(frac[e, 0]):                       # NaN row: least_loaded
                rep_nodes = np.flatnonzero(reps[e]).tolist()
                f = [float(frac[e, 0])] + [float(frac[e, 1 + c]) for c in rep_nodes]
                tot = sum(f)
                f = [v / tot for v in f] if tot > 0 else [1.0 / n_copies] * n_copies
                quota = _largest_remainder(f, n_rows)
                plan = [j for j, q in enumerate(quota) for _ in range(q)]
        plans.append(plan)
    return plans


def _assign_compiled(sets: NDArray[np.int64], shares: NDArray[np.float64],
                     reps: NDArray[np.bool_], rep_experts: NDArray[np.int64],
                     base: NDArray[np.float64], w: float,
                     plans: list[list[int] | None]) -> _Assignment:
    """The assignment by ``dispatch_kernels.replica_kernel`` (every rule but ``nearest``)."""
    from hdamoe_env.decisions.dispatch_kernels import replica_kernel

    lengths = [0 if p is None else len(p) for p in plans]
    plan_ofs = np.zeros(len(plans), dtype=np.int64)
    plan_ofs[1:] = np.cumsum(lengths)[:-1]
    flat = np.fromiter((j for p in plans if p is not None for j in p), dtype=np.int64,
                       count=sum(lengths))
    has_plan = np.array([p is not None for p in plans], dtype=bool)
    group_max = int((shares[rep_experts] > 0).sum(axis=1).max())
    width = sets.shape[1] * max(group_max, 1)
    nodes, copies, work, prim, repl, chosen, n_chosen = replica_kernel(
        sets, shares, reps, rep_experts.astype(np.int64), np.array(base, dtype=np.float64),
        float(w), flat, plan_ofs, has_plan, width)
    used = int(n_chosen.max()) if n_chosen.size else 0
    return nodes, copies, work, prim, repl, (chosen[:, :used].copy() if used else None)


def _assign_python(sets: NDArray[np.int64], shares: NDArray[np.float64],
                   reps: NDArray[np.bool_], rep_experts: NDArray[np.int64],
                   base: NDArray[np.float64], w: float, plans: list[list[int] | None],
                   P_layer: NDArray[np.float64], hop: list[list[float]] | None
                   ) -> _Assignment:
    """The assignment loop in Python: ``nearest`` (``hop`` given), and the reference of
    :func:`_assign_compiled` for the other rules (``hop`` None)."""
    num_tokens, top_k = sets.shape
    num_nodes = shares.shape[1]
    R = rep_experts.size
    nodes = np.full((num_tokens, top_k), -1, dtype=np.int64)
    copies_of = np.full((num_tokens, top_k), -1, dtype=np.int64)
    primary_tokens = np.zeros(R)
    replica_tokens = np.zeros((R, num_nodes))
    chosen_nodes: list[list[int]] = [[] for _ in range(num_tokens)]
    loads = base.tolist()
    work = [0.0] * num_nodes
    anchors_of: list[list[int]] | None = None
    if hop is not None:
        holders = _holder_lists(P_layer)
        anchors_of = [sorted({c for j in row for c in holders[j]}) for row in sets.tolist()]
    set_rows = sets.tolist()
    for r, e in enumerate(rep_experts.tolist()):
        group = np.flatnonzero(shares[e] > 0).tolist()
        group_share = [float(shares[e, c]) for c in group]
        rep_nodes = np.flatnonzero(reps[e]).tolist()
        cands: list[tuple[list[int], list[float]]] = [(group, group_share)]
        cands += [([c], [1.0]) for c in rep_nodes]
        rows = np.flatnonzero((sets == e).any(axis=1)).tolist()
        plan = plans[r]
        for pos, t in enumerate(rows):
            if plan is not None:
                pick = plan[pos]
            else:
                peak = [max(loads[c] + s * w for c, s in zip(cn, sh, strict=True))
                        for cn, sh in cands]
                if hop is not None:
                    assert anchors_of is not None
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
    extra_holders = None
    width = max((len(x) for x in chosen_nodes), default=0)
    if width:
        extra_holders = np.full((num_tokens, width), -1, dtype=np.int64)
        for t, xs in enumerate(chosen_nodes):
            extra_holders[t, :len(xs)] = xs
    return nodes, copies_of, np.asarray(work), primary_tokens, replica_tokens, extra_holders


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
