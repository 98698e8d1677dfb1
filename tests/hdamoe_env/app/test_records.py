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


def test_summary_and_table_carry_energy(tmp_path):
    def rec(m, s, jpt):
        parts = {"dram": 1.0 * jpt, "noc": 0.5 * jpt, "compute": 2.0 * jpt, "static": 0.5 * jpt}
        return {"method": m, "seed": s, "tbt_us": 10.0, "tbt_std_us": 0.0, "breakdown_us": {},
                "decision_ms_per_step": 0.1, "gating": None, "j_per_token": jpt,
                "edp_js": 2.0 * jpt, "energy_j": {**parts, "total": 4.0 * jpt}}

    recs = [rec("tp", s, 2e-3) for s in (0, 1)] + [rec("ep", s, 1.5e-3 + s * 1e-3)
                                                   for s in (0, 1)]
    rows = {r["method"]: r for r in records.summarise(recs)}
    assert rows["ep"]["j_per_token"] == pytest.approx(2e-3)
    assert rows["ep"]["energy_over_tp"] == pytest.approx((0.75 + 1.25) / 2)
    assert rows["tp"]["noc_j"] == pytest.approx(1e-3)
    table = records.format_bench_table(recs)
    assert "mJ/token" in table and "E/TP" in table and "2.000" in table
    old = [{k: v for k, v in r.items() if k not in ("j_per_token", "edp_js", "energy_j")}
           for r in recs]                     # records written before the energy model
    assert "mJ/token" in records.format_bench_table(old)
    path = records.write_csv(tmp_path / "r.csv", recs)
    head, first = path.read_text().splitlines()[:2]
    cols = dict(zip(head.split(","), first.split(","), strict=True))
    assert float(cols["j_per_token"]) == 2e-3 and float(cols["noc_j"]) == 1e-3
