"""Tests of hdamoe_env.app.bench: the benchmark harness on a tiny configuration (§9, §13) —
records, resume, caches, the ``bench`` command and its parser."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hdamoe_env.app import bench, envbench, records
from hdamoe_env.app.cli import build_parser
from hdamoe_env.app.bench import BenchConfig, run_bench
from hdamoe_env.app.methods import DEFAULT_METHODS, parse_method
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.specs import ModelSpec

TINY = ModelSpec(key="tiny", name="tiny", num_moe_layers=2, num_experts=4, top_k=2,
                 hidden_size=64, expert_intermediate=128, attn_weight_elements=4 * 64 * 64,
                 kv_elements_per_token=2 * 64, core_flops_per_ctx_token=4 * 64,
                 hybrid_regions=2)


def _config(tmp_path, **kw):
    args = dict(model=TINY, mesh="2x2", setting="1/1", batch=8, steps=2, k_b=1,
                trace_requests=4, cache_dir=str(tmp_path / "cache"), place_batch=8,
                env_kwargs={"trace_tokens": 256})
    args.update(kw)
    return BenchConfig.create(**args)


def test_bench_records_resume_and_cache(tmp_path, monkeypatch):
    out = tmp_path / "bench.json"
    cfg = _config(tmp_path)
    res = run_bench(cfg, ["tp", "ep", "hd-moe"], [0, 1], json_path=out,
                    csv_path=tmp_path / "bench.csv", progress=False)
    assert [(r["method"], r["seed"]) for r in res.records] == [
        ("tp", 0), ("tp", 1), ("ep", 0), ("ep", 1), ("hd-moe", 0), ("hd-moe", 1)]
    for rec in res.records:
        assert rec["tbt_us"] > 0 and rec["decode_steps"] == 2
        assert rec["env_steps"] == 4 and rec["decision_ms_per_step"] >= 0
        assert set(rec["breakdown_us"]) >= {"compute_us", "communication_us", "memory_us",
                                            "extra_us"}
        assert rec["profile"] == "faithful" and rec["trace_id"] and rec["run_key"] == res.run_key
    hd = [r for r in res.records if r["method"] == "hd-moe"][0]
    assert hd["placement_artifact"].endswith("placement.npz") and hd["agent"] == "hd-moe"
    assert json.loads(out.read_text()) == res.all_records
    assert (tmp_path / "bench.csv").read_text().count("\n") == 7
    assert res.placement_wall_s > 0

    def boom(*a, **k):
        raise AssertionError("resume must not rerun finished (method, seed) pairs")

    monkeypatch.setattr(bench, "run_episode", boom)
    again = run_bench(cfg, ["tp", "ep", "hd-moe"], [0, 1], json_path=out, resume=True,
                      progress=False)
    assert len(again.skipped) == 6 and again.records == res.records
    assert again.placement_wall_s == 0.0          # placement artifact reused, never re-solved
    monkeypatch.undo()
    more = run_bench(cfg, ["tp", "agent:random@ep"], [0, 1, 2], json_path=out, resume=True,
                     progress=False)
    assert len(more.skipped) == 2 and len(more.records) == 6
    assert len(json.loads(out.read_text())) == 6 + 4
    assert "TBT/TP" in records.format_bench_table(more.records)


def test_placement_dir_is_used(tmp_path):
    from hdamoe_env.sim.placement import tensor_parallel

    d = tmp_path / "place"
    tensor_parallel(2, 4, 4).with_layers(method="node_link").save(d / "placement.npz")
    res = run_bench(_config(tmp_path, placement_dir=str(d)), ["node-link"], [0],
                    progress=False)
    assert res.records[0]["placement_artifact"] == str(d / "placement.npz")
    with pytest.raises(ConfigError, match="placement_hybrid.npz"):
        run_bench(_config(tmp_path, placement_dir=str(d)), ["hybrid"], [0], progress=False)


def test_parser_defaults():
    parser = build_parser()
    args = parser.parse_args(["bench"])
    assert args.model == "deepseek-v2-lite" and args.mesh == "4x8" and args.setting == "5/50"
    assert args.batch == 128 and args.methods.split(",") == list(DEFAULT_METHODS)
    assert args.func is bench.cmd_bench
    assert parser.parse_args(["bench-env"]).func is envbench.cmd_bench_env


def test_cmd_bench_prints_the_table_and_writes_outputs(tmp_path, capsys):
    parser = build_parser()
    args = parser.parse_args(["bench", "--mesh", "2x2", "--setting", "1/1", "--batch", "8",
                              "--methods", "tp,ep", "--seeds", "0", "--steps", "2",
                              "--requests", "4", "--json", str(tmp_path / "r.json"),
                              "--csv", str(tmp_path / "r.csv"), "--no-progress",
                              "--tensorboard", str(tmp_path / "tb"),
                              "--cache-dir", str(tmp_path / "cache")])
    args.model = TINY                       # presets only on the command line; a spec here
    assert bench.cmd_bench(args) == 0
    out = capsys.readouterr().out
    assert "TBT/TP" in out and "ep" in out
    assert len(json.loads((tmp_path / "r.json").read_text())) == 2
    dirs = sorted((tmp_path / "tb").iterdir())
    parts = [p.name.split("__") for p in dirs]
    assert [q[:6] for q in parts] == [["HdMoE-v1", "tiny", "1-1", "B8", m, "0"]
                                      for m in ("ep", "tp")]
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(dirs[0]), size_guidance={"tensors": 0})
    acc.Reload()
    L = TINY.num_moe_layers
    # one x-axis for the latency group: the env step (the one that ended the decode step)
    assert [e.step for e in acc.Scalars("latency/tbt_us")] == [L - 1, 2 * L - 1]
    assert [e.step for e in acc.Scalars("latency/layer_us")] == list(range(2 * L))
    assert [e.step for e in acc.Scalars("latency/episode_tbt_us")] == [2 * L - 1]
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| model | tiny |" in text and "| batch | 8 |" in text


def test_bench_quick_pipeline_prints_no_solver_banner_on_stdout(tmp_path):
    """`make run`'s job: the node-link pipeline's MILP solver never writes to stdout."""
    pytest.importorskip("pulp")
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
           "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-m", "hdamoe_env.app.cli", "bench", "--model", "mixtral", "--mesh",
         "2x2", "--setting", "1/1", "--batch", "8", "--methods", "tp,hd-moe", "--seeds", "0",
         "--steps", "1", "--requests", "4", "--cache-dir", str(tmp_path / "cache"),
         "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "hd-moe" in proc.stdout and "TBT/TP" in proc.stdout        # the pipeline ran
    assert "quick pipeline" in proc.stdout
    for banner in ("HiGHS", "Running", "Copyright", "THIRD_PARTY"):
        assert banner not in proc.stdout, proc.stdout[:500]
        assert banner not in proc.stderr, proc.stderr[:500]             # nor anywhere (no -v)


def test_trace_skew_reaches_records_keys_and_the_placement_cache(tmp_path):
    base = _config(tmp_path)
    sharp = _config(tmp_path, trace_skew=2.0)
    res = run_bench(sharp, ["tp", "node-link"], [0], progress=False)
    assert {r["trace_skew"] for r in res.records} == {2.0}
    trace, _ = bench.load_bench_trace(sharp)
    assert trace.meta["generator"]["skew"] == 2.0
    assert sharp.run_key(trace.trace_id) != base.run_key(trace.trace_id)
    # the key of a τ = 1 configuration does not mention the knob (runs made before it exist)
    assert "trace_skew" not in base.store_config().quick
    store = bench.placement_store(sharp, trace, progress=False)
    assert "__skew2__" in store.cache_path().name
    assert store.place_config().to_dict()["trace_skew"] == 2.0
    assert "trace_skew" not in bench.placement_store(base, trace, progress=False
                                                     ).place_config().to_dict()
    node_link = next(r for r in res.records if r["method"] == "node-link")
    assert "__skew2__" in node_link["placement_artifact"]
    with pytest.raises(ConfigError, match="trace_skew"):
        _config(tmp_path, trace_skew=0.0)


def test_bench_cli_rejects_a_bad_trace_skew(capsys):
    from hdamoe_env.app.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--trace-skew", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--trace-skew" in err and "> 0" in err


def test_eplb_methods_run_and_record_their_rebalances(tmp_path):
    """eplb (static redundant experts) and eplb-dynamic@1 (a rebalance after every decode
    step but the last) run on the tiny model; the dynamic records count the rebalances (steps
    − 1 = 1 per episode) and the moves' charge per decode step."""
    assert parse_method("eplb-dynamic").rebalance_period == 4
    assert parse_method("eplb-dynamic@3").rebalance_period == 3
    for bad in ("eplb-dynamic@0", "eplb-dynamic@x"):
        with pytest.raises(ConfigError, match="eplb-dynamic@N"):
            parse_method(bad)
    res = run_bench(_config(tmp_path), ["eplb", "eplb-dynamic@1"], [0], progress=False)
    static, dyn = res.records
    assert static["placement_method"] == "eplb" and "rebalances" not in static
    assert dyn["rebalances"] == 1 and dyn["rebalance_period"] == 1
    assert dyn["rebalance_us_per_step"] >= 0.0 and np.isfinite(dyn["tbt_us"])


