"""Tests of hdamoe_env.app.evaluate: the evaluation of a learned agent against the heuristics is
deterministic (tiny env of tests/conftest.py, a few hundred training steps).
"""

from __future__ import annotations

import pytest

pytest.importorskip("stable_baselines3")
pytest.importorskip("sb3_contrib")

from agents.learned import train as learned_train  # noqa: E402
from hdamoe_env.app import evaluate as evaluate_app  # noqa: E402

SMALL_PPO = {"n_steps": 64, "batch_size": 32, "n_epochs": 2}


def _train(env_kwargs, out, algo="maskable-ppo", timesteps=256, **kw):
    kw.setdefault("hyperparams", SMALL_PPO if "ppo" in algo else None)
    kw.setdefault("tensorboard", False)
    return learned_train.train(algo, env_kwargs, timesteps, out_dir=out, checkpoint_every=128,
                               **kw)


def test_deterministic_evaluation(env_kwargs, tmp_path):
    _train(env_kwargs, tmp_path, timesteps=128)
    kw = dict(seeds=[5, 6], steps=2, fidelities=["des"], baselines=["noop"])
    a = evaluate_app.evaluate(tmp_path, **kw)
    b = evaluate_app.evaluate(tmp_path, **kw)
    def tbt(res):
        return [(r["method"], r["seed"], r["tbt_steps_us"]) for r in res["records"]]

    assert tbt(a) == tbt(b)
    assert any(r["method"] == "learned" for r in a["records"])
