"""MoE task generation and the busy-until discrete-event NoC simulator.

Implements paper-model.md §6.2 (task generation: aggregators, combine and dispatch messages) and
§6.3 (event loop), on the topologies of ``hdamoe_env.topology`` (§6.1).

Model (§6.3). Fluid store-and-forward: a message occupies one directed link at a time, the next
hop starts when the whole message has crossed the previous one, per-hop time = size / bandwidth
of that link, plus an optional fixed ``hop_latency_s`` after every traversal. No flits, credits,
back-pressure or injection limits; the only resources are the directed links, each served in
event order (first come, first served). The earliest pending event is popped; its hop starts at
``max(t, busy_until[link])``. Equal event times are ordered by the tie rule:

* ``fifo`` — insertion order (a global sequence counter incremented at every push);
* ``ref`` — by remaining bytes (whole messages: the message size) ascending, then by the route
  compared lexicographically as a list of link labels (``Topology.route_lex_rank``), then by
  insertion order (quirk Q19).

Two implementations share those semantics and agree bit for bit (same floating-point operations
in the same order):

* the production kernel (numba ``@njit(cache=True)``): events of equal time grouped in buckets
  (linked lists), a binary heap of buckets and a hash table from time to open bucket
  (``_des_core``), per-link ``busy_until`` and ``busy_time`` arrays;
* ``simulate_messages_oracle``: a small pure-Python interval calendar (per-link reserved intervals,
  earliest-gap search at or after the ready time, heap of plain tuples), i.e. the reference
  semantics of §6.3 "Equivalence with the reference"; it exists for tests and benchmarks.

``simulate_layer_comm`` is the production path for one MoE layer: message generation, route
selection (flow key = (layer, task id, source endpoint, chunk index), §6.1) and both DES runs
happen inside one compiled call.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.errors import ConfigError, unknown_name
from hdamoe_env.topology import Topology

__all__ = [
    "AGGREGATOR_RULES",
    "PHASES",
    "TIE_BREAKS",
    "DesResult",
    "LayerComm",
    "choose_aggregators",
    "default_ring",
    "layer_flow_keys",
    "layer_messages",
    "link_load_bound",
    "ring_allreduce_des",
    "simulate_layer_comm",
    "simulate_messages",
    "simulate_messages_oracle",
]

TIE_BREAKS = ("fifo", "ref")
AGGREGATOR_RULES = ("ref", "uniform", "first")
PHASES = ("dispatch", "combine")

# splitmix64 constants of ``topology.stable_hash`` as numba compile-time constants
_U_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_U_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_U_MIX2 = np.uint64(0x94D049BB133111EB)
_U30 = np.uint64(30)
_U27 = np.uint64(27)
_U31 = np.uint64(31)


@dataclass(frozen=True, slots=True, eq=False)
class DesResult:
    """Result of one DES run (§6.3).

    Attributes:
        makespan_s: latest finish time over all messages (0 when there are none), seconds.
        link_busy_s: float64 [num_links] total time every directed link carried data, seconds.
        finish_s: float64 [M] finish time of every input message (with ``chunks > 1`` the finish
            of its last part); messages with an empty route finish at their ready time.
    """

    makespan_s: float
    link_busy_s: NDArray[np.float64]
    finish_s: NDArray[np.float64]


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
# compiled kernel


# ref tie key = dense rank of size_rank * (num_routes + 1) + route_rank: the limit keeps that
# product far below 2**63
_MAX_REF_MESSAGES = 1 << 22


def _check_ref_size(tie_ref: bool, num_messages: int) -> None:
    if tie_ref and num_messages > _MAX_REF_MESSAGES:
        raise ConfigError(f"tie_break='ref' supports at most {_MAX_REF_MESSAGES} messages per DES "
                          f"run, got {num_messages}; use tie_break='fifo' or fewer chunks")


@njit(cache=True)
def _dense_rank(values: NDArray[Any]) -> NDArray[np.int64]:
    """Return the dense rank [M] of ``values`` (equal values share a rank)."""
    order = np.argsort(values, kind="mergesort")
    rank = np.empty(values.shape[0], dtype=np.int64)
    current = -1
    for i in range(order.shape[0]):
        m = order[i]
        if i == 0 or values[m] != values[order[i - 1]]:
            current += 1
        rank[m] = current
    return rank


_U_FIB = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: multiplicative (Fibonacci) hash


@intrinsic
def _float_bits(typingctx: Any, x: Any) -> Any:
    """Reinterpret a float64 as its uint64 bit pattern (no conversion)."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(64))
    return types.uint64(types.float64), codegen


