"""Tests of hdamoe_env.app.train (``hdamoe train``): the train and evaluate parsers, RL Zoo style
hyperparameter files with flags overriding them, and several training seeds evaluated together
with a 95 % interval. Tiny env of tests/conftest.py (L = 2, E = 4, 2×2 mesh, k_b = 2 forced).
"""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

import pytest

pytest.importorskip("stable_baselines3")
pytest.importorskip("sb3_contrib")

from agents.learned import policy as learned  # noqa: E402
from agents.learned import train as learned_train  # noqa: E402
from hdamoe_env.app import cli, records  # noqa: E402
from hdamoe_env.app import evaluate as evaluate_app  # noqa: E402
from hdamoe_env.app import train as train_app  # noqa: E402
from hdamoe_env.config.errors import ConfigError  # noqa: E402

# hyperparameter files are YAML: the tests that read one need pyyaml
needs_yaml = pytest.mark.skipif(find_spec("yaml") is None, reason="pyyaml is not installed")

SMALL_PPO = {"n_steps": 64, "batch_size": 32, "n_epochs": 2}
REPO = Path(__file__).resolve().parents[3]
COMMITTED = REPO / "hyperparams" / "maskable-ppo.yml"


def _train(env_kwargs, out, algo="maskable-ppo", timesteps=256, **kw):
    kw.setdefault("hyperparams", SMALL_PPO if "ppo" in algo else None)
    kw.setdefault("tensorboard", False)
    return learned_train.train(algo, env_kwargs, timesteps, out_dir=out, checkpoint_every=128,
                               **kw)


