"""Command-line interface ``hdamoe`` (application layer, style.md §2).

Subcommands: ``simulate`` (per-layer latency and TBT of TP/EP or a saved placement),
``bench-sim`` (DES kernel vs oracle speed), ``traces stats|gen|convert`` and
``traces train-tiny|record|fidelity`` (real routing, ``hdamoe_env.app.record``), and, when their extras
are installed, the offline placement commands. Heavy dependencies are imported inside the
subcommand that needs them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hdamoe_env import __version__
from hdamoe_env.errors import HdMoeError, TraceFormatError
from hdamoe_env.fileio import load_trace_file, write_json
from hdamoe_env.placement import Placement, expert_parallel, tensor_parallel
from hdamoe_env.profiles import PROFILES, get_profile
from hdamoe_env.specs import (
    MODEL_PRESETS,
    TOPOLOGY_KINDS,
    ModelSpec,
    get_model,
    hardware_from_setting,
)

__all__ = ["load_trace", "main", "write_json_atomic"]

US = 1e6


# ------------------------------------------------------------------------------------- helpers
def _progress(total: int | None = None, desc: str = "") -> Callable[[Iterable[Any]], Iterable[Any]]:
    """Return a wrapper that shows a tqdm progress bar on stderr when tqdm is installed."""
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are optional
        return lambda it: it
    return lambda it: tqdm(it, total=total, desc=desc, leave=False, file=sys.stderr,
                           disable=not sys.stderr.isatty())


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> Path:
    """Write JSON to ``path`` atomically (temp file in the same directory, then rename)."""
    return write_json(path, data)


def load_trace(spec: str, model: ModelSpec, seed: int, *, requests: int | None = None) -> Any:
    """Load a trace for ``model``: ``"synthetic"`` (built-in generator) or a path (.json/.npz).

    Raises:
        TraceFormatError: The file is malformed.
        ConfigError: The file does not exist.
    """
    from traces import synthetic

    if spec == "synthetic":
        return synthetic.generate(model.key, n_requests=requests, seed=seed)
    return load_trace_file(spec, model)


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]], fmt: str = "{:.2f}") -> str:
    cells = [[c if isinstance(c, str) else fmt.format(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[j]) for r in cells)) if cells else len(h)
              for j, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ simulate
def _build_placement(name: str, model: ModelSpec, num_nodes: int, seed: int) -> Placement:
    if name == "tp":
        return tensor_parallel(model.num_moe_layers, model.num_experts, num_nodes)
    if name == "ep":
        p = expert_parallel(model.num_moe_layers, model.num_experts, num_nodes,
                            np.random.default_rng(seed))
        return p.with_layers(seed=seed)
    return Placement.load(name)


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run ``hdamoe simulate``."""
    from hdamoe_env.simulator import MoESimulator, evaluate_sampled, evaluate_static

    model = get_model(args.model)
    hw = hardware_from_setting(args.setting, args.mesh, hop_latency_ns=args.hop_latency_ns,
                               node_dram_gib=args.dram_gib)
    conv = get_profile(args.conventions)
    sim = MoESimulator(model, hw, args.topology, conv)
    t0 = time.perf_counter()
    trace = load_trace(args.trace, model, args.seed, requests=args.requests)
    t_trace = time.perf_counter() - t0
    requested = [n.strip() for n in args.placement.split(",") if n.strip()]
    names = requested if "tp" in requested else ["tp", *requested]  # TP normalises
    evals = {}
    t0 = time.perf_counter()
    for name in names:
        placement = _build_placement(name, model, hw.num_nodes, args.seed)
        if args.evaluator == "static":
            evals[name] = evaluate_static(sim, placement, trace, args.batch, seed=args.seed,
                                          view=args.view)
        else:
            evals[name] = evaluate_sampled(sim, placement, trace, args.batch, steps=args.steps,
                                           seed=args.seed, mode=args.batching, view=args.view,
                                           progress=_progress(args.steps, name))
    t_sim = time.perf_counter() - t0
    tp_tbt = evals["tp"].tbt_s
    print(f"hdamoe simulate: {model.key} on {args.topology} {hw.mesh_shape[0]}x{hw.mesh_shape[1]}"
          f" ({hw.num_nodes} nodes), {hw.compute_tflops:g} TFLOPS/node, "
          f"{hw.link_bw_gbps:g} GB/s/link, DRAM {hw.mem_bw_gbps:g} GB/s/node, B={args.batch}")
    trace_desc = (f"synthetic (seed {args.seed})" if args.trace == "synthetic" else args.trace)
    steps_desc = (f"{args.steps} decode steps ({args.batching})" if args.evaluator == "sampled"
                  else "expected loads")
    print(f"conventions: {conv.name} · evaluator: {args.evaluator}, {steps_desc} · trace: "
          f"{trace_desc}, {trace.num_tokens} rows, id {trace.trace_id[:12]}")
    for name in requested:
        ev = evals[name]
        lm = ev.layer_means
        rows = [[str(layer), lm["t_nm_s"][layer] * US, lm["t_comp_s"][layer] * US,
                 lm["t_dispatch_s"][layer] * US, lm["t_combine_s"][layer] * US,
                 lm["t_comm_moe_s"][layer] * US, lm["total_s"][layer] * US]
                for layer in range(model.num_moe_layers)]
        print(f"\nplacement {name}: per MoE layer (µs, mean over steps)")
        print(_table(["layer", "t_nm", "t_comp", "dispatch", "combine", "comm_moe", "total"],
                     rows))
    print("\nsummary (µs per decode step)")
    rows = []
    for name in names:
        ev = evals[name]
        b = ev.breakdown
        rows.append([name, ev.tbt_s * US, ev.tbt_std_s * US, b["compute_s"] * US,
                     b["communication_s"] * US, b["memory_s"] * US, ev.tbt_s / tp_tbt])
    print(_table(["placement", "TBT", "±std", "compute", "communication", "memory",
                  "TBT/TP"], rows, fmt="{:.2f}"))
    dense = sim.dense_time(args.batch)
    if dense:
        print(f"(compute includes {dense * US:.2f} µs of dense leading layers)")
    print(f"\ntrace {t_trace:.1f} s, simulation {t_sim:.1f} s")
    if args.json:
        records = []
        for name, ev in evals.items():
            records.append({
                "method": name, "tbt_us": ev.tbt_s * US, "tbt_std_us": ev.tbt_std_s * US,
                "tbt_over_tp": ev.tbt_s / tp_tbt, "evaluator": ev.evaluator, "steps": ev.steps,
                "breakdown_us": {k: v * US for k, v in ev.breakdown.items()},
                "layers_us": {k: (v * US if k != "balancedness" else v)
                              for k, v in ev.layer_means.items()},
                "meta": ev.meta, "version": __version__,
            })
        write_json_atomic(args.json, records)
        print(f"wrote {args.json}")
    return 0


