"""Learned online policies: Stable-Baselines3 / sb3-contrib training, loading and evaluation.

Implements issue 5 on top of paper-model.md §10–11 (the online decisions of ``HdMoE-v0``: the
pre-broadcast slots, the dispatch rule and the gating level of every MoE layer). A policy is
trained with PPO, MaskablePPO (the env's ``action_masks()``) or A2C on vectorised copies of the
env, usually on the γ-calibrated analytic twin (``fidelity="analytic"``, fast), and evaluated by
the benchmark harness (``hdamoe_env.app.bench``) against the paper's greedy agents on held-out
request streams, on the twin and on the DES.

This is the only module that imports or seeds torch (style.md R7); torch, stable-baselines3 and
sb3-contrib are imported lazily (R12), so ``import agents`` stays light.

Saved agent (a directory ``out_dir``):

* ``model.zip`` — the SB3 model;
* ``vecnormalize.pkl`` — the observation-normalisation statistics (``VecNormalize``), when used;
* ``learned.json`` — algorithm, hyperparameters, env arguments, seeds, step count, wall time;
* ``checkpoints/ckpt_<steps>.zip`` (+ ``_vecnormalize.pkl``) every ``checkpoint_every`` steps,
  written atomically (temporary file + rename), used by ``resume=True``;
* ``tb/`` — TensorBoard logs (SB3's ``train/*`` and ``rollout/*`` plus ``latency/total_us`` and
  ``latency/tbt_us`` from the env's ``info``);
* ``eval.json``, ``eval.md`` — the held-out evaluation (bench records and table).

Decisions:

* [decision] Observations normalised: ``pred_load``, ``node_load`` and ``link_busy`` (small,
  skewed, layer-dependent magnitudes) by running mean/std (``VecNormalize``, clip 10); the
  already-bounded static features ``replicas``, ``layer`` and ``budget`` are left raw (a
  near-constant feature would be blown up by its tiny variance). Rewards are not normalised
  (they are already ≈ −latency ÷ TP latency ≈ −1).
* [decision] PPO and A2C sample the raw ``MultiDiscrete`` space, so their training envs use
  ``invalid_action="coerce"`` (masked slots and duplicates become "none"); MaskablePPO respects
  the per-dimension masks and uses ``duplicates="ignore"``. ``LearnedAgent.predict`` applies the
  same coercion, so a learned agent runs on a strict (``"raise"``) env such as the bench's.
* [decision] Held-out streams: a synthetic training trace with ``trace_seed`` s is evaluated on
  ``trace_seed`` s + 1000 (a different set of requests), with episode seeds 10 000 + i, never
  used in training (training episodes are seeded by SB3 from ``seed``). For a real trace, pass
  ``eval_trace`` (e.g. another category); without it the same trace is used with unseen
  episode seeds, and the table says so.
* [decision] ``action_mode="residual"`` (:class:`ResidualHDA`) acts as a deviation from the
  greedy HDA-MoE action of the layer; value 0 of every dimension is "keep" and its logit starts
  biased (:data:`RESIDUAL_KEEP_LOGIT`), so an untrained policy equals HDA-MoE. Every lever acts on
  the layer it is chosen for, so ``gamma = 0`` (a per-layer bandit) is the recommended setting
  (docs/results/learned/README.md: with 0.99 nothing was learned in 20 k steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import os
import pickle
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from agents.base import ActionLayout
from hdamoe_env.errors import ConfigError, DependencyNotInstalled, unknown_name

__all__ = [
    "ALGORITHMS",
    "HYPERPARAMS",
    "A2CHyperparams",
    "LearnedAgent",
    "MaskablePPOHyperparams",
    "PPOHyperparams",
    "add_evaluate_parser",
    "add_train_parser",
    "cmd_evaluate",
    "cmd_train",
    "evaluate",
    "latest_checkpoint",
    "load_agent",
    "make_vec_env",
    "plot_learning_curve",
    "read_scalars",
    "train",
]

log = logging.getLogger(__name__)

RL_EXTRA = '`pip install "hdamoe-env[rl]"`'
#: Observation keys normalised by ``VecNormalize`` (module docstring).
NORM_OBS_KEYS: tuple[str, ...] = ("pred_load", "node_load", "link_busy")
MODEL_FILE, VECNORM_FILE, META_FILE = "model.zip", "vecnormalize.pkl", "learned.json"
#: Offset of the held-out synthetic trace seed and of the evaluation episode seeds.
HELD_OUT_TRACE_OFFSET, EVAL_SEED_BASE = 1000, 10_000
#: Heuristic agents every evaluation compares against (static, greedy pre-broadcast only,
#: gating only, HD-MoE, HDA-MoE).
DEFAULT_BASELINES: tuple[str, ...] = ("noop", "greedy-prebroadcast", "hardware-aware-gating",
                                      "hd-moe", "hda-moe")
#: Agent aliases of ``hdamoe evaluate``.
AGENT_ALIASES = {"greedy-hda": "hda-moe", "greedy-hd": "hd-moe", "greedy": "greedy-prebroadcast",
                 "static": "noop"}


# ------------------------------------------------------------------------- hyperparameters
@dataclass(frozen=True)
class PPOHyperparams:
    """PPO hyperparameters (RL-Zoo style; sized for ~10⁴–10⁵ steps on the analytic twin).

    Attributes:
        n_steps: Rollout steps per env before an update (n_steps · n_envs per update; about
            2.5 episodes of DeepSeek-V2-Lite at 4 decode steps × 26 layers).
        batch_size: Minibatch size of the SGD epochs.
        n_epochs: SGD passes over each rollout.
        learning_rate: Adam step size.
        gamma: Discount per env step (one MoE layer); 0.99 ≈ a 100-layer horizon, about one
            decode step of a 26-layer model × 4.
        gae_lambda: GAE λ.
        clip_range: PPO ratio clip.
        ent_coef: Entropy bonus (keeps the many slot heads exploring).
        vf_coef: Value-loss weight.
        max_grad_norm: Gradient clip.
        net_arch: Hidden layers of the policy and value MLPs (shared extractor flattens the Dict).
    """

    n_steps: int = 256
    batch_size: int = 64
    n_epochs: int = 10
    learning_rate: float = 3e-4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_range: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    net_arch: tuple[int, ...] = (64, 64)


@dataclass(frozen=True)
class MaskablePPOHyperparams(PPOHyperparams):
    """MaskablePPO hyperparameters: PPO's, with a smaller entropy bonus (masks already prune)."""

    ent_coef: float = 0.005


@dataclass(frozen=True)
class A2CHyperparams:
    """A2C hyperparameters (RL-Zoo defaults for small discrete tasks).

    Attributes:
        n_steps: Rollout steps per env before an update.
        learning_rate: RMSprop step size.
        gamma: Discount per env step.
        gae_lambda: GAE λ (1.0 = plain n-step returns).
        ent_coef: Entropy bonus.
        vf_coef: Value-loss weight.
        max_grad_norm: Gradient clip.
        net_arch: Hidden layers of the policy and value MLPs.
    """

    n_steps: int = 8
    learning_rate: float = 7e-4
    gamma: float = 0.99
    gae_lambda: float = 1.0
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    net_arch: tuple[int, ...] = (64, 64)


HYPERPARAMS: dict[str, type[Any]] = {"ppo": PPOHyperparams,
                                     "maskable-ppo": MaskablePPOHyperparams,
                                     "a2c": A2CHyperparams}
ALGORITHMS: tuple[str, ...] = tuple(HYPERPARAMS)


def _algo_key(algo: str) -> str:
    key = algo.lower().replace("_", "-")
    key = {"maskableppo": "maskable-ppo", "maskable": "maskable-ppo"}.get(key, key)
    if key not in HYPERPARAMS:
        raise unknown_name("algorithm", algo, HYPERPARAMS)
    return key


def _algo_class(algo: str) -> type[Any]:
    """Import the SB3 / sb3-contrib class of ``algo`` (lazy, R12)."""
    try:
        if algo == "maskable-ppo":
            from sb3_contrib import MaskablePPO

            return MaskablePPO
        from stable_baselines3 import A2C, PPO

        return {"ppo": PPO, "a2c": A2C}[algo]
    except ImportError as exc:
        raise DependencyNotInstalled(f"training and loading learned agents needs torch, "
                                     f"stable-baselines3 and sb3-contrib; run {RL_EXTRA}") from exc


def _model_kwargs(hp: Any) -> dict[str, Any]:
    kwargs = dataclasses.asdict(hp)
    net_arch = list(kwargs.pop("net_arch"))
    kwargs["policy_kwargs"] = {"net_arch": {"pi": net_arch, "vf": list(net_arch)}}
    return kwargs


