"""The offline HD-MoE placement pipeline, per layer (paper-model.md §8.5, paper Alg. 2).

For every MoE layer l, independently:

1. mine f_i, the co-activation groups G_l and f_g from the trace view (``content`` by default);
2. P_EP ← EP placement (§9.2; one seeded P for the whole run) and π_0 ← a random mapping of the
   layer (seeded);
3. γ_l ← ``calibrate.fit_gamma`` on (P_EP, π_0) (§5.5);
4. P_l ← Node Balance (§7) with γ_l;
5. π_l ← Link Balance (§8) starting from π_0;
6. evaluate the layer with the static evaluator (§5.7) under TP, EP (π_0), the compute-balanced
   hybrid (§9.3), Node Balance (P_l with π_0) and Node + Link Balance (P_l with π_l): expert
   compute t_comp, MoE communication t_comm_moe and their sum (the MoE latency), plus t_nm.

Aggregators: under ``lb_noise = "crn"`` (``faithful``) one aggregator draw for the Node-Balance
support is shared by the Link-Balance objective and the Node-Balance / Node+Link evaluations, so
the comparison of the two mappings is free of aggregator noise.

Guard [decision]: Node Balance optimises Eq. 1 + γ·Eq. 2 with γ fitted on EP; that estimate
can misjudge strongly split placements, and TP's real communication is the all-reduce of §5.6,
not Eq. 2. The pipeline therefore re-scores the finished Node+Link placement against TP (the
always-feasible Node-Balance start) with the static evaluator and keeps TP for the layer when
Node+Link is slower (``guard="tp"``, recorded per layer with both numbers; ``guard=None`` turns
it off). The ``node_balance`` column and artifact always hold Node Balance's own result.

Determinism: ``SeedSequence(seed).spawn(L + 1)`` — child l drives layer l (spawned again into the
streams of π_0, the γ fit, Node Balance, Link Balance, the evaluations and the hybrid), child L
the run-level EP shares. A layer's result therefore does not depend on which other layers run
or on the number of workers. (A MILP stopped by its time limit can still depend on machine
speed; the record says when that happened.)

Artifacts in the output directory (every file written atomically: temporary file + rename):

* ``run.json`` — the configuration, its hash and the trace id;
* ``layer_LLL.npz`` (``P``/``pi`` final Node+Link placement, ``P_nb`` Node-Balance shares,
  ``pi_lb`` Link-Balance mapping, ``pi0``, ``P_hybrid``, ``P_ep``) and ``layer_LLL.json`` (γ fit,
  solver and optimiser records, timings, per-method latencies) for every finished layer;
* ``placement.npz`` — the merged Node+Link placement (``Placement.save``; layers not placed yet
  are TP with the identity mapping and listed in ``meta["layers_missing"]``; layers where the TP
  guard kept TP in ``meta["layers_guarded"]``), plus ``placement_node_link_raw.npz`` (Node + Link
  Balance without the guard, for ablations), ``placement_node_balance.npz``,
  ``placement_hybrid.npz`` and ``placement_ep.npz``.

``resume=True`` skips layers whose files exist with the same configuration hash, and refuses to
continue a directory written with another configuration. Layers run in parallel with
``workers`` processes (``concurrent.futures.ProcessPoolExecutor``) or, with ``backend="ray"``,
as Ray tasks.

This module is longer than 700 lines because the per-layer pipeline, its artifacts, resume and
worker pool are one unit whose determinism and file layout are documented here together.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from baselines.link_balance import LB_METHODS, LB_OBJECTIVES, MappingObjective, link_balance
from baselines.node_balance.milp import NB_MODES, node_balance
from baselines.static import layer_placement, evaluate_hybrid, hybrid_layer
from hdamoe_env.noc import linksim
from hdamoe_env.cost import perf
from hdamoe_env.sim import sources
from hdamoe_env.sim.calibrate import fit_gamma
from hdamoe_env.config.cache import BoundedCache
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled, OutputPathError
from hdamoe_env.config.fileio import atomic_write, check_output_dir, write_json
from hdamoe_env.sim.placement import Placement, expert_parallel, identity_mapping, share_unit
from hdamoe_env.config.profiles import PROFILES, Conventions, get_profile
from hdamoe_env.sim.simulator import MoESimulator, is_tensor_parallel
from hdamoe_env.config.specs import (
    MODEL_PRESETS,
    HardwareSpec,
    ModelSpec,
    TopologySpec,
    get_model,
    hardware_from_setting,
)

__all__ = [
    "METHOD_NAMES",
    "PLACEMENT_FILE",
    "LayerOutcome",
    "PipelineResult",
    "PlaceConfig",
    "evaluate_layer",
    "load_trace",
    "parse_layers",
    "place_layer",
    "run_pipeline",
    "sweep_rho_mem",
]

log = logging.getLogger(__name__)

PLACEMENT_FILE = "placement.npz"
RUN_FILE = "run.json"
METHOD_NAMES = ("tp", "ep", "hybrid", "node_balance", "node_link")
BACKENDS = ("process", "ray")
_LAYER_RE = re.compile(r"^layer_(\d{3})\.(json|npz)$")


# --------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class PlaceConfig:
    """Everything that determines the placements of a run (hashed for ``resume``).

    Attributes:
        model: Model preset id or alias, or a ``ModelSpec`` (custom models need an explicit
            trace).
        mesh: (X, Y) node grid.
        setting: ``"TFLOPS/GBps"`` (e.g. ``"5/50"``).
        batch: Batch size of the optimisation and the static evaluation (128).
        topology: ``"mesh"``, ``"torus"`` or ``"fattree"``.
        trace: ``"synthetic"`` or a trace path (reference ``.json`` or canonical ``.npz``).
        trace_requests: Synthetic trace: number of requests (None = generator default).
        trace_seed: Synthetic trace seed (None = ``seed``).
        trace_skew: Synthetic trace: skew power τ of the expert popularity (1 = the fitted
            generator; ``traces.synthetic``). Left out of :meth:`to_dict` at 1, so the
            configuration hashes of runs made before the knob existed are unchanged.
        view: Trace view the statistics are mined from (``content``).
        conventions: Convention profile name or ``Conventions`` object (a derived profile is
            kept as is; resolved once, here).
        rho_mem: Relative memory cap ρ_mem of Node Balance, or None.
        nb_mode: ``"milp"`` or ``"heuristic"``.
        time_limit_s: Node-Balance MILP time limit per layer.
        mip_gap: Relative MIP gap.
        solver: ``"highs"``, ``"cbc"`` or None (auto).
        lb_method: ``"bo"``, ``"local"``, ``"anneal"`` or ``"random"``.
        bo_calls: Link-Balance evaluation budget (70).
        lb_objective: ``"des"`` or ``"mst"``.
        hybrid_time_limit_s: Time limit of the hybrid's region-balance MILP.
        hop_latency_ns: Per-hop latency of the NoC (None: the profile's ``hop_latency_s``).
        guard: ``"tp"`` (default): keep TP for a layer whose Node+Link placement the static
            evaluator finds slower than TP ([decision], module docstring); None: off.
        seed: Run seed.
    """

    model: str | ModelSpec
    mesh: tuple[int, int] = (4, 8)
    setting: str = "5/50"
    batch: int = 128
    topology: str = "mesh"
    trace: str = "synthetic"
    trace_requests: int | None = None
    trace_seed: int | None = None
    trace_skew: float = 1.0
    view: str = "content"
    conventions: str | Conventions = "faithful"
    rho_mem: float | None = None
    nb_mode: str = "milp"
    time_limit_s: float = 10.0
    mip_gap: float = 0.05
    solver: str | None = None
    lb_method: str = "bo"
    bo_calls: int = 70
    lb_objective: str = "des"
    hybrid_time_limit_s: float = 60.0
    hop_latency_ns: float | None = None
    guard: str | None = "tp"
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mesh", tuple(int(v) for v in self.mesh))
        object.__setattr__(self, "trace_skew", sources.check_trace_skew(self.trace_skew))
        if self.nb_mode not in NB_MODES:
            raise ConfigError(f"nb_mode={self.nb_mode!r}; expected one of {list(NB_MODES)}")
        if self.lb_method not in LB_METHODS:
            raise ConfigError(f"lb_method={self.lb_method!r}; expected one of {list(LB_METHODS)}")
        if self.lb_objective not in LB_OBJECTIVES:
            raise ConfigError(f"lb_objective={self.lb_objective!r}; expected one of "
                              f"{list(LB_OBJECTIVES)}")
        if self.batch < 1 or self.bo_calls < 1:
            raise ConfigError(f"batch and bo_calls must be >= 1, got {self.batch}, "
                              f"{self.bo_calls}")
        if self.guard not in (None, "tp"):
            raise ConfigError(f"guard={self.guard!r}; expected 'tp' or None")
        get_model(self.model)
        get_profile(self.conventions)                        # validates a name

    @property
    def conv(self) -> Conventions:
        """The conventions: the object itself when one was given, else the named profile.

        ``conventions`` keeps what the caller passed (a name stays a name in ``to_dict`` and in
        records, so cache keys are unchanged); a ``Conventions`` object, derived or not, is
        used as is and never looked up by name.
        """
        return get_profile(self.conventions)

    @property
    def model_spec(self) -> ModelSpec:
        """The model spec."""
        return get_model(self.model)

    @property
    def hardware(self) -> HardwareSpec:
        """The hardware spec."""
        return hardware_from_setting(self.setting, self.mesh, hop_latency_ns=self.hop_latency_ns)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict (model resolved to its preset id)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["mesh"] = list(self.mesh)
        if self.trace_skew == 1.0:  # the default stays out: cache keys of older runs hold
            del d["trace_skew"]
        spec = self.model_spec
        preset = MODEL_PRESETS.get(spec.key)
        d["model"] = spec.key if preset == spec else spec.to_dict()
        if isinstance(self.conventions, Conventions):          # a name stays a name
            conv = self.conventions
            d["conventions"] = conv.name if PROFILES.get(conv.name) == conv else conv.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlaceConfig:
        """Rebuild a configuration from :meth:`to_dict` output."""
        d = dict(data)
        d["mesh"] = tuple(d["mesh"])
        if isinstance(d["model"], dict):
            d["model"] = ModelSpec.from_dict(d["model"])
        if isinstance(d.get("conventions"), dict):
            d["conventions"] = Conventions.from_dict(d["conventions"])
        return cls(**d)

    def config_hash(self, trace_id: str) -> str:
        """Return a short SHA-256 of the configuration and the trace id."""
        payload = {"config": self.to_dict(), "trace_id": trace_id,
                   "conventions": self.conv.to_dict()["knobs_sha256"]}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def parse_layers(text: str | Sequence[int] | None, num_layers: int) -> tuple[int, ...]:
    """Parse a layer selection: None (all), ``"0-3"``, ``"0,2,5"`` or a mix ``"0-3,7"``.

    Raises:
        ConfigError: Malformed text or a layer outside [0, L).
    """
    if text is None:
        return tuple(range(num_layers))
    if not isinstance(text, str):
        layers = sorted({int(v) for v in text})
    else:
        layers_set: set[int] = set()
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            m = re.fullmatch(r"(\d+)\s*-\s*(\d+)|(\d+)", part)
            if not m:
                raise ConfigError(f"layers {text!r}: cannot parse {part!r}; expected e.g. "
                                  "'0-3' or '0,2,5'")
            if m.group(3) is not None:
                layers_set.add(int(m.group(3)))
            else:
                lo, hi = int(m.group(1)), int(m.group(2))
                if hi < lo:
                    raise ConfigError(f"layers {text!r}: empty range {part!r}")
                layers_set.update(range(lo, hi + 1))
        layers = sorted(layers_set)
    bad = [v for v in layers if not 0 <= v < num_layers]
    if bad or not layers:
        raise ConfigError(f"layers {text!r}: {bad or 'none selected'}; the model has MoE layers "
                          f"0..{num_layers - 1}")
    return tuple(layers)


def load_trace(config: PlaceConfig) -> Any:
    """Load the run's routing trace (``synthetic`` or a ``.json``/``.npz`` path).

    Raises:
        TraceFormatError: The trace file does not exist or is malformed.
    """
    seed = config.seed if config.trace_seed is None else config.trace_seed
    return sources.load_trace(config.trace, config.model_spec, seed=seed,
                              requests=config.trace_requests, skew=config.trace_skew)


# --------------------------------------------------------------------------------------------
# one layer


@dataclass(frozen=True)
class _LayerTask:
    config: dict[str, Any]
    config_hash: str
    layer: int
    freqs: NDArray[np.float64]
    groups: NDArray[np.int64]
    group_freqs: NDArray[np.float64]
    rows: NDArray[np.int64]
    ep_P: NDArray[np.float64]


@dataclass(frozen=True)
class LayerOutcome:
    """Result of one layer.

    Attributes:
        layer: MoE layer index.
        arrays: ``P`` [E, D] and ``pi`` [D] the final Node+Link placement (TP when the guard
            applied), ``P_nb`` [E, D] the Node-Balance shares, ``pi_lb`` [D] the Link-Balance
            mapping, ``pi0`` [D], ``P_hybrid`` [E, D], ``P_ep`` [E, D].
        record: JSON-serialisable record (γ fit, solver and optimiser records, latencies in µs,
            timings).
    """

    layer: int
    arrays: dict[str, NDArray[Any]]
    record: dict[str, Any]


#: Simulators by placement configuration (JSON). A pipeline run uses one, a reproduce grid a few
#: dozen, the whole test suite 10 (measured); 64 never evicts those working sets.
_SIM_CACHE: BoundedCache[str, MoESimulator] = BoundedCache(
    64, name="baselines.pipeline.simulators")


def _simulator(config: PlaceConfig) -> MoESimulator:
    key = json.dumps(config.to_dict(), sort_keys=True)
    sim = _SIM_CACHE.get(key)
    if sim is None:
        sim = MoESimulator(config.model_spec, config.hardware, TopologySpec(kind=config.topology),
                           config.conv)
        _SIM_CACHE.put(key, sim)
    return sim


def evaluate_layer(sim: MoESimulator, P_layer: NDArray[np.float64], pi_layer: NDArray[np.int64],
                   layer: int, freqs: NDArray[np.float64], groups: NDArray[np.int64],
                   group_freqs: NDArray[np.float64], batch: int, *, rng: np.random.Generator,
                   agg: NDArray[np.int64] | None = None) -> dict[str, Any]:
    """Evaluate one layer's placement with the static evaluator (§5.7).

    Returns:
        ``compute_us`` (t_comp), ``comm_us`` (t_comm_moe), ``total_us`` (their sum, the MoE
        latency), ``nm_us`` (t_nm), ``dispatch_us``, ``combine_us`` and ``mode``.
    """
    placement = layer_placement(P_layer, pi_layer, layer, "eval")
    res = sim.layer_static(placement, layer, freqs, groups, group_freqs, batch, rng=rng, agg=agg)
    return {"compute_us": res.t_comp_s * 1e6, "comm_us": res.t_comm_moe_s * 1e6,
            "total_us": (res.t_comp_s + res.t_comm_moe_s) * 1e6, "nm_us": res.t_nm_s * 1e6,
            "dispatch_us": res.t_dispatch_s * 1e6, "combine_us": res.t_combine_s * 1e6,
            "mode": res.mode}


def _layer_dram_budget(config: PlaceConfig) -> float | None:
    """[decision] With ``node_dram_gib`` set, every layer gets an equal share of each node's DRAM."""
    cap = config.hardware.node_dram_bytes
    return None if cap is None else cap / config.model_spec.num_moe_layers


def place_layer(task: _LayerTask) -> LayerOutcome:
    """Run the pipeline of §8.5 for one layer (module docstring); picklable for workers."""
    t_layer = time.perf_counter()
    cpu_layer = time.process_time()
    config = PlaceConfig.from_dict(task.config)
    sim = _simulator(config)
    model, hw, conv = sim.model, sim.hw, sim.conv
    layer, batch = task.layer, config.batch
    D = hw.num_nodes
    ss = np.random.SeedSequence(config.seed).spawn(model.num_moe_layers + 1)[layer]
    s_pi0, s_gamma, s_nb, s_lb, s_eval, s_hyb = ss.spawn(6)
    f, groups, fg = task.freqs, task.groups, task.group_freqs
    timings: dict[str, float] = {}

    pi0 = np.random.default_rng(s_pi0).permutation(D).astype(np.int64)
    t0 = time.perf_counter()
    ep_placement = layer_placement(task.ep_P, pi0, layer, "ep")
    gfit = fit_gamma(sim, ep_placement, layer, task.rows, batch, np.random.default_rng(s_gamma))
    gamma = max(float(gfit.gamma), 0.0)
    timings["gamma_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    nb = node_balance(f, groups, fg, model=model, hw=hw, conv=conv, gamma=gamma, batch=batch,
                      bw_end_Bps=sim.topology.bw_end_Bps, rho_mem=config.rho_mem,
                      node_dram_bytes=_layer_dram_budget(config), mode=config.nb_mode,
                      time_limit_s=config.time_limit_s, mip_gap=config.mip_gap,
                      solver=config.solver, seed=s_nb, ep_start=task.ep_P)
    P = nb.P_layer
    timings["node_balance_s"] = time.perf_counter() - t0

    eval_streams = s_eval.spawn(4)
    support = P > 0
    agg = None
    if conv.lb_noise == "crn":
        agg = linksim.choose_aggregators(groups, support, conv.aggregator,
                                         np.random.default_rng(eval_streams[0]))
    t0 = time.perf_counter()
    if is_tensor_parallel(P):
        pi = pi0.copy()
        lb_record: dict[str, Any] = {"optimiser": None, "skipped": "TP shares: every cluster "
                                     "holds every expert, the mapping does not matter"}
        lb_history: list[float] = []
    else:
        objective = MappingObjective(sim, support, groups, fg, batch, layer,
                                     np.random.default_rng(s_lb.spawn(1)[0]),
                                     kind=config.lb_objective, agg=agg)
        lb = link_balance(objective, pi0, sim.topology.endpoint_coords[:D],
                          method=config.lb_method, n_calls=config.bo_calls, seed=s_lb,
                          topology=sim.topology)
        pi = lb.pi
        lb_record, lb_history = lb.record, lb.history
    timings["link_balance_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    hyb = hybrid_layer(f, hw.mesh_shape, model.hybrid_regions,
                       time_limit_s=config.hybrid_time_limit_s, mip_gap=config.mip_gap,
                       solver=config.solver,
                       unit=None if conv.tile_cols == 1 else share_unit(model, conv))
    timings["hybrid_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    lat: dict[str, dict[str, Any]] = {}
    ev = eval_streams[1]
    lat["tp"] = evaluate_layer(sim, np.full_like(P, 1.0 / D), identity_mapping(1, D)[0], layer,
                               f, groups, fg, batch, rng=np.random.default_rng(ev))
    lat["ep"] = evaluate_layer(sim, task.ep_P, pi0, layer, f, groups, fg, batch,
                               rng=np.random.default_rng(ev))
    lat["hybrid"] = evaluate_hybrid(sim, hyb, layer, f, groups, fg, batch,
                                    rng=np.random.default_rng(eval_streams[2]),
                                    slip_support=support)
    lat["node_balance"] = evaluate_layer(sim, P, pi0, layer, f, groups, fg, batch,
                                         rng=np.random.default_rng(ev), agg=agg)
    lat["node_link"] = evaluate_layer(sim, P, pi, layer, f, groups, fg, batch,
                                      rng=np.random.default_rng(ev), agg=agg)
    guard: dict[str, Any] = {"kind": config.guard, "applied": False}
    P_final, pi_final = P, pi
    if config.guard == "tp" and lat["node_link"]["total_us"] > lat["tp"]["total_us"] + 1e-9:
        guard.update(applied=True, node_link_raw_us=lat["node_link"],
                     reason=f"Node+Link {lat['node_link']['total_us']:.3f} µs > TP "
                            f"{lat['tp']['total_us']:.3f} µs under the static evaluator: TP kept")
        P_final, pi_final = np.full_like(P, 1.0 / D), identity_mapping(1, D)[0]
        lat["node_link"] = dict(lat["tp"])
    timings["evaluation_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_layer
    timings["cpu_s"] = time.process_time() - cpu_layer     # wall time without contention
    best_baseline = min(lat[m]["total_us"] for m in ("tp", "ep", "hybrid"))
    record = {
        "layer": layer, "config_hash": task.config_hash, "run_seed": config.seed,
        "seed_spawn_key": list(ss.spawn_key), "num_groups": int(groups.shape[0]),
        "gamma": gfit.to_dict(), "node_balance": nb.record, "link_balance": lb_record,
        "link_balance_history_s": lb_history, "hybrid": hyb.record, "latency_us": lat,
        "node_link_beats_baselines": bool(lat["node_link"]["total_us"] <= best_baseline + 1e-9),
        "guard": guard,
        "timings_s": timings,
    }
    arrays = {"P": P_final, "pi": pi_final, "P_nb": P, "pi_lb": pi, "pi0": pi0,
              "P_hybrid": hyb.P_layer, "P_ep": task.ep_P}
    return LayerOutcome(layer, arrays, record)


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
    result = None
    for name, fname in (("node_link", PLACEMENT_FILE),
                        ("node_link_raw", "placement_node_link_raw.npz"),
                        ("node_balance", "placement_node_balance.npz"),
                        ("hybrid", "placement_hybrid.npz"), ("ep", "placement_ep.npz")):
        P, pi = arrays[name]
        pl = Placement(P=P, pi=pi, method=name, meta=common)
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
           ) -> list[_LayerTask]:
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
        tasks.append(_LayerTask(config.to_dict(), config_hash, layer, f,
                                np.asarray(g, dtype=np.int64), fg,
                                np.asarray(trace.topk_ids[layer, rows], dtype=np.int64), ep_P))
    return tasks


def _run_tasks(tasks: list[_LayerTask], workers: int, backend: str,
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


def spawn_pool_map(fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], workers: int,
                   done: Callable[[Any], None]) -> None:
    """Run ``fn(*args)`` for every ``args`` in ``calls`` in a spawn process pool.

    ``done`` gets each result in completion order; on an error or interruption the calls not
    started yet are cancelled, the running workers are terminated (within seconds) and the
    exception propagates. Workers exit by themselves when the parent dies (``kill -9``) (finished results were already
    handed to ``done``, so a resumable caller loses nothing). One BLAS/OpenMP thread per worker
    (dependencies.md §4), inherited by the children.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    ctx = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx,
                                                  initializer=_watch_parent,
                                                  initargs=(os.getpid(),))
    futures = [pool.submit(fn, *args) for args in calls]
    try:
        for fut in concurrent.futures.as_completed(futures):
            done(fut.result())
    except BaseException:
        # Ctrl-C or an error: drop the calls not started and stop the running workers now
        # (finished results were already handed to ``done``)
        for fut in futures:
            fut.cancel()
        _terminate_workers(pool)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _terminate_workers(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()


def _watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Pool-worker initializer: exit as soon as the parent process is gone (issue 15 #5).

    On Linux the kernel sends SIGKILL when the parent dies (``PR_SET_PDEATHSIG``); everywhere a
    daemon thread polls ``os.getppid()`` as well, so a ``kill -9`` of the parent never leaves
    workers blocked on their pipes.
    """
    import signal
    import sys
    import threading

    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)      # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:                            # died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="hdamoe-parent-watch", daemon=True).start()


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
    sim = _simulator(config)
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
            "config": config.to_dict(), "config_hash": config_hash, "evaluator": "static"}
    computed: list[int] = []

    def done(outcome: LayerOutcome) -> None:
        log.info("layer %d finished in %.1f s (%s)", outcome.layer,
                 outcome.record["timings_s"]["total_s"], outcome.record["node_balance"]["path"])
        _write_layer(out, outcome)
        outcomes[outcome.layer] = outcome
        computed.append(outcome.layer)
        _merge(out, outcomes, model, hw.num_nodes, meta)
        if on_layer is not None:
            on_layer(outcome)

    if todo:
        _run_tasks(_tasks(config, trace, todo, config_hash), workers, backend, done)
    placement = _merge(out, outcomes, model, hw.num_nodes, meta)
    return PipelineResult(placement, {l: outcomes[l] for l in sorted(outcomes)},
                          sorted(computed), skipped, out, time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# memory-cap sweep (paper Fig. 20)


def sweep_rho_mem(config: PlaceConfig, rho_values: Sequence[float | None],
                  out_dir: str | os.PathLike[str], *, layers: str | Sequence[int] | None = None,
                  workers: int = 1, backend: str = "process", resume: bool = False,
                  trace: Any = None, force: bool = False) -> list[dict[str, Any]]:
    """Sweep the memory cap ρ_mem (§7.3 (10), paper Fig. 20).

    For every ρ_mem the pipeline runs into ``out_dir/rho_<value>``; reported per value: the
    routed-expert DRAM bytes of every physical node summed over the placed layers (max and mean,
    and their ratio), and the TBT of the placed layers (Σ t_nm + MoE latency, static evaluator)
    for Node+Link Balance and TP, with the normalised TBT = TBT / TBT_TP.

    Returns:
        One dict per ρ_mem value.
    """
    if trace is None:
        trace = load_trace(config)
    model = config.model_spec
    conv = config.conv
    out = Path(out_dir)
    rows = []
    for rho in rho_values:
        cfg = dataclasses.replace(config, rho_mem=None if rho is None else float(rho))
        sub = out / ("rho_none" if rho is None else f"rho_{float(rho):g}")
        res = run_pipeline(cfg, sub, layers=layers, workers=workers, backend=backend,
                           resume=resume, trace=trace, force=force)
        placed = sorted(res.layers)
        P, pi = res.placement.P, res.placement.pi
        w_e = perf.expert_bytes(model, conv)
        dram = np.zeros(P.shape[2])
        for layer in placed:
            np.add.at(dram, pi[layer], P[layer].sum(axis=0) * w_e)
        tbt = sum(res.layers[l].record["latency_us"]["node_link"]["total_us"]
                  + res.layers[l].record["latency_us"]["node_link"]["nm_us"] for l in placed)
        tbt_tp = sum(res.layers[l].record["latency_us"]["tp"]["total_us"]
                     + res.layers[l].record["latency_us"]["tp"]["nm_us"] for l in placed)
        rows.append({"rho_mem": rho, "layers": placed,
                     "dram_max_gib": float(dram.max()) / 2**30,
                     "dram_mean_gib": float(dram.mean()) / 2**30,
                     "dram_max_over_mean": float(dram.max() / dram.mean()) if dram.mean() else 1.0,
                     "tbt_us": tbt, "tbt_tp_us": tbt_tp,
                     "normalised_tbt": tbt / tbt_tp if tbt_tp else float("nan"),
                     "out_dir": str(sub)})
    return rows
