"""The placement env ``HdMoePlaceEnv`` (``hdamoe_env/HdMoE-Place-v1``, issue 31, item 2).

Pins: both check_envs, legality of every action of the space (coercion, strict mode, out of
space), same seed ⇒ same trajectory, the placement built from a hand-written action sequence
and its reward against the simulator's own static evaluator, spread-everything = tile-aligned
TP, the shaping potential leaves the return unchanged, and a tiny MaskablePPO run.
"""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest

import hdamoe_env
from hdamoe_env.config.errors import ConfigError, InvalidAction
from hdamoe_env.config.specs import ModelSpec
from hdamoe_env.env.place import (HdMoePlaceEnv, greedy_balance, heldout_layers, random_search,
                                  region_blocks)
from hdamoe_env.sim.placement import (Placement, check_memory, identity_mapping,
                                      tensor_parallel_tiled)

# E = 8, k = 2; I = 256 at 64-column tiles: U = 4 tiles per expert
MODEL = ModelSpec(key="tiny-place", name="tiny-place", num_moe_layers=4, num_experts=8, top_k=2,
                  hidden_size=64, expert_intermediate=256, attn_weight_elements=4 * 64 * 64,
                  kv_elements_per_token=2 * 64, core_flops_per_ctx_token=4 * 64)
KW = dict(model=MODEL, mesh="2x2", setting="1/1", batch=8, trace_requests=4, trace_tokens=256)


def make(**kwargs) -> HdMoePlaceEnv:
    return HdMoePlaceEnv(**{**KW, **kwargs})


def rollout(env: HdMoePlaceEnv, actions) -> tuple[list, list]:
    obs, info = env.reset(seed=3, options={"layer": 1})
    seen, rewards = [obs], []
    for a in actions:
        obs, r, term, trunc, info = env.step(a)
        seen.append(obs)
        rewards.append(r)
    assert term and not trunc
    return seen, rewards


def test_spaces_and_patterns():
    env = make()
    assert env.units == 4 and env.num_nodes == 4
    assert env.action_patterns == ("node 0", "node 1", "node 2", "node 3", "region 2/0",
                                   "region 2/1", "spread")
    assert env.action_space.n == 7
    assert region_blocks((4, 8), 2) == (1, 2) and region_blocks((4, 8), 8) == (2, 4)
    assert region_blocks((4, 8), 4) == (2, 2) and region_blocks((3, 3), 2) is None
    assert heldout_layers(26) == (3, 7, 11, 15, 19, 23)


def test_gymnasium_check_env():
    from gymnasium.utils.env_checker import check_env

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(make(), skip_render_check=True)
        check_env(make(rho_mem=1.0, evaluator="static"), skip_render_check=True)


def test_sb3_check_env():
    pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.env_checker import check_env

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(make(rho_mem=1.0), warn=True)


def test_registered_id_makes_the_env():
    assert "hdamoe_env/HdMoE-Place-v1" in hdamoe_env.PLACE_ENVS
    env = gym.make("hdamoe_env/HdMoE-Place-v1", **KW)
    assert isinstance(env.unwrapped, HdMoePlaceEnv)
    env.reset(seed=0)
    env.close()


