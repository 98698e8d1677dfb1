"""Command-line front ends of the offline placement pipeline: ``hdamoe place`` and ``sweep-mem``.

``hdamoe place --method eplb`` runs the EPLB redundant-expert baseline (``baselines.eplb``)
instead of the pipeline: ``placement_eplb.npz`` in ``--out`` and a per-layer table of the expected
max/mean node load of EP and EPLB (the placement always covers every layer; ``--layers`` selects
the rows of the table).

``hdamoe_env.app.cli`` defines the parsers; their ``func`` is :func:`run_place` / :func:`run_sweep`,
which return the process exit code. Progress goes to stderr (tqdm when installed); the final
per-layer table (TP, EP, hybrid, Node Balance, Node+Link Balance: compute, communication and
total MoE latency in µs, plus sums, solver status and wall time per layer) goes to stdout,
followed, when the ``best`` guard scored the candidates, by the objective table
(:func:`objective_rows`: per layer the latency winner, the energy winner and what the chosen
placement costs in latency; ``--objective energy|edp`` chooses by energy or EDP).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from baselines.memory_sweep import sweep_rho_mem
from baselines.pipeline import METHOD_NAMES, PipelineResult, run_pipeline
from baselines.pipeline_config import PlaceConfig, load_trace, parse_layers
from hdamoe_env.app.progress import bar as progress_bar
from hdamoe_env.app.tables import render_table
from hdamoe_env.config.fileio import write_json

__all__ = ["format_objective_table", "format_table", "objective_rows", "run_place",
           "run_sweep"]

#: ``--lb-method`` values -> the Link-Balance optimiser of ``PlaceConfig.lb_method``.
LB_CHOICES = {"bo": "bo", "local": "local", "anneal": "anneal", "random": "random"}
#: ``--lb-objective`` values (``baselines.pipeline_config.LB_OBJECTIVE_CHOICES``).
LB_OBJECTIVE_CHOICES = ("auto", "des", "steps", "mst")


def _config(args: argparse.Namespace, rho_mem: float | None) -> PlaceConfig:
    return PlaceConfig.create(
        model=args.model, mesh=args.mesh, setting=args.setting, batch=args.batch,
        topology=args.topology, trace=args.trace, trace_requests=args.trace_requests,
        trace_skew=args.trace_skew, conventions=args.conventions, rho_mem=rho_mem,
        nb_mode=args.nb_mode,
        time_limit_s=args.time_limit, mip_gap=args.mip_gap, solver=args.solver,
        lb_method=LB_CHOICES[args.lb_method], bo_calls=args.bo_calls,
        lb_objective=args.lb_objective, hop_latency_ns=args.hop_latency_ns,
        objective=getattr(args, "objective", "latency"),
        guard=None if args.no_guard else _guard(getattr(args, "guard", "best")),
        seed=args.seed)


def _guard(text: str) -> str | None:
    return None if text == "none" else text


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
                  _guard_label(guard), f"{row['wall_s']:.1f}"]
        wall += row["wall_s"]
        lines.append(cells)
    total = ["sum"]
    for m in METHOD_NAMES:
        total += [f"{v:.2f}" for v in sums[m]]
    total += ["", "", "", f"{wall:.1f}"]
    lines.append(total)
    return render_table(head, lines)


def objective_rows(result: PipelineResult) -> list[dict[str, Any]]:
    """Per layer: the latency and energy winners among the guard's candidates, and the cost.

    Read from the ``best`` guard's scores (``method_costs_us``: every candidate's mean MoE
    latency and layer energy on the same sampled steps). ``latency_winner`` / ``energy_winner``
    are the candidates (Node+Link's final layer included as ``node-link``, preferred on ties)
    with the lowest ``total_us`` / ``energy_uj``; ``chosen`` is the final layer (``node-link``) under the run's
    objective, and ``latency_cost_us`` its MoE latency minus the latency winner's (the price in
    time of the run's choice; 0 under ``latency``). Layers without the scores (``tp`` guard,
    ``paper*`` profiles, placements from before the energy model) are left out.
    """
    rows = []
    for layer in sorted(result.layers):
        rec = result.layers[layer].record
        costs = rec.get("method_costs_us") or {}
        if not costs or not all("energy_uj" in c for c in costs.values()):
            continue
        order = ["node-link", *(m for m in costs if m != "node-link")]  # ties: the final layer
        lat_w = min(order, key=lambda m: costs[m]["total_us"])
        en_w = min(order, key=lambda m: costs[m]["energy_uj"])
        final = costs["node-link"]
        rows.append({
            "layer": layer, "objective": rec.get("objective", "latency"),
            "warm_start": rec.get("warm_start"), "latency_winner": lat_w,
            "energy_winner": en_w, "same_winner": lat_w == en_w or (
                costs[lat_w]["total_us"] == costs[en_w]["total_us"]
                and costs[lat_w]["energy_uj"] == costs[en_w]["energy_uj"]),
            "chosen_us": final["total_us"], "chosen_uj": final["energy_uj"],
            "latency_best_us": costs[lat_w]["total_us"],
            "energy_best_uj": costs[en_w]["energy_uj"],
            "latency_cost_us": final["total_us"] - costs[lat_w]["total_us"],
            "latency_ratio": final["total_us"] / costs[lat_w]["total_us"],
            "energy_ratio": final["energy_uj"] / costs[en_w]["energy_uj"]})
    return rows


def format_objective_table(rows: Sequence[dict[str, Any]]) -> str:
    """Return the table of :func:`objective_rows` (µs, µJ per layer and decode step)."""
    head = ["layer", "objective", "warm start", "latency winner", "energy winner",
            "chosen µs", "chosen µJ", "best µs", "best µJ", "latency cost µs", "µs ratio",
            "µJ ratio"]
    return render_table(head, [[str(r["layer"]), r["objective"], str(r["warm_start"]),
                                r["latency_winner"], r["energy_winner"],
                                f"{r['chosen_us']:.2f}", f"{r['chosen_uj']:.2f}",
                                f"{r['latency_best_us']:.2f}", f"{r['energy_best_uj']:.2f}",
                                f"{r['latency_cost_us']:+.2f}", f"{r['latency_ratio']:.4f}",
                                f"{r['energy_ratio']:.4f}"] for r in rows])


def _guard_label(guard: dict[str, object]) -> str:
    """The guard column: the warm start that won (``best``), TP (``tp``) or '-'."""
    if not guard.get("applied"):
        return "-"
    return str(guard.get("warm_start") or "TP")


def run_place(args: argparse.Namespace) -> int:
    """Run ``hdamoe place``; return the exit code."""
    config = _config(args, args.rho_mem)
    trace = load_trace(config)
    if getattr(args, "method", "pipeline") == "eplb":
        return _run_eplb(args, config, trace)
    todo = parse_layers(args.layers, config.model_spec.num_moe_layers)
    bar = progress_bar(len(todo), "layers", unit="layer")

    def tick(outcome: Any) -> None:
        bar.update(1)

    try:
        result = run_pipeline(config, args.out, layers=todo, workers=args.workers,
                              backend=args.backend, resume=args.resume, trace=trace,
                              on_layer=tick, force=getattr(args, "force", False))
    finally:
        bar.close()
    shown = PipelineResult(result.placement, {l: result.layers[l] for l in todo
                                              if l in result.layers},
                           result.computed, result.skipped, result.out_dir, result.wall_s)
    print(format_table(shown))
    obj_rows = objective_rows(shown)
    if obj_rows:
        print(f"\nObjective {config.objective}: the guard's candidates on "
              f"{config.score_steps} sampled steps (MoE latency µs, layer energy µJ)")
        print(format_objective_table(obj_rows))
    print(f"\n{len(result.computed)} layer(s) computed, {len(result.skipped)} reused; wall "
          f"{result.wall_s:.1f} s; placement written to {result.out_dir}/placement.npz")
    if args.json:
        by_layer = {r["layer"]: r for r in obj_rows}
        _write_rows(args.json, [{**row, **({"objective_costs": by_layer[row["layer"]]}
                                           if row["layer"] in by_layer else {})}
                                for row in shown.table_rows()])
    return 0


def _run_eplb(args: argparse.Namespace, config: PlaceConfig, trace: Any) -> int:
    """``hdamoe place --method eplb``: EPLB on the trace's frequencies, one file, a table."""
    from pathlib import Path

    import numpy as np

    from baselines.eplb import eplb, eplb_placement, eplb_slots, expected_node_load
    from hdamoe_env.config.errors import OutputPathError

    model, hw = config.model_spec, config.hardware
    out = Path(args.out) / "placement_eplb.npz"
    if out.exists() and not getattr(args, "force", False):
        raise OutputPathError(f"{str(out)!r} already exists and would be replaced; pass --force "
                              "or choose another --out")
    rows = trace.view(config.view)
    freqs = np.stack([trace.layer_frequencies(layer, rows)
                      for layer in range(model.num_moe_layers)])
    slots = eplb_slots(model.num_experts, hw.num_nodes, rho_mem=config.rho_mem, model=model,
                       hw=hw, conv=config.conv)
    result = eplb(freqs, hw.num_nodes, slots, num_node_groups=args.node_groups)
    placement = eplb_placement(result, trace_id=trace.trace_id, rho_mem=config.rho_mem,
                               model=model.key, mesh=list(config.run.mesh_shape))
    ep = expected_node_load(_ep(config), freqs)
    load = expected_node_load(placement, freqs)
    todo = parse_layers(args.layers, model.num_moe_layers)
    lines = [[str(layer), str(int(result.counts[layer].max())),
              f"{ep[layer].max() / ep[layer].mean():.3f}",
              f"{load[layer].max() / load[layer].mean():.3f}"] for layer in todo]
    print(render_table(["layer", "max copies", "EP max/mean", "EPLB max/mean"], lines))
    placement.save(out)
    print(f"\nEPLB: S={slots} slots per node, {int(result.counts[0].sum())} physical experts "
          f"per layer, {args.node_groups} node group(s); placement written to {out}")
    if args.json:
        keys = ("layer", "max_copies", "ep_max_over_mean", "eplb_max_over_mean")
        _write_rows(args.json, [dict(zip(keys, row, strict=True)) for row in lines])
    return 0


