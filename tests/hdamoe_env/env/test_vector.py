"""Tests of hdamoe_env.env.vector: the batched vector env equals N single envs, step by step.

Pins the contract of issue "Fast enough to learn": every copy's observations, rewards,
terminations and truncations are bit-identical to a single env (``gymnasium.make`` of the same
id, seed ``seed + i``) with the same actions, under Gymnasium 1.x autoreset (NEXT_STEP), for
both fidelities and for actions that take the batched path (no broadcast, gating off) and the
per-copy path (pre-broadcast, gating); and the registered ``vector_entry_point``.
"""

from __future__ import annotations

import pickle

import gymnasium as gym
import numba
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import hdamoe_env
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.env.environment import HdMoeEnv
from hdamoe_env.env.vector import HdMoeVectorEnv

TINY = dict(model="deepseek-v2-lite", mesh="2x4", batch=8, trace_tokens=512, trace_requests=8,
            steps_per_episode=1)


def _mask_tuple(venv, i):
    splits = np.cumsum(venv.single_action_space.nvec)[:-1]
    return tuple(m.astype(np.int8) for m in np.split(venv.action_masks()[i], splits))


def _compare(env_id, num_envs, steps, kwargs, *, policy="mixed", seed=11, vec_kwargs=None):
    """Step the vector env and N single envs with the same actions; assert equality
    (``vec_kwargs``: arguments of the vector env only)."""
    venv = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="vector_entry_point",
                        **kwargs, **(vec_kwargs or {}))
    assert isinstance(venv.unwrapped, HdMoeVectorEnv)
    singles = [gym.make(env_id, **kwargs) for _ in range(num_envs)]
    obs, _ = venv.reset(seed=seed)
    single_obs = [env.reset(seed=seed + i)[0] for i, env in enumerate(singles)]
    for i, o in enumerate(single_obs):
        for key in o:
            np.testing.assert_array_equal(obs[key][i], o[key])
    base = venv.unwrapped.envs[0]
    noop = np.array([base.num_experts] * base.max_broadcast + [0, 0] + [0] * bool(
        base.replica_rules))
    rng = np.random.default_rng(seed)
    space = venv.unwrapped.single_action_space
    space.seed(seed)
    done = np.zeros(num_envs, dtype=bool)
    paths = 0
    for _ in range(steps):
        if policy == "noop":
            acts = np.tile(noop, (num_envs, 1))
        elif policy == "gating":                        # no broadcast, a random gating level
            acts = np.tile(noop, (num_envs, 1))
            acts[:, base.max_broadcast + 1] = rng.integers(0, len(base.gating_levels),
                                                           num_envs)
        else:                                           # random masked ("mixed": half noop)
            acts = np.stack([space.sample(mask=_mask_tuple(venv.unwrapped, i))
                             for i in range(num_envs)])
            if policy == "mixed":
                plain = rng.random(num_envs) < 0.5
                acts[plain] = noop
                paths += int((~plain).sum())
        obs, rew, term, trunc, info = venv.step(acts)
        for i, env in enumerate(singles):
            if done[i]:                                 # NEXT_STEP autoreset
                o, r, te, tr = *env.reset()[:1], 0.0, False, False
            else:
                o, r, te, tr, _ = env.step(acts[i])
            assert r == rew[i] and te == term[i] and tr == trunc[i]
            for key in o:
                np.testing.assert_array_equal(obs[key][i], o[key], err_msg=key)
            done[i] = te or tr
        assert info["action_mask"].shape == (num_envs, int(space.nvec.sum()))
    venv.close()
    return paths


@pytest.mark.parametrize("num_envs", [1, 7])
def test_vector_env_equals_single_envs_analytic(num_envs):
    _compare("hdamoe_env/HdMoE-v1", num_envs, 40, dict(TINY, fidelity="analytic",
                                                        gammas=[0.7] * 26))


def test_vector_env_equals_single_envs_des():
    _compare("hdamoe_env/HdMoE-v1", 3, 30, TINY)
    _compare("hdamoe_env/HdMoE-v1", 2, 60, dict(TINY, steps_per_episode=2), policy="noop")


