"""Dispatch of broadcast copies and redundant replicas (paper-model.md §10.6–10.7;
``hdamoe_env.decisions.dispatch``): rules, bookkeeping, streaming, the tile model, merging."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.profiles import get_profile
from hdamoe_env.config.specs import HardwareSpec, TopologySpec, get_model, hardware_from_setting
from hdamoe_env.cost import perf
from hdamoe_env.decisions.dispatch import dispatch_broadcast, dispatch_replicas, merge_dispatch
from hdamoe_env.noc.topology import make_topology
from hdamoe_env.sim.placement import expert_parallel
from hdamoe_env.sim.simulator import MoESimulator

DEEPSEEK = get_model("deepseek-v2-lite")
FAITHFUL = get_profile("faithful")


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


def test_tile_aware_dispatch_fills_open_token_tiles():
    """With the tile model, a token that fits an open token tile costs nothing: fill it."""

    def tile_time(tokens):                   # 8-token tiles of 1 s each, plus 0.1 s per GEMM
        t = np.asarray(tokens, dtype=np.float64)
        return np.ceil(t / 8 - 1e-9).clip(0) * 1.0 + (t > 0) * 0.1

    P = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    sets = np.array([[2, 0], [2, 1], [2, 0], [2, 1]])          # expert 2 broadcast
    fluid = dispatch_broadcast(sets, P, [2], 1.0, tile_time=tile_time)
    tiled = dispatch_broadcast(sets, P, [2], 1.0, tile_time=tile_time, base_s=np.zeros(2))
    assert sorted(set(fluid.nodes[:, 0].tolist())) == [0, 1]   # fluid: spread, two tiles
    assert set(tiled.nodes[:, 0].tolist()) == {0}               # tiles: one replica, one tile
    assert tiled.extra_compute_s.sum() == pytest.approx(1.1)
    assert fluid.extra_compute_s.sum() == pytest.approx(2.2)
    # a loaded node is still avoided when the open tile would finish later
    busy = dispatch_broadcast(sets, P, [2], 1.0, tile_time=tile_time, base_s=np.array([5.0, 0]))
    assert set(busy.nodes[:, 0].tolist()) == {1}
    # ref bookkeeping and the paper rule are unchanged without base_s
    ref = dispatch_broadcast(sets, P, [2], 1.0, ref_bookkeeping=True, tile_time=tile_time)
    assert np.array_equal(ref.nodes, dispatch_broadcast(sets, P, [2], 1.0,
                                                        ref_bookkeeping=True).nodes)
