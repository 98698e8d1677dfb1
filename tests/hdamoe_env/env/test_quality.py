"""The quality-budget env ``HdMoeQualityEnv`` (``hdamoe_env/HdMoE-Quality-v1``, issue 31, item 4).

Pins: both check_envs, legality of every action of the space (masked ones coerced to level 0 or
raising in strict mode, out of space raising), same seed ⇒ same trajectory, the budget met by
every episode whatever the actions, the observation's costs equal to what the step charges, the
knapsack oracle against brute force and scipy's LP, the oracle below every policy run in the env,
and a tiny MaskablePPO run. All on a tiny synthetic model (seconds).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import hdamoe_env
from hdamoe_env.config.errors import ConfigError, InvalidAction
from hdamoe_env.config.specs import ModelSpec
from hdamoe_env.env.quality import (HdMoeQualityEnv, knapsack_oracle, lp_bound, price_policy,
                                    run_policy, single_scale_policy)

MODEL = ModelSpec(key="tiny-quality", name="tiny-quality", num_moe_layers=3, num_experts=8,
                  top_k=2, hidden_size=64, expert_intermediate=256,
                  attn_weight_elements=4 * 64 * 64, kv_elements_per_token=2 * 64,
                  core_flops_per_ctx_token=4 * 64)
# strong coefficients so that gating changes sets on the tiny chip
KW = dict(model=MODEL, mesh="2x2", setting="1/1", batch=16, trace_requests=8, trace_tokens=256,
          steps_per_episode=2, target=0.9, gating_coefficients=(-1e7, -0.05),
          levels=(1.0, 4.0), protect=(0, 1))


def make(**kwargs) -> HdMoeQualityEnv:
    return HdMoeQualityEnv(**{**KW, **kwargs})


def test_registered_and_check_envs(check_registered_env):
    check_registered_env("hdamoe_env/HdMoE-Quality-v1", hdamoe_env.QUALITY_ENVS, HdMoeQualityEnv, KW, make())


def test_action_grid_and_bad_arguments():
    env = make()
    assert env.action_names == ("level 0", "level 1 protect 0", "level 1 protect 1",
                                "level 4 protect 0", "level 4 protect 1")
    assert env.observation_space.shape == (2 * 5 + 5,)
    # protect-top values >= k are dropped (they equal level 0)
    assert make(protect=(0, 1, 2, 5)).protect == (0, 1)
    for bad in (dict(target=1.5), dict(target=()), dict(levels=(0.0, 1.0)),
                dict(protect=(2, 3)), dict(fidelity="exact"), dict(invalid_action="skip"),
                dict(steps_per_episode=0), dict(gating_levels=(0, 1))):
        with pytest.raises(ConfigError):
            make(**bad)


def test_every_action_is_legal_masked_ones_coerced_out_of_space_raises():
    env = make()
    with pytest.raises(InvalidAction):
        env.step(0)                                    # before reset
    env.reset(seed=0)
    lat, loss = env.episode_table()
    assert (loss[..., 0] == 0).all() and (loss > 0).any()   # gating drops top-1 choices here
    n = env.action_space.n
    for a in range(n):
        env.reset(seed=0, options={"target": 1.0})    # zero budget: only lossless actions
        assert env.budget == 0
        mask = env.action_masks()
        assert mask[0] and np.array_equal(mask, loss[0, 0] == 0)
        obs, r, term, trunc, info = env.step(np.int64(a))
        assert env.observation_space.contains(obs) and np.isfinite(r) and not trunc
        if mask[a]:
            assert info["action"] == a and info["coerced"] == ()
        else:
            assert info["action"] == 0 and info["coerced"] == ((0, a, "masked"),)
        assert info["lost"] == 0
    masked = int(np.flatnonzero(loss[0, 0] > 0)[0])
    strict = make(invalid_action="raise")
    strict.reset(seed=0, options={"target": 1.0})
    with pytest.raises(InvalidAction, match="remaining budget"):
        strict.step(masked)
    for bad in (n, -1, 1.5, [0, 1], "1"):
        with pytest.raises(InvalidAction):
            env.step(bad)


def test_same_seed_same_trajectory_and_costs_are_what_the_step_charges():
    def rollout(seed):
        env = make()
        obs, _ = env.reset(seed=seed)
        rng = np.random.default_rng(seed)
        out = [obs]
        done = False
        while not done:
            lat, loss = env.current_costs()
            a = int(rng.integers(env.action_space.n))
            remaining = env.remaining
            obs, r, term, trunc, info = env.step(a)
            done = term or trunc
            b = info["action"]
            assert b == (a if loss[a] <= remaining else 0)
            assert info["lost"] == loss[b] and info["remaining"] == remaining - loss[b]
            assert info["total_us"] == pytest.approx(lat[b] * 1e6)
            assert r == pytest.approx(-lat[b] / env._ep["tp_mean"])
            out += [obs, r]
        return out, info

    a, info_a = rollout(3)
    b, _ = rollout(3)
    c, _ = rollout(4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    assert info_a["top1_retention"] >= 0.9 and "episode_tbt_us" in info_a


@pytest.mark.parametrize("target", [0.8, 0.9, 0.97])
def test_every_episode_meets_its_target(target):
    env = make(target=target)
    for seed in range(3):
        res = run_policy(env, lambda e: int(e.action_space.sample()), seed)
        assert res["top1"] >= target - 1e-12
    # greedy fastest-first spends the budget, and still meets it
    res = run_policy(env, price_policy(0.0), 0)
    assert target - 1e-12 <= res["top1"] < 1.0


def test_targets_drawn_per_episode_and_in_the_observation():
    env = make(target=(0.8, 0.95))
    seen = set()
    for seed in range(8):
        obs, info = env.reset(seed=seed)
        seen.add(info["target"])
        assert obs[-1] == pytest.approx(1 - info["target"])
        assert info["budget"] == int(np.floor((1 - info["target"]) * 16 * 3 * 2 + 1e-9))
    assert seen == {0.8, 0.95}
    _, info = env.reset(seed=0, options={"target": 0.5})
    assert info["target"] == 0.5


def test_tbt_and_policies_against_the_oracle():
    env = make()
    env.reset(seed=1)
    lat, loss = env.episode_table()
    oracle = knapsack_oracle(lat, loss, env.budget)
    assert oracle.lost <= env.budget
    assert oracle.latency_s == pytest.approx(lat.reshape(-1, lat.shape[-1])[
        np.arange(oracle.choices.size), oracle.choices].sum())
    assert oracle.lp_bound_s <= oracle.latency_s + 1e-15
    ungated = lat[..., 0].sum()
    for policy in (single_scale_policy(0), single_scale_policy(3), price_policy(0.0),
                   price_policy(2.0)):
        res = run_policy(env, policy, 1)
        moe_s = (res["tbt_us"] * 1e-6 - env.dense_s) * env.steps_per_episode
        assert oracle.latency_s <= moe_s + 1e-12
    noop = run_policy(env, single_scale_policy(0), 1)
    assert noop["top1"] == 1.0
    assert (noop["tbt_us"] * 1e-6 - env.dense_s) * 2 == pytest.approx(ungated)


def _brute(lat, loss, budget):
    best = np.inf
    for pick in itertools.product(range(lat.shape[1]), repeat=lat.shape[0]):
        idx = (np.arange(lat.shape[0]), np.array(pick))
        if loss[idx].sum() <= budget:
            best = min(best, lat[idx].sum())
    return best


def test_knapsack_oracle_is_exact_and_the_lp_a_bound():
    rng = np.random.default_rng(0)
    for _ in range(20):
        N, A = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        lat = rng.uniform(1, 2, (N, A))
        loss = rng.integers(0, 5, (N, A))
        loss[:, 0] = 0
        budget = int(rng.integers(0, 8))
        res = knapsack_oracle(lat, loss, budget)
        assert res.latency_s == pytest.approx(_brute(lat, loss, budget))
        assert res.front_s.size <= budget + 1 and res.front_s[-1] == res.latency_s
        b = int(rng.integers(0, res.front_s.size))
        assert res.front_s[b] == pytest.approx(_brute(lat, loss, b))   # every smaller budget
        assert res.lost <= budget
        assert res.lp_bound_s <= res.latency_s + 1e-12
        assert res.lp_bound_s >= lat.min(axis=1).sum() - 1e-12
    with pytest.raises(ConfigError):
        knapsack_oracle(np.ones((2, 2)), np.ones((2, 2), dtype=int), 3)   # no free action
    with pytest.raises(ConfigError):
        knapsack_oracle(np.ones((2, 2)), np.zeros((2, 3), dtype=int), 3)


def test_lp_bound_matches_scipy_linprog():
    optimize = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(1)
    for _ in range(10):
        N, A = 6, 4
        lat = rng.uniform(1, 2, (N, A))
        loss = rng.integers(0, 6, (N, A))
        loss[:, 0] = 0
        budget = int(rng.integers(0, 15))
        eq = np.kron(np.eye(N), np.ones(A))
        res = optimize.linprog(lat.ravel(), A_ub=loss.ravel()[None, :], b_ub=[budget],
                               A_eq=eq, b_eq=np.ones(N), bounds=(0, 1), method="highs")
        assert lp_bound(lat, loss, budget) == pytest.approx(res.fun, rel=1e-9)


def test_des_fidelity_charges_the_des():
    env = make(fidelity="des")
    env.reset(seed=0)
    lat, _ = env.current_costs()
    _, r, _, _, info = env.step(0)
    assert info["fidelity"] == "des" and np.isfinite(r) and info["total_us"] > 0
    assert info["ungated_us"] == pytest.approx(lat[0] * 1e6)     # the analytic estimate
    des, loss = env.episode_table("des")
    assert des[0, 0, 0] * 1e6 == pytest.approx(info["total_us"])    # what the step charged
    assert des.shape == loss.shape and (des > 0).all()
    with pytest.raises(ConfigError):
        env.episode_table("exact")


def test_tiny_maskable_ppo_run():
    pytest.importorskip("sb3_contrib")
    import torch
    from sb3_contrib import MaskablePPO

    torch.set_num_threads(1)
    env = make()
    model = MaskablePPO("MlpPolicy", env, n_steps=12, batch_size=12, n_epochs=1, seed=0,
                        device="cpu")
    model.learn(total_timesteps=24)
    obs, _ = env.reset(seed=1)
    term = False
    while not term:
        mask = env.action_masks()
        action, _ = model.predict(obs, action_masks=mask, deterministic=True)
        assert mask[int(action)]
        obs, _, term, _, info = env.step(action)
        assert info["action"] == int(action) and info["coerced"] == ()
    assert info["top1_retention"] >= 0.9
