"""Benchmark harness: methods × seeds on identical episodes of ``HdMoE-v1`` (``hdamoe bench``).

Application layer (style.md §2): composes placements (``baselines``) with online agents
(``agents``) in the env and writes records; ``agents``, ``baselines``, TensorBoard, tqdm and
matplotlib are imported lazily.

Methods are parsed by :mod:`hdamoe_env.app.methods` (its docstring lists them).

Placements of ``hybrid``, ``node-balance`` and ``node-link`` come from a ``hdamoe place`` output
directory (``placement_dir``) or, without one, from a quick run of the offline pipeline
(``baselines.pipeline.run_pipeline`` with the heuristic Node Balance and a small local-search
Link-Balance budget, :data:`QUICK_PLACEMENT`) cached under ``cache_dir`` in a directory keyed by
the pipeline's configuration hash — model, trace id, hardware, topology, profile, seed and the
budget. An existing complete artifact is loaded, never re-solved; an interrupted run resumes
layer by layer. Placements are optimised at ``place_batch`` = 128 (paper §13) whatever the
benchmark's B.

Episodes: for seed s every method runs ``env.reset(seed=s)`` on its own env built from the same
trace, so the decode steps (rows of the trace and hence the routing) are identical across methods;
aggregator draws and predictor noise come from the same generator afterwards and may diverge once
methods consume different numbers of draws. One episode = ``steps`` decode steps × L layers.

Record per (method, seed) (JSON list / CSV rows; ``run_key`` identifies the configuration so
that ``resume`` skips finished pairs of the same configuration): TBT mean and std over decode
steps (µs), breakdown per decode step (compute incl. dense layers, communication, exposed memory,
other = broadcast excess), routing quality (top-1 retention, score mass kept, changed fraction:
means over all decode steps and layers; exactly 1, 1, 0 for methods without gating), the applied
gating scale, the matched-quality target and search (``hda-moe@qNN``), decision time per env
step (wall time of ``agent.predict``), env steps, profile name and knob hash, placement method
and artifact, trace id and trace skew τ, setting, batch, and the mean busy time of every directed
link per decode step (for the congestion heat map).

Env throughput (``hdamoe bench-env``) is measured by :mod:`hdamoe_env.app.envbench`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hdamoe_env import __version__
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled, OutputPathError
from baselines.store import QUICK_PLACEMENT, PlacementStore, StoreConfig
from hdamoe_env.app.progress import bar as progress_bar
from hdamoe_env.app.progress import factory as progress_factory
from hdamoe_env.app.records import (format_bench_table, read_records, write_csv,
                                    write_records)
from hdamoe_env.app.argtypes import run_from_args
from hdamoe_env.app.methods import DEFAULT_METHODS, MethodSpec, parse_method, resolve_agent
from hdamoe_env.config.run import RUN_DEFAULTS, RunFields, RunSpec, check_batch

__all__ = ["BenchConfig", "BenchResult", "cmd_bench", "placement_store", "run_bench", "run_episode"]

log = logging.getLogger(__name__)

US = 1e6


# --------------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class BenchConfig(RunFields):
    """Everything that defines a benchmark configuration (one ``run_key``): a run plus the bench.

    Build it with :meth:`create` from names (``BenchConfig.create(model="qwen", batch=32)``) or
    directly from a resolved ``RunSpec`` (``BenchConfig(run=spec, steps=8)``).

    Attributes:
        run: The run (model, chip, NoC, profile, B, trace; ``hdamoe_env.config.run``). A
            skewed synthetic trace's placements are optimised on the same skewed trace and
            cached under a key that includes τ.
        steps: Decode steps per episode.
        fidelity: ``"des"`` or ``"analytic"``.
        predictor: Next-layer predictor of the env.
        max_broadcast: Pre-broadcast slots of the action.
        k_b: Manual pre-broadcast slots (None: the budget rule of §10.3).
        placement_dir: ``hdamoe place`` output directory (None: quick pipeline, cached).
        cache_dir: Root of the placement cache (None: :func:`default_cache_dir`).
        placement_seed: Seed of EP and of the offline pipeline.
        place_batch: Batch size the placements are optimised at (paper: the default B).
        place_workers: Worker processes of the quick pipeline.
        quick: Budget of the quick pipeline (``PlaceConfig`` fields).
        env_kwargs: Further ``HdMoeEnv`` keyword arguments (e.g. ``gating_protect_top``).
        batch_guard: Re-check every Node+Link layer at the benchmark's B
            (``baselines.batch_guard``; ``faithful`` placements of the ``best`` guard only).

    The run's values read through (``RunFields``): ``model_spec``, ``setting``, ``mesh``,
    ``topology``, ``batch``, ``conventions``, ``trace``, ``trace_requests``, ``trace_skew``,
    ``trace_label``.
    """

    run: RunSpec = field(default_factory=RunSpec.resolve)
    steps: int = 16
    fidelity: str = "des"
    predictor: str = "noisy_oracle"
    max_broadcast: int = 8
    k_b: int | None = None
    placement_dir: str | None = None
    cache_dir: str | None = None
    placement_seed: int = 0
    place_batch: int = RUN_DEFAULTS.batch
    place_workers: int = 1
    quick: dict[str, Any] = field(default_factory=lambda: dict(QUICK_PLACEMENT))
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    batch_guard: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.run, RunSpec):
            raise ConfigError(f"run must be a RunSpec (RunSpec.resolve(...)), got "
                              f"{type(self.run).__name__}; or use BenchConfig.create(**names)")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ConfigError(f"steps must be a positive integer, got {self.steps!r}")
        check_batch(self.place_batch)

    def env_arguments(self) -> dict[str, Any]:
        """Return the ``HdMoeEnv`` keyword arguments shared by every method (run resolved)."""
        run = self.run
        kwargs: dict[str, Any] = {
            "model": run.model, "setting": run.setting, "mesh": run.mesh,
            "hardware": run.hardware, "topology": run.topology, "batch": run.batch,
            "conventions": run.conventions,
            "steps_per_episode": self.steps, "fidelity": self.fidelity,
            "predictor": self.predictor, "max_broadcast": self.max_broadcast,
            "placement_seed": self.placement_seed, **self.env_kwargs}
        if run.trace_requests is not None:
            kwargs["trace_requests"] = run.trace_requests
        if run.trace_skew != 1.0:
            kwargs["trace_skew"] = run.trace_skew
        if self.k_b is not None:
            kwargs["k_b"] = self.k_b
        return kwargs

    def store_config(self) -> StoreConfig:
        """Return the placement-resolver configuration of this benchmark configuration."""
        return StoreConfig(run=self.run, placement_dir=self.placement_dir,
                           cache_dir=self.cache_dir, placement_seed=self.placement_seed,
                           place_batch=self.place_batch, place_workers=self.place_workers,
                           quick=self.quick, batch_guard=self.batch_guard)

    def run_key(self, trace_id: str) -> str:
        """Return a short hash of the configuration and the trace id (resume key)."""
        payload = {
            "model": self.run.model_key(), "trace_id": trace_id,
            "mesh": list(self.run.mesh_shape), "topology": self.topology,
            "setting": self.setting, "batch": self.batch,
            "conventions": self.run.conventions.to_dict()["knobs_sha256"],
            "steps": self.steps, "fidelity": self.fidelity, "predictor": self.predictor,
            "max_broadcast": self.max_broadcast, "k_b": self.k_b,
            "placements": (str(Path(self.placement_dir).resolve()) if self.placement_dir
                           else {"quick": self.quick, "batch": self.place_batch}),
            "placement_seed": self.placement_seed,
            "env_kwargs": {k: self.env_kwargs[k] for k in sorted(self.env_kwargs)},
        }
        if self.trace_skew != 1.0:  # τ = 1 stays out of the key (CHANGELOG: compatibility)
            payload["trace_skew"] = self.trace_skew
        if self.batch_guard and not self.run.conventions.is_paper:  # changes node_link
            payload["batch_guard"] = dataclasses.asdict(self.store_config().guard)
        blob = json.dumps(payload, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# ------------------------------------------------------------------------------------ placements
def placement_store(config: BenchConfig, trace: Any, *, progress: bool = True) -> PlacementStore:
    """Return the placement resolver (``baselines.store``) of a benchmark configuration."""
    return PlacementStore(config.store_config(), trace, progress=progress_factory(progress))


# ------------------------------------------------------------------------------------ agents


def _accepts_masks(agent: Any) -> bool:
    try:
        return "action_masks" in inspect.signature(agent.predict).parameters
    except (TypeError, ValueError):
        return False


# ------------------------------------------------------------------------------------ episodes
def _nanmean(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(vals)) if vals else None


def run_episode(env: Any, agent: Any, seed: int, *, writer: Any = None,
                on_step: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run one episode and return its measurements (the method-independent record fields).

    Args:
        env: An ``HdMoeEnv``.
        agent: Anything with SB3's ``predict``.
        seed: ``env.reset(seed=seed)``.
        writer: Optional scalar writer (``hdamoe_env.app.tb``) for per-step TensorBoard scalars.
        on_step: Called after every env step (progress bars).

    Returns:
        TBT statistics, breakdown, routing quality (``gating``: top-1 retention, score mass kept
        and changed fraction, means over every env step — an ungated layer counts as unchanged,
        so a method without gating records exactly 1, 1, 0), the mean gating scale, decision
        time, link busy time, k_b and broadcast counts.
    """
    base = getattr(env, "unwrapped", env)
    masks = _accepts_masks(agent) and hasattr(base, "action_masks")
    obs, _ = env.reset(seed=seed)
    tbts: list[float] = []
    totals: list[float] = []
    step_energy: list[dict[str, float]] = []
    sums = {"compute_us": 0.0, "t_comm_us": 0.0, "t_nm_comm_us": 0.0, "memory_us": 0.0,
            "t_extra_us": 0.0,
            "t_nm_us": 0.0, "t_comp_us": 0.0, "t_dispatch_us": 0.0, "t_combine_us": 0.0,
            "bc_makespan_us": 0.0}
    gating: dict[str, list[float]] = {"changed_fraction": [], "top1_retention": [],
                                      "score_mass_kept": []}
    levels: list[float] = []
    decision_s: list[float] = []
    busy_sum: np.ndarray | None = None
    kb: list[int] = []
    nbc: list[int] = []
    balance: list[float] = []
    step = 0
    layer_total = 0.0
    t_start = time.perf_counter()
    done = False
    while not done:
        kwargs = {"action_masks": base.action_masks()} if masks else {}
        t0 = time.perf_counter()
        action, _ = agent.predict(obs, deterministic=True, **kwargs)
        decision_s.append(time.perf_counter() - t0)
        obs, _reward, terminated, truncated, info = env.step(action)
        done = bool(terminated or truncated)
        for key in sums:
            sums[key] += float(info.get(key, 0.0))
        total = float(info["total_us"])
        layer_total += total
        busy = info.get("link_busy_us")
        if busy is not None:
            busy = np.asarray(busy, dtype=np.float64)
            busy_sum = busy.copy() if busy_sum is None else busy_sum + busy
        kb.append(int(info.get("k_b", 0)))
        nbc.append(len(info.get("broadcast", ())))
        # every layer counts: an ungated layer keeps its routing (1, 1, 0 in the env's info)
        levels.append(float(info.get("gating_level", 0.0)))
        for key, unchanged in (("changed_fraction", 0.0), ("top1_retention", 1.0),
                               ("score_mass_kept", 1.0)):
            gating[key].append(float(info.get(key, unchanged)))
        bal = _balancedness(base, info)
        if bal is not None:
            balance.append(bal)
        if writer is not None:
            _write_step(writer, step, info, total, busy, bal, decision_s[-1])
        if "tbt_us" in info:
            tbts.append(float(info["tbt_us"]))
            totals.append(layer_total)
            layer_total = 0.0
            if "step_energy_j" in info:
                step_energy.append(dict(info["step_energy_j"]))
            if writer is not None:              # x = env step (docs/TENSORBOARD.md)
                writer.add_scalar("latency/tbt_us", float(info["tbt_us"]), step)
                if "j_per_token" in info:
                    writer.add_scalar("energy/uj_per_token", 1e6 * float(info["j_per_token"]),
                                      step)
        if done and writer is not None and "episode_tbt_us" in info:
            writer.add_scalar("latency/episode_tbt_us", float(info["episode_tbt_us"]), step)
        step += 1
        if on_step is not None:
            on_step()
    wall = time.perf_counter() - t_start
    n_dec = max(len(tbts), 1)
    tbt = np.asarray(tbts, dtype=np.float64)
    dense = float(tbt.mean() - np.mean(totals)) if tbts else 0.0
    breakdown = {
        "compute_us": sums["compute_us"] / n_dec + dense,
        "communication_us": (sums["t_comm_us"] + sums["t_nm_comm_us"]) / n_dec,
        "memory_us": sums["memory_us"] / n_dec,
        "extra_us": sums["t_extra_us"] / n_dec,
        "dense_us": dense,
        "t_nm_us": sums["t_nm_us"] / n_dec, "t_comp_us": sums["t_comp_us"] / n_dec,
        "dispatch_us": sums["t_dispatch_us"] / n_dec, "combine_us": sums["t_combine_us"] / n_dec,
        "broadcast_makespan_us": sums["bc_makespan_us"] / n_dec,
    }
    link = None if busy_sum is None or not busy_sum.any() else (busy_sum / n_dec).tolist()
    energy: dict[str, Any] = {}
    if step_energy and len(step_energy) == len(tbts):     # docs/PHYSICS.md §18
        parts = {k: float(np.mean([e[k] for e in step_energy])) for k in step_energy[0]}
        totals_j = np.array([e["total"] for e in step_energy])
        energy = {"energy_j": parts, "j_per_token": parts["total"] / base.batch,
                  "edp_js": float(np.mean(totals_j * tbt * 1e-6)),
                  "energy_steps_j": totals_j.tolist()}
    return {
        "tbt_us": float(tbt.mean()) if tbts else float("nan"),
        "tbt_std_us": float(tbt.std()) if tbts else float("nan"),
        "tbt_steps_us": tbt.tolist(),
        "decode_steps": len(tbts), "env_steps": step,
        "breakdown_us": breakdown,
        "gating": {key: _nanmean(vals) for key, vals in gating.items()},
        "gated_layers": sum(1 for v in levels if v > 0),
        "gating_scale": float(np.mean(levels)) if levels else 0.0,
        "decision_ms_per_step": 1e3 * float(np.mean(decision_s)) if decision_s else 0.0,
        "decision_ms_p95": 1e3 * float(np.percentile(decision_s, 95)) if decision_s else 0.0,
        "k_b_mean": float(np.mean(kb)) if kb else 0.0,
        "broadcast_mean": float(np.mean(nbc)) if nbc else 0.0,
        "balancedness_mean": _nanmean(balance),
        "link_busy_us": link,
        "episode_wall_s": wall,
        **energy,
    }


