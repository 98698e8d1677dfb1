"""``benchmarks/headroom.py``: a tiny end-to-end run of the placement-lever headroom table."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from hdamoe_env.config.specs import ModelSpec

pytest.importorskip("pulp")

MODEL = ModelSpec(key="tiny-headroom", name="tiny-headroom", num_moe_layers=4, num_experts=8,
                  top_k=2, hidden_size=64, expert_intermediate=256, hybrid_regions=2,
                  attn_weight_elements=4 * 64 * 64, kv_elements_per_token=2 * 64,
                  core_flops_per_ctx_token=4 * 64)


def tiny_args(tmp_path, learn_steps):
    return argparse.Namespace(model=MODEL, setting="1/1", mesh="2x2", batch=8,
                              conventions="faithful", evaluator="des", score_steps=2,
                              episodes=3, sampler="kind", layers=None, seed=0, workers=1,
                              learn_steps=learn_steps, learn_shaping=0.1,
                              out=str(tmp_path / "pipeline"))


def test_tiny_headroom_table(tmp_path, load_benchmark):
    drv = load_benchmark("headroom")
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
def test_tiny_headroom_table_with_learned_column(tmp_path, load_benchmark):
    pytest.importorskip("sb3_contrib")
    drv = load_benchmark("headroom")
    results = drv.run(tiny_args(tmp_path, 32))
    assert results[3]["learned"]["ratio"] > 0 and "learned" in drv.table(results)


def test_tiny_headroom_table_has_a_bound_below_every_placement(tmp_path, load_benchmark):
    drv = load_benchmark("headroom")
    row = drv.run(tiny_args(tmp_path, 0))[3]
    assert all(row["bound"]["latency_us"] <= r["latency_us"] * (1 + 1e-9)
               for k, r in row.items() if k != "bound")


class _Oracle:
    """Stand-in of OracleResult's per-layer terms: S = 1 step, K = 3 points, L = 2 layers."""

    dense_s = 1e-6
    layer_s = np.array([[[3e-6, 3e-6], [2e-6, 4e-6], [1e-6, 1e-6]]])
    layer_top1 = np.array([[[1.0, 1.0], [1.0, 0.9], [0.5, 0.5]]])


def test_subset_oracle_respects_the_per_layer_target(load_benchmark):
    drv = load_benchmark("headroom")
    out = drv._subset(_Oracle(), [0, 1, 2], 0.95)
    np.testing.assert_allclose(out["fixed_us"], [7.0, 7.0, 3.0])
    np.testing.assert_allclose(out["top1"], [1.0, 0.95, 0.5])
    assert out["oracle_us"] == pytest.approx(1 + 2 + 3)     # layer 0: point 1; layer 1: point 0
    assert out["free_us"] == pytest.approx(1 + 1 + 1)       # quality ignored: point 2
    assert drv._subset(_Oracle(), [0, 1], 0.85)["oracle_us"] == pytest.approx(1 + 2 + 3)


def test_online_tables_render_every_row(load_benchmark):
    drv = load_benchmark("headroom")
    row = {"noop_us": 10.0, "tuned_us": 8.0, "tuned_top1": 1.0, "tuned": "x", "oracle_us": 7.0,
           "free_us": 6.0}
    res = {"c": {k: dict(row) for k, _ in drv.ONLINE_ROWS}}
    res["c"]["gating@0.9"]["oracle_us"] = 7.5
    text = drv.online_table(res)
    assert text.count("\n") == len(drv.ONLINE_ROWS) + 1 and "| yes |" in text
    summary = drv.online_summary(res)
    assert "12.5 %" in summary and summary.count("| yes |") == len(drv.ONLINE_ROWS) - 1
    assert len(drv.online_levers()["gating"][0]) == 22


