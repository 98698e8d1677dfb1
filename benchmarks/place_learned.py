"""Learned vs tuned vs bound on the placement lever (``HdMoE-Place-v1``; issue 31, item 5).

For one or more cells of ``benchmarks/headroom.py`` (names like ``ds_10-25_B128``; synthetic
traces, the placement env's evaluator ``--evaluator`` on ``--score-steps`` sampled decode steps):

* **references** on the held-out layers (``heldout_layers``: every 4th layer) of trace seed
  ``--seed``, scored on fresh streams (``eval_seed = seed + 1000``), computed by
  ``headroom.run`` (its cached pipeline under ``--pipeline-out/<cell>``): TP, NoOp (EP),
  Node+Link (the tuned heuristic, quick budget), greedy (``greedy_balance``, the best pattern
  size per layer chosen on the search streams ``eval_seed = seed``) and the bound
  (``HdMoePlaceEnv.latency_lower_bound``);
* **behaviour cloning** from the greedy: on every (trace, layer) of the training split
  (``--trace-seeds``; the env's streams ``eval_seed = seed``) the greedy of the best size is
  replayed and its (observation, action, mask) pairs recorded; MaskablePPO's policy is
  pre-trained on them for ``--bc-epochs`` epochs of masked cross-entropy on its action logits
  (through ``model.policy.get_distribution``), its value head on the episodes' returns;
* **PPO fine-tuning** of that policy for ``--timesteps`` steps on the training split (γ = 1:
  the reward is paid at the episode's end), one run per ``--seeds`` seed; every
  ``--eval-every`` steps the deterministic policy places every held-out layer and is scored
  on the fresh streams (the learning curve; step 0 is the BC-only policy);
* optionally **from scratch** (``--scratch-seeds``): the same PPO without BC.

Reported per cell: per held-out layer and mean the ratio to TP of every method, the learned
runs' mean with a 95 % t-interval over the seeds, and per seed the share of the headroom it
captures, (Node+Link − learned) / (Node+Link − bound). With the bound in the denominator this
share is a LOWER bound on the share of the true headroom (the optimum lies somewhere between
the bound and the best placement found).

Output (``--out``, default ``runs/place-learned``): ``config.json``, ``results.jsonl`` (one
``references`` record per cell, one ``run`` record per cell × variant × seed; finished ones
are skipped with ``--resume``), ``summary.md`` and ``curves.png`` (matplotlib, if installed).
A non-empty ``--out`` is refused without ``--resume``, and with it when its ``config.json``
differs in an option that changes results. ``--tensorboard DIR``: one SB3 run per seed with
``eval/ratio``. Bad options: one line on stderr, exit 2.

Run: ``OMP_NUM_THREADS=1 python benchmarks/place_learned.py --cells ds_10-25_B128,ds_5-50_B128
--timesteps 65536 --out runs/place-learned``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from hdamoe_env.app.records import t_interval
from hdamoe_env.config.errors import ConfigError, HdMoeError, OutputPathError
from hdamoe_env.env.place import PLACE_EVALUATORS, HdMoePlaceEnv, greedy_balance

#: Reference methods of the table: (header, key of ``headroom.run``'s rows).
REFERENCES = (("NoOp (EP)", "ep"), ("TP", "tp"), ("Node+Link", "node_link"),
              ("greedy", "greedy"), ("bound", "bound"))
#: Options that do not change results (may differ on ``--resume``).
NEUTRAL = ("out", "resume", "tensorboard", "cells", "seeds", "scratch_seeds", "figure",
           "pipeline_out", "workers")
SYNTHETIC_MODELS = {"ds": "deepseek-v2-lite", "qwen": "qwen2-57b-a14b", "mix": "mixtral-8x7b"}


def _headroom_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "headroom", Path(__file__).with_name("headroom.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_cell(cell: str) -> tuple[str, str, int]:
    """Return (model, setting, batch) of a cell name like ``ds_10-25_B128``.

    Raises:
        ConfigError: Not of the form ``{ds,qwen,mix}_<a>-<b>_B<batch>``.
    """
    parts = cell.split("_")
    try:
        m, setting, b = parts
        if m not in SYNTHETIC_MODELS or not b.startswith("B") or "-" not in setting:
            raise ValueError
        batch = int(b[1:])
        lo, hi = setting.split("-")
        float(lo), float(hi)
    except ValueError:
        raise ConfigError(f"cell {cell!r}: expected <model>_<setting>_B<batch> with model in "
                          f"{sorted(SYNTHETIC_MODELS)}, e.g. ds_10-25_B128") from None
    return SYNTHETIC_MODELS[m], setting.replace("-", "/"), batch


def make_env(cell: str, args: argparse.Namespace, *, split: str, eval_seed: int,
             trace_seeds: tuple[int, ...]) -> HdMoePlaceEnv:
    """The placement env of a cell (the evaluator of the table, no shaping)."""
    model, setting, batch = parse_cell(cell)
    return HdMoePlaceEnv(model=model, setting=setting, mesh=args.mesh,
                         conventions=args.conventions, batch=batch, trace_seeds=trace_seeds,
                         split=split, evaluator=args.evaluator, score_steps=args.score_steps,
                         eval_seed=eval_seed, shaping_weight=args.shaping,
                         pattern_features=args.pattern_features)


def heldout_env(cell: str, args: argparse.Namespace) -> HdMoePlaceEnv:
    """Held-out layers of trace ``--seed``, fresh streams (``eval_seed = seed + 1000``)."""
    return make_env(cell, args, split="heldout", eval_seed=args.seed + 1000,
                    trace_seeds=(args.seed,))


def references(cell: str, args: argparse.Namespace) -> dict[str, Any]:
    """TP, EP, Node+Link, greedy and the bound per held-out layer (``headroom.run``)."""
    model, setting, batch = parse_cell(cell)
    layers = heldout_env(cell, args).layers
    a = argparse.Namespace(model=model, setting=setting, mesh=args.mesh, batch=batch,
                           conventions=args.conventions, evaluator=args.evaluator,
                           score_steps=args.score_steps, seed=args.seed, episodes=0,
                           learn_steps=0, layers=",".join(str(x) for x in layers),
                           out=str(Path(args.pipeline_out) / cell), workers=args.workers)
    rows = _headroom_module().run(a)
    return {str(layer): {k: float(rows[layer][k]["ratio"]) for _, k in REFERENCES}
            for layer in layers}


def policy_ratios(env: HdMoePlaceEnv, model: Any) -> dict[str, float]:
    """Ratio to TP of the deterministic policy's placement of every layer of ``env``."""
    out = {}
    for layer in env.layers:
        obs, _ = env.reset(options={"layer": layer, "trace_index": 0})
        done = False
        info: dict[str, Any] = {}
        while not done:
            action, _ = model.predict(obs, action_masks=env.action_masks(), deterministic=True)
            obs, _, done, _, info = env.step(int(action))
        out[str(layer)] = float(info["ratio"])
    return out


