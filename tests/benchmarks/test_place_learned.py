"""``benchmarks/place_learned.py`` on a tiny placement model (BC + a 64-step PPO run)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hdamoe_env.config.specs import ModelSpec
from hdamoe_env.env.place import HdMoePlaceEnv, greedy_balance

# E = 8, k = 2, U = 4 tiles per expert on a 2×4 mesh; 8 layers: held out 3 and 7
MODEL = ModelSpec(key="tiny-place-bench", name="tiny-place-bench", num_moe_layers=8,
                  num_experts=8, top_k=2, hidden_size=64, expert_intermediate=256,
                  attn_weight_elements=4 * 64 * 64, kv_elements_per_token=2 * 64,
                  core_flops_per_ctx_token=4 * 64)


def tiny_env(cell, args, *, split, eval_seed, trace_seeds):
    return HdMoePlaceEnv(model=MODEL, mesh="2x4", setting="1/1", batch=16, trace_requests=4,
                         trace_tokens=256, trace_seeds=trace_seeds, split=split,
                         evaluator=args.evaluator, score_steps=args.score_steps,
                         eval_seed=eval_seed, pattern_features=args.pattern_features)


def tiny_references(pl):
    def refs(cell, args):
        env = pl.heldout_env(cell, args)
        out = {}
        for layer in env.layers:
            g = {s: greedy_balance(env, s, layer=layer).best_ratio for s in (1, 2, 8)}
            bound = env.latency_lower_bound(layer=layer, trace_index=0)["ratio"]
            out[str(layer)] = {"ep": g[1], "tp": 1.0, "node_link": g[8],
                               "greedy": min(g.values()), "bound": bound}
        return out
    return refs


@pytest.fixture
def pl(load_benchmark, monkeypatch):
    module = load_benchmark("place_learned")
    monkeypatch.setattr(module, "make_env", tiny_env)
    monkeypatch.setattr(module, "references", tiny_references(module))
    return module


ARGV = ["--cells", "ds_10-25_B128", "--seeds", "0", "1", "--scratch-seeds", "0",
        "--trace-seeds", "0", "1", "--evaluator", "static", "--timesteps", "64", "--eval-every",
        "32", "--n-steps", "32", "--batch-size", "32", "--n-epochs", "1", "--bc-epochs", "40",
        "--net-arch", "64,64"]


def test_run_writes_records_summary_and_figure_and_resumes(pl, tmp_path, capsys):
    pytest.importorskip("sb3_contrib")
    out = tmp_path / "out"
    assert pl.main([*ARGV, "--out", str(out)]) == 0
    records = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["references", "run", "run", "run"]
    runs = records[1:]
    assert [(r["variant"], r["seed"]) for r in runs] == [("bc+ppo", 0), ("bc+ppo", 1),
                                                         ("scratch", 0)]
    for r in runs:
        assert sorted(r["final"]) == ["3", "7"] and all(v > 0 for v in r["final"].values())
        assert [s for s, _ in r["curve"]] == [0, 32, 64]
    assert "bc_accuracy" in runs[0] and "bc_accuracy" not in runs[2]
    text = (out / "summary.md").read_text()
    assert "BC + PPO" in text and "scratch PPO" in text and "± " in text and "≥ " in text
    pytest.importorskip("matplotlib")
    assert (out / "curves.png").stat().st_size > 1000
    before = (out / "results.jsonl").read_text()
    assert pl.main([*ARGV, "--out", str(out), "--resume"]) == 0       # nothing re-trained
    assert (out / "results.jsonl").read_text() == before


def test_behaviour_cloning_matches_the_greedy(pl):
    pytest.importorskip("sb3_contrib")
    import torch
    from sb3_contrib import MaskablePPO

    torch.set_num_threads(1)
    args = pl.parse_args(["--evaluator", "static", "--trace-seeds", "0", "1"])
    env = tiny_env("x", args, split="train", eval_seed=0, trace_seeds=(0, 1))
    demos = pl.greedy_demonstrations(env)
    assert demos["actions"].size == len(env.episodes) * env.num_experts
    assert demos["masks"][np.arange(demos["actions"].size), demos["actions"]].all()
    model = MaskablePPO("MultiInputPolicy", env, n_steps=32, batch_size=32,
                        policy_kwargs={"net_arch": [64, 64]}, seed=0, device="cpu")
    before = pl.bc_accuracy(model, demos)
    res = pl.behaviour_clone(model, demos, epochs=60, lr=1e-3, batch_size=64,
                             rng=np.random.default_rng(0))
    assert res["bc_accuracy"] >= 0.8 and res["bc_accuracy"] > before + 0.3


def test_out_refused_without_resume_and_with_other_options(pl, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "x.txt").write_text("someone else's")
    assert pl.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not empty" in err[0] and "--resume" in err[0]
    assert pl.main(["--out", str(out), "--resume"]) == 2
    assert "config.json" in capsys.readouterr().err
    (out / "config.json").write_text(json.dumps({**vars(pl.parse_args([])), "lr": 0.5}))
    assert pl.main(["--out", str(out), "--resume"]) == 2
    assert "lr" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--timesteps", "-1"], ["--cells", "ds_10-25"],
                                 ["--evaluator", "exact"], ["--net-arch", "64,x"],
                                 ["--timesteps", "many"], ["--no-such-flag"]])
def test_bad_option_one_line_exit_2(pl, tmp_path, capsys, bad):
    assert pl.main([*bad, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("place_learned: error:")
    assert not (tmp_path / "o").exists()
