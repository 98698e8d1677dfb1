"""``benchmarks/drift_headroom.py`` and ``benchmarks/drift_learned.py`` on a tiny drift env."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from hdamoe_env.config.specs import ModelSpec
from hdamoe_env.env.drift import HdMoeDriftEnv, periodic_policy, static_policy

ROOT = Path(__file__).resolve().parents[2]
MODEL = ModelSpec(key="tiny-drift-bench", name="tiny-drift-bench", num_moe_layers=2,
                  num_experts=8, top_k=2, hidden_size=64, expert_intermediate=256,
                  attn_weight_elements=4 * 64 * 64, kv_elements_per_token=2 * 64,
                  core_flops_per_ctx_token=4 * 64)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_env(*_args) -> HdMoeDriftEnv:
    """Slow compute and skewed regimes: re-placing pays here (the oracle re-places)."""
    return HdMoeDriftEnv(model=MODEL, mesh="2x4", setting="0.05/1", batch=64, trace_requests=4,
                         trace_tokens=256, num_regimes=2, regime_skews=(1.0, 3.0), window=8,
                         num_windows=3, mean_dwell=4.0)


def small_grid(levels: int) -> dict:
    """Three candidates instead of the benchmark's 28 (seconds, not tens of seconds)."""
    return {"static": static_policy(), "periodic@8 r2": periodic_policy(8, levels - 1),
            "periodic@16 r0": periodic_policy(16, 0)}


def test_drift_headroom_cell_and_table(monkeypatch):
    dh = _load("drift_headroom")
    assert len(dh.cells(None)) == 8 and dh.cells("mix_5-50_B128")[0][1:] == ("mix", "5/50", 128)
    with pytest.raises(SystemExit, match="unknown cells"):
        dh.cells("ds_1-1_B8")
    assert len(dh.policy_grid(3)) == 1 + 3 * (len(dh.PERIODS) + len(dh.THRESHOLDS))
    monkeypatch.setattr(dh, "policy_grid", small_grid)
    grid = small_grid(3)
    r = dh.run_cell(tiny_env(), [0], [0, 2])
    # the tuned pick is one of the grid's, the oracle replays below static on these streams
    assert r["tuned_name"] in grid and r["oracle"] < r["static"]
    assert r["oracle"] <= r["tuned"] + 1e-12 or r["tuned_name"] != "static"
    assert r["free"] <= r["oracle"] + 1e-12
    text = dh.table({"tiny": r})
    assert text.count("\n") == 2 and "| tiny |" in text


def test_drift_learned_runs_resumes_and_summarises(tmp_path, monkeypatch):
    pytest.importorskip("sb3_contrib")
    dl, dh = _load("drift_learned"), _load("drift_headroom")
    monkeypatch.setattr(dh, "policy_grid", small_grid)
    monkeypatch.setattr(dl, "_headroom_module", lambda: dh)
    monkeypatch.setattr(dl, "make_env", tiny_env)
    argv = ["--cell", "tiny", "--seeds", "1", "--train-seeds", "0", "--heldout-seeds", "0",
            "2", "--timesteps", "32", "--eval-every", "16", "--n-steps", "16", "--batch-size",
            "16", "--n-epochs", "1", "--out", str(tmp_path)]
    dl.main(argv)
    res = json.loads((tmp_path / "tiny.json").read_text())
    assert sorted(res["runs"]) == ["1"]
    assert [s for s, _ in res["runs"]["1"]["curve"]] == [16, 32]
    ref = res["references"]
    assert ref["oracle"] < ref["static"] and res["runs"]["1"]["heldout"] > 0
    text = dl.summary("tiny", res)
    assert "hindsight oracle" in text and "95 % t" in text
    before = (tmp_path / "tiny.json").read_text()
    dl.main(argv)                                   # resumes: nothing re-trained
    assert json.loads((tmp_path / "tiny.json").read_text())["runs"] == json.loads(before)["runs"]
