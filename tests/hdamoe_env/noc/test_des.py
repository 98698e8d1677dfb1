"""Tests of hdamoe_env.noc.des: the discrete-event message simulator (paper-model.md §6.3) —
hand-calculated makespans and link busy times (§14.8 items 1–3), the compiled kernel against the
pure-Python oracle, tie rules, the link-load lower bound and input validation.
"""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.specs import HardwareSpec, TopologySpec
from hdamoe_env.noc.des import (link_load_bound, port_routes, prepare_run, simulate_messages,
                                simulate_messages_oracle, simulate_runs)
from hdamoe_env.noc.topology import make_topology

HW48 = HardwareSpec(mesh_shape=(4, 8), link_bw_gbps=50.0)
HW22 = HardwareSpec(mesh_shape=(2, 2), link_bw_gbps=1.0)  # 1 byte per ns


def mesh22():
    return make_topology("mesh", HW22)


def busy_of(topo, result, a, b):
    return result.link_busy_s[topo.link_id(a, b)]


def assert_same(a, b):
    assert a.makespan_s == b.makespan_s
    assert np.array_equal(a.link_busy_s, b.link_busy_s)
    assert np.array_equal(a.finish_s, b.finish_s)


# --- §14.8 items 1–3 and other hand calculations ----------------------------------------


def test_single_flow_4x8():  # §14.8 item 1
    topo = make_topology("mesh", HW48)
    res = simulate_messages(topo, [0], [31], [2048.0])
    assert res.makespan_s == pytest.approx(409.6e-9, rel=1e-12)
    assert np.count_nonzero(res.link_busy_s) == 10
    assert_same(res, simulate_messages_oracle(topo, [0], [31], [2048.0]))


def test_three_flows_2x2():  # §14.8 item 2
    topo = mesh22()
    for tie in ("fifo", "ref"):
        res = simulate_messages(topo, [0, 1, 2], [3, 3, 3], [1000.0] * 3, tie_break=tie)
        assert res.makespan_s == pytest.approx(2e-6, rel=1e-12)
        assert busy_of(topo, res, 0, 2) == pytest.approx(1e-6)
        assert busy_of(topo, res, 2, 3) == pytest.approx(2e-6)
        assert busy_of(topo, res, 1, 3) == pytest.approx(1e-6)
        assert res.link_busy_s.sum() == pytest.approx(4e-6)


def test_opposite_directions_do_not_interfere():  # §14.8 item 3
    res = simulate_messages(mesh22(), [0, 1], [1, 0], [1000.0, 1000.0])
    assert res.makespan_s == pytest.approx(1e-6, rel=1e-12)


def test_two_flow_contention_mesh():
    # (0,0)->(0,1) and (1,0)->(0,1) via (0,0): second waits for the first on link (0,0)->(0,1)
    topo = mesh22()
    res = simulate_messages(topo, [0, 2], [1, 1], [1000.0, 500.0])
    assert res.finish_s.tolist() == pytest.approx([1e-6, 1.5e-6])
    assert busy_of(topo, res, 0, 1) == pytest.approx(1.5e-6)


def test_torus_wrap_flow_and_contention():
    topo = make_topology("torus", HW48)
    hop = 2048.0 / 50e9
    res = simulate_messages(topo, [0], [7], [2048.0])        # wrap-around, one hop
    assert res.makespan_s == pytest.approx(hop, rel=1e-12)
    # (0,6)->(0,0) (2 hops via (0,7)) and (0,7)->(0,0) share the wrap link (0,7)->(0,0)
    res = simulate_messages(topo, [6, 7], [0, 0], [2048.0, 2048.0])
    assert res.finish_s.tolist() == pytest.approx([2 * hop, hop])
    assert res.link_busy_s[topo.link_id(7, 0)] == pytest.approx(2 * hop)


