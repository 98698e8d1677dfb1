"""``hdamoe crossover --robust``: joint samples of the judgement knobs, verdicts and the report."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from hdamoe_env.app import bench, robust
from hdamoe_env.app.cli import main
from hdamoe_env.app.methods import DEFAULT_METHODS
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.profiles import get_profile
from hdamoe_env.config.specs import get_model
from hdamoe_env.config.uncertainty import UNCERTAINTIES, Uncertainty

#: TP's TBT grows with the per-GEMM overhead (it runs a GEMM of every active expert on every
#: node), EP's does not: the winner flips from TP to EP at this overhead (seconds).
FLIP_S = 2.5e-7


def _fake_run_bench(ep_tbt_us):
    """A stand-in for ``bench.run_bench``: TBT as a known function of the sample's knobs."""
    def run(config, methods, seeds, progress=False):
        conv = config.run.conventions
        hop = 1e6 * conv.hop_latency_s        # the same for both methods: decides nothing
        tbt = {"tp": 100.0 + 2e8 * conv.gemm_overhead_s + hop, "ep": ep_tbt_us + hop}
        records = [{"method": m, "seed": s, "tbt_us": tbt[m], "tbt_std_us": 0.0,
                    "breakdown_us": {}, "decision_ms_per_step": 0.0,
                    "model": config.model_spec.key, "setting": config.setting,
                    "mesh": config.mesh, "batch": config.batch, "profile": conv.name}
                   for m in methods for s in seeds]
        return SimpleNamespace(records=records)
    return run


def test_stump_finds_a_known_threshold():
    values = [0.5, 3.0, 1.0, 4.0, 2.0, 5.0]
    labels = ["a", "b", "a", "b", "a", "b"]
    split = robust.stump_split(values, labels)
    assert split["threshold"] == 2.0 and split["accuracy"] == 1.0
    assert (split["below"], split["above"]) == ("a", "b") and split["baseline"] == 0.5
    same = robust.stump_split(values, ["a"] * 6)
    assert same["threshold"] is None and same["accuracy"] == 1.0


def test_verdict_names_the_knob_that_separates_the_winners():
    rng = np.random.default_rng(0)
    decisive = rng.random(40)
    noise = rng.random(40)
    winners = ["hybrid" if v < 0.3 else "tp" for v in decisive]
    verdict = robust.cell_verdict({"noise": noise, "tile_cols": decisive}, winners,
                                  base_winner="tp")
    assert not verdict["robust"] and verdict["deciding"] == "tile_cols"
    assert verdict["splits"]["tile_cols"]["accuracy"] == 1.0
    assert verdict["splits"]["noise"]["accuracy"] < 1.0
    assert robust.mark(verdict).startswith("depends on tile_cols")
    steady = robust.cell_verdict({"noise": noise}, ["tp"] * 39 + ["ep"], base_winner="tp")
    assert steady["robust"] and steady["deciding"] is None and steady["base_share"] == 0.975
    assert robust.mark(steady) == "robust (98%)"
    # a modal winner that is not the base profile's winner is not a robust headline
    other = robust.cell_verdict({"noise": noise}, ["ep"] * 40, base_winner="tp")
    assert robust.mark(other) == "conditional (0%; ep wins 100% of the samples)"


def test_ties_go_to_the_first_listed_method():
    winner, tied = robust.lowest_winner({"tp": 10.0, "node-link": 10.0, "ep": 12.0},
                                  ["tp", "ep", "node-link"])
    assert winner == "tp" and tied == ["tp", "node-link"]


def test_placements_are_reoptimised_only_where_the_base_grid_is_illegal():
    model = get_model("deepseek-v2-lite")             # I = 1408: 22 tiles of 64 columns
    base = get_profile("faithful")
    finer = base.derive(tile_cols=32, gemm_overhead_s=1e-6)
    assert robust.placement_profile(model, base, finer, ["tile_cols", "gemm_overhead_s"]) is base
    coarser = base.derive(tile_cols=128, gemm_overhead_s=1e-6)
    place = robust.placement_profile(model, base, coarser, ["tile_cols", "gemm_overhead_s"])
    assert place.name == "faithful+tile_cols=128"


