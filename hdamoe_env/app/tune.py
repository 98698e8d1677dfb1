"""``hdamoe tune``: the tuned-heuristic baseline and its per-layer hindsight bound.

Searches every knob of the greedy agents (``agents.tuned``: gating level, protect-top, dispatch
rule, k_b, and the replica rule of redundant experts) on the TRAINING part of a trace, under a top-1 retention
constraint, then measures the best point, default HDA-MoE and HD-MoE on HELD-OUT streams and,
with ``--oracle``, the per-layer hindsight oracle over the same grid on the held-out steps.

Decisions:

* [decision] Split, as ``hdamoe train`` (``hdamoe_env.app.train``): a synthetic training trace
  with ``trace_seed`` s is evaluated on ``trace_seed`` s + 1000 with episode seeds 10 000 + i;
  a real trace is evaluated on the same trace with the unseen episode seeds (or pass
  ``--eval-trace``). Training episodes use ``--train-seeds`` (default 0, 1).
* [decision] The placement (``--placement``, default ``node_link`` as bench's ``hda-moe``) is
  resolved once, on the training trace, by the bench's placement store, and used unchanged on
  the held-out streams: it is an offline artifact of the training data. (``hdamoe evaluate``
  resolves it on the evaluation trace instead; its HDA-MoE numbers can differ by that.)
* [decision] Quality = mean over all MoE layers of all decode steps of the top-1 retention
  (1 for an ungated layer), the term the constraint and the reward wrapper use.

Output directory ``--out``: ``points.jsonl`` (one line per evaluated point, rewritten atomically
after each; ``--resume`` reuses it), ``tuned.json`` (best knobs, training and held-out TBT and
quality, all points; ``hdamoe bench --methods tuned:OUT/tuned.json`` runs it), ``oracle.json``
(``--oracle``) and ``tune.md`` (the tables). A non-empty ``--out`` that is not a tune run is
refused unless ``--force``, which first moves this command's files into
``--out/superseded-<time>/`` (nothing is deleted).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from hdamoe_env.app.flags import add_deprecated_alias, add_progress_flag
from hdamoe_env.app import bench
from hdamoe_env.app.evaluate import EVAL_SEED_BASE, HELD_OUT_TRACE_OFFSET
from hdamoe_env.app.argtypes import (add_decision_arguments, add_run_arguments, bounded_float,
                                     nonneg_int, positive_int, run_from_args, seed_list)
from hdamoe_env.app.tables import render_table
from hdamoe_env.config.errors import ConfigError, OutputPathError
from hdamoe_env.config.fileio import atomic_write, write_json

__all__ = ["OWN_FILES", "add_tune_arguments", "cmd_tune", "parse_grid", "run_tune"]

log = logging.getLogger(__name__)

#: Files this command writes into ``--out``.
OWN_FILES = ("points.jsonl", "tuned.json", "oracle.json", "tune.md")
# ------------------------------------------------------------------------------------ grid
def _ints(text: str | list[int]) -> list[int]:
    if isinstance(text, list):
        return [int(t) for t in text]
    return [int(t) for t in str(text).split(",") if t.strip()]


def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ConfigError(f"--{what} {text!r}: expected a comma list of numbers") from None


def _kb_values(text: str) -> tuple[int | None, ...]:
    out: list[int | None] = []
    for t in (t.strip() for t in text.split(",")):
        if not t:
            continue
        if t in ("budget", "none", "rule"):
            out.append(None)
            continue
        try:
            out.append(int(t))
        except ValueError:
            raise ConfigError(f"--k-b {text!r}: expected a comma list of 'budget' and integers"
                              ) from None
    return tuple(out)


def parse_grid(levels: str, protect_top: str, rules: str, k_b: str, replica_rules: str,
               min_imbalance: str = "none") -> Any:
    """Return the ``agents.tuned.KnobGrid`` of the CLI's comma lists.

    Raises:
        ConfigError: A malformed list or an unknown value.
    """
    from agents.tuned.knobs import KnobGrid

    try:
        protect = tuple(int(t) for t in protect_top.split(",") if t.strip())
    except ValueError:
        raise ConfigError(f"--gating-protect-top {protect_top!r}: expected integers") from None
    replica = tuple(None if t.strip() in ("none", "default") else t.strip()
                    for t in replica_rules.split(",") if t.strip())
    imb: list[float | None] = []
    for t in (t.strip() for t in min_imbalance.split(",")):
        if t:
            imb.append(None if t in ("none", "off") else _floats(t, "min-imbalance")[0])
    return KnobGrid(gating_levels=_floats(levels, "gating-levels"), protect_top=protect,
                    dispatch_rules=tuple(t.strip() for t in rules.split(",") if t.strip()),
                    k_b=_kb_values(k_b), replica_rules=replica, min_imbalance=tuple(imb))


# ----------------------------------------------------------------------------- output dir
def _prepare_out(out: Path, *, resume: bool, force: bool) -> None:
    """Refuse a foreign non-empty ``out``; with ``force`` move this command's files aside."""
    if not out.exists() or not any(out.iterdir()):
        return
    ours = (out / "points.jsonl").exists() or (out / "tuned.json").exists()
    if resume and ours:
        return
    if not force:
        what = "holds a tune run" if ours else "is not empty and is not an `hdamoe tune` output"
        raise OutputPathError(f"--out {str(out)!r} {what}; pass --resume to continue it, --force "
                              "to move its tune files into --out/superseded-*/, or use a new "
                              "directory")
    moved = [out / f for f in OWN_FILES if (out / f).exists()]
    if moved:
        dest = out / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
        dest.mkdir()
        for f in moved:
            shutil.move(str(f), str(dest / f.name))
        log.info("moved %d earlier tune file(s) into %s", len(moved), dest)


