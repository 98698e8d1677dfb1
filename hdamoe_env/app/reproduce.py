"""The paper's evaluation as one command (``hdamoe reproduce --suite quick|full --out DIR``).

Application layer (style.md §2), like :mod:`hdamoe_env.app.bench`: it composes the benchmark harness,
the offline placement pipeline (``baselines``) and the agents into the experiment grid of
paper-model.md §13, and writes a self-contained report (:mod:`hdamoe_env.app.report`).

Work is split into **cells**. A cell is one unit of the grid with a stable key (a hash of its
kind and parameters): a ``placement`` cell computes (or finds cached) the quick-pipeline
placements of one configuration; a ``bench`` cell runs methods × seeds on identical episodes of
``HdMoE-v1`` (:func:`hdamoe_env.app.bench.run_bench`); a ``sweep_mem`` cell runs the memory-cap sweep
(:func:`baselines.pipeline.sweep_rho_mem`). Every finished cell is written atomically to
``OUT/cells/<key>.json`` and the raw records of all finished cells to ``OUT/results.jsonl``; a
rerun with the same ``OUT`` skips finished cells (resume after an interruption loses at most the
cells that were running). Placement cells run first (the bench cells of a configuration share
them); the rest then run in any order.

Backends: ``process`` (``concurrent.futures`` with ``--workers N`` spawned processes, or inline
for one worker) and ``ray`` (one Ray task per cell; ``ray.init()`` starts a local Ray instance
on this machine unless ``--ray-address`` names a cluster). Ray 2.x removed the single-process
``local_mode``; the local instance is what "Ray locally" means with the pinned Ray.

Suites (:func:`suite_cells`): ``tiny`` (seconds; tests), ``quick`` (≤ 20 minutes on 2 cores:
DeepSeek-V2-Lite synthetic and Mixtral on its real reasoning trace, the reduced grid of every
figure) and ``full`` (all four models, every setting, batch 16–128, both profiles, meshes and
topologies; hours on 2 cores, meant for ``--workers N`` or a Ray cluster).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hdamoe_env import __version__
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.app.records import read_jsonl, write_jsonl
from hdamoe_env.config.fileio import json_default, write_json

log = logging.getLogger(__name__)

__all__ = [
    "BACKENDS",
    "BASELINES",
    "CELL_FORMAT",
    "SUITES",
    "Cell",
    "ReproduceResult",
    "cmd_reproduce",
    "read_results",
    "run_cell",
    "run_suite",
    "run_suite_printing",
    "cpu_summary",
    "dedupe_cells",
    "model_trace",
    "shrink",
    "suite_cells",
]

#: Bumped when the meaning of a cell's parameters or records changes (invalidates resume).
CELL_FORMAT = 1
BACKENDS = ("process", "ray")
SUITES = ("tiny", "quick", "full")
#: Default location of the real Mixtral reasoning trace (paper §13: placements are optimised on
#: the MT-Bench reasoning trace).
DEFAULT_MIXTRAL_DIR = "../shared/reference-traces/mixtral"
#: Record fields dropped from the JSONL unless a figure needs them (the link heat maps).
_BULKY = ("link_busy_us",)


@dataclass(frozen=True)
class Cell:
    """One unit of the experiment grid.

    Attributes:
        figure: Figure / study id (e.g. ``"fig10_end_to_end"``); groups cells in the report.
        kind: ``"placement"``, ``"bench"`` or ``"sweep_mem"``.
        params: JSON-serialisable parameters (see :func:`run_cell`).
        tags: Extra fields copied into every record of the cell (e.g. ``{"r_comp": -3e4}``).
    """

    figure: str
    kind: str
    params: Mapping[str, Any]
    tags: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in _RUNNERS:
            raise ConfigError(f"cell kind {self.kind!r}; expected one of {list(_RUNNERS)}")

    @property
    def key(self) -> str:
        """Stable 16-hex-digit key of the cell (resume key)."""
        payload = {"format": CELL_FORMAT, "figure": self.figure, "kind": self.kind,
                   "params": self.params, "tags": self.tags}
        blob = json.dumps(payload, sort_keys=True, default=json_default).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def label(self) -> str:
        """Short human-readable description."""
        cfg = self.params.get("config", self.params)
        parts = [self.figure, self.kind, str(cfg.get("model", "")), str(cfg.get("setting", "")),
                 f"B={cfg['batch']}" if "batch" in cfg else "",
                 str(cfg.get("conventions", "faithful"))]
        if cfg.get("mesh", "4x8") != "4x8":
            parts.append(str(cfg["mesh"]))
        if cfg.get("topology", "mesh") != "mesh":
            parts.append(str(cfg["topology"]))
        if cfg.get("trace_skew", 1.0) != 1.0:
            parts.append(f"skew={cfg['trace_skew']:g}")
        parts += [f"{k}={v}" for k, v in sorted(self.tags.items())]
        return " ".join(p for p in parts if p)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``Cell(**d)`` rebuilds it)."""
        return {"figure": self.figure, "kind": self.kind, "params": dict(self.params),
                "tags": dict(self.tags)}


