"""Collectives on the NoC DES: the all-reduce of TP layers, by the best algorithm available.

Implements paper-model.md §5.6 (TP all-reduce) simulated with the message DES of §6.3
(``hdamoe_env.noc.des``), with the α–β cost of docs/PHYSICS.md: every collective step is one DES
round whose messages start α after the previous step ended, and every hop adds the hop latency.

Algorithms (``ALGORITHMS``; reduce-scatter then all-gather, S bytes per node, p nodes):

* ``ring`` — 1-D ring over ``default_ring``: 2(p−1) steps of S/p per member; on a ring of
  one-hop neighbours 2(p−1)·(α + hop + S/(p·BW)), the closed form ``perf.tp_allreduce_time``.
* ``biring`` — the same ring in both directions at once, each carrying half the data:
  2(p−1) steps of S/(2p) to the successor and S/(2p) to the predecessor.
* ``ring2d`` — rows then columns of the endpoint grid (X rows of Y): reduce-scatter along every
  row ring (Y−1 steps of S/Y), then along every column ring (X−1 steps of S/(X·Y)), all-gather in
  reverse. Mesh rows and columns are lines, so their rings are the folded order 0, 2, 4, …, 5,
  3, 1 (every link used once per step, two hops per message); torus rows and columns are rings;
  on the fat-tree a row is a pod (pod-local rings, then cross-pod rings: the hierarchical scheme).

Every step of an algorithm repeats the same messages on idle links, so one DES round per distinct
step kind is simulated and multiplied by its count (exact: the DES is shift-invariant). Results
are cached per (topology, algorithm, bytes, α, hop latency, switching, ports and their
latency); ``best_allreduce`` returns the fastest and its name, which the evaluators report.

Switching and network-interface ports (docs/PHYSICS.md §16) are those of the message DES
(``des.simulate_messages``): with ``ni_bw_Bps`` every message also crosses its source's injection
port and its destination's ejection port, each paying the port latency t_ni (``ni_latency_s``,
default the hop latency). A ring step then costs α + 2·t_ni + hop + S/(p·BW) under cut-through
(α + 2·t_ni + hop + 3·S/(p·BW) under store-and-forward), and ``biring``, whose nodes send
and receive two messages per step, loses its advantage when the ports are as fast as a link:
both messages share one injection and one ejection port.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.noc.des import (check_ni_bandwidth, check_ni_latency, check_switching,
                                des_kernel, simulate_messages)
from hdamoe_env.noc.messages import check_scalar, prepare_messages
from hdamoe_env.config.cache import BoundedCache
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.noc.topology import Topology

__all__ = ["ALGORITHMS", "AllReduce", "allreduce_time", "best_allreduce", "default_ring",
           "ring_allreduce_des"]

ALGORITHMS = ("ring", "biring", "ring2d")


@dataclass(frozen=True, slots=True)
class AllReduce:
    """The all-reduce chosen for a size: its time and the algorithm (``ALGORITHMS``).

    Attributes:
        time_s: Seconds.
        algorithm: Name of the fastest algorithm (ties: the first in ``ALGORITHMS``).
        times_s: Seconds of every algorithm considered, by name.
    """

    time_s: float
    algorithm: str
    times_s: dict[str, float]


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
                       chunks: int = 1, hop_latency_s: float = 0.0,
                       switching: str = "store_and_forward",
                       ni_bw_Bps: float | None = None,
                       ni_latency_s: float | None = None) -> float:
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
        switching: ``"store_and_forward"`` or ``"cut_through"`` (``hdamoe_env.noc.des``).
        ni_bw_Bps: Network-interface port bandwidth (``des.simulate_messages``), or None.
        ni_latency_s: Port latency, seconds; ``None`` = the hop latency.

    Returns:
        The all-reduce time in seconds (0 for p <= 1).

    Raises:
        ConfigError: Invalid ring, size, chunks, latency, switching or port bandwidth.
    """
    cut = check_switching(switching)
    if ni_bw_Bps is not None:
        check_ni_bandwidth(ni_bw_Bps)
    check_ni_latency(ni_latency_s, check_scalar("hop_latency_s", hop_latency_s))
    size = check_scalar("size_bytes", size_bytes)
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
    if ni_bw_Bps is not None:
        t = 0.0
        for _ in range(2 * (p - 1)):
            t = simulate_messages(topology, src, dst, np.full(p, size / p), np.full(p, t),
                                  hop_latency_s=hop_latency_s, chunks=chunks,
                                  switching=switching, ni_bw_Bps=ni_bw_Bps,
                                  ni_latency_s=ni_latency_s).makespan_s
        return float(t)
    prep = prepare_messages(topology, src, dst, np.full(p, size / p), None, "fifo",
                            hop_latency_s, None, chunks)
    routes = topology.select_routes(prep.src, prep.dst, prep.keys)
    rank = np.zeros(routes.size, dtype=np.int64)
    t = 0.0
    for _ in range(2 * (p - 1)):
        ready = np.full(routes.size, t)
        t, _busy, _finish = des_kernel(routes, prep.size, ready, rank, topology.route_ptr,
                                       topology.route_links, topology.link_bw_Bps,
                                       prep.hop_latency, False, cut)
    return float(t)