def greedy_demonstrations(env: HdMoePlaceEnv) -> dict[str, Any]:
    """(obs, action, mask, return) of the best-size greedy on every episode of ``env``'s split.

    Per (trace, layer) every pattern size's ``greedy_balance`` is played on the env's streams;
    the best one is replayed and its states recorded. The return of every state is the
    episode's reward, −ratio (γ = 1, no shaping in the demonstrations).
    """
    sizes = sorted(set(env.patterns.sum(axis=1).tolist()))
    obs_list: list[dict[str, np.ndarray]] = []
    actions: list[int] = []
    masks: list[np.ndarray] = []
    returns: list[float] = []
    for t_idx, layer in env.episodes:
        plays = [greedy_balance(env, s, layer=layer, trace_index=t_idx) for s in sizes]
        best = min(plays, key=lambda g: g.best_ratio)
        obs, _ = env.reset(options={"layer": layer, "trace_index": t_idx})
        for a in best.best_actions:
            obs_list.append(obs)
            masks.append(env.action_masks())
            actions.append(a)
            obs, *_ = env.step(a)
        returns.extend([-best.best_ratio] * len(best.best_actions))
    return {"obs": {k: np.stack([o[k] for o in obs_list]) for k in obs_list[0]},
            "actions": np.array(actions, dtype=np.int64), "masks": np.stack(masks),
            "returns": np.array(returns, dtype=np.float32)}