def test_cli_parsers(env_kwargs, tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    train_app.add_train_arguments(sub.add_parser("train")).set_defaults(func=train_app.cmd_train)
    evaluate_app.add_evaluate_arguments(sub.add_parser("evaluate")).set_defaults(
        func=evaluate_app.cmd_evaluate)
    args = parser.parse_args(["train", "--algo", "ppo", "--timesteps", "64", "--k-b", "2",
                              "--batch", "8", "--hp", "n_steps=32", "--out", str(tmp_path)])
    assert args.func is train_app.cmd_train and train_app._parse_hp(args.hp) == {"n_steps": 32}
    assert evaluate_app.env_kwargs_from_args(args)["k_b"] == 2
    assert "gating_protect_top" not in evaluate_app.env_kwargs_from_args(args)
    args_p = parser.parse_args(["train", "--gating-protect-top", "1", "--out", str(tmp_path)])
    assert evaluate_app.env_kwargs_from_args(args_p)["gating_protect_top"] == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--gating-protect-top", "-1", "--out", str(tmp_path)])
    _train(env_kwargs, tmp_path, timesteps=64)
    args = parser.parse_args(["evaluate", "--agent", f"{tmp_path},greedy-hda", "--baselines",
                              "noop", "--seeds", "1", "--steps", "1", "--fidelity", "des"])
    assert evaluate_app.cmd_evaluate(args) == 0
    text = capsys.readouterr().out
    assert "learned" in text and "hda-moe" in text and "noop" in text


@needs_yaml
def test_cli_unknown_key_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "bad.yml"
    path.write_text("maskable-ppo:\n  n_step: 128\n")
    code = cli.main(["train", "--hyperparams", str(path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "unknown key 'n_step'" in err
    assert not (tmp_path / "o").exists()                      # refused before any work


@needs_yaml
def test_flags_override_the_file():
    parser = cli.build_parser()
    args = parser.parse_args(["train", "--hyperparams", str(COMMITTED), "--hyperparams-section",
                              "maskable-ppo-residual", "--hp", "n_steps=64", "--out", "x"])
    hp, timesteps, n_envs, normalize = train_app._train_settings(args)
    assert hp["n_steps"] == 64 and hp["gamma"] == 0.0
    assert (timesteps, n_envs, normalize) == (10_000, train_app.DEFAULT_N_ENVS, True)
    args = parser.parse_args(["train", "--hyperparams-section", "x", "--out", "x"])
    with pytest.raises(ConfigError, match="needs --hyperparams"):
        train_app._train_settings(args)


@needs_yaml
def test_seeds_train_and_evaluate_together(env_kwargs, tmp_path, monkeypatch, capsys):
    """--seeds 0,1 with 2 SubprocVecEnv copies: OUT/seed<k>/ each loadable, one joint evaluation."""
    monkeypatch.setattr(train_app, "env_kwargs_from_args",
                        lambda args, base=None: dict(env_kwargs))
    hp = Path(tmp_path / "hp.yml")
    hp.write_text("maskable-ppo:\n  n_steps: 32\n  batch_size: 32\n  n_epochs: 1\n  gamma: 0.0\n")
    out = tmp_path / "run"
    args = cli.build_parser().parse_args(
        ["train", "--hyperparams", str(hp), "--timesteps", "64", "--n-envs", "2",
         "--seeds", "0,1", "--action-mode", "residual", "--checkpoint-every", "0",
         "--no-tensorboard", "--eval-steps", "1", "--eval-seeds", "10000,10001",
         "--eval-baselines", "noop,hda-moe", "--out", str(out)])
    assert train_app.cmd_train(args) == 0
    for seed in (0, 1):
        meta = json.loads((out / f"seed{seed}" / "learned.json").read_text())
        assert meta["seed"] == seed and meta["n_envs"] == 2 and meta["hyperparams"]["n_steps"] == 32
        assert meta["layout"]["num_nodes"] == 4                # SubprocVecEnv: layout recorded
        learned.load_agent(out / f"seed{seed}")
    summary = json.loads((out / "seeds.json").read_text())["summary"]
    for fid in ("analytic", "des"):
        s = summary[fid]
        assert [p["seed"] for p in s["per_seed"]] == [0, 1]
        tbts = [p["tbt_us"] for p in s["per_seed"]]
        mean, hw = records.t_interval(tbts)
        assert s["learned"]["tbt_us"] == pytest.approx(mean)
        assert s["learned"]["tbt_ci95_us"] == pytest.approx(hw)
        assert set(s["baselines"]) == {"noop", "hda-moe"}
    assert "mean ± 95 % CI" in (out / "seeds.md").read_text()
    assert "Student t" in capsys.readouterr().out


def test_vec_backend_auto_picks_batched_when_it_applies():
    assert cli.build_parser().parse_args(["train", "--out", "x"]).vec_backend == "auto"
    resolve = train_app.resolve_vec_backend
    assert resolve("auto", 16, "ranked", None, None) == "batched"
    assert resolve("auto", 2, "full", None, None) == "batched"
    assert resolve("auto", 1, "ranked", None, None) == "subproc"              # one copy
    assert resolve("auto", 4, "residual", None, None) == "subproc"            # unsupported mode
    assert resolve("auto", 4, "ranked", {"target": 0.99}, None) == "subproc"  # quality reward
    assert resolve("auto", 4, "ranked", None, 4) == "subproc"                 # replica shares
    assert resolve("subproc", 16, "ranked", None, None) == "subproc"          # explicit choice
    assert resolve("batched", 1, "ranked", None, None) == "batched"


@needs_yaml
def test_default_copies_follow_the_backend_and_the_earlier_section_is_one_env():
    """32 batched copies by default where the batched backend applies; one env for the
    per-process designs (residual, quality reward); ``maskable-ppo-earlier`` is the earlier
    default run (one env, 256-step rollouts, 10 epochs of 64, the full policy input)."""
    parser = cli.build_parser()
    settings = lambda *extra: train_app._train_settings(  # noqa: E731
        parser.parse_args(["train", *extra, "--out", "x"]))
    assert settings()[2] == 32 and settings("--action-mode", "full")[2] == 32
    assert settings("--action-mode", "residual")[2] == 1
    assert settings("--quality-target", "0.99")[2] == 1
    assert settings("--n-envs", "4")[2] == 4
    hp, _, n_envs, _ = settings("--hyperparams", str(COMMITTED), "--hyperparams-section",
                                "maskable-ppo-earlier")
    assert n_envs == 1 and (hp["n_steps"], hp["batch_size"], hp["n_epochs"],
                            hp["policy_input"]) == (256, 64, 10, "full")
