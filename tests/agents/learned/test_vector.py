"""Tests of agents.learned.vector: the SB3 adapter of the batched vector env."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

from agents.learned.envs import make_vec_env  # noqa: E402
from hdamoe_env.config.errors import ConfigError  # noqa: E402

TINY = dict(model="deepseek-v2-lite", mesh="2x4", batch=8, trace_tokens=512, trace_requests=8,
            steps_per_episode=1, fidelity="analytic", gammas=[0.7] * 26)


@pytest.mark.parametrize("action_mode", ["full", "ranked"])
def test_batched_backend_equals_dummy_vec_env(action_mode):
    """Same seeds and actions: the batched backend gives the per-process backend's numbers."""
    batched = make_vec_env(TINY, 3, seed=4, action_mode=action_mode, vec_backend="batched")
    ref = [make_vec_env(TINY, 1, seed=4 + i, action_mode=action_mode) for i in range(3)]
    obs = batched.reset()
    ref_obs = [r.reset() for r in ref]
    for i in range(3):
        np.testing.assert_array_equal(obs["pred_load"][i], ref_obs[i]["pred_load"][0])
    rng = np.random.default_rng(0)
    episodes = 0
    for _ in range(60):
        masks = np.stack(batched.env_method("action_masks"))
        ref_masks = [r.env_method("action_masks")[0] for r in ref]
        for i in range(3):
            np.testing.assert_array_equal(masks[i], ref_masks[i])
        nvec = batched.action_space.nvec
        acts = np.stack([[rng.integers(n) for n in nvec] for _ in range(3)])
        obs, rew, done, infos = batched.step(acts)
        for i, r in enumerate(ref):
            o, rr, d, inf = r.step(acts[i:i + 1])
            assert rr[0] == rew[i] and d[0] == done[i]
            for key in o:
                np.testing.assert_array_equal(o[key][0], obs[key][i])
            if d[0]:
                episodes += 1
                assert infos[i]["episode"]["l"] == inf[0]["episode"]["l"]
                np.testing.assert_array_equal(infos[i]["terminal_observation"]["layer"],
                                              inf[0]["terminal_observation"]["layer"])
    assert episodes >= 3


def test_batched_backend_rejects_what_it_cannot_do():
    with pytest.raises(ConfigError, match="subproc"):
        make_vec_env(TINY, 2, action_mode="residual", vec_backend="batched")
    with pytest.raises(ConfigError):
        make_vec_env(TINY, 2, vec_backend="threads")


@pytest.mark.slow                         # torch start-up and one PPO update
def test_maskable_ppo_learns_on_the_batched_backend(tmp_path):
    pytest.importorskip("sb3_contrib")
    from sb3_contrib import MaskablePPO

    venv = make_vec_env(TINY, 4, seed=0, action_mode="ranked", vec_backend="batched")
    model = MaskablePPO("MultiInputPolicy", venv, n_steps=16, batch_size=32, n_epochs=1,
                        seed=0, device="cpu")
    model.learn(128)
    assert model.num_timesteps >= 128
