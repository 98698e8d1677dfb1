"""The offline HD-MoE placement pipeline (paper-model.md §8.5, Alg. 2): the run and its files.

Every MoE layer is placed independently by ``baselines.pipeline_layer.place_layer`` (the steps
of Alg. 2, the TP guard and the seeding are described there) under the configuration of
``baselines.pipeline_config.PlaceConfig``; :func:`run_pipeline` selects the layers, runs them
and merges the finished ones into placements after every layer.

Artifacts in the output directory (every file written atomically: temporary file + rename):

* ``run.json`` — the configuration, its hash and the trace id;
* ``layer_LLL.npz`` (``P``/``pi`` final Node+Link placement, ``P_nb`` Node-Balance shares,
  ``pi_lb`` Link-Balance mapping, ``pi0``, ``P_hybrid``, ``P_ep``) and ``layer_LLL.json`` (γ fit,
  solver and optimiser records, timings, per-method latencies) for every finished layer;
* ``placement.npz`` — the merged Node+Link placement (``Placement.save``; layers not placed yet
  are TP with the identity mapping and listed in ``meta["layers_missing"]``; layers where the
  guard replaced Node+Link in ``meta["layers_guarded"]``; with the ``best`` guard, every
  layer's sampled-step costs per method in ``meta["method_costs_us"]`` and the winning warm
  start in ``meta["warm_start"]``; tile-aligned TP layers marked ``allreduce``; the objective
  the placement minimised in ``meta["objective"]``, and in ``method_costs_us`` every
  candidate's energy ``energy_uj`` and ``edp_js`` beside its latency), plus
  ``placement_node_link_raw.npz`` (Node + Link Balance without the guard, for ablations),
  ``placement_node_balance.npz``, ``placement_hybrid.npz`` and ``placement_ep.npz``.

``resume=True`` skips layers whose files exist with the same configuration hash, and refuses to
continue a directory written with another configuration. Layers run in parallel with
``workers`` processes (``baselines.pool.spawn_pool_map``) or, with ``backend="ray"``,
as Ray tasks.

The memory-cap sweep over runs of this pipeline is ``baselines.memory_sweep``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from baselines.pipeline_config import PlaceConfig, load_trace, parse_layers
from baselines.pipeline_layer import LayerOutcome, LayerTask, layer_simulator, place_layer
from baselines.pool import spawn_pool_map
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled, OutputPathError
from hdamoe_env.config.fileio import atomic_write, check_output_dir, write_json
from hdamoe_env.sim.placement import Placement, expert_parallel
from hdamoe_env.config.specs import ModelSpec

__all__ = [
    "METHOD_NAMES",
    "PLACEMENT_FILE",
    "PipelineResult",
    "run_pipeline",
]

log = logging.getLogger(__name__)

#: Seconds between refreshes of the merged placement artifacts during a run (the per-layer
#: files are written as each layer finishes; the merged files are always written at the end).
MERGE_INTERVAL_S = 30.0

PLACEMENT_FILE = "placement.npz"
RUN_FILE = "run.json"
METHOD_NAMES = ("tp", "ep", "hybrid", "node_balance", "node_link")
BACKENDS = ("process", "ray")
_LAYER_RE = re.compile(r"^layer_(\d{3})\.(json|npz)$")


# --------------------------------------------------------------------------------------------
# files


def _write_json(path: Path, data: Any) -> None:
    write_json(path, data, sort_keys=True)


def _layer_paths(out: Path, layer: int) -> tuple[Path, Path]:
    return out / f"layer_{layer:03d}.npz", out / f"layer_{layer:03d}.json"


def _write_layer(out: Path, outcome: LayerOutcome) -> None:
    npz, js = _layer_paths(out, outcome.layer)
    atomic_write(npz, lambda fh: np.savez_compressed(fh, **outcome.arrays), "wb")
    _write_json(js, outcome.record)        # the JSON marks the layer as finished


def _read_layer(out: Path, layer: int, config_hash: str) -> LayerOutcome | None:
    npz, js = _layer_paths(out, layer)
    if not (npz.exists() and js.exists()):
        return None
    try:
        record = json.loads(js.read_text())
        with np.load(npz, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except Exception as exc:  # noqa: BLE001 - a damaged layer is recomputed, whatever broke
        log.warning("layer %d in %s is unreadable (%s: %s); it will be recomputed", layer, out,
                    type(exc).__name__, exc)
        return None
    if not isinstance(record, dict) or record.get("config_hash") != config_hash:
        return None
    return LayerOutcome(layer, arrays, record)


_OWN_FILES = re.compile(r"^(run\.json|placement(_[a-z_]+)?\.npz|layer_\d{3}\.(json|npz))$")


def _read_run_file(path: Path) -> dict[str, Any] | None:
    """Return the ``run.json`` of an ``hdamoe place`` run, or None when it is not one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and isinstance(data.get("config"), dict)
            and isinstance(data.get("config_hash"), str)):
        return None
    return data