# --------------------------------------------------------------------------------- cell runners
def _bench_config(params: Mapping[str, Any], cache_dir: str | None) -> Any:
    from hdamoe_env.app.bench import BenchConfig

    kwargs = dict(params)
    kwargs.setdefault("cache_dir", cache_dir)
    kwargs.setdefault("place_workers", 1)
    return BenchConfig.create(**kwargs)


def _placement_dir_of(params: Mapping[str, Any], cache_dir: str | None) -> str:
    """Compute (or find cached) the quick placements of a configuration; return the directory."""
    from hdamoe_env.app.bench import load_bench_trace, placement_store

    config = _bench_config(params, cache_dir)
    trace, _ = load_bench_trace(config)
    store = placement_store(config, trace, progress=False)
    store.get("node_link")
    return str(store.pipeline_dir)


def _guard_batches(params: Mapping[str, Any], cache_dir: str | None) -> dict[str, Any]:
    """Build the batch-guarded Node+Link placements of a configuration (cached for its cells).

    Returns the winners per batch: ``{str(B): {"winner_counts", "wall_s", "cpu_s"}}``.
    """
    from hdamoe_env.app.bench import load_bench_trace, placement_store

    out: dict[str, Any] = {}
    trace = None
    for batch in params.get("guard_batches", ()):
        t0, cpu0 = time.perf_counter(), time.process_time()
        config = _bench_config({**params["config"], "batch": int(batch)}, cache_dir)
        if trace is None:
            trace, _ = load_bench_trace(config)
        placement, _ = placement_store(config, trace, progress=False).get("node_link")
        guard = placement.meta.get("batch_guard")
        if guard is None:
            continue
        out[str(batch)] = {"winner_counts": guard["winner_counts"],
                           "wall_s": time.perf_counter() - t0,
                           "cpu_s": time.process_time() - cpu0}
    return out


def _run_placement(params: Mapping[str, Any], cache_dir: str | None) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    directory = _placement_dir_of(params["config"], cache_dir)
    meta: dict[str, Any] = {}
    run = Path(directory) / "placement.npz"
    if run.exists():
        from hdamoe_env.sim.placement import Placement

        meta = {k: v for k, v in Placement.load(run).meta.items()
                if k in ("trace_id", "config_hash", "layers_missing", "layers_guarded")}
    layer_s = []
    for f in sorted(Path(directory).glob("layer_*.json")):
        try:
            layer_s.append(float(json.loads(f.read_text())["timings_s"]["total_s"]))
        except (KeyError, ValueError, OSError):
            continue
    record = {"placement_dir": directory, "wall_s": time.perf_counter() - t0,
              "pipeline_cpu_s": sum(layer_s), **meta, **params["config"]}
    if params.get("guard_batches"):
        record["batch_guard"] = _guard_batches(params, cache_dir)
    return [record]


