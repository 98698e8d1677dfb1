"""Public wrappers of the core (hdamoe_env/env/wrappers.py): flatten-replicas, ranked actions, quality.

Pins that each wrapper is an importable ``gymnasium.Wrapper`` (RL Zoo's ``env_wrapper``), that it
changes only the encoding of the paper-model.md §10–11 decisions (same episodes as the raw env),
and that ``action_masks()`` is reachable through outer wrappers with the action-space length.
"""

from __future__ import annotations

import itertools
import warnings

import gymnasium as gym
import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.specs import HardwareSpec, ModelSpec
from hdamoe_env.env.environment import HdMoeEnv
from hdamoe_env.env.actions import ActionLayout
from hdamoe_env.env.wrappers import (FlattenReplicasWrapper, RankedBroadcastWrapper,
                                     ranked_candidates, ranked_mask, ranked_mask_many,
                                     ranked_to_full, ranked_to_full_many)

TINY = ModelSpec(key="tiny3", name="tiny3", num_moe_layers=3, num_experts=4, top_k=2,
                 hidden_size=64, expert_intermediate=128, attn_weight_elements=4 * 64 * 64,
                 kv_elements_per_token=2 * 64, core_flops_per_ctx_token=4 * 64)
HW = HardwareSpec(mesh_shape=(2, 2), compute_tflops=1.0, link_bw_gbps=1.0)


def make(**kw) -> HdMoeEnv:
    args = dict(model=TINY, hardware=HW, batch=8, steps_per_episode=2, max_broadcast=2,
                k_b=[0, 1, 2], trace_tokens=512, trace_requests=8)
    args.update(kw)
    return HdMoeEnv(**args)