def _set_aside(out: Path, names: Sequence[str], label: str) -> Path:
    """Move files of ``out`` into a new ``out/superseded-<label>-N/`` directory (never delete)."""
    for n in range(1, 10_000):
        target = out / f"superseded-{label}-{n}"
        if not target.exists():
            break
    target.mkdir()
    for name in names:
        os.replace(out / name, target / name)
    return target


def _config_diff(old: dict[str, Any], run_info: dict[str, Any]) -> list[str]:
    diff = sorted(k for k in set(old.get("config", {})) | set(run_info["config"])
                  if old.get("config", {}).get(k) != run_info["config"].get(k))
    if old.get("trace_id") != run_info["trace_id"]:
        diff.append("trace_id")
    return diff or ["conventions"]


def _check_run_file(out: Path, run_info: dict[str, Any], resume: bool, force: bool = False
                    ) -> None:
    """Decide whether ``out`` may receive this run; never delete a file.

    * empty or new directory, or this configuration's own run: go on (finished layers are kept;
      without ``resume`` the selected layers are recomputed);
    * a run of another configuration: refused (with ``resume`` too); ``force`` moves its files
      into ``superseded-<hash>-N/`` first;
    * any other non-empty directory: refused; ``force`` moves only the files whose names this
      command writes into ``superseded-foreign-N/`` and leaves everything else alone.

    Raises:
        OutputPathError: The directory holds another configuration's run or unrelated files.
    """
    path = out / RUN_FILE
    old = _read_run_file(path) if path.exists() else None
    present = sorted(p.name for p in out.iterdir())
    if old is not None and old.get("config_hash") != run_info["config_hash"]:
        diff = _config_diff(old, run_info)
        if not force:
            raise OutputPathError(
                f"{'cannot resume ' if resume else ''}{str(out)!r}: it holds a run of another "
                f"configuration (differs in {diff}; hash {old.get('config_hash')} vs "
                f"{run_info['config_hash']}); use a new --out directory, or --force to move the "
                "old run's files into a superseded-* subdirectory")
        own = [n for n in present if _OWN_FILES.match(n)]
        moved = _set_aside(out, own, str(old.get("config_hash"))[:8])
        log.warning("moved the run of another configuration (%s) to %s", diff, moved)
    elif old is None and present:
        clashes = [n for n in present if _OWN_FILES.match(n)]
        if not force:
            raise OutputPathError(
                f"{str(out)!r} is not empty and is not an `hdamoe place` run ({len(present)} "
                f"entries, e.g. {present[:3]}"
                + (f"; would overwrite {clashes[:4]}" if clashes else "")
                + "); use a new or empty --out directory, or --force (files this command writes "
                "are moved into a superseded-* subdirectory, nothing is deleted)")
        if clashes:
            moved = _set_aside(out, clashes, "foreign")
            log.warning("moved %d file(s) of %s into %s", len(clashes), out, moved)
    _write_json(path, run_info)


def _merge(out: Path, outcomes: dict[int, LayerOutcome], model: ModelSpec, D: int,
           meta: dict[str, Any]) -> Placement:
    """Write the merged placement artifacts; return the Node+Link placement."""
    L, E = model.num_moe_layers, model.num_experts
    tp = np.full((E, D), 1.0 / D)
    ident = np.arange(D, dtype=np.int64)

    def stack(key: str | None, fill: NDArray[Any]) -> NDArray[Any]:
        return np.stack([outcomes[l].arrays[key] if (key and l in outcomes) else fill
                         for l in range(L)])

    allreduce = np.array([bool(outcomes[l].arrays["allreduce"])
                          if l in outcomes and "allreduce" in outcomes[l].arrays else False
                          for l in range(L)])
    arrays = {"node_link": (stack("P", tp), stack("pi", ident)),
              "node_link_raw": (stack("P_nb", tp), stack("pi_lb", ident)),
              "node_balance": (stack("P_nb", tp), stack("pi0", ident)),
              "hybrid": (stack("P_hybrid", tp), stack(None, ident)),
              "ep": (stack("P_ep", tp), stack("pi0", ident))}
    placed = sorted(outcomes)
    common = {**meta, "layers_placed": placed,
              "layers_missing": [l for l in range(L) if l not in outcomes],
              "layers_guarded": [l for l in placed
                                 if outcomes[l].record.get("guard", {}).get("applied")],
              "gammas": {str(l): outcomes[l].record["gamma"]["gamma"] for l in placed},
              "latency_us": {str(l): outcomes[l].record["latency_us"] for l in placed},
              "solver": {str(l): _solver_summary(outcomes[l].record) for l in placed},
              "timings_s": {str(l): outcomes[l].record["timings_s"] for l in placed}}
    costs = {str(l): outcomes[l].record["method_costs_us"] for l in placed
             if "method_costs_us" in outcomes[l].record}
    if costs:
        common["method_costs_us"] = costs
        common["warm_start"] = {str(l): outcomes[l].record.get("warm_start") for l in placed
                                if "method_costs_us" in outcomes[l].record}
    result = None
    for name, fname in (("node_link", PLACEMENT_FILE),
                        ("node_link_raw", "placement_node_link_raw.npz"),
                        ("node_balance", "placement_node_balance.npz"),
                        ("hybrid", "placement_hybrid.npz"), ("ep", "placement_ep.npz")):
        P, pi = arrays[name]
        pl = Placement(P=P, pi=pi, method=name, meta=common,
                       allreduce=allreduce if name == "node_link" else None)
        pl.save(out / fname)
        if name == "node_link":
            result = pl
    assert result is not None
    return result