def test_fattree_flows_and_tiers():
    spec = TopologySpec(kind="fattree", bw_el_gbps=10.0, bw_la_gbps=20.0, bw_ac_gbps=40.0,
                        oversubscription=2.0)
    topo = make_topology(spec, HW48)
    s = 1000.0
    res = simulate_messages(topo, [0], [31], [s])
    assert res.makespan_s == pytest.approx(2 * s / 10e9 + 2 * s / 20e9 + 2 * s / 20e9)
    res = simulate_messages(topo, [0], [1], [s])                         # same leaf
    assert res.makespan_s == pytest.approx(2 * s / 10e9)
    # same pod, keys 0 and 1 pick aggs 0 and 1; both end on leaf (0,1) -> endpoint 2
    flat = make_topology("fattree", HW48)
    d = s / 50e9
    res = simulate_messages(flat, [0, 1], [2, 2], [s, s], flow_keys=[0, 1])
    assert res.finish_s.tolist() == pytest.approx([4 * d, 5 * d])
    assert res.link_busy_s[flat.link_id(flat.num_endpoints + 1, 2)] == pytest.approx(2 * d)


def test_empty_route_chunks_and_hop_latency():
    topo = make_topology("mesh", HW48)
    res = simulate_messages(topo, [3, 0], [3, 1], [100.0, 0.0], ready_s=[5e-6, 1e-6])
    assert res.finish_s.tolist() == [5e-6, 1e-6] and res.makespan_s == 5e-6
    empty = simulate_messages(topo, [], [], [])
    assert empty.makespan_s == 0.0 and empty.finish_s.shape == (0,)
    # 4 chunks pipelined over 3 hops: (3 + 4 - 1) * (S/4)/BW
    res = simulate_messages(topo, [0], [3], [4096.0], chunks=4)
    assert res.makespan_s == pytest.approx(6 * 1024 / 50e9, rel=1e-12)
    assert res.finish_s.shape == (1,)
    res = simulate_messages(topo, [0], [31], [2048.0], hop_latency_s=1e-9)
    assert res.makespan_s == pytest.approx(10 * (2048 / 50e9 + 1e-9), rel=1e-12)


# --- cut-through switching ------------------------------------------------------------------

HW14 = HardwareSpec(mesh_shape=(1, 4), link_bw_gbps=1.0)  # a line 0-1-2-3, 1 byte per ns


def test_cut_through_three_messages_by_hand():
    # A: 0->3, 1000 B at 0; B: 1->3, 500 B at 0; C: 2->3, 200 B at 600 ns; hop latency 10 ns.
    # Cut-through (times in ns, fifo): A takes 0->1 over [0, 1000], its head reaches router 1 at
    # 10; B takes 1->2 over [0, 500], head at router 2 at 10. At t = 10 A's head waits for 1->2
    # until 500: [500, max(500 + 1000, 1000 + 10)] = [500, 1500], head at router 2 at 510;
    # B's head takes 2->3 at once: [10, max(10 + 500, 500 + 10)] = [10, 510], B done at 520.
    # At 510 A takes 2->3: [510, max(510 + 1000, 1500 + 10)] = [510, 1510], A done at 1520.
    # C, ready at 600, waits for 2->3 until 1510: [1510, 1710], done at 1720.
    topo = make_topology("mesh", HW14)
    args = (topo, [0, 1, 2], [3, 3, 3], [1000.0, 500.0, 200.0], [0.0, 0.0, 600e-9])
    kw = {"hop_latency_s": 10e-9, "switching": "cut_through"}
    res = simulate_messages(*args, **kw)
    assert res.finish_s.tolist() == pytest.approx([1520e-9, 520e-9, 1720e-9], rel=1e-12)
    assert res.makespan_s == pytest.approx(1720e-9, rel=1e-12)
    assert busy_of(topo, res, 0, 1) == pytest.approx(1000e-9)
    assert busy_of(topo, res, 1, 2) == pytest.approx(1500e-9)   # 500 (B) + 1000 (A)
    assert busy_of(topo, res, 2, 3) == pytest.approx(1700e-9)   # 500 (B) + 1000 (A) + 200 (C)
    assert_same(res, simulate_messages_oracle(*args, **kw))
    # store-and-forward on the same messages: A 0->1 [0, 1000] (+10); B 1->2 [0, 500], 2->3
    # [510, 1010], done 1020; C 2->3 [1010, 1210], done 1220; A 1->2 [1010, 2010], 2->3
    # [2020, 3020], done 3030
    saf = simulate_messages(*args, hop_latency_s=10e-9)
    assert saf.finish_s.tolist() == pytest.approx([3030e-9, 1020e-9, 1220e-9], rel=1e-12)


