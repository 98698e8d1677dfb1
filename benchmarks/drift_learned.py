"""Learned vs tuned vs hindsight oracle on the re-placement lever (``HdMoE-Drift-v1``).

One cell of ``benchmarks/drift_headroom.py``: MaskablePPO (sb3-contrib) trains on the drift env
with ``--seeds`` (each seed its own run; training streams come from the env's generator seeded by
SB3 with that seed), and its deterministic policy is scored on the *held-out* streams
``--heldout-seeds`` beside the tuned heuristic (the best of ``drift_headroom.policy_grid`` on
``--train-seeds`` streams) and ``hindsight_oracle``. Every ``--eval-every`` steps the current
policy is scored on the first three held-out streams (the learning curve). Reported: mean window
ratio to TP (moves included) per method, the learned runs' mean with a 95 % t-interval over the
seeds, and the share of the oracle's headroom over tuned the learned policy captures,
(tuned − learned) / (tuned − oracle).

Writes ``--out/<cell>.json`` (resumes finished seeds) and, with ``--tensorboard DIR``, one
run per seed (``HdMoE-Drift-v1__{model}__{setting}__B{batch}__maskable-ppo__{seed}__{time}_1``)
with SB3's training scalars and ``eval/ratio``.

Run: ``OMP_NUM_THREADS=1 python benchmarks/drift_learned.py --cell mix_5-50_B128
--timesteps 8192 --out runs/drift-learned``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from hdamoe_env.app.records import t_interval
from hdamoe_env.env.drift import (HdMoeDriftEnv, compare_policies, once_policy,
                                  regime_policy)



def _headroom_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "drift_headroom", Path(__file__).with_name("drift_headroom.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_env(cell: str, args: argparse.Namespace) -> HdMoeDriftEnv:
    """The drift env of a ``drift_headroom`` cell name (e.g. ``mix_5-50_B128``)."""
    dh = _headroom_module()
    match = [c for c in dh.cells(None) if c[0] == cell]
    if not match:
        raise SystemExit(f"unknown cell {cell!r}; e.g. {dh.cells(None)[0][0]}")
    _, m, setting, batch = match[0]
    return dh.make_env(m, setting, batch, args)


def policy_ratio(env: HdMoeDriftEnv, model: Any, seeds: list[int]) -> float:
    """Mean window ratio of the deterministic policy on the given streams."""
    ratios = []
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        done = False
        while not done:
            action, _ = model.predict(obs, action_masks=env.action_masks(), deterministic=True)
            obs, _, term, trunc, info = env.step(int(action))
            ratios.append(info["ratio"])
            done = term or trunc
    return float(np.mean(ratios))


def train_seed(cell: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train one MaskablePPO run; return its held-out ratio, curve and timings."""
    import torch
    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.callbacks import BaseCallback

    torch.set_num_threads(1)
    env, eval_env = make_env(cell, args), make_env(cell, args)
    curve: list[tuple[int, float]] = []

    class Curve(BaseCallback):
        def _on_step(self) -> bool:
            if self.num_timesteps % args.eval_every == 0:
                r = policy_ratio(eval_env, self.model, args.heldout_seeds[:3])
                curve.append((int(self.num_timesteps), r))
                self.logger.record("eval/ratio", r)      # in SB3's run, at its next dump
            return True

    model = MaskablePPO("MlpPolicy", env, n_steps=args.n_steps, batch_size=args.batch_size,
                        n_epochs=args.n_epochs, learning_rate=args.lr, gamma=args.gamma,
                        ent_coef=args.ent_coef, seed=seed, device="cpu", verbose=0,
                        tensorboard_log=args.tensorboard)
    t0, c0 = time.perf_counter(), time.process_time()
    run = None
    if args.tensorboard:
        from hdamoe_env.app import tb
        run = tb.run_dir_name("maskable-ppo", seed, env_id="HdMoE-Drift-v1",
                              model=env.model.key, setting=str(env.run.setting),
                              batch=env.batch)
    model.learn(total_timesteps=args.timesteps, callback=Curve(),
                tb_log_name=run or "MaskablePPO")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"heldout": policy_ratio(eval_env, model, args.heldout_seeds), "curve": curve,
            "train_wall_s": wall, "train_cpu_s": cpu, "steps_per_s": args.timesteps / wall}


def references(cell: str, args: argparse.Namespace) -> dict[str, Any]:
    """Static, tuned (picked on the training streams) and the oracle on the held-out streams
    (``drift_headroom.run_cell``)."""
    r = _headroom_module().run_cell(make_env(cell, args), args.train_seeds, args.heldout_seeds,
                                    tuple(args.cooldowns))
    return {k: r[k] for k in ("static", "tuned", "tuned_name", "oracle")}


