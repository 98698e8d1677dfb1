"""Tests of hdamoe_env.cost.broadcast: the pre-broadcast budget and plan (paper-model.md
§10.3–10.4) pinned to the check values of §14.7 — payload, tree depth, chunk size, T_bc*, k_b.

Check values are stated in µs rounded to 0.01 (budgets to 0.1, chunk sizes to 0.1 KB); ``close``
accepts |x − value| ≤ half a unit of the last digit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.profiles import get_profile
from hdamoe_env.config.specs import get_model, hardware_from_setting
from hdamoe_env.cost import broadcast as prebroadcast
from hdamoe_env.cost.broadcast import broadcast_plan, broadcast_slots
from tests.hdamoe_env.cost.check_values import MODELS, SETTINGS, US, close

DEEPSEEK = get_model("deepseek-v2-lite")
PAPER = get_profile("paper")
FAITHFUL = get_profile("faithful")
ALPHA = 100e-9


# ------------------------------------------------------------------------------ §10.3–10.4, §14.7
@pytest.mark.parametrize("bw,expected_kb", [(75, 61.8e3), (50, 50.5e3), (25, 35.7e3)])
def test_chunk_size_hand_values_paper(bw, expected_kb):
    hw = hardware_from_setting(f"5/{bw}")
    S = prebroadcast.broadcast_payload(DEEPSEEK, PAPER)
    H = prebroadcast.broadcast_depth(PAPER, hw.num_nodes)
    assert S == 5_767_168
    c = prebroadcast.broadcast_chunk(1, S, H, PAPER.bc_alpha_s, hw.link_bw_Bps)
    assert c == pytest.approx(expected_kb, abs=60)
    # c*(1) by hand: sqrt(α·S·BW/H)
    assert c == pytest.approx(np.sqrt(100e-9 * S * bw * 1e9 / (2 * np.sqrt(32))))


def test_chunk_size_and_time_faithful():
    hw = hardware_from_setting("5/50")
    plan = broadcast_plan(DEEPSEEK, hw, FAITHFUL, 128, 10, 1e-3, 1e-3, 8)
    assert plan.payload_bytes == 17_301_504 and plan.depth_hops == 10
    c1 = prebroadcast.broadcast_chunk(1, plan.payload_bytes, 10, 100e-9, hw.link_bw_Bps)
    assert c1 == pytest.approx(93.0e3, abs=60)
    t1 = prebroadcast.broadcast_time(1, plan.payload_bytes, 10, 100e-9, hw.link_bw_Bps)
    assert t1 * 1e6 == pytest.approx(384.2, abs=0.05)


@pytest.mark.parametrize("setting,batch,budget_us,k_b", [
    ("2.5/75", 512, 482.6, 5), ("5/50", 512, 304.8, 2), ("10/25", 512, 215.9, 0),
    ("2.5/75", 128, 135.1, 1), ("5/50", 128, 90.7, 0), ("10/25", 128, 68.4, 0),
    ("5/50", 64, None, 0)])
def test_kb_table_14_7(setting, batch, budget_us, k_b):
    hw = hardware_from_setting(setting)
    plan = broadcast_plan(DEEPSEEK, hw, PAPER, batch, None, None, None, 64)
    if budget_us is not None:
        assert plan.budget_s * 1e6 == pytest.approx(budget_us, abs=0.05)
    assert plan.k_b == k_b
    assert broadcast_slots(DEEPSEEK, hw, PAPER, batch, None, None, None, 64) == k_b
    if k_b:
        assert plan.time_s < plan.budget_s
        S, H = plan.payload_bytes, plan.depth_hops
        assert prebroadcast.broadcast_time(k_b + 1, S, H, 100e-9, hw.link_bw_Bps) >= plan.budget_s


def test_faithful_budget_is_per_layer_and_capped():
    hw = hardware_from_setting("5/50")
    S, H = prebroadcast.broadcast_payload(DEEPSEEK, FAITHFUL), 10
    big = broadcast_slots(DEEPSEEK, hw, FAITHFUL, 128, 10, 2e-3, 1e-3, 64)
    t = prebroadcast.broadcast_time(np.arange(1, 65), S, H, 100e-9, hw.link_bw_Bps)
    assert big == int((t < 3e-3).sum())
    assert broadcast_slots(DEEPSEEK, hw, FAITHFUL, 128, 10, 2e-3, 1e-3, 2) == min(big, 2)
    with pytest.raises(ConfigError):
        broadcast_slots(DEEPSEEK, hw, FAITHFUL, 128, 10, None, None, 8)


# ------------------------------------------------------------------------------------------------
# §14.7 Broadcast
# ------------------------------------------------------------------------------------------------

TABLE_14_7 = {  # GB/s: (T_bc*(1), (2), (3), (5), (6)), c*(1) in KB
    75: ((96.68, 181.30, 264.13, 427.32, 508.20), 61.8),
    50: ((139.32, 264.13, 386.73, 628.94, 749.15), 50.5),
    25: ((264.13, 508.20, 749.15, 1226.81, 1464.40), 35.7),
}


def test_14_7_broadcast_table_paper() -> None:
    """§14.7: DeepSeek, D = 32, H = 2√32, S = 2·h·I = 5,767,168 B, α = 100 ns."""
    model = MODELS["deepseek"]
    S = prebroadcast.broadcast_payload(model, PAPER)
    H = prebroadcast.broadcast_depth(PAPER, 32)
    assert S == 5_767_168
    assert math.isclose(H, 2 * math.sqrt(32))
    assert PAPER.bc_alpha_s == ALPHA
    for gbps, (times, chunk_kb) in TABLE_14_7.items():
        bw = gbps * 1e9
        vec = prebroadcast.broadcast_time(np.array([1, 2, 3, 5, 6]), S, H, ALPHA, bw)
        for m, value, v in zip((1, 2, 3, 5, 6), times, vec, strict=True):
            assert close(prebroadcast.broadcast_time(m, S, H, ALPHA, bw) * US, value), (gbps, m)
            assert close(v * US, value)
        assert close(prebroadcast.broadcast_chunk(1, S, H, ALPHA, bw) / 1e3, chunk_kb, 1)


def test_14_7_faithful_broadcast() -> None:
    """§14.7: faithful S = 3·h·I·2 = 17,301,504 B, H = 10 (4×8 diameter)."""
    model = MODELS["deepseek"]
    S = prebroadcast.broadcast_payload(model, FAITHFUL)
    H = prebroadcast.broadcast_depth(FAITHFUL, 32, diameter=10)
    assert S == 17_301_504 and H == 10
    for gbps, t_us, c_kb in ((75, 262.1, 113.9), (50, 384.2, 93.0), (25, 745.7, 65.8)):
        assert close(prebroadcast.broadcast_time(1, S, H, ALPHA, gbps * 1e9) * US, t_us, 1)
        assert close(prebroadcast.broadcast_chunk(1, S, H, ALPHA, gbps * 1e9) / 1e3, c_kb, 1)
    with pytest.raises(ConfigError, match="diameter"):
        prebroadcast.broadcast_depth(FAITHFUL, 32)


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        (512, ((482.6, 5), (304.8, 2), (215.9, 0))),
        (128, ((135.1, 1), (90.7, 0), (68.4, 0))),
    ],
)
def test_14_7_budget_and_kb(batch: int, expected: tuple[tuple[float, int], ...]) -> None:
    """§14.7 / §10.3: paper* budget (L_ctx = 1024) and k_b, DeepSeek 4×8."""
    model = MODELS["deepseek"]
    S = prebroadcast.broadcast_payload(model, PAPER)
    H = prebroadcast.broadcast_depth(PAPER, 32)
    for setting, (budget_us, k_b) in zip(SETTINGS, expected, strict=True):
        hw = hardware_from_setting(setting, "4x8")
        budget = prebroadcast.broadcast_budget(model, hw, PAPER, batch)
        assert budget == prebroadcast.hd_budget(model, hw, batch)
        assert close(budget * US, budget_us, 1), (setting, budget * US)
        assert prebroadcast.num_broadcast(budget, S, H, ALPHA, hw.link_bw_Bps, model.num_experts) == k_b


def test_14_7_small_batches_give_no_broadcast() -> None:
    """§14.7: B ≤ 64 → k_b = 0 in all three settings."""
    model = MODELS["deepseek"]
    S = prebroadcast.broadcast_payload(model, PAPER)
    H = prebroadcast.broadcast_depth(PAPER, 32)
    for batch in (1, 8, 16, 32, 64):
        for setting in SETTINGS:
            hw = hardware_from_setting(setting, "4x8")
            budget = prebroadcast.hd_budget(model, hw, batch)
            assert prebroadcast.num_broadcast(budget, S, H, ALPHA, hw.link_bw_Bps, 64) == 0


def test_10_4_chunk_is_optimal() -> None:
    """§10.4: T_bc(c*(m); m) = T_bc*(m), and c* minimises T_bc(c; m)."""
    S, H, bw = 5_767_168.0, 2 * math.sqrt(32), 50e9
    for m in (1, 2, 5):
        c_star = prebroadcast.broadcast_chunk(m, S, H, ALPHA, bw)
        t_star = prebroadcast.broadcast_time(m, S, H, ALPHA, bw)
        assert math.isclose(
            prebroadcast.broadcast_time_chunked(c_star, m, S, H, ALPHA, bw), t_star, rel_tol=1e-12
        )
        around = prebroadcast.broadcast_time_chunked(
            c_star * np.array([0.5, 0.9, 1.1, 2.0]), m, S, H, ALPHA, bw
        )
        assert np.all(around > t_star)
    assert prebroadcast.broadcast_time(0, S, H, ALPHA, bw) == 0.0


def test_10_3_num_broadcast_edges_and_layer_budget() -> None:
    """§10.3: k_b bounded by max_m; the faithful budget is t_nm + t_comp of the layer."""
    S, H, bw = 5_767_168.0, 2 * math.sqrt(32), 50e9
    assert prebroadcast.num_broadcast(1.0, S, H, ALPHA, bw, max_m=7) == 7
    assert prebroadcast.num_broadcast(0.0, S, H, ALPHA, bw, max_m=7) == 0
    assert prebroadcast.num_broadcast(1.0, S, H, ALPHA, bw, max_m=0) == 0
    t1 = prebroadcast.broadcast_time(1, S, H, ALPHA, bw)
    assert prebroadcast.num_broadcast(t1, S, H, ALPHA, bw, 8) == 0  # strict inequality
    model, hw = MODELS["deepseek"], hardware_from_setting("5/50")
    budget = prebroadcast.broadcast_budget(model, hw, FAITHFUL, 128, t_nm_s=1e-5, t_comp_s=2e-5)
    assert budget == pytest.approx(3e-5)
    with pytest.raises(ConfigError, match="t_nm_s"):
        prebroadcast.broadcast_budget(model, hw, FAITHFUL, 128)