def test_hand_specified_placement_and_reward_match_the_static_evaluator():
    env = make(evaluator="static", split="all")
    # sorted positions 0..7: node 0, node 1, node 2, node 3, region 2/0, region 2/1, spread,
    # and the last expert whole on node 0
    actions = [0, 1, 2, 3, 4, 5, 6, 0]
    _, rewards = rollout(env, actions)
    order = env.expert_order
    expected = np.zeros((8, 4))
    expected[order[0]] = [1, 0, 0, 0]
    expected[order[1]] = [0, 1, 0, 0]
    expected[order[2]] = [0, 0, 1, 0]
    expected[order[3]] = [0, 0, 0, 1]
    expected[order[4]] = [0.5, 0.5, 0, 0]
    expected[order[5]] = [0, 0, 0.5, 0.5]
    expected[order[6]] = [0.25, 0.25, 0.25, 0.25]   # all clusters hold 6 tiles: one each
    expected[order[7]] = [1, 0, 0, 0]
    P, allreduce = env.placement_layer()
    np.testing.assert_array_equal(P, expected)
    assert not allreduce
    assert rewards[:-1] == [0.0] * 7

    # the reward from the simulator's own static evaluator, streams as documented
    trace = env.traces[0]
    rows = trace.view("content")
    f = trace.layer_frequencies(1, rows)
    g, fg = trace.groups(1, rows)
    agg_seed = np.random.SeedSequence([0, 0, 1]).spawn(3)[2]
    L = MODEL.num_moe_layers

    def latency(P_layer):
        P_all = np.full((L, 8, 4), 0.25)
        P_all[1] = P_layer
        res = env.sim.layer_static(Placement(P=P_all, pi=identity_mapping(L, 4)), 1, f,
                                   np.asarray(g, dtype=np.int64), fg, 8,
                                   rng=np.random.default_rng(agg_seed))
        assert res.mode == ("tp" if np.allclose(P_layer, 0.25) else "des")
        return res.t_comp_s + res.t_comm_moe_s

    ratio = latency(expected) / latency(np.full((8, 4), 0.25))
    assert rewards[-1] == pytest.approx(-ratio, rel=1e-12)
    assert env.evaluate_placement(expected)["reward"] == pytest.approx(rewards[-1], rel=1e-12)


def test_region_extra_tiles_and_water_filling():
    env = make(split="all")
    env.reset(seed=0, options={"layer": 0})
    order = env.expert_order
    env.step(0)                      # first expert whole on node 0: tiles [4, 0, 0, 0]
    env.step(6)                      # spread: one tile each to 1, 2, 3, then node 1 again
    P, _ = env.placement_layer()
    np.testing.assert_array_equal(P[order[1]], [0, 0.5, 0.25, 0.25])


def test_spread_everything_is_tile_aligned_tp():
    # D = 8 > U = 4: a spread layer is tensor_parallel_tiled (rows in visiting order)
    env = make(mesh="2x4", evaluator="static")
    assert "region 8/0" not in env.action_patterns        # more clusters than tiles
    env.reset(seed=0)
    for _ in range(8):
        *_, term, _, info = env.step(env.spread_action)
    assert term
    P, allreduce = env.placement_layer()
    ref = tensor_parallel_tiled(1, 8, 8, 0.25).P[0]
    order = env.expert_order
    np.testing.assert_array_equal(P[order], ref)
    assert allreduce and info["mode"] == "tp"


def test_every_action_is_legal_and_masks_hold_the_cap():
    env = make(rho_mem=1.0, split="all")    # cap: 8 tiles = 2 experts per cluster
    assert env.cap_tiles == 8
    rng = np.random.default_rng(0)
    for episode in range(6):
        env.reset(seed=episode)
        term = False
        while not term:
            a = int(rng.integers(env.action_space.n))      # masked or not
            mask = env.action_masks()
            _, _, term, _, info = env.step(a)
            assert info["coerced"] == (not mask[a])
            assert info["action"] == (a if mask[a] else env.spread_action)
        P, _ = env.placement_layer()
        L = MODEL.num_moe_layers
        P_all = np.full((L, 8, 4), 0.25)
        P_all[env.layer] = P
        check_memory(Placement(P=P_all, pi=identity_mapping(L, 4)), MODEL, env.sim.hw,
                     env.sim.conv, rho_mem=1.0)
        assert np.isfinite(info["ratio"]) and info["ratio"] > 0


def test_masked_action_is_coerced_or_raises_in_strict_mode():
    env = make(rho_mem=1.0)
    env.reset(seed=0)
    env.step(0)
    env.step(0)                                   # node 0 full (8 tiles)
    mask = env.action_masks()
    assert not mask[0] and not mask[4] and mask[1] and mask[env.spread_action]
    assert np.array_equal(env.step(0)[4]["action_mask"], env.action_masks())
    strict = make(rho_mem=1.0, strict=True)
    strict.reset(seed=0)
    strict.step(0)
    strict.step(0)
    with pytest.raises(InvalidAction, match="memory cap"):
        strict.step(0)
    for bad in (-1, 7, 2.5, "x"):
        with pytest.raises(InvalidAction):
            env.step(bad)


