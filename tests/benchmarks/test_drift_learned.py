"""``benchmarks/drift_learned.py`` on a tiny drift env (a 32-step MaskablePPO run)."""

from __future__ import annotations

import json

import pytest


def test_drift_learned_runs_resumes_and_summarises(tmp_path, monkeypatch, load_benchmark,
                                                   tiny_drift_env, small_drift_grid):
    pytest.importorskip("sb3_contrib")
    dl, dh = load_benchmark("drift_learned"), load_benchmark("drift_headroom")
    monkeypatch.setattr(dh, "policy_grid", small_drift_grid)
    monkeypatch.setattr(dl, "_headroom_module", lambda: dh)
    monkeypatch.setattr(dl, "make_env", tiny_drift_env)
    argv = ["--cell", "tiny", "--seeds", "1", "--train-seeds", "0", "--heldout-seeds", "0",
            "2", "--timesteps", "32", "--eval-every", "16", "--n-steps", "16", "--batch-size",
            "16", "--n-epochs", "1", "--out", str(tmp_path), "--tensorboard",
            str(tmp_path / "tb"), "--causal-refs"]
    dl.main(argv)
    res = json.loads((tmp_path / "tiny.json").read_text())
    assert sorted(res["runs"]) == ["1"]
    assert [s for s, _ in res["runs"]["1"]["curve"]] == [16, 32]
    ref = res["references"]
    assert ref["oracle"] < ref["static"] and res["runs"]["1"]["heldout"] > 0
    text = dl.summary("tiny", res)
    assert "hindsight oracle" in text and "95 % t" in text
    causal = res["causal"]
    assert causal["open-loop"]["name"].startswith("once@")
    assert causal["regime-aware"]["name"].startswith("regime r")
    for c in causal.values():                    # never better than the oracle on held-out
        assert ref["oracle"] <= c["heldout"] + 1e-12
    assert "best open-loop" in text and "best regime-aware" in text
    runs = list((tmp_path / "tb").iterdir())
    assert len(runs) == 1
    assert runs[0].name.startswith(
        "HdMoE-Drift-v1__tiny-drift-bench__0.05-1__B64__maskable-ppo__1__")
    before = (tmp_path / "tiny.json").read_text()
    dl.main(argv)                                   # resumes: nothing re-trained
    assert json.loads((tmp_path / "tiny.json").read_text())["runs"] == json.loads(before)["runs"]
