"""Placements: TP/EP constructors (§9.1–9.2), validation, memory checks (§7.3), storage (§7.7)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError, HdMoeError, InfeasibleError
from hdamoe_env.config.profiles import PROFILES
from hdamoe_env.config.specs import HardwareSpec, get_model
from hdamoe_env.sim.placement import (Placement, check_memory, expert_parallel,
                                      import_reference_layers, node_weight_bytes, tensor_parallel)
from tests.hdamoe_env.sim.sample_placements import deepseek_ep_placement


def test_tp_rows_and_shape():
    p = tensor_parallel(3, 8, 32)
    assert p.P.shape == (3, 8, 32) and np.allclose(p.P, 1 / 32)
    assert (p.pi == np.arange(32)).all()


def test_ep_more_nodes_than_experts():  # Mixtral on 4×8: every expert over 4 random clusters
    p = expert_parallel(2, 8, 32, np.random.default_rng(0))
    assert ((p.P[0] > 0).sum(axis=1) == 4).all() and ((p.P[0] > 0).sum(axis=0) == 1).all()
    assert np.array_equal(p.P[0], p.P[1])
    assert not np.array_equal(p.pi[0], p.pi[1])


def test_ep_fewer_nodes_than_experts():  # DeepSeek on 4×8: 2 whole experts per node
    p = expert_parallel(1, 64, 32, np.random.default_rng(1))
    assert set(np.unique(p.P)) == {0.0, 1.0} and (p.P[0].sum(axis=0) == 2).all()
    q = expert_parallel(1, 10, 4, np.random.default_rng(1))
    assert sorted(q.P[0].sum(axis=0)) == [2, 2, 3, 3]


def test_ep_is_seeded():
    a = expert_parallel(4, 64, 32, np.random.default_rng(7))
    b = expert_parallel(4, 64, 32, np.random.default_rng(7))
    assert np.array_equal(a.P, b.P) and np.array_equal(a.pi, b.pi)


def test_validation_messages():
    P = np.full((1, 2, 2), 0.5)
    with pytest.raises(ConfigError, match=r"P\[0, 1, :\] sums to 1.5"):
        Placement(P=np.array([[[0.5, 0.5], [1.0, 0.5]]]), pi=np.array([[0, 1]]))
    with pytest.raises(ConfigError, match="not a permutation"):
        Placement(P=P, pi=np.array([[0, 0]]))
    with pytest.raises(ConfigError, match="shape"):
        Placement(P=P[0], pi=np.array([[0, 1]]))
    p = tensor_parallel(26, 64, 16)
    with pytest.raises(ConfigError, match="hardware has 32 nodes"):
        p.validate(get_model("deepseek-v2-lite"), HardwareSpec())
    with pytest.raises(ConfigError, match="L=26"):
        p.validate(get_model("mixtral-8x7b"))


def test_memory_checks():
    model = get_model("deepseek-v2-lite")
    conv = PROFILES["faithful"]
    ep = expert_parallel(26, 64, 32, np.random.default_rng(0))
    need = node_weight_bytes(ep, model, conv)
    assert np.allclose(need, 26 * 2 * 3 * 2048 * 1408 * 2)
    check_memory(ep, model, HardwareSpec(node_dram_gib=2.0), conv)
    with pytest.raises(InfeasibleError, match=r"needs 0\.84 GiB on node \d+ but node_dram_gib=0.5"):
        check_memory(ep, model, HardwareSpec(node_dram_gib=0.5), conv)
    check_memory(ep, model, HardwareSpec(), conv, rho_mem=1.0)
    P = ep.P.copy()
    P[:, :, :] = 0
    P[:, :, 0] = 1.0
    skew = ep.with_layers(P=P)
    with pytest.raises(InfeasibleError, match="rho_mem=1.5 allows 3.000"):
        check_memory(skew, model, HardwareSpec(), conv, rho_mem=1.5)


def test_save_load_roundtrip(tmp_path):
    p = expert_parallel(2, 8, 4, np.random.default_rng(3)).with_layers(seed=3, profile="paper")
    path = p.save(tmp_path / "sub" / "ep.npz")
    q = Placement.load(path)
    assert np.array_equal(p.P, q.P) and np.array_equal(p.pi, q.pi)
    assert q.method == "ep" and q.meta["seed"] == 3 and q.meta["profile"] == "paper"
    with pytest.raises(ConfigError, match="does not exist"):
        Placement.load(tmp_path / "missing.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(2))
    with pytest.raises(ConfigError, match="not a placement"):
        Placement.load(tmp_path / "other.npz")


def test_reference_importer():
    L, E, D = 2, 3, 4
    arrays = []
    for layer in range(L):
        a = np.zeros((L, E, D))
        a[layer] = 1.0 / D
        arrays.append(a)
    onehots = [np.eye(D)[[1, 0, 3, 2]].reshape(D, 2, 2) for _ in range(L)]
    p = import_reference_layers(arrays, onehots)
    assert np.allclose(p.P, 1 / D) and p.pi[0].tolist() == [1, 0, 3, 2]


def test_placement_by_name(tmp_path, tiny_model):  # §9.1–9.2, §7.7
    from hdamoe_env.sim.placement import placement_by_name

    tp = placement_by_name("tp", tiny_model, 4, 0)
    assert tp.method == "tp" and np.allclose(tp.P, 0.25)
    ep = placement_by_name("ep", tiny_model, 4, 7)
    ref = expert_parallel(2, 4, 4, np.random.default_rng(7))
    assert np.array_equal(ep.P, ref.P) and np.array_equal(ep.pi, ref.pi)
    assert ep.meta == {"seed": 7}
    assert placement_by_name("ep", tiny_model, 4, 7, record_seed=False).meta == {}
    path = ep.save(tmp_path / "ep.npz")
    back = placement_by_name(path, tiny_model, 4)
    assert np.array_equal(back.P, ep.P) and back.method == "ep"
    with pytest.raises(ConfigError, match="does not exist"):
        placement_by_name(tmp_path / "missing.npz", tiny_model, 4)


# ------------------------------------------------------------------------------ tile grid
def test_share_unit_of_the_presets_and_profiles():
    """u = tile_cols / I: 64/1408 = 1/22, 64/14336 = 1/224, 64/2560 = 1/40, 64/512 = 1/8."""
    from hdamoe_env.sim.placement import share_unit

    faithful = PROFILES["faithful"]
    assert faithful.tile_cols == 64
    assert PROFILES["paper"].tile_cols == 1 and PROFILES["paper-hd"].tile_cols == 1
    for key, U in (("deepseek", 22), ("mixtral", 224), ("qwen2", 40), ("qwen3.5", 8)):
        assert share_unit(get_model(key), faithful) == pytest.approx(1 / U, abs=0)
    assert share_unit(get_model("deepseek"), PROFILES["paper"]) == 1 / 1408
    # a tile that does not divide I: ceil(1408 / 100) = 15 tiles, the last one padded
    assert share_unit(get_model("deepseek"), faithful.derive(tile_cols=100)) == 1 / 15


def test_snap_shares_largest_remainder_hand_cases():
    """Units U = 4. Row (0.5, 0.3, 0.2) → (2, 1.2, 0.8) units: floors (2, 1, 0), one unit left,
    largest remainder 0.8 → (2, 1, 1). Row (1/3, 1/3, 1/3) → 4/3 each: floors (1, 1, 1), the left
    unit breaks the three-way tie on the lowest node → (2, 1, 1). Row (0.1, 0.9, 0) → (0.4, 3.6,
    0): floors (0, 3), remainders 0.4 and 0.6 → (0, 4, 0). On-grid rows are kept exactly."""
    from hdamoe_env.sim.placement import snap_shares

    P = np.array([[0.5, 0.3, 0.2], [1 / 3, 1 / 3, 1 / 3], [0.1, 0.9, 0.0], [0.25, 0.75, 0.0]])
    got = snap_shares(P, 0.25)
    assert np.array_equal(got * 4, [[2, 1, 1], [2, 1, 1], [0, 4, 0], [1, 3, 0]])
    assert np.array_equal((got * 4).sum(axis=1), [4, 4, 4, 4])
    # 22 units: 1/32 each → 0.6875 units: every floor is 0, the 22 largest remainders (ties →
    # lowest nodes) get one unit
    tp = snap_shares(np.full((1, 32), 1 / 32), 1 / 22)
    assert np.array_equal(np.rint(tp * 22)[0], [1] * 22 + [0] * 10)
    with pytest.raises(ConfigError, match="unit"):
        snap_shares(P, 0.0)


def test_placement_refuses_a_sliver_share():
    """53 of 1408 columns (0.0376) is not a whole tile of 64 columns: refused under faithful."""
    from hdamoe_env.sim.placement import check_tile_grid

    row = np.zeros(32)
    row[5], row[6] = 53 / 1408, 1355 / 1408
    p = deepseek_ep_placement(row)
    p.validate()                                                   # shape-only checks pass
    p.validate(get_model("deepseek"), None, PROFILES["paper"])     # 1/1408 grid: 53 columns
    sliver = np.zeros(32)
    sliver[5], sliver[6] = 0.0380001, 0.9619999                   # paper*: continuous, no check
    deepseek_ep_placement(sliver).validate(get_model("deepseek"), None, PROFILES["paper"])
    with pytest.raises(ConfigError, match=r"P\[3, 17, 5\] = 0\.0376 is not a multiple of the "
                                          r"tile unit 1/22 = 0\.0455 \(64 of 1408 columns\)"):
        p.validate(get_model("deepseek"), None, PROFILES["faithful"])
    with pytest.raises(ConfigError, match="snap_shares"):
        check_tile_grid(p, get_model("deepseek"), PROFILES["faithful"])


def test_tile_grid_accepts_tp_ep_and_on_grid_shards():
    from hdamoe_env.sim.placement import check_tile_grid, snap_shares

    model, conv = get_model("deepseek"), PROFILES["faithful"]
    check_tile_grid(tensor_parallel(model.num_moe_layers, 64, 32), model, conv)  # 1/32: exempt
    check_tile_grid(expert_parallel(model.num_moe_layers, 64, 32, np.random.default_rng(0)),
                    model, conv)
    row = np.zeros(32)
    row[5], row[6] = 7 / 22, 15 / 22
    check_tile_grid(deepseek_ep_placement(row), model, conv)
    # a nearly uniform row is not TP: 1/32 everywhere except two nodes is refused
    row = np.full(32, 1 / 32)
    row[0], row[1] = 1 / 32 + 0.01, 1 / 32 - 0.01
    with pytest.raises(ConfigError, match=r"P\[3, 17, 0\]"):
        check_tile_grid(deepseek_ep_placement(row), model, conv)
    check_tile_grid(deepseek_ep_placement(snap_shares(row, 1 / 22)), model, conv)


def _replicated():
    """2 layers, 3 experts, 4 clusters; EP-like primaries, expert 0 of layer 0 copied twice."""
    P = np.zeros((2, 3, 4))
    P[:, 0, 0] = P[:, 1, 1] = P[:, 2, 2] = 1.0
    reps = np.zeros((2, 3, 4), dtype=bool)
    reps[0, 0, [1, 3]] = True
    return P, reps


def test_replicas_count_copies_and_memory():
    P, reps = _replicated()
    pl = Placement(P=P, pi=np.tile(np.arange(4), (2, 1)), replicas=reps)
    assert pl.has_replicas
    assert pl.copies(0).tolist() == [3, 1, 1] and pl.copies().tolist() == [[3, 1, 1], [1, 1, 1]]
    # layer 0: node 1 holds expert 1 plus a copy of expert 0; node 3 only the copy
    assert pl.held_experts().tolist() == [[1, 2, 1, 1], [1, 1, 1, 0]]
    with pytest.raises(InfeasibleError, match="node 1 holds 2.000 experts"):  # cap 1.5·3/4
        check_memory(pl, get_model("deepseek-v2-lite"), HardwareSpec(), PROFILES["paper"],
                     rho_mem=1.5)
    # an all-False mask is no replicas at all
    assert Placement(P=P, pi=pl.pi, replicas=np.zeros_like(reps)).replicas is None
    assert pl.with_layers(replicas=None).replicas is None
    assert pl.with_layers(method="x").replicas is not None


def test_replicas_validation_names_the_clash():
    P, reps = _replicated()
    pi = np.tile(np.arange(4), (2, 1))
    reps[1, 2, 2] = True                                  # node 2 already holds expert 2
    with pytest.raises(ConfigError, match=r"replicas\[1, 2, 2\].*already holds a share"):
        Placement(P=P, pi=pi, replicas=reps)
    with pytest.raises(ConfigError, match="shape of P"):
        Placement(P=P, pi=pi, replicas=np.ones((2, 3, 5), dtype=bool))
    with pytest.raises(ConfigError, match="bool mask"):
        Placement(P=P, pi=pi, replicas=np.full((2, 3, 4), 0.5))


def test_replicas_save_load_roundtrip(tmp_path):
    P, reps = _replicated()
    pl = Placement(P=P, pi=np.tile(np.arange(4), (2, 1)), method="eplb", replicas=reps)
    back = Placement.load(pl.save(tmp_path / "r.npz"))
    assert back.replicas is not None and np.array_equal(back.replicas, reps)
    plain = Placement.load(pl.with_layers(replicas=None).save(tmp_path / "p.npz"))
    assert plain.replicas is None
    with np.load(tmp_path / "p.npz") as data:               # no replicas: still version 1
        assert '"format_version": 1' in bytes(data["meta"]).decode()


def test_float_pi_is_refused(tmp_path):
    """A float ``pi`` is refused, not truncated silently."""
    meta = np.frombuffer(json.dumps({"format": "hdamoe-placement", "format_version": 1}).encode(),
                         np.uint8)
    path = tmp_path / "p.npz"
    np.savez(path, P=np.full((1, 2, 2), 0.5), pi=np.array([[0.0, 1.7]]), meta=meta)
    with pytest.raises(HdMoeError, match="pi"):
        Placement.load(path)
    with pytest.raises(HdMoeError, match="non-integer"):
        Placement(P=np.full((1, 2, 2), 0.5), pi=np.array([[0.0, 1.7]]))
