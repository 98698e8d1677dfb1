"""One run configuration: what a run simulates, declared once and resolved once.

A run is one MoE model (paper-model.md §2) on one chip (§3: a compute/bandwidth setting and an
X×Y node grid) joined by one NoC topology, under one convention profile (§4), at one batch size
B, reading one routing trace. Every command and every Python entry point that simulates a run
(the env, the bench, the placement store, the placement pipeline) takes these as one frozen
:class:`RunSpec`, built by :meth:`RunSpec.resolve` at the boundary: the model preset, the
setting and mesh, the topology kind and the profile name are looked up there once, and nothing
downstream looks a name up again.

Each option of a run is declared once, in :data:`RUN_OPTIONS`: its Python keyword, its
command-line flag, its default and its help text. The defaults of every configuration class
(``EnvConfig``, ``BenchConfig``, ``StoreConfig``, ``PlaceConfig``) and the command-line options
of every ``hdamoe`` command are taken from there; :func:`check_batch` is the one validation of
the batch size (defined beside the decode-step formers in ``traces.batching``, the bottom
layer, and re-exported here).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from hdamoe_env.config import limits
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.profiles import PROFILES, Conventions, get_profile
from hdamoe_env.config.specs import (MODEL_PRESETS, TOPOLOGY_KINDS, HardwareSpec, ModelSpec,
                                     TopologySpec, get_model, hardware_from_setting, parse_mesh)
from traces import synthetic
from traces.batching import check_batch

__all__ = ["RUN_DEFAULTS", "RUN_OPTIONS", "RunFields", "RunOption", "RunSpec", "check_batch",
           "check_hardware", "check_run_memory", "check_seed", "check_trace_requests",
           "check_trace_skew", "mesh_label", "profile_key"]


def _parse_batch(text: str) -> int:
    """Command-line text of ``--batch`` -> B, checked by :func:`check_batch`."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ConfigError(f"batch {text!r} is not an integer; expected tokens per decode step "
                          "B >= 1, e.g. 128") from None
    return check_batch(value)


def check_trace_skew(value: Any) -> float:
    """Return the trace skew τ as a float, or raise ``ConfigError`` if not finite and > 0.

    Args:
        value: The skew power τ (1 = the fitted synthetic popularity).

    Raises:
        ConfigError: Not a number, not finite, or <= 0 (the message names the value and a fix).
    """
    if isinstance(value, bool | np.bool_):
        raise ConfigError(f"trace_skew must be a finite number > 0, got {value!r}")
    try:
        skew = synthetic.check_skew(value)
    except ValueError as exc:
        raise ConfigError(f"trace_skew: {exc}; e.g. trace_skew=1.5 (sharper) or 0.5 "
                          "(flatter)") from None
    return limits.check_bound("trace_skew", skew, limits.SKEW_RANGE,
                              "e.g. trace_skew=1.5 (sharper) or 0.5 (flatter)")


