"""Headroom of the placement lever on held-out layers (one cell so far).

For one cell (model, setting, mesh, batch, profile) and the held-out layers of the placement
env (``hdamoe_env.env.place.heldout_layers``: every 4th layer), every layer placement is scored
with the env's own evaluator (``HdMoePlaceEnv.evaluate_placement``; ``--evaluator static`` =
``MoESimulator.layer_static`` on expected loads, as the pipeline's per-layer records):

* NoOp: EP (§9.2, the pipeline's seeded shares and random mapping π0);
* the static baselines TP, tile-aligned TP and the hybrid (§9.1–9.3), and the best of them;
* Node + Link Balance: the offline pipeline (``baselines.layer_baselines.pipeline_candidates``
  with the quick budget ``baselines.store.QUICK_PLACEMENT``; its ``best`` guard already starts
  from the best-scored of the baselines and runs the tile local search);
* greedy: the best over pattern sizes of ``greedy_balance`` (longest-processing-time over the
  env's patterns of one size: node, each region size, spread);
* random search: the best of ``--episodes`` episodes of random legal actions in the placement
  env (``random_search``, ``--sampler kind``: a pattern size, then a pattern) — a search
  reference, not a bound;
* learned (``--learn-steps N``): MaskablePPO trained for N steps on the training layers (one
  seed), its deterministic placement of every held-out layer.

The greedy and the random search choose with the env's streams (``eval_seed = seed``); every
number of the table is scored again with fresh streams (``eval_seed = seed + 1000``: other
sampled steps and aggregators), so a search's pick carries no selection bias into the table.

Printed: a Markdown table per layer of the MoE latency t_comp + t_comm_moe in µs and as a
ratio to TP, and the mean ratio over the layers. Lower is better.

Run: ``OMP_NUM_THREADS=1 python benchmarks/headroom.py --episodes 64 --out runs/headroom``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from baselines.layer_baselines import pipeline_candidates
from baselines.pipeline_config import PlaceConfig
from baselines.store import QUICK_PLACEMENT
from hdamoe_env.env.place import (PLACE_EVALUATORS, RANDOM_SAMPLERS, HdMoePlaceEnv,
                                  greedy_balance, random_search)

#: Table columns: (header, key of the per-layer results).
COLUMNS = (("NoOp (EP)", "ep"), ("TP", "tp"), ("TP tiled", "tp-tiled"), ("hybrid", "hybrid"),
           ("best baseline", "best_baseline"), ("Node+Link", "node_link"),
           ("greedy", "greedy"), ("random best", "random"), ("learned", "learned"))


def run(args: argparse.Namespace) -> dict[int, dict[str, dict[str, float]]]:
    """Score every method on every held-out layer; return ``{layer: {method: scores}}``."""
    def make(eval_seed: int, split: str = "heldout", shaping: float = 0.0) -> HdMoePlaceEnv:
        return HdMoePlaceEnv(model=args.model, setting=args.setting, mesh=args.mesh,
                             conventions=args.conventions, batch=args.batch,
                             trace_seeds=(args.seed,), split=split,
                             evaluator=args.evaluator, score_steps=args.score_steps,
                             eval_seed=eval_seed, shaping_weight=shaping)

    env = make(args.seed)                 # the search's env
    scorer = make(args.seed + 1000)       # fresh streams for the table (no selection bias)
    config = PlaceConfig.create(model=args.model, setting=args.setting, mesh=args.mesh,
                                conventions=args.conventions, batch=args.batch,
                                trace="synthetic", seed=args.seed, **QUICK_PLACEMENT)
    layers = env.layers if args.layers is None else tuple(
        int(v) for v in args.layers.split(","))
    t0 = time.perf_counter()
    cands = pipeline_candidates(config, env.traces[0], layers, args.out, workers=args.workers)
    print(f"pipeline (quick budget) on layers {list(layers)}: {time.perf_counter() - t0:.0f} s")
    rng = np.random.default_rng(args.seed)
    results: dict[int, dict[str, dict[str, float]]] = {}
    for layer in layers:
        row: dict[str, dict[str, float]] = {}
        for name, cand in cands[layer].items():
            row[name] = scorer.evaluate_placement(cand.P, cand.pi, cand.allreduce,
                                                  layer=layer, trace_index=0)
        row["best_baseline"] = min((row[m] for m in ("tp", "tp-tiled", "hybrid")),
                                   key=lambda s: s["latency_us"])
        greedy = [greedy_balance(env, size, layer=layer)
                  for size in sorted(set(env.patterns.sum(axis=1).tolist()))]
        best_greedy = min(greedy, key=lambda g: g.best_ratio)
        print(f"layer {layer}: greedy ratio by pattern size " + ", ".join(
            f"{size}: {g.best_ratio:.4f}" for size, g in zip(
                sorted(set(env.patterns.sum(axis=1).tolist())), greedy, strict=True)))
        row["greedy"] = scorer.evaluate_placement(best_greedy.best_placement[0], None,
                                                  best_greedy.best_placement[1], layer=layer,
                                                  trace_index=0)
        t1 = time.perf_counter()
        rs = random_search(env, args.episodes, rng, layer=layer, sampler=args.sampler)
        P_best, red_best = rs.best_placement
        row["random"] = scorer.evaluate_placement(P_best, None, red_best, layer=layer,
                                                  trace_index=0)
        print(f"layer {layer}: random search {args.episodes} episodes "
              f"{time.perf_counter() - t1:.0f} s, best ratio {rs.best_ratio:.4f}, median "
              f"{float(np.median(rs.ratios)):.4f}")
        results[layer] = row
    if args.learn_steps > 0:
        for layer, (P, red) in learned_placements(args, make, layers).items():
            results[layer]["learned"] = scorer.evaluate_placement(P, None, red, layer=layer,
                                                                  trace_index=0)
    return results


def learned_placements(args: argparse.Namespace, make: Any, layers: tuple[int, ...]
                       ) -> dict[int, tuple[np.ndarray, bool]]:
    """Train MaskablePPO on the training layers; return its deterministic held-out placements.

    One seed, ``--learn-steps`` environment steps, the evaluator of the table with the
    search's streams (``eval_seed = seed``); γ = 1 (the only reward is at the episode's end),
    ``--learn-shaping w``: the env's load-balance potential (the return is unchanged).
    """
    import torch
    from sb3_contrib import MaskablePPO

    torch.set_num_threads(1)
    train_env = make(args.seed, "train", args.learn_shaping)
    t0 = time.perf_counter()
    n_steps = min(512, args.learn_steps)
    model = MaskablePPO("MultiInputPolicy", train_env, n_steps=n_steps,
                        batch_size=min(128, n_steps), n_epochs=5,
                        gamma=1.0, ent_coef=0.01, seed=args.seed, device="cpu", verbose=0)
    model.learn(total_timesteps=args.learn_steps)
    print(f"MaskablePPO {args.learn_steps} steps on layers {list(train_env.layers)}: "
          f"{time.perf_counter() - t0:.0f} s")
    env = make(args.seed)
    out = {}
    for layer in layers:
        obs, _ = env.reset(options={"layer": layer, "trace_index": 0})
        terminated = False
        while not terminated:
            action, _ = model.predict(obs, action_masks=env.action_masks(), deterministic=True)
            obs, _, terminated, _, info = env.step(action)
        print(f"layer {layer}: learned ratio {info['ratio']:.4f} (search streams)")
        out[layer] = env.placement_layer()
    return out


def table(results: dict[int, dict[str, dict[str, float]]]) -> str:
    """Return the Markdown table: µs (ratio to TP) per layer and method, and the mean ratio."""
    first = next(iter(results.values()))
    columns = [(h, k) for h, k in COLUMNS if k in first]
    head = "| layer | " + " | ".join(h for h, _ in columns) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 1)]
    for layer, row in results.items():
        cells = [f"{row[k]['latency_us']:.1f} ({row[k]['ratio']:.3f})" for _, k in columns]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    means = [float(np.mean([row[k]["ratio"] for row in results.values()])) for _, k in columns]
    lines.append("| mean ratio | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    return "\n".join(lines)


def main() -> None:
    """Parse the arguments, run, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--setting", default="5/50")
    ap.add_argument("--mesh", default="4x8")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--conventions", default="faithful")
    ap.add_argument("--evaluator", default="static", choices=PLACE_EVALUATORS)
    ap.add_argument("--score-steps", type=int, default=16,
                    help="sampled decode steps of the analytic/des evaluators")
    ap.add_argument("--episodes", type=int, default=64, help="random-search episodes per layer")
    ap.add_argument("--sampler", default="kind", choices=RANDOM_SAMPLERS,
                    help="random-search sampler (random_search)")
    ap.add_argument("--learn-steps", type=int, default=0,
                    help="train MaskablePPO for this many env steps on the training layers "
                         "(0: no learned column)")
    ap.add_argument("--learn-shaping", type=float, default=0.0,
                    help="shaping_weight of the training env (potential on the peak load)")
    ap.add_argument("--layers", default=None, help="comma-separated layers (default: held-out)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", default="runs/headroom", help="pipeline output directory")
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = run(args)
    print(f"\n{args.model} {args.mesh} {args.setting} B={args.batch} {args.conventions}, "
          f"evaluator {args.evaluator} ({args.score_steps} steps if sampled), seed {args.seed}, "
          f"{args.episodes} random episodes/layer, learn steps {args.learn_steps} (shaping "
          f"{args.learn_shaping}); µs (ratio to TP), lower is better\n")
    print(table(results))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
