"""The pre-broadcast budget and plan (paper-model.md §10.3–10.4, check values §14.7):
chunk size, T_bc*, k_b (``hdamoe_env.cost.broadcast``)."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.profiles import get_profile
from hdamoe_env.config.specs import get_model, hardware_from_setting
from hdamoe_env.cost import broadcast as prebroadcast
from hdamoe_env.cost.broadcast import broadcast_plan, broadcast_slots

DEEPSEEK = get_model("deepseek-v2-lite")
PAPER = get_profile("paper")
FAITHFUL = get_profile("faithful")


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
