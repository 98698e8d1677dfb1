"""Issue 14 acceptance: the registered env with no kwargs works with the standard RL tooling."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest

import hdamoe_env  # noqa: F401 - registers the ids

ENV_ID = "hdamoe_env/HdMoE-v0"


def test_gymnasium_check_env_on_default_registered_env():
    from gymnasium.utils.env_checker import check_env

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(gym.make(ENV_ID).unwrapped)


def test_sb3_check_env_on_default_registered_env():
    pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.env_checker import check_env

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(gym.make(ENV_ID), warn=True)
    # only the 2-D replicas observation earns a warning; never an error
    assert all("unconventional shape" in str(w.message) for w in caught)


def test_random_actions_of_the_space_step_the_default_env():
    env = gym.make(ENV_ID)
    env.action_space.seed(0)
    env.reset(seed=0)
    coerced = 0
    for _ in range(30):
        _, reward, term, trunc, info = env.step(env.action_space.sample())
        assert np.isfinite(reward)
        coerced += len(info["coerced"])
        if term or trunc:
            env.reset()
    assert coerced > 0                        # the raw space holds masked values; none raised


def test_plain_ppo_and_evaluate_policy_on_default_env():
    pytest.importorskip("stable_baselines3")
    from stable_baselines3 import PPO
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.monitor import Monitor

    env = Monitor(gym.make(ENV_ID))
    model = PPO("MultiInputPolicy", env, n_steps=32, batch_size=32, n_epochs=1, seed=0,
                device="cpu").learn(64)
    mean, std = evaluate_policy(model, env, n_eval_episodes=1)
    assert np.isfinite(mean) and mean < 0 and std == 0.0
