"""Tests of hdamoe_env.cost.perf: the check values of paper-model.md §14.1–14.9 and properties
(the non-MoE term of §14.3–14.4 is pinned in test_nonmoe.py, the broadcast of §14.7 in
test_broadcast.py).

Check values are stated in µs rounded to 0.01 (R_cc to 0.001, caps to 0.0001); ``close`` accepts
|x − value| ≤ half a unit of the last digit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hdamoe_env.cost import nonmoe
from hdamoe_env.cost import perf
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.specs import ModelSpec, hardware_from_setting
from tests.hdamoe_env.cost.check_values import (FAITHFUL, FAITHFUL_V1, FAITHFUL_V2, MODELS,
                                                   PAPER, PAPER_HD, SETTINGS, US, close)



def tp_placement(model: ModelSpec, num_nodes: int) -> np.ndarray:
    return np.full((model.num_experts, num_nodes), 1.0 / num_nodes)


def uniform_f(model: ModelSpec) -> np.ndarray:
    return np.full(model.num_experts, model.top_k / model.num_experts)


# ------------------------------------------------------------------------------------------------
# §14.1 TP expert computation per layer
# ------------------------------------------------------------------------------------------------

TABLE_14_1 = {  # model: {mesh: (2.5, 5, 10 TFLOPS)}
    "deepseek": {
        "4x4": (110.73, 55.36, 27.68),
        "4x8": (55.36, 27.68, 13.84),
        "8x8": (27.68, 13.84, 6.92),
    },
    "mixtral": {
        "4x4": (751.62, 375.81, 187.90),
        "4x8": (375.81, 187.90, 93.95),
        "8x8": (187.90, 93.95, 46.98),
    },
    "qwen2": {
        "4x4": (469.76, 234.88, 117.44),
        "4x8": (234.88, 117.44, 58.72),
        "8x8": (117.44, 58.72, 29.36),
    },
    "qwen35": {
        "4x4": (53.69, 26.84, 13.42),
        "4x8": (26.84, 13.42, 6.71),
        "8x8": (13.42, 6.71, 3.36),
    },
}


@pytest.mark.parametrize("name", sorted(TABLE_14_1))
@pytest.mark.parametrize("mesh", ["4x4", "4x8", "8x8"])
def test_14_1_tp_expert_compute_paper(name: str, mesh: str) -> None:
    """§14.1: k·B·2·h·I/(D·C) via Eq. 1 on the TP placement (paper, m = 1)."""
    model = MODELS[name]
    for tflops, expected in zip((2.5, 5, 10), TABLE_14_1[name][mesh], strict=True):
        hw = hardware_from_setting(f"{tflops}/50", mesh)
        P = tp_placement(model, hw.num_nodes)
        t = perf.t_comp_static(P, uniform_f(model), 128, model, hw, PAPER)
        assert close(t * US, expected), (name, mesh, tflops, t * US)
        assert math.isclose(t, perf.tp_expert_compute_time(model, hw, PAPER, 128), rel_tol=1e-12)


def test_14_1_faithful_is_three_times_paper() -> None:
    """§14.1: faithful (m = 3) is three times the paper values; DeepSeek 4×8 at 5 TFLOPS 83.05."""
    hw = hardware_from_setting("5/50", "4x8")
    for model in MODELS.values():
        ratio = perf.tp_expert_compute_time(model, hw, FAITHFUL, 128) / perf.tp_expert_compute_time(
            model, hw, PAPER, 128
        )
        assert math.isclose(ratio, 3.0, rel_tol=1e-12)
    assert close(perf.tp_expert_compute_time(MODELS["deepseek"], hw, FAITHFUL, 128) * US, 83.05)


# ------------------------------------------------------------------------------------------------
# §14.2 TP communication per layer
# ------------------------------------------------------------------------------------------------

TABLE_14_2 = {  # model: {GB/s: (4·Bh/BW, 8·Bh/BW, 16·Bh/BW)}
    "deepseek": {75: (13.98, 27.96, 55.92), 50: (20.97, 41.94, 83.89), 25: (41.94, 83.89, 167.77)},
    "qwen35": {75: (13.98, 27.96, 55.92), 50: (20.97, 41.94, 83.89), 25: (41.94, 83.89, 167.77)},
    "mixtral": {
        75: (27.96, 55.92, 111.85),
        50: (41.94, 83.89, 167.77),
        25: (83.89, 167.77, 335.54),
    },
    "qwen2": {75: (24.47, 48.93, 97.87), 50: (36.70, 73.40, 146.80), 25: (73.40, 146.80, 293.60)},
}


@pytest.mark.parametrize("name", sorted(TABLE_14_2))
def test_14_2_tp_allreduce_constants(name: str) -> None:
    """§14.2: 4·Bh/BW (analytic TP estimate), 8·Bh/BW (paper-hd), 16·Bh/BW (paper)."""
    model = MODELS[name]
    for gbps, (v4, v8, v16) in TABLE_14_2[name].items():
        hw = hardware_from_setting(f"5/{gbps}", "4x8")
        assert close(perf.tp_allreduce_time(model, hw, PAPER, 128) * US, v16)
        assert close(perf.tp_allreduce_time(model, hw, PAPER_HD, 128) * US, v8)
        assert close(perf.tp_allreduce_time(model, hw, PAPER.derive(tp_const=4.0), 128) * US, v4)
        # Eq. 2 on TP: every cluster holds a shard of every expert, so V_c = B·h for every c.
        groups = np.arange(model.top_k)[None, :]
        t, volume = perf.analytic_comm_static(
            tp_placement(model, 32),
            groups,
            np.ones(1),
            128,
            model.hidden_size,
            PAPER.kappa_a,
            hw.link_bw_Bps,
        )
        assert np.allclose(volume, 128 * model.hidden_size)
        assert close(t * US, v4)


def test_14_2_faithful_ring() -> None:
    """§14.2: faithful ring, D = 32, b_psum = 2, no hop latency: 2·31/32·B·h·2/BW.

    The §14.2 values are stated for b_psum = 2; faithful's default is 4 (PHYSICS.md), which
    exactly doubles them (DeepSeek 5/50: 40.63 µs).
    """
    expected = {
        "deepseek": (13.54, 20.32, 40.63),
        "qwen35": (13.54, 20.32, 40.63),
        "mixtral": (27.09, 40.63, 81.26),
        "qwen2": (23.70, 35.55, 71.11),
    }
    for name, values in expected.items():
        for setting, value in zip(SETTINGS, values, strict=True):
            hw = hardware_from_setting(setting, "4x8")
            assert close(perf.tp_allreduce_time(MODELS[name], hw, FAITHFUL_V1, 128) * US, value)
    assert FAITHFUL.b_psum == 4 and PAPER.b_psum == 2
    hw = hardware_from_setting("5/50", "4x8")
    fp32 = FAITHFUL_V1.derive(b_psum=4)
    assert close(perf.tp_allreduce_time(MODELS["deepseek"], hw, fp32, 128) * US, 40.63)


def test_5_6_faithful_ring_alpha_beta() -> None:
    """§5.6 with docs/PHYSICS.md: t = 2(D−1)·(α + hop + B·h·b_psum/(D·BW)).

    DeepSeek, 4×8, 50 GB/s, B = 128, faithful (α = 100 ns, hop = 2 ns, b_psum = 4):
    S/(D·BW) = 128·2048·4 B / (32 · 50 GB/s) = 655.36 ns; 62 · (100 + 2 + 655.36) ns = 46.956 µs.
    An explicit hardware hop latency (10 ns) replaces the profile's 2 ns: + 62·8 ns = 47.452 µs.
    """
    model = MODELS["deepseek"]
    hw = hardware_from_setting("5/50", "4x8")
    assert FAITHFUL.msg_alpha_s == 100e-9 and FAITHFUL.hop_latency_s == 2e-9
    assert hw.hop_latency_ns is None and hw.hop_latency_for(FAITHFUL) == 2e-9
    assert close(perf.tp_allreduce_time(model, hw, FAITHFUL, 128) * US, 46.96)
    assert math.isclose(perf.tp_allreduce_time(model, hw, FAITHFUL, 128), 62 * 757.36e-9,
                        rel_tol=1e-12)
    hw10 = hardware_from_setting("5/50", "4x8", hop_latency_ns=10.0)
    assert math.isclose(perf.tp_allreduce_time(model, hw10, FAITHFUL, 128), 62 * 765.36e-9,
                        rel_tol=1e-12)
    assert PAPER.msg_alpha_s == 0.0 and PAPER.hop_latency_s == 0.0
    assert PAPER.broadcast_alpha_s == 100e-9 == FAITHFUL.broadcast_alpha_s


def test_5_6_ring_hop_latency_and_bw_end() -> None:
    """§5.6: the ring adds 2(D−1) hop latencies; bw_end_Bps overrides the link bandwidth."""
    model = MODELS["deepseek"]
    hw = hardware_from_setting("5/50", "4x8", hop_latency_ns=10.0)
    base = perf.tp_allreduce_time(model, hardware_from_setting("5/50", "4x8"), FAITHFUL_V1, 128)
    assert math.isclose(
        perf.tp_allreduce_time(model, hw, FAITHFUL_V1, 128), base + 62 * 10e-9, rel_tol=1e-12
    )
    half = perf.tp_allreduce_time(
        model, hardware_from_setting("5/50"), FAITHFUL_V1, 128, bw_end_Bps=25e9
    )
    assert math.isclose(half, 2 * base, rel_tol=1e-12)
    assert perf.tp_allreduce_time(model, hw, FAITHFUL_V1, 128, num_nodes=1) == 0.0


# ------------------------------------------------------------------------------------------------
# §14.4 paper TP time per decode step (the non-MoE term: test_nonmoe.py)
# ------------------------------------------------------------------------------------------------

TABLE_14_4 = {  # model: ((compute, comm, non-MoE, total) at 2.5/75, 5/50, 10/25)
    "deepseek": (
        (1439.49, 1454.03, 1537.61, 4431.12),
        (719.74, 2181.04, 1025.07, 3925.85),
        (359.87, 4362.08, 768.79, 5490.74),
    ),
    "mixtral": (
        (12025.91, 3579.14, 5187.93, 20792.98),
        (6012.95, 5368.71, 3456.53, 14838.19),
        (3006.48, 10737.42, 2590.82, 16334.72),
    ),
    "qwen2": (
        (6576.67, 2740.28, 9492.79, 18809.74),
        (3288.33, 4110.42, 5698.37, 13097.12),
        (1644.17, 8220.84, 3801.15, 13666.15),
    ),
    "qwen35": (
        (1073.74, 2236.96, 2406.09, 5716.79),
        (536.87, 3355.44, 1793.72, 5686.03),
        (268.44, 6710.89, 1487.54, 8466.86),
    ),
}


@pytest.mark.parametrize("name", sorted(TABLE_14_4))
def test_14_4_paper_tp_step(name: str) -> None:
    """§14.4: Σ_l (TP compute + 16·Bh/BW + t_nm), 4×8, paper (no dense layer)."""
    model = MODELS[name]
    L = model.num_moe_layers
    for setting, (comp, comm, nm, total) in zip(SETTINGS, TABLE_14_4[name], strict=True):
        hw = hardware_from_setting(setting, "4x8")
        P = tp_placement(model, hw.num_nodes)
        t_comp = L * perf.t_comp_static(P, uniform_f(model), 128, model, hw, PAPER)
        t_comm = L * perf.tp_allreduce_time(model, hw, PAPER, 128)
        t_nm = nonmoe.nonmoe_step_time(model, hw, PAPER, 128)
        assert close(t_comp * US, comp), (setting, t_comp * US)
        assert close(t_comm * US, comm), (setting, t_comm * US)
        assert close(t_nm * US, nm), (setting, t_nm * US)
        assert close((t_comp + t_comm + t_nm) * US, total), setting


# ------------------------------------------------------------------------------------------------
# §14.5 faithful values (4×8, L_ctx = 1024)
# ------------------------------------------------------------------------------------------------

TABLE_14_5 = {  # model: ((t_nm compute, DRAM, roofline), (TP compute, streaming, roofline))
    "deepseek": ((58.09, 10.66, 58.09), (83.05, 55.36, 83.05)),
    "mixtral": ((80.53, 31.04, 80.53), (563.71, 140.93, 563.71)),
    "qwen2": ((411.04, 38.38, 411.04), (352.32, 176.16, 352.32)),
}


@pytest.mark.parametrize("name", sorted(TABLE_14_5))
def test_14_5_faithful(name: str) -> None:
    """§14.5: architecture t_nm roofline and TP expert roofline (all experts active), 5/50."""
    model = MODELS[name]
    hw = hardware_from_setting("5/50", "4x8")
    (nm_c, nm_m, nm_t), (ex_c, ex_s, ex_t) = TABLE_14_5[name]
    t = nonmoe.nonmoe_time(model, hw, FAITHFUL_V1, 128)
    assert close(t.compute_s * US, nm_c) and close(t.memory_s * US, nm_m), t
    assert close(t.total_s * US, nm_t)
    P = tp_placement(model, hw.num_nodes)
    n = uniform_f(model) * 128
    compute, stream = perf.expert_compute_times(
        P, n, model, hw, FAITHFUL_V1, active=np.ones(model.num_experts)
    )
    assert compute.shape == stream.shape == (32,)
    assert close(compute.max() * US, ex_c) and close(stream.max() * US, ex_s)
    assert close(perf.t_comp(compute, stream) * US, ex_t)
    # The static form (a_i = 1 − (1 − f_i)^128 ≈ 1) gives the same rounded value.
    assert close(perf.t_comp_static(P, uniform_f(model), 128, model, hw, FAITHFUL_V1) * US, ex_t)


def test_14_5_memory_bound_at_10_tflops() -> None:
    """§14.5: at 10 TFLOPS DeepSeek's TP expert phase is memory-bound: 41.52 vs 55.36 → 55.36."""
    model = MODELS["deepseek"]
    hw = hardware_from_setting("10/25", "4x8")
    compute, stream = perf.expert_compute_times(
        tp_placement(model, 32),
        uniform_f(model) * 128,
        model,
        hw,
        FAITHFUL_V1,
        active=np.ones(model.num_experts),
    )
    assert close(compute.max() * US, 41.52) and close(stream.max() * US, 55.36)
    assert close(perf.t_comp(compute, stream) * US, 55.36)


