"""Tests of hdamoe_env.noc.linksim: task generation, aggregators and one layer's dispatch and
combine traffic on the DES (paper-model.md §6.2, §14.8 item 4)."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from hdamoe_env.noc import linksim
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.noc.des import simulate_messages, simulate_messages_oracle
from hdamoe_env.noc.linksim import (
    HolderTable,
    aggregators_many,
    choose_aggregators,
    holder_arrays,
    layer_flow_keys,
    layer_messages,
    simulate_layer_comm,
    simulate_layers_comm,
)
from hdamoe_env.config.specs import HardwareSpec, TopologySpec
from hdamoe_env.noc.topology import make_topology, stable_hash
from hdamoe_env.sim.placement import expert_parallel

HW48 = HardwareSpec(mesh_shape=(4, 8), link_bw_gbps=50.0)
HW22 = HardwareSpec(mesh_shape=(2, 2), link_bw_gbps=1.0)  # 1 byte per ns


def mesh22():
    return make_topology("mesh", HW22)


def assert_same(a, b):
    assert a.makespan_s == b.makespan_s
    assert np.array_equal(a.link_busy_s, b.link_busy_s)
    assert np.array_equal(a.finish_s, b.finish_s)


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


def test_partial_sum_combine_messages():
    """psum_combine (docs/PHYSICS.md §2): a partial-shard holder's combine message carries
    ``combine_bytes``; dispatch and whole-expert holders keep ``msg_bytes``.

    Static 2×2 task set at b_msg = 2 (messages 1000, 600, 400 B from clusters 1, 3, 3), cluster
    3 a partial holder of expert 3 with partial sums at 4 B: its two messages double (1200,
    800 B); cluster 1's stays 1000 B. The compiled layer path equals the message path.
    """
    topo = mesh22()
    holders = np.eye(4, dtype=bool)
    pi = np.arange(4)
    agg = np.array([0, 2, 0])
    msg = STATIC_F * 10 * 100 * 2
    partial = np.zeros((4, 4), dtype=bool)
    partial[3, 3] = True
    src, dst, size, task = layer_messages(STATIC_SETS, msg, holders, agg, pi,
                                          partial_mask=partial, combine_bytes=2 * msg)
    assert size.tolist() == pytest.approx([1000.0, 1200.0, 800.0])
    comm = simulate_layer_comm(topo, STATIC_SETS, msg, holders, pi, agg, partial_mask=partial,
                               combine_bytes=2 * msg, layer=2)
    base = simulate_layer_comm(topo, STATIC_SETS, msg, holders, pi, agg, layer=2)
    assert comm.dispatch_s == base.dispatch_s and comm.num_messages == base.num_messages
    keys = layer_flow_keys(2, task, src)
    assert comm.combine_s == simulate_messages(topo, src, dst, size, flow_keys=keys).makespan_s
    assert comm.combine_s > base.combine_s
    # every holder partial: the combine is the run with the partial-sum sizes throughout
    allp = simulate_layer_comm(topo, STATIC_SETS, msg, holders, pi, agg, layer=2,
                               partial_mask=np.ones((4, 4), bool), combine_bytes=2 * msg)
    doubled = simulate_layer_comm(topo, STATIC_SETS, 2 * msg, holders, pi, agg, layer=2)
    assert allp.combine_s == doubled.combine_s and allp.dispatch_s == base.dispatch_s
    # no partial holder: bit-identical to the run without the arguments
    nonep = simulate_layer_comm(topo, STATIC_SETS, msg, holders, pi, agg, layer=2,
                                partial_mask=np.zeros((4, 4), bool), combine_bytes=2 * msg)
    assert nonep.makespan_s == base.makespan_s
    with pytest.raises(ConfigError, match="together"):
        simulate_layer_comm(topo, STATIC_SETS, msg, holders, pi, agg, partial_mask=partial)
    with pytest.raises(ConfigError, match="partial_mask"):
        simulate_layer_comm(topo, STATIC_SETS, msg, holders, pi, agg,
                            partial_mask=np.ones((3, 4), bool), combine_bytes=msg)


@pytest.mark.parametrize("switching,ni,ni_lat", [("cut_through", None, None),
                                                 ("cut_through", 50e9, None),
                                                 ("cut_through", 50e9, 1.5e-9),
                                                 ("store_and_forward", 50e9, 0.5e-9)])
def test_layer_comm_switching_and_ports_equal_message_path(switching, ni, ni_lat):
    rng = np.random.default_rng(27)
    for kind in ("mesh", "torus", "fattree"):
        topo = make_topology(kind, HW48)
        for trial in range(2):
            holders = rng.random((16, 32)) < 0.08
            holders[np.arange(16), rng.integers(0, 32, 16)] = True
            sets = np.array([rng.choice(16, 3, replace=False) for _ in range(12)])
            pi = rng.permutation(32)
            agg = choose_aggregators(sets, holders, "uniform", rng)
            msg = rng.choice([512.0, 1024.0], 12)
            tie = "ref" if trial else "fifo"
            kw = dict(tie_break=tie, chunks=1 + trial, hop_latency_s=2e-9, switching=switching,
                      ni_bw_Bps=ni, ni_latency_s=ni_lat)
            comm = simulate_layer_comm(topo, sets, msg, holders, pi, agg, layer=3, **kw)
            for p, direction in enumerate(("dispatch", "combine")):
                src, dst, size, task = layer_messages(sets, msg, holders, agg, pi,
                                                      direction=direction)
                keys = layer_flow_keys(3, task, src, 1 + trial)
                fast = simulate_messages(topo, src, dst, size, flow_keys=keys, **kw)
                assert comm.makespan_s[p] == fast.makespan_s
                assert np.array_equal(comm.link_busy_s[p], fast.link_busy_s)
                assert_same(fast, simulate_messages_oracle(topo, src, dst, size, flow_keys=keys,
                                                           **kw))


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

    (a1, c1), (a2, c2), (a3, _) = run(9), run(9), run(10)
    assert np.array_equal(a1, a2) and c1.makespan_s == c2.makespan_s
    assert np.array_equal(c1.link_busy_s, c2.link_busy_s)
    assert not np.array_equal(a1, a3)


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


def _layers_case(kind: str, num_runs: int = 9, layers: np.ndarray | None = None):
    """Topology, runs and options of a batched call (fat tree: several routes per pair);
    ``layers`` fixes the runs' layers (default: ``num_runs`` random ones)."""
    rng = np.random.default_rng(8)
    topo = make_topology(kind, HW48)
    L, E, k, T, D = 3, 16, 3, 24, 32
    masks = rng.random((L, E, D)) < 0.08
    for layer in range(L):
        masks[layer, np.arange(E), rng.integers(0, D, E)] = True
    pis = np.stack([rng.permutation(D) for _ in range(L)])
    if layers is None:
        layers = rng.integers(0, L, num_runs)
    sets = np.stack([np.array([rng.choice(E, k, replace=False) for _ in range(T)])
                     for _ in layers])
    aggs = np.stack([choose_aggregators(sets[j], masks[layer], "uniform", rng)
                     for j, layer in enumerate(layers)])
    msg = rng.choice([512.0, 1024.0], T)
    opts = dict(switching="cut_through", hop_latency_s=2e-9, ni_bw_Bps=2e10, tie_break="ref",
                chunks=2)
    return topo, (sets, msg, masks, pis, aggs, layers), opts


