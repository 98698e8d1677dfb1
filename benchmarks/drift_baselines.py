"""Re-placement baselines of the drift env on the same seeds.

Runs the baselines of ``hdamoe_env.env.drift`` on ``hdamoe_env/HdMoE-Drift-v1`` episodes with
the same seeds: static (the reset's offline EPLB, never re-placed), periodic
(``eplb-dynamic@N``: EPLB on the last window every N decode steps, with 0 redundant slots per
node unless ``--redundancy-level``) and threshold-triggered (re-place when the drift statistic,
the TV distance between the window's loads and the placement's build loads, exceeds T).

Printed: a Markdown table with, per policy, the mean reward per window, the mean window latency
as a ratio to TP (weight moves included; lower is better) and without the moves, the moves
per episode and the mean move time per window (µs).

Run: ``OMP_NUM_THREADS=1 python benchmarks/drift_baselines.py --seeds 0 1 2``
(``--regimes categories --model mixtral-8x7b`` for the real Mixtral task categories, read from
``--trace-dir``, default ../shared/reference-traces/mixtral). ``--tensorboard DIR`` also writes
every window's scalars, one run directory per (policy, seed) (docs/TENSORBOARD.md).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from hdamoe_env.env.drift import (DEFAULT_MIXTRAL_DIR, HdMoeDriftEnv, compare_policies,
                                  periodic_policy, static_policy, threshold_policy)


def window_scalars(info: dict[str, Any]) -> dict[str, float]:
    """TensorBoard scalars of one drift-env window (tags of docs/TENSORBOARD.md)."""
    return {"latency/window_us": float(info["window_us"]),
            "latency/tp_window_us": float(info["tp_window_us"]),
            "latency/total_over_tp": float(info["ratio"]),
            "latency/move_us": float(info["move_us"]), "moves/count": float(info["moves"]),
            "moves/energy_uj": float(info["move_energy_uj"]), "drift/tv": float(info["drift"])}


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run the baselines, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--setting", default="5/50")
    ap.add_argument("--mesh", default="4x8")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--regimes", default="synthetic",
                    choices=("synthetic", "categories", "auto"))
    ap.add_argument("--trace-dir", default=DEFAULT_MIXTRAL_DIR)
    ap.add_argument("--window", type=int, default=8, help="decode steps per decision (K)")
    ap.add_argument("--num-windows", type=int, default=16)
    ap.add_argument("--mean-dwell", type=float, default=32.0)
    ap.add_argument("--fidelity", default="analytic", choices=("analytic", "des"))
    ap.add_argument("--periods", type=int, nargs="+", default=[16, 64],
                    help="periodic baselines, decode steps")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.2, 0.3])
    ap.add_argument("--redundancy-level", type=int, default=0,
                    help="index into the env's redundancy levels (0, 1, 2) for re-placements")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--tensorboard", default=None, metavar="DIR",
                    help="write every window's latency scalars under DIR (one run per policy "
                    "and seed)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    env = HdMoeDriftEnv(model=args.model, setting=args.setting, mesh=args.mesh,
                        batch=args.batch, regimes=args.regimes, trace_dir=args.trace_dir,
                        window=args.window, num_windows=args.num_windows,
                        mean_dwell=args.mean_dwell, fidelity=args.fidelity)
    lvl = args.redundancy_level
    policies = {"static": static_policy()}
    policies.update({f"periodic@{n}": periodic_policy(n, lvl) for n in args.periods})
    policies.update({f"threshold>{t:g}": threshold_policy(t, lvl) for t in args.thresholds})
    writers: dict[tuple[str, int], Any] = {}

    def log_window(name: str, seed: int, window: int, info: dict[str, Any]) -> None:
        from hdamoe_env.app import tb

        w = writers.get((name, seed))
        if w is None:
            run = tb.run_dir_name(name, seed, env_id="HdMoE-Drift-v1", model=args.model,
                                  setting=args.setting, batch=args.batch)
            w = writers[(name, seed)] = tb.make_writer(Path(args.tensorboard) / run)
            w.add_text("config", tb.config_markdown({**vars(args), "policy": name,
                                                      "seed": seed}))
        w.add_scalars(window_scalars(info), window)
    res = compare_policies(env, policies, args.seeds,
                           on_step=log_window if args.tensorboard else None)
    for w in writers.values():
        w.close()
    print(f"{args.model} {args.mesh} {args.setting} B={args.batch} {env.regime_source} regimes "
          f"({env.num_regimes}), K={args.window}, {args.num_windows} windows, mean dwell "
          f"{args.mean_dwell:g} steps, {args.fidelity}, profile faithful, seeds {args.seeds}\n")
    print("| policy | reward | window / TP | without moves | moves / episode | move µs / window |")
    print("|---|---|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {r['reward']:.4f} | {r['ratio']:.4f} | {r['ratio_no_moves']:.4f} | "
              f"{r['moves_per_episode']:.1f} | {r['move_us_per_window']:.1f} |")
    print(f"\n({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
