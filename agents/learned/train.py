"""Training learned online policies with Stable-Baselines3 / sb3-contrib.

Trains policies for the online decisions of paper-model.md §10–11 (the decisions of
``HdMoE-v1``: the pre-broadcast slots, the dispatch rule and the gating level of every MoE
layer). A policy is trained with PPO, MaskablePPO (the env's ``action_masks()``) or A2C on
vectorised copies of the env, usually on the γ-calibrated analytic twin
(``fidelity="analytic"``, fast), and saved in the layout ``agents.learned.policy`` loads (see
its module docstring). The held-out evaluation against the paper's greedy agents and the
``hdamoe train`` command are the application layer's
(``hdamoe_env.app.train``): :func:`train` takes the placement already resolved and an optional
``evaluate_fn`` callback, and imports nothing above ``agents``.

torch, stable-baselines3 and sb3-contrib are imported lazily (style.md R12); torch is seeded in
``agents.learned.policy`` (style.md R7).

Decisions:

* [decision] Observations normalised: ``pred_load``, ``node_load`` and ``link_busy`` (small,
  skewed, layer-dependent magnitudes) by running mean/std (``VecNormalize``, clip 10); the
  already-bounded static features ``replicas``, ``layer`` and ``budget`` are left raw (a
  near-constant feature would be blown up by its tiny variance). Rewards are not normalised
  (they are already ≈ −latency ÷ TP latency ≈ −1).

The training envs and their action designs are ``agents.learned.envs``; the hyperparameter
dataclasses and files ``agents.learned.hyperparams``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from agents.learned.envs import (bias_keep, env_arguments, share_rule_value,
                                 check_replica_shares, make_vec_env)
from agents.learned.hyperparams import HYPERPARAMS, check_hyperparam_types, model_kwargs
from agents.learned.resume import (ResumeState, load_resume_state, resume_state_path,
                                   save_resume_state)
from agents.learned.policy import (
    META_FILE,
    MODEL_FILE,
    VECNORM_FILE,
    ObsNormalizer,
    algo_class,
    algo_key,
    seed_everything,
    set_threads,
    checkpoint_path,
    file_sha256,
    latest_checkpoint,
)
from agents.wrappers import RESIDUAL_KEEP_LOGIT
from hdamoe_env.env.actions import ActionLayout
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.fileio import atomic_write
from hdamoe_env.config.trust import verify_file, write_signature
from hdamoe_env.sim.placement import Placement

__all__ = [
    "LEGACY_POLICY_INPUT",
    "NORM_OBS_KEYS",
    "to_jsonable",
    "train",
]

log = logging.getLogger(__name__)

#: Observation keys normalised by ``VecNormalize`` (module docstring).
NORM_OBS_KEYS: tuple[str, ...] = ("pred_load", "node_load", "link_busy")

#: The policy input of runs written before the hyperparameter ``policy_input`` existed (SB3's
#: flattening of every observation value); ``--resume`` of such a run keeps it.
LEGACY_POLICY_INPUT = "full"

# ------------------------------------------------------------------------------- callbacks
def _progress_callback(on_progress: Callable[[int, float], None]) -> Any:
    """Return an SB3 callback calling ``on_progress(num_timesteps, steps_per_s)`` per rollout."""
    from stable_baselines3.common.callbacks import BaseCallback

    class ProgressCallback(BaseCallback):
        def _on_training_start(self) -> None:
            self.t0 = time.perf_counter()
            self.n0 = self.model.num_timesteps

        def _on_step(self) -> bool:
            return True

        def _on_rollout_end(self) -> None:
            elapsed = time.perf_counter() - self.t0
            n = self.model.num_timesteps
            on_progress(n, (n - self.n0) / elapsed if elapsed > 0 else 0.0)

    return ProgressCallback()


def _hparam_callback(hparams: dict[str, Any]) -> Any:
    """Return an SB3 callback recording ``hparams`` in TensorBoard's HPARAMS tab at the start."""
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.logger import HParam

    clean = {k: (v if isinstance(v, bool | int | float | str) else json.dumps(to_jsonable(v)))
             for k, v in hparams.items()}

    class HParamCallback(BaseCallback):
        def _on_training_start(self) -> None:
            self.logger.record("hparams", HParam(clean, {"rollout/ep_rew_mean": 0.0,
                                                         "latency/total_over_tp": 0.0}),
                               exclude=("stdout", "log", "json", "csv"))

        def _on_step(self) -> bool:
            return True

    return HParamCallback()