def test_bad_arguments_raise_config_errors():
    with pytest.raises(ConfigError, match="evaluator"):
        make(evaluator="fast")
    with pytest.raises(ConfigError, match="split"):
        make(split="test")
    with pytest.raises(ConfigError, match="cannot hold"):
        make(rho_mem=0.5)
    with pytest.raises(InvalidAction):
        make().step(0)                            # before reset


def test_terminal_info_carries_the_training_callback_keys():
    env = make(evaluator="static")
    env.reset(seed=0)
    for _ in range(7):
        *_, info = env.step(env.spread_action)
        assert "total_us" not in info
    *_, term, _, info = env.step(env.spread_action)
    assert term and info["total_us"] == info["latency_us"]
    assert info["total_us"] / info["tp_total_us"] == pytest.approx(info["ratio"])


def test_same_seed_same_trajectory():
    def run(seed):
        env = make(rho_mem=1.5)
        obs, _ = env.reset(seed=seed)
        rng = np.random.default_rng(seed)
        out = [obs]
        term = False
        while not term:
            a = rng.choice(np.flatnonzero(env.action_masks()))
            obs, r, term, _, info = env.step(a)
            out.append((obs, r, info["layer"]))
        return out

    a, b, c = run(5), run(5), run(6)
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x[1] == y[1] and x[2] == y[2]
        for key in x[0]:
            np.testing.assert_array_equal(x[0][key], y[0][key])
    assert [x[1] for x in a[1:]] != [x[1] for x in c[1:]] or a[-1][2] != c[-1][2]


def test_splits_are_disjoint_and_episodes_stay_in_their_split():
    train, held = make(split="train"), make(split="heldout")
    assert set(train.layers).isdisjoint(held.layers)
    assert set(train.layers) | set(held.layers) == set(range(4)) and held.layers == (3,)
    seen = {held.reset(seed=s)[1]["layer"] for s in range(5)}
    assert seen == {3}
    assert {train.reset(seed=s)[1]["layer"] for s in range(20)} == {0, 1, 2}


def test_shaping_moves_credit_but_keeps_the_return():
    actions = [0, 0, 1, 2, 3, 6, 6, 4]
    _, plain = rollout(make(), actions)
    _, shaped = rollout(make(shaping_weight=0.1), actions)
    assert any(r != 0.0 for r in shaped[:-1])
    assert sum(shaped) == pytest.approx(sum(plain), rel=1e-12)


def test_tiny_maskable_ppo_run():
    pytest.importorskip("sb3_contrib")
    import torch
    from sb3_contrib import MaskablePPO

    torch.set_num_threads(1)
    env = make(rho_mem=1.5)
    model = MaskablePPO("MultiInputPolicy", env, n_steps=32, batch_size=32, n_epochs=1, seed=0,
                        device="cpu")
    model.learn(total_timesteps=128)
    obs, _ = env.reset(seed=1)
    term = False
    while not term:
        action, _ = model.predict(obs, action_masks=env.action_masks(), deterministic=True)
        obs, _, term, _, info = env.step(action)
        assert not info["coerced"]
    assert info["ratio"] > 0


def test_random_search_keeps_the_best_episode_and_replays():
    env = make(evaluator="static")
    res = random_search(env, 6, np.random.default_rng(0), layer=2)
    assert res.ratios.shape == (6,) and res.best_ratio == res.ratios.min()
    assert len(res.best_actions) == 8
    env.reset(seed=0, options={"layer": 2})
    for a in res.best_actions:
        *_, info = env.step(a)
    assert info["ratio"] == res.best_ratio
    np.testing.assert_array_equal(env.placement_layer()[0], res.best_placement[0])
    again = random_search(env, 6, np.random.default_rng(0), layer=2)
    np.testing.assert_array_equal(again.ratios, res.ratios)
    with pytest.raises(ConfigError):
        random_search(env, 0, np.random.default_rng(0))


