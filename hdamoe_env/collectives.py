"""Collectives on the NoC DES: the ring all-reduce of TP layers.

Implements paper-model.md §5.6 (TP all-reduce) simulated with the message DES of §6.3
(``hdamoe_env.des``): the default ring of a topology and a reduce-scatter + all-gather run as
2(p−1) sequential DES rounds. The closed form used by the evaluators is ``perf.tp_allreduce_time``;
this module exists to check it against the simulated network.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.des import _check_scalar, _des_kernel, _prepare
from hdamoe_env.errors import ConfigError
from hdamoe_env.topology import Topology

__all__ = ["default_ring", "ring_allreduce_des"]


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
