"""Tests of hdamoe_env.noc.linksim, hdamoe_env.noc.des and hdamoe_env.noc.collectives (paper-model.md §6.2–6.3,
§5.6, §14.8)."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.noc import linksim
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.noc.collectives import default_ring, ring_allreduce_des
from hdamoe_env.noc.des import link_load_bound, simulate_messages, simulate_messages_oracle
from hdamoe_env.noc.linksim import (
    HolderTable,
    choose_aggregators,
    layer_flow_keys,
    layer_messages,
    simulate_layer_comm,
)
from hdamoe_env.config.specs import HardwareSpec, TopologySpec
from hdamoe_env.noc.topology import make_topology, stable_hash
from hdamoe_env.sim.placement import expert_parallel

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


# --- ring all-reduce (§5.6) --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mesh", "torus"])
def test_ring_allreduce_closed_form(kind):
    topo = make_topology(kind, HW48)
    ring = default_ring(topo)
    assert sorted(ring.tolist()) == list(range(32))
    nxt = np.roll(ring, -1)
    assert all(len(topo.route(int(a), int(b))) == 1 for a, b in zip(ring, nxt, strict=True))
    size = 128 * 2048 * 2.0
    closed = 2 * 31 / 32 * size / 50e9
    assert ring_allreduce_des(topo, size) == pytest.approx(closed, rel=1e-9)
    lat = ring_allreduce_des(topo, size, hop_latency_s=5e-9, chunks=2)
    assert lat >= closed


@pytest.mark.parametrize("kind,shape", [("mesh", (3, 4)), ("mesh", (2, 5)), ("torus", (3, 5)),
                                        ("torus", (5, 3)), ("torus", (1, 5)), ("mesh", (4, 1))])
def test_default_ring_is_one_hop_cycle(kind, shape):
    topo = make_topology(kind, HardwareSpec(mesh_shape=shape))
    ring = default_ring(topo)
    assert sorted(ring.tolist()) == list(range(topo.num_endpoints))
    nxt = np.roll(ring, -1)
    hops = [len(topo.route(int(a), int(b))) for a, b in zip(ring, nxt, strict=True)]
    if shape == (4, 1):   # a mesh line has no Hamiltonian cycle: only the closing step is long
        assert hops == [1, 1, 1, 3]
    else:
        assert hops == [1] * topo.num_endpoints


def test_ring_fattree():
    fat = make_topology("fattree", HW48)
    assert default_ring(fat).tolist() == list(range(32))
    size = 1e6
    assert ring_allreduce_des(fat, size) >= 2 * 31 / 32 * size / 50e9
    assert ring_allreduce_des(fat, size, ring=[5]) == 0.0
    with pytest.raises(ConfigError):
        ring_allreduce_des(fat, size, ring=[1, 1])


# --- task generation (§6.2) and §14.8 item 4 ---------------------------------------------


STATIC_SETS = np.array([[0, 1], [2, 3], [0, 3]])
STATIC_F = np.array([0.5, 0.3, 0.2])


@pytest.mark.parametrize("b_msg,combine_ns,dispatch_ns", [(1, 700.0, None), (2, 1400.0, 1000.0)])
def test_static_task_set_2x2(b_msg, combine_ns, dispatch_ns):  # §14.8 item 4
    topo = mesh22()
    holders = np.eye(4, dtype=bool)
    pi = np.arange(4)
    agg = choose_aggregators(STATIC_SETS, holders, "first", np.random.default_rng(0))
    assert agg.tolist() == [0, 2, 0]
    msg = STATIC_F * 10 * 100 * b_msg
    src, dst, size, task = layer_messages(STATIC_SETS, msg, holders, agg, pi)
    assert src.tolist() == [1, 3, 3] and dst.tolist() == [0, 2, 0]
    assert size.tolist() == pytest.approx([500.0 * b_msg, 300.0 * b_msg, 200.0 * b_msg])
    assert task.tolist() == [0, 1, 2]
    comm = simulate_layer_comm(topo, STATIC_SETS, msg, holders, pi, agg)
    assert comm.combine_s == pytest.approx(combine_ns * 1e-9, rel=1e-12)
    if dispatch_ns is not None:
        assert comm.dispatch_s == pytest.approx(dispatch_ns * 1e-9, rel=1e-12)
    assert comm.num_messages == (3, 3)
    assert comm.link_busy_s.shape == (2, topo.num_links)
    # byte-hops per phase: 500 + 300 + 2 * 200 = 1200 (times b_msg), 1 byte per ns
    assert comm.link_busy_total_s.sum() == pytest.approx(2 * 1200 * b_msg * 1e-9)
    assert comm.total_s == comm.dispatch_s + comm.combine_s
    only = simulate_layer_comm(topo, STATIC_SETS, msg, holders, pi, agg, phases=("combine",))
    assert only.combine_s == comm.combine_s
    # α–β start-up (docs/PHYSICS.md): every message ready at α = the same run shifted by α
    shifted = simulate_layer_comm(topo, STATIC_SETS, msg, holders, pi, agg, alpha_s=1e-7)
    assert shifted.combine_s == pytest.approx(comm.combine_s + 1e-7, rel=1e-12)
    assert shifted.dispatch_s == pytest.approx(comm.dispatch_s + 1e-7, rel=1e-12)
    assert np.array_equal(shifted.link_busy_s, comm.link_busy_s)
    ready = simulate_messages(topo, src, dst, size, ready_s=np.full(3, 1e-7))
    assert shifted.combine_s == pytest.approx(ready.makespan_s, rel=1e-12)
    with pytest.raises(ConfigError, match="dispatch"):
        _ = only.dispatch_s


def test_layer_comm_equals_message_path_and_oracle():
    rng = np.random.default_rng(11)
    for kind in ("mesh", "torus", "fattree"):
        topo = make_topology(kind, HW48)
        for trial in range(4):
            e, k, t = 16, 3, 12
            holders = rng.random((e, 32)) < 0.08
            holders[np.arange(e), rng.integers(0, 32, e)] = True
            sets = np.array([rng.choice(e, k, replace=False) for _ in range(t)])
            pi = rng.permutation(32)
            agg = choose_aggregators(sets, holders, "uniform", rng)
            extra = rng.integers(-1, 32, (t, 2)) if trial % 2 else None
            msg = rng.choice([512.0, 1024.0], t)
            chunks = 1 + trial // 2
            tie = "ref" if trial % 2 else "fifo"
            comm = simulate_layer_comm(topo, sets, msg, holders, pi, agg, tie_break=tie,
                                       layer=3, extra_holders=extra, chunks=chunks,
                                       hop_latency_s=1e-9 * trial)
            for p, direction in enumerate(("dispatch", "combine")):
                src, dst, size, task = layer_messages(sets, msg, holders, agg, pi, extra,
                                                      direction=direction)
                keys = layer_flow_keys(3, task, src, chunks)
                kw = dict(tie_break=tie, flow_keys=keys, chunks=chunks,
                          hop_latency_s=1e-9 * trial)
                fast = simulate_messages(topo, src, dst, size, **kw)
                assert comm.makespan_s[p] == fast.makespan_s
                assert np.array_equal(comm.link_busy_s[p], fast.link_busy_s)
                assert comm.num_messages[p] == src.size * chunks
                assert_same(fast, simulate_messages_oracle(topo, src, dst, size, **kw))


def test_numba_flow_hash_matches_stable_hash():
    rng = np.random.default_rng(5)
    for a, b, c, d in rng.integers(0, 2**31, (50, 4)):
        assert int(linksim._flow_hash4(a, b, c, d)) == stable_hash((a, b, c, d))


def test_aggregator_rules():
    rng = np.random.default_rng(3)
    holders = np.zeros((4, 4), dtype=bool)
    holders[0, [1, 3]] = True          # expert 0 TP-split over clusters 1 and 3
    holders[1, 2] = True
    holders[3, 0] = True               # expert 2 has no holder
    sets = np.tile([2, 0, 1], (400, 1))
    first = choose_aggregators(sets, holders, "first", rng)
    assert np.all(first == 1)          # smallest held expert 0 -> lowest holder 1
    ref = choose_aggregators(sets, holders, "ref", rng)
    assert set(ref.tolist()) == {1, 2}  # expert 2 is re-drawn; lowest holders only
    uni = choose_aggregators(sets, holders, "uniform", rng)
    assert set(uni.tolist()) == {1, 2, 3}
    assert 0.2 < np.mean(uni == 2) < 0.8
    with pytest.raises(ConfigError, match="token 1"):
        choose_aggregators(np.array([[0, 1], [2, 2]]), holders, "ref", rng)
    with pytest.raises(ConfigError, match="did you mean 'uniform'"):
        choose_aggregators(sets, holders, "unifrom", rng)


def test_determinism_same_seed():
    topo = make_topology("fattree", HW48)
    holders = np.zeros((64, 32), dtype=bool)
    holders[np.arange(64), np.arange(64) // 2] = True

    def run(seed):
        rng = np.random.default_rng(seed)
        sets = np.array([rng.choice(64, 6, replace=False) for _ in range(32)])
        agg = choose_aggregators(sets, holders, "uniform", rng)
        pi = rng.permutation(32)
        return agg, simulate_layer_comm(topo, sets, 4096.0, holders, pi, agg, layer=2)

    (a1, c1), (a2, c2), (a3, _c3) = run(9), run(9), run(10)
    assert np.array_equal(a1, a2) and c1.makespan_s == c2.makespan_s
    assert np.array_equal(c1.link_busy_s, c2.link_busy_s)
    assert not np.array_equal(a1, a3)


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


def test_layer_validation():
    topo = mesh22()
    holders = np.eye(4, dtype=bool)
    agg = np.array([0, 2, 0])
    ok = (topo, STATIC_SETS, 100.0, holders, np.arange(4), agg)
    with pytest.raises(ConfigError, match="phase"):
        simulate_layer_comm(*ok, phases=("combine", "shuffle"))
    with pytest.raises(ConfigError, match="permutation"):
        simulate_layer_comm(topo, STATIC_SETS, 100.0, holders, [0, 0, 1, 2], agg)
    with pytest.raises(ConfigError, match="expert ids"):
        simulate_layer_comm(topo, STATIC_SETS + 4, 100.0, holders, np.arange(4), agg)
    with pytest.raises(ConfigError, match="endpoints"):
        simulate_layer_comm(make_topology("mesh", HW48), *ok[1:])
    with pytest.raises(ConfigError, match="extra_holders"):
        simulate_layer_comm(*ok, extra_holders=np.full((3, 1), 9))
    with pytest.raises(ConfigError, match="agg"):
        simulate_layer_comm(topo, STATIC_SETS, 100.0, holders, np.arange(4), [0, 1])
    with pytest.raises(ConfigError, match="'ferr'"):
        simulate_layer_comm(*ok, tie_break="ferr")


def test_replica_messages_go_to_the_chosen_copy_only():
    """2x2 mesh, expert i wholly on node i, expert 0 replicated on node 2; tokens (0, 3).

    ``nearest`` puts expert 0 of both tokens on the replica (node 2 is 1 hop from the anchor,
    node 3; the primary, node 0, is 2 hops). The replicated row is zeroed, so the aggregator is
    expert 3's holder, node 3, and the only combine message per token is 2 -> 3 (dispatch: 3 ->
    2); the primary node 0 sends and receives nothing.
    """
    from hdamoe_env.decisions.dispatch import dispatch_replicas

    topo = make_topology(TopologySpec(kind="mesh"), HardwareSpec(mesh_shape=(2, 2)))
    reps = np.zeros((4, 4), dtype=bool)
    reps[0, 2] = True
    sets = np.array([[0, 3], [0, 3]])
    d = dispatch_replicas(sets, np.eye(4), reps, 1.0, rule="nearest", hops=topo.hop_counts())
    agg = linksim.choose_aggregators(sets, d.P_layer > 0, "uniform", np.random.default_rng(0),
                                     d.extra_holders)
    assert agg.tolist() == [3, 3]
    pi = np.arange(4)
    src, dst, _, task = linksim.layer_messages(sets, 1.0, d.P_layer > 0, agg, pi,
                                               d.extra_holders)
    assert src.tolist() == [2, 2] and dst.tolist() == [3, 3] and task.tolist() == [0, 1]
    src, dst, _, _ = linksim.layer_messages(sets, 1.0, d.P_layer > 0, agg, pi, d.extra_holders,
                                            direction="dispatch")
    assert src.tolist() == [3, 3] and dst.tolist() == [2, 2]
    # without the replica the tokens' expert-0 messages come from the primary, node 0
    src0, _, _, _ = linksim.layer_messages(sets, 1.0, np.eye(4) > 0, agg, pi)
    assert src0.tolist() == [0, 0]


# ------------------------------------------------------------------------------ aggregators
def _naive_aggregators(sets, support, rule, rng):
    """Loop-by-token reference of §6.2 step 2 with the same vectorised draw calls."""
    valid = [[bool(support[e].any()) for e in row] for row in sets.tolist()]
    if rule == "first":
        experts = [min(e for e, ok in zip(row, v) if ok) for row, v in zip(sets.tolist(), valid)]
    else:
        u = rng.integers(0, np.array([sum(v) for v in valid]))
        experts = [[e for e, ok in zip(row, v) if ok][int(x)]
                   for row, v, x in zip(sets.tolist(), valid, u)]
    holders = [np.flatnonzero(support[e]) for e in experts]
    if rule == "uniform":
        v = rng.integers(0, np.array([h.size for h in holders]))
        return np.array([h[int(x)] for h, x in zip(holders, v)])
    return np.array([h[0] for h in holders])


@pytest.mark.parametrize("rule", ["uniform", "ref", "first"])
def test_aggregators_match_naive_reference(rng, rule):
    P = expert_parallel(1, 16, 8, rng).P[0]
    P[3] = [0.25, 0.25, 0.5, 0, 0, 0, 0, 0]
    sets = np.stack([rng.permutation(16)[:4] for _ in range(50)])
    ref = _naive_aggregators(sets, P > 0, rule, np.random.default_rng(5))
    got = choose_aggregators(sets, HolderTable.from_shares(P), rule, np.random.default_rng(5))
    np.testing.assert_array_equal(ref, got)
    np.testing.assert_array_equal(
        got, choose_aggregators(sets, P > 0, rule, np.random.default_rng(5)))
    zero = P.copy()
    zero[[1, 2]] = 0.0                                   # broadcast rows zeroed
    ok = ~np.isin(sets, [1, 2]).all(axis=1)
    ref = _naive_aggregators(sets[ok], zero > 0, rule, np.random.default_rng(5))
    got = choose_aggregators(sets[ok], HolderTable.from_shares(zero), rule,
                             np.random.default_rng(5))
    np.testing.assert_array_equal(ref, got)
    np.testing.assert_array_equal(
        got, choose_aggregators(sets[ok], zero > 0, rule, np.random.default_rng(5)))


def test_aggregators_for_holderless_tokens():
    P = np.array([[0.0, 0.0], [0.0, 1.0]])
    sets = np.array([[0, 0], [0, 1]])
    extra = np.array([[1, -1], [-1, -1]])
    agg = choose_aggregators(sets, HolderTable.from_shares(P), "uniform",
                             np.random.default_rng(0), extra)
    assert agg.tolist() == [1, 1]
    assert choose_aggregators(sets, P > 0, "uniform", np.random.default_rng(0),
                              extra).tolist() == [1, 1]
    with pytest.raises(ConfigError, match="holder"):
        choose_aggregators(sets, HolderTable.from_shares(P), "ref", np.random.default_rng(0))
