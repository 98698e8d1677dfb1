"""Learned agents: train (agents/learned/train.py), save, load (agents/learned/policy.py), evaluate
(hdamoe_env/app/train.py), resume, determinism, threads.

Tiny configuration: the L = 2, E = 4 model of ``conftest.py`` on a 2×2 mesh with k_b = 2 forced,
2 decode steps per episode (4 env steps); a few hundred training steps take a few seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")
pytest.importorskip("sb3_contrib")

from agents.learned import policy as learned
from agents.learned import envs as learned_envs
from agents.learned import hyperparams as learned_hp
from agents.learned import train as learned_train
from hdamoe_env.app import evaluate as evaluate_app  # noqa: E402
from hdamoe_env.app import train as train_app  # noqa: E402
from hdamoe_env.config.errors import ConfigError  # noqa: E402

SMALL_PPO = {"n_steps": 64, "batch_size": 32, "n_epochs": 2}


def _train(env_kwargs, out, algo="maskable-ppo", timesteps=256, **kw):
    kw.setdefault("hyperparams", SMALL_PPO if "ppo" in algo else None)
    kw.setdefault("tensorboard", False)
    return learned_train.train(algo, env_kwargs, timesteps, out_dir=out, checkpoint_every=128,
                               **kw)


def test_train_save_load_evaluate(env_kwargs, tmp_path, make_tiny_env):
    import torch

    evaluate_fn = evaluate_app.held_out_evaluation(steps=2, seeds=[0, 1],
                                                baselines=["noop", "hd-moe", "hda-moe"])
    reports = []
    path = _train(env_kwargs, tmp_path, evaluate_fn=evaluate_fn, tensorboard=True,
                  on_progress=lambda n, fps: reports.append((n, fps)))
    # progress after every rollout (n_steps = 64): env steps so far and a positive rate
    assert [n for n, _ in reports] == [64, 128, 192, 256] and all(f > 0 for _, f in reports)
    assert path == tmp_path / "model.zip" and path.exists()
    assert (tmp_path / "vecnormalize.npz").exists() and not list(tmp_path.rglob("*.pkl"))
    meta = json.loads((tmp_path / "learned.json").read_text())
    assert meta["algo"] == "maskable-ppo" and meta["num_timesteps"] >= 256
    assert meta["torch_threads"] == 1 and torch.get_num_threads() == 1
    # held-out evaluation: synthetic trace seed + 1000, both fidelities, learned vs heuristics
    ev = json.loads((tmp_path / "eval.json").read_text())
    assert "trace_seed 1000" in ev["split"]
    assert set(ev["tables"]) == {"analytic", "des"}
    methods = {r["method"] for r in ev["records"]}
    assert {"learned", "noop", "hd-moe", "hda-moe"} <= methods
    assert "twin_gap" in ev["summary"]
    assert "learned_vs_hda-moe" in ev["summary"]["des"]
    assert (tmp_path / "eval.md").read_text().startswith("held-out split")
    assert any((tmp_path / "tb").rglob("events.out.tfevents*"))
    # TensorBoard: eval/* on the training-step axis, hyperparameters in the HPARAMS plugin
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = next(p for p in (tmp_path / "tb").iterdir() if p.is_dir())
    acc = EventAccumulator(str(run))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "eval/des/tbt_us/learned" in tags and "eval/analytic/tbt_us/hda-moe" in tags
    assert [e.step for e in acc.Scalars("eval/des/tbt_us/learned")] == [meta["num_timesteps"]]
    assert "rollout/ep_rew_mean" in tags or "latency/total_over_tp" in tags
    plugins = {p for f in run.glob("events.out.tfevents*") for p in _plugins(f)}
    assert "hparams" in plugins
    # the loaded agent runs on a strict env (2-D replicas, duplicates raise) without masks too
    agent = learned.load_agent(tmp_path, env=make_tiny_env())
    env = make_tiny_env(fidelity="analytic")
    obs, _ = env.reset(seed=3)
    done = False
    while not done:
        action, _ = agent.predict(obs, deterministic=True)
        assert action.dtype == np.int64 and action.shape == env.action_space.shape
        obs, _, term, trunc, _ = env.step(action)
        done = term or trunc
    # batched observations, as from a VecEnv
    obs, _ = env.reset(seed=4)
    batch = {k: np.stack([v, v]) for k, v in obs.items()}
    actions, _ = agent.predict(batch, action_masks=np.stack([env.action_masks()] * 2))
    assert actions.shape == (2, *env.action_space.shape)


def _plugins(path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    for event in EventFileLoader(str(path)).Load():
        for value in event.summary.value:
            if value.metadata.plugin_data.plugin_name:
                yield value.metadata.plugin_data.plugin_name


def test_bench_resolves_learned_agent(env_kwargs, tmp_path, make_tiny_env):
    from hdamoe_env.app.methods import resolve_agent

    _train(env_kwargs, tmp_path, timesteps=128)
    agent = resolve_agent(str(tmp_path / "model.zip"), make_tiny_env())
    assert isinstance(agent, learned.LearnedAgent) and agent.vecnorm is not None


def test_resume_continues_step_count(env_kwargs, tmp_path):
    _train(env_kwargs, tmp_path, timesteps=128)
    first = learned.latest_checkpoint(tmp_path)
    assert first is not None and first.name == "ckpt_128.zip"
    _train(env_kwargs, tmp_path, timesteps=256, resume=True)
    meta = json.loads((tmp_path / "learned.json").read_text())
    assert meta["resumed_at"] == 128 and meta["num_timesteps"] == 256
    assert learned.latest_checkpoint(tmp_path).name == "ckpt_256.zip"
    from hdamoe_env.config.errors import ConfigError

    with pytest.raises(ConfigError, match="resume"):
        _train(env_kwargs, tmp_path, timesteps=512, resume=True, action_mode="full")
    # a checkpoint loads on its own, with its own normalisation statistics
    agent = learned.load_agent(tmp_path / "checkpoints" / "ckpt_128.zip")
    assert agent.algo == "maskable-ppo" and agent.vecnorm is not None


@pytest.mark.parametrize(("algo", "mode"), [("ppo", "ranked"), ("a2c", "ranked"),
                                            ("maskable-ppo", "full")])
def test_other_algorithms_and_action_modes(env_kwargs, tmp_path, algo, mode, make_tiny_env):
    _train(env_kwargs, tmp_path, algo=algo, timesteps=128, action_mode=mode)
    agent = learned.load_agent(tmp_path)
    env = make_tiny_env()
    obs, _ = env.reset(seed=0)
    env.step(agent.predict(obs, action_masks=env.action_masks())[0])


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


def test_deterministic_evaluation(env_kwargs, tmp_path):
    _train(env_kwargs, tmp_path, timesteps=128)
    kw = dict(seeds=[5, 6], steps=2, fidelities=["des"], baselines=["noop"])
    a = evaluate_app.evaluate(tmp_path, **kw)
    b = evaluate_app.evaluate(tmp_path, **kw)
    def tbt(res):
        return [(r["method"], r["seed"], r["tbt_steps_us"]) for r in res["records"]]

    assert tbt(a) == tbt(b)
    assert any(r["method"] == "learned" for r in a["records"])


def test_same_seed_same_policy(env_kwargs, tmp_path):
    import torch

    _train(env_kwargs, tmp_path / "a", timesteps=128, seed=3)
    _train(env_kwargs, tmp_path / "b", timesteps=128, seed=3)
    pa = learned.load_agent(tmp_path / "a").model.policy.state_dict()
    pb = learned.load_agent(tmp_path / "b").model.policy.state_dict()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_threads_set_to_one(env_kwargs, tmp_path):
    import torch

    torch.set_num_threads(2)
    _train(env_kwargs, tmp_path, algo="a2c", timesteps=16)
    assert torch.get_num_threads() == 1
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert json.loads((tmp_path / "learned.json").read_text())["torch_threads"] == 1


@pytest.mark.slow
def test_threads_honoured_in_fresh_process(tmp_path):
    code = (
        "import torch\n"
        "torch.set_num_threads(2)\n"
        "from agents.learned import train as learned_train\n"
        "from hdamoe_env.config.specs import ModelSpec\n"
        "m = ModelSpec(key='tiny', name='tiny', num_moe_layers=2, num_experts=4, top_k=2, "
        "hidden_size=64, expert_intermediate=128, attn_weight_elements=4*64*64, "
        "kv_elements_per_token=2*64, core_flops_per_ctx_token=4*64)\n"
        "kw = dict(model=m, mesh='2x2', setting='1/1', batch=8, steps_per_episode=2, "
        "placement='ep', k_b=2, trace_requests=4, trace_tokens=256)\n"
        f"learned_train.train('a2c', kw, 16, out_dir={str(tmp_path)!r}, checkpoint_every=0, "
        "tensorboard=False)\n"
        "import os; print(torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    assert out.stdout.split()[-2:] == ["1", "1"]
    assert json.loads((tmp_path / "learned.json").read_text())["torch_threads"] == 1


def test_bad_arguments(env_kwargs, tmp_path):
    from hdamoe_env.config.errors import ConfigError

    with pytest.raises(ConfigError, match="algorithm"):
        learned_train.train("dqn", env_kwargs, 8, out_dir=tmp_path)
    with pytest.raises(ConfigError, match="hyperparameters"):
        learned_train.train("ppo", env_kwargs, 8, out_dir=tmp_path, hyperparams={"nsteps": 3})
    with pytest.raises(ConfigError, match="no learned model"):
        learned.load_agent(tmp_path / "missing")


def test_cli_parsers(env_kwargs, tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    train_app.add_train_arguments(sub.add_parser("train")).set_defaults(func=train_app.cmd_train)
    evaluate_app.add_evaluate_arguments(sub.add_parser("evaluate")).set_defaults(
        func=evaluate_app.cmd_evaluate)
    args = parser.parse_args(["train", "--algo", "ppo", "--timesteps", "64", "--k-b", "2",
                              "--batch", "8", "--hp", "n_steps=32", "--out", str(tmp_path)])
    assert args.func is train_app.cmd_train and train_app._parse_hp(args.hp) == {"n_steps": 32}
    assert evaluate_app.env_kwargs_from_args(args)["k_b"] == 2
    assert "gating_protect_top" not in evaluate_app.env_kwargs_from_args(args)
    args_p = parser.parse_args(["train", "--gating-protect-top", "1", "--out", str(tmp_path)])
    assert evaluate_app.env_kwargs_from_args(args_p)["gating_protect_top"] == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--gating-protect-top", "-1", "--out", str(tmp_path)])
    _train(env_kwargs, tmp_path, timesteps=64)
    args = parser.parse_args(["evaluate", "--agent", f"{tmp_path},greedy-hda", "--baselines",
                              "noop", "--seeds", "1", "--steps", "1", "--fidelity", "des"])
    assert evaluate_app.cmd_evaluate(args) == 0
    text = capsys.readouterr().out
    assert "learned" in text and "hda-moe" in text and "noop" in text


@pytest.mark.slow
def test_subproc_vec_env(env_kwargs, tmp_path):
    _train(env_kwargs, tmp_path, timesteps=256, n_envs=2)
    assert json.loads((tmp_path / "learned.json").read_text())["n_envs"] == 2


def test_residual_action_mode(env_kwargs, tmp_path, make_tiny_env):
    """Residual action: value 0 = HDA-MoE's action; an untrained (biased) policy acts like it."""
    from agents import ActionLayout, HDAMoEAgent

    env = make_tiny_env(flatten_replicas=True)
    from agents.wrappers import ResidualHDA

    design = ResidualHDA.from_env(env)
    ref = HDAMoEAgent.from_env(make_tiny_env())
    obs, _ = env.reset(seed=0)
    obs, *_ = env.step(ActionLayout.from_env(env).noop())                    # reach layer 1
    choice = design.choose(obs, env.action_masks())
    obs2 = dict(obs, replicas=obs["replicas"].reshape(4, -1))
    expected = ref.predict(obs2, action_masks=env.action_masks())[0]
    assert design.to_full(np.zeros(3, dtype=np.int64), choice).tolist() == expected.tolist()
    keep = choice.slots[0]
    assert len(keep) == 2 and choice.mask[:4].tolist() == [True, True, True, choice.slots[3] is not None]
    assert design.to_full(np.array([1, 0, 0]), choice)[:2].tolist() == [keep[0], 4]
    assert design.to_full(np.array([2, 1, 1]), choice).tolist()[:2] == [4, 4]
    if choice.slots[3] is not None:                  # swap: the next greedy pick replaces the last
        swapped = design.to_full(np.array([3, 0, 0]), choice)[:2].tolist()
        assert swapped[0] == keep[0] and swapped[1] not in keep
    assert design.to_full(np.array([2, 1, 1]), choice)[-1] == (int(expected[-1]) + 1) % 4
    # timesteps=0: the saved policy is the biased initialisation, i.e. exactly HDA-MoE
    _train(env_kwargs, tmp_path, timesteps=0, action_mode="residual")
    meta = json.loads((tmp_path / "learned.json").read_text())
    assert meta["action_mode"] == "residual" and meta["layout"]["num_nodes"] == 4
    agent = learned.load_agent(tmp_path, env=make_tiny_env())
    unbound = learned.load_agent(tmp_path)                  # reference rebuilt from learned.json
    strict = make_tiny_env()
    obs, _ = strict.reset(seed=5)
    done = False
    while not done:
        act = agent.predict(obs, action_masks=strict.action_masks())[0]
        assert act.tolist() == ref.predict(obs, action_masks=strict.action_masks())[0].tolist()
        assert unbound.predict(obs, action_masks=strict.action_masks())[0].tolist() == act.tolist()
        obs, _, term, trunc, _ = strict.step(act)
        done = term or trunc
    # and it trains (resume keeps the mode) and runs on the bench's strict env
    _train(env_kwargs, tmp_path / "t", timesteps=128, action_mode="residual")
    from hdamoe_env.app.methods import resolve_agent

    agent = resolve_agent(str(tmp_path / "t"), make_tiny_env())
    obs, _ = strict.reset(seed=6)
    strict.step(agent.predict(obs, action_masks=strict.action_masks())[0])