# ------------------------------------------------------------------------------------------------
# §14.6 R_cc and the Node-Balance cap
# ------------------------------------------------------------------------------------------------

TABLE_14_6 = {  # model: ((R_cc, cap) at 2.5/75, 5/50, 10/25), TP load k/D
    "deepseek": (((3.960, 0.2348), (1.320, 0.3295), (0.330, 0.7557)), 0.1875),
    "mixtral": (((13.440, 0.0672), (4.480, 0.0765), (1.120, 0.1183)), 0.0625),
    "qwen2": (((9.600, 0.2760), (3.200, 0.3281), (0.800, 0.5625)), 0.2500),
    "qwen35": (((1.920, 0.3802), (0.640, 0.6406), (0.160, 1.8125)), 0.2500),
}


@pytest.mark.parametrize("name", sorted(TABLE_14_6))
def test_14_6_rcc_and_cap(name: str) -> None:
    """§14.6: paper* R_cc = BW·I·k/(2·D·C) and cap = (k/D)(1 + 1/R_cc), 4×8."""
    model = MODELS[name]
    rows, tp_load = TABLE_14_6[name]
    assert close(model.top_k / 32, tp_load, 4)
    for setting, (ratio, cap) in zip(SETTINGS, rows, strict=True):
        hw = hardware_from_setting(setting, "4x8")
        assert close(perf.r_cc(model, hw, PAPER), ratio, 3)
        assert close(perf.r_cc(model, hw, PAPER_HD), ratio, 3)
        closed = (
            hw.link_bw_Bps * model.expert_intermediate * model.top_k / (2 * 32 * hw.compute_flops)
        )
        assert math.isclose(perf.r_cc(model, hw, PAPER), closed, rel_tol=1e-12)
        assert close(perf.tp_ratio_cap(model, hw, PAPER), cap, 4)
        assert perf.tp_ratio_cap(model, hw, PAPER) > tp_load  # TP is always feasible (§7.6)


