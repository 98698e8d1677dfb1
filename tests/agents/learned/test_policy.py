"""Tests of agents.learned.policy: loading a learned agent (no pickle of the package's own, the
model's SHA-256 checked before loading, typed errors for damaged files) and what the loaded agent
does — residual actions equal to HDA-MoE's, replica shares applied on its bound env, batches, the
bench's resolver.

Tiny configuration of ``tests/conftest.py`` (L = 2, E = 4, 2×2 mesh, k_b = 2 forced).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")
pytest.importorskip("sb3_contrib")

from agents.learned import policy as learned  # noqa: E402
from agents.learned import train as learned_train  # noqa: E402
from hdamoe_env.config.errors import ConfigError, HdMoeError, IntegrityError  # noqa: E402

SMALL_PPO = {"n_steps": 64, "batch_size": 32, "n_epochs": 2}


def _train(env_kwargs, out, algo="maskable-ppo", timesteps=256, **kw):
    kw.setdefault("hyperparams", SMALL_PPO if "ppo" in algo else None)
    kw.setdefault("tensorboard", False)
    return learned_train.train(algo, env_kwargs, timesteps, out_dir=out, checkpoint_every=128,
                               **kw)


@pytest.fixture
def trained(env_kwargs, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    _train(env_kwargs, out, timesteps=128)
    return out


def test_no_pickle_and_sha_recorded(trained):
    """Normalisation statistics are plain arrays; learned.json records the model SHA-256."""
    meta = json.loads((trained / "learned.json").read_text())
    assert meta["model_sha256"] == learned.file_sha256(trained / "model.zip")
    assert not list(trained.rglob("*.pkl"))
    with np.load(trained / "vecnormalize.npz", allow_pickle=False) as data:
        assert "meta" in data.files
    agent = learned.load_agent(trained)
    assert isinstance(agent.vecnorm, learned.ObsNormalizer)


def test_statistics_match_sb3_normalisation(trained, make_tiny_env):
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    norm = learned.ObsNormalizer.load(trained / "vecnormalize.npz")
    env = make_tiny_env()
    obs, _ = env.reset(seed=0)
    vn = VecNormalize(DummyVecEnv([make_tiny_env]), norm_obs_keys=norm.norm_obs_keys)
    norm.apply_to(vn)
    ours, theirs = norm.normalize_obs(obs), vn.normalize_obs(obs)
    for key in obs:
        assert np.array_equal(ours[key], theirs[key]), key


def test_replaced_model_is_refused_before_loading(trained, tmp_path):
    """A replaced model.zip is not opened (no code runs); typed refusal."""
    marker = tmp_path / "marker"
    (trained / "model.zip").write_bytes(b"PK\x05\x06" + b"\0" * 18)
    with pytest.raises(IntegrityError, match="SHA-256"):
        learned.load_agent(trained)
    assert not marker.exists()


def test_legacy_pickle_statistics_are_refused(trained):
    (trained / "vecnormalize.npz").rename(trained / "vecnormalize.pkl")
    with pytest.raises(ConfigError, match="pickle"):
        learned.load_agent(trained)


def test_garbage_agent_file_is_a_typed_error(tmp_path):
    """A garbage agent file (`evaluate --agent garbage.npz` / a garbage zip) → typed error."""
    bad = tmp_path / "garbage.zip"
    bad.write_bytes(b"not a zip at all")
    with pytest.raises(HdMoeError):
        learned.load_agent(bad)
    with pytest.raises(HdMoeError):
        learned.load_agent(tmp_path / "garbage.npz")


def test_bench_resolves_learned_agent(env_kwargs, tmp_path, make_tiny_env):
    from hdamoe_env.app.methods import resolve_agent

    _train(env_kwargs, tmp_path, timesteps=128)
    agent = resolve_agent(str(tmp_path / "model.zip"), make_tiny_env())
    assert isinstance(agent, learned.LearnedAgent) and agent.vecnorm is not None


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


def test_models_load_only_when_signed_or_trusted(trained, tmp_path):
    """The trust rule: this package's signed models load; a model from elsewhere (no
    signature, a recomputed SHA-256, a checkpoint without its signature) needs trust=True."""
    import shutil

    from hdamoe_env.config import trust
    from hdamoe_env.config.errors import UntrustedFileError

    assert trust.signature_path(trained / "model.zip").exists()
    learned.load_agent(trained)                                   # signed by this key
    alone = tmp_path / "copied.zip"
    shutil.copy(trained / "model.zip", alone)                     # a model passed alone
    with pytest.raises(UntrustedFileError, match="trust"):
        learned.load_agent(alone)
    agent = learned.load_agent(alone, trust=True)
    with trust.consent():                                         # --trust-model
        learned.load_agent(alone)
    ckpt = sorted((trained / "checkpoints").glob("ckpt_*.zip"))[-1]
    # another valid model in place of model.zip, with a recomputed SHA-256 in learned.json
    import torch

    with torch.no_grad():
        next(agent.model.policy.parameters()).add_(1.0)
    agent.model.save(trained / "model.zip")
    meta = json.loads((trained / "learned.json").read_text())
    meta["model_sha256"] = learned.file_sha256(trained / "model.zip")
    (trained / "learned.json").write_text(json.dumps(meta))
    with pytest.raises(UntrustedFileError, match="does not match"):
        learned.load_agent(trained)
    trust.signature_path(ckpt).unlink()
    ckpt.with_suffix(".json").unlink()
    with pytest.raises(UntrustedFileError):
        learned.load_agent(ckpt)


def test_bench_agent_file_from_elsewhere_is_refused(trained, tmp_path, monkeypatch, capsys):
    import shutil

    from hdamoe_env.app.cli import main

    monkeypatch.chdir(tmp_path)
    shutil.copy(trained / "model.zip", tmp_path / "evil.zip")
    code = main(["bench", "--methods", "agent:evil.zip", "--seeds", "0", "--model", "mixtral",
                 "--mesh", "2x2", "--steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("hdamoe: error:") and "--trust-model" in err[-1]
    assert "Traceback" not in "\n".join(err)


def test_statistics_that_would_normalise_wrong_are_refused(trained, tmp_path):
    """All-NaN statistics, or arrays of length 1 that would broadcast, are a typed error."""
    norm = learned.ObsNormalizer.load(trained / "vecnormalize.npz")
    key = norm.norm_obs_keys[0]
    mean, var, count = norm.stats[key]
    for stats in ((np.full_like(mean, np.nan), var, count), (mean[:1], var[:1], count),
                  (mean, -np.ones_like(var), count)):
        bad = learned.ObsNormalizer({**norm.stats, key: stats}, norm.clip_obs, norm.epsilon)
        bad.save(trained / "vecnormalize.npz")
        with pytest.raises(ConfigError, match="statistics"):
            learned.load_agent(trained)


def test_agent_on_an_env_of_another_shape_is_refused_at_load(trained, make_tiny_env):
    with pytest.raises(ConfigError, match="trained on observations|trained for actions"):
        learned.load_agent(trained, env=make_tiny_env(mesh="2x4", k_b=None))


@pytest.mark.parametrize("layout", [{"gating_levels": ["x"]}, {"num_experts": "many"},
                                    {"dispatch_rules": 3}])
def test_damaged_layout_in_learned_json_is_a_config_error(trained, layout):
    meta = json.loads((trained / "learned.json").read_text())
    meta["layout"] = {**meta["layout"], **layout}
    (trained / "learned.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="layout"):
        learned.load_agent(trained)
