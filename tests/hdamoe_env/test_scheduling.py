"""Online scheduling mechanics (paper-model.md §10): budget, k_b, chunk size, priority, dispatch,
broadcast traffic, aggregators, prediction and the cached layer evaluator."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.cost import perf
from hdamoe_env.cost import broadcast as prebroadcast
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.sim.placement import expert_parallel, tensor_parallel
from hdamoe_env.config.profiles import get_profile
from hdamoe_env.noc.linksim import HolderTable, choose_aggregators
from hdamoe_env.sim.evaluator import LayerEvaluator
from hdamoe_env.decisions.scheduling import (AliasSampler, broadcast_plan, broadcast_slots, broadcast_tree,
                                             dispatch_broadcast, dispatch_replicas, merge_dispatch,
                                             noisy_oracle_sets, priority_broadcast, simulate_broadcast)
from hdamoe_env.sim.simulator import MoESimulator
from hdamoe_env.config.specs import HardwareSpec, TopologySpec, get_model, hardware_from_setting
from hdamoe_env.noc.topology import make_topology

DEEPSEEK = get_model("deepseek-v2-lite")
PAPER = get_profile("paper")
FAITHFUL = get_profile("faithful")


# ------------------------------------------------------------------------------ §10.3–10.4, §14.7
@pytest.mark.parametrize("bw,expected_kb", [(75, 61.8e3), (50, 50.5e3), (25, 35.7e3)])
def test_chunk_size_hand_values_paper(bw, expected_kb):
    hw = hardware_from_setting(f"5/{bw}")
    S = prebroadcast.broadcast_payload(DEEPSEEK, PAPER)
    H = prebroadcast.broadcast_depth(PAPER, hw.num_nodes)
    assert S == 5_767_168
    c = prebroadcast.broadcast_chunk(1, S, H, PAPER.bc_alpha_s, hw.link_bw_Bps)
    assert c == pytest.approx(expected_kb, abs=60)
    # c*(1) by hand: sqrt(α·S·BW/H)
    assert c == pytest.approx(np.sqrt(100e-9 * S * bw * 1e9 / (2 * np.sqrt(32))))


def test_chunk_size_and_time_faithful():
    hw = hardware_from_setting("5/50")
    plan = broadcast_plan(DEEPSEEK, hw, FAITHFUL, 128, 10, 1e-3, 1e-3, 8)
    assert plan.payload_bytes == 17_301_504 and plan.depth_hops == 10
    c1 = prebroadcast.broadcast_chunk(1, plan.payload_bytes, 10, 100e-9, hw.link_bw_Bps)
    assert c1 == pytest.approx(93.0e3, abs=60)
    t1 = prebroadcast.broadcast_time(1, plan.payload_bytes, 10, 100e-9, hw.link_bw_Bps)
    assert t1 * 1e6 == pytest.approx(384.2, abs=0.05)


@pytest.mark.parametrize("setting,batch,budget_us,k_b", [
    ("2.5/75", 512, 482.6, 5), ("5/50", 512, 304.8, 2), ("10/25", 512, 215.9, 0),
    ("2.5/75", 128, 135.1, 1), ("5/50", 128, 90.7, 0), ("10/25", 128, 68.4, 0),
    ("5/50", 64, None, 0)])
def test_kb_table_14_7(setting, batch, budget_us, k_b):
    hw = hardware_from_setting(setting)
    plan = broadcast_plan(DEEPSEEK, hw, PAPER, batch, None, None, None, 64)
    if budget_us is not None:
        assert plan.budget_s * 1e6 == pytest.approx(budget_us, abs=0.05)
    assert plan.k_b == k_b
    assert broadcast_slots(DEEPSEEK, hw, PAPER, batch, None, None, None, 64) == k_b
    if k_b:
        assert plan.time_s < plan.budget_s
        S, H = plan.payload_bytes, plan.depth_hops
        assert prebroadcast.broadcast_time(k_b + 1, S, H, 100e-9, hw.link_bw_Bps) >= plan.budget_s


def test_faithful_budget_is_per_layer_and_capped():
    hw = hardware_from_setting("5/50")
    S, H = prebroadcast.broadcast_payload(DEEPSEEK, FAITHFUL), 10
    big = broadcast_slots(DEEPSEEK, hw, FAITHFUL, 128, 10, 2e-3, 1e-3, 64)
    t = prebroadcast.broadcast_time(np.arange(1, 65), S, H, 100e-9, hw.link_bw_Bps)
    assert big == int((t < 3e-3).sum())
    assert broadcast_slots(DEEPSEEK, hw, FAITHFUL, 128, 10, 2e-3, 1e-3, 2) == min(big, 2)
    with pytest.raises(ConfigError):
        broadcast_slots(DEEPSEEK, hw, FAITHFUL, 128, 10, None, None, 8)


# ------------------------------------------------------------------------------ §10.5
def _ep4():
    # 4 experts, 2 nodes: experts 0, 1 on node 0; 2, 3 on node 1
    return np.array([[1.0, 0], [1.0, 0], [0, 1.0], [0, 1.0]])


def test_priority_picks_hottest_expert_on_congested_node():
    P = _ep4()
    n = np.array([3.0, 5.0, 4.0, 0.0])        # node 0 load 8 > node 1 load 4
    assert priority_broadcast(P, n, 1.0, 1.0, 1) == [1]
    # repeated selection: after removing 1 node 0 has 3 < 4 → the next pick is on node 1
    assert priority_broadcast(P, n, 1.0, 1.0, 2, ref_bookkeeping=True) == [1, 2]
    # ties on priority: highest expert id
    assert priority_broadcast(P, np.array([4.0, 4.0, 1.0, 1.0]), 1.0, 1.0, 1) == [1]


def test_priority_zero_priority_rule():
    P = _ep4()
    n = np.array([2.0, 0.0, 0.0, 0.0])
    assert priority_broadcast(P, n, 1.0, 1.0, 3, skip_zero_priority=True) == [0]
    ref = priority_broadcast(P, n, 1.0, 1.0, 3, ref_bookkeeping=True, skip_zero_priority=False)
    assert ref[0] == 0 and len(ref) == 3 and len(set(ref)) == 3
    assert ref[1:] == [3, 2]                    # all priorities 0: the highest unpicked id


def test_priority_faithful_bookkeeping_counts_predicted_dispatch():
    # experts 0, 1 on node 0; expert 2 on node 1; expert 3 on node 2
    P = np.array([[1.0, 0, 0], [1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]])
    sets = np.array([[0, 2]] * 3 + [[0, 3]] * 3 + [[1, 3]] * 5)
    n = np.bincount(sets.ravel(), minlength=4).astype(float)     # [6, 5, 3, 8]
    # ref: expert 0's load disappears → node 2 (8) is congested next → pick 3
    assert priority_broadcast(P, n, 1.0, 1.0, 2, ref_bookkeeping=True) == [0, 3]
    # faithful: expert 0's tokens are predicted to land on nodes 1 and 0 (least loaded
    # co-holders), node 0 ends at 9 > 8 → it stays congested → pick 1
    assert priority_broadcast(P, n, 1.0, 1.0, 2, token_sets_pred=sets) == [0, 1]
    # without sets: expert 0's work is spread evenly (node 0: 5 + 2 = 7 < node 2: 8 + 2)
    assert priority_broadcast(P, n, 1.0, 1.0, 2) == [0, 3]


# ------------------------------------------------------------------------------ §10.6–10.7
def test_dispatch_picks_least_loaded_candidate():
    # 3 nodes; expert 0 on node 0 (hot), expert 1 on node 1, expert 2 on node 2 (idle)
    P = np.eye(3)
    sets = np.array([[0, 1], [0, 2], [1, 2], [0, 1]])
    d = dispatch_broadcast(sets, P, [0], 1.0)
    # non-broadcast loads: node1 = 2 (tokens 0, 2, 3 use expert 1 → 3), node2 = 2
    # token 0: cand [0, 1] → node 0 (load 0)
    assert d.nodes[0].tolist() == [0, -1]
    # token 1: cand [0, 2]: node 0 now 1, node 2 has 2 → node 0
    assert d.nodes[1].tolist() == [0, -1]
    # token 3: cand [0, 1]: node 0 has 2, node 1 has 3 → node 0
    assert d.nodes[3, 0] == 0
    np.testing.assert_array_equal(d.node_flops, [3.0, 0, 0])
    np.testing.assert_array_equal(d.P_layer[0], 0.0)
    np.testing.assert_array_equal(d.P_layer[1:], P[1:])
    assert d.extra_holders is not None and d.extra_holders[:, 0].tolist() == [0, 0, -1, 0]


def test_dispatch_rules_first_and_home():
    P = np.array([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    sets = np.array([[1, 0], [2, 0]])
    first = dispatch_broadcast(sets, P, [0], 1.0, rule="first")
    assert first.nodes[:, 1].tolist() == [1, 2]            # lowest holder of the token's 1st
    ll = dispatch_broadcast(sets, P, [0], 1.0, rule="least_loaded")
    # token 0: cand [1, 0, 1]: node 1 has 1, node 0 has 0 → node 0
    assert ll.nodes[0, 1] == 0
    home = dispatch_broadcast(sets, P, [0], 1.0, rule="home")
    assert set(home.nodes[:, 1].tolist()) <= {0, 1}         # expert 0's own holders


def test_dispatch_all_k_broadcast_and_bookkeeping():
    P = np.array([[1.0, 0], [0, 1.0], [1.0, 0], [0, 1.0]])
    sets = np.array([[0, 1], [0, 2], [3, 2]])
    d = dispatch_broadcast(sets, P, [0, 1], 1.0)
    assert d.orphans.tolist() == [True, False, False]
    assert (d.nodes[0] >= 0).all()
    ref = dispatch_broadcast(sets, P, [0, 1], 1.0, ref_bookkeeping=True)
    assert ref.extra_holders is not None
    assert (ref.extra_holders[1:] == -1).all() and (ref.extra_holders[0] >= 0).any()
    assert d.node_flops.sum() == ref.node_flops.sum() == 3.0    # all pairs charged
    with pytest.raises(ConfigError, match="distinct"):
        dispatch_broadcast(sets, P, [0, 0], 1.0)
    with pytest.raises(ConfigError, match="dispatch rule"):
        dispatch_broadcast(sets, P, [0], 1.0, rule="nearest")


def test_dispatch_streaming_and_conservation(rng):
    model = DEEPSEEK
    hw = hardware_from_setting("5/50")
    # FLOPs are conserved in the fluid model; the tile model pads GEMMs (docs/PHYSICS.md)
    sim = MoESimulator(model, hw, "mesh", FAITHFUL.derive(tile_tokens=1, tile_cols=1,
                                                          gemm_overhead_s=0.0))
    pl = expert_parallel(model.num_moe_layers, 64, 32, rng)
    sets = np.stack([rng.permutation(64)[:6] for _ in range(128)])
    w = perf.expert_flops(model, sim.conv)
    stream = perf.expert_bytes(model, sim.conv) / hw.mem_bw_Bps
    d = dispatch_broadcast(sets, pl.P[2], [int(sets[0, 0]), int(sets[1, 1])], w,
                           compute_flops=hw.compute_flops, stream_s=stream)
    base = sim.layer_sampled(pl, 2, sets, rng=np.random.default_rng(0))
    res = sim.layer_sampled(pl, 2, sets, rng=np.random.default_rng(0), P_layer=d.P_layer,
                            extra_holders=d.extra_holders, extra_compute_s=d.extra_compute_s,
                            extra_stream_s=d.extra_stream_s)
    assert res.node_compute_s.sum() == pytest.approx(base.node_compute_s.sum())  # work moved
    # every node computing a replica streams its weights once
    placed = d.nodes >= 0
    pairs = set(zip(sets[placed].tolist(), d.nodes[placed].tolist(), strict=True))
    assert placed.any() and d.extra_stream_s.sum() == pytest.approx(stream * len(pairs))


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


# ------------------------------------------------------------------------------ §10.2 prediction
def test_noisy_oracle_semantics():
    rng = np.random.default_rng(1)
    E, B, k = 16, 256, 4
    p = np.arange(1, E + 1, dtype=float) ** -1.0
    actual = np.stack([rng.choice(E, k, replace=False, p=p / p.sum()) for _ in range(B)])
    sampler = AliasSampler(p)
    overlaps = []
    for _ in range(20):
        pred = noisy_oracle_sets(actual, 0.7, sampler, rng)
        assert all(len(set(r)) == k for r in pred.tolist())
        kept = (pred[:, :, None] == actual[:, None, :]).any(axis=2)
        same_slot = pred == actual
        assert (kept == same_slot).all()               # replacements never come from the set
        overlaps.append(kept.mean())
    assert np.mean(overlaps) == pytest.approx(0.7, abs=0.015)
    np.testing.assert_array_equal(noisy_oracle_sets(actual, 1.0, sampler, rng), actual)


def test_noisy_oracle_per_layer_rows():
    rng = np.random.default_rng(2)
    E, B, k = 8, 200, 2
    shares = np.array([np.r_[np.ones(4), np.full(4, 1e-12)], np.r_[np.full(4, 1e-12), np.ones(4)]])
    actual = np.tile([[0, 1]], (2 * B, 1))
    actual[B:] = [4, 5]
    layers = np.repeat([0, 1], B)
    pred = noisy_oracle_sets(actual, 0.0, AliasSampler(shares), rng, layer_of_row=layers)
    assert np.isin(pred[:B], [2, 3]).all()             # layer 0 draws ∝ its own popularity
    assert np.isin(pred[B:], [6, 7]).all()


def test_alias_sampler_distribution():
    p = np.array([0.5, 0.25, 0.125, 0.125, 0.0])
    draws = AliasSampler(p).sample(np.zeros(100_000, dtype=np.int64), 1,
                                   np.random.default_rng(0)).ravel()
    freq = np.bincount(draws, minlength=5) / draws.size
    np.testing.assert_allclose(freq, p, atol=0.005)


# ------------------------------------------------------------------------------ layer evaluator
@pytest.mark.parametrize("profile", ["faithful", "paper"])
def test_evaluator_equals_layer_sampled(profile, tiny_model, tiny_hw, rng):
    sim = MoESimulator(tiny_model, tiny_hw, conventions=profile)
    pl = expert_parallel(tiny_model.num_moe_layers, 4, 4, rng)
    ev = LayerEvaluator(sim, pl, 16)
    sets = np.stack([rng.permutation(4)[:2] for _ in range(16)])
    for fid, gamma in (("des", None), ("analytic", 0.37)):
        a = sim.layer_sampled(pl, 1, sets, rng=np.random.default_rng(3), fidelity=fid,
                              gamma=gamma)
        b = ev.evaluate(1, sets, rng=np.random.default_rng(3), fidelity=fid, gamma=gamma)
        for name in ("t_nm_s", "t_comp_s", "t_dispatch_s", "t_combine_s", "t_comm_moe_s",
                     "total_s", "mode"):
            assert getattr(a, name) == getattr(b, name), name
        if a.link_busy_s is not None:
            np.testing.assert_array_equal(a.link_busy_s, b.link_busy_s)
    d = dispatch_broadcast(sets, pl.P[1], [int(sets[0, 0])], perf.expert_flops(tiny_model,
                           sim.conv), compute_flops=tiny_hw.compute_flops, stream_s=1e-7)
    kw = dict(P_layer=d.P_layer, extra_holders=d.extra_holders, extra_compute_s=d.extra_compute_s,
              extra_stream_s=d.extra_stream_s, extra_s=2e-7)
    a = sim.layer_sampled(pl, 1, sets, rng=np.random.default_rng(3), **kw)
    b = ev.evaluate(1, sets, rng=np.random.default_rng(3), **kw)
    assert a.total_s == b.total_s and a.t_extra_s == b.t_extra_s == 2e-7


def test_evaluator_tp_and_tp_totals(tiny_model, tiny_hw, rng):
    sim = MoESimulator(tiny_model, tiny_hw)
    tp = tensor_parallel(tiny_model.num_moe_layers, 4, 4)
    ev = LayerEvaluator(sim, tp, 16)
    step = np.stack([np.stack([rng.permutation(4)[:2] for _ in range(16)]) for _ in range(2)])
    totals = ev.tp_totals(step)
    for layer in range(2):
        ref = sim.layer_sampled(tp, layer, step[layer], rng=rng)
        assert ref.mode == "tp"
        assert totals[layer] == pytest.approx(ref.total_s, rel=1e-12)
    with pytest.raises(ConfigError, match="TP"):
        LayerEvaluator(sim, expert_parallel(2, 4, 4, rng), 16).tp_totals(step)


def test_dispatch_replicas_follow_the_tile_model(rng):
    """docs/PHYSICS.md §4: a replica runs a whole expert (I = 1408 columns) on its tokens.

    DeepSeek, 5 TFLOPS, faithful tiles: a replica with n tokens costs
    3·(ceil(n/8)·8·1408·2048·2 / 5e12 s + 100 ns); the charged extra compute of every node is the
    sum over its replicas (here one broadcast expert).
    """
    model = DEEPSEEK
    hw = hardware_from_setting("5/50")
    sim = MoESimulator(model, hw, "mesh", FAITHFUL)
    pl = expert_parallel(model.num_moe_layers, 64, 32, rng)
    sets = np.stack([rng.permutation(64)[:6] for _ in range(128)])
    e = int(sets[0, 0])
    tile = lambda n: perf.gemm_tile_time(n, 1408, model, hw, sim.conv)  # noqa: E731
    d = dispatch_broadcast(sets, pl.P[2], [e], perf.expert_flops(model, sim.conv),
                           compute_flops=hw.compute_flops, tile_time=tile)
    tokens = np.bincount(d.nodes[d.nodes >= 0], minlength=32)
    want = [3 * (np.ceil(n / 8) * 8 * 1408 * 2048 * 2 / 5e12 + 1e-7) if n else 0.0
            for n in tokens]
    np.testing.assert_allclose(d.extra_compute_s, want, rtol=1e-12)
    fluid = dispatch_broadcast(sets, pl.P[2], [e], perf.expert_flops(model, sim.conv),
                               compute_flops=hw.compute_flops)
    assert (d.extra_compute_s >= fluid.extra_compute_s - 1e-15).all()


# ------------------------------------------------------------------------------ redundant experts
def _identity_shares(n: int) -> np.ndarray:
    return np.eye(n)                                 # expert i wholly on node i (EP, E = D)


def test_replica_least_loaded_halves_the_hot_node():
    """EP on 4 nodes, k = 1, B = 16: expert 0 takes half the tokens (8), experts 1 and 2 take
    4 each, expert 3 none; one whole replica of expert 0 on node 3.

    Loads (w = 1) start from the non-replicated experts: [0, 4, 4, 0]. Greedy per token,
    min over copies of the copy's load after the token, ties to the primary:
    primary 1 vs replica 1 -> primary; 2 vs 1 -> replica; 2 vs 2 -> primary; 3 vs 2 -> replica;
    ... so the 8 tokens alternate and end 4 / 4: the busiest node drops from 8 to 4 (2x).
    """
    sets = np.array([[0]] * 8 + [[1]] * 4 + [[2]] * 4)
    reps = np.zeros((4, 4), dtype=bool)
    reps[0, 3] = True
    d = dispatch_replicas(sets, _identity_shares(4), reps, 1.0)
    base = np.array([0.0, 4.0, 4.0, 0.0])
    np.testing.assert_array_equal(d.extra_compute_s, [4.0, 0.0, 0.0, 4.0])
    np.testing.assert_array_equal(base + d.extra_compute_s, [4.0, 4.0, 4.0, 4.0])
    assert d.copies[:8, 0].tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert (d.copies[8:] == -1).all() and (d.P_layer[0] == 0).all()
    np.testing.assert_array_equal(d.P_layer[1:], _identity_shares(4)[1:])
    assert d.nodes[:8, 0].tolist() == [0, 3] * 4
    # every copy that computes streams its weights once
    s = dispatch_replicas(sets, _identity_shares(4), reps, 1.0, stream_s=2.0)
    np.testing.assert_array_equal(s.extra_stream_s, [2.0, 0.0, 0.0, 2.0])


def test_replica_round_robin_and_shares_are_exact():
    """Expert 0 on node 0 with replicas on nodes 2 and 3 (copies 0, 1, 2); 7 tokens use it.

    round_robin: copies 0,1,2,0,1,2,0 -> tokens per node [3, 0, 2, 2].
    shares with fractions (primary .5, node 2 .25, node 3 .25): quotas 3.5, 1.75, 1.75, floors
    3, 1, 1 and the two leftover tokens to the largest remainders (.75, .75: copies 1 and 2)
    -> 3, 2, 2 in batch order: copies 0,0,0,1,1,2,2.
    """
    sets = np.array([[0, 1]] * 7)
    reps = np.zeros((4, 4), dtype=bool)
    reps[0, [2, 3]] = True
    rr = dispatch_replicas(sets, _identity_shares(4), reps, 1.0, rule="round_robin")
    assert rr.copies[:, 0].tolist() == [0, 1, 2, 0, 1, 2, 0]
    np.testing.assert_array_equal(rr.extra_compute_s, [3.0, 0.0, 2.0, 2.0])
    frac = np.zeros((4, 5))
    frac[0, [0, 3, 4]] = [0.5, 0.25, 0.25]
    sh = dispatch_replicas(sets, _identity_shares(4), reps, 1.0, rule="shares", fractions=frac)
    assert sh.copies[:, 0].tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert sh.nodes[:, 0].tolist() == [0, 0, 0, 2, 2, 3, 3]
    again = dispatch_replicas(sets, _identity_shares(4), reps, 1.0, rule="shares", fractions=frac)
    np.testing.assert_array_equal(again.copies, sh.copies)
    with pytest.raises(ConfigError, match="fractions"):
        dispatch_replicas(sets, _identity_shares(4), reps, 1.0, rule="shares")
    with pytest.raises(ConfigError, match="replica rule"):
        dispatch_replicas(sets, _identity_shares(4), reps, 1.0, rule="busiest")


def test_replica_nearest_picks_the_nearer_copy_on_a_2x2_mesh():
    """2x2 mesh, endpoints 0 (0,0), 1 (0,1), 2 (1,0), 3 (1,1); expert i on node i, expert 0
    replicated on node 2. Tokens (0, 3): the anchor is node 3; the primary (node 0) is 2 hops
    away, the replica (node 2) 1 hop: nearest takes the replica both times. least_loaded
    (loads [0, 1, 0, 2] from experts 1 and 3): t0 primary 0+1 = 1 vs replica 0+1 = 1 -> the
    primary (tie, lower copy); t1 primary 2 vs replica 1 -> the replica.
    A token (0, 1) has anchor node 1: primary 1 hop, replica 2 hops -> primary.
    """
    topo = make_topology(TopologySpec(kind="mesh"), HardwareSpec(mesh_shape=(2, 2)))
    hops = topo.hop_counts()
    assert hops.tolist() == [[0, 1, 1, 2], [1, 0, 2, 1], [1, 2, 0, 1], [2, 1, 1, 0]]
    reps = np.zeros((4, 4), dtype=bool)
    reps[0, 2] = True
    sets = np.array([[0, 3], [0, 3], [0, 1]])
    near = dispatch_replicas(sets, _identity_shares(4), reps, 1.0, rule="nearest", hops=hops)
    assert near.copies[:, 0].tolist() == [1, 1, 0]
    assert near.extra_holders[:, 0].tolist() == [2, 2, 0]
    ll = dispatch_replicas(sets, _identity_shares(4), reps, 1.0)
    assert ll.copies[:2, 0].tolist() == [0, 1]
    # a mapping moves the clusters: cluster 2 at endpoint 1 is 1 hop from endpoint 0 ...
    pi = np.array([3, 2, 1, 0])       # cluster 0 -> ep 3, cluster 2 -> ep 1, cluster 3 -> ep 0
    moved = dispatch_replicas(sets[:1], _identity_shares(4), reps, 1.0, rule="nearest",
                              hops=hops, pi=pi)
    assert moved.copies[0, 0] == 1    # replica (ep 1) 1 hop from the anchor (ep 0); primary 2
    with pytest.raises(ConfigError, match="hop"):
        dispatch_replicas(sets, _identity_shares(4), reps, 1.0, rule="nearest")


def test_replica_sharded_primary_follows_the_tile_model():
    """DeepSeek (I = 1408, h = 2048, m = 3), 5 TFLOPS, faithful tiles (8 tokens, 64 columns,
    100 ns per GEMM). Expert 0 is sharded 1/2 + 1/2 on nodes 0 and 1 (704 columns each, 11
    tiles) with a whole replica on node 2; round_robin sends 10 tokens 5 / 5.

    Primary nodes: 3·(8·704·2048·2 / 5e12 + 100 ns) = 3·(4.6137 + 0.1) µs each; the replica:
    3·(8·1408·2048·2 / 5e12 + 100 ns) = 3·(9.2275 + 0.1) µs. Streaming: W_e/2 on each primary
    node, W_e on the replica.
    """
    hw = hardware_from_setting("5/50")
    P = np.zeros((4, 4))
    P[0, :2] = 0.5
    P[1:, 3] = 1.0
    reps = np.zeros((4, 4), dtype=bool)
    reps[0, 2] = True
    sets = np.array([[0, 1]] * 10)
    tile = lambda n, share: perf.gemm_tile_time(n, share * 1408, DEEPSEEK, hw, FAITHFUL)  # noqa
    d = dispatch_replicas(sets, P, reps, perf.expert_flops(DEEPSEEK, FAITHFUL),
                          rule="round_robin", compute_flops=hw.compute_flops, stream_s=1.0,
                          tile_time=tile)
    half = 3 * (8 * 704 * 2048 * 2 / 5e12 + 1e-7)
    whole = 3 * (8 * 1408 * 2048 * 2 / 5e12 + 1e-7)
    np.testing.assert_allclose(d.extra_compute_s, [half, half, whole, 0.0], rtol=1e-12)
    np.testing.assert_allclose(d.extra_stream_s, [0.5, 0.5, 1.0, 0.0])
    # a token on the primary group visits both shard holders
    assert d.extra_holders[0].tolist() == [0, 1] and d.extra_holders[1].tolist() == [2, -1]


def test_replica_dispatch_composes_with_broadcast():
    """A broadcast expert (row zeroed by dispatch_broadcast) is not replica-dispatched; the
    replica dispatch then runs on the zeroed shares, and the merge adds work and holders."""
    reps = np.zeros((4, 4), dtype=bool)
    reps[0, 3] = True
    reps[1, 2] = True
    sets = np.array([[0, 1], [0, 2], [1, 3], [0, 3]])
    bc = dispatch_broadcast(sets, _identity_shares(4), [1], 1.0)
    rd = dispatch_replicas(sets, bc.P_layer, reps, 1.0, initial_flops=bc.node_flops)
    assert (rd.copies[sets == 1] == -1).all()          # expert 1 went through broadcast
    assert (rd.copies[sets == 0] >= 0).all()
    merged = merge_dispatch(bc, rd)
    assert (merged.P_layer[[0, 1]] == 0).all()
    assert merged.extra_compute_s.sum() == pytest.approx(
        (sets == 0).sum() + (sets == 1).sum())
    assert merged.extra_holders.shape[1] == bc.extra_holders.shape[1] + rd.extra_holders.shape[1]