def test_cut_through_idle_path_and_slow_upstream():
    # idle 4x8 mesh, 10 hops: H * latency + S / BW instead of H * (latency + S / BW)
    topo = make_topology("mesh", HW48)
    res = simulate_messages(topo, [0], [31], [2048.0], hop_latency_s=1e-9,
                            switching="cut_through")
    assert res.makespan_s == pytest.approx(10e-9 + 2048 / 50e9, rel=1e-12)
    # fat-tree with slow endpoint links: the tail is paced by the slowest (first) link, so a
    # 4-hop route finishes at S / BW_el + 4 * latency; every hop starts one latency after the
    # previous one and ends one latency after it, so every link (fast ones too) is busy S / BW_el
    spec = TopologySpec(kind="fattree", bw_el_gbps=10.0, bw_la_gbps=40.0, bw_ac_gbps=40.0)
    ft = make_topology(spec, HW48)
    s, lat = 1000.0, 1e-9
    res = simulate_messages(ft, [0], [2], [s], hop_latency_s=lat, switching="cut_through")
    assert res.makespan_s == pytest.approx(s / 10e9 + 4 * lat, rel=1e-12)
    assert res.link_busy_s.max() == pytest.approx(s / 10e9, rel=1e-12)
    assert_same(res, simulate_messages_oracle(ft, [0], [2], [s], hop_latency_s=lat,
                                              switching="cut_through"))


def test_cut_through_never_slower_on_one_message_and_rejects_unknown():
    topo = make_topology("torus", HW48)
    for d in range(1, 32):
        ct = simulate_messages(topo, [0], [d], [4096.0], hop_latency_s=2e-9,
                               switching="cut_through").makespan_s
        saf = simulate_messages(topo, [0], [d], [4096.0], hop_latency_s=2e-9).makespan_s
        assert ct <= saf
        assert (ct < saf) == (topo.route(0, d).size > 1)
    with pytest.raises(ConfigError, match="switching"):
        simulate_messages(topo, [0], [1], [1.0], switching="wormhole")
    with pytest.raises(ConfigError, match="switching"):
        simulate_messages_oracle(topo, [0], [1], [1.0], switching="wormhole")


def test_network_interface_ports():
    # endpoint 9 of the 4x8 mesh sends 1000 B to both row neighbours (different links):
    # without ports both take 20 ns; with 50 GB/s ports they share the injection port
    topo = make_topology("mesh", HW48)
    args = (topo, [9, 9], [10, 8], [1000.0, 1000.0])
    d = 1000 / 50e9
    assert simulate_messages(*args).finish_s.tolist() == pytest.approx([d, d])
    # cut-through: injection [0, d] then [d, 2d]; link and ejection follow the head at once
    ct = simulate_messages(*args, switching="cut_through", ni_bw_Bps=50e9)
    assert ct.finish_s.tolist() == pytest.approx([d, 2 * d], rel=1e-12)
    # store-and-forward: three serialisations; the second waits d for the port
    saf = simulate_messages(*args, ni_bw_Bps=50e9)
    assert saf.finish_s.tolist() == pytest.approx([3 * d, 4 * d], rel=1e-12)
    assert saf.link_busy_s.shape == (topo.num_links,)
    assert saf.link_busy_s.sum() == pytest.approx(2 * d)     # ports are not links
    # idle path: 10 links + 2 ports, each paying the hop latency once under cut-through
    one = simulate_messages(topo, [0], [31], [2048.0], hop_latency_s=1e-9,
                            switching="cut_through", ni_bw_Bps=50e9)
    assert one.makespan_s == pytest.approx(12e-9 + 2048 / 50e9, rel=1e-12)
    with pytest.raises(ConfigError, match="ni_bw_Bps"):
        simulate_messages(*args, ni_bw_Bps=0.0)