# ----------------------------------------------------------------------------------- bench-sim
def cmd_bench_sim(args: argparse.Namespace) -> int:
    """Run ``hdamoe bench-sim``: fast DES path vs the pure-Python oracle, same run."""
    from hdamoe_env.app.simbench import bench_sim

    res = bench_sim(seconds=args.seconds, seed=args.seed)
    print("DES benchmark: DeepSeek-V2-Lite (E=64, top-6), B=128, 4x8 mesh 50 GB/s, EP, "
          "dispatch + combine per layer simulation")
    for key, value in res.items():
        print(f"  {key:>22}: {value:.4g}" if isinstance(value, float) else
              f"  {key:>22}: {value}")
    if args.json:
        write_json_atomic(args.json, res)
    return 0


# -------------------------------------------------------------------------------------- traces
def cmd_traces_stats(args: argparse.Namespace) -> int:
    """Run ``hdamoe traces stats PATH...`` (``synthetic:<model>`` generates one)."""
    from traces import stats

    columns = {}
    for spec in args.paths:
        if spec.startswith("synthetic"):
            key = spec.split(":", 1)[1] if ":" in spec else "mixtral-8x7b"
            model = get_model(key)
            trace = load_trace("synthetic", model, args.seed, requests=args.requests)
            label = f"synthetic:{model.key}"
        else:
            model = None
            trace = load_trace_file(spec)
            label = Path(spec).name
        columns[label] = stats.trace_stats(trace, view=args.view, B=args.batch,
                                           rng_seed=args.seed)
    print(stats.format_stats_table(columns))
    if args.json:
        write_json_atomic(args.json, columns)
    return 0


def cmd_traces_gen(args: argparse.Namespace) -> int:
    """Run ``hdamoe traces gen``: write a synthetic trace in the canonical format."""
    import traces

    model = get_model(args.model)
    trace = load_trace("synthetic", model, args.seed, requests=args.requests)
    path = traces.save(trace, args.out)
    print(f"wrote {path}: {trace.num_layers} layers × {trace.num_tokens} rows × "
          f"top-{trace.top_k}, trace id {trace.trace_id[:12]}")
    return 0


def cmd_traces_convert(args: argparse.Namespace) -> int:
    """Run ``hdamoe traces convert``: reference JSON → canonical ``.npz``."""
    import traces

    kwargs: dict[str, Any] = {}
    if args.model:
        model = get_model(args.model)
        kwargs = {"model_key": model.key, "E": model.num_experts, "k": model.top_k,
                  "layer_key_offset": model.layer_key_offset}
    trace = traces.read_reference_json(args.path, **kwargs)
    path = traces.save(trace, args.out)
    print(f"wrote {path}: {trace.num_layers} layers × {trace.num_tokens} rows; keep it outside "
          "the repository (it redistributes reference-trace content; see NOTICE)")
    return 0