def _run_bench(params: Mapping[str, Any], cache_dir: str | None) -> list[dict[str, Any]]:
    from hdamoe_env.app.bench import run_bench

    cfg = dict(params["config"])
    env_kwargs = dict(cfg.get("env_kwargs", {}))
    published = env_kwargs.pop("gating_coefficients_published", None)
    if published is not None:  # §11.7 units (w = 2·h·I): r_comp ÷ m in the profile (§11.3)
        from hdamoe_env.config.profiles import get_profile

        m = get_profile(cfg.get("conventions", "faithful")).expert_matrices
        env_kwargs["gating_coefficients"] = (float(published[0]) / m, float(published[1]))
    cfg["env_kwargs"] = env_kwargs
    source = params.get("placement_from")
    if source is not None:  # placements optimised on another trace (paper Fig. 21)
        cfg["placement_dir"] = _placement_dir_of(source, cache_dir)
    config = _bench_config(cfg, cache_dir)
    result = run_bench(config, list(params["methods"]), list(params["seeds"]), progress=False)
    keep = set(params.get("keep", ()))
    records = []
    for rec in result.records:
        rec = {k: v for k, v in rec.items() if k not in _BULKY or k in keep}
        rec["topology"] = config.topology
        records.append(rec)
    return records


def _run_sweep_mem(params: Mapping[str, Any], cache_dir: str | None) -> list[dict[str, Any]]:
    from baselines.memory_sweep import sweep_rho_mem
    from baselines.pipeline_config import PlaceConfig
    from baselines.store import QUICK_PLACEMENT, default_cache_dir

    cfg = dict(params["config"])
    mesh = cfg.pop("mesh", "4x8")
    X, Y = (int(v) for v in str(mesh).lower().split("x"))
    budget = {**QUICK_PLACEMENT, **params.get("budget", {})}
    pc = PlaceConfig.create(mesh=(X, Y), **{**budget, **cfg})
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    out = root / f"sweep_mem__{pc.config_hash('sweep')}"
    rows = sweep_rho_mem(pc, list(params["rho"]), out, layers=params.get("layers"),
                         resume=True, force=True)      # the package's own cache directory
    return [{**row, "model": pc.model_spec.key, "setting": pc.setting, "mesh": mesh,
             "batch": pc.batch, "profile": pc.conventions} for row in rows]


_RUNNERS: dict[str, Callable[[Mapping[str, Any], str | None], list[dict[str, Any]]]] = {
    "placement": _run_placement,
    "bench": _run_bench,
    "sweep_mem": _run_sweep_mem,
}