def behaviour_clone(model: Any, demos: dict[str, Any], *, epochs: int, lr: float,
                    batch_size: int, rng: np.random.Generator) -> dict[str, float]:
    """Pre-train ``model.policy`` on the demonstrations; return loss and argmax accuracy.

    Masked cross-entropy of the greedy's actions under the policy's distribution, plus the
    mean squared error of the value head against the demonstrations' returns.
    """
    import torch

    policy = model.policy
    policy.set_training_mode(True)
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    n = demos["actions"].size
    obs_t, _ = policy.obs_to_tensor(demos["obs"])
    act_t = torch.as_tensor(demos["actions"])
    ret_t = torch.as_tensor(demos["returns"])
    loss_v = float("nan")
    for _ in range(epochs):
        for idx in np.array_split(rng.permutation(n), max(1, n // batch_size)):
            sub = {k: v[idx] for k, v in obs_t.items()}
            dist = policy.get_distribution(sub, action_masks=demos["masks"][idx])
            values = policy.predict_values(sub).flatten()
            loss = (-dist.log_prob(act_t[idx]).mean()
                    + torch.nn.functional.mse_loss(values, ret_t[idx]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_v = float(loss.detach())
    policy.set_training_mode(False)
    return {"bc_loss": loss_v, "bc_accuracy": bc_accuracy(model, demos)}


def bc_accuracy(model: Any, demos: dict[str, Any]) -> float:
    """Share of the demonstrations' states where the policy's masked argmax is the greedy's."""
    import torch

    with torch.no_grad():
        obs_t, _ = model.policy.obs_to_tensor(demos["obs"])
        dist = model.policy.get_distribution(obs_t, action_masks=demos["masks"])
        pred = dist.distribution.probs.argmax(dim=1).numpy()
    return float(np.mean(pred == demos["actions"]))


def train_seed(cell: str, seed: int, variant: str, args: argparse.Namespace,
               demos: dict[str, Any] | None) -> dict[str, Any]:
    """One MaskablePPO run (``bc+ppo`` or ``scratch``); its held-out ratios and curve."""
    import torch
    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.callbacks import BaseCallback

    torch.set_num_threads(1)
    train_env = make_env(cell, args, split="train", eval_seed=args.seed,
                         trace_seeds=tuple(args.trace_seeds))
    eval_env = heldout_env(cell, args)
    curve: list[tuple[int, float]] = []

    class Curve(BaseCallback):
        def _on_step(self) -> bool:
            if self.num_timesteps % args.eval_every == 0:
                r = float(np.mean(list(policy_ratios(eval_env, self.model).values())))
                curve.append((int(self.num_timesteps), r))
                self.logger.record("eval/ratio", r)
            return True

    arch = [int(v) for v in args.net_arch.split(",")]
    model = MaskablePPO("MultiInputPolicy", train_env, n_steps=args.n_steps,
                        batch_size=args.batch_size, n_epochs=args.n_epochs,
                        learning_rate=args.lr, gamma=1.0, gae_lambda=args.gae_lambda,
                        clip_range=args.clip_range, ent_coef=args.ent_coef,
                        target_kl=args.target_kl, policy_kwargs={"net_arch": arch},
                        seed=seed, device="cpu", verbose=0, tensorboard_log=args.tensorboard)
    t0, c0 = time.perf_counter(), time.process_time()
    rec: dict[str, Any] = {"kind": "run", "cell": cell, "variant": variant, "seed": seed}
    if demos is not None:
        rec.update(behaviour_clone(model, demos, epochs=args.bc_epochs, lr=args.bc_lr,
                                   batch_size=args.bc_batch, rng=np.random.default_rng(seed)))
        rec["bc_cpu_s"] = time.process_time() - c0
    start = policy_ratios(eval_env, model)
    rec["start"] = start
    curve.append((0, float(np.mean(list(start.values())))))
    run_name = "MaskablePPO"
    if args.tensorboard:
        from hdamoe_env.app import tb
        run_name = tb.run_dir_name(f"maskable-ppo-{variant}", seed, env_id="HdMoE-Place-v1",
                                   model=train_env.model.key,
                                   setting=str(train_env.run.setting), batch=train_env.batch)
    c1, t1 = time.process_time(), time.perf_counter()
    if args.timesteps > 0:
        model.learn(total_timesteps=args.timesteps, callback=Curve(), tb_log_name=run_name)
    rec.update(final=policy_ratios(eval_env, model), curve=curve,
               ppo_cpu_s=time.process_time() - c1, ppo_wall_s=time.perf_counter() - t1,
               train_cpu_s=time.process_time() - c0, train_wall_s=time.perf_counter() - t0,
               timesteps=args.timesteps, n_steps=args.n_steps)
    return rec


def summary(cell: str, ref: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """Markdown: per held-out layer every method's ratio to TP, the learned interval and the
    share of the bound-measured headroom captured per seed."""
    layers = list(ref)
    by = {v: sorted([r for r in runs if r["variant"] == v], key=lambda r: r["seed"])
          for v in ("bc+ppo", "scratch")}
    cols = [(h, {lay: ref[lay][k] for lay in layers}) for h, k in REFERENCES]
    if by["bc+ppo"]:
        cols.append(("BC only (seed mean)", {lay: float(np.mean(
            [r["start"][lay] for r in by["bc+ppo"]])) for lay in layers}))
        cols.append(("BC + PPO (seed mean)", {lay: float(np.mean(
            [r["final"][lay] for r in by["bc+ppo"]])) for lay in layers}))
    if by["scratch"]:
        cols.append(("scratch (seed mean)", {lay: float(np.mean(
            [r["final"][lay] for r in by["scratch"]])) for lay in layers}))
    lines = ["| layer | " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for lay in layers:
        lines.append(f"| {lay} | " + " | ".join(f"{c[lay]:.4f}" for _, c in cols) + " |")
    means = {h: float(np.mean(list(c.values()))) for h, c in cols}
    lines.append("| mean | " + " | ".join(f"{means[h]:.4f}" for h, _ in cols) + " |")
    nl, bound = means["Node+Link"], means["bound"]
    greedy = means["greedy"]
    lines += ["", "| policy | seeds | mean ratio per seed | mean ± 95 % t | share of the "
              "headroom over Node+Link captured, per seed (≥ : bound denominator) | "
              "vs greedy | steps | PPO CPU s per seed |", "|---|---|---|---|---|---|---|---|"]
    rows = []
    if by["bc+ppo"]:
        rows.append(("BC only", by["bc+ppo"], "start", None))
        rows.append(("BC + PPO", by["bc+ppo"], "final", "ppo_cpu_s"))
    if by["scratch"]:
        rows.append(("scratch PPO", by["scratch"], "final", "ppo_cpu_s"))
    for name, rs, key, cpu in rows:
        vals = [float(np.mean([r[key][lay] for lay in layers])) for r in rs]
        m, h = t_interval(vals)
        h = float("nan") if h is None else h
        share = [(nl - v) / (nl - bound) for v in vals]
        steps = "0" if key == "start" else str(rs[0]["timesteps"])
        lines.append(f"| {name} | {', '.join(str(r['seed']) for r in rs)} | "
                     + ", ".join(f"{v:.4f}" for v in vals) + f" | {m:.4f} ± {h:.4f} | "
                     + ", ".join(f"≥ {100 * s:.1f} %" for s in share)
                     + f" | {m - greedy:+.4f} | {steps} | "
                     + (", ".join(f"{r[cpu]:.0f}" for r in rs) if cpu else "—") + " |")
    curved = [r for v in ("bc+ppo", "scratch") for r in by[v]]
    if curved:
        steps = [s for s, _ in curved[0]["curve"]]
        lines += ["", "Learning curves (mean held-out ratio to TP, deterministic policy; step 0 "
                  "= after BC, or the untrained policy from scratch; the point at step s is "
                  f"evaluated while the rollout ending at s is collected, i.e. after the updates "
                  f"on the first s − {curved[0].get('n_steps', 2048)} steps; final = after the "
                  "last update):", "",
                  "| run, seed | " + " | ".join(f"{s / 1024:g}k" for s in steps) + " | final |",
                  "|" + "---|" * (len(steps) + 2)]
        for r in curved:
            vals = dict(r["curve"])
            lines.append(f"| {r['variant']}, {r['seed']} | "
                         + " | ".join(f"{vals[s]:.3f}" if s in vals else "—" for s in steps)
                         + f" | {np.mean(list(r['final'].values())):.3f} |")
    lines += ["", f"{cell}: Node+Link {nl:.4f}, greedy {greedy:.4f}, bound {bound:.4f} × TP "
              f"(mean over held-out layers {', '.join(layers)}); the bound leaves at most "
              f"{100 * (1 - bound / nl):.1f} % below Node+Link, the greedy finds "
              f"{100 * (1 - greedy / nl):.1f} %. Target: ≥ 50 % of the headroom captured."]
    return "\n".join(lines)


def plot_curves(records: list[dict[str, Any]], refs: dict[str, dict[str, Any]],
                path: Path) -> bool:
    """Learning curves (mean held-out ratio vs steps) per cell; False without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    cells = list(refs)
    fig = Figure(figsize=(5.0 * len(cells), 3.6))
    for i, cell in enumerate(cells):
        ax = fig.add_subplot(1, len(cells), i + 1)
        for r in records:
            if r["cell"] != cell:
                continue
            x, y = zip(*r["curve"], strict=True)
            ax.plot(x, y, "-" if r["variant"] == "bc+ppo" else ":", marker=".",
                    label=f"{r['variant']} seed {r['seed']}")
        for (label, key), style in zip((("Node+Link", "node_link"), ("greedy", "greedy"),
                                        ("bound", "bound")), ("--", "-.", ":"), strict=True):
            ax.axhline(float(np.mean([v[key] for v in refs[cell].values()])), color="k",
                       linestyle=style, linewidth=0.8, label=label)
        bc = [v for r in records if r["cell"] == cell and r["variant"] == "bc+ppo"
              for _, v in r["curve"]]
        if bc:            # zoom on the BC runs; a from-scratch run far above is noted
            low = float(np.mean([v["bound"] for v in refs[cell].values()]))
            top = max(max(bc), 1.0) + 0.05
            ax.set_ylim(low - 0.05, top)
            for r in records:
                if r["cell"] == cell and r["variant"] == "scratch" and max(
                        v for _, v in r["curve"]) > top:
                    ax.text(0.02, 0.97, f"scratch seed {r['seed']}: {r['curve'][0][1]:.2f} → "
                            f"{r['curve'][-1][1]:.2f} (above the axis)", transform=ax.transAxes,
                            fontsize=7, va="top")
        ax.set_title(cell)
        ax.set_xlabel("PPO env steps (0 = BC only)")
        ax.set_ylabel("held-out mean latency / TP")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    return True


def load_records(path: Path) -> list[dict[str, Any]]:
    """The records of ``results.jsonl`` (none if absent)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_out(out: Path, config: dict[str, Any], resume: bool) -> None:
    """Refuse a non-empty ``out`` without ``resume``, or one whose config differs.

    Raises:
        OutputPathError: As above.
    """
    if not out.exists() or not any(out.iterdir()):
        return
    cfg = out / "config.json"
    if not resume:
        raise OutputPathError(f"--out {str(out)!r} is not empty; pass --resume to continue a "
                              "place_learned run there, or use a new directory")
    if not cfg.exists():
        raise OutputPathError(f"--out {str(out)!r} is not a place_learned output (no "
                              "config.json); use a new directory")
    old = json.loads(cfg.read_text())
    diff = sorted(k for k in set(old) | set(config) if k not in NEUTRAL
                  and old.get(k) != config.get(k))
    if diff:
        raise OutputPathError(f"--out {str(out)!r} was run with other options ({', '.join(diff)}"
                              "); use a new directory")


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors raise ``ConfigError`` (one line in :func:`main`)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options (see the module docstring)."""
    ap = _Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="ds_10-25_B128",
                    help="comma list of cells, e.g. ds_10-25_B128,ds_5-50_B128")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--scratch-seeds", type=int, nargs="*", default=[],
                    help="also train from scratch (no BC) with these seeds")
    ap.add_argument("--seed", type=int, default=0,
                    help="trace seed of the held-out layers; search streams eval_seed = seed, "
                    "fresh scoring streams seed + 1000")
    ap.add_argument("--trace-seeds", type=int, nargs="+", default=[0, 1, 2],
                    help="trace seeds of the training layers")
    ap.add_argument("--mesh", default="4x8")
    ap.add_argument("--conventions", default="faithful")
    ap.add_argument("--evaluator", default="des")
    ap.add_argument("--score-steps", type=int, default=8)
    ap.add_argument("--pattern-features", action=argparse.BooleanOptionalAction, default=True,
                    help="the env's optional pattern_peak observation (greedy_balance's "
                    "criterion per action)")
    ap.add_argument("--shaping", type=float, default=0.0,
                    help="shaping_weight of the training env")
    ap.add_argument("--timesteps", type=int, default=65536, help="PPO steps per seed (0: BC only)")
    ap.add_argument("--eval-every", type=int, default=4096)
    ap.add_argument("--bc-epochs", type=int, default=100)
    ap.add_argument("--bc-lr", type=float, default=1e-3)
    ap.add_argument("--bc-batch", type=int, default=256)
    ap.add_argument("--net-arch", default="256,256", help="hidden layers of policy and value")
    ap.add_argument("--n-steps", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--n-epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--gae-lambda", type=float, default=0.95)
    ap.add_argument("--clip-range", type=float, default=0.1)
    ap.add_argument("--ent-coef", type=float, default=0.0)
    ap.add_argument("--target-kl", type=float, default=0.02)
    ap.add_argument("--pipeline-out", default="runs/headroom3/place",
                    help="Node+Link pipeline cache; one directory per cell under it")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--tensorboard", default=None, metavar="DIR")
    ap.add_argument("--figure", default=None, help="learning curves PNG (default OUT/curves.png)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run in --out (finished records are kept)")
    ap.add_argument("--out", default="runs/place-learned")
    args = ap.parse_args(argv)
    for name in ("timesteps", "bc_epochs"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("eval_every", "n_steps", "batch_size", "n_epochs", "bc_batch", "score_steps"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.evaluator not in PLACE_EVALUATORS:
        raise ConfigError(f"--evaluator {args.evaluator!r}; expected one of "
                          f"{list(PLACE_EVALUATORS)}")
    try:
        if any(int(v) < 1 for v in args.net_arch.split(",")):
            raise ValueError
    except ValueError:
        raise ConfigError(f"--net-arch {args.net_arch!r}: expected positive integers, e.g. "
                          "256,256") from None
    for cell in args.cells.split(","):
        parse_cell(cell)
    return args


def run(args: argparse.Namespace) -> str:
    """Run (resuming in ``--out``), write the summary and the figure; return the summary."""
    out = Path(args.out)
    config = {k: v for k, v in vars(args).items()}
    check_out(out, config, args.resume)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    path = out / "results.jsonl"
    records = load_records(path)

    def append(rec: dict[str, Any]) -> None:
        records.append(rec)
        with path.open("a") as fh:
            fh.write(json.dumps(rec) + "\n")

    cells = args.cells.split(",")
    for cell in cells:
        if not any(r["kind"] == "references" and r["cell"] == cell for r in records):
            t0 = time.perf_counter()
            append({"kind": "references", "cell": cell, "layers": references(cell, args)})
            print(f"{cell}: references {time.perf_counter() - t0:.0f} s", flush=True)
        done = {(r["variant"], r["seed"]) for r in records
                if r["kind"] == "run" and r["cell"] == cell}
        todo = [("bc+ppo", s) for s in args.seeds] + [("scratch", s) for s in args.scratch_seeds]
        todo = [t for t in todo if t not in done]
        demos = None
        if any(v == "bc+ppo" for v, _ in todo):
            t0 = time.process_time()
            demos = greedy_demonstrations(make_env(cell, args, split="train",
                                                   eval_seed=args.seed,
                                                   trace_seeds=tuple(args.trace_seeds)))
            print(f"{cell}: {demos['actions'].size} greedy states, "
                  f"{time.process_time() - t0:.0f} s CPU", flush=True)
        for variant, seed in todo:
            rec = train_seed(cell, seed, variant, args, demos if variant == "bc+ppo" else None)
            append(rec)
            print(f"{cell} {variant} seed {seed}: start "
                  f"{np.mean(list(rec['start'].values())):.4f}, final "
                  f"{np.mean(list(rec['final'].values())):.4f}, "
                  f"{rec['train_cpu_s']:.0f} s CPU", flush=True)
    refs = {r["cell"]: r["layers"] for r in records if r["kind"] == "references"
            and r["cell"] in cells}
    runs = [r for r in records if r["kind"] == "run" and r["cell"] in cells]
    text = "\n\n".join(summary(c, refs[c], [r for r in runs if r["cell"] == c]) for c in cells)
    (out / "summary.md").write_text(text + "\n")
    plot_curves(runs, refs, Path(args.figure) if args.figure else out / "curves.png")
    return text


def main(argv: list[str] | None = None) -> int:
    """Parse, run, print the summary; one line on stderr and exit 2 on bad input."""
    try:
        print(run(parse_args(argv)))
    except HdMoeError as exc:
        print(f"place_learned: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
