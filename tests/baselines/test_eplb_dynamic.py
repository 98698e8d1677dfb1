"""Tests of baselines.eplb_dynamic: incremental EPLB rebalancing (moves, their application and their
cost on the NoC); values worked out by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from baselines.eplb import eplb
from baselines.eplb_dynamic import Move, apply_moves, eplb_dynamic, plan_moves, simulate_moves
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.noc.topology import make_topology

SKEWED = [8.0, 4.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0]


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


def test_move_cost_follows_switching_and_ports(hw22):
    """2x2 mesh at 1 GB/s, hop latency 0, 1 MB experts (1 ms per link or port crossing).

    * 0 → 3 (two hops): store-and-forward 2 ms, cut-through 1 ms (the body follows the head);
    * 0 → 1 and 0 → 2 (one source, two different links): without ports both leave at once,
      1 ms; with one injection port per node (1 GB/s) they leave one after the other, 2 ms under
      either switching (cut-through: 1 + 1 ms; store-and-forward: port, link, port = 3 ms for
      the first, the second waits 1 ms for the port: 4 ms).
    """
    topo = make_topology("mesh", hw22)
    diag = [Move(0, 0, 0, 3)]
    assert simulate_moves(topo, diag, 1e6).makespan_s == pytest.approx(2e-3)
    assert simulate_moves(topo, diag, 1e6, switching="cut_through").makespan_s \
        == pytest.approx(1e-3)
    fan = [Move(0, 0, 0, 1), Move(0, 1, 0, 2)]
    assert simulate_moves(topo, fan, 1e6, switching="cut_through").makespan_s \
        == pytest.approx(1e-3)
    assert simulate_moves(topo, fan, 1e6, switching="cut_through",
                          ni_bw_Bps=1e9).makespan_s == pytest.approx(2e-3)
    assert simulate_moves(topo, fan, 1e6, ni_bw_Bps=1e9).makespan_s == pytest.approx(4e-3)
    with pytest.raises(ConfigError, match="switching"):
        simulate_moves(topo, diag, 1e6, switching="wormhole")
