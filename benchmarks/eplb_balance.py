"""Expected node-load balance of EP vs EPLB, per layer, from a trace's expert frequencies.

For every MoE layer: f_i from the trace (``content`` view, as the placement pipeline mines it);
node load = Σ_i f_i · (P + replicas) / copies (``baselines.eplb.expected_node_load``: every copy
serves an equal share of its expert's tokens); the ratio max/mean node load. Printed: the mean
of the ratio over layers (and its worst layer) for EP (seed 0) and EPLB at each ρ_mem, global
(G = 1) and hierarchical over the mesh rows (G = X). ρ_mem values whose whole-copy slot budget
is infeasible (S < ⌈E/D⌉) are skipped with the reason; ``--slots`` gives S directly.

Run: ``OMP_NUM_THREADS=1 python benchmarks/eplb_balance.py --model deepseek-v2-lite``
or ``... --model mixtral-8x7b --rho 4,8
--trace ../shared/reference-traces/mixtral/experts_reasoning_mixtral.json``.
"""

from __future__ import annotations

import argparse

import numpy as np

from baselines.eplb import eplb, eplb_placement, eplb_slots, expected_node_load
from hdamoe_env.config.errors import InfeasibleError
from hdamoe_env.sim.placement import placement_by_name
from hdamoe_env.sim.sources import load_trace
from hdamoe_env.config.specs import get_model, parse_mesh


def _ratio(load: np.ndarray) -> np.ndarray:
    return load.max(axis=1) / load.mean(axis=1)


def main() -> None:
    """Print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--trace", default="synthetic")
    ap.add_argument("--mesh", default="4x8")
    ap.add_argument("--rho", default="1.25,1.5,2.0")
    ap.add_argument("--slots", type=int, default=None, help="S directly (overrides --rho)")
    args = ap.parse_args()
    model = get_model(args.model)
    X, Y = parse_mesh(args.mesh)
    D = X * Y
    trace = load_trace(args.trace, model, seed=0)
    rows = trace.view("content")
    L = model.num_moe_layers
    f = np.stack([trace.layer_frequencies(layer, rows) for layer in range(L)])
    print(f"{model.key}, trace {args.trace} ({trace.trace_id[:12]}), {X}x{Y} mesh, L={L}, "
          f"E={model.num_experts}, D={D}")
    ep = placement_by_name("ep", model, D, seed=0)
    r = _ratio(expected_node_load(ep, f))
    print(f"  EP                      max/mean mean {r.mean():.3f}  worst layer {r.max():.3f}")
    budgets: list[tuple[str, int]] = []
    if args.slots is not None:
        budgets.append((f"S={args.slots}", args.slots))
    else:
        for rho in (float(v) for v in args.rho.split(",")):
            try:
                budgets.append((f"rho={rho}", eplb_slots(model.num_experts, D, rho_mem=rho)))
            except InfeasibleError as exc:
                print(f"  EPLB rho={rho}: infeasible: {exc}")
    for label, S in budgets:
        for G in (1, X):
            res = eplb(f, D, S, num_node_groups=G)
            r = _ratio(expected_node_load(eplb_placement(res), f))
            print(f"  EPLB {label:8s} S={S} G={G}  max/mean mean {r.mean():.3f}  worst layer "
                  f"{r.max():.3f}  (physical/layer {int(res.counts[0].sum())}, max copies "
                  f"{int(res.counts.max())})")


if __name__ == "__main__":
    main()