def test_cells_sample_every_uncertainty_and_every_registered_method():
    cells = robust.robust_cells(models=("deepseek-v2-lite",), settings=("5/50", "10/25"),
                                batches=(128,), samples=6, seed=3, mixtral_dir=None)
    benches = [c for c in cells if c.kind == "bench"]
    assert len(benches) == 2 * (6 + 1)                 # + the base profile per cell
    assert all(c.params["methods"] == list(DEFAULT_METHODS) for c in benches)
    assert benches[0].tags["robust_knobs"] == sorted(UNCERTAINTIES)
    per_setting = {}
    for c in benches:
        per_setting.setdefault(c.params["config"]["setting"], []).append(
            c.params["config"]["conventions"])
    assert per_setting["5/50"] == per_setting["10/25"]          # common samples in every cell
    assert per_setting["5/50"][0] == "faithful" and len(set(per_setting["5/50"])) == 7
    sources = {c.params["placement_from"]["conventions"] for c in benches}
    placements = {c.params["config"]["conventions"] for c in cells if c.kind == "placement"}
    assert sources == placements and "faithful" in sources
    assert robust.robust_cells(models=("deepseek-v2-lite",), settings=("5/50",), batches=(128,),
                               samples=6, seed=3, mixtral_dir=None)[-1].key == benches[6].key
    with pytest.raises(ConfigError, match="unknown uncertainty 'tile_col'"):
        robust.robust_cells(models=("deepseek-v2-lite",), settings=("5/50",), batches=(8,),
                            knobs=["tile_col"])
    with pytest.raises(ConfigError, match="samples must be an integer >= 1"):
        robust.robust_cells(models=("deepseek-v2-lite",), settings=("5/50",), batches=(8,),
                            samples=0)