@pytest.mark.parametrize("kind,opts", [
    ("mesh", dict()),
    ("torus", dict(tie_break="ref", chunks=2, hop_latency_s=2e-9, alpha_s=1e-7)),
    ("mesh", dict(switching="cut_through", hop_latency_s=2e-9, ni_bw_Bps=5e10,
                  ni_latency_s=1.5e-9, phases=("combine",))),
    # ports on a topology with several routes per pair (the batched call builds every
    # route's port list once), ref ties and chunks
    ("fattree", dict(switching="cut_through", hop_latency_s=2e-9, ni_bw_Bps=2e10,
                   tie_break="ref", chunks=2)),
])
def test_simulate_layers_comm_equals_one_run_per_layer(kind, opts):
    """The batched entry (one compiled call) gives every run's makespans and busy times bit
    for bit as ``simulate_layer_comm`` of that run."""
    topo, (sets, msg, masks, pis, aggs, layers), _ = _layers_case(
        kind, layers=np.array([2, 0, 2, 1, 1]))
    D = masks.shape[2]
    makespan, busy = simulate_layers_comm(topo, sets, msg, masks, pis, aggs, layers, **opts)
    for j, layer in enumerate(layers.tolist()):
        one = simulate_layer_comm(topo, sets[j], msg, masks[layer], pis[layer], aggs[j],
                                  layer=layer, **opts)
        assert tuple(makespan[j].tolist()) == one.makespan_s
        np.testing.assert_array_equal(busy[j], one.link_busy_s)
    bad = aggs.copy()
    bad[3, 0] = D                                               # cluster out of range
    with pytest.raises(ConfigError, match="run 3"):
        simulate_layers_comm(topo, sets, msg, masks, pis, bad, layers, **opts)


