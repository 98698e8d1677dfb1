"""Tests of agents.learned.resume: a resumed training run repeats an uninterrupted one bit for
bit (policy, optimizer and normalisation statistics), after a clean stop at a checkpoint and
after SIGKILL (slow); the resume state is signed and refused when changed.

Tiny configuration of ``tests/agents/learned/test_train.py`` (``env_kwargs`` of conftest).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")
pytest.importorskip("sb3_contrib")

from agents.learned import train as learned_train  # noqa: E402
from agents.learned.resume import load_resume_state, resume_state_path  # noqa: E402
from hdamoe_env.config.errors import ConfigError, UntrustedFileError  # noqa: E402

SMALL_PPO = {"n_steps": 32, "batch_size": 16, "n_epochs": 2}


def _train(env_kwargs, out, timesteps, **kw):
    kw.setdefault("hyperparams", SMALL_PPO)
    return learned_train.train("maskable-ppo", env_kwargs, timesteps, out_dir=out,
                               checkpoint_every=64, tensorboard=False, **kw)


def _tensors(zip_path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the policy and the optimizer state in an SB3 zip, as numpy arrays."""
    import torch

    out: dict[str, np.ndarray] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, torch.Tensor):
            out[prefix] = value.detach().numpy().copy()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)
        elif isinstance(value, int | float):
            out[prefix] = np.asarray(value)

    with zipfile.ZipFile(zip_path) as zf:
        for name in ("policy.pth", "policy.optimizer.pth"):
            walk(name, torch.load(io.BytesIO(zf.read(name)), weights_only=True))
    return out


def _stats(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def _identical(a: Path, b: Path) -> bool:
    ta, tb = _tensors(a / "model.zip"), _tensors(b / "model.zip")
    sa, sb = _stats(a / "vecnormalize.npz"), _stats(b / "vecnormalize.npz")
    return (ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta)
            and sa.keys() == sb.keys() and all(np.array_equal(sa[k], sb[k]) for k in sa))


def test_resume_after_a_clean_stop_repeats_the_uninterrupted_run(env_kwargs, tmp_path):
    """Train 96 steps; stop at 64 and resume to 96: the same weights, optimizer, statistics.

    Episodes are 6 steps (3 decode steps of 2 layers) and a rollout 32, so the checkpoint at 64
    is at a rollout start in the middle of an episode. A run resumed without the resume state
    (as before it existed) differs, so the comparison can fail.
    """
    ref, run, stale = tmp_path / "ref", tmp_path / "run", tmp_path / "stale"
    _train({**env_kwargs, "steps_per_episode": 3}, ref, 96)
    for out in (run, stale):
        _train({**env_kwargs, "steps_per_episode": 3}, out, 64)
    ckpt = run / "checkpoints" / "ckpt_64.zip"
    state = load_resume_state(resume_state_path(ckpt))
    assert state.meta["num_timesteps"] == 64 and state.n_envs == 1
    env = state.meta["envs"][0]["env"]                      # mid-episode: 64 = 10·6 + 4
    assert env["decode_step"] * 2 + env["layer"] == 4 and not env["episode_over"]
    assert not list(tmp_path.rglob("*.pkl"))
    resume_state_path(stale / "checkpoints" / "ckpt_64.zip").unlink()
    for out in (run, stale):
        _train({**env_kwargs, "steps_per_episode": 3}, out, 96, resume=True)
    assert json.loads((run / "learned.json").read_text())["resumed_at"] == 64
    assert _identical(ref, run)
    assert not _identical(ref, stale)


@pytest.mark.slow
@pytest.mark.parametrize("algo, extra", [
    ("ppo", {"action_mode": "full"}),
    ("a2c", {"action_mode": "ranked", "hyperparams": {"n_steps": 8}}),
    ("maskable-ppo", {"action_mode": "residual"}),
    ("maskable-ppo", {"quality": {"target": 0.99, "weight": 100.0, "lagrangian": True,
                                  "dual_step": 50.0}}),
], ids=["ppo-full", "a2c-ranked", "residual", "quality-lagrangian"])
def test_resume_is_exact_for_other_algorithms_and_designs(env_kwargs, tmp_path, algo, extra):
    kw = {**env_kwargs, "steps_per_episode": 3}
    extra = {"hyperparams": SMALL_PPO, **extra}

    def run(out, steps, resume=False):
        learned_train.train(algo, kw, steps, out_dir=out, checkpoint_every=64,
                            tensorboard=False, resume=resume, **extra)

    run(tmp_path / "ref", 160)
    run(tmp_path / "run", 64)
    run(tmp_path / "run", 160, True)
    assert _identical(tmp_path / "ref", tmp_path / "run")


