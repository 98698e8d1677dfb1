"""Greedy pre-broadcast: priority on the most congested node (paper-model.md §10.3–10.5, §10.9)."""

from __future__ import annotations

import numpy as np
import pytest

from agents import GreedyPreBroadcastAgent, make_agent
from agents import prebroadcast as prebroadcast_module
from hdamoe_env.config.specs import HardwareSpec
from hdamoe_env.cost import perf


def _obs(P, counts, batch, k_b, max_broadcast=8):
    return {"replicas": np.asarray(P, np.float32),
            "pred_load": (np.asarray(counts, np.float64) / batch).astype(np.float32),
            "budget": np.array([k_b / max_broadcast], np.float32),
            "layer": np.array([1.0], np.float32)}


#: The fluid compute model of §5.2 (the paper's priorities); the tile model has its own test.
FLUID = "faithful+tile_tokens=1+tile_cols=1+gemm_overhead_s=0"


@pytest.fixture
def agent(tiny_agent_model):
    return GreedyPreBroadcastAgent(tiny_agent_model, HardwareSpec(mesh_shape=(1, 2)), FLUID,
                                   batch=16)


def test_tile_model_priorities_count_padded_tiles(tiny_agent_model):
    """faithful: 5 and 3 tokens on node 0 are two 8-token tiles, 6 tokens on node 1 one tile;
    expert 0 and 1 each free a whole tile, and the highest id wins the tie (§10.5)."""
    tiled = GreedyPreBroadcastAgent(tiny_agent_model, HardwareSpec(mesh_shape=(1, 2)),
                                    batch=16)
    assert tiled.conv.tiled and tiled.conv.tile_tokens == 8
    assert tiled.choose_broadcast(_obs(EP, [5, 3, 6, 0], 16, k_b=1)) == [1]
    # 9 tokens of expert 2: the fluid model finds node 1 congested (9 > 8) and picks it; in
    # tiles both nodes run 16 token rows, node 0 in two GEMM sets: it stays the congested one
    fluid = GreedyPreBroadcastAgent(tiny_agent_model, HardwareSpec(mesh_shape=(1, 2)), FLUID,
                                    batch=16)
    assert fluid.choose_broadcast(_obs(EP, [5, 3, 9, 0], 16, k_b=1)) == [2]
    assert tiled.choose_broadcast(_obs(EP, [5, 3, 9, 0], 16, k_b=1)) == [1]


# EP on 2 nodes: experts 0, 1 on node 0; experts 2, 3 on node 1.
EP = [[1, 0], [1, 0], [0, 1], [0, 1]]


def test_picks_the_hottest_expert_of_the_congested_node(agent):
    # node 0 is congested (5 + 3 = 8 > 6 + 0) although the hottest expert overall (2) is on node 1
    action, _ = agent.predict(_obs(EP, [5, 3, 6, 0], 16, k_b=1))
    assert action[0] == 0
    assert (action[1:8] == 4).all()
    assert action[8] == agent.layout.rule_index("least_loaded")
    assert action[9] == 0                                   # gating off


def test_repeated_selection_moves_to_the_next_congested_node(agent):
    # after expert 0 leaves node 0 (3 left) node 1 (6) is the congested one: expert 2 is next
    assert agent.choose_broadcast(_obs(EP, [5, 3, 6, 0], 16, k_b=2)) == [0, 2]


def test_budget_zero_and_zero_priority(agent):
    assert agent.choose_broadcast(_obs(EP, [5, 3, 6, 0], 16, k_b=0)) == []
    # faithful skips zero-priority experts and stops early (§10.5 [decision])
    assert agent.choose_broadcast(_obs(EP, [4, 0, 0, 0], 16, k_b=3)) == [0]


def test_experts_held_everywhere_are_not_broadcast(agent):
    P = [[0.5, 0.5], [1, 0], [0, 1], [0, 1]]           # expert 0 is split over both nodes
    chosen = agent.choose_broadcast(_obs(P, [12, 5, 3, 1], 16, k_b=1))
    assert chosen == [1]


def test_bookkeeping_defaults_follow_the_profile_and_are_passed(monkeypatch, tiny_agent_model):
    seen = {}

    def fake(P, counts, w, C, k_b, **kw):
        seen.update(kw, k_b=k_b, w=w, C=C, counts=counts)
        return []

    monkeypatch.setattr(prebroadcast_module, "priority_broadcast", fake)
    faithful = GreedyPreBroadcastAgent(tiny_agent_model, batch=16)
    paper = GreedyPreBroadcastAgent(tiny_agent_model, conventions="paper", batch=16)
    assert (faithful.ref_bookkeeping, faithful.skip_zero_priority) == (False, True)
    assert (paper.ref_bookkeeping, paper.skip_zero_priority) == (True, False)
    assert paper.w == faithful.w / 3                       # F_e = 2·m·h·I, m = 1 vs 3
    forced = GreedyPreBroadcastAgent(tiny_agent_model, batch=16, ref_bookkeeping=True)
    forced.predict(_obs(EP, [5, 3, 6, 0], 16, k_b=2))
    assert seen["ref_bookkeeping"] is True and seen["skip_zero_priority"] is True
    assert seen["k_b"] == 2
    np.testing.assert_allclose(seen["counts"], [5, 3, 6, 0], rtol=1e-6)


def test_in_the_env_matches_a_hand_computation(make_tiny_env):
    env = make_tiny_env(k_b=1)
    agent = make_agent("greedy-prebroadcast", env=env)
    obs, _ = env.reset(seed=3)
    done, checked = False, 0
    while not done:
        action, _ = agent.predict(obs, action_masks=env.action_masks())
        if env.current_layer > 0 and obs["pred_load"].any():
            P = obs["replicas"].astype(np.float64)
            # the tile model of the env's profile: seconds of every shard at the predicted counts
            counts = obs["pred_load"].astype(np.float64) * env.batch
            cols = P * env.model.expert_intermediate
            shard = (perf.gemm_tile_time(counts[:, None], cols, env.model, env.hw, env.conv)
                     if env.conv.tiled else P * counts[:, None])
            node = int(np.argmax(shard.sum(axis=0)))
            prio = shard[:, node]
            expected = len(prio) - 1 - int(np.argmax(prio[::-1]))
            assert action[0] == expected
            checked += 1
        obs, _, term, trunc, info = env.step(action)
        done = term or trunc
    assert checked >= 1
    assert info["episode_tbt_us"] > 0
