"""Headroom per lever: NoOp, tuned heuristic and a hindsight oracle or bound (issue 31).

Three parts (``--part``); docs/results/headroom.md has the tables and commands.

* ``online``: the online levers of ``HdMoE-v1`` over the 12 cells (:func:`online_levers`,
  :func:`online_cell`): NoOp, the grid point tuned on training episodes and the per-layer
  hindsight oracle (``agents.tuned.per_layer_oracle``) on held-out episodes.
* ``placement-cells``: the placement part below over the same cells, with the placement env's
  compute bound (``HdMoePlaceEnv.latency_lower_bound``) and without random search / learning.
* ``placement`` (default): the placement lever in one cell, in depth:

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

Run: ``OMP_NUM_THREADS=1 python benchmarks/headroom.py --episodes 64 --out runs/headroom``
(``--part online --out runs/headroom`` for the online levers).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
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
           ("greedy", "greedy"), ("random best", "random"), ("learned", "learned"),
           ("bound", "bound"))


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
        bound = scorer.latency_lower_bound(layer=layer, trace_index=0)
        row["bound"] = {"latency_us": bound["lower_bound_us"], "ratio": bound["ratio"]}
        if getattr(args, "bound", "perstep") == "fixed":
            fx = scorer.latency_lower_bound(layer=layer, trace_index=0, fixed=True)
            row["bound_fixed"] = {"latency_us": fx["lower_bound_us"], "ratio": fx["ratio"],
                                  "solve_s": fx["fixed_solve_s"], "gap": fx["fixed_gap"]}
            print(f"layer {layer}: fixed-placement bound {fx['ratio']:.4f} (per step "
                  f"{bound['ratio']:.4f}), MILP {fx['fixed_solve_s']:.1f} s CPU, "
                  f"gap {fx['fixed_gap']:.1e}")
        if args.episodes > 0:
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
                        gamma=1.0, ent_coef=0.01, seed=args.seed, device="cpu", verbose=0,
                        tensorboard_log=getattr(args, "tensorboard", None))
    model.learn(total_timesteps=args.learn_steps, callback=latency_callback(),
                tb_log_name="place-maskable-ppo")
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


def latency_callback() -> Any:
    """SB3 callback: the episode latency of the placement env under ``latency/``.

    The tags of HdMoE-v0's training (docs/TENSORBOARD.md): ``latency/total_us`` and
    ``latency/total_over_tp``, means since the last dump, from the terminal step's
    ``info["total_us"]`` and ``info["tp_total_us"]``.
    """
    from stable_baselines3.common.callbacks import BaseCallback

    class PlaceLatency(BaseCallback):
        def _on_step(self) -> bool:
            for info in self.locals.get("infos", ()):
                if "total_us" in info and info.get("tp_total_us", 0) > 0:
                    self.logger.record_mean("latency/total_us", float(info["total_us"]))
                    self.logger.record_mean("latency/total_over_tp",
                                            float(info["total_us"]) / float(info["tp_total_us"]))
            return True

    return PlaceLatency()


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


# ------------------------------------------------------------------ online levers (HdMoE-v0)
#: The cells of the online-lever table: model key -> (model, training trace, held-out trace).
MIXTRAL_DIR = "../shared/reference-traces/mixtral"
ONLINE_MODELS = {
    "ds": ("deepseek-v2-lite", "synthetic", None),
    "qwen": ("qwen2-57b-a14b", "synthetic", None),
    "mix": ("mixtral-8x7b", f"{MIXTRAL_DIR}/experts_reasoning_mixtral.json",
            f"{MIXTRAL_DIR}/experts_stem_mixtral.json"),
}
ONLINE_SETTINGS = ("5/50", "10/25")
ONLINE_BATCHES = (32, 128)
#: Mean top-1 retention targets of the gating lever (the other levers never gate).
GATING_TARGETS = (0.99, 0.95, 0.90)
AGGREGATOR_RULES = ("uniform", "ref", "first")


def online_levers() -> dict[str, tuple[list[Any], Any]]:
    """Return ``{lever: (grid points, NoOp point)}`` of the online levers of HdMoE-v0.

    Every lever varies alone; the others stay at NoOp (gating off, no pre-broadcast) except
    where the lever needs one (dispatch acts on broadcast experts' tokens):

    * ``prebroadcast``: k_b ∈ {0, the budget rule, 1, 2, 4, 8} slots, least-loaded dispatch;
    * ``dispatch``: the rules least_loaded, first, home at the budget rule's k_b
      (``dispatch@kb4``: at 4 forced slots); NoOp = ``first`` (no load information);
    * ``gating``: levels 0 … 32 × protect-top 0, 1, 2 (k_b = 0);
    * ``all``: the union of a joint grid (levels 0, 1, 8, 32 × protect-top 0, 1 × least-loaded
      dispatch × k_b 0, budget, 2) and the points above.
    """
    from agents.tuned import KnobGrid, TunedKnobs

    off = TunedKnobs(gating_level=0.0, k_b=0)
    pre = [TunedKnobs(gating_level=0.0, k_b=kb) for kb in (0, None, 1, 2, 4, 8)]
    disp = [TunedKnobs(gating_level=0.0, k_b=None, dispatch_rule=r)
            for r in ("first", "least_loaded", "home")]
    disp4 = [TunedKnobs(gating_level=0.0, k_b=4, dispatch_rule=r)
             for r in ("first", "least_loaded", "home")]
    gate = KnobGrid(gating_levels=(0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0),
                    protect_top=(0, 1, 2), dispatch_rules=("least_loaded",), k_b=(0,)).points()
    joint = KnobGrid(gating_levels=(0.0, 1.0, 8.0, 32.0), protect_top=(0, 1),
                     dispatch_rules=("least_loaded",), k_b=(0, None, 2)).points()
    every = list({p.key(): p for p in [*pre, *disp, *disp4, *gate, *joint]}.values())
    return {"prebroadcast": (pre, off), "dispatch": (disp, disp[0]),
            "dispatch@kb4": (disp4, disp4[0]), "gating": (gate, off), "all": (every, off)}


def _cell_env_kwargs(model: str, setting: str, batch: int, trace: str, eval_trace: str | None,
                     train_steps: int, eval_steps: int) -> tuple[Any, dict[str, Any],
                                                              dict[str, Any]]:
    """Return (config, training env kwargs, held-out env kwargs) of one cell (DES, Node+Link).

    The split of ``hdamoe tune``: a synthetic training trace (trace_seed 0) is held out on
    trace_seed 1000; a real trace on ``eval_trace``. The placement is the bench's ``node_link``
    (quick pipeline, cached), resolved on the training trace.
    """
    import dataclasses

    from hdamoe_env.app import bench
    from hdamoe_env.app.evaluate import HELD_OUT_TRACE_OFFSET
    from hdamoe_env.config.run import RunSpec

    run = RunSpec.resolve(model=model, setting=setting, mesh="4x8", conventions="faithful",
                          batch=batch, trace=trace)
    config = bench.BenchConfig(run=run, steps=train_steps, fidelity="des",
                               env_kwargs={"trace_seed": 0})
    tr, _ = bench.load_bench_trace(config)
    placement, _ = bench.placement_store(config, tr, progress=False).get("node_link")
    train = {**config.env_arguments(), "trace": tr, "placement": placement}
    if eval_trace is not None:
        held_tr, _ = bench.load_bench_trace(config.with_run(trace=eval_trace))
        held = {**train, "trace": held_tr}
    else:
        seed = HELD_OUT_TRACE_OFFSET
        held_cfg = dataclasses.replace(config, env_kwargs={"trace_seed": seed})
        held_tr, _ = bench.load_bench_trace(held_cfg)
        held = {**train, "trace": held_tr, "trace_seed": seed}
    held["steps_per_episode"] = eval_steps
    return config, train, held


def _subset(o: Any, idx: list[int], target: float) -> dict[str, Any]:
    """Fixed TBTs [k] (µs, mean over steps), mean top-1 [k] and the per-layer oracle of a subset.

    The oracle picks per decode step and layer the fastest point of the subset whose top-1
    retention on that layer is ≥ ``target`` (``per_layer_oracle``'s constrained oracle,
    restricted to the subset); ``free_us`` the fastest point whatever its quality (a lower
    bound for every per-layer policy over the subset's actions).
    """
    lat, top1 = o.layer_s[:, idx, :], o.layer_top1[:, idx, :]
    fixed = (lat.sum(axis=2) + o.dense_s).mean(axis=0) * 1e6
    q = top1.mean(axis=(0, 2))
    masked = np.where(top1 >= target, lat, np.inf)
    best = masked.min(axis=1)                                   # [S, L]
    if not np.isfinite(best).all():
        best = np.where(np.isfinite(best), best, lat.min(axis=1))
    return {"fixed_us": fixed, "top1": q,
            "oracle_us": float(((best.sum(axis=1) + o.dense_s) * 1e6).mean()),
            "free_us": float(((lat.min(axis=1).sum(axis=1) + o.dense_s) * 1e6).mean())}


def online_cell(model_key: str, setting: str, batch: int, args: argparse.Namespace
                ) -> dict[str, dict[str, Any]]:
    """Headroom rows of every online lever in one cell; see :func:`online_levers`."""
    from agents.tuned import per_layer_oracle
    from hdamoe_env.app.evaluate import EVAL_SEED_BASE

    model, trace, eval_trace = ONLINE_MODELS[model_key]
    config, train, held = _cell_env_kwargs(model, setting, batch, trace, eval_trace,
                                           args.train_steps, args.eval_steps)
    levers = online_levers()
    points = levers["all"][0]
    keys = [p.key() for p in points]
    train_seeds = list(range(args.train_seeds))
    eval_seeds = [EVAL_SEED_BASE + i for i in range(args.eval_seeds)]
    t0 = time.process_time()
    o_train = per_layer_oracle(train, points, train_seeds, lp_shares=False)
    o_held = per_layer_oracle(held, points, eval_seeds, lp_shares=False)
    if args.out:                          # the per-layer terms, for other subsets later
        from pathlib import Path

        raw = Path(args.out) / "online"
        raw.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(raw / f"{model_key}_{setting.replace('/', '-')}_B{batch}.npz",
                            keys=np.array(keys), train_s=o_train.layer_s,
                            train_top1=o_train.layer_top1, held_s=o_held.layer_s,
                            held_top1=o_held.layer_top1, dense_s=o_held.dense_s)
    rows: dict[str, dict[str, Any]] = {}
    for lever, (pts, noop) in levers.items():
        idx = [keys.index(p.key()) for p in pts]
        targets = GATING_TARGETS if lever in ("gating", "all") else (0.99,)
        for target in targets:
            tr = _subset(o_train, idx, target)
            ho = _subset(o_held, idx, target)
            ok = np.flatnonzero(tr["top1"] >= target)
            pick = int(ok[np.argmin(tr["fixed_us"][ok])])
            name = lever if len(targets) == 1 else f"{lever}@{target:g}"
            rows[name] = {"noop_us": float(ho["fixed_us"][idx.index(keys.index(noop.key()))]),
                          "tuned_us": float(ho["fixed_us"][pick]),
                          "tuned_top1": float(ho["top1"][pick]),
                          "tuned": pts[pick].label(),
                          "oracle_us": ho["oracle_us"], "free_us": ho["free_us"]}
    # the aggregator rule: a convention of the profile, so one env per rule (NoOp knobs)
    off = levers["prebroadcast"][1]
    per_rule_train, per_rule_held = [], []
    conv = config.run.conventions
    for rule in AGGREGATOR_RULES:
        c = conv if rule == conv.aggregator else _with_aggregator(conv, rule)
        per_rule_train.append(per_layer_oracle({**train, "conventions": c}, [off], train_seeds,
                                               lp_shares=False))
        per_rule_held.append(per_layer_oracle({**held, "conventions": c}, [off], eval_seeds,
                                              lp_shares=False))
    lat_tr = np.stack([o.layer_s[:, 0, :] for o in per_rule_train], axis=1)     # [S, R, L]
    lat_ho = np.stack([o.layer_s[:, 0, :] for o in per_rule_held], axis=1)
    dense = per_rule_held[0].dense_s
    fixed_tr = (lat_tr.sum(axis=2) + dense).mean(axis=0)
    fixed_ho = (lat_ho.sum(axis=2) + dense).mean(axis=0) * 1e6
    pick = int(np.argmin(fixed_tr))
    free = float(((lat_ho.min(axis=1).sum(axis=1) + dense) * 1e6).mean())
    rows["aggregator"] = {"noop_us": float(fixed_ho[AGGREGATOR_RULES.index(conv.aggregator)]),
                          "tuned_us": float(fixed_ho[pick]), "tuned_top1": 1.0,
                          "tuned": f"aggregator={AGGREGATOR_RULES[pick]}",
                          "oracle_us": free, "free_us": free}
    cpu = time.process_time() - t0
    pl = held["placement"]
    tp_layers = 0 if pl.allreduce is None else int(np.asarray(pl.allreduce).sum())
    for row in rows.values():
        row["cpu_s"] = cpu
        row["allreduce_layers"] = f"{tp_layers}/{pl.P.shape[0]}"
    return rows


def aggregator_bound_cell(model_key: str, setting: str, batch: int, args: argparse.Namespace
                          ) -> dict[str, Any]:
    """A bound on the per-token aggregator lever of one cell (held-out episodes, NoOp knobs).

    A token's aggregator only decides where its dispatch starts and its combine ends (§6.2):
    the messages' sources, compute, streaming and the non-MoE time do not depend on it. So no
    per-token choice makes a decode step faster than its TBT minus the MoE communication of
    its dispatch-mode layers (``info["t_comm_us"]``, the DES makespans of both phases, i.e.
    communication brought to zero). All-reduce layers (``info["mode"] == "tp"``) pay TP's
    all-reduce, which has no aggregator. Returns the NoOp TBT, the bound and the share of the
    TBT the aggregator could act on at most.
    """
    from agents.base import NoOpAgent
    from hdamoe_env.app.evaluate import EVAL_SEED_BASE
    from hdamoe_env.env.environment import HdMoeEnv

    model, trace, eval_trace = ONLINE_MODELS[model_key]
    _, _, held = _cell_env_kwargs(model, setting, batch, trace, eval_trace, args.train_steps,
                                  args.eval_steps)
    t0 = time.process_time()
    env = HdMoeEnv(**held)
    agent = NoOpAgent.from_env(env)
    tbts, comms = [], []
    for i in range(args.eval_seeds):
        obs, _ = env.reset(seed=EVAL_SEED_BASE + i)
        comm, done = 0.0, False
        while not done:
            obs, _, term, trunc, info = env.step(agent.act(obs))
            if info["mode"] != "tp":          # all-reduce layers: no aggregator to choose
                comm += float(info["t_comm_us"])
            if "tbt_us" in info:
                tbts.append(float(info["tbt_us"]))
                comms.append(comm)
                comm = 0.0
            done = term or trunc
    tbt, comm = float(np.mean(tbts)), float(np.mean(comms))
    return {"noop_us": tbt, "bound_us": tbt - comm, "comm_share": comm / tbt,
            "steps": len(tbts), "cpu_s": time.process_time() - t0}


def run_aggregator_bound(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Run (or resume from ``--out/aggregator.json``) the aggregator bound of every cell."""
    return _run_cells(args, "aggregator.json", lambda name, m, setting, batch, out:
                      aggregator_bound_cell(m, setting, batch, args))


def aggregator_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: per cell the NoOp TBT, the bound and the largest possible headroom."""
    lines = ["| cell | NoOp TBT µs | dispatch-mode MoE communication µs (share) | bound µs | "
             "headroom ≤ | "
             "≥ 10 % possible? |", "|" + "---|" * 6]
    for cell, r in results.items():
        comm = r["noop_us"] - r["bound_us"]
        lines.append(f"| {cell} | {r['noop_us']:.1f} | {comm:.1f} ({100 * r['comm_share']:.1f} "
                     f"%) | {r['bound_us']:.1f} | {100 * r['comm_share']:.1f} % | "
                     f"{'yes' if r['comm_share'] >= 0.10 else 'no'} |")
    return "\n".join(lines)


def _with_aggregator(conv: Any, rule: str) -> Any:
    """Return the conventions ``conv`` with another aggregator rule (a derived profile)."""
    from hdamoe_env.config.run import RunSpec

    return RunSpec.resolve(conventions=f"{conv.name}+aggregator={rule}").conventions



#: Row order and the label of every online lever in the table.
ONLINE_ROWS = (("prebroadcast", "pre-broadcast (k_b)"), ("dispatch", "dispatch rule (k_b budget)"),
               ("dispatch@kb4", "dispatch rule (k_b = 4)"),
               ("gating@0.99", "gating, top-1 ≥ 0.99"), ("gating@0.95", "gating, top-1 ≥ 0.95"),
               ("gating@0.9", "gating, top-1 ≥ 0.90"), ("aggregator", "aggregator rule"),
               ("all@0.99", "all levers, top-1 ≥ 0.99"), ("all@0.95", "all levers, top-1 ≥ 0.95"),
               ("all@0.9", "all levers, top-1 ≥ 0.90"))


def online_cells(args: argparse.Namespace) -> list[tuple[str, str, str, int]]:
    """Return (cell name, model key, setting, B) of the requested online cells."""
    cells = [(f"{m}_{s.replace('/', '-')}_B{b}", m, s, b) for m in ONLINE_MODELS
             for s in ONLINE_SETTINGS for b in ONLINE_BATCHES]
    if args.cells:
        chosen = set(args.cells.split(","))
        cells = [c for c in cells if c[0] in chosen]
    return cells


def _resume_results(args: argparse.Namespace, filename: str
                    ) -> tuple[Path, dict[str, dict[str, dict[str, Any]]]]:
    """``--out/filename`` and the cells already in it, plus those of the ``--merge`` dirs'
    files of the same name (cells run by other processes with ``--cells`` and their own
    ``--out``)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / filename
    results: dict[str, dict[str, dict[str, Any]]] = (
        json.loads(path.read_text()) if path.exists() else {})
    for other in args.merge or ():
        done = Path(other) / filename
        if done.exists():
            for cell, rows in json.loads(done.read_text()).items():
                results.setdefault(cell, rows)
    return path, results


def _run_cells(args: argparse.Namespace, filename: str,
               run_cell: Callable[[str, str, str, int, Path], Any],
               done: Callable[[Any], bool] = lambda row: True) -> dict[str, Any]:
    """Run every requested cell not yet in ``--out/filename`` (resuming; ``done(row)`` False
    re-runs a finished cell), saving the file atomically after each; return all rows.

    ``run_cell(name, model key, setting, batch, out dir)`` computes one cell's row.
    """
    path, results = _resume_results(args, filename)
    for name, m, setting, batch in ([] if args.table_only else online_cells(args)):
        if name in results and done(results[name]):
            continue
        t0, c0 = time.perf_counter(), time.process_time()
        results[name] = run_cell(name, m, setting, batch, path.parent)
        print(f"{name}: {time.perf_counter() - t0:.0f} s wall, "
              f"{time.process_time() - c0:.0f} s CPU", flush=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(path)
    return results


def run_online(args: argparse.Namespace) -> dict[str, dict[str, dict[str, Any]]]:
    """Run (or resume from ``--out/online.json``) every requested cell; return all rows."""
    return _run_cells(args, "online.json",
                      lambda name, m, setting, batch, out: online_cell(m, setting, batch, args))


def online_table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Markdown: per cell and lever NoOp / tuned / oracle µs, ratios and the headroom."""
    lines = ["| cell | lever | NoOp µs | tuned µs (knobs; top-1) | oracle µs | quality-free "
             "bound µs | tuned ÷ NoOp | oracle ÷ tuned | headroom ≥ 10 %? |", "|" + "---|" * 9]
    for cell, rows in results.items():
        for key, label in ONLINE_ROWS:
            r = rows.get(key)
            if r is None:
                continue
            gain = 1.0 - r["oracle_us"] / r["tuned_us"]
            lines.append(f"| {cell} | {label} | {r['noop_us']:.1f} | {r['tuned_us']:.1f} "
                         f"({r['tuned']}; {r['tuned_top1']:.4f}) | {r['oracle_us']:.1f} | "
                         f"{r['free_us']:.1f} | {r['tuned_us'] / r['noop_us']:.4f} | "
                         f"{r['oracle_us'] / r['tuned_us']:.4f} | "
                         f"{'yes' if gain >= 0.10 else 'no'} |")
    return "\n".join(lines)


def online_summary(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Markdown: per lever the range over cells of tuned ÷ NoOp and oracle ÷ tuned."""
    lines = ["| lever | cells | tuned ÷ NoOp (min … max) | oracle ÷ tuned (min … max) | "
             "quality-free bound ÷ tuned (min … max) | largest oracle headroom (cell) | "
             "any cell ≥ 10 %? |", "|" + "---|" * 7]
    for key, label in ONLINE_ROWS:
        rs = [(c, r[key]) for c, r in results.items() if key in r]
        if not rs:
            continue
        tn = [r["tuned_us"] / r["noop_us"] for _, r in rs]
        ot = [r["oracle_us"] / r["tuned_us"] for _, r in rs]
        ft = [r["free_us"] / r["tuned_us"] for _, r in rs]
        worst = int(np.argmin(ot))
        lines.append(f"| {label} | {len(rs)} | {min(tn):.4f} … {max(tn):.4f} | "
                     f"{min(ot):.4f} … {max(ot):.4f} | {min(ft):.4f} … {max(ft):.4f} | "
                     f"{100 * (1 - ot[worst]):.1f} % "
                     f"({rs[worst][0]}) | {'yes' if min(ot) <= 0.90 else 'no'} |")
    return "\n".join(lines)



#: Layers of the placement cells (the first three held-out layers of every model).
PLACE_CELL_LAYERS = "3,7,11"


def run_place_cells(args: argparse.Namespace) -> dict[str, dict[str, dict[str, Any]]]:
    """The placement lever over the 12 cells (synthetic traces; resumes ``--out/place.json``).

    Per cell :func:`run` on ``--layers`` (default :data:`PLACE_CELL_LAYERS`) without the random
    search and the learned policy; returns ``{cell: {method: {latency_us, ratio}}}`` with the
    means over the layers.
    """
    import copy

    def cell(name: str, m: str, setting: str, batch: int, out: Path) -> dict[str, Any]:
        a = copy.copy(args)
        a.model, a.setting, a.batch = ONLINE_MODELS[m][0], setting, batch
        a.layers = args.layers or PLACE_CELL_LAYERS
        a.episodes, a.learn_steps = 0, 0
        a.out = str(out / "place" / name)
        c0 = time.process_time()
        per_layer = run(a)
        methods = next(iter(per_layer.values())).keys()
        row = {k: {"latency_us": float(np.mean([r[k]["latency_us"] for r in per_layer.values()])),
                   "ratio": float(np.mean([r[k]["ratio"] for r in per_layer.values()]))}
               for k in methods}
        if "bound_fixed" in row:
            fixed = [r["bound_fixed"] for r in per_layer.values()]
            row["bound_fixed"].update(solve_s=float(sum(f["solve_s"] for f in fixed)),
                                      gap=float(max(f["gap"] for f in fixed)))
        row["_meta"] = {"layers": a.layers, "cpu_s": time.process_time() - c0}
        return row

    return _run_cells(args, "place.json", cell,
                      lambda row: getattr(args, "bound", "perstep") != "fixed"
                      or "bound_fixed" in row)


def place_cells_table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Markdown: per cell the mean ratio to TP of every placement, the bound and the verdict.

    Headroom over Node+Link (the lever's tuned heuristic), from the mean ratios: at least what
    the best placement found gains over it, at most what the bound leaves (1 − bound ÷
    Node+Link); ≥ 10 % is decided "no" when the bound leaves less, "yes" when a found placement
    gains that much, else "open".
    """
    cols = [(h, k) for h, k in COLUMNS if k not in ("random", "learned")]
    fixed = any("bound_fixed" in row for row in results.values())
    extra = " | fixed-placement bound | MILP CPU s" if fixed else ""
    lines = ["| cell | layers | " + " | ".join(h for h, _ in cols) + extra
             + " | best found ÷ bound | headroom over Node+Link: found … bound | ≥ 10 %? |",
             "|" + "---|" * (len(cols) + 5 + 2 * fixed)]
    for cell, row in results.items():
        best = min(row[k]["ratio"] for k in row if k not in ("bound", "bound_fixed", "_meta"))
        nl, bound = row["node_link"]["ratio"], row["bound"]["ratio"]
        cells = ""
        if fixed:
            fx = row.get("bound_fixed")
            if fx is not None:
                bound = max(bound, fx["ratio"])     # both bounds hold: the larger one
                cells = f" | {fx['ratio']:.3f} | {fx['solve_s']:.0f}"
            else:
                cells = " | – | –"
        lo, hi = max(0.0, 1.0 - best / nl), max(0.0, 1.0 - bound / nl)
        verdict = "yes" if lo >= 0.10 else ("no" if hi < 0.10 else "open")
        lines.append(f"| {cell} | {row['_meta']['layers']} | "
                     + " | ".join(f"{row[k]['ratio']:.3f}" for _, k in cols) + cells
                     + f" | {best / bound:.2f} | {100 * lo:.1f} … {100 * hi:.1f} % "
                     + f"| {verdict} |")
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
    ap.add_argument("--tensorboard", default=None, metavar="DIR",
                    help="TensorBoard log directory of the MaskablePPO run (SB3's tags plus "
                    "latency/total_us, latency/total_over_tp)")
    ap.add_argument("--learn-shaping", type=float, default=0.0,
                    help="shaping_weight of the training env (potential on the peak load)")
    ap.add_argument("--layers", default=None, help="comma-separated layers (default: held-out)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", default="runs/headroom", help="pipeline output directory")
    ap.add_argument("--part", default="placement",
                    choices=("placement", "online", "placement-cells", "aggregator-bound"),
                    help="placement: the placement lever of one cell; online: the online "
                         "levers of HdMoE-v0 over the 12 cells (resumes from --out/online.json); "
                         "placement-cells: the placement lever over the 12 cells (resumes "
                         "from --out/place.json); aggregator-bound: a bound on per-token "
                         "aggregator choice over the 12 cells (resumes --out/aggregator.json)")
    ap.add_argument("--bound", default="perstep", choices=("perstep", "fixed"),
                    help="placement parts: also compute the fixed-placement bound "
                         "(latency_lower_bound(fixed=True), a MILP per layer); placement-cells "
                         "re-runs the cells of --out/place.json that lack it")
    ap.add_argument("--cells", default=None,
                    help="online: comma list of cell names (default all 12, e.g. ds_5-50_B128)")
    ap.add_argument("--merge", nargs="*", default=None, metavar="DIR",
                    help="online: also take the finished cells of these --out directories "
                    "(runs split over processes with --cells)")
    ap.add_argument("--table-only", action="store_true",
                    help="online: print the tables of the finished cells, run nothing")
    ap.add_argument("--train-seeds", type=int, default=2,
                    help="online: training episodes (seeds 0 …) that pick the tuned point")
    ap.add_argument("--train-steps", type=int, default=3,
                    help="online: decode steps per training episode")
    ap.add_argument("--eval-seeds", type=int, default=2,
                    help="online: held-out episodes (seeds 10000 …)")
    ap.add_argument("--eval-steps", type=int, default=4,
                    help="online: decode steps per held-out episode")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.part == "placement-cells":
        res = run_place_cells(args)
        print("\n" + place_cells_table(res))
        print(f"\ntotal {time.perf_counter() - t0:.0f} s")
        return
    if args.part == "aggregator-bound":
        agg = run_aggregator_bound(args)
        print("\n" + aggregator_table(agg))
        print(f"\ntotal {time.perf_counter() - t0:.0f} s")
        return
    if args.part == "online":
        res = run_online(args)
        print("\n" + online_summary(res) + "\n\n" + online_table(res))
        print(f"\ntotal {time.perf_counter() - t0:.0f} s")
        return
    results = run(args)
    print(f"\n{args.model} {args.mesh} {args.setting} B={args.batch} {args.conventions}, "
          f"evaluator {args.evaluator} ({args.score_steps} steps if sampled), seed {args.seed}, "
          f"{args.episodes} random episodes/layer, learn steps {args.learn_steps} (shaping "
          f"{args.learn_shaping}); µs (ratio to TP), lower is better\n")
    print(table(results))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