def _solver_summary(record: dict[str, Any]) -> dict[str, Any]:
    nb = record["node_balance"]
    solver = nb.get("solver", {})
    return {"path": nb.get("path"), "mode": nb.get("mode"), "status": solver.get("status"),
            "sol_status": solver.get("sol_status"), "solver": solver.get("solver_version"),
            "gap": solver.get("gap"), "nb_wall_s": nb.get("wall_s"),
            "lb_optimiser": record["link_balance"].get("optimiser"),
            "lb_evaluations": record["link_balance"].get("evaluations"),
            "flags": nb.get("flags", []) + record["link_balance"].get("flags", [])}


# --------------------------------------------------------------------------------------------
# the run


@dataclass
class PipelineResult:
    """Result of :func:`run_pipeline`.

    Attributes:
        placement: The merged Node+Link placement (missing layers TP).
        layers: Outcome per finished layer.
        computed: Layers computed in this call.
        skipped: Layers reused from the output directory (``resume``).
        out_dir: The output directory.
        wall_s: Wall time of the call.
    """

    placement: Placement
    layers: dict[int, LayerOutcome]
    computed: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    out_dir: Path | None = None
    wall_s: float = 0.0

    def table_rows(self) -> list[dict[str, Any]]:
        """Return one dict per layer: latencies per method (µs), solver status, wall time."""
        rows = []
        for layer in sorted(self.layers):
            rec = self.layers[layer].record
            row: dict[str, Any] = {"layer": layer}
            for m in METHOD_NAMES:
                lat = rec["latency_us"][m]
                row[m] = (lat["compute_us"], lat["comm_us"], lat["total_us"])
            nb = rec["node_balance"]
            row["nb_path"] = nb.get("path")
            row["nb_status"] = nb.get("solver", {}).get("status", nb.get("mode"))
            row["wall_s"] = rec["timings_s"]["total_s"]
            rows.append(row)
        return rows


def _tasks(config: PlaceConfig, trace: Any, layers: Sequence[int], config_hash: str
           ) -> list[LayerTask]:
    model = config.model_spec
    D = config.hardware.num_nodes
    if trace.num_experts != model.num_experts or trace.top_k != model.top_k:
        raise ConfigError(f"trace has E={trace.num_experts}, k={trace.top_k} but model "
                          f"{model.key!r} has E={model.num_experts}, k={model.top_k}")
    if trace.num_layers < model.num_moe_layers:
        raise ConfigError(f"trace has {trace.num_layers} MoE layers, model {model.key!r} has "
                          f"{model.num_moe_layers}")
    ep_ss = np.random.SeedSequence(config.seed).spawn(model.num_moe_layers + 1)[-1]
    ep_P = expert_parallel(1, model.num_experts, D, np.random.default_rng(ep_ss)).P[0]
    rows = trace.view(config.view)
    tasks = []
    for layer in layers:
        f = trace.layer_frequencies(layer, rows)
        g, fg = trace.groups(layer, rows)
        tasks.append(LayerTask(config.to_dict(), config_hash, layer, f,
                                np.asarray(g, dtype=np.int64), fg,
                                np.asarray(trace.topk_ids[layer, rows], dtype=np.int64), ep_P))
    return tasks