def run_cell(cell: Cell | Mapping[str, Any], cache_dir: str | None = None) -> dict[str, Any]:
    """Run one cell and return its payload (what ``OUT/cells/<key>.json`` holds).

    Args:
        cell: A :class:`Cell` or its :meth:`Cell.to_dict` form (what worker processes receive).
        cache_dir: Placement cache root (None: the bench harness's default).

    Returns:
        ``{"key", "cell", "records", "wall_s", "cpu_s", "version", "finished"}`` (``cpu_s``:
        process time of the cell's work in the process that ran it, which on a shared machine
        is the honest cost next to ``wall_s``); every record carries ``figure``, ``cell`` (the
        key) and the cell's tags.
    """
    if not isinstance(cell, Cell):
        cell = Cell(**cell)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    records = _RUNNERS[cell.kind](cell.params, cache_dir)
    for rec in records:
        rec.update({"figure": cell.figure, "cell": cell.key, "kind": cell.kind, **cell.tags})
    return {"key": cell.key, "cell": cell.to_dict(), "records": records,
            "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0,
            "version": __version__, "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}


def shrink(cell: Cell) -> Cell:
    """Return a seconds-sized version of a bench cell (TP and EP only, one seed, one step).

    Used by the tests to run "the smallest cell of a suite" without the placement pipeline.
    """
    if cell.kind != "bench":
        raise ConfigError(f"shrink() takes a bench cell, got kind {cell.kind!r}")
    params = dict(cell.params)
    params["config"] = {**params["config"], "steps": 1}
    params["methods"] = ["tp", "ep"]
    params["seeds"] = [0]
    params.pop("placement_from", None)
    return dataclasses.replace(cell, params=params)


# -------------------------------------------------------------------------------------- suites
#: The baselines the Node+Link search space contains (every cell with Node+Link runs them, so
#: that the report can set Node+Link against the fastest of them).
BASELINES = ("tp", "tp-tiled", "ep", "hybrid")
METHODS_E2E = ("tp", "tp-tiled", "ep", "hybrid", "node-balance", "node-link", "node-link-raw",
               "hd-moe", "hda-moe", "eplb", "eplb-dynamic")
#: HDA-MoE at matched routing quality (top-1 retention >= 99 % and >= 95 %): every end-to-end
#: cell, so that each HDA-MoE speed-up of the claims is also stated at matched quality.
METHODS_MATCHED = ("hda-moe@q99", "hda-moe@q95")
#: Extra gating scales of the speed-vs-quality (Pareto) curve, 5/50 B = 128 cells only; with
#: hd-moe (scale 0), the matched-quality points and hda-moe (scale 1) they trace the curve.
METHODS_PARETO = ("hda-moe@s0.0625", "hda-moe@s0.25")


def model_trace(model: str, mixtral_dir: str | None) -> str | None:
    """Return the trace of a model's cells: Mixtral's real reasoning trace, else "synthetic".

    None (with a warning) when Mixtral's trace is not in ``mixtral_dir``: its cells are skipped.
    """
    if model != "mixtral-8x7b":
        return "synthetic"
    trace = mixtral_trace_path(mixtral_dir)
    if trace is None:
        log.warning("no Mixtral reasoning trace in %s; Mixtral cells are skipped", mixtral_dir)
    return trace


def mixtral_trace_path(mixtral_dir: str | None, category: str = "reasoning") -> str | None:
    """Return the path of the reference Mixtral trace of ``category``, or None if absent."""
    if mixtral_dir is None:
        return None
    path = Path(mixtral_dir) / f"experts_{category}_mixtral.json"
    return str(path) if path.exists() else None


def bench_cfg(model: str, trace: str, setting: str, batch: int, conventions: str = "faithful",
              mesh: str = "4x8", topology: str = "mesh", steps: int = 8,
              **extra: Any) -> dict[str, Any]:
    """Return one bench configuration of the grids (model, trace, setting, batch, ...) as a dict.

    ``extra`` adds or overrides fields (e.g. ``env_kwargs``); shared with ``crossover``.
    """
    cfg = {"model": model, "trace": trace, "setting": setting, "batch": batch,
           "conventions": conventions, "mesh": mesh, "topology": topology, "steps": steps}
    cfg.update(extra)
    return cfg


def placement_key(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a bench configuration the placements depend on."""
    keys = ("model", "trace", "setting", "conventions", "mesh", "topology", "trace_requests",
            "trace_skew")  # trace_skew: only present (and keyed) when != 1
    key = {k: cfg[k] for k in keys if k in cfg}
    trace_kwargs = {k: v for k, v in cfg.get("env_kwargs", {}).items()
                    if k in ("trace_seed", "trace_tokens", "trace_skew", "view")}  # the trace
    if trace_kwargs:
        key["env_kwargs"] = trace_kwargs
    return key


def suite_cells(suite: str, *, mixtral_dir: str | None = DEFAULT_MIXTRAL_DIR,
                seeds: Sequence[int] | None = None) -> list[Cell]:
    """Return the cells of a suite (placement cells first, no duplicates).

    Args:
        suite: ``"tiny"``, ``"quick"`` or ``"full"``.
        mixtral_dir: Directory of the real Mixtral traces (``experts_<category>_mixtral.json``);
            Mixtral cells are left out when it is None or missing.
        seeds: Episode seeds (default: (0, 1) for quick and full, (0,) for tiny).

    Raises:
        ConfigError: Unknown suite.
    """
    if suite not in SUITES:
        raise ConfigError(f"unknown suite {suite!r}; expected one of {list(SUITES)}")
    full = suite == "full"
    seeds = list(seeds) if seeds is not None else ([0] if suite == "tiny" else [0, 1])
    cells: list[Cell] = []

    guard_batches: dict[str, set[int]] = {}

    def bench(figure: str, cfg: dict[str, Any], methods: Sequence[str], *,
              placement: bool = True, keep: Sequence[str] = (), tags: Mapping[str, Any] = (),
              placement_from: dict[str, Any] | None = None) -> None:
        needs = placement and any(m not in ("tp", "tp-tiled", "ep") for m in methods)
        if needs:
            src = placement_from if placement_from is not None else cfg
            key = placement_key(src)
            cells.append(Cell("placements", "placement", {"config": key}))
            if not str(cfg.get("conventions", "faithful")).startswith("paper"):
                guard_batches.setdefault(json.dumps(key, sort_keys=True), set()).add(
                    int(cfg["batch"]))
        params: dict[str, Any] = {"config": cfg, "methods": list(methods), "seeds": seeds}
        if keep:
            params["keep"] = list(keep)
        if placement_from is not None:
            params["placement_from"] = placement_key(placement_from)
        cells.append(Cell(figure, "bench", params, dict(tags)))

    if suite == "tiny":
        bench("fig10_end_to_end", bench_cfg("deepseek-v2-lite", "synthetic", "5/50", 8, steps=1,
                                            trace_requests=16), ("tp", "ep"), placement=False)
        bench("fig10_end_to_end", bench_cfg("deepseek-v2-lite", "synthetic", "2.5/75", 8, steps=1,
                                            trace_requests=16), ("tp", "ep"), placement=False)
        return dedupe_cells(cells)

    def with_guards(cells: list[Cell]) -> list[Cell]:
        """Placement cells also build the batch guards of every batch their cells run at."""
        out = []
        for cell in cells:
            batches = guard_batches.get(json.dumps(cell.params.get("config"), sort_keys=True))
            if cell.kind == "placement" and batches:
                cell = dataclasses.replace(cell, params={**cell.params,
                                                         "guard_batches": sorted(batches)})
            out.append(cell)
        return dedupe_cells(out)

    ds = ("deepseek-v2-lite", "synthetic")
    models = [ds]
    mixtral = mixtral_trace_path(mixtral_dir)
    if mixtral is not None:
        models.append(("mixtral-8x7b", mixtral))
    if full:
        models += [("qwen2-57b-a14b", "synthetic"), ("qwen3.5-35b-a3b", "synthetic")]
    settings = ("2.5/75", "5/50", "10/25")
    batches = (16, 32, 64, 128) if full else (32, 128)
    profiles = ("faithful", "paper")
    steps = 8

    # Fig. 10: end-to-end, every setting and batch; the headline under both profiles
    for model, trace in models:
        for setting in settings:
            for conv in profiles:
                for batch in (batches if conv == "faithful" or full else (128,)):
                    headline = setting == "5/50" and batch == 128
                    keep = ("link_busy_us",) if headline else ()
                    methods = METHODS_E2E + METHODS_MATCHED + (METHODS_PARETO if headline
                                                               else ())
                    bench("fig10_end_to_end", bench_cfg(model, trace, setting, batch, conv,
                                                        steps=steps), methods, keep=keep)
    # Fig. 11: mesh size at 5/50; Fig. 12: topology at 32 endpoints (5 TFLOPS assumed, §13)
    scale_models = models if full else [ds]
    for model, trace in scale_models:
        for mesh in ("4x4", "8x8"):
            bench("fig11_mesh", bench_cfg(model, trace, "5/50", 128, mesh=mesh, steps=steps),
                  (*BASELINES, "node-link", "hd-moe", "hda-moe"))
        for topo in ("torus", "fattree"):
            bench("fig12_topology",
                  bench_cfg(model, trace, "5/50", 128, topology=topo, steps=steps),
                  (*BASELINES, "node-link", "hd-moe", "hda-moe"))
    # Fig. 20: memory cap (DeepSeek, 5/50, B = 128)
    cells.append(Cell("fig20_memory_cap", "sweep_mem", {
        "config": {"model": "deepseek-v2-lite", "trace": "synthetic", "setting": "5/50",
                   "batch": 128, "conventions": "faithful", "mesh": "4x8"},
        "rho": [None, 1.5, 1.25, 1.1, 1.02], "layers": None if full else "0-3"}))
    # Fig. 21: static vs dynamic placement; placement optimised on the seed-0 synthetic trace
    # (the "reasoning" trace), runtime traces from other seeds (other "categories"); Mixtral:
    # the real categories
    dyn_batch = 512 if full else 128
    runtime: list[tuple[str, str, dict[str, Any], str]] = [
        (ds[0], "synthetic", {"trace_seed": s}, f"synthetic seed {s}") for s in (1, 2, 3)]
    if full and mixtral is not None:
        for category in ("extraction", "humanities", "roleplay", "stem", "writing"):
            path = mixtral_trace_path(mixtral_dir, category)
            if path is not None:
                runtime.append(("mixtral-8x7b", path, {}, category))
    for setting, k_b in (("5/50", 2), ("2.5/75", 5)):
        for model, trace, env_kwargs, category in runtime:
            src_trace = mixtral if model == "mixtral-8x7b" else "synthetic"
            src = bench_cfg(model, src_trace, setting, 128)
            cfg = bench_cfg(model, trace, setting, dyn_batch, steps=steps, k_b=k_b,
                            env_kwargs=env_kwargs)
            bench("fig21_dynamic", cfg, (*BASELINES, "node-link", "hd-moe"), placement_from=src,
                  tags={"category": category, "k_b": k_b})
    # Fig. 22: gating vs batch (DeepSeek, 2.5/75)
    for batch in ((1, 2, 4, 8, 32, 64, 128) if full else (1, 4, 8, 32, 128)):
        bench("fig22_gating_batch", bench_cfg(ds[0], "synthetic", "2.5/75", batch, steps=steps),
              (*BASELINES, "node-link", "hd-moe", "agent:hardware-aware-gating", "hda-moe"))
    # Fig. 24: sensitivity to r_comp (r_comm = 0) and r_comm (r_comp = -3e4), DeepSeek 2.5/75
    # B = 32; published units (w = 2·h·I), converted to the profile in the env (÷ m)
    r_comps = (0.0, -1e4, -3e4, -5e4, -1e5) + ((-2e5,) if full else ())
    r_comms = (0.0, -0.01, -0.03, -0.06, -0.1) + ((-0.2,) if full else ())
    sweep = [(rc, 0.0, "r_comp") for rc in r_comps] + [(-3e4, rm, "r_comm") for rm in r_comms]
    for r_comp, r_comm, axis in sweep:
        cfg = bench_cfg(ds[0], "synthetic", "2.5/75", 32, steps=steps,
                        env_kwargs={"gating_coefficients_published": [r_comp, r_comm]})
        bench("fig24_sensitivity", cfg, (*BASELINES, "node-link", "hda-moe"),
              tags={"r_comp": r_comp, "r_comm": r_comm, "axis": axis})
    return with_guards(cells)


def dedupe_cells(cells: Iterable[Cell]) -> list[Cell]:
    """Drop repeated cells (same key) and put placement cells first, order kept otherwise."""
    seen: dict[str, Cell] = {}
    for cell in cells:
        seen.setdefault(cell.key, cell)
    ordered = list(seen.values())
    return [c for c in ordered if c.kind == "placement"] + [
        c for c in ordered if c.kind != "placement"]


# -------------------------------------------------------------------------------------- runner
@dataclass
class ReproduceResult:
    """What :func:`run_suite` did.

    Attributes:
        out_dir: The output directory.
        payloads: Cell payloads of every finished cell of the suite, in suite order.
        computed: Keys of the cells computed in this call.
        skipped: Keys of the cells found finished (resume).
        wall_s: Wall time of this call.
    """

    out_dir: Path
    payloads: list[dict[str, Any]]
    computed: list[str]
    skipped: list[str]
    wall_s: float

    @property
    def records(self) -> list[dict[str, Any]]:
        """All records of the finished cells."""
        return [r for p in self.payloads for r in p["records"]]


def _cell_path(out: Path, key: str) -> Path:
    return out / "cells" / f"{key}.json"


def _read_cell(out: Path, cell: Cell) -> dict[str, Any] | None:
    path = _cell_path(out, cell.key)
    if not path.exists():
        return None
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError):
        log.warning("%s is unreadable; the cell runs again", path)
        return None
    if payload.get("key") != cell.key or "records" not in payload:
        log.warning("%s does not belong to cell %s; it runs again", path, cell.key)
        return None
    return payload


def write_results_jsonl(path: Path, payloads: Sequence[dict[str, Any]]) -> Path:
    """Write every record of ``payloads`` as one JSON line, atomically."""
    return write_jsonl(path, (rec for payload in payloads for rec in payload["records"]))


def read_results(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a ``results.jsonl`` (or the ``OUT`` directory holding it)."""
    return read_jsonl(path)


def _execute(cells: Sequence[Cell], *, workers: int, backend: str, cache_dir: str | None,
             ray_address: str | None, done: Callable[[dict[str, Any]], None]) -> None:
    if not cells:
        return
    if backend == "ray":
        from baselines.pool import ray_pool_map

        ray_pool_map(run_cell, [(c.to_dict(), cache_dir) for c in cells], workers, done,
                     ray_address=ray_address)
        return
    if workers <= 1 or len(cells) == 1:
        for cell in cells:
            done(run_cell(cell, cache_dir))
        return
    from baselines.pool import spawn_pool_map

    spawn_pool_map(run_cell, [(c.to_dict(), cache_dir) for c in cells], workers, done)


def run_suite(cells: Sequence[Cell], out_dir: str | os.PathLike[str], *, workers: int = 1,
              backend: str = "process", cache_dir: str | None = None, resume: bool = True,
              ray_address: str | None = None,
              on_cell: Callable[[Cell, dict[str, Any], int, int], None] | None = None,
              only: Sequence[str] | None = None) -> ReproduceResult:
    """Run cells (placements first), writing every finished cell at once; skip finished ones.

    Args:
        cells: The cells (e.g. :func:`suite_cells`).
        out_dir: Output directory; ``cells/`` and ``results.jsonl`` are written here.
        workers: Parallel worker processes, or Ray CPUs of a local Ray instance.
        backend: ``"process"`` or ``"ray"``.
        cache_dir: Placement cache root (None: ``$HDAMOE_CACHE_DIR`` or ``~/.cache/hdamoe-env``).
        resume: Skip cells whose result file is present and belongs to the same cell (default).
        ray_address: Address of a running Ray cluster (None: start a local instance).
        on_cell: Called in the parent after every finished cell (cell, payload, done, total).
        only: Compute only the unfinished cells whose label contains one of these terms
            (case-insensitive); finished cells of the whole suite are still read and
            reported (None: every cell).

    Returns:
        The payloads of every finished cell and the bookkeeping.

    Raises:
        ConfigError: Unknown backend or bad worker count.
        DependencyNotInstalled: ``backend="ray"`` without Ray.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r}; expected one of {list(BACKENDS)}")
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    t0 = time.perf_counter()
    out = Path(out_dir)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    by_key = {c.key: c for c in cells}
    payloads: dict[str, dict[str, Any]] = {}
    skipped: list[str] = []
    if resume:
        for cell in cells:
            found = _read_cell(out, cell)
            if found is not None:
                payloads[cell.key] = found
                skipped.append(cell.key)
    computed: list[str] = []
    total = len(cells)

    def ordered() -> list[dict[str, Any]]:
        return [payloads[c.key] for c in cells if c.key in payloads]

    def done(payload: dict[str, Any]) -> None:
        key = payload["key"]
        write_json(_cell_path(out, key), payload)
        payloads[key] = payload
        computed.append(key)
        write_results_jsonl(out / "results.jsonl", ordered())
        log.info("cell %s (%s) finished in %.1f s", key, by_key[key].label, payload["wall_s"])
        if on_cell is not None:
            on_cell(by_key[key], payload, len(payloads), total)

    write_json(out / "suite.json", {"cells": [c.to_dict() | {"key": c.key} for c in cells],
                                    "version": __version__})
    terms = [t.strip().lower() for t in (only or ()) if t.strip()]
    for phase in ("placement", None):
        todo = [c for c in cells if c.key not in payloads
                and ((c.kind == "placement") == (phase == "placement"))
                and (not terms or any(t in c.label.lower() for t in terms))]
        _execute(todo, workers=workers, backend=backend, cache_dir=cache_dir,
                 ray_address=ray_address, done=done)
    write_results_jsonl(out / "results.jsonl", ordered())
    return ReproduceResult(out, ordered(), computed, skipped, time.perf_counter() - t0)


# ----------------------------------------------------------------------------------------- CLI

def run_suite_printing(cells: Sequence[Cell], out: str | Path, args: argparse.Namespace, *,
                       resume: bool) -> ReproduceResult:
    """``run_suite`` with the commands' progress: one line per finished cell, then a summary.

    ``args`` carries the pool options every grid command shares (``workers``, ``backend``,
    ``cache_dir``, ``ray_address``).
    """
    def tick(cell: Cell, payload: dict[str, Any], n: int, total: int) -> None:
        cpu = payload.get("cpu_s")
        print(f"[{n}/{total}] {payload['wall_s']:7.1f} s"
              + (f" (cpu {cpu:7.1f} s)" if cpu is not None else "") + f"  {cell.label}",
              flush=True)

    result = run_suite(cells, out, workers=args.workers, backend=args.backend,
                       cache_dir=args.cache_dir, resume=resume, ray_address=args.ray_address,
                       on_cell=tick, only=_only_terms(args))
    cpu = cpu_summary(result)["cpu_s"]
    print(f"{len(result.computed)} cell(s) computed, {len(result.skipped)} resumed, "
          f"wall {result.wall_s:.1f} s, cpu {cpu:.1f} s over {args.workers} worker(s) "
          f"({cpu / max(args.workers, 1):.1f} s per worker)")
    return result


def _only_terms(args: argparse.Namespace) -> list[str] | None:
    """The ``--only`` terms (comma list), or None when the option is absent or empty."""
    text = getattr(args, "only", None)
    terms = [t.strip() for t in text.split(",") if t.strip()] if text else []
    return terms or None


def cpu_summary(result: ReproduceResult) -> dict[str, Any]:
    """CPU time of a run next to its wall time (the machine may be shared while it runs).

    Returns:
        ``cpu_s``: summed process time of the cells computed in this call; ``cpu_s_all``: of
        every finished cell (resumed ones included, as recorded when they ran; cells written
        before CPU times were recorded count 0 and are counted in ``cells_without_cpu``).
    """
    computed = set(result.computed)
    cpu = [float(p.get("cpu_s", 0.0)) for p in result.payloads if p["key"] in computed]
    every = [p.get("cpu_s") for p in result.payloads]
    return {"cpu_s": sum(cpu), "cpu_s_all": sum(float(c) for c in every if c is not None),
            "cells_without_cpu": sum(1 for c in every if c is None)}


def cmd_reproduce(args: argparse.Namespace) -> int:
    """Run ``hdamoe reproduce``; return the exit code."""
    from hdamoe_env.app import report

    seeds = None
    if args.seeds:
        try:
            seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        except ValueError:
            raise ConfigError(f"--seeds {args.seeds!r}: expected integers like 0,1") from None
    mixtral_dir = args.mixtral_dir if args.mixtral_dir and Path(args.mixtral_dir).is_dir() else None
    if args.mixtral_dir and mixtral_dir is None:
        print(f"hdamoe reproduce: {args.mixtral_dir!r} not found; Mixtral cells are skipped "
              "(pass --mixtral-dir DIR)", file=sys.stderr)
    cells = suite_cells(args.suite, mixtral_dir=mixtral_dir, seeds=seeds)
    out = Path(args.out)
    if args.list:
        for cell in cells:
            print(f"{cell.key}  {cell.label}")
        print(f"{len(cells)} cells")
        return 0
    command = " ".join(["hdamoe reproduce", f"--suite {args.suite}", f"--out {args.out}"]
                       + ([f"--mixtral-dir {args.mixtral_dir}"]
                          if args.mixtral_dir != DEFAULT_MIXTRAL_DIR else [])
                       + ([f"--seeds {args.seeds}"] if args.seeds else []))
    if not args.report_only:
        result = run_suite_printing(cells, out, args, resume=not args.fresh)
        meta = {"suite": args.suite, "command": command, "wall_s": result.wall_s,
                "computed": len(result.computed), "resumed": len(result.skipped),
                "workers": args.workers, "backend": args.backend, **cpu_summary(result)}
        write_json(out / "run.json", meta)
    path = report.write_report(out, suite=args.suite, command=command)
    check = report.node_link_check(read_results(out)) if (out / "results.jsonl").exists() else []
    if check:
        print("\n".join(check[:1] + check[4:5] + [""] + check[6:]))
    print(f"wrote {path}")
    return 0
