"""The drift env ``HdMoeDriftEnv`` (``hdamoe_env/HdMoE-Drift-v1``, issue 31, item 3).

Pins: both check_envs, legality of every action of the space (out of space raises), same seed ⇒
same trajectory, the weight moves charged when re-placing and nothing when keeping, the
one-layer EPLB against ``baselines.eplb``, the threshold baseline re-placing after a forced
regime switch, the real Mixtral categories (skipped without ../shared/reference-traces) and a
tiny MaskablePPO run. All on a tiny synthetic model (seconds).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import hdamoe_env
from baselines.eplb import eplb, replicate
from hdamoe_env.config.errors import ConfigError, InvalidAction, TraceFormatError
from hdamoe_env.config.specs import ModelSpec
from hdamoe_env.env.drift import (HdMoeDriftEnv, compare_policies, eplb_layer, hindsight_oracle,
                                  once_policy, periodic_policy, regime_policy, static_policy,
                                  threshold_policy, total_variation)

MODEL = ModelSpec(key="tiny-drift", name="tiny-drift", num_moe_layers=2, num_experts=8, top_k=2,
                  hidden_size=64, expert_intermediate=256, attn_weight_elements=4 * 64 * 64,
                  kv_elements_per_token=2 * 64, core_flops_per_ctx_token=4 * 64)
KW = dict(model=MODEL, mesh="2x2", setting="1/1", batch=8, trace_requests=4, trace_tokens=256,
          num_regimes=2, window=4, num_windows=4, mean_dwell=8.0)
MIXTRAL_DIR = Path(__file__).resolve().parents[3] / ".." / "shared" / "reference-traces" / "mixtral"


def make(**kwargs) -> HdMoeDriftEnv:
    return HdMoeDriftEnv(**{**KW, **kwargs})


def rollout(env: HdMoeDriftEnv, actions, seed: int = 3) -> tuple[list, list, list]:
    obs, info = env.reset(seed=seed)
    seen, rewards, infos = [obs], [], [info]
    for a in actions:
        obs, r, term, trunc, info = env.step(a)
        seen.append(obs)
        rewards.append(r)
        infos.append(info)
    assert term and not trunc
    return seen, rewards, infos


def test_registered_and_check_envs(check_registered_env):
    check_registered_env("hdamoe_env/HdMoE-Drift-v1", hdamoe_env.DRIFT_ENVS, HdMoeDriftEnv, KW,
                         make())


def test_every_action_is_legal_and_out_of_space_raises():
    env = make()
    n = env.action_space.n
    assert n == 4 and env.action_names == ("keep", "replace r=0", "replace r=1", "replace r=2")
    with pytest.raises(InvalidAction):
        env.step(0)                                    # before reset
    obs, info = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    assert info["fidelity"] == "analytic" and info["regime_source"] == "synthetic"
    for a in range(n):
        assert env.action_masks().all()
        env.reset(seed=a)
        obs, r, term, trunc, info = env.step(np.int64(a))
        assert env.observation_space.contains(obs) and np.isfinite(r) and not trunc
        assert info["action"] == a and r == pytest.approx(-info["ratio"])
        # the redundancy level of the placement shows in the holders: D·S copies after a re-place
        if a:
            assert env.holders.sum() == 4 * (2 + env.redundancy[a - 1])
    for bad in (-1, n, 1.5, "1", [0, 1]):
        with pytest.raises(InvalidAction):
            env.step(bad)


def test_same_seed_same_trajectory():
    actions = [1, 0, 3, 0]
    a_obs, a_rew, a_inf = rollout(make(), actions)
    b_obs, b_rew, b_inf = rollout(make(), actions)
    for x, y in zip(a_obs, b_obs, strict=True):
        np.testing.assert_array_equal(x, y)
    assert a_rew == b_rew
    assert [i["regime"] for i in a_inf] == [i["regime"] for i in b_inf]
    _, c_rew, _ = rollout(make(), actions, seed=4)
    assert c_rew != a_rew


def test_weight_moves_charged_when_replacing_zero_when_keeping():
    env = make()
    env.reset(seed=1)
    _, _, _, _, keep = env.step(0)
    assert keep["moves"] == 0 and keep["move_us"] == 0.0 and keep["move_energy_uj"] == 0.0
    _, r, _, _, more = env.step(3)                     # 2 redundant slots per node: 8 new copies
    assert more["moves"] >= 8 and more["move_us"] > 0 and more["move_energy_uj"] > 0
    assert more["ratio"] == pytest.approx(more["window_us"] / more["tp_window_us"])
    assert r == pytest.approx(-(more["window_us"]) / more["tp_window_us"])
    # the charge is the makespan: the window's latency without it is a plain layer latency
    assert more["window_us"] - more["move_us"] > 0
    # the energy-aware reward subtracts the moves' energy, and nothing when keeping
    env_e = make(energy_weight=1.0)
    env_e.reset(seed=1)
    _, r_keep, _, _, _ = env_e.step(0)
    assert r_keep == pytest.approx(-keep["ratio"])
    _, r_e, _, _, _ = env_e.step(3)
    assert r_e < r


def test_replace_on_unchanged_loads_moves_nothing():
    env = make()
    env.reset(seed=2)
    env.step(1)
    holds = env.holders
    counts, again = env._build(env._built_on, 0)
    assert env._moves(holds, again)[0] == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_eplb_layer_matches_baselines_eplb(seed):
    rng = np.random.default_rng(seed)
    f = rng.gamma(0.5, size=16)
    for S in (4, 5, 6):
        counts, holds = eplb_layer(f, 4, S)
        np.testing.assert_array_equal(counts, replicate(f, 4 * S, 4))
        ref = eplb(f, 4, S)
        np.testing.assert_array_equal(holds.sum(axis=1), counts)
        assert (holds.sum(axis=0) <= S).all()
        np.testing.assert_allclose(np.sort(holds.T.astype(float) @ (f / counts)),
                                   np.sort(ref.node_load()[0]))
    with pytest.raises(ConfigError):
        eplb_layer(f, 2, 4)                            # 8 slots < 16 experts


def test_threshold_baseline_replaces_after_forced_switch():
    env = make(batch=32, mean_dwell=1e9, regime_skews=(4.0,), num_windows=8)
    env.reset(seed=0, options={"regime": 0})
    policy = threshold_policy(0.35)
    env.step(1)                                        # build on regime 0's window
    for _ in range(2):                                 # no switch: the drift stays small
        assert env.drift < 0.35 and policy(env) == 0
        env.step(policy(env))
    env.switch_regime(1)
    _, _, _, _, info = env.step(policy(env))           # a window of the new regime
    assert info["regime"] == 1 and info["drift"] > 0.35
    assert policy(env) == 1
    _, _, _, _, info = env.step(policy(env))
    assert info["moves"] > 0 and env.drift < 0.35


def test_baselines_and_compare():
    env = make(num_windows=4)
    periodic = periodic_policy(8)                      # every 2 windows of 4 steps
    env.reset(seed=0)
    acts = []
    for _ in range(4):
        acts.append(periodic(env))
        env.step(acts[-1])
    assert acts == [0, 1, 0, 1]
    seen = []
    res = compare_policies(env, {"static": static_policy(), "periodic@8": periodic,
                                 "threshold": threshold_policy(0.0)}, seeds=[0, 1],
                           on_step=lambda *a: seen.append(a))
    assert [(n, s, w) for n, s, w, _ in seen[:5]] == [("static", 0, w) for w in range(4)] + [
        ("static", 1, 0)]
    assert len(seen) == 3 * 2 * 4
    for *_, info in seen:                               # the training callback's keys
        assert info["total_us"] == info["window_us"] and info["tp_total_us"] > 0
        assert info["total_us"] / info["tp_total_us"] == pytest.approx(info["ratio"])
    assert res["static"]["moves_per_episode"] == 0 and res["static"]["move_us_per_window"] == 0
    assert res["threshold"]["moves_per_episode"] > 0
    assert all(v["ratio"] > 0 and v["reward"] == pytest.approx(-v["ratio"]) for v in res.values())
    assert total_variation([1, 0], [0, 1]) == 1.0 and total_variation([2, 2], [1, 1]) == 0.0


def test_des_fidelity_and_bad_config():
    env = make(fidelity="des", num_windows=1)
    env.reset(seed=0)
    _, r, term, _, info = env.step(2)
    assert info["fidelity"] == "des" and term and np.isfinite(r)
    for bad in (dict(fidelity="fast"), dict(window=0), dict(redundancy=(1, 1)),
                dict(mean_dwell=0.5), dict(num_regimes=1), dict(regimes="mixed"),
                dict(regimes="categories")):           # categories need Mixtral
        with pytest.raises(ConfigError):
            make(**bad)
    with pytest.raises(TraceFormatError):
        HdMoeDriftEnv(model="mixtral-8x7b", regimes="categories", trace_dir="/nonexistent")
    with pytest.raises(ConfigError):
        HdMoeDriftEnv(model="mixtral-8x7b", regimes="categories", categories=("poetry", "stem"))


@pytest.mark.slow  # parses two real-trace JSON files (~3.5 s); the synthetic path runs by default
def test_mixtral_categories():
    if not MIXTRAL_DIR.is_dir():
        pytest.skip(f"real Mixtral traces not found at {MIXTRAL_DIR} "
                    "(../shared/reference-traces/mixtral)")
    # the two smallest files: reading all six JSON files takes ~10 s
    env = HdMoeDriftEnv(model="mixtral-8x7b", mesh="2x4", batch=16, regimes="auto",
                        trace_dir=MIXTRAL_DIR, categories=("reasoning", "extraction"),
                        layers=(0,), window=2, num_windows=2)
    assert env.regime_source == "categories" and env.regime_names == ("reasoning", "extraction")
    obs, info = env.reset(seed=0)
    assert info["regime_name"] in ("reasoning", "extraction")
    # the categories differ: the drift statistic between their layer-0 loads is not zero
    assert total_variation(env.regime_frequencies(0), env.regime_frequencies(1)) > 0.01
    _, r, _, _, info = env.step(1)
    assert np.isfinite(r) and info["moves"] >= 0


def test_tiny_maskable_ppo_run():
    pytest.importorskip("sb3_contrib")
    import torch
    from sb3_contrib import MaskablePPO

    torch.set_num_threads(1)
    env = make()
    model = MaskablePPO("MlpPolicy", env, n_steps=16, batch_size=16, n_epochs=1, seed=0,
                        device="cpu")
    model.learn(total_timesteps=32)
    obs, _ = env.reset(seed=1)
    term = False
    while not term:
        action, _ = model.predict(obs, action_masks=env.action_masks(), deterministic=True)
        obs, _, term, _, info = env.step(action)
        assert info["action"] == int(action)


def _brute_force(env: HdMoeDriftEnv, seed: int) -> float:
    """The least mean window ratio over every action sequence of the episode."""
    import itertools

    best = np.inf
    for acts in itertools.product(range(int(env.action_space.n)), repeat=env.num_windows):
        env.reset(seed=seed)
        best = min(best, float(np.mean([env.step(a)[4]["ratio"] for a in acts])))
    return best


@pytest.mark.parametrize("seed", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_hindsight_oracle_matches_brute_force_where_re_placing_pays(seed):
    """Slow compute and skewed regimes make re-placing worth its moves: the programme's replayed
    sequence is the best of all 4^3 sequences, and it re-places."""
    env = make(batch=64, window=8, mean_dwell=4.0, mesh="2x4", num_windows=3, setting="0.05/1",
               regime_skews=(1.0, 3.0))
    h = hindsight_oracle(env, seed)
    assert any(a > 0 for a in h.actions) and h.moves > 0
    assert h.ratio == pytest.approx(_brute_force(env, seed), rel=1e-12)
    assert h.ratio == pytest.approx(h.dp_ratio, rel=1e-9)
    assert h.free_ratio <= h.dp_ratio + 1e-12 and h.dp_ratio < h.static_ratio


def test_hindsight_oracle_keeps_when_moves_cost_more():
    """On the default tiny env moves outweigh every gain: never re-place, value = static."""
    env = make()
    h = hindsight_oracle(env, 1)
    assert h.actions == (0,) * env.num_windows and h.moves == 0
    assert h.ratio == pytest.approx(h.static_ratio, rel=1e-12)
    res = compare_policies(env, {"static": static_policy()}, [1])["static"]
    assert res["ratio"] == pytest.approx(h.ratio, rel=1e-12)
    # the stream is recorded without disturbing the env: a replay after the oracle is unchanged
    assert hindsight_oracle(env, 1) == h


def test_free_move_charge_drops_only_the_moves_makespan():
    """Same stream and moves; "free" leaves the makespan out of the window, "serial" charges it."""
    serial, free = make(), make(move_charge="free")
    actions = [1, 0, 3, 0]
    _, _, a = rollout(serial, actions)
    _, _, b = rollout(free, actions)
    moved = [i for i, x in enumerate(a[1:]) if x["moves"] > 0]
    assert moved
    for x, y in zip(a[1:], b[1:], strict=True):
        assert (x["moves"], x["move_us"]) == (y["moves"], y["move_us"])
        assert y["charged_move_us"] == 0.0 and x["charged_move_us"] == x["move_us"]
        assert x["window_us"] == pytest.approx(y["window_us"] + x["move_us"], rel=1e-12)
    with pytest.raises(ConfigError, match="move_charge"):
        make(move_charge="overlap")


def test_threshold_cooldown_holds_back_later_replacements():
    """Threshold 0 re-places whenever the loads moved; a cooldown of the episode's length
    allows one re-placement; bad arguments are typed errors."""
    env = make(num_windows=6)
    counts = {}
    for c in (0, 6):
        policy = threshold_policy(0.0, 1, cooldown_windows=c)
        env.reset(seed=4)
        actions = []
        for _ in range(env.num_windows):
            a = policy(env)
            actions.append(a)
            env.step(a)
        counts[c] = sum(a > 0 for a in actions)
        assert env.replacements == counts[c]
    assert counts[6] == 1 and counts[0] > 1
    with pytest.raises(ConfigError, match="cooldown_windows"):
        threshold_policy(0.1, 0, cooldown_windows=-1)


def test_once_policy_replaces_at_its_window_only():
    env = make(num_windows=5)
    policy = once_policy(2, 1)
    for seed in (0, 1):                                # the same instance over two episodes
        env.reset(seed=seed)
        actions = []
        for _ in range(env.num_windows):
            actions.append(policy(env))
            env.step(actions[-1])
        assert actions == [0, 0, 2, 0, 0] and env.replacements == 1
    with pytest.raises(ConfigError, match="window"):
        once_policy(-1)


def test_regime_policy_follows_the_true_regime():
    """It re-places at the first decision (built for the current regime), not again while the
    regime holds, again after a forced switch once the delay has passed, and never beyond
    ``max_replacements``; its memory is cleared by the next episode."""
    env = make(mean_dwell=1e9, num_windows=8)
    policy = regime_policy(0, max_replacements=2, delay_windows=1)
    for _ in range(2):
        env.reset(seed=0, options={"regime": 0})
        actions = []
        for w in range(env.num_windows):
            if w == 3:
                env.switch_regime(1)                   # windows from here on are regime 1
            actions.append(policy(env))
            env.step(actions[-1])
        # delay 1: the first decision (regime 0's first window) waits one window; the switch
        # made before decision 3 shows in env.regime at decision 3, waits until decision 4
        assert actions == [0, 1, 0, 0, 1, 0, 0, 0]
    one = regime_policy(0, max_replacements=1)
    env.reset(seed=0, options={"regime": 0})
    acts = []
    for w in range(4):
        if w == 2:
            env.switch_regime(1)
        acts.append(one(env))
        env.step(acts[-1])
    assert acts == [1, 0, 0, 0]
    with pytest.raises(ConfigError, match="max_replacements"):
        regime_policy(0, max_replacements=0)
    with pytest.raises(ConfigError, match="delay_windows"):
        regime_policy(0, delay_windows=-1)
