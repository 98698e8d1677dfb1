"""Tests of hdamoe_env.env.environment, the Gymnasium environment: API conformance, masks,
invalid actions, determinism, vector envs, pre-broadcast traffic, gating protection, fidelities,
typed constructor errors, and the registered env with no kwargs under the standard RL tooling."""

from __future__ import annotations

import importlib
import warnings

import gymnasium as gym
import numpy as np
import pytest

import hdamoe_env  # registers the ids
from hdamoe_env.config.errors import ConfigError, HdMoeError, InvalidAction
from hdamoe_env.config.specs import HardwareSpec, ModelSpec
from hdamoe_env.env.environment import HdMoeEnv
from hdamoe_env.sim.placement import expert_parallel
from traces import RoutingTrace, save as save_trace

TINY = ModelSpec(key="tiny3", name="tiny3", num_moe_layers=3, num_experts=4, top_k=2,
                 hidden_size=64, expert_intermediate=128, attn_weight_elements=4 * 64 * 64,
                 kv_elements_per_token=2 * 64, core_flops_per_ctx_token=4 * 64)
HW = HardwareSpec(mesh_shape=(2, 2), compute_tflops=1.0, link_bw_gbps=1.0)
E = TINY.num_experts


def make(**kw) -> HdMoeEnv:
    args = dict(model=TINY, hardware=HW, batch=8, steps_per_episode=2, max_broadcast=2,
                k_b=[0, 1, 2], trace_tokens=512, trace_requests=8)
    args.update(kw)
    return HdMoeEnv(**args)


def noop(env: HdMoeEnv, rule: int = 0, level: int = 0) -> np.ndarray:
    return np.array([env.num_experts] * env.max_broadcast + [rule, level])


def valid_action(env: HdMoeEnv, rng: np.random.Generator) -> np.ndarray:
    """Sample every dimension from its mask; drop repeated experts (masks cannot)."""
    mask, out, off = env.action_masks(), [], 0
    for n in env.action_space.nvec:
        out.append(int(rng.choice(np.flatnonzero(mask[off:off + n]))))
        off += n
    seen: set[int] = set()
    for i in range(env.max_broadcast):
        if out[i] in seen:
            out[i] = env.num_experts
        seen.add(out[i])
    return np.array(out)


def rollout(env: HdMoeEnv, seed: int, action_seed: int = 0):
    rng = np.random.default_rng(action_seed)
    obs, info = env.reset(seed=seed)
    trace = [(obs, None, info)]
    done = False
    while not done:
        obs, r, term, trunc, info = env.step(valid_action(env, rng))
        trace.append((obs, r, info))
        done = term or trunc
    return trace


# ------------------------------------------------------------------------------ API conformance
def test_gymnasium_check_env():
    from gymnasium.utils.env_checker import check_env

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(make(invalid_action="coerce"), skip_render_check=True)


def test_sb3_check_env():
    pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.env_checker import check_env

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(make(invalid_action="coerce", flatten_replicas=True), warn=True)
    # the 2-D replicas observation only earns SB3's "unconventional shape" warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(make(invalid_action="coerce"), warn=True)
    assert caught and all("unconventional shape" in str(w.message) for w in caught)


def test_registered_make_and_reimport_does_not_warn():
    env = gym.make("hdamoe_env/HdMoE-v1", model=TINY, hardware=HW, batch=8, trace_tokens=512,
                   trace_requests=8, steps_per_episode=1)
    obs, info = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    env.step(noop(env.unwrapped))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(hdamoe_env)


def test_spaces_and_observation_bounds():
    env = make()
    L, D = TINY.num_moe_layers, HW.num_nodes
    assert env.action_space.nvec.tolist() == [E + 1, E + 1, 3, 4]
    shapes = {k: v.shape for k, v in env.observation_space.spaces.items()}
    assert shapes == {"pred_load": (E,), "node_load": (D,), "link_busy": (env.topology.num_links,),
                      "replicas": (E, D), "layer": (1,), "budget": (1,)}
    for obs, _, _ in rollout(env, seed=3):
        assert env.observation_space.contains(obs)
        assert all(v.dtype == np.float32 for v in obs.values())
    obs, _ = env.reset(seed=0)
    assert obs["layer"][0] == 0 and not obs["pred_load"].any() and not obs["link_busy"].any()
    np.testing.assert_allclose(obs["replicas"], env.placement.P[0])
    obs, *_ = env.step(noop(env))
    assert obs["layer"][0] == pytest.approx(1 / (L - 1))
    assert obs["budget"][0] == pytest.approx(1 / 2) and obs["link_busy"].max() > 0
    # predicted loads: counts ÷ B; node load ÷ TP load sums to D
    assert obs["pred_load"].sum() == pytest.approx(TINY.top_k)
    assert obs["node_load"].sum() == pytest.approx(D, rel=1e-5)