def test_14_6_min_shards_mixtral() -> None:
    """§14.6: Mixtral layer 0, 5/50: ⌈f_i / 0.0765⌉ = [4, 4, 3, 4, 4, 4, 3, 4] (f of §14.9)."""
    f = np.array([0.2617, 0.2346, 0.2201, 0.2832, 0.2564, 0.2817, 0.1984, 0.2639])
    cap = perf.tp_ratio_cap(MODELS["mixtral"], hardware_from_setting("5/50"), PAPER)
    assert perf.min_shards(f, cap).tolist() == [4, 4, 3, 4, 4, 4, 3, 4]


def test_7_3_faithful_rcc_uses_ring() -> None:
    """§7.3: faithful R_cc = t_comp_TP / t_TP(ring); independent of B without hop latency."""
    model = MODELS["deepseek"]
    hw = hardware_from_setting("5/50", "4x8")
    conv = FAITHFUL_V1
    expected = perf.tp_expert_compute_time(model, hw, conv, 128) / perf.tp_allreduce_time(
        model, hw, conv, 128
    )
    assert math.isclose(perf.r_cc(model, hw, conv), expected, rel_tol=1e-12)
    assert math.isclose(perf.r_cc(model, hw, conv, B=16), expected, rel_tol=1e-12)
    with pytest.raises(ConfigError, match="R_cc is undefined"):
        perf.r_cc(model, hw, FAITHFUL, num_nodes=1)


