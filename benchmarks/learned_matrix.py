"""Run the issue-17 evaluation matrix: tuned heuristic and learned policy per cell.

Cells: 3 models (DeepSeek-V2-Lite, Qwen2-57B-A14B: synthetic traces; Mixtral-8x7B: the real
trace, trained on the ``reasoning`` category, held-out on ``stem``) × 2 settings (2.5/75, 10/25)
× B ∈ {32, 128}, 4×8 mesh, ``faithful`` profile, Node + Link placement, DES fidelity.

Per cell, two phases, each a plain ``hdamoe`` command (printed before it runs):

* ``tune``: ``hdamoe tune`` over grid G2 of docs/results/tuned/matrix.md (levels
  0 … 32 × protect-top 0, 1, 2 × least-loaded × k_b budget / 1), out ``OUT/<cell>/tune``;
* ``tune-eplb``: the same cell on the ``eplb`` placement (redundant experts): levels 0, 1, 4,
  32 × protect-top 0, 1 × replica rules least-loaded / nearest / round-robin, with ``--oracle``
  (per-layer hindsight over the grid, plus LP-balanced replica shares), out
  ``OUT/<cell>/tune_eplb``;
* ``train``: ``hdamoe train --seeds 0,1,2`` (MaskablePPO, residual action, quality target 0.99,
  ``hyperparams/maskable-ppo.yml`` section ``maskable-ppo-residual``, 2 envs, DES), evaluated
  on the held-out episodes against NoOp, gating, HD-MoE, HDA-MoE and the cell's
  ``tuned:OUT/<cell>/tune/tuned.json``, out ``OUT/<cell>/train``.

A phase whose output is complete (``tuned.json`` / ``seeds.json``) is skipped, so the driver
resumes after an interruption; each command resumes its own partial output (``--resume``).
``--summary`` prints the Markdown table of every finished cell.

Cells run one after the other by default. ``--workers N`` runs N cells at once (``--backend
process``: every command is its own process already, so N driver threads each run one cell's
commands) and ``--backend ray`` runs one Ray task per cell, like ``hdamoe reproduce --backend
ray`` (``ray.init()`` starts a local instance with N CPUs unless ``--ray-address`` names a
cluster; Ray is an optional extra, imported only then).

Run: ``OMP_NUM_THREADS=1 python benchmarks/learned_matrix.py --out runs/learned_matrix
[--phase tune|tune-eplb|train|all] [--cells ds_2.5-75_B128,...] [--timesteps 20480] [--train-arg=--flag]
[--workers N] [--backend process|ray] [--ray-address ADDRESS]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from hdamoe_env.app.tables import render_table
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled

MIXTRAL_DIR = "../shared/reference-traces/mixtral"
MODELS = {
    "ds": ("deepseek-v2-lite", []),
    "qwen": ("qwen2-57b-a14b", []),
    "mix": ("mixtral-8x7b", ["--trace", f"{MIXTRAL_DIR}/experts_reasoning_mixtral.json",
                             "--eval-trace", f"{MIXTRAL_DIR}/experts_stem_mixtral.json"]),
}
SETTINGS = ("2.5/75", "10/25")
BATCHES = (32, 128)
G2 = ["--gating-levels", "0,0.5,1,2,4,8,16,32", "--gating-protect-top", "0,1,2",
      "--dispatch-rules", "least_loaded", "--k-b", "budget,1", "--max-grid", "200",
      "--steps", "4", "--train-seeds", "0,1", "--eval-steps", "8"]
EPLB_GRID = ["--gating-levels", "0,1,4,32", "--gating-protect-top", "0,1", "--dispatch-rules", "least_loaded",
             "--k-b", "budget", "--replica-rules", "least_loaded,nearest,round_robin",
             "--steps", "4", "--train-seeds", "0,1", "--eval-steps", "8", "--oracle"]
BASELINES = "noop,hardware-aware-gating,hd-moe,hda-moe"
BACKENDS = ("process", "ray")


def cells() -> list[tuple[str, str, str, int]]:
    """Return (cell name, model key, setting, B) for every cell of the matrix."""
    return [(f"{m}_{s.replace('/', '-')}_B{b}", m, s, b)
            for m in MODELS for s in SETTINGS for b in BATCHES]


def _common(model_key: str, setting: str, batch: int) -> list[str]:
    model, trace_args = MODELS[model_key]
    return ["--model", model, "--mesh", "4x8", "--setting", setting, "--batch", str(batch),
            "--conventions", "faithful", "--placement", "node_link", "--fidelity", "des",
            *trace_args]


def tune_cmd(out: Path, model_key: str, setting: str, batch: int, eplb: bool = False
             ) -> list[str]:
    """Return the ``hdamoe tune`` command of one cell (``eplb``: the redundant-expert grid)."""
    common = _common(model_key, setting, batch)
    if eplb:
        common[common.index("node_link")] = "eplb"
    return ["hdamoe", "tune", *common, *(EPLB_GRID if eplb else G2), "--no-progress",
            "--out", str(out), "--resume"]


def train_cmd(out: Path, tuned: Path, model_key: str, setting: str, batch: int,
              timesteps: int, extra: list[str], placement: str = "node_link") -> list[str]:
    """Return the ``hdamoe train`` command of one cell."""
    common = _common(model_key, setting, batch)
    common[common.index("node_link")] = placement
    return ["hdamoe", "train", "--algo", "maskable-ppo", *common,
            "--gating-levels", "0,0.5,1,2,4,8,16,32", "--action-mode", "residual",
            "--quality-target", "0.99", "--hyperparams", "hyperparams/maskable-ppo.yml",
            "--hyperparams-section", "maskable-ppo-residual", "--timesteps", str(timesteps),
            "--n-envs", "2", "--seeds", "0,1,2", "--checkpoint-every", "10240",
            "--eval-baselines", f"{BASELINES},tuned:{tuned}", *extra,
            "--out", str(out), "--resume"]


def _run(cmd: list[str]) -> int:
    print("$", shlex.join(cmd), flush=True)
    exe = Path(sys.executable).with_name("hdamoe")            # the console script of this venv
    return subprocess.call([str(exe) if exe.exists() else "hdamoe", *cmd[1:]])


NAMES = {"ds": "DeepSeek-V2-Lite", "qwen": "Qwen2-57B-A14B", "mix": "Mixtral-8x7B"}


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def learned_table(out: Path) -> str:
    """Markdown table of the learned policies (DES, held-out) of every finished cell."""
    head = ["model", "setting", "B", "NoOp µs", "HDA-MoE µs", "tuned µs (top-1)",
            "learned µs (mean ± 95 % CI, 3 seeds)", "learned top-1", "learned ÷ tuned − 1",
            "95 % CI of the gap", "beats tuned by ≥ 5 %?"]
    rows: list[list[str]] = []
    for name, m, setting, b in cells():
        data = _load(out / name / "train" / "seeds.json")
        if data is None:
            continue
        des = data["summary"]["des"]
        lrn, base = des["learned"], des["baselines"]
        tuned = base["tuned"]["tbt_us"]
        gap = lrn["tbt_us"] / tuned - 1.0
        half = (lrn["tbt_ci95_us"] or 0.0) / tuned
        verdict = ("yes" if gap + half < 0 and gap <= -0.05
                   and lrn["top1_retention"] >= 0.99 else "no")
        rows.append([NAMES[m], str(setting), str(b), f"{base['noop']['tbt_us']:.1f}",
                     f"{base['hda-moe']['tbt_us']:.1f}",
                     f"{tuned:.1f} ({base['tuned']['top1_retention']:.4f})",
                     f"{lrn['tbt_us']:.1f} ± {lrn['tbt_ci95_us'] or 0:.1f}",
                     f"{lrn['top1_retention']:.4f}", f"{100 * gap:+.2f} %",
                     f"[{100 * (gap - half):+.2f}, {100 * (gap + half):+.2f}] %", verdict])
    return render_table(head, rows, style="markdown")


def replica_table(out: Path) -> str:
    """Markdown table of the redundant-expert (eplb) tuning and oracle of every finished cell."""
    head = ["model", "setting", "B", "tuned Node + Link µs", "tuned EPLB µs (knobs)",
            "EPLB oracle ÷ best tuned (constrained / unconstrained)",
            "best LP-shares point ÷ best rule point", "oracle layers on LP shares"]
    rows: list[list[str]] = []
    for name, m, setting, b in cells():
        nl = _load(out / name / "tune" / "tuned.json")
        ep = _load(out / name / "tune_eplb" / "tuned.json")
        orc = _load(out / name / "tune_eplb" / "oracle.json")
        if nl is None or ep is None or orc is None:
            continue
        best = min(nl["held_out"]["tbt_us"], ep["held_out"]["tbt_us"])
        fixed = orc["fixed"]
        lp = [f for f in fixed if f["knobs"]["replica_rule"] == "lp_shares"]
        rule = [f for f in fixed if f["knobs"]["replica_rule"] != "lp_shares"]
        feas = [f for f in rule if f["top1_retention"] >= orc["target"]] or rule
        lp_feas = [f for f in lp if f["top1_retention"] >= orc["target"]] or lp
        lp_ratio = (min(f["tbt_us"] for f in lp_feas) / min(f["tbt_us"] for f in feas)
                    if lp_feas else float("nan"))
        layers = sum(f["oracle_choices"] for f in fixed)
        lp_layers = sum(f["oracle_choices"] for f in lp)
        k = ep["knobs"]
        knobs = f"level {k['gating_level']:g}, protect {k['protect_top']}, {k['replica_rule']}"
        rows.append([NAMES[m], str(setting), str(b), f"{nl['held_out']['tbt_us']:.1f}",
                     f"{ep['held_out']['tbt_us']:.1f} ({knobs})",
                     f"{orc['constrained_tbt_us'] / best:.3f} / "
                     f"{orc['unconstrained_tbt_us'] / best:.3f}", f"{lp_ratio:.3f}",
                     f"{lp_layers} / {layers}"])
    return render_table(head, rows, style="markdown")


def summary(out: Path) -> str:
    """Return both Markdown tables (cells whose phases finished)."""
    return ("## Learned policies\n\n" + learned_table(out) + "\n\n## Redundant experts (EPLB)"
            "\n\n" + replica_table(out) + "\n")


def main() -> int:
    """Run the requested phases over the requested cells."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/learned_matrix")
    ap.add_argument("--phase", choices=("tune", "tune-eplb", "train", "all"), default="all")
    ap.add_argument("--cells", default=None, help="comma list of cell names (default: all 12)")
    ap.add_argument("--timesteps", type=int, default=20480)
    ap.add_argument("--train-arg", action="append", default=[],
                    help="extra argument for hdamoe train (repeat; --train-arg=--flag)")
    ap.add_argument("--placement", choices=("node_link", "eplb"), default="node_link",
                    help="placement of the train phase (eplb: compared with tune_eplb's tuned "
                    "heuristic; add --train-arg=--replica-shares --train-arg=K for the share "
                    "action)")
    ap.add_argument("--workers", type=int, default=1,
                    help="cells at once (process backend) or CPUs of a local Ray instance")
    ap.add_argument("--backend", choices=BACKENDS, default="process",
                    help="process (default) or ray: one Ray task per cell (optional extra)")
    ap.add_argument("--ray-address", default=None,
                    help="address of a running Ray cluster (default: start a local instance)")
    ap.add_argument("--summary", action="store_true", help="print the table and exit")
    args = ap.parse_args()
    out = Path(args.out)
    if args.summary:
        print(summary(out))
        return 0
    chosen = set(args.cells.split(",")) if args.cells else None
    todo = [c for c in cells() if chosen is None or c[0] in chosen]
    if chosen and len(todo) != len(chosen):
        known = [c[0] for c in cells()]
        print(f"unknown cell in {sorted(chosen)}; expected names from {known}", file=sys.stderr)
        return 2
    try:
        failed = run_cells(todo, out, phase=args.phase, timesteps=args.timesteps,
                           train_args=args.train_arg, placement=args.placement,
                           workers=args.workers, backend=args.backend,
                           ray_address=args.ray_address)
    except (ConfigError, DependencyNotInstalled) as exc:
        print(f"learned_matrix: {exc}", file=sys.stderr)
        return 2
    if failed:
        print("failed:", ", ".join(failed), file=sys.stderr)
        return 1
    return 0