# ------------------------------------------------------------------------------ threads, seeds
def _set_threads(threads: int = 1) -> None:
    """One torch thread (dependencies.md §6); children inherit ``OMP_NUM_THREADS``."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(threads))
    torch.set_num_threads(int(threads))


def _seed_everything(seed: int) -> None:
    """Seed torch (the only place in the package, style.md R7) and SB3's global helpers."""
    import torch
    from stable_baselines3.common.utils import set_random_seed

    set_random_seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------- envs
def _env_arguments(env_kwargs: dict[str, Any], algo: str, fidelity: str) -> dict[str, Any]:
    """Return the ``HdMoeEnv`` kwargs of a training env (module docstring decisions)."""
    kwargs = {"fidelity": fidelity, "flatten_replicas": True, **env_kwargs}
    if algo == "maskable-ppo":
        kwargs.setdefault("duplicates", "ignore")
    else:
        kwargs.setdefault("invalid_action", "coerce")
    return kwargs


ACTION_MODES: tuple[str, ...] = ("ranked", "full", "residual")


def ranked_candidates(pred_load: NDArray[Any], allowed: NDArray[np.bool_],
                      num_candidates: int) -> NDArray[np.int64]:
    """Return up to ``num_candidates`` broadcastable experts, highest predicted load first.

    Args:
        pred_load: float [E] predicted tokens per expert ÷ B (observation ``pred_load``).
        allowed: bool [E] experts the env allows in a slot (not already on every node).
        num_candidates: K.

    Returns:
        int64 [≤ K] expert ids with positive predicted load, by decreasing load (ties: lower id).
    """
    load = np.where(allowed, np.asarray(pred_load, dtype=np.float64).reshape(-1), -1.0)
    order = np.lexsort((np.arange(load.size), -load))
    return order[load[order] > 0][:num_candidates].astype(np.int64)


def ranked_mask(full_mask: NDArray[np.bool_], layout: ActionLayout,
                num_candidates: int, pred_load: NDArray[Any]) -> NDArray[np.bool_]:
    """Map a flat ``HdMoE-v0`` mask to the ranked action space (:class:`RankedBroadcast`)."""
    parts = layout.split_mask(full_mask)
    cands = ranked_candidates(pred_load, parts[0][:layout.num_experts], num_candidates)
    slots = []
    for slot in range(layout.max_broadcast):
        m = np.zeros(num_candidates + 1, dtype=bool)
        m[num_candidates] = True                                    # "none" is always allowed
        if parts[slot][:layout.num_experts].any():
            m[:cands.size] = parts[slot][cands]
        slots.append(m)
    return np.concatenate([*slots, parts[-2], parts[-1]])


def ranked_to_full(action: NDArray[Any], layout: ActionLayout, num_candidates: int,
                   pred_load: NDArray[Any], full_mask: NDArray[np.bool_] | None
                   ) -> NDArray[np.int64]:
    """Translate a ranked action into an ``HdMoE-v0`` action (slot value c → c-th candidate)."""
    allowed = (np.ones(layout.num_experts, dtype=bool) if full_mask is None
               else layout.split_mask(full_mask)[0][:layout.num_experts])
    cands = ranked_candidates(pred_load, allowed, num_candidates)
    action = np.asarray(action, dtype=np.int64).reshape(-1)
    full = np.full(layout.max_broadcast + 2, layout.none, dtype=np.int64)
    for slot in range(layout.max_broadcast):
        c = int(action[slot])
        if c < cands.size:
            full[slot] = cands[c]
    full[-2:] = action[-2:]
    return full


class RankedBroadcast:
    """Action design for learning: slot value c picks the c-th most-loaded predicted expert.

    The raw ``HdMoE-v0`` slot has E + 1 values (E = 64 for DeepSeek-V2-Lite), so an untrained
    policy almost never samples "none" (1/65) and spends most of its steps learning that one
    value. Here a slot has K + 1 values: candidate c < K is the c-th broadcastable expert by
    predicted load ``pred_load`` (the greedy's own priority order, §10.5), K = none. Dispatch
    and gating are unchanged. ``action_masks()`` maps the env's mask. Implemented as a
    ``gymnasium.Wrapper`` built by :func:`_wrap_ranked` (gymnasium is a core dependency).
    """


def _wrap_ranked(env: Any, num_candidates: int) -> Any:
    import gymnasium as gym
    from gymnasium import spaces

    class _Ranked(gym.Wrapper, RankedBroadcast):  # type: ignore[misc]
        def __init__(self, env: Any) -> None:
            super().__init__(env)
            self.layout = ActionLayout.from_env(env)
            self.num_candidates = int(num_candidates)
            lay = self.layout
            self.action_space = spaces.MultiDiscrete(
                [self.num_candidates + 1] * lay.max_broadcast
                + [len(lay.dispatch_rules), len(lay.gating_levels)])
            self._obs: Any = None

        def reset(self, **kwargs: Any) -> Any:
            obs, info = self.env.reset(**kwargs)
            self._obs = obs
            return obs, info

        def action_masks(self) -> NDArray[np.bool_]:
            return ranked_mask(self.env.unwrapped.action_masks(), self.layout,
                               self.num_candidates, self._obs["pred_load"])

        def step(self, action: Any) -> Any:
            full = ranked_to_full(action, self.layout, self.num_candidates,
                                  self._obs["pred_load"], self.env.unwrapped.action_masks())
            obs, reward, terminated, truncated, info = self.env.step(full)
            self._obs = obs
            return obs, reward, terminated, truncated, info

    return _Ranked(env)


# --------------------------------------------------------------------- residual action mode
#: Broadcast operations of the residual action (dimension 0), applied to the greedy's set.
RESIDUAL_OPS: tuple[str, ...] = ("keep", "drop_last", "drop_all", "swap_last")
#: Logit added to the "keep the greedy's choice" value of every residual dimension at
#: initialisation, so that an untrained policy acts like HDA-MoE (p(keep) ≈ 0.7–0.9).
RESIDUAL_KEEP_LOGIT = 2.0


@dataclass(frozen=True)
class ResidualChoice:
    """The greedy reference's decision for one layer and the deviations it admits.

    Attributes:
        base: int64 [max_broadcast + 2] the reference agent's (HDA-MoE's) action.
        slots: Per broadcast op of :data:`RESIDUAL_OPS`, the expert list it yields, or None when
            the op is unavailable (nothing to drop or swap) or equal to an earlier op.
        mask: bool [4 + R + G] mask of the residual action (model space).
    """

    base: NDArray[np.int64]
    slots: tuple[tuple[int, ...] | None, ...]
    mask: NDArray[np.bool_]


