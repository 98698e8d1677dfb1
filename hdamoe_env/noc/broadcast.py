"""Pre-broadcast traffic on the NoC: chunk-pipelined tree broadcasts as DES messages.

Implements paper-model.md §10.4 and §10.8: the broadcast tree of a source endpoint on the
topology's own routes (``broadcast_tree``), the chunk messages of broadcasting whole experts
from one holder to every other endpoint with the contention-free pipeline schedule as release
times (``broadcast_messages``), and their simulation on idle links with the package's DES
(``simulate_broadcast``). Which experts are broadcast is decided in
``hdamoe_env.decisions.broadcast``; the α–β closed form and the budget are in
``hdamoe_env.cost.broadcast``. Units are SI.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.noc import linksim
from hdamoe_env.noc.des import PreparedRun, prepare_run, simulate_runs
from hdamoe_env.noc.topology import Topology

__all__ = ["BroadcastMessages", "BroadcastResult", "broadcast_fanout", "broadcast_messages",
           "broadcast_tree", "simulate_broadcast", "simulate_broadcasts"]


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


@functools.lru_cache(maxsize=16)
def broadcast_fanout(topology: Topology) -> int:
    """Return the largest number of children of any endpoint in any source's broadcast tree.

    With one injection port per endpoint (``ni_ports``) a forwarding endpoint injects each chunk
    once per child, so its port, not a link, bounds the broadcast's pipeline rate at
    BW / fanout. O(N²) route walks (1.3 s on a 16x16 mesh), so cached per topology object
    (topologies compare by identity and ``make_topology`` reuses them).
    """
    best = 1
    for source in range(topology.num_endpoints):
        parent, _ = broadcast_tree(topology, source)
        children = np.bincount(parent[parent >= 0], minlength=topology.num_endpoints)
        best = max(best, int(children.max()))
    return best


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
                       trees: dict[int, tuple[NDArray[np.int64], NDArray[np.int64]]] | None = None,
                       switching: str = "store_and_forward", ni_bw_Bps: float | None = None,
                       ni_latency_s: float | None = None) -> BroadcastResult:
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
        switching: DES switching (``hdamoe_env.noc.des``).
        ni_bw_Bps: DES network-interface port bandwidth, or None (``des.simulate_messages``).
        ni_latency_s: DES port latency, seconds; ``None`` = the hop latency.

    Returns:
        Makespan and per-link busy time.
    """
    return simulate_broadcasts(topology, [(P_layer, experts, chunk_bytes, pi)], S_bytes,
                               alpha_s=alpha_s, hop_latency_s=hop_latency_s,
                               tie_break=tie_break, max_messages=max_messages, trees=trees,
                               switching=switching, ni_bw_Bps=ni_bw_Bps,
                               ni_latency_s=ni_latency_s)[0]


def _messages(topology: Topology, P_layer: ArrayLike, experts: list[int], S_bytes: float,
              chunk_bytes: float, pi: ArrayLike | None, alpha_s: float, hop_latency_s: float,
              max_messages: int,
              trees: dict[int, tuple[NDArray[np.int64], NDArray[np.int64]]] | None
              ) -> BroadcastMessages:
    """The messages ``simulate_broadcast`` simulates (chunk count capped by ``max_messages``)."""
    if not chunk_bytes > 0:
        raise ConfigError(f"chunk_bytes must be positive, got {chunk_bytes!r}")
    chunks = max(1, math.ceil(float(S_bytes) / float(chunk_bytes)))
    per_chunk = len(experts) * (topology.num_endpoints - 1)
    chunks = max(1, min(chunks, max_messages // max(per_chunk, 1)))
    return broadcast_messages(topology, P_layer, experts, S_bytes, chunks, pi=pi,
                              alpha_s=alpha_s, hop_latency_s=hop_latency_s, trees=trees)


def simulate_broadcasts(topology: Topology,
                        runs: Sequence[tuple[ArrayLike, Sequence[int], float, ArrayLike | None]],
                        S_bytes: float, *, alpha_s: float = 0.0, hop_latency_s: float = 0.0,
                        tie_break: str = "fifo", max_messages: int = 20_000,
                        trees: dict[int, tuple[NDArray[np.int64], NDArray[np.int64]]]
                        | None = None, switching: str = "store_and_forward",
                        ni_bw_Bps: float | None = None, ni_latency_s: float | None = None,
                        threads: int = 1) -> list[BroadcastResult]:
    """``simulate_broadcast`` of several broadcasts, their DES in one compiled call.

    Every result equals ``simulate_broadcast`` of that run with the same options, bit for bit
    (the same messages; ``des.simulate_runs`` runs ``des_core`` on each).

    Args:
        topology: The NoC.
        runs: One ``(P_layer, experts, chunk_bytes, pi)`` per broadcast (arguments of
            ``simulate_broadcast``).
        S_bytes, alpha_s, hop_latency_s, tie_break, max_messages, trees, switching,
            ni_bw_Bps, ni_latency_s: As ``simulate_broadcast``, shared by the runs.
        threads: numba threads the runs' DES are spread over (``linksim.check_threads``); 1
            runs them in order on the calling thread. Results are the same for every value.

    Returns:
        One ``BroadcastResult`` per run, in order.
    """
    threads = linksim.check_threads(threads)
    results: list[BroadcastResult | None] = [None] * len(runs)
    prepared: list[PreparedRun] = []
    where: list[tuple[int, BroadcastMessages]] = []
    for j, (P_layer, experts, chunk_bytes, pi) in enumerate(runs):
        experts = list(experts)
        if not experts:
            results[j] = BroadcastResult(0.0, np.zeros(topology.num_links), 0, 0, 0.0)
            continue
        msgs = _messages(topology, P_layer, experts, S_bytes, chunk_bytes, pi, alpha_s,
                         hop_latency_s, max_messages, trees)
        prepared.append(prepare_run(topology, msgs.src, msgs.dst, msgs.size_bytes,
                                    msgs.ready_s, tie_break=tie_break,
                                    hop_latency_s=hop_latency_s, switching=switching,
                                    ni_bw_Bps=ni_bw_Bps, ni_latency_s=ni_latency_s))
        where.append((j, msgs))
    if threads > 1 and len(prepared) > 1:
        with linksim.numba_threads(threads):
            makespan, busy = simulate_runs(topology, prepared, parallel=True)
    else:
        makespan, busy = simulate_runs(topology, prepared)
    for m, (j, msgs) in enumerate(where):
        results[j] = BroadcastResult(float(makespan[m]), busy[m], int(msgs.src.size),
                                     msgs.chunks, msgs.chunk_bytes)
    return [r for r in results if r is not None]