def run_cell(name: str, m: str, s: str, b: int, out: str, phase: str, timesteps: int,
             train_args: list[str], placement: str) -> list[str]:
    """Run the requested phases of one cell (skipping finished ones); return its failures."""
    root = Path(out)
    failed: list[str] = []
    tune_dir, train_dir = root / name / "tune", root / name / "train"
    if phase == "tune-eplb":
        eplb_dir = root / name / "tune_eplb"
        if not (eplb_dir / "oracle.json").exists() and \
                _run(tune_cmd(eplb_dir, m, s, b, eplb=True)) != 0:
            failed.append(f"{name}:tune-eplb")
        return failed
    if phase in ("tune", "all") and not (tune_dir / "tuned.json").exists():
        if _run(tune_cmd(tune_dir, m, s, b)) != 0:
            return [f"{name}:tune"]
    if phase in ("train", "all") and not (train_dir / "seeds.json").exists():
        tuned_dir = tune_dir if placement == "node_link" else root / name / "tune_eplb"
        if not (tuned_dir / "tuned.json").exists():
            return [f"{name}:train (no {tuned_dir / 'tuned.json'})"]
        if _run(train_cmd(train_dir, tuned_dir / "tuned.json", m, s, b, timesteps, train_args,
                          placement)) != 0:
            failed.append(f"{name}:train")
    return failed


