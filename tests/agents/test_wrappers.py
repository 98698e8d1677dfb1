"""Tests of agents.wrappers: the residual action over HDA-MoE.

Pins that ``ResidualHDAWrapper`` is an importable ``gymnasium.Wrapper`` whose all-zero action is
HDA-MoE's decision of every layer (paper-model.md §10–11): the wrapped episode equals the greedy
agent's episode on a raw env, observation by observation, reward by reward.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest


def test_residual_names_are_importable():
    from agents import wrappers

    assert issubclass(wrappers.ResidualHDAWrapper, gym.Wrapper)
    assert wrappers.RESIDUAL_OPS[0] == "keep" and wrappers.RESIDUAL_KEEP_LOGIT == 2.0
    for name in ("ResidualHDA", "ResidualChoice", "ResidualHDAWrapper", "RESIDUAL_OPS",
                 "RESIDUAL_KEEP_LOGIT"):
        assert name in wrappers.__all__


@pytest.mark.parametrize("flatten", [False, True])
def test_zero_residual_reproduces_hda_moe_episode(make_tiny_env, flatten):
    from agents import HDAMoEAgent
    from agents.wrappers import ResidualHDAWrapper

    wrapped = ResidualHDAWrapper(make_tiny_env(flatten_replicas=flatten))
    raw = make_tiny_env(flatten_replicas=flatten)
    agent = HDAMoEAgent.from_env(make_tiny_env())
    zero = np.zeros(3, dtype=np.int64)
    assert wrapped.action_space.nvec.tolist() == [4, 3, 4]
    obs_w, _ = wrapped.reset(seed=9)
    obs_r, _ = raw.reset(seed=9)
    done, steps, broadcasts = False, 0, 0
    while not done:
        for key in obs_r:
            np.testing.assert_array_equal(obs_w[key], obs_r[key], err_msg=key)
        obs_agent = dict(obs_r, replicas=np.asarray(obs_r["replicas"]).reshape(4, -1))
        action, _ = agent.predict(obs_agent, action_masks=raw.action_masks())
        broadcasts += int(np.sum(action[:2] != 4))
        obs_w, r_w, term_w, trunc_w, info_w = wrapped.step(zero)
        obs_r, r_r, term_r, trunc_r, info_r = raw.step(action)
        assert (r_w, term_w, trunc_w) == (r_r, term_r, trunc_r)
        assert info_w["residual_deviation"] is False
        assert info_w.get("tbt_us") == info_r.get("tbt_us")
        done, steps = term_r or trunc_r, steps + 1
    assert steps == 4 and broadcasts > 0               # the greedy did pre-broadcast something


def test_residual_action_masks_and_deviation(make_tiny_env):
    from agents.wrappers import ResidualHDAWrapper

    env = gym.wrappers.RecordEpisodeStatistics(ResidualHDAWrapper(make_tiny_env()))
    env.reset(seed=1)
    mask = env.get_wrapper_attr("action_masks")()
    assert mask.dtype == bool and mask.shape == (int(env.action_space.nvec.sum()),)
    assert mask[0]                                              # "keep" is always allowed
    _, _, _, _, info = env.step(np.array([0, 1, 0], dtype=np.int64))
    assert info["residual_deviation"] is True


def test_residual_step_before_reset_is_an_error(make_tiny_env):
    from agents.wrappers import ResidualHDAWrapper
    from hdamoe_env.config.errors import ConfigError

    with pytest.raises(ConfigError, match="reset"):
        ResidualHDAWrapper(make_tiny_env()).step(np.zeros(3, dtype=np.int64))