def test_episode_structure_tbt_and_reward_types():
    env = make(steps_per_episode=3)
    obs, info = env.reset(seed=1)
    n, tbts = 0, []
    while True:
        obs, r, term, trunc, info = env.step(noop(env))
        n += 1
        assert isinstance(r, float) and isinstance(term, bool) and isinstance(trunc, bool)
        assert info["decode_step"] == (n - 1) // 3 and info["layer"] == (n - 1) % 3
        if info["layer"] == 2:
            tbts.append(info["tbt_us"])
        else:
            assert "tbt_us" not in info
        if term or trunc:
            break
    assert n == 3 * 3 and term and not trunc
    assert info["episode_tbt_us"] == pytest.approx(np.mean(tbts))
    for key in ("t_nm_us", "t_comp_us", "t_dispatch_us", "t_combine_us", "t_comm_us",
                "t_extra_us", "total_us", "link_busy_us", "broadcast", "k_b",
                "changed_fraction", "top1_retention", "score_mass_kept", "action_mask"):
        assert key in info
    assert info["total_us"] == pytest.approx(info["t_nm_us"] + info["t_comp_us"]
                                             + info["t_comm_us"] + info["t_extra_us"])
    with pytest.raises(ConfigError, match="reset"):
        env.step(noop(env))


def test_tp_placement_reward_is_minus_one():
    env = make(placement="tp")
    env.reset(seed=0)
    for _ in range(3):
        _, r, *_ = env.step(noop(env))
        assert r == pytest.approx(-1.0, rel=1e-9)


def test_tp_tiled_placement_beats_tp_on_padding():
    """Tile-aligned TP: 2 whole 64-column tiles per expert instead of 4 padded 32-column shards,
    the same all-reduce: every layer is faster than TP (reward > −1)."""
    env = make(placement="tp-tiled")
    env.reset(seed=0)
    assert env.placement.method == "tp-tiled" and env.placement.allreduce is not None
    for _ in range(3):
        _, r, *_ = env.step(noop(env))
        assert -1.0 < r < 0.0


def test_truncation_when_the_trace_runs_out():
    env = make(steps_per_episode=500, batch_options={"cycle": False}, batch=8)
    env.reset(seed=0)
    while True:
        _, _, term, trunc, info = env.step(noop(env))
        if term or trunc:
            break
    assert trunc and not term and "truncated_reason" in info and "episode_tbt_us" in info


# ------------------------------------------------------------------------------ determinism
def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def test_same_seed_same_rollout():
    env = make()
    first, second = rollout(env, seed=7), rollout(env, seed=7)
    assert len(first) == len(second)
    for (o1, r1, i1), (o2, r2, i2) in zip(first, second, strict=True):
        assert _equal(o1, o2) and r1 == r2 and _equal(i1, i2)
    other = rollout(make(), seed=8)
    assert any(not _equal(a[0], b[0]) for a, b in zip(first, other, strict=False))


def test_vector_envs():
    fns = [lambda: make(steps_per_episode=1), lambda: make(steps_per_episode=1)]
    for vec_cls in (gym.vector.SyncVectorEnv, gym.vector.AsyncVectorEnv):
        vec = vec_cls(fns)
        try:
            obs, info = vec.reset(seed=[0, 1])
            assert obs["replicas"].shape == (2, E, 4) and info["action_mask"].shape[0] == 2
            acts = np.stack([np.array([E, E, 0, 0])] * 2)
            for _ in range(4):
                obs, rew, term, trunc, info = vec.step(acts)
                assert rew.shape == (2,) and rew.dtype == np.float64
        finally:
            vec.close()


