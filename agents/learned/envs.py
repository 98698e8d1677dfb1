"""Training envs of the learned policies: the action designs and the SB3 vector env.

A training env is ``HdMoeEnv`` → ``QualityRewardWrapper`` (optional) → the action design
(ranked / full / residual) → ``ReplicaSharesWrapper`` (optional) → ``Monitor``, built in the
worker by a picklable factory (:func:`make_vec_env`: ``DummyVecEnv`` for one copy,
``SubprocVecEnv`` above).

Decisions:

* [decision] PPO and A2C sample the raw ``MultiDiscrete`` space, so their training envs use
  ``invalid_action="coerce"`` (masked slots and duplicates become "none"); MaskablePPO respects
  the per-dimension masks and uses ``duplicates="ignore"``. ``LearnedAgent.predict`` applies the
  same coercion, so a learned agent runs on a strict (``"raise"``) env such as the bench's.
* [decision] ``action_mode="ranked"`` (``hdamoe_env.env.wrappers.RankedBroadcastWrapper``, the
  default): a slot picks the c-th most-loaded predicted expert, K + 1 values instead of E + 1.
* [decision] ``action_mode="residual"`` (``agents.wrappers.ResidualHDAWrapper``) acts as a
  deviation from the greedy HDA-MoE action of the layer; value 0 of every dimension is "keep"
  and its logit starts biased (``RESIDUAL_KEEP_LOGIT``), so an untrained policy equals HDA-MoE.
  Every lever acts on the layer it is chosen for, so ``gamma = 0`` (a per-layer bandit) is the
  recommended setting (docs/results/learned/README.md: with 0.99 nothing was learned in 20 k
  steps).
* [decision] ``replica_shares=K`` (placements with redundant experts, e.g. ``eplb``) appends
  one share dimension per routed expert (``hdamoe_env.env.wrappers.ReplicaSharesWrapper``, the
  outermost wrapper) to whichever action design is inside. In residual mode the share
  dimensions get one more value, 0 = "the least-loaded rule" (``rule_value=True``), and its logit
  is biased like the residual "keep" values, so the untrained policy is HDA-MoE with the env's
  default replica dispatch; in full / ranked mode the values are the K + 1 shares, unbiased.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agents.wrappers import ResidualHDAWrapper
from hdamoe_env.config.errors import ConfigError, unknown_name
from hdamoe_env.sim.placement import Placement
from hdamoe_env.env.wrappers import (QualityRewardWrapper, RankedBroadcastWrapper,
                                     ReplicaSharesWrapper)

__all__ = ["ACTION_MODES", "VEC_BACKENDS", "check_replica_shares", "make_vec_env",
           "restore_training_env_state", "training_env_state"]


# ------------------------------------------------------------------------------------- envs
def env_arguments(env_kwargs: dict[str, Any], algo: str, fidelity: str) -> dict[str, Any]:
    """Return the ``HdMoeEnv`` kwargs of a training env (module docstring decisions)."""
    kwargs = {"fidelity": fidelity, "flatten_replicas": True, **env_kwargs}
    if algo == "maskable-ppo":
        kwargs.setdefault("duplicates", "ignore")
    else:
        kwargs.setdefault("invalid_action", "coerce")
    return kwargs


#: Vector env backends of training: ``"subproc"`` (``DummyVecEnv`` / ``SubprocVecEnv``) and
#: ``"batched"`` (``agents.learned.vector.SharedVecEnv``, one process).
VEC_BACKENDS: tuple[str, ...] = ("subproc", "batched")

#: Action designs of the training env: ``"ranked"`` (``RankedBroadcastWrapper``), ``"full"``
#: (the env's own action) and ``"residual"`` (``ResidualHDAWrapper``).
ACTION_MODES: tuple[str, ...] = ("ranked", "full", "residual")


def bias_keep(model: Any, nvec: Sequence[int], logit: float) -> None:
    """Add ``logit`` to the action-net bias of value 0 of every dimension (residual start)."""
    import torch

    starts = np.concatenate([[0], np.cumsum(np.asarray(nvec))[:-1]]).astype(int)
    with torch.no_grad():
        bias = model.policy.action_net.bias
        for s in starts:
            bias[int(s)] += float(logit)


def check_replica_shares(replica_shares: int | None, placement: Any,
                         name: str | None = None) -> int | None:
    """Validate ``replica_shares`` against the training placement; return K or None (off).

    Args:
        replica_shares: K share steps per expert (>= 1), or None / 0 for off.
        placement: What the env builds from: a ``Placement``, ``"tp"``, ``"ep"`` or a ``.npz``
            path.
        name: The placement's name for the message (default: ``placement`` if a string, else
            its ``method``).

    Raises:
        ConfigError: K is not an integer >= 1, or the placement has no redundant experts.
    """
    if replica_shares is None or (replica_shares == 0 and not isinstance(replica_shares, bool)):
        return None
    if isinstance(replica_shares, bool) or not isinstance(replica_shares, int | np.integer) \
            or replica_shares < 1:
        raise ConfigError(f"replica_shares must be an integer >= 1 (share steps per expert), got "
                          f"{replica_shares!r}; e.g. 4")
    resolved = placement
    if isinstance(placement, str) and placement.endswith(".npz"):
        resolved = Placement.load(placement)
    has = isinstance(resolved, Placement) and resolved.has_replicas
    if not has:
        label = name or (placement if isinstance(placement, str)
                         else getattr(placement, "method", "?"))
        raise ConfigError(f"replica shares need a placement with redundant experts "
                          f"(Placement.replicas), but placement {label!r} has none; use the "
                          "'eplb' placement (`--placement eplb`)")
    return int(replica_shares)


def share_rule_value(action_mode: str) -> bool:
    """Whether replica shares get value 0 = "the least-loaded rule" (residual mode only)."""
    return action_mode == "residual"


@dataclass
class _EnvFactory:
    """Picklable env constructor for ``SubprocVecEnv`` (builds ``HdMoeEnv`` in the worker).

    Wrapper order: ``HdMoeEnv`` → ``QualityRewardWrapper`` → ranked / residual →
    ``ReplicaSharesWrapper`` (it appends its share dimensions to whatever action is inside) →
    ``Monitor``.
    """

    kwargs: dict[str, Any]
    action_mode: str = "full"
    num_candidates: int = 4
    quality: dict[str, Any] | None = None
    replica_shares: int | None = None

    def __call__(self) -> Any:
        from hdamoe_env.env.environment import HdMoeEnv

        env = HdMoeEnv(**self.kwargs)
        if self.quality is not None:
            env = QualityRewardWrapper(env, **self.quality)
        if self.action_mode == "ranked":
            env = RankedBroadcastWrapper(env, self.num_candidates)
        elif self.action_mode == "residual":
            env = ResidualHDAWrapper(env)
        if self.replica_shares:                  # residual: share value 0 = the env's rule
            env = ReplicaSharesWrapper(env, self.replica_shares,
                                       rule_value=share_rule_value(self.action_mode))
        return _monitor_class()(env)


# ------------------------------------------------------------------------- resumable state
_MONITOR_CLASS: Any = None


def _monitor_class() -> Any:
    """Return SB3's ``Monitor`` with the resume methods (created once, SB3 imported lazily)."""
    global _MONITOR_CLASS
    if _MONITOR_CLASS is None:
        from stable_baselines3.common.monitor import Monitor

        class ResumableMonitor(Monitor):  # type: ignore[misc]
            """``Monitor`` whose wrapper chain's state can be read and restored (resume)."""

            def resume_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
                return training_env_state(self)

            def restore_resume_state(self, meta: dict[str, Any],
                                     arrays: dict[str, Any]) -> None:
                restore_training_env_state(self, meta, arrays)

        _MONITOR_CLASS = ResumableMonitor
    return _MONITOR_CLASS