def test_network_interface_port_latency_hand_worked():
    """Ports with their own latency (BookSim's 3 + 3 cycles around 4-cycle hops).

    0 -> 31 on the 4x8 mesh: 10 links of hop 4 ns and two ports of 3 ns, 2048 B at 50 GB/s
    (40.96 ns). Cut-through: 2·3 + 10·4 + 40.96 = 86.96 ns. Store-and-forward: every one of the
    12 traversals serialises, 12·40.96 + 2·3 + 10·4 = 537.52 ns.
    """
    topo = make_topology("mesh", HW48)
    kw = dict(hop_latency_s=4e-9, ni_bw_Bps=50e9, ni_latency_s=3e-9)
    for switching, want in (("cut_through", 86.96e-9), ("store_and_forward", 537.52e-9)):
        res = simulate_messages(topo, [0], [31], [2048.0], switching=switching, **kw)
        assert res.makespan_s == pytest.approx(want, rel=1e-12), switching
        assert_same(res, simulate_messages_oracle(topo, [0], [31], [2048.0],
                                                  switching=switching, **kw))
    # two messages from node 9 to both row neighbours, 1000 B (20 ns), cut-through: the second
    # waits for the injection port (busy [0, 20]) and its tail leaves it at 40 ns; each then
    # crosses one link and the ejection port: 20 + 3 + 4 + 3 = 30 ns and 40 + 3 + 4 + 3 = 50 ns
    two = simulate_messages(topo, [9, 9], [10, 8], [1000.0, 1000.0], switching="cut_through",
                            **kw)
    assert two.finish_s.tolist() == pytest.approx([30e-9, 50e-9], rel=1e-12)
    # None = the hop latency; without ports the port latency changes nothing
    base = simulate_messages(topo, [0], [31], [2048.0], hop_latency_s=4e-9, ni_bw_Bps=50e9,
                             switching="cut_through")
    assert base.makespan_s == pytest.approx(48e-9 + 40.96e-9, rel=1e-12)
    assert simulate_messages(topo, [0], [31], [2048.0], hop_latency_s=4e-9,
                             ni_latency_s=3e-9).makespan_s == simulate_messages(
        topo, [0], [31], [2048.0], hop_latency_s=4e-9).makespan_s
    for bad in (-1e-9, float("inf")):
        with pytest.raises(ConfigError, match="ni_latency_s"):
            simulate_messages(topo, [0], [31], [2048.0], ni_bw_Bps=50e9, ni_latency_s=bad)
        with pytest.raises(ConfigError, match="ni_latency_s"):
            simulate_messages_oracle(topo, [0], [31], [2048.0], ni_bw_Bps=50e9,
                                     ni_latency_s=bad)


def test_cut_through_kernel_equals_oracle_random():
    rng = np.random.default_rng(27)
    for kind, shape in ORACLE_TOPOLOGIES:
        topo = make_topology(kind, HardwareSpec(mesh_shape=shape, link_bw_gbps=50.0))
        for i in range(16):
            src, dst, size, kwargs = random_case(rng, topo)
            kwargs["switching"] = "cut_through" if i % 4 else "store_and_forward"
            if i % 2:
                kwargs["ni_bw_Bps"] = 50e9
                if i % 3:  # ports with a latency of their own (0 included)
                    kwargs["ni_latency_s"] = float(rng.choice([0.0, 0.75e-9, 2.5e-9]))
            assert_same(simulate_messages(topo, src, dst, size, **kwargs),
                        simulate_messages_oracle(topo, src, dst, size, **kwargs))