def _balancedness(env: Any, info: dict[str, Any]) -> float | None:
    if "balancedness" in info:
        return float(info["balancedness"])
    last = getattr(env, "last_layer", None)
    loads = getattr(last, "node_compute_s", None)
    if loads is None:
        return None
    peak = float(np.max(loads))
    return 1.0 if peak <= 0 else float(np.mean(loads)) / peak


def _write_step(writer: Any, step: int, info: dict[str, Any], total_us: float,
                busy_us: np.ndarray | None, balancedness: float | None,
                decision_s: float) -> None:
    values = {
        "latency/layer_us": total_us,
        "latency/comm_us": float(info.get("t_comm_us", 0.0)),
        "latency/compute_us": float(info.get("t_comp_us", 0.0)),
        "latency/nm_us": float(info.get("t_nm_us", 0.0)),
        "latency/memory_us": float(info.get("memory_us", 0.0)),
        "latency/extra_us": float(info.get("t_extra_us", 0.0)),
        **{f"energy/{k}_uj": 1e6 * float(v) for k, v in (info.get("energy_j") or {}).items()},
        "broadcast/k_b": float(info.get("k_b", 0)),
        "broadcast/experts": float(len(info.get("broadcast", ()))),
        "agent/decision_ms": 1e3 * decision_s,
    }
    if busy_us is not None and total_us > 0:
        values["links/max_util"] = float(busy_us.max()) / total_us
        values["links/mean_util"] = float(busy_us.mean()) / total_us
    if balancedness is not None:
        values["nodes/balancedness"] = balancedness
    if float(info.get("gating_level", 0.0)) > 0:
        for key in ("top1_retention", "changed_fraction", "score_mass_kept"):
            if key in info:
                values[f"gating/{key}"] = float(info[key])
    for tag, value in values.items():
        writer.add_scalar(tag, value, step)


