"""Priority selection of the experts to pre-broadcast (paper-model.md §10.5, §10.9;
``hdamoe_env.decisions.broadcast``)."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.decisions.broadcast import priority_broadcast


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


def test_priority_with_tile_times_sees_padded_tiles():
    """9 + 9 tokens fill four 8-token tiles (32 rows), 20 tokens only three (24 rows)."""
    P = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    n = np.array([9.0, 20.0, 0.0, 9.0])
    assert priority_broadcast(P, n, 1.0, 1.0, 1) == [1]              # fluid: 20 > 18
    rows = np.ceil(n / 8) * 8
    shard_time = P * rows[:, None] + (P > 0) * (n[:, None] > 0) * 0.5
    assert priority_broadcast(P, n, 1.0, 1.0, 1, shard_time=shard_time) == [3]
    # then node 1 (24.5 s + the spread dispatch) is the congested one
    assert priority_broadcast(P, n, 1.0, 1.0, 2, shard_time=shard_time) == [3, 1]
    with pytest.raises(ConfigError, match="shard_time"):
        priority_broadcast(P, n, 1.0, 1.0, 1, shard_time=np.ones((2, 2)))
