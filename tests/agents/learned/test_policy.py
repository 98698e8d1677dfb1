"""Issue 15: learned agents load no pickle of the package's own, check the model's SHA-256, and
``train --resume`` refuses another env or hyperparameters (reproducers 4, 10, 13)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")
pytest.importorskip("sb3_contrib")

from agents.learned import policy as learned
from agents.learned import train as learned_train
from hdamoe_env.config.errors import ConfigError, HdMoeError, IntegrityError  # noqa: E402

SMALL_PPO = {"n_steps": 64, "batch_size": 32, "n_epochs": 2}


def _train(env_kwargs, out, algo="maskable-ppo", timesteps=256, **kw):
    kw.setdefault("hyperparams", SMALL_PPO if "ppo" in algo else None)
    kw.setdefault("tensorboard", False)
    return learned_train.train(algo, env_kwargs, timesteps, out_dir=out, checkpoint_every=128,
                               **kw)


@pytest.fixture
def trained(env_kwargs, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    _train(env_kwargs, out, timesteps=128)
    return out


def test_no_pickle_and_sha_recorded(trained):
    """Reproducer 4: statistics are plain arrays; learned.json records the model SHA-256."""
    meta = json.loads((trained / "learned.json").read_text())
    assert meta["model_sha256"] == learned.file_sha256(trained / "model.zip")
    assert not list(trained.rglob("*.pkl"))
    with np.load(trained / "vecnormalize.npz", allow_pickle=False) as data:
        assert "meta" in data.files
    agent = learned.load_agent(trained)
    assert isinstance(agent.vecnorm, learned.ObsNormalizer)


def test_statistics_match_sb3_normalisation(trained, make_tiny_env):
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    norm = learned.ObsNormalizer.load(trained / "vecnormalize.npz")
    env = make_tiny_env()
    obs, _ = env.reset(seed=0)
    vn = VecNormalize(DummyVecEnv([make_tiny_env]), norm_obs_keys=norm.norm_obs_keys)
    norm.apply_to(vn)
    ours, theirs = norm.normalize_obs(obs), vn.normalize_obs(obs)
    for key in obs:
        assert np.array_equal(ours[key], theirs[key]), key


def test_replaced_model_is_refused_before_loading(trained, tmp_path):
    """Reproducer 4: a crafted model.zip is not opened (no code runs); typed refusal."""
    marker = tmp_path / "marker"
    (trained / "model.zip").write_bytes(b"PK\x05\x06" + b"\0" * 18)
    with pytest.raises(IntegrityError, match="SHA-256"):
        learned.load_agent(trained)
    assert not marker.exists()


def test_legacy_pickle_statistics_are_refused(trained):
    (trained / "vecnormalize.npz").rename(trained / "vecnormalize.pkl")
    with pytest.raises(ConfigError, match="pickle"):
        learned.load_agent(trained)


def test_garbage_agent_file_is_a_typed_error(tmp_path):
    """Reproducer 10: `evaluate --agent garbage.npz` / garbage zip → typed error."""
    bad = tmp_path / "garbage.zip"
    bad.write_bytes(b"not a zip at all")
    with pytest.raises(HdMoeError):
        learned.load_agent(bad)
    with pytest.raises(HdMoeError):
        learned.load_agent(tmp_path / "garbage.npz")


@pytest.mark.parametrize("change", [{"setting": "2/1"}, {"batch": 16}])
def test_resume_refuses_another_env(env_kwargs, trained, change):
    """Reproducer 13: --resume with --setting 10/25 or --batch 64 is refused, naming the field."""
    before = (trained / "learned.json").read_text()
    with pytest.raises(ConfigError, match="another env or hyperparameters.*" + next(iter(change))):
        _train({**env_kwargs, **change}, trained, timesteps=256, resume=True)
    assert (trained / "learned.json").read_text() == before


def test_resume_refuses_other_hyperparameters_and_stale_checkpoints(env_kwargs, trained):
    with pytest.raises(ConfigError, match="hp.n_epochs"):
        _train(env_kwargs, trained, timesteps=256, resume=True,
               hyperparams={**SMALL_PPO, "n_epochs": 3})
    (trained / "checkpoints" / "ckpt_128.json").unlink()      # a checkpoint of unknown origin
    with pytest.raises(ConfigError, match="no readable"):
        _train(env_kwargs, trained, timesteps=256, resume=True)


def test_typed_hyperparameters(env_kwargs, tmp_path):
    """Reproducer 8: --hp n_steps=abc is a typed error, not a TypeError inside SB3."""
    with pytest.raises(ConfigError, match="n_steps='abc'"):
        _train(env_kwargs, tmp_path, timesteps=128, hyperparams={**SMALL_PPO, "n_steps": "abc"})