@pytest.mark.parametrize("threads", [1, 2])
def test_simulate_layers_comm_per_run_masks_and_extra_holders(threads):
    """``mask_of`` / ``extra_holders`` (the vector env's pre-broadcast steps): every run equals
    ``simulate_layer_comm`` with its own holder mask and extra holders, bit for bit, on one or
    more threads (capped at numba's pool); padding the extra holders with −1 changes nothing;
    a bad shape or row is a ConfigError."""
    threads = min(threads, int(numba.config.NUMBA_NUM_THREADS))
    topo, (sets, msg, masks, pis, aggs, layers), opts = _layers_case(
        "fattree", layers=np.array([2, 0, 2, 1, 1, 0]))
    rng = np.random.default_rng(3)
    n, T, D = sets.shape[0], sets.shape[1], masks.shape[2]
    own = masks[layers].copy()                       # one mask per run, some rows zeroed
    own[:, :2] = False
    own[:, 2:, 0] |= True                            # every other expert keeps a holder
    width = [1, 3, 0, 2, 1, 2]
    extras = np.full((n, T, 3), -1, dtype=np.int64)
    for j in range(n):
        if width[j]:
            extras[j, :, :width[j]] = rng.integers(-1, D, (T, width[j]))
    runs_aggs = np.stack([choose_aggregators(sets[j], own[j], "uniform", rng, extras[j])
                          for j in range(n)])
    makespan, busy = simulate_layers_comm(topo, sets, msg, own, pis, runs_aggs, layers,
                                          mask_of=np.arange(n), extra_holders=extras,
                                          threads=threads, **opts)
    for j, layer in enumerate(layers.tolist()):
        one = simulate_layer_comm(topo, sets[j], msg, own[j], pis[layer], runs_aggs[j],
                                  layer=layer, extra_holders=extras[j, :, :width[j]], **opts)
        assert tuple(makespan[j].tolist()) == one.makespan_s
        np.testing.assert_array_equal(busy[j], one.link_busy_s)
    assert makespan.min() > 0
    with pytest.raises(ConfigError, match="mask_of"):
        simulate_layers_comm(topo, sets, msg, own, pis, runs_aggs, layers,
                             mask_of=np.arange(n) + 1, extra_holders=extras, **opts)
    with pytest.raises(ConfigError, match="extra_holders"):
        simulate_layers_comm(topo, sets, msg, own, pis, runs_aggs, layers,
                             mask_of=np.arange(n), extra_holders=extras[:, :2], **opts)