def test_place_cells_run_resumes_and_renders(tmp_path, monkeypatch, load_benchmark):
    """--part placement-cells on one tiny cell: the results file, a resume, the table."""
    drv = load_benchmark("headroom")
    monkeypatch.setattr(drv, "ONLINE_MODELS", {"tiny": (MODEL, "synthetic", None)})
    monkeypatch.setattr(drv, "online_cells", lambda args: [("tiny_1-1_B8", "tiny", "1/1", 8)])
    args = tiny_args(tmp_path, 0)
    args.layers, args.merge, args.table_only = "3", None, False
    res = drv.run_place_cells(args)
    row = res["tiny_1-1_B8"]
    assert row["tp"]["ratio"] == pytest.approx(1.0) and row["_meta"]["layers"] == "3"
    assert (tmp_path / "pipeline" / "place.json").exists()
    assert (tmp_path / "pipeline" / "place" / "tiny_1-1_B8").is_dir()
    args.table_only = True
    assert drv.run_place_cells(args) == res
    text = drv.place_cells_table(res)
    assert "| tiny_1-1_B8 | 3 |" in text and text.count("\n") == 2
    # --bound fixed re-runs the cell (same placements, same numbers) and adds the column
    args.table_only, args.bound = False, "fixed"
    fixed = drv.run_place_cells(args)["tiny_1-1_B8"]
    assert {k: v for k, v in fixed.items() if k not in ("bound_fixed", "_meta")} == {
        k: v for k, v in row.items() if k != "_meta"}
    fx = fixed["bound_fixed"]
    assert row["bound"]["ratio"] * (1 - 1e-12) <= fx["ratio"] <= min(
        r["ratio"] for k, r in fixed.items() if k not in ("bound", "bound_fixed", "_meta")
    ) * (1 + 1e-9)
    assert fx["gap"] <= 1e-5 and fx["solve_s"] >= 0
    text = drv.place_cells_table({"tiny_1-1_B8": fixed})
    assert "fixed-placement bound" in text and f"| {fx['ratio']:.3f} |" in text


def test_aggregator_bound_is_below_every_aggregator_rule(tmp_path, monkeypatch, load_benchmark):
    """--part aggregator-bound on a tiny cell: the bound (TBT minus the dispatch-mode layers'
    MoE communication) lies below the held-out TBT under every aggregator rule, the run
    resumes, and the table renders."""
    from agents.base import NoOpAgent
    from hdamoe_env.env.environment import HdMoeEnv

    drv = load_benchmark("headroom")
    held = dict(model=MODEL, mesh="2x2", setting="1/1", batch=8, steps_per_episode=2,
                trace_tokens=512, trace_requests=8, placement="ep")
    monkeypatch.setattr(drv, "ONLINE_MODELS", {"tiny": (MODEL, "synthetic", None)})
    monkeypatch.setattr(drv, "online_cells", lambda args: [("tiny_1-1_B8", "tiny", "1/1", 8)])
    monkeypatch.setattr(drv, "_cell_env_kwargs", lambda *a: (None, None, held))
    args = argparse.Namespace(out=str(tmp_path), merge=None, table_only=False, train_steps=1,
                              eval_steps=2, eval_seeds=2)
    row = drv.run_aggregator_bound(args)["tiny_1-1_B8"]
    assert row["steps"] == 4 and 0.0 < row["comm_share"] < 1.0
    env = HdMoeEnv(**held)
    conv = env.sim.conv
    for rule in drv.AGGREGATOR_RULES:
        e = HdMoeEnv(**{**held, "conventions": drv._with_aggregator(conv, rule)
                        if rule != conv.aggregator else conv})
        agent, tbts = NoOpAgent.from_env(e), []
        for i in range(2):
            obs, _ = e.reset(seed=10000 + i)
            done = False
            while not done:
                obs, _, term, trunc, info = e.step(agent.act(obs))
                tbts.extend([info["tbt_us"]] if "tbt_us" in info else [])
                done = term or trunc
        assert row["bound_us"] < float(np.mean(tbts))
    args.table_only = True
    assert drv.run_aggregator_bound(args) == {"tiny_1-1_B8": row}
    text = drv.aggregator_table({"tiny_1-1_B8": row})
    assert "| tiny_1-1_B8 |" in text and text.count("\n") == 2
