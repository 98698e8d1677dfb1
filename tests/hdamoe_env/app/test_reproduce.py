"""Tests of hdamoe_env.app.reproduce (``hdamoe reproduce``): suites, cells, resume, backends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hdamoe_env.app import reproduce
from hdamoe_env.app.cli import main
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.app.reproduce import Cell, run_cell, run_suite, shrink, suite_cells

FIGURES = {"placements", "fig10_end_to_end", "fig11_mesh", "fig12_topology", "fig20_memory_cap",
           "fig21_dynamic", "fig22_gating_batch", "fig24_sensitivity"}


def _fake_mixtral(tmp_path: Path) -> Path:
    d = tmp_path / "mixtral"
    d.mkdir()
    (d / "experts_reasoning_mixtral.json").write_text("{}")
    return d


def test_quick_suite_covers_every_study_once(tmp_path: Path) -> None:
    cells = suite_cells("quick", mixtral_dir=str(_fake_mixtral(tmp_path)))
    keys = [c.key for c in cells]
    assert len(keys) == len(set(keys))
    assert {c.figure for c in cells} == FIGURES
    kinds = [c.kind for c in cells]
    first_other = kinds.index("bench")
    assert all(k == "placement" for k in kinds[:first_other])
    assert "placement" not in kinds[first_other:]
    models = {c.params["config"]["model"] for c in cells if c.figure == "fig10_end_to_end"}
    assert models == {"deepseek-v2-lite", "mixtral-8x7b"}
    profiles = {c.params["config"]["conventions"] for c in cells if c.kind == "bench"}
    assert profiles == {"faithful", "paper"}
    # every bench cell that needs Node/Link Balance has its placement cell in the suite
    placement_keys = {json.dumps(c.params["config"], sort_keys=True)
                      for c in cells if c.kind == "placement"}
    for c in cells:
        if c.kind == "bench" and set(c.params["methods"]) - {"tp", "ep"}:
            src = c.params.get("placement_from") or reproduce.placement_key(c.params["config"])
            assert json.dumps(src, sort_keys=True) in placement_keys, c.label


def test_suite_without_mixtral_and_full_is_larger(tmp_path: Path) -> None:
    quick = suite_cells("quick", mixtral_dir=None)
    assert all(c.params.get("config", {}).get("model") != "mixtral-8x7b" for c in quick)
    full = suite_cells("full", mixtral_dir=None)
    assert len(full) > 2 * len(quick)
    assert {c.params["config"]["model"] for c in full if c.figure == "fig10_end_to_end"} == {
        "deepseek-v2-lite", "qwen2-57b-a14b", "qwen3.5-35b-a3b"}


def test_full_suite_sets_node_link_against_its_baselines(tmp_path: Path) -> None:
    """Every faithful cell with Node+Link runs tp, tp-tiled, ep and hybrid too, and its
    placement cell builds the batch guard of the cell's B (paper placements never)."""
    cells = suite_cells("full", mixtral_dir=str(_fake_mixtral(tmp_path)))
    placements = {json.dumps(c.params["config"], sort_keys=True): c
                  for c in cells if c.kind == "placement"}
    checked = 0
    for c in cells:
        if c.kind != "bench":
            continue
        cfg, methods = c.params["config"], set(c.params["methods"])
        assert "tp-tiled" in methods, c.label
        if cfg["conventions"] != "faithful" or "node-link" not in methods:
            continue
        assert set(reproduce.BASELINES) <= methods, c.label
        src = c.params.get("placement_from") or reproduce.placement_key(cfg)
        assert cfg["batch"] in placements[json.dumps(src, sort_keys=True)].params[
            "guard_batches"], c.label
        checked += 1
    assert checked > 60
    assert all("guard_batches" not in c.params for c in placements.values()
               if c.params["config"]["conventions"] == "paper")