def test_quality_reward_plumbing(env_kwargs):
    """``quality=`` wraps every training env in ``QualityRewardWrapper`` and enters the digest."""
    import argparse

    from hdamoe_env.env.wrappers import QualityRewardWrapper

    env = learned_envs._EnvFactory(dict(env_kwargs), "ranked", 4,
                                   {"target": 0.99, "lagrangian": True})()
    inner, found = env, None
    while hasattr(inner, "env"):
        if isinstance(inner, QualityRewardWrapper):
            found = inner
        inner = inner.env
    assert found is not None and found.lagrangian and found.lam == 0.0
    hp = learned_hp.HYPERPARAMS["maskable_ppo" if "maskable_ppo" in learned_hp.HYPERPARAMS
                                else next(iter(learned_hp.HYPERPARAMS))]()
    base = learned_train.run_digest("a", "ranked", 4, "analytic", True, hp, env_kwargs, None)
    assert base == learned_train.run_digest("a", "ranked", 4, "analytic", True, hp, env_kwargs,
                                            None, None)
    assert base != learned_train.run_digest("a", "ranked", 4, "analytic", True, hp, env_kwargs,
                                            None, {"target": 0.99})
    args = argparse.Namespace(quality_target=None, lagrangian=True)
    with pytest.raises(train_app.ConfigError, match="--quality-target"):
        train_app._quality(args)
    args = argparse.Namespace(quality_target=0.99, quality_weight=5.0, lagrangian=False,
                              dual_step=50.0)
    assert train_app._quality(args) == {"target": 0.99, "weight": 5.0, "lagrangian": False,
                                        "dual_step": 50.0}


