"""Policy networks (agents/learned/nets.py): the padded masked head and the compact input.

Pins that the padded distribution is sb3-contrib's masked multi-categorical (same log-probs,
entropies and modes, samples only allowed actions), that the compact extractor summarises the
replica map as stated, and that a model built with both saves and loads.
"""

from __future__ import annotations

import numpy as np
import pytest

th = pytest.importorskip("torch")
pytest.importorskip("sb3_contrib")

from gymnasium import spaces  # noqa: E402
from sb3_contrib.common.maskable.distributions import (  # noqa: E402
    MaskableMultiCategoricalDistribution)

from agents.learned.nets import (compact_extractor, fast_maskable_policy,  # noqa: E402
                                 fast_multi_categorical)


def test_padded_distribution_equals_sb3_contrib_masked_multi_categorical():
    dims = [5, 5, 3, 4, 1]
    rng = np.random.default_rng(0)
    logits = th.tensor(rng.normal(size=(64, sum(dims))), dtype=th.float32)
    masks = rng.random((64, sum(dims))) < 0.6
    for d, start in enumerate(np.cumsum([0] + dims[:-1])):
        masks[np.arange(64), start + rng.integers(0, dims[d], 64)] = True   # one allowed each
    ref = MaskableMultiCategoricalDistribution(dims).proba_distribution(logits)
    fast = fast_multi_categorical()(dims).proba_distribution(logits)
    for m in (None, masks):
        ref.apply_masking(m)
        fast.apply_masking(m)
        th.testing.assert_close(fast.entropy(), ref.entropy(), rtol=1e-5, atol=1e-4)
        assert th.equal(fast.mode(), ref.mode())
        acts = ref.sample()
        th.testing.assert_close(fast.log_prob(acts), ref.log_prob(acts), rtol=1e-5, atol=1e-4)
    th.manual_seed(0)
    sampled = fast.sample()
    assert sampled.shape == (64, len(dims))
    starts = np.cumsum([0] + dims[:-1])
    assert all(masks[i, starts[d] + int(sampled[i, d])] for i in range(64)
               for d in range(len(dims)))


def test_compact_extractor_summarises_the_replica_map():
    E, D = 4, 3
    space = spaces.Dict({"pred_load": spaces.Box(0, 1, (E,)), "node_load": spaces.Box(0, 3, (D,)),
                         "replicas": spaces.Box(0, 1, (E * D,)), "layer": spaces.Box(0, 1, (1,))})
    ext = compact_extractor()(space)
    assert ext.features_dim == E + D + 1 + E + D
    rep = th.tensor([[1, 0, 0], [0, .5, .5], [0, 0, 1], [1 / 3, 1 / 3, 1 / 3]]).reshape(1, -1)
    obs = {"pred_load": th.arange(E, dtype=th.float32)[None], "node_load": th.ones(1, D),
           "replicas": rep, "layer": th.full((1, 1), 0.5)}
    out = ext(obs)[0]
    keys = list(space.spaces)               # Dict sorts its keys
    assert keys == ["layer", "node_load", "pred_load", "replicas"]
    th.testing.assert_close(out[:1 + D + E], th.tensor([0.5, 1, 1, 1, 0, 1, 2, 3]))
    th.testing.assert_close(out[1 + D + E:], th.tensor([1, .5, 1, 1 / 3, 1 + 1 / 3, 5 / 6,
                                                        1 + 5 / 6]))


def test_model_with_the_fast_policy_saves_and_loads(tmp_path):
    import gymnasium as gym
    from sb3_contrib import MaskablePPO

    class Env(gym.Env):
        observation_space = spaces.Dict({"pred_load": spaces.Box(0, 1, (4,)),
                                         "replicas": spaces.Box(0, 1, (8,))})
        action_space = spaces.MultiDiscrete([3, 2])

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return self.observation_space.sample(), {}

        def step(self, action):
            return self.observation_space.sample(), float(action[0]), False, False, {}

        def action_masks(self):
            return np.array([True, False, True, True, True])

    model = MaskablePPO(fast_maskable_policy(), Env(), n_steps=16, batch_size=8, n_epochs=1,
                        policy_kwargs={"features_extractor_class": compact_extractor()},
                        seed=0, device="cpu")
    model.learn(32)
    model.save(tmp_path / "m.zip")
    loaded = MaskablePPO.load(tmp_path / "m.zip", device="cpu")
    assert type(loaded.policy) is fast_maskable_policy()
    obs = Env().observation_space.sample()
    a1, _ = model.predict(obs, deterministic=True, action_masks=Env().action_masks())
    a2, _ = loaded.predict(obs, deterministic=True, action_masks=Env().action_masks())
    assert np.array_equal(a1, a2) and a1[0] != 1