def test_greedy_balance_is_lpt_over_one_pattern_size():
    env = make(evaluator="static")
    res = greedy_balance(env, 1, layer=0)
    f = env.expert_frequencies
    load = np.zeros(4)
    expected = np.zeros((8, 4))
    for expert in env.expert_order:                 # longest processing time first
        node = int(np.argmin(load))
        expected[expert, node] = 1.0
        load[node] += f[expert]
    np.testing.assert_array_equal(res.best_placement[0], expected)
    assert res.best_actions == tuple(int(np.argmax(expected[e])) for e in env.expert_order)
    spread = greedy_balance(env, 4, layer=0)        # size D: every expert spread = TP here
    assert spread.best_placement[1] and spread.best_ratio == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="no pattern"):
        greedy_balance(env, 3)


@pytest.mark.parametrize("evaluator", ["static", "analytic", "des"])
def test_the_reward_is_a_function_of_the_placement(evaluator):
    env = make(evaluator=evaluator, score_steps=3)
    env.reset(seed=0, options={"layer": 2})
    P = np.zeros((8, 4))
    P[np.arange(8), np.arange(8) % 4] = 1.0
    first = env.evaluate_placement(P)
    for _ in range(2):
        assert env.evaluate_placement(P) == first
    other = make(evaluator=evaluator, score_steps=3)
    other.reset(seed=9, options={"layer": 2})
    assert other.evaluate_placement(P) == first       # streams depend on (seed, trace, layer)


@pytest.mark.slow
def test_default_registered_env_passes_both_checkers():
    from gymnasium.utils.env_checker import check_env

    env = gym.make("hdamoe_env/HdMoE-Place-v1").unwrapped     # DeepSeek-V2-Lite on 4x8
    assert env.action_space.n == 61 and env.units == 22
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env, skip_render_check=True)
        if pytest.importorskip("stable_baselines3"):
            from stable_baselines3.common.env_checker import check_env as sb3_check_env

            sb3_check_env(env, warn=True)


@pytest.mark.parametrize("evaluator", ["static", "des"])
def test_latency_lower_bound_is_below_every_placement(evaluator):
    """The compute bound holds for TP, tiled TP, EP-like, greedy and random placements."""
    env = make(mesh="2x4", evaluator=evaluator, score_steps=3)
    env.reset(seed=0, options={"layer": 1})
    lb = env.latency_lower_bound()
    assert lb["lower_bound_us"] > 0
    # the step mean of the max is at least the max of the step means (equal for one step)
    assert lb["lower_bound_us"] >= max(lb["compute_bound_us"], lb["stream_bound_us"]) * (1 - 1e-9)
    placements = [(tensor_parallel_tiled(1, 8, 8, 0.25).P[0], True),
                  (np.full((8, 8), 1.0 / 8), False)]
    one_hot = np.zeros((8, 8))
    one_hot[np.arange(8), np.arange(8)] = 1.0
    placements.append((one_hot, False))
    for size in (1, 2, 4):
        placements.append(greedy_balance(env, size, layer=1).best_placement)
    rs = random_search(env, 4, np.random.default_rng(0), layer=1)
    placements.append(rs.best_placement)
    for P, allreduce in placements:
        out = env.evaluate_placement(P, None, allreduce, layer=1)
        assert lb["lower_bound_us"] <= out["compute_us"] * (1 + 1e-9)
        assert lb["lower_bound_us"] <= out["latency_us"] * (1 + 1e-9)
    assert 0 < lb["ratio"] <= 1.0


def _random_tile_placement(rng: np.random.Generator, E: int, D: int, U: int) -> np.ndarray:
    """Whole tiles: every expert on 1..min(U, D) random clusters, its tiles dealt at random."""
    P = np.zeros((E, D))
    for e in range(E):
        h = int(rng.integers(1, min(U, D) + 1))
        nodes = rng.choice(D, size=h, replace=False)
        tiles = np.ones(h, dtype=np.int64)
        np.add.at(tiles, rng.integers(0, h, size=U - h), 1)
        P[e, nodes] = tiles / U
    return P


@pytest.mark.parametrize("evaluator,conventions", [
    ("des", "faithful"), ("analytic", "faithful"), ("des", "paper"),
    ("des", "faithful+ni_ports=False")])