def test_vector_env_equals_single_envs_analytic_id_noop():
    """The registered analytic id (TimeLimit passed as max_episode_steps), all batched."""
    _compare("hdamoe_env/HdMoE-analytic-v1", 2, 60,
             dict(batch=8, trace_tokens=512, trace_requests=8, gammas=[0.5] * 26),
             policy="noop")


@pytest.mark.parametrize("num_envs,fidelity", [(1, "analytic"), (7, "analytic"), (5, "des")])
def test_vector_env_gating_without_broadcast_is_batched_and_equal(num_envs, fidelity,
                                                                  monkeypatch):
    """Copies with gating on and no broadcast take the batched gated path."""
    calls = []
    original = HdMoeVectorEnv._step_gated

    def spy(self, idx, a):
        done = original(self, idx, a)
        calls.append(int(done.sum()))
        return done

    monkeypatch.setattr(HdMoeVectorEnv, "_step_gated", spy)
    _compare("hdamoe_env/HdMoE-v1", num_envs, 40, dict(TINY, fidelity=fidelity,
                                                        gammas=[0.7] * 26), policy="gating")
    assert sum(calls) > 10


def test_vector_env_des_copies_take_one_batched_des_call(monkeypatch):
    """DES copies with plain actions: aggregators per copy, one compiled DES call for all."""
    from hdamoe_env.env import vector

    runs = []
    original = vector._BatchedDes.latency

    def spy(self, layers, sets, counts, rngs):
        runs.append(layers.size)
        return original(self, layers, sets, counts, rngs)

    monkeypatch.setattr(vector._BatchedDes, "latency", spy)
    _compare("hdamoe_env/HdMoE-v1", 5, 40, dict(TINY, steps_per_episode=2), policy="noop")
    assert sum(runs) > 100 and max(runs) > 1


def test_vector_env_des_threads_reach_the_batched_call_and_stay_equal(monkeypatch):
    """``des_threads`` (here numba's pool size: 1 under NUMBA_NUM_THREADS=1) is passed to
    every batched DES call; the copies still equal single envs."""
    import numba

    from hdamoe_env.noc import linksim

    limit = numba.config.NUMBA_NUM_THREADS
    seen = []
    original = linksim.simulate_layers_comm

    def spy(*args, **kwargs):
        seen.append(kwargs["threads"])
        return original(*args, **kwargs)

    monkeypatch.setattr(linksim, "simulate_layers_comm", spy)
    _compare("hdamoe_env/HdMoE-v1", 3, 30, dict(TINY, steps_per_episode=2), policy="noop",
             vec_kwargs=dict(des_threads=limit))
    assert seen and set(seen) == {limit}


def _spy_broadcast(monkeypatch):
    """Count the copies ``_step_broadcast`` steps (batched pre-broadcast steps)."""
    counts = []
    original = HdMoeVectorEnv._step_broadcast

    def spy(self, idx, a):
        done = original(self, idx, a)
        counts.append(int(done.sum()))
        return done

    monkeypatch.setattr(HdMoeVectorEnv, "_step_broadcast", spy)
    return counts


@pytest.mark.parametrize("num_envs,kwargs", [
    (1, dict(k_b=2)), (7, dict(k_b=2)), (7, dict(k_b=3, conventions="paper")),
    (5, dict(k_b=2, steps_per_episode=2, dispatch_rules=("least_loaded", "first", "home")))])
def test_vector_env_des_pre_broadcast_copies_are_batched_and_equal(num_envs, kwargs,
                                                                   monkeypatch):
    """DES copies with a pre-broadcast (random masked actions: broadcast slots, dispatch rule
    and gating level drawn from the masks) take the batched pre-broadcast step and equal
    single envs step by step."""
    counts = _spy_broadcast(monkeypatch)
    _compare("hdamoe_env/HdMoE-v1", num_envs, 40, dict(TINY, **kwargs), policy="random")
    assert sum(counts) > 10 * num_envs


