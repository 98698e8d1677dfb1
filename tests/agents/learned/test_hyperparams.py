"""Tests of agents.learned.hyperparams: RL Zoo style hyperparameter files
(``load_hyperparams``) — the committed file, rl-zoo3 names and values, refused files.

The command-line side (``hdamoe train --hyperparams / --seeds``) is tested in
tests/hdamoe_env/app/test_train.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("stable_baselines3")
pytest.importorskip("sb3_contrib")
pytest.importorskip("yaml")

from agents.learned import hyperparams as learned_hp
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
    batched = learned_hp.load_hyperparams(COMMITTED, "maskable-ppo", "maskable-ppo-batched")
    hp = cls(**batched.hyperparams)
    assert batched.n_envs == 16 and (hp.n_steps, hp.batch_size, hp.n_epochs) == (128, 512, 4)
    assert hp.n_steps * batched.n_envs % hp.batch_size == 0     # whole minibatches per rollout


def test_zoo_layout_values_reach_the_dataclass(tmp_path):
    """rl-zoo3 names (ppo_mask, !!float, policy_kwargs string) map onto our fields."""
    path = tmp_path / "zoo.yml"
    path.write_text("ppo_mask:\n  n_envs: 2\n  n_timesteps: !!float 2e4\n"
                    "  policy: 'MultiInputPolicy'\n  n_steps: 128\n  batch_size: 32\n"
                    "  learning_rate: !!float 1e-3\n  gamma: 0.5\n  ent_coef: 0.02\n"
                    "  policy_kwargs: \"dict(net_arch=[32, 16])\"\n"
                    "  normalize: \"{'norm_obs': False, 'norm_reward': False}\"\n"
                    "HdMoE-v1:\n  n_steps: 64\n")
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
    ("maskable-ppo:\n  env_wrapper: [gymnasium.wrappers.TimeLimit]\n",
     "not a training setting"),
    ("maskable-ppo:\n  env_wrapper:\n    - agents.wrappers.ResidualHDAWrapper\n"
     "    - hdamoe_env.env.wrappers.RankedBroadcastWrapper\n", "two action designs"),
])
def test_bad_files_refused(tmp_path, body, match):
    path = tmp_path / "bad.yml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=match):
        learned_hp.load_hyperparams(path, "maskable-ppo")




def test_zoo_env_sections_and_env_wrapper(tmp_path):
    """RL Zoo's layout: sections per env id; env_wrapper maps onto the action design."""
    path = tmp_path / "zoo.yml"
    path.write_text("hdamoe_env/HdMoE-analytic-v1:\n  env_wrapper:\n"
                    "    - hdamoe_env.env.wrappers.FlattenReplicasWrapper\n"
                    "    - hdamoe_env.env.wrappers.RankedBroadcastWrapper:\n"
                    "        num_candidates: 6\n  n_steps: 64\n"
                    "HdMoE-Mixtral-v1:\n  env_wrapper: agents.wrappers.ResidualHDAWrapper\n")
    ranked = learned_hp.load_hyperparams(path, "maskable-ppo")       # first registered id
    assert (ranked.section, ranked.action_mode, ranked.num_candidates) == (
        "hdamoe_env/HdMoE-analytic-v1", "ranked", 6)
    assert ranked.hyperparams == {"n_steps": 64}
    mixtral = learned_hp.load_hyperparams(path, "maskable-ppo",
                                          env_id="hdamoe_env/HdMoE-Mixtral-v1")
    assert (mixtral.section, mixtral.action_mode) == ("HdMoE-Mixtral-v1", "residual")
