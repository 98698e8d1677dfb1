"""``hdamoe compare``: heuristic, tuned and learned agents side by side, with intervals.

Every method runs on identical held-out episodes through the bench harness
(``hdamoe_env.app.bench.run_bench``): the same trace, the same episode seeds, the same env
arguments. One value per (method, seed): the episode's mean time between tokens (TBT, µs per
decode step). Per method the table gives

* the mean over seeds with its 95 % Student-t interval (``ddof=1``, scipy);
* with ≥ 5 seeds, the interquartile mean (IQM) with a 95 % stratified-bootstrap percentile
  interval (``hdamoe_env.app.intervals``; every method's bootstrap draws from a generator
  seeded by ``--bootstrap-seed``, so all methods are resampled on the same seed indices);
* the paired difference against a reference method (per seed: method − reference, on the
  same episode) with its 95 % t interval, in µs and in % of the reference's mean;
* top-1 routing retention and the agent's decision time.

Columns whose values are the same for every method are dropped (and named below the table),
except the method, its mean TBT and that interval.
Outputs: Markdown (default on stdout), LaTeX (booktabs), CSV (full precision) and JSON (the
records and the statistics), all rendered by the one table renderer
(``hdamoe_env.app.tables``).

Decisions:

* [decision] Held-out episodes: the synthetic trace is drawn with ``trace_seed`` 1000 (training
  uses 0, ``hdamoe train``'s held-out split) and the episode seeds default to 10 000 …
  10 004, never used in training. A real trace (``--trace PATH``) is used as given.
* [decision] Method labels: ``tuned:PATH`` is shown as ``tuned`` and ``agent:PATH`` (a saved
  learned agent) as ``learned`` (with the directory name when several are compared); the full
  specification stays in the records (``agent``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hdamoe_env import __version__
from hdamoe_env.app import bench, intervals
from hdamoe_env.app.argtypes import (add_decision_arguments, add_run_arguments, int_list,
                                     nonneg_int, positive_int, run_from_args)
from hdamoe_env.app.flags import add_progress_flag
from hdamoe_env.app.methods import MethodSpec, parse_method
from hdamoe_env.app.tables import TABLE_STYLES, constant_columns, render_table
from hdamoe_env.config.errors import ConfigError, OutputPathError
from hdamoe_env.config.fileio import atomic_write, json_default

__all__ = ["COMPARE_SEEDS", "HELD_OUT_TRACE_SEED", "CompareResult", "add_compare_arguments",
           "cmd_compare", "compare", "compare_table", "format_compare"]

log = logging.getLogger(__name__)

#: Default episode seeds (held out: training never resets with them).
COMPARE_SEEDS: tuple[int, ...] = tuple(10_000 + i for i in range(5))
#: Seed of the held-out synthetic trace (training: trace_seed 0).
HELD_OUT_TRACE_SEED = 1000

#: The first three columns (method, mean TBT and its interval) are never dropped.
_KEEP = 3
_HEAD = ("method", "TBT µs", "± 95 % (t)", "seeds", "IQM µs", "IQM 95 % low", "IQM 95 % high",
         "Δ vs ref µs", "Δ ± 95 % (t)", "Δ %", "Δ % ± 95 % (t)", "top-1 retention",
         "decide ms/step")
_FORMATS = (None, "{:.2f}", "{:.2f}", "{:d}", "{:.2f}", "{:.2f}", "{:.2f}", "{:+.2f}", "{:.2f}",
            "{:+.2f}", "{:.2f}", "{:.4f}", "{:.3f}")


@dataclasses.dataclass
class CompareResult:
    """Result of :func:`compare`.

    Attributes:
        methods: Method labels in order.
        seeds: Episode seeds.
        reference: Label of the reference method of the paired differences.
        per_seed: label -> [n] TBT µs per seed (seed order).
        stats: label -> statistics (the table's columns by key, None where undefined).
        records: The bench records (one per method and seed).
        config: The configuration (for the header line).
        bootstrap: ``{"reps", "seed", "confidence"}`` of the IQM intervals.
    """

    methods: list[str]
    seeds: list[int]
    reference: str
    per_seed: dict[str, list[float]]
    stats: dict[str, dict[str, Any]]
    records: list[dict[str, Any]]
    config: dict[str, Any]
    bootstrap: dict[str, Any]


def _labels(specs: Sequence[MethodSpec]) -> list[MethodSpec]:
    """Give ``tuned:`` and learned ``agent:`` methods short labels (module docstring)."""
    tuned = [s for s in specs if s.name.startswith("tuned:")]
    learned = [s for s in specs if s.name.startswith("agent:") and s.agent is not None
               and (s.agent.endswith(".zip") or Path(s.agent).exists())]
    out = []
    for s in specs:
        label = s.name
        if s in tuned:
            label = "tuned" if len(tuned) == 1 else f"tuned:{Path(s.agent[6:]).parent.name}"
        elif s in learned:
            path = Path(str(s.agent))
            label = "learned" if len(learned) == 1 else \
                f"learned:{path.parent.name if path.name == 'model.zip' else path.stem}"
        out.append(dataclasses.replace(s, name=label))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"methods repeat a label: {names}; give the agents distinct "
                          "directories")
    return out


def _summary(values: dict[str, list[float]], extra: dict[str, dict[str, float | None]],
             reference: str, seed: int, reps: int) -> dict[str, dict[str, Any]]:
    ref = np.asarray(values[reference])
    out: dict[str, dict[str, Any]] = {}
    for m, vals in values.items():
        x = np.asarray(vals)
        tiv = intervals.t_interval(x)
        row: dict[str, Any] = {"n": int(x.size), "mean_us": tiv.estimate,
                               "t95_us": tiv.half_width, "iqm_us": None, "iqm_low_us": None,
                               "iqm_high_us": None, "diff_us": None, "diff_t95_us": None,
                               "diff_pct": None, "diff_pct_t95": None, **extra[m]}
        if x.size >= intervals.MIN_SEEDS_IQM:
            # one generator per method from the same seed: every method is resampled with the
            # same seed indices (common random numbers), so equal data give equal intervals
            rng = np.random.default_rng(seed)
            biv = intervals.stratified_bootstrap_interval(x, intervals.iqm, rng, reps=reps)
            row.update(iqm_us=biv.estimate, iqm_low_us=biv.low, iqm_high_us=biv.high)
        if m != reference:
            d = intervals.paired_difference(x, ref)
            rel = intervals.t_interval(100.0 * (x / ref - 1.0))
            row.update(diff_us=d.estimate, diff_t95_us=d.half_width, diff_pct=rel.estimate,
                       diff_pct_t95=rel.half_width)
        out[m] = row
    return out


def compare(config: bench.BenchConfig, methods: Sequence[str | MethodSpec],
            seeds: Sequence[int] = COMPARE_SEEDS, *, reference: str | None = None,
            bootstrap_reps: int = 2000, bootstrap_seed: int = 0,
            progress: bool = False) -> CompareResult:
    """Run methods × seeds on identical episodes and compute the statistics of the table.

    Args:
        config: The bench configuration (its trace is the held-out one; see the module).
        methods: Method names (``parse_method``: built-in, ``tuned:PATH``, ``agent:PATH``) or
            specs; at least two.
        seeds: Episode seeds (at least two; IQM from five).
        reference: Label of the reference method (default ``hda-moe`` when present, else the
            first method).
        bootstrap_reps: Replicates of the stratified bootstrap.
        bootstrap_seed: Seed of the bootstrap's generator.
        progress: Progress bars.

    Raises:
        ConfigError: Fewer than two methods or seeds, or an unknown reference.
    """
    specs = _labels([m if isinstance(m, MethodSpec) else parse_method(m) for m in methods])
    labels = [s.name for s in specs]
    seeds = [int(s) for s in seeds]
    if len(specs) < 2:
        raise ConfigError(f"compare needs at least two methods, got {labels}")
    if len(seeds) < 2:
        raise ConfigError(f"compare needs at least two seeds for an interval, got {seeds}")
    if reference is None:
        reference = "hda-moe" if "hda-moe" in labels else labels[0]
    if reference not in labels:
        raise ConfigError(f"--reference {reference!r} is not among the methods {labels}")
    if bootstrap_reps < 1:
        raise ConfigError(f"--bootstrap-reps must be >= 1, got {bootstrap_reps}")
    result = bench.run_bench(config, specs, seeds, progress=progress)
    by = {(r["method"], int(r["seed"])): r for r in result.records}
    per_seed = {m: [float(by[(m, s)]["tbt_us"]) for s in seeds] for m in labels}
    extra = {m: {"top1_retention": _mean([(by[(m, s)].get("gating") or {}).get(
                 "top1_retention") for s in seeds]),
                 "decide_ms": _mean([by[(m, s)].get("decision_ms_per_step") for s in seeds])}
             for m in labels}
    stats = _summary(per_seed, extra, reference, bootstrap_seed, bootstrap_reps)
    rec0 = result.records[0]
    conf = {"model": rec0["model"], "setting": rec0["setting"], "mesh": rec0["mesh"],
            "topology": rec0["topology"], "batch": rec0["batch"],
            "steps": rec0["steps_per_episode"], "fidelity": rec0["fidelity"],
            "profile": rec0["profile"], "trace": rec0["trace"], "trace_id": rec0["trace_id"],
            "predictor": rec0["predictor"], "version": __version__}
    return CompareResult(labels, seeds, reference, per_seed, stats, result.records, conf,
                         {"reps": bootstrap_reps, "seed": bootstrap_seed, "confidence": 0.95})


def _mean(values: Sequence[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def _rows(result: CompareResult) -> list[list[Any]]:
    keys = ("mean_us", "t95_us", "n", "iqm_us", "iqm_low_us", "iqm_high_us", "diff_us",
            "diff_t95_us", "diff_pct", "diff_pct_t95", "top1_retention", "decide_ms")
    return [[m, *(result.stats[m][k] for k in keys)] for m in result.methods]


def compare_table(result: CompareResult, style: str = "markdown") -> str:
    """Return the comparison table in ``style`` (constant columns dropped)."""
    head = [h.replace("ref", result.reference) for h in _HEAD]
    return render_table(head, _rows(result), style=style, formats=_FORMATS,
                        drop_constant=True, keep=_KEEP)


def seeds_table(result: CompareResult, style: str = "markdown") -> str:
    """Return the per-seed TBT (µs) of every method: one row per seed."""
    rows = [[str(s), *(result.per_seed[m][i] for m in result.methods)]
            for i, s in enumerate(result.seeds)]
    return render_table(["seed", *result.methods], rows, style=style)


def _dropped(result: CompareResult) -> list[str]:
    """Return ``"column = value"`` of the dropped constant columns (undefined ones left out)."""
    head = [h.replace("ref", result.reference) for h in _HEAD]
    rows = _rows(result)
    out = []
    for j in constant_columns(head, rows, keep=_KEEP, formats=_FORMATS):
        value = rows[0][j]
        if value is not None:
            spec = _FORMATS[j] or "{:.2f}"
            out.append(f"{head[j]} = {spec.format(value)}")
    return out


def format_compare(result: CompareResult, style: str = "markdown") -> str:
    """Return the full report in ``style``: header, table, per-seed table and notes (text and
    Markdown), or the bare table (LaTeX, CSV)."""
    if style in ("latex", "csv"):
        return compare_table(result, style) + "\n"
    c = result.config
    n = len(result.seeds)
    lines = [f"hdamoe compare: {c['model']} on {c['topology']} {c['mesh']}, {c['setting']}, "
             f"B={c['batch']}, profile {c['profile']}, fidelity {c['fidelity']}, trace "
             f"{c['trace']} (id {str(c['trace_id'])[:12]}), {c['steps']} decode steps per "
             f"episode, episode seeds {result.seeds}", "",
             compare_table(result, style), ""]
    notes = [f"One value per seed: the episode's mean TBT (µs per decode step); all methods on "
             f"the same episodes. ± 95 % (t): Student-t interval over the {n} seeds "
             f"(n − 1 = {n - 1} degrees of freedom, sample std with ddof=1)."]
    if n >= intervals.MIN_SEEDS_IQM:
        b = result.bootstrap
        notes.append(f"IQM: interquartile mean over seeds with a 95 % percentile interval of a "
                     f"stratified bootstrap ({b['reps']} replicates, generator seed {b['seed']};"
                     f" implemented in hdamoe_env.app.intervals, not rliable).")
    notes.append(f"Δ: paired per-seed difference method − {result.reference} (negative = "
                 f"faster than {result.reference}), with its Student-t interval; Δ % likewise "
                 f"on 100·(method / {result.reference} − 1).")
    dropped = _dropped(result)
    if dropped:
        notes.append("Same for every method (column dropped): " + "; ".join(dropped) + ".")
    lines += notes + ["", "Per-seed TBT (µs):", "", seeds_table(result, style)]
    return "\n".join(lines) + "\n"


def write_outputs(result: CompareResult, out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write ``compare.md``, ``compare.tex``, ``compare.csv``, ``seeds.csv`` and
    ``compare.json`` into ``out_dir``; return the paths."""
    target = Path(out_dir)
    texts = {"compare.md": format_compare(result, "markdown"),
             "compare.tex": format_compare(result, "latex"),
             "compare.csv": format_compare(result, "csv"),
             "seeds.csv": seeds_table(result, "csv") + "\n",
             "compare.json": json.dumps(to_json(result), indent=1, default=json_default) + "\n"}
    paths = []
    for name, text in texts.items():
        paths.append(atomic_write(target / name, lambda fh, t=text: fh.write(t)))
    return paths


def to_json(result: CompareResult) -> dict[str, Any]:
    """Return the result as a JSON-ready dict."""
    return {"methods": result.methods, "seeds": result.seeds, "reference": result.reference,
            "per_seed_tbt_us": result.per_seed, "stats": result.stats,
            "config": result.config, "bootstrap": result.bootstrap, "records": result.records}


def add_compare_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options of ``hdamoe compare`` to ``p`` (``func`` = :func:`cmd_compare`)."""
    add_run_arguments(p, ("model", "trace", "trace_requests", "mesh", "topology", "setting",
                          "batch", "conventions"))
    p.add_argument("--methods", required=True,
                   help="comma list: built-in methods (hda-moe, hd-moe, tp, ...), "
                   "tuned:PATH/tuned.json, agent:PATH/model.zip or agent:NAME")
    p.add_argument("--reference", default=None,
                   help="method of the paired differences (default hda-moe if listed, else the "
                   "first)")
    p.add_argument("--seeds", type=int_list, default=",".join(map(str, COMPARE_SEEDS)),
                   help="held-out episode seeds (IQM with >= 5)")
    p.add_argument("--steps", type=positive_int, default=8, help="decode steps per episode")
    p.add_argument("--trace-seed", type=nonneg_int, default=HELD_OUT_TRACE_SEED,
                   help="seed of the synthetic trace (held out: training uses 0)")
    add_decision_arguments(p)
    p.add_argument("--placement-dir", default=None,
                   help="`hdamoe place` output directory (default: quick pipeline, cached)")
    p.add_argument("--cache-dir", default=None,
                   help="placement cache root (default $HDAMOE_CACHE_DIR or ~/.cache/hdamoe-env)")
    p.add_argument("--place-seed", type=nonneg_int, default=0, help="seed of EP and the pipeline")
    p.add_argument("--bootstrap-reps", type=positive_int, default=2000,
                   help="replicates of the stratified bootstrap of the IQM")
    p.add_argument("--bootstrap-seed", type=nonneg_int, default=0,
                   help="seed of the bootstrap's generator")
    p.add_argument("--format", default="markdown", choices=TABLE_STYLES,
                   help="format of the table printed on stdout")
    p.add_argument("--out", default=None,
                   help="write compare.md, compare.tex, compare.csv, seeds.csv, compare.json here")
    p.add_argument("--json", default=None, help="write the result (JSON) here ('-' = stdout)")
    add_progress_flag(p, default=False)
    p.set_defaults(func=cmd_compare)
    return p


#: The files ``--out`` receives.
OUT_FILES = ("compare.md", "compare.tex", "compare.csv", "seeds.csv", "compare.json")


def cmd_compare(args: argparse.Namespace) -> int:
    """Run ``hdamoe compare``; print the table; return the exit code.

    Raises:
        OutputPathError: ``--out`` already holds a comparison (never overwritten).
    """
    if args.out:
        taken = [name for name in OUT_FILES if (Path(args.out) / name).exists()]
        if taken:
            raise OutputPathError(f"--out {args.out!r} already holds {taken}; choose another "
                                  "directory or move them away first")
    methods = [m.strip() for m in str(args.methods).split(",") if m.strip()]
    seeds = [int(s) for s in int_list(args.seeds).split(",") if s.strip()]
    config = bench.BenchConfig(
        run=run_from_args(args), steps=args.steps, fidelity=args.fidelity,
        predictor=args.predictor, max_broadcast=args.max_broadcast,
        placement_dir=args.placement_dir, cache_dir=args.cache_dir,
        placement_seed=args.place_seed, env_kwargs={"trace_seed": args.trace_seed})
    result = compare(config, methods, seeds, reference=args.reference,
                     bootstrap_reps=args.bootstrap_reps, bootstrap_seed=args.bootstrap_seed,
                     progress=args.progress)
    sys.stdout.write(format_compare(result, args.format))
    if args.out:
        for path in write_outputs(result, args.out):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        text = json.dumps(to_json(result), indent=1, default=json_default) + "\n"
        atomic_write(args.json, lambda fh: fh.write(text))
    return 0
