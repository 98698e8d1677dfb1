"""The one placement resolver: a method's placement name → ``Placement`` (paper-model.md §7–9).

Every command that needs a placement by name (``hdamoe bench``, ``reproduce``, ``train``,
``evaluate``, ``simulate``) asks this module. The names and the artifact each one is stored in:

| name | placement | where it comes from |
|---|---|---|
| ``tp`` | TP (§9.1) | built (core data constructor) |
| ``tp_tiled`` | tile-aligned TP (``tensor_parallel_tiled``; not in the paper) | built |
| ``ep`` | EP (§9.2) | built, seeded by ``placement_seed`` |
| ``hybrid`` | compute-balanced hybrid TP-EP (§9.3) | ``placement_hybrid.npz`` |
| ``node_balance`` | Node Balance with the random mapping π0 (§7) | ``placement_node_balance.npz`` |
| ``node_link`` | Node + Link Balance with the TP guard (§7–8) | ``placement.npz`` |
| ``node_link_raw`` | the same without the TP guard (ablations) | ``placement_node_link_raw.npz`` |
| ``eplb`` | EPLB redundant experts (``baselines.eplb``; not in the paper) | computed directly |

``eplb`` is computed from the trace's per-layer frequencies f_i (the pipeline's ``content``
view) and the slot budget of ``StoreConfig.eplb_rho_mem`` and the hardware's DRAM cap
(:func:`baselines.eplb.eplb_slots`); it takes milliseconds, so it is neither cached on disk nor
read from a placement directory (only kept in memory, like ``tp`` and ``ep``).

Artifact-backed placements are read from a ``hdamoe place`` output directory when one is given,
otherwise from a quick run of the offline pipeline (:data:`QUICK_PLACEMENT`: heuristic Node
Balance, a small local-search Link-Balance budget) cached under :func:`default_cache_dir` in a
directory keyed by the pipeline's configuration hash — model, trace id, trace skew τ (when
!= 1), hardware, topology, profile, seed and budget. A complete cached artifact is loaded, never
re-solved; an interrupted run resumes layer by layer. A quick budget with an ``objective``
other than latency (``quick={"objective": "energy", ...}``) hashes it and names it in the
directory, so latency placements are never reused for energy. The online methods HD-MoE and
HDA-MoE are ``node_link`` plus agents; the application layer composes them (this package never
imports ``agents``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from baselines.batch_guard import BatchGuardSpec, guard_key, guarded_placement
from hdamoe_env.config.errors import ConfigError, unknown_name
from hdamoe_env.sim.placement import Placement, placement_by_name
from hdamoe_env.config.run import RUN_DEFAULTS, RunFields, RunSpec

__all__ = ["PLACEMENT_ARTIFACTS", "QUICK_PLACEMENT", "PlacementStore", "StoreConfig",
           "default_cache_dir"]

log = logging.getLogger(__name__)

#: Placement names and the artifact file of each in a ``hdamoe place`` output directory.
PLACEMENT_ARTIFACTS: dict[str, str | None] = {
    "tp": None, "tp_tiled": None, "ep": None, "hybrid": "placement_hybrid.npz",
    "node_balance": "placement_node_balance.npz", "node_link": "placement.npz",
    "node_link_raw": "placement_node_link_raw.npz", "eplb": None,
}

#: Budget of the quick offline pipeline used when no placement directory is given [decision]:
#: heuristic Node Balance (no MILP), swap local search for Link Balance with 12 DES evaluations,
#: a 5 s limit on the hybrid's region-balance MILP.
QUICK_PLACEMENT: dict[str, Any] = {"nb_mode": "heuristic", "lb_method": "local", "bo_calls": 12,
                                   "lb_objective": "auto", "hybrid_time_limit_s": 5.0}


def default_cache_dir() -> Path:
    """Return the placement cache root: ``$HDAMOE_CACHE_DIR`` or ``~/.cache/hdamoe-env``."""
    env = os.environ.get("HDAMOE_CACHE_DIR")
    if env:
        return Path(env) / "placements"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hdamoe-env" / "placements"


@dataclass(frozen=True)
class StoreConfig(RunFields):
    """What defines the placements of one configuration: a run plus the placement sources.

    Attributes:
        run: The run (``hdamoe_env.config.run.RunSpec``). A skewed synthetic trace's τ is part
            of the pipeline's configuration hash and of the cache directory name when != 1.
        placement_dir: ``hdamoe place`` output directory (None: quick pipeline, cached).
        cache_dir: Root of the placement cache (None: :func:`default_cache_dir`).
        placement_seed: Seed of EP and of the offline pipeline.
        place_batch: Batch size the placements are optimised at (paper: the default B).
        place_workers: Worker processes of the quick pipeline.
        quick: Budget of the quick pipeline (``PlaceConfig`` fields).
        eplb_rho_mem: Relative memory cap ρ_mem that sets EPLB's slots per node,
            S = ⌊ρ_mem·E/D⌋ (None: ``baselines.eplb.DEFAULT_REDUNDANCY``).
        eplb_node_groups: EPLB node groups (1: global policy; the mesh rows X: hierarchical).
        batch_guard: Re-check every ``node_link`` layer at the run's batch
            (``baselines.batch_guard``) when the placement was made by the ``best`` guard
            (``faithful``; ``paper*`` placements are never re-checked).
        guard: Budget and selection rule of the batch guard.
    """

    run: RunSpec = field(default_factory=RunSpec.resolve)
    placement_dir: str | None = None
    cache_dir: str | None = None
    placement_seed: int = 0
    place_batch: int = RUN_DEFAULTS.batch
    place_workers: int = 1
    quick: dict[str, Any] = field(default_factory=lambda: dict(QUICK_PLACEMENT))
    eplb_rho_mem: float | None = None
    eplb_node_groups: int = 1
    batch_guard: bool = True
    guard: BatchGuardSpec = field(default_factory=BatchGuardSpec)


class PlacementStore:
    """Placements of the methods of one configuration, built, loaded or computed once.

    Args:
        config: The configuration.
        trace: The loaded trace (its id keys the cache; the pipeline mines it).
        progress: Optional factory ``progress(total, desc)`` returning an object with
            ``update(n)`` and ``close()`` (a progress bar over the layers of a pipeline run).
    """

    def __init__(self, config: StoreConfig, trace: Any, *,
                 progress: Callable[[int, str], Any] | None = None) -> None:
        self.config = config
        self.trace = trace
        self.progress = progress
        self.model = config.model_spec
        self.hw = config.hardware
        self._cache: dict[str, tuple[Placement, str | None]] = {}
        self.pipeline_dir: Path | None = None
        self.pipeline_wall_s: float = 0.0
        self.pipeline_solved = False

    def get(self, name: str) -> tuple[Placement, str | None]:
        """Return the placement of ``name`` and the artifact path it came from (or None).

        Raises:
            ConfigError: Unknown placement, or a placement file that does not fit the model.
        """
        name = name.replace("-", "_")
        if name not in PLACEMENT_ARTIFACTS:
            raise unknown_name("placement", name, PLACEMENT_ARTIFACTS)
        hit = self._cache.get(name)
        if hit is not None:
            return hit
        if name in ("tp", "tp_tiled", "ep"):
            result: tuple[Placement, str | None] = (placement_by_name(
                name, self.model, self.hw.num_nodes, self.config.placement_seed,
                record_seed=False, conv=self.config.conv), None)
        elif PLACEMENT_ARTIFACTS[name] is None:
            result = (self._eplb(), None)
        else:
            directory = (Path(self.config.placement_dir) if self.config.placement_dir
                         else self._quick_pipeline())
            artifact = PLACEMENT_ARTIFACTS[name]
            assert artifact is not None
            path = directory / artifact
            if not path.exists():
                raise ConfigError(f"placement directory {str(directory)!r} has no {artifact} "
                                  f"(needed by {name!r}); run `hdamoe place --out {directory}` "
                                  "or omit --placement-dir to use the quick pipeline")
            placement = Placement.load(path)
            placement.validate(self.model, self.hw)
            missing = placement.meta.get("layers_missing") or []
            if missing:
                log.warning("%s: layers %s were not placed (TP used there)", path, missing)
            placed_on = placement.meta.get("trace_id")
            if placed_on and placed_on != self.trace.trace_id:
                log.info("%s was optimised on trace %s; evaluating on trace %s", path,
                         str(placed_on)[:12], self.trace.trace_id[:12])
            result = (placement, str(path))
            if name == "node_link" and self.guards(placement):
                result = (self._batch_guarded(placement, directory), str(path))
        self._cache[name] = result
        return result

    def guards(self, placement: Placement) -> bool:
        """Whether ``node_link`` is re-checked at the run's batch (``StoreConfig.batch_guard``).

        Only placements of the pipeline's ``best`` guard (their ``meta`` has
        ``method_costs_us``) under a non-``paper`` profile are: the paper's Node+Link stays
        the paper's. Placements optimised for energy or EDP (``meta["objective"]``) are not:
        the batch guard re-selects by latency and would undo their choice.
        """
        return (self.config.batch_guard and not self.config.conv.is_paper
                and "method_costs_us" in placement.meta
                and placement.meta.get("objective", "latency") == "latency")

    def guard_path(self, placement: Placement) -> tuple[Path, str]:
        """Return the cache file and key of the batch-guarded ``node_link`` at the run's batch."""
        batch = self.config.batch
        key = guard_key({
            "placement": placement.meta.get("config_hash"), "batch": batch,
            "guard": dataclasses.asdict(self.config.guard),
            "ep_seed": self.config.placement_seed, "hardware": repr(self.hw),
            "topology": self.config.topology, "knobs": self.config.conv.to_dict()["knobs_sha256"],
            "model": self.model.key})
        root = Path(self.config.cache_dir) if self.config.cache_dir else default_cache_dir()
        name = f"{placement.meta.get('config_hash')}__B{batch}__{key}.npz"
        return root / "batch_guard" / name, key

    def _batch_guarded(self, placed: Placement, directory: Path) -> Placement:
        """The ``node_link`` placement re-checked at the run's batch (``baselines.batch_guard``).

        Its ``meta["batch_guard"]["artifact"]`` is the cache file; the store reports the
        pipeline's ``placement.npz`` as the artifact it came from.
        """
        from baselines.batch_guard import batch_guard
        from baselines.pipeline_layer import layer_simulator

        path, key = self.guard_path(placed)
        raw_path = directory / PLACEMENT_ARTIFACTS["node_link_raw"]  # type: ignore[operator]

        def build() -> Placement:
            t0 = time.perf_counter()
            run = _read_run(directory)
            place_batch = run.get("config", {}).get("batch", self.config.place_batch)
            baselines = {"tp": self.get("tp")[0], "tp-tiled": self.get("tp_tiled")[0],
                         "ep": self.get("ep")[0], "hybrid": self.get("hybrid")[0]}
            optimised = {f"node-link@B{place_batch}": placed}
            if raw_path.exists():
                optimised["nb-lb"] = Placement.load(raw_path)
            trace, view = self._placement_trace(placed, run)
            guarded = batch_guard(layer_simulator(self.place_config()), baselines, optimised,
                                  trace, self.config.batch, self.config.guard, view=view)
            guarded.meta.update({k: v for k, v in placed.meta.items()
                                 if k in ("trace_id", "config_hash", "seed")})
            guarded.meta["batch_guard"].update(source=str(directory / "placement.npz"),
                                               place_batch=place_batch)
            log.info("batch guard at B=%d: %s (%.1f s)", self.config.batch,
                     guarded.meta["batch_guard"]["winner_counts"], time.perf_counter() - t0)
            return guarded

        guarded = guarded_placement(path, key, build)
        guarded.validate(self.model, self.hw)
        guarded.meta["batch_guard"]["artifact"] = str(path)
        return guarded

    def _placement_trace(self, placed: Placement, run: dict[str, Any]) -> tuple[Any, str]:
        """The trace a placement was optimised on and its view (from the run's ``run.json``)."""
        config = run.get("config", {})
        view = str(config.get("view", "content"))
        placed_on = placed.meta.get("trace_id")
        if not placed_on or placed_on == self.trace.trace_id or not config:
            return self.trace, view
        from baselines.pipeline_config import PlaceConfig, load_trace

        trace = load_trace(PlaceConfig.from_dict(config))
        if trace.trace_id != placed_on:
            raise ConfigError(f"the batch guard cannot rebuild the trace the placement was "
                              f"optimised on ({str(placed_on)[:12]}; {config.get('trace')!r} "
                              f"gives {trace.trace_id[:12]}); pass batch_guard=False")
        return trace, view

    def _eplb(self) -> Placement:
        from baselines.eplb import eplb, eplb_placement, eplb_slots

        model, D = self.model, self.hw.num_nodes
        rows = self.trace.view("content")
        freqs = np.stack([self.trace.layer_frequencies(layer, rows)
                          for layer in range(model.num_moe_layers)])
        slots = eplb_slots(model.num_experts, D, rho_mem=self.config.eplb_rho_mem, model=model,
                           hw=self.hw, conv=self.config.conv)
        result = eplb(freqs, D, slots, num_node_groups=self.config.eplb_node_groups)
        return eplb_placement(result, trace_id=self.trace.trace_id,
                              rho_mem=self.config.eplb_rho_mem)

    def place_config(self) -> Any:
        """Return the ``baselines.pipeline_config.PlaceConfig`` of the quick pipeline."""
        from baselines.pipeline_config import PlaceConfig

        cfg = self.config
        run = dataclasses.replace(cfg.run, batch=cfg.place_batch, trace=cfg.trace_label)
        return PlaceConfig(run=run, seed=cfg.placement_seed, **cfg.quick)

    def cache_path(self) -> Path:
        """Return the cache directory of this configuration's quick placements."""
        pc = self.place_config()
        digest = pc.config_hash(self.trace.trace_id)
        X, Y = self.config.run.mesh_shape
        name = (f"{self.model.key}__{self.config.topology}{X}x{Y}__"
                f"{self.config.setting.replace('/', '-')}__{self.config.conventions}__"
                f"seed{self.config.placement_seed}__"
                + (f"skew{self.config.trace_skew:g}__" if self.config.trace_skew != 1.0 else "")
                + (f"{pc.objective}__" if pc.objective != "latency" else "")
                + digest)
        root = Path(self.config.cache_dir) if self.config.cache_dir else default_cache_dir()
        return root / name

    def _quick_pipeline(self) -> Path:
        if self.pipeline_dir is not None:
            return self.pipeline_dir
        from baselines.pipeline import run_pipeline

        out = self.cache_path()
        pc = self.place_config()
        digest = pc.config_hash(self.trace.trace_id)
        if _complete_artifact(out, digest):
            log.info("using cached placements in %s", out)
            self.pipeline_dir = out
            return out
        log.info("computing quick placements (heuristic Node Balance, local-search Link Balance) "
                 "into %s", out)
        bar = self.progress(self.model.num_moe_layers, "placement layers") \
            if self.progress is not None else None
        t0 = time.perf_counter()
        try:
            # the cache directory is the package's own: a damaged entry is set aside (force)
            run_pipeline(pc, out, workers=max(1, self.config.place_workers), resume=True,
                         force=True, trace=self.trace,
                         on_layer=(lambda _: bar.update(1)) if bar else None)
        finally:
            if bar is not None:
                bar.close()
        self.pipeline_wall_s = time.perf_counter() - t0
        self.pipeline_solved = True
        self.pipeline_dir = out
        return out


def _read_run(directory: Path) -> dict[str, Any]:
    """The ``run.json`` of a pipeline directory ({} when absent or unreadable)."""
    import json

    try:
        data = json.loads((directory / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _complete_artifact(directory: Path, config_hash: str) -> bool:
    path = directory / "placement.npz"
    if not path.exists() or not all((directory / a).exists()
                                    for a in PLACEMENT_ARTIFACTS.values() if a):
        return False  # a cache without every artifact: the resumed pipeline merges again
    try:
        meta = Placement.load(path).meta
        for artifact in PLACEMENT_ARTIFACTS.values():
            if artifact and artifact != "placement.npz":
                Placement.load(directory / artifact)
    except ConfigError as exc:
        # a corrupt cache entry is a miss: the resumed pipeline recomputes what it cannot read
        log.warning("placement cache %s is damaged (%s); recomputing it", directory, exc)
        return False
    return meta.get("config_hash") == config_hash and not meta.get("layers_missing")