def test_14_9_ep_compute_rounded_f() -> None:
    """§14.9 (with the 4-digit f of the doc): EP, one expert per 4 clusters, 5 TFLOPS ≈ 212.87."""
    f = np.array([0.2617, 0.2346, 0.2201, 0.2832, 0.2564, 0.2817, 0.1984, 0.2639])
    P = np.kron(np.eye(8), np.full((1, 4), 0.25))  # expert i on clusters 4i..4i+3
    t = perf.t_comp_static(P, f, 128, MODELS["mixtral"], hardware_from_setting("5/50"), PAPER)
    # f rounded to 1e-4 moves t by up to 5e-5·128·2hI/(4C) ≈ 0.04 µs.
    assert abs(t * US - 212.87) < 0.04


# ------------------------------------------------------------------------------------------------
# §14.8 item 4: analytic estimator (Eq. 2)
# ------------------------------------------------------------------------------------------------


def test_14_8_4_analytic_static() -> None:
    """§14.8 item 4: V = [700, 500, 300, 500] elements; t = 2.8 µs (κ=4), 1.4 µs (κ=2)."""
    support = np.eye(4, dtype=bool)  # expert i alone on cluster i
    groups = np.array([[0, 1], [2, 3], [0, 3]])
    f_g = np.array([0.5, 0.3, 0.2])
    t4, volume = perf.analytic_comm_static(support, groups, f_g, 10, 100, PAPER.kappa_a, 1e9)
    assert volume.tolist() == pytest.approx([700, 500, 300, 500])
    assert close(t4 * US, 2.80)
    t2, _ = perf.analytic_comm_static(support, groups, f_g, 10, 100, FAITHFUL.kappa_a, 1e9)
    assert close(t2 * US, 1.40)
    # Shares instead of a boolean support give the same holders.
    t_shares, _ = perf.analytic_comm_static(np.eye(4), groups, f_g, 10, 100, 4.0, 1e9)
    assert t_shares == t4