# ------------------------------------------------------------------------------------ the run
@dataclass
class BenchResult:
    """Result of :func:`run_bench`.

    Attributes:
        records: The records of this configuration (resumed ones included), method order.
        all_records: Everything in the JSON output (other configurations included).
        skipped: (method, seed) pairs taken from the existing JSON (``resume``).
        run_key: Configuration hash.
        topology: The run's ``Topology`` (for the heat map).
        placement_wall_s: Wall time of a quick-pipeline run in this call (0 if cached/given).
        wall_s: Wall time of the call.
    """

    records: list[dict[str, Any]]
    all_records: list[dict[str, Any]]
    skipped: list[tuple[str, int]]
    run_key: str
    topology: Any
    placement_wall_s: float = 0.0
    placement_dir: str | None = None
    wall_s: float = 0.0


def load_bench_trace(config: BenchConfig) -> tuple[Any, Any]:
    """Load the trace exactly as every method's env will; return it and the run's topology."""
    from hdamoe_env.env.config import EnvConfig
    from hdamoe_env.noc.topology import make_topology

    env_config = EnvConfig(**{**config.env_arguments(), "trace": config.trace, "placement": "tp"})
    topology = make_topology(env_config.topology_spec, env_config.hardware_spec)
    return env_config.load_trace(), topology


