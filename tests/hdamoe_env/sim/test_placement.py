"""Placements: TP/EP constructors (§9.1–9.2), validation, memory checks (§7.3), storage (§7.7)."""

from __future__ import annotations

import dataclasses
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


# ----------------------------------------------------------------------------- tile-aligned TP
def test_tp_tiled_deals_whole_tiles_evenly():
    from hdamoe_env.sim.placement import check_tile_grid, share_unit, tensor_parallel_tiled

    model, conv = get_model("deepseek"), PROFILES["faithful"]
    p = tensor_parallel_tiled(2, 64, 32, share_unit(model, conv))          # 22 tiles / expert
    assert p.method == "tp-tiled" and p.allreduce is not None and p.allreduce.all()
    check_tile_grid(p, model, conv)
    tiles = p.P[0] * 22
    assert np.allclose(tiles, np.rint(tiles)) and np.allclose(p.P.sum(axis=2), 1.0)
    assert ((p.P[0] > 0).sum(axis=1) == 22).all()                        # 22 of 32 nodes
    assert np.array_equal(tiles.sum(axis=0), np.full(32, 64 * 22 / 32))  # 44 tiles per node
    q = tensor_parallel_tiled(1, 64, 32, 1 / 40)                           # Qwen2: 1 or 2 tiles
    assert set(np.unique(q.P[0] * 40).round().tolist()) == {1.0, 2.0}
    assert np.allclose((q.P[0] * 40).sum(axis=0), 80)
    assert np.allclose(tensor_parallel_tiled(1, 8, 32, 1 / 224).P, 1 / 32)  # Mixtral: = TP
    with pytest.raises(ConfigError, match="share unit"):
        tensor_parallel_tiled(1, 8, 32, 0.0)


def test_allreduce_mask_roundtrip_and_versions(tmp_path):
    from hdamoe_env.sim.placement import tensor_parallel_tiled

    p = tensor_parallel_tiled(3, 4, 8, 1 / 5)
    back = Placement.load(p.save(tmp_path / "t.npz"))
    assert back.allreduce is not None and back.allreduce.tolist() == [True] * 3
    assert back.is_allreduce(1) and np.array_equal(back.P, p.P)
    with np.load(tmp_path / "t.npz") as data:
        assert json.loads(bytes(data["meta"]).decode())["format_version"] == 3
    plain = p.with_layers(allreduce=None, method="custom")
    assert plain.allreduce is None and not plain.is_allreduce(0)
    with np.load(plain.save(tmp_path / "p.npz")) as data:
        assert json.loads(bytes(data["meta"]).decode())["format_version"] == 1
    assert Placement.load(tmp_path / "p.npz").allreduce is None
    assert p.with_layers(allreduce=np.zeros(3, dtype=bool)).allreduce is None
    with pytest.raises(ConfigError, match=r"allreduce must have shape \[L\]"):
        p.with_layers(allreduce=np.ones(2, dtype=bool))
    with pytest.raises(ConfigError, match="bool mask"):
        p.with_layers(allreduce=np.full(3, 0.5))


def test_placement_by_name_tp_tiled_needs_the_profile():
    from hdamoe_env.sim.placement import placement_by_name

    model = get_model("deepseek")
    p = placement_by_name("tp-tiled", model, 32, conv=PROFILES["faithful"])
    assert p.method == "tp-tiled" and p.allreduce is not None
    with pytest.raises(ConfigError, match="conv="):
        placement_by_name("tp-tiled", model, 32)
    # paper* (tile_cols 1): tiles of one column, I = 1408 divides over 32 nodes: plain TP shares
    assert np.allclose(placement_by_name("tp_tiled", model, 32, conv=PROFILES["paper"]).P,
                       1 / 32)


def test_ep_unit_leaves_draws_and_divisible_cases_unchanged():
    a = expert_parallel(2, 8, 32, np.random.default_rng(4))
    b = expert_parallel(2, 8, 32, np.random.default_rng(4), unit=1 / 224)  # 224 / 4: exact
    assert np.array_equal(a.P, b.P) and np.array_equal(a.pi, b.pi)
    c = expert_parallel(1, 64, 256, np.random.default_rng(4), unit=1 / 22)  # 4 nodes, 22 tiles
    d = expert_parallel(1, 64, 256, np.random.default_rng(4))
    assert np.array_equal(c.pi, d.pi) and np.array_equal(c.P > 0, d.P > 0)
    assert sorted(set((c.P[0][c.P[0] > 0] * 22).round().tolist())) == [5.0, 6.0]


@pytest.mark.parametrize("mesh", [(16, 16), (32, 32)])
@pytest.mark.parametrize("key", ["mixtral-8x7b", "deepseek-v2-lite", "qwen2-57b-a14b",
                                 "qwen3.5-35b-a3b"])
def test_baselines_lie_on_the_tile_grid_of_large_meshes(key, mesh):
    """TP, tp-tiled, EP and the hybrid are legal placements of every preset on big chips."""
    from baselines.static import hybrid_placement
    from hdamoe_env.sim.placement import check_tile_grid, placement_by_name, share_unit

    model, conv = get_model(key), PROFILES["faithful"]
    D = mesh[0] * mesh[1]
    hw = HardwareSpec(mesh_shape=mesh)
    L = 2                                          # the grid check is per layer; keep it fast
    small = dataclasses.replace(model, num_moe_layers=L)
    freqs = [np.random.default_rng(layer).dirichlet(np.ones(model.num_experts)) * model.top_k
             for layer in range(L)]
    unit = share_unit(model, conv)
    for name in ("tp", "tp-tiled", "ep"):
        p = placement_by_name(name, small, D, seed=1, conv=conv)
        check_tile_grid(p, small, conv)
        p.validate(small, hw, conv)
    hyb = hybrid_placement(freqs, mesh, model.hybrid_regions, method="lpt", unit=unit)
    check_tile_grid(hyb, small, conv)
