"""MoE task generation and the per-layer communication run on the NoC DES.

Implements paper-model.md §6.2 (task generation: aggregators, combine and dispatch messages) on
the topologies of ``hdamoe_env.noc.topology`` (§6.1), simulated with the §6.3 event loop of
``hdamoe_env.noc.des`` (which holds the generic message DES, its oracle and the semantics).

``simulate_layer_comm`` is the production path for one MoE layer: message generation, route
selection (flow key = (layer, task id, source endpoint, chunk index), §6.1) and both DES runs
happen inside one compiled call (``_layer_kernel``, which calls the DES core ``des.des_core``
directly). ``layer_messages`` + ``des.simulate_messages`` with ``layer_flow_keys`` is the same
computation, step by step (tests pin the equality).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import llvmlite.binding as llvm
import numba
import numpy as np
from numba import njit, prange, types
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.noc.des import (check_ni_bandwidth, check_ni_latency, check_switching,
                                count_trailing_zeros, des_core, port_routes)
from hdamoe_env.noc.messages import check_chunks, check_ref_size, check_scalar, tie_break_is_ref
from hdamoe_env.config.cache import BoundedCache
from hdamoe_env.config.errors import ConfigError, unknown_name
from hdamoe_env.noc.topology import Topology

__all__ = [
    "AGGREGATOR_RULES",
    "PHASES",
    "HolderTable",
    "LayerComm",
    "aggregators_many",
    "check_threads",
    "choose_aggregators",
    "holder_arrays",
    "layer_flow_keys",
    "layer_messages",
    "numba_threads",
    "simulate_layer_comm",
    "simulate_layers_comm",
]

AGGREGATOR_RULES = ("ref", "uniform", "first")
PHASES = ("dispatch", "combine")

#: PCG64's ``next_uint32`` (numpy's C function behind ``Generator.integers`` for ranges below
#: 2**32), registered under a fixed symbol so that kernels calling it stay cacheable on disk;
#: a kernel passes it the address of a generator's PCG64 state (``bit_generator.ctypes.
#: state_address``, as ``decisions.prediction_kernels.generator_state`` returns it).
_NEXT_UINT32 = "hdamoe_env_pcg64_next_uint32"
llvm.add_symbol(_NEXT_UINT32, ctypes.cast(np.random.PCG64(0).ctypes.next_uint32,
                                          ctypes.c_void_p).value)
_next_uint32 = types.ExternalFunction(_NEXT_UINT32, types.uint32(types.uintp))
_U32_MAX = np.uint64(0xFFFFFFFF)

# splitmix64 constants of ``topology.stable_hash`` as numba compile-time constants
_U_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_U_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_U_MIX2 = np.uint64(0x94D049BB133111EB)
_U30 = np.uint64(30)
_U27 = np.uint64(27)
_U31 = np.uint64(31)


@dataclass(frozen=True, slots=True, eq=False)
class LayerComm:
    """MoE communication of one layer: one independent DES run per phase (§6.2–6.3).

    Attributes:
        phases: simulated phases in the order requested, each ``"dispatch"`` or ``"combine"``.
        makespan_s: [P] makespan of every phase, seconds.
        link_busy_s: float64 [P, num_links] per-link busy time of every phase, seconds.
        num_messages: [P] number of messages (after chunking) of every phase.
    """

    phases: tuple[str, ...]
    makespan_s: tuple[float, ...]
    link_busy_s: NDArray[np.float64]
    num_messages: tuple[int, ...]

    def get(self, phase: str) -> float:
        """Return the makespan of ``phase`` in seconds.

        Raises:
            ConfigError: The phase was not simulated.
        """
        if phase not in self.phases:
            raise ConfigError(f"phase {phase!r} was not simulated; simulated phases: "
                              f"{list(self.phases)}")
        return self.makespan_s[self.phases.index(phase)]

    @property
    def dispatch_s(self) -> float:
        """Dispatch makespan in seconds (raises ``ConfigError`` if not simulated)."""
        return self.get("dispatch")

    @property
    def combine_s(self) -> float:
        """Combine makespan in seconds (raises ``ConfigError`` if not simulated)."""
        return self.get("combine")

    @property
    def total_s(self) -> float:
        """Sum of the makespans of the simulated phases in seconds."""
        return float(sum(self.makespan_s))

    @property
    def link_busy_total_s(self) -> NDArray[np.float64]:
        """Float64 [num_links] per-link busy time summed over the simulated phases, seconds."""
        return self.link_busy_s.sum(axis=0)


# --------------------------------------------------------------------------------------------
# compiled layer kernel (§6.2 generation + §6.3 DES)


@njit(cache=True)
def _mix64(z: np.uint64) -> np.uint64:
    z = z + _U_GOLDEN
    z = (z ^ (z >> _U30)) * _U_MIX1
    z = (z ^ (z >> _U27)) * _U_MIX2
    return z ^ (z >> _U31)


@njit(cache=True)
def _flow_hash4(a: int, b: int, c: int, d: int) -> np.uint64:
    """``stable_hash((a, b, c, d))`` for non-negative ints (splitmix64 fold)."""
    h = _mix64(np.uint64(0) ^ np.uint64(a))
    h = _mix64(h ^ np.uint64(b))
    h = _mix64(h ^ np.uint64(c))
    return _mix64(h ^ np.uint64(d))


@njit(cache=True)
def _layer_kernel(  # noqa: C901 - generation and DES in one compiled call
    token_sets: NDArray[np.int64], holder_mask: NDArray[np.bool_],
    extra: NDArray[np.int64], agg: NDArray[np.int64], pi: NDArray[np.int64],
    msg_bytes: NDArray[np.float64], partial_mask: NDArray[np.bool_],
    combine_bytes: NDArray[np.float64], chunks: int, layer: int,
    pair_ptr: NDArray[np.int64], route_ptr: NDArray[np.int64],
    route_links: NDArray[np.int32], link_bw: NDArray[np.float64],
    route_rank: NDArray[np.int64], hop_latency: float, tie_ref: bool, num_endpoints: int,
    phase_codes: NDArray[np.int64], busy_out: NDArray[np.float64],
    makespan_out: NDArray[np.float64], count_out: NDArray[np.int64], cut_through: bool,
    ni_bw: float, ni_lat: float, port_ptr: NDArray[np.int64], port_links: NDArray[np.int32],
) -> bool:
    """Generate the layer's messages (§6.2) and run one DES per phase (0 dispatch, 1 combine).

    Messages are ordered by token, then ascending source cluster, then chunk index — the order of
    ``layer_messages`` expanded as in ``simulate_messages``. Returns False, without simulating,
    when the inputs fail ``_layer_inputs_ok`` (checking here saves a second compiled call).
    A combine message from a cluster that holds a partial shard of any expert of its token
    (``partial_mask`` [E, D]; shape [0, D] = none) carries ``combine_bytes[t]`` bytes.
    ``ni_bw`` > 0 adds the network-interface ports of ``des.simulate_messages(ni_bw_Bps=...)``,
    each with latency ``ni_lat`` (seconds): every message's link list is its route with its
    ports, from ``port_ptr``/``port_links`` (``des.port_routes`` of the topology, built once per
    topology; read only when ``ni_bw`` > 0).
    """
    if not _layer_inputs_ok(token_sets, holder_mask, msg_bytes, agg, pi, extra, num_endpoints):
        return False
    has_partial = partial_mask.shape[0] > 0
    if has_partial and (partial_mask.shape != holder_mask.shape
                        or combine_bytes.shape[0] != token_sets.shape[0]):
        return False
    num_tokens, top_k = token_sets.shape
    num_experts, num_clusters = holder_mask.shape
    num_ep = pi.shape[0]
    # holder clusters of every expert as a bit set (64 clusters per word): a token's sources are
    # the OR of its experts' sets, read in ascending order by counting trailing zeros
    words = (num_clusters + 63) >> 6
    hbits = np.zeros((num_experts, words), dtype=np.uint64)
    for e in range(num_experts):
        for c in range(num_clusters):
            if holder_mask[e, c]:
                hbits[e, c >> 6] |= np.uint64(1) << np.uint64(c & 63)
    pbits = np.zeros((num_experts if has_partial else 0, words), dtype=np.uint64)
    if has_partial:
        for e in range(num_experts):
            for c in range(num_clusters):
                if partial_mask[e, c]:
                    pbits[e, c >> 6] |= np.uint64(1) << np.uint64(c & 63)
    touch = np.empty(words, dtype=np.uint64)
    ptouch = np.zeros(words, dtype=np.uint64)
    # (token, source cluster) pairs, token-major, ascending cluster
    pair_tok = np.empty(num_tokens * num_clusters, dtype=np.int64)
    pair_cl = np.empty(num_tokens * num_clusters, dtype=np.int64)
    pair_psum = np.zeros(num_tokens * num_clusters, dtype=np.bool_)
    npairs = 0
    for t in range(num_tokens):
        touch[:] = 0
        ptouch[:] = 0
        for j in range(top_k):
            e = token_sets[t, j]
            for w in range(words):
                touch[w] |= hbits[e, w]
            if has_partial:
                for w in range(words):
                    ptouch[w] |= pbits[e, w]
        for j in range(extra.shape[1]):
            c = extra[t, j]
            if c >= 0:
                touch[c >> 6] |= np.uint64(1) << np.uint64(c & 63)
        a = agg[t]
        touch[a >> 6] &= ~(np.uint64(1) << np.uint64(a & 63))
        for w in range(words):
            x = touch[w]
            while x:
                pair_tok[npairs] = t
                bit = np.int64(count_trailing_zeros(x))
                pair_cl[npairs] = (w << 6) + bit
                pair_psum[npairs] = (ptouch[w] >> np.uint64(bit)) & np.uint64(1) != 0
                npairs += 1
                x &= x - np.uint64(1)
    # sizes, ready times and endpoints are the same in every phase: build them once
    num_msg = npairs * chunks
    msg_size = np.empty(num_msg)
    comb_size = np.empty(num_msg)
    msg_ready = np.zeros(num_msg)
    holder_ep = np.empty(npairs, dtype=np.int64)
    agg_ep = np.empty(npairs, dtype=np.int64)
    for i in range(npairs):
        t = pair_tok[i]
        holder_ep[i] = pi[pair_cl[i]]
        agg_ep[i] = pi[agg[t]]
        size = msg_bytes[t] / chunks
        csize = combine_bytes[t] / chunks if pair_psum[i] else size
        for ch in range(chunks):
            msg_size[i * chunks + ch] = size
            comb_size[i * chunks + ch] = csize
    pos = np.empty(num_msg, dtype=np.int64)
    stop = np.empty(num_msg, dtype=np.int64)
    msg_rank = np.zeros(num_msg, dtype=np.int64)
    finish = np.empty(num_msg)
    num_links = link_bw.shape[0]
    # ports (ni_bw > 0): injection num_links + src, ejection num_links + N + dst
    port_bw = np.concatenate((link_bw, np.full(2 * num_ep, ni_bw)))
    link_lat = np.full(num_links, hop_latency)
    port_lat = np.concatenate((link_lat, np.full(2 * num_ep, ni_lat)))
    port_busy = np.zeros(port_bw.shape[0])
    ptr = port_ptr if ni_bw > 0 else route_ptr
    for p in range(phase_codes.shape[0]):
        combine = phase_codes[p] == 1
        m = 0
        for i in range(npairs):
            if combine:
                s = holder_ep[i]
                d = agg_ep[i]
            else:
                s = agg_ep[i]
                d = holder_ep[i]
            base = pair_ptr[s * num_ep + d]
            ncand = pair_ptr[s * num_ep + d + 1] - base
            for ch in range(chunks):
                r = base
                if ncand > 1:
                    h = _flow_hash4(layer, pair_tok[i], s, ch)
                    r = base + np.int64(h % np.uint64(ncand))
                pos[m] = ptr[r]
                stop[m] = ptr[r + 1]
                if tie_ref:
                    msg_rank[m] = route_rank[r]
                m += 1
        size_p = comb_size if combine else msg_size
        count_out[p] = num_msg
        if ni_bw <= 0:
            makespan_out[p] = des_core(pos, stop, size_p, msg_ready, msg_rank, route_links,
                                       link_bw, link_lat, tie_ref, busy_out[p], finish,
                                       cut_through)
            continue
        port_busy[:] = 0.0
        makespan_out[p] = des_core(pos, stop, size_p, msg_ready, msg_rank, port_links, port_bw,
                                   port_lat, tie_ref, port_busy, finish, cut_through)
        busy_out[p] += port_busy[:num_links]
    return True


# --------------------------------------------------------------------------------------------
# task generation (§6.2)


def _as_token_sets(token_sets: ArrayLike, num_experts: int) -> NDArray[np.int64]:
    ts = np.asarray(token_sets)
    if ts.ndim != 2:
        raise ConfigError(f"token_sets must be an integer array [T, k], got shape {ts.shape}")
    if ts.size and not np.issubdtype(ts.dtype, np.integer):
        raise ConfigError(f"token_sets must hold integer expert ids, got dtype {ts.dtype}")
    ts = np.ascontiguousarray(ts, dtype=np.int64)
    if ts.size and (ts.min() < 0 or ts.max() >= num_experts):
        raise ConfigError(f"token_sets holds expert ids in [{ts.min()}, {ts.max()}]; expected "
                          f"0 <= id < E = {num_experts}")
    return ts


def _as_holder_mask(holder_mask: ArrayLike) -> NDArray[np.bool_]:
    hm = np.asarray(holder_mask)
    if hm.ndim != 2:
        raise ConfigError(f"holder_mask must be an array [E, D], got shape {hm.shape}")
    if hm.dtype != np.bool_:
        hm = hm > 0  # a share matrix P [E, D]: every positive share is a holder
    return np.ascontiguousarray(hm)


@dataclass(frozen=True, eq=False)
class HolderTable:
    """Holder clusters of every expert of one layer, for fast aggregator draws (§6.2).

    Attributes:
        support: bool [E, D] P_ic > 0.
        num_holders: int64 [E].
        table: int64 [E, h] the holders in ascending order (padded with the last holder).
        all_held: whether every expert has at least one holder.
    """

    support: NDArray[np.bool_]
    num_holders: NDArray[np.int64]
    table: NDArray[np.int64]
    all_held: bool

    @classmethod
    def from_shares(cls, P: ArrayLike) -> HolderTable:
        """Build the table of a share (or bool support) matrix [E, D]."""
        support = np.ascontiguousarray(np.asarray(P) > 0)
        num = support.sum(axis=1).astype(np.int64)
        width = max(1, int(num.max(initial=1)))
        order = np.argsort(~support, axis=1, kind="stable")[:, :width]
        last = np.take_along_axis(order, np.maximum(num - 1, 0)[:, None], axis=1)
        table = np.where(np.arange(width) < num[:, None], order, last).astype(np.int64)
        return cls(support, num, table, bool((num > 0).all()))


def choose_aggregators(token_sets: ArrayLike, holders: HolderTable | ArrayLike, rule: str,
                       rng: np.random.Generator, extra_holders: ArrayLike | None = None
                       ) -> NDArray[np.int64]:
    """Choose the aggregator cluster of every token (or group) by ``rule`` (§6.2 step 2).

    Rules: ``ref`` — an expert of the set uniformly at random, its lowest-indexed holder cluster;
    ``uniform`` — an expert uniformly at random, then one of its holders uniformly at random;
    ``first`` — the first (smallest) expert id of the set, its lowest-indexed holder. An expert
    without holder is re-drawn among the others; this is implemented exactly as the equivalent
    uniform draw among the set positions whose expert has a holder (``first``: the smallest such
    expert). Random draws: one ``rng.integers`` call for the experts of all tokens, and for
    ``uniform`` one more for the holders (deterministic given the generator state).

    Extension (§10.7): a token none of whose experts has a holder (all its experts broadcast)
    aggregates on one of its ``extra_holders`` (uniformly at random for ``uniform``, with one
    more ``rng.integers`` call; the lowest otherwise) instead of raising.

    Args:
        token_sets: Int array [T, k] of expert ids per token.
        holders: The layer's ``HolderTable`` (fast path for internal callers: ``token_sets`` must
            then be a valid int64 array, it is not checked), or a bool array [E, D], True where
            cluster c holds (a shard of) expert i (a non-bool share matrix counts entries > 0 as
            holders; inputs are then validated).
        rule: ``"ref"``, ``"uniform"`` or ``"first"``.
        rng: The random generator (unused by ``first`` unless a token needs an extra holder).
        extra_holders: Optional int array [T, x] of further holder clusters per token (-1 =
            none), used only by tokens without a held expert.

    Returns:
        Int64 array [T] of aggregator clusters.

    Raises:
        ConfigError: Unknown rule, bad shapes or ids, or a token none of whose experts has a
            holder and which has no extra holder.
    """
    if rule not in AGGREGATOR_RULES:
        raise unknown_name("aggregator rule", rule, AGGREGATOR_RULES)
    if isinstance(holders, HolderTable):
        ts = np.asarray(token_sets)
        ex = None if extra_holders is None else np.asarray(extra_holders)
    else:
        hm = _as_holder_mask(holders)
        ts = _as_token_sets(token_sets, hm.shape[0])
        ex = None if extra_holders is None else _as_extra(extra_holders, ts.shape[0],
                                                          hm.shape[1])
        holders = HolderTable.from_shares(hm)
    num_tokens, top_k = ts.shape
    if num_tokens == 0:
        return np.zeros(0, dtype=np.int64)
    rows = np.arange(num_tokens)
    if holders.all_held:
        valid = None
        nvalid = np.full(num_tokens, top_k, dtype=np.int64)
        orphan = None
    else:
        valid = holders.num_holders[ts] > 0
        nvalid = valid.sum(axis=1)
        orphan = nvalid == 0
        if not orphan.any():
            orphan = None
        else:
            nvalid = np.where(orphan, 1, nvalid)
    if rule == "first":
        keyed = ts if valid is None else np.where(valid, ts, holders.support.shape[0])
        expert = keyed.min(axis=1)
        if orphan is not None:
            expert = np.where(orphan, ts[:, 0], expert)
    else:
        u = rng.integers(0, nvalid)                          # [T], uniform over valid slots
        pos = u if valid is None else (np.cumsum(valid, axis=1) <= u[:, None]).sum(axis=1)
        expert = ts[rows, np.minimum(pos, top_k - 1)]
    if rule == "uniform":
        v = rng.integers(0, np.maximum(holders.num_holders[expert], 1) if orphan is not None
                         else holders.num_holders[expert])
        agg = holders.table[expert, v]
    else:
        agg = holders.table[expert, 0]                       # lowest-indexed holder
    if orphan is not None:
        agg = agg.copy()
        idx = np.flatnonzero(orphan)
        if ex is None:
            t = int(idx[0])
            raise ConfigError(f"token {t} (experts {ts[t].tolist()}) has no expert with a holder "
                              f"cluster ({idx.size} such tokens) and no extra holders; every "
                              "token needs at least one held expert or an extra holder")
        ex = ex[idx]
        ok = ex >= 0
        count = ok.sum(axis=1)
        if (count == 0).any():
            t = int(idx[np.flatnonzero(count == 0)[0]])
            raise ConfigError(f"token {t} (experts {ts[t].tolist()}) has no holder and no extra "
                              "holder cluster")
        if rule == "uniform":
            pick = rng.integers(0, count)
            col = (np.cumsum(ok, axis=1) <= pick[:, None]).sum(axis=1)
            agg[idx] = ex[np.arange(idx.size), col]
        else:
            agg[idx] = np.where(ok, ex, np.iinfo(np.int64).max).min(axis=1)
    return agg.astype(np.int64, copy=False)


def _as_extra(extra_holders: ArrayLike | None, num_tokens: int,
              num_clusters: int) -> NDArray[np.int64]:
    if extra_holders is None:
        return np.zeros((num_tokens, 0), dtype=np.int64)
    ex = np.asarray(extra_holders)
    if ex.ndim == 1:
        ex = ex.reshape(-1, 1)
    if ex.ndim != 2 or ex.shape[0] != num_tokens or (
            ex.size and not np.issubdtype(ex.dtype, np.integer)):
        raise ConfigError(f"extra_holders must be an integer array [T={num_tokens}, x], got shape "
                          f"{ex.shape} and dtype {ex.dtype}")
    ex = np.ascontiguousarray(ex, dtype=np.int64)
    if ex.size and (ex.min() < -1 or ex.max() >= num_clusters):
        raise ConfigError(f"extra_holders ids must be -1 (none) or in [0, {num_clusters}); got "
                          f"range [{ex.min()}, {ex.max()}]")
    return ex


def _as_layer_inputs(token_sets: ArrayLike, msg_bytes: ArrayLike, holder_mask: ArrayLike,
                     agg: ArrayLike, pi: ArrayLike, extra_holders: ArrayLike | None,
                     num_endpoints: int | None) -> tuple[NDArray[Any], ...]:
    hm = _as_holder_mask(holder_mask)
    ts = _as_token_sets(token_sets, hm.shape[0])
    num_tokens = ts.shape[0]
    num_clusters = hm.shape[1]
    size = np.asarray(msg_bytes, dtype=np.float64)
    if size.ndim == 0:
        size = np.full(num_tokens, float(size))
    if size.shape != (num_tokens,):
        raise ConfigError(f"msg_bytes must be a scalar or shape [T={num_tokens}], got "
                          f"{size.shape}")
    if size.size and not (np.isfinite(size).all() and size.min() >= 0):
        raise ConfigError("msg_bytes must be finite and >= 0")
    ag = np.ascontiguousarray(agg, dtype=np.int64).reshape(-1)
    if ag.shape != (num_tokens,) or (ag.size and (ag.min() < 0 or ag.max() >= num_clusters)):
        raise ConfigError(f"agg must hold T={num_tokens} cluster ids in [0, {num_clusters}); got "
                          f"shape {ag.shape}")
    p = np.ascontiguousarray(pi, dtype=np.int64).reshape(-1)
    if p.shape != (num_clusters,):
        raise ConfigError(f"pi must have one endpoint per cluster, shape [D={num_clusters}], got "
                          f"{p.shape}")
    if num_endpoints is not None:
        if num_clusters != num_endpoints:
            raise ConfigError(f"holder_mask has D={num_clusters} clusters but the topology has "
                              f"{num_endpoints} endpoints")
        if p.size and (p.min() < 0 or p.max() >= num_endpoints
                       or np.bincount(p, minlength=num_endpoints).max() > 1):
            raise ConfigError(f"pi must be a permutation of the endpoints 0..{num_endpoints - 1}, "
                              f"got {p.tolist()}")
    ex = _as_extra(extra_holders, num_tokens, num_clusters)
    return ts, size, hm, ag, p, ex


@njit(cache=True)
def _layer_inputs_ok(ts: NDArray[np.int64], hm: NDArray[np.bool_], size: NDArray[np.float64],
                     agg: NDArray[np.int64], pi: NDArray[np.int64], ex: NDArray[np.int64],
                     num_endpoints: int) -> bool:
    """Return whether already-converted layer inputs pass every check of ``_as_layer_inputs``."""
    num_tokens = ts.shape[0]
    num_experts, num_clusters = hm.shape
    if size.shape[0] != num_tokens or agg.shape[0] != num_tokens or ex.shape[0] != num_tokens:
        return False
    if pi.shape[0] != num_clusters or num_clusters != num_endpoints:
        return False
    for t in range(num_tokens):
        for j in range(ts.shape[1]):
            if ts[t, j] < 0 or ts[t, j] >= num_experts:
                return False
        if not (size[t] >= 0 and size[t] < np.inf) or agg[t] < 0 or agg[t] >= num_clusters:
            return False
        for j in range(ex.shape[1]):
            if ex[t, j] < -1 or ex[t, j] >= num_clusters:
                return False
    seen = np.zeros(num_endpoints, dtype=np.bool_)
    for c in range(num_clusters):
        if pi[c] < 0 or pi[c] >= num_endpoints or seen[pi[c]]:
            return False
        seen[pi[c]] = True
    return True


def _fast_layer_inputs(token_sets: ArrayLike, msg_bytes: ArrayLike, holder_mask: ArrayLike,
                       agg: ArrayLike, pi: ArrayLike,
                       extra_holders: ArrayLike | None) -> tuple[NDArray[Any], ...] | None:
    """Convert well-formed layer inputs cheaply, or return None.

    The common case (integer token sets, a bool holder mask, no extra holders) is converted
    with at most one copy each and no checks: ``_layer_kernel`` validates in compiled code.
    Anything else returns None and goes through ``_as_layer_inputs``. Dtype kinds are tested
    directly because ``np.issubdtype`` costs ~0.4 us per call on this hot path.
    """
    ts = np.asarray(token_sets)
    hm = np.asarray(holder_mask)
    size = np.asarray(msg_bytes, dtype=np.float64)
    if not (ts.ndim == 2 and ts.dtype.kind in "iu" and hm.ndim == 2 and hm.dtype == np.bool_
            and size.ndim <= 1 and extra_holders is None):
        return None
    ts = np.ascontiguousarray(ts, dtype=np.int64)
    hm = np.ascontiguousarray(hm)
    if size.ndim == 0:
        size = np.full(ts.shape[0], float(size))
    ag = np.ascontiguousarray(agg, dtype=np.int64)
    p = np.ascontiguousarray(pi, dtype=np.int64)
    if ag.ndim != 1:
        ag = ag.reshape(-1)
    if p.ndim != 1:
        p = p.reshape(-1)
    return ts, size, hm, ag, p, np.zeros((ts.shape[0], 0), dtype=np.int64)


#: Kernel codes by validated phase tuple (at most a handful exist; 16 never evicts).
_PHASE_CODES: BoundedCache[tuple[str, ...], NDArray[np.int64]] = BoundedCache(
    16, name="hdamoe_env.noc.linksim.phase_codes")


def _phase_codes(phase_names: tuple[str, ...]) -> NDArray[np.int64]:
    """Validate a phase tuple once and cache its kernel codes (0 dispatch, 1 combine)."""
    codes = _PHASE_CODES.get(phase_names)
    if codes is None:
        for name in phase_names:
            if name not in PHASES:
                raise unknown_name("phase", name, PHASES)
        if len(set(phase_names)) != len(phase_names):
            raise ConfigError(f"phases must not repeat, got {list(phase_names)}")
        codes = np.array([PHASES.index(x) for x in phase_names], dtype=np.int64)
        codes.setflags(write=False)
        _PHASE_CODES.put(phase_names, codes)
    return codes


def layer_messages(token_sets: ArrayLike, msg_bytes: ArrayLike, holder_mask: ArrayLike,
                   agg: ArrayLike, pi: ArrayLike, extra_holders: ArrayLike | None = None, *,
                   direction: str = "combine", partial_mask: ArrayLike | None = None,
                   combine_bytes: ArrayLike | None = None,
                   ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64],
                              NDArray[np.int64]]:
    """Build the messages of one layer (§6.2), vectorised.

    Combine: for every token t the distinct clusters holding (a shard of) any expert of its set,
    plus its extra holder clusters, each send one message of ``msg_bytes[t]`` bytes (local
    pre-combination) to the aggregator cluster ``agg[t]``; the aggregator's own message is
    skipped. Dispatch (``direction="dispatch"``) is the reverse: aggregator → every other source.
    Messages are ordered by token, then ascending source cluster.

    Args:
        token_sets: Int array [T, k] of expert ids per token (or per group).
        msg_bytes: Float array [T] (or a scalar) of message sizes in bytes: h·b_msg per token,
            f_g·B·h·b_msg per group (static task set).
        holder_mask: Bool array [E, D] of holder clusters (a share matrix counts entries > 0).
        agg: Int array [T] of aggregator clusters (``choose_aggregators``).
        pi: Int array [D]: pi[c] = endpoint of logical cluster c.
        extra_holders: Optional int array [T, x] of further source clusters per token, -1 = none
            (e.g. pre-broadcast replicas or a dispatch node).
        direction: ``"combine"`` or ``"dispatch"``.
        partial_mask: Optional bool [E, D] partial-shard holders (``simulate_layer_comm``):
            their combine messages carry ``combine_bytes[t]`` bytes.
        combine_bytes: Float array [T] (or a scalar), with ``partial_mask``.

    Returns:
        ``(src_ep, dst_ep, size_bytes, task_id)``, each of shape [M]; ``task_id`` is the token
        (group) index.
    """
    if direction not in PHASES:
        raise unknown_name("direction", direction, PHASES)
    ts, size, hm, ag, p, ex = _as_layer_inputs(token_sets, msg_bytes, holder_mask, agg, pi,
                                               extra_holders, None)
    num_tokens = ts.shape[0]
    touch = hm[ts].any(axis=1)                                # [T, D]
    rows = np.arange(num_tokens)
    if ex.size:
        r, j = np.nonzero(ex >= 0)
        touch[r, ex[r, j]] = True
    touch[rows, ag] = False
    task, cluster = np.nonzero(touch)                         # token-major, ascending cluster
    holder_ep = p[cluster]
    agg_ep = p[ag[task]]
    task = task.astype(np.int64)
    if direction == "combine":
        pm, cb = _as_partial(partial_mask, combine_bytes, (ts, size, hm, ag, p, ex))
        if pm.shape[0] == 0:
            return holder_ep, agg_ep, size[task], task
        partial = pm[ts].any(axis=1)[task, cluster]
        return holder_ep, agg_ep, np.where(partial, cb[task], size[task]), task
    return agg_ep, holder_ep, size[task], task


def layer_flow_keys(layer: int, task_id: ArrayLike, src_ep: ArrayLike,
                    chunks: int = 1) -> NDArray[np.int64]:
    """Return flow keys for ``simulate_messages`` equal to those of ``simulate_layer_comm``.

    The layer path keys every message by (layer, task id, source endpoint, chunk index). With
    ``chunks == 1`` this returns [M, 4] keys with chunk index 0; with ``chunks > 1`` it returns
    [M, 3] keys, to which ``simulate_messages`` appends the chunk index.
    """
    task = np.asarray(task_id, dtype=np.int64).reshape(-1)
    src = np.asarray(src_ep, dtype=np.int64).reshape(-1)
    cols = [np.full(task.size, int(layer), dtype=np.int64), task, src]
    if check_chunks(chunks) == 1:
        cols.append(np.zeros(task.size, dtype=np.int64))
    return np.column_stack(cols)


def _comm_options(switching: str, ni_bw_Bps: float | None, tie_break: str,
                  hop_latency_s: float, ni_latency_s: float | None, chunks: int
                  ) -> tuple[bool, float, bool, float, float, int]:
    """Check the DES options of a layer run: (cut-through, port bandwidth (0 = no ports), ref
    tie rule, hop latency, port latency, chunks).

    Raises:
        ConfigError: An invalid switching, port bandwidth or latency, tie rule or chunk count.
    """
    cut = check_switching(switching)
    ni_bw = 0.0 if ni_bw_Bps is None else check_ni_bandwidth(ni_bw_Bps)
    tie_ref = tie_break_is_ref(tie_break)
    hop = check_scalar("hop_latency_s", hop_latency_s)
    return cut, ni_bw, tie_ref, hop, check_ni_latency(ni_latency_s, hop), check_chunks(chunks)


def simulate_layer_comm(topology: Topology, token_sets: ArrayLike, msg_bytes: ArrayLike,
                        holder_mask: ArrayLike, pi: ArrayLike, agg: ArrayLike, *,
                        phases: Sequence[str] = PHASES, tie_break: str = "fifo",
                        hop_latency_s: float = 0.0, layer: int = 0,
                        extra_holders: ArrayLike | None = None, chunks: int = 1,
                        alpha_s: float = 0.0, partial_mask: ArrayLike | None = None,
                        combine_bytes: ArrayLike | None = None,
                        switching: str = "store_and_forward",
                        ni_bw_Bps: float | None = None,
                        ni_latency_s: float | None = None) -> LayerComm:
    """Simulate the MoE communication of one layer: message generation plus one DES per phase.

    The production path (§6.2–6.3): equivalent to ``layer_messages`` followed by
    ``simulate_messages`` per phase with flow keys ``layer_flow_keys(layer, task, src)``, but
    compiled into one call. Every phase starts with idle links at t = 0.

    Args:
        topology: The NoC; its endpoint count must equal D.
        token_sets: Int array [T, k] of expert ids per token (or group).
        msg_bytes: Float array [T] (or a scalar) of message sizes in bytes.
        holder_mask: Bool array [E, D] of holder clusters (a share matrix counts entries > 0).
        pi: Int array [D], a permutation: pi[c] = endpoint of logical cluster c.
        agg: Int array [T] of aggregator clusters.
        phases: Phases to simulate, in order: any of ``"dispatch"``, ``"combine"``.
        tie_break: ``"fifo"`` or ``"ref"``.
        hop_latency_s: Latency added after every link traversal, seconds.
        layer: Layer index (enters the flow key).
        extra_holders: Optional int array [T, x] of further source clusters, -1 = none.
        chunks: Split every message into this many equal parts.
        alpha_s: Start-up latency α of every message (α–β model, docs/PHYSICS.md): a message
            can enter the network α after it is ready. All messages of a phase are ready at
            t = 0, so the DES is the same run shifted by α: a phase's makespan grows by α
            when any message leaves its node, busy times are unchanged.
        partial_mask: Optional bool array [E, D]: cluster c holds a partial shard of expert i
            (0 < P_ic < 1). A combine message from such a cluster for a token with expert i
            carries partial sums of ``combine_bytes[t]`` bytes (``psum_combine``,
            docs/PHYSICS.md); all other messages keep ``msg_bytes[t]``. Needs ``combine_bytes``.
        combine_bytes: Float array [T] (or a scalar) of partial-sum combine message sizes.
        switching: ``"store_and_forward"`` or ``"cut_through"`` (``hdamoe_env.noc.des``).
        ni_bw_Bps: ``None`` or the bandwidth of one injection and one ejection port per
            endpoint (``des.simulate_messages``).
        ni_latency_s: Latency of each port, seconds; ``None`` = the hop latency.

    Returns:
        Makespan, per-link busy time and message count per phase.

    Raises:
        ConfigError: Invalid shapes, ids, phases, tie rule, latency, chunk count or switching.
    """
    cut, ni_bw, tie_ref, hop, ni_lat, chunks = _comm_options(
        switching, ni_bw_Bps, tie_break, hop_latency_s, ni_latency_s, chunks)
    phase_names = tuple(phases)
    codes = _phase_codes(phase_names)
    if isinstance(layer, bool) or not isinstance(layer, int | np.integer) or layer < 0:
        raise ConfigError(f"layer must be an integer >= 0, got {layer!r}")
    busy = np.zeros((codes.size, topology.num_links))
    makespan = np.zeros(codes.size)
    counts = np.zeros(codes.size, dtype=np.int64)
    arrays = _fast_layer_inputs(token_sets, msg_bytes, holder_mask, agg, pi, extra_holders)
    psum = _as_partial(partial_mask, combine_bytes, arrays)
    args = (psum, chunks, int(layer), topology, hop, tie_ref, codes, busy, makespan, counts, cut,
            ni_bw, ni_lat)
    if arrays is None or not _run_layer_kernel(arrays, *args):
        # the slow path converts everything and raises the detailed ConfigError
        arrays = _as_layer_inputs(token_sets, msg_bytes, holder_mask, agg, pi, extra_holders,
                                  topology.num_endpoints)
        psum = _as_partial(partial_mask, combine_bytes, arrays)
        if not _run_layer_kernel(arrays, psum, *args[1:]):
            raise ConfigError("layer inputs failed validation")  # not reached: see above
    alpha = check_scalar("alpha_s", alpha_s)
    if alpha > 0:
        makespan = np.where(makespan > 0, makespan + alpha, makespan)
    return LayerComm(phase_names, tuple(makespan.tolist()), busy, tuple(counts.tolist()))


def simulate_layers_comm(topology: Topology, token_sets: NDArray[np.int64],
                         msg_bytes: NDArray[np.float64], holder_masks: NDArray[np.bool_],
                         pis: NDArray[np.int64], aggs: NDArray[np.int64],
                         layers: NDArray[np.int64], *, phases: Sequence[str] = PHASES,
                         tie_break: str = "fifo", hop_latency_s: float = 0.0, chunks: int = 1,
                         alpha_s: float = 0.0, switching: str = "store_and_forward",
                         ni_bw_Bps: float | None = None, ni_latency_s: float | None = None,
                         threads: int = 1, mask_of: NDArray[np.int64] | None = None,
                         extra_holders: NDArray[np.int64] | None = None
                         ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """``simulate_layer_comm`` of n layer runs in one compiled call (the batched vector env).

    Run j simulates layer ``layers[j]`` (holder mask ``holder_masks[layers[j]]``, or
    ``holder_masks[mask_of[j]]``; endpoints ``pis[layers[j]]``) with token sets
    ``token_sets[j]``, aggregators ``aggs[j]`` and extra holders ``extra_holders[j]`` (none by
    default); no partial shards. Every run equals ``simulate_layer_comm`` with the same
    arguments (the same kernel, ``_layer_kernel``, per run).

    Args:
        topology: The NoC; its endpoint count must equal D.
        token_sets: int64 [n, T, k] expert sets of every run.
        msg_bytes: float64 [T] message sizes, shared by the runs.
        holder_masks: bool [L, E, D] holder clusters of every layer (or [M, E, D], the rows
            ``mask_of`` picks).
        pis: int64 [L, D] endpoint of every cluster of every layer.
        aggs: int64 [n, T] aggregator clusters of every run.
        layers: int64 [n] layer of every run (enters the flow keys).
        phases, tie_break, hop_latency_s, chunks, alpha_s, switching, ni_bw_Bps, ni_latency_s:
            As ``simulate_layer_comm``.
        threads: numba threads the runs are spread over (``check_threads``); 1 runs them in
            order on the calling thread. The results are bit-identical for every value.
        mask_of: int64 [n] row of ``holder_masks`` of every run (e.g. one mask per run, the
            layer's shares with broadcast experts zeroed), or None: ``layers``.
        extra_holders: int64 [n, T, x] further holder clusters of every run's tokens (−1 =
            none; a run pads with −1, which changes nothing), or None.

    Returns:
        ``makespan`` float64 [n, P] (α added as in ``simulate_layer_comm``) and ``busy``
        float64 [n, P, num_links].

    Raises:
        ConfigError: Invalid options (including ``threads``), or a run whose inputs fail
            validation (the message names the run; ``simulate_layer_comm`` of that run gives
            the details).
    """
    threads = check_threads(threads)
    cut, ni_bw, tie_ref, hop, ni_lat, chunks = _comm_options(
        switching, ni_bw_Bps, tie_break, hop_latency_s, ni_latency_s, chunks)
    codes = _phase_codes(tuple(phases))
    alpha = check_scalar("alpha_s", alpha_s)
    ts = np.ascontiguousarray(token_sets, dtype=np.int64)
    ag = np.ascontiguousarray(aggs, dtype=np.int64)
    lay = np.ascontiguousarray(layers, dtype=np.int64)
    n = lay.shape[0]
    if ts.ndim != 3 or ts.shape[0] != n or ag.shape != ts.shape[:2]:
        raise ConfigError(f"token_sets [n, T, k] and aggs [n, T] must match layers [n={n}], got "
                          f"{ts.shape} and {ag.shape}")
    rows = lay if mask_of is None else np.ascontiguousarray(mask_of, dtype=np.int64)
    if rows.shape != (n,) or (n and (rows.min() < 0 or rows.max() >= holder_masks.shape[0])):
        raise ConfigError(f"layers (or mask_of) must hold n={n} rows of holder_masks in [0, "
                          f"{holder_masks.shape[0]}), got {rows.tolist()}")
    if n and (lay.min() < 0 or lay.max() >= pis.shape[0]):
        raise ConfigError(f"layers must lie in [0, {pis.shape[0]}), got {lay.tolist()}")
    extras = (np.zeros((n, ts.shape[1], 0), dtype=np.int64) if extra_holders is None
              else np.ascontiguousarray(extra_holders, dtype=np.int64))
    if extras.ndim != 3 or extras.shape[:2] != ts.shape[:2]:
        raise ConfigError(f"extra_holders must have shape [n, T, x] = [{n}, {ts.shape[1]}, x], "
                          f"got {extras.shape}")
    check_ref_size(tie_ref, ts.shape[1] * topology.num_endpoints * chunks)
    size = np.ascontiguousarray(msg_bytes, dtype=np.float64)
    busy = np.zeros((n, codes.size, topology.num_links))
    makespan = np.zeros((n, codes.size))
    counts = np.zeros((n, codes.size), dtype=np.int64)
    args = (ts, np.ascontiguousarray(holder_masks, dtype=np.bool_), rows, extras,
            np.ascontiguousarray(pis, dtype=np.int64), ag, lay, size, chunks,
            topology.pair_route_ptr, topology.route_ptr, topology.route_links,
            topology.link_bw_Bps, topology.route_lex_rank, hop, tie_ref, topology.num_endpoints,
            codes, busy, makespan, counts, cut, ni_bw, ni_lat, *_port_arrays(topology, ni_bw))
    if threads == 1 or n < 2:
        bad = _layers_kernel(*args)
    else:
        with numba_threads(threads):
            bad = _layers_kernel_par(*args)
    if bad >= 0:
        raise ConfigError(f"run {bad} (layer {int(lay[bad])}): layer inputs failed validation; "
                          "simulate_layer_comm of that run names the problem")
    if alpha > 0:
        makespan = np.where(makespan > 0, makespan + alpha, makespan)
    return makespan, busy


#: numba threading layers ``numba_threads`` tries, in order, when the process has not chosen
#: one (numba's own order puts TBB first). OpenMP's calling thread takes a share of the work, so
#: a 2-thread call wakes one worker; numba's workqueue wakes two and idles the caller: in the
#: env on idle cores 2 threads gave 3.37x the single env with the workqueue and 4.36x with
#: OpenMP (docs/results/throughput.md, seventh round). The workqueue remains where numba has no
#: OpenMP runtime.
THREADING_LAYERS: tuple[str, ...] = ("omp", "workqueue", "tbb")
#: ``OMP_WAIT_POLICY`` set for the OpenMP runtime unless the process set one: ``passive``
#: workers sleep between calls. Spinning ones (GNU's default spins briefly, ``active`` without
#: end) made 2-thread calls up to 3x slower than 1 thread while other processes held the
#: cores, and gained nothing on idle cores (4.36x passive, 4.47x active, same session).
OMP_WAIT_POLICY = "passive"


def check_threads(threads: int, name: str = "threads") -> int:
    """Return ``threads`` checked as a numba thread count for ``simulate_layers_comm``.

    Args:
        threads: The count.
        name: The option's name in the error message.

    Raises:
        ConfigError: Not an integer in [1, ``numba.config.NUMBA_NUM_THREADS``] (numba's pool
            size, fixed when the process starts: the ``NUMBA_NUM_THREADS`` environment
            variable, else the number of cores).
    """
    limit = int(numba.config.NUMBA_NUM_THREADS)
    if isinstance(threads, bool) or not isinstance(threads, int | np.integer) or threads < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {threads!r}; use 1 for the "
                          f"serial kernel or up to {limit} (numba's thread pool)")
    if threads > limit:
        raise ConfigError(f"{name}={int(threads)} exceeds numba's thread pool of {limit} "
                          f"(NUMBA_NUM_THREADS); use {name} <= {limit}, or start Python with "
                          f"NUMBA_NUM_THREADS={int(threads)} or more")
    return int(threads)


@contextlib.contextmanager
def numba_threads(threads: int) -> Iterator[None]:
    """Run the block with ``numba.set_num_threads(threads)``; restore the previous count.

    Unless the process chose numba's threading layer (``NUMBA_THREADING_LAYER`` or
    ``numba.config.THREADING_LAYER`` set to anything but ``"default"``), the first call sets
    numba's layer priority to :data:`THREADING_LAYERS` and, unless set, ``OMP_WAIT_POLICY`` to
    :data:`OMP_WAIT_POLICY` before numba starts its threads (numba fixes the layer then, for
    the whole process; the OpenMP runtime reads its environment when it loads). A process
    that has used the OpenMP layer must not fork children that call threaded kernels (GNU
    OpenMP is not fork-safe; numba stops such a child with an error): start them with
    ``spawn`` or keep ``threads=1`` in the parent.

    Raises:
        ConfigError: ``threads`` fails ``check_threads``.
    """
    threads = check_threads(threads)
    if numba.config.THREADING_LAYER == "default" and "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER_PRIORITY = list(THREADING_LAYERS)
        os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
    before = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        yield
    finally:
        numba.set_num_threads(before)


@njit(cache=True)
def _layers_kernel(token_sets: NDArray[np.int64], holder_masks: NDArray[np.bool_],
                   mask_of: NDArray[np.int64], extras: NDArray[np.int64],
                   pis: NDArray[np.int64], aggs: NDArray[np.int64], layers: NDArray[np.int64],
                   msg_bytes: NDArray[np.float64], chunks: int, pair_ptr: NDArray[np.int64],
                   route_ptr: NDArray[np.int64], route_links: NDArray[np.int32],
                   link_bw: NDArray[np.float64], route_rank: NDArray[np.int64],
                   hop_latency: float, tie_ref: bool, num_endpoints: int,
                   phase_codes: NDArray[np.int64], busy_out: NDArray[np.float64],
                   makespan_out: NDArray[np.float64], count_out: NDArray[np.int64],
                   cut_through: bool, ni_bw: float, ni_lat: float, port_ptr: NDArray[np.int64],
                   port_links: NDArray[np.int32]) -> int:
    """``_layer_kernel`` for every run of ``simulate_layers_comm`` (run j: holder mask
    ``holder_masks[mask_of[j]]``, extra holders ``extras[j]`` [T, x], endpoints
    ``pis[layers[j]]``); the first invalid run, or −1."""
    no_partial = np.zeros((0, 1), dtype=np.bool_)
    no_sizes = np.zeros(0)
    for j in range(layers.shape[0]):
        layer = layers[j]
        if not _layer_kernel(token_sets[j], holder_masks[mask_of[j]], extras[j], aggs[j],
                             pis[layer], msg_bytes, no_partial, no_sizes, chunks, layer,
                             pair_ptr, route_ptr, route_links, link_bw, route_rank, hop_latency,
                             tie_ref, num_endpoints, phase_codes, busy_out[j], makespan_out[j],
                             count_out[j], cut_through, ni_bw, ni_lat, port_ptr, port_links):
            return j
    return -1


@njit(cache=True, parallel=True)
def _layers_kernel_par(token_sets: NDArray[np.int64], holder_masks: NDArray[np.bool_],
                       mask_of: NDArray[np.int64], extras: NDArray[np.int64],
                       pis: NDArray[np.int64], aggs: NDArray[np.int64],
                       layers: NDArray[np.int64], msg_bytes: NDArray[np.float64], chunks: int,
                       pair_ptr: NDArray[np.int64], route_ptr: NDArray[np.int64],
                       route_links: NDArray[np.int32], link_bw: NDArray[np.float64],
                       route_rank: NDArray[np.int64], hop_latency: float, tie_ref: bool,
                       num_endpoints: int, phase_codes: NDArray[np.int64],
                       busy_out: NDArray[np.float64], makespan_out: NDArray[np.float64],
                       count_out: NDArray[np.int64], cut_through: bool, ni_bw: float,
                       ni_lat: float, port_ptr: NDArray[np.int64],
                       port_links: NDArray[np.int32]) -> int:
    """``_layers_kernel`` with the runs spread over numba's threads (``prange``).

    The runs are independent: run j reads only shared inputs and writes only row j of
    ``busy_out`` / ``makespan_out`` / ``count_out``, with the same arithmetic as the serial
    kernel, so every valid run's results are bit-identical to it. Each run records whether its
    inputs failed validation; the smallest such j is returned (−1 if none), as the serial
    kernel does (which stops there; here later runs are simulated too, and the caller discards
    everything on error).
    """
    n = layers.shape[0]
    no_partial = np.zeros((0, 1), dtype=np.bool_)
    no_sizes = np.zeros(0)
    failed = np.zeros(n, dtype=np.bool_)
    for j in prange(n):
        layer = layers[j]
        failed[j] = not _layer_kernel(token_sets[j], holder_masks[mask_of[j]], extras[j],
                                      aggs[j], pis[layer], msg_bytes, no_partial, no_sizes,
                                      chunks, layer, pair_ptr, route_ptr, route_links, link_bw,
                                      route_rank, hop_latency, tie_ref, num_endpoints,
                                      phase_codes, busy_out[j], makespan_out[j], count_out[j],
                                      cut_through, ni_bw, ni_lat, port_ptr, port_links)
    for j in range(n):
        if failed[j]:
            return j
    return -1


@njit(cache=True)
def _bounded(state: int, rng: int) -> int:
    """One value of ``Generator.integers(0, rng + 1)`` (an element of an array ``high``) for
    0 <= rng < 2**32 − 1: numpy's ``random_bounded_uint64`` without a buffer, i.e. no draw for
    rng = 0, else Lemire's multiply-shift rejection on ``next_uint32``."""
    if rng == 0:
        return 0
    excl = np.uint64(rng) + np.uint64(1)
    m = np.uint64(_next_uint32(state)) * excl
    leftover = m & _U32_MAX
    if leftover < excl:
        threshold = (_U32_MAX - np.uint64(rng)) % excl
        while leftover < threshold:
            m = np.uint64(_next_uint32(state)) * excl
            leftover = m & _U32_MAX
    return np.int64(m >> np.uint64(32))