# ------------------------------------------------------------------- replica routing shares
def _forced_shares(agent, value):
    """Make the agent's model answer share value ``value`` for every expert (inner part kept)."""
    real = agent.model.predict

    def predict(obs, **kw):
        action, state = real(obs, **kw)
        action = np.array(action, copy=True)
        action[..., action.shape[-1] - agent.layout.num_experts:] = value
        return action, state

    agent.model.predict = predict


def _shares_run(env_kwargs, out, placement, mode, timesteps=192, **kw):
    kwargs = dict(env_kwargs, placement="eplb")        # the name recorded; the env uses `placement`
    return _train(kwargs, out, timesteps=timesteps, action_mode=mode, replica_shares=2,
                  placement=placement, **kw)


@pytest.mark.parametrize("mode", ["full", "residual", "ranked"])
def test_replica_shares_train_save_load_apply(env_kwargs, tmp_path, make_tiny_env,
                                              replicated_placements, mode):
    """A model trained with replica shares acts in the env's action + E share dimensions,
    records replica_shares and the replica rules of the layout, reloads on the replica
    placement, returns the env's own action and, bound, sets the env's replica fractions."""
    ep, rep = replicated_placements
    _shares_run(env_kwargs, tmp_path, rep, mode)
    meta = json.loads((tmp_path / "learned.json").read_text())
    env = make_tiny_env(placement=rep)
    nvec = env.action_space.nvec.tolist()
    assert meta["replica_shares"] == 2 and meta["action_mode"] == mode
    assert meta["layout"]["replica_rules"] == list(env.replica_rules) and env.replica_rules
    agent = learned.load_agent(tmp_path, env=env)
    model_nvec = agent.model.action_space.nvec.tolist()
    values = 4 if mode == "residual" else 3            # residual: value 0 = the env's rule
    assert model_nvec[-4:] == [values] * 4 and len(model_nvec) > 4
    assert meta["replica_share_rule_value"] == (mode == "residual")
    if mode == "full":
        assert model_nvec == [*nvec, 3, 3, 3, 3]
    assert agent.layout.nvec.tolist() == nvec and agent.replica_shares == 2
    unbound = learned.load_agent(tmp_path)
    other = make_tiny_env(placement=rep)
    obs, _ = env.reset(seed=3)
    other.reset(seed=3)
    done = False
    while not done:
        action, _ = agent.predict(obs, action_masks=env.action_masks())
        assert action.dtype == np.int64 and action.shape == env.action_space.shape
        assert agent.last_replica_shares.shape == (4,)
        plain_action, _ = unbound.predict(obs, action_masks=env.action_masks())
        assert plain_action.tolist() == action.tolist()            # the same inner action
        obs, _, term, trunc, info = env.step(action)
        assert info["replica_rule"] == "shares"                     # the bound agent's shares
        _, _, _, _, info_other = other.step(plain_action)
        assert info_other["replica_rule"] != "shares"               # unbound: not applied
        done = term or trunc
    with pytest.raises(ConfigError, match="redundant experts"):
        learned.load_agent(tmp_path, env=make_tiny_env(placement=ep))