def _chain(env: Any) -> tuple[list[Any], Any]:
    """Return (the wrappers from outside in, the ``HdMoeEnv`` inside)."""
    import gymnasium as gym

    wrappers = []
    while isinstance(env, gym.Wrapper):
        wrappers.append(env)
        env = env.env
    return wrappers, env


def training_env_state(env: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return the state of a training env (``Monitor`` → wrappers → ``HdMoeEnv``) for resume.

    The ``Monitor``'s episode counters (not its wall-clock times), the Lagrange multiplier of
    a ``QualityRewardWrapper`` and the env's :meth:`HdMoeEnv.get_state`; the ranked and
    residual wrappers keep only what they recompute from the env's observation.

    Returns:
        ``(meta, arrays)``: JSON-ready values and numpy arrays.
    """
    wrappers, base = _chain(env)
    meta: dict[str, Any] = {"format": "hdamoe-training-env-state", "wrappers": []}
    for w in wrappers:
        if hasattr(w, "episode_returns") and hasattr(w, "total_steps"):      # Monitor
            meta["monitor"] = {"rewards": [float(r) for r in w.rewards],
                               "episode_returns": [float(r) for r in w.episode_returns],
                               "episode_lengths": [int(n) for n in w.episode_lengths],
                               "total_steps": int(w.total_steps),
                               "needs_reset": bool(w.needs_reset)}
        elif isinstance(w, QualityRewardWrapper):
            meta["wrappers"].append({"class": "QualityRewardWrapper", "lam": float(w.lam)})
    env_meta, arrays = base.get_state()
    meta["env"] = env_meta
    return meta, arrays


def restore_training_env_state(env: Any, meta: dict[str, Any], arrays: dict[str, Any]) -> None:
    """Restore :func:`training_env_state` into a training env built with the same arguments.

    Raises:
        ConfigError: Not such a state, or one of another wrapper chain or configuration.
    """
    if not isinstance(meta, dict) or meta.get("format") != "hdamoe-training-env-state":
        raise ConfigError("not a training-env state written by training_env_state")
    wrappers, base = _chain(env)
    obs = base.set_state(meta["env"], arrays)                # what the wrappers last saw
    quality = [w for w in wrappers if isinstance(w, QualityRewardWrapper)]
    saved = [w for w in meta.get("wrappers", []) if w.get("class") == "QualityRewardWrapper"]
    if len(quality) != len(saved):
        raise ConfigError("the training-env state is of another wrapper chain (quality "
                          "reward); resume with the same arguments")
    for w, st in zip(quality, saved, strict=True):
        w.lam = float(st["lam"])
    for w in reversed(wrappers):                      # inside out
        if isinstance(w, RankedBroadcastWrapper | ResidualHDAWrapper):
            w.sync_observation(obs)
        elif hasattr(w, "episode_returns") and "monitor" in meta:          # Monitor
            mon = meta["monitor"]
            w.rewards = [float(r) for r in mon["rewards"]]
            w.episode_returns = [float(r) for r in mon["episode_returns"]]
            w.episode_lengths = [int(n) for n in mon["episode_lengths"]]
            w.total_steps = int(mon["total_steps"])
            w.needs_reset = bool(mon["needs_reset"])


def make_vec_env(env_kwargs: dict[str, Any], n_envs: int = 1, *, seed: int = 0,
                 start_method: str | None = None, action_mode: str = "full",
                 num_candidates: int = 4, quality: dict[str, Any] | None = None,
                 replica_shares: int | None = None, vec_backend: str = "subproc") -> Any:
    """Build ``n_envs`` monitored ``HdMoeEnv`` copies (DummyVecEnv for 1, SubprocVecEnv above).

    With ``vec_backend="batched"`` the copies live in one process instead, in the batched
    vector env (``agents.learned.vector.SharedVecEnv``; action modes ``full`` and ``ranked``,
    no quality reward or replica shares).

    Args:
        env_kwargs: Complete ``HdMoeEnv`` keyword arguments.
        n_envs: Number of env copies.
        seed: Seed of the vector env (copy i gets seed + i on its first reset).
        start_method: ``multiprocessing`` start method of ``SubprocVecEnv`` (None: SB3's).
        action_mode: ``"full"`` (the env's action), ``"ranked"`` (``RankedBroadcastWrapper``)
            or ``"residual"`` (``ResidualHDAWrapper``).
        num_candidates: K of the ranked action.
        quality: Keyword arguments of ``hdamoe_env.env.wrappers.QualityRewardWrapper`` (target,
            weight, lagrangian, dual_step, ...), or None for the latency reward only.
        replica_shares: K of ``hdamoe_env.env.wrappers.ReplicaSharesWrapper`` (outermost action
            wrapper; the placement needs redundant experts), or None for off.
        vec_backend: ``"subproc"`` (one process per copy above one copy) or ``"batched"``
            (``VEC_BACKENDS``).

    Returns:
        A seeded SB3 ``VecEnv``.

    Raises:
        ConfigError: Bad ``n_envs``, action mode, quality arguments or ``replica_shares`` (or a
            placement without redundant experts).
    """
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    if n_envs < 1:
        raise ConfigError(f"n_envs must be >= 1, got {n_envs}")
    if action_mode not in ACTION_MODES:
        raise unknown_name("action mode", action_mode, ACTION_MODES)
    if quality is not None:                      # validate once, in this process
        QualityRewardWrapper.validate(**quality)
    replica_shares = check_replica_shares(replica_shares, env_kwargs.get("placement", "ep"))
    if vec_backend not in VEC_BACKENDS:
        raise unknown_name("vec backend", vec_backend, VEC_BACKENDS)
    if vec_backend == "batched":
        from agents.learned.vector import SharedVecEnv

        if quality is not None or replica_shares:
            raise ConfigError("vec_backend='batched' supports neither the quality reward nor "
                              "replica shares; use vec_backend='subproc'")
        shared = SharedVecEnv(dict(env_kwargs), n_envs, action_mode=action_mode,
                              num_candidates=num_candidates)
        shared.seed(seed)
        return shared
    fns = [_EnvFactory(dict(env_kwargs), action_mode, num_candidates,
                       None if quality is None else dict(quality), replica_shares)
           for _ in range(n_envs)]
    venv = DummyVecEnv(fns) if n_envs == 1 else SubprocVecEnv(fns, start_method=start_method)
    venv.seed(seed)
    return venv