@njit(cache=True)
def _aggregators_kernel(token_sets: NDArray[np.int64], layers: NDArray[np.int64],
                        tables: NDArray[np.int64], num_holders: NDArray[np.int64],
                        states: NDArray[np.uint64], rule: int, out: NDArray[np.int64]) -> int:
    """``choose_aggregators`` of every run (rule 0 ``ref``, 1 ``uniform``, 2 ``first``), the
    draws from each run's PCG64 state; return the first run with a token none of whose experts
    has a holder (nothing drawn for it), or −1."""
    n, num_tokens, top_k = token_sets.shape
    expert = np.empty(num_tokens, dtype=np.int64)
    for j in range(n):
        layer = layers[j]
        ts = token_sets[j]
        nh = num_holders[layer]
        for t in range(num_tokens):
            held = 0
            for s in range(top_k):
                if nh[ts[t, s]] > 0:
                    held += 1
            if held == 0:
                return j
        for t in range(num_tokens):      # one draw per token (array ``high`` = valid slots)
            if rule == 2:
                best = -1
                for s in range(top_k):
                    e = ts[t, s]
                    if nh[e] > 0 and (best < 0 or e < best):
                        best = e
                expert[t] = best
                continue
            held = 0
            for s in range(top_k):
                if nh[ts[t, s]] > 0:
                    held += 1
            u = _bounded(states[j], held - 1)
            pos = 0                                    # the u-th slot whose expert is held
            seen = 0
            for s in range(top_k):
                if nh[ts[t, s]] > 0:
                    if seen == u:
                        pos = s
                        break
                    seen += 1
            expert[t] = ts[t, pos]
        for t in range(num_tokens):      # uniform: one more draw per token among its holders
            e = expert[t]
            v = _bounded(states[j], nh[e] - 1) if rule == 1 else 0
            out[j, t] = tables[layer, e, v]
    return -1