@pytest.mark.parametrize("rule", ["ref", "uniform", "first"])
def test_aggregators_many_equal_choose_aggregators_and_the_stream(rule):
    """Compiled draws on each generator's PCG64 state: the same aggregators and the same
    stream position as ``choose_aggregators`` with that generator, run by run; a run with a
    token without a held expert stops the call before drawing anything for it."""
    rng = np.random.default_rng(3)
    L, E, D, k, T = 3, 12, 8, 3, 40
    masks = rng.random((L, E, D)) < 0.25
    masks[0] |= np.eye(E, D, dtype=bool)                  # layer 0: every expert held
    masks[1, :3] = False                                  # layer 1: experts 0..2 unheld
    tables = [HolderTable.from_shares(m) for m in masks]
    arrays = holder_arrays(tables)
    layers = np.array([0, 1, 2, 1, 0, 2, 2])
    sets = np.stack([np.array([rng.choice(np.arange(3, E), k, replace=False)
                               for _ in range(T)]) for _ in layers])
    sets[3, :5, 0] = [0, 1, 2, 0, 1]                      # unheld experts among held ones
    ref = [np.random.default_rng(100 + j) for j in range(layers.size)]
    got = [np.random.default_rng(100 + j) for j in range(layers.size)]
    states = np.array([g.bit_generator.ctypes.state_address for g in got], dtype=np.uint64)
    out, stop = aggregators_many(sets, layers, arrays, rule, states)
    assert stop == -1
    for j, layer in enumerate(layers.tolist()):
        want = choose_aggregators(sets[j], tables[layer], rule, ref[j])
        np.testing.assert_array_equal(out[j], want)
        assert got[j].random() == ref[j].random()        # same stream position after
    orphan = sets.copy()
    orphan[2, 7] = [0, 1, 2]                              # only unheld experts (layer 2 holds
    masks2 = masks.copy()                                 # them? make sure it does not)
    masks2[2, :3] = False
    arrays2 = holder_arrays([HolderTable.from_shares(m) for m in masks2])
    before = [g.bit_generator.state for g in got]
    _, stop = aggregators_many(orphan, layers, arrays2, rule, states)
    assert stop == 2
    assert got[2].bit_generator.state == before[2]       # nothing drawn for the stopping run


def _kernel_outputs(kernel, topo, sets, msg, masks, pis, aggs, layers):
    """Call a batched layer kernel directly (cut-through, ports, ref ties, 2 chunks)."""
    n = layers.size
    busy = np.zeros((n, 2, topo.num_links))
    makespan = np.zeros((n, 2))
    counts = np.zeros((n, 2), dtype=np.int64)
    extras = np.zeros((n, sets.shape[1], 0), dtype=np.int64)
    bad = kernel(sets, masks, layers, extras, pis, aggs, layers, msg, 2, topo.pair_route_ptr,
                 topo.route_ptr,
                 topo.route_links, topo.link_bw_Bps, topo.route_lex_rank, 2e-9, True,
                 topo.num_endpoints, np.array([0, 1]), busy, makespan, counts, True, 2e10,
                 0.0, *linksim._port_arrays(topo, 2e10))
    return bad, makespan, busy, counts


def test_parallel_layers_kernel_equals_the_serial_one():
    """The prange kernel (here on numba's current thread count) gives the serial kernel's
    outputs bit for bit and the same first invalid run, also when several runs are invalid."""
    topo, (sets, msg, masks, pis, aggs, layers), _ = _layers_case("fattree")
    serial = _kernel_outputs(linksim._layers_kernel, topo, sets, msg, masks, pis, aggs, layers)
    par = _kernel_outputs(linksim._layers_kernel_par, topo, sets, msg, masks, pis, aggs, layers)
    assert serial[0] == par[0] == -1
    for a, b in zip(serial[1:], par[1:]):
        np.testing.assert_array_equal(a, b)
    assert serial[1].min() > 0
    bad = aggs.copy()
    bad[[6, 3, 8], 0] = 32                                      # clusters out of range
    assert _kernel_outputs(linksim._layers_kernel_par, topo, sets, msg, masks, pis, bad,
                           layers)[0] == 3
    assert _kernel_outputs(linksim._layers_kernel, topo, sets, msg, masks, pis, bad,
                           layers)[0] == 3