class ResidualHDA:
    """Residual action design: HDA-MoE's greedy decision plus a learned deviation.

    The policy acts in ``MultiDiscrete([4, R, G])`` (R dispatch rules, G gating levels):

    * dimension 0, the broadcast op on the greedy pre-broadcast set of the layer (§10.5):
      ``keep`` it, ``drop_last`` pick, ``drop_all`` (no broadcast), or ``swap_last`` pick for
      the next expert the greedy priority would choose;
    * dimension 1, a dispatch-rule offset: rule (greedy's + v) mod R;
    * dimension 2, a gating-level offset: level index (greedy's + v) mod G.

    Value 0 of every dimension reproduces the reference agent's action exactly, and
    :func:`train` biases those logits by :data:`RESIDUAL_KEEP_LOGIT`, so learning starts at the
    greedy agent's performance and explores deviations from it. The env's mask is mapped onto
    the residual space (unavailable or redundant ops masked; "keep" always allowed).

    Args:
        reference: The greedy agent (an ``agents.composite.CompositeAgent``, by default
            HDA-MoE built from the env's specs) whose action is the residual's origin.
        num_nodes: D, to reshape a flat ``replicas`` observation to [E, D].
    """

    def __init__(self, reference: Any, num_nodes: int) -> None:
        self.reference = reference
        self.layout: ActionLayout = reference.layout
        self.num_nodes = int(num_nodes)
        lay = self.layout
        self.nvec = np.array([len(RESIDUAL_OPS), len(lay.dispatch_rules),
                              len(lay.gating_levels)], dtype=np.int64)

    @classmethod
    def from_env(cls, env: Any) -> ResidualHDA:
        """Build the residual design with HDA-MoE from an ``HdMoeEnv``'s specs."""
        from agents.composite import HDAMoEAgent

        base = getattr(env, "unwrapped", env)
        return cls(HDAMoEAgent.from_env(base), int(base.num_nodes))

    def _observation(self, observation: dict[str, Any]) -> dict[str, NDArray[Any]]:
        obs = dict(observation)
        obs["replicas"] = np.asarray(observation["replicas"]).reshape(
            self.layout.num_experts, self.num_nodes)
        return obs

    def choose(self, observation: dict[str, Any],
               full_mask: NDArray[np.bool_] | None) -> ResidualChoice:
        """Return the reference decision and the residual options for one raw observation.

        Args:
            observation: One (unbatched, unnormalised) ``HdMoE-v0`` observation.
            full_mask: The env's flat ``action_masks()`` (None: everything allowed).
        """
        lay = self.layout
        obs = self._observation(observation)
        parts = None if full_mask is None else lay.split_mask(full_mask)
        base = np.asarray(self.reference.act(obs, parts), dtype=np.int64)
        keep = tuple(int(e) for e in base[: lay.max_broadcast] if int(e) != lay.none)
        swap: tuple[int, ...] | None = None
        broadcaster = getattr(self.reference, "broadcast", None)
        if keep and broadcaster is not None and len(keep) < lay.num_experts:
            wider = dict(obs, budget=np.array([(len(keep) + 1) / max(1, lay.max_broadcast)],
                                              dtype=np.float32))
            if len(keep) + 1 <= lay.max_broadcast:
                ext = broadcaster.choose_broadcast(wider, None)
            else:
                ext = []
            cand = [e for e in ext if e not in keep]
            if cand and (parts is None or parts[len(keep) - 1][cand[0]]):
                swap = (*keep[:-1], int(cand[0]))
        slots = (keep, keep[:-1] if keep else None, () if len(keep) >= 2 else None, swap)
        mask = np.zeros(int(self.nvec.sum()), dtype=bool)
        mask[: len(RESIDUAL_OPS)] = [s is not None for s in slots]
        r0, g0 = int(base[-2]), int(base[-1])
        n_r, n_g = int(self.nvec[1]), int(self.nvec[2])
        rules = np.ones(n_r, dtype=bool) if parts is None else parts[-2]
        levels = np.ones(n_g, dtype=bool) if parts is None else parts[-1]
        off = len(RESIDUAL_OPS)
        mask[off: off + n_r] = [bool(rules[(r0 + v) % n_r]) for v in range(n_r)]
        mask[off + n_r:] = [bool(levels[(g0 + v) % n_g]) for v in range(n_g)]
        return ResidualChoice(base, slots, mask)

    def to_full(self, action: NDArray[Any], choice: ResidualChoice) -> NDArray[np.int64]:
        """Translate a residual action into an ``HdMoE-v0`` action (unavailable op → keep)."""
        lay = self.layout
        a = np.asarray(action, dtype=np.int64).reshape(-1)
        chosen = choice.slots[int(a[0])] if 0 <= int(a[0]) < len(choice.slots) else None
        if chosen is None:
            chosen = choice.slots[0]
        full = np.full(lay.max_broadcast + 2, lay.none, dtype=np.int64)
        full[: len(chosen)] = chosen
        full[-2] = (int(choice.base[-2]) + int(a[1])) % int(self.nvec[1])
        full[-1] = (int(choice.base[-1]) + int(a[2])) % int(self.nvec[2])
        return full


def _wrap_residual(env: Any) -> Any:
    import gymnasium as gym
    from gymnasium import spaces

    class _Residual(gym.Wrapper):  # type: ignore[misc]
        def __init__(self, env: Any) -> None:
            super().__init__(env)
            self.residual = ResidualHDA.from_env(env)
            self.action_space = spaces.MultiDiscrete(self.residual.nvec)
            self._choice: ResidualChoice | None = None

        def _update(self, obs: Any) -> None:
            self._choice = self.residual.choose(obs, self.env.unwrapped.action_masks())

        def reset(self, **kwargs: Any) -> Any:
            obs, info = self.env.reset(**kwargs)
            self._update(obs)
            return obs, info

        def action_masks(self) -> NDArray[np.bool_]:
            assert self._choice is not None
            return self._choice.mask.copy()

        def step(self, action: Any) -> Any:
            assert self._choice is not None
            full = self.residual.to_full(action, self._choice)
            obs, reward, terminated, truncated, info = self.env.step(full)
            info["residual_deviation"] = bool(np.any(np.asarray(action) != 0))
            if not (terminated or truncated):
                self._update(obs)
            return obs, reward, terminated, truncated, info

    return _Residual(env)


def _bias_keep(model: Any, nvec: Sequence[int], logit: float) -> None:
    """Add ``logit`` to the action-net bias of value 0 of every dimension (residual start)."""
    import torch

    starts = np.concatenate([[0], np.cumsum(np.asarray(nvec))[:-1]]).astype(int)
    with torch.no_grad():
        bias = model.policy.action_net.bias
        for s in starts:
            bias[int(s)] += float(logit)


@dataclass
class _EnvFactory:
    """Picklable env constructor for ``SubprocVecEnv`` (builds ``HdMoeEnv`` in the worker)."""

    kwargs: dict[str, Any]
    action_mode: str = "full"
    num_candidates: int = 4

    def __call__(self) -> Any:
        from stable_baselines3.common.monitor import Monitor

        from hdamoe_env.env import HdMoeEnv

        env = HdMoeEnv(**self.kwargs)
        if self.action_mode == "ranked":
            env = _wrap_ranked(env, self.num_candidates)
        elif self.action_mode == "residual":
            env = _wrap_residual(env)
        return Monitor(env)


def make_vec_env(env_kwargs: dict[str, Any], n_envs: int = 1, *, seed: int = 0,
                 start_method: str | None = None, action_mode: str = "full",
                 num_candidates: int = 4) -> Any:
    """Build ``n_envs`` monitored ``HdMoeEnv`` copies (DummyVecEnv for 1, SubprocVecEnv above).

    Args:
        env_kwargs: Complete ``HdMoeEnv`` keyword arguments.
        n_envs: Number of env copies.
        seed: Seed of the vector env (copy i gets seed + i on its first reset).
        start_method: ``multiprocessing`` start method of ``SubprocVecEnv`` (None: SB3's).
        action_mode: ``"full"`` (the env's action), ``"ranked"`` (:class:`RankedBroadcast`) or
            ``"residual"`` (:class:`ResidualHDA`).
        num_candidates: K of the ranked action.

    Returns:
        A seeded SB3 ``VecEnv``.
    """
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    if n_envs < 1:
        raise ConfigError(f"n_envs must be >= 1, got {n_envs}")
    if action_mode not in ACTION_MODES:
        raise unknown_name("action mode", action_mode, ACTION_MODES)
    fns = [_EnvFactory(dict(env_kwargs), action_mode, num_candidates) for _ in range(n_envs)]
    venv = DummyVecEnv(fns) if n_envs == 1 else SubprocVecEnv(fns, start_method=start_method)
    venv.seed(seed)
    return venv


