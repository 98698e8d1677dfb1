"""The report states every HDA-MoE speed-up with its routing quality and at matched quality."""

from __future__ import annotations

from pathlib import Path

from hdamoe_env.app.bench import BenchConfig, run_bench
from hdamoe_env.app.claims import claims_section
from hdamoe_env.app.records import write_jsonl
from hdamoe_env.app.report import write_report
from hdamoe_env.config.specs import ModelSpec

TINY = ModelSpec(key="tiny", name="tiny", num_moe_layers=2, num_experts=4, top_k=2,
                 hidden_size=64, expert_intermediate=128, attn_weight_elements=4 * 64 * 64,
                 kv_elements_per_token=2 * 64, core_flops_per_ctx_token=4 * 64,
                 hybrid_regions=2)
METHODS = ["tp", "ep", "hd-moe", "hda-moe", "hda-moe@q99", "hda-moe@q95", "hda-moe@s0.25"]


def _records(tmp_path: Path) -> list[dict]:
    cfg = BenchConfig.create(model=TINY, mesh="2x2", setting="1/1", batch=8, steps=2, k_b=1,
                      conventions="paper", trace_requests=4, cache_dir=str(tmp_path / "cache"),
                      place_batch=8, env_kwargs={"trace_tokens": 256})
    out = []
    for rec in run_bench(cfg, METHODS, [0], progress=False).records:
        out.append({**rec, "figure": "fig10_end_to_end", "cell": "c0", "kind": "bench"})
    return out


def test_report_has_the_quality_section_pareto_and_matched_claims(tmp_path):
    records = _records(tmp_path)
    write_jsonl(tmp_path / "results.jsonl", records)
    text = write_report(tmp_path).read_text()
    assert "## Speed-up at matched routing quality" in text
    assert "hda-moe@q99" in text and "traces fidelity" in text
    claims = "\n".join(claims_section(records))
    assert "top-1 ≥ 99 %" in claims and "top-1 ≥ 95 %" in claims
    assert "At matched quality (top-1 ≥ 99 %)" in claims and "top-1 kept" in claims
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "figures" / "pareto_tiny_paper.png").stat().st_size > 0


def _fake(cell: str, method: str, tbt: float, **extra) -> dict:
    return {"kind": "bench", "figure": "fig10_end_to_end", "cell": cell, "method": method,
            "seed": 0, "tbt_us": tbt, "tbt_std_us": 0.0, "breakdown_us": {},
            "decision_ms_per_step": 0.0, "profile": "faithful", "model": "deepseek-v2-lite",
            "setting": "5/50", "batch": 16, "mesh": "4x8", "topology": "mesh", **extra}


def test_node_link_check_marks_each_faithful_cell(tmp_path):
    """A real tiny faithful bench (Node+Link batch-guarded at B = 8) and two crafted cells."""
    from hdamoe_env.app.report import node_link_check

    cfg = BenchConfig.create(model=TINY, mesh="2x2", setting="1/1", batch=8, steps=2,
                             conventions="faithful", trace_requests=4,
                             cache_dir=str(tmp_path / "cache"), place_batch=16,
                             env_kwargs={"trace_tokens": 256})
    real = [{**rec, "figure": "fig10_end_to_end", "cell": "real", "kind": "bench"}
            for rec in run_bench(cfg, ["tp", "tp-tiled", "ep", "hybrid", "node-link"], [0],
                                 progress=False).records]
    guard = next(r["batch_guard"] for r in real if r["method"] == "node-link")
    assert guard["batch"] == 8 and sum(guard["winner_counts"].values()) == 2
    base = {"tp": 100.0, "tp-tiled": 95.0, "ep": 120.0, "hybrid": 97.0}
    lose = [_fake("lose", m, t) for m, t in {**base, "node-link": 96.0}.items()]
    win = [_fake("win", m, t) for m, t in {**base, "node-link": 94.0}.items()]
    partial = [_fake("partial", m, t) for m, t in {"tp": 100.0, "node-link": 90.0}.items()]
    paper = [{**_fake("paper", m, t), "profile": "paper"}
             for m, t in {**base, "node-link": 99.0}.items()]
    lines = node_link_check(real + lose + win + partial + paper)
    text = "\n".join(lines)
    assert lines[0] == "## Node+Link vs the baselines its search contains"
    nl = {r["method"]: r["tbt_us"] for r in real}
    real_ok = nl["node-link"] / nl["tp"] <= min(nl[m] for m in base) / nl["tp"] + 5e-4
    assert f"**✓ in {1 + int(real_ok)} of 3 cells**" in text
    assert "worst Node+Link ÷ best baseline" in text and "1 faithful cell(s)" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| fig10")]
    assert len(rows) == 3                                   # the paper cell is not listed
    assert any("0.960" in ln and "0.950 (tp-tiled)" in ln and "✗" in ln for ln in rows)
    assert any("0.940" in ln and "✓" in ln for ln in rows)
    assert any(next(iter(guard["winner_counts"])) in ln for ln in rows)
    write_jsonl(tmp_path / "results.jsonl", real + lose + win)
    assert "## Node+Link vs the baselines its search contains" in \
        write_report(tmp_path).read_text()


def test_report_marks_a_partial_run(tmp_path):
    import json

    recs = [_fake("c1", m, t) for m, t in {"tp": 100.0, "node-link": 90.0}.items()]
    write_jsonl(tmp_path / "results.jsonl", recs)
    (tmp_path / "suite.json").write_text(json.dumps({"cells": [{}, {}, {}]}))
    (tmp_path / "run.json").write_text(json.dumps({"wall_s": 600.0, "cpu_s": 120.0,
                                                   "workers": 2, "computed": 1}))
    text = write_report(tmp_path).read_text()
    assert "Partial run: 1 of the suite's 3 cells are finished" in text
    assert "CPU time of the computed cells 2.0 min summed (1.0 min per worker" in text


def test_report_has_energy_beside_tbt_and_a_scatter_per_cell(tmp_path):
    """A real tiny bench carries the energy fields; a crafted cell where EP is slower but uses
    less energy is marked as a differing winner."""
    real = _records(tmp_path)
    rec = next(r for r in real if r["method"] == "tp")
    assert {"energy_j", "j_per_token", "edp_js"} <= set(rec)
    assert set(rec["energy_j"]) >= {"dram", "noc", "compute", "static", "total"}

    def energy(cell, method, tbt, j):
        return _fake(cell, method, tbt, j_per_token=j, edp_js=j * 16 * tbt * 1e-6,
                     energy_j={"dram": j * 16, "noc": 0.0, "compute": 0.0, "static": 0.0,
                               "total": j * 16})

    crafted = [energy("e1", "tp", 100.0, 2e-3), energy("e1", "ep", 110.0, 1.8e-3),
               energy("e1", "node-link", 95.0, 1.9e-3)]
    write_jsonl(tmp_path / "results.jsonl", real + crafted)
    text = write_report(tmp_path).read_text()
    assert "## Energy per token beside TBT" in text
    line = next(l for l in text.splitlines() if "figures/energy_latency_e1.png" in l)
    # mJ/token (E/TP / TBT/TP), then latency, energy, EDP winners
    assert "1.800 (0.900 / 1.100)" in line and "| node-link | ep | node-link | **no** |" in line
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "figures" / "energy_latency_e1.png").stat().st_size > 0
    assert (tmp_path / "figures" / "energy_latency_c0.png").stat().st_size > 0