# ------------------------------------------------------------------------------ masks
def test_action_masks():
    env = make()
    _, info = env.reset(seed=0)
    slots = info["action_mask"][:2 * (E + 1)].reshape(2, E + 1)
    assert not slots[:, :E].any() and slots[:, E].all()             # layer 0: no broadcast
    np.testing.assert_array_equal(env.action_masks(), info["action_mask"])
    _, _, _, _, info = env.step(noop(env))
    slots = info["action_mask"][:2 * (E + 1)].reshape(2, E + 1)
    assert slots[0].all() and not slots[1, :E].any()                 # k_b = 1 at layer 1
    env.step(noop(env))
    assert env.action_masks()[:2 * (E + 1)].all()                    # k_b = 2 at layer 2
    assert env.action_masks()[2 * (E + 1):].all()
    tp = make(placement="tp")
    tp.reset(seed=0)
    tp.step(noop(tp))
    assert not tp.action_masks()[:E].any()                           # already on every node


def test_budget_rule_sets_kb():
    env = make(k_b=None, conventions="paper")
    assert env.k_b[0] == 0 and (env.k_b <= env.max_broadcast).all()
    for layer in range(1, 3):
        plan = env.plan(layer)
        assert plan is not None and env.k_b[layer] == min(plan.k_b, 2)


# ------------------------------------------------------------------------------ invalid actions
@pytest.mark.parametrize("action,match", [
    (np.array([E, E, 0]), "shape"),
    (np.array([E, E, 0, 0, 0]), "shape"),
    (np.array([E, E, 3, 0]), r"action\[2\] \(dispatch rule\) = 3 is outside \[0, 2\]"),
    (np.array([E + 1, E, 0, 0]), r"outside \[0, 4\]"),
    (np.array([-1, E, 0, 0]), "outside"),
    (np.array([E, E, 0, 1.5]), "integers"),
    (np.array([0, E, 0, 0]), r"action\[0\] \(broadcast slot 0\) = 0 is masked: layer 0"),
])
def test_invalid_actions_at_layer0(action, match):
    env = make(invalid_action="raise")
    env.reset(seed=0)
    with pytest.raises(InvalidAction, match=match):
        env.step(action)
    env.step(noop(env))                                              # the env is still usable


def test_invalid_actions_later_layers():
    env = make(invalid_action="raise")
    env.reset(seed=0)
    env.step(noop(env))
    with pytest.raises(InvalidAction, match=r"slot 1\) = 2 is masked: only 1 pre-broadcast"):
        env.step(np.array([0, 2, 0, 0]))
    env.step(np.array([1, E, 0, 0]))
    with pytest.raises(InvalidAction, match="repeats expert 3"):
        env.step(np.array([3, 3, 0, 0]))
    env.step(np.array([3, 1, 0, 0]))                                 # layer 2: k_b = 2
    # integral floats are accepted (some wrappers cast)
    env.reset(seed=0)
    env.step(np.array([E, E, 0, 0], dtype=np.float32))


def test_coerce_and_ignore_modes():
    env = make(invalid_action="raise", duplicates="ignore")
    env.reset(seed=0)
    env.step(noop(env))
    env.step(noop(env))
    _, _, _, _, info = env.step(np.array([3, 3, 0, 0]))
    assert info["broadcast"] == (3,)
    env = make(invalid_action="coerce")
    env.reset(seed=0)
    _, _, _, _, info = env.step(np.array([1, 2, 0, 0]))              # layer 0: masked → none
    assert info["broadcast"] == ()
    assert info["coerced"] == ((0, 1, "masked"), (1, 2, "masked"))


@pytest.mark.parametrize("action,match", [
    (np.array([E, E, 0]), "shape"),
    (np.array([E + 1, E, 0, 0]), "outside"),
    (np.array([E, E, 0, 4]), "outside"),
    (np.array([E, E, 0, 1.5]), "integers"),
])
def test_default_coerces_in_space_but_rejects_out_of_space(action, match):
    env = make()                                          # default: invalid_action="coerce"
    assert env.invalid_action == "coerce"
    env.reset(seed=0)
    with pytest.raises(InvalidAction, match=match):
        env.step(action)