# --- kernel == oracle ----------------------------------------------------------------------

ORACLE_TOPOLOGIES = [("mesh", (2, 2)), ("mesh", (4, 4)), ("mesh", (4, 8)), ("torus", (4, 4)),
                     ("torus", (2, 4)), ("torus", (3, 5)), ("fattree", (4, 8))]


def random_case(rng, topo):
    n = topo.num_endpoints
    m = int(rng.integers(1, 40))
    src = rng.integers(0, n, m)
    dst = rng.integers(0, n, m)
    size = rng.choice([256.0, 512.0, 1000.0, 4096.0, 0.0], m, p=[0.3, 0.3, 0.2, 0.15, 0.05])
    kwargs = {"tie_break": str(rng.choice(["fifo", "ref"]))}
    if rng.random() < 0.5:
        kwargs["ready_s"] = rng.choice([0.0, 1e-8, 2.048e-8, 5e-8], m)
    if rng.random() < 0.3:
        kwargs["hop_latency_s"] = float(rng.choice([1e-9, 3.3e-9]))
    if rng.random() < 0.3:
        kwargs["chunks"] = int(rng.integers(2, 4))
    choice = rng.integers(0, 3)
    if choice == 1:
        kwargs["flow_keys"] = rng.integers(0, 50, m)
    elif choice == 2:
        kwargs["flow_keys"] = rng.integers(0, 50, (m, 3))
    return src, dst, size, kwargs


def test_kernel_equals_oracle_random():
    rng = np.random.default_rng(2024)
    cases = 0
    for kind, shape in ORACLE_TOPOLOGIES:
        topo = make_topology(kind, HardwareSpec(mesh_shape=shape, link_bw_gbps=50.0))
        for _ in range(32):
            src, dst, size, kwargs = random_case(rng, topo)
            fast = simulate_messages(topo, src, dst, size, **kwargs)
            slow = simulate_messages_oracle(topo, src, dst, size, **kwargs)
            assert_same(fast, slow)
            cases += 1
    assert cases >= 200


def test_tie_rules():
    topo = mesh22()
    # same route, both ready at 0: fifo keeps insertion order, ref serves the smaller first
    args = ([0, 0], [1, 1], [1000.0, 200.0])
    fifo = simulate_messages(topo, *args, tie_break="fifo")
    ref = simulate_messages(topo, *args, tie_break="ref")
    assert fifo.finish_s.tolist() == pytest.approx([1.0e-6, 1.2e-6])
    assert ref.finish_s.tolist() == pytest.approx([1.2e-6, 0.2e-6])
    # equal sizes meeting on link (1,0)->(1,1) at t = 1 us: A = (0,0)->(1,1) was pushed there
    # after B = (1,0)->(1,1) (initial event), but A's route is lexicographically smaller
    args = ([0, 2], [3, 3], [1000.0, 1000.0])
    ready = [0.0, 1e-6]
    fifo = simulate_messages(topo, *args, ready, tie_break="fifo")
    ref = simulate_messages(topo, *args, ready, tie_break="ref")
    assert fifo.finish_s.tolist() == pytest.approx([3e-6, 2e-6])
    assert ref.finish_s.tolist() == pytest.approx([2e-6, 3e-6])
    for tie in ("fifo", "ref"):
        assert_same(simulate_messages(topo, *args, ready, tie_break=tie),
                    simulate_messages_oracle(topo, *args, ready, tie_break=tie))


def test_makespan_at_least_link_load_bound():
    rng = np.random.default_rng(7)
    for kind, shape in ORACLE_TOPOLOGIES:
        topo = make_topology(kind, HardwareSpec(mesh_shape=shape))
        for _ in range(8):
            m = int(rng.integers(1, 300))
            src, dst = rng.integers(0, topo.num_endpoints, (2, m))
            size = rng.uniform(0, 5000, m)
            keys = rng.integers(0, 100, (m, 2))
            bound = link_load_bound(topo, src, dst, size, flow_keys=keys)
            res = simulate_messages(topo, src, dst, size, flow_keys=keys)
            assert res.makespan_s >= bound * (1 - 1e-12)
            assert res.link_busy_s.max() <= bound * (1 + 1e-12)
    assert link_load_bound(mesh22(), [1], [1], [5.0]) == 0.0


