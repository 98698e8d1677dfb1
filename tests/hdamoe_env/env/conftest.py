"""Fixtures of the env tests: both check_envs on a registered id."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym
import pytest


@pytest.fixture
def check_registered_env() -> Callable[..., None]:
    """``check(env_id, registry, cls, kwargs, fresh)``: the id is in the package's registry,
    ``gym.make`` builds a ``cls``, Gymnasium's check_env passes on it and SB3's on ``fresh``."""
    def check(env_id: str, registry: Mapping[str, Any], cls: type, kwargs: Mapping[str, Any],
              fresh: gym.Env[Any, Any]) -> None:
        from gymnasium.utils.env_checker import check_env
        pytest.importorskip("stable_baselines3")
        from stable_baselines3.common.env_checker import check_env as sb3_check_env

        assert env_id in registry
        env = gym.make(env_id, **kwargs)
        assert isinstance(env.unwrapped, cls)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")       # gymnasium's note on the unbounded reward
            check_env(env.unwrapped, skip_render_check=True)
        sb3_check_env(fresh, warn=True)
    return check