def test_threaded_decode_step_formation_reforms_flagged_copies(monkeypatch):
    """With ``des_threads`` > 1 the decode steps are formed by ``form_steps_par``; a flagged
    copy (the predictor's fallback) gets its generator back and is formed again serially, so
    every copy still equals its single env. Run on numba's pool of this process: the thread
    check and count are stubbed, and the spy flags copies 0 and 2 at every call."""
    import contextlib

    from hdamoe_env.noc import linksim
    from hdamoe_env.sim import batch_kernels

    monkeypatch.setattr(linksim, "check_threads", lambda threads, name="threads": int(threads))
    monkeypatch.setattr(linksim, "numba_threads", lambda threads: contextlib.nullcontext())
    calls = []
    original = batch_kernels.form_steps_par

    def spy(*args):
        pending = original(*args)
        calls.append(pending.size)
        pending[[0, 2]] = True
        return pending

    monkeypatch.setattr(batch_kernels, "form_steps_par", spy)
    _compare("hdamoe_env/HdMoE-v1", 4, 40, dict(TINY, steps_per_episode=2), policy="noop",
             vec_kwargs=dict(des_threads=2))
    _compare("hdamoe_env/HdMoE-v1", 3, 30, dict(TINY, fidelity="analytic", gammas=[0.7] * 26),
             vec_kwargs=dict(des_threads=2))
    assert len(calls) >= 4 and max(calls) >= 3


_TWO_THREADS = """
import numba
from tests.hdamoe_env.env.test_vector import TINY, _compare
assert numba.config.NUMBA_NUM_THREADS == 2
_compare("hdamoe_env/HdMoE-v1", 5, 40, dict(TINY, steps_per_episode=2), policy="noop",
         vec_kwargs=dict(des_threads=2))
print("equal", numba.threading_layer())
"""


