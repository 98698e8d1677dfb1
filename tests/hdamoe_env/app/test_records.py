"""Tests of hdamoe_env.app.records: the summary table of bench records (speed-ups over TP and EP)
and the Student-t interval of several seeds.
"""

from __future__ import annotations

import math

import pytest

from hdamoe_env.app import records
from hdamoe_env.config.errors import ConfigError


def test_summary_speedups():
    recs = [{"method": m, "seed": s, "tbt_us": t, "tbt_std_us": 0.0, "breakdown_us": {},
             "decision_ms_per_step": 0.1, "gating": None}
            for m, t in (("tp", 10.0), ("ep", 8.0), ("hd-moe", 5.0)) for s in (0, 1)]
    rows = {r["method"]: r for r in records.summarise(recs)}
    assert rows["hd-moe"]["speedup_over_tp"] == pytest.approx(2.0)
    assert rows["hd-moe"]["speedup_over_ep"] == pytest.approx(1.6)
    assert rows["ep"]["tbt_over_tp"] == pytest.approx(0.8)
    assert "speedup_over_hybrid" not in rows["tp"]


def test_t_interval_by_hand():
    pytest.importorskip("scipy")
    mean, hw = records.t_interval([1.0, 2.0, 3.0])      # s = 1, t(0.975, 2) = 4.302653
    assert mean == 2.0 and hw == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)
    assert records.t_interval([5.0]) == (5.0, None)
    mean, hw = records.t_interval([10.0, 14.0])          # s = 2√2, t(0.975, 1) = 12.706205
    assert mean == 12.0 and hw == pytest.approx(12.706205 * 2.0, rel=1e-6)
    with pytest.raises(ConfigError):
        records.t_interval([])
