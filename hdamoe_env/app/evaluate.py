"""``hdamoe evaluate``: learned agents against heuristic ones on held-out streams.

The held-out evaluation of learned agents (``agents.learned``) against heuristic agents with
the bench harness (``hdamoe_env.app.bench``), on the analytic twin and on the DES; the mapping
of env arguments onto a bench configuration (which also resolves a placement given by method
name); the env options ``hdamoe train`` and ``hdamoe evaluate`` share.

Decisions:

* [decision] Held-out streams: a synthetic training trace with ``trace_seed`` s is evaluated on
  ``trace_seed`` s + 1000 (a different set of requests), with episode seeds 10 000 + i, never
  used in training (training episodes are seeded by SB3 from ``seed``). For a real trace, pass
  ``eval_trace`` (e.g. another category); without it the same trace is used with unseen
  episode seeds, and the table says so.
* [decision] Every compared method runs on the same placement and the same env arguments as
  the learned agent was trained with (bench's identical episodes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agents.learned.policy import read_meta
from agents.learned.train import to_jsonable
from baselines.store import PLACEMENT_ARTIFACTS
from hdamoe_env.app import bench
from hdamoe_env.app.flags import add_progress_flag
from hdamoe_env.app.methods import MethodSpec, parse_method
from hdamoe_env.app.argtypes import (add_run_arguments, name_list, nonneg_int, positive_int,
                                     seed_list)
from hdamoe_env.app.plots import plot_learning_curve
from hdamoe_env.app.records import format_bench_table, summarise
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled
from hdamoe_env.config.fileio import atomic_write
from hdamoe_env.sim.placement import Placement

__all__ = ["AGENT_ALIASES", "DEFAULT_BASELINES", "EVAL_SEED_BASE", "HELD_OUT_TRACE_OFFSET",
           "add_evaluate_arguments", "cmd_evaluate", "evaluate", "format_evaluation",
           "held_out_evaluation", "resolve_placement", "write_eval_scalars"]

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


def resolve_placement(env_kwargs: dict[str, Any]) -> Placement | None:
    """Return the placement a method name in ``env_kwargs["placement"]`` stands for.

    ``tp``, ``ep``, ``.npz`` paths and ``Placement`` objects are built by the env itself (None
    is returned); a method name such as ``node_link`` or ``hybrid`` is computed (or read from
    the cache / ``placement_dir``) by the bench's placement store on the configuration's trace.

    Raises:
        ConfigError: Unknown placement name or bad configuration.
    """
    name = env_kwargs.get("placement", "ep")
    if not isinstance(name, str) or name in ("tp", "tp-tiled", "tp_tiled", "ep") \
            or name.endswith(".npz"):
        return None
    # [decision] the one place this command resolves a placement name: swap for the single
    # name -> Placement resolver (style.md §1, baselines/store.py) when it exists
    config = _bench_config(env_kwargs, fidelity="des", steps=1)
    trace, _ = bench.load_bench_trace(config)
    placement, _ = bench.placement_store(config, trace, progress=False).get(name)
    return placement


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
    return bench.BenchConfig.create(**fields, steps=steps, fidelity=fidelity, env_kwargs=extra)


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


def _methods(agent_specs: Sequence[str], placement: str) -> list[MethodSpec]:

    methods = []
    n_learned = sum(1 for s in agent_specs if Path(s).exists() or s.endswith(".zip"))
    n_tuned = sum(1 for s in agent_specs if s.startswith("tuned:"))
    for spec in agent_specs:
        if spec.startswith("tuned:"):               # the tuned heuristic of `hdamoe tune`
            parsed = parse_method(spec if "@" in spec else f"{spec}@{placement}")
            methods.append(dataclasses.replace(parsed, name="tuned" if n_tuned == 1 else
                                               f"tuned:{Path(spec[6:]).parent.name}"))
            continue
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
            PLACEMENT_ARTIFACTS:
        raise ConfigError(f"evaluation placement must be one of {list(PLACEMENT_ARTIFACTS)},"
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


def add_env_arguments(p: argparse.ArgumentParser, *, defaults: bool) -> None:
    names = ("model", "mesh", "setting", "batch", "conventions", "trace", "trace_requests")
    add_run_arguments(p, names, defaults=None if defaults else dict.fromkeys(names))
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


def env_kwargs_from_args(args: argparse.Namespace, base: dict[str, Any] | None = None
                          ) -> dict[str, Any]:
    kwargs = dict(base or {})
    for attr, key in (("model", "model"), ("mesh", "mesh"), ("setting", "setting"),
                      ("batch", "batch"), ("conventions", "conventions"), ("trace", "trace"),
                      ("trace_requests", "trace_requests"), ("trace_seed", "trace_seed"),
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


def parse_seeds(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"seeds {text!r}: expected integers like 0,1,2") from None


def add_evaluate_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options of ``hdamoe evaluate`` to ``p`` (the command runs :func:`cmd_evaluate`).

    Returns:
        ``p``.
    """
    p.add_argument("--agent", type=name_list, required=True,
                   help="comma list: PATH (learned) | greedy-hda | hd-moe | greedy | noop | any "
                   "registered agent")
    p.add_argument("--baselines", default=",".join(DEFAULT_BASELINES),
                   help="heuristic agents added to the comparison ('' for none)")
    add_env_arguments(p, defaults=False)
    p.add_argument("--fidelity", default="des",
                   help="comma list of fidelities (des, analytic)")
    p.add_argument("--seeds", type=seed_list, default=None, help="episode seeds (default 10000,10001,10002)")
    p.add_argument("--steps", type=positive_int, default=16, help="decode steps per episode")
    p.add_argument("--no-held-out", action="store_true",
                   help="evaluate on the given trace as is (default: the held-out split of a "
                   "learned agent's training trace)")
    p.add_argument("--out", default=None, help="write eval.json / eval.md here")
    p.add_argument("--json", default=None, help="write the result (JSON) here ('-' = stdout)")
    add_progress_flag(p, default=False)
    p.add_argument("--trust-model", action="store_true",
                   help="load SB3 models not signed by this user's key (from another "
                   "user or machine); loading one runs code from the file: only for files "
                   "you trust")
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
    kwargs = env_kwargs_from_args(args, meta.get("env_kwargs", {}))
    trace = None
    if args.trace is not None and args.trace != kwargs.get("trace", "synthetic"):
        trace = args.trace
    fidelities = [f.strip() for f in args.fidelity.split(",") if f.strip()]
    res = evaluate(paths or None, env_kwargs=kwargs, seeds=parse_seeds(args.seeds), steps=args.steps,
                   fidelities=fidelities, trace=trace, baselines=baselines,
                   placement=kwargs.get("placement"), out_dir=args.out,
                   held_out=not args.no_held_out and bool(paths), progress=args.progress)
    print(format_evaluation(res))
    if args.json:
        text = json.dumps(dict(res), indent=1, default=to_jsonable) + "\n"
        atomic_write(args.json, lambda fh: fh.write(text.encode()), "wb")
    return 0