@intrinsic
def _count_trailing_zeros(typingctx: Any, x: Any) -> Any:
    """Index of the lowest set bit of a non-zero uint64 (LLVM ``cttz``)."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))
    return types.uint64(types.uint64), codegen


@njit(cache=True, inline="always")
def _home_slot(bits: np.uint64, shift: np.uint64) -> np.uint64:
    """Home slot of a time (as bits) in a hash table of 2**(64 - shift) slots."""
    return (bits * _U_FIB) >> shift


@njit(cache=True)
def _table_remove(i: np.uint64, s_bits: NDArray[np.uint64], s_b: NDArray[np.int64],
                  b_slot: NDArray[np.uint64], shift: np.uint64) -> None:
    """Empty slot ``i`` of the linear-probing table (backward-shift deletion).

    Later entries of the probe chain whose home slot does not lie cyclically in (hole, entry]
    move into the hole, so lookups never meet tombstones.
    """
    mask = np.uint64(s_b.shape[0] - 1)
    one = np.uint64(1)
    k = (i + one) & mask
    while s_b[k] >= 0:
        home = _home_slot(s_bits[k], shift)
        if ((k - home) & mask) >= ((k - i) & mask):
            s_bits[i] = s_bits[k]
            s_b[i] = s_b[k]
            b_slot[s_b[i]] = i
            i = k
        k = (k + one) & mask
    s_b[i] = -1


@njit(cache=True)
def _stable_sort_by_key(run: NDArray[np.int64], count: int, key: NDArray[np.int64]) -> None:
    """Sort ``run[:count]`` by ``key[run[i]]``, keeping the order of equal keys."""
    if count <= 32:  # insertion sort: buckets are short and mostly in key order already
        for i in range(1, count):
            m = run[i]
            j = i - 1
            while j >= 0 and key[run[j]] > key[m]:
                run[j + 1] = run[j]
                j -= 1
            run[j + 1] = m
    else:
        part = run[:count].copy()
        order = np.argsort(key[part], kind="mergesort")
        for i in range(count):
            run[i] = part[order[i]]


@njit(cache=True)
def _des_core(  # noqa: C901 - one flat event loop is what keeps the kernel fast
    pos: NDArray[np.int64], stop: NDArray[np.int64], msg_size: NDArray[np.float64],
    msg_ready: NDArray[np.float64], msg_rank: NDArray[np.int64],
    route_links: NDArray[np.int32], link_bw: NDArray[np.float64], hop_latency: float,
    tie_ref: bool, busy_time: NDArray[np.float64], finish: NDArray[np.float64],
) -> float:
    """Run the §6.3 event loop; fill ``busy_time`` [L] (accumulated) and ``finish`` [M].

    Message m crosses the links ``route_links[pos[m]:stop[m]]``; ``pos`` is the cursor of the
    next hop and is advanced in place (callers pass a scratch array). ``msg_rank`` is the
    route's lexicographic rank (read with ``tie_ref`` only).

    Events are ordered by (time, tie key, sequence): the tie key is 0 (``fifo``) or the dense
    rank of the message by (size, route rank) (``ref``), and the sequence is the insertion
    order (initial events: the message index, below every later push). That is the order
    (time, size, route, sequence) of the module docstring.

    Events of equal time form a *bucket*: a linked list through ``nxt`` in sequence order,
    since pushes arrive in sequence order and are appended. A binary heap orders the buckets by
    time and a hash table (linear probing on the time's bits) finds the open bucket of a
    pushed event. The earliest bucket is taken out of the heap and the table; under ``ref`` its
    list is relinked in stable tie-key order, which is (key, sequence) order. Then its events
    run in list order. Pushes made meanwhile have times >= the bucket's time. A later time, or
    an equal time (a zero-duration hop) with a key >= every key still waiting in the list,
    sorts after the whole bucket and goes to a bucket of its own (an equal time opens a fresh
    bucket that runs next). An equal time with a smaller key (``ref`` only) is linked into the
    waiting list after the events of keys <= its own.

    MoE workloads are full of exact ties (equal message sizes on equal links: the benchmark
    layer has ~75 distinct event times for ~2,500 hops), so most hops cost one table lookup and
    an append, and no heap work; without ties every bucket holds one event and a hop costs one
    sift-down plus a table insert and removal, about what a heap of single events costs.

    Times are compared by their bit patterns in the table, which is exact because no event
    time is -0.0 (initial times are normalised with ``+ 0.0``; later ones are sums of
    non-negative terms starting from +0.0) or NaN (inputs are finite). The arrival event after
    the last hop is not pushed: it would only update the makespan, and skipping it keeps the
    relative order of all other events.
    """
    num_msg = pos.shape[0]
    busy_until = np.zeros(link_bw.shape[0])
    kbase = np.zeros(num_msg, dtype=np.int64)
    if tie_ref and num_msg > 0:
        size_rank = _dense_rank(msg_size)
        kbase = _dense_rank(size_rank * (msg_rank.max() + 1) + msg_rank)
    # messages with empty routes finish at their ready time
    nxt = np.empty(num_msg, dtype=np.int64)
    makespan = 0.0
    live = 0
    sorted_ready = True
    for m in range(num_msg):
        if pos[m] == stop[m]:
            finish[m] = msg_ready[m]
            if msg_ready[m] > makespan:
                makespan = msg_ready[m]
        else:
            live += 1
        if m > 0 and msg_ready[m] < msg_ready[m - 1]:
            sorted_ready = False
    if sorted_ready:
        order0 = np.arange(num_msg)
    else:  # initial events by ready time, then message index (= their sequence)
        order0 = np.argsort(msg_ready, kind="mergesort")
    # buckets (at most one per event in flight, so at most `live`): list head and tail, table
    # slot; the heap keeps the time next to the bucket id so comparisons need no indirection
    cap = max(live, 1)
    b_head = np.empty(cap, dtype=np.int64)
    b_tail = np.empty(cap, dtype=np.int64)
    b_slot = np.empty(cap, dtype=np.uint64)
    free_ids = np.empty(cap, dtype=np.int64)
    h_time = np.empty(cap)
    h_b = np.empty(cap, dtype=np.int64)
    run = np.empty(cap, dtype=np.int64)  # scratch for sorting a bucket (ref)
    # hash table time bits -> bucket, -1 = empty slot
    log_slots = 1
    while (1 << log_slots) < 2 * cap:  # load factor <= 1/2 keeps probe chains short
        log_slots += 1
    shift = np.uint64(64 - log_slots)
    mask = np.uint64((1 << log_slots) - 1)
    one = np.uint64(1)
    s_bits = np.empty(1 << log_slots, dtype=np.uint64)
    s_b = np.full(1 << log_slots, -1, dtype=np.int64)
    # initial buckets: runs of equal ready time in sorted order; a sorted array is a heap
    n = 0
    prev = -1
    run_bits = np.uint64(0)
    for i in range(num_msg):
        m = order0[i]
        if pos[m] == stop[m]:
            continue
        tm = msg_ready[m] + 0.0  # -0.0 -> +0.0: equal times must have equal bits
        bits = _float_bits(tm)
        if prev >= 0 and bits == run_bits:
            nxt[prev] = m
        else:
            if prev >= 0:
                nxt[prev] = -1
                b_tail[n - 1] = prev
            run_bits = bits
            k = _home_slot(bits, shift)
            while s_b[k] >= 0:
                k = (k + one) & mask
            s_bits[k] = bits
            s_b[k] = n
            b_slot[n] = k
            b_head[n] = m
            h_time[n] = tm
            h_b[n] = n
            n += 1
        prev = m
    if prev >= 0:
        nxt[prev] = -1
        b_tail[n - 1] = prev
    num_ids = n
    num_free = 0
    while n > 0:
        # take the earliest bucket out of the table; its heap slot is refilled below
        ob = h_b[0]
        t = h_time[0]
        _table_remove(b_slot[ob], s_bits, s_b, b_slot, shift)
        free_ids[num_free] = ob
        num_free += 1
        m = b_head[ob]
        max_key = 0  # largest key in the bucket (ref): the key of its last event
        if tie_ref and nxt[m] >= 0:  # relink the list in (key, sequence) order
            count = 0
            while m >= 0:
                run[count] = m
                count += 1
                m = nxt[m]
            _stable_sort_by_key(run, count, kbase)
            for j in range(count - 1):
                nxt[run[j]] = run[j + 1]
            nxt[run[count - 1]] = -1
            m = run[0]
            max_key = kbase[run[count - 1]]
        held = -1  # first bucket opened by this one: it replaces the root afterwards
        held_time = 0.0
        while m >= 0:
            nm = nxt[m]
            p = pos[m]
            # unsigned indices: values loaded from arrays skip numba's negative-index wraparound
            link = np.uint64(route_links[np.uint64(p)])
            bu = busy_until[link]
            start = t if t > bu else bu
            end = start + msg_size[m] / link_bw[link]
            busy_until[link] = end
            busy_time[link] += end - start
            arrive = end + hop_latency
            if p + 1 == stop[m]:
                finish[m] = arrive
                if arrive > makespan:
                    makespan = arrive
                m = nm
                continue
            pos[m] = p + 1
            if tie_ref and arrive == t and nm >= 0 and kbase[m] < max_key:
                # zero-duration hop that sorts before waiting events of this bucket: link it in
                # after the last waiting event with a key <= its own (the last one's is larger)
                if kbase[nm] > kbase[m]:
                    nxt[m] = nm
                    continue  # it runs next
                q = nm
                while kbase[nxt[q]] <= kbase[m]:
                    q = nxt[q]
                nxt[m] = nxt[q]
                nxt[q] = m
                m = nm
                continue
            nxt[m] = -1
            bits = _float_bits(arrive)
            k = _home_slot(bits, shift)
            while s_b[k] >= 0 and s_bits[k] != bits:
                k = (k + one) & mask
            b = s_b[k]
            if b >= 0:  # append to the open bucket
                nxt[np.uint64(b_tail[b])] = m
                b_tail[b] = m
                m = nm
                continue
            if num_free > 0:  # open a bucket
                num_free -= 1
                b = free_ids[num_free]
            else:
                b = num_ids
                num_ids += 1
            s_bits[k] = bits
            s_b[k] = b
            b_slot[b] = k
            b_head[b] = m
            b_tail[b] = m
            if held < 0:
                held = b
                held_time = arrive
            else:  # sift up; the stale root (time t) sorts before every new bucket
                hp = n
                n += 1
                while hp > 0:
                    parent = (hp - 1) >> 1
                    if arrive < h_time[parent]:
                        h_time[hp] = h_time[parent]
                        h_b[hp] = h_b[parent]
                        hp = parent
                    else:
                        break
                h_time[hp] = arrive
                h_b[hp] = b
            m = nm
        # replace the root by the held bucket, or remove it; then sift down
        if held >= 0:
            kt = held_time
            kb = held
        else:
            n -= 1
            if n == 0:
                break
            kt = h_time[n]
            kb = h_b[n]
        hp = 0
        while True:
            child = 2 * hp + 1
            if child >= n:
                break
            right = child + 1
            if right < n and h_time[right] < h_time[child]:
                child = right
            if h_time[child] < kt:
                h_time[hp] = h_time[child]
                h_b[hp] = h_b[child]
                hp = child
            else:
                break
        h_time[hp] = kt
        h_b[hp] = kb
    return makespan


@njit(cache=True)
def _des_kernel(msg_route: NDArray[np.int64], msg_size: NDArray[np.float64],
                msg_ready: NDArray[np.float64], msg_rank: NDArray[np.int64],
                route_ptr: NDArray[np.int64], route_links: NDArray[np.int32],
                link_bw: NDArray[np.float64], hop_latency: float,
                tie_ref: bool) -> tuple[float, NDArray[np.float64], NDArray[np.float64]]:
    """Compiled entry of ``simulate_messages``: returns (makespan, busy [L], finish [M])."""
    busy = np.zeros(link_bw.shape[0])
    finish = np.zeros(msg_route.shape[0])
    makespan = _des_core(route_ptr[msg_route], route_ptr[msg_route + 1], msg_size, msg_ready,
                         msg_rank, route_links, link_bw, hop_latency, tie_ref, busy, finish)
    return makespan, busy, finish


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
    msg_bytes: NDArray[np.float64], chunks: int, layer: int,
    pair_ptr: NDArray[np.int64], route_ptr: NDArray[np.int64],
    route_links: NDArray[np.int32], link_bw: NDArray[np.float64],
    route_rank: NDArray[np.int64], hop_latency: float, tie_ref: bool, num_endpoints: int,
    phase_codes: NDArray[np.int64], busy_out: NDArray[np.float64],
    makespan_out: NDArray[np.float64], count_out: NDArray[np.int64],
) -> bool:
    """Generate the layer's messages (§6.2) and run one DES per phase (0 dispatch, 1 combine).

    Messages are ordered by token, then ascending source cluster, then chunk index — the order of
    ``layer_messages`` expanded as in ``simulate_messages``. Returns False, without simulating,
    when the inputs fail ``_layer_inputs_ok`` (checking here saves a second compiled call).
    """
    if not _layer_inputs_ok(token_sets, holder_mask, msg_bytes, agg, pi, extra, num_endpoints):
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
    touch = np.empty(words, dtype=np.uint64)
    # (token, source cluster) pairs, token-major, ascending cluster
    pair_tok = np.empty(num_tokens * num_clusters, dtype=np.int64)
    pair_cl = np.empty(num_tokens * num_clusters, dtype=np.int64)
    npairs = 0
    for t in range(num_tokens):
        touch[:] = 0
        for j in range(top_k):
            e = token_sets[t, j]
            for w in range(words):
                touch[w] |= hbits[e, w]
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
                pair_cl[npairs] = (w << 6) + np.int64(_count_trailing_zeros(x))
                npairs += 1
                x &= x - np.uint64(1)
    # sizes, ready times and endpoints are the same in every phase: build them once
    num_msg = npairs * chunks
    msg_size = np.empty(num_msg)
    msg_ready = np.zeros(num_msg)
    holder_ep = np.empty(npairs, dtype=np.int64)
    agg_ep = np.empty(npairs, dtype=np.int64)
    for i in range(npairs):
        t = pair_tok[i]
        holder_ep[i] = pi[pair_cl[i]]
        agg_ep[i] = pi[agg[t]]
        size = msg_bytes[t] / chunks
        for ch in range(chunks):
            msg_size[i * chunks + ch] = size
    pos = np.empty(num_msg, dtype=np.int64)
    stop = np.empty(num_msg, dtype=np.int64)
    msg_rank = np.zeros(num_msg, dtype=np.int64)
    finish = np.empty(num_msg)
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
                pos[m] = route_ptr[r]
                stop[m] = route_ptr[r + 1]
                if tie_ref:
                    msg_rank[m] = route_rank[r]
                m += 1
        makespan_out[p] = _des_core(pos, stop, msg_size, msg_ready, msg_rank, route_links,
                                    link_bw, hop_latency, tie_ref, busy_out[p], finish)
        count_out[p] = num_msg
    return True


# --------------------------------------------------------------------------------------------
# input handling shared by the kernel and the oracle


def _tie_code(tie_break: str) -> bool:
    if tie_break not in TIE_BREAKS:
        raise unknown_name("tie_break", tie_break, TIE_BREAKS)
    return tie_break == "ref"


def _check_scalar(name: str, value: float) -> float:
    v = float(value)
    if not (np.isfinite(v) and v >= 0):
        raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
    return v


def _check_chunks(chunks: int) -> int:
    if isinstance(chunks, bool) or not isinstance(chunks, int | np.integer) or chunks < 1:
        raise ConfigError(f"chunks must be an integer >= 1, got {chunks!r}")
    return int(chunks)


@dataclass(frozen=True, slots=True)
class _Prepared:
    """Validated, chunk-expanded messages (M·chunks rows, message-major)."""

    num_input: int
    src: NDArray[np.int64]
    dst: NDArray[np.int64]
    size: NDArray[np.float64]
    ready: NDArray[np.float64]
    keys: NDArray[np.int64]        # [M'] int keys or [M', K] tuple keys
    tie_ref: bool
    hop_latency: float
    chunks: int


def _prepare(topology: Topology, src: ArrayLike, dst: ArrayLike, size_bytes: ArrayLike,
             ready_s: ArrayLike | None, tie_break: str, hop_latency_s: float,
             flow_keys: ArrayLike | None, chunks: int) -> _Prepared:
    tie_ref = _tie_code(tie_break)
    hop = _check_scalar("hop_latency_s", hop_latency_s)
    chunks = _check_chunks(chunks)
    s = np.asarray(src)
    d = np.asarray(dst)
    z = np.asarray(size_bytes, dtype=np.float64)
    if s.ndim != 1 or d.ndim != 1 or z.ndim != 1:
        raise ConfigError(f"src, dst and size_bytes must be 1-D arrays [M]; got shapes {s.shape}, "
                          f"{d.shape}, {z.shape}")
    m = s.shape[0]
    if d.shape[0] != m or z.shape[0] != m:
        raise ConfigError(f"src, dst and size_bytes must have equal lengths; got {m}, "
                          f"{d.shape[0]}, {z.shape[0]}")
    if m and not (np.issubdtype(s.dtype, np.integer) and np.issubdtype(d.dtype, np.integer)):
        raise ConfigError(f"src and dst must be integer endpoint ids, got dtypes {s.dtype}, "
                          f"{d.dtype}")
    s = s.astype(np.int64)
    d = d.astype(np.int64)
    n = topology.num_endpoints
    for name, arr in (("src", s), ("dst", d)):
        bad = np.flatnonzero((arr < 0) | (arr >= n))
        if bad.size:
            raise ConfigError(f"{name}[{bad[0]}]={arr[bad[0]]} is not an endpoint id; expected "
                              f"0 <= {name} < {n}")
    bad = np.flatnonzero(~(np.isfinite(z) & (z >= 0)))
    if bad.size:
        raise ConfigError(f"size_bytes[{bad[0]}]={z[bad[0]]!r} must be finite and >= 0")
    if ready_s is None:
        ready = np.zeros(m)
    else:
        ready = np.asarray(ready_s, dtype=np.float64)
        if ready.ndim == 0:
            ready = np.full(m, float(ready))
        if ready.shape != (m,):
            raise ConfigError(f"ready_s must have shape [{m}], got {ready.shape}")
        bad = np.flatnonzero(~(np.isfinite(ready) & (ready >= 0)))
        if bad.size:
            raise ConfigError(f"ready_s[{bad[0]}]={ready[bad[0]]!r} must be finite and >= 0")
    if flow_keys is None:
        keys = np.arange(m, dtype=np.int64)  # [decision] default key = message index
    else:
        keys = np.asarray(flow_keys)
        if keys.shape[:1] != (m,) or keys.ndim not in (1, 2) or (
                m and not np.issubdtype(keys.dtype, np.integer)):
            raise ConfigError(f"flow_keys must be an integer array [{m}] or [{m}, K], got shape "
                              f"{keys.shape} and dtype {keys.dtype}")
        keys = keys.astype(np.int64)
    if chunks > 1:
        s = np.repeat(s, chunks)
        d = np.repeat(d, chunks)
        z = np.repeat(z / chunks, chunks)
        ready = np.repeat(ready, chunks)
        chunk_idx = np.tile(np.arange(chunks, dtype=np.int64), m)
        keys2 = keys.reshape(m, -1)
        keys = np.column_stack([np.repeat(keys2, chunks, axis=0), chunk_idx])
    _check_ref_size(tie_ref, m * chunks)
    return _Prepared(m, s, d, z, ready, keys, tie_ref, hop, chunks)


def _per_message(finish: NDArray[np.float64], prep: _Prepared) -> NDArray[np.float64]:
    if prep.chunks == 1:
        return finish
    return finish.reshape(prep.num_input, prep.chunks).max(axis=1)


def simulate_messages(topology: Topology, src: ArrayLike, dst: ArrayLike, size_bytes: ArrayLike,
                      ready_s: ArrayLike | None = None, *, tie_break: str = "fifo",
                      hop_latency_s: float = 0.0, flow_keys: ArrayLike | None = None,
                      chunks: int = 1) -> DesResult:
    """Simulate a set of messages with the compiled busy-until DES (§6.3).

    Args:
        topology: The NoC.
        src: Int array [M] of source endpoints.
        dst: Int array [M] of destination endpoints.
        size_bytes: Float array [M] of message sizes in bytes (>= 0).
        ready_s: Float array [M] (or a scalar) of ready times in seconds; default all 0.
        tie_break: ``"fifo"`` or ``"ref"`` (module docstring).
        hop_latency_s: Fixed latency added after every link traversal, seconds.
        flow_keys: Route-choice keys: ``None`` (the message index, [decision]), int [M] (used
            directly modulo the candidate count) or int [M, K] (tuple keys, ``stable_hash``).
        chunks: Split every message into this many equal parts (separate messages, message-major
            insertion order); when ``chunks > 1`` the chunk index is appended to the flow key,
            which becomes the tuple ``(key..., chunk)``.

    Returns:
        The makespan, per-link busy time [num_links] and per-message finish time [M].

    Raises:
        ConfigError: Mismatched lengths, endpoint ids out of range, negative or non-finite sizes
            or ready times, an unknown tie rule, a negative hop latency or ``chunks < 1``.
    """
    prep = _prepare(topology, src, dst, size_bytes, ready_s, tie_break, hop_latency_s,
                    flow_keys, chunks)
    routes = topology.select_routes(prep.src, prep.dst, prep.keys)
    rank = topology.route_lex_rank[routes] if prep.tie_ref else np.zeros(routes.size, np.int64)
    makespan, busy, finish = _des_kernel(routes, prep.size, prep.ready, rank, topology.route_ptr,
                                         topology.route_links, topology.link_bw_Bps,
                                         prep.hop_latency, prep.tie_ref)
    return DesResult(float(makespan), busy, _per_message(finish, prep))


def _earliest_gap(intervals: list[tuple[float, float]], t: float, dur: float) -> float:
    """Return the earliest start x >= t with [x, x + dur) free in the sorted ``intervals``."""
    x = t
    for s, e in intervals:
        if e <= x:
            continue
        if x < s and x + dur <= s:
            break  # fits in the gap before this reservation
        x = max(x, e)
    return x


def simulate_messages_oracle(topology: Topology, src: ArrayLike, dst: ArrayLike,
                             size_bytes: ArrayLike, ready_s: ArrayLike | None = None, *,
                             tie_break: str = "fifo", hop_latency_s: float = 0.0,
                             flow_keys: ArrayLike | None = None, chunks: int = 1) -> DesResult:
    """Simulate messages with a slow, obviously correct interval-calendar DES (test oracle).

    Same signature, semantics and results (bit for bit) as ``simulate_messages``. Routes are
    chosen one by one with ``Topology.route`` and ``stable_hash``; every link keeps a sorted list
    of reserved intervals and a hop starts in the earliest free gap at or after its ready time
    (§6.3 "Equivalence with the reference"); the ``ref`` tie-break compares the routes' link-label
    lists directly. Arguments as ``simulate_messages``.
    """
    prep = _prepare(topology, src, dst, size_bytes, ready_s, tie_break, hop_latency_s,
                    flow_keys, chunks)
    num = prep.src.shape[0]
    routes: list[list[int]] = []
    for i in range(num):
        raw = prep.keys[i]
        key: int | tuple[int, ...] = int(raw) if prep.keys.ndim == 1 else tuple(
            int(x) for x in raw)
        routes.append([int(x) for x in topology.route(int(prep.src[i]), int(prep.dst[i]), key)])
    sizes = [float(x) for x in prep.size]
    bw = [float(x) for x in topology.link_bw_Bps]
    calendar: list[list[tuple[float, float]]] = [[] for _ in range(topology.num_links)]
    busy = [0.0] * topology.num_links
    finish = [0.0] * num
    seq = 0
    heap: list[tuple[Any, ...]] = []

    def push(t: float, m: int, hop: int) -> None:
        nonlocal seq
        if prep.tie_ref:
            labels = tuple(topology.link_labels[x] for x in routes[m])
            heapq.heappush(heap, (t, sizes[m], labels, seq, m, hop))
        else:
            heapq.heappush(heap, (t, seq, m, hop))
        seq += 1

    for m in range(num):
        push(float(prep.ready[m]), m, 0)
    makespan = 0.0
    while heap:
        entry = heapq.heappop(heap)
        t, m, hop = entry[0], entry[-2], entry[-1]
        if hop == len(routes[m]):
            finish[m] = t
            makespan = max(makespan, t)
            continue
        link = routes[m][hop]
        dur = sizes[m] / bw[link]
        start = _earliest_gap(calendar[link], t, dur)
        end = start + dur
        bisect.insort(calendar[link], (start, end))
        busy[link] += end - start
        push(end + prep.hop_latency, m, hop + 1)
    return DesResult(float(makespan), np.array(busy, dtype=np.float64),
                     _per_message(np.array(finish, dtype=np.float64), prep))


def link_load_bound(topology: Topology, src: ArrayLike, dst: ArrayLike, size_bytes: ArrayLike,
                    flow_keys: ArrayLike | None = None) -> float:
    """Return a lower bound on the makespan of messages all ready at 0 (hop latency 0).

    The bound is the larger of (a) the maximum over links of Σ size/bw over the messages whose
    chosen route crosses the link and (b) the maximum over messages of Σ size/bw along its own
    route. Routes are chosen as in ``simulate_messages`` (``flow_keys=None`` = message index).
    Sums are formed in a different order than in the DES, so compare with a relative tolerance
    of a few ulps.

    Args:
        topology: The NoC.
        src: Int array [M] of source endpoints.
        dst: Int array [M] of destination endpoints.
        size_bytes: Float array [M] of message sizes in bytes.
        flow_keys: As ``simulate_messages``.

    Returns:
        The bound in seconds (0 for no messages).
    """
    prep = _prepare(topology, src, dst, size_bytes, None, "fifo", 0.0, flow_keys, 1)
    routes = topology.select_routes(prep.src, prep.dst, prep.keys)
    start = topology.route_ptr[routes]
    length = topology.route_ptr[routes + 1] - start
    total = int(length.sum())
    if total == 0:
        return 0.0
    owner = np.repeat(np.arange(routes.size), length)
    offset = np.arange(total) - np.repeat(np.cumsum(length) - length, length)
    links = topology.route_links[start[owner] + offset]
    hop_time = prep.size[owner] / topology.link_bw_Bps[links]
    per_link = np.bincount(links, weights=hop_time, minlength=topology.num_links)
    per_msg = np.bincount(owner, weights=hop_time, minlength=routes.size)
    return float(max(per_link.max(), per_msg.max()))


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


def choose_aggregators(token_sets: ArrayLike, holder_mask: ArrayLike, rule: str,
                       rng: np.random.Generator) -> NDArray[np.int64]:
    """Choose the aggregator cluster of every token (or group) by ``rule`` (§6.2 step 2).

    Rules: ``ref`` — an expert of the set uniformly at random, its lowest-indexed holder cluster;
    ``uniform`` — an expert uniformly at random, then one of its holders uniformly at random;
    ``first`` — the first (smallest) expert id of the set, its lowest-indexed holder. An expert
    without holder is re-drawn among the others; this is implemented exactly as the equivalent
    uniform draw among the set positions whose expert has a holder (``first``: the smallest such
    expert). Random draws: one ``rng.integers`` call for the experts of all tokens, and for
    ``uniform`` one more for the holders (deterministic given the generator state).

    Args:
        token_sets: Int array [T, k] of expert ids per token.
        holder_mask: Bool array [E, D], True where cluster c holds (a shard of) expert i; a
            non-bool share matrix counts entries > 0 as holders.
        rule: ``"ref"``, ``"uniform"`` or ``"first"``.
        rng: The random generator (unused by ``first``).

    Returns:
        Int64 array [T] of aggregator clusters.

    Raises:
        ConfigError: Unknown rule, bad shapes or ids, or a token none of whose experts has a
            holder.
    """
    if rule not in AGGREGATOR_RULES:
        raise unknown_name("aggregator rule", rule, AGGREGATOR_RULES)
    hm = _as_holder_mask(holder_mask)
    ts = _as_token_sets(token_sets, hm.shape[0])
    num_tokens = ts.shape[0]
    if num_tokens == 0:
        return np.zeros(0, dtype=np.int64)
    has_holder = np.asarray(hm.any(axis=1))
    valid = has_holder[ts]                                   # [T, k]
    nvalid = valid.sum(axis=1)
    orphan = np.flatnonzero(nvalid == 0)
    if orphan.size:
        t = int(orphan[0])
        raise ConfigError(f"token {t} (experts {ts[t].tolist()}) has no expert with a holder "
                          f"cluster ({orphan.size} such tokens); every token needs at least one "
                          "held expert")
    rows = np.arange(num_tokens)
    if rule == "first":
        expert = np.where(valid, ts, hm.shape[0]).min(axis=1)
    else:
        u = rng.integers(0, nvalid)                          # [T], uniform over valid slots
        pos = (np.cumsum(valid, axis=1) <= u[:, None]).sum(axis=1)
        expert = ts[rows, pos]
    holders = hm[expert]                                     # [T, D]
    if rule == "uniform":
        v = rng.integers(0, holders.sum(axis=1))
        return (np.cumsum(holders, axis=1) <= v[:, None]).sum(axis=1).astype(np.int64)
    return holders.argmax(axis=1).astype(np.int64)           # lowest-indexed holder


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


_PHASE_CODES: dict[tuple[str, ...], NDArray[np.int64]] = {}  # validated phase tuple -> codes


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
        _PHASE_CODES[phase_names] = codes
    return codes


def layer_messages(token_sets: ArrayLike, msg_bytes: ArrayLike, holder_mask: ArrayLike,
                   agg: ArrayLike, pi: ArrayLike, extra_holders: ArrayLike | None = None, *,
                   direction: str = "combine") -> tuple[NDArray[np.int64], NDArray[np.int64],
                                                        NDArray[np.float64], NDArray[np.int64]]:
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
        return holder_ep, agg_ep, size[task], task
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
    if _check_chunks(chunks) == 1:
        cols.append(np.zeros(task.size, dtype=np.int64))
    return np.column_stack(cols)


def simulate_layer_comm(topology: Topology, token_sets: ArrayLike, msg_bytes: ArrayLike,
                        holder_mask: ArrayLike, pi: ArrayLike, agg: ArrayLike, *,
                        phases: Sequence[str] = PHASES, tie_break: str = "fifo",
                        hop_latency_s: float = 0.0, layer: int = 0,
                        extra_holders: ArrayLike | None = None, chunks: int = 1) -> LayerComm:
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

    Returns:
        Makespan, per-link busy time and message count per phase.

    Raises:
        ConfigError: Invalid shapes, ids, phases, tie rule, latency or chunk count.
    """
    tie_ref = _tie_code(tie_break)
    hop = _check_scalar("hop_latency_s", hop_latency_s)
    chunks = _check_chunks(chunks)
    phase_names = tuple(phases)
    codes = _phase_codes(phase_names)
    if isinstance(layer, bool) or not isinstance(layer, int | np.integer) or layer < 0:
        raise ConfigError(f"layer must be an integer >= 0, got {layer!r}")
    busy = np.zeros((codes.size, topology.num_links))
    makespan = np.zeros(codes.size)
    counts = np.zeros(codes.size, dtype=np.int64)
    args = (chunks, int(layer), topology, hop, tie_ref, codes, busy, makespan, counts)
    arrays = _fast_layer_inputs(token_sets, msg_bytes, holder_mask, agg, pi, extra_holders)
    if arrays is None or not _run_layer_kernel(arrays, *args):
        # the slow path converts everything and raises the detailed ConfigError
        arrays = _as_layer_inputs(token_sets, msg_bytes, holder_mask, agg, pi, extra_holders,
                                  topology.num_endpoints)
        if not _run_layer_kernel(arrays, *args):
            raise ConfigError("layer inputs failed validation")  # not reached: see above
    return LayerComm(phase_names, tuple(makespan.tolist()), busy, tuple(counts.tolist()))


def _run_layer_kernel(arrays: tuple[NDArray[Any], ...], chunks: int, layer: int,
                      topology: Topology, hop: float, tie_ref: bool, codes: NDArray[np.int64],
                      busy: NDArray[np.float64], makespan: NDArray[np.float64],
                      counts: NDArray[np.int64]) -> bool:
    """Call ``_layer_kernel`` on converted inputs; False when they fail its validation."""
    ts, size, hm, ag, p, ex = arrays
    _check_ref_size(tie_ref, ts.shape[0] * topology.num_endpoints * chunks)
    return _layer_kernel(ts, hm, ex, ag, p, size, chunks, layer, topology.pair_route_ptr,
                         topology.route_ptr, topology.route_links, topology.link_bw_Bps,
                         topology.route_lex_rank, hop, tie_ref, topology.num_endpoints, codes,
                         busy, makespan, counts)


# --------------------------------------------------------------------------------------------
# ring all-reduce (§5.6)


def _grid_cycle(x: int, y: int) -> list[tuple[int, int]]:
    """Return a Hamiltonian cycle of the X×Y mesh (X·Y even, X, Y >= 2) using mesh links."""
    if x % 2 == 1:  # transpose the even-rows construction
        return [(r, c) for c, r in _grid_cycle(y, x)]
    cells = [(0, 0)]
    for r in range(x):  # boustrophedon over columns 1..Y-1, back up column 0
        cols = range(1, y) if r % 2 == 0 else range(y - 1, 0, -1)
        cells += [(r, c) for c in cols]
    return cells + [(r, 0) for r in range(x - 1, 0, -1)]


def default_ring(topology: Topology) -> NDArray[np.int64]:
    """Return the default all-reduce ring of ``topology`` as endpoint ids [N].

    Consecutive ring members (and the last and first) are one hop apart whenever the grid allows
    it. Fat-tree: endpoint order. Mesh and torus with X·Y even and X, Y >= 2: a boustrophedon over
    columns 1..Y-1 that returns along column 0 (transposed when X is odd), which uses mesh links
    only and so is also a cycle of the torus. Torus with X·Y odd: a 1×Y or X×1 torus is its own
    ring; otherwise the cycle of the first X−1 rows with the last row spliced in through its
    wrap-around link. Mesh with X·Y odd or a 1×Y mesh line (no Hamiltonian cycle exists): the
    row-major boustrophedon, whose closing step is several hops [decision].
    """
    n = topology.num_endpoints
    if topology.kind == "fattree" or n <= 2:
        return np.arange(n, dtype=np.int64)
    x, y = topology.grid_shape
    torus = topology.kind == "torus"
    cells: list[tuple[int, int]]
    if (x * y) % 2 == 0 and min(x, y) >= 2:
        cells = _grid_cycle(x, y)
    elif torus and min(x, y) == 1:
        cells = [(r, c) for r in range(x) for c in range(y)]
    elif torus:  # X, Y odd >= 3: splice row X-1 between (X-2, 2) and (X-2, 1)
        base = _grid_cycle(x - 1, y)
        at = base.index((x - 2, 2)) + 1
        last_row = [(x - 1, (2 + i) % y) for i in range(y)]
        cells = base[:at] + last_row + base[at:]
    else:
        cells = [(r, c if r % 2 == 0 else y - 1 - c) for r in range(x) for c in range(y)]
    return np.array([r * y + c for r, c in cells], dtype=np.int64)


def ring_allreduce_des(topology: Topology, size_bytes: float, *, ring: ArrayLike | None = None,
                       chunks: int = 1, hop_latency_s: float = 0.0) -> float:
    """Simulate a ring all-reduce (reduce-scatter then all-gather) with the DES (§5.6).

    2(p−1) sequential steps; in every step each ring member sends ``size_bytes / p`` bytes to its
    successor, all ready when the previous step has finished. On a ring of physical neighbours
    the result is 2(p−1)·(S/(p·BW) + hop latency).

    Args:
        topology: The NoC.
        size_bytes: Bytes S to all-reduce per node.
        ring: Int array [p] of distinct endpoints in ring order; default ``default_ring``.
        chunks: Split every step's messages into this many parts.
        hop_latency_s: Latency added after every link traversal, seconds.

    Returns:
        The all-reduce time in seconds (0 for p <= 1).

    Raises:
        ConfigError: Invalid ring, size, chunks or latency.
    """
    size = _check_scalar("size_bytes", size_bytes)
    order = default_ring(topology) if ring is None else np.asarray(ring, dtype=np.int64)
    order = order.reshape(-1)
    p = order.size
    if p and (order.min() < 0 or order.max() >= topology.num_endpoints
              or np.unique(order).size != p):
        raise ConfigError(f"ring must list distinct endpoint ids in [0, "
                          f"{topology.num_endpoints}), got {order.tolist()}")
    if p <= 1:
        return 0.0
    src = order
    dst = np.roll(order, -1)
    prep = _prepare(topology, src, dst, np.full(p, size / p), None, "fifo", hop_latency_s,
                    None, chunks)
    routes = topology.select_routes(prep.src, prep.dst, prep.keys)
    rank = np.zeros(routes.size, dtype=np.int64)
    t = 0.0
    for _ in range(2 * (p - 1)):
        ready = np.full(routes.size, t)
        t, _busy, _finish = _des_kernel(routes, prep.size, ready, rank, topology.route_ptr,
                                        topology.route_links, topology.link_bw_Bps,
                                        prep.hop_latency, False)
    return float(t)
