"""``hdamoe simulate``: per-layer latency and TBT of TP, tp-tiled, EP, hybrid or placement files.

The simulator alone (no env, no agents): ``MoESimulator`` with the sampled evaluator (decode steps
drawn from the trace) or the static one (expected loads), on the run resolved once from the
command line (``hdamoe_env.config.run``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from hdamoe_env import __version__
from hdamoe_env.app.argtypes import run_from_args
from hdamoe_env.app.progress import wrap
from hdamoe_env.app.tables import render_table
from hdamoe_env.config.fileio import write_json
from hdamoe_env.sim.placement import Placement, placement_by_name, share_unit
from hdamoe_env.sim.sources import load_trace

__all__ = ["cmd_simulate"]

US = 1e6


def _hybrid(trace: Any, model: Any, hw: Any, conv: Any, view: str) -> Placement:
    """Build the compute-balanced hybrid (§9.3) from the trace's f_i, on the profile's tile grid.

    [decision] The region balance is the greedy LPT assignment (no MILP), so that the command
    stays seconds-fast on any mesh; the bench's hybrid (``baselines.store``) solves the MILP.
    """
    from baselines.static import hybrid_placement

    rows = trace.view(view)
    freqs = [trace.layer_frequencies(layer, rows) for layer in range(model.num_moe_layers)]
    return hybrid_placement(freqs, hw.mesh_shape, model.hybrid_regions, method="lpt",
                            unit=None if conv.tile_cols == 1 else share_unit(model, conv))


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run ``hdamoe simulate``."""
    from hdamoe_env.sim.simulator import MoESimulator, evaluate_sampled, evaluate_static

    run = run_from_args(args, hardware_overrides={"hop_latency_ns": args.hop_latency_ns,
                                                  "node_dram_gib": args.dram_gib})
    model, hw, conv = run.model, run.hardware, run.conventions
    sim = MoESimulator(model, hw, run.topology, conv)
    t0 = time.perf_counter()
    trace = load_trace(run.trace, model, seed=args.seed, requests=run.trace_requests)
    t_trace = time.perf_counter() - t0
    requested = [n.strip() for n in args.placement.split(",") if n.strip()]
    names = requested if "tp" in requested else ["tp", *requested]  # TP normalises
    evals = {}
    t0 = time.perf_counter()
    for name in names:
        if name == "hybrid":
            placement = _hybrid(trace, model, hw, conv, args.view)
        else:
            placement = placement_by_name(name, model, hw.num_nodes, args.seed, conv=conv)
        if args.evaluator == "static":
            evals[name] = evaluate_static(sim, placement, trace, run.batch, seed=args.seed,
                                          view=args.view)
        else:
            evals[name] = evaluate_sampled(sim, placement, trace, run.batch, steps=args.steps,
                                           seed=args.seed, mode=args.batching, view=args.view,
                                           progress=lambda it: wrap(it, args.steps, name),
                                           replica_rule=args.replica_rule)
    t_sim = time.perf_counter() - t0
    tp_tbt = evals["tp"].tbt_s
    print(f"hdamoe simulate: {model.key} on {run.topology.kind} {hw.mesh_shape[0]}x{hw.mesh_shape[1]}"
          f" ({hw.num_nodes} nodes), {hw.compute_tflops:g} TFLOPS/node, "
          f"{hw.link_bw_gbps:g} GB/s/link, DRAM {hw.mem_bw_gbps:g} GB/s/node, B={run.batch}")
    trace_desc = (f"synthetic (seed {args.seed})" if run.trace == "synthetic" else run.trace)
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
        print(render_table(["layer", "t_nm", "t_comp", "dispatch", "combine", "comm_moe", "total"],
                     rows))
    print("\nsummary (µs per decode step)")
    rows = []
    for name in names:
        ev = evals[name]
        b = ev.breakdown
        rows.append([name, ev.tbt_s * US, ev.tbt_std_s * US, b["compute_s"] * US,
                     b["communication_s"] * US, b["memory_s"] * US, ev.tbt_s / tp_tbt])
    print(render_table(["placement", "TBT", "±std", "compute", "communication", "memory",
                  "TBT/TP"], rows, number="{:.2f}"))
    dense = sim.dense_time(run.batch)
    if dense:
        print(f"(compute includes {dense * US:.2f} µs of dense leading layers)")
    print(f"\nenergy (mJ per decode step; docs/PHYSICS.md §18, {sim.energy_spec.name})")
    rows = []
    for name in names:
        e = evals[name].energy_j
        rows.append([name, evals[name].j_per_token * 1e3, e["total"] * 1e3, e["dram"] * 1e3,
                     e["noc"] * 1e3, e["compute"] * 1e3, e["static"] * 1e3,
                     evals[name].edp_js * 1e6, e["total"] / evals["tp"].energy_j["total"]])
    print(render_table(["placement", "mJ/token", "total", "dram", "noc", "compute", "static",
                        "EDP µJ·s", "E/TP"], rows, number="{:.3f}"))
    print(f"\ntrace {t_trace:.1f} s, simulation {t_sim:.1f} s")
    if args.json:
        records = []
        for name, ev in evals.items():
            records.append({
                "method": name, "tbt_us": ev.tbt_s * US, "tbt_std_us": ev.tbt_std_s * US,
                "tbt_over_tp": ev.tbt_s / tp_tbt, "evaluator": ev.evaluator, "steps": ev.steps,
                "breakdown_us": {k: v * US for k, v in ev.breakdown.items()},
                "energy_j": ev.energy_j, "j_per_token": ev.j_per_token, "edp_js": ev.edp_js,
                "energy_spec": sim.energy_spec.to_dict(),
                "layers_us": {k: (v * US if k != "balancedness" else v)
                              for k, v in ev.layer_means.items()},
                "meta": ev.meta, "version": __version__,
            })
        write_json(args.json, records)
        print(f"wrote {args.json}")
    return 0