def test_simulate_layers_comm_threads_one_and_pool_size_agree():
    """``threads`` = numba's pool size (1 when the tests run with NUMBA_NUM_THREADS=1) gives
    the results of ``threads=1``; an invalid run is named either way."""
    import numba

    topo, args, opts = _layers_case("torus")
    limit = numba.config.NUMBA_NUM_THREADS
    ref = simulate_layers_comm(topo, *args, **opts)
    got = simulate_layers_comm(topo, *args, threads=limit, **opts)
    np.testing.assert_array_equal(ref[0], got[0])
    np.testing.assert_array_equal(ref[1], got[1])
    bad = list(args)
    bad[4] = args[4].copy()
    bad[4][5, 1] = -1
    with pytest.raises(ConfigError, match="run 5"):
        simulate_layers_comm(topo, *bad, threads=limit, **opts)


_TWO_THREADS = """
import numpy as np, numba
from tests.hdamoe_env.noc.test_linksim import _layers_case, simulate_layers_comm
assert numba.config.NUMBA_NUM_THREADS == 2
topo, args, opts = _layers_case("fattree", 16)
ref = simulate_layers_comm(topo, *args, **opts)
got = simulate_layers_comm(topo, *args, threads=2, **opts)
assert numba.get_num_threads() == 2                  # restored (the pool's default)
assert (ref[0] == got[0]).all() and (ref[1] == got[1]).all() and ref[0].min() > 0
import os
print("equal", numba.threading_layer(), os.environ.get("OMP_WAIT_POLICY"))
"""


@pytest.mark.parametrize("policy", [None, "active"])
def test_simulate_layers_comm_with_two_threads_is_bit_identical(policy):
    """In a process with a pool of two numba threads, ``threads=2`` (the prange kernel on
    two threads) equals ``threads=1`` bit for bit; the first threaded call takes the first
    available layer of ``THREADING_LAYERS`` and sets ``OMP_WAIT_POLICY`` only if unset."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {key: value for key, value in os.environ.items()
           if key not in ("NUMBA_THREADING_LAYER", "OMP_WAIT_POLICY")}
    env.update(NUMBA_NUM_THREADS="2",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    done = subprocess.run([sys.executable, "-c", _TWO_THREADS], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    word, layer, wait = done.stdout.split()
    assert word == "equal"
    assert layer in linksim.THREADING_LAYERS
    assert wait == (policy or linksim.OMP_WAIT_POLICY)


@pytest.mark.parametrize("value,match", [(0, "threads must be an integer >= 1, got 0"),
                                         (-2, "got -2"), (1.5, "got 1.5"), (True, "got True"),
                                         ("2", "got '2'")])
def test_bad_threads_are_config_errors(value, match):
    topo, args, opts = _layers_case("mesh", 2)
    with pytest.raises(ConfigError, match=match):
        simulate_layers_comm(topo, *args, threads=value, **opts)


def test_threads_above_the_pool_name_the_limit_and_the_fix():
    import numba

    limit = numba.config.NUMBA_NUM_THREADS
    with pytest.raises(ConfigError, match=rf"des_threads={limit + 1} exceeds numba's thread "
                                          rf"pool of {limit}.*NUMBA_NUM_THREADS={limit + 1}"):
        linksim.check_threads(limit + 1, "des_threads")


def test_numba_threads_restores_the_count():
    import numba

    before = numba.get_num_threads()
    with linksim.numba_threads(1):
        assert numba.get_num_threads() == 1
    assert numba.get_num_threads() == before
    with pytest.raises(RuntimeError), linksim.numba_threads(1):
        raise RuntimeError("inside")
    assert numba.get_num_threads() == before
