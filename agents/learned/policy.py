"""Learned online policies: a trained SB3 / sb3-contrib model behind the agents' ``predict``.

Implements the learned counterpart of the heuristic agents of paper-model.md §10–11 (the online
decisions of ``HdMoE-v1``: the pre-broadcast slots, the dispatch rule and the gating level of
every MoE layer): :class:`LearnedAgent` wraps a policy trained by
``agents.learned.train.train`` and :func:`load_agent` loads one from disk. Held-out evaluation
against the greedy agents is the application layer's (``hdamoe_env.app.train``).

torch, stable-baselines3 and sb3-contrib are imported lazily (style.md R12), so ``import agents``
stays light; torch's thread count and seed are set only here (:func:`set_threads`,
:func:`seed_everything`, style.md R7), for loading and for training alike.

Saved agent (a directory ``out_dir``):

* ``model.zip`` — the SB3 model;
* ``vecnormalize.npz`` — the observation-normalisation statistics (mean, var, count per
  normalised key; clip and epsilon in a JSON ``meta`` array), when used — plain arrays, no pickle;
* ``learned.json`` — algorithm, hyperparameters, env arguments, action mode and layout, seeds,
  step count, wall time, and ``model_sha256`` (the SHA-256 of ``model.zip``);
* ``checkpoints/ckpt_<steps>.zip`` (+ ``ckpt_<steps>_vecnormalize.npz``), written during
  training, each loadable on its own;

Security: **loading an SB3 ``.zip`` runs code from the file.** stable-baselines3 unpickles parts
of the archive (e.g. the learning-rate schedule), so only load models you trained yourself or
trust. :func:`load_agent` therefore checks the SHA-256 of ``model.zip`` against the
``model_sha256`` of its ``learned.json`` and refuses a mismatch (:class:`IntegrityError`) before
SB3 opens it; a model without that record (a bare ``.zip``) is loaded with a warning. The
package never pickles its own data: pickled ``vecnormalize.pkl`` files are refused.
* ``tb/``, ``eval.json``, ``eval.md``, ``learning_curve.png`` — training logs and the held-out
  evaluation (written by the application layer).

Decisions:

* [decision] The model may act in a reshaped action space (``action_mode`` ``"ranked"``,
  ``hdamoe_env.env.wrappers.RankedBroadcastWrapper``, or ``"residual"``,
  ``agents.wrappers.ResidualHDAWrapper``); :meth:`LearnedAgent.predict` applies the same
  mapping to the env's own action, so a learned agent runs on an unwrapped env.
* [decision] A model trained with replica routing shares (``replica_shares`` K in
  ``learned.json``, ``hdamoe_env.env.wrappers.ReplicaSharesWrapper``) acts in the inner action
  followed by one share value per routed expert. :meth:`LearnedAgent.predict` splits the share
  values off, returns the env's own action and, when the agent is bound to an env
  (:meth:`LearnedAgent.bind`, done by :func:`load_agent` with ``env=``), applies the shares to
  that env's next step with ``set_replica_fractions`` (the wrapper's mapping,
  ``hdamoe_env.env.wrappers.replica_share_fractions``). Unbound, the returned action is still valid
  but the shares are not applied (the env's replica rule of the action decides; a warning is
  logged once); they are in :attr:`LearnedAgent.last_replica_shares`.
* [decision] PPO and A2C sample the raw ``MultiDiscrete`` space and were trained with
  ``invalid_action="coerce"``; ``LearnedAgent.predict`` applies the same coercion (masked slots
  and duplicates become "none"), so a learned agent runs on a strict (``"raise"``) env such as
  the bench's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from agents.wrappers import ResidualChoice, ResidualHDA
from hdamoe_env.env.actions import ActionLayout
from hdamoe_env.config.errors import (ConfigError, DependencyNotInstalled, IntegrityError,
                                      unknown_name)
from hdamoe_env.config.fileio import atomic_write, loads_json, read_input_bytes
from hdamoe_env.config.trust import verify_file
from hdamoe_env.env.wrappers import (ranked_mask, ranked_to_full, replica_share_fractions,
                                     replica_share_values)
from hdamoe_env.config.run import RUN_DEFAULTS

__all__ = [
    "ALGORITHMS",
    "LearnedAgent",
    "ObsNormalizer",
    "file_sha256",
    "latest_checkpoint",
    "load_agent",
    "read_meta",
]

RL_EXTRA = '`pip install "hdamoe-env[rl]"`'
MODEL_FILE, VECNORM_FILE, META_FILE = "model.zip", "vecnormalize.npz", "learned.json"
LEGACY_VECNORM_FILE = "vecnormalize.pkl"
log = logging.getLogger(__name__)
#: Algorithms a learned agent may use (``agents.learned.hyperparams.HYPERPARAMS`` has their
#: fields).
ALGORITHMS: tuple[str, ...] = ("ppo", "maskable-ppo", "a2c")


# ---------------------------------------------------------------------- algorithms, threads
def algo_key(algo: str) -> str:
    """Return the canonical key of ``ALGORITHMS`` for an algorithm name (case, ``_`` and aliases).

    Raises:
        ConfigError: An unknown algorithm (with a near-miss suggestion).
    """
    key = algo.lower().replace("_", "-")
    key = {"maskableppo": "maskable-ppo", "maskable": "maskable-ppo"}.get(key, key)
    if key not in ALGORITHMS:
        raise unknown_name("algorithm", algo, ALGORITHMS)
    return key


def algo_class(algo: str) -> type[Any]:
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


def set_threads(threads: int = 1) -> None:
    """One torch thread (dependencies.md §6); children inherit ``OMP_NUM_THREADS``."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(threads))
    torch.set_num_threads(int(threads))