def test_default_env_accepts_every_element_of_the_action_space():
    env = make()
    rng = np.random.default_rng(0)
    env.action_space.seed(0)
    env.reset(seed=0)
    kinds = set()
    for _ in range(60):
        a = env.action_space.sample()
        mask_parts = env.action_mask_tuple()
        legal = [int(v) for i, v in enumerate(a[:env.max_broadcast])
                 if v != E and mask_parts[i][v]]
        _, _, term, trunc, info = env.step(a)
        expect_bc = list(dict.fromkeys(legal))                        # first occurrence wins
        assert list(info["broadcast"]) == expect_bc
        for slot, value, why in info["coerced"]:
            assert a[slot] == value and why in ("masked", "duplicate")
            kinds.add(why)
        n_changed = sum(1 for v in a[:env.max_broadcast] if v != E) - len(expect_bc)
        assert len(info["coerced"]) == n_changed
        if term or trunc:
            env.reset(seed=int(rng.integers(100)))
    assert kinds == {"masked", "duplicate"}
    # a legal action reports nothing
    env.reset(seed=0)
    _, _, _, _, info = env.step(noop(env))
    assert info["coerced"] == ()


def test_duplicates_coerced_by_default():
    env = make()
    env.reset(seed=0)
    env.step(noop(env))
    env.step(noop(env))                                              # layer 2: k_b = 2
    _, _, _, _, info = env.step(np.array([3, 3, 0, 0]))
    assert info["broadcast"] == (3,) and info["coerced"] == ((1, 3, "duplicate"),)


def test_action_mask_tuple_matches_flat_mask_and_samples_legal_slots():
    env = make()
    env.reset(seed=0)
    env.step(noop(env))                                              # layer 1: k_b = 1
    parts = env.action_mask_tuple()
    assert [p.size for p in parts] == env.action_space.nvec.tolist()
    assert all(p.dtype == np.int8 for p in parts)
    np.testing.assert_array_equal(np.concatenate(parts).astype(bool), env.action_masks())
    assert parts[1].tolist() == [0] * E + [1]                        # slot 1 >= k_b: none only
    env.action_space.seed(1)
    for _ in range(20):
        a = env.action_space.sample(mask=parts)
        assert a[1] == E and bool(parts[0][a[0]])


def test_action_masks_reachable_through_gym_make_wrappers():
    env = gym.make("hdamoe_env/HdMoE-v1", model=TINY, hardware=HW, batch=8, trace_tokens=512,
                   trace_requests=8, steps_per_episode=1, max_broadcast=2, k_b=[0, 1, 2])
    env.reset(seed=0)
    expect = env.unwrapped.action_masks()
    np.testing.assert_array_equal(env.get_wrapper_attr("action_masks")(), expect)
    pytest.importorskip("sb3_contrib")
    from sb3_contrib.common.maskable.utils import get_action_masks, is_masking_supported
    from sb3_contrib.common.wrappers import ActionMasker

    assert is_masking_supported(env)
    np.testing.assert_array_equal(get_action_masks(env), expect)
    masked = ActionMasker(env, lambda e: e.get_wrapper_attr("action_masks")())
    np.testing.assert_array_equal(get_action_masks(masked), expect)


# ------------------------------------------------------------------------------ mechanics
def test_prebroadcast_traffic_visible_in_link_busy():
    env = make(k_b=[0, 2, 2])
    env.reset(seed=0)
    env.step(noop(env))
    _, _, _, _, base = env.step(noop(env))
    env.reset(seed=0)
    env.step(noop(env))
    obs, _, _, _, info = env.step(np.array([0, 3, 0, 0]))
    assert info["broadcast"] == (0, 3) and info["bc_makespan_us"] > 0
    bc = info["bc_link_busy_us"]
    np.testing.assert_allclose(info["link_busy_us"] - bc, env.last_layer.link_busy_s * 1e6)
    # each broadcast expert crosses the 3 edges of a spanning tree of the 2×2 mesh once, in
    # chunks that also occupy the link for the start-up α
    alpha = env.conv.broadcast_alpha_s
    per_edge = env.decisions.bc_payload + info["bc_chunks"] * alpha * HW.link_bw_Bps
    assert bc.sum() == pytest.approx(2 * 3 * per_edge / HW.link_bw_Bps * 1e6)
    assert np.count_nonzero(bc) >= 3
    assert info["link_busy_us"].sum() > base["link_busy_us"].sum()
    assert info["t_extra_us"] == pytest.approx(max(0.0, info["bc_makespan_us"]
                                                   - info["bc_budget_us"]))
    assert obs["link_busy"].max() > 0


def test_prebroadcast_changes_placement_and_dispatch(rng):
    env = make(k_b=[0, 2, 2], conventions="paper")
    env.reset(seed=0)
    env.step(noop(env))
    _, _, _, _, info = env.step(np.array([0, E, 1, 0]))
    assert info["dispatch_rule"] == "first" and info["t_extra_us"] == 0.0  # paper: hidden
    assert info["bc_makespan_us"] > 0