def test_resume_state_is_signed_and_checked(env_kwargs, tmp_path):
    _train(env_kwargs, tmp_path, 64)
    path = resume_state_path(tmp_path / "checkpoints" / "ckpt_64.zip")
    assert path.with_name(path.name + ".sig").exists()
    data = bytearray(path.read_bytes())
    data[-40] ^= 1                                         # one bit changed
    path.write_bytes(bytes(data))
    with pytest.raises(UntrustedFileError, match="resume state"):
        _train(env_kwargs, tmp_path, 128, resume=True)
    path.write_bytes(b"not an npz")                          # consent does not make it valid
    from hdamoe_env.config.trust import consent

    with consent(), pytest.raises(ConfigError, match="not a resume state"):
        _train(env_kwargs, tmp_path, 128, resume=True)


def test_resume_refuses_another_number_of_envs(env_kwargs, tmp_path):
    _train(env_kwargs, tmp_path, 64)
    with pytest.raises(ConfigError, match="--n-envs 1"):
        _train(env_kwargs, tmp_path, 128, resume=True, n_envs=2)


# ------------------------------------------------------------------------------- SIGKILL
_SCRIPT = """
import json, sys
from hdamoe_env.config.specs import ModelSpec
from agents.learned import train
kw = json.loads(sys.argv[1])
kw["model"] = ModelSpec(**kw["model"])
train.train("maskable-ppo", kw, int(sys.argv[3]), out_dir=sys.argv[2], checkpoint_every=64,
            tensorboard=False, n_envs=int(sys.argv[4]), resume=sys.argv[5] == "1",
            hyperparams={"n_steps": 32, "batch_size": 16, "n_epochs": 2})
"""


def _spawn(env_kwargs, out: Path, timesteps: int, n_envs: int, resume: bool
           ) -> subprocess.Popen:
    import dataclasses

    kw = {**env_kwargs, "model": dataclasses.asdict(env_kwargs["model"])}
    return subprocess.Popen([sys.executable, "-c", _SCRIPT, json.dumps(kw), str(out),
                             str(timesteps), str(n_envs), "1" if resume else "0"],
                            env={**os.environ}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


@pytest.mark.slow
@pytest.mark.parametrize("n_envs", [1, 2])
def test_resume_after_sigkill_repeats_the_uninterrupted_run(env_kwargs, tmp_path, n_envs):
    """A run killed with SIGKILL after a checkpoint and resumed equals an uninterrupted one."""
    timesteps = 512 * n_envs
    kw = {**env_kwargs, "steps_per_episode": 3}
    ref = _spawn(kw, tmp_path / "ref", timesteps, n_envs, False)
    assert ref.wait(timeout=900) == 0, ref.stderr.read().decode()[-2000:]
    proc = _spawn(kw, tmp_path / "run", timesteps, n_envs, False)
    ckpts = tmp_path / "run" / "checkpoints"
    deadline = time.monotonic() + 600
    while not list(ckpts.glob("ckpt_*.json")) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it was killed"
    assert not (tmp_path / "run" / "model.zip").exists()
    resumed = _spawn(kw, tmp_path / "run", timesteps, n_envs, True)
    assert resumed.wait(timeout=900) == 0, resumed.stderr.read().decode()[-2000:]
    meta = json.loads((tmp_path / "run" / "learned.json").read_text())
    assert 0 < meta["resumed_at"] < timesteps
    assert _identical(tmp_path / "ref", tmp_path / "run")


def test_resume_skips_a_checkpoint_killed_while_written(env_kwargs, tmp_path, caplog):
    """A checkpoint without its sidecar (written last) is skipped for the one before it."""
    _train(env_kwargs, tmp_path, 96)
    (tmp_path / "checkpoints" / "ckpt_96.json").unlink()
    with caplog.at_level("WARNING"):
        _train(env_kwargs, tmp_path, 128, resume=True)
    assert "ckpt_96.zip is incomplete" in caplog.text
    assert json.loads((tmp_path / "learned.json").read_text())["resumed_at"] == 64
