"""NoC topologies: mesh, torus and fat-tree link tables with precomputed routes.

Implements paper-model.md §6.1 (topology interface) for the settings of §3.

Model. Vertices are endpoints (compute-near-memory nodes, vertex ids ``0..N-1``) followed by
switches (fat-tree only). Every directed link ``(from-vertex, to-vertex)`` is an independent
resource with its own bandwidth (full duplex, §3). For grid layouts endpoint id = row·Y + col.
Routes are precomputed for every ordered endpoint pair as a list of candidate routes, each a
sequence of directed link ids, stored in CSR form:

* candidates of the pair ``(s, d)`` are the route ids ``pair_route_ptr[s*N + d] ..
  pair_route_ptr[s*N + d + 1] - 1``;
* route ``r`` traverses the links ``route_links[route_ptr[r]:route_ptr[r + 1]]``;
* ``s == d`` has exactly one, empty, route.

Routing rules (§6.1):

* **mesh** — dimension-ordered: first along the row index, then along the column index; one
  candidate.
* **torus** — mesh plus wrap-around links; per dimension the direction with fewer hops, on an
  exact tie (distance = half the ring) the +1 direction; row dimension first; one candidate.
  [decision] For a ring of size 2 the wrap-around link and the direct link join the same ordered
  pair of vertices; the topology keeps a single directed link (no parallel duplicate), so a 2-wide
  torus dimension has the same links as the mesh.
* **fattree** — pods × leaves × endpoints, ``A`` aggregation switches per pod connected to every
  leaf of the pod, core switches connected to every aggregation switch of every pod. Same leaf:
  e → leaf → e' (1 candidate); same pod: e → leaf → agg a → leaf' → e' (one candidate per a, in
  ascending a); different pods: e → leaf → agg (p, a) → core c → agg (p', c mod A) → leaf' → e'
  (one candidate per (a, c), a-major then c). Links touching an endpoint have ``BW_el``, leaf–agg
  links ``BW_la``, agg–core links ``BW_ac / oversubscription`` (``None`` tier bandwidths default
  to the hardware link bandwidth). [decision] Every core–agg pair is physically connected in both
  directions (the prose of §6.1); the down links core c → agg (p', a') with a' != c mod A are
  therefore present in the link table but no route uses them (their busy time is always 0).

Route choice among several candidates: ``candidates[stable_hash(flow_key) % n]`` (§6.1).

The ``ref`` DES tie-break (§6.3) compares routes lexicographically as lists of link labels: on
grids a link label is ``((row, col), (row, col))``, on the fat-tree ``(from-vertex label,
to-vertex label)`` with vertex labels ``("ep", (row, col))``, ``("leaf", p, j)``, ``("agg", p, a)``
and ``("core", c)``. ``route_lex_rank`` holds the dense rank of every route in that order, so a
kernel can compare two routes with one integer comparison.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.cache import BoundedCache
from hdamoe_env.config.errors import ConfigError, unknown_name
from hdamoe_env.config.specs import HardwareSpec, TopologySpec

__all__ = [
    "TOPOLOGIES",
    "Topology",
    "make_topology",
    "stable_hash",
    "stable_hash_array",
]

_MASK64 = 0xFFFFFFFFFFFFFFFF
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _splitmix64(z: int) -> int:
    """Apply one splitmix64 step (increment by the golden gamma, then finalise) to ``z``."""
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def stable_hash(key: int | Sequence[int]) -> int:
    """Hash a flow key deterministically across processes and runs.

    [decision] (paper-model.md §6.1, quirk Q17): Python's salted ``hash`` is never used.

    * An ``int`` key is returned unchanged, so route choice is ``key % n`` [ref].
    * A tuple of ints ``(x_0, …, x_{K-1})`` is folded with splitmix64:
      ``h = 0; for x in key: h = splitmix64(h XOR (x mod 2**64))`` where ``splitmix64(z)`` adds
      0x9E3779B97F4A7C15, then applies ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9;
      z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31`` (all modulo 2**64). The result is in
      ``[0, 2**64)``. ``stable_hash_array`` and the DES kernel implement the same function.

    Note that ``stable_hash(5)`` (an int) and ``stable_hash((5,))`` (a 1-tuple) differ.

    Args:
        key: An integer or a sequence of integers.

    Returns:
        The hash as a Python int.

    Raises:
        ConfigError: The key is neither an int nor a sequence of ints.
    """
    if isinstance(key, int | np.integer):
        return int(key)
    try:
        parts = [int(x) for x in key]
    except (TypeError, ValueError):
        raise ConfigError(f"flow key must be an int or a tuple of ints, got {key!r}") from None
    h = 0
    for x in parts:
        h = _splitmix64(h ^ (x & _MASK64))
    return h


def stable_hash_array(keys: ArrayLike) -> NDArray[np.uint64]:
    """Vectorised ``stable_hash`` of tuple keys, one key per row.

    Args:
        keys: Integer array [M, K]; row m is the tuple key of item m.

    Returns:
        uint64 array [M] equal to ``[stable_hash(tuple(row)) for row in keys]``.
    """
    arr = np.asarray(keys)
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"tuple keys must be an integer array [M, K], got shape {arr.shape} "
                          f"and dtype {arr.dtype}")
    cols = arr.astype(np.int64).astype(np.uint64)  # two's complement = x mod 2**64
    h = np.zeros(arr.shape[0], dtype=np.uint64)
    golden, mix1, mix2 = np.uint64(_GOLDEN), np.uint64(_MIX1), np.uint64(_MIX2)
    s30, s27, s31 = np.uint64(30), np.uint64(27), np.uint64(31)
    for col in range(arr.shape[1]):
        z = (h ^ cols[:, col]) + golden
        z = (z ^ (z >> s30)) * mix1
        z = (z ^ (z >> s27)) * mix2
        h = z ^ (z >> s31)
    return h


def _readonly(a: NDArray[Any]) -> NDArray[Any]:
    a.flags.writeable = False
    return a


@dataclass(frozen=True, slots=True, eq=False)
class Topology:
    """A NoC: vertices, directed links with bandwidths and precomputed candidate routes (§6.1).

    Shapes: N endpoints, V vertices, num_links directed links, R routes in total.

    Attributes:
        kind: ``"mesh"``, ``"torus"`` or ``"fattree"``.
        grid_shape: (X, Y) grid of the endpoints (endpoint id = row·Y + col).
        num_endpoints: N.
        num_vertices: V; endpoints are vertices 0..N-1, switches follow.
        vertex_labels: [V] labels ``("ep", (row, col))``, ``("leaf", p, j)``, ``("agg", p, a)``,
            ``("core", c)``.
        num_links: number of directed links.
        link_src: int32 [num_links] source vertex of every link.
        link_dst: int32 [num_links] destination vertex of every link.
        link_bw_Bps: float64 [num_links] bandwidth of every link in B/s.
        link_labels: [num_links] link labels used by the ``ref`` tie-break (module docstring).
        bw_end_Bps: endpoint-side bandwidth BW_end in B/s (mesh/torus: BW; fat-tree: BW_el).
        diameter: maximum route length in hops over all endpoint pairs.
        endpoint_coords: int64 [N, 2] (row, col) of every endpoint.
        pair_route_ptr: int64 [N·N + 1] CSR pointer from the pair index s·N + d to route ids.
        route_ptr: int64 [R + 1] CSR pointer from route ids to ``route_links``.
        route_links: int32 [route_ptr[-1]] link ids of all routes, concatenated.
        route_lex_rank: int64 [R] dense rank of every route in lexicographic link-label order.
    """

    kind: str
    grid_shape: tuple[int, int]
    num_endpoints: int
    num_vertices: int
    vertex_labels: tuple[Any, ...]
    num_links: int
    link_src: NDArray[np.int32]
    link_dst: NDArray[np.int32]
    link_bw_Bps: NDArray[np.float64]
    link_labels: tuple[Any, ...]
    bw_end_Bps: float
    diameter: int
    endpoint_coords: NDArray[np.int64]
    pair_route_ptr: NDArray[np.int64]
    route_ptr: NDArray[np.int64]
    route_links: NDArray[np.int32]
    route_lex_rank: NDArray[np.int64]

    @property
    def num_routes(self) -> int:
        """Total number of candidate routes R over all ordered endpoint pairs."""
        return int(self.route_ptr.shape[0] - 1)

    @property
    def num_candidates(self) -> NDArray[np.int64]:
        """Int64 [N, N] number of candidate routes of every ordered endpoint pair."""
        n = self.num_endpoints
        return np.diff(self.pair_route_ptr).reshape(n, n)

    def hop_counts(self) -> NDArray[np.int64]:
        """Return int64 [N, N] the number of links on the first candidate route of every pair.

        The diagonal is 0 (a message to oneself crosses no link); on the fat-tree a hop through
        a switch counts, as in ``diameter``.
        """
        n = self.num_endpoints
        first = self.pair_route_ptr[:-1]
        has = np.diff(self.pair_route_ptr) > 0
        lengths = np.diff(self.route_ptr)
        hops = np.where(has, lengths[np.minimum(first, lengths.size - 1)], 0).reshape(n, n)
        np.fill_diagonal(hops, 0)
        out: NDArray[np.int64] = hops.astype(np.int64)
        return out

    def _check_endpoint(self, name: str, value: int) -> int:
        if not (0 <= int(value) < self.num_endpoints):
            raise ConfigError(f"{name}={value} is not an endpoint id; expected 0 <= {name} < "
                              f"{self.num_endpoints}")
        return int(value)

    def endpoint_id(self, row: int, col: int) -> int:
        """Return the endpoint id of grid cell (row, col), i.e. row·Y + col."""
        x, y = self.grid_shape
        if not (0 <= row < x and 0 <= col < y):
            raise ConfigError(f"cell ({row}, {col}) outside the {x}x{y} grid")
        return row * y + col

    def link_id(self, from_vertex: int, to_vertex: int) -> int:
        """Return the id of the directed link ``from_vertex -> to_vertex``.

        Raises:
            ConfigError: No such link exists.
        """
        hit = np.flatnonzero((self.link_src == from_vertex) & (self.link_dst == to_vertex))
        if hit.size == 0:
            raise ConfigError(f"no directed link {from_vertex} -> {to_vertex} in this {self.kind}")
        return int(hit[0])

    def route_ids(self, src: int, dst: int) -> NDArray[np.int64]:
        """Return the route ids [n] of the candidates of the pair (src, dst)."""
        s = self._check_endpoint("src", src)
        d = self._check_endpoint("dst", dst)
        p = s * self.num_endpoints + d
        return np.arange(self.pair_route_ptr[p], self.pair_route_ptr[p + 1], dtype=np.int64)

    def route_of(self, route_id: int) -> NDArray[np.int32]:
        """Return the link ids (int32, read-only) of route ``route_id``."""
        return self.route_links[self.route_ptr[route_id]:self.route_ptr[route_id + 1]]

    def candidates(self, src: int, dst: int) -> list[NDArray[np.int32]]:
        """Return the candidate routes of (src, dst), each an int32 array of directed link ids."""
        return [self.route_of(int(r)) for r in self.route_ids(src, dst)]

    def route(self, src: int, dst: int, flow_key: int | Sequence[int] = 0) -> NDArray[np.int32]:
        """Return the chosen route ``candidates[stable_hash(flow_key) % n]`` of (src, dst)."""
        ids = self.route_ids(src, dst)
        return self.route_of(int(ids[stable_hash(flow_key) % ids.size]))

    def select_routes(self, src: ArrayLike, dst: ArrayLike,
                      flow_keys: ArrayLike | None = None) -> NDArray[np.int64]:
        """Choose a route id for every (src, dst, flow key) triple, vectorised.

        Args:
            src: Int array [M] of source endpoints.
            dst: Int array [M] of destination endpoints.
            flow_keys: ``None`` (key 0 for every item, as ``route``), an int array [M] (used
                directly modulo n) or an int array [M, K] of tuple keys (``stable_hash_array``).

        Returns:
            Int64 array [M] of route ids.

        Raises:
            ConfigError: Shapes disagree or an endpoint id is out of range.
        """
        s = np.asarray(src, dtype=np.int64).reshape(-1)
        d = np.asarray(dst, dtype=np.int64).reshape(-1)
        if s.shape != d.shape:
            raise ConfigError(f"src and dst lengths differ: {s.size} vs {d.size}")
        n = self.num_endpoints
        if s.size and (s.min() < 0 or s.max() >= n or d.min() < 0 or d.max() >= n):
            raise ConfigError(f"endpoint ids must lie in [0, {n}); got src in [{s.min()}, "
                              f"{s.max()}], dst in [{d.min()}, {d.max()}]")
        pair = s * n + d
        base = self.pair_route_ptr[pair]
        count = self.pair_route_ptr[pair + 1] - base
        if flow_keys is None or not np.any(count > 1):
            return base.copy()
        keys = np.asarray(flow_keys)
        if keys.ndim == 1:
            if keys.shape[0] != s.size:
                raise ConfigError(f"flow_keys length {keys.shape[0]} != number of messages "
                                  f"{s.size}")
            return base + np.mod(keys.astype(np.int64), count)
        if keys.ndim == 2 and keys.shape[0] == s.size:
            h = stable_hash_array(keys)
            return base + (h % count.astype(np.uint64)).astype(np.int64)
        raise ConfigError(f"flow_keys must have shape [{s.size}] or [{s.size}, K], got "
                          f"{keys.shape}")


# --------------------------------------------------------------------------------------------
# builders


class _LinkTable:
    """Incremental directed-link table with deduplication (build-time helper)."""

    def __init__(self) -> None:
        self.index: dict[tuple[int, int], int] = {}
        self.src: list[int] = []
        self.dst: list[int] = []
        self.bw: list[float] = []

    def add(self, u: int, v: int, bw: float) -> int:
        key = (u, v)
        if key not in self.index:  # a 2-ring's wrap link equals the direct link: keep one
            self.index[key] = len(self.src)
            self.src.append(u)
            self.dst.append(v)
            self.bw.append(bw)
        return self.index[key]

    def path(self, vertices: Sequence[int]) -> list[int]:
        return [self.index[(u, v)] for u, v in itertools.pairwise(vertices)]


def _assemble(kind: str, grid: tuple[int, int], num_endpoints: int, labels: list[Any],
              links: _LinkTable, routes: list[list[list[int]]], bw_end: float,
              grid_link_labels: bool) -> Topology:
    """Build the CSR arrays, link labels and lexicographic ranks of a topology."""
    n = num_endpoints
    pair_ptr = np.zeros(n * n + 1, dtype=np.int64)
    flat: list[list[int]] = []
    for p, cands in enumerate(routes):
        pair_ptr[p + 1] = pair_ptr[p] + len(cands)
        flat.extend(cands)
    lengths = np.array([len(r) for r in flat], dtype=np.int64)
    route_ptr = np.zeros(len(flat) + 1, dtype=np.int64)
    np.cumsum(lengths, out=route_ptr[1:])
    route_links = np.array([x for r in flat for x in r], dtype=np.int32)

    src = np.array(links.src, dtype=np.int32)
    dst = np.array(links.dst, dtype=np.int32)

    def vlabel(v: int) -> Any:
        return labels[v][1] if grid_link_labels else labels[v]

    link_labels = tuple((vlabel(int(u)), vlabel(int(v))) for u, v in zip(src, dst, strict=True))
    # §6.3 `ref` ties: routes compared as Python lists of link labels; dense rank.
    keys = [tuple(link_labels[x] for x in r) for r in flat]
    order = sorted(range(len(flat)), key=keys.__getitem__)
    rank = np.empty(len(flat), dtype=np.int64)
    current = -1
    previous: tuple[Any, ...] | None = None
    for pos in order:
        if previous is None or keys[pos] != previous:
            current += 1
            previous = keys[pos]
        rank[pos] = current

    y = grid[1]
    coords = np.array([(e // y, e % y) for e in range(n)], dtype=np.int64).reshape(n, 2)
    return Topology(
        kind=kind,
        grid_shape=grid,
        num_endpoints=n,
        num_vertices=len(labels),
        vertex_labels=tuple(labels),
        num_links=len(links.src),
        link_src=_readonly(src),
        link_dst=_readonly(dst),
        link_bw_Bps=_readonly(np.array(links.bw, dtype=np.float64)),
        link_labels=link_labels,
        bw_end_Bps=float(bw_end),
        diameter=int(lengths.max()) if lengths.size else 0,
        endpoint_coords=_readonly(coords),
        pair_route_ptr=_readonly(pair_ptr),
        route_ptr=_readonly(route_ptr),
        route_links=_readonly(route_links),
        route_lex_rank=_readonly(rank),
    )


def _ring_steps(a: int, b: int, size: int, wrap: bool) -> list[int]:
    """Return the successive coordinates from ``a`` to ``b`` along one dimension (excl. ``a``)."""
    if a == b:
        return []
    if not wrap:
        step = 1 if b > a else -1
        return list(range(a + step, b + step, step))
    forward = (b - a) % size
    backward = size - forward
    step = 1 if forward <= backward else -1  # tie (half the ring) -> +1 direction (§6.1)
    count = forward if step == 1 else backward
    return [(a + step * (i + 1)) % size for i in range(count)]


def _build_grid(hw: HardwareSpec, wrap: bool) -> Topology:
    x, y = hw.mesh_shape
    n = x * y
    bw = hw.link_bw_Bps
    links = _LinkTable()
    for row in range(x):
        for col in range(y):
            u = row * y + col
            for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                r2, c2 = row + dr, col + dc
                if wrap:
                    r2, c2 = r2 % x, c2 % y
                if 0 <= r2 < x and 0 <= c2 < y and (r2, c2) != (row, col):
                    links.add(u, r2 * y + c2, bw)
    routes: list[list[list[int]]] = []
    for s in range(n):
        r0, c0 = divmod(s, y)
        for d in range(n):
            r1, c1 = divmod(d, y)
            cells = [(r0, c0)]
            cells += [(r, c0) for r in _ring_steps(r0, r1, x, wrap)]  # row dimension first
            cells += [(r1, c) for c in _ring_steps(c0, c1, y, wrap)]
            routes.append([links.path([r * y + c for r, c in cells])])
    labels = [("ep", (e // y, e % y)) for e in range(n)]
    return _assemble("torus" if wrap else "mesh", (x, y), n, labels, links, routes, bw, True)


def _build_mesh(spec: TopologySpec, hw: HardwareSpec) -> Topology:
    """Build an X×Y mesh with dimension-ordered (row, then column) routing (§6.1)."""
    return _build_grid(hw, wrap=False)


def _build_torus(spec: TopologySpec, hw: HardwareSpec) -> Topology:
    """Build an X×Y torus with minimum-hop, +1-on-tie, row-first routing (§6.1)."""
    return _build_grid(hw, wrap=True)


def _fattree_bandwidths(spec: TopologySpec, hw: HardwareSpec) -> tuple[float, float, float]:
    """Return (BW_el, BW_la, BW_ac / oversubscription) in B/s; ``None`` tiers = hw link BW."""

    def tier(gbps: float | None) -> float:
        return hw.link_bw_Bps if gbps is None else gbps * 1e9

    return tier(spec.bw_el_gbps), tier(spec.bw_la_gbps), tier(spec.bw_ac_gbps) / \
        spec.oversubscription


@dataclass(frozen=True, slots=True)
class _FatTreeIds:
    """Vertex numbering of the fat-tree: endpoints, then leaves, aggs and cores (build helper)."""

    spec: TopologySpec

    def leaf_of(self, e: int) -> tuple[int, int]:
        """Return (pod, leaf-in-pod) of endpoint ``e``."""
        return divmod(e // self.spec.endpoints_per_leaf, self.spec.leaves_per_pod)

    def leaf(self, p: int, j: int) -> int:
        return self.spec.fattree_endpoints + p * self.spec.leaves_per_pod + j

    def agg(self, p: int, a: int) -> int:
        return self.leaf(self.spec.pods, 0) + p * self.spec.aggs_per_pod + a

    def core(self, c: int) -> int:
        return self.agg(self.spec.pods, 0) + c

    def routes(self, links: _LinkTable, s: int, d: int) -> list[list[int]]:
        """Return the candidate routes (link ids) from endpoint ``s`` to ``d`` (§6.1)."""
        (ps, js), (pd, jd) = self.leaf_of(s), self.leaf_of(d)
        naggs, ncores = self.spec.aggs_per_pod, self.spec.core_switches
        up, down = self.leaf(ps, js), self.leaf(pd, jd)
        if s == d:
            return [[]]
        if up == down:
            return [links.path([s, up, d])]
        if ps == pd:
            return [links.path([s, up, self.agg(ps, a), down, d]) for a in range(naggs)]
        return [links.path([s, up, self.agg(ps, a), self.core(c), self.agg(pd, c % naggs),
                            down, d])
                for a in range(naggs) for c in range(ncores)]


def _build_fattree(spec: TopologySpec, hw: HardwareSpec) -> Topology:
    """Build the pods × leaves × endpoints fat-tree of §6.1 with tiered bandwidths."""
    n = spec.fattree_endpoints
    if hw.num_nodes != n:
        raise ConfigError(
            f"fat-tree has {spec.pods} pods x {spec.leaves_per_pod} leaves x "
            f"{spec.endpoints_per_leaf} endpoints = {n} endpoints but the hardware mesh "
            f"{hw.mesh_shape[0]}x{hw.mesh_shape[1]} has {hw.num_nodes} nodes; make them equal")
    bw_el, bw_la, bw_ac = _fattree_bandwidths(spec, hw)
    npods, nleaf = spec.pods, spec.leaves_per_pod
    naggs, ncores = spec.aggs_per_pod, spec.core_switches
    y = hw.mesh_shape[1]
    ids = _FatTreeIds(spec)
    labels: list[Any] = [("ep", (e // y, e % y)) for e in range(n)]
    labels += [("leaf", p, j) for p in range(npods) for j in range(nleaf)]
    labels += [("agg", p, a) for p in range(npods) for a in range(naggs)]
    labels += [("core", c) for c in range(ncores)]

    links = _LinkTable()
    for e in range(n):
        lv = ids.leaf(*ids.leaf_of(e))
        links.add(e, lv, bw_el)
        links.add(lv, e, bw_el)
    for p in range(npods):
        for j in range(nleaf):
            for a in range(naggs):
                links.add(ids.leaf(p, j), ids.agg(p, a), bw_la)
                links.add(ids.agg(p, a), ids.leaf(p, j), bw_la)
    for p in range(npods):
        for a in range(naggs):
            for c in range(ncores):
                links.add(ids.agg(p, a), ids.core(c), bw_ac)
                links.add(ids.core(c), ids.agg(p, a), bw_ac)
    routes = [ids.routes(links, s, d) for s in range(n) for d in range(n)]
    return _assemble("fattree", hw.mesh_shape, n, labels, links, routes, bw_el, False)


#: Topology builders by name (style R9); each takes (TopologySpec, HardwareSpec).
TOPOLOGIES: dict[str, Callable[[TopologySpec, HardwareSpec], Topology]] = {
    "mesh": _build_mesh,
    "torus": _build_torus,
    "fattree": _build_fattree,
}


#: Built topologies by (spec, hardware): a run uses one or a few, the whole test suite 28
#: (measured), so 64 never evicts either working set.
_BUILT: BoundedCache[tuple[TopologySpec, HardwareSpec], Topology] = BoundedCache(
    64, name="hdamoe_env.noc.topology.make_topology")


def _cached_build(spec: TopologySpec, hw: HardwareSpec) -> Topology:
    hit = _BUILT.get((spec, hw))
    if hit is None:
        hit = _BUILT.put((spec, hw), TOPOLOGIES[spec.kind](spec, hw))
    return hit


def make_topology(spec: TopologySpec | str, hw: HardwareSpec) -> Topology:
    """Build (or fetch from the cache) the topology of ``spec`` on the hardware ``hw``.

    Built topologies are cached by (spec, hw) — both are frozen dataclasses — and their arrays are
    read-only, so sharing them is safe.

    Args:
        spec: A ``TopologySpec`` or a topology name of ``TOPOLOGIES``.
        hw: The hardware (grid shape, link bandwidth).

    Returns:
        The topology.

    Raises:
        ConfigError: Unknown topology name, or a fat-tree whose endpoint count differs from
            ``hw.num_nodes``.
    """
    if isinstance(spec, str):
        if spec not in TOPOLOGIES:
            raise unknown_name("topology", spec, TOPOLOGIES)
        spec = TopologySpec(kind=spec)
    if spec.kind not in TOPOLOGIES:
        raise unknown_name("topology", spec.kind, TOPOLOGIES)
    return _cached_build(spec, hw)