def _ep(config: PlaceConfig) -> Any:
    """Return the EP placement of the configuration (seeded by its seed), for comparison."""
    from hdamoe_env.sim.placement import placement_by_name

    return placement_by_name("ep", config.model_spec, config.hardware.num_nodes, config.seed)


def run_sweep(args: argparse.Namespace) -> int:
    """Run ``hdamoe sweep-mem``; return the exit code."""
    values: list[float | None] = []
    for part in (p.strip() for p in args.rho_values.split(",")):
        if part:
            values.append(None if part.lower() == "none" else float(part))
    config = _config(args, None)
    rows = sweep_rho_mem(config, values, args.out, layers=args.layers, workers=args.workers,
                         backend=args.backend, resume=args.resume,
                         force=getattr(args, "force", False))
    head = ["rho_mem", "DRAM max GiB", "DRAM mean GiB", "max/mean", "TBT µs", "TP TBT µs",
            "norm. TBT"]
    print(render_table(head, [[str(r["rho_mem"]), f"{r['dram_max_gib']:.3f}",
                               f"{r['dram_mean_gib']:.3f}", f"{r['dram_max_over_mean']:.3f}",
                               f"{r['tbt_us']:.2f}", f"{r['tbt_tp_us']:.2f}",
                               f"{r['normalised_tbt']:.4f}"] for r in rows]))
    if args.json:
        _write_rows(args.json, rows)
    return 0


def _write_rows(path: str, rows: Sequence[Any]) -> None:
    write_json(path, list(rows), sort_keys=True)
