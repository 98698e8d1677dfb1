"""Pre-broadcast traffic on the NoC (paper-model.md §10.4, §10.8; ``hdamoe_env.noc.broadcast``):
broadcast trees, the chunk-pipelined DES schedule, the α–β agreement and the message cap."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.config.profiles import get_profile
from hdamoe_env.config.specs import HardwareSpec, TopologySpec, get_model, hardware_from_setting
from hdamoe_env.cost import broadcast as prebroadcast
from hdamoe_env.noc import broadcast
from hdamoe_env.noc.broadcast import broadcast_tree, simulate_broadcast, simulate_broadcasts
from hdamoe_env.noc.des import simulate_messages
from hdamoe_env.noc.topology import make_topology
from hdamoe_env.sim.placement import expert_parallel

DEEPSEEK = get_model("deepseek-v2-lite")
PAPER = get_profile("paper")


# ------------------------------------------------------------------------------ broadcast traffic
def test_broadcast_tree_mesh_and_fattree():
    hw = HardwareSpec(mesh_shape=(1, 4), compute_tflops=1.0, link_bw_gbps=1.0)
    path = make_topology("mesh", hw)
    parent, depth = broadcast_tree(path, 1)
    assert parent.tolist() == [1, -1, 1, 2] and depth.tolist() == [1, 0, 1, 2]
    mesh = make_topology("mesh", hardware_from_setting("5/50"))
    parent, depth = broadcast_tree(mesh, 9)
    assert depth.max() <= mesh.diameter and (parent >= 0).sum() == 31
    for v in range(32):                          # every tree edge is one link (neighbours)
        if parent[v] >= 0:
            assert len(mesh.route(int(parent[v]), v)) == 1
    tree = make_topology(TopologySpec(kind="fattree"), hardware_from_setting("5/50"))
    parent, depth = broadcast_tree(tree, 3)
    assert set(parent.tolist()) == {-1, 3} and depth.max() == 1     # star: switches do not copy


def test_broadcast_makespan_hand_value_and_link_busy():
    hw = HardwareSpec(mesh_shape=(1, 4), compute_tflops=1.0, link_bw_gbps=1.0)
    topo = make_topology("mesh", hw)
    P = np.eye(4)
    one = simulate_broadcast(topo, P, [0], 1000.0, 100.0)
    # 10 chunks of 100 B over a 3-hop pipeline at 1 B/ns: (10 + 3 − 1) · 100 ns
    assert one.makespan_s == pytest.approx(1.2e-6)
    assert one.chunks == 10 and one.num_messages == 30
    assert one.link_busy_s.sum() == pytest.approx(3 * 1000e-9)    # every edge carries S once
    assert np.count_nonzero(one.link_busy_s) == 3
    two = simulate_broadcast(topo, P, [0, 1], 1000.0, 100.0)
    assert two.makespan_s > one.makespan_s                      # shared links serialise
    assert two.link_busy_s.sum() == pytest.approx(6 * 1000e-9)
    none = simulate_broadcast(topo, P, [], 1000.0, 100.0)
    assert none.makespan_s == 0 and not none.link_busy_s.any()


def test_broadcast_des_reproduces_alpha_beta_paper():
    """The chunk-pipelined tree on 4×8 lands close to T_bc*(m) of §10.4 (`paper` conventions)."""
    hw = hardware_from_setting("5/50")
    topo = make_topology("mesh", hw)
    pl = expert_parallel(1, 64, 32, np.random.default_rng(0))
    S = prebroadcast.broadcast_payload(DEEPSEEK, PAPER)
    H = prebroadcast.broadcast_depth(PAPER, 32)
    for m in (1, 2):
        c = prebroadcast.broadcast_chunk(m, S, H, 100e-9, hw.link_bw_Bps)
        res = simulate_broadcast(topo, pl.P[0], list(range(0, 2 * m, 2)), S, c,
                                 pi=pl.pi[0], alpha_s=100e-9)
        t = prebroadcast.broadcast_time(m, S, H, 100e-9, hw.link_bw_Bps)
        assert res.makespan_s == pytest.approx(t, rel=0.25)


def test_broadcast_message_cap():
    hw = hardware_from_setting("5/50")
    topo = make_topology("mesh", hw)
    P = expert_parallel(1, 64, 32, np.random.default_rng(0)).P[0]
    res = simulate_broadcast(topo, P, [0, 1, 2], 17e6, 10e3, max_messages=3000)
    assert res.num_messages <= 3000 and res.chunks == 3000 // (3 * 31)


def test_broadcast_fanout_bounds_the_budget_rule_under_ports():
    """With one injection port per node a tree node injects each chunk once per child: the
    dimension-ordered tree of a 4x8 mesh or torus has a node with 4 children, the fat-tree's star
    31; the budget rule then runs the pipeline at BW / fanout, so fewer experts fit."""
    from hdamoe_env.config.errors import ConfigError
    from hdamoe_env.config.profiles import PROFILES
    from hdamoe_env.config.specs import HardwareSpec, get_model
    from hdamoe_env.cost.broadcast import broadcast_plan
    from hdamoe_env.noc.broadcast import broadcast_fanout
    from hdamoe_env.noc.topology import make_topology

    hw = HardwareSpec(mesh_shape=(4, 8))
    assert broadcast_fanout(make_topology("mesh", hw)) == 4
    assert broadcast_fanout(make_topology("torus", hw)) == 4
    assert broadcast_fanout(make_topology("fattree", hw)) == 31
    model, conv = get_model("deepseek-v2-lite"), PROFILES["faithful"]
    one = broadcast_plan(model, hw, conv, 128, 10, 200e-6, 240e-6, 8)
    four = broadcast_plan(model, hw, conv, 128, 10, 200e-6, 240e-6, 8, fanout=4)
    assert one.k_b >= 1 and four.k_b < one.k_b
    S = one.payload_bytes
    assert four.time_s == 0.0 or four.time_s > S * four.k_b * 4 / hw.link_bw_Bps
    with pytest.raises(ConfigError, match="fanout"):
        broadcast_plan(model, hw, conv, 128, 10, 200e-6, 240e-6, 8, fanout=0)


@pytest.mark.parametrize("kind,opts", [
    ("mesh", dict()),
    ("mesh", dict(switching="cut_through", hop_latency_s=2e-9, ni_bw_Bps=5e10,
                  ni_latency_s=1e-9, alpha_s=1e-7)),
    ("fattree", dict(tie_break="ref", hop_latency_s=1e-9, ni_bw_Bps=5e10)),
])
def test_simulate_broadcasts_equal_one_call_per_broadcast(kind, opts):
    """The batched entry (one compiled DES call, 1 or 2 numba threads within the pool) gives
    every broadcast's result bit for bit as ``simulate_broadcast``; an empty broadcast is the
    idle result without a DES run."""
    import numba

    hw = hardware_from_setting("5/50")
    topo = make_topology(TopologySpec(kind=kind), hw)
    rng = np.random.default_rng(4)
    pl = expert_parallel(3, 64, 32, rng)
    runs = [(pl.P[layer], [int(e) for e in rng.choice(64, m, replace=False)], c, pl.pi[layer])
            for layer, m, c in ((0, 2, 200e3), (1, 1, 90e3), (2, 3, 400e3), (1, 2, 200e3))]
    runs.insert(2, (pl.P[0], [], 1e3, pl.pi[0]))
    for threads in sorted({1, min(2, int(numba.config.NUMBA_NUM_THREADS))}):
        got = simulate_broadcasts(topo, runs, 1.7e6, max_messages=4000, threads=threads,
                                  **opts)
        assert len(got) == len(runs)
        for res, (P, experts, chunk, pi) in zip(got, runs, strict=True):
            want = simulate_broadcast(topo, P, experts, 1.7e6, chunk, pi=pi, max_messages=4000,
                                      **opts)
            assert (res.makespan_s, res.num_messages, res.chunks, res.chunk_bytes) == (
                want.makespan_s, want.num_messages, want.chunks, want.chunk_bytes)
            np.testing.assert_array_equal(res.link_busy_s, want.link_busy_s)
            if experts:                          # and as the message DES of its messages
                msgs = broadcast._messages(topo, P, experts, 1.7e6, chunk, pi,
                                           opts.get("alpha_s", 0.0),
                                           opts.get("hop_latency_s", 0.0), 4000, None)
                des = simulate_messages(topo, msgs.src, msgs.dst, msgs.size_bytes, msgs.ready_s,
                                        **{k: v for k, v in opts.items() if k != "alpha_s"})
                assert res.makespan_s == des.makespan_s
                np.testing.assert_array_equal(res.link_busy_s, des.link_busy_s)
        assert got[2].makespan_s == 0.0 and got[0].makespan_s > 0