def test_replica_shares_change_the_dispatch(env_kwargs, tmp_path, make_tiny_env,
                                            replicated_placements):
    """All-primary shares (v = K) give the expert phase of the placement without the replica,
    step by step; all-replica shares (v = 0) move expert 0's tokens and change it (the physics
    of ReplicaSharesWrapper, applied by the loaded agent on its bound env)."""
    ep, rep = replicated_placements
    _shares_run(env_kwargs, tmp_path, rep, "full", timesteps=128)

    def episode(value):
        env = make_tiny_env(placement=rep)
        agent = learned.load_agent(tmp_path, env=env)
        _forced_shares(agent, value)
        plain = make_tiny_env(placement=ep)
        obs, _ = env.reset(seed=5)
        plain.reset(seed=5)
        comp, comp_plain, done = [], [], False
        while not done:
            action, _ = agent.predict(obs, action_masks=env.action_masks())
            assert agent.last_replica_shares.tolist() == [value] * 4
            obs, _, term, trunc, info = env.step(action)
            _, _, _, _, ref = plain.step(action[:-1])              # without the replica rule
            comp.append(info["t_comp_us"])
            comp_plain.append(ref["t_comp_us"])
            done = term or trunc
        return np.array(comp), np.array(comp_plain)

    primary, plain = episode(2)
    np.testing.assert_allclose(primary, plain, rtol=1e-12)
    moved, plain = episode(0)
    assert not np.allclose(moved, plain, rtol=1e-9)


