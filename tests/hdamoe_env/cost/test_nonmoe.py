"""Tests of hdamoe_env.cost.nonmoe: the non-MoE term (attention, KV/weight memory, all-reduce) per
layer and per decode step, pinned to the check values of paper-model.md §14.3–14.4 and §5.3.4.

Check values are stated in µs rounded to 0.01; ``close`` accepts |x − value| ≤ half a unit of the
last digit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.specs import hardware_from_setting
from hdamoe_env.cost import nonmoe, perf
from tests.hdamoe_env.cost.check_values import (FAITHFUL, FAITHFUL_V1, MODELS, PAPER, PAPER_HD,
                                                   SETTINGS, US, close)



# ------------------------------------------------------------------------------------------------
# §14.3 Non-MoE term, paper (journal formulas, L_dec = 64), 4×8
# ------------------------------------------------------------------------------------------------

TABLE_14_3 = {  # model: ((t_attn, t_mem, t_nm) at 2.5, 5, 10 TFLOPS)
    "deepseek": ((39.43, 19.71, 59.14), (19.71, 19.71, 39.43), (9.86, 19.71, 29.57)),
    "mixtral": ((108.21, 53.91, 162.12), (54.11, 53.91, 108.02), (27.05, 53.91, 80.96)),
    "qwen2": ((271.03, 68.00, 339.03), (135.52, 68.00, 203.51), (67.76, 68.00, 135.76)),
    "qwen35": ((30.62, 29.53, 60.15), (15.31, 29.53, 44.84), (7.65, 29.53, 37.19)),
}


@pytest.mark.parametrize("name", sorted(TABLE_14_3))
def test_14_3_journal_nonmoe(name: str) -> None:
    """§14.3 (and §5.3.3 for Qwen3.5): t_attn + t_mem per layer, 4×8."""
    model = MODELS[name]
    for setting, (attn, mem, total) in zip(SETTINGS, TABLE_14_3[name], strict=True):
        t = nonmoe.nonmoe_time(model, hardware_from_setting(setting, "4x8"), PAPER, 128)
        assert close(t.compute_s * US, attn), (setting, t)
        assert close(t.memory_s * US, mem), (setting, t)
        assert close(t.total_s * US, total), (setting, t)
        assert t.comm_s == 0.0


@pytest.mark.parametrize("name", sorted(TABLE_14_3))
def test_14_3_scales_as_32_over_d(name: str) -> None:
    """§14.3: both terms scale exactly as 32/D for other meshes."""
    model = MODELS[name]
    ref = nonmoe.nonmoe_time(model, hardware_from_setting("5/50", "4x8"), PAPER, 128)
    for mesh, nodes in (("4x4", 16), ("8x8", 64)):
        t = nonmoe.nonmoe_time(model, hardware_from_setting("5/50", mesh), PAPER, 128)
        assert math.isclose(t.compute_s, ref.compute_s * 32 / nodes, rel_tol=1e-12)
        assert math.isclose(t.memory_s, ref.memory_s * 32 / nodes, rel_tol=1e-12)


def test_14_3_batch_dependence() -> None:
    """§14.3: t_attn + t_mem at B = 16 / 32 / 64, 4×8, 5 TFLOPS (also as one vectorised call)."""
    expected = {
        "deepseek": ((2.46, 19.67), (4.93, 19.68), (9.86, 19.69)),
        "mixtral": ((6.76, 50.78), (13.53, 51.23), (27.05, 52.12)),
        "qwen2": ((16.94, 67.29), (33.88, 67.39), (67.76, 67.59)),
    }
    hw = hardware_from_setting("5/50", "4x8")
    for name, rows in expected.items():
        vec = nonmoe.nonmoe_time(MODELS[name], hw, PAPER, np.array([16, 32, 64]))
        for j, (batch, (attn, mem)) in enumerate(zip((16, 32, 64), rows, strict=True)):
            t = nonmoe.nonmoe_time(MODELS[name], hw, PAPER, batch)
            assert close(t.compute_s * US, attn) and close(t.memory_s * US, mem), (name, batch)
            assert math.isclose(vec.total_s[j], t.total_s, rel_tol=1e-12)


def test_14_3_whole_model() -> None:
    """§14.3: L·t_nm, 4×8, 5 TFLOPS."""
    hw = hardware_from_setting("5/50", "4x8")
    for name, value in (("deepseek", 1025.07), ("mixtral", 3456.53), ("qwen2", 5698.37)):
        assert close(nonmoe.nonmoe_step_time(MODELS[name], hw, PAPER, 128) * US, value)


# ------------------------------------------------------------------------------------------------
# §14.4 paper-hd non-MoE
# ------------------------------------------------------------------------------------------------

TABLE_14_4_HD = {  # model: ((t_attn, t_mem, total or None) at 2.5, 5, 10 TFLOPS)
    "deepseek": ((33.55, 46.21, 79.77), (16.78, 46.21, 62.99), (8.39, 46.21, 54.60)),
    "mixtral": ((120.80, 104.24, 225.04), (60.40, 104.24, 164.64), (30.20, 104.24, 134.44)),
    "qwen2": ((93.95, 108.40, None), (46.98, 108.40, None), (23.49, 108.40, None)),
    "qwen35": ((33.55, 54.59, None), (16.78, 54.59, None), (8.39, 54.59, None)),
}


@pytest.mark.parametrize("name", sorted(TABLE_14_4_HD))
def test_14_4_paper_hd_nonmoe(name: str) -> None:
    """§14.4: paper-hd non-MoE per layer (generic formula, L_kv = 1024), 4×8."""
    model = MODELS[name]
    for setting, (attn, mem, total) in zip(SETTINGS, TABLE_14_4_HD[name], strict=True):
        t = nonmoe.nonmoe_time(model, hardware_from_setting(setting, "4x8"), PAPER_HD, 128)
        assert close(t.compute_s * US, attn) and close(t.memory_s * US, mem), (setting, t)
        assert math.isclose(t.total_s, t.compute_s + t.memory_s, rel_tol=1e-12)
        if total is not None:
            assert close(t.total_s * US, total), (setting, t)


# ------------------------------------------------------------------------------------------------
# §5.3.4 architecture formula: Qwen3.5 layers, dense layer, knobs
# ------------------------------------------------------------------------------------------------


def test_5_3_4_qwen35_full_and_linear_layers() -> None:
    """§5.3.4: every 4th Qwen3.5 layer is full attention; the others use the DeltaNet state."""
    model = MODELS["qwen35"]
    hw = hardware_from_setting("5/50", "4x8")
    D, C, M = 32, hw.compute_flops, hw.mem_bw_Bps
    h, I_s = 2048, 512
    full = nonmoe.nonmoe_time(model, hw, FAITHFUL_V1, 128, layer=3)
    linear = nonmoe.nonmoe_time(model, hw, FAITHFUL_V1, 128, layer=0)
    assert math.isclose(
        full.compute_s, 128 * (2 * 27_262_976 + 16384 * 1024 + 6 * h * I_s) / (D * C)
    )
    assert math.isclose(
        full.memory_s, (2 * (27_262_976 + 3 * h * I_s) + 128 * 1024 * 1024 * 2) / (D * M)
    )
    assert math.isclose(
        linear.compute_s, 128 * (2 * 33_685_504 + 3_145_728 + 6 * h * I_s) / (D * C)
    )
    assert math.isclose(
        linear.memory_s, (2 * (33_685_504 + 3 * h * I_s) + 128 * 2 * 32 * 128 * 128 * 4) / (D * M)
    )
    assert full.total_s == max(full.compute_s, full.memory_s)
    step = nonmoe.nonmoe_step_time(model, hw, FAITHFUL_V1, 128)
    assert math.isclose(step, 10 * full.total_s + 30 * linear.total_s, rel_tol=1e-12)
    with pytest.raises(ConfigError, match="layer"):
        nonmoe.nonmoe_time(model, hw, FAITHFUL_V1, 128, layer=40)


def test_5_3_4_dense_layer_and_profile_rules() -> None:
    """§5.3.4: DeepSeek's dense layer 0 joins faithful only; paper+arch is serial."""
    model = MODELS["deepseek"]
    hw = hardware_from_setting("5/50", "4x8")
    dense = nonmoe.dense_layer_time(model, hw, FAITHFUL_V1, 128)
    h, I_d = 2048, 10944
    assert math.isclose(
        dense.compute_s,
        128 * (2 * 13_762_560 + 10240 * 1024 + 6 * h * I_d) / (32 * hw.compute_flops),
    )
    assert math.isclose(
        dense.memory_s,
        (2 * (13_762_560 + 3 * h * I_d) + 128 * 1024 * 576 * 2) / (32 * hw.mem_bw_Bps),
    )
    layer = nonmoe.nonmoe_time(model, hw, FAITHFUL_V1, 128)
    assert math.isclose(
        nonmoe.nonmoe_step_time(model, hw, FAITHFUL_V1, 128),
        26 * layer.total_s + dense.total_s,
        rel_tol=1e-12,
    )
    no_dense = FAITHFUL_V1.derive(dense_layers=False)
    assert math.isclose(
        nonmoe.nonmoe_step_time(model, hw, no_dense, 128), 26 * layer.total_s, rel_tol=1e-12
    )
    serial = nonmoe.nonmoe_time(model, hw, PAPER.derive(nonmoe="arch", nonmoe_ctx_len=1024), 128)
    assert math.isclose(serial.total_s, layer.compute_s + layer.memory_s, rel_tol=1e-12)