def holder_arrays(holders: Sequence[HolderTable]
                  ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Return the ``aggregators_many`` arrays of per-layer holder tables: ``tables`` int64
    [L, E, h] (each layer's ``table``, zero-padded) and ``num_holders`` int64 [L, E]."""
    num_experts = holders[0].num_holders.shape[0]
    width = max(h.table.shape[1] for h in holders)
    tables = np.zeros((len(holders), num_experts, width), dtype=np.int64)
    for layer, h in enumerate(holders):
        tables[layer, :, :h.table.shape[1]] = h.table
    nh = np.ascontiguousarray(np.stack([h.num_holders for h in holders]), dtype=np.int64)
    return tables, nh


def aggregators_many(token_sets: NDArray[np.int64], layers: NDArray[np.int64],
                     holders: tuple[NDArray[np.int64], NDArray[np.int64]], rule: str,
                     states: NDArray[np.uint64]) -> tuple[NDArray[np.int64], int]:
    """``choose_aggregators`` (no extra holders) of n runs in one compiled call.

    Run j chooses the aggregators of ``token_sets[j]`` at layer ``layers[j]`` (holder table
    ``holders[layers[j]]``) drawing from the PCG64 state at address ``states[j]`` (the
    generator's ``bit_generator.ctypes.state_address``): the same values and the same stream
    position as ``choose_aggregators(token_sets[j], holders[layers[j]], rule, rng)``.

    Args:
        token_sets: int64 [n, T, k] valid expert ids.
        layers: int64 [n] layer of every run.
        holders: ``holder_arrays`` of the layers' holder tables.
        rule: ``"ref"``, ``"uniform"`` or ``"first"``.
        states: uint64 [n] PCG64 state addresses; each generator must outlive the call.

    Returns:
        ``(aggs int64 [n, T], stop)``: ``stop`` = −1 when every run is done; otherwise run
        ``stop`` has a token without a held expert and runs ``stop``.. are not chosen (and
        nothing was drawn for them): call ``choose_aggregators`` for run ``stop`` (it raises
        or uses extra holders) and this function again for the rest.

    Raises:
        ConfigError: Unknown rule.
    """
    if rule not in AGGREGATOR_RULES:
        raise unknown_name("aggregator rule", rule, AGGREGATOR_RULES)
    tables, nh = holders
    out = np.zeros(token_sets.shape[:2], dtype=np.int64)
    stop = _aggregators_kernel(np.ascontiguousarray(token_sets, dtype=np.int64),
                               np.ascontiguousarray(layers, dtype=np.int64), tables, nh,
                               np.ascontiguousarray(states, dtype=np.uint64),
                               AGGREGATOR_RULES.index(rule), out)
    return out, int(stop)


def _as_partial(partial_mask: ArrayLike | None, combine_bytes: ArrayLike | None,
                arrays: tuple[NDArray[Any], ...] | None
                ) -> tuple[NDArray[np.bool_], NDArray[np.float64]]:
    """Return the kernel's (partial mask, combine sizes); a [0, D] mask when there is none.

    Raises:
        ConfigError: Only one of the two is given, or their shapes or values are invalid.
    """
    if partial_mask is None and combine_bytes is None:
        return _NO_PARTIAL, _NO_SIZES
    if partial_mask is None or combine_bytes is None:
        raise ConfigError("partial_mask and combine_bytes must be given together")
    pm = np.ascontiguousarray(partial_mask, dtype=np.bool_)
    cb = np.asarray(combine_bytes, dtype=np.float64)
    if arrays is None:  # the slow path will convert and check the other inputs first
        return pm, np.atleast_1d(cb)
    num_tokens = arrays[0].shape[0]
    if cb.ndim == 0:
        cb = np.full(num_tokens, float(cb))
    if pm.shape != arrays[2].shape:
        raise ConfigError(f"partial_mask must have the holder mask's shape {arrays[2].shape}, "
                          f"got {pm.shape}")
    if cb.shape != (num_tokens,) or (cb.size and not (np.isfinite(cb).all()
                                                      and cb.min() >= 0)):
        raise ConfigError(f"combine_bytes must be finite, >= 0 and of shape [T={num_tokens}], "
                          f"got shape {cb.shape}")
    return pm, np.ascontiguousarray(cb)


_NO_PARTIAL = np.zeros((0, 1), dtype=np.bool_)
_NO_SIZES = np.zeros(0, dtype=np.float64)
_NO_PORTS = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32))