def _resolve_placement(env_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Replace a bench placement name (``node_link``, ``hybrid``, ...) by the placement itself."""
    name = env_kwargs.get("placement", "ep")
    if not isinstance(name, str) or name in ("tp", "ep") or name.endswith(".npz"):
        return env_kwargs
    from hdamoe_env import bench  # application layer, lazily (style.md §2)

    config = _bench_config(env_kwargs, fidelity="des", steps=1)
    trace, _ = bench._load_trace(config)
    placement, _ = bench.PlacementStore(config, trace, progress=False).get(name)
    return {**env_kwargs, "placement": placement}


# ------------------------------------------------------------------------------- callbacks
def _callbacks(out_dir: Path, checkpoint_every: int, vecnorm: Any) -> Any:
    """Return the SB3 callbacks: latency logging and atomic checkpoints."""
    from stable_baselines3.common.callbacks import BaseCallback, CallbackList

    class LatencyCallback(BaseCallback):
        """Log the env's ``info["total_us"]`` and ``info["tbt_us"]`` under ``latency/``."""

        def _on_step(self) -> bool:
            for info in self.locals.get("infos", ()):
                if "total_us" in info:
                    self.logger.record_mean("latency/total_us", float(info["total_us"]))
                if "tbt_us" in info:
                    self.logger.record_mean("latency/tbt_us", float(info["tbt_us"]))
                if "tp_total_us" in info and info["tp_total_us"] > 0:
                    self.logger.record_mean("latency/total_over_tp",
                                            float(info["total_us"]) / float(info["tp_total_us"]))
            return True

    class AtomicCheckpoint(BaseCallback):
        """Save model (+ VecNormalize) every ``every`` steps to ``checkpoints/`` atomically."""

        def __init__(self) -> None:
            super().__init__()
            self.next_at = 0

        def _on_training_start(self) -> None:
            n = self.model.num_timesteps
            self.next_at = (n // checkpoint_every + 1) * checkpoint_every

        def _on_step(self) -> bool:
            if self.model.num_timesteps >= self.next_at:
                _save_checkpoint(self.model, vecnorm, out_dir)
                self.next_at = (self.model.num_timesteps // checkpoint_every + 1) \
                    * checkpoint_every
            return True

    callbacks: list[Any] = [LatencyCallback()]
    if checkpoint_every > 0:
        callbacks.append(AtomicCheckpoint())
    return CallbackList(callbacks)


def _atomic_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _save_model(model: Any, vecnorm: Any, model_path: Path, vecnorm_path: Path) -> None:
    buf = io.BytesIO()
    model.save(buf)
    if vecnorm is not None:                    # statistics first: a model never lacks them
        _atomic_bytes(vecnorm_path, pickle.dumps(vecnorm))  # __getstate__ drops the envs
    _atomic_bytes(model_path, buf.getvalue())


def _save_checkpoint(model: Any, vecnorm: Any, out_dir: Path) -> Path:
    steps = int(model.num_timesteps)
    ckpt = out_dir / "checkpoints" / f"ckpt_{steps}.zip"
    _save_model(model, vecnorm, ckpt, ckpt.with_name(f"ckpt_{steps}_{VECNORM_FILE}"))
    log.info("checkpoint %s", ckpt)
    return ckpt


def latest_checkpoint(out_dir: str | os.PathLike[str]) -> Path | None:
    """Return the checkpoint with the most steps in ``out_dir/checkpoints`` (or None)."""
    best: tuple[int, Path] | None = None
    for path in (Path(out_dir) / "checkpoints").glob("ckpt_*.zip"):
        m = re.fullmatch(r"ckpt_(\d+)\.zip", path.name)
        if m and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), path)
    return None if best is None else best[1]


def _layout_meta(venv: Any) -> dict[str, Any]:
    """Return the env's action layout and node count (``learned.json``, for loading)."""
    base = venv.envs[0].unwrapped if hasattr(venv, "envs") else None
    if base is None:
        return {}
    lay = ActionLayout.from_env(base)
    return {"num_experts": lay.num_experts, "max_broadcast": lay.max_broadcast,
            "dispatch_rules": list(lay.dispatch_rules), "gating_levels": list(lay.gating_levels),
            "num_nodes": int(base.num_nodes)}


# ----------------------------------------------------------------------------------- train
def train(algo: str = "maskable-ppo", env_kwargs: dict[str, Any] | None = None,
          timesteps: int = 10_000, n_envs: int = 1, seed: int = 0,
          out_dir: str | os.PathLike[str] = "runs/learned", checkpoint_every: int = 5_000,
          fidelity: str = "analytic", normalize_obs: bool = True, tensorboard: bool = True,
          resume: bool = False, *, hyperparams: dict[str, Any] | None = None,
          evaluate_after: bool = True, eval_seeds: Sequence[int] | None = None,
          eval_steps: int = 16, eval_fidelities: Sequence[str] | None = None,
          eval_trace: Any = None, eval_baselines: Sequence[str] | None = None,
          threads: int = 1, start_method: str | None = None, progress: bool = False,
          action_mode: str = "ranked", num_candidates: int = 4,
          residual_keep_logit: float = RESIDUAL_KEEP_LOGIT) -> Path:
    """Train a policy for ``HdMoE-v0`` and save it (and its held-out evaluation) in ``out_dir``.

    Args:
        algo: ``"ppo"``, ``"maskable-ppo"`` or ``"a2c"``.
        env_kwargs: ``HdMoeEnv`` keyword arguments (model, mesh, setting, batch, k_b,
            placement — ``"tp"``, ``"ep"`` or a bench placement name such as ``"node_link"``,
            computed by the bench's quick pipeline —, trace, trace_seed, ...).
        timesteps: Total env steps (with ``resume``, the target including earlier steps).
        n_envs: Env copies (``SubprocVecEnv`` when > 1).
        seed: Seed of torch, SB3 and the training episodes.
        out_dir: Output directory (see the module docstring).
        checkpoint_every: Save a checkpoint every this many steps (0: never).
        fidelity: Training fidelity, ``"analytic"`` (default, fast) or ``"des"``.
        normalize_obs: Wrap the envs in ``VecNormalize`` for :data:`NORM_OBS_KEYS`.
        tensorboard: Write TensorBoard logs to ``out_dir/tb``.
        resume: Continue from the latest checkpoint (step count continues).
        hyperparams: Overrides of the algorithm's dataclass fields (e.g. ``{"n_steps": 64}``).
        evaluate_after: Run the held-out evaluation and write ``eval.json``/``eval.md``.
        eval_seeds: Evaluation episode seeds (default 10 000, 10 001, 10 002).
        eval_steps: Decode steps per evaluation episode.
        eval_fidelities: Fidelities of the evaluation (default: the training one and ``"des"``).
        eval_trace: Held-out trace (default: synthetic with ``trace_seed`` + 1000, or the same
            real trace with unseen episode seeds).
        eval_baselines: Heuristic agents compared (default :data:`DEFAULT_BASELINES`).
        threads: torch / BLAS threads (1, dependencies.md §6).
        start_method: ``SubprocVecEnv`` start method.
        progress: SB3 progress bar.
        action_mode: ``"ranked"`` (default, :class:`RankedBroadcast`: slot = rank among the
            ``num_candidates`` most-loaded predicted experts), ``"full"`` (expert ids) or
            ``"residual"`` (:class:`ResidualHDA`: HDA-MoE's action + a learned deviation; the
            policy starts biased towards "no deviation" by ``residual_keep_logit``).
        num_candidates: K of the ranked action.
        residual_keep_logit: Initial logit bonus of "keep the greedy's choice" (residual mode).

    Returns:
        The path of the saved model (``out_dir/model.zip``).

    Raises:
        ConfigError: Bad algorithm, hyperparameter or env argument.
        DependencyNotInstalled: torch / stable-baselines3 / sb3-contrib missing.
    """
    key = _algo_key(algo)
    cls = _algo_class(key)
    _set_threads(threads)
    from stable_baselines3.common.vec_env import VecNormalize

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        hp = HYPERPARAMS[key](**(hyperparams or {}))
    except TypeError as exc:
        names = [f.name for f in dataclasses.fields(HYPERPARAMS[key])]
        raise ConfigError(f"bad hyperparameters {hyperparams!r} for {key}: {exc}; expected "
                          f"fields of {names}") from None
    user_kwargs = dict(env_kwargs or {})
    resolved = {k: v for k, v in _resolve_placement(user_kwargs).items()
                if k not in ("placement_dir", "cache_dir")}     # bench fields, not env kwargs
    env_args = _env_arguments(resolved, key, fidelity)
    ckpt = latest_checkpoint(out) if resume else None
    if resume and ckpt is None:
        log.warning("resume: no checkpoint in %s; starting from scratch", out / "checkpoints")
    if ckpt is not None and (out / META_FILE).exists():
        earlier = json.loads((out / META_FILE).read_text())
        if earlier.get("algo", key) != key:
            raise ConfigError(f"--resume: {out} was trained with {earlier['algo']!r}, not "
                              f"{key!r}; pass --algo {earlier['algo']} or a new --out")
        if (earlier.get("action_mode", action_mode), earlier.get("num_candidates",
                                                                 num_candidates)) != (
                action_mode, num_candidates):
            raise ConfigError(f"--resume: {out} was trained with action_mode "
                              f"{earlier.get('action_mode')!r}, K={earlier.get('num_candidates')}"
                              f"; pass the same --action-mode/--candidates or a new --out")
    _seed_everything(seed)
    venv = make_vec_env(env_args, n_envs, seed=seed, start_method=start_method,
                        action_mode=action_mode, num_candidates=num_candidates)
    vecnorm = None
    if normalize_obs:
        stats = ckpt.with_name(ckpt.stem + "_" + VECNORM_FILE) if ckpt else None
        if stats is not None and stats.exists():
            vecnorm = VecNormalize.load(str(stats), venv)
            vecnorm.training = True
        else:
            keys = [k for k in NORM_OBS_KEYS if k in venv.observation_space.spaces]
            vecnorm = VecNormalize(venv, norm_obs=True, norm_reward=False, clip_obs=10.0,
                                   norm_obs_keys=keys, gamma=hp.gamma)
        venv_train = vecnorm
    else:
        venv_train = venv
    tb_dir = str(out / "tb") if tensorboard else None
    if tensorboard:
        try:
            import tensorboard as _tb  # noqa: F401  (SB3's writer needs the package)
        except ImportError:
            log.warning("tensorboard is not installed (`pip install \"hdamoe-env[log]\"`); "
                        "training without TensorBoard logs")
            tb_dir = None
    t0 = time.perf_counter()
    if ckpt is not None:
        model = cls.load(str(ckpt), env=venv_train, tensorboard_log=tb_dir, seed=seed)
        log.info("resumed from %s at %d steps", ckpt, model.num_timesteps)
    else:
        model = cls("MultiInputPolicy", venv_train, seed=seed, tensorboard_log=tb_dir,
                    verbose=0, device="cpu", **_model_kwargs(hp))
        if action_mode == "residual" and residual_keep_logit:
            _bias_keep(model, venv.action_space.nvec, residual_keep_logit)
    start_steps = int(model.num_timesteps)
    remaining = max(0, int(timesteps) - start_steps)
    if not (out / META_FILE).exists():         # checkpoints need the algorithm and action mode
        early = {"algo": key, "action_mode": action_mode, "num_candidates": num_candidates,
                 "fidelity": fidelity, "env_kwargs": _jsonable(user_kwargs), "complete": False}
        _atomic_bytes(out / META_FILE, (json.dumps(early, indent=1) + "\n").encode())
    if remaining > 0:
        model.learn(total_timesteps=remaining, callback=_callbacks(out, checkpoint_every, vecnorm),
                    reset_num_timesteps=ckpt is None, tb_log_name=key, progress_bar=progress)
    wall = time.perf_counter() - t0
    if checkpoint_every > 0 and remaining > 0:     # resume continues from the exact end
        _save_checkpoint(model, vecnorm, out)
    model_path = out / MODEL_FILE
    _save_model(model, vecnorm, model_path, out / VECNORM_FILE)
    if vecnorm is None and (out / VECNORM_FILE).exists():
        (out / VECNORM_FILE).unlink()
    import torch

    meta = {
        "algo": key, "hyperparams": dataclasses.asdict(hp), "seed": seed, "n_envs": n_envs,
        "fidelity": fidelity, "normalize_obs": normalize_obs, "action_mode": action_mode,
        "num_candidates": num_candidates, "complete": True,
        "residual_keep_logit": residual_keep_logit if action_mode == "residual" else None,
        "layout": _layout_meta(venv),
        "norm_obs_keys": list(vecnorm.norm_obs_keys) if vecnorm is not None else [],
        "env_kwargs": _jsonable(user_kwargs),
        "train_env_kwargs": _jsonable({k: (v if k != "placement" or isinstance(v, str) else
                                           f"<Placement {getattr(v, 'method', '?')}>")
                                       for k, v in env_args.items()}),
        "num_timesteps": int(model.num_timesteps), "resumed_from": str(ckpt) if ckpt else None,
        "resumed_at": start_steps if ckpt else None, "wall_s": wall,
        "steps_per_s": (int(model.num_timesteps) - start_steps) / wall if wall > 0 else None,
        "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__,
        "observation_shapes": {k: list(s.shape) for k, s in
                               venv.observation_space.spaces.items()},
    }
    _atomic_bytes(out / META_FILE, (json.dumps(meta, indent=1) + "\n").encode())
    venv_train.close()
    log.info("trained %s for %d steps in %.1f s -> %s", key, model.num_timesteps, wall,
             model_path)
    if evaluate_after:
        res = evaluate(out, seeds=eval_seeds, steps=eval_steps, fidelities=eval_fidelities,
                       trace=eval_trace, baselines=eval_baselines, out_dir=out)
        if tb_dir is not None:
            ref = {m: v for m, v in res["summary"].get(fidelity, {}).get("tbt_us", {}).items()
                   if m in ("noop", "hardware-aware-gating", "hda-moe")}
            try:
                plot_learning_curve(out, reference={f"{m} (held-out, {fidelity})": v
                                                    for m, v in ref.items()})
            except DependencyNotInstalled as exc:
                log.warning("learning curve skipped: %s", exc)
    return model_path


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        to_dict = getattr(value, "to_dict", None)
        return _jsonable(to_dict() if to_dict else dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return repr(value)


# ------------------------------------------------------------------------------ the agent
class LearnedAgent:
    """A trained SB3 policy behind the package's ``predict`` protocol (style.md R11).

    ``predict`` reshapes the observation to the training layout (e.g. 2-D ``replicas`` →
    [E·D]), applies the saved ``VecNormalize`` statistics, calls the model (with
    ``action_masks`` for MaskablePPO) and coerces the action to a valid one: slots the mask
    forbids, and experts repeated in a later slot, become "none"; without a mask, slots beyond
    the observation's budget k_b become "none". So a learned agent runs on a strict env.

    Args:
        model: The SB3 model.
        vecnorm: ``VecNormalize`` (statistics only) or None.
        meta: Content of ``learned.json``.
        path: Where it was loaded from.
    """

    name = "learned"

    def __init__(self, model: Any, vecnorm: Any = None, meta: dict[str, Any] | None = None,
                 path: str | os.PathLike[str] | None = None) -> None:
        self.model = model
        self.vecnorm = vecnorm
        self.meta = dict(meta or {})
        self.path = None if path is None else Path(path)
        self.algo = self.meta.get("algo", "ppo")
        space = model.observation_space
        self._shapes = {k: tuple(s.shape) for k, s in space.spaces.items()}
        nvec = np.asarray(model.action_space.nvec)
        self.action_mode = self.meta.get("action_mode", "full")
        self.num_candidates = int(self.meta.get("num_candidates", int(nvec[0]) - 1))
        saved = self.meta.get("layout") or {}
        if self.action_mode == "residual":
            if not saved:
                raise ConfigError("a residual-mode learned agent needs the action layout of "
                                  "its learned.json; retrain or pass the run directory")
            self.layout = ActionLayout(int(saved["num_experts"]), int(saved["max_broadcast"]),
                                       tuple(saved["dispatch_rules"]),
                                       tuple(saved["gating_levels"]))
        else:
            num_experts = (self._shapes["pred_load"][0] if self.action_mode == "ranked"
                           else int(nvec[0]) - 1)
            #: Layout of the env's (full) action; the model may act in the ranked space.
            self.layout = ActionLayout(int(num_experts), int(nvec.size) - 2,
                                       tuple(f"rule{i}" for i in range(int(nvec[-2]))),
                                       tuple(float(i) for i in range(int(nvec[-1]))))
        self._masked = self.algo == "maskable-ppo"
        self._residual: ResidualHDA | None = None

    def bind(self, env: Any) -> None:
        """Use ``env``'s specs for the greedy reference of a residual-mode agent (else no-op)."""
        if self.action_mode == "residual":
            self._residual = ResidualHDA.from_env(env)

    def residual_design(self) -> ResidualHDA:
        """Return the :class:`ResidualHDA` of a residual-mode agent (built from ``learned.json``
        unless :meth:`bind` gave an env)."""
        if self._residual is None:
            from agents.composite import HDAMoEAgent
            from hdamoe_env.specs import ModelSpec, hardware_from_setting

            kw = self.meta.get("env_kwargs", {})
            model = kw.get("model", "deepseek-v2-lite")
            model = ModelSpec.from_dict(model) if isinstance(model, dict) else model
            lay = self.layout
            ref = HDAMoEAgent(model, hardware_from_setting(kw.get("setting", "5/50"),
                                                           kw.get("mesh", "4x8")),
                              kw.get("conventions", "faithful"), batch=int(kw.get("batch", 128)),
                              max_broadcast=lay.max_broadcast, dispatch_rules=lay.dispatch_rules,
                              gating_levels=lay.gating_levels)
            self._residual = ResidualHDA(ref, int(self.meta["layout"]["num_nodes"]))
        return self._residual

    def _prepare(self, observation: dict[str, Any]) -> tuple[dict[str, NDArray[Any]], bool]:
        batched = np.asarray(observation["budget"]).ndim > 1       # budget is [1] per env
        obs: dict[str, NDArray[Any]] = {}
        for key, shape in self._shapes.items():
            value = np.asarray(observation[key], dtype=np.float32)
            obs[key] = value.reshape((-1, *shape) if batched else shape)
        if self.vecnorm is not None:
            obs = self.vecnorm.normalize_obs(obs)
        return obs, batched

    def predict(self, observation: Any, state: Any = None, episode_start: Any = None,
                deterministic: bool = True, action_masks: Any = None
                ) -> tuple[NDArray[np.int64], Any]:
        """Return ``(action, state)`` for an env observation (SB3's signature, R11).

        Args:
            observation: Raw Dict observation of ``HdMoE-v0`` (or a batch).
            state: Recurrent state (unused, returned unchanged).
            episode_start: Episode-start flags (unused).
            deterministic: Most likely action (True) or a sample from the policy.
            action_masks: The env's flat ``action_masks()`` (or one per row), optional.

        Returns:
            int64 [max_broadcast + 2] (or [n, max_broadcast + 2]) and ``state``.
        """
        obs, batched = self._prepare(observation)
        n = obs["budget"].shape[0] if batched else 1
        lay, K = self.layout, self.num_candidates
        pred = np.asarray(observation["pred_load"], dtype=np.float64).reshape(n, -1)
        budget = np.asarray(observation["budget"]).reshape(n, -1)[:, 0]
        masks = (None if action_masks is None else
                 np.asarray(action_masks, dtype=bool).reshape(n, -1))
        kwargs: dict[str, Any] = {}
        choices: list[ResidualChoice] = []
        if self.action_mode == "residual":
            design = self.residual_design()
            for i in range(n):
                row = {k: (np.asarray(v)[i] if batched else v) for k, v in observation.items()}
                choices.append(design.choose(row, None if masks is None else masks[i]))
            if self._masked:
                model_masks = np.stack([c.mask for c in choices])
                kwargs["action_masks"] = model_masks if batched else model_masks[0]
        elif self._masked and masks is not None:
            model_masks = masks if self.action_mode == "full" else np.stack(
                [ranked_mask(masks[i], lay, K, pred[i]) for i in range(n)])
            kwargs["action_masks"] = model_masks if batched else model_masks[0]
        action, _ = self.model.predict(obs, deterministic=deterministic, **kwargs)
        action = np.asarray(action, dtype=np.int64).reshape(n, -1)
        rows = []
        for i in range(n):
            mask_i = None if masks is None else masks[i]
            if self.action_mode == "residual":
                full = self.residual_design().to_full(action[i], choices[i])
            elif self.action_mode == "full":
                full = action[i]
            else:
                full = ranked_to_full(action[i], lay, K, pred[i], mask_i)
            rows.append(self._coerce(full, mask_i, float(budget[i])))
        return (np.stack(rows) if batched else rows[0]), state

    def _coerce(self, action: NDArray[np.int64], mask: Any, budget: float) -> NDArray[np.int64]:
        lay = self.layout
        action = action.copy()
        if mask is not None:
            parts = lay.split_mask(mask)
        else:
            k_b = int(round(budget * lay.max_broadcast))
            parts = None
        seen: set[int] = set()
        for slot in range(lay.max_broadcast):
            value = int(action[slot])
            allowed = (bool(parts[slot][value]) if parts is not None else slot < k_b)
            if value == lay.none:
                continue
            if not allowed or value in seen:
                action[slot] = lay.none
            else:
                seen.add(value)
        for dim in (lay.max_broadcast, lay.max_broadcast + 1):
            if parts is not None and not parts[dim][int(action[dim])]:
                action[dim] = int(np.flatnonzero(parts[dim])[0])
        return action


def _find_files(path: Path) -> tuple[Path, Path | None, Path | None]:
    """Return (model zip, VecNormalize pickle or None, learned.json or None) of a saved agent."""
    if path.is_dir():
        model = path / MODEL_FILE
        vecnorm, meta = path / VECNORM_FILE, path / META_FILE
    else:
        model = path
        m = re.fullmatch(r"(ckpt_\d+)\.zip", path.name)
        vecnorm = (path.with_name(f"{m.group(1)}_{VECNORM_FILE}") if m
                   else path.with_name(VECNORM_FILE))
        meta = path.with_name(META_FILE)
        if not meta.exists() and path.parent.name == "checkpoints":
            meta = path.parent.parent / META_FILE
    if not model.exists():
        raise ConfigError(f"no learned model at {str(model)!r}; pass the output directory of "
                          "`hdamoe train` or a model .zip")
    return model, vecnorm if vecnorm.exists() else None, meta if meta.exists() else None


def load_agent(path: str | os.PathLike[str], env: Any = None, *,
               algo: str | None = None) -> LearnedAgent:
    """Load a learned agent saved by :func:`train` (a directory, ``model.zip`` or checkpoint).

    Args:
        path: Output directory of ``hdamoe train``, its ``model.zip``, or a checkpoint
            ``checkpoints/ckpt_<steps>.zip``.
        env: Optional env; its action space must match the model's (checked).
        algo: Algorithm (default: from ``learned.json``, else inferred by trying the classes).

    Returns:
        A :class:`LearnedAgent`.

    Raises:
        ConfigError: Missing files, or an env whose action space differs from the model's.
        DependencyNotInstalled: The rl extra is missing.
    """
    _set_threads(1)
    model_path, vecnorm_path, meta_path = _find_files(Path(path))
    meta = json.loads(meta_path.read_text()) if meta_path is not None else {}
    key = _algo_key(algo or meta.get("algo", "ppo"))
    model = _algo_class(key).load(str(model_path), device="cpu")
    meta.setdefault("algo", key)
    vecnorm = None
    if vecnorm_path is not None:
        with open(vecnorm_path, "rb") as fh:
            vecnorm = pickle.load(fh)  # noqa: S301 - our own file, written by train()
        vecnorm.training = False
    agent = LearnedAgent(model, vecnorm, meta, model_path)
    if env is not None:
        agent.bind(env)
        nvec = np.asarray(getattr(env, "unwrapped", env).action_space.nvec)
        if not np.array_equal(nvec, agent.layout.nvec):
            raise ConfigError(f"the learned agent at {str(path)!r} was trained for actions "
                              f"{agent.layout.nvec.tolist()} but the env has {nvec.tolist()}; "
                              "evaluate on the model and max_broadcast it was trained with")
    return agent


# ------------------------------------------------------------------------------- evaluation
_BENCH_FIELDS = ("model", "trace", "trace_requests", "mesh", "topology", "setting", "batch",
                 "conventions", "predictor", "max_broadcast", "k_b", "placement_dir",
                 "cache_dir", "placement_seed")
#: Env arguments the training adds that the bench must not see (it builds strict envs).
_TRAIN_ONLY = ("fidelity", "flatten_replicas", "duplicates", "invalid_action",
               "steps_per_episode", "placement")


def _bench_config(env_kwargs: dict[str, Any], *, fidelity: str, steps: int,
                  trace: Any = None) -> Any:
    """Map ``HdMoeEnv`` kwargs onto a ``hdamoe_env.app.bench.BenchConfig``."""
    from hdamoe_env.app.bench import BenchConfig

    fields: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for name, value in env_kwargs.items():
        if name in _BENCH_FIELDS:
            fields[name] = value
        elif name not in _TRAIN_ONLY:
            extra[name] = value
    mesh = fields.get("mesh")
    if isinstance(mesh, tuple | list):
        fields["mesh"] = f"{mesh[0]}x{mesh[1]}"
    if isinstance(fields.get("k_b"), list | tuple | np.ndarray):
        extra["k_b"] = list(fields.pop("k_b"))
    if trace is not None:
        fields["trace"] = trace
    for name in ("model",):
        if isinstance(fields.get(name), dict):
            from hdamoe_env.specs import ModelSpec

            fields[name] = ModelSpec.from_dict(fields[name])
    return BenchConfig(**fields, steps=steps, fidelity=fidelity, env_kwargs=extra)


def _held_out(env_kwargs: dict[str, Any], trace: Any) -> tuple[dict[str, Any], Any, str]:
    """Return (env kwargs, trace, label) of the held-out evaluation split."""
    kwargs = dict(env_kwargs)
    if trace is not None:
        return kwargs, trace, f"eval trace {trace!r}"
    train_trace = kwargs.get("trace", "synthetic")
    if isinstance(train_trace, str) and train_trace == "synthetic":
        seed = int(kwargs.get("trace_seed", 0)) + HELD_OUT_TRACE_OFFSET
        kwargs["trace_seed"] = seed
        return kwargs, None, f"synthetic, trace_seed {seed} (training: {seed - 1000})"
    return kwargs, None, "the training trace with unseen episode seeds (pass eval_trace)"


def _methods(agent_specs: Sequence[str], placement: str) -> list[Any]:
    from hdamoe_env.app.bench import MethodSpec

    methods = []
    n_learned = sum(1 for s in agent_specs if Path(s).exists() or s.endswith(".zip"))
    for spec in agent_specs:
        name = AGENT_ALIASES.get(spec, spec)
        label = "learned" if Path(spec).exists() or spec.endswith(".zip") else name
        if label == "learned" and n_learned > 1:
            label = f"learned:{Path(spec).name}" if Path(spec).name != "model.zip" else \
                f"learned:{Path(spec).parent.name}"
        methods.append(MethodSpec(label, placement, None if name == "noop" else name,
                                  f"{name} on {placement}"))
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ConfigError(f"agents repeat a name: {names}")
    return methods


def evaluate(agent_paths: str | os.PathLike[str] | Sequence[str] | None, *,
             env_kwargs: dict[str, Any] | None = None, seeds: Sequence[int] | None = None,
             steps: int = 16, fidelities: Sequence[str] | None = None, trace: Any = None,
             baselines: Sequence[str] | None = None, placement: str | None = None,
             out_dir: str | os.PathLike[str] | None = None, held_out: bool = True,
             progress: bool = False) -> dict[str, Any]:
    """Compare learned and heuristic agents on identical episodes with the bench harness.

    Args:
        agent_paths: A saved learned agent (directory or zip), several, or None (heuristics
            only).
        env_kwargs: Env configuration (default: the first learned agent's ``learned.json``).
        seeds: Episode seeds (default 10 000 + 0..2, never used in training).
        steps: Decode steps per episode.
        fidelities: Fidelities to evaluate on (default: the training one and ``"des"``).
        trace: Evaluation trace (default: the held-out split, :func:`_held_out`).
        baselines: Heuristic agents (default :data:`DEFAULT_BASELINES`).
        placement: Placement of every method (default: the training placement, else ``ep``).
        out_dir: Write ``eval.json`` and ``eval.md`` here.
        held_out: Use the held-out split when ``trace`` is None.
        progress: tqdm bars.

    Returns:
        ``{"tables": {fidelity: text}, "records": [...], "summary": {...}, "split": label}``;
        the summary gives per fidelity the mean TBT of every method and the learned agents'
        relative gap to HDA-MoE and NoOp, and the twin-vs-DES gap of every method.
    """
    from hdamoe_env.app import bench

    if agent_paths is None:
        paths: list[str] = []
    elif isinstance(agent_paths, str | os.PathLike):
        paths = [str(agent_paths)]
    else:
        paths = [str(p) for p in agent_paths]
    meta: dict[str, Any] = {}
    for p in paths:
        _, _, meta_path = _find_files(Path(p))
        if meta_path is not None:
            meta = json.loads(meta_path.read_text())
            break
    kwargs = dict(env_kwargs if env_kwargs is not None else meta.get("env_kwargs", {}))
    placement = placement or kwargs.get("placement") or "ep"
    if not isinstance(placement, str) or placement.replace("-", "_") not in \
            bench.PLACEMENT_ARTIFACTS:
        raise ConfigError(f"evaluation placement must be one of {list(bench.PLACEMENT_ARTIFACTS)},"
                          f" got {placement!r}")
    placement = placement.replace("-", "_")
    if held_out:
        kwargs, trace, split = _held_out(kwargs, trace)
    else:
        split = "as given"
    seeds = list(seeds) if seeds is not None else [EVAL_SEED_BASE + i for i in range(3)]
    train_fid = meta.get("fidelity", "analytic")
    fidelities = list(fidelities) if fidelities else list(dict.fromkeys([train_fid, "des"]))
    baselines = list(baselines) if baselines is not None else list(DEFAULT_BASELINES)
    methods = _methods(baselines + paths, placement)
    tables: dict[str, str] = {}
    records: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for fid in fidelities:
        config = _bench_config(kwargs, fidelity=fid, steps=steps, trace=trace)
        result = bench.run_bench(config, methods, seeds, progress=progress)
        tables[fid] = bench.format_table(result.records)
        records.extend(result.records)
        rows = {r["method"]: r for r in bench.summarise(result.records)}
        fid_sum: dict[str, Any] = {"tbt_us": {m: r["tbt_us"] for m, r in rows.items()}}
        for m in rows:
            if m.startswith("learned"):
                for ref in ("hda-moe", "noop", "hd-moe"):
                    if ref in rows and rows[ref]["tbt_us"] > 0:
                        fid_sum[f"{m}_vs_{ref}"] = rows[m]["tbt_us"] / rows[ref]["tbt_us"] - 1
        summary[fid] = fid_sum
    if "analytic" in summary and "des" in summary:
        summary["twin_gap"] = {m: summary["analytic"]["tbt_us"][m] / v - 1
                               for m, v in summary["des"]["tbt_us"].items()
                               if m in summary["analytic"]["tbt_us"] and v > 0}
    out = {"tables": tables, "records": records, "summary": summary, "split": split,
           "seeds": seeds, "steps": steps, "placement": placement}
    if out_dir is not None:
        target = Path(out_dir)
        _atomic_bytes(target / "eval.json", (json.dumps(
            {k: v for k, v in out.items()}, indent=1, default=_jsonable) + "\n").encode())
        _atomic_bytes(target / "eval.md", format_evaluation(out).encode())
    return out


def format_evaluation(result: dict[str, Any]) -> str:
    """Return the evaluation as Markdown-ish text: one bench table per fidelity plus the gaps."""
    lines = [f"held-out split: {result['split']}; seeds {result['seeds']}; "
             f"{result['steps']} decode steps; placement {result['placement']}", ""]
    for fid, table in result["tables"].items():
        lines += [f"## fidelity {fid}", "", "```", table, "```", ""]
        for key, value in result["summary"][fid].items():
            if key != "tbt_us":
                lines.append(f"* {key}: {value:+.2%}")
        lines.append("")
    gap = result["summary"].get("twin_gap")
    if gap:
        lines.append("twin gap (analytic TBT / DES TBT − 1): " + ", ".join(
            f"{m} {v:+.2%}" for m, v in gap.items()))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- learning curve
def read_scalars(out_dir: str | os.PathLike[str],
                 tags: Sequence[str] = ("latency/tbt_us", "rollout/ep_rew_mean")
                 ) -> dict[str, list[tuple[int, float]]]:
    """Read TensorBoard scalars of a training run (``out_dir/tb``), all runs merged by step.

    Returns:
        ``{tag: [(step, value), ...]}`` sorted by step (tags without data are omitted).

    Raises:
        DependencyNotInstalled: The tensorboard package is missing.
    """
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as exc:
        raise DependencyNotInstalled('reading TensorBoard logs needs tensorboard; run '
                                     '`pip install "hdamoe-env[log]"`') from exc
    out: dict[str, dict[int, float]] = {}
    for events in sorted((Path(out_dir) / "tb").rglob("events.out.tfevents*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in tags:
            if tag in acc.Tags().get("scalars", []):
                out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return {tag: sorted(values.items()) for tag, values in out.items()}


def plot_learning_curve(out_dir: str | os.PathLike[str], path: str | os.PathLike[str] | None = None,
                        reference: dict[str, float] | None = None) -> Path:
    """Write ``learning_curve.png``: mean training TBT and episode reward over env steps.

    Args:
        out_dir: Output directory of :func:`train`.
        path: PNG path (default ``out_dir/learning_curve.png``).
        reference: Horizontal lines, label → TBT µs (e.g. heuristic agents on the twin).

    Raises:
        DependencyNotInstalled: matplotlib or tensorboard missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise DependencyNotInstalled("the learning-curve plot needs matplotlib") from exc
    scalars = read_scalars(out_dir)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, tag, label in ((axes[0], "latency/tbt_us", "training TBT (µs, analytic twin)"),
                           (axes[1], "rollout/ep_rew_mean", "episode reward")):
        data = scalars.get(tag, [])
        if data:
            ax.plot([s for s, _ in data], [v for _, v in data], label="learned")
        if tag == "latency/tbt_us":
            for i, (name, value) in enumerate((reference or {}).items()):
                ax.axhline(value, ls="--", lw=1, color=f"C{i + 1}", label=name)
            ax.legend(fontsize=8)
        ax.set_xlabel("env steps")
        ax.set_title(label, fontsize=10)
    fig.tight_layout()
    target = Path(path) if path is not None else Path(out_dir) / "learning_curve.png"
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target


# ------------------------------------------------------------------------------------- CLI
def _env_cli_arguments(p: argparse.ArgumentParser, *, defaults: bool) -> None:
    d: Callable[[Any], Any] = (lambda v: v) if defaults else (lambda v: None)
    p.add_argument("--model", default=d("deepseek-v2-lite"), help="model preset id")
    p.add_argument("--mesh", default=d("4x8"), help="node grid XxY")
    p.add_argument("--setting", default=d("5/50"), help="TFLOPS per node / GB/s per link")
    p.add_argument("--batch", type=int, default=d(128), help="tokens per decode step B")
    p.add_argument("--conventions", default=d("faithful"), help="convention profile")
    p.add_argument("--trace", default=d("synthetic"), help="'synthetic' or a trace path")
    p.add_argument("--requests", type=int, default=None, help="synthetic trace: requests")
    p.add_argument("--trace-seed", type=int, default=None, help="synthetic trace seed")
    p.add_argument("--k-b", type=int, default=None,
                   help="force N pre-broadcast slots per layer (default: the budget rule)")
    p.add_argument("--max-broadcast", type=int, default=None, help="pre-broadcast slots")
    p.add_argument("--placement", default=None,
                   help="tp | ep | node_link | hybrid | node_balance (default ep)")
    p.add_argument("--placement-dir", default=None, help="`hdamoe place` output directory")
    p.add_argument("--gating-levels", default=None,
                   help="comma list of gating levels of the action, index 0 = off (default "
                   "0,0.5,1,2); every compared method runs on the same env")


def _env_kwargs_from_args(args: argparse.Namespace, base: dict[str, Any] | None = None
                          ) -> dict[str, Any]:
    kwargs = dict(base or {})
    for attr, key in (("model", "model"), ("mesh", "mesh"), ("setting", "setting"),
                      ("batch", "batch"), ("conventions", "conventions"), ("trace", "trace"),
                      ("requests", "trace_requests"), ("trace_seed", "trace_seed"),
                      ("k_b", "k_b"), ("max_broadcast", "max_broadcast"),
                      ("placement", "placement"), ("placement_dir", "placement_dir")):
        value = getattr(args, attr, None)
        if value is not None:
            kwargs[key] = value
    levels = getattr(args, "gating_levels", None)
    if levels is not None:
        try:
            kwargs["gating_levels"] = [float(v) for v in levels.split(",") if v.strip()]
        except ValueError:
            raise ConfigError(f"--gating-levels {levels!r}: expected numbers like "
                              "0,0.5,1,2") from None
    if "placement_dir" in kwargs:          # a bench field, not an HdMoeEnv argument
        kwargs.setdefault("placement", "node_link")
    return kwargs


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``train`` to an argparse subparsers object (``func`` = :func:`cmd_train`)."""
    p = subparsers.add_parser("train", help="train an RL policy (SB3) and evaluate it on "
                              "held-out streams", formatter_class=argparse.
                              ArgumentDefaultsHelpFormatter)
    p.add_argument("--algo", default="maskable-ppo", choices=ALGORITHMS)
    _env_cli_arguments(p, defaults=True)
    p.add_argument("--timesteps", type=int, default=10_000, help="total env steps")
    p.add_argument("--action-mode", default="ranked", choices=ACTION_MODES,
                   help="ranked: slot = rank among the K most-loaded predicted experts; full: "
                   "expert ids; residual: HDA-MoE's action + a learned deviation")
    p.add_argument("--keep-logit", type=float, default=RESIDUAL_KEEP_LOGIT,
                   help="residual mode: initial logit bonus of 'keep the greedy's choice'")
    p.add_argument("--candidates", type=int, default=4, help="K of the ranked action")
    p.add_argument("--fidelity", default="analytic", choices=("analytic", "des"),
                   help="training fidelity")
    p.add_argument("--n-envs", type=int, default=1, help="env copies (SubprocVecEnv if > 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=5_000, help="steps (0: never)")
    p.add_argument("--no-normalize", action="store_true", help="no VecNormalize")
    p.add_argument("--no-tensorboard", action="store_true")
    p.add_argument("--hp", action="append", default=[], metavar="NAME=VALUE",
                   help="hyperparameter override, e.g. --hp n_steps=128 (repeatable)")
    p.add_argument("--eval-steps", type=int, default=16, help="decode steps per eval episode")
    p.add_argument("--eval-seeds", default=None, help="comma list (default 10000,10001,10002)")
    p.add_argument("--eval-trace", default=None, help="held-out trace (real traces)")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--progress", action="store_true", help="SB3 progress bar")
    p.set_defaults(func=cmd_train)
    return p


def _parse_hp(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"--hp {item!r}: expected NAME=VALUE, e.g. n_steps=128")
        try:
            out[name.strip()] = json.loads(text)
        except json.JSONDecodeError:
            out[name.strip()] = text
        if isinstance(out[name.strip()], list):
            out[name.strip()] = tuple(out[name.strip()])
    return out


def _seeds(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"seeds {text!r}: expected integers like 0,1,2") from None


def cmd_train(args: argparse.Namespace) -> int:
    """Run ``hdamoe train``; print the evaluation; return the exit code."""
    t0 = time.perf_counter()
    path = train(args.algo, _env_kwargs_from_args(args), args.timesteps, n_envs=args.n_envs,
                 seed=args.seed, out_dir=args.out, checkpoint_every=args.checkpoint_every,
                 fidelity=args.fidelity, normalize_obs=not args.no_normalize,
                 tensorboard=not args.no_tensorboard, resume=args.resume,
                 hyperparams=_parse_hp(args.hp), evaluate_after=not args.no_eval,
                 eval_seeds=_seeds(args.eval_seeds), eval_steps=args.eval_steps,
                 eval_trace=args.eval_trace, progress=args.progress,
                 action_mode=args.action_mode, num_candidates=args.candidates,
                 residual_keep_logit=args.keep_logit)
    meta = json.loads((Path(args.out) / META_FILE).read_text())
    print(f"hdamoe train: {meta['algo']} {meta['num_timesteps']} steps on {args.fidelity} "
          f"({meta['steps_per_s'] or 0:.0f} steps/s, training wall {meta['wall_s']:.1f} s) "
          f"-> {path}")
    if not args.no_eval:
        print((Path(args.out) / "eval.md").read_text())
    print(f"wall {time.perf_counter() - t0:.1f} s")
    return 0


def add_evaluate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``evaluate`` to an argparse subparsers object (``func`` = :func:`cmd_evaluate`)."""
    p = subparsers.add_parser(
        "evaluate", help="compare learned and heuristic agents on identical episodes",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--agent", required=True,
                   help="comma list: PATH (learned) | greedy-hda | hd-moe | greedy | noop | any "
                   "registered agent")
    p.add_argument("--baselines", default=",".join(DEFAULT_BASELINES),
                   help="heuristic agents added to the comparison ('' for none)")
    _env_cli_arguments(p, defaults=False)
    p.add_argument("--fidelity", default="des",
                   help="comma list of fidelities (des, analytic)")
    p.add_argument("--seeds", default=None, help="episode seeds (default 10000,10001,10002)")
    p.add_argument("--steps", type=int, default=16, help="decode steps per episode")
    p.add_argument("--no-held-out", action="store_true",
                   help="evaluate on the given trace as is (default: the held-out split of a "
                   "learned agent's training trace)")
    p.add_argument("--out", default=None, help="write eval.json / eval.md here")
    p.set_defaults(func=cmd_evaluate)
    return p


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Run ``hdamoe evaluate``; print the table(s); return the exit code."""
    items = [s.strip() for s in args.agent.split(",") if s.strip()]
    paths = [s for s in items if Path(s).exists() or s.endswith(".zip")]
    heur = [s for s in items if s not in paths]
    base = [s.strip() for s in args.baselines.split(",") if s.strip()]
    baselines = list(dict.fromkeys(base + heur))
    meta: dict[str, Any] = {}
    if paths:
        _, _, meta_path = _find_files(Path(paths[0]))
        meta = json.loads(meta_path.read_text()) if meta_path else {}
    kwargs = _env_kwargs_from_args(args, meta.get("env_kwargs", {}))
    trace = None
    if args.trace is not None and args.trace != kwargs.get("trace", "synthetic"):
        trace = args.trace
    fidelities = [f.strip() for f in args.fidelity.split(",") if f.strip()]
    res = evaluate(paths or None, env_kwargs=kwargs, seeds=_seeds(args.seeds), steps=args.steps,
                   fidelities=fidelities, trace=trace, baselines=baselines,
                   placement=kwargs.get("placement"), out_dir=args.out,
                   held_out=not args.no_held_out and bool(paths))
    print(format_evaluation(res))
    return 0