def test_5_3_4_optional_knobs() -> None:
    """§5.3.4: include_lm_head adds vocab·h once per step; nonmoe_allreduce adds a TP all-reduce."""
    model = MODELS["mixtral"]
    hw = hardware_from_setting("5/50", "4x8")
    base = nonmoe.nonmoe_step_time(model, hw, FAITHFUL_V1, 128)
    head = nonmoe.lm_head_time(model, hw, FAITHFUL_V1, 128)
    assert math.isclose(head.compute_s, 2 * 128 * 32000 * 4096 / (32 * hw.compute_flops))
    assert math.isclose(head.memory_s, 2 * 32000 * 4096 / (32 * hw.mem_bw_Bps))
    with_head = nonmoe.nonmoe_step_time(model, hw, FAITHFUL_V1.derive(include_lm_head=True), 128)
    assert math.isclose(with_head, base + head.total_s, rel_tol=1e-12)
    conv = FAITHFUL_V1.derive(nonmoe_allreduce=True)
    t = nonmoe.nonmoe_time(model, hw, conv, 128)
    assert math.isclose(t.comm_s, perf.tp_allreduce_time(model, hw, conv, 128))
    assert math.isclose(t.total_s, max(t.compute_s, t.memory_s) + t.comm_s)


def test_faithful_nonmoe_allreduce_uses_the_best_collective() -> None:
    """PHYSICS.md: faithful splits attention over D, so every layer all-reduces B·h activations.

    Mixtral (h = 4096), 4×8 mesh 5/50, B = 128, b_psum = 4: S = 2 MiB; with a topology the
    fastest DES algorithm under cut-through with network-interface ports (docs/PHYSICS.md §16):
    ring2d, every step one 2-hop message per node through injection port (1.5 ns = 0.75 hop),
    two links (2 ns each) and ejection port (1.5 ns), 14·(100 + 7 + 5242.88) +
    6·(100 + 7 + 1310.72) ns = 83.40464 µs (the bidirectional ring's two messages per node
    share the ports: 62·(100 + 5 + 1310.72) ns = 87.77464 µs); without a topology the
    closed-form 1-D ring 62·(102 + 1310.72) ns = 87.58864 µs. paper*: none.
    """
    from hdamoe_env.noc.topology import make_topology

    model = MODELS["mixtral"]
    hw = hardware_from_setting("5/50", "4x8")
    topo = make_topology("mesh", hw)
    assert FAITHFUL.nonmoe_allreduce and not PAPER.nonmoe_allreduce
    t = nonmoe.nonmoe_time(model, hw, FAITHFUL, 128, topology=topo)
    assert math.isclose(t.comm_s, 83.40464e-6, rel_tol=1e-9)
    assert math.isclose(t.total_s, max(t.compute_s, t.memory_s) + 83.40464e-6, rel_tol=1e-9)
    closed = nonmoe.nonmoe_time(model, hw, FAITHFUL, 128)
    assert math.isclose(closed.comm_s, 87.58864e-6, rel_tol=1e-9)
    both = nonmoe.nonmoe_allreduce_time(model, hw, FAITHFUL, np.array([128, 128]),
                                        topology=topo)
    assert np.allclose(both, 83.40464e-6, rtol=1e-9)
    assert nonmoe.nonmoe_time(model, hw, PAPER, 128, topology=topo).comm_s == 0.0
