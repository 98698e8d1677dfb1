"""``benchmarks/drift_headroom.py`` on a tiny drift env where re-placing pays."""

from __future__ import annotations

import pytest


def test_drift_headroom_cell_and_table(monkeypatch, load_benchmark, tiny_drift_env,
                                       small_drift_grid):
    dh = load_benchmark("drift_headroom")
    assert len(dh.cells(None)) == 12 and dh.cells("mix_5-50_B128")[0][1:] == ("mix", "5/50", 128)
    with pytest.raises(SystemExit, match="unknown cells"):
        dh.cells("ds_1-1_B8")
    assert len(dh.policy_grid(3)) == 1 + 3 * (len(dh.PERIODS) + len(dh.THRESHOLDS))
    assert len(dh.policy_grid(3, (4, 16))) == 1 + 3 * (len(dh.PERIODS) + 3 * len(dh.THRESHOLDS))
    monkeypatch.setattr(dh, "policy_grid", small_drift_grid)
    r = dh.run_cell(tiny_drift_env(), [0], [0, 2])
    # the tuned pick is one of the grid's, the oracle replays below static on these streams
    assert r["tuned_name"] in small_drift_grid(3) and r["oracle"] < r["static"]
    assert set(r["train_scores"]) == set(small_drift_grid(3))
    assert r["free"] <= r["oracle"] + 1e-12
    text = dh.table({"tiny": r})
    assert text.count("\n") == 2 and "| tiny |" in text