def seed_everything(seed: int) -> None:
    """Seed torch (the only place in the package, style.md R7) and SB3's global helpers."""
    import torch
    from stable_baselines3.common.utils import set_random_seed

    set_random_seed(seed)
    torch.manual_seed(seed)



# ------------------------------------------------------------------------------------ files
def checkpoint_path(out_dir: str | os.PathLike[str], steps: int) -> Path:
    """Return the path of the checkpoint of ``out_dir`` at ``steps`` env steps."""
    return Path(out_dir) / "checkpoints" / f"ckpt_{int(steps)}.zip"


def latest_checkpoint(out_dir: str | os.PathLike[str]) -> Path | None:
    """Return the checkpoint with the most steps in ``out_dir/checkpoints`` (or None)."""
    best: tuple[int, Path] | None = None
    for path in (Path(out_dir) / "checkpoints").glob("ckpt_*.zip"):
        m = re.fullmatch(r"ckpt_(\d+)\.zip", path.name)
        if m and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), path)
    return None if best is None else best[1]



def file_sha256(path: str | os.PathLike[str]) -> str:
    """Return the hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class ObsNormalizer:
    """Observation statistics of a ``VecNormalize``, stored as plain arrays (no pickle).

    ``normalize_obs`` computes exactly what ``VecNormalize.normalize_obs`` computes:
    ``clip((obs - mean) / sqrt(var + epsilon), -clip_obs, clip_obs)`` as float32 for every key
    of ``norm_obs_keys``; the other keys pass through.

    Args:
        stats: Per key ``(mean, var, count)``.
        clip_obs: Clip bound.
        epsilon: Variance epsilon.
    """

    training = False

    def __init__(self, stats: dict[str, tuple[NDArray[np.float64], NDArray[np.float64], float]],
                 clip_obs: float, epsilon: float) -> None:
        self.stats = stats
        self.norm_obs_keys = list(stats)
        self.clip_obs = float(clip_obs)
        self.epsilon = float(epsilon)

    @classmethod
    def from_vecnormalize(cls, vecnorm: Any) -> ObsNormalizer:
        """Copy the observation statistics of an SB3 ``VecNormalize`` (dict observations)."""
        stats = {k: (np.array(vecnorm.obs_rms[k].mean, dtype=np.float64),
                     np.array(vecnorm.obs_rms[k].var, dtype=np.float64),
                     float(vecnorm.obs_rms[k].count)) for k in vecnorm.norm_obs_keys}
        return cls(stats, vecnorm.clip_obs, vecnorm.epsilon)

    def apply_to(self, vecnorm: Any) -> None:
        """Write these statistics into an SB3 ``VecNormalize`` (resuming training)."""
        for key, (mean, var, count) in self.stats.items():
            vecnorm.obs_rms[key].mean = mean.copy()
            vecnorm.obs_rms[key].var = var.copy()
            vecnorm.obs_rms[key].count = count
        vecnorm.clip_obs, vecnorm.epsilon = self.clip_obs, self.epsilon

    def normalize_obs(self, obs: dict[str, Any]) -> dict[str, Any]:
        """Return a normalised copy of a dict observation (statistics unchanged)."""
        out = {k: np.array(v, copy=True) for k, v in obs.items()}
        for key, (mean, var, _) in self.stats.items():
            out[key] = np.clip((np.asarray(obs[key]) - mean) / np.sqrt(var + self.epsilon),
                               -self.clip_obs, self.clip_obs).astype(np.float32)
        return out

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the statistics as ``.npz`` (arrays and a UTF-8 JSON ``meta``), atomically."""
        arrays: dict[str, NDArray[Any]] = {}
        for i, (mean, var, count) in enumerate(self.stats.values()):
            arrays[f"mean_{i}"], arrays[f"var_{i}"] = mean, var
            arrays[f"count_{i}"] = np.array(count, dtype=np.float64)
        meta = {"format": "hdamoe-obs-normalizer", "format_version": 1,
                "keys": self.norm_obs_keys, "clip_obs": self.clip_obs, "epsilon": self.epsilon}
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        return atomic_write(path, lambda fh: np.savez(fh, **arrays), "wb")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ObsNormalizer:
        """Read statistics written by :meth:`save` (``allow_pickle=False``).

        Raises:
            ConfigError: The file is not such a statistics file.
        """
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(bytes(data["meta"]).decode())
                keys = list(meta["keys"])
                stats = {k: (np.asarray(data[f"mean_{i}"], dtype=np.float64),
                             np.asarray(data[f"var_{i}"], dtype=np.float64),
                             float(data[f"count_{i}"])) for i, k in enumerate(keys)}
                norm = cls(stats, float(meta["clip_obs"]), float(meta["epsilon"]))
        except Exception as exc:  # noqa: BLE001 - any damage: one typed error naming the file
            raise ConfigError(f"{str(path)!r} is not an observation-statistics file "
                              f"({type(exc).__name__}: {exc}); retrain or restore it") from None
        norm.check(str(path))
        return norm

    def check(self, source: str = "statistics", shapes: dict[str, Any] | None = None) -> None:
        """Refuse statistics that would normalise silently wrong.

        Args:
            source: Where they come from (for the message).
            shapes: Observation shapes the statistics must match (None: only self-consistency).

        Raises:
            ConfigError: Non-finite or negative values, mean and variance of different shapes,
                or a shape other than the observation's (a length-1 array would broadcast).
        """
        for key, (mean, var, count) in self.stats.items():
            problem = ""
            if mean.shape != var.shape:
                problem = f"mean {mean.shape} and var {var.shape} differ in shape"
            elif not (np.isfinite(mean).all() and np.isfinite(var).all() and (var >= 0).all()
                      and math.isfinite(count) and count > 0):
                problem = "non-finite or negative values"
            elif shapes is not None and key in shapes and tuple(mean.shape) != tuple(
                    np.shape(np.empty(shapes[key]))):
                problem = f"shape {mean.shape}, but the observation has {tuple(shapes[key])}"
            if problem:
                raise ConfigError(f"{source}: observation statistics of {key!r} have {problem}; "
                                  "retrain or restore the file")
        if not (math.isfinite(self.clip_obs) and self.clip_obs > 0
                and math.isfinite(self.epsilon) and self.epsilon >= 0):
            raise ConfigError(f"{source}: clip_obs={self.clip_obs} / epsilon={self.epsilon} are "
                              "not valid; retrain or restore the file")