# ------------------------------------------------------------------------------------ run
def _config_payload(args: argparse.Namespace, grid: Any) -> dict[str, Any]:
    return {"model": args.model, "trace": args.trace, "requests": args.trace_requests,
            "trace_seed": args.trace_seed, "mesh": args.mesh, "topology": args.topology,
            "setting": args.setting, "batch": args.batch, "conventions": args.conventions,
            "placement": args.placement, "placement_dir": args.placement_dir,
            "place_seed": args.place_seed, "fidelity": args.fidelity,
            "predictor": args.predictor, "max_broadcast": args.max_broadcast,
            "steps": args.steps, "train_seeds": _ints(args.train_seeds),
            "quality_target": args.quality_target, "penalty": args.penalty,
            "method": args.method, "n_calls": args.n_calls, "n_initial": args.n_initial,
            "max_grid": args.max_grid, "seed": args.seed, "grid": grid.to_dict()}


def run_tune(args: argparse.Namespace) -> dict[str, Any]:
    """Run the search (and the held-out evaluation and the oracle); return the summary."""
    from agents import tuned

    out = Path(args.out)
    _prepare_out(out, resume=args.resume, force=args.force)
    grid = parse_grid(args.levels, args.protect_top, args.dispatch_rules, args.k_b,
                      args.replica_rules, args.min_imbalance)
    payload = _config_payload(args, grid)
    run_key = tuned.run_key_of(payload)
    env_kwargs: dict[str, Any] = {"trace_seed": args.trace_seed}
    config = bench.BenchConfig(
        run=run_from_args(args), steps=args.steps, fidelity=args.fidelity,
        predictor=args.predictor, max_broadcast=args.max_broadcast,
        placement_dir=args.placement_dir, cache_dir=args.cache_dir,
        placement_seed=args.place_seed, env_kwargs=env_kwargs)
    trace, _ = bench.load_bench_trace(config)
    placement, artifact = bench.placement_store(config, trace, progress=args.progress
                                                ).get(args.placement.replace("-", "_"))
    base = {**config.env_arguments(), "trace": trace, "placement": placement}
    train_seeds = _ints(args.train_seeds)
    train_eval = tuned.EpisodeEvaluator(base, train_seeds)

    def on_point(rec: Any) -> None:
        log.info("%-60s TBT %.1f µs, top-1 kept %.4f%s", rec.knobs.label(), rec.tbt_us,
                 rec.top1_retention, "" if rec.feasible else " (infeasible)")

    t0 = time.perf_counter()
    result = tuned.tune(train_eval, grid, target=args.quality_target, method=args.method,
                        n_calls=args.n_calls, n_initial=args.n_initial, max_grid=args.max_grid,
                        seed=args.seed, penalty=args.penalty, journal=out / "points.jsonl",
                        resume=args.resume, run_key=run_key, on_point=on_point)
    search_s = time.perf_counter() - t0
    if result.best is None:
        raise ConfigError(f"no grid point meets --quality-target {args.quality_target}; add "
                          "level 0 to --gating-levels or lower the target")

    # held-out split
    eval_kwargs = dict(base)
    if args.eval_trace is not None:
        eval_config = config.with_run(trace=args.eval_trace)
        eval_kwargs["trace"], _ = bench.load_bench_trace(eval_config)
        split = f"eval trace {args.eval_trace!r}"
    elif isinstance(args.trace, str) and args.trace == "synthetic":
        seed = args.trace_seed + HELD_OUT_TRACE_OFFSET
        eval_config = dataclasses.replace(config, env_kwargs={"trace_seed": seed})
        eval_kwargs["trace"], _ = bench.load_bench_trace(eval_config)
        eval_kwargs["trace_seed"] = seed
        split = f"synthetic, trace_seed {seed} (training: {args.trace_seed})"
    else:
        split = f"same trace {args.trace!r}, unseen episode seeds"
    eval_kwargs["steps_per_episode"] = args.eval_steps
    eval_seeds = (_ints(args.eval_seeds) if args.eval_seeds
                  else [EVAL_SEED_BASE + i for i in range(3)])
    held = tuned.EpisodeEvaluator(eval_kwargs, eval_seeds)
    compared = {
        "hd-moe": tuned.TunedKnobs(gating_level=0.0),
        "hda-moe": tuned.TunedKnobs(gating_level=1.0),
        "tuned": result.best.knobs,
    }
    held_out = {name: held(k) for name, k in compared.items()}
    training = {name: train_eval(k) for name, k in compared.items()}
    config_out = {**payload, "placement_artifact": artifact, "trace_id": trace.trace_id,
                  "split": split, "eval_seeds": eval_seeds, "eval_steps": args.eval_steps,
                  "run_key": run_key}
    summary: dict[str, Any] = {
        "split": split, "search_wall_s": search_s, "resumed_points": result.resumed,
        "compared": {name: {"knobs": compared[name].to_dict(),
                            "training": dataclasses.asdict(training[name]),
                            "held_out": dataclasses.asdict(held_out[name])}
                     for name in compared}}
    oracle = None
    if args.oracle:
        o = tuned.per_layer_oracle(eval_kwargs, grid.points(), eval_seeds,
                                   target=args.quality_target)
        oracle = o.summary()
        tuned_tbt = held_out["tuned"].tbt_us
        oracle["tuned_held_out_tbt_us"] = tuned_tbt
        oracle["constrained_over_tuned"] = oracle["constrained_tbt_us"] / tuned_tbt
        oracle["unconstrained_over_tuned"] = oracle["unconstrained_tbt_us"] / tuned_tbt
        write_json(out / "oracle.json", {"config": config_out, **oracle})
        summary["oracle"] = {k: v for k, v in oracle.items() if k != "fixed"}
    tuned.write_tuned(out / "tuned.json", result, config=config_out, grid=grid,
                      held_out=held_out["tuned"], extra={"summary": summary})
    text = format_tune(result, summary)
    atomic_write(out / "tune.md", lambda fh: fh.write(text))
    return {"result": result, "summary": summary, "text": text}


