"""SB3 adapter of the batched vector env: PPO, MaskablePPO and A2C on ``HdMoeVectorEnv``.

``SharedVecEnv`` is a Stable-Baselines3 ``VecEnv`` over one ``hdamoe_env.env.vector.
HdMoeVectorEnv`` (N copies in one process, static data shared, the common layers batched)
instead of N ``HdMoeEnv`` in N processes. It follows SB3's conventions: autoreset with the
last observation in ``info["terminal_observation"]``, ``info["TimeLimit.truncated"]``,
Monitor-style ``info["episode"]`` (return, length, time), ``env_method("action_masks")`` for
MaskablePPO. Action designs: ``"full"`` (the env's action) and ``"ranked"`` (the translation of
``RankedBroadcastWrapper``, per copy, from the public ``ranked_mask`` / ``ranked_to_full``);
the quality reward, the residual design and replica shares need the per-process path
(``agents.learned.envs.make_vec_env`` with ``vec_backend="subproc"``).

Decisions:

* [decision] ``seed(s)`` then ``reset()`` seeds copy i with s + i, as ``DummyVecEnv`` /
  ``SubprocVecEnv`` do, so a copy's episodes equal those of the per-process backends under the
  same actions.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.env.actions import ActionLayout
from hdamoe_env.env.wrappers import ranked_mask_many, ranked_to_full_many

__all__ = ["VECTOR_ACTION_MODES", "SharedVecEnv"]

#: Action designs the batched backend supports.
VECTOR_ACTION_MODES: tuple[str, ...] = ("full", "ranked")


def _vec_env_base() -> Any:
    from stable_baselines3.common.vec_env import VecEnv

    return VecEnv


class SharedVecEnv(_vec_env_base()):  # type: ignore[misc]
    """SB3 ``VecEnv`` over ``HdMoeVectorEnv`` (module docstring).

    Args:
        env_kwargs: ``HdMoeEnv`` keyword arguments.
        n_envs: Copies N.
        action_mode: ``"full"`` or ``"ranked"``.
        num_candidates: K of the ranked action.

    Raises:
        ConfigError: An unsupported action mode, or a bad env argument.
    """

    def __init__(self, env_kwargs: dict[str, Any], n_envs: int, *, action_mode: str = "full",
                 num_candidates: int = 4) -> None:
        from gymnasium import spaces

        from hdamoe_env.env.vector import HdMoeVectorEnv

        if action_mode not in VECTOR_ACTION_MODES:
            raise ConfigError(f"the batched vector backend supports action_mode in "
                              f"{list(VECTOR_ACTION_MODES)}, got {action_mode!r}; use "
                              "vec_backend='subproc'")
        self.venv = HdMoeVectorEnv(n_envs, **env_kwargs)
        self.envs = self.venv.envs               # the copies (``HdMoeEnv``), read-only use
        base = self.envs[0]
        self.layout = ActionLayout.from_env(base)
        self.action_mode = action_mode
        self.num_candidates = int(num_candidates)
        if self.num_candidates < 1:
            raise ConfigError(f"num_candidates must be >= 1, got {num_candidates}")
        lay = self.layout
        if action_mode == "ranked":
            action_space = spaces.MultiDiscrete([self.num_candidates + 1] * lay.max_broadcast
                                                + lay.nvec[lay.max_broadcast:].tolist())
        else:
            action_space = base.action_space
        super().__init__(n_envs, base.observation_space, action_space)
        self._actions: NDArray[np.int64] | None = None
        self._obs: dict[str, NDArray[np.float32]] | None = None
        self._seed: int | None = None
        self._returns = np.zeros(n_envs)
        self._lengths = np.zeros(n_envs, dtype=np.int64)
        self._t0 = time.time()

    # ------------------------------------------------------------------ VecEnv API
    def reset(self) -> dict[str, NDArray[np.float32]]:
        """Reset every copy (seeded ``seed + i`` after ``seed(seed)``)."""
        obs, _ = self.venv.reset(seed=self._seed)
        self._seed = None
        self._obs = obs
        self._returns[:] = 0.0
        self._lengths[:] = 0
        return obs

    def step_async(self, actions: NDArray[Any]) -> None:
        """Remember the actions of the next ``step_wait``."""
        self._actions = np.asarray(actions, dtype=np.int64).reshape(self.num_envs, -1)

    def step_wait(self) -> tuple[dict[str, NDArray[np.float32]], NDArray[np.float32],
                                 NDArray[np.bool_], list[dict[str, Any]]]:
        """Step every copy; autoreset finished ones (SB3 semantics)."""
        assert self._actions is not None and self._obs is not None, "call reset() first"
        full = self._full_actions(self._actions)
        obs, rew, term, trunc, _ = self.venv.step(full)
        done = term | trunc
        self._returns += rew
        self._lengths += 1
        infos: list[dict[str, Any]] = [{} for _ in range(self.num_envs)]
        if done.any():
            idx = np.flatnonzero(done)
            terminal = {key: value[idx].copy() for key, value in obs.items()}
            reset = np.zeros(self.num_envs, dtype=bool)
            reset[idx] = True
            new_obs, _ = self.venv.reset(options={"reset_mask": reset})
            for j, i in enumerate(idx.tolist()):
                infos[i]["terminal_observation"] = {k: v[j] for k, v in terminal.items()}
                infos[i]["TimeLimit.truncated"] = bool(trunc[i] and not term[i])
                infos[i]["episode"] = {"r": float(self._returns[i]), "l": int(self._lengths[i]),
                                       "t": round(time.time() - self._t0, 6)}
            self._returns[idx] = 0.0
            self._lengths[idx] = 0
            obs = new_obs
        self._obs = obs
        return obs, rew.astype(np.float32), done, infos

    def action_masks(self) -> NDArray[np.bool_]:
        """Return bool [N, mask size] of every copy in the adapter's action space."""
        full = self.venv.action_masks()
        if self.action_mode == "full":
            return full
        assert self._obs is not None, "call reset() first"
        return ranked_mask_many(full, self.layout, self.num_candidates, self._obs["pred_load"])

    def close(self) -> None:
        """Close the vector env."""
        self.venv.close()

    def seed(self, seed: int | None = None) -> Sequence[None | int]:
        """Seed the next ``reset`` (copy i gets ``seed + i``)."""
        self._seed = seed
        return [None if seed is None else seed + i for i in range(self.num_envs)]

    def get_attr(self, attr_name: str, indices: Any = None) -> list[Any]:
        """Return an attribute of the copies."""
        return [getattr(self.envs[i], attr_name) for i in self._get_indices(indices)]

    def set_attr(self, attr_name: str, value: Any, indices: Any = None) -> None:
        """Refuse: the copies share their static data."""
        raise ConfigError("SharedVecEnv copies share their data; set_attr is not supported")

    def env_method(self, method_name: str, *method_args: Any, indices: Any = None,
                   **method_kwargs: Any) -> list[Any]:
        """Call a method per copy; ``action_masks`` answers from the batched masks."""
        idx = list(self._get_indices(indices))
        if method_name == "action_masks":
            masks = self.action_masks()
            return [masks[i] for i in idx]
        return [getattr(self.envs[i], method_name)(*method_args, **method_kwargs) for i in idx]

    def env_is_wrapped(self, wrapper_class: Any, indices: Any = None) -> list[bool]:
        """No copy is wrapped."""
        return [False for _ in self._get_indices(indices)]

    # ------------------------------------------------------------------ internals
    def _full_actions(self, actions: NDArray[np.int64]) -> NDArray[np.int64]:
        if self.action_mode == "full":
            return actions
        assert self._obs is not None
        return ranked_to_full_many(actions, self.layout, self.num_candidates,
                                   self._obs["pred_load"], self.venv.action_masks())
