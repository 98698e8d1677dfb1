"""The generic message DES: the busy-until NoC simulator and its interval-calendar oracle.

Implements paper-model.md §6.3 (event loop) on the topologies of ``hdamoe_env.noc.topology`` (§6.1).
MoE task generation (§6.2) lives in ``hdamoe_env.noc.linksim``; the ring all-reduce on the DES
(§5.6) in ``hdamoe_env.noc.collectives``; the validation and chunk expansion of message lists
that every entry shares in ``hdamoe_env.noc.messages``.

Model (§6.3). Fluid store-and-forward: a message occupies one directed link at a time, the next
hop starts when the whole message has crossed the previous one, per-hop time = size / bandwidth
of that link, plus an optional fixed ``hop_latency_s`` after every traversal (``switching =
"store_and_forward"``, the paper's and the reference's model). No flits, credits,
back-pressure or injection limits; the only resources are the directed links, each served in
event order (first come, first served). The earliest pending event is popped; its hop starts at
``max(t, busy_until[link])``. Equal event times are ordered by the tie rule:

* ``fifo`` — insertion order (a global sequence counter incremented at every push);
* ``ref`` — by remaining bytes (whole messages: the message size) ascending, then by the route
  compared lexicographically as a list of link labels (``Topology.route_lex_rank``), then by
  insertion order (quirk Q19).

``switching = "cut_through"`` (virtual cut-through, pipelined): the head pays the per-hop latency
and the body follows at link bandwidth. A hop still starts at ``max(t, busy_until[link])`` and
keeps its link busy for the message's serialisation, ``end = start + size / bw``, but no earlier
than the previous hop's end plus ``hop_latency_s`` (the tail cannot overtake itself when an
upstream link is slower); the next hop's event is the head's arrival ``start + hop_latency_s``
and the message finishes at the last hop's ``end + hop_latency_s``. A blocked head waits in the
router (unbounded buffers) while its upstream link is released at its own end. On an idle path of
H equal links this gives ``H·hop_latency + size/bw`` instead of ``H·(hop_latency + size/bw)``.
Validated against BookSim 2.0 in docs/results/validation.md.

Network-interface ports (``ni_bw_Bps``, off by default): one injection port per source and one
ejection port per destination endpoint, modelled as two extra links at the ends of every
non-empty route (ids ``num_links + src`` and ``num_links + N + dst``), so a node sends and
receives one message at a time at port bandwidth, as a router's local port does. A port pays its
own latency ``ni_latency_s`` (default: the hop latency) where a link pays the hop latency; the
kernel reads one latency per link (``link_lat``). On an idle path of H links with ports,
cut-through takes ``2·ni_latency + H·hop_latency + size/bw`` (docs/PHYSICS.md §16).

Two implementations share those semantics and agree bit for bit (same floating-point operations
in the same order):

* the production kernel (numba ``@njit(cache=True)``): events of equal time grouped in buckets
  (linked lists), a binary heap of buckets and a hash table from time to open bucket
  (``des_core``), per-link ``busy_until`` and ``busy_time`` arrays;
* ``simulate_messages_oracle``: a small pure-Python interval calendar (per-link reserved intervals,
  earliest-gap search at or after the ready time, heap of plain tuples), i.e. the reference
  semantics of §6.3 "Equivalence with the reference"; it exists for tests and benchmarks.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core.extending import intrinsic
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.cache import BoundedCache
from hdamoe_env.config.errors import ConfigError, unknown_name
from hdamoe_env.noc.messages import TIE_BREAKS, PreparedMessages, check_scalar, prepare_messages
from hdamoe_env.noc.topology import Topology

SWITCHINGS: tuple[str, ...] = ("store_and_forward", "cut_through")

__all__ = [
    "SWITCHINGS",
    "TIE_BREAKS",
    "DesResult",
    "PreparedRun",
    "check_ni_bandwidth",
    "check_ni_latency",
    "check_switching",
    "count_trailing_zeros",
    "des_core",
    "des_kernel",
    "link_load_bound",
    "port_latencies",
    "port_routes",
    "prepare_run",
    "simulate_messages",
    "simulate_messages_oracle",
    "simulate_runs",
]



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


# --------------------------------------------------------------------------------------------
# compiled kernel


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
def count_trailing_zeros(typingctx: Any, x: Any) -> Any:
    """Return the index of the lowest set bit of a non-zero uint64 (LLVM ``cttz``; jitted code)."""
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
def des_core(  # noqa: C901 - one flat event loop is what keeps the kernel fast
    pos: NDArray[np.int64], stop: NDArray[np.int64], msg_size: NDArray[np.float64],
    msg_ready: NDArray[np.float64], msg_rank: NDArray[np.int64],
    route_links: NDArray[np.int32], link_bw: NDArray[np.float64],
    link_lat: NDArray[np.float64], tie_ref: bool, busy_time: NDArray[np.float64],
    finish: NDArray[np.float64], cut_through: bool,
) -> float:
    """Run the §6.3 event loop; fill ``busy_time`` [L] (accumulated) and ``finish`` [M].

    Message m crosses the links ``route_links[pos[m]:stop[m]]``; ``pos`` is the cursor of the
    next hop and is advanced in place (callers pass a scratch array). ``msg_rank`` is the
    route's lexicographic rank (read with ``tie_ref`` only). ``link_lat`` [L] is the latency
    paid after crossing each link (the hop latency; network-interface ports their own).
    ``cut_through`` selects the switching of the module docstring: the next hop's event is the
    head's arrival (start + latency) instead of the tail's (end + latency), and a hop ends no
    earlier than the tail's arrival from upstream (the previous hop's end plus that hop's
    latency).

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
    if num_msg >= 2**31:  # message and bucket ids are int32 (a smaller working set)
        raise ValueError("des_core: more than 2**31 - 1 messages")
    busy_until = np.zeros(link_bw.shape[0])
    kbase = np.zeros(num_msg, dtype=np.int64)
    tail_in = np.full(num_msg, -np.inf)  # cut-through: the tail's arrival from upstream
    if tie_ref and num_msg > 0:
        size_rank = _dense_rank(msg_size)
        kbase = _dense_rank(size_rank * (msg_rank.max() + 1) + msg_rank)
    # messages with empty routes finish at their ready time
    nxt = np.empty(num_msg, dtype=np.int32)
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
    b_head = np.empty(cap, dtype=np.int32)
    b_tail = np.empty(cap, dtype=np.int32)
    b_slot = np.empty(cap, dtype=np.uint64)
    free_ids = np.empty(cap, dtype=np.int32)
    h_time = np.empty(cap)
    h_b = np.empty(cap, dtype=np.int32)
    run = np.empty(cap, dtype=np.int64)  # scratch for sorting a bucket (ref)
    # hash table time bits -> bucket, -1 = empty slot
    log_slots = 1
    while (1 << log_slots) < 2 * cap:  # load factor <= 1/2 keeps probe chains short
        log_slots += 1
    shift = np.uint64(64 - log_slots)
    mask = np.uint64((1 << log_slots) - 1)
    one = np.uint64(1)
    s_bits = np.empty(1 << log_slots, dtype=np.uint64)
    s_b = np.full(1 << log_slots, -1, dtype=np.int32)
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
            lat = link_lat[link]
            if cut_through:  # the tail cannot leave before it has arrived from upstream
                tail_ready = tail_in[m]
                if tail_ready > end:
                    end = tail_ready
                tail_in[m] = end + lat
            busy_until[link] = end
            busy_time[link] += end - start
            arrive = end + lat
            if p + 1 == stop[m]:
                finish[m] = arrive
                if arrive > makespan:
                    makespan = arrive
                m = nm
                continue
            if cut_through:
                arrive = start + lat  # the head reaches the next router
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
def des_kernel(msg_route: NDArray[np.int64], msg_size: NDArray[np.float64],
               msg_ready: NDArray[np.float64], msg_rank: NDArray[np.int64],
               route_ptr: NDArray[np.int64], route_links: NDArray[np.int32],
               link_bw: NDArray[np.float64], hop_latency: float,
               tie_ref: bool, cut_through: bool = False,
               ) -> tuple[float, NDArray[np.float64], NDArray[np.float64]]:
    """Run the DES on prepared messages; return (makespan, busy [L], finish [M]).

    The compiled entry of the collectives' rounds (``simulate_messages`` runs ``des_core`` on
    ``prepare_run``'s arrays). ``msg_route`` [M] is each message's route id into
    ``route_ptr``/``route_links`` (the topology's CSR routes), ``msg_size`` [M] bytes,
    ``msg_ready`` [M] release times, ``msg_rank`` [M] the tie key ranks, ``link_bw`` [L] B/s,
    ``cut_through`` the switching (False: store-and-forward); see ``des_core`` for the event
    loop.
    """
    busy = np.zeros(link_bw.shape[0])
    finish = np.zeros(msg_route.shape[0])
    link_lat = np.full(link_bw.shape[0], hop_latency)
    makespan = des_core(route_ptr[msg_route], route_ptr[msg_route + 1], msg_size, msg_ready,
                        msg_rank, route_links, link_bw, link_lat, tie_ref, busy, finish,
                        cut_through)
    return makespan, busy, finish