def test_replica_shares_batched_predict_and_bench(env_kwargs, tmp_path, make_tiny_env,
                                                  replicated_placements):
    """Bound to one env, a shares agent refuses a batch of observations (the fractions are per
    env); unbound it answers a batch (shares in last_replica_shares, not applied). The bench
    binds the agent to the env it acts on, so an episode there runs the shares rule."""
    from hdamoe_env.app import bench, methods

    _, rep = replicated_placements
    _shares_run(env_kwargs, tmp_path, rep, "full", timesteps=64)
    env = make_tiny_env(placement=rep)
    obs, _ = env.reset(seed=0)
    batch = {k: np.stack([v, v]) for k, v in obs.items()}
    masks = np.stack([env.action_masks()] * 2)
    with pytest.raises(ConfigError, match="one observation at a time"):
        learned.load_agent(tmp_path, env=env).predict(batch, action_masks=masks)
    unbound = learned.load_agent(tmp_path)
    actions, _ = unbound.predict(batch, action_masks=masks)
    assert actions.shape == (2, *env.action_space.shape)
    assert unbound.last_replica_shares.shape == (2, 4)
    agent = methods.resolve_agent(str(tmp_path), env)
    seen = []
    real_step = env.step

    def step(action):
        out = real_step(action)
        seen.append(out[4]["replica_rule"])
        return out

    env.step = step
    measured = bench.run_episode(env, agent, seed=1)
    assert measured["decode_steps"] == 2 and set(seen) == {"shares"}