def _port_arrays(topology: Topology, ni_bw: float
                 ) -> tuple[NDArray[np.int64], NDArray[np.int32]]:
    """Return the kernel's port routes of ``topology`` (empty arrays without ports)."""
    return _NO_PORTS if ni_bw <= 0 else port_routes(topology)


def _run_layer_kernel(arrays: tuple[NDArray[Any], ...],
                      psum: tuple[NDArray[np.bool_], NDArray[np.float64]], chunks: int,
                      layer: int, topology: Topology, hop: float, tie_ref: bool,
                      codes: NDArray[np.int64], busy: NDArray[np.float64],
                      makespan: NDArray[np.float64], counts: NDArray[np.int64], cut: bool,
                      ni_bw: float, ni_lat: float) -> bool:
    """Call ``_layer_kernel`` on converted inputs; False when they fail its validation."""
    ts, size, hm, ag, p, ex = arrays
    check_ref_size(tie_ref, ts.shape[0] * topology.num_endpoints * chunks)
    return _layer_kernel(ts, hm, ex, ag, p, size, psum[0], psum[1], chunks, layer,
                         topology.pair_route_ptr,
                         topology.route_ptr, topology.route_links, topology.link_bw_Bps,
                         topology.route_lex_rank, hop, tie_ref, topology.num_endpoints, codes,
                         busy, makespan, counts, cut, ni_bw, ni_lat,
                         *_port_arrays(topology, ni_bw))