def _gating_scale_of(spec: MethodSpec, placement: Any, env_args: dict[str, Any],
                     searches: dict[str, Any], targets: Sequence[float]) -> tuple[float, Any]:
    """Return the gating scale of an ``hda-moe@q`` / ``@s`` method and its search (or None).

    One probe (training decode steps of a search env) per placement, shared by every target.
    """
    if spec.gating_scale is not None:
        return float(spec.gating_scale), None
    from hdamoe_env.app.matched import GatingQualityProbe, search_matched_levels
    from hdamoe_env.env.environment import HdMoeEnv

    entry = searches.get(spec.placement)
    if entry is None:
        t0 = time.perf_counter()
        probe = GatingQualityProbe(HdMoeEnv(**env_args, placement=placement))
        found = search_matched_levels(probe, targets)
        entry = searches[spec.placement] = (probe, found, time.perf_counter() - t0)
        log.info("matched-quality search on %d training decode steps: %s (%.1f s)",
                 probe.decode_steps, ", ".join(f"top-1 >= {t:.0%}: scale {m.level:.4g}"
                                               for t, m in found.items()), entry[2])
    probe, found, wall = entry
    match = found[float(spec.quality_target)]
    search = {
        "target": match.target, "level": match.level, "train_top1_retention": match.value,
        "train_quality": probe.measure(match.level), "train_seeds": list(probe.seeds),
        "train_decode_steps": probe.decode_steps, "capped": match.capped,
        "monotone_violations": match.violations,
        "grid": list(match.grid), "grid_top1_retention": list(match.grid_values),
        "evaluations": len(match.evaluated), "search_wall_s": wall}
    return match.level, search


