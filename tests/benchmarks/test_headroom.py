"""``benchmarks/headroom.py``: a tiny end-to-end run of the placement-lever headroom table."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from hdamoe_env.config.specs import ModelSpec

pytest.importorskip("pulp")

ROOT = Path(__file__).resolve().parents[2]
MODEL = ModelSpec(key="tiny-headroom", name="tiny-headroom", num_moe_layers=4, num_experts=8,
                  top_k=2, hidden_size=64, expert_intermediate=256, hybrid_regions=2,
                  attn_weight_elements=4 * 64 * 64, kv_elements_per_token=2 * 64,
                  core_flops_per_ctx_token=4 * 64)


def _driver():
    spec = importlib.util.spec_from_file_location("headroom", ROOT / "benchmarks" / "headroom.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_args(tmp_path, learn_steps):
    return argparse.Namespace(model=MODEL, setting="1/1", mesh="2x2", batch=8,
                              conventions="faithful", evaluator="des", score_steps=2,
                              episodes=3, sampler="kind", layers=None, seed=0, workers=1,
                              learn_steps=learn_steps, learn_shaping=0.1,
                              out=str(tmp_path / "pipeline"))


def test_tiny_headroom_table(tmp_path):
    drv = _driver()
    args = tiny_args(tmp_path, 0)
    results = drv.run(args)
    assert list(results) == [3]                          # the held-out layer of L = 4
    row = results[3]
    assert row["tp"]["ratio"] == pytest.approx(1.0)
    assert row["best_baseline"]["latency_us"] == min(
        row[m]["latency_us"] for m in ("tp", "tp-tiled", "hybrid"))
    text = drv.table(results)
    assert text.count("\n") == 3 and "| 3 |" in text and "mean ratio" in text
    assert "learned" not in text


@pytest.mark.slow
def test_tiny_headroom_table_with_learned_column(tmp_path):
    pytest.importorskip("sb3_contrib")
    drv = _driver()
    results = drv.run(tiny_args(tmp_path, 32))
    assert results[3]["learned"]["ratio"] > 0 and "learned" in drv.table(results)
