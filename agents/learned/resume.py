"""The resume state of a training checkpoint: everything beyond the model that training reads.

A checkpoint is taken at a rollout start (``agents.learned.train``): the previous update is
done and the rollout buffer is empty. The SB3 ``.zip`` then holds the policy and optimizer, the
observation statistics are the ``vecnormalize.npz`` beside it, and the rest is this file,
``ckpt_<steps>_state.npz`` (arrays, plus a UTF-8 JSON array ``meta``; no pickle):

* the global RNG states that SB3 draws from: torch's CPU generator (action sampling; uint8
  array), numpy's legacy ``np.random`` (minibatch permutations; MT19937 keys + position) and
  Python's ``random``;
* SB3's ``_last_obs`` (normalised, per key) and ``_last_episode_starts``, ``num_timesteps``
  and ``_n_updates`` (checked against the ``.zip``);
* ``VecNormalize``'s return statistics and running returns (the observation statistics are
  in ``vecnormalize.npz``);
* per env copy the state of its wrapper chain (``agents.learned.envs.training_env_state``:
  the ``Monitor`` counters, a quality wrapper's multiplier, ``HdMoeEnv.get_state``: decode
  steps, position, predictions drawn and the bit-generator states).

Restored before ``learn(reset_num_timesteps=False)``, a resumed run repeats the updates of an
uninterrupted one bit for bit (``tests/agents/learned/test_resume.py``). It is signed like the
model (``hdamoe_env.config.trust``) and verified on resume.

Decisions:

* [decision] Exact resume needs the per-process backend (``vec_backend="subproc"``:
  ``DummyVecEnv`` / ``SubprocVecEnv``) and the same ``n_envs``; the batched backend keeps
  state of its own, so its checkpoints carry no resume state and resume only approximately
  (the envs start new episodes), with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.fileio import atomic_write
from hdamoe_env.config.trust import verify_file, write_signature

__all__ = ["ResumeState", "load_resume_state", "resume_state_path", "save_resume_state"]

log = logging.getLogger(__name__)

_FORMAT = "hdamoe-resume-state"
#: Largest resume-state file read (bytes); a tiny run's is a few kB.
MAX_STATE_BYTES = 1 << 30


def resume_state_path(ckpt: Path) -> Path:
    """Return the resume-state file of a checkpoint (``ckpt_N.zip`` -> ``ckpt_N_state.npz``)."""
    return ckpt.with_name(ckpt.stem + "_state.npz")


@dataclass(frozen=True)
class ResumeState:
    """A resume state read from a file (:func:`load_resume_state`).

    Attributes:
        meta: The JSON part (module docstring).
        arrays: The arrays by name.
    """

    meta: dict[str, Any]
    arrays: dict[str, NDArray[Any]]

    @property
    def n_envs(self) -> int:
        """Env copies of the run."""
        return len(self.meta["envs"])

    def env_state(self, i: int) -> tuple[dict[str, Any], dict[str, NDArray[Any]]]:
        """Return (meta, arrays) of env copy ``i`` (``restore_training_env_state``)."""
        prefix = f"env{i}/"
        return self.meta["envs"][i], {k[len(prefix):]: v for k, v in self.arrays.items()
                                      if k.startswith(prefix)}

    def restore_envs(self, venv: Any) -> None:
        """Reset ``venv`` (starts the ``Monitor``s) and restore every copy's state.

        Raises:
            ConfigError: Another number of env copies.
        """
        if venv.num_envs != self.n_envs:
            raise ConfigError(f"--resume: the checkpoint was taken with {self.n_envs} env "
                              f"copies, this run has {venv.num_envs}; resume with --n-envs "
                              f"{self.n_envs}")
        venv.reset()                          # its draws are overwritten below
        for i in range(self.n_envs):
            meta, arrays = self.env_state(i)
            venv.env_method("restore_resume_state", meta, arrays, indices=[i])

    def restore_model(self, model: Any, vecnorm: Any) -> None:
        """Restore SB3's last observation, the return statistics and the global RNG states.

        Call it last before ``learn``: loading a model reseeds the global generators.

        Raises:
            ConfigError: The model's step or update count differs from the state's.
        """
        import torch

        meta, arrays = self.meta, self.arrays
        if int(model.num_timesteps) != int(meta["num_timesteps"]) or \
                int(model._n_updates) != int(meta["n_updates"]):
            raise ConfigError(f"--resume: the resume state is of step {meta['num_timesteps']} "
                              f"(update {meta['n_updates']}), the checkpoint of step "
                              f"{model.num_timesteps} (update {model._n_updates}); use a new "
                              "--out")
        keys = list(meta["last_obs_keys"])
        if keys:
            model._last_obs = {k: arrays[f"last_obs/{k}"].copy() for k in keys}
        else:
            model._last_obs = arrays["last_obs"].copy()
        model._last_episode_starts = arrays["last_episode_starts"].copy()
        if vecnorm is not None and "vecnorm" in meta:
            vn = meta["vecnorm"]
            vecnorm.ret_rms.mean = arrays["ret_rms_mean"].copy()
            vecnorm.ret_rms.var = arrays["ret_rms_var"].copy()
            vecnorm.ret_rms.count = float(vn["ret_rms_count"])
            vecnorm.returns = arrays["returns"].copy()
        torch.set_rng_state(torch.from_numpy(arrays["torch_rng"].copy()))
        npr = meta["numpy_random"]
        np.random.set_state((npr["name"], arrays["numpy_mt_keys"].copy(), int(npr["pos"]),
                             int(npr["has_gauss"]), float(npr["cached_gaussian"])))
        version, internal, gauss = meta["python_random"]
        random.setstate((int(version), tuple(int(v) for v in internal), gauss))


def save_resume_state(path: Path, model: Any, vecnorm: Any, venv: Any) -> Path:
    """Write and sign the resume state of ``model`` training on ``venv`` (module docstring).

    Args:
        path: The file (:func:`resume_state_path`).
        model: The SB3 model, at a rollout start.
        vecnorm: Its ``VecNormalize`` (None: none).
        venv: The vector env inside ``VecNormalize`` (``DummyVecEnv`` / ``SubprocVecEnv`` of
            ``agents.learned.envs``).

    Returns:
        ``path``.
    """
    import torch

    arrays: dict[str, NDArray[Any]] = {}
    env_metas = []
    for i, (meta_i, arrays_i) in enumerate(venv.env_method("resume_state")):
        env_metas.append(meta_i)
        arrays.update({f"env{i}/{k}": np.asarray(v) for k, v in arrays_i.items()})
    last = model._last_obs
    if isinstance(last, dict):
        keys = sorted(last)
        arrays.update({f"last_obs/{k}": np.asarray(last[k]) for k in keys})
    else:
        keys = []
        arrays["last_obs"] = np.asarray(last)
    arrays["last_episode_starts"] = np.asarray(model._last_episode_starts)
    arrays["torch_rng"] = torch.get_rng_state().numpy().copy()
    name, mt_keys, pos, has_gauss, cached = np.random.get_state()
    arrays["numpy_mt_keys"] = np.asarray(mt_keys)
    version, internal, gauss = random.getstate()
    meta: dict[str, Any] = {
        "format": _FORMAT, "format_version": 1,
        "num_timesteps": int(model.num_timesteps), "n_updates": int(model._n_updates),
        "last_obs_keys": keys, "envs": env_metas,
        "numpy_random": {"name": name, "pos": int(pos), "has_gauss": int(has_gauss),
                         "cached_gaussian": float(cached)},
        "python_random": [version, list(internal), gauss],
    }
    if vecnorm is not None:
        arrays["ret_rms_mean"] = np.asarray(vecnorm.ret_rms.mean, dtype=np.float64)
        arrays["ret_rms_var"] = np.asarray(vecnorm.ret_rms.var, dtype=np.float64)
        arrays["returns"] = np.asarray(vecnorm.returns)
        meta["vecnorm"] = {"ret_rms_count": float(vecnorm.ret_rms.count)}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    atomic_write(path, lambda fh: np.savez(fh, **arrays), "wb")
    write_signature(path, path.read_bytes())
    return path


def load_resume_state(path: str | os.PathLike[str]) -> ResumeState:
    """Read a resume state written by :func:`save_resume_state`, checking its signature.

    Args:
        path: The ``ckpt_<steps>_state.npz`` file.

    Raises:
        UntrustedFileError: Not signed by this user's key (and no ``--trust-model``).
        ConfigError: Not a regular file, too large, or not a resume state.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--resume: {str(path)!r} is not a regular file")
    if path.stat().st_size > MAX_STATE_BYTES:
        raise ConfigError(f"--resume: {str(path)!r} is larger than {MAX_STATE_BYTES} bytes; "
                          "not a resume state of this package")
    verify_file(path, what="--resume state")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: np.asarray(data[k]) for k in data.files}
        meta = json.loads(bytes(arrays.pop("meta")).decode())
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            raise ValueError("no resume-state meta")
        for key in ("num_timesteps", "n_updates", "envs", "last_obs_keys", "numpy_random",
                    "python_random"):
            meta[key]                                   # noqa: B018 - presence check
    except Exception as exc:  # noqa: BLE001 - any damage: one typed error naming the file
        raise ConfigError(f"--resume: {str(path)!r} is not a resume state "
                          f"({type(exc).__name__}: {exc}); use a new --out") from None
    return ResumeState(meta, arrays)