def run_bench(config: BenchConfig, methods: Sequence[str | MethodSpec] = DEFAULT_METHODS,
              seeds: Sequence[int] = (0, 1, 2), *, json_path: str | os.PathLike[str] | None = None,
              csv_path: str | os.PathLike[str] | None = None, resume: bool = False,
              tensorboard_dir: str | os.PathLike[str] | None = None,
              progress: bool = True) -> BenchResult:
    """Run methods × seeds on identical episodes and return (and write) one record per pair.

    Args:
        config: The configuration.
        methods: Method names (``parse_method``) or specs.
        seeds: Episode seeds; seed s is ``env.reset(seed=s)`` for every method.
        json_path: Write all records here after every finished pair (atomic).
        csv_path: Write the CSV here at the end (atomic).
        resume: Keep the records already in ``json_path`` and skip their (method, seed) pairs
            of the same configuration (``run_key``).
        tensorboard_dir: Write per-step scalars to ``DIR/{env_id}__{method}__{seed}__{time}``.
        progress: tqdm bars on stderr (when installed and stderr is a terminal).

    Returns:
        The records of this configuration and bookkeeping.

    Raises:
        ConfigError: Bad method names, seeds or configuration.
    """
    from hdamoe_env.env.environment import HdMoeEnv

    t_run = time.perf_counter()
    specs = [m if isinstance(m, MethodSpec) else parse_method(m) for m in methods]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"methods repeat a name: {names}")
    seeds = [int(s) for s in seeds]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds must be distinct and non-empty, got {seeds}")
    trace, topology = load_bench_trace(config)
    run_key = config.run_key(trace.trace_id)
    if json_path and not resume and Path(json_path).is_file() and Path(json_path).stat().st_size:
        raise OutputPathError(f"{str(json_path)!r} already exists and would be replaced; pass "
                              "resume=True (--resume) to keep its records and skip finished "
                              "pairs, or choose another path")
    existing = read_records(json_path) if (json_path and resume) else []
    done = {(r.get("run_key"), r.get("method"), r.get("seed")): r for r in existing}
    skipped = [(m, s) for m in names for s in seeds if (run_key, m, s) in done]
    todo = [(spec, s) for spec in specs for s in seeds if (run_key, spec.name, s) not in done]
    if skipped:
        log.info("resume: %d of %d (method, seed) pairs already in %s", len(skipped),
                 len(names) * len(seeds), json_path)
    all_records = list(existing)
    store = placement_store(config, trace, progress=progress)
    env_args = {**config.env_arguments(), "trace": trace}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    total_steps = len(todo) * config.steps * config.model_spec.num_moe_layers
    bar = progress_bar(total_steps, "bench env steps", enabled=progress) if todo else None
    envs: dict[str, Any] = {}
    conv = config.run.conventions
    model = config.model_spec
    targets = sorted({s.quality_target for s in specs if s.quality_target is not None})
    searches: dict[str, Any] = {}
    scales: dict[str, tuple[float, Any]] = {}
    try:
        for spec, seed in todo:
            placement, artifact = store.get(spec.placement)
            agent_kwargs: dict[str, Any] = {}
            search = None
            if spec.quality_target is not None or spec.gating_scale is not None:
                if spec.name not in scales:
                    scales[spec.name] = _gating_scale_of(spec, placement, env_args, searches,
                                                         targets)
                scale, search = scales[spec.name]
                agent_kwargs["gating_level"] = scale
            env = envs.get(spec.name)
            if env is None:
                extra = ({"gating_levels": sorted({0.0, agent_kwargs["gating_level"]})}
                         if agent_kwargs else {})
                env = envs[spec.name] = HdMoeEnv(**{**env_args, **extra,
                                                    **dict(spec.env_kwargs)},
                                                 placement=placement)
                if spec.rebalance_period is not None:
                    from baselines.rebalance import EplbRebalanceWrapper

                    env = envs[spec.name] = EplbRebalanceWrapper(env,
                                                                 period=spec.rebalance_period)
            agent = resolve_agent(spec.agent, env, seed=seed, **agent_kwargs)
            writer = None
            if tensorboard_dir is not None:
                from hdamoe_env.app.tb import config_markdown, make_writer, run_dir_name

                writer = make_writer(Path(tensorboard_dir) / run_dir_name(
                    spec.name, seed, timestamp=stamp, model=config.model_spec.key,
                    setting=config.setting, batch=config.batch))
                writer.add_text("config", config_markdown({
                    "method": spec.name, "seed": seed, "agent": spec.agent or "noop",
                    "placement": spec.placement, "model": config.model_spec.key,
                    "setting": config.setting, "mesh": config.mesh,
                    "topology": config.topology, "batch": config.batch,
                    "steps_per_episode": config.steps, "fidelity": config.fidelity,
                    "predictor": config.predictor, "max_broadcast": config.max_broadcast,
                    "profile": conv.name, "trace": config.trace_label,
                    "trace_id": trace.trace_id, "trace_skew": config.trace_skew,
                    "placement_seed": config.placement_seed,
                    "version": __version__}))
            try:
                measured = run_episode(env, agent, seed, writer=writer,
                                       on_step=(lambda: bar.update(1)) if bar else None)
            finally:
                if writer is not None:
                    writer.close()
            history = getattr(env, "history", None)
            rebalance = {} if history is None else {
                "rebalance_period": spec.rebalance_period, "rebalances": len(history),
                "moves_per_rebalance": (float(np.mean([h["moves"] for h in history]))
                                        if history else 0.0),
                "rebalance_us_per_step": (sum(h["makespan_us"] for h in history)
                                          / max(measured["decode_steps"], 1))}
            record = {
                "method": spec.name, "seed": seed, **measured, **rebalance,
                "agent": spec.agent or "noop", "agent_class": type(agent).__name__,
                "placement": spec.placement, "placement_method": placement.method,
                "placement_artifact": artifact,
                "model": model.key, "setting": config.setting, "mesh": config.mesh,
                "topology": config.topology, "batch": config.batch,
                "steps_per_episode": config.steps, "fidelity": config.fidelity,
                "predictor": config.predictor, "max_broadcast": config.max_broadcast,
                "profile": conv.name, "knobs_sha256": conv.to_dict()["knobs_sha256"],
                "gating_coefficients": list(getattr(env, "gating_coefficients", ())),
                "trace": config.trace_label, "trace_id": trace.trace_id,
                "trace_skew": config.trace_skew,
                "score_kind": getattr(env, "score_kind", None),
                "placement_seed": config.placement_seed, "run_key": run_key,
                "quality_target": spec.quality_target, "gating_search": search,
                "version": __version__,
            }
            if spec.env_kwargs:
                record["method_env_kwargs"] = dict(spec.env_kwargs)
            guard = placement.meta.get("batch_guard")
            if guard:
                record["batch_guard"] = {"batch": guard["batch"], "winner": guard["winner"],
                                         "winner_counts": guard["winner_counts"],
                                         "artifact": guard.get("artifact")}
            all_records.append(record)
            done[(run_key, spec.name, seed)] = record
            if json_path is not None:
                write_records(json_path, all_records)
            log.info("%s seed %d: TBT %.2f µs (%d decode steps)", spec.name, seed,
                     record["tbt_us"], record["decode_steps"])
    finally:
        if bar is not None:
            bar.close()
    records = [done[(run_key, m, s)] for m in names for s in seeds]
    if json_path is not None:
        write_records(json_path, all_records)
    if csv_path is not None:
        write_csv(csv_path, records)
    return BenchResult(records, all_records, skipped, run_key, topology,
                       store.pipeline_wall_s,
                       str(store.pipeline_dir or config.placement_dir or "") or None,
                       time.perf_counter() - t_run)


