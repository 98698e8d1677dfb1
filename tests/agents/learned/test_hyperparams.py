"""RL Zoo style hyperparameter files and several training seeds with a 95 % interval
(``agents.learned.hyperparams.load_hyperparams``, ``hdamoe train --hyperparams / --seeds``).

Tiny configuration of ``test_learned.py`` (L = 2, E = 4, 2×2 mesh, k_b = 2 forced).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("stable_baselines3")
pytest.importorskip("sb3_contrib")
pytest.importorskip("yaml")

from agents.learned import policy as learned
from agents.learned import hyperparams as learned_hp
from hdamoe_env.app import cli
from hdamoe_env.app import plots, records, tb
from hdamoe_env.app import train as train_app
from hdamoe_env.config.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]
COMMITTED = REPO / "hyperparams" / "maskable-ppo.yml"


def test_committed_file_loads_into_the_dataclass():
    """The committed file: defaults section = the dataclass defaults; residual section's values."""
    cls = learned_hp.HYPERPARAMS["maskable-ppo"]
    default = learned_hp.load_hyperparams(COMMITTED, "maskable-ppo")
    assert default.section == "maskable-ppo" and default.normalize_obs is True
    assert cls(**default.hyperparams) == cls()                    # what LEARNED.md documents
    residual = learned_hp.load_hyperparams(COMMITTED, "maskable-ppo", "maskable-ppo-residual")
    hp = cls(**residual.hyperparams)
    assert (hp.n_steps, hp.batch_size, hp.gamma, hp.ent_coef, hp.net_arch) == \
        (512, 128, 0.0, 0.005, (64, 64))


def test_zoo_layout_values_reach_the_dataclass(tmp_path):
    """rl-zoo3 names (ppo_mask, !!float, policy_kwargs string) map onto our fields."""
    path = tmp_path / "zoo.yml"
    path.write_text("ppo_mask:\n  n_envs: 2\n  n_timesteps: !!float 2e4\n"
                    "  policy: 'MultiInputPolicy'\n  n_steps: 128\n  batch_size: 32\n"
                    "  learning_rate: !!float 1e-3\n  gamma: 0.5\n  ent_coef: 0.02\n"
                    "  policy_kwargs: \"dict(net_arch=[32, 16])\"\n"
                    "  normalize: \"{'norm_obs': False, 'norm_reward': False}\"\n"
                    "HdMoE-v0:\n  n_steps: 64\n")
    got = learned_hp.load_hyperparams(path, "maskable-ppo")
    assert got.section == "ppo_mask" and (got.n_envs, got.n_timesteps) == (2, 20_000)
    assert got.normalize_obs is False
    hp = learned_hp.HYPERPARAMS["maskable-ppo"](**got.hyperparams)
    assert (hp.n_steps, hp.batch_size, hp.learning_rate, hp.gamma, hp.ent_coef, hp.net_arch) == \
        (128, 32, 1e-3, 0.5, 0.02, (32, 16))
    assert learned_hp.load_hyperparams(path, "ppo").hyperparams == {"n_steps": 64}  # env id


@pytest.mark.parametrize(("body", "match"), [
    ("maskable-ppo:\n  n_step: 128\n", r"unknown key 'n_step'.*allowed: .*n_steps"),
    ("maskable-ppo:\n  n_steps: abc\n", "n_steps='abc'"),
    ("maskable-ppo:\n  policy_kwargs: \"dict(ortho_init=False)\"\n", "only net_arch"),
    ("maskable-ppo:\n  normalize: \"{'norm_reward': True}\"\n", "reward normalisation"),
    ("a2c:\n  n_steps: 8\n", "no section for maskable-ppo"),
    ("- 1\n", "mapping of sections"),
])
def test_bad_files_refused(tmp_path, body, match):
    path = tmp_path / "bad.yml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=match):
        learned_hp.load_hyperparams(path, "maskable-ppo")


def test_cli_unknown_key_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "bad.yml"
    path.write_text("maskable-ppo:\n  n_step: 128\n")
    code = cli.main(["train", "--hyperparams", str(path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "unknown key 'n_step'" in err
    assert not (tmp_path / "o").exists()                      # refused before any work


def test_flags_override_the_file():
    parser = cli.build_parser()
    args = parser.parse_args(["train", "--hyperparams", str(COMMITTED), "--hyperparams-section",
                              "maskable-ppo-residual", "--hp", "n_steps=64", "--out", "x"])
    hp, timesteps, n_envs, normalize = train_app._train_settings(args)
    assert hp["n_steps"] == 64 and hp["gamma"] == 0.0
    assert (timesteps, n_envs, normalize) == (10_000, 1, True)
    args = parser.parse_args(["train", "--hyperparams-section", "x", "--out", "x"])
    with pytest.raises(ConfigError, match="needs --hyperparams"):
        train_app._train_settings(args)


def test_t_interval_by_hand():
    mean, hw = records.t_interval([1.0, 2.0, 3.0])      # s = 1, t(0.975, 2) = 4.303
    assert mean == 2.0 and hw == pytest.approx(4.303 / math.sqrt(3))
    assert records.t_interval([5.0]) == (5.0, None)
    mean, hw = records.t_interval([10.0, 14.0])          # s = 2√2, t(0.975, 1) = 12.706
    assert mean == 12.0 and hw == pytest.approx(12.706 * 2.0)
    with pytest.raises(ConfigError):
        records.t_interval([])


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


def test_seed_curves_plot_every_seed(tmp_path, monkeypatch):
    """One PNG with a curve per seed; None (no file) when no seed logged scalars."""
    pytest.importorskip("matplotlib")
    logged = {"seed0": {"latency/tbt_us": [(0, 10.0), (64, 9.0)]},
              "seed1": {"latency/tbt_us": [(0, 11.0), (64, 8.5)],
                        "rollout/ep_rew_mean": [(64, -3.0)]}}
    monkeypatch.setattr(tb, "read_scalars", lambda d: logged.get(Path(d).name, {}))
    dirs = {0: tmp_path / "seed0", 1: tmp_path / "seed1"}
    png = plots.plot_seed_curves(tmp_path, dirs)
    assert png == tmp_path / "learning_curves.png" and png.stat().st_size > 1000
    assert plots.plot_seed_curves(tmp_path, {2: tmp_path / "seed2"},
                                  path=tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