def run_cells(todo: list[tuple[str, str, str, int]], out: Path, *, phase: str = "all",
              timesteps: int = 20480, train_args: list[str] | None = None,
              placement: str = "node_link", workers: int = 1, backend: str = "process",
              ray_address: str | None = None) -> list[str]:
    """Run :func:`run_cell` for every cell of ``todo``; return the failures in cell order.

    ``backend="process"`` with ``workers`` > 1 runs that many cells at once (driver threads;
    each command is a process of its own); ``backend="ray"`` runs one Ray task per cell.

    Raises:
        ConfigError: Unknown backend or ``workers`` < 1.
        DependencyNotInstalled: ``backend="ray"`` without Ray.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r}; expected one of {list(BACKENDS)}")
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    calls = [(name, m, s, b, str(out), phase, timesteps, list(train_args or []), placement)
             for name, m, s, b in todo]
    results: list[list[str]]
    if backend == "ray":
        results = _run_ray(calls, workers, ray_address)
    elif workers <= 1 or len(calls) <= 1:
        results = [run_cell(*call) for call in calls]
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(lambda call: run_cell(*call), calls))
    return [f for res in results for f in res]


def _run_ray(calls: list[tuple[Any, ...]], workers: int, ray_address: str | None
             ) -> list[list[str]]:
    """One Ray task per cell (a local instance of ``workers`` CPUs, or ``ray_address``)."""
    from baselines.pool import RAY_HINT, ray_pool_map

    try:
        from ray import cloudpickle
    except ImportError as exc:
        raise DependencyNotInstalled(RAY_HINT) from exc
    module = sys.modules.get(__name__)
    if module is not None and __name__ != "__main__":
        # a script module is not importable in the Ray workers: ship run_cell by value
        cloudpickle.register_pickle_by_value(module)
    return ray_pool_map(run_cell, calls, workers, ray_address=ray_address, log_to_driver=True)


if __name__ == "__main__":
    raise SystemExit(main())