# ------------------------------------------------------------------------------------ CLI: bench
def _parse_list(text: str, what: str) -> list[str]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ConfigError(f"--{what} is empty")
    return items


def cmd_bench(args: argparse.Namespace) -> int:
    """Run ``hdamoe bench``; print the table; return the exit code."""
    try:
        seeds = [int(s) for s in _parse_list(args.seeds, "seeds")]
    except ValueError:
        raise ConfigError(f"--seeds {args.seeds!r}: expected integers like 0,1,2") from None
    methods = _parse_list(args.methods, "methods")
    env_kwargs = {}
    if args.gating_protect_top:
        env_kwargs["gating_protect_top"] = args.gating_protect_top
    config = BenchConfig(
        run=run_from_args(args), steps=args.steps, fidelity=args.fidelity,
        predictor=args.predictor, max_broadcast=args.max_broadcast, k_b=args.k_b,
        placement_dir=args.placement_dir, cache_dir=args.cache_dir,
        placement_seed=args.place_seed, place_workers=args.place_workers, env_kwargs=env_kwargs)
    result = run_bench(config, methods, seeds, json_path=args.json, csv_path=args.csv,
                       resume=args.resume, tensorboard_dir=args.tensorboard,
                       progress=args.progress)
    model = config.model_spec
    hw = config.run.hardware
    rec0 = result.records[0]
    print(f"hdamoe bench: {model.key} on {config.topology} {config.mesh} ({hw.num_nodes} nodes), "
          f"{hw.compute_tflops:g} TFLOPS/node, {hw.link_bw_gbps:g} GB/s/link, B={config.batch}, "
          f"{config.steps} decode steps x seeds {seeds}")
    print(f"conventions: {rec0['profile']} · fidelity {config.fidelity} · predictor "
          f"{config.predictor} · trace {config.trace_label}"
          + (f" skew τ={config.trace_skew:g}" if config.trace_skew != 1.0 else "")
          + f" (id {rec0['trace_id'][:12]}) · "
          f"placements: {result.placement_dir or 'built'}"
          + (f" (quick pipeline {result.placement_wall_s:.0f} s)" if result.placement_wall_s
             else ""))
    print()
    print(format_bench_table(result.records))
    print("\nµs per decode step (compute incl. dense layers); ×m = speed-up over m; changed / "
          "top1 kept: routing quality over all layers (quality from routing only; KL / PPL of "
          "gating need a recorded model trace: `hdamoe traces fidelity`); scale = gating scale "
          "(× default coefficients); decide = agent.predict per env step; mJ/token = energy "
          "per token, E/TP = its ratio to TP's (docs/PHYSICS.md §18)")
    if result.skipped:
        print(f"resumed {len(result.skipped)} record(s) from {args.json}")
    if args.plots:
        from hdamoe_env.app.plots import write_plots

        try:
            paths = write_plots(result.records, args.plots, topology=result.topology,
                                heatmap_method=args.heatmap_method)
        except DependencyNotInstalled as exc:
            print(f"plots skipped: {exc}", file=sys.stderr)
        else:
            print("wrote " + ", ".join(str(p) for p in paths))
    for path in (args.json, args.csv):
        if path:
            print(f"wrote {path}")
    print(f"wall {result.wall_s:.1f} s")
    return 0