def test_5_5_analytic_sampled_matches_static_on_expanded_tokens() -> None:
    """§5.5: the sampled form on tokens repeating the groups by f_g equals the static form."""
    support = np.eye(4, dtype=bool)
    tokens = np.array([[0, 1]] * 5 + [[2, 3]] * 3 + [[0, 3]] * 2)  # B = 10 tokens
    t, volume = perf.analytic_comm_sampled(support, tokens, 100, 4.0, 1e9)
    assert volume.tolist() == [700, 500, 300, 500]
    assert close(t * US, 2.80)


def test_5_5_local_precombination_and_padding() -> None:
    """§5.5: a cluster holding several of a token's experts counts it once; −1 pads sets."""
    support = np.zeros((4, 2), dtype=bool)
    support[[0, 1], 0] = True
    support[[2, 3], 1] = True
    t, volume = perf.analytic_comm_sampled(support, np.array([[0, 1], [2, -1]]), 10, 1.0, 1.0)
    assert volume.tolist() == [10, 10] and t == 10
    with pytest.raises(ConfigError, match="names expert 7"):
        perf.analytic_comm_sampled(support, np.array([[0, 7]]), 10, 1.0, 1.0)
    with pytest.raises(ConfigError, match="f_g"):
        perf.analytic_comm_static(support, np.array([[0, 1]]), np.ones(2), 4, 10, 1.0, 1.0)


