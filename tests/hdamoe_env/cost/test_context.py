"""Tests of hdamoe_env.cost.context: sourced context-length distributions, their sampling and the
decode-step attention/KV cost of per-request context lengths (docs/PHYSICS.md §12–13)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.specs import hardware_from_setting
from hdamoe_env.cost import context, nonmoe
from tests.hdamoe_env.cost.check_values import FAITHFUL, MODELS, PAPER, PAPER_HD, US


def test_distributions_are_sourced_and_consistent():
    conv = context.CONTEXT_DISTRIBUTIONS["azure-conv"]
    code = context.get_context_distribution("azure-code")
    # the faithful default context is the Azure conversation mean (1226.5 tokens)
    assert abs(FAITHFUL.nonmoe_ctx_len - conv.mean_tokens) <= 0.5
    assert (PAPER.nonmoe_ctx_len, PAPER_HD.nonmoe_ctx_len) == (64, 1024)
    for d in (conv, code):
        assert "AzureLLMInferenceTrace" in d.source
        assert abs(d.table_mean / d.mean_tokens - 1) < 0.011
    assert conv.tokens[10] == 1249 and code.tokens[10] == 1586   # medians
    with pytest.raises(ConfigError, match="context distribution"):
        context.get_context_distribution("sharegpt-v9")
    with pytest.raises(ConfigError, match="probabilities"):
        context.ContextDistribution("bad", "", (0.0, 0.5), (1, 2), 1.0, 1)


def test_sampling_is_seeded_and_matches_the_table():
    a = context.sample_context_lengths("azure-conv", 200_000, np.random.default_rng(0))
    b = context.sample_context_lengths("azure-conv", 200_000, np.random.default_rng(0))
    c = context.sample_context_lengths("azure-conv", 1000, np.random.default_rng(1))
    assert np.array_equal(a, b) and not np.array_equal(a[:1000], c)
    assert a.dtype == np.int64 and a.min() >= 1 and a.max() <= 14088
    table = context.CONTEXT_DISTRIBUTIONS["azure-conv"]
    assert abs(a.mean() / table.table_mean - 1) < 0.01
    assert abs(np.median(a) - 1249) <= 5
    assert context.sample_context_lengths("azure-code", 0, np.random.default_rng(0)).size == 0
    with pytest.raises(ConfigError):
        context.sample_context_lengths("azure-code", -1, np.random.default_rng(0))


def test_step_lengths_from_trace_positions_or_distribution():
    rng = np.random.default_rng(3)
    assert context.step_context_lengths(3, rng, pos=[0, 9, 99]).tolist() == [1, 10, 100]
    assert context.step_context_lengths(4, rng, "azure-code").shape == (4,)
    with pytest.raises(ConfigError, match="shape"):
        context.step_context_lengths(2, rng, pos=[0, 1, 2])
    with pytest.raises(ConfigError, match=">= 0"):
        context.trace_context_lengths([-1])


def test_faithful_nonmoe_check_values_context_and_dram():
    """DeepSeek-V2-Lite, faithful, 5/50, B = 128, MoE layer 0 (full attention), by hand from
    docs/PHYSICS.md §12–13: FLOP = B·(2·W_attn + F_core·L + 6·h·I_s) = 128·(27,525,120 +
    10,240·1226 + 34,603,008) = 9,559,343,104 → /(32·5 TFLOPS) = 59.7459 µs; bytes =
    b_w·(W_attn + 3·h·I_s) + B·L·kv·2 = 62,128,128 + 128·1226·576·2 = 242,909,184 →
    /(32·625 GB/s·0.85) = 14.2888 µs (compute-bound)."""
    model = MODELS["deepseek"]
    hw = hardware_from_setting("5/50")
    t = nonmoe.nonmoe_time(model, hw, FAITHFUL, 128, 0)
    assert math.isclose(t.compute_s * US, 59.7458944, rel_tol=1e-9)
    assert math.isclose(t.memory_s * US, 242_909_184 / (32 * 625e9 * 0.85) * US, rel_tol=1e-12)
    assert round(t.memory_s * US, 4) == 14.2888
    # per-request lengths: the step's cost is the cost at their mean (linear in L)
    lens = np.array([100, 2352] * 64)                        # mean 1226
    s = context.step_nonmoe_time(model, hw, FAITHFUL, lens, 0)
    assert s.compute_s == t.compute_s and s.memory_s == t.memory_s
    # doubling every context adds exactly B·L·(F_core/(D·C)) compute
    s2 = context.step_nonmoe_time(model, hw, FAITHFUL, 2 * lens, 0)
    assert math.isclose(s2.compute_s - s.compute_s, 128 * 1226 * 10240 / (32 * 5e12),
                        rel_tol=1e-9)
    with pytest.raises(ConfigError):
        context.step_nonmoe_time(model, hw, FAITHFUL, [], 0)
    with pytest.raises(ConfigError, match="ctx_len"):
        nonmoe.nonmoe_time(model, hw, FAITHFUL, 128, 0, ctx_len=-1.0)