def test_tiny_run_finds_the_knob_at_which_the_winner_flips(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "run_bench", _fake_run_bench(ep_tbt_us=150.0))
    out = tmp_path / "rb"
    argv = ["crossover", "--robust", "--suite", "tiny", "--out", str(out), "--methods", "tp,ep",
            "--knob", "gemm_overhead_s", "--knob", "hop_latency_s", "--samples", "12",
            "--workers", "1"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "warning: --samples 12 < 64" in captured.err
    (row,) = json.loads((out / "robust.json").read_text())["rows"]
    assert row["knobs"] == ["gemm_overhead_s", "hop_latency_s"] and len(row["samples"]) == 12
    overheads = np.array([s["knobs"]["gemm_overhead_s"] for s in row["samples"]])
    assert (overheads < FLIP_S).any() and (overheads > FLIP_S).any()
    assert row["base"]["winner"] == "tp"             # faithful: 100 ns per GEMM < FLIP_S
    assert not row["robust"] and row["deciding"] == "gemm_overhead_s"
    split = row["splits"]["gemm_overhead_s"]
    assert split["accuracy"] == 1.0 and (split["below"], split["above"]) == ("tp", "ep")
    assert split["threshold"] == overheads[overheads < FLIP_S].max()   # the flip lies above it
    assert row["splits"]["hop_latency_s"]["accuracy"] < 1.0
    text = (out / "robust.md").read_text()
    assert "depends on gemm_overhead_s" in text and "tp if gemm_overhead_s ≤" in text
    assert main(argv) == 2                                   # non-empty: --resume or --force
    assert "pass --resume to continue it" in capsys.readouterr().err
    assert main([*argv, "--resume"]) == 0
    assert "0 cell(s) computed, 13 resumed" in capsys.readouterr().out


def test_tiny_run_with_a_robust_winner(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "run_bench", _fake_run_bench(ep_tbt_us=1000.0))
    out = tmp_path / "rb"
    assert main(["crossover", "--robust", "--suite", "tiny", "--out", str(out), "--methods",
                 "tp,ep", "--knob", "gemm_overhead_s", "--knob", "hop_latency_s", "--samples",
                 "8", "--workers", "1"]) == 0
    (row,) = json.loads((out / "robust.json").read_text())["rows"]
    assert row["robust"] and row["counts"] == {"tp": 8} and row["mark"] == "robust (100%)"
    assert row["deciding"] is None
    assert "robust (100%)" in (out / "robust.md").read_text()


def test_robust_options_are_checked(tmp_path, capsys):
    assert main(["crossover", "--robust", "--suite", "tiny", "--out", str(tmp_path / "a"),
                 "--knob", "tile_cols=16,32"]) == 2
    assert "values are not allowed" in capsys.readouterr().err
    assert main(["crossover", "--robust", "--suite", "tiny", "--out", str(tmp_path / "b"),
                 "--knob", "tile_col"]) == 2
    assert "did you mean 'tile_cols'" in capsys.readouterr().err


def test_custom_uncertainties_are_sampled_within_their_ranges():
    knobs = {"gemm_overhead_s": Uncertainty("gemm_overhead_s", 1e-8, 1e-7, "test", scale="log")}
    cells = robust.robust_cells(models=("deepseek-v2-lite",), settings=("5/50",), batches=(8,),
                                methods=("tp", "ep"), samples=5, knobs=knobs)
    values = [get_profile(c.params["config"]["conventions"]).gemm_overhead_s
              for c in cells if c.tags["robust_sample"] != "base"]
    assert len(values) == 5 and all(1e-8 <= v <= 1e-7 for v in values)
    # Latin hypercube: one sample per fifth of the log range
    strata = np.floor(5 * (np.log(values) - np.log(1e-8)) / np.log(10)).astype(int)
    assert sorted(strata.tolist()) == [0, 1, 2, 3, 4]


def test_parts_of_a_grid_run_into_one_out_are_reported_together(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "run_bench", _fake_run_bench(ep_tbt_us=1000.0))
    out = tmp_path / "rb"
    argv = ["crossover", "--robust", "--suite", "tiny", "--out", str(out), "--methods", "tp,ep",
            "--knob", "gemm_overhead_s", "--samples", "3", "--workers", "1", "--resume"]
    assert main([*argv, "--settings", "5/50"]) == 0
    assert main([*argv, "--settings", "10/25"]) == 0        # results.jsonl: this part only
    rows = json.loads((out / "robust.json").read_text())["rows"]
    assert sorted(r["setting"] for r in rows) == ["10/25", "5/50"]
    assert all(len(r["samples"]) == 3 and r["base"] is not None for r in rows)


def test_keep_routing_ranks_only_the_methods_that_change_no_expert_choice():
    """A gating method that wins every sample by changing routing is left out of the
    ``keep_routing`` verdicts (which then name the best routing-preserving method), and every
    row states the modal winner's worst top-1 retention."""
    def rec(sample, method, tbt, changed=0.0, top1=1.0):
        return {"kind": "bench", "figure": robust.FIGURE, "model": "m", "setting": "5/50",
                "batch": 128, "mesh": "4x8", "base": "faithful", "robust_n": 4,
                "robust_seed": 0, "robust_knobs": ["gemm_overhead_s"], "robust_sample": sample,
                "profile": "faithful", "method": method, "seed": 0, "tbt_us": tbt,
                "tbt_std_us": 0.0, "breakdown_us": {}, "decision_ms_per_step": 0.0,
                "gating": {"changed_fraction": changed, "top1_retention": top1}}

    records = []
    for sample in ("base", 0, 1, 2, 3):
        records += [rec(sample, "tp", 100.0), rec(sample, "ep", 90.0 + (sample == 3) * 20),
                    rec(sample, "hda-moe", 80.0, changed=0.4, top1=0.7 - 0.01 * (sample == 1))]
    (row,) = robust.analyse_robust(records)
    assert row["modal"] == "hda-moe" and row["counts"] == {"hda-moe": 4}
    assert row["top1_min"]["hda-moe"] == pytest.approx(0.69) and row["top1_min"]["tp"] == 1.0
    (kept,) = robust.analyse_robust(records, keep_routing=True)
    assert kept["excluded"] == ["hda-moe"]
    assert kept["counts"] == {"ep": 3, "tp": 1} and kept["base"]["winner"] == "ep"
    text = robust.render_section([kept], keep_routing=True)
    assert "left out: `hda-moe`" in text and "| 100.0% |" in text
    assert "69.0%" in robust.render_section([row])