def test_gating_protect_top_keeps_top1():
    # the fluid penalty (paper) charges every token: under faithful's tile model a B = 8 step
    # of this EP placement fits one token tile per expert, all nodes cost the same and the
    # penalty never changes a choice (docs/PHYSICS.md §4.1a)
    strong = (-1e9, -10.0)
    free = make(gating_coefficients=strong, conventions="paper")
    prot = make(gating_coefficients=strong, gating_protect_top=1, conventions="paper")
    top1 = {}
    for name, env in (("free", free), ("protected", prot)):
        env.reset(seed=0)
        vals = []
        for _ in range(3):
            _, _, _, _, info = env.step(noop(env, level=3))
            vals.append(info["top1_retention"])
            assert info["gating_level"] == 2.0
        top1[name] = vals
    assert all(v == 1.0 for v in top1["protected"])
    assert min(top1["free"]) < 1.0


def test_gating_level_zero_is_plain_topk():
    env = make()
    env.reset(seed=0)
    _, _, _, _, info = env.step(noop(env, level=0))
    assert (info["changed_fraction"], info["top1_retention"], info["score_mass_kept"]) == \
        (0.0, 1.0, 1.0)


def test_analytic_fidelity_and_twin_error():
    env = make(fidelity="analytic", measure_twin_error=True)
    env.reset(seed=0)
    for _ in range(3):
        _, r, _, _, info = env.step(noop(env))
        assert info["mode"] == "analytic" and np.isfinite(r)
        assert np.isfinite(info["twin_error"]) and abs(info["twin_error"]) < 1.0
    des = make(measure_twin_error=True, gammas=[0.5, 0.5, 0.5])
    des.reset(seed=0)
    _, _, _, _, info = des.step(noop(des))
    assert info["mode"] == "des" and "twin_total_us" in info


@pytest.mark.parametrize("predictor", ["oracle", "frequency", "trace", "noisy_oracle"])
def test_predictors(predictor):
    env = make(predictor=predictor)
    env.reset(seed=0)
    obs, *_ = env.step(noop(env))
    assert obs["pred_load"].sum() == pytest.approx(TINY.top_k, rel=1e-5)
    if predictor == "oracle":
        actual = np.bincount(env._sets[1].ravel(), minlength=E) / env.batch
        np.testing.assert_allclose(obs["pred_load"], actual, rtol=1e-6)


def test_trace_and_placement_inputs(tmp_path):
    base = make()
    trace = base.trace
    bare = RoutingTrace(topk_ids=trace.topk_ids, req_id=trace.req_id, pos=trace.pos,
                        phase=trace.phase, keep=trace.keep, meta={"E": E})
    env = make(trace=bare)
    env.reset(seed=0)
    _, _, _, _, info = env.step(noop(env, level=2))                  # scores synthesised
    assert env.score_kind == "synthetic" and 0 <= info["changed_fraction"] <= 1
    path = save_trace(trace, tmp_path / "t.npz")
    pl = expert_parallel(3, E, 4, np.random.default_rng(9))
    ppath = pl.save(tmp_path / "p.npz")
    env = make(trace=path, placement=ppath)
    np.testing.assert_array_equal(env.placement.P, pl.P)
    env.reset(seed=0)
    env.step(noop(env))
    with pytest.raises(ConfigError):
        make(placement="nope")
    with pytest.raises(ConfigError, match="fidelity"):
        make(fidelity="exact")
    with pytest.raises(ConfigError, match="pred_ids"):
        make(trace=bare, predictor="trace")


def test_render_ansi():
    env = make(render_mode="ansi")
    env.reset(seed=0)
    env.step(noop(env))
    text = env.render()
    assert isinstance(text, str) and "layer 0" in text


def test_deepseek_smoke():
    """The default configuration (DeepSeek-V2-Lite, 4×8 mesh, B = 128) in both fidelities."""
    for fidelity in ("des", "analytic"):
        env = HdMoeEnv(fidelity=fidelity, steps_per_episode=1, gammas=[0.3] * 26)
        obs, info = env.reset(seed=0)
        assert obs["replicas"].shape == (64, 32) and obs["link_busy"].shape == (104,)
        rewards = []
        for _ in range(4):
            obs, r, *_ , info = env.step(noop(env))
            rewards.append(r)
        assert all(-10 < r < 0 for r in rewards) and info["mode"] == fidelity
        assert env.k_b.tolist() == [0] * 26           # faithful budget < T_bc*(1) at B = 128


