"""Tests of hdamoe_env.noc.topology (paper-model.md §6.1, §3)."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.specs import HardwareSpec, TopologySpec
from hdamoe_env.noc.topology import (
    TOPOLOGIES,
    make_topology,
    stable_hash,
    stable_hash_array,
)

HW48 = HardwareSpec(mesh_shape=(4, 8), link_bw_gbps=50.0)


def cells(topo, route):
    """Vertex sequence of a route as grid cells."""
    if len(route) == 0:
        return []
    verts = [int(topo.link_src[route[0]])] + [int(topo.link_dst[x]) for x in route]
    return [tuple(int(v) for v in topo.endpoint_coords[v]) for v in verts]


def test_registry_and_unknown_name():
    assert set(TOPOLOGIES) == {"mesh", "torus", "fattree"}
    with pytest.raises(ConfigError, match="did you mean 'torus'"):
        make_topology("toruss", HW48)


def test_cache_and_readonly():
    a = make_topology("mesh", HW48)
    b = make_topology(TopologySpec(kind="mesh"), HW48)
    assert a is b
    with pytest.raises(ValueError):
        a.link_bw_Bps[0] = 1.0


# --- mesh (§6.1: row dimension first, unique route) ---------------------------------------


def test_mesh_links_and_diameter():
    topo = make_topology("mesh", HW48)
    assert topo.num_endpoints == 32 and topo.num_vertices == 32
    assert topo.num_links == 2 * (4 * 7 + 3 * 8)
    assert topo.diameter == 3 + 7
    assert topo.bw_end_Bps == 50e9
    assert np.all(topo.link_bw_Bps == 50e9)
    assert np.all(topo.num_candidates == 1)
    assert topo.endpoint_coords[topo.endpoint_id(2, 5)].tolist() == [2, 5]
    assert topo.endpoint_id(2, 5) == 2 * 8 + 5
    assert topo.vertex_labels[13] == ("ep", (1, 5))


def test_mesh_dimension_order():
    topo = make_topology("mesh", HW48)
    route = topo.route(0, topo.endpoint_id(3, 7))
    assert len(route) == 10
    assert cells(topo, route) == [(r, 0) for r in range(4)] + [(3, c) for c in range(1, 8)]
    small = make_topology("mesh", HardwareSpec(mesh_shape=(2, 2)))
    assert cells(small, small.route(3, 0)) == [(1, 1), (0, 1), (0, 0)]  # §14.8 item 4 (via (0,1))
    assert len(topo.route(5, 5)) == 0
    assert len(topo.candidates(5, 5)) == 1


def test_link_labels_are_cell_pairs_on_grids():
    topo = make_topology("mesh", HardwareSpec(mesh_shape=(2, 2)))
    link = topo.link_id(0, 1)
    assert topo.link_labels[link] == ((0, 0), (0, 1))
    with pytest.raises(ConfigError):
        topo.link_id(0, 3)


# --- torus --------------------------------------------------------------------------------


def test_torus_wrap_and_ties():
    topo = make_topology("torus", HW48)
    assert topo.num_links == 4 * 32
    assert topo.diameter == 4 // 2 + 8 // 2
    ep = topo.endpoint_id
    assert cells(topo, topo.route(0, ep(0, 7))) == [(0, 0), (0, 7)]          # wrap, 1 hop
    assert cells(topo, topo.route(0, ep(0, 4))) == [(0, c) for c in range(5)]  # tie -> +1
    assert cells(topo, topo.route(0, ep(0, 5))) == [(0, 0), (0, 7), (0, 6), (0, 5)]
    assert cells(topo, topo.route(0, ep(2, 0))) == [(0, 0), (1, 0), (2, 0)]    # tie -> +1
    assert cells(topo, topo.route(0, ep(3, 0))) == [(0, 0), (3, 0)]
    assert cells(topo, topo.route(ep(3, 6), ep(1, 1))) == [
        (3, 6), (0, 6), (1, 6), (1, 7), (1, 0), (1, 1)]                      # rows first


def test_torus_ring_of_two_has_no_duplicate_links():
    hw = HardwareSpec(mesh_shape=(2, 2))
    torus, mesh = make_topology("torus", hw), make_topology("mesh", hw)
    assert torus.num_links == mesh.num_links == 8
    pairs = set(zip(torus.link_src.tolist(), torus.link_dst.tolist(), strict=True))
    assert len(pairs) == 8
    assert len(torus.route(0, 1)) == 1


def test_torus_odd_ring():
    topo = make_topology("torus", HardwareSpec(mesh_shape=(3, 5)))
    assert topo.diameter == 1 + 2
    assert cells(topo, topo.route(0, 3)) == [(0, 0), (0, 4), (0, 3)]


# --- fat-tree ----------------------------------------------------------------------------


def test_fattree_structure_hops_candidates():
    topo = make_topology("fattree", HW48)
    assert topo.num_endpoints == 32
    assert topo.num_vertices == 32 + 16 + 8 + 4
    assert topo.num_links == 2 * 32 + 2 * 16 * 2 + 2 * 8 * 4
    assert topo.diameter == 6
    cand = topo.num_candidates
    assert cand[0, 1] == 1 and all(len(r) == 2 for r in topo.candidates(0, 1))   # same leaf
    assert cand[0, 2] == 2 and all(len(r) == 4 for r in topo.candidates(0, 2))   # same pod
    assert cand[0, 8] == 8 and all(len(r) == 6 for r in topo.candidates(0, 8))   # cross pod
    assert cand[0, 0] == 1 and len(topo.candidates(0, 0)[0]) == 0
    labels = topo.vertex_labels
    # cross-pod candidate (a, c): ... agg (p, a) -> core c -> agg (p', c mod A) ...
    for idx, route in enumerate(topo.candidates(0, 31)):
        a, c = divmod(idx, 4)
        verts = [labels[topo.link_dst[x]] for x in route]
        assert verts == [("leaf", 0, 0), ("agg", 0, a), ("core", c), ("agg", 3, c % 2),
                         ("leaf", 3, 3), ("ep", (3, 7))]
    for idx, route in enumerate(topo.candidates(0, 7)):
        verts = [labels[topo.link_dst[x]] for x in route]
        assert verts == [("leaf", 0, 0), ("agg", 0, idx), ("leaf", 0, 3), ("ep", (0, 7))]


def test_fattree_bandwidth_tiers():
    spec = TopologySpec(kind="fattree", bw_el_gbps=10.0, bw_la_gbps=20.0, bw_ac_gbps=40.0,
                        oversubscription=2.0)
    topo = make_topology(spec, HW48)
    assert topo.bw_end_Bps == 10e9
    for link in range(topo.num_links):
        kinds = {topo.vertex_labels[topo.link_src[link]][0],
                 topo.vertex_labels[topo.link_dst[link]][0]}
        expected = {frozenset({"ep", "leaf"}): 10e9, frozenset({"leaf", "agg"}): 20e9,
                    frozenset({"agg", "core"}): 20e9}[frozenset(kinds)]
        assert topo.link_bw_Bps[link] == expected
    default = make_topology("fattree", HW48)
    assert np.all(default.link_bw_Bps == 50e9)


def test_fattree_requires_matching_node_count():
    with pytest.raises(ConfigError, match=r"32 endpoints.*16 nodes"):
        make_topology("fattree", HardwareSpec(mesh_shape=(4, 4)))


# --- route choice and the stable hash ------------------------------------------------------


def test_stable_hash_pinned_and_vectorised():
    assert stable_hash(7) == 7 and stable_hash(-3) == -3
    assert stable_hash((1, 2, 3)) == 15020427595393229491  # splitmix64 fold, pinned
    assert stable_hash(()) == 0
    rng = np.random.default_rng(0)
    keys = rng.integers(-(2**40), 2**40, size=(50, 4))
    vec = stable_hash_array(keys)
    assert vec.dtype == np.uint64
    assert [int(v) for v in vec] == [stable_hash(tuple(int(x) for x in row)) for row in keys]


def test_route_choice_by_flow_key():
    topo = make_topology("fattree", HW48)
    cands = topo.candidates(0, 31)
    for key in range(20):
        assert np.array_equal(topo.route(0, 31, key), cands[key % 8])
    key = (3, 17, 0, 1)
    assert np.array_equal(topo.route(0, 31, key), cands[stable_hash(key) % 8])
    rng = np.random.default_rng(1)
    src = rng.integers(0, 32, 200)
    dst = rng.integers(0, 32, 200)
    ikeys = rng.integers(0, 1000, 200)
    tkeys = rng.integers(0, 1000, (200, 4))
    r_int = topo.select_routes(src, dst, ikeys)
    r_tup = topo.select_routes(src, dst, tkeys)
    r_none = topo.select_routes(src, dst)
    for m in range(200):
        s, d = int(src[m]), int(dst[m])
        assert np.array_equal(topo.route_of(r_int[m]), topo.route(s, d, int(ikeys[m])))
        assert np.array_equal(topo.route_of(r_tup[m]), topo.route(s, d, tuple(tkeys[m])))
        assert np.array_equal(topo.route_of(r_none[m]), topo.route(s, d))
    with pytest.raises(ConfigError):
        topo.select_routes([0, 40], [1, 2])
    with pytest.raises(ConfigError):
        topo.select_routes([0, 1], [1, 2], np.zeros((3, 2), dtype=np.int64))


@pytest.mark.parametrize("kind,shape", [("mesh", (2, 3)), ("torus", (3, 3)),
                                        ("fattree", (4, 8))])
def test_route_lex_rank_matches_label_lists(kind, shape):
    topo = make_topology(kind, HardwareSpec(mesh_shape=shape))
    rng = np.random.default_rng(2)
    ids = rng.integers(0, topo.num_routes, size=(300, 2))
    for a, b in ids:
        la = [topo.link_labels[x] for x in topo.route_of(a)]
        lb = [topo.link_labels[x] for x in topo.route_of(b)]
        ra, rb = topo.route_lex_rank[a], topo.route_lex_rank[b]
        assert (la < lb) == (ra < rb) and (la == lb) == (ra == rb)
