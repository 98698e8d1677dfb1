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