@pytest.mark.parametrize("env_id", sorted(hdamoe_env.REGISTERED_ENVS))
def test_registered_variants(env_id):
    kwargs, max_steps = hdamoe_env.REGISTERED_ENVS[env_id]
    spec = gym.spec(env_id)
    assert spec.entry_point == "hdamoe_env.env.environment:HdMoeEnv"
    assert spec.max_episode_steps == max_steps
    env = gym.make(env_id, batch=8, trace_tokens=512, trace_requests=8)
    base = env.unwrapped
    for key, value in kwargs.items():
        assert getattr(base.config, key) == value if key != "model" else base.model.key == value
    if max_steps is not None:                 # the TimeLimit equals the env's own episode end
        assert max_steps == base.steps_per_episode * base.num_layers
    env.reset(seed=0)
    n, done = 0, False
    while not done:
        _, _, term, trunc, _ = env.step(noop(base))
        n += 1
        done = term or trunc
    assert term and n == base.steps_per_episode * base.num_layers


def test_prebroadcast_with_zero_alpha_uses_finite_chunks():
    """α = 0 (e.g. ``faithful+msg_alpha_s=0.0``) makes c* = 0; the DES then pipelines 256 chunks."""
    env = make(k_b=[0, 2, 2], conventions="faithful+msg_alpha_s=0.0")
    assert env.conv.broadcast_alpha_s == 0.0
    env.reset(seed=0)
    env.step(noop(env))
    _, _, _, _, info = env.step(np.array([0, 3, 0, 0]))
    assert info["bc_makespan_us"] > 0 and info["bc_chunks"] == 256


# ------------------------------------------------------------------------------ redundant experts
def _replicated_ep():
    from hdamoe_env.sim.placement import Placement

    ep = expert_parallel(TINY.num_moe_layers, E, 4, np.random.default_rng(0))
    reps = np.zeros(ep.P.shape, dtype=bool)
    for layer in range(TINY.num_moe_layers):          # expert 0 gets a copy on a node without it
        reps[layer, 0, int(np.flatnonzero(ep.P[layer, 0] == 0)[0])] = True
    return Placement(ep.P, ep.pi, "ep+rep", replicas=reps)


def test_no_replicas_keeps_the_action_space():
    env = make()
    assert env.replica_rules == () and env.action_space.nvec.tolist() == [E + 1, E + 1, 3, 4]
    from hdamoe_env.env.actions import ActionLayout

    assert ActionLayout.from_env(env).size == 4


def test_replicated_env_steps_with_every_rule_and_every_sampled_action():
    """With replicas the action gains one last dimension over the replica rules (default
    least_loaded first); every rule steps, every sampled action is legal, and the observation
    shows the replica as a held copy (1.0)."""
    from hdamoe_env.env.actions import ActionLayout

    pl = _replicated_ep()
    env = make(placement=pl, replica_rule="round_robin")
    assert env.replica_rules == ("round_robin", "least_loaded", "nearest")
    assert env.action_space.nvec.tolist() == [E + 1, E + 1, 3, 4, 3]
    lay = ActionLayout.from_env(env)
    assert lay.replica_slot == 4 and lay.encode(replica_rule="nearest")[-1] == 2
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    np.testing.assert_array_equal(obs["replicas"], (pl.P[0] + pl.replicas[0]).astype(np.float32))
    for rule in env.replica_rules:
        a = lay.encode(replica_rule=rule)
        _, _, term, _, info = env.step(a)
        assert info["replica_rule"] == rule and np.isfinite(info["total_us"])
    env.action_space.seed(1)
    env.reset(seed=1)
    for _ in range(30):
        _, _, term, trunc, info = env.step(env.action_space.sample())
        assert info["replica_rule"] in env.replica_rules
        if term or trunc:
            env.reset(seed=2)
    with pytest.raises(InvalidAction, match="replica rule"):
        env.step(np.array([E, E, 0, 0]))
    with pytest.raises(ConfigError, match="shares"):
        make(placement=pl, replica_rules=("shares",))