def test_replica_shares_refused_without_replicas(env_kwargs, tmp_path, capsys):
    """--replica-shares on a placement without redundant experts: one ConfigError naming it
    and pointing at eplb (API and CLI, exit 2, one line); 0 and negative K fail at parse time."""
    from hdamoe_env.app.cli import main

    with pytest.raises(ConfigError, match=r"placement 'ep' has none.*--placement eplb"):
        learned_train.train("maskable-ppo", env_kwargs, 8, out_dir=tmp_path / "a",
                            replica_shares=2, tensorboard=False)
    with pytest.raises(ConfigError, match="integer >= 1"):
        learned_envs.check_replica_shares(-1, "eplb")
    for placement in ("ep", "node_link"):
        code = main(["train", "--placement", placement, "--replica-shares", "2", "--timesteps",
                     "8", "--no-eval", "--out", str(tmp_path / placement)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1
        assert f"placement {placement!r}" in err[0] and "--placement eplb" in err[0]
        assert not (tmp_path / placement / "model.zip").exists()
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit) as exc:
            main(["train", "--replica-shares", bad, "--out", str(tmp_path / "b")])
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1
        assert "error: argument --replica-shares" in err[0]


@pytest.mark.parametrize("shares", [None, 2])
def test_residual_on_a_replica_placement(env_kwargs, tmp_path, make_tiny_env,
                                         replicated_placements, shares):
    """Residual mode on a placement with redundant experts (the env has a trailing replica-rule
    dimension): the saved layout carries the replica rules, so the agent loads on that env, and
    the untrained (keep-biased) policy is exactly HDA-MoE, bound or rebuilt from learned.json.
    With shares, value 0 of every share dimension (the least-loaded rule) is biased too, so the
    bound untrained policy dispatches exactly as the env's default rule: the same latency, step
    by step, as HDA-MoE on an env without shares."""
    from agents import HDAMoEAgent

    _, rep = replicated_placements
    kwargs = dict(env_kwargs, placement="eplb")
    _train(kwargs, tmp_path, timesteps=0, action_mode="residual", replica_shares=shares,
           placement=rep)
    env = make_tiny_env(placement=rep)
    agent = learned.load_agent(tmp_path, env=env)
    unbound = learned.load_agent(tmp_path)
    assert unbound.layout.nvec.tolist() == env.action_space.nvec.tolist()
    ref = HDAMoEAgent.from_env(env)
    bias = agent.model.policy.action_net.bias.detach().numpy()
    n_res = int(sum(agent.residual_design().nvec))
    assert bias.size == n_res + (16 if shares else 0)               # 4 experts × (K + 2)
    if shares:
        share_bias = bias[n_res:].reshape(4, 4)
        assert np.all(share_bias[:, 0] > share_bias[:, 1:].max())    # value 0 (the rule) kept
    plain = make_tiny_env(placement=rep)
    obs, _ = env.reset(seed=5)
    plain.reset(seed=5)
    done = False
    while not done:
        act = agent.predict(obs, action_masks=env.action_masks())[0]
        assert act.tolist() == ref.predict(obs, action_masks=env.action_masks())[0].tolist()
        assert unbound.predict(obs, action_masks=env.action_masks())[0].tolist() == act.tolist()
        if shares:
            assert agent.last_replica_shares.tolist() == [0, 0, 0, 0]
        obs, _, term, trunc, info = env.step(act)
        _, _, _, _, ref_info = plain.step(act)
        assert info["total_us"] == ref_info["total_us"]              # the default dispatch
        assert info["replica_rule"] == ("shares" if shares else ref_info["replica_rule"])
        done = term or trunc
