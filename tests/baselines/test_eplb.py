"""EPLB redundant experts (baselines/eplb.py, eplb_dynamic.py); values worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from baselines.eplb import (
    balanced_packing,
    eplb,
    eplb_placement,
    eplb_slots,
    expected_node_load,
    replicate,
)
from baselines.eplb_dynamic import Move, apply_moves, eplb_dynamic, plan_moves, simulate_moves
from baselines.store import PlacementStore, StoreConfig
from hdamoe_env.config.errors import ConfigError, InfeasibleError
from hdamoe_env.sim.placement import Placement, check_memory, expert_parallel
from hdamoe_env.config.profiles import get_profile
from hdamoe_env.noc.topology import make_topology

SKEWED = [8.0, 4.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0]


def test_replica_counts_small_case():
    """Loads [6, 2, 1, 1], D=3, S=2: 6 slots, 2 extra copies both go to expert 0.

    Per copy [6, 2, 1, 1] -> expert 0 gets a 2nd copy (3) -> still the largest (3 > 2) -> a 3rd
    (2). Counts [3, 1, 1, 1]; per-copy loads 2, 2, 2 | 2 | 1 | 1. Packing (heaviest first, least
    loaded node, ties lower id): e0 -> n0, n1, n2; e1 -> n0; e2 -> n1; e3 -> n2: loads [4, 3, 3].
    """
    res = eplb([6, 2, 1, 1], num_nodes=3, slots_per_node=2)
    assert res.counts.tolist() == [[3, 1, 1, 1]]
    assert res.holds[0].astype(int).tolist() == [[1, 1, 1], [1, 0, 0], [0, 1, 0], [0, 0, 1]]
    np.testing.assert_allclose(res.node_load(), [[4.0, 3.0, 3.0]])


def test_copies_capped_at_node_count():
    """Loads [6, 2, 1, 1], D=2, S=3: expert 0 may have at most D=2 copies (no node holds two).

    Per copy [6, 2, 1, 1] -> e0 x2 (3) -> e0 capped, e1 x2 (1): counts [2, 2, 1, 1] (6 slots).
    Packing: e0 (3) -> n0, n1; e1 (1) -> n0, n1; e2 -> n0; e3 -> n1: loads [5, 5].
    """
    res = eplb([6, 2, 1, 1], num_nodes=2, slots_per_node=3)
    assert res.counts.tolist() == [[2, 2, 1, 1]]
    np.testing.assert_allclose(res.node_load(), [[5.0, 5.0]])
    assert replicate([6, 2, 1, 1], 100, 2).tolist() == [2, 2, 2, 2]   # E·cap slots at most


def test_slot_budget_respected_exactly(rng):
    loads = rng.gamma(0.5, size=(3, 24))
    res = eplb(loads, num_nodes=8, slots_per_node=4)
    per_node = res.holds.sum(axis=1)
    assert per_node.max() <= 4 and per_node.sum() == 3 * 32
    # no duplicate copies: the bool mask holds exactly the counted copies
    np.testing.assert_array_equal(res.holds.sum(axis=2), res.counts)
    assert (res.counts >= 1).all() and res.fallback_layers == ()


def test_balance_on_skewed_case_beats_ep():
    """Loads [8, 4, 2, 2, 1, 1, 1, 1] (sum 20), D=4, S=3: 12 slots, 4 extra copies.

    Replication: e0 -> 2 (4); tie 4 = 4, lower id e0 -> 3 (2.67); e1 -> 2 (2); e0 -> 4 (2):
    counts [4, 2, 1, 1, 1, 1, 1, 1], per copy 2 except 1 for e4..e7. Packing: e0 on all four
    nodes, e1 on n0, n1, e2 on n2, e3 on n3 (all at 4), then the four 1s one per node:
    [5, 5, 5, 5] = the mean. EP (2 whole experts per node) has max >= 8 (expert 0 alone).
    """
    res = eplb(SKEWED, num_nodes=4, slots_per_node=3)
    assert res.counts.tolist() == [[4, 2, 1, 1, 1, 1, 1, 1]]
    np.testing.assert_allclose(res.node_load(), [[5.0] * 4])
    ep = expert_parallel(1, 8, 4, np.random.default_rng(0))
    ep_load = expected_node_load(ep, np.array([SKEWED]))
    assert ep_load.max() >= 8.0 > res.node_load().max()
    np.testing.assert_allclose(expected_node_load(eplb_placement(res), [SKEWED]),
                               res.node_load())


def test_infeasible_slot_budget():
    with pytest.raises(InfeasibleError, match=r"E=5.*ceil\(E/D\) = 3"):
        eplb([1.0] * 5, num_nodes=2, slots_per_node=2)
    # Mixtral-like E=8 on D=32 whole copies need S=1 = rho·8/32 -> rho >= 4
    with pytest.raises(InfeasibleError, match="rho_mem >= 4"):
        eplb_slots(8, 32, rho_mem=1.5)
    assert eplb_slots(8, 32, rho_mem=4.0) == 1 and eplb_slots(8, 32) == 1
    # DeepSeek-V2-Lite on 4x8: floor(rho·64/32)
    assert [eplb_slots(64, 32, rho_mem=r) for r in (1.25, 1.5, 2.0)] == [2, 3, 4]
    assert eplb_slots(64, 32) == 3


def test_repair_swap_when_free_slots_share_one_node():
    """3 bins x 3 slots; items [10, 1, 1, 1, 1, 1, 1, .5, .5], the two .5s copies of expert 7.

    10 -> b0; the six 1s alternate b1, b2 (ties: lower bin) until both are full; first .5 ->
    b0; the second has no legal bin (only b0 has room, and it holds expert 7): the lightest
    full bin lacking 7 (b1) gives its first item (1, expert 1) to b0, and the .5 takes b1.
    """
    bins, fallback = balanced_packing([10, 1, 1, 1, 1, 1, 1, .5, .5], 3, 3,
                                      [0, 1, 2, 3, 4, 5, 6, 7, 7])
    assert not fallback
    assert bins.tolist() == [0, 0, 2, 1, 2, 1, 2, 0, 1]


def test_hierarchical_keeps_groups_in_node_groups():
    """Expert groups {0,1}=12, {2,3}=4, {4,5}=2, {6,7}=2 into 2 node groups of 2 groups each.

    12 -> NG0; 4 -> NG1; 2 ({4,5}) -> NG1 (4 < 12); 2 ({6,7}) -> NG0 (NG1 is full). NG0 = nodes
    0-1 holds experts 0, 1, 6, 7; NG1 = nodes 2-3 holds 2, 3, 4, 5.
    """
    res = eplb(SKEWED, num_nodes=4, slots_per_node=3, num_node_groups=2, num_expert_groups=4)
    assert res.node_group_of_expert.tolist() == [[0, 0, 1, 1, 1, 1, 0, 0]]
    holds = res.holds[0]
    assert not holds[[0, 1, 6, 7]][:, 2:].any() and not holds[[2, 3, 4, 5]][:, :2].any()
    assert holds.sum(axis=0).max() <= 3
    # singleton groups: every expert still inside one node group
    res = eplb(np.arange(1.0, 9.0), num_nodes=4, slots_per_node=2, num_node_groups=2)
    for e, g in enumerate(res.node_group_of_expert[0]):
        assert res.holds[0, e, 2 * g:2 * g + 2].sum() == res.counts[0, e]


def test_placement_memory_validate_roundtrip(nb_model, hw22, tmp_path):
    conv = get_profile("faithful")
    S = eplb_slots(4, 4, rho_mem=2.0)                        # floor(2·4/4) = 2
    res = eplb([[4, 2, 1, 1], [1, 1, 1, 5]], 4, S)
    pl = eplb_placement(res)
    assert pl.method == "eplb" and pl.has_replicas
    np.testing.assert_array_equal(pl.copies(), res.counts)
    pl.validate(nb_model, hw22)
    check_memory(pl, nb_model, hw22, conv, rho_mem=2.0)
    with pytest.raises(InfeasibleError):
        check_memory(pl, nb_model, hw22, conv, rho_mem=1.0)
    back = Placement.load(pl.save(tmp_path / "eplb.npz"))
    np.testing.assert_array_equal(back.P, pl.P)
    np.testing.assert_array_equal(back.replicas, pl.replicas)
    assert back.meta["slots_per_node"] == 2


def test_deterministic(rng):
    loads = rng.random((2, 16))
    a, b = eplb(loads, 8, 3, num_node_groups=2), eplb(loads.copy(), 8, 3, num_node_groups=2)
    np.testing.assert_array_equal(a.holds, b.holds)
    np.testing.assert_array_equal(a.counts, b.counts)


def test_dynamic_no_moves_when_loads_constant():
    steps = np.tile(np.array(SKEWED), (12, 1))
    sched = eplb_dynamic(steps, period=4, num_nodes=4, slots_per_node=3)
    assert sched.starts == (0, 4, 8) and len(sched.placements) == 3
    assert all(m == () for m in sched.moves)
    np.testing.assert_array_equal(sched.placements[0].P, sched.placements[2].P)


def test_dynamic_moves_turn_old_into_new(rng):
    steps = rng.gamma(0.3, size=(9, 2, 12)) * 10
    sched = eplb_dynamic(steps, period=3, num_nodes=6, slots_per_node=3,
                         initial_loads=np.ones((2, 12)), mode="full")
    for k, moves in enumerate(sched.moves):
        old, new = sched.results[k].holds, sched.results[k + 1].holds
        assert len(moves) == int((new & ~old).sum())
        np.testing.assert_array_equal(apply_moves(old, moves, old & ~new), new)
        # relabelling never does worse than the raw EPLB labels
        raw = eplb(steps[3 * k:3 * k + 3].sum(axis=0), 6, 3).holds
        assert len(moves) <= int((raw & ~old).sum())


def test_dynamic_incremental_moves_only_what_changed():
    """E = 4, D = 4, S = 2; uniform start: 2 copies each, nodes {0,2} {0,2} {1,3} {1,3}.

    The window then sees loads [10, 1, 1, 1]: replication of 8 copies (cap 4 per expert) gives
    counts [4, 2, 1, 1] (expert 0: 10 → 5 → 3.33 → 2.5 per copy, then capped; expert 1 next).
    Expert 2 drops its copy on node 0 (the most loaded holder, ties: lower id), expert 3 on
    node 2; expert 0 takes node 2's free slot; node 0's free slot holds expert 0 already, so
    expert 1 moves from node 3 to node 0 and expert 0 takes node 3: 3 moves (no 2-move
    solution exists from this start). Nodes {0,1} {0,2} {0,1} {0,3} with per-copy loads 2.5,
    0.5, 1, 1: max 3.5 (before: 10 + 1 = 11 per node holding expert 0, window loads ÷ 2).
    """
    start = np.ones((1, 4))
    steps = np.tile(np.array([10.0, 1.0, 1.0, 1.0]), (6, 1))
    sched = eplb_dynamic(steps, period=2, num_nodes=4, slots_per_node=2, initial_loads=start)
    old, new = sched.results[0].holds[0], sched.results[1].holds[0]
    assert old.sum(axis=1).tolist() == [2, 2, 2, 2]
    assert new.sum(axis=1).tolist() == [4, 2, 1, 1]
    assert new.sum(axis=0).max() <= 2
    assert [(m.expert, m.dst) for m in sched.moves[0]] == [(0, 2), (0, 3), (1, 0)]
    assert sched.moves[1] == ()                                # steady loads: nothing moves
    w = np.array([10.0, 1, 1, 1]) / new.sum(axis=1)
    assert (w @ new).max() == pytest.approx(3.5)
    full = eplb_dynamic(steps, period=2, num_nodes=4, slots_per_node=2, initial_loads=start,
                        mode="full")
    assert len(full.moves[0]) >= len(sched.moves[0])
    with pytest.raises(ConfigError, match="rebalance mode"):
        eplb_dynamic(steps, period=2, num_nodes=4, slots_per_node=2, mode="sticky")


def test_move_cost_on_the_noc(hw22):
    """One 1 MB expert between neighbours of a 2x2 mesh at 1 GB/s: 1 ms; two disjoint: 1 ms."""
    topo = make_topology("mesh", hw22)
    one = simulate_moves(topo, [Move(0, 0, 0, 1)], 1e6)
    assert one.makespan_s == pytest.approx(1e-3)
    two = simulate_moves(topo, [Move(0, 0, 0, 1), Move(0, 1, 2, 3)], 1e6)
    assert two.makespan_s == pytest.approx(1e-3)
    assert simulate_moves(topo, [], 1e6).makespan_s == 0.0
    moves = plan_moves(np.array([[[1, 0, 0, 0]]], bool), np.array([[[1, 0, 0, 1]]], bool))
    assert moves == [Move(0, 0, 0, 3)]


def test_store_resolves_eplb(nb_model, hw22, make_trace):
    trace = make_trace(2, 4, 2, 200)
    store = PlacementStore(StoreConfig.create(model=nb_model, mesh="2x2", setting="1/1",
                                       eplb_rho_mem=2.0), trace)
    pl, artifact = store.get("eplb")
    assert artifact is None and pl.method == "eplb"
    assert (pl.copies().sum(axis=1) == 8).all()               # D·S = 4·2 physical experts
    check_memory(pl, nb_model, hw22, get_profile("faithful"), rho_mem=2.0)
    assert store.get("eplb")[0] is pl                         # kept in memory


def test_place_method_eplb_cli(tmp_path, capsys):
    """Mixtral (E=8) on a 2x2 mesh, rho_mem 1.5: S = floor(1.5·8/4) = 3, 12 physical experts."""
    from hdamoe_env.app.cli import main as hdamoe_main

    argv = ["place", "--model", "mixtral", "--mesh", "2x2", "--requests", "2", "--method",
            "eplb", "--rho-mem", "1.5", "--layers", "0-1", "--out", str(tmp_path)]
    assert hdamoe_main(argv) == 0
    out = capsys.readouterr().out
    assert "EPLB max/mean" in out and "S=3" in out and "12 physical experts" in out
    pl = Placement.load(tmp_path / "placement_eplb.npz")
    assert pl.method == "eplb" and (pl.copies().sum(axis=1) == 12).all()
    assert hdamoe_main(argv) == 2                              # refuses to overwrite
    assert "already exists" in capsys.readouterr().err
    # whole copies of 8 experts on 32 nodes do not fit rho_mem 1.5: one-line typed error
    assert hdamoe_main([*argv[:4], "4x8", *argv[5:-1], str(tmp_path / "b")]) == 2
    assert "rho_mem >= 4" in capsys.readouterr().err