def _callbacks(out_dir: Path, checkpoint_every: int, vecnorm: Any, digest: str = "",
               on_progress: Callable[[int, float], None] | None = None,
               hparams: dict[str, Any] | None = None, state_venv: Any = None) -> Any:
    """Return the SB3 callbacks: latency logging, atomic checkpoints, progress, hparams.

    ``state_venv`` is the vector env (inside ``VecNormalize``) whose copies' states the
    checkpoints save for an exact resume; None: checkpoints without them.
    """
    from stable_baselines3.common.callbacks import BaseCallback, CallbackList

    class LatencyCallback(BaseCallback):
        """Log the env's ``info["total_us"]`` and ``info["tbt_us"]`` under ``latency/``."""

        def _on_step(self) -> bool:
            for info in self.locals.get("infos", ()):
                if "total_us" in info:
                    self.logger.record_mean("latency/total_us", float(info["total_us"]))
                if "tbt_us" in info:
                    self.logger.record_mean("latency/tbt_us", float(info["tbt_us"]))
                if "j_per_token" in info:           # energy (docs/PHYSICS.md §18)
                    self.logger.record_mean("energy/uj_per_token",
                                            1e6 * float(info["j_per_token"]))
                if "tp_total_us" in info and info["tp_total_us"] > 0:
                    self.logger.record_mean("latency/total_over_tp",
                                            float(info["total_us"]) / float(info["tp_total_us"]))
            return True

    class AtomicCheckpoint(BaseCallback):
        """Save a resumable checkpoint at the first rollout start after every ``every`` steps.

        At a rollout start the previous update is done and the rollout buffer is empty, so
        the model, the normaliser, the RNG states, the envs and SB3's last observation are
        the whole state of training (``_save_checkpoint``).
        """

        def __init__(self) -> None:
            super().__init__()
            self.next_at = 0

        def _on_training_start(self) -> None:
            n = self.model.num_timesteps
            self.next_at = (n // checkpoint_every + 1) * checkpoint_every

        def _on_rollout_start(self) -> None:
            if self.model.num_timesteps >= self.next_at:
                _save_checkpoint(self.model, vecnorm, out_dir, digest, state_venv)
                self.next_at = (self.model.num_timesteps // checkpoint_every + 1) \
                    * checkpoint_every

        def _on_step(self) -> bool:
            return True

    callbacks: list[Any] = [LatencyCallback()]
    if hparams:
        callbacks.append(_hparam_callback(hparams))
    if checkpoint_every > 0:
        callbacks.append(AtomicCheckpoint())
    if on_progress is not None:
        callbacks.append(_progress_callback(on_progress))
    return CallbackList(callbacks)


def _atomic_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda fh: fh.write(data), "wb")


def _save_model(model: Any, vecnorm: Any, model_path: Path, vecnorm_path: Path) -> str:
    """Write the model (and its observation statistics as ``.npz``); return its SHA-256."""
    buf = io.BytesIO()
    model.save(buf)
    if vecnorm is not None:                    # statistics first: a model never lacks them
        ObsNormalizer.from_vecnormalize(vecnorm).save(vecnorm_path)      # arrays, no pickle
    data = buf.getvalue()
    _atomic_bytes(model_path, data)
    write_signature(model_path, data)          # this user's HMAC: loadable without --trust-model
    return hashlib.sha256(data).hexdigest()


def _save_checkpoint(model: Any, vecnorm: Any, out_dir: Path, digest: str = "",
                     state_venv: Any = None) -> Path:
    """Write a checkpoint: model, statistics, resume state (with ``state_venv``), sidecar last."""
    steps = int(model.num_timesteps)
    ckpt = checkpoint_path(out_dir, steps)
    state_file = None
    if state_venv is not None:
        state_file = save_resume_state(resume_state_path(ckpt), model, vecnorm, state_venv)
    sha = _save_model(model, vecnorm, ckpt, ckpt.with_name(f"ckpt_{steps}_{VECNORM_FILE}"))
    # the sidecar marks the checkpoint as this run's: its SHA-256 and the run digest (resume);
    # written last, so a checkpoint with a sidecar is complete
    record: dict[str, Any] = {"sha256": sha, "run_digest": digest, "steps": steps}
    if state_file is not None:
        record["resume_state"] = state_file.name
    _atomic_bytes(ckpt.with_suffix(".json"), (json.dumps(record, indent=1) + "\n").encode())
    log.info("checkpoint %s", ckpt)
    return ckpt


def run_digest(algo: str, action_mode: str, num_candidates: int, fidelity: str,
               normalize_obs: bool, hp: Any, env_kwargs: dict[str, Any],
               residual_keep_logit: float | None,
               quality: dict[str, Any] | None = None,
               replica_shares: int | None = None, *, legacy_policy_input: bool = False) -> str:
    """Return the SHA-256 of everything a resumed run must share (env + hyperparameters).

    ``legacy_policy_input``: the digest of a run written before the hyperparameter
    ``policy_input`` existed (its hyperparameters without that key; such a run used
    ``policy_input="full"``, :data:`LEGACY_POLICY_INPUT`).
    """
    hp_entry = dataclasses.asdict(hp)
    if legacy_policy_input:
        hp_entry.pop("policy_input", None)
    payload: dict[str, Any] = {"algo": algo, "action_mode": action_mode, "num_candidates": num_candidates,
               "fidelity": fidelity, "normalize_obs": normalize_obs,
               "hyperparams": to_jsonable(hp_entry),
               "env_kwargs": to_jsonable(env_kwargs),
               "residual_keep_logit": residual_keep_logit if action_mode == "residual" else None}
    if quality is not None:                  # only then: a latency-only digest has no entry
        payload["quality"] = to_jsonable(quality)
    if replica_shares:                       # only then: a digest without shares has no entry
        payload["replica_shares"] = int(replica_shares)
        payload["replica_share_rule_value"] = share_rule_value(action_mode)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _layout_meta(venv: Any) -> dict[str, Any]:
    """Return the env's action layout and node count (``learned.json``, for loading)."""
    if hasattr(venv, "envs"):                    # DummyVecEnv: read the env itself
        base = venv.envs[0].unwrapped
        lay = ActionLayout.from_env(base)
        num_nodes = int(base.num_nodes)
    else:                                        # SubprocVecEnv: plain attributes of env 0
        def attr(name: str) -> Any:
            return venv.get_attr(name, indices=[0])[0]

        lay = ActionLayout(int(attr("num_experts")), int(attr("max_broadcast")),
                           tuple(attr("dispatch_rules")), tuple(attr("gating_levels")),
                           tuple(attr("replica_rules")))
        num_nodes = int(attr("num_nodes"))
    return {"num_experts": lay.num_experts, "max_broadcast": lay.max_broadcast,
            "dispatch_rules": list(lay.dispatch_rules), "gating_levels": list(lay.gating_levels),
            "replica_rules": list(lay.replica_rules), "num_nodes": num_nodes}


def _resume_checkpoint(out: Path, algo: str, action_mode: str, num_candidates: int,
                       digest: str = "", details: dict[str, Any] | None = None,
                       legacy_digest: str = "") -> tuple[Path | None, bool]:
    """Return the checkpoint to resume from (None: start afresh), checking it matches the run,
    and whether its run digest is ``legacy_digest`` (written before ``policy_input`` existed:
    ``run_digest(..., legacy_policy_input=True)``) rather than ``digest``.

    Raises:
        ConfigError: ``out`` was trained with another algorithm, action design, env or
            hyperparameters, or its latest checkpoint was not written by a run of this version.
        IntegrityError: The checkpoint differs from the SHA-256 recorded next to it.
    """
    from hdamoe_env.config.errors import IntegrityError

    ckpt = latest_checkpoint(out)
    if ckpt is None:
        log.warning("resume: no checkpoint in %s; starting from scratch", out / "checkpoints")
        return None, False
    complete = _latest_complete_checkpoint(out)
    if complete is not None and complete != ckpt:
        log.warning("resume: %s is incomplete (no sidecar: the run stopped while writing "
                    "it); resuming from %s", ckpt.name, complete.name)
        ckpt = complete
    earlier: dict[str, Any] = {}
    if (out / META_FILE).exists():
        earlier = json.loads((out / META_FILE).read_text())
        if earlier.get("algo", algo) != algo:
            raise ConfigError(f"--resume: {out} was trained with {earlier['algo']!r}, not "
                              f"{algo!r}; pass --algo {earlier['algo']} or a new --out")
        if (earlier.get("action_mode", action_mode), earlier.get("num_candidates",
                                                                 num_candidates)) != (
                action_mode, num_candidates):
            raise ConfigError(f"--resume: {out} was trained with action_mode "
                              f"{earlier.get('action_mode')!r}, K={earlier.get('num_candidates')}"
                              f"; pass the same --action-mode/--candidates or a new --out")
    side = ckpt.with_suffix(".json")
    try:
        record = json.loads(side.read_text())
    except (OSError, ValueError):
        raise ConfigError(f"--resume: checkpoint {str(ckpt)!r} has no readable {side.name} "
                          "(written by an older version or another program); use a new --out")
    legacy = bool(legacy_digest) and record.get("run_digest") == legacy_digest
    if digest and record.get("run_digest") != digest and not legacy:
        diff = []
        if details is not None:
            old_kw = earlier.get("env_kwargs", {})
            new_kw = details.get("env_kwargs", {})
            diff = sorted(k for k in set(old_kw) | set(new_kw) if old_kw.get(k) != new_kw.get(k))
            old_hp, new_hp = earlier.get("hyperparams") or {}, details.get("hyperparams", {})
            diff += sorted(f"hp.{k}" for k in set(old_hp) | set(new_hp)
                           if old_hp and old_hp.get(k) != new_hp.get(k))
            for k in ("fidelity", "normalize_obs", "replica_shares"):
                if k in earlier and earlier[k] != details.get(k):
                    diff.append(k)
        raise ConfigError(f"--resume: {out} was trained with another env or hyperparameters "
                          f"(differs in {diff or 'the run digest'}); resume with the same "
                          "arguments, or train into a new --out")
    if file_sha256(ckpt) != record.get("sha256"):
        raise IntegrityError(f"--resume: checkpoint {str(ckpt)!r} does not match the SHA-256 "
                             "recorded next to it; it was modified and is not loaded (loading "
                             "runs code from the file)")
    verify_file(ckpt, what="--resume checkpoint")
    return ckpt, legacy


def _latest_complete_checkpoint(out: Path) -> Path | None:
    """Return the checkpoint with the most steps that has its sidecar (written last)."""
    found = []
    for path in (out / "checkpoints").glob("ckpt_*.zip"):
        stem = path.stem[len("ckpt_"):]
        if stem.isdigit() and path.with_suffix(".json").is_file():
            found.append((int(stem), path))
    return max(found)[1] if found else None


def _resume_state(ckpt: Path | None, vec_backend: str) -> ResumeState | None:
    """Return the resume state of ``ckpt`` (None: none, resuming only approximately)."""
    if ckpt is None:
        return None
    path = resume_state_path(ckpt)
    if vec_backend != "subproc":
        log.warning("resume: the %s vector backend has no exact resume; the envs start new "
                    "episodes (vec_backend='subproc' resumes bit for bit)", vec_backend)
        return None
    if not path.exists():
        log.warning("resume: checkpoint %s has no resume state (%s; written by an older "
                    "version or the batched backend); the envs start new episodes and the "
                    "run will not repeat an uninterrupted one exactly", ckpt.name, path.name)
        return None
    return load_resume_state(path)


# ----------------------------------------------------------------------------------- train
def train(algo: str = "maskable-ppo", env_kwargs: dict[str, Any] | None = None,
          timesteps: int = 10_000, n_envs: int = 1, seed: int = 0,
          out_dir: str | os.PathLike[str] = "runs/learned", checkpoint_every: int = 5_000,
          fidelity: str = "analytic", normalize_obs: bool = True, tensorboard: bool = True,
          resume: bool = False, *, hyperparams: dict[str, Any] | None = None,
          placement: Placement | None = None, evaluate_fn: Callable[[Path], Any] | None = None,
          threads: int = 1, start_method: str | None = None, progress: bool = False,
          action_mode: str = "ranked", num_candidates: int = 4,
          residual_keep_logit: float = RESIDUAL_KEEP_LOGIT,
          quality: dict[str, Any] | None = None, replica_shares: int | None = None,
          on_progress: Callable[[int, float], None] | None = None,
          vec_backend: str = "subproc") -> Path:
    """Train a policy for ``HdMoE-v1`` and save it in ``out_dir``.

    Args:
        algo: ``"ppo"``, ``"maskable-ppo"`` or ``"a2c"``.
        env_kwargs: ``HdMoeEnv`` keyword arguments (model, mesh, setting, batch, k_b,
            placement — ``"tp"``, ``"ep"``, a ``.npz`` path, a ``Placement``, or a placement
            name such as ``"node_link"`` together with ``placement=`` —, trace, trace_seed,
            ...). They are recorded in ``learned.json`` as given.
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
        placement: The placement ``env_kwargs["placement"]`` names, already resolved by the
            caller (the application layer resolves method names such as ``"node_link"``;
            ``agents`` does not import it). The training envs use it; ``learned.json`` keeps
            the name.
        evaluate_fn: Called with ``out_dir`` once the model and ``learned.json`` are saved
            (e.g. the held-out evaluation of ``hdamoe_env.app.train``); its result is ignored.
        threads: torch / BLAS threads (1, dependencies.md §6).
        start_method: ``SubprocVecEnv`` start method.
        progress: SB3 progress bar.
        action_mode: ``"ranked"`` (default, ``RankedBroadcastWrapper``: slot = rank among the
            ``num_candidates`` most-loaded predicted experts), ``"full"`` (expert ids) or
            ``"residual"`` (``ResidualHDAWrapper``: HDA-MoE's action + a learned deviation; the
            policy starts biased towards "no deviation" by ``residual_keep_logit``).
        num_candidates: K of the ranked action.
        residual_keep_logit: Initial logit bonus of "keep the greedy's choice" (residual mode).
        quality: Train on the quality-charged reward: keyword arguments of
            ``hdamoe_env.env.wrappers.QualityRewardWrapper`` (``target``, ``weight``,
            ``lagrangian``, ``dual_step``, ...); None = latency reward only. Recorded in
            ``learned.json`` and in the resume digest.
        replica_shares: Learn per-expert replica routing shares too: K share steps per routed
            expert (``hdamoe_env.env.wrappers.ReplicaSharesWrapper`` around the action design),
            None = off. Needs a placement with redundant experts (e.g. ``eplb``). Recorded as
            ``replica_shares`` in ``learned.json`` and in the resume digest.
        on_progress: Called with (env steps so far, training steps/s) after every rollout
            (the application layer shows it; ``agents`` prints nothing).
        vec_backend: ``"subproc"`` (one process per copy) or ``"batched"`` (the batched
            vector env in this process, ``agents.learned.vector.SharedVecEnv``; action modes
            full and ranked).

    Returns:
        The path of the saved model (``out_dir/model.zip``).

    Raises:
        ConfigError: Bad algorithm, hyperparameter or env argument, a placement name
            without ``placement=``, or ``replica_shares`` on a placement without redundant
            experts.
        DependencyNotInstalled: torch / stable-baselines3 / sb3-contrib missing.
    """
    key = algo_key(algo)
    cls = algo_class(key)
    set_threads(threads)
    from stable_baselines3.common.vec_env import VecNormalize

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        hp = HYPERPARAMS[key](**(hyperparams or {}))
    except TypeError as exc:
        names = [f.name for f in dataclasses.fields(HYPERPARAMS[key])]
        raise ConfigError(f"bad hyperparameters {hyperparams!r} for {key}: {exc}; expected "
                          f"fields of {names}") from None
    check_hyperparam_types(hp, hyperparams or {})
    user_kwargs = dict(env_kwargs or {})
    resolved = {k: v for k, v in _with_placement(user_kwargs, placement).items()
                if k not in ("placement_dir", "cache_dir")}     # bench fields, not env kwargs
    env_args = env_arguments(resolved, key, fidelity)
    user_name = user_kwargs.get("placement", "ep")
    replica_shares = check_replica_shares(replica_shares, env_args.get("placement", "ep"),
                                          user_name if isinstance(user_name, str) else None)
    rule_value = bool(replica_shares) and share_rule_value(action_mode)
    digest = run_digest(key, action_mode, num_candidates, fidelity, normalize_obs, hp,
                        user_kwargs, residual_keep_logit, quality, replica_shares)
    details = {"env_kwargs": to_jsonable(user_kwargs), "hyperparams": dataclasses.asdict(hp),
               "fidelity": fidelity, "normalize_obs": normalize_obs,
               "replica_shares": replica_shares}
    ckpt, legacy = None, False
    if resume:
        legacy_digest = run_digest(key, action_mode, num_candidates, fidelity, normalize_obs, hp,
                                   user_kwargs, residual_keep_logit, quality, replica_shares,
                                   legacy_policy_input=True)
        ckpt, legacy = _resume_checkpoint(out, key, action_mode, num_candidates, digest,
                                          to_jsonable(details), legacy_digest)
    if legacy:
        # a run from before the hyperparameter policy_input: it used the full input, and its
        # checkpoints keep the digest without the key (so later resumes match again)
        asked = (hyperparams or {}).get("policy_input", LEGACY_POLICY_INPUT)
        if asked != LEGACY_POLICY_INPUT:
            raise ConfigError(f"--resume: {out} was trained before the hyperparameter "
                              f"policy_input existed, i.e. with policy_input="
                              f"{LEGACY_POLICY_INPUT!r}; drop --hp policy_input={asked} or "
                              "train into a new --out")
        hp = dataclasses.replace(hp, policy_input=LEGACY_POLICY_INPUT)
        digest = legacy_digest
        log.info("resume: %s predates policy_input; resuming with policy_input=%r", out,
                 LEGACY_POLICY_INPUT)
    state = _resume_state(ckpt, vec_backend)
    if state is not None and state.n_envs != n_envs:        # before any worker starts
        raise ConfigError(f"--resume: the checkpoint was taken with {state.n_envs} env copies, "
                          f"this run has {n_envs}; resume with --n-envs {state.n_envs}")
    seed_everything(seed)
    venv = make_vec_env(env_args, n_envs, seed=seed, start_method=start_method,
                        action_mode=action_mode, num_candidates=num_candidates,
                        quality=quality, replica_shares=replica_shares,
                        vec_backend=vec_backend)
    state_venv = venv if vec_backend == "subproc" else None     # checkpoints save its state
    if state is not None:
        try:
            state.restore_envs(venv)               # before VecNormalize: its reset is unseen
        except Exception:
            venv.close()
            raise
    layout_meta = _layout_meta(venv)
    vecnorm = None
    if normalize_obs:
        stats = ckpt.with_name(ckpt.stem + "_" + VECNORM_FILE) if ckpt else None
        keys = [k for k in NORM_OBS_KEYS if k in venv.observation_space.spaces]
        vecnorm = VecNormalize(venv, norm_obs=True, norm_reward=False, clip_obs=10.0,
                               norm_obs_keys=keys, gamma=hp.gamma)
        if stats is not None and stats.exists():
            ObsNormalizer.load(stats).apply_to(vecnorm)         # plain arrays, no pickle
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
        if state is not None:                      # last: loading reseeded the generators
            state.restore_model(model, vecnorm)
        log.info("resumed from %s at %d steps", ckpt, model.num_timesteps)
    else:
        kwargs = model_kwargs(hp)
        # a rollout smaller than one minibatch is one minibatch (SB3 would warn and do so)
        if "batch_size" in kwargs:
            kwargs["batch_size"] = min(hp.batch_size, hp.n_steps * n_envs)
        model = cls(_policy(key), venv_train, seed=seed, tensorboard_log=tb_dir,
                    verbose=0, device="cpu", **kwargs)
        if action_mode == "residual" and residual_keep_logit:
            # residual dims, then any share dims, whose value 0 is the env's replica rule: the
            # untrained policy is HDA-MoE with the default replica dispatch
            bias_keep(model, venv.action_space.nvec, residual_keep_logit)
    if tb_dir is None:
        # without TensorBoard SB3 would configure a logger in a fresh $TMPDIR/SB3-<time>
        # directory on every learn(): a file-less logger creates nothing
        from stable_baselines3.common.logger import Logger

        model.set_logger(Logger(folder=None, output_formats=[]))
    start_steps = int(model.num_timesteps)
    remaining = max(0, int(timesteps) - start_steps)
    if not (out / META_FILE).exists():         # checkpoints need the algorithm and action mode
        early = {"algo": key, "action_mode": action_mode, "num_candidates": num_candidates,
                 "replica_shares": replica_shares,
                 "replica_share_rule_value": rule_value,
                 "layout": layout_meta,
                 "fidelity": fidelity, "env_kwargs": to_jsonable(user_kwargs), "complete": False}
        _atomic_bytes(out / META_FILE, (json.dumps(early, indent=1) + "\n").encode())
    if remaining > 0:
        model.learn(total_timesteps=remaining, callback=_callbacks(
                        out, checkpoint_every, vecnorm, digest, on_progress,
                        hparams={"algo": key, "action_mode": action_mode,
                                 "num_candidates": num_candidates, "fidelity": fidelity,
                                 "replica_shares": replica_shares or 0,
                                 "seed": seed, "n_envs": n_envs, "normalize_obs": normalize_obs,
                                 **{f"env/{k}": v for k, v in user_kwargs.items()},
                                 **{f"hp/{k}": v for k, v in dataclasses.asdict(hp).items()}},
                        state_venv=state_venv),
                    reset_num_timesteps=ckpt is None, tb_log_name=key, progress_bar=progress)
    wall = time.perf_counter() - t0
    if checkpoint_every > 0 and remaining > 0:     # resume continues from the exact end
        _save_checkpoint(model, vecnorm, out, digest, state_venv)
    model_path = out / MODEL_FILE
    model_sha = _save_model(model, vecnorm, model_path, out / VECNORM_FILE)
    if vecnorm is None and (out / VECNORM_FILE).exists():
        (out / VECNORM_FILE).unlink()
    import torch

    meta = {
        "algo": key, "hyperparams": dataclasses.asdict(hp), "seed": seed, "n_envs": n_envs,
        "fidelity": fidelity, "normalize_obs": normalize_obs, "action_mode": action_mode,
        "num_candidates": num_candidates, "replica_shares": replica_shares,
        "replica_share_rule_value": rule_value,
        "complete": True, "model_sha256": model_sha,
        "run_digest": digest,
        "residual_keep_logit": residual_keep_logit if action_mode == "residual" else None,
        "quality_reward": to_jsonable(quality) if quality is not None else None,
        "layout": layout_meta,
        "norm_obs_keys": list(vecnorm.norm_obs_keys) if vecnorm is not None else [],
        "env_kwargs": to_jsonable(user_kwargs),
        "train_env_kwargs": to_jsonable({k: (v if k != "placement" or isinstance(v, str) else
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
    if evaluate_fn is not None:
        evaluate_fn(out)
    return model_path



def _policy(key: str) -> Any:
    """Return the policy of algorithm ``key``: MaskablePPO's with the padded masked head
    (``agents.learned.nets.fast_maskable_policy``), SB3's ``MultiInputPolicy`` otherwise."""
    if key == "maskable-ppo":
        from agents.learned.nets import fast_maskable_policy

        return fast_maskable_policy()
    return "MultiInputPolicy"


def _with_placement(env_kwargs: dict[str, Any], placement: Placement | None) -> dict[str, Any]:
    """Return ``env_kwargs`` with the placement the env builds from (``placement=`` of train)."""
    if placement is not None:
        return {**env_kwargs, "placement": placement}
    name = env_kwargs.get("placement", "ep")
    if isinstance(name, str) and name not in ("tp", "ep") and not name.endswith(".npz"):
        raise ConfigError(f"placement {name!r} is a placement method, not one the env builds "
                          "(tp, ep, a .npz path or a Placement); resolve it first, e.g. with "
                          "hdamoe_env.app.evaluate.resolve_placement, and pass it as "
                          "train(..., placement=<Placement>)")
    return env_kwargs


def to_jsonable(value: Any) -> Any:
    """Return ``value`` as JSON-ready data (dataclasses via ``to_dict``, numpy as lists).

    Objects JSON cannot represent become their ``repr``.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        to_dict = getattr(value, "to_dict", None)
        return to_jsonable(to_dict() if to_dict else dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return repr(value)