def format_tune(result: Any, summary: dict[str, Any]) -> str:
    """Return the Markdown report of a tune run (search, held-out comparison, oracle)."""
    best = result.best
    lines = [f"# hdamoe tune ({result.method}, {len(result.points)} points, quality target "
             f"top-1 ≥ {result.target:g})", "",
             f"Best knobs: `{best.knobs.label()}`; held-out split: {summary['split']}.", "",
             "## Held-out streams", ""]
    rows = []
    for name, d in summary["compared"].items():
        rows.append([name, f"{d['training']['tbt_us']:.1f}",
                     f"{d['training']['top1_retention']:.4f}",
                     f"{d['held_out']['tbt_us']:.1f}",
                     f"{d['held_out']['top1_retention']:.4f}",
                     f"{d['held_out']['score_mass_kept']:.4f}"])
    lines.append(render_table(["method", "train TBT µs", "train top-1", "held-out TBT µs",
                               "held-out top-1", "held-out score mass kept"], rows,
                              style="markdown"))
    if "oracle" in summary:
        o = summary["oracle"]
        lines += ["", "## Per-layer hindsight oracle (held-out steps, identical draws)", ""]
        rows = [["constrained (top-1 ≥ target per layer)", f"{o['constrained_tbt_us']:.1f}",
                 f"{o['constrained_top1']:.4f}", f"{o['constrained_over_tuned']:.4f}"],
                ["unconstrained", f"{o['unconstrained_tbt_us']:.1f}",
                 f"{o['unconstrained_top1']:.4f}", f"{o['unconstrained_over_tuned']:.4f}"],
                ["best fixed grid point (same draws)", f"{o['best_fixed_tbt_us']:.1f}",
                 f"{o['best_fixed_top1']:.4f}",
                 f"{o['best_fixed_tbt_us'] / o['tuned_held_out_tbt_us']:.4f}"]]
        lines.append(render_table(["bound", "TBT µs", "top-1", "÷ tuned held-out TBT"], rows,
                                  style="markdown"))
    lines += ["", "## Search points (training)", ""]
    rows = [[p.knobs.label(), f"{p.tbt_us:.1f}", f"{p.top1_retention:.4f}",
             "yes" if p.feasible else "no"]
            for p in sorted(result.points, key=lambda p: p.tbt_us)]
    lines.append(render_table(["knobs", "TBT µs", "top-1", "feasible"], rows, style="markdown"))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ CLI
