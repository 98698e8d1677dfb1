"""The examples/ scripts and the RL Zoo hyperparameter file, in tiny configurations."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import hdamoe_env  # noqa: F401 - registers the ids

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TINY = ["--model", "mixtral-8x7b", "--mesh", "2x2", "--batch", "8"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_heuristic_agent_example(capsys):
    path = EXAMPLES / "heuristic_agent.py"
    assert len(path.read_text().splitlines()) <= 40
    tbt = _load("heuristic_agent").main([*TINY, "--steps", "2"])
    out = capsys.readouterr().out
    assert tbt > 0 and out.count("decode step") == 2 and "episode mean TBT" in out


def test_maskable_ppo_example(capsys, tmp_path):
    pytest.importorskip("sb3_contrib")
    fps = _load("train_maskable_ppo").main([*TINY, "--timesteps", "64", "--n-steps", "32",
                                            "--k-b", "2", "--save", str(tmp_path / "m.zip")])
    out = capsys.readouterr().out
    assert fps > 0 and "MaskablePPO: 64 env steps" in out and "evaluation episode" in out
    assert (tmp_path / "m.zip").exists()


def _wrapper(entry):
    """Resolve one RL Zoo ``env_wrapper`` entry: "module.Class" or {"module.Class": kwargs}."""
    name, kwargs = (entry, {}) if isinstance(entry, str) else next(iter(entry.items()))
    module, _, cls = name.rpartition(".")
    return getattr(importlib.import_module(module), cls), dict(kwargs or {})


def test_rl_zoo_hyperparameters_parse_and_wrappers_apply():
    yaml = pytest.importorskip("yaml")
    path = EXAMPLES / "hyperparams" / "ppo_mask.yml"
    text = path.read_text()
    assert "hdamoe train --algo maskable-ppo --hyperparams examples/hyperparams/ppo_mask.yml" \
        in text                                                         # the command
    assert "rl_zoo3 itself is not supported" in text                    # no Zoo claim
    conf = yaml.safe_load(text)
    assert set(conf) == {"hdamoe_env/HdMoE-analytic-v1", "hdamoe_env/HdMoE-Mixtral-v1"}
    for env_id, hp in conf.items():
        assert env_id in gym.registry and hp["policy"] == "MultiInputPolicy"
        assert isinstance(hp["n_timesteps"], float) and hp["n_steps"] > 0
        env = gym.make(env_id, mesh="2x2", batch=8, trace_tokens=512, trace_requests=8)
        for entry in hp["env_wrapper"]:
            cls, kwargs = _wrapper(entry)
            assert issubclass(cls, gym.Wrapper)
            env = cls(env, **kwargs)
        obs, _ = env.reset(seed=0)
        assert env.observation_space.contains(obs)
        assert all(v.ndim == 1 for v in obs.values())                  # flattened replicas
        env.action_space.seed(0)
        for _ in range(5):
            mask = np.asarray(env.get_wrapper_attr("action_masks")(), dtype=bool)
            assert mask.size == int(np.sum(env.action_space.nvec))
            parts = np.split(mask.astype(np.int8), np.cumsum(env.action_space.nvec)[:-1])
            obs, *_ = env.step(env.action_space.sample(mask=tuple(parts)))


@pytest.mark.parametrize("section, mode, k", [("hdamoe_env/HdMoE-analytic-v1", "ranked", 4),
                                              ("hdamoe_env/HdMoE-Mixtral-v1", "residual", 4)])
def test_rl_zoo_file_trains_with_hdamoe_train(tmp_path, section, mode, k):
    """One dialect: the Zoo-format file runs with `hdamoe train --hyperparams` (env_wrapper ->
    action design, normalize, policy_kwargs and the algorithm's fields)."""
    pytest.importorskip("sb3_contrib")
    import json

    from hdamoe_env.app.cli import main

    out = tmp_path / "run"
    code = main(["-q", "train", "--algo", "maskable-ppo", "--hyperparams",
                 str(EXAMPLES / "hyperparams" / "ppo_mask.yml"), "--hyperparams-section", section,
                 *TINY, "--timesteps", "32", "--hp", "n_steps=32", "--hp", "batch_size=32",
                 "--no-eval", "--no-tensorboard", "--out", str(out)])
    assert code == 0
    meta = json.loads((out / "learned.json").read_text())
    assert meta["action_mode"] == mode and meta["num_candidates"] == k
    assert meta["normalize_obs"] is True and meta["hyperparams"]["n_epochs"] == 10
    assert meta["hyperparams"]["ent_coef"] == 0.005 and meta["num_timesteps"] >= 32


def _documented_names():
    """Yield (file, dotted name) for every project import and dotted reference in the docs.

    Sources: ``import`` / ``from ... import`` lines in README.md, docs/**/*.md and examples/, and
    backticked dotted names such as ``hdamoe_env.noc.des.simulate_messages`` in the Markdown.
    """
    import re

    root = Path(__file__).resolve().parents[1]
    files = [root / "README.md", *sorted((root / "docs").rglob("*.md")),
             *sorted((root / "examples").rglob("*.py"))]
    packages = "hdamoe_env|agents|baselines|traces"
    for path in files:
        text = path.read_text()
        for m in re.finditer(rf"^\s*from ((?:{packages})[\w.]*) import ([\w, ()]+)", text, re.M):
            for item in m.group(2).strip("() ").split(","):
                if item.split():
                    yield path.name, f"{m.group(1)}.{item.split()[0].strip('()')}"
        for m in re.finditer(rf"^\s*import ((?:{packages})[\w.]*)", text, re.M):
            yield path.name, m.group(1)
        if path.suffix == ".md":
            for m in re.finditer(rf"`((?:{packages})(?:\.\w+)+)", text):
                yield path.name, m.group(1)


def test_every_documented_import_and_dotted_name_resolves():
    """README, docs and examples name only modules and attributes that exist."""
    import importlib

    missing = []
    for where, dotted in sorted(set(_documented_names())):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(f"{where}: {dotted}")
            break
        else:
            missing.append(f"{where}: {dotted}")
    assert not missing, "\n".join(missing)