def test_bad_suite_backend_and_workers(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown suite 'fast'"):
        suite_cells("fast")
    cells = suite_cells("tiny")
    with pytest.raises(ConfigError, match="backend='mpi'"):
        run_suite(cells, tmp_path, backend="mpi")
    with pytest.raises(ConfigError, match="workers must be >= 1"):
        run_suite(cells, tmp_path, workers=0)
    with pytest.raises(ConfigError, match="cell kind 'nope'"):
        Cell("x", "nope", {})


def test_smallest_quick_cell_runs_on_a_tiny_config() -> None:
    cells = [c for c in suite_cells("quick", mixtral_dir=None) if c.kind == "bench"]
    smallest = min(cells, key=lambda c: c.params["config"]["batch"])
    payload = run_cell(shrink(smallest))
    recs = payload["records"]
    assert [r["method"] for r in recs] == ["tp", "ep"]
    assert all(r["tbt_us"] > 0 and r["figure"] == smallest.figure for r in recs)
    assert all(r["cell"] == payload["key"] for r in recs)
    assert recs[0]["batch"] == smallest.params["config"]["batch"]
    for r in recs:              # energy beside time in every reproduce record (issue 30)
        assert r["j_per_token"] > 0 and r["edp_js"] > 0
        assert r["energy_j"]["total"] == pytest.approx(sum(
            r["energy_j"][p] for p in ("dram", "noc", "compute", "static")))
    assert 0 < payload["cpu_s"] and payload["wall_s"] > 0


def test_resume_skips_finished_cells_and_reruns_broken_ones(tmp_path: Path) -> None:
    cells = suite_cells("tiny")
    first = run_suite(cells, tmp_path)
    assert len(first.computed) == 2 and not first.skipped
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 4
    again = run_suite(cells, tmp_path)
    assert again.computed == [] and len(again.skipped) == 2
    assert (tmp_path / "results.jsonl").read_text().splitlines() == lines
    # a truncated cell file (interrupted write of another tool) is recomputed, with equal numbers
    broken = tmp_path / "cells" / f"{cells[1].key}.json"
    broken.write_text(broken.read_text()[:40])
    third = run_suite(cells, tmp_path)
    assert third.computed == [cells[1].key]
    tbt = [json.loads(x)["tbt_us"] for x in lines]
    assert [r["tbt_us"] for r in third.records] == tbt


def test_interrupted_run_keeps_finished_cells(tmp_path: Path) -> None:
    cells = suite_cells("tiny")

    def stop(cell: Cell, payload: dict, n: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_suite(cells, tmp_path, on_cell=stop)
    assert (tmp_path / "cells" / f"{cells[0].key}.json").exists()
    rest = run_suite(cells, tmp_path)
    assert rest.skipped == [cells[0].key] and rest.computed == [cells[1].key]


def test_process_pool_matches_inline(tmp_path: Path) -> None:
    cells = suite_cells("tiny")
    inline = run_suite(cells, tmp_path / "a")
    pooled = run_suite(cells, tmp_path / "b", workers=2)
    assert [r["tbt_us"] for r in pooled.records] == [r["tbt_us"] for r in inline.records]


@pytest.mark.slow   # Ray's start-up alone is about a minute on 2 cores
def test_ray_backend_matches_process_pool(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="ray is not installed (extra `ray`); the Ray backend "
                        "of `hdamoe reproduce` cannot be tested")
    cells = suite_cells("tiny")[:1]
    local = run_suite(cells, tmp_path / "proc")
    remote = run_suite(cells, tmp_path / "ray", backend="ray", workers=1)
    assert remote.computed == [cells[0].key]
    assert [r["tbt_us"] for r in remote.records] == [r["tbt_us"] for r in local.records]


def test_cli_runs_tiny_suite_and_writes_report(tmp_path: Path, capsys: pytest.CaptureFixture
                                               ) -> None:
    assert main(["reproduce", "--suite", "tiny", "--out", str(tmp_path), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 cell(s) computed, 0 resumed" in out and "cpu" in out
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["cpu_s"] > 0 and run["cpu_s_all"] == pytest.approx(run["cpu_s"])
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# HDA-MoE evaluation, `tiny` suite")
    assert "hdamoe reproduce --suite tiny" in report
    assert "Profile `faithful`" in report
    assert main(["reproduce", "--suite", "tiny", "--out", str(tmp_path), "--workers", "1"]) == 0
    assert "0 cell(s) computed, 2 resumed" in capsys.readouterr().out
    assert main(["reproduce", "--suite", "tiny", "--out", str(tmp_path), "--list"]) == 0
    assert "2 cells" in capsys.readouterr().out


def test_read_results_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="run `hdamoe reproduce"):
        reproduce.read_results(tmp_path)
    (tmp_path / "results.jsonl").write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ConfigError, match="results.jsonl:2: not a JSON line"):
        reproduce.read_results(tmp_path)


def test_only_computes_the_matching_cells_and_keeps_the_rest_for_later(tmp_path: Path) -> None:
    """``only`` terms select unfinished cells by label (case-insensitive, any term); a later
    run without it computes the rest and reuses the first."""
    cells = suite_cells("tiny")
    assert "5/50 B=8" in cells[0].label and "5/50 B=8" not in cells[1].label
    first = run_suite(cells, tmp_path, only=["5/50 b=8", "no-such-cell"])
    assert first.computed == [cells[0].key]
    assert [json.loads(x)["setting"] for x in
            (tmp_path / "results.jsonl").read_text().splitlines()] == ["5/50", "5/50"]
    rest = run_suite(cells, tmp_path)
    assert rest.skipped == [cells[0].key] and rest.computed == [cells[1].key]
