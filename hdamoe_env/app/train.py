"""``hdamoe train`` and ``hdamoe evaluate``: train learned agents, compare them on held-out streams.

Implements the application side of issue 5 (learned online policies for the decisions of
paper-model.md §10–11): argument parsing, resolution of a placement given by method name, the
held-out evaluation of learned against heuristic agents with the bench harness
(``hdamoe_env.app.bench``), on the analytic twin and on the DES, and the learning-curve plot.
Training itself is ``agents.learned.train.train`` and loading ``agents.learned.policy.load_agent``;
they import nothing from this layer (style.md §2), so this module passes them the resolved
placement and the evaluation as a callback.

Decisions:

* [decision] Held-out streams: a synthetic training trace with ``trace_seed`` s is evaluated on
  ``trace_seed`` s + 1000 (a different set of requests), with episode seeds 10 000 + i, never
  used in training (training episodes are seeded by SB3 from ``seed``). For a real trace, pass
  ``eval_trace`` (e.g. another category); without it the same trace is used with unseen
  episode seeds, and the table says so.
* [decision] Every compared method runs on the same placement and the same env arguments as
  the learned agent was trained with (bench's identical episodes).

This module is longer than 700 lines because the two commands it serves (``train`` and
``evaluate``) share the placement resolution, the held-out evaluation, its table and the plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agents.learned.policy import read_meta
from agents.learned.train import (
    ACTION_MODES,
    ALGORITHMS,
    check_replica_shares,
    load_hyperparams,
    to_jsonable,
    train,
)
from agents.wrappers import RESIDUAL_KEEP_LOGIT
from hdamoe_env.app import bench
from hdamoe_env.app.argtypes import hp_item, int_list, nonneg_int, positive_int
from hdamoe_env.app.progress import bar as progress_bar
from hdamoe_env.app.progress import stage
from hdamoe_env.app.records import format_bench_table, summarise
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled
from hdamoe_env.config.fileio import atomic_write
from hdamoe_env.sim.placement import Placement

__all__ = [
    "AGENT_ALIASES",
    "DEFAULT_BASELINES",
    "add_evaluate_arguments",
    "add_train_arguments",
    "cmd_evaluate",
    "cmd_train",
    "evaluate",
    "format_evaluation",
    "format_seed_summary",
    "held_out_evaluation",
    "plot_learning_curve",
    "plot_seed_curves",
    "read_scalars",
    "resolve_placement",
    "seed_interval_summary",
    "t_interval",
    "write_eval_scalars",
]

log = logging.getLogger(__name__)

#: Offset of the held-out synthetic trace seed and of the evaluation episode seeds.
HELD_OUT_TRACE_OFFSET, EVAL_SEED_BASE = 1000, 10_000
#: Heuristic agents every evaluation compares against (static, greedy pre-broadcast only,
#: gating only, HD-MoE, HDA-MoE).
DEFAULT_BASELINES: tuple[str, ...] = ("noop", "greedy-prebroadcast", "hardware-aware-gating",
                                      "hd-moe", "hda-moe")
#: Agent aliases of ``hdamoe evaluate``.
AGENT_ALIASES = {"greedy-hda": "hda-moe", "greedy-hd": "hd-moe", "greedy": "greedy-prebroadcast",
                 "static": "noop"}



# ------------------------------------------------------------------------------- placement
def resolve_placement(env_kwargs: dict[str, Any]) -> Placement | None:
    """Return the placement a method name in ``env_kwargs["placement"]`` stands for.

    ``tp``, ``ep``, ``.npz`` paths and ``Placement`` objects are built by the env itself (None
    is returned); a method name such as ``node_link`` or ``hybrid`` is computed (or read from
    the cache / ``placement_dir``) by the bench's placement store on the configuration's trace.

    Raises:
        ConfigError: Unknown placement name or bad configuration.
    """
    name = env_kwargs.get("placement", "ep")
    if not isinstance(name, str) or name in ("tp", "ep") or name.endswith(".npz"):
        return None
    # [decision] the one place this command resolves a placement name: swap for the single
    # name -> Placement resolver (style.md §1, baselines/store.py) when it exists
    config = _bench_config(env_kwargs, fidelity="des", steps=1)
    trace, _ = bench.load_bench_trace(config)
    placement, _ = bench.placement_store(config, trace, progress=False).get(name)
    return placement


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
            from hdamoe_env.config.specs import ModelSpec

            fields[name] = ModelSpec.from_dict(fields[name])
    return bench.BenchConfig(**fields, steps=steps, fidelity=fidelity, env_kwargs=extra)


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


def _methods(agent_specs: Sequence[str], placement: str) -> list[bench.MethodSpec]:

    methods = []
    n_learned = sum(1 for s in agent_specs if Path(s).exists() or s.endswith(".zip"))
    n_tuned = sum(1 for s in agent_specs if s.startswith("tuned:"))
    for spec in agent_specs:
        if spec.startswith("tuned:"):               # the tuned heuristic of `hdamoe tune`
            parsed = bench.parse_method(spec if "@" in spec else f"{spec}@{placement}")
            methods.append(dataclasses.replace(parsed, name="tuned" if n_tuned == 1 else
                                               f"tuned:{Path(spec[6:]).parent.name}"))
            continue
        name = AGENT_ALIASES.get(spec, spec)
        label = "learned" if Path(spec).exists() or spec.endswith(".zip") else name
        if label == "learned" and n_learned > 1:
            label = f"learned:{Path(spec).name}" if Path(spec).name != "model.zip" else \
                f"learned:{Path(spec).parent.name}"
        methods.append(bench.MethodSpec(label, placement, None if name == "noop" else name,
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
    if agent_paths is None:
        paths: list[str] = []
    elif isinstance(agent_paths, str | os.PathLike):
        paths = [str(agent_paths)]
    else:
        paths = [str(p) for p in agent_paths]
    meta: dict[str, Any] = {}
    for p in paths:
        meta = read_meta(p)
        if meta:
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
        tables[fid] = format_bench_table(result.records)
        records.extend(result.records)
        rows = {r["method"]: r for r in summarise(result.records)}
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
        text = json.dumps(dict(out), indent=1, default=to_jsonable) + "\n"
        atomic_write(target / "eval.json", lambda fh: fh.write(text.encode()), "wb")
        atomic_write(target / "eval.md", lambda fh: fh.write(format_evaluation(out).encode()),
                     "wb")
    return out


def held_out_evaluation(*, seeds: Sequence[int] | None = None, steps: int = 16,
                        fidelities: Sequence[str] | None = None, trace: Any = None,
                        baselines: Sequence[str] | None = None, learning_curve: bool = True
                        ) -> Callable[[Path], dict[str, Any]]:
    """Return the ``evaluate_fn`` of ``agents.learned.train.train``: evaluate, then plot.

    The callable runs :func:`evaluate` on the freshly trained agent (its held-out split,
    writing ``eval.json`` and ``eval.md`` next to it) and, with ``learning_curve``, writes
    ``learning_curve.png`` with the heuristic agents' held-out TBT as reference lines (skipped
    with a warning when tensorboard or matplotlib is missing).

    Args:
        seeds: Evaluation episode seeds (default 10 000, 10 001, 10 002).
        steps: Decode steps per evaluation episode.
        fidelities: Fidelities of the evaluation (default: the training one and ``"des"``).
        trace: Held-out trace (default: synthetic with ``trace_seed`` + 1000, or the same real
            trace with unseen episode seeds).
        baselines: Heuristic agents compared (default :data:`DEFAULT_BASELINES`).
        learning_curve: Plot the learning curve from the run's TensorBoard logs.
    """
    def run(out_dir: Path) -> dict[str, Any]:
        res = evaluate(out_dir, seeds=seeds, steps=steps, fidelities=fidelities, trace=trace,
                       baselines=baselines, out_dir=out_dir)
        write_eval_scalars(out_dir, res)
        if learning_curve:
            fidelity = read_meta(out_dir).get("fidelity", "analytic")
            ref = {m: v for m, v in res["summary"].get(fidelity, {}).get("tbt_us", {}).items()
                   if m in ("noop", "hardware-aware-gating", "hda-moe")}
            try:
                plot_learning_curve(out_dir, reference={f"{m} (held-out, {fidelity})": v
                                                        for m, v in ref.items()})
            except DependencyNotInstalled as exc:
                log.warning("learning curve skipped: %s", exc)
        return res

    return run


def write_eval_scalars(out_dir: str | os.PathLike[str], result: dict[str, Any]) -> Path | None:
    """Write the held-out evaluation as ``eval/*`` scalars into the run's TensorBoard directory.

    Tags ``eval/{fidelity}/tbt_us/{method}`` and ``eval/{fidelity}/{learned}_vs_{ref}`` at
    x = the agent's training env steps (the x-axis of SB3's ``rollout/*`` and ``train/*``), in
    the newest SB3 run directory under ``out_dir/tb`` (docs/TENSORBOARD.md).

    Returns:
        The run directory written to, or None without TensorBoard logs.
    """
    from hdamoe_env.app.tb import make_writer

    tb_root = Path(out_dir) / "tb"
    runs = sorted((p for p in tb_root.glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    if not runs:
        return None
    step = int(read_meta(out_dir).get("num_timesteps", 0))
    with make_writer(runs[-1]) as writer:
        for fid, summary in result["summary"].items():
            if fid == "twin_gap":
                continue
            for method, tbt in summary.get("tbt_us", {}).items():
                writer.add_scalar(f"eval/{fid}/tbt_us/{method}", float(tbt), step)
            for key, value in summary.items():
                if key != "tbt_us":
                    writer.add_scalar(f"eval/{fid}/{key}", float(value), step)
    return runs[-1]


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


def _pyplot() -> Any:
    """Return ``matplotlib.pyplot`` with the Agg backend (lazy; the plot extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise DependencyNotInstalled("the learning-curve plot needs matplotlib") from exc
    return plt


def plot_learning_curve(out_dir: str | os.PathLike[str], path: str | os.PathLike[str] | None = None,
                        reference: dict[str, float] | None = None) -> Path:
    """Write ``learning_curve.png``: mean training TBT and episode reward over env steps.

    Args:
        out_dir: Output directory of ``hdamoe train``.
        path: PNG path (default ``out_dir/learning_curve.png``).
        reference: Horizontal lines, label → TBT µs (e.g. heuristic agents on the twin).

    Raises:
        DependencyNotInstalled: matplotlib or tensorboard missing.
    """
    plt = _pyplot()
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


def plot_seed_curves(out_dir: str | os.PathLike[str], seed_dirs: dict[int, Path],
                     path: str | os.PathLike[str] | None = None) -> Path | None:
    """Write ``learning_curves.png`` of a ``--seeds`` run: every seed's training curves.

    Left: TensorBoard ``latency/tbt_us`` (mean TBT of the training episodes, training trace and
    fidelity); right: ``rollout/ep_rew_mean`` (the reward the policy optimised, quality term
    included). One line per seed.

    Args:
        out_dir: Output directory of ``hdamoe train --seeds``.
        seed_dirs: Seed → its run directory (``OUT/seed<S>``).
        path: PNG path (default ``out_dir/learning_curves.png``).

    Returns:
        The PNG path, or None when no seed has TensorBoard scalars.

    Raises:
        DependencyNotInstalled: matplotlib or tensorboard missing.
    """
    plt = _pyplot()
    curves = {seed: read_scalars(d) for seed, d in sorted(seed_dirs.items())}
    if not any(curves.values()):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, tag, label in ((axes[0], "latency/tbt_us", "training TBT (µs)"),
                           (axes[1], "rollout/ep_rew_mean", "episode reward")):
        for i, (seed, scalars) in enumerate(curves.items()):
            data = scalars.get(tag, [])
            if data:
                ax.plot([s for s, _ in data], [v for _, v in data], color=f"C{i}",
                        label=f"seed {seed}")
        ax.set_xlabel("env steps")
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    target = Path(path) if path is not None else Path(out_dir) / "learning_curves.png"
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target


# ------------------------------------------------------------------------------------- CLI
def _env_cli_arguments(p: argparse.ArgumentParser, *, defaults: bool) -> None:
    d: Callable[[Any], Any] = (lambda v: v) if defaults else (lambda v: None)
    p.add_argument("--model", default=d("deepseek-v2-lite"), help="model preset id")
    p.add_argument("--mesh", default=d("4x8"), help="node grid XxY")
    p.add_argument("--setting", default=d("5/50"), help="TFLOPS per node / GB/s per link")
    p.add_argument("--batch", type=positive_int, default=d(128), help="tokens per decode step B")
    p.add_argument("--conventions", default=d("faithful"), help="convention profile")
    p.add_argument("--trace", default=d("synthetic"), help="'synthetic' or a trace path")
    p.add_argument("--requests", type=positive_int, default=None, help="synthetic trace: requests")
    p.add_argument("--trace-seed", type=nonneg_int, default=None, help="synthetic trace seed")
    p.add_argument("--k-b", type=nonneg_int, default=None,
                   help="force N pre-broadcast slots per layer (default: the budget rule)")
    p.add_argument("--max-broadcast", type=nonneg_int, default=None, help="pre-broadcast slots")
    p.add_argument("--placement", default=None,
                   help="tp | ep | node_link | hybrid | node_balance (default ep)")
    p.add_argument("--placement-dir", default=None, help="`hdamoe place` output directory")
    p.add_argument("--gating-levels", default=None,
                   help="comma list of gating levels of the action, index 0 = off (default "
                   "0,0.5,1,2); every compared method runs on the same env")
    p.add_argument("--gating-protect-top", type=nonneg_int, default=None,
                   help="never let gating drop a token's m best experts (env setting "
                   "gating_protect_top, 0..k; default 0); the baselines run on the same env, "
                   "a tuned: method keeps its own")


def _env_kwargs_from_args(args: argparse.Namespace, base: dict[str, Any] | None = None
                          ) -> dict[str, Any]:
    kwargs = dict(base or {})
    for attr, key in (("model", "model"), ("mesh", "mesh"), ("setting", "setting"),
                      ("batch", "batch"), ("conventions", "conventions"), ("trace", "trace"),
                      ("requests", "trace_requests"), ("trace_seed", "trace_seed"),
                      ("k_b", "k_b"), ("max_broadcast", "max_broadcast"),
                      ("placement", "placement"), ("placement_dir", "placement_dir"),
                      ("gating_protect_top", "gating_protect_top")):
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


def add_train_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options of ``hdamoe train`` to ``p`` (the command runs :func:`cmd_train`).

    Returns:
        ``p``.
    """
    p.add_argument("--algo", default="maskable-ppo", choices=ALGORITHMS, help="RL algorithm")
    _env_cli_arguments(p, defaults=True)
    p.add_argument("--timesteps", type=positive_int, default=None,
                   help="total env steps (default: n_timesteps of --hyperparams, else 10000)")
    p.add_argument("--action-mode", default="ranked", choices=ACTION_MODES,
                   help="ranked: slot = rank among the K most-loaded predicted experts; full: "
                   "expert ids; residual: HDA-MoE's action + a learned deviation")
    p.add_argument("--keep-logit", type=float, default=RESIDUAL_KEEP_LOGIT,
                   help="residual mode: initial logit bonus of 'keep the greedy's choice'")
    p.add_argument("--candidates", type=positive_int, default=4, help="K of the ranked action")
    p.add_argument("--replica-shares", type=positive_int, default=None, metavar="K",
                   help="also learn per-expert replica routing shares: one extra action value "
                   "0..K per routed expert (v/K of its tokens to the primary copy, the rest "
                   "evenly to its replicas); needs a placement with redundant experts "
                   "(--placement eplb); default off")
    p.add_argument("--fidelity", default="analytic", choices=("analytic", "des"),
                   help="training fidelity")
    p.add_argument("--n-envs", type=positive_int, default=None,
                   help="env copies, SubprocVecEnv if > 1 (default: n_envs of --hyperparams, "
                   "else 1)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="random seed")
    p.add_argument("--seeds", type=int_list, default=None, metavar="S,S,...",
                   help="train one policy per seed into OUT/seed<S>/, then evaluate all of them "
                   "together on the held-out streams (mean and 95 %% t-interval over seeds)")
    p.add_argument("--hyperparams", default=None, metavar="FILE.yml",
                   help="RL Zoo style hyperparameter file (e.g. hyperparams/maskable-ppo.yml); "
                   "--hp, --timesteps and --n-envs override it")
    p.add_argument("--hyperparams-section", default=None, metavar="NAME",
                   help="section of --hyperparams (default: the algorithm's name, then HdMoE-v0)")
    p.add_argument("--checkpoint-every", type=nonneg_int, default=5_000, help="steps (0: never)")
    p.add_argument("--no-normalize", action="store_true", help="no VecNormalize")
    p.add_argument("--no-tensorboard", action="store_true", help="do not write TensorBoard logs")
    p.add_argument("--hp", type=hp_item, action="append", default=[], metavar="NAME=VALUE",
                   help="hyperparameter override, e.g. --hp n_steps=128 (repeatable)")
    p.add_argument("--quality-target", type=float, default=None,
                   help="charge the reward for top-1 retention below this target "
                   "(QualityRewardWrapper; default: latency reward only)")
    p.add_argument("--quality-weight", type=float, default=100.0,
                   help="fixed penalty weight per unit of missing top-1 retention")
    p.add_argument("--lagrangian", action="store_true",
                   help="update the weight by projected dual ascent instead (λ starts at 0)")
    p.add_argument("--dual-step", type=float, default=50.0, help="dual ascent step size")
    p.add_argument("--eval-steps", type=positive_int, default=16, help="decode steps per eval episode")
    p.add_argument("--eval-seeds", type=int_list, default=None, help="comma list (default 10000,10001,10002)")
    p.add_argument("--eval-trace", default=None, help="held-out trace (real traces)")
    p.add_argument("--eval-baselines", default=",".join(DEFAULT_BASELINES),
                   help="heuristic agents of the held-out evaluation, comma list; "
                   "tuned:PATH/tuned.json adds the tuned heuristic of `hdamoe tune`")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--progress", action="store_true", help="SB3 progress bar")
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


#: Two-sided 95 % Student-t quantiles t(0.975, dof) for dof = 1 … 30 (beyond: 1.96 + 2.5/dof,
#: within 0.3 % of the exact value for dof > 30).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_interval(values: Sequence[float]) -> tuple[float, float | None]:
    """Return the mean and the half-width of its two-sided 95 % Student-t interval.

    The interval is mean ± t(0.975, n − 1) · s / √n with the sample standard deviation s
    (n − 1 in the denominator): the spread over independent training seeds, not over episodes.

    Args:
        values: One value per seed.

    Returns:
        ``(mean, half_width)``; half_width is None for a single value.

    Raises:
        ConfigError: No values.
    """
    xs = [float(v) for v in values]
    if not xs:
        raise ConfigError("t_interval needs at least one value, got none; pass one per seed")
    n = len(xs)
    mean = sum(xs) / n
    if n == 1:
        return mean, None
    dof = n - 1
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / dof)
    t = _T975[dof - 1] if dof <= len(_T975) else 1.96 + 2.5 / dof
    return mean, t * std / math.sqrt(n)


def seed_interval_summary(result: dict[str, Any], labels: dict[str, int]) -> dict[str, Any]:
    """Summarise an :func:`evaluate` result of several training seeds per fidelity.

    Args:
        result: The evaluation (its ``records``; learned methods named as in ``labels``).
        labels: Method label of each seed's learned agent -> training seed.

    Returns:
        ``{fidelity: {"per_seed": [{seed, tbt_us, top1_retention}], "learned": {tbt_us,
        tbt_ci95_us, top1_retention, top1_ci95}, "baselines": {method: {tbt_us,
        top1_retention}}, "learned_vs": {method: mean learned TBT / method TBT − 1}}}``; TBT and
        retention of a seed are means over the evaluation episodes.
    """
    out: dict[str, Any] = {}
    by_fid: dict[str, list[dict[str, Any]]] = {}
    for rec in result["records"]:
        by_fid.setdefault(str(rec.get("fidelity", "des")), []).append(rec)
    for fid, recs in by_fid.items():
        rows = {r["method"]: r for r in summarise(recs)}
        per_seed = [{"seed": seed, "tbt_us": rows[m]["tbt_us"],
                     "top1_retention": rows[m].get("top1_retention")}
                    for m, seed in labels.items() if m in rows]
        if not per_seed:
            continue
        tbt, tbt_hw = t_interval([p["tbt_us"] for p in per_seed])
        rets = [p["top1_retention"] for p in per_seed if p["top1_retention"] is not None]
        ret, ret_hw = t_interval(rets) if rets else (None, None)
        base = {m: {"tbt_us": r["tbt_us"], "top1_retention": r.get("top1_retention")}
                for m, r in rows.items() if m not in labels}
        out[fid] = {"per_seed": per_seed,
                    "learned": {"tbt_us": tbt, "tbt_ci95_us": tbt_hw, "top1_retention": ret,
                                "top1_ci95": ret_hw, "n_seeds": len(per_seed)},
                    "baselines": base,
                    "learned_vs": {m: tbt / b["tbt_us"] - 1 for m, b in base.items()
                                   if b["tbt_us"] > 0}}
    return out


def format_seed_summary(summary: dict[str, Any]) -> str:
    """Return :func:`seed_interval_summary` as Markdown tables (one per fidelity)."""
    def pct(v: Any) -> str:
        return "–" if v is None else f"{v:.4f}"

    lines: list[str] = []
    for fid, s in summary.items():
        ln = s["learned"]
        ci = "" if ln["tbt_ci95_us"] is None else f" ± {ln['tbt_ci95_us']:.1f}"
        rci = "" if ln["top1_ci95"] is None else f" ± {ln['top1_ci95']:.4f}"
        lines += [f"## fidelity {fid}", "",
                  f"95 % interval: Student t, n − 1 = {ln['n_seeds'] - 1} degrees of freedom, "
                  "over training seeds (each seed: mean over the evaluation episodes).", "",
                  "| method | TBT µs | top-1 retention |", "|---|---|---|"]
        for p in s["per_seed"]:
            lines.append(f"| learned, seed {p['seed']} | {p['tbt_us']:.1f} | "
                         f"{pct(p['top1_retention'])} |")
        lines.append(f"| **learned, mean ± 95 % CI** | **{ln['tbt_us']:.1f}{ci}** | "
                     f"{pct(ln['top1_retention'])}{rci} |")
        for m, b in s["baselines"].items():
            lines.append(f"| {m} | {b['tbt_us']:.1f} | {pct(b['top1_retention'])} |")
        lines += ["", "learned mean vs: " + ", ".join(f"{m} {v:+.2%}" for m, v in
                                                       s["learned_vs"].items()), ""]
    return "\n".join(lines) + "\n"


def _train_settings(args: argparse.Namespace) -> tuple[dict[str, Any], int, int, bool]:
    """Merge ``--hyperparams FILE`` with the flags: (overrides, timesteps, n_envs, normalize)."""
    hp: dict[str, Any] = {}
    timesteps, n_envs, normalize = None, None, None
    if args.hyperparams is not None:
        loaded = load_hyperparams(args.hyperparams, args.algo, args.hyperparams_section)
        hp.update(loaded.hyperparams)
        timesteps, n_envs, normalize = loaded.n_timesteps, loaded.n_envs, loaded.normalize_obs
    elif args.hyperparams_section is not None:
        raise ConfigError(f"--hyperparams-section {args.hyperparams_section!r} needs "
                          "--hyperparams FILE.yml")
    hp.update(_parse_hp(args.hp))
    timesteps = args.timesteps or timesteps or 10_000
    n_envs = args.n_envs or n_envs or 1
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
    env_kwargs = _env_kwargs_from_args(args)
    baselines = [b.strip() for b in args.eval_baselines.split(",") if b.strip()]
    for b in baselines:
        if b.startswith("tuned:"):
            bench.parse_method(b)                # a bad tuned file fails before training
    seeds = list(dict.fromkeys(_seeds(args.seeds) or [])) or None
    if seeds is not None and args.seed != 0:
        raise ConfigError(f"--seed {args.seed} with --seeds {args.seeds}: expected only one of "
                          "them; add the seed to --seeds")
    per_seed_eval = None if args.no_eval or seeds else held_out_evaluation(
        seeds=_seeds(args.eval_seeds), steps=args.eval_steps, trace=args.eval_trace,
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
            res = evaluate([str(out) for _, out in runs], seeds=_seeds(args.eval_seeds),
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
    if name in ("tp", "ep") or name.endswith(".npz"):
        check_replica_shares(replica_shares, name)
    elif name.replace("-", "_") != "eplb":
        check_replica_shares(replica_shares, None, name)


def _train_one(args: argparse.Namespace, env_kwargs: dict[str, Any], seed: int, out: Path,
               timesteps: int, n_envs: int, normalize: bool, hyperparams: dict[str, Any],
               placement: Placement | None, quality: dict[str, Any] | None,
               evaluate_fn: Callable[[Path], dict[str, Any]] | None) -> Path:
    """Train one seed of ``hdamoe train`` with a progress bar; return the model path."""
    # one progress helper (a tqdm bar on a terminal, plain lines in logs); SB3's own bar with
    # --progress instead
    bar = progress_bar(timesteps, f"train env steps (seed {seed})", unit="step",
                       enabled=not args.progress)
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
                     evaluate_fn=wrapped, progress=args.progress,
                     action_mode=args.action_mode, num_candidates=args.candidates,
                     residual_keep_logit=args.keep_logit, quality=quality,
                     replica_shares=args.replica_shares,
                     on_progress=None if args.progress else on_progress)
    finally:
        bar.close()


def add_evaluate_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options of ``hdamoe evaluate`` to ``p`` (the command runs :func:`cmd_evaluate`).

    Returns:
        ``p``.
    """
    p.add_argument("--agent", required=True,
                   help="comma list: PATH (learned) | greedy-hda | hd-moe | greedy | noop | any "
                   "registered agent")
    p.add_argument("--baselines", default=",".join(DEFAULT_BASELINES),
                   help="heuristic agents added to the comparison ('' for none)")
    _env_cli_arguments(p, defaults=False)
    p.add_argument("--fidelity", default="des",
                   help="comma list of fidelities (des, analytic)")
    p.add_argument("--seeds", type=int_list, default=None, help="episode seeds (default 10000,10001,10002)")
    p.add_argument("--steps", type=positive_int, default=16, help="decode steps per episode")
    p.add_argument("--no-held-out", action="store_true",
                   help="evaluate on the given trace as is (default: the held-out split of a "
                   "learned agent's training trace)")
    p.add_argument("--out", default=None, help="write eval.json / eval.md here")
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
        meta = read_meta(paths[0])
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