# ------------------------------------------------------------------------------ the agent
class LearnedAgent:
    """A trained SB3 policy behind the package's ``predict`` protocol (style.md R11).

    ``predict`` reshapes the observation to the training layout (e.g. 2-D ``replicas`` →
    [E·D]), applies the saved ``VecNormalize`` statistics, calls the model (with
    ``action_masks`` for MaskablePPO) and coerces the action to a valid one: slots the mask
    forbids, and experts repeated in a later slot, become "none"; without a mask, slots beyond
    the observation's budget k_b become "none". So a learned agent runs on a strict env.

    With replica routing shares (``meta["replica_shares"]`` = K) the model's action is the
    inner action followed by E share values in [0, K]; ``predict`` passes all-True share masks
    to the model, returns only the env's action and, bound to an env, sets that env's replica
    fractions for its current layer (module docstring). Bound, it predicts one observation at
    a time (the fractions belong to the one env).

    Args:
        model: The SB3 model.
        vecnorm: :class:`ObsNormalizer` (or an SB3 ``VecNormalize``) or None.
        meta: Content of ``learned.json``.
        path: Where it was loaded from.

    Attributes:
        layout: The env's action layout (without share dimensions).
        replica_shares: K of the share dimensions, 0 without them.
        last_replica_shares: int64 [E] (or [n, E]) share values of the last ``predict``, or
            None.

    Raises:
        ConfigError: A residual-mode model without its saved layout, or share dimensions that
            do not match ``replica_shares``.
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
        self.replica_shares = int(self.meta.get("replica_shares") or 0)
        #: Share value 0 = the least-loaded rule (``replica_share_fractions(rule_value=True)``).
        self.share_rule_value = bool(self.meta.get("replica_share_rule_value", False))
        self._num_shares = int(self._shapes["pred_load"][0]) if self.replica_shares else 0
        self._share_values = replica_share_values(self.replica_shares, self.share_rule_value)
        if self.replica_shares:
            tail = nvec[nvec.size - self._num_shares:]
            if nvec.size <= self._num_shares or not (tail == self._share_values).all():
                raise ConfigError(f"learned.json records replica_shares={self.replica_shares} "
                                  f"but the model's action {nvec.tolist()} does not end in "
                                  f"{self._num_shares} dimensions of {self._share_values} "
                                  "values; the files belong to different runs, retrain")
            nvec = nvec[: nvec.size - self._num_shares]      # the inner (action-design) part
        self.action_mode = self.meta.get("action_mode", "full")
        self.num_candidates = int(self.meta.get("num_candidates", int(nvec[0]) - 1))
        saved = self.meta.get("layout") or {}
        if self.action_mode == "residual" and not saved:
            raise ConfigError("a residual-mode learned agent needs the action layout of "
                              "its learned.json; retrain or pass the run directory")
        if saved:
            #: Layout of the env's (full) action; the model may act in a reshaped space.
            try:
                self.layout = ActionLayout(
                    int(saved["num_experts"]), int(saved["max_broadcast"]),
                    tuple(str(r) for r in saved["dispatch_rules"]),
                    tuple(float(x) for x in saved["gating_levels"]),
                    tuple(str(r) for r in saved.get("replica_rules", ())))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ConfigError(f"learned.json: its 'layout' is damaged ({type(exc).__name__}: "
                                  f"{exc}); retrain or restore the file") from None
        else:                           # a bare model .zip: the layout read off its action
            num_experts = (self._shapes["pred_load"][0] if self.action_mode == "ranked"
                           else int(nvec[0]) - 1)
            self.layout = ActionLayout(int(num_experts), int(nvec.size) - 2,
                                       tuple(f"rule{i}" for i in range(int(nvec[-2]))),
                                       tuple(float(i) for i in range(int(nvec[-1]))))
        expected = {"full": self.layout.size, "ranked": self.layout.size}.get(self.action_mode)
        if expected is not None and nvec.size != expected:
            raise ConfigError(f"the model acts in {nvec.size} dimensions {nvec.tolist()} but "
                              f"the layout of its learned.json has {expected} "
                              f"({self.layout.nvec.tolist()}); the files belong to different "
                              "runs, retrain")
        self._masked = self.algo == "maskable-ppo"
        self._residual: ResidualHDA | None = None
        self._env: Any = None
        self._warned_unbound = False
        self.last_replica_shares: NDArray[np.int64] | None = None

    def bind(self, env: Any) -> None:
        """Act on ``env``: its specs give a residual-mode agent's greedy reference, and a model
        with replica shares sets its replica fractions in :meth:`predict`.

        Raises:
            ConfigError: A model with replica shares and an env whose placement has no
                redundant experts.
        """
        if self.action_mode == "residual":
            self._residual = ResidualHDA.from_env(env)
        if self.replica_shares:
            base = getattr(env, "unwrapped", env)
            placement = getattr(base, "placement", None)
            if placement is None or not placement.has_replicas:
                raise ConfigError(f"this learned agent sets replica routing shares "
                                  f"(replica_shares={self.replica_shares}) but the env's "
                                  f"placement {getattr(placement, 'method', None)!r} has no "
                                  "redundant experts; evaluate it on the placement it was "
                                  "trained on (e.g. --placement eplb)")
            self._env = base

    def residual_design(self) -> ResidualHDA:
        """Return the :class:`ResidualHDA` of a residual-mode agent.

        Built from ``learned.json`` unless :meth:`bind` gave an env.
        """
        if self._residual is None:
            from agents.composite import HDAMoEAgent
            from hdamoe_env.config.specs import ModelSpec, hardware_from_setting

            kw = self.meta.get("env_kwargs", {})
            model = kw.get("model", "deepseek-v2-lite")
            model = ModelSpec.from_dict(model) if isinstance(model, dict) else model
            lay = self.layout
            ref = HDAMoEAgent(model, hardware_from_setting(kw.get("setting", "5/50"),
                                                           kw.get("mesh", "4x8")),
                              kw.get("conventions", "faithful"), batch=int(kw.get("batch", RUN_DEFAULTS.batch)),
                              max_broadcast=lay.max_broadcast, dispatch_rules=lay.dispatch_rules,
                              gating_levels=lay.gating_levels)
            if lay.replica_rules:            # the env's trailing replica-rule dimension
                ref.adopt_replica_rules(lay.replica_rules)
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
            observation: Raw Dict observation of ``HdMoE-v1`` (or a batch).
            state: Recurrent state (unused, returned unchanged).
            episode_start: Episode-start flags (unused).
            deterministic: Most likely action (True) or a sample from the policy.
            action_masks: The env's flat ``action_masks()`` (or one per row), optional.

        Returns:
            int64 [layout.size] (or [n, layout.size]), the env's own action, and ``state``.
            With replica shares and a bound env, that env's replica fractions for its next
            step are set as a side effect.

        Raises:
            ConfigError: More than one observation while bound with replica shares.
        """
        obs, batched = self._prepare(observation)
        n = obs["budget"].shape[0] if batched else 1
        if self.replica_shares and self._env is not None and n > 1:
            raise ConfigError(f"a learned agent with replica shares bound to one env predicts "
                              f"one observation at a time, got {n}; use one agent per env (or "
                              "an unbound agent, whose shares are not applied)")
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
        if self._num_shares and "action_masks" in kwargs:     # share values are never masked
            share_mask = np.ones((n, self._num_shares * self._share_values), dtype=bool)
            inner_masks = np.asarray(kwargs["action_masks"], dtype=bool).reshape(n, -1)
            model_masks = np.concatenate([inner_masks, share_mask], axis=1)
            kwargs["action_masks"] = model_masks if batched else model_masks[0]
        action, _ = self.model.predict(obs, deterministic=deterministic, **kwargs)
        action = np.asarray(action, dtype=np.int64).reshape(n, -1)
        if self._num_shares:
            shares = action[:, action.shape[1] - self._num_shares:]
            action = action[:, : action.shape[1] - self._num_shares]
            self.last_replica_shares = shares.copy() if batched else shares[0].copy()
            self._apply_shares(shares[0])
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

    def _apply_shares(self, shares: NDArray[np.int64]) -> None:
        """Set the bound env's replica fractions of its current layer (module docstring)."""
        if self._env is None:
            if not self._warned_unbound:
                log.warning("learned agent %s is not bound to an env: its replica shares are "
                            "not applied (load it with load_agent(path, env) or call bind)",
                            self.path)
                self._warned_unbound = True
            return
        base = self._env
        base.set_replica_fractions(replica_share_fractions(
            shares, base.placement.replicas[base.current_layer], self.replica_shares,
            rule_value=self.share_rule_value))

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
    """Return (model zip, statistics .npz or None, learned.json or None) of a saved agent.

    Raises:
        ConfigError: No model, or only a pickled ``vecnormalize.pkl`` (refused: loading
            a pickle runs code from the file).
    """
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
    if not model.exists() or not model.is_file():
        raise ConfigError(f"no learned model at {str(model)!r}; pass the output directory of "
                          "`hdamoe train` or a model .zip")
    legacy = vecnorm.with_name(vecnorm.name.replace(VECNORM_FILE, LEGACY_VECNORM_FILE))
    if not vecnorm.exists() and legacy.exists():
        raise ConfigError(f"{str(legacy)!r} holds pickled statistics; loading a pickle runs code "
                          "from the file, so this version refuses it; retrain the agent (the "
                          "statistics are now saved as vecnormalize.npz)")
    return model, vecnorm if vecnorm.exists() else None, meta if meta.exists() else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = loads_json(read_input_bytes(path, "agent metadata"), str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{str(path)!r} is not valid JSON ({exc}); retrain or restore "
                          "it") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{str(path)!r} holds a JSON {type(data).__name__}, expected an object")
    return data