def test_vector_env_on_two_threads_equals_single_envs():
    """In a process with a pool of two numba threads, ``des_threads=2`` (the threaded DES
    call and decode-step formation) keeps every copy equal to its single env."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, NUMBA_NUM_THREADS="2",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _TWO_THREADS], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("equal")


@pytest.mark.parametrize("value,match", [
    (0, "des_threads must be an integer >= 1, got 0"), (2.0, "des_threads must be an integer"),
    (None, "got None"), (10_000, "des_threads=10000 exceeds numba's thread pool")])
def test_bad_des_threads_are_config_errors(value, match):
    with pytest.raises(ConfigError, match=match):
        HdMoeVectorEnv(2, des_threads=value, **TINY)


@pytest.mark.slow
def test_vector_env_equals_single_envs_64():
    _compare("hdamoe_env/HdMoE-v1", 64, 60, dict(TINY, fidelity="analytic",
                                                  gammas=[0.7] * 26))
    _compare("hdamoe_env/HdMoE-v1", 64, 30, TINY)
    _compare("hdamoe_env/HdMoE-v1", 64, 30, dict(TINY, fidelity="analytic",
                                                  gammas=[0.7] * 26), policy="gating")
    _compare("hdamoe_env/HdMoE-v1", 64, 30, TINY, policy="gating")
    _compare("hdamoe_env/HdMoE-v1", 64, 30, dict(TINY, k_b=2), policy="random",
             vec_kwargs=dict(des_threads=numba.config.NUMBA_NUM_THREADS))


def test_vector_entry_point_registered_for_every_id():
    for env_id in hdamoe_env.REGISTERED_ENVS:
        spec = gym.spec(env_id)
        assert spec.vector_entry_point == hdamoe_env.VECTOR_ENTRY_POINT


def test_same_step_autoreset_returns_final_obs():
    venv = HdMoeVectorEnv(2, autoreset_mode=AutoresetMode.SAME_STEP, fidelity="analytic",
                          gammas=[0.7] * 26, **TINY)
    venv.reset(seed=0)
    acts = np.tile(np.array([64] * 8 + [0, 0]), (2, 1))
    for step in range(26):
        obs, _, term, _, info = venv.step(acts)
    assert term.all() and info["_final_obs"].all()
    assert info["final_obs"][0]["pred_load"].sum() == 0          # the episode-over observation
    assert obs["layer"][:, 0].tolist() == [0.0, 0.0]
    venv.step(acts)                                               # already reset: steps on


def test_disabled_autoreset_needs_reset_mask():
    venv = HdMoeVectorEnv(2, autoreset_mode="Disabled", fidelity="analytic", gammas=[0.7] * 26,
                          **TINY)
    venv.reset(seed=0)
    acts = np.tile(np.array([64] * 8 + [0, 0]), (2, 1))
    for _ in range(26):
        venv.step(acts)
    with pytest.raises(ConfigError, match="reset_mask"):
        venv.step(acts)
    venv.reset(options={"reset_mask": np.array([True, True])})
    venv.step(acts)


@pytest.mark.parametrize("kwargs", [{"num_envs": 0}, {"num_envs": 2, "max_episode_steps": 0},
                                    {"num_envs": 2, "autoreset_mode": "sometimes"}])
def test_bad_arguments_are_typed(kwargs):
    with pytest.raises(ConfigError):
        HdMoeVectorEnv(**kwargs, **TINY)


def test_copies_share_static_data():
    venv = HdMoeVectorEnv(3, fidelity="analytic", gammas=[0.7] * 26, **TINY)
    a, b = venv.envs[0], venv.envs[2]
    assert a.trace is b.trace and a.placement is b.placement and a.evaluator is b.evaluator
    venv.reset(seed=0)
    assert a.np_random is not b.np_random and a._sets is not b._sets


@pytest.mark.parametrize("env_id", ["hdamoe_env/HdMoE-v0", "hdamoe_env/HdMoE-analytic-v0",
                                    "hdamoe_env/HdMoE-Mixtral-v0"])
def test_v0_ids_are_retired_with_a_message_naming_v1(env_id):
    successor = env_id.replace("-v0", "-v1")
    with pytest.raises(ConfigError, match=successor):
        gym.make(env_id)
    with pytest.raises(ConfigError, match=successor):
        gym.make_vec(env_id, num_envs=2, vectorization_mode="vector_entry_point")



def test_env_pickle_rebuilds_the_trace_and_continues_the_same_rollout():
    """A synthetic trace is left out of the pickle and rebuilt on load; the rollout goes on."""
    from hdamoe_env.env.environment import HdMoeEnv

    env = HdMoeEnv(fidelity="analytic", gammas=[0.7] * 26, **dict(TINY, steps_per_episode=2))
    env.reset(seed=3)
    noop = np.array([64] * 8 + [0, 0])
    for _ in range(5):
        env.step(noop)
    blob = pickle.dumps(env)
    assert len(blob) < len(pickle.dumps(env.trace))           # the trace is not in it
    twin = pickle.loads(blob)
    for _ in range(40):
        a = env.step(noop)
        b = twin.step(noop)
        assert a[1:4] == b[1:4]
        for key in a[0]:
            np.testing.assert_array_equal(a[0][key], b[0][key])


@pytest.mark.slow
def test_default_env_pickles_under_2_mb():
    from hdamoe_env.env.environment import HdMoeEnv

    env = HdMoeEnv(fidelity="des")
    env.reset(seed=0)
    assert len(pickle.dumps(env)) <= 2_000_000


@pytest.mark.parametrize("reward", ["energy", "edp"])
def test_vector_env_equals_single_envs_energy_rewards(reward):
    _compare("hdamoe_env/HdMoE-v1", 3, 24, dict(TINY, reward=reward))
    _compare("hdamoe_env/HdMoE-v1", 2, 24, dict(TINY, fidelity="analytic", gammas=[0.7] * 26,
                                                 reward=reward), policy="noop")


def test_copies_with_another_bit_generator_take_the_numpy_path():
    """A copy whose generator is not PCG64 forms its decode steps per copy (numpy predictor)
    and still equals a single env holding the same generator."""
    kwargs = dict(TINY, fidelity="analytic", gammas=[0.7] * 26, steps_per_episode=3)
    venv = HdMoeVectorEnv(3, **kwargs)
    singles = [HdMoeEnv(**kwargs) for _ in range(3)]
    venv.reset(seed=5)
    for i, env in enumerate(singles):
        env.reset(seed=5 + i)
    for i in (0, 2):                     # from now on (the next decode step on), Philox
        venv.envs[i].np_random = np.random.Generator(np.random.Philox(i))
        singles[i].np_random = np.random.Generator(np.random.Philox(i))
    base = venv.envs[0]
    noop = np.array([base.num_experts] * base.max_broadcast + [0, 0])
    for _ in range(2 * base.num_layers + 3):
        obs, rew, term, trunc, _ = venv.step(np.tile(noop, (3, 1)))
        for i, env in enumerate(singles):
            o, r, te, tr, _ = env.step(noop)
            assert r == rew[i] and te == term[i] and tr == trunc[i]
            for key in o:
                np.testing.assert_array_equal(obs[key][i], o[key], err_msg=key)
