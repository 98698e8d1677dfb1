"""Tests of hdamoe_env.app.compare: methods on identical held-out episodes, intervals over
seeds, paired differences, Markdown / LaTeX / CSV output with constant columns dropped."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest

from hdamoe_env.app import compare as cmp
from hdamoe_env.app.bench import BenchConfig
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.specs import ModelSpec

pytest.importorskip("scipy")

TINY = ModelSpec(key="tiny", name="tiny", num_moe_layers=2, num_experts=4, top_k=2,
                 hidden_size=64, expert_intermediate=128, attn_weight_elements=4 * 64 * 64,
                 kv_elements_per_token=2 * 64, core_flops_per_ctx_token=4 * 64,
                 hybrid_regions=2)
SEEDS = [10_000, 10_001, 10_002, 10_003, 10_004]


def _config(tmp_path):
    return BenchConfig.create(model=TINY, mesh="2x2", setting="1/1", batch=8, steps=2, k_b=1,
                              trace_requests=4, cache_dir=str(tmp_path / "cache"),
                              place_batch=8, fidelity="analytic",
                              env_kwargs={"trace_tokens": 256,
                                          "trace_seed": cmp.HELD_OUT_TRACE_SEED})


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    return cmp.compare(_config(tmp), ["tp", "ep", "hda-moe"], SEEDS, bootstrap_reps=200)


def test_statistics(result):
    assert result.methods == ["tp", "ep", "hda-moe"] and result.reference == "hda-moe"
    assert result.seeds == SEEDS
    by = {(r["method"], r["seed"]): r for r in result.records}
    for m in result.methods:
        vals = np.array(result.per_seed[m])
        assert vals.shape == (5,)
        assert [by[(m, s)]["tbt_us"] for s in SEEDS] == result.per_seed[m]
        st = result.stats[m]
        assert st["mean_us"] == pytest.approx(vals.mean())
        assert st["t95_us"] == pytest.approx(2.776445 * vals.std(ddof=1) / np.sqrt(5), rel=1e-5)
        assert st["iqm_low_us"] <= st["iqm_us"] <= st["iqm_high_us"]
    ref = np.array(result.per_seed["hda-moe"])
    ep = result.stats["ep"]
    assert ep["diff_us"] == pytest.approx(np.mean(np.array(result.per_seed["ep"]) - ref))
    assert result.stats["hda-moe"]["diff_us"] is None
    # identical episodes: the TP records of a seed are those of the same decode steps
    assert len({by[(m, SEEDS[0])]["trace_id"] for m in result.methods}) == 1


def test_outputs_markdown_latex_csv(result, tmp_path):
    md = cmp.format_compare(result, "markdown")
    assert "| method |" in md and "± 95 % (t)" in md and "IQM µs" in md
    assert "Δ vs hda-moe µs" in md and "stratified bootstrap" in md
    assert "Per-seed TBT" in md and "| 10004 |" in md
    # top-1 retention is 1 for every method here (no gating difference): dropped and named
    header = md.split("| method |")[1].splitlines()[0]
    if len({result.stats[m]["top1_retention"] for m in result.methods}) == 1:
        assert "top-1 retention" not in header and "column dropped" in md
    tex = cmp.format_compare(result, "latex")
    assert tex.startswith(r"\begin{tabular}") and r"$\pm$ 95 \%" in tex
    rows = list(csv.reader(io.StringIO(cmp.format_compare(result, "csv"))))
    assert rows[0][0] == "method" and [r[0] for r in rows[1:]] == result.methods
    assert float(rows[1][rows[0].index("TBT µs")]) == result.stats["tp"]["mean_us"]
    paths = cmp.write_outputs(result, tmp_path / "out")
    assert sorted(p.name for p in paths) == ["compare.csv", "compare.json", "compare.md",
                                            "compare.tex", "seeds.csv"]
    data = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert data["per_seed_tbt_us"]["ep"] == result.per_seed["ep"]


def test_fewer_than_five_seeds_have_no_iqm_and_errors(tmp_path):
    res = cmp.compare(_config(tmp_path), ["tp", "ep"], [0, 1, 2], reference="tp")
    assert res.stats["ep"]["iqm_us"] is None
    md = cmp.format_compare(res)
    assert "IQM" not in md and "Δ vs tp µs" in md
    with pytest.raises(ConfigError, match="two methods"):
        cmp.compare(_config(tmp_path), ["tp"], [0, 1])
    with pytest.raises(ConfigError, match="two seeds"):
        cmp.compare(_config(tmp_path), ["tp", "ep"], [0])
    with pytest.raises(ConfigError, match="reference"):
        cmp.compare(_config(tmp_path), ["tp", "ep"], [0, 1], reference="hd-moe")


def test_cli_refuses_to_overwrite_a_comparison(tmp_path, capsys):
    from hdamoe_env.app.cli import main

    (tmp_path / "compare.md").write_text("earlier run\n")
    code = main(["compare", "--methods", "tp,ep", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "already holds ['compare.md']" in err[0]
    assert err[0].endswith("(see `hdamoe compare --help`)")
    assert (tmp_path / "compare.md").read_text() == "earlier run\n"