def verify_model(model_path: Path, meta: dict[str, Any]) -> None:
    """Check ``model_path`` against the ``model_sha256`` recorded in ``learned.json``.

    Raises:
        IntegrityError: The digests differ (the model was replaced or modified).
    """
    if model_path.name == MODEL_FILE:
        expected = meta.get("model_sha256")
    else:                                  # a checkpoint: the sidecar written next to it
        try:
            expected = json.loads(model_path.with_suffix(".json").read_text()).get("sha256")
        except (OSError, ValueError, AttributeError):
            expected = None
    if expected is None:                   # the signature (config.trust) decides instead
        log.debug("%s has no recorded SHA-256", model_path)
        return
    actual = file_sha256(model_path)
    if actual != expected:
        raise IntegrityError(f"{str(model_path)!r} has SHA-256 {actual[:16]}… but learned.json "
                             f"records {str(expected)[:16]}…; the model was modified or replaced "
                             "and is not loaded (loading it would run code from the file); "
                             "retrain, or restore the original file")


def load_agent(path: str | os.PathLike[str], env: Any = None, *,
               algo: str | None = None, trust: bool = False) -> LearnedAgent:
    """Load a learned agent saved by training (a directory, ``model.zip`` or checkpoint).

    Args:
        path: Output directory of ``hdamoe train``, its ``model.zip``, or a checkpoint
            ``checkpoints/ckpt_<steps>.zip``.
        env: Optional env the agent will act on: its action space must match the model's
            (checked; without the share dimensions of a ``replica_shares`` model) and the
            agent is bound to it (:meth:`LearnedAgent.bind`: residual reference, replica
            shares applied to it).
        algo: Algorithm (default: from ``learned.json``, else inferred by trying the classes).
        trust: Load the model even when it is not signed by this user's key
            (``hdamoe_env.config.trust``). Loading an SB3 ``.zip`` runs code from the file:
            pass True only for files whose origin you trust.

    Returns:
        A :class:`LearnedAgent`.

    Raises:
        ConfigError: Missing or unreadable files, or an env whose action space differs from the
            model's.
        IntegrityError: ``model.zip`` differs from the SHA-256 recorded in ``learned.json``.
        UntrustedFileError: The model is not signed by this user's key and ``trust`` is False.
        DependencyNotInstalled: The rl extra is missing.

    Warning:
        Loading an SB3 ``.zip`` runs code from the file (SB3 unpickles parts of it). Only load
        models you trust; the SHA-256 check guards ``hdamoe train`` outputs against replacement.
    """
    set_threads(1)
    model_path, vecnorm_path, meta_path = _find_files(Path(path))
    meta = _read_json(meta_path) if meta_path is not None else {}
    known = algo or meta.get("algo")
    verify_model(model_path, meta)
    verify_file(model_path, trust=trust, what="learned agent")
    # without learned.json the algorithm is inferred by trying the classes (maskable first:
    # a MaskablePPO zip read as PPO fails inside SB3 with a TypeError)
    keys = [algo_key(known)] if known else ["maskable-ppo", "ppo", "a2c"]
    for key in keys:
        try:
            model = algo_class(key).load(str(model_path), device="cpu")
            break
        except (ValueError, KeyError, OSError, EOFError, AssertionError, TypeError,
                AttributeError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            import zipfile

            if isinstance(exc, zipfile.BadZipFile):
                raise ConfigError(f"{str(model_path)!r} is not a model .zip ({exc})") from None
            raise
    else:
        raise ConfigError(f"{str(model_path)!r} is not a {' or '.join(keys)} model saved by "
                          f"`hdamoe train` ({problem}); pass algo= or keep its learned.json")
    meta.setdefault("algo", key)
    vecnorm = ObsNormalizer.load(vecnorm_path) if vecnorm_path is not None else None
    if vecnorm is not None and hasattr(getattr(model, "observation_space", None), "spaces"):
        vecnorm.check(str(vecnorm_path), {k: space.shape for k, space in
                                          model.observation_space.spaces.items()})
    agent = LearnedAgent(model, vecnorm, meta, model_path)
    if env is not None:
        _check_observation_sizes(model, env, path)
        agent.bind(env)
        nvec = np.asarray(getattr(env, "unwrapped", env).action_space.nvec)
        if not np.array_equal(nvec, agent.layout.nvec):
            raise ConfigError(f"the learned agent at {str(path)!r} was trained for actions "
                              f"{agent.layout.nvec.tolist()} but the env has {nvec.tolist()}; "
                              "evaluate on the model and max_broadcast it was trained with")
    return agent




def _check_observation_sizes(model: Any, env: Any, path: Any) -> None:
    """Refuse an env whose observations differ in size from the model's (another mesh/model).

    Raises:
        ConfigError: Naming the first differing key and both sizes.
    """
    theirs = getattr(getattr(env, "unwrapped", env), "observation_space", None)
    ours = getattr(model, "observation_space", None)
    spaces_ours = getattr(ours, "spaces", None)
    spaces_theirs = getattr(theirs, "spaces", None)
    if not spaces_ours or not spaces_theirs:
        return
    for key, space in spaces_ours.items():
        if key in spaces_theirs and int(np.prod(space.shape)) != int(
                np.prod(spaces_theirs[key].shape)):
            raise ConfigError(f"the learned agent at {str(path)!r} was trained on observations "
                              f"{key!r} of size {int(np.prod(space.shape))} but the env gives "
                              f"{int(np.prod(spaces_theirs[key].shape))}; evaluate on the model, "
                              "mesh and batch it was trained with")


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Return the ``learned.json`` of a saved agent (``{}`` when it has none).

    Args:
        path: Output directory of ``hdamoe train``, its ``model.zip``, or a checkpoint.

    Raises:
        ConfigError: No model at ``path``.
    """
    _, _, meta_path = _find_files(Path(path))
    return _read_json(meta_path) if meta_path is not None else {}
