"""``hdamoe crossover``: grid construction, resumable cells, winners and the report."""

from __future__ import annotations

import json

import pytest

from hdamoe_env.app import crossover
from hdamoe_env.app.cli import main
from hdamoe_env.config.errors import ConfigError


def test_cells_sweep_one_knob_at_a_time_with_derived_profiles():
    cells = crossover.crossover_cells(models=("deepseek-v2-lite",), settings=("5/50", "10/25"),
                                      batches=(32, 128), knobs={"b_psum": (2, 4, 8)},
                                      methods=("tp", "ep"), mixtral_dir=None)
    # per (setting, B): the base cell + the two values that differ from faithful's b_psum = 4
    assert len(cells) == 2 * 2 * 3
    profiles = sorted({c.params["config"]["conventions"] for c in cells})
    assert profiles == ["faithful", "faithful+b_psum=2", "faithful+b_psum=8"]
    assert all(c.kind == "bench" for c in cells)            # tp, ep: no placement cell


def test_knob_cells_reuse_the_base_placements_unless_replace():
    kw = dict(models=("deepseek-v2-lite",), settings=("5/50",), batches=(128,),
              knobs={"b_psum": (2,)}, methods=("tp", "node-link"), mixtral_dir=None)
    cells = crossover.crossover_cells(**kw)
    assert [c.kind for c in cells] == ["placement", "bench", "bench"]
    knob = [c for c in cells if c.tags.get("knob") == "b_psum"][0]
    assert knob.params["placement_from"]["conventions"] == "faithful"
    replaced = crossover.crossover_cells(**kw, replace=True)
    assert [c.kind for c in replaced] == ["placement", "placement", "bench", "bench"]


def test_unknown_knobs_and_bad_values_are_typed_errors():
    with pytest.raises(ConfigError, match="unknown convention knob 'nope'"):
        crossover.parse_knob("nope=1,2")
    with pytest.raises(ConfigError, match="b_psum='x' is not a valid int"):
        crossover.parse_knob("b_psum=2,x")
    assert crossover.parse_knob("b_psum=2,4") == ("b_psum", (2, 4))


def test_context_len_and_dram_knobs_are_swept():
    """``context_len`` names the mean decode context ``nonmoe_ctx_len`` (cost.context)."""
    assert crossover.parse_knob("context_len=512,8192") == ("nonmoe_ctx_len", (512, 8192))
    assert crossover.parse_knob("context_len") == ("nonmoe_ctx_len", (512, 1226, 4096, 8192))
    assert crossover.parse_knob("dram_efficiency=0.7,1") == ("dram_efficiency", (0.7, 1.0))
    with pytest.raises(ConfigError, match="dram_efficiency"):
        crossover.parse_knob("dram_efficiency=0")
    cells = crossover.crossover_cells(models=("deepseek-v2-lite",), settings=("5/50",),
                                      batches=(128,), knobs={"nonmoe_ctx_len": (1226, 8192)},
                                      methods=("tp",), mixtral_dir=None)
    profiles = sorted(c.params["config"]["conventions"] for c in cells)
    assert profiles == ["faithful", "faithful+nonmoe_ctx_len=8192"]


def test_tiny_run_finds_winners_and_resumes(tmp_path, capsys):
    out = tmp_path / "xo"
    argv = ["crossover", "--suite", "tiny", "--out", str(out), "--methods", "tp,ep",
            "--knob", "b_psum=2,8", "--workers", "1"]
    assert main(argv) == 0
    rows = json.loads((out / "crossover.json").read_text())["rows"]
    base = next(r for r in rows if r["knob"] == "base")
    knob = next(r for r in rows if r["knob"] == "b_psum" and r["value"] == 8)
    # 2x more partial-sum bytes slow every all-reduce: the non-MoE one of every method, and
    # TP's MoE all-reduce on top, so TP loses more than EP
    tp_extra = knob["tbt_us"]["tp"] - base["tbt_us"]["tp"]
    ep_extra = knob["tbt_us"]["ep"] - base["tbt_us"]["ep"]
    assert ep_extra > 0 and tp_extra > ep_extra
    assert base["winner"] in ("tp", "ep") and base["margin"] >= 1.0
    text = (out / "crossover.md").read_text()
    assert "Where each method wins" in text and "b_psum" in text
    capsys.readouterr()
    assert main(argv) == 0                                   # everything resumed
    assert "0 cell(s) computed, 3 resumed" in capsys.readouterr().out


def test_refuses_a_foreign_non_empty_out(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["crossover", "--suite", "tiny", "--out", str(tmp_path),
                 "--methods", "tp,ep"]) == 2
    assert "is not an `hdamoe crossover` output" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_trace_skew_cells_change_the_trace_and_optimise_placements_on_it(tmp_path):
    mixtral_dir = tmp_path / "mixtral"
    mixtral_dir.mkdir()
    (mixtral_dir / "experts_reasoning_mixtral.json").write_text("{}")   # a "real" trace
    cells = crossover.crossover_cells(
        models=("deepseek-v2-lite", "mixtral-8x7b"), settings=("5/50",), batches=(128,),
        knobs={"trace_skew": (0.5, 1.0, 2.0)}, methods=("tp", "node-link"),
        mixtral_dir=str(mixtral_dir))
    skew = [c for c in cells if c.tags.get("knob") == "trace_skew"]
    # τ = 1 is the base cell; Mixtral runs on its real trace, so it has no skew cells
    assert sorted(c.tags["value"] for c in skew) == [0.5, 2.0]
    assert {c.params["config"]["model"] for c in skew} == {"deepseek-v2-lite"}
    for cell in skew:
        cfg = cell.params["config"]
        assert cfg["trace_skew"] == cell.tags["value"] and cfg["conventions"] == "faithful"
        assert cell.params["placement_from"]["trace_skew"] == cfg["trace_skew"]
        assert f"skew={cfg['trace_skew']:g}" in cell.label
    placements = [c.params["config"] for c in cells if c.kind == "placement"]
    assert sorted(p.get("trace_skew", 1.0) for p in placements
                  if p["model"] == "deepseek-v2-lite") == [0.5, 1.0, 2.0]
    base = [c for c in cells if c.tags.get("knob") == "base"]
    assert all("trace_skew" not in c.params["config"] for c in base)  # keys of older runs hold


