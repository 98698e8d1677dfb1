"""Command-line front ends of the offline placement pipeline: ``hdamoe place`` and ``sweep-mem``.

``hdamoe_env.app.cli`` adds these subcommands with :func:`add_place_parser` and
:func:`add_sweep_parser`; each parser sets ``func`` to :func:`run_place` / :func:`run_sweep`,
which return the process exit code. Progress goes to stderr (tqdm when installed); the final
per-layer table (TP, EP, hybrid, Node Balance, Node+Link Balance: compute, communication and
total MoE latency in µs, plus sums, solver status and wall time per layer) goes to stdout.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from baselines.pipeline import (METHOD_NAMES, PipelineResult, PlaceConfig, load_trace,
                                parse_layers, run_pipeline, sweep_rho_mem)
from hdamoe_env.profiles import PROFILES
from hdamoe_env.specs import MODEL_PRESETS, TOPOLOGY_KINDS, parse_mesh

__all__ = ["add_place_parser", "add_sweep_parser", "format_table", "run_place", "run_sweep"]

_LB_CHOICES = {"bo": "bo", "local": "local", "anneal": "anneal", "random": "random"}


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=f"model preset: {', '.join(MODEL_PRESETS)} "
                   "(aliases mixtral, deepseek, qwen2, qwen35)")
    p.add_argument("--mesh", default="4x8", help="node grid XxY")
    p.add_argument("--setting", default="5/50", help="TFLOPS per node / GB/s per link")
    p.add_argument("--batch", type=int, default=128, help="tokens per decode step B")
    p.add_argument("--topology", default="mesh", choices=TOPOLOGY_KINDS)
    p.add_argument("--hop-latency-ns", type=float, default=0.0)
    p.add_argument("--trace", default="synthetic",
                   help="'synthetic' or a trace path (.json reference trace, .npz canonical)")
    p.add_argument("--requests", type=int, default=None,
                   help="synthetic trace: number of requests (default: generator's)")
    p.add_argument("--conventions", default="faithful", choices=sorted(PROFILES))
    p.add_argument("--layers", default=None, help="MoE layers, e.g. 0-3 or 0,2,5 (default all)")
    p.add_argument("--time-limit", type=float, default=10.0,
                   help="Node-Balance time budget per layer (heuristic warm start + MILP), s")
    p.add_argument("--mip-gap", type=float, default=0.05)
    p.add_argument("--nb-mode", default="milp", choices=("milp", "heuristic"))
    p.add_argument("--solver", default=None, choices=("highs", "cbc"),
                   help="MILP solver (default: HiGHS when highspy is installed, else CBC)")
    p.add_argument("--bo-calls", type=int, default=70, help="Link-Balance evaluation budget")
    p.add_argument("--lb-method", default="bo", choices=sorted(_LB_CHOICES))
    p.add_argument("--lb-objective", default="des", choices=("des", "mst"))
    p.add_argument("--no-guard", action="store_true",
                   help="do not fall back to TP for layers where Node+Link is slower")
    p.add_argument("--workers", type=int, default=1, help="parallel worker processes")
    p.add_argument("--backend", default="process", choices=("process", "ray"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--resume", action="store_true",
                   help="skip layers already finished in --out (same configuration only)")
    p.add_argument("--json", default=None, help="also write the table rows to this JSON file")


def add_place_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``place`` (the offline HD-MoE placement pipeline) to an argparse subparsers object."""
    p = subparsers.add_parser(
        "place", help="offline placement: γ fit, Node Balance, Link Balance per layer",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_common(p)
    p.add_argument("--rho-mem", type=float, default=None,
                   help="memory-capacity cap factor ρ_mem (Eq. 10; None = off)")
    p.set_defaults(func=run_place)
    return p


def add_sweep_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``sweep-mem`` (the ρ_mem sweep of paper Fig. 20) to an argparse subparsers object."""
    p = subparsers.add_parser(
        "sweep-mem", help="memory-cap sweep: ρ_mem → max/mean DRAM load and TBT",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_common(p)
    p.add_argument("--rho-values", default="none,2,1.5,1.25,1.1,1.0",
                   help="comma list of ρ_mem values ('none' = no cap)")
    p.set_defaults(func=run_sweep)
    return p


def _config(args: argparse.Namespace, rho_mem: float | None) -> PlaceConfig:
    return PlaceConfig(
        model=args.model, mesh=parse_mesh(args.mesh), setting=args.setting, batch=args.batch,
        topology=args.topology, trace=args.trace, trace_requests=args.requests,
        conventions=args.conventions, rho_mem=rho_mem, nb_mode=args.nb_mode,
        time_limit_s=args.time_limit, mip_gap=args.mip_gap, solver=args.solver,
        lb_method=_LB_CHOICES[args.lb_method], bo_calls=args.bo_calls,
        lb_objective=args.lb_objective, hop_latency_ns=args.hop_latency_ns,
        guard=None if args.no_guard else "tp", seed=args.seed)


def _progress_bar(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are optional
        return None
    return tqdm(total=total, desc="layers", unit="layer", file=sys.stderr, leave=False)


def format_table(result: PipelineResult) -> str:
    """Return the per-layer table of a pipeline result (µs), with sums."""
    rows = result.table_rows()
    head = ["layer"]
    for m in METHOD_NAMES:
        head += [f"{m}:comp", f"{m}:comm", f"{m}:total"]
    head += ["nb path", "status", "guard", "wall s"]
    lines: list[list[str]] = []
    sums = {m: [0.0, 0.0, 0.0] for m in METHOD_NAMES}
    wall = 0.0
    for row in rows:
        cells = [str(row["layer"])]
        for m in METHOD_NAMES:
            cells += [f"{v:.2f}" for v in row[m]]
            for j in range(3):
                sums[m][j] += row[m][j]
        guard = result.layers[row["layer"]].record.get("guard", {})
        cells += [str(row["nb_path"]), str(row["nb_status"]),
                  "TP" if guard.get("applied") else "-", f"{row['wall_s']:.1f}"]
        wall += row["wall_s"]
        lines.append(cells)
    total = ["sum"]
    for m in METHOD_NAMES:
        total += [f"{v:.2f}" for v in sums[m]]
    total += ["", "", "", f"{wall:.1f}"]
    lines.append(total)
    widths = [max(len(h), *(len(r[j]) for r in lines)) for j, h in enumerate(head)]
    out = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in lines]
    return "\n".join(out)


def run_place(args: argparse.Namespace) -> int:
    """Run ``hdamoe place``; return the exit code."""
    config = _config(args, args.rho_mem)
    trace = load_trace(config)
    todo = parse_layers(args.layers, config.model_spec.num_moe_layers)
    bar = _progress_bar(len(todo))

    def tick(outcome: Any) -> None:
        if bar is not None:
            bar.set_postfix(layer=outcome.layer, refresh=False)
            bar.update(1)

    try:
        result = run_pipeline(config, args.out, layers=todo, workers=args.workers,
                              backend=args.backend, resume=args.resume, trace=trace,
                              on_layer=tick)
    finally:
        if bar is not None:
            bar.close()
    shown = PipelineResult(result.placement, {l: result.layers[l] for l in todo
                                              if l in result.layers},
                           result.computed, result.skipped, result.out_dir, result.wall_s)
    print(format_table(shown))
    print(f"\n{len(result.computed)} layer(s) computed, {len(result.skipped)} reused; wall "
          f"{result.wall_s:.1f} s; placement written to {result.out_dir}/placement.npz")
    if args.json:
        _write_rows(args.json, shown.table_rows())
    return 0


def run_sweep(args: argparse.Namespace) -> int:
    """Run ``hdamoe sweep-mem``; return the exit code."""
    values: list[float | None] = []
    for part in (p.strip() for p in args.rho_values.split(",")):
        if part:
            values.append(None if part.lower() == "none" else float(part))
    config = _config(args, None)
    rows = sweep_rho_mem(config, values, args.out, layers=args.layers, workers=args.workers,
                         backend=args.backend, resume=args.resume)
    head = ["rho_mem", "DRAM max GiB", "DRAM mean GiB", "max/mean", "TBT µs", "TP TBT µs",
            "norm. TBT"]
    print("  ".join(head))
    for r in rows:
        print("  ".join([str(r["rho_mem"]), f"{r['dram_max_gib']:.3f}",
                         f"{r['dram_mean_gib']:.3f}", f"{r['dram_max_over_mean']:.3f}",
                         f"{r['tbt_us']:.2f}", f"{r['tbt_tp_us']:.2f}",
                         f"{r['normalised_tbt']:.4f}"]))
    if args.json:
        _write_rows(args.json, rows)
    return 0


def _write_rows(path: str, rows: Sequence[Any]) -> None:
    from baselines.pipeline import _write_json

    _write_json(Path(path), list(rows))


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point (``python -m hdamoe_env.app.place place …``)."""
    parser = argparse.ArgumentParser(prog="python -m hdamoe_env.app.place")
    sub = parser.add_subparsers(dest="command", required=True)
    add_place_parser(sub)
    add_sweep_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