def test_latency_lower_bound_holds_for_random_tile_placements(evaluator, conventions):
    """Dispatch-mode, all-reduce and TP placements, any mapping, never beat the joint bound."""
    env = make(mesh="2x4", evaluator=evaluator, score_steps=3, conventions=conventions)
    env.reset(seed=0, options={"layer": 2})
    lb = env.latency_lower_bound()
    E, D, U = env.num_experts, env.num_nodes, env.units
    rng = np.random.default_rng(7)
    worst = np.inf
    for i in range(24):
        P = _random_tile_placement(rng, E, D, U)
        pi = rng.permutation(D) if i % 2 else None
        out = env.evaluate_placement(P, pi, allreduce=(i % 5 == 0))
        worst = min(worst, out["latency_us"])
        assert lb["lower_bound_us"] <= out["latency_us"] * (1 + 1e-9), (i, lb, out)
    for size in (1, 2, 4, 8):
        P, red = greedy_balance(env, size, layer=2).best_placement
        out = env.evaluate_placement(P, None, red)
        assert lb["lower_bound_us"] <= out["latency_us"] * (1 + 1e-9)
    assert lb["lower_bound_us"] <= env.evaluate_placement(np.full((E, D), 1.0 / D))["latency_us"]
    assert lb["lower_bound_us"] <= worst


def test_latency_lower_bound_is_tighter_than_the_compute_means():
    """Token-tile padding, per-holder overheads and the tile grid lift it above the node means."""
    env = make(mesh="2x4", evaluator="des", score_steps=3)
    env.reset(seed=0, options={"layer": 2})
    lb = env.latency_lower_bound()
    assert lb["dispatch_bound_us"] > 1.05 * max(lb["compute_bound_us"], lb["stream_bound_us"])
    assert lb["lower_bound_us"] == pytest.approx(min(lb["dispatch_bound_us"],
                                                     lb["allreduce_bound_us"]), rel=0.5)


def test_nearest_hops_on_a_2x4_mesh():
    """Σ of the j smallest hop counts from the best-placed cluster (an inner one of the row)."""
    env = make(mesh="2x4", evaluator="des", score_steps=1)
    np.testing.assert_array_equal(env._nearest_hops(), [0, 1, 2, 3, 5, 7, 9, 12])


def test_pattern_peak_is_greedys_criterion_and_optional():
    assert "pattern_peak" not in make().observation_space.spaces
    env = make(pattern_features=True, mesh="2x4")
    assert env.observation_space["pattern_peak"].shape == (env.action_space.n,)
    for size in (1, 2):
        g = greedy_balance(env, size, layer=1)
        obs, _ = env.reset(options={"layer": 1, "trace_index": 0})
        positive = 0
        for a in g.best_actions:
            assert env.observation_space.contains(obs)
            assert obs["pattern_peak"][a] == 0.0          # the greedy's pick is a minimum
            positive += int((obs["pattern_peak"] > 0).sum())
            obs, *_ = env.step(a)
        assert positive > 0                               # and the feature tells patterns apart


def _brute_force_fixed(env: HdMoePlaceEnv, layer: int, comm: bool = True) -> float:
    """min over every h ∈ {1..min(U, D)}^E of mean_s B_s(h) (µs), B_s by direct evaluation."""
    import itertools

    data = env._layer_data(0, layer)
    E, D = env.num_experts, env.num_nodes
    H = min(env.units, D)
    steps = [env._fixed_step_data(sets, 64) for sets in data.steps]
    best = np.inf
    for hv in itertools.product(range(1, H + 1), repeat=E):
        h = np.array(hv, dtype=np.int64)
        total = 0.0
        for st, sets in zip(steps, data.steps, strict=True):
            act = st["act"]
            ok = (st["hreq"][:, act] <= h[act]).all(axis=1)          # τ ≥ max_e M_e(h_e)
            if not ok.any():
                total = np.inf
                break
            mean = max((st["total"] + (h[act] - 1).sum() * st["extra"]) / D, st["stream"])
            comp = np.maximum(st["grid"][ok], mean)
            if comm:
                u = np.maximum(h[sets].max(axis=1)[None, :], st["cap"][ok])
                h_full = np.broadcast_to(np.where(act, h, 1), (u.shape[0], E))
                comp = comp + env._comm_bound(u, h_full, sets) * 1e6
            total += float(comp.min())
        best = min(best, total / len(steps))
    return best