def test_trace_skew_knob_values_are_checked():
    assert crossover.parse_knob("trace_skew=0.5,2") == ("trace_skew", (0.5, 2.0))
    assert crossover.parse_knob("trace_skew") == ("trace_skew",
                                                  crossover.DEFAULT_KNOBS["trace_skew"])
    for bad in ("trace_skew=0", "trace_skew=-1", "trace_skew=nan", "trace_skew=sharp"):
        with pytest.raises(ConfigError, match="finite number > 0"):
            crossover.parse_knob(bad)


def test_tiny_trace_skew_run_names_the_knob(tmp_path, capsys):
    out = tmp_path / "xo"
    assert main(["crossover", "--suite", "tiny", "--out", str(out), "--methods", "tp,ep",
                 "--knob", "trace_skew=2", "--workers", "1"]) == 0
    rows = json.loads((out / "crossover.json").read_text())["rows"]
    assert sorted((r["knob"], r["trace_skew"]) for r in rows) == [("base", 1.0),
                                                                    ("trace_skew", 2.0)]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["trace_skew"] for r in records} == {1.0, 2.0}
    text = (out / "crossover.md").read_text()
    assert "trace_skew" in text and "p ← p^τ" in text
    capsys.readouterr()
    assert main(["crossover", "--suite", "tiny", "--out", str(tmp_path / "bad"),
                 "--knob", "trace_skew=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "finite number > 0" in err


def test_energy_knobs_parse_with_aliases_and_make_no_cells():
    assert crossover.parse_knob("e_hop=0.2,2") == ("noc_pj_per_bit_hop", (0.2, 2.0))
    assert crossover.parse_knob("static_w_per_node") == ("static_w_per_node", (0.2, 2.0))
    with pytest.raises(ConfigError, match="not a finite number >= 0"):
        crossover.parse_knob("e_mac=-1")
    with pytest.raises(ConfigError, match="not a finite number >= 0"):
        crossover.parse_knob("e_dram=x")
    cells = crossover.crossover_cells(models=("deepseek-v2-lite",), settings=("5/50",),
                                      batches=(128,), knobs={"mac_pj": (0.1, 2.0)},
                                      methods=("tp", "ep"), mixtral_dir=None)
    assert [c.tags["knob"] for c in cells] == ["base"]       # re-priced, not simulated


def test_energy_knob_rows_reprice_the_breakdown_exactly():
    """A knob value scales exactly its part; here a dearer NoC flips the energy winner."""
    parts = {"tp": {"dram": 1.0, "noc": 0.1, "compute": 1.0, "static": 1.0},
             "ep": {"dram": 1.0, "noc": 0.3, "compute": 0.9, "static": 0.95}}
    row = {"cell": "c", "model": "m", "setting": "5/50", "batch": 10, "profile": "faithful",
           "trace_skew": 1.0, "knob": "base", "value": None, "winner": "tp", "margin": 1.01,
           "energy_parts_j": parts, "energy_winner": "ep"}
    out = crossover.energy_knob_rows([row], {"noc_pj_per_bit_hop": (0.7, 2.1)})
    assert len(out) == 1                                     # 0.7 is the base value
    r = out[0]
    assert r["j_per_token"]["tp"] == pytest.approx((1.0 + 0.3 + 1.0 + 1.0) / 10)
    assert r["j_per_token"]["ep"] == pytest.approx((1.0 + 0.9 + 0.9 + 0.95) / 10)
    assert r["energy_winner"] == "tp" and r["base_energy_winner"] == "ep"
    assert r["winner"] == "tp" and r["energy_margin"] == pytest.approx(3.75 / 3.3)


def test_tiny_run_records_energy_and_sweeps_an_energy_knob(tmp_path):
    out = tmp_path / "xo"
    argv = ["crossover", "--suite", "tiny", "--out", str(out), "--methods", "tp,ep",
            "--knob", "e_hop=0.2,2", "--workers", "1"]
    assert main(argv) == 0
    data = json.loads((out / "crossover.json").read_text())
    base = next(r for r in data["rows"] if r["knob"] == "base")
    assert set(base["j_per_token"]) == {"tp", "ep"} and base["energy_winner"] in ("tp", "ep")
    assert base["energy_over_tp"]["tp"] == pytest.approx(1.0)
    e_rows = data["energy_knob_rows"]
    assert sorted(r["value"] for r in e_rows) == [0.2, 2.0]
    for r in e_rows:                     # only the NoC part moves, in proportion to the value
        for m in ("tp", "ep"):
            noc = base["energy_parts_j"][m]["noc"] / base["batch"]
            assert r["j_per_token"][m] == pytest.approx(
                base["j_per_token"][m] + noc * (r["value"] / 0.7 - 1.0), rel=1e-9)
    text = (out / "crossover.md").read_text()
    assert "## Energy per token under the base profile" in text
    assert "## Energy knobs (re-priced, not re-simulated)" in text
    assert "`noc_pj_per_bit_hop` (0.2, 2)" in text