def _folded(n: int) -> list[int]:
    """Return the ring order of a line of n nodes with every link used once: 0, 2, …, 3, 1."""
    return list(range(0, n, 2)) + list(range(n - 1 - (n % 2 == 1), 0, -2)) if n > 2 \
        else list(range(n))


def _grid_groups(topology: Topology) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Return the row rings [X, Y] and column rings [Y, X] of ``ring2d`` as endpoint ids."""
    x, y = topology.grid_shape
    grid = np.arange(x * y, dtype=np.int64).reshape(x, y)
    if topology.kind == "mesh":  # lines: the folded ring
        return grid[:, _folded(y)], grid.T[:, _folded(x)]
    return grid, grid.T.copy()  # torus rings; fat-tree rows = pods in endpoint order


def _round_s(topology: Topology, src: NDArray[np.int64], dst: NDArray[np.int64], size: float,
             alpha_s: float, hop_latency_s: float, cut: bool = False,
             ni_bw_Bps: float | None = None, ni_latency_s: float | None = None) -> float:
    """Return the time of one collective step: all messages start at α on idle links."""
    if src.size == 0 or size <= 0:
        return 0.0
    if ni_bw_Bps is not None:
        return simulate_messages(topology, src, dst, np.full(src.size, size),
                                 np.full(src.size, alpha_s), hop_latency_s=hop_latency_s,
                                 switching="cut_through" if cut else "store_and_forward",
                                 ni_bw_Bps=ni_bw_Bps, ni_latency_s=ni_latency_s).makespan_s
    prep = prepare_messages(topology, src, dst, np.full(src.size, size), None, "fifo",
                            hop_latency_s, None, 1)
    routes = topology.select_routes(prep.src, prep.dst, prep.keys)
    ready = np.full(routes.size, alpha_s)
    rank = np.zeros(routes.size, dtype=np.int64)
    t, _busy, _finish = des_kernel(routes, prep.size, ready, rank, topology.route_ptr,
                                   topology.route_links, topology.link_bw_Bps,
                                   prep.hop_latency, False, cut)
    return float(t)


def _schedule(topology: Topology, algorithm: str, size: float
              ) -> list[tuple[int, NDArray[np.int64], NDArray[np.int64], float]]:
    """Return the steps of an algorithm as (count, src, dst, bytes per message)."""
    if algorithm == "ring":
        order = default_ring(topology)
        p = order.size
        return [(2 * (p - 1), order, np.roll(order, -1), size / p)]
    if algorithm == "biring":
        order = default_ring(topology)
        p = order.size
        src = np.concatenate([order, order])
        dst = np.concatenate([np.roll(order, -1), np.roll(order, 1)])
        return [(2 * (p - 1), src, dst, size / (2 * p))]
    if algorithm == "ring2d":
        rows, cols = _grid_groups(topology)
        x, y = topology.grid_shape
        steps = []
        for count, rings, part in ((2 * (y - 1), rows, size / y),
                                   (2 * (x - 1), cols, size / (x * y))):
            if count:
                steps.append((count, rings.reshape(-1), np.roll(rings, -1, axis=1).reshape(-1),
                               part))
        return steps
    raise ConfigError(f"unknown all-reduce algorithm {algorithm!r}; expected one of "
                      f"{list(ALGORITHMS)}")


#: All-reduce times by (topology id, algorithm, bytes, α, hop latency, switching, port bandwidth,
#: port latency);
#: a value keeps its topology (checked by identity, so a reused id can never hit). A run needs a
#: few per batch size and topology, the whole test suite 71 (measured), so 4096 never evicts
#: either working set.
_TIMES: BoundedCache[tuple[int, str, float, float, float, bool, float | None, float],
                     tuple[Topology, float]] = BoundedCache(
    4096, name="hdamoe_env.noc.collectives.allreduce_time")


def allreduce_time(topology: Topology, size_bytes: float, algorithm: str = "ring", *,
                   alpha_s: float = 0.0, hop_latency_s: float = 0.0,
                   switching: str = "store_and_forward",
                   ni_bw_Bps: float | None = None,
                   ni_latency_s: float | None = None) -> float:
    """Return the DES time of an all-reduce of ``size_bytes`` per node by ``algorithm`` (cached).

    Args:
        topology: The NoC (all endpoints take part).
        size_bytes: Bytes S to all-reduce per node.
        algorithm: One of ``ALGORITHMS``.
        alpha_s: Start-up latency α of every step, seconds.
        hop_latency_s: Latency after every link traversal, seconds.
        switching: ``"store_and_forward"`` or ``"cut_through"`` (``hdamoe_env.noc.des``).
        ni_bw_Bps: Network-interface port bandwidth (``des.simulate_messages``), or None.
        ni_latency_s: Port latency, seconds; ``None`` = the hop latency.

    Returns:
        Seconds (0 for one endpoint or S = 0).

    Raises:
        ConfigError: Unknown algorithm or switching, or a negative or non-finite size or
            hop or port latency, or a non-positive port bandwidth.
    """
    cut = check_switching(switching)
    ni = None if ni_bw_Bps is None else check_ni_bandwidth(ni_bw_Bps)
    size = check_scalar("size_bytes", size_bytes)
    alpha = check_scalar("alpha_s", alpha_s)
    hop = check_scalar("hop_latency_s", hop_latency_s)
    ni_lat = check_ni_latency(ni_latency_s, hop)
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"unknown all-reduce algorithm {algorithm!r}; expected one of "
                          f"{list(ALGORITHMS)}")
    key = (id(topology), algorithm, size, alpha, hop, cut, ni, ni_lat)
    entry = _TIMES.get(key)
    if entry is None or entry[0] is not topology:
        if topology.num_endpoints <= 1 or size == 0:
            hit = 0.0
        else:
            hit = math.fsum(count * _round_s(topology, src, dst, part, alpha, hop, cut, ni,
                                             ni_lat)
                            for count, src, dst, part in _schedule(topology, algorithm, size))
        entry = _TIMES.put(key, (topology, hit))
    return entry[1]


def best_allreduce(topology: Topology, size_bytes: float, *, alpha_s: float = 0.0,
                   hop_latency_s: float = 0.0,
                   algorithms: tuple[str, ...] = ALGORITHMS,
                   switching: str = "store_and_forward",
                   ni_bw_Bps: float | None = None,
                   ni_latency_s: float | None = None) -> AllReduce:
    """Return the fastest all-reduce algorithm the topology admits for ``size_bytes`` (§5.6).

    Args:
        topology: The NoC.
        size_bytes: Bytes S to all-reduce per node (TP: B·h·b_psum).
        alpha_s: Start-up latency α of every step, seconds.
        hop_latency_s: Latency after every link traversal, seconds.
        algorithms: Candidates, default all of ``ALGORITHMS``.
        switching: ``"store_and_forward"`` or ``"cut_through"`` (``hdamoe_env.noc.des``).
        ni_bw_Bps: Network-interface port bandwidth (``des.simulate_messages``), or None.
        ni_latency_s: Port latency, seconds; ``None`` = the hop latency.

    Returns:
        The time, the chosen algorithm and every candidate's time.
    """
    times = {name: allreduce_time(topology, size_bytes, name, alpha_s=alpha_s,
                                  hop_latency_s=hop_latency_s, switching=switching,
                                  ni_bw_Bps=ni_bw_Bps, ni_latency_s=ni_latency_s)
             for name in algorithms}
    name = min(times, key=lambda n: (times[n], algorithms.index(n)))
    return AllReduce(times[name], name, times)