def test_replace_placement_between_decode_steps_charges_the_next_layer():
    """A swap between decode steps takes effect at the next step and charges it exactly once:
    the next layer's total grows by the charge (1 ms) relative to the same step without it."""
    pl = _replicated_ep()
    lay_env = make(placement=pl)
    from hdamoe_env.env.actions import ActionLayout

    a = ActionLayout.from_env(lay_env).encode()
    ref = make(placement=pl)
    ref.reset(seed=3)
    lay_env.reset(seed=3)
    obs = lay_env.replace_placement(pl, charge_s=1e-3)
    assert lay_env.observation_space.contains(obs)
    _, _, _, _, with_charge = lay_env.step(a)
    _, _, _, _, plain = ref.step(a)
    assert with_charge["rebalance_us"] == pytest.approx(1e3)
    assert with_charge["total_us"] - plain["total_us"] == pytest.approx(1e3)
    assert with_charge["t_extra_us"] - plain["t_extra_us"] == pytest.approx(1e3)
    _, _, _, _, after = lay_env.step(a)                   # charged once only
    assert "rebalance_us" not in after
    with pytest.raises(ConfigError, match="between decode steps"):
        lay_env.replace_placement(pl)                      # layer 2 of the decode step
    with pytest.raises(ConfigError, match="redundant experts"):
        make(placement="ep").replace_placement(pl)
    with pytest.raises(ConfigError, match="charge_s"):
        make(placement=pl).replace_placement(pl, charge_s=-1.0)


@pytest.mark.parametrize("kwargs", [
    {"view": "foo"}, {"trace_seed": -1}, {"placement_seed": "x"}, {"k_b": 100},
    {"trace_requests": 0}, {"trace_tokens": 0}, {"batch": True},
])
def test_env_arguments_are_typed(kwargs):
    """Bad constructor arguments are typed errors (not raw errors, silent clipping or fallbacks)."""
    from hdamoe_env.env.environment import HdMoeEnv

    with pytest.raises(HdMoeError):
        HdMoeEnv(model="mixtral-8x7b", mesh="2x2", steps_per_episode=1, **kwargs)


# ------------------------------------------- the registered env with no kwargs and RL tooling
ENV_ID = "hdamoe_env/HdMoE-v1"


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


# ------------------------------------------------------------------------------ episode state
def _continue(env: HdMoeEnv, rng: np.random.Generator, episodes: int = 2) -> list:
    """Step to the end of the episode, then ``episodes - 1`` whole episodes more."""
    out, done = [], False
    for _ in range(episodes):
        while not done:
            obs, r, term, trunc, info = env.step(valid_action(env, rng))
            out.append((obs, r, info))
            done = term or trunc
        obs, info = env.reset()
        out.append((obs, None, info))
        done = False
    return out


def test_get_state_set_state_continues_the_episode_bit_for_bit(tmp_path):
    import io
    import json

    kw = dict(steps_per_episode=3, predictor="noisy_oracle", gating_levels=(0, 1))
    env = make(**kw)
    env.reset(seed=5)
    act_rng = np.random.default_rng(1)
    for _ in range(4):                                   # mid-episode: decode step 1, layer 1
        env.step(valid_action(env, act_rng))
    meta, arrays = env.get_state()
    buf = io.BytesIO()                                    # through the file formats: JSON, npz
    np.savez(buf, **arrays)
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as data:
        arrays2 = {k: data[k] for k in data.files}
    meta2 = json.loads(json.dumps(meta))
    other = make(**kw)
    other.reset(seed=99)                                  # another episode, overwritten
    other.set_state(meta2, arrays2)
    rng_a, rng_b = np.random.default_rng(2), np.random.default_rng(2)
    first, second = _continue(env, rng_a), _continue(other, rng_b)
    assert len(first) == len(second) > 4
    for (o1, r1, i1), (o2, r2, i2) in zip(first, second, strict=True):
        assert _equal(o1, o2) and r1 == r2 and _equal(i1, i2)


def test_set_state_refuses_another_configuration_and_damage():
    env = make()
    env.reset(seed=0)
    meta, arrays = env.get_state()
    with pytest.raises(ConfigError, match="configuration"):
        make(batch=4).set_state(meta, arrays)
    with pytest.raises(ConfigError, match="not an env state"):
        make().set_state({"format": "x"}, arrays)
    with pytest.raises(ConfigError, match="obs_node"):
        make().set_state(meta, {k: v for k, v in arrays.items() if k != "obs_node"})
    with pytest.raises(ConfigError, match="damaged"):
        make().set_state({**meta, "np_random": {"bit_generator": "PCG64"}}, arrays)


