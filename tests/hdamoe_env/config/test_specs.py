"""Tests of hdamoe_env.config.specs: model and hardware presets (paper-model.md §2–3), parsing,
validation with typed errors, round trips."""

from __future__ import annotations

import dataclasses

import pytest

from hdamoe_env.config.errors import ConfigError, HdMoeError
from hdamoe_env.config.profiles import PROFILES, Conventions
from hdamoe_env.config.specs import (HARDWARE_PRESETS, MODEL_PRESETS, HardwareSpec, ModelSpec,
                                     TopologySpec, get_model, hardware_from_setting, parse_mesh,
                                     parse_setting)


def test_model_presets_match_spec_table():  # §2.1
    ds = get_model("deepseek-v2-lite")
    assert (ds.num_moe_layers, ds.num_experts, ds.top_k, ds.hidden_size,
            ds.expert_intermediate, ds.shared_intermediate) == (26, 64, 6, 2048, 1408, 2816)
    assert ds.layer_key(0) == "1" and ds.num_dense_layers == 1
    mx = get_model("mixtral-8x7b")
    assert (mx.num_experts, mx.top_k, mx.hidden_size, mx.expert_intermediate) == (8, 2, 4096,
                                                                                  14336)
    assert mx.hybrid_regions == 2
    q2 = get_model("qwen2-57b-a14b")
    assert (q2.num_moe_layers, q2.top_k, q2.expert_intermediate, q2.shared_intermediate) == (
        28, 8, 2560, 20480)
    q35 = get_model("qwen3.5-35b-a3b")
    assert q35.num_experts == 256 and sum(q35.is_full_attention(l) for l in range(40)) == 10
    assert get_model("deepseek") is ds  # alias


def test_derived_sizes_bf16():  # §2.2: bytes per routed expert, 3·h·I·2
    expected = {"mixtral-8x7b": 352.3e6, "deepseek-v2-lite": 17.30e6, "qwen2-57b-a14b": 55.05e6,
                "qwen3.5-35b-a3b": 6.29e6}
    for key, value in expected.items():
        m = MODEL_PRESETS[key]
        assert abs(3 * m.hidden_size * m.expert_intermediate * 2 - value) / value < 2e-3


def test_unknown_model_suggests_near_miss():
    with pytest.raises(ConfigError, match="did you mean 'deepseek-v2-lite'"):
        get_model("deepseek-v2-lit")


def test_hardware_presets_and_parsing():
    assert set(HARDWARE_PRESETS) == {"2.5/75", "5/50", "10/25"}
    hw = hardware_from_setting("2.5/75", "8x8")
    assert hw.mesh_shape == (8, 8) and hw.num_nodes == 64 and hw.compute_flops == 2.5e12
    assert hw.link_bw_Bps == 75e9 and hw.mem_bw_Bps == 625e9 and hw.setting == "2.5/75"
    assert parse_mesh("4x8") == (4, 8) and parse_setting("10/25") == (10.0, 25.0)
    with pytest.raises(ConfigError, match="XxY"):
        parse_mesh("4by8")
    with pytest.raises(ConfigError, match="TFLOPS/GBps"):
        parse_setting("fast")
    with pytest.raises(ConfigError, match="mesh_shape"):
        HardwareSpec(mesh_shape=(0, 4))
    with pytest.raises(ConfigError, match="link_bw_gbps"):
        HardwareSpec(link_bw_gbps=-1)


def test_round_trips():
    hw = HardwareSpec(mesh_shape=(4, 4), node_dram_gib=8.0, hop_latency_ns=2.0)
    assert HardwareSpec.from_dict(hw.to_dict()) == hw
    m = MODEL_PRESETS["qwen3.5-35b-a3b"]
    assert ModelSpec.from_dict(m.to_dict()) == m
    t = TopologySpec(kind="fattree", oversubscription=2.0)
    assert TopologySpec.from_dict(t.to_dict()) == t
    for conv in PROFILES.values():
        assert Conventions.from_dict(conv.to_dict()) == conv


def test_topology_spec_rejects_unknown_kind():
    with pytest.raises(ConfigError, match="did you mean 'torus'"):
        TopologySpec(kind="torrus")


def test_specs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        HardwareSpec().compute_tflops = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("call", [
    lambda: __import__("hdamoe_env.config.specs", fromlist=["x"]).hardware_from_setting("5/50", 32),
    lambda: __import__("hdamoe_env.config.specs", fromlist=["x"]).hardware_from_setting("5/50",
                                                                               (4, 8, 2)),
    lambda: __import__("hdamoe_env.config.specs", fromlist=["x"]).hardware_from_setting("5/50",
                                                                               (4.5, 8)),
])
def test_hardware_from_setting_is_typed(call):
    """A mesh that is no pair of positive integers is a typed error (not a TypeError, not a silent
    4x8)."""
    with pytest.raises(HdMoeError, match="mesh"):
        call()