# ------------------------------------------------------------------------------------------------
# §5.2 expert computation: properties
# ------------------------------------------------------------------------------------------------


def test_5_2_sizes() -> None:
    """§2.2: F_e and W_e at m = 3 (faithful) and m = 1 (paper)."""
    model = MODELS["deepseek"]
    assert perf.expert_flops(model, FAITHFUL) == 6 * 2048 * 1408
    assert perf.expert_bytes(model, FAITHFUL) == 17_301_504
    assert perf.expert_flops(model, PAPER) == 2 * 2048 * 1408
    assert perf.expert_bytes(model, PAPER) == 2 * 2048 * 1408


def test_5_2_sampled_streams_only_active_shards() -> None:
    """§5.2: sampled a_i = 1[n_i > 0]; paper* has no streaming term; leading layer axes work."""
    model = ModelSpec(
        key="tiny",
        name="tiny",
        num_moe_layers=2,
        num_experts=4,
        top_k=2,
        hidden_size=8,
        expert_intermediate=16,
    )
    hw = hardware_from_setting("5/50", (1, 2))
    P = np.array([[1, 0], [0.5, 0.5], [0, 1], [0, 1]], dtype=float)
    counts = np.array([2, 0, 1, 0])
    compute, stream = perf.expert_compute_times(P, counts, model, hw, FAITHFUL_V1)
    f_e, w_e = perf.expert_flops(model, FAITHFUL_V1), perf.expert_bytes(model, FAITHFUL_V1)
    assert np.allclose(compute, np.array([2, 1]) * f_e / hw.compute_flops)
    assert np.allclose(stream, np.array([1, 1]) * w_e / hw.mem_bw_Bps)
    _, stream_paper = perf.expert_compute_times(P, counts, model, hw, PAPER)
    assert not stream_paper.any()
    layered = perf.t_comp_sampled(
        np.stack([P, P[::-1]]), np.stack([counts, counts]), model, hw, FAITHFUL_V1
    )
    assert layered.shape == (2,)
    assert math.isclose(layered[0], perf.t_comp(compute, stream))
    with pytest.raises(ConfigError, match="experts"):
        perf.expert_compute_times(P[:3], counts[:3], model, hw, FAITHFUL_V1)
    with pytest.raises(ConfigError, match="shape"):
        perf.expert_compute_times(P, counts[:3], model, hw, FAITHFUL_V1)