# --- input validation ----------------------------------------------------------------------


def test_message_validation():
    topo = mesh22()
    with pytest.raises(ConfigError, match="equal lengths"):
        simulate_messages(topo, [0, 1], [1], [1.0, 1.0])
    with pytest.raises(ConfigError, match=r"dst\[1\]=4"):
        simulate_messages(topo, [0, 1], [1, 4], [1.0, 1.0])
    with pytest.raises(ConfigError, match="size_bytes"):
        simulate_messages(topo, [0], [1], [-1.0])
    with pytest.raises(ConfigError, match="'lifo'"):
        simulate_messages(topo, [0], [1], [1.0], tie_break="lifo")
    with pytest.raises(ConfigError, match="ready_s"):
        simulate_messages(topo, [0], [1], [1.0], ready_s=[-1.0])
    with pytest.raises(ConfigError, match="hop_latency_s"):
        simulate_messages_oracle(topo, [0], [1], [1.0], hop_latency_s=-1.0)
    with pytest.raises(ConfigError, match="chunks"):
        simulate_messages(topo, [0], [1], [1.0], chunks=0)
    with pytest.raises(ConfigError, match="flow_keys"):
        simulate_messages(topo, [0], [1], [1.0], flow_keys=[1, 2])


def test_port_routes_wrap_every_route_in_its_ports():
    """``port_routes``: route r of the pair (s, d) is [L + s, its links..., L + N + d]; an
    empty route stays empty; built once per topology."""
    for kind, shape in (("mesh", (4, 8)), ("fattree", (4, 8)), ("torus", (3, 5))):
        topo = make_topology(kind, HardwareSpec(mesh_shape=shape, link_bw_gbps=50.0))
        ptr, links = port_routes(topo)
        assert port_routes(topo)[0] is ptr
        L, n = topo.num_links, topo.num_endpoints
        for s in range(n):
            for d in range(n):
                pair = s * n + d
                for r in range(topo.pair_route_ptr[pair], topo.pair_route_ptr[pair + 1]):
                    inner = topo.route_links[topo.route_ptr[r]:topo.route_ptr[r + 1]].tolist()
                    want = [L + s, *inner, L + n + d] if inner else []
                    assert links[ptr[r]:ptr[r + 1]].tolist() == want


def test_simulate_runs_equal_simulate_messages_and_check_their_options():
    """``prepare_run`` + ``simulate_runs`` (serial and prange kernels) give every run's makespan
    and busy time of ``simulate_messages``; runs with other options are a ConfigError."""
    rng = np.random.default_rng(12)
    for kind, shape in (("mesh", (4, 8)), ("fattree", (4, 8))):
        topo = make_topology(kind, HardwareSpec(mesh_shape=shape, link_bw_gbps=50.0))
        for kwargs in (dict(tie_break="ref", hop_latency_s=1e-9),
                       dict(switching="cut_through", ni_bw_Bps=50e9, ni_latency_s=2e-9)):
            cases = [random_case(rng, topo)[:3] for _ in range(5)]
            runs = [prepare_run(topo, *case, **kwargs) for case in cases]
            for parallel in (False, True):
                makespan, busy = simulate_runs(topo, runs, parallel=parallel)
                for j, case in enumerate(cases):
                    want = simulate_messages(topo, *case, **kwargs)
                    assert makespan[j] == want.makespan_s
                    np.testing.assert_array_equal(busy[j], want.link_busy_s)
    other = prepare_run(topo, *cases[0], tie_break="fifo")
    with pytest.raises(ConfigError, match="share one topology"):
        simulate_runs(topo, [runs[0], other])