# ---------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``hdamoe``."""
    parser = argparse.ArgumentParser(
        prog="hdamoe", description="HDA-MoE on 3D near-memory processing: simulate MoE decode "
        "latency on a NoC, build placements, benchmark agents.")
    parser.add_argument("--version", action="version", version=f"hdamoe-env {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="per-layer latency and TBT of TP/EP or a placement",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sim.add_argument("--model", default="deepseek-v2-lite",
                     help=f"model preset: {', '.join(MODEL_PRESETS)}")
    sim.add_argument("--topology", default="mesh", choices=TOPOLOGY_KINDS)
    sim.add_argument("--mesh", default="4x8", help="node grid XxY (fat-tree: 4x8 endpoints)")
    sim.add_argument("--setting", default="5/50", help="TFLOPS per node / GB/s per link")
    sim.add_argument("--hop-latency-ns", type=float, default=0.0)
    sim.add_argument("--dram-gib", type=float, default=None,
                     help="DRAM capacity per node; placements that do not fit are rejected")
    sim.add_argument("--batch", type=int, default=128, help="tokens per decode step B")
    sim.add_argument("--placement", default="tp,ep",
                     help="comma list of tp, ep or paths to placement .npz files")
    sim.add_argument("--trace", default="synthetic", help="'synthetic' or a trace path")
    sim.add_argument("--requests", type=int, default=None,
                     help="synthetic trace: number of requests (default: generator's)")
    sim.add_argument("--conventions", default="faithful", choices=sorted(PROFILES))
    sim.add_argument("--evaluator", default="sampled", choices=("sampled", "static"))
    sim.add_argument("--steps", type=int, default=16, help="decode steps (sampled evaluator)")
    sim.add_argument("--batching", default="streams", choices=("streams", "random_rows"))
    sim.add_argument("--view", default="content", choices=("content", "unique", "raw"),
                     help="trace rows used: content (new computation only), unique, raw (all "
                     "rows, as the reference sampled them)")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--json", default=None, help="write records to this JSON file")
    sim.set_defaults(func=cmd_simulate)

    bs = sub.add_parser("bench-sim", help="DES fast kernel vs oracle: simulations per second")
    bs.add_argument("--seconds", type=float, default=3.0, help="time budget per measurement")
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--json", default=None)
    bs.set_defaults(func=cmd_bench_sim)

    tr = sub.add_parser("traces", help="routing traces: statistics, generation, conversion")
    tsub = tr.add_subparsers(dest="traces_command", required=True)
    st = tsub.add_parser("stats", help="statistics of traces side by side",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    st.add_argument("paths", nargs="+",
                    help="trace files (.json reference, .npz canonical) or synthetic:<model>")
    st.add_argument("--view", default="content", choices=("content", "unique", "raw"))
    st.add_argument("--batch", type=int, default=64, help="B for the fluctuation statistics")
    st.add_argument("--requests", type=int, default=None)
    st.add_argument("--seed", type=int, default=0)
    st.add_argument("--json", default=None)
    st.set_defaults(func=cmd_traces_stats)
    gen = tsub.add_parser("gen", help="write a synthetic trace (.hdtrace.npz)")
    gen.add_argument("--model", default="deepseek-v2-lite")
    gen.add_argument("--requests", type=int, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--out", required=True)
    gen.set_defaults(func=cmd_traces_gen)
    conv = tsub.add_parser("convert", help="reference JSON trace → canonical .npz")
    conv.add_argument("path")
    conv.add_argument("--model", default=None)
    conv.add_argument("--out", required=True)
    conv.set_defaults(func=cmd_traces_convert)

    _add_record_commands(tsub)

    _add_optional_commands(sub)
    return parser


def _add_record_commands(tsub: Any) -> None:
    """Add ``traces train-tiny|record|fidelity`` (issue 7; torch/transformers imported lazily)."""
    from hdamoe_env.app import record as record_cli

    record_cli.add_record_parsers(tsub)


def _add_optional_commands(sub: Any) -> None:
    """Add subcommands implemented in the application layer (bench) and in baselines."""
    from hdamoe_env.app import bench

    bench.add_bench_parser(sub)
    bench.add_bench_env_parser(sub)
    from hdamoe_env.app import train  # torch and SB3 are imported inside its commands only

    train.add_train_arguments(sub.add_parser(
        "train", help="train an RL policy (SB3) and evaluate it on held-out streams",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)).set_defaults(func=train.cmd_train)
    train.add_evaluate_arguments(sub.add_parser(
        "evaluate", help="compare learned and heuristic agents on identical episodes",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)).set_defaults(
        func=train.cmd_evaluate)
    from hdamoe_env.app import reproduce

    reproduce.add_reproduce_parser(sub)
    try:
        from hdamoe_env.app import place as baselines_cli
    except ImportError:
        return
    for name in ("add_place_parser", "add_sweep_parser"):
        add = getattr(baselines_cli, name, None)
        if add is not None:
            add(sub)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hdamoe`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except HdMoeError as exc:
        print(f"hdamoe: error: {exc}", file=sys.stderr)
        return 2
    except TraceFormatError as exc:
        print(f"hdamoe: trace error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hdamoe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