def test_5_2_expected_active() -> None:
    """§5.2: a_i = 1 − (1 − f_i)^B."""
    a = perf.expected_active(np.array([0.0, 0.5, 1.0]), 3)
    assert a.tolist() == pytest.approx([0.0, 0.875, 1.0])
    with pytest.raises(ConfigError):
        perf.expected_active(np.array([0.5]), -1)


# ------------------------------------------------------------------------------------------------
# Tile model of the expert GEMMs (docs/PHYSICS.md)
# ------------------------------------------------------------------------------------------------


def test_tile_model_sourced_column_granularity() -> None:
    """Default faithful: columns pad to the 8-column MAC granularity, not the 64-column grid.

    DeepSeek (h = 2048, m = 3), 5 TFLOPS, tiles 8 tokens × 8 columns, o = 100 ns, 12 tokens
    (docs/PHYSICS.md §4): a 44-column shard (TP's 1408/32) pads to 48 columns; one GEMM
    16·48·2048·2 = 3,145,728 FLOP = 629.1456 ns, + 100 ns, × 3 = 2.1874368 µs. A whole expert
    (1408 = 176·8 columns) pads only its rows: 55.6648128 µs as before. Qwen2 (h = 3584): its
    80-column TP shard is on the 8-column grid, 16·80·3584·2 = 9,175,040 FLOP = 1.835008 µs,
    + 0.1 µs, × 3 = 5.805024 µs (64-column padding: 128 columns, 9.1080384 µs).
    """
    hw = hardware_from_setting("5/50", "4x8")
    ds, qwen = MODELS["deepseek"], MODELS["qwen2"]
    assert (FAITHFUL.col_granularity, FAITHFUL.tile_cols, FAITHFUL.col_pad) == (8, 64, 8)
    assert math.isclose(perf.gemm_tile_time(12, 44, ds, hw, FAITHFUL), 2.1874368e-6,
                        rel_tol=1e-12)
    assert math.isclose(perf.gemm_tile_time(12, 1408, ds, hw, FAITHFUL), 55.6648128e-6,
                        rel_tol=1e-12)
    assert math.isclose(perf.gemm_tile_time(12, 80, qwen, hw, FAITHFUL), 5.805024e-6,
                        rel_tol=1e-12)
    assert math.isclose(perf.gemm_tile_time(12, 80, qwen, hw, FAITHFUL_V2), 9.1080384e-6,
                        rel_tol=1e-12)
    # the padding unit is min(col_granularity, tile_cols): a 1-column grid pads nothing
    assert FAITHFUL.derive(tile_cols=1).col_pad == 1
    assert FAITHFUL.derive(col_granularity=128).col_pad == 64
    assert PAPER.col_pad == 1 and PAPER_HD.col_pad == 1
    assert np.allclose(perf.tile_columns(np.array([1 / 32, 1 / 22, 0.0]), ds, FAITHFUL),
                       [48.0, 64.0, 0.0])


