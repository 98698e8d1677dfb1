"""``hdamoe crossover``: grid construction, resumable cells, winners and the report."""

from __future__ import annotations

import json

import pytest

from hdamoe_env.app import crossover
from hdamoe_env.app.cli import main
from hdamoe_env.errors import ConfigError


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