def test_records_carry_routing_quality_for_every_method(tmp_path):
    """Methods without gating record exactly 1, 1, 0; gating methods measured means; matched
    methods their target, the found scale and the search."""
    cfg = _config(tmp_path, conventions="paper")
    res = run_bench(cfg, ["tp", "ep", "hd-moe", "hda-moe", "hda-moe@q99", "hda-moe@s0"], [0],
                    progress=False)
    by = {r["method"]: r for r in res.records}
    for method in ("tp", "ep", "hd-moe", "hda-moe@s0"):
        assert by[method]["gating"] == {"changed_fraction": 0.0, "top1_retention": 1.0,
                                        "score_mass_kept": 1.0}, method
        assert by[method]["gating_scale"] == 0.0 and by[method]["quality_target"] is None
    for method in ("hda-moe", "hda-moe@q99"):
        g = by[method]["gating"]
        assert all(isinstance(g[k], float) and 0.0 <= g[k] <= 1.0 for k in g), g
    assert by["hda-moe"]["gating_scale"] == 1.0
    q = by["hda-moe@q99"]
    assert q["quality_target"] == 0.99
    search = q["gating_search"]
    assert search["target"] == 0.99 and 0.0 <= search["level"] <= 1.0
    assert search["train_top1_retention"] >= 0.99
    assert q["gating_scale"] == pytest.approx(search["level"])
    table = records.format_bench_table(res.records)
    assert "hda-moe@q99" in table and "scale" in table