def check_seed(value: Any, name: str = "seed") -> int:
    """Return a seed as an ``int``, or raise ``ConfigError`` if it is not one.

    A seed is a non-negative integer up to ``limits.SEED_MAX`` (Python ``int`` or a NumPy
    integer); booleans, floats (even integral ones) and text are refused rather than converted.

    Args:
        value: The seed received.
        name: What it is, for the message (``"seed"``, ``"--seeds"``, ``"trace_seed"``).

    Raises:
        ConfigError: Not an integer, negative, or larger than ``SEED_MAX``.
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise ConfigError(f"{name} must be an integer in [0, {limits.SEED_MAX}], got "
                          f"{value!r} ({type(value).__name__}); e.g. 0")
    if not 0 <= int(value) <= limits.SEED_MAX:
        raise ConfigError(f"{name}={int(value)} is outside [0, {limits.SEED_MAX}]; use a "
                          "non-negative 32-bit integer, e.g. 0")
    return int(value)


def check_hardware(hw: HardwareSpec) -> HardwareSpec:
    """Return ``hw`` when every value lies in its ``limits.HARDWARE_BOUNDS`` range.

    Raises:
        ConfigError: A value outside its physically meaningful range, or a mesh larger than
            ``limits.MAX_MESH_SIDE`` per side / ``limits.MAX_MESH_NODES`` in total.
    """
    rows, cols = hw.mesh_shape
    if max(rows, cols) > limits.MAX_MESH_SIDE or rows * cols > limits.MAX_MESH_NODES:
        raise ConfigError(f"mesh {rows}x{cols} is larger than the simulator supports (at most "
                          f"{limits.MAX_MESH_SIDE} per side and {limits.MAX_MESH_NODES} nodes); "
                          "use a smaller mesh, e.g. 4x8")
    for name, bound in limits.HARDWARE_BOUNDS.items():
        value = getattr(hw, name)
        if value is not None:
            limits.check_bound(name, value, bound, f"give {name} in {bound.unit}")
    return hw


def check_run_memory(model: ModelSpec, hw: HardwareSpec, batch: int) -> None:
    """The memory pre-flight of a run (the same estimate as the command line's).

    Raises:
        ResourceLimitError: The decode batch or the NoC tables need more memory than is
            available (the message has the estimate and a fix).
    """
    nodes = hw.num_nodes
    need = (limits.batch_bytes(batch, model.num_experts, model.top_k, nodes)
            + limits.mesh_bytes(nodes))
    limits.check_fits(need, f"a decode batch of {batch} tokens ({model.key}, "
                      f"{hw.mesh_shape[0]}x{hw.mesh_shape[1]} nodes)",
                      "use a smaller batch (--batch) or mesh (--mesh)")


def check_trace_requests(value: Any) -> int | None:
    """Return the synthetic trace's request count (None = the generator's default).

    Raises:
        ConfigError: Not None and not an integer >= 1.
    """
    if value is None:
        return None
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer) or value < 1:
        raise ConfigError(f"trace_requests must be None (the default) or a positive integer, "
                          f"got {value!r}")
    return int(value)


def mesh_label(mesh: str | tuple[int, int]) -> str:
    """Return the canonical ``"XxY"`` label of a mesh given as text or a pair."""
    rows, cols = parse_mesh(mesh)
    return f"{rows}x{cols}"


@dataclass(frozen=True)
class RunOption:
    """One option of a run: declared once, used by every configuration and command.

    Attributes:
        name: Python keyword (``RunSpec.resolve`` argument and configuration field).
        flag: Command-line flag.
        default: Default value (what every configuration and command starts from).
        help: Help text of the command-line option.
        parse: Command-line text -> value; raises ``ConfigError`` (None: keep the text).
        choices: Allowed values on the command line, or None.
        metavar: Command-line metavariable, or None.
    """

    name: str
    flag: str
    default: Any
    help: str
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


def _parse_requests(text: str) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ConfigError(f"requests {text!r} is not an integer; expected e.g. 32") from None
    check_trace_requests(value)
    return value


#: Every option of a run, in the order commands list them. Defaults and help live here only.
RUN_OPTIONS: dict[str, RunOption] = {opt.name: opt for opt in (
    RunOption("model", "--model", "deepseek-v2-lite",
              f"model preset: {', '.join(MODEL_PRESETS)}"),
    RunOption("setting", "--setting", "5/50", "TFLOPS per node / GB/s per link"),
    RunOption("mesh", "--mesh", "4x8", "node grid XxY (fat-tree: the XxY endpoint grid)"),
    RunOption("topology", "--topology", "mesh", "NoC topology", choices=TOPOLOGY_KINDS),
    RunOption("conventions", "--conventions", "faithful",
              f"convention profile: {', '.join(sorted(PROFILES))}, or a derived one such as "
              "faithful+b_psum=4 (any knob of docs/PHYSICS.md)"),
    RunOption("batch", "--batch", 128, "tokens per decode step B", parse=_parse_batch),
    RunOption("trace", "--trace", "synthetic", "'synthetic' or a trace path"),
    RunOption("trace_requests", "--requests", None,
              "synthetic trace: number of requests (default: the generator's, 32)",
              parse=_parse_requests),
    RunOption("trace_skew", "--trace-skew", 1.0,
              "synthetic trace: skew power τ of the expert popularity (p ← p^τ; >1 sharper, "
              "<1 flatter)", parse=check_trace_skew, metavar="TAU"),
)}


class _Defaults:
    """Attribute access to the default of every run option (``RUN_DEFAULTS.batch``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return RUN_OPTIONS[name].default
        except KeyError:
            raise AttributeError(name) from None


#: ``RUN_DEFAULTS.batch`` etc.: the defaults of :data:`RUN_OPTIONS`, for dataclass fields.
RUN_DEFAULTS = _Defaults()


@dataclass(frozen=True)
class RunSpec:
    """One run, resolved: specs for the physics, labels for records and cache keys.

    Build it with :meth:`resolve`; its fields are never names to look up again.

    Attributes:
        model: The model.
        hardware: The chip (setting and mesh, plus any hardware overrides).
        topology: The NoC topology.
        conventions: The convention profile (possibly derived).
        batch: Tokens per decode step B.
        setting: The setting label ``"TFLOPS/GBps"`` as given.
        mesh: The canonical mesh label ``"XxY"``.
        trace: ``"synthetic"``, a trace path or a loaded ``RoutingTrace``.
        trace_requests: Requests of a synthetic trace (None: the generator's default).
        trace_skew: Skew power τ of a synthetic trace's expert popularity (1 = fitted).
    """

    model: ModelSpec
    hardware: HardwareSpec
    topology: TopologySpec
    conventions: Conventions
    batch: int
    setting: str
    mesh: str
    trace: Any = RUN_DEFAULTS.trace
    trace_requests: int | None = RUN_DEFAULTS.trace_requests
    trace_skew: float = RUN_DEFAULTS.trace_skew

    @classmethod
    def resolve(cls, *, model: str | ModelSpec = RUN_DEFAULTS.model,
                setting: str = RUN_DEFAULTS.setting,
                mesh: str | tuple[int, int] = RUN_DEFAULTS.mesh,
                topology: str | TopologySpec = RUN_DEFAULTS.topology,
                conventions: str | Conventions = RUN_DEFAULTS.conventions,
                batch: int = RUN_DEFAULTS.batch, trace: Any = RUN_DEFAULTS.trace,
                trace_requests: int | None = RUN_DEFAULTS.trace_requests,
                trace_skew: float = RUN_DEFAULTS.trace_skew,
                hardware: HardwareSpec | None = None,
                hardware_overrides: Mapping[str, Any] | None = None) -> RunSpec:
        """Resolve the names of a run into specs, once, and validate every value.

        Args:
            model: Model preset id or alias, or a ``ModelSpec``.
            setting: ``"TFLOPS/GBps"`` (ignored for the physics when ``hardware`` is given).
            mesh: ``"XxY"`` or (X, Y) (likewise).
            topology: ``"mesh"``, ``"torus"``, ``"fattree"`` or a ``TopologySpec``.
            conventions: Profile name (derived names included) or ``Conventions``.
            batch: Tokens per decode step B (an integer >= 1).
            trace: ``"synthetic"``, a trace path or a ``RoutingTrace``.
            trace_requests: Requests of a synthetic trace (None: the generator's default).
            trace_skew: Skew power τ of a synthetic trace (finite, > 0).
            hardware: A complete ``HardwareSpec`` (the setting and mesh then only label it).
            hardware_overrides: Further ``HardwareSpec`` fields for the setting's hardware
                (e.g. ``hop_latency_ns``, ``node_dram_gib``).

        Raises:
            ConfigError: An unknown name or an invalid value (the message names it and a fix).
        """
        if hardware is None:
            if not isinstance(hardware_overrides, Mapping | None):
                raise ConfigError(f"hardware_overrides must be a mapping, got "
                                  f"{type(hardware_overrides).__name__}")
            known = {f.name for f in dataclasses.fields(HardwareSpec)} - {
                "mesh_shape", "compute_tflops", "link_bw_gbps"}
            unknown = sorted(map(str, set(hardware_overrides or {}) - known))
            if unknown:
                raise ConfigError(f"hardware overrides {unknown} are not allowed (compute and "
                                  "link bandwidth come from setting, the grid from mesh); "
                                  f"expected some of {sorted(known)}")
            hardware = hardware_from_setting(setting, mesh, **dict(hardware_overrides or {}))
        elif not isinstance(hardware, HardwareSpec):
            raise ConfigError(f"hardware must be a HardwareSpec or None, got "
                              f"{type(hardware).__name__}")
        else:
            mesh = hardware.mesh_shape
        check_hardware(hardware)
        topo = topology if isinstance(topology, TopologySpec) else TopologySpec(kind=topology)
        if not isinstance(trace, str | os.PathLike) and not hasattr(trace, "trace_id"):
            raise ConfigError(f"trace must be 'synthetic', a RoutingTrace or a path, got "
                              f"{type(trace).__name__}")
        if isinstance(trace, str) and not trace.strip():
            raise ConfigError("trace is empty; expected 'synthetic' or a trace path")
        spec = cls(model=get_model(model), hardware=hardware, topology=topo,
                   conventions=get_profile(conventions), batch=check_batch(batch),
                   setting=str(setting), mesh=mesh_label(mesh), trace=trace,
                   trace_requests=check_trace_requests(trace_requests),
                   trace_skew=check_trace_skew(trace_skew))
        check_run_memory(spec.model, spec.hardware, spec.batch)
        return spec

    @property
    def profile(self) -> str:
        """The profile's name (a derived profile's name records its overrides)."""
        return self.conventions.name

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """The node grid (X, Y)."""
        return parse_mesh(self.mesh)

    @property
    def trace_label(self) -> str:
        """``"synthetic"``, the trace path, or ``"trace:<id>"`` for a loaded trace."""
        if isinstance(self.trace, str | os.PathLike):
            return str(self.trace)
        return f"trace:{getattr(self.trace, 'trace_id', '?')[:12]}"

    def model_key(self) -> str | dict[str, Any]:
        """The model as a key: its preset id, or its whole spec when it is not a preset."""
        return (self.model.key if MODEL_PRESETS.get(self.model.key) == self.model
                else self.model.to_dict())


class RunFields:
    """Read-through properties of a configuration that holds its run in a ``run`` field.

    ``BenchConfig``, ``StoreConfig`` and ``PlaceConfig`` compose a :class:`RunSpec` instead of
    repeating its fields; this mixin gives them the run's values under the names their records
    and cache keys use (labels as text, specs as objects).
    """

    run: RunSpec
    #: Fields of the configuration that are also hardware overrides of its run.
    hardware_fields: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def create(cls, **kwargs: Any) -> Any:
        """Return a configuration from names: the run's options and the class's own fields.

        Args:
            **kwargs: Any ``RunSpec.resolve`` argument (``model``, ``setting``, ``mesh``,
                ``topology``, ``conventions``, ``batch``, ``trace``, ``trace_requests``,
                ``trace_skew``) and any field of the class.

        Raises:
            ConfigError: An unknown name or an invalid value.
        """
        run_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in RUN_OPTIONS}
        overrides = {k: kwargs[k] for k in cls.hardware_fields if k in kwargs}
        return cls(run=RunSpec.resolve(**run_kwargs, hardware_overrides=overrides), **kwargs)

    def with_run(self, **changes: Any) -> Any:
        """Return a copy whose run has ``changes`` (resolved run fields, e.g. ``trace=...``)."""
        return dataclasses.replace(self, run=dataclasses.replace(self.run, **changes))

    @property
    def model_spec(self) -> ModelSpec:
        """The model."""
        return self.run.model

    @property
    def hardware(self) -> HardwareSpec:
        """The chip."""
        return self.run.hardware

    @property
    def conv(self) -> Conventions:
        """The convention profile."""
        return self.run.conventions

    @property
    def setting(self) -> str:
        """The setting label ``"TFLOPS/GBps"``."""
        return self.run.setting

    @property
    def mesh(self) -> str:
        """The mesh label ``"XxY"``."""
        return self.run.mesh

    @property
    def topology(self) -> str:
        """The topology kind."""
        return self.run.topology.kind

    @property
    def batch(self) -> int:
        """Tokens per decode step B."""
        return self.run.batch

    @property
    def conventions(self) -> str:
        """The profile's name (a derived profile's name records its overrides)."""
        return self.run.profile

    @property
    def trace(self) -> Any:
        """``"synthetic"``, a trace path, or a loaded ``RoutingTrace``."""
        return self.run.trace

    @property
    def trace_requests(self) -> int | None:
        """Requests of the synthetic trace (None: the generator's default)."""
        return self.run.trace_requests

    @property
    def trace_skew(self) -> float:
        """Skew power τ of the synthetic trace."""
        return self.run.trace_skew

    @property
    def trace_label(self) -> str:
        """``"synthetic"``, the trace path, or ``"trace:<id>"`` for a loaded trace."""
        return self.run.trace_label


def profile_key(conv: Conventions) -> str | dict[str, Any]:
    """Return a profile as a key: its name when the name resolves to it, else its knobs.

    Registered profiles and derived profiles made by name (``"faithful+b_psum=4"``) are keyed
    by name; a ``Conventions`` object edited by hand keeps its name but not its knobs, so it is
    keyed by its whole ``to_dict``.
    """
    if PROFILES.get(conv.name) == conv:
        return conv.name
    if "+" in conv.name:
        try:
            if get_profile(conv.name) == conv:
                return conv.name
        except ConfigError:
            pass
    return conv.to_dict()