def test_tile_model_shards_of_12_tokens() -> None:
    """DeepSeek (h = 2048, m = 3), 5 TFLOPS, tiles 8 × 64 with columns padded to the share
    grid (``FAITHFUL_V2``, before PHYSICS.md §4 sourced the granularity), o = 100 ns, 12 tokens.

    44-column shard (TP's 1408/32): rows 12 → 16, columns 44 → 64; one GEMM
    16·64·2048·2 = 4,194,304 FLOP = 838.8608 ns, + 100 ns = 938.8608 ns; m = 3 → 2.8165824 µs
    (the fluid model: 12·44·2048·2·3 FLOP = 1.2976128 µs).
    1408-column shard (a whole expert): 16·1408·2048·2 = 92,274,688 FLOP = 18.4549376 µs,
    + 0.1 µs, × 3 = 55.6648128 µs (fluid 41.5236096 µs).
    The overhead term alone: m·o = 0.3 µs per active shard.
    """
    model = MODELS["deepseek"]
    hw = hardware_from_setting("5/50", "4x8")
    assert (FAITHFUL_V2.tile_tokens, FAITHFUL_V2.col_pad, FAITHFUL_V2.gemm_overhead_s) == (8, 64,
                                                                                        1e-7)
    assert math.isclose(perf.gemm_tile_time(12, 44, model, hw, FAITHFUL_V2), 2.8165824e-6,
                        rel_tol=1e-12)
    assert math.isclose(perf.gemm_tile_time(12, 1408, model, hw, FAITHFUL_V2), 55.6648128e-6,
                        rel_tol=1e-12)
    no_overhead = FAITHFUL_V2.derive(gemm_overhead_s=0.0)
    assert math.isclose(perf.gemm_tile_time(12, 44, model, hw, FAITHFUL_V2)
                        - perf.gemm_tile_time(12, 44, model, hw, no_overhead), 3e-7,
                        rel_tol=1e-9)
    assert perf.gemm_tile_time(0, 44, model, hw, FAITHFUL_V2) == 0.0
    fluid = FAITHFUL_V2.derive(tile_tokens=1, tile_cols=1, gemm_overhead_s=0.0)
    assert not fluid.tiled and not PAPER.tiled and FAITHFUL_V2.tiled
    assert math.isclose(perf.gemm_tile_time(12, 44, model, hw, fluid), 1.2976128e-6,
                        rel_tol=1e-12)
    # per node, TP (every shard 44 columns) with 12 tokens on each of two experts
    P = tp_placement(model, 32)
    counts = np.zeros(model.num_experts)
    counts[[3, 7]] = 12
    compute, _ = perf.expert_compute_times(P, counts, model, hw, FAITHFUL_V2)
    assert np.allclose(compute, 2 * 2.8165824e-6, rtol=1e-12)
    compute, _ = perf.expert_compute_times(P, counts, model, hw, fluid)
    assert np.allclose(compute, 2 * 1.2976128e-6, rtol=1e-12)


def test_faithful_dram_efficiency_streaming() -> None:
    """Weight streaming at the sustained bandwidth BW_mem·η (docs/PHYSICS.md §12): a whole
    DeepSeek expert, W_e = 3·2048·1408·2 = 17,301,504 B, streams in 17,301,504 / (625 GB/s ·
    0.85) = 32.5675 µs (ideal roofline, ``paper*`` and η = 1: 27.6824 µs)."""
    model = MODELS["deepseek"]
    hw = hardware_from_setting("5/50", "4x8")
    assert FAITHFUL.dram_efficiency == 0.85 and PAPER.dram_efficiency == 1.0
    assert perf.effective_mem_bw(hw, FAITHFUL) == 625e9 * 0.85
    assert perf.effective_mem_bw(hw, PAPER) == hw.mem_bw_Bps
    P = np.zeros((model.num_experts, 32))
    P[:, 0] = 1.0
    counts = np.zeros(model.num_experts)
    counts[5] = 3
    _, stream = perf.expert_compute_times(P, counts, model, hw, FAITHFUL)
    assert round(stream[0] * US, 4) == 32.5675
    _, ideal = perf.expert_compute_times(P, counts, model, hw, FAITHFUL.derive(dram_efficiency=1.0))
    assert round(ideal[0] * US, 4) == 27.6824
    with pytest.raises(ConfigError, match="dram_efficiency"):
        FAITHFUL.derive(dram_efficiency=1.2)
