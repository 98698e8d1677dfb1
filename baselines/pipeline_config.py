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
from dataclasses import dataclass
from typing import Any

from baselines.link_balance import LB_METHODS, LB_OBJECTIVES
from baselines.node_balance.milp import NB_MODES
from hdamoe_env.sim import sources
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.profiles import PROFILES, Conventions, get_profile
from hdamoe_env.config.specs import (
    MODEL_PRESETS,
    HardwareSpec,
    ModelSpec,
    get_model,
    hardware_from_setting,
)

__all__ = ["PlaceConfig", "load_trace", "parse_layers"]


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
            configuration hash of a run at τ = 1 has no skew entry.
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
            evaluator finds slower than TP ([decision], ``baselines.pipeline_layer``); None: off.
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
        records, so a named profile's cache key holds its name); a ``Conventions`` object,
        derived or not, is
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
        if self.trace_skew == 1.0:  # the default stays out of the hash (class docstring)
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