def add_tune_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``hdamoe tune`` arguments to a parser."""
    from agents.tuned.search import DEFAULT_PENALTY, DEFAULT_QUALITY_TARGET, SEARCH_METHODS

    add_run_arguments(p, ("model", "trace", "trace_requests"))
    p.add_argument("--trace-seed", type=nonneg_int, default=0,
                   help="synthetic training trace seed (held-out: + 1000)")
    p.add_argument("--eval-trace", default=None,
                   help="held-out trace path (default: see the module docstring)")
    add_run_arguments(p, ("mesh", "topology", "setting", "batch", "conventions"))
    p.add_argument("--placement", default="node_link",
                   help="placement method resolved on the training trace")
    p.add_argument("--placement-dir", default=None, help="`hdamoe place` output directory")
    p.add_argument("--cache-dir", default=None, help="placement cache root")
    p.add_argument("--place-seed", type=nonneg_int, default=0, help="seed of the placement")
    add_decision_arguments(p)
    p.add_argument("--gating-levels", dest="levels", default="0,0.5,1,2,4,8,16",
                   help="gating levels searched (0 = off)")
    p.add_argument("--gating-protect-top", dest="protect_top", default="0,1",
                   help="gating protect-top values searched")
    add_deprecated_alias(p, "--levels", "--gating-levels", "levels", takes_value=True)
    add_deprecated_alias(p, "--protect-top", "--gating-protect-top", "protect_top",
                         takes_value=True)
    p.add_argument("--dispatch-rules", default="least_loaded,first,home", help="dispatch rules")
    p.add_argument("--k-b", default="budget",
                   help="pre-broadcast slot options: 'budget' (the budget rule) and integers")
    p.add_argument("--min-imbalance", default="none",
                   help="gating thresholds: gate only layers whose predicted max/mean node load "
                   "reaches it ('none' = every layer)")
    p.add_argument("--replica-rules", default="none",
                   help="replica-dispatch rules of redundant experts (placement 'eplb'; 'none' = the "
                   "env's default)")
    p.add_argument("--method", default="auto", choices=SEARCH_METHODS,
                   help="grid (exhaustive), bo (gp_minimize, needs the opt extra) or auto")
    p.add_argument("--n-calls", type=positive_int, default=40, help="BO evaluations")
    p.add_argument("--n-initial", type=positive_int, default=10, help="BO random initial points")
    p.add_argument("--max-grid", type=positive_int, default=128,
                   help="largest grid 'auto' searches exhaustively")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the BO search")
    p.add_argument("--quality-target", type=bounded_float(0.0, 1.0), default=DEFAULT_QUALITY_TARGET,
                   help="minimum mean top-1 retention")
    p.add_argument("--penalty", type=bounded_float(0.0, 1e12), default=DEFAULT_PENALTY,
                   help="objective penalty factor per unit of missing top-1 retention")
    p.add_argument("--steps", type=positive_int, default=4,
                   help="decode steps per training episode")
    p.add_argument("--train-seeds", type=seed_list, default="0,1", help="training episode seeds")
    p.add_argument("--eval-steps", type=positive_int, default=16,
                   help="decode steps per held-out episode")
    p.add_argument("--eval-seeds", type=seed_list, default=None,
                   help="held-out episode seeds (default 10000,10001,10002)")
    p.add_argument("--oracle", action="store_true",
                   help="also compute the per-layer hindsight oracle on the held-out steps")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--resume", action="store_true",
                   help="reuse the points already in --out/points.jsonl (same arguments only)")
    p.add_argument("--force", action="store_true",
                   help="use a non-empty --out: earlier tune files are moved into "
                   "--out/superseded-*/ (never deleted)")
    add_progress_flag(p, default=True)
    return p


def cmd_tune(args: argparse.Namespace) -> int:
    """Run ``hdamoe tune``; print the report; return the exit code."""
    if not 0.0 <= args.quality_target <= 1.0:
        raise ConfigError(f"--quality-target must lie in [0, 1], got {args.quality_target}")
    res = run_tune(args)
    print(res["text"])
    print(f"wrote {Path(args.out) / 'tuned.json'} (run it: hdamoe bench --methods "
          f"hda-moe,tuned:{Path(args.out) / 'tuned.json'})")
    return 0
