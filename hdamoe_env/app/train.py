"""``hdamoe train``: train learned online policies and compare them with the heuristics.

The application side of the learned online policies (the decisions of paper-model.md §10–11):
the command's options, the placement given by method name, one training run per seed, and the
held-out comparison (``hdamoe_env.app.evaluate``) with 95 % intervals over seeds
(``hdamoe_env.app.records.seed_interval_summary``). Training itself is
``agents.learned.train.train`` and loading ``agents.learned.policy.load_agent``; they import
nothing from this layer (style.md §2), so this module passes them the resolved placement and
the evaluation as a callback.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agents.learned.envs import ACTION_MODES, check_replica_shares
from agents.learned.hyperparams import load_hyperparams
from agents.learned.policy import ALGORITHMS, read_meta
from agents.learned.train import to_jsonable, train
from agents.wrappers import RESIDUAL_KEEP_LOGIT
from hdamoe_env.app.flags import add_progress_flag
from hdamoe_env.app.methods import parse_method
from hdamoe_env.app.argtypes import (bounded_float, check_hyperparams, hp_item, nonneg_int,
                                     positive_int, seed_list)
from hdamoe_env.app.evaluate import (DEFAULT_BASELINES, add_env_arguments, env_kwargs_from_args,
                                     parse_seeds, evaluate, held_out_evaluation, resolve_placement)
from hdamoe_env.app.plots import plot_seed_curves
from hdamoe_env.app.progress import bar as progress_bar
from hdamoe_env.app.progress import stage
from hdamoe_env.app.records import format_seed_summary, seed_interval_summary
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled
from hdamoe_env.config.fileio import atomic_write
from hdamoe_env.sim.placement import Placement

__all__ = ["DEFAULT_N_ENVS", "add_train_arguments", "cmd_train", "default_n_envs",
           "resolve_vec_backend"]

log = logging.getLogger(__name__)



# ------------------------------------------------------------------------------------- CLI
def add_train_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options of ``hdamoe train`` to ``p`` (the command runs :func:`cmd_train`).

    Returns:
        ``p``.
    """
    p.add_argument("--algo", default="maskable-ppo", choices=ALGORITHMS, help="RL algorithm")
    add_env_arguments(p, defaults=True)
    p.add_argument("--timesteps", type=positive_int, default=None,
                   help="total env steps (default: n_timesteps of --hyperparams, else 10000)")
    p.add_argument("--action-mode", default=None, choices=ACTION_MODES,
                   help="ranked: slot = rank among the K most-loaded predicted experts; full: "
                   "expert ids; residual: HDA-MoE's action + a learned deviation (default: "
                   "env_wrapper of --hyperparams, else ranked)")
    p.add_argument("--keep-logit", type=bounded_float(-100.0, 100.0), default=RESIDUAL_KEEP_LOGIT,
                   help="residual mode: initial logit bonus of 'keep the greedy's choice'")
    p.add_argument("--candidates", type=positive_int, default=None,
                   help="K of the ranked action (default: num_candidates of --hyperparams, else 4)")
    p.add_argument("--replica-shares", type=positive_int, default=None, metavar="K",
                   help="also learn per-expert replica routing shares: one extra action value "
                   "0..K per routed expert (v/K of its tokens to the primary copy, the rest "
                   "evenly to its replicas); needs a placement with redundant experts "
                   "(--placement eplb); default off")
    p.add_argument("--fidelity", default="analytic", choices=("analytic", "des"),
                   help="training fidelity")
    p.add_argument("--n-envs", type=positive_int, default=None,
                   help="env copies (default: n_envs of --hyperparams, else 32 on the batched "
                   "backend when it applies, else 1; the earlier one-env run: --n-envs 1 "
                   "with --hyperparams-section maskable-ppo-earlier)")
    p.add_argument("--vec-backend", default="auto", choices=("auto", "subproc", "batched"),
                   help="env copies in one process each (subproc) or all in the batched "
                   "vector env of this process (batched; action modes full and ranked, no "
                   "quality reward or replica shares); auto: batched above one copy when it "
                   "applies, else subproc (subproc resumes bit for bit, batched does not)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="random seed")
    p.add_argument("--seeds", type=seed_list, default=None, metavar="S,S,...",
                   help="train one policy per seed into OUT/seed<S>/, then evaluate all of them "
                   "together on the held-out streams (mean and 95 %% t-interval over seeds)")
    p.add_argument("--hyperparams", default=None, metavar="FILE.yml",
                   help="RL Zoo style hyperparameter file (e.g. hyperparams/maskable-ppo.yml); "
                   "--hp, --timesteps and --n-envs override it")
    p.add_argument("--hyperparams-section", default=None, metavar="NAME",
                   help="section of --hyperparams (default: the algorithm's name, then HdMoE-v1)")
    p.add_argument("--checkpoint-every", type=nonneg_int, default=5_000, help="steps (0: never)")
    p.add_argument("--no-normalize", action="store_true", help="no VecNormalize")
    p.add_argument("--no-tensorboard", action="store_true", help="do not write TensorBoard logs")
    p.add_argument("--hp", type=hp_item, action="append", default=[], metavar="NAME=VALUE",
                   help="hyperparameter override, e.g. --hp n_steps=128 (repeatable)")
    p.add_argument("--quality-target", type=bounded_float(0.0, 1.0), default=None,
                   help="charge the reward for top-1 retention below this target "
                   "(QualityRewardWrapper; default: latency reward only)")
    p.add_argument("--quality-weight", type=bounded_float(0.0, 1e9), default=100.0,
                   help="fixed penalty weight per unit of missing top-1 retention")
    p.add_argument("--lagrangian", action="store_true",
                   help="update the weight by projected dual ascent instead (λ starts at 0)")
    p.add_argument("--dual-step", type=bounded_float(0.0, 1e9), default=50.0, help="dual ascent step size")
    p.add_argument("--eval-steps", type=positive_int, default=16, help="decode steps per eval episode")
    p.add_argument("--eval-seeds", type=seed_list, default=None, help="comma list (default 10000,10001,10002)")
    p.add_argument("--eval-trace", default=None, help="held-out trace (real traces)")
    p.add_argument("--eval-baselines", default=",".join(DEFAULT_BASELINES),
                   help="heuristic agents of the held-out evaluation, comma list; "
                   "tuned:PATH/tuned.json adds the tuned heuristic of `hdamoe tune`")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    add_progress_flag(p, default=True)
    p.add_argument("--sb3-progress-bar", action="store_true",
                   help="SB3's own (rich) progress bar instead of the package's")
    p.add_argument("--trust-model", action="store_true",
                   help="load a --resume checkpoint not signed by this user's key (from another "
                   "user or machine); loading one runs code from the file: only for files "
                   "you trust")
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


def _quality(args: argparse.Namespace) -> dict[str, Any] | None:
    """Return the ``QualityRewardWrapper`` arguments of ``hdamoe train`` (None: not asked)."""
    if getattr(args, "quality_target", None) is None:
        if getattr(args, "lagrangian", False):
            raise ConfigError("--lagrangian needs --quality-target (e.g. 0.99)")
        return None
    quality = {"target": args.quality_target, "weight": args.quality_weight,
               "lagrangian": bool(args.lagrangian), "dual_step": args.dual_step}
    from hdamoe_env.env.wrappers import QualityRewardWrapper

    QualityRewardWrapper.validate(**quality)
    return quality


def _run_env_id(args: argparse.Namespace) -> str:
    """The registered env id the run corresponds to (the most specific whose kwargs match)."""
    import hdamoe_env

    run = {"model": getattr(args, "model", None) or "deepseek-v2-lite",
           "fidelity": getattr(args, "fidelity", None)}
    best, best_n = next(iter(hdamoe_env.REGISTERED_ENVS)), -1
    for env_id, (kwargs, _) in hdamoe_env.REGISTERED_ENVS.items():
        if all(run.get(k) == v for k, v in kwargs.items()) and len(kwargs) > best_n:
            best, best_n = env_id, len(kwargs)
    return best


def _train_settings(args: argparse.Namespace) -> tuple[dict[str, Any], int, int, bool]:
    """Merge ``--hyperparams FILE`` with the flags: (overrides, timesteps, n_envs, normalize)."""
    hp: dict[str, Any] = {}
    timesteps, n_envs, normalize = None, None, None
    mode, candidates = None, None
    if args.hyperparams is not None:
        loaded = load_hyperparams(args.hyperparams, args.algo, args.hyperparams_section,
                                  env_id=_run_env_id(args))
        hp.update(loaded.hyperparams)
        timesteps, n_envs, normalize = loaded.n_timesteps, loaded.n_envs, loaded.normalize_obs
        mode, candidates = loaded.action_mode, loaded.num_candidates
    elif args.hyperparams_section is not None:
        raise ConfigError(f"--hyperparams-section {args.hyperparams_section!r} needs "
                          "--hyperparams FILE.yml")
    hp.update(_parse_hp(args.hp))
    check_hyperparams(hp)
    # the flags win over the file's env_wrapper (RL Zoo's action design)
    args.action_mode = args.action_mode or mode or "ranked"
    args.candidates = args.candidates or candidates or 4
    timesteps = args.timesteps or timesteps or 10_000
    n_envs = args.n_envs or n_envs or default_n_envs(args.action_mode, _quality(args),
                                                     getattr(args, "replica_shares", None))
    normalize = False if args.no_normalize else (True if normalize is None else normalize)
    return hp, timesteps, n_envs, normalize


def cmd_train(args: argparse.Namespace) -> int:
    """Run ``hdamoe train``; print the evaluation; return the exit code.

    With ``--seeds``, one policy per seed is trained into ``OUT/seed<S>/`` (each resumable with
    ``--resume``), then all of them are evaluated together with the baselines on the held-out
    streams; ``OUT/seeds.json`` and ``OUT/seeds.md`` give the per-seed and mean TBT with a 95 %
    Student-t interval over seeds.
    """
    t0 = time.perf_counter()
    quality = _quality(args)                     # checked before any work
    hyperparams, timesteps, n_envs, normalize = _train_settings(args)
    env_kwargs = env_kwargs_from_args(args)
    baselines = [b.strip() for b in args.eval_baselines.split(",") if b.strip()]
    for b in baselines:
        if b.startswith("tuned:"):
            parse_method(b)                # a bad tuned file fails before training
    seeds = list(dict.fromkeys(parse_seeds(args.seeds) or [])) or None
    if seeds is not None and args.seed != 0:
        raise ConfigError(f"--seed {args.seed} with --seeds {args.seeds}: expected only one of "
                          "them; add the seed to --seeds")
    per_seed_eval = None if args.no_eval or seeds else held_out_evaluation(
        seeds=parse_seeds(args.eval_seeds), steps=args.eval_steps, trace=args.eval_trace,
        baselines=baselines, learning_curve=not args.no_tensorboard)
    _check_replica_placement(args.replica_shares, env_kwargs)      # before resolving it
    placement = resolve_placement(env_kwargs)
    runs = [(args.seed, Path(args.out))] if seeds is None else \
        [(s, Path(args.out) / f"seed{s}") for s in seeds]
    for seed, out in runs:
        path = _train_one(args, env_kwargs, seed, out, timesteps, n_envs, normalize, hyperparams,
                          placement, quality, per_seed_eval)
        meta = read_meta(out)
        print(f"hdamoe train: {meta['algo']} seed {seed} {meta['num_timesteps']} steps on "
              f"{args.fidelity} ({meta['steps_per_s'] or 0:.0f} steps/s, training wall "
              f"{meta['wall_s']:.1f} s) -> {path}")
        if per_seed_eval is not None:
            print((out / "eval.md").read_text())
    if seeds is not None and not args.no_eval:
        line = stage("held-out evaluation of every seed")
        try:
            res = evaluate([str(out) for _, out in runs], seeds=parse_seeds(args.eval_seeds),
                           steps=args.eval_steps, trace=args.eval_trace, baselines=baselines,
                           out_dir=args.out)
        finally:
            line.close()
        labels = {f"learned:{out.name}": seed for seed, out in runs}
        summary = seed_interval_summary(res, labels)
        text = json.dumps({"seeds": seeds, "summary": summary}, indent=1,
                          default=to_jsonable) + "\n"
        atomic_write(Path(args.out) / "seeds.json", lambda fh: fh.write(text.encode()), "wb")
        md = format_seed_summary(summary)
        atomic_write(Path(args.out) / "seeds.md", lambda fh: fh.write(md.encode()), "wb")
        print(md)
    if seeds is not None and not args.no_tensorboard:
        try:
            png = plot_seed_curves(args.out, {seed: out for seed, out in runs})
            if png is not None:
                print(f"learning curves of every seed: {png}")
        except DependencyNotInstalled as exc:
            print(f"hdamoe train: no learning-curve plot ({exc})")
    print(f"wall {time.perf_counter() - t0:.1f} s")
    return 0


#: Env copies of ``hdamoe train`` without ``--n-envs`` (or a file's ``n_envs``) when the batched
#: backend supports the run; one env otherwise (docs/results/throughput.md, "Training").
DEFAULT_N_ENVS = 32


def default_n_envs(action_mode: str, quality: dict[str, Any] | None,
                   replica_shares: int | None) -> int:
    """Return the default env copies: :data:`DEFAULT_N_ENVS` where the batched vector backend
    applies (action mode full or ranked, no quality reward, no replica shares), else 1 (the
    per-process backend would start one process per copy)."""
    return DEFAULT_N_ENVS if resolve_vec_backend("auto", DEFAULT_N_ENVS, action_mode, quality,
                                                 replica_shares) == "batched" else 1


def resolve_vec_backend(name: str, n_envs: int, action_mode: str,
                        quality: dict[str, Any] | None, replica_shares: int | None) -> str:
    """Return the vector backend of ``--vec-backend name``: ``auto`` is ``batched`` for more
    than one copy when the batched backend supports the run (action mode full or ranked, no
    quality reward, no replica shares), else ``subproc``; other names are returned as given."""
    if name != "auto":
        return name
    from agents.learned.vector import VECTOR_ACTION_MODES

    eligible = (n_envs > 1 and action_mode in VECTOR_ACTION_MODES and quality is None
                and not replica_shares)
    return "batched" if eligible else "subproc"


def _check_replica_placement(replica_shares: int | None, env_kwargs: dict[str, Any]) -> None:
    """Refuse ``--replica-shares`` on a placement without redundant experts, before any work.

    ``tp``, ``ep`` and ``.npz`` files are checked directly; among the placement methods only
    ``eplb`` adds redundant experts ([decision]: checked by name, so a costly method such as
    ``node_link`` is refused before it is computed); ``train`` checks the resolved placement
    again.

    Raises:
        ConfigError: Naming the placement and suggesting ``--placement eplb``.
    """
    name = env_kwargs.get("placement", "ep")
    if replica_shares is None or not isinstance(name, str):
        return
    if name in ("tp", "tp-tiled", "tp_tiled", "ep") or name.endswith(".npz"):
        check_replica_shares(replica_shares, name)
    elif name.replace("-", "_") != "eplb":
        check_replica_shares(replica_shares, None, name)


def _train_one(args: argparse.Namespace, env_kwargs: dict[str, Any], seed: int, out: Path,
               timesteps: int, n_envs: int, normalize: bool, hyperparams: dict[str, Any],
               placement: Placement | None, quality: dict[str, Any] | None,
               evaluate_fn: Callable[[Path], dict[str, Any]] | None) -> Path:
    """Train one seed of ``hdamoe train`` with a progress bar; return the model path."""
    # one progress helper (a tqdm bar on a terminal, plain lines in logs); SB3's own bar with
    # --sb3-progress-bar instead; none with --no-progress
    sb3_bar = bool(args.sb3_progress_bar) and args.progress
    bar = progress_bar(timesteps, f"train env steps (seed {seed})", unit="step",
                       enabled=args.progress and not sb3_bar)
    done = {"n": 0}

    def on_progress(steps: int, fps: float) -> None:
        bar.set_postfix_str(f"{fps:.0f} steps/s")
        bar.update(max(0, steps - done["n"]))
        done["n"] = steps
        if steps >= timesteps:
            bar.close()

    wrapped = None
    if evaluate_fn is not None:
        inner = evaluate_fn

        def wrapped(out_dir: Path) -> dict[str, Any]:
            bar.close()
            line = stage("held-out evaluation")
            try:
                return inner(out_dir)
            finally:
                line.close()

    try:
        return train(args.algo, env_kwargs, timesteps, n_envs=n_envs,
                     seed=seed, out_dir=out, checkpoint_every=args.checkpoint_every,
                     fidelity=args.fidelity, normalize_obs=normalize,
                     tensorboard=not args.no_tensorboard, resume=args.resume,
                     hyperparams=hyperparams, placement=placement,
                     evaluate_fn=wrapped, progress=sb3_bar,
                     action_mode=args.action_mode, num_candidates=args.candidates,
                     residual_keep_logit=args.keep_logit, quality=quality,
                     replica_shares=args.replica_shares,
                     on_progress=on_progress if args.progress and not sb3_bar else None,
                     vec_backend=resolve_vec_backend(getattr(args, "vec_backend", "auto"),
                                                     n_envs, args.action_mode, quality,
                                                     args.replica_shares))
    finally:
        bar.close()


