"""Configuration of the offline placement pipeline: :class:`PlaceConfig`, layers and trace.

:class:`PlaceConfig` holds everything that determines the placements of a run of
``baselines.pipeline.run_pipeline`` and hashes it (:meth:`PlaceConfig.config_hash`, the key of
``resume``); :func:`parse_layers` reads a layer selection and :func:`load_trace` loads the run's
routing trace.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from baselines.link_balance import LB_METHODS, PLACE_OBJECTIVES
from baselines.node_balance.milp import NB_MODES
from hdamoe_env.sim import sources
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.profiles import Conventions
from hdamoe_env.config.run import RunFields, RunSpec, profile_key
from hdamoe_env.config.specs import ModelSpec

__all__ = ["GUARDS", "LB_OBJECTIVE_CHOICES", "PlaceConfig", "load_trace", "parse_layers"]

#: Per-layer guards of the pipeline (``PlaceConfig.guard``).
GUARDS = ("best", "tp", None)
#: What Link Balance scores a mapping with (``PlaceConfig.lb_objective``): ``des`` the DES of
#: the layer's static group task set (§8.2), ``steps`` the DES of the ``best`` guard's sampled
#: decode steps (``local_search.ScoredMapping``), ``mst`` the proxy, ``auto`` (default)
#: ``steps`` where the ``best`` guard runs (tile-model profiles) and ``des`` otherwise.
LB_OBJECTIVE_CHOICES = ("auto", "des", "steps", "mst")


@dataclass(frozen=True)
class PlaceConfig(RunFields):
    """Everything that determines the placements of a run (hashed for ``resume``).

    Build it with :meth:`create` from names or directly from a resolved ``RunSpec``. The run's
    ``batch`` is the batch size of the optimisation and of the static evaluation; its ``trace``
    is ``"synthetic"`` or a trace path (reference ``.json`` or canonical ``.npz``).

    Attributes:
        run: The run (``hdamoe_env.config.run.RunSpec``); custom models need an explicit trace.
        trace_seed: Synthetic trace seed (None = ``seed``).
        view: Trace view the statistics are mined from (``content``).
        rho_mem: Relative memory cap ρ_mem of Node Balance, or None.
        nb_mode: ``"milp"`` or ``"heuristic"``.
        time_limit_s: Node-Balance MILP time limit per layer.
        mip_gap: Relative MIP gap.
        solver: ``"highs"``, ``"cbc"`` or None (auto).
        lb_method: ``"bo"``, ``"local"``, ``"anneal"`` or ``"random"``.
        bo_calls: Link-Balance evaluation budget (70).
        lb_objective: One of :data:`LB_OBJECTIVE_CHOICES`; :attr:`lb_kind` is the one used.
        hybrid_time_limit_s: Time limit of the hybrid's region-balance MILP.
        hop_latency_ns: Per-hop latency of the NoC (None: the profile's ``hop_latency_s``);
            the run's hardware carries it (``create`` puts it there).
        guard: ``"best"`` (default): score Node + Link Balance, TP, tile-aligned TP, EP and the
            hybrid on sampled decode steps with the evaluator, warm-start a tile local search
            from the best of them and keep the layer no slower than any
            (``baselines.node_balance.local_search``); ``paper*`` profiles apply ``"tp"``
            instead, so that their Node+Link stays the paper's; ``"tp"``: keep TP for a layer
            whose Node+Link placement the static evaluator finds slower than TP; None: off.
        score_steps: Sampled decode steps the ``best`` guard scores every candidate on.
        ls_moves: Move budget of the tile local search (``best`` guard).
        objective: What the placement minimises: ``"latency"`` (default, the paper's MoE
            latency), ``"energy"`` or ``"edp"`` (docs/PHYSICS.md §18). It enters Link Balance
            (``MappingObjective(objective=)``, ``des`` only) and the ``best`` guard's choice
            among its candidates; Node Balance's MILP / heuristic and the ``tp`` guard stay
            latency-driven. Left out of :meth:`to_dict` (and so of the hash) under
            ``latency``, so latency placements keep their cache keys.
        seed: Run seed.
    """

    run: RunSpec = field(default_factory=RunSpec.resolve)
    trace_seed: int | None = None
    view: str = "content"
    rho_mem: float | None = None
    nb_mode: str = "milp"
    time_limit_s: float = 10.0
    mip_gap: float = 0.05
    solver: str | None = None
    lb_method: str = "bo"
    bo_calls: int = 70
    lb_objective: str = "auto"
    hybrid_time_limit_s: float = 60.0
    hop_latency_ns: float | None = None
    guard: str | None = "best"
    score_steps: int = 16
    ls_moves: int = 1000
    objective: str = "latency"
    seed: int = 0
    hardware_fields = ("hop_latency_ns",)

    def __post_init__(self) -> None:
        if not isinstance(self.run, RunSpec):
            raise ConfigError(f"run must be a RunSpec (RunSpec.resolve(...)), got "
                              f"{type(self.run).__name__}; or use PlaceConfig.create(**names)")
        if not isinstance(self.run.trace, str):
            raise ConfigError(f"the placement pipeline names its trace: 'synthetic' or a path, "
                              f"got {type(self.run.trace).__name__}; pass trace=<label> and "
                              "the loaded trace to run_pipeline(trace=...)")
        if self.run.hardware.hop_latency_ns != self.hop_latency_ns:
            raise ConfigError(f"hop_latency_ns={self.hop_latency_ns!r} but the run's hardware "
                              f"has {self.run.hardware.hop_latency_ns!r}; build the config "
                              "with PlaceConfig.create(..., hop_latency_ns=...)")
        if self.nb_mode not in NB_MODES:
            raise ConfigError(f"nb_mode={self.nb_mode!r}; expected one of {list(NB_MODES)}")
        if self.lb_method not in LB_METHODS:
            raise ConfigError(f"lb_method={self.lb_method!r}; expected one of {list(LB_METHODS)}")
        if self.lb_objective not in LB_OBJECTIVE_CHOICES:
            raise ConfigError(f"lb_objective={self.lb_objective!r}; expected one of "
                              f"{list(LB_OBJECTIVE_CHOICES)}")
        if self.bo_calls < 1:
            raise ConfigError(f"bo_calls must be >= 1, got {self.bo_calls}")
        if self.guard not in GUARDS:
            raise ConfigError(f"guard={self.guard!r}; expected one of {list(GUARDS)}")
        if self.objective not in PLACE_OBJECTIVES:
            raise ConfigError(f"objective={self.objective!r}; expected one of "
                              f"{list(PLACE_OBJECTIVES)}")
        if self.objective != "latency" and self.lb_objective == "mst":
            raise ConfigError(f"objective={self.objective!r} needs a simulated Link-Balance "
                              f"objective (lb_objective 'auto', 'des' or 'steps'); the mst "
                              "proxy scores latency only")
        if self.score_steps < 1 or self.ls_moves < 0:
            raise ConfigError(f"score_steps must be >= 1 and ls_moves >= 0, got "
                              f"{self.score_steps} and {self.ls_moves}")

    @property
    def lb_kind(self) -> str:
        """The Link-Balance objective used: ``des``, ``steps`` or ``mst`` (``auto`` resolved).

        [decision] ``auto`` is ``steps`` where the ``best`` guard runs (its sampled decode
        steps judge the layer, and a 256-expert layer's group task set costs ~1 s per DES run
        against ~30 ms for the steps), ``des`` under ``paper*`` profiles (their pipeline is the
        paper's, §8.2) and without the ``best`` guard.
        """
        if self.lb_objective != "auto":
            return self.lb_objective
        return "steps" if self.guard == "best" and not self.conv.is_paper else "des"

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict (model resolved to its preset id, run flattened)."""
        run = self.run
        d: dict[str, Any] = {
            "model": run.model_key(), "mesh": list(run.mesh_shape), "setting": run.setting,
            "batch": run.batch, "topology": run.topology.kind, "trace": run.trace,
            "trace_requests": run.trace_requests, "trace_seed": self.trace_seed}
        if run.trace_skew != 1.0:  # τ = 1 stays out (CHANGELOG: compatibility)
            d["trace_skew"] = run.trace_skew
        d["view"] = self.view
        d["conventions"] = profile_key(run.conventions)
        own = [f.name for f in dataclasses.fields(self)]
        for name in own[own.index("rho_mem"):]:
            if name == "objective" and self.objective == "latency":
                continue        # latency placements keep the hashes they had without an objective
            d[name] = getattr(self, name)
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
        return cls.create(**d)

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