def causal_references(cell: str, args: argparse.Namespace) -> dict[str, Any]:
    """Non-clairvoyant references, each family's best picked on the training streams
    (``--causal-train-seeds``, default ``--train-seeds``) and scored on the held-out ones.

    ``open-loop``: re-place once at decision j with level r (``once_policy``), every j of the
    episode and every level. ``regime-aware``: ``regime_policy`` (privileged: it reads the
    stream's true current regime) over levels × at most 1, 2 or every window re-placements ×
    delay 0 or 1 window. Neither sees the future, so together they show how much of the
    oracle's headroom a causal policy reaches by timing alone and by perfect regime recognition.
    """
    env = make_env(cell, args)
    levels = len(env.redundancy)
    families = {
        "open-loop": {f"once@{j} r{lvl}": once_policy(j, lvl)
                      for j in range(env.num_windows) for lvl in range(levels)},
        "regime-aware": {f"regime r{lvl} max{n} delay{d}": regime_policy(lvl, n, d)
                         for lvl in range(levels) for n in (1, 2, env.num_windows)
                         for d in (0, 1)},
    }
    out: dict[str, Any] = {}
    for family, grid in families.items():
        train = compare_policies(env, grid, args.causal_train_seeds or args.train_seeds)
        name = min(train, key=lambda k: train[k]["ratio"])
        held = compare_policies(env, {name: grid[name]}, args.heldout_seeds)
        out[family] = {"name": name, "train": train[name]["ratio"],
                       "train_seeds": list(args.causal_train_seeds or args.train_seeds),
                       "heldout": held[name]["ratio"], "candidates": len(grid)}
    return out


def summary(cell: str, res: dict[str, Any]) -> str:
    """Markdown rows: the methods' ratios, the learned interval and the captured headroom."""
    runs = [res["runs"][k] for k in sorted(res["runs"], key=int)]
    vals = np.array([r["heldout"] for r in runs])
    mean, half = t_interval(vals)
    half = float("nan") if half is None else half
    ref = res["references"]
    gap = ref["tuned"] - ref["oracle"]
    captured = [(ref["tuned"] - v) / gap if gap > 0 else float("nan") for v in vals]
    lines = ["| method | held-out window ratio to TP |", "|---|---|",
             f"| static (NoOp) | {ref['static']:.4f} |",
             f"| tuned ({ref['tuned_name']}) | {ref['tuned']:.4f} |",
             f"| hindsight oracle | {ref['oracle']:.4f} |",
             *[f"| best {fam} ({c['name']}; {c['candidates']} candidates) | "
               f"{c['heldout']:.4f} |" for fam, c in res.get("causal", {}).items()],
             "| learned, seeds " + ", ".join(f"{v:.4f}" for v in vals)
             + f" | {mean:.4f} ± {half:.4f} (95 % t) |",
             "", f"{cell}: oracle headroom over tuned "
             f"{max(0.0, 100 * gap / ref['tuned']):.1f} %; the "
             "learned policy captures " + ", ".join(f"{100 * c:.0f} %" for c in captured)
             + " of it per seed (target ≥ 50 %); training "
             + ", ".join(f"{r['steps_per_s']:.0f}" for r in runs) + " steps/s."]
    for fam, c in res.get("causal", {}).items():
        share = (ref["tuned"] - c["heldout"]) / gap if gap > 0 else float("nan")
        lines.append(f"The best {fam} reference captures {100 * share:.0f} %.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run (resuming), print the summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", default="mix_5-50_B128")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--train-seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--heldout-seeds", type=int, nargs="+", default=[100, 101, 102, 103, 104, 105])
    ap.add_argument("--cooldowns", type=int, nargs="*", default=[],
                    help="also tune threshold policies with these cooldowns (windows)")
    ap.add_argument("--timesteps", type=int, default=8192)
    ap.add_argument("--eval-every", type=int, default=1024)
    ap.add_argument("--n-steps", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--n-epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--gamma", type=float, default=0.99)
    ap.add_argument("--ent-coef", type=float, default=0.01)
    _headroom_module().add_stream_arguments(ap)
    ap.add_argument("--causal-refs", action="store_true",
                    help="also score the best open-loop and regime-aware schedules")
    ap.add_argument("--causal-train-seeds", type=int, nargs="+", default=None,
                    help="streams the causal references are picked on (default: --train-seeds)")
    ap.add_argument("--tensorboard", default=None, metavar="DIR")
    ap.add_argument("--out", default="runs/drift-learned")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.cell}.json"
    res: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    res["config"] = {k: v for k, v in vars(args).items()
                     if k not in ("out", "tensorboard", "causal_refs", "causal_train_seeds")}

    def save() -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(path)
    if "references" not in res:
        res["references"] = references(args.cell, args)
        save()
    if args.causal_refs and "causal" not in res:
        res["causal"] = causal_references(args.cell, args)
        save()
    for seed in args.seeds:
        if str(seed) in res["runs"]:
            continue
        res["runs"][str(seed)] = train_seed(args.cell, seed, args)
        print(f"seed {seed}: held-out {res['runs'][str(seed)]['heldout']:.4f}", flush=True)
        save()
    print(summary(args.cell, res))


if __name__ == "__main__":
    main()