def assert_same_obs(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def sample(mask: np.ndarray, nvec: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    out, off = [], 0
    for n in nvec:
        out.append(int(rng.choice(np.flatnonzero(mask[off:off + n]))))
        off += n
    return np.array(out, dtype=np.int64)


def test_public_wrappers_are_importable_gymnasium_wrappers():
    import hdamoe_env.env.wrappers as module

    for name in ("FlattenReplicasWrapper", "RankedBroadcastWrapper"):
        cls = getattr(module, name)
        assert isinstance(cls, type) and issubclass(cls, gym.Wrapper) and name in module.__all__
    from agents.base import ActionLayout as from_agents
    from hdamoe_env.env.actions import ActionLayout

    assert from_agents is ActionLayout                      # one class, re-exported by agents


def test_flatten_wrapper_equals_flatten_option():
    """The wrapper gives the observation of ``flatten_replicas=True``, step by step."""
    option, wrapped = make(flatten_replicas=True), FlattenReplicasWrapper(make())
    assert wrapped.observation_space == option.observation_space
    assert wrapped.observation_space["replicas"].shape == (TINY.num_experts * 4,)
    rng = np.random.default_rng(0)
    obs_a, _ = option.reset(seed=11)
    obs_b, _ = wrapped.reset(seed=11)
    done = False
    while not done:
        assert_same_obs(obs_a, obs_b)
        assert wrapped.observation_space.contains(obs_b)
        np.testing.assert_array_equal(wrapped.action_masks(), option.action_masks())
        action = sample(option.action_masks(), option.action_space.nvec, rng)
        if action[0] == action[1] != TINY.num_experts:
            action[1] = TINY.num_experts                   # an expert twice would be invalid
        obs_a, r_a, term_a, trunc_a, _ = option.step(action)
        obs_b, r_b, term_b, trunc_b, _ = wrapped.step(action)
        assert (r_a, term_a, trunc_a) == (r_b, term_b, trunc_b)
        done = term_a or trunc_a
    assert_same_obs(obs_a, obs_b)


def _ranked_expert(obs: dict, mask: np.ndarray, c: int) -> int | None:
    """The c-th broadcastable expert by predicted load (ties: lower id), written out plainly."""
    E = TINY.num_experts
    pred = obs["pred_load"]
    allowed = [e for e in range(E) if mask[e] and pred[e] > 0]
    order = sorted(allowed, key=lambda e: (-float(pred[e]), e))
    return order[c] if c < len(order) else None


@pytest.mark.parametrize("num_candidates", [1, 3])
def test_ranked_step_equals_env_step_with_ranked_expert(num_candidates):
    """Slot value c steps the env with the c-th ranked expert: same obs and rewards."""
    E = TINY.num_experts
    ranked, raw = RankedBroadcastWrapper(make(), num_candidates=num_candidates), make()
    assert ranked.action_space.nvec.tolist() == [num_candidates + 1] * 2 + [3, 4]
    rng = np.random.default_rng(1)
    obs_w, _ = ranked.reset(seed=5)
    obs_r, _ = raw.reset(seed=5)
    done, steps = False, 0
    while not done:
        assert_same_obs(obs_w, obs_r)
        mask_w = ranked.action_masks()
        assert mask_w.shape == (int(ranked.action_space.nvec.sum()),)
        action = sample(mask_w, ranked.action_space.nvec, rng)
        if action[0] == action[1] != num_candidates:
            action[1] = num_candidates                     # a candidate twice would repeat
        full_mask = raw.action_masks()
        expected = []
        for slot in range(2):
            c = int(action[slot])
            e = None if c == num_candidates else _ranked_expert(obs_r, full_mask[:E], c)
            expected.append(E if e is None else e)
        full = np.array([*expected, action[2], action[3]], dtype=np.int64)
        obs_w, r_w, term_w, trunc_w, info_w = ranked.step(action)
        obs_r, r_r, term_r, trunc_r, info_r = raw.step(full)
        assert (r_w, term_w, trunc_w) == (r_r, term_r, trunc_r)
        assert info_w.get("tbt_us") == info_r.get("tbt_us")
        done, steps = term_r or trunc_r, steps + 1
    assert steps == 2 * TINY.num_moe_layers


def test_ranked_mask_never_offers_a_missing_candidate():
    env = RankedBroadcastWrapper(make(), num_candidates=4)
    obs, _ = env.reset(seed=2)
    for _ in range(3):
        mask = env.action_masks()
        cands = ranked_candidates(obs["pred_load"], env.unwrapped.action_masks()[:4], 4)
        slot0 = mask[:5]
        assert slot0[4]                                              # "none" always allowed
        assert not slot0[cands.size:4].any()
        obs, *_ = env.step(np.array([4, 4, 0, 0], dtype=np.int64))      # no broadcast


def test_action_masks_reachable_through_outer_wrappers():
    for inner, size in ((RankedBroadcastWrapper(make(), 3), 2 * 4 + 3 + 4),
                        (FlattenReplicasWrapper(make()), 2 * 5 + 3 + 4),
                        (RankedBroadcastWrapper(FlattenReplicasWrapper(make()), 2), 2 * 3 + 3 + 4)):
        outer = gym.wrappers.RecordEpisodeStatistics(inner)
        outer.reset(seed=0)
        mask = outer.get_wrapper_attr("action_masks")()
        assert mask.dtype == bool and mask.shape == (size,)
        assert size == int(outer.action_space.nvec.sum())


def test_wrappers_pass_gymnasium_checker():
    from gymnasium.utils.env_checker import check_env

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the checker samples unmasked actions, so the env coerces masked ones
        check_env(RankedBroadcastWrapper(make(invalid_action="coerce"), 3),
                  skip_render_check=True)
        check_env(FlattenReplicasWrapper(make(invalid_action="coerce")),
                  skip_render_check=True)


def test_ranked_rejects_bad_candidates_and_step_before_reset():
    from hdamoe_env.config.errors import ConfigError

    with pytest.raises(ConfigError, match="num_candidates"):
        RankedBroadcastWrapper(make(), num_candidates=0)
    with pytest.raises(ConfigError, match="reset"):
        RankedBroadcastWrapper(make()).action_masks()


# ------------------------------------------------------------------------- QualityRewardWrapper
class _ScriptedEnv(gym.Env):
    """Reward −0.9 every step; ``info["top1_retention"]`` from a script (None: key absent)."""

    def __init__(self, retentions):
        self.observation_space = gym.spaces.Discrete(1)
        self.action_space = gym.spaces.Discrete(1)
        self.retentions = list(retentions)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return 0, {}

    def step(self, action):
        q = self.retentions[self.t]
        self.t += 1
        info = {} if q is None else {"top1_retention": q}
        return 0, -0.9, self.t >= len(self.retentions), False, info

    def action_masks(self):
        return np.ones(1, dtype=bool)


def test_quality_reward_fixed_weight_exact_value():
    """r = −0.9, τ = 0.99, q = 0.95, w = 100: r' = −0.9 − 100 · 0.04 = −4.9; q ≥ τ: r' = r."""
    from hdamoe_env.env.wrappers import QualityRewardWrapper

    env = QualityRewardWrapper(_ScriptedEnv([0.95, 1.0, None]), target=0.99, weight=100.0)
    env.reset(seed=0)
    _, r, _, _, info = env.step(0)
    assert r == pytest.approx(-4.9)
    assert info["quality_violation"] == pytest.approx(0.04)
    assert info["quality_penalty"] == pytest.approx(4.0)
    assert info["latency_reward"] == -0.9 and info["quality_lambda"] == 100.0
    _, r, _, _, _ = env.step(0)
    assert r == -0.9
    _, r, _, _, info = env.step(0)                 # no key: gating off, retention 1
    assert r == -0.9 and info["quality_violation"] == 0.0
    assert env.action_masks().all()


def test_quality_reward_lagrangian_rises_stays_nonnegative_and_falls():
    """τ = 0.99, η = 50, λ0 = 0.

    q = 0.79: penalty uses λ = 0 (r' = r), then λ = 50 · 0.2 = 10; q = 0.79 again: r' = −0.9 −
    10 · 0.2 = −2.9, λ = 20; then q = 1 (satisfied) 50 times: λ falls by 0.5 per step to 0 after
    40 steps and stays there (projection).
    """
    from hdamoe_env.env.wrappers import QualityRewardWrapper

    env = QualityRewardWrapper(_ScriptedEnv([0.79, 0.79] + [1.0] * 50), target=0.99,
                               lagrangian=True, dual_step=50.0)
    env.reset(seed=0)
    _, r, _, _, info = env.step(0)
    assert r == pytest.approx(-0.9) and info["quality_lambda"] == 0.0
    assert env.lam == pytest.approx(10.0)
    _, r, _, _, info = env.step(0)
    assert r == pytest.approx(-2.9) and info["quality_lambda"] == pytest.approx(10.0)
    assert env.lam == pytest.approx(20.0)
    lams = []
    for _ in range(50):
        _, r, _, _, info = env.step(0)
        lams.append(env.lam)
        assert r == -0.9                                  # satisfied steps are not charged
    assert lams[0] == pytest.approx(19.5)
    assert all(b <= a for a, b in itertools.pairwise(lams))
    assert min(lams) == 0.0 and all(v >= 0.0 for v in lams)
    assert lams[39] == pytest.approx(0.0, abs=1e-9)


def test_quality_reward_on_the_env_reads_top1_retention():
    from hdamoe_env.env.wrappers import QualityRewardWrapper

    env = QualityRewardWrapper(make(gating_levels=(0.0, 64.0)), target=1.0, weight=10.0)
    env.reset(seed=0)
    action = env.unwrapped.action_space.sample()
    action[:] = 0
    action[:-2] = env.unwrapped.num_experts                     # no broadcast
    action[-1] = len(env.unwrapped.gating_levels) - 1           # strongest gating
    _, r, _, _, info = env.step(action)
    assert r == pytest.approx(info["latency_reward"]
                              - 10.0 * max(0.0, 1.0 - info["top1_retention"]))


def test_quality_reward_rejects_bad_values():
    from hdamoe_env.env.wrappers import QualityRewardWrapper

    with pytest.raises(ConfigError, match="target"):
        QualityRewardWrapper(_ScriptedEnv([1.0]), target=1.5)
    with pytest.raises(ConfigError, match="dual_step"):
        QualityRewardWrapper(_ScriptedEnv([1.0]), lagrangian=True, dual_step=0.0)
    with pytest.raises(ConfigError, match="weight"):
        QualityRewardWrapper(_ScriptedEnv([1.0]), weight=-1.0)


def _replicated(num_layers: int):
    """EP on 4 nodes (expert i on node π_i) plus one whole copy of expert 0 on another node."""
    from hdamoe_env.sim.placement import Placement, expert_parallel

    ep = expert_parallel(num_layers, 4, 4, np.random.default_rng(0))
    reps = np.zeros(ep.P.shape, dtype=bool)
    for layer in range(num_layers):
        reps[layer, 0, int(np.flatnonzero(ep.P[layer, 0] == 0)[0])] = True
    return ep, Placement(ep.P, ep.pi, "ep+rep", replicas=reps)


def test_replica_shares_wrapper_fractions_space_and_physics():
    """Share value v of K = 2 sends v/2 of an expert's tokens to its primary copy: v = 2 keeps
    every token on the primary, so each layer's expert phase (compute, streaming) is exactly
    that of the placement without the replica on the same seed (the DES differs only through
    the aggregator draws over other holder sets); v = 0 moves them all to the replica; other
    experts (no replica) ignore their value. Every sampled action is legal."""
    from hdamoe_env.env.wrappers import ReplicaSharesWrapper

    ep, rep = _replicated(make().num_layers)
    env = ReplicaSharesWrapper(make(placement=rep), levels=2)
    inner = make(placement=rep).action_space.nvec
    assert env.action_space.nvec.tolist() == [*inner.tolist(), 3, 3, 3, 3]
    fr = env.fractions(np.array([1, 2, 0, 2]), 0)
    node = int(np.flatnonzero(rep.replicas[0, 0])[0])
    assert fr[0, 0] == 0.5 and fr[0, 1 + node] == 0.5 and fr[0].sum() == 1.0
    assert fr[1].tolist() == [1.0, 0, 0, 0, 0] and fr[2, 0] == 1.0     # no replica: primary
    plain = make(placement=ep)
    env.reset(seed=4)
    plain.reset(seed=4)
    noop_plain = np.array([plain.num_experts] * plain.max_broadcast + [0, 0])
    all_primary = np.concatenate([noop_plain, [0], [2, 2, 2, 2]])
    for _ in range(plain.num_layers):
        _, _, _, _, a = env.step(all_primary)
        _, _, _, _, b = plain.step(noop_plain)
        assert a["replica_rule"] == "shares"
        assert a["t_comp_us"] == pytest.approx(b["t_comp_us"], rel=1e-12)
        assert a["t_nm_us"] == pytest.approx(b["t_nm_us"], rel=1e-12)
    env.reset(seed=4)
    _, _, _, _, moved = env.step(np.concatenate([noop_plain, [0], [0, 2, 2, 2]]))
    assert np.isfinite(moved["total_us"])
    env.action_space.seed(0)
    env.reset(seed=5)
    for _ in range(12):
        _, _, term, trunc, info = env.step(env.action_space.sample())
        assert info["replica_rule"] == "shares"
        if term or trunc:
            env.reset(seed=6)
    assert env.action_masks().all() or env.action_masks().size == env.action_space.nvec.sum()
    with pytest.raises(ConfigError, match="redundant experts"):
        ReplicaSharesWrapper(make(placement=ep))
    with pytest.raises(ConfigError, match="redundant experts"):
        make(placement=ep).set_replica_fractions(np.zeros((4, 5)))
    with pytest.raises(ConfigError, match="shape"):
        make(placement=rep).set_replica_fractions(np.zeros((4, 4)))


def test_replica_share_fractions_is_the_wrappers_mapping():
    """One mapping (used by the wrapper and by learned agents): v/K on the primary, the rest
    split evenly over the replica nodes, experts without a replica stay on their primary."""
    from hdamoe_env.env.wrappers import ReplicaSharesWrapper, replica_share_fractions

    reps = np.array([[False, True, True, False], [False] * 4, [True, False, False, False]])
    fr = replica_share_fractions(np.array([1, 0, 3]), reps, 4)
    assert fr[0].tolist() == [0.25, 0.0, 0.375, 0.375, 0.0]
    assert fr[1].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]                   # no replica: ignored
    assert fr[2].tolist() == [0.75, 0.25, 0.0, 0.0, 0.0]
    _, rep = _replicated(make().num_layers)
    env = ReplicaSharesWrapper(make(placement=rep), levels=3)
    shares = np.array([2, 3, 0, 1])
    for layer in range(rep.num_layers):
        assert np.array_equal(env.fractions(shares, layer),
                              replica_share_fractions(shares, rep.replicas[layer], 3))
    with pytest.raises(ConfigError, match="levels"):
        replica_share_fractions(shares, rep.replicas[0], 0)
    with pytest.raises(ConfigError, match="one value per expert"):
        replica_share_fractions(shares[:3], rep.replicas[0], 3)


def test_ranked_wrapper_keeps_the_replica_rule_dimension():
    """On a placement with redundant experts the ranked action keeps the env's trailing
    replica-rule dimension, so its space matches its mask and every sampled action steps (it
    raised a broadcast error before)."""
    _, rep = _replicated(make().num_layers)
    base = make(placement=rep)
    env = RankedBroadcastWrapper(base, num_candidates=2)
    assert env.action_space.nvec.tolist() == [3, 3, *base.action_space.nvec[2:].tolist()]
    env.reset(seed=0)
    env.action_space.seed(0)
    assert env.action_masks().size == int(env.action_space.nvec.sum())
    action = env.action_space.sample()
    action[-1] = 1                                                      # the second replica rule
    _, _, _, _, info = env.step(action)
    assert info["replica_rule"] == base.replica_rules[1]


def test_replica_shares_over_the_ranked_wrapper():
    """ReplicaSharesWrapper appends its E share dimensions to an inner wrapper's action space
    and mask, and all-primary shares give the expert phase of the placement without the replica
    (the same physics as on the bare env)."""
    from hdamoe_env.env.wrappers import ReplicaSharesWrapper

    ep, rep = _replicated(make().num_layers)
    ranked = RankedBroadcastWrapper(make(placement=rep), num_candidates=2)
    env = ReplicaSharesWrapper(ranked, levels=2)
    inner = ranked.action_space.nvec.tolist()
    assert env.action_space.nvec.tolist() == [*inner, 3, 3, 3, 3]
    env.reset(seed=4)
    mask = env.action_masks()
    assert mask.size == int(env.action_space.nvec.sum())
    assert np.array_equal(mask[:-12], ranked.action_masks()) and mask[-12:].all()
    plain = make(placement=ep)
    plain.reset(seed=4)
    none_ranked = [2, 2, 0, 0, 0]                            # no broadcast, rule 0, gating off
    noop_plain = np.array([plain.num_experts] * plain.max_broadcast + [0, 0])
    for _ in range(plain.num_layers):
        _, _, _, _, a = env.step(np.array([*none_ranked, 2, 2, 2, 2]))
        _, _, _, _, b = plain.step(noop_plain)
        assert a["replica_rule"] == "shares"
        assert a["t_comp_us"] == pytest.approx(b["t_comp_us"], rel=1e-12)


def test_share_fractions_rule_value_and_nan_rows_follow_least_loaded():
    """rule_value: value 0 = an all-NaN row (the least-loaded rule), v >= 1 = (v - 1)/K on the
    primary; the dispatch of an all-NaN fractions matrix equals the least-loaded rule's."""
    from hdamoe_env.decisions import dispatch as dispatch_mod
    from hdamoe_env.env.wrappers import replica_share_fractions

    reps = np.array([[False, True, False], [False, False, False]])
    fr = replica_share_fractions(np.array([0, 3]), reps, 2, rule_value=True)
    assert np.isnan(fr[0]).all() and fr[1].tolist() == [1.0, 0.0, 0.0, 0.0]   # no replica
    fr = replica_share_fractions(np.array([2, 0]), reps, 2, rule_value=True)
    assert fr[0].tolist() == [0.5, 0.0, 0.5, 0.0]
    assert replica_share_fractions(np.array([2, 0]), reps, 2)[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    P = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    sets = np.array([[0, 1]] * 5 + [[0, 1]] * 3)
    ll = dispatch_mod.dispatch_replicas(sets, P, reps, 1.0, rule="least_loaded")
    nan = dispatch_mod.dispatch_replicas(sets, P, reps, 1.0, rule="shares",
                                         fractions=np.full((2, 4), np.nan))
    np.testing.assert_array_equal(ll.nodes, nan.nodes)
    np.testing.assert_array_equal(ll.extra_compute_s, nan.extra_compute_s)
    with pytest.raises(ConfigError, match="NaN"):
        bad = np.zeros((2, 4))
        bad[0, 1] = np.nan                                   # a partly NaN row is refused
        dispatch_mod.dispatch_replicas(sets, P, reps, 1.0, rule="shares", fractions=bad)


def test_ranked_action_translation():
    from agents.base import ActionLayout
    from hdamoe_env.env.wrappers import ranked_candidates, ranked_mask, ranked_to_full

    lay = ActionLayout(4, 2)
    pred = np.array([0.1, 0.5, 0.0, 0.3])
    full_mask = np.concatenate([[True, True, True, False, True], [True, True, True, True, True],
                                np.ones(3 + 4, dtype=bool)])
    # expert 3 is masked, expert 2 has no predicted load: candidates are 1 then 0
    assert ranked_candidates(pred, full_mask[:4], 3).tolist() == [1, 0]
    rmask = ranked_mask(full_mask, lay, 3, pred)
    assert rmask[:4].tolist() == [True, True, False, True]
    full = ranked_to_full(np.array([0, 3, 2, 1]), lay, 3, pred, full_mask)
    assert full.tolist() == [1, 4, 2, 1]


@pytest.mark.parametrize("num_candidates", [1, 4, 9])
def test_ranked_many_equal_the_per_copy_translation(num_candidates):
    """The batched mask and action translation equal the per-copy functions row by row, with
    tied and zero predicted loads, unbroadcastable experts and slots with nothing allowed."""
    layout = ActionLayout(8, 3, ("least_loaded", "first", "home"), (0.0, 0.5, 1.0, 2.0), ())
    rng = np.random.default_rng(7)
    n = 40
    pred = rng.choice([0.0, 0.125, 0.25, 0.5], size=(n, 8)).astype(np.float32)
    masks = rng.random((n, int(layout.nvec.sum()))) < 0.7
    masks[::5, 9:18] = False                                  # slot 1: nothing allowed
    got = ranked_mask_many(masks, layout, num_candidates, pred)
    want = np.stack([ranked_mask(masks[i], layout, num_candidates, pred[i]) for i in range(n)])
    np.testing.assert_array_equal(got, want)
    ranked_nvec = [num_candidates + 1] * 3 + [3, 4]
    actions = np.stack([rng.integers(0, v, size=n) for v in ranked_nvec], axis=1)
    got = ranked_to_full_many(actions, layout, num_candidates, pred, masks)
    want = np.stack([ranked_to_full(actions[i], layout, num_candidates, pred[i], masks[i])
                     for i in range(n)])
    np.testing.assert_array_equal(got, want)