# ------------------------------------------------------------------------------ energy rewards
@pytest.mark.parametrize("reward", ["energy", "edp"])
def test_energy_rewards_pass_check_env_and_report_the_breakdown(reward):
    from gymnasium.utils.env_checker import check_env

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(gym.make(ENV_ID, reward=reward).unwrapped, skip_render_check=True)
    env = make(reward=reward)
    lat = make()
    env.reset(seed=3)
    lat.reset(seed=3)
    done = False
    while not done:
        a = noop(env)
        _, r, term, trunc, info = env.step(a)
        _, r_lat, _, _, info_lat = lat.step(a)
        e = info["energy_j"]
        assert set(e) == {"dram", "noc", "compute", "static", "total"}
        assert all(v >= 0 for v in e.values()) and e["total"] == pytest.approx(
            e["dram"] + e["noc"] + e["compute"] + e["static"])
        assert e == info_lat["energy_j"]                  # reported whatever the reward
        assert info["total_us"] == info_lat["total_us"]   # energy changes no latency
        assert r_lat == pytest.approx(-info["total_us"] / info["tp_total_us"], rel=1e-12)
        # static energy: every node over the layer's time (docs/PHYSICS.md §18)
        assert e["static"] == pytest.approx(
            env._energy.spec.static_w_per_node * env.num_nodes * info["total_us"] * 1e-6)
        tp_e = float(env._tp_energy[info["layer"]])
        assert tp_e > 0
        if reward == "energy":
            assert r == pytest.approx(-e["total"] / tp_e, rel=1e-12)
        else:
            assert r == pytest.approx(-(e["total"] * info["total_us"])
                                      / (tp_e * info["tp_total_us"]), rel=1e-12)
        if "tbt_us" in info:
            assert info["j_per_token"] == pytest.approx(info["step_energy_j"]["total"] / 8)
        done = term or trunc


def test_tp_energy_reward_is_minus_one():
    env = make(placement="tp", reward="energy")
    env.reset(seed=0)
    for _ in range(env.num_layers):
        _, r, *_ = env.step(noop(env))
        assert r == pytest.approx(-1.0, rel=1e-9)


def test_reward_argument_is_checked():
    with pytest.raises(ConfigError, match="reward"):
        make(reward="power")
    with pytest.raises(ConfigError, match="reward_scale"):
        make(reward="energy", reward_scale=1e-3)


def test_rebalance_moves_are_charged_to_noc_energy():
    env = make()
    env.reset(seed=0)
    with pytest.raises(ConfigError, match="charge_link_busy_s"):
        env.replace_placement(env.placement, charge_link_busy_s=np.ones(3))
    busy = np.full(env.topology.num_links, 1e-6)
    env.replace_placement(env.placement, charge_s=2e-6, charge_link_busy_s=busy)
    twin = make()
    twin.reset(seed=0)
    a = noop(env)
    _, _, _, _, info = env.step(a)
    _, _, _, _, plain = twin.step(a)
    extra = float(busy @ env.topology.link_bw_Bps) * 8 * env._energy.spec.noc_pj_per_bit_hop \
        * 1e-12
    assert info["energy_j"]["noc"] == pytest.approx(plain["energy_j"]["noc"] + extra)
    assert info["energy_j"]["static"] == pytest.approx(
        plain["energy_j"]["static"] + 2e-6 * env.num_nodes * env._energy.spec.static_w_per_node)


def _ppo_on_energy(env, steps: int) -> None:
    pytest.importorskip("stable_baselines3")
    from stable_baselines3 import PPO

    model = PPO("MultiInputPolicy", env, n_steps=32, batch_size=32, n_epochs=1, seed=0,
                device="cpu").learn(steps)
    assert model.num_timesteps == steps
    obs, _ = env.reset(seed=1)
    action, _ = model.predict(obs, deterministic=True)
    _, r, *_ = env.step(action)
    assert np.isfinite(r) and r < 0


def test_ppo_trains_on_the_energy_reward():
    _ppo_on_energy(make(reward="energy"), 64)


@pytest.mark.slow
def test_ppo_trains_a_few_hundred_steps_on_the_energy_reward():
    _ppo_on_energy(make(reward="energy"), 320)
    _ppo_on_energy(gym.make(ENV_ID, reward="energy"), 320)
