"""Command-line interface ``hdamoe``: every parser, the pre-flight checks and ``main``.

Each subcommand's implementation lives in its own module of the application layer (``simulate``,
``simbench``, ``tracetools``, ``record``, ``bench``, ``envbench``, ``place``, ``reproduce``,
``crossover``, ``train``, ``evaluate``, ``tune``); the options of a run are generated from
``hdamoe_env.config.run.RUN_OPTIONS`` (``argtypes.add_run_arguments``). Heavy dependencies are
imported inside the subcommand that needs them. Errors of the package become one line on stderr
and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from hdamoe_env import __version__
from hdamoe_env.app import (bench, crossover, envbench, methods, place, record, reproduce,
                            simbench, simulate, tracetools)
from hdamoe_env.app.argtypes import (
    add_decision_arguments,
    add_run_arguments,
    check_output_options,
    float_list,
    name_list,
    nonneg_float,
    output_targets,
    nonneg_int,
    positive_float,
    positive_int,
    run_from_args,
    seed_list,
)
from hdamoe_env.app.flags import add_deprecated_alias, add_progress_flag
from hdamoe_env.app.logs import configure_logging
from hdamoe_env.config.errors import HdMoeError
from hdamoe_env.config.run import RUN_DEFAULTS
from hdamoe_env.config.specs import get_model

__all__ = ["build_parser", "main"]



# ------------------------------------------------------------------------------------ simulate


# ----------------------------------------------------------------------------------- bench-sim


# -------------------------------------------------------------------------------------- traces


# ---------------------------------------------------------------------------------------- main
class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Show an option's default once: appended only when it says something and the help does not.

    No "(default: None)" or "(default: False)"; a help text that already mentions its default
    ("default: the budget rule") is left alone.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default in (None, False, argparse.SUPPRESS)
                or "default" in text.lower() or "%(default)" in text
                or (isinstance(default, list | tuple | str) and not default)):
            return text
        return f"{text} (default: %(default)s)"


def _use_formatter(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` and every subparser below it :class:`HelpFormatter`."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _use_formatter(sub)


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE (see PROG --help)`` and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``hdamoe`` (subcommand parsers inherit one-line errors)."""
    parser = _Parser(
        prog="hdamoe", description="HDA-MoE on 3D near-memory processing: simulate MoE decode "
        "latency on a NoC, build placements, benchmark agents.")
    parser.add_argument("--version", action="version", version=f"hdamoe-env {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more log output (-vv: debug); errors show their traceback")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="per-layer latency and TBT of TP/EP or a placement",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_run_arguments(sim, ("model", "topology", "mesh", "setting"))
    sim.add_argument("--hop-latency-ns", type=nonneg_float, default=None,
                     help="per-hop NoC latency, ns (default: the profile's hop_latency_s)")
    sim.add_argument("--dram-gib", type=positive_float, default=None,
                     help="DRAM capacity per node; placements that do not fit are rejected")
    add_run_arguments(sim, ("batch",))
    sim.add_argument("--placement", type=name_list, default="tp,ep",
                     help="comma list of tp, tp-tiled, ep, hybrid (greedy region balance) "
                          "or paths to placement .npz files")
    add_run_arguments(sim, ("trace", "trace_requests", "conventions"))
    sim.add_argument("--evaluator", default="sampled", choices=("sampled", "static"),
                     help="sampled: simulate decode steps; static: expected loads")
    sim.add_argument("--steps", type=positive_int, default=16, help="decode steps (sampled evaluator)")
    sim.add_argument("--replica-rule", default="least_loaded",
                     choices=("least_loaded", "nearest", "round_robin"),
                     help="placements with redundant experts (sampled evaluator): the copy that "
                     "computes each token")
    sim.add_argument("--batching", default="streams", choices=("streams", "random_rows"),
                     help="decode-step formation from the trace")
    sim.add_argument("--view", default="content", choices=("content", "unique", "raw"),
                     help="trace rows used: content (new computation only), unique, raw (all "
                     "rows, as the reference sampled them)")
    sim.add_argument("--seed", type=nonneg_int, default=0, help="random seed")
    sim.add_argument("--json", default=None,
                     help="write records to this JSON file ('-' = stdout, text to stderr)")
    sim.set_defaults(func=simulate.cmd_simulate)

    bs = sub.add_parser("bench-sim", help="DES fast kernel vs oracle: simulations per second")
    bs.add_argument("--seconds", type=positive_float, default=3.0, help="time budget per measurement")
    bs.add_argument("--seed", type=nonneg_int, default=0, help="random seed")
    bs.add_argument("--json", default=None,
                    help="also write the results to this JSON file ('-' = stdout, text to stderr)")
    bs.set_defaults(func=simbench.cmd_bench_sim)

    tr = sub.add_parser("traces", help="routing traces: statistics, generation, conversion")
    tsub = tr.add_subparsers(dest="traces_command", required=True)
    st = tsub.add_parser("stats", help="statistics of traces side by side",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    st.add_argument("paths", nargs="+",
                    help="trace files (.json reference, .npz canonical) or synthetic:<model>")
    st.add_argument("--view", default="content", choices=("content", "unique", "raw"),
                    help="trace rows used: content, unique or raw")
    add_run_arguments(st, ("batch", "trace_requests"), defaults={"batch": 64},
                      helps={"batch": " of the fluctuation statistics"})
    st.add_argument("--seed", type=nonneg_int, default=0, help="random seed")
    st.add_argument("--json", default=None,
                    help="also write the results to this JSON file ('-' = stdout, text to stderr)")
    st.set_defaults(func=tracetools.cmd_traces_stats)
    gen = tsub.add_parser("gen", help="write a synthetic trace (.hdtrace.npz)")
    add_run_arguments(gen, ("model", "trace_requests"), helps={"model": " (of the trace)"})
    gen.add_argument("--seed", type=nonneg_int, default=0, help="random seed")
    gen.add_argument("--skew", type=positive_float, default=1.0, metavar="TAU",
                     help="skew power τ of the expert popularity (p ← p^τ; >1 sharper, <1 "
                     "flatter)")
    gen.add_argument("--out", required=True, help="output trace path (.hdtrace.npz)")
    gen.set_defaults(func=tracetools.cmd_traces_gen)
    conv = tsub.add_parser("convert", help="reference JSON trace → canonical .npz")
    conv.add_argument("path", help="reference JSON trace file")
    conv.add_argument("--model", default=None,
                      help="model preset of the trace (E, k, layer keys; default: from the file)")
    conv.add_argument("--out", required=True, help="output trace path (.hdtrace.npz)")
    conv.set_defaults(func=tracetools.cmd_traces_convert)

    _add_record_parsers(tsub)

    _add_optional_commands(sub)
    _use_formatter(parser)
    return parser


def _add_optional_commands(sub: Any) -> None:
    """Add the commands whose implementations live in other application modules."""
    _add_bench_parser(sub)
    _add_bench_env_parser(sub)
    # torch and SB3 are imported inside the commands of train and evaluate only
    from hdamoe_env.app import evaluate, train

    train.add_train_arguments(sub.add_parser(
        "train", help="train an RL policy (SB3) and evaluate it on held-out streams",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)).set_defaults(func=train.cmd_train)
    evaluate.add_evaluate_arguments(sub.add_parser(
        "evaluate", help="compare learned and heuristic agents on identical episodes",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)).set_defaults(
        func=evaluate.cmd_evaluate)
    from hdamoe_env.app import tune  # agents.tuned; skopt only inside a BO search

    tune.add_tune_arguments(sub.add_parser(
        "tune", help="tuned-heuristic baseline: search the greedy agents' knobs under a top-1 "
        "retention target; held-out comparison; per-layer oracle bound (--oracle)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)).set_defaults(func=tune.cmd_tune)
    from hdamoe_env.app import compare

    compare.add_compare_arguments(sub.add_parser(
        "compare", help="heuristic, tuned and learned agents on identical held-out episodes: "
        "means with 95 %% t intervals, IQM with bootstrap intervals, paired differences",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    _add_reproduce_parser(sub)
    _add_energy_report_parser(sub)
    crossover.add_arguments(sub.add_parser(
        "crossover", help="which method wins each cell, and which cost-model knob decides it",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    _add_place_parser(sub)
    _add_sweep_parser(sub)


def _add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` to an argparse subparsers object (``func`` = :func:`bench.cmd_bench`)."""
    p = subparsers.add_parser(
        "bench", help="compare TP, EP, hybrid, Node/Link Balance, HD-MoE, HDA-MoE and agents "
        "on identical episodes", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_run_arguments(p, ("model", "trace", "trace_requests", "trace_skew", "mesh", "topology",
                          "setting", "batch", "conventions"),
                      helps={"trace_skew": "; placements are optimised on the same trace"})
    p.add_argument("--methods", type=name_list, default=",".join(methods.DEFAULT_METHODS),
                   help="comma list of methods; agent:NAME[@placement] or agent:PATH.zip adds "
                   "an agent, tuned:PATH/tuned.json[@placement] the tuned heuristic of "
                   "`hdamoe tune`")
    p.add_argument("--seeds", type=seed_list, default="0,1,2", help="comma list of episode seeds")
    p.add_argument("--steps", type=positive_int, default=16, help="decode steps per episode")
    add_decision_arguments(p)
    p.add_argument("--k-b", type=nonneg_int, default=None,
                   help="manual pre-broadcast slots per layer (default: the budget rule)")
    p.add_argument("--gating-protect-top", type=nonneg_int, default=0,
                   help="never drop a token's m best original experts (0 = reference)")
    p.add_argument("--placement-dir", default=None,
                   help="`hdamoe place` output directory (default: quick pipeline, cached)")
    p.add_argument("--cache-dir", default=None,
                   help="placement cache root (default $HDAMOE_CACHE_DIR or ~/.cache/hdamoe-env)")
    p.add_argument("--place-workers", type=positive_int, default=min(2, os.cpu_count() or 1),
                   help="worker processes of the quick placement pipeline")
    p.add_argument("--place-seed", type=nonneg_int, default=0, help="seed of EP and the pipeline")
    p.add_argument("--json", default=None, help="write the records (JSON list) here ('-' = stdout)")
    p.add_argument("--csv", default=None, help="write the records as CSV here")
    p.add_argument("--resume", action="store_true",
                   help="skip (method, seed) pairs already in --json for this configuration")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="per-step TensorBoard scalars under DIR/{env}__{method}__{seed}__{time}")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG figures here")
    p.add_argument("--heatmap-method", default=None,
                   help="method of the link heat map (default: the last with link data)")
    add_progress_flag(p, default=True)
    p.add_argument("--trust-model", action="store_true",
                   help="load SB3 models (agent:PATH.zip) not signed by this user's key (from "
                   "another user or machine); loading one runs code from the file: only for "
                   "files you trust")
    p.set_defaults(func=bench.cmd_bench)
    return p


def _add_bench_env_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench-env`` to an argparse subparsers object (``func`` = :func:`envbench.cmd_bench_env`)."""
    p = subparsers.add_parser(
        "bench-env", help="env steps/s (DES, analytic) and heuristic decision time per step",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_run_arguments(p, ("model", "mesh", "setting", "batch", "conventions"))
    p.add_argument("--seconds", type=positive_float, default=2.0, help="time budget per measurement")
    p.add_argument("--seed", type=nonneg_int, default=0, help="random seed")
    p.add_argument("--num-envs", type=nonneg_int, default=0,
                   help="N > 0: instead, single env vs the batched vector env with N copies "
                        "(steps/s of both in the same run, ratio)")
    p.add_argument("--fidelity", choices=("analytic", "des", "both"), default="both",
                   help="with --num-envs: the fidelities measured")
    p.add_argument("--des-threads", type=positive_int, nargs="+", default=[1], metavar="T",
                   help="with --num-envs: numba threads of the batched env (des_threads: "
                        "DES layer runs and decode-step formation); "
                        "several values measure one batched env each in the same run (the "
                        "single env always uses one thread); at most NUMBA_NUM_THREADS")
    p.add_argument("--k-b", type=nonneg_int, default=None, metavar="K",
                   help="with --num-envs: manual pre-broadcast slots k_b of every layer but the "
                        "first (the env's k_b; default: the budget rule), so that random masked "
                        "actions pre-broadcast")
    p.add_argument("--json", default=None,
                   help="also write the results to this JSON file ('-' = stdout, text to stderr)")
    p.set_defaults(func=envbench.cmd_bench_env)
    return p


def _add_reproduce_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``reproduce`` to an argparse subparsers object (``func`` = :func:`reproduce.cmd_reproduce`)."""
    p = subparsers.add_parser(
        "reproduce", help="the paper's evaluation grid, ablations, figures and a report",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--suite", default="quick", choices=reproduce.SUITES,
                   help="quick: <= 20 min on 2 cores; full: the whole grid")
    p.add_argument("--out", required=True, help="output directory (report.md, figures/, "
                   "results.jsonl, cells/)")
    p.add_argument("--workers", type=positive_int, default=min(2, os.cpu_count() or 1),
                   help="parallel worker processes (or Ray CPUs)")
    p.add_argument("--backend", default="process", choices=reproduce.BACKENDS,
                   help="parallel back end")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster address (default: start a local Ray instance)")
    p.add_argument("--mixtral-dir", default=reproduce.DEFAULT_MIXTRAL_DIR,
                   help="directory of the real Mixtral traces experts_<category>_mixtral.json "
                   "(Mixtral cells are skipped when it is missing)")
    p.add_argument("--cache-dir", default=None,
                   help="placement cache root (default $HDAMOE_CACHE_DIR or ~/.cache/hdamoe-env)")
    p.add_argument("--seeds", type=seed_list, default=None, help="comma list of episode seeds")
    p.add_argument("--fresh", action="store_true",
                   help="ignore finished cells in --out and compute everything again")
    p.add_argument("--report-only", action="store_true",
                   help="only (re)write the report from --out/results.jsonl")
    p.add_argument("--list", action="store_true", help="list the suite's cells and exit")
    p.add_argument("--only", default=None, metavar="TERMS",
                   help="compute only unfinished cells whose label (see --list) contains one "
                   "of these comma-separated terms, e.g. mixtral,fig10; finished cells are "
                   "still reported")
    p.set_defaults(func=reproduce.cmd_reproduce)
    return p


def _add_energy_report_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``energy-report`` (``func`` = :func:`energy_report.cmd_energy_report`)."""
    p = subparsers.add_parser("energy-report", help="energy table of bench records: energy and "
                              "EDP winners with robust marks over the pJ ranges",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("records", nargs="+", help="`hdamoe bench --json` record files")
    p.add_argument("--samples", type=positive_int, default=64,
                   help="joint Latin-hypercube samples of the energy uncertainties")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the samples")
    p.add_argument("--methods", type=name_list, default=None,
                   help="comma list: compare only these methods of the records (default all)")
    p.set_defaults(func=_energy_report)
    return p


def _add_record_parsers(tsub: Any) -> None:
    """Register ``train-tiny``, ``record`` and ``fidelity`` under ``hdamoe traces``."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    tt = tsub.add_parser("train-tiny", formatter_class=fmt,
                         help="train the tiny Mixtral model on stdlib sources (needs [record])")
    tt.add_argument("--out", default=None,
                    help="output directory (default ~/.cache/hdamoe-env/tiny-mixtral)")
    tt.add_argument("--minutes", type=positive_float, default=8.0, help="wall-clock training budget")
    tt.add_argument("--seed", type=nonneg_int, default=0, help="random seed")
    tt.add_argument("--hidden", type=positive_int, default=96, help="hidden size of the tiny model")
    tt.add_argument("--layers", type=positive_int, default=4, help="transformer layers of the tiny model")
    tt.add_argument("--seq-len", type=positive_int, default=128, help="training sequence length, tokens")
    tt.add_argument("--batch", type=positive_int, default=16, help="sequences per training batch")
    tt.add_argument("--lr", type=positive_float, default=3e-3, help="learning rate")
    tt.add_argument("--max-steps", type=positive_int, default=None,
                    help="stop after this many optimiser steps (default: time budget only)")
    tt.set_defaults(func=record.cmd_train_tiny)

    rec = tsub.add_parser("record", formatter_class=fmt,
                          help="record routing (ids, scores, next-layer predictions) during "
                          "generate() of a transformers MoE model (needs [record])")
    rec.add_argument("--model-dir", default=None,
                     help="save_pretrained directory (default: the train-tiny output)")
    src = rec.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", default=None,
                     help="text file, prompts separated by blank lines")
    src.add_argument("--stdlib-heldout", action="store_true",
                     help="prompts from the held-out stdlib files")
    rec.add_argument("--num-prompts", type=positive_int, default=16, help="prompts to generate from")
    rec.add_argument("--prompt-bytes", type=positive_int, default=256,
                     help="--stdlib-heldout: bytes per prompt")
    rec.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens generated per prompt")
    rec.add_argument("--extra-candidates", type=nonneg_int, default=None,
                     help="J: candidates beyond the top-k stored with scores (default k)")
    rec.add_argument("--model-key", default=None, help="meta['model'] of the trace")
    rec.add_argument("--seed", type=nonneg_int, default=0, help="random seed")
    rec.add_argument("--out", required=True, help="trace path (.hdtrace.npz)")
    rec.add_argument("--json", default=None,
                     help="write the prediction accuracy here ('-' = stdout)")
    rec.set_defaults(func=record.cmd_record)

    fid = tsub.add_parser("fidelity", formatter_class=fmt,
                          help="routing fidelity of hardware-aware gating on held-out text "
                          "(paper-model.md §12; needs [record])")
    fid.add_argument("--model-dir", default=None,
                     help="save_pretrained directory of the model (default: the train-tiny output)")
    fid.add_argument("--num-texts", type=positive_int, default=16, help="held-out texts evaluated")
    fid.add_argument("--text-bytes", type=positive_int, default=512, help="bytes per held-out text")
    fid.add_argument("--max-len", type=positive_int, default=512, help="tokens per text at most")
    add_run_arguments(fid, ("batch",), defaults={"batch": 32},
                      helps={"batch": ": the gating batch (consecutive rows gated together)"})
    fid.add_argument("--gating-levels", dest="levels", type=float_list(positive=False),
                     default="0.01,0.1,1",
                     help="multiples of the default (r_comp, r_comm) of --sim-model")
    add_deprecated_alias(fid, "--levels", "--gating-levels", "levels", takes_value=True)
    fid.add_argument("--cache-lambda", type=nonneg_float, default=0.5,
                     help="weight of the cache term of the fidelity metric")
    fid.add_argument("--sub-tokens", type=positive_int, default=256,
                     help="tokens per layer for the substitutability matrix")
    fid.add_argument("--sim-model", default="mixtral-8x7b",
                     help="preset whose layer shapes (h, I) and coefficients are used; its "
                     "layer count is replaced by the recorded model's")
    add_run_arguments(fid, ("setting", "mesh", "conventions"), defaults={"conventions": "paper"})
    fid.add_argument("--placement", default="ep", choices=("ep", "tp"),
                     help="placement of the simulation")
    fid.add_argument("--no-simulate", dest="simulate", action="store_false",
                     help="skip the latency simulation (routing fidelity only)")
    fid.add_argument("--seed", type=nonneg_int, default=0, help="random seed")
    fid.add_argument("--json", default=None,
                     help="also write the results to this JSON file ('-' = stdout, text to stderr)")
    fid.set_defaults(func=record.cmd_fidelity)


def _add_place_common(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p, ("model", "mesh", "setting", "batch", "topology"), required=("model",),
                      helps={"model": " (aliases mixtral, deepseek, qwen2, qwen35)"})
    p.add_argument("--hop-latency-ns", type=nonneg_float, default=None,
                   help="per-hop NoC latency, ns (default: the profile's hop_latency_s)")
    add_run_arguments(p, ("trace", "trace_requests", "trace_skew", "conventions"),
                      helps={"trace": " (.json reference trace, .npz canonical)"})
    p.add_argument("--layers", default=None, help="MoE layers, e.g. 0-3 or 0,2,5 (default all)")
    p.add_argument("--time-limit", type=positive_float, default=10.0,
                   help="Node-Balance time budget per layer (heuristic warm start + MILP), s")
    p.add_argument("--mip-gap", type=nonneg_float, default=0.05,
                   help="relative MIP gap at which Node Balance stops")
    p.add_argument("--nb-mode", default="milp", choices=("milp", "heuristic"),
                   help="Node Balance: MILP or heuristic")
    p.add_argument("--solver", default=None, choices=("highs", "cbc"),
                   help="MILP solver (default: HiGHS when highspy is installed, else CBC)")
    p.add_argument("--bo-calls", type=positive_int, default=70, help="Link-Balance evaluation budget")
    p.add_argument("--lb-method", default="bo", choices=sorted(place.LB_CHOICES),
                   help="Link Balance search method")
    p.add_argument("--lb-objective", default="auto", choices=place.LB_OBJECTIVE_CHOICES,
                   help="Link Balance objective: des (DES of the static group task set), "
                        "steps (DES of the best guard's sampled decode steps), mst (proxy), "
                        "auto (steps under the best guard, else des)")
    p.add_argument("--objective", default="latency", choices=("latency", "energy", "edp"),
                   help="what the placement minimises: MoE latency (the paper's), energy per "
                        "layer, or energy x delay (Link Balance and the best guard's choice; "
                        "docs/PHYSICS.md §18)")
    p.add_argument("--guard", default="best", choices=("best", "tp", "none"),
                   help="per-layer guard: best (score Node+Link, tp, tp-tiled, ep, hybrid on "
                        "sampled steps, tile local search from the best), tp (fall back to TP "
                        "when Node+Link is slower), none")
    p.add_argument("--no-guard", action="store_true", help="the same as --guard none")
    p.add_argument("--workers", type=positive_int, default=1, help="parallel worker processes")
    p.add_argument("--backend", default="process", choices=("process", "ray"),
                   help="parallel back end")
    p.add_argument("--seed", type=nonneg_int, default=0, help="random seed")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--resume", action="store_true",
                   help="skip layers already finished in --out (same configuration only)")
    p.add_argument("--force", action="store_true",
                   help="use an --out directory holding another run or other files: the files "
                   "this command writes are first moved into --out/superseded-*/ (never deleted)")
    p.add_argument("--json", default=None,
                   help="also write the table rows to this JSON file ('-' = stdout)")


def _add_place_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``place`` (the offline HD-MoE placement pipeline) to an argparse subparsers object."""
    p = subparsers.add_parser(
        "place", help="offline placement: γ fit, Node Balance, Link Balance per layer",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_place_common(p)
    p.add_argument("--rho-mem", type=positive_float, default=None,
                   help="memory-capacity cap factor ρ_mem (Eq. 10; None = off)")
    p.add_argument("--method", default="pipeline", choices=("pipeline", "eplb"),
                   help="pipeline: the HD-MoE offline pipeline (Alg. 2); eplb: redundant experts "
                   "by load (baselines.eplb; slots per node from --rho-mem, writes "
                   "placement_eplb.npz)")
    p.add_argument("--node-groups", type=positive_int, default=1,
                   help="eplb: node groups of consecutive nodes (1 = global policy; the mesh "
                   "rows X = hierarchical)")
    p.set_defaults(func=place.run_place)
    return p


def _add_sweep_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``sweep-mem`` (the ρ_mem sweep of paper Fig. 20) to an argparse subparsers object."""
    p = subparsers.add_parser(
        "sweep-mem", help="memory-cap sweep: ρ_mem → max/mean DRAM load and TBT",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_place_common(p)
    p.add_argument("--rho-values", type=float_list(allow_none=True),
                   default="none,2,1.5,1.25,1.1,1.0",
                   help="comma list of ρ_mem values ('none' = no cap)")
    p.set_defaults(func=place.run_sweep)
    return p


_FILE_OPTIONS = ("json", "csv")
#: (command path) -> kind of ``--out``: "dir" or "file".
_OUT_KIND = {"place": "dir", "sweep-mem": "dir", "train": "dir", "reproduce": "dir",
             "crossover": "dir", "tune": "dir",
             "evaluate": "dir", "compare": "dir", "traces gen": "file", "traces convert": "file",
             "traces record": "file", "traces train-tiny": "dir"}


def _energy_report(args: argparse.Namespace) -> int:
    from hdamoe_env.app.energy_report import cmd_energy_report

    return cmd_energy_report(args)


def _command(args: argparse.Namespace) -> str:
    sub = getattr(args, "traces_command", None)
    return f"{args.command} {sub}" if sub else str(args.command)


def _preflight_outputs(args: argparse.Namespace, command: str) -> None:
    """Check every output path before any work starts; refuse to replace files silently.

    Raises:
        OutputPathError: A directory given as a file (or the reverse), an unusable parent, an
            existing file that would be replaced, or a non-empty directory that is not this
            command's own run.
    """
    from hdamoe_env.config.errors import OutputPathError
    from hdamoe_env.config.fileio import check_output_dir, check_output_file

    check_output_options(args, _OUT_KIND.get(command))
    resume = bool(getattr(args, "resume", False)) or bool(getattr(args, "force", False))
    for opt in _FILE_OPTIONS:
        value = getattr(args, opt, None)
        if value and value != "-":
            path = check_output_file(value, f"--{opt}")
            if path.is_file() and path.stat().st_size and not resume:
                hint = ("pass --resume to keep its records and skip finished pairs, "
                        if command == "bench" else "")
                raise OutputPathError(f"--{opt} {value!r} already exists and would be replaced; "
                                      f"{hint}choose another path or move it away first")
    for opt in ("tensorboard", "plots"):
        value = getattr(args, opt, None)
        if value:
            check_output_dir(value, f"--{opt}")
    out = getattr(args, "out", None)
    kind = _OUT_KIND.get(command)
    if not out or kind is None:
        return
    if kind == "file":
        path = check_output_file(out, "--out", parent_must_exist=True)
        if path.is_file() and path.stat().st_size:
            raise OutputPathError(f"--out {out!r} already exists and would be replaced; choose "
                                  "another path or move it away first")
        return
    path = check_output_dir(out, "--out")
    if not path.is_dir() or not any(path.iterdir()):
        return
    if command == "train" and not args.resume:
        raise OutputPathError(f"--out {out!r} is not empty (e.g. {sorted(os.listdir(path))[:3]}); "
                              "a fresh run would mix with its files and stale checkpoints; pass "
                              "--resume to continue the run there, or use a new directory")
    if command in ("reproduce", "crossover") and not (
            (path / "suite.json").exists() or (path / "cells").is_dir()
            or (path / "results.jsonl").exists()):
        raise OutputPathError(f"--out {out!r} is not empty and is not an `hdamoe {command}` "
                              "output (no suite.json, cells/ or results.jsonl); use a new or "
                              "empty directory")


def _preflight_memory(args: argparse.Namespace, command: str) -> None:
    """Refuse runs whose estimated peak memory exceeds what is available (``limits``)."""
    from hdamoe_env.app import limits
    from hdamoe_env.config.specs import parse_mesh

    model_key = getattr(args, "model", None)
    if not isinstance(model_key, str):
        return
    try:
        if any(getattr(args, name, "") is None for name in ("setting", "mesh", "conventions")):
            model = get_model(model_key)       # a command whose run takes a base's values
        else:
            model = run_from_args(args, cache=True).model   # resolved once, for the command
    except HdMoeError:
        return                                 # the command reports the unknown name itself
    batch = getattr(args, "batch", None)
    mesh = getattr(args, "mesh", None)
    if command in ("simulate", "bench", "place", "sweep-mem", "train", "bench-env") and batch:
        try:
            X, Y = parse_mesh(mesh or RUN_DEFAULTS.mesh)
        except HdMoeError:
            return
        need = limits.batch_bytes(batch, model.num_experts, model.top_k, X * Y)
        limits.check_fits(need, f"a decode batch of --batch {batch} tokens ({model.key}, "
                          f"{X}x{Y} nodes)", "use a smaller --batch")
    requests = getattr(args, "trace_requests", None) or getattr(args, "requests", None)
    if requests and command in ("simulate", "bench", "place", "sweep-mem", "traces gen",
                                "traces stats", "train"):
        need = limits.trace_bytes(requests, model.num_moe_layers, model.top_k)
        limits.check_fits(need, f"a synthetic trace of --requests {requests} ({model.key})",
                          "use fewer --requests")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{exc.strerror}: {exc.filename!r}" if exc.filename else exc.strerror
    return text or type(exc).__name__


def _run_command(args: argparse.Namespace) -> int:
    """Run the subcommand; with ``--json -`` its JSON goes to stdout and its text to stderr."""
    from hdamoe_env.config.trust import consent

    with consent(bool(getattr(args, "trust_model", False))):
        return _run_command_json(args)


def _run_command_json(args: argparse.Namespace) -> int:
    if getattr(args, "json", None) != "-":
        return int(args.func(args) or 0)
    stdout = sys.stdout
    with tempfile.TemporaryDirectory(prefix="hdamoe-json-") as tmp:
        args.json = str(Path(tmp) / "out.json")
        with contextlib.redirect_stdout(sys.stderr):       # the tables and notes
            code = int(args.func(args) or 0)
        result = Path(args.json)
        if result.exists():
            text = result.read_text()
            stdout.write(text if text.endswith("\n") else text + "\n")
            stdout.flush()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hdamoe`` console script.

    Every error becomes one line on stderr and exit code 2 (``-v`` adds the traceback);
    Ctrl-C exits with 130. Output paths and the memory estimate are checked before the command
    starts any work.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    verbose = int(getattr(args, "verbose", 0) or 0)
    configure_logging(verbose, bool(getattr(args, "quiet", False)))
    try:
        command = _command(args)
        _preflight_outputs(args, command)
        _preflight_memory(args, command)
        from hdamoe_env.config.fileio import output_lock

        line = "hdamoe " + " ".join(sys.argv[1:] if argv is None else argv)
        with output_lock(output_targets(args, _OUT_KIND.get(command)), line):
            return _run_command(args)
    except KeyboardInterrupt:
        print("hdamoe: interrupted (finished results were kept; rerun with --resume where "
              "available)", file=sys.stderr)
        return 130
    except HdMoeError as exc:
        if verbose:
            import traceback

            traceback.print_exc()
        print(f"hdamoe: error: {_one_line(exc)} (see `hdamoe {_command(args)} --help`)",
              file=sys.stderr)
        return 2
    except MemoryError:
        if verbose:
            import traceback

            traceback.print_exc()
        print("hdamoe: error: out of memory; use a smaller --batch, fewer --requests or a "
              "smaller model", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, exit 2
        if verbose:
            import traceback

            traceback.print_exc()
        kind = "error" if isinstance(exc, OSError) else f"internal error ({type(exc).__name__})"
        print(f"hdamoe: {kind}: {_one_line(exc)}"
              + ("" if verbose else " (rerun with -v for the traceback)"), file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