def _run_tasks(tasks: list[LayerTask], workers: int, backend: str,
               done: Callable[[LayerOutcome], None]) -> None:
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r}; expected one of {list(BACKENDS)}")
    if backend == "ray":
        try:
            import ray
        except ImportError as exc:
            raise DependencyNotInstalled("backend='ray' needs Ray (`pip install ray`); or use "
                                         "backend='process' (--workers N)") from exc
        if not ray.is_initialized():
            ray.init(num_cpus=max(1, workers), include_dashboard=False, ignore_reinit_error=True,
                     log_to_driver=False)
        remote = ray.remote(num_cpus=1)(place_layer)
        pending = [remote.remote(t) for t in tasks]
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            done(ray.get(ready[0]))
        return
    if workers <= 1 or len(tasks) <= 1:
        for task in tasks:
            done(place_layer(task))
        return
    spawn_pool_map(place_layer, [(t,) for t in tasks], workers, done)


def run_pipeline(config: PlaceConfig, out_dir: str | os.PathLike[str], *,
                 layers: str | Sequence[int] | None = None, workers: int = 1,
                 backend: str = "process", resume: bool = False, trace: Any = None,
                 on_layer: Callable[[LayerOutcome], None] | None = None,
                 force: bool = False) -> PipelineResult:
    """Run the offline placement pipeline (§8.5) and write its artifacts.

    Args:
        config: The run configuration.
        out_dir: Output directory (created).
        layers: Layer selection (``"0-3"``, ``"0,2,5"``, a sequence, or None for all).
        workers: Parallel worker processes (``backend="process"``) or Ray CPUs.
        backend: ``"process"`` or ``"ray"`` (needs ``ray``).
        resume: Skip layers already finished in ``out_dir`` with the same configuration.
        trace: A loaded ``RoutingTrace`` (default: :func:`load_trace`).
        on_layer: Called in the parent with every finished layer (progress bars).
        force: Use a directory holding another configuration's run or unrelated files: the
            files this command would overwrite are moved into ``out_dir/superseded-*/`` first
            (nothing is ever deleted).

    Returns:
        The merged placement and the per-layer outcomes.

    Raises:
        ConfigError: Invalid configuration.
        OutputPathError: ``out_dir`` is a file, or holds another configuration's run or
            unrelated files (without ``force``).
        DependencyNotInstalled: ``backend="ray"`` without Ray.
    """
    t0 = time.perf_counter()
    out = check_output_dir(out_dir)
    model = config.model_spec
    hw = config.hardware
    if trace is None:
        trace = load_trace(config)
    selected = parse_layers(layers, model.num_moe_layers)
    config_hash = config.config_hash(trace.trace_id)
    sim = layer_simulator(config)
    run_info = {"config": config.to_dict(), "config_hash": config_hash,
                "trace_id": trace.trace_id, "trace": config.trace,
                "conventions": sim.conv.to_dict(), "hardware": hw.to_dict(),
                "topology": sim.topology_spec.to_dict(), "model": model.key}
    out.mkdir(parents=True, exist_ok=True)
    _check_run_file(out, run_info, resume, force)
    outcomes: dict[int, LayerOutcome] = {}
    for layer in range(model.num_moe_layers):
        found = _read_layer(out, layer, config_hash)
        if found is not None:
            outcomes[layer] = found
    skipped = [l for l in selected if l in outcomes] if resume else []
    todo = [l for l in selected if l not in skipped]
    meta = {"model": model.key, "trace_id": trace.trace_id, "trace": config.trace,
            "hardware": hw.to_dict(), "topology": sim.topology_spec.to_dict(),
            "profile": sim.conv.to_dict(), "seed": config.seed, "batch": config.batch,
            "config": config.to_dict(), "config_hash": config_hash, "evaluator": "static",
            "objective": config.objective}
    computed: list[int] = []
    last_merge = [time.perf_counter()]

    def done(outcome: LayerOutcome) -> None:
        log.info("layer %d finished in %.1f s (%s)", outcome.layer,
                 outcome.record["timings_s"]["total_s"], outcome.record["node_balance"]["path"])
        _write_layer(out, outcome)
        outcomes[outcome.layer] = outcome
        computed.append(outcome.layer)
        # The per-layer files are what resume reads; the merged artifacts (five placements of
        # every layer) are refreshed at most every MERGE_INTERVAL_S and once at the end (also
        # when the run stops early), not after every layer (that rewrote O(L²) layer arrays).
        if time.perf_counter() - last_merge[0] >= MERGE_INTERVAL_S:
            _merge(out, outcomes, model, hw.num_nodes, meta)
            last_merge[0] = time.perf_counter()
        if on_layer is not None:
            on_layer(outcome)

    try:
        if todo:
            _run_tasks(_tasks(config, trace, todo, config_hash), workers, backend, done)
    finally:                            # also after an error or interrupt: the finished layers
        placement = _merge(out, outcomes, model, hw.num_nodes, meta)
    return PipelineResult(placement, {l: outcomes[l] for l in sorted(outcomes)},
                          sorted(computed), skipped, out, time.perf_counter() - t0)
