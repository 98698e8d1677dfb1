"""Placements: TP/EP constructors (§9.1–9.2), validation, memory checks (§7.3), storage (§7.7)."""

import numpy as np
import pytest

from hdamoe_env.errors import ConfigError, InfeasibleError
from hdamoe_env.placement import (Placement, check_memory, expert_parallel,
                                  import_reference_layers, node_weight_bytes, tensor_parallel)
from hdamoe_env.profiles import PROFILES
from hdamoe_env.specs import HardwareSpec, get_model


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
    from hdamoe_env.placement import placement_by_name

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
