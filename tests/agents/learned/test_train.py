"""Tests of agents.learned.train: training, saving and held-out evaluation, resume (and what it
refuses), other algorithms and action modes, determinism, threads, replica shares, the quality
reward, typed hyperparameters.

Tiny configuration: the L = 2, E = 4 model of ``tests/conftest.py`` on a 2×2 mesh with k_b = 2
forced, 2 decode steps per episode (4 env steps); a few hundred training steps take a few seconds.
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

from agents.learned import envs as learned_envs  # noqa: E402
from agents.learned import hyperparams as learned_hp  # noqa: E402
from agents.learned import policy as learned  # noqa: E402
from agents.learned import train as learned_train  # noqa: E402
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


@pytest.mark.slow
def test_subproc_vec_env(env_kwargs, tmp_path):
    _train(env_kwargs, tmp_path, timesteps=256, n_envs=2)
    assert json.loads((tmp_path / "learned.json").read_text())["n_envs"] == 2


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


@pytest.fixture
def trained(env_kwargs, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    _train(env_kwargs, out, timesteps=128)
    return out


@pytest.mark.parametrize("change", [{"setting": "2/1"}, {"batch": 16}])
def test_resume_refuses_another_env(env_kwargs, trained, change):
    """--resume with another --setting or --batch is refused, naming the field."""
    before = (trained / "learned.json").read_text()
    with pytest.raises(ConfigError, match="another env or hyperparameters.*" + next(iter(change))):
        _train({**env_kwargs, **change}, trained, timesteps=256, resume=True)
    assert (trained / "learned.json").read_text() == before


def test_resume_refuses_other_hyperparameters_and_stale_checkpoints(env_kwargs, trained):
    with pytest.raises(ConfigError, match="hp.n_epochs"):
        _train(env_kwargs, trained, timesteps=256, resume=True,
               hyperparams={**SMALL_PPO, "n_epochs": 3})
    (trained / "checkpoints" / "ckpt_128.json").unlink()      # a checkpoint of unknown origin
    with pytest.raises(ConfigError, match="no readable"):
        _train(env_kwargs, trained, timesteps=256, resume=True)


def test_resume_of_a_run_from_before_policy_input(env_kwargs, tmp_path):
    """A checkpoint written before the hyperparameter policy_input existed (its run digest
    lacks the key; the run used the full input) resumes with policy_input=full when the run
    does not ask for another input, and keeps that digest for its later checkpoints."""
    full = {**SMALL_PPO, "policy_input": "full"}
    _train(env_kwargs, tmp_path, timesteps=128, hyperparams=full)
    hp = learned_hp.MaskablePPOHyperparams(**full)
    legacy = learned_train.run_digest("maskable-ppo", "ranked", 4, "analytic", True, hp,
                                      env_kwargs, None, legacy_policy_input=True)
    assert legacy != learned_train.run_digest("maskable-ppo", "ranked", 4, "analytic", True,
                                              hp, env_kwargs, None)
    # what the earlier version wrote: the digest and learned.json without policy_input
    side = tmp_path / "checkpoints" / "ckpt_128.json"
    side.write_text(json.dumps({**json.loads(side.read_text()), "run_digest": legacy}))
    meta = json.loads((tmp_path / "learned.json").read_text())
    meta["hyperparams"].pop("policy_input")
    (tmp_path / "learned.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="policy_input"):
        _train(env_kwargs, tmp_path, timesteps=256, resume=True,
               hyperparams={**SMALL_PPO, "policy_input": "compact"})
    _train(env_kwargs, tmp_path, timesteps=256, resume=True)        # default input: compact
    meta = json.loads((tmp_path / "learned.json").read_text())
    assert meta["resumed_at"] == 128 and meta["num_timesteps"] == 256
    assert meta["hyperparams"]["policy_input"] == "full" and meta["run_digest"] == legacy
    assert json.loads((tmp_path / "checkpoints" / "ckpt_256.json").read_text())[
        "run_digest"] == legacy
    _train(env_kwargs, tmp_path, timesteps=384, resume=True)        # and again
    assert json.loads((tmp_path / "learned.json").read_text())["resumed_at"] == 256
    # another setting still differs from the checkpoint's
    with pytest.raises(ConfigError, match="hp.n_epochs"):
        _train(env_kwargs, tmp_path, timesteps=512, resume=True,
               hyperparams={**SMALL_PPO, "n_epochs": 3})


def test_typed_hyperparameters(env_kwargs, tmp_path):
    """--hp n_steps=abc is a typed error, not a TypeError inside SB3."""
    with pytest.raises(ConfigError, match="n_steps='abc'"):
        _train(env_kwargs, tmp_path, timesteps=128, hyperparams={**SMALL_PPO, "n_steps": "abc"})


def test_training_without_tensorboard_creates_no_logger_directory(env_kwargs, tmp_path,
                                                                   monkeypatch):
    """SB3 would configure its logger in a new directory ($SB3_LOGDIR, else $TMPDIR/SB3-<time>)
    on every learn(); without TensorBoard the package's file-less logger creates nothing."""
    where = tmp_path / "sb3-logdir"
    monkeypatch.setenv("SB3_LOGDIR", str(where))
    _train(env_kwargs, tmp_path / "run", timesteps=128)
    assert not where.exists()
