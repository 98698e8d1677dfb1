"""The quality-budget lever (issue 31, item 4): single-scale vs allocator vs knapsack oracle.

Per cell (model, setting, B; 4×8 mesh, ``faithful``, the bench's Node+Link placement resolved on
the training trace, as ``benchmarks/headroom.py --part online``) the quality-budget env
``HdMoE-Quality-v1`` (``hdamoe_env.env.quality``, analytic twin) gives every held-out episode's
table of latency and lost top-1 choices of every gating action at every (decode step, layer)
(``HdMoeQualityEnv.episode_table``). Actions are separable (common random numbers per
position), so every policy's episode is a walk through that table:

* **NoOp**: level 0 everywhere (no gating);
* **single-scale** (the paper's HDA-MoE): one grid action for every layer and step, open-loop
  (no budget masks; the env with target 0 gives the same numbers); its Pareto front is the
  sweep over the grid; at a target, the point with the lowest training TBT whose training
  top-1 meets the target, measured held-out (it may miss the target there: reported);
* **allocator**: ``price_policy(λ)`` inside the env's budget masks (every episode meets its
  target), λ of a grid tuned per target on the training episodes; held-out numbers checked
  against ``run_policy`` on the env itself;
* **oracle**: the exact multiple-choice knapsack per held-out episode
  (``knapsack_oracle``, DP over the integer budget) and its LP relaxation.

Hypervolume of a front (TBT ÷ NoOp, top-1), both to be improved, with the reference point
(TBT ÷ NoOp = 1, top-1 = ``--hv-ref``, default 0.85): the area of the union of the rectangles
[ratio, 1] × [ref, top-1] of its points.

Run: ``OMP_NUM_THREADS=1 python benchmarks/quality_budget.py --out runs/quality_budget``
(resumes from ``--out/quality.json``; ``--cells ds_5-50_B32,...``; ``--table-only``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.env.quality import HdMoeQualityEnv, knapsack_oracle, price_policy, run_policy

MIXTRAL_DIR = "../shared/reference-traces/mixtral"
#: model key -> (model, training trace, held-out trace (None: synthetic trace_seed 1000))
MODELS = {
    "ds": ("deepseek-v2-lite", "synthetic", None),
    "qwen": ("qwen2-57b-a14b", "synthetic", None),
    "mix": ("mixtral-8x7b", f"{MIXTRAL_DIR}/experts_reasoning_mixtral.json",
            f"{MIXTRAL_DIR}/experts_stem_mixtral.json"),
}
SETTINGS = ("5/50", "10/25")
BATCHES = (32, 128)
#: The verdict targets and the targets of the allocator's / oracle's fronts.
TARGETS = (0.99, 0.95, 0.90)
FRONT_TARGETS = (0.995, 0.99, 0.98, 0.97, 0.96, 0.95, 0.94, 0.92, 0.90, 0.875, 0.85)
PRICES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


def cell_kwargs(model: str, setting: str, batch: int, trace: str, eval_trace: str | None,
                conventions: str = "faithful") -> tuple[dict[str, Any], dict[str, Any]]:
    """Return the (training, held-out) ``HdMoE-v1`` arguments of a cell (Node+Link placement).

    The split of ``benchmarks/headroom.py --part online``: a synthetic training trace
    (trace_seed 0) is held out on trace_seed 1000; a real trace on ``eval_trace``.
    """
    from hdamoe_env.app import bench
    from hdamoe_env.app.evaluate import HELD_OUT_TRACE_OFFSET
    from hdamoe_env.config.run import RunSpec

    run = RunSpec.resolve(model=model, setting=setting, mesh="4x8", conventions=conventions,
                          batch=batch, trace=trace)
    config = bench.BenchConfig(run=run, steps=4, fidelity="analytic",
                               env_kwargs={"trace_seed": 0})
    tr, _ = bench.load_bench_trace(config)
    placement, _ = bench.placement_store(config, tr, progress=False).get("node_link")
    train = {**config.env_arguments(), "trace": tr, "placement": placement}
    for key in ("steps_per_episode", "fidelity", "max_broadcast", "predictor"):
        train.pop(key, None)
    if eval_trace is not None:
        held_tr, _ = bench.load_bench_trace(config.with_run(trace=eval_trace))
        held = {**train, "trace": held_tr}
    else:
        held_cfg = dataclasses.replace(config, env_kwargs={"trace_seed": HELD_OUT_TRACE_OFFSET})
        held_tr, _ = bench.load_bench_trace(held_cfg)
        held = {**train, "trace": held_tr, "trace_seed": HELD_OUT_TRACE_OFFSET}
    return train, held


def tables(env: HdMoeQualityEnv, seeds: list[int]
           ) -> list[tuple[NDArray[np.float64], NDArray[np.int64], NDArray[np.float64]]]:
    """Return per episode of ``seeds`` the tables [S, L, A] (latency s charged, lost top-1,
    latency s the env observes): the charged one is the env's fidelity, the observed one the
    analytic twin (the same array under ``analytic``)."""
    out = []
    for seed in seeds:
        env.reset(seed=seed)
        seen, loss = env.episode_table()
        charged = seen if env.fidelity == "analytic" else env.episode_table(env.fidelity)[0]
        out.append((charged, loss, seen))
    return out


def simulate_price(lat: NDArray[np.float64], loss: NDArray[np.int64], budget: int,
                   price: float, batch: int, charged: NDArray[np.float64] | None = None
                   ) -> tuple[float, int]:
    """Return (Σ latency s, lost) of ``price_policy(price)`` under the masks (the env's rule):
    decisions on ``lat`` (what the env observes), latency charged from ``charged`` (default
    ``lat``)."""
    t = lat.reshape(-1, lat.shape[-1])
    c = t if charged is None else charged.reshape(t.shape)
    w = loss.reshape(t.shape)
    remaining, total, lost = budget, 0.0, 0
    for n in range(t.shape[0]):
        score = np.where(w[n] <= remaining, t[n] / t[n, 0] + price * w[n] / batch, np.inf)
        a = int(np.argmin(score))
        total += float(c[n, a])
        remaining -= int(w[n, a])
        lost += int(w[n, a])
    return total, lost


def hypervolume(points: list[tuple[float, float]], ref_top1: float) -> float:
    """Area dominated by (TBT ÷ NoOp, top-1) points w.r.t. (1, ``ref_top1``) (both improve:
    lower ratio, higher top-1)."""
    pts = sorted(((1.0 - r, q - ref_top1) for r, q in points if r < 1.0 and q > ref_top1),
                 reverse=True)
    hv, best = 0.0, 0.0
    for x, y in pts:
        if y > best:
            hv += x * (y - best)
            best = y
    return hv


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The non-dominated (ratio, top-1) points, by ratio."""
    out: list[tuple[float, float]] = []
    for r, q in sorted(points, key=lambda p: (p[0], -p[1])):
        if not out or q > out[-1][1]:
            out.append((r, q))
    return out


def evaluate_cell(model_key: str, setting: str, batch: int, args: argparse.Namespace
                  ) -> dict[str, Any]:
    """All numbers of one cell (module docstring)."""
    model, trace, eval_trace = MODELS[model_key]
    c0 = time.process_time()
    train_kw, held_kw = cell_kwargs(model, setting, batch, trace, eval_trace,
                                    args.conventions)
    train_env = HdMoeQualityEnv(**train_kw, steps_per_episode=args.train_steps, target=0.0,
                                fidelity=args.fidelity)
    held_env = HdMoeQualityEnv(**held_kw, steps_per_episode=args.eval_steps, target=0.0,
                               fidelity=args.fidelity)
    train_seeds = list(range(args.train_seeds))
    held_seeds = [10_000 + i for i in range(args.eval_seeds)]
    tr, ho = tables(train_env, train_seeds), tables(held_env, held_seeds)
    build_s = time.process_time() - c0
    dense = held_env.dense_s
    B, L = batch, held_env.num_layers

    def tbt_us(totals: list[float], steps: int) -> float:
        return float(np.mean([(t / steps + dense) * 1e6 for t in totals]))

    def top1(lost: list[int], steps: int) -> float:
        return 1.0 - float(np.sum(lost)) / (len(lost) * B * L * steps)

    def budget(target: float, steps: int) -> int:
        return int(np.floor((1.0 - target) * B * L * steps + 1e-9))

    names = held_env.action_names
    A = len(names)
    # single scale, open loop
    ss_tr = [(tbt_us([float(t[..., a].sum()) for t, _, _ in tr], args.train_steps),
              top1([int(w[..., a].sum()) for _, w, _ in tr], args.train_steps))
             for a in range(A)]
    ss_ho = [(tbt_us([float(t[..., a].sum()) for t, _, _ in ho], args.eval_steps),
              top1([int(w[..., a].sum()) for _, w, _ in ho], args.eval_steps))
             for a in range(A)]
    noop = ss_ho[0][0]
    out: dict[str, Any] = {"noop_us": noop, "actions": list(names),
                           "single_scale": [{"action": names[a], "tbt_us": ss_ho[a][0],
                                             "top1": ss_ho[a][1]} for a in range(A)],
                           "targets": {}, "front": {"allocator": [], "oracle": []}}
    check = []
    for target in sorted(set(FRONT_TARGETS) | set(TARGETS), reverse=True):
        ok = [a for a in range(A) if ss_tr[a][1] >= target]
        ss_pick = min(ok, key=lambda a: ss_tr[a][0])
        # allocator: λ tuned on training
        tr_b, ho_b = budget(target, args.train_steps), budget(target, args.eval_steps)
        tr_scores = [tbt_us([simulate_price(seen, w, tr_b, p, B, t)[0] for t, w, seen in tr],
                            args.train_steps) for p in PRICES]
        price = PRICES[int(np.argmin(tr_scores))]
        runs = [simulate_price(seen, w, ho_b, price, B, t) for t, w, seen in ho]
        alloc_us = tbt_us([r[0] for r in runs], args.eval_steps)
        alloc_top1 = top1([r[1] for r in runs], args.eval_steps)
        orc = [knapsack_oracle(t, w, ho_b) for t, w, _ in ho]
        orc_us = tbt_us([o.latency_s for o in orc], args.eval_steps)
        lp_us = tbt_us([o.lp_bound_s for o in orc], args.eval_steps)
        orc_top1 = top1([o.lost for o in orc], args.eval_steps)
        out["front"]["allocator"].append([alloc_us / noop, alloc_top1, target])
        out["front"]["oracle"].append([orc_us / noop, orc_top1, target])
        if target in TARGETS:
            ss_us, ss_q = ss_ho[ss_pick]
            tuned = min([alloc_us] + ([ss_us] if ss_q >= target else []))
            out["targets"][f"{target:g}"] = {
                "single_scale": names[ss_pick], "single_scale_us": ss_us,
                "single_scale_top1": ss_q, "price": price, "allocator_us": alloc_us,
                "allocator_top1": alloc_top1, "oracle_us": orc_us, "lp_us": lp_us,
                "oracle_top1": orc_top1, "tuned_us": tuned,
                "free_us": tbt_us([float(t.min(axis=-1).sum()) for t, _, _ in ho],
                                  args.eval_steps)}
            # the same allocator inside the env's API (masks, run_policy)
            env_us = float(np.mean([run_policy(held_env, price_policy(price), s,
                                               options={"target": target},
                                               on_step=tb_logger(args, model, setting, batch,
                                                                 f"allocator@{target:g}", s))
                                    ["tbt_us"] for s in held_seeds]))
            check.append(abs(env_us - alloc_us) / alloc_us)
    # the oracle's whole front: the DP's optimum for every budget b at once (same b in every
    # episode: top-1 ≥ 1 − b / (B·L·S), exact where the front is tight)
    ref = args.hv_ref
    cap = budget(ref, args.eval_steps)
    per_ep = [knapsack_oracle(t, w, cap).front_s for t, w, _ in ho]
    fronts = np.stack([np.pad(f, (0, cap + 1 - f.size), mode="edge") for f in per_ep])
    dense_front = [((fronts[:, b].mean() / args.eval_steps + dense) * 1e6 / noop,
                    1.0 - b / (B * L * args.eval_steps)) for b in range(fronts.shape[1])]
    out["hv_ref_top1"] = ref
    out["hv"] = {"single_scale": hypervolume([(u / noop, q) for u, q in ss_ho], ref),
                 "allocator": hypervolume([(r, q) for r, q, _ in out["front"]["allocator"]],
                                          ref),
                 "oracle": hypervolume(dense_front, ref)}
    out["env_check_max_rel"] = float(max(check))
    out["meta"] = {"fidelity": args.fidelity, "conventions": args.conventions, "train": f"{len(train_seeds)} x {args.train_steps}",
                   "held": f"{len(held_seeds)} x {args.eval_steps}",
                   "tables_cpu_s": build_s, "cpu_s": time.process_time() - c0,
                   "dense_us": dense * 1e6}
    return out


def step_scalars(info: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one env step (``HdMoE-v1``'s ``latency/`` tags)."""
    out = {"latency/total_us": float(info["total_us"]),
           "latency/total_over_tp": float(info["total_us"]) / float(info["tp_total_us"]),
           "latency/ungated_us": float(info["ungated_us"]),
           "quality/lost_top1": float(info["lost"]),
           "quality/remaining_budget": float(info["remaining"])}
    if "tbt_us" in info:
        out["latency/tbt_us"] = float(info["tbt_us"])
    return out


def tb_logger(args: argparse.Namespace, model: str, setting: str, batch: int, method: str,
              seed: int) -> Any:
    """Return ``run_policy``'s ``on_step`` writing one TensorBoard run (None without
    ``--tensorboard``); the run is closed at the episode's last step."""
    if not getattr(args, "tensorboard", None):
        return None
    from hdamoe_env.app import tb

    run = tb.run_dir_name(method, seed, env_id="HdMoE-Quality-v1", model=model,
                          setting=setting, batch=batch)
    writer = tb.make_writer(Path(args.tensorboard) / run)

    def on_step(n: int, info: dict[str, Any]) -> None:
        writer.add_scalars(step_scalars(info), n)
        if "episode_tbt_us" in info:
            writer.close()
    return on_step


def cells(args: argparse.Namespace) -> list[tuple[str, str, str, int]]:
    """(name, model key, setting, B) of the requested cells."""
    out = [(f"{m}_{s.replace('/', '-')}_B{b}", m, s, b) for m in MODELS for s in SETTINGS
           for b in BATCHES]
    if args.cells:
        chosen = args.cells.split(",")
        out = [c for name in chosen for c in out if c[0] == name]
    return out


def verdict_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: per cell and target NoOp / single-scale / allocator / oracle and headroom."""
    lines = ["| cell | target | NoOp µs | single-scale µs (action; held-out top-1) | allocator µs "
             "(λ; top-1) | tuned ÷ NoOp | oracle µs (LP bound) | oracle ÷ tuned | "
             "quality-free µs | headroom ≥ 10 %? |", "|" + "---|" * 10]
    for cell, r in results.items():
        for t, row in r["targets"].items():
            lines.append(
                f"| {cell} | {t} | {r['noop_us']:.1f} | {row['single_scale_us']:.1f} "
                f"({row['single_scale']}; {row['single_scale_top1']:.4f}) | "
                f"{row['allocator_us']:.1f} ({row['price']:g}; {row['allocator_top1']:.4f}) | "
                f"{row['tuned_us'] / r['noop_us']:.4f} | {row['oracle_us']:.1f} "
                f"({row['lp_us']:.1f}) | {row['oracle_us'] / row['tuned_us']:.4f} | "
                f"{row['free_us']:.1f} | "
                f"{'yes' if row['oracle_us'] / row['tuned_us'] <= 0.90 else 'no'} |")
    return "\n".join(lines)


def hv_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: hypervolume of the three fronts per cell."""
    lines = ["| cell | HV single-scale | HV allocator | HV oracle | allocator ÷ single-scale | "
             "oracle ÷ allocator | CPU s |", "|" + "---|" * 7]
    for cell, r in results.items():
        hv = r["hv"]
        ratio = (f"{hv['allocator'] / hv['single_scale']:.2f}" if hv["single_scale"] > 0
                 else "n/a")
        ratio2 = f"{hv['oracle'] / hv['allocator']:.2f}" if hv["allocator"] > 0 else "n/a"
        lines.append(f"| {cell} | {hv['single_scale']:.5f} | {hv['allocator']:.5f} | "
                     f"{hv['oracle']:.5f} | {ratio} | {ratio2} | {r['meta']['cpu_s']:.0f} |")
    return "\n".join(lines)


def summary(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: per target the range over cells (the verdict row)."""
    lines = ["| target | cells | tuned ÷ NoOp (min … max) | allocator ÷ single-scale (min … "
             "max) | oracle ÷ tuned (min … max) | largest oracle headroom (cell) | "
             "quality-free ÷ tuned (min) | ≥ 10 %? |", "|" + "---|" * 8]
    for target in TARGETS:
        key = f"{target:g}"
        rs = [(c, r["targets"][key], r["noop_us"]) for c, r in results.items()
              if key in r["targets"]]
        if not rs:
            continue
        tn = [row["tuned_us"] / n for _, row, n in rs]
        ot = [row["oracle_us"] / row["tuned_us"] for _, row, _ in rs]
        ft = [row["free_us"] / row["tuned_us"] for _, row, _ in rs]
        av = [row["allocator_us"] / row["single_scale_us"] for _, row, _ in rs]
        worst = int(np.argmin(ot))
        lines.append(f"| {target:g} | {len(rs)} | {min(tn):.4f} … {max(tn):.4f} | "
                     f"{min(av):.4f} … {max(av):.4f} | "
                     f"{min(ot):.4f} … {max(ot):.4f} | {100 * (1 - ot[worst]):.1f} % "
                     f"({rs[worst][0]}) | {min(ft):.4f} | "
                     f"{'yes' if min(ot) <= 0.90 else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    """Run (or resume) the requested cells; print the tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/quality_budget")
    ap.add_argument("--cells", default=None, help="comma list, e.g. ds_5-50_B32 (default all)")
    ap.add_argument("--train-seeds", type=int, default=4)
    ap.add_argument("--train-steps", type=int, default=4)
    ap.add_argument("--eval-seeds", type=int, default=4)
    ap.add_argument("--eval-steps", type=int, default=4)
    ap.add_argument("--hv-ref", type=float, default=0.85,
                    help="top-1 of the hypervolume reference point (TBT ÷ NoOp = 1)")
    ap.add_argument("--fidelity", default="analytic", choices=("analytic", "des"),
                    help="the latency charged (decisions always see the analytic twin)")
    ap.add_argument("--conventions", default="faithful", help="profile (default faithful)")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--tensorboard", default=None, metavar="DIR",
                    help="write every held-out allocator episode's step scalars under DIR "
                    "(one run per target and seed)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "quality.json"
    results: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.exists() else {}
    for name, m, setting, batch in ([] if args.table_only else cells(args)):
        if name in results:
            continue
        t0 = time.perf_counter()
        results[name] = evaluate_cell(m, setting, batch, args)
        print(f"{name}: {time.perf_counter() - t0:.0f} s wall, "
              f"{results[name]['meta']['cpu_s']:.0f} s CPU, env check "
              f"{results[name]['env_check_max_rel']:.1e}", flush=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(path)
    print("\n" + summary(results) + "\n\n" + verdict_table(results) + "\n\n"
          + hv_table(results))


if __name__ == "__main__":
    main()