# E = 4, k = 2; I = 256 at 64-column tiles: U = 4, so 4^4 holder-count vectors
MODEL_E4 = ModelSpec(key="tiny-place-e4", name="tiny-place-e4", num_moe_layers=4, num_experts=4,
                     top_k=2, hidden_size=64, expert_intermediate=256,
                     attn_weight_elements=4 * 64 * 64, kv_elements_per_token=2 * 64,
                     core_flops_per_ctx_token=4 * 64)


@pytest.mark.parametrize("conventions", ["faithful", "faithful+ni_ports=False",
                                         "faithful+moe_comm=2xcombine"])
def test_fixed_bound_equals_brute_force_over_holder_counts(conventions):
    """The MILP's dual bound is min_h mean_s B_s(h) over every holder-count vector, exactly,
    and here strictly above the per-step bound (the steps disagree on the best h)."""
    env = make(model=MODEL_E4, mesh="2x4", setting="5/50", evaluator="des", score_steps=3,
               batch=64, conventions=conventions)
    assert env.units == 4
    data = env._layer_data(0, 2)
    steps = [env._fixed_step_data(sets, 64) for sets in data.steps]
    for comm in (True, False):
        milp = env._fixed_bound_milp(steps, data.steps, data.gamma, comm, 60.0)
        assert milp["optimal"] == 1.0
        assert milp["value_us"] == pytest.approx(_brute_force_fixed(env, 2, comm), rel=1e-6)
    fx = env.latency_lower_bound(layer=2, trace_index=0, fixed=True)
    assert fx["fixed_dispatch_us"] > 1.003 * fx["dispatch_bound_us"]


@pytest.mark.parametrize("evaluator,conventions", [
    ("des", "faithful"), ("analytic", "faithful"), ("des", "paper")])
def test_fixed_bound_between_per_step_bound_and_tile_placements(evaluator, conventions):
    """per-step LB ≤ fixed LB ≤ every random tile placement, greedy, TP (any mode, mapping)."""
    env = make(mesh="2x4", evaluator=evaluator, score_steps=3, batch=16,
               conventions=conventions)
    env.reset(seed=0, options={"layer": 2})
    lb = env.latency_lower_bound()
    fx = env.latency_lower_bound(fixed=True)
    assert {k: lb[k] for k in lb} == {k: fx[k] for k in lb if k not in ("lower_bound_us",
                                                                         "ratio")} | {
        "lower_bound_us": lb["lower_bound_us"], "ratio": lb["ratio"]}
    assert fx["perstep_bound_us"] == lb["lower_bound_us"]
    assert fx["lower_bound_us"] >= lb["lower_bound_us"]
    assert fx["fixed_dispatch_us"] >= lb["dispatch_bound_us"] * (1 - 1e-6)
    assert fx["fixed_gap"] <= 1e-5
    E, D, U = env.num_experts, env.num_nodes, env.units
    rng = np.random.default_rng(11)
    for i in range(24):
        P = _random_tile_placement(rng, E, D, U)
        pi = rng.permutation(D) if i % 2 else None
        out = env.evaluate_placement(P, pi, allreduce=(i % 5 == 0))
        assert fx["lower_bound_us"] <= out["latency_us"] * (1 + 1e-9), (i, fx, out)
    for size in (1, 2, 4, 8):
        P, red = greedy_balance(env, size, layer=2).best_placement
        assert fx["lower_bound_us"] <= env.evaluate_placement(P, None, red)["latency_us"] * (
            1 + 1e-9)
    assert fx["lower_bound_us"] <= fx["lower_bound_us"] / fx["ratio"] * (1 + 1e-12)   # ≤ TP
    assert fx["lower_bound_us"] <= env.evaluate_placement(np.full((E, D), 1.0 / D))["latency_us"]


def test_fixed_bound_static_is_the_per_step_bound():
    env = make(evaluator="static")
    env.reset(seed=0, options={"layer": 1})
    fx = env.latency_lower_bound(fixed=True)
    assert fx["lower_bound_us"] == fx["perstep_bound_us"] == env.latency_lower_bound()[
        "lower_bound_us"]