def check_switching(switching: str) -> bool:
    """Return whether ``switching`` is cut-through; raise ``ConfigError`` if it is unknown."""
    if switching not in SWITCHINGS:
        raise unknown_name("switching", switching, SWITCHINGS)
    return switching == "cut_through"


def _per_message(finish: NDArray[np.float64], prep: PreparedMessages) -> NDArray[np.float64]:
    if prep.chunks == 1:
        return finish
    return finish.reshape(prep.num_input, prep.chunks).max(axis=1)


def simulate_messages(topology: Topology, src: ArrayLike, dst: ArrayLike, size_bytes: ArrayLike,
                      ready_s: ArrayLike | None = None, *, tie_break: str = "fifo",
                      hop_latency_s: float = 0.0, flow_keys: ArrayLike | None = None,
                      chunks: int = 1, switching: str = "store_and_forward",
                      ni_bw_Bps: float | None = None,
                      ni_latency_s: float | None = None) -> DesResult:
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
        switching: ``"store_and_forward"`` or ``"cut_through"`` (module docstring).
        ni_bw_Bps: ``None`` (no network-interface limit, §6.3) or the bandwidth of one
            injection port per source and one ejection port per destination endpoint: every
            message with a non-empty route then crosses its source's injection port first and
            its destination's ejection port last, as two extra links (each with the hop
            latency of ``ni_latency_s``). Their busy time is not part of ``link_busy_s``.
        ni_latency_s: Latency after crossing a network-interface port, seconds; ``None`` = the
            hop latency. Ignored without ports.

    Returns:
        The makespan, per-link busy time [num_links] and per-message finish time [M].

    Raises:
        ConfigError: Mismatched lengths, endpoint ids out of range, negative or non-finite sizes
            or ready times, an unknown tie rule or switching, a negative hop or port latency, a
            non-positive port bandwidth or ``chunks < 1``.
    """
    run = prepare_run(topology, src, dst, size_bytes, ready_s, tie_break=tie_break,
                      hop_latency_s=hop_latency_s, flow_keys=flow_keys, chunks=chunks,
                      switching=switching, ni_bw_Bps=ni_bw_Bps, ni_latency_s=ni_latency_s)
    prep = run.prep
    busy = np.zeros(run.bw.shape[0])
    finish = np.zeros(run.pos.size)
    makespan = des_core(run.pos, run.stop, prep.size, prep.ready, run.rank, run.links, run.bw,
                        run.lat, prep.tie_ref, busy, finish, run.cut)
    return DesResult(float(makespan), busy[:topology.num_links], _per_message(finish, prep))


@dataclass(frozen=True, eq=False)
class PreparedRun:
    """The inputs of one ``des_core`` run of ``simulate_messages`` (``prepare_run``).

    Attributes:
        prep: The validated, chunk-expanded messages.
        rank: int64 [M'] the routes' lexicographic ranks (zeros without ``ref`` ties).
        pos: int64 [M'] first link of every message in ``links`` (a fresh array: ``des_core``
            advances it). stop: int64 [M'] one past its last link.
        links: int32 the link lists (the topology's routes, or ``port_routes`` with ports).
        bw: float64 [L'] bandwidth of every link (+ the 2N ports). lat: float64 [L'] latency
            after every link.
        cut: Cut-through switching. ports: Whether network-interface ports are simulated.
    """

    prep: PreparedMessages
    rank: NDArray[np.int64]
    pos: NDArray[np.int64]
    stop: NDArray[np.int64]
    links: NDArray[np.int32]
    bw: NDArray[np.float64]
    lat: NDArray[np.float64]
    cut: bool
    ports: bool


def prepare_run(topology: Topology, src: ArrayLike, dst: ArrayLike, size_bytes: ArrayLike,
                ready_s: ArrayLike | None = None, *, tie_break: str = "fifo",
                hop_latency_s: float = 0.0, flow_keys: ArrayLike | None = None,
                chunks: int = 1, switching: str = "store_and_forward",
                ni_bw_Bps: float | None = None, ni_latency_s: float | None = None
                ) -> PreparedRun:
    """Validate and route messages for the DES: the inputs ``simulate_messages`` runs.

    Arguments and errors as ``simulate_messages``. Without ports the link lists are the
    topology's routes and every link has the hop latency (what ``des_kernel`` passes to
    ``des_core``); with ports, ``port_routes`` and ``port_latencies``.
    """
    cut = check_switching(switching)
    prep = prepare_messages(topology, src, dst, size_bytes, ready_s, tie_break, hop_latency_s,
                            flow_keys, chunks)
    ni_lat = check_ni_latency(ni_latency_s, prep.hop_latency)
    routes = topology.select_routes(prep.src, prep.dst, prep.keys)
    rank = topology.route_lex_rank[routes] if prep.tie_ref else np.zeros(routes.size, np.int64)
    if ni_bw_Bps is not None:
        pos, stop, links, bw = _with_ports(topology, prep, routes, ni_bw_Bps)
        lat = port_latencies(topology, prep.hop_latency, ni_lat)
        return PreparedRun(prep, rank, pos, stop, links, bw, lat, cut, True)
    ptr = topology.route_ptr
    return PreparedRun(prep, rank, ptr[routes], ptr[routes + 1], topology.route_links,
                       topology.link_bw_Bps,
                       np.full(topology.link_bw_Bps.shape[0], prep.hop_latency), cut, False)


def simulate_runs(topology: Topology, runs: list[PreparedRun], *, parallel: bool = False
                  ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Run the DES of several prepared runs in one compiled call.

    Every run gives the makespan and link busy time of ``simulate_messages`` with the same
    arguments, bit for bit (``des_core`` per run, on the same inputs). The runs must share
    the link lists, bandwidths, latencies, tie rule and switching (one topology, one set of
    options).

    Args:
        topology: The NoC.
        runs: ``prepare_run`` results.
        parallel: Spread the runs over numba's threads (``prange``; the caller sets the
            count, e.g. ``linksim.numba_threads``).

    Returns:
        ``makespan`` float64 [n] and ``busy`` float64 [n, num_links].

    Raises:
        ConfigError: Runs with different links or options.
    """
    n = len(runs)
    busy = np.zeros((n, topology.num_links))
    if n == 0:
        return np.zeros(0), busy
    first = runs[0]
    for run in runs[1:]:
        if (run.links is not first.links or run.cut != first.cut or run.ports != first.ports
                or run.prep.tie_ref != first.prep.tie_ref or run.prep.hop_latency
                != first.prep.hop_latency or not np.array_equal(run.bw, first.bw)
                or not np.array_equal(run.lat, first.lat)):
            raise ConfigError("simulate_runs: the runs must share one topology and one set of "
                              "DES options")
    offsets = np.zeros(n + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([run.pos.size for run in runs])
    pos = np.concatenate([run.pos for run in runs]).astype(np.int64, copy=False)
    stop = np.concatenate([run.stop for run in runs]).astype(np.int64, copy=False)
    size = np.concatenate([run.prep.size for run in runs])
    ready = np.concatenate([run.prep.ready for run in runs])
    rank = np.concatenate([run.rank for run in runs]).astype(np.int64, copy=False)
    all_busy = np.zeros((n, first.bw.shape[0]))
    finish = np.zeros(pos.size)
    makespan = np.zeros(n)
    kernel = _des_runs_par if parallel and n > 1 else _des_runs
    kernel(offsets, pos, stop, size, ready, rank, first.links, first.bw, first.lat,
           first.prep.tie_ref, all_busy, finish, makespan, first.cut)
    busy[:] = all_busy[:, :topology.num_links]
    return makespan, busy


@njit(cache=True)
def _des_runs(offsets: NDArray[np.int64], pos: NDArray[np.int64], stop: NDArray[np.int64],
              size: NDArray[np.float64], ready: NDArray[np.float64], rank: NDArray[np.int64],
              links: NDArray[np.int32], bw: NDArray[np.float64], lat: NDArray[np.float64],
              tie_ref: bool, busy: NDArray[np.float64], finish: NDArray[np.float64],
              makespan: NDArray[np.float64], cut: bool) -> None:
    """``des_core`` of run j on messages ``offsets[j]:offsets[j + 1]`` (``simulate_runs``)."""
    for j in range(offsets.shape[0] - 1):
        a, b = offsets[j], offsets[j + 1]
        makespan[j] = des_core(pos[a:b], stop[a:b], size[a:b], ready[a:b], rank[a:b], links,
                               bw, lat, tie_ref, busy[j], finish[a:b], cut)


@njit(cache=True, parallel=True)
def _des_runs_par(offsets: NDArray[np.int64], pos: NDArray[np.int64], stop: NDArray[np.int64],
                  size: NDArray[np.float64], ready: NDArray[np.float64],
                  rank: NDArray[np.int64], links: NDArray[np.int32], bw: NDArray[np.float64],
                  lat: NDArray[np.float64], tie_ref: bool, busy: NDArray[np.float64],
                  finish: NDArray[np.float64], makespan: NDArray[np.float64],
                  cut: bool) -> None:
    """``_des_runs`` with the runs spread over numba's threads: run j reads shared inputs and
    its own slices and writes only its own rows, so the results equal the serial kernel's."""
    for j in prange(offsets.shape[0] - 1):
        a, b = offsets[j], offsets[j + 1]
        makespan[j] = des_core(pos[a:b], stop[a:b], size[a:b], ready[a:b], rank[a:b], links,
                               bw, lat, tie_ref, busy[j], finish[a:b], cut)


def check_ni_bandwidth(ni_bw_Bps: float) -> float:
    """Return a network-interface port bandwidth as float; ``ConfigError`` unless finite > 0."""
    bw = float(ni_bw_Bps)
    if not (bw > 0 and np.isfinite(bw)):
        raise ConfigError(f"ni_bw_Bps must be a finite number > 0, got {ni_bw_Bps!r}")
    return bw


def check_ni_latency(ni_latency_s: float | None, hop_latency_s: float) -> float:
    """Return a port latency in seconds (``None``: ``hop_latency_s``); ``ConfigError`` if < 0."""
    if ni_latency_s is None:
        return float(hop_latency_s)
    return check_scalar("ni_latency_s", ni_latency_s)


def port_latencies(topology: Topology, hop_latency_s: float,
                   ni_latency_s: float) -> NDArray[np.float64]:
    """Per-link latencies [L + 2N] with ports: L hop latencies, then 2N port latencies."""
    return np.concatenate([np.full(topology.num_links, float(hop_latency_s)),
                           np.full(2 * topology.num_endpoints, float(ni_latency_s))])


@njit(cache=True)
def _port_routes(pair_ptr: NDArray[np.int64], route_ptr: NDArray[np.int64],
                 route_links: NDArray[np.int32], num_endpoints: int, num_links: int
                 ) -> tuple[NDArray[np.int64], NDArray[np.int32]]:
    """Every route with its network-interface ports, as CSR (``ptr`` [R + 1], ``links``).

    Route r of the pair (s, d) becomes the injection port ``num_links + s``, its links, then
    the ejection port ``num_links + N + d``; an empty route stays empty (``port_routes``).
    """
    num_routes = route_ptr.shape[0] - 1
    ptr = np.zeros(num_routes + 1, dtype=np.int64)
    for r in range(num_routes):
        length = route_ptr[r + 1] - route_ptr[r]
        ptr[r + 1] = ptr[r] + (length + 2 if length > 0 else 0)
    links = np.empty(ptr[num_routes], dtype=np.int32)
    for s in range(num_endpoints):
        for d in range(num_endpoints):
            pair = s * num_endpoints + d
            for r in range(pair_ptr[pair], pair_ptr[pair + 1]):
                if route_ptr[r + 1] == route_ptr[r]:
                    continue
                k = ptr[r]
                links[k] = num_links + s
                for q in range(route_ptr[r], route_ptr[r + 1]):
                    k += 1
                    links[k] = route_links[q]
                links[k + 1] = num_links + num_endpoints + d
    return ptr, links


#: Every route of a topology with its network-interface ports (``_port_routes``), by topology
#: (identity: ``Topology`` compares by identity and its arrays are read-only).
_PORT_ROUTES: BoundedCache[Topology, tuple[NDArray[np.int64], NDArray[np.int32]]] = BoundedCache(
    8, name="hdamoe_env.noc.des.port_routes")


def port_routes(topology: Topology) -> tuple[NDArray[np.int64], NDArray[np.int32]]:
    """Return every route of ``topology`` with its network-interface ports, built once.

    Route r of the pair (s, d) is ``links[ptr[r]:ptr[r + 1]]``: the injection port
    ``num_links + s``, the route's links, the ejection port ``num_links + N + d`` (an empty
    route stays empty), the link lists of ``simulate_messages(ni_bw_Bps=...)`` and of
    ``linksim._layer_kernel`` with ports.

    Returns:
        ``(ptr`` int64 [R + 1], ``links`` int32``)``, shared: do not modify.
    """
    found = _PORT_ROUTES.get(topology)
    if found is None:
        found = _port_routes(topology.pair_route_ptr, topology.route_ptr, topology.route_links,
                             topology.num_endpoints, topology.num_links)
        _PORT_ROUTES.put(topology, found)
    return found


def _with_ports(topology: Topology, prep: PreparedMessages, routes: NDArray[np.int64],
                ni_bw_Bps: float) -> tuple[NDArray[np.int64], NDArray[np.int64],
                                           NDArray[np.int32], NDArray[np.float64]]:
    """Per-message link lists with injection (L + src) and ejection (L + N + dst) ports: the
    cursors ``pos`` (a fresh array, advanced by ``des_core``) and ``stop`` into the topology's
    ``port_routes``, those links and the bandwidths [L + 2N]."""
    bw = check_ni_bandwidth(ni_bw_Bps)
    ptr, links = port_routes(topology)
    link_bw = np.concatenate([topology.link_bw_Bps, np.full(2 * topology.num_endpoints, bw)])
    return ptr[routes], ptr[routes + 1], links, link_bw


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


def _earliest_gap_until(intervals: list[tuple[float, float]], t: float,
                        end_at: Any) -> float:
    """Return the earliest start x >= t with [x, end_at(x)) free in the sorted ``intervals``."""
    x = t
    for s, e in intervals:
        if e <= x:
            continue
        if x < s and end_at(x) <= s:
            break
        x = max(x, e)
    return x


def simulate_messages_oracle(topology: Topology, src: ArrayLike, dst: ArrayLike,
                             size_bytes: ArrayLike, ready_s: ArrayLike | None = None, *,
                             tie_break: str = "fifo", hop_latency_s: float = 0.0,
                             flow_keys: ArrayLike | None = None, chunks: int = 1,
                             switching: str = "store_and_forward",
                             ni_bw_Bps: float | None = None,
                             ni_latency_s: float | None = None) -> DesResult:
    """Simulate messages with a slow, obviously correct interval-calendar DES (test oracle).

    Same signature, semantics and results (bit for bit) as ``simulate_messages``. Routes are
    chosen one by one with ``Topology.route`` and ``stable_hash``; every link keeps a sorted list
    of reserved intervals and a hop starts in the earliest free gap at or after its ready time
    (§6.3 "Equivalence with the reference"); the ``ref`` tie-break compares the routes' link-label
    lists directly. Under cut-through a hop's end depends on its start (the upstream tail), so
    the gap search evaluates the end at every candidate start. Arguments as
    ``simulate_messages``.
    """
    cut = check_switching(switching)
    prep = prepare_messages(topology, src, dst, size_bytes, ready_s, tie_break, hop_latency_s,
                            flow_keys, chunks)
    ni_lat = check_ni_latency(ni_latency_s, prep.hop_latency)
    num = prep.src.shape[0]
    routes: list[list[int]] = []
    for i in range(num):
        raw = prep.keys[i]
        key: int | tuple[int, ...] = int(raw) if prep.keys.ndim == 1 else tuple(
            int(x) for x in raw)
        routes.append([int(x) for x in topology.route(int(prep.src[i]), int(prep.dst[i]), key)])
    labels = [tuple(topology.link_labels[x] for x in r) for r in routes]
    sizes = [float(x) for x in prep.size]
    bw = [float(x) for x in topology.link_bw_Bps]
    lat = [prep.hop_latency] * len(bw)
    if ni_bw_Bps is not None:  # injection port L + src first, ejection port L + N + dst last
        n, ports = topology.num_endpoints, check_ni_bandwidth(ni_bw_Bps)
        routes = [[topology.num_links + int(prep.src[i]), *r,
                   topology.num_links + n + int(prep.dst[i])] if r else r
                  for i, r in enumerate(routes)]
        bw += [ports] * (2 * n)
        lat += [ni_lat] * (2 * n)
    calendar: list[list[tuple[float, float]]] = [[] for _ in range(len(bw))]
    busy = [0.0] * len(bw)
    finish = [0.0] * num
    tail_in = [-np.inf] * num  # cut-through: the tail's arrival from the previous hop
    seq = 0
    heap: list[tuple[Any, ...]] = []

    def push(t: float, m: int, hop: int) -> None:
        nonlocal seq
        if prep.tie_ref:
            heapq.heappush(heap, (t, sizes[m], labels[m], seq, m, hop))
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
        if not cut:
            start = _earliest_gap(calendar[link], t, dur)
            end = start + dur
            bisect.insort(calendar[link], (start, end))
            busy[link] += end - start
            push(end + lat[link], m, hop + 1)
            continue
        tail_ready = tail_in[m]

        def end_at(x: float, dur: float = dur, tail_ready: float = tail_ready) -> float:
            end = x + dur
            return tail_ready if tail_ready > end else end

        start = _earliest_gap_until(calendar[link], t, end_at)
        end = end_at(start)
        tail_in[m] = end + lat[link]
        bisect.insort(calendar[link], (start, end))
        busy[link] += end - start
        if hop + 1 == len(routes[m]):
            finish[m] = end + lat[link]
            makespan = max(makespan, finish[m])
        else:
            push(start + lat[link], m, hop + 1)
    return DesResult(float(makespan), np.array(busy[:topology.num_links], dtype=np.float64),
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
    prep = prepare_messages(topology, src, dst, size_bytes, None, "fifo", 0.0, flow_keys, 1)
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
