"""Tests of baselines.eplb: EPLB redundant experts (replica counts, slots, packing, placement);
values worked out by hand."""

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
from hdamoe_env.config.errors import InfeasibleError
from hdamoe_env.sim.placement import Placement, check_memory, expert_parallel
from hdamoe_env.config.profiles import get_profile

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


