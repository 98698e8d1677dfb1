"""The configuration of ``HdMoeEnv``: one frozen, validated spec of every constructor argument.

Implements the env arguments of paper-model.md §10–11 (online decisions: pre-broadcast budget,
dispatch rules, gating levels, predictors) on the model, hardware, topology and convention specs
of §2–4. ``EnvConfig`` resolves names at the boundary — the model preset, the hardware from
``setting``/``mesh``, the topology kind and the convention profile become spec objects — and
validates every argument that can be checked without loading the trace or the placement, with
the typed ``ConfigError``s of the env (style.md R2, R8). Nothing downstream looks a name up
again.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.config.errors import ConfigError, unknown_name
from hdamoe_env.config.profiles import Conventions
from hdamoe_env.config.run import RUN_DEFAULTS, RunSpec, check_seed
from hdamoe_env.config.specs import HardwareSpec, ModelSpec, TopologySpec
from hdamoe_env.decisions.gating import COMM_PENALTIES, COMP_PENALTIES
from hdamoe_env.decisions.dispatch import DISPATCH_RULES, REPLICA_RULES
from hdamoe_env.decisions.prediction import PREDICTORS
from hdamoe_env.sim.evaluator import FIDELITIES
from hdamoe_env.sim.placement import Placement
from hdamoe_env.sim.sources import check_skew_applies, load_trace
from traces import RoutingTrace, batching, synthetic

__all__ = ["ENV_REPLICA_RULES", "INVALID_ACTION_MODES", "PREDICTORS", "RENDER_MODES", "REWARDS",
           "RUN_FIELDS", "EnvConfig"]

#: The ``EnvConfig`` arguments that are the run's identity (``RunSpec``), not the env's own.
RUN_FIELDS = ("model", "setting", "mesh", "topology", "batch", "conventions", "trace",
              "trace_requests", "trace_skew")

INVALID_ACTION_MODES = ("raise", "coerce")
DUPLICATE_MODES = ("raise", "ignore")
RENDER_MODES = ("ansi", "rgb_array")
#: Reward objectives: the layer's latency, its energy, or their product (docs/PHYSICS.md §18).
REWARDS = ("latency", "energy", "edp")
#: Replica rules the env can offer: ``"shares"`` needs per-copy fractions, which the discrete
#: action does not carry.
ENV_REPLICA_RULES = tuple(r for r in REPLICA_RULES if r != "shares")


def _positive_int(name: str, value: Any, minimum: int, what: str) -> int:
    if isinstance(value, bool | np.bool_) or not (isinstance(value, int | np.integer)
                                                   and value >= minimum):
        raise ConfigError(f"{name} must be {what}, got {value!r}")
    return int(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise ConfigError(f"{name} must be True or False, got {value!r} "
                          f"({type(value).__name__})")
    return bool(value)


def _number(value: Any) -> bool:
    return (not isinstance(value, bool | np.bool_) and isinstance(value, int | float | np.number)
            and math.isfinite(float(value)))


def _gating_levels(value: Any) -> tuple[float, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
        raise ConfigError(f"gating_levels must be a sequence of numbers such as (0, 0.5, 1, 2), "
                          f"got {value!r}")
    if not all(_number(x) for x in value):
        raise ConfigError(f"gating_levels must hold finite numbers >= 0, got {list(value)!r}")
    levels = tuple(float(x) for x in value)
    if not levels or any(x < 0 for x in levels):
        raise ConfigError(f"gating_levels must be finite multipliers >= 0, got {levels}")
    if len(set(levels)) != len(levels):
        raise ConfigError(f"gating_levels {levels} repeat a level (two actions would be the "
                          "same); give each multiplier once")
    return levels


#: Options of the batching modes the env sets itself (not through ``batch_options``).
_ENV_BATCH_ARGS = ("trace", "B", "rng", "n_steps", "view")


def _batch_options(mode: str, value: Any) -> dict[str, Any] | None:
    """Check ``batch_options`` against the keyword arguments of the batching mode."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"batch_options must be None or a dict such as {{'cycle': False}}, got "
                          f"{value!r}")
    params = {name: p for name, p in inspect.signature(batching.BATCH_MODES[mode]).parameters
              .items() if name not in _ENV_BATCH_ARGS}
    options = {}
    for key, option in value.items():
        if key not in params:
            raise unknown_name(f"option of batching mode {mode!r}", key, params)
        default = params[key].default
        if isinstance(default, bool) and not isinstance(option, bool | np.bool_):
            raise ConfigError(f"batch_options[{key!r}] must be True or False, got {option!r}")
        options[str(key)] = bool(option) if isinstance(default, bool) else option
    return options


@dataclass(frozen=True)
class EnvConfig:
    """Every argument of ``HdMoeEnv``, resolved and validated: the one place each is documented.

    After construction ``model`` is a ``ModelSpec``, ``hardware`` a ``HardwareSpec`` (built from
    ``setting`` and ``mesh`` when not given), ``topology`` a ``TopologySpec`` and ``conventions``
    a ``Conventions`` object (a derived profile is kept as is); ``dispatch_rules`` and
    ``gating_levels`` are tuples. To change ``setting`` or ``mesh`` of an existing config with
    ``dataclasses.replace``, pass ``hardware=None`` too.

    Attributes:
        model, setting, mesh, topology, batch, conventions, trace, trace_requests, trace_skew:
            The run (model, chip, NoC, profile, B, trace): the arguments of
            ``hdamoe_env.config.run.RunSpec.resolve``, whose defaults and meaning are declared
            once in ``RUN_OPTIONS``; ``setting`` and ``mesh`` are ignored when ``hardware`` is
            given. ``EnvConfig.from_run(run, ...)`` takes an already resolved ``RunSpec``.
        placement: ``"tp"``, ``"tp-tiled"`` (tile-aligned TP), ``"ep"`` (seeded by
            ``placement_seed``), a ``Placement`` or a path to a placement ``.npz``
            (``hdamoe place``).
        steps_per_episode: Decode steps per episode.
        fidelity: ``"des"`` (default) or ``"analytic"`` (γ-calibrated twin; γ per layer is
            fitted lazily on the placement with ``calibrate.twin_gammas`` and cached).
        predictor: Next-layer predictor (§10.2): ``"noisy_oracle"`` (default targets of
            traces.md §7.6, or ``predictor_accuracy``), ``"oracle"``, ``"trace"`` (recorded
            ``pred_ids``) or ``"frequency"`` (long-term f_i·B).
        max_broadcast: Pre-broadcast slots in the action (k_b is capped by it).
        gating_levels: Multipliers of the default (r_comp, r_comm) of §11.7.
        dispatch_rules: Dispatch rules offered (subset of ``dispatch.DISPATCH_RULES``).
        reward_scale: None: reward = −latency / TP latency of the layer; a float s:
            −latency / s (seconds). ``reward="latency"`` only.
        reward: ``"latency"`` (default), ``"energy"`` (−energy / TP's energy of the layer) or
            ``"edp"`` (−(energy · latency) / (TP's energy · TP's latency) of the layer).
        render_mode: None, ``"ansi"`` (one line of text) or ``"rgb_array"`` (link heat map).
        hardware: Full ``HardwareSpec`` (overrides ``setting`` and ``mesh``).
        trace_tokens: Rows of the synthetic trace (default max(8192, 16·B)).
        trace_seed: Seed of the synthetic trace and of score synthesis.
        batch_mode: Decode-step formation (default: the profile's ``batch_mode``,
            ``"streams"``, cycling).
        batch_options: Extra options of the batching mode (e.g. ``{"cycle": False}`` for
            ``streams``, which can then run out of requests: the episode is truncated).
        view: Trace view (``"content"``).
        placement_seed: Seed of the EP placement.
        measure_twin_error: Also evaluate the other fidelity each step and report
            ``info["twin_error"]`` (relative error of the analytic twin vs the DES).
        gammas: γ per layer (skips the fit).
        gamma_seed: Seed of the γ fit.
        predictor_accuracy: Noisy-oracle accuracy (scalar or per layer).
        gating_coefficients: (r_comp, r_comm) at level 1 in the profile's units (default
            §11.7, r_comp divided by the profile's m).
        gating_protect_top: Never drop a token's m best original experts.
        gating_comp_penalty: ``"marginal_max"``, ``"host_finish"`` or ``"host_load_mean"``.
        gating_comm_penalty: ``"dispersion"`` or ``"new_nodes"``.
        gating_candidate_window: Only original ranks < k + J may enter.
        gating_include_future: Count later rows' original choices in the penalties.
        gating_streaming: Under the tile model (``faithful``), whether the computation penalty
            charges each node max(compute, weight streaming) as the evaluator does (True), or
            the tile-model compute alone (False, default: tile-padded tokens and columns,
            per-GEMM overhead; measured faster, docs/PHYSICS.md §4.1a); no effect under
            ``paper*`` (fluid penalty).
        k_b: Manual pre-broadcast slots (int, or one per layer) instead of the budget rule.
        bc_max_messages: Cap on DES messages of one layer's pre-broadcast.
        invalid_action: ``"coerce"`` (default: masked values become "none", duplicates
            count once, both listed in ``info["coerced"]``) or ``"raise"`` (strict
            ``InvalidAction``; see Action Space).
        duplicates: ``"raise"`` (default) or ``"ignore"``: with ``invalid_action="raise"``,
            whether an expert repeated in a later slot raises or counts once
            (``invalid_action="coerce"`` implies ``"ignore"``).
        flatten_replicas: Give ``replicas`` as a 1-D [E·D] vector (row-major) instead of
            [E, D]; SB3's ``check_env`` warns about 2-D observations.
        replica_rule: Default rule for the tokens of redundant experts (placements with
            ``replicas``; ``"least_loaded"``): index 0 of the replica-rule dimension.
        replica_rules: Replica rules offered in the action (``ENV_REPLICA_RULES`` =
            least_loaded, nearest, round_robin).
    """

    model: str | ModelSpec = RUN_DEFAULTS.model
    setting: str = RUN_DEFAULTS.setting
    mesh: str | tuple[int, int] = RUN_DEFAULTS.mesh
    topology: str | TopologySpec = RUN_DEFAULTS.topology
    batch: int = RUN_DEFAULTS.batch
    conventions: str | Conventions = RUN_DEFAULTS.conventions
    trace: str | RoutingTrace | Path = RUN_DEFAULTS.trace
    trace_requests: int | None = RUN_DEFAULTS.trace_requests
    placement: str | Placement | Path = "ep"
    steps_per_episode: int = 4
    fidelity: str = "des"
    predictor: str = "noisy_oracle"
    max_broadcast: int = 8
    gating_levels: Sequence[float] = (0.0, 0.5, 1.0, 2.0)
    dispatch_rules: Sequence[str] = ("least_loaded", "first", "home")
    reward_scale: float | None = None
    reward: str = "latency"
    render_mode: str | None = None
    hardware: HardwareSpec | None = None
    trace_tokens: int | None = None
    trace_seed: int = 0
    trace_skew: float = RUN_DEFAULTS.trace_skew
    batch_mode: str | None = None
    batch_options: dict[str, Any] | None = field(default=None, hash=False)
    view: str = "content"
    placement_seed: int = 0
    measure_twin_error: bool = False
    gammas: Sequence[float] | None = None
    gamma_seed: int = 0
    predictor_accuracy: float | Sequence[float] | None = None
    gating_coefficients: tuple[float, float] | None = None
    gating_protect_top: int = 0
    gating_comp_penalty: str = "marginal_max"
    gating_comm_penalty: str = "dispersion"
    gating_candidate_window: int | None = None
    gating_include_future: bool = False
    gating_streaming: bool = False
    k_b: int | Sequence[int] | None = None
    bc_max_messages: int = 20_000
    invalid_action: str = "coerce"
    duplicates: str = "raise"
    flatten_replicas: bool = False
    replica_rule: str = "least_loaded"
    replica_rules: Sequence[str] = ENV_REPLICA_RULES

    @classmethod
    def create(cls, **kwargs: Any) -> EnvConfig:
        """Return the configuration of keyword arguments, refusing unknown names.

        Raises:
            ConfigError: An unknown argument (with a near-miss suggestion) or an invalid value.
        """
        known = cls.field_names()
        for name in kwargs:
            if name not in known:
                raise unknown_name("HdMoeEnv argument", name, known)
        return cls(**kwargs)

    def replace(self, **kwargs: Any) -> EnvConfig:
        """Return a copy with ``kwargs`` changed (``dataclasses.replace``), refusing unknown names.

        Raises:
            ConfigError: An unknown argument or an invalid value.
        """
        known = self.field_names()
        for name in kwargs:
            if name not in known:
                raise unknown_name("HdMoeEnv argument", name, known)
        return dataclasses.replace(self, **kwargs)

    def __post_init__(self) -> None:  # noqa: C901 - one check per argument, in order
        set_ = object.__setattr__  # frozen: resolved values are set once, here
        for name in ("measure_twin_error", "gating_include_future", "gating_streaming",
                     "flatten_replicas"):
            set_(self, name, _flag(name, getattr(self, name)))
        if self.render_mode is not None and self.render_mode not in RENDER_MODES:
            raise unknown_name("render mode", self.render_mode, RENDER_MODES)
        if self.fidelity not in FIDELITIES:
            raise unknown_name("fidelity", self.fidelity, FIDELITIES)
        if self.predictor not in PREDICTORS:
            raise unknown_name("predictor", self.predictor, PREDICTORS)
        if self.invalid_action not in INVALID_ACTION_MODES:
            raise unknown_name("invalid_action mode", self.invalid_action, INVALID_ACTION_MODES)
        if self.duplicates not in DUPLICATE_MODES:
            raise unknown_name("duplicates mode", self.duplicates, DUPLICATE_MODES)
        _positive_int("steps_per_episode", self.steps_per_episode, 1, "a positive integer")
        _positive_int("max_broadcast", self.max_broadcast, 0, "an integer >= 0")
        for name in ("trace_seed", "placement_seed", "gamma_seed"):
            set_(self, name, check_seed(getattr(self, name), name))
        _positive_int("bc_max_messages", self.bc_max_messages, 1, "a positive integer")
        if self.gating_candidate_window is not None:
            _positive_int("gating_candidate_window", self.gating_candidate_window, 0,
                          "None or an integer >= 0")
        if self.trace_tokens is not None:
            _positive_int("trace_tokens", self.trace_tokens, 1,
                          "None (the default) or a positive integer")
        for name in ("dispatch_rules", "replica_rules"):
            value = getattr(self, name)
            if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not all(
                    isinstance(rule, str) for rule in value):
                raise ConfigError(f"{name} must be a sequence of rule names, got {value!r}")
        if not isinstance(self.replica_rule, str):
            raise ConfigError(f"replica_rule must be a rule name, got {self.replica_rule!r}")
        rules = tuple(self.dispatch_rules)
        if len(set(rules)) != len(rules):
            raise ConfigError(f"dispatch_rules {rules} repeat a rule; give each rule once")
        for rule in rules:
            if rule not in DISPATCH_RULES:
                raise unknown_name("dispatch rule", rule, DISPATCH_RULES)
        if not rules:
            raise ConfigError("dispatch_rules must name at least one rule")
        set_(self, "dispatch_rules", rules)
        for rule in (self.replica_rule, *self.replica_rules):
            if rule == "shares":
                raise ConfigError("replica rule 'shares' needs per-copy fractions, which the env's "
                                  "discrete action does not carry; use it through "
                                  "DecisionEvaluator.evaluate(replica_fractions=...) or pick one "
                                  f"of {list(ENV_REPLICA_RULES)}")
            if rule not in ENV_REPLICA_RULES:
                raise unknown_name("replica rule", rule, ENV_REPLICA_RULES)
        ordered = tuple(dict.fromkeys((self.replica_rule, *self.replica_rules)))
        set_(self, "replica_rules", ordered)
        set_(self, "gating_levels", _gating_levels(self.gating_levels))
        scale = self.reward_scale
        if scale is not None and not (_number(scale) and scale > 0):
            raise ConfigError(f"reward_scale must be None or a positive number of seconds, got "
                              f"{scale!r}")
        if not isinstance(self.reward, str) or self.reward not in REWARDS:
            raise unknown_name("reward", self.reward, REWARDS)
        if scale is not None and self.reward != "latency":
            raise ConfigError(f"reward_scale (seconds) applies to reward='latency' only; "
                              f"reward={self.reward!r} is normalised by TP's value of the layer")

        # names -> spec objects, once (RunSpec.resolve; spec objects pass through unchanged)
        run = RunSpec.resolve(model=self.model, setting=self.setting, mesh=self.mesh,
                              topology=self.topology, conventions=self.conventions,
                              batch=self.batch, trace=self.trace,
                              trace_requests=self.trace_requests, trace_skew=self.trace_skew,
                              hardware=self.hardware)
        for name in ("model", "hardware", "topology", "conventions", "batch", "trace_requests",
                     "trace_skew"):
            set_(self, name, getattr(run, name))
        check_skew_applies(self.trace, self.trace_skew)
        mode = self.resolved_batch_mode
        if mode not in batching.BATCH_MODES or mode == "random_rows_per_layer":
            raise unknown_name("batching mode", mode,
                               set(batching.BATCH_MODES) - {"random_rows_per_layer"})
        set_(self, "batch_options", _batch_options(mode, self.batch_options))
        if not isinstance(self.placement, Placement | str | Path):
            raise ConfigError(f"placement must be 'tp', 'tp-tiled', 'ep', a Placement or a "
                              f"path, got {self.placement!r}")

        L = self.model_spec.num_moe_layers
        if self.k_b is not None:
            try:
                raw = np.asarray(self.k_b)
            except (TypeError, ValueError):
                raw = np.asarray([], dtype=np.float64)        # refused just below
            if raw.dtype.kind not in "iu" or raw.ndim > 1 or raw.size not in (1, L):
                raise ConfigError(f"k_b must be an integer or one integer per layer (L={L}), "
                                  f"got {self.k_b!r}")
            manual = np.broadcast_to(raw.astype(np.int64), (L,))
            cap = min(self.max_broadcast, self.model_spec.num_experts)
            if (manual < 0).any() or (manual > cap).any():
                raise ConfigError(f"k_b must lie in [0, min(max_broadcast, E) = {cap}], got "
                                  f"{self.k_b!r}; raise max_broadcast or lower k_b")
        if self.gating_comp_penalty not in COMP_PENALTIES:
            raise unknown_name("computation penalty", self.gating_comp_penalty, COMP_PENALTIES)
        if self.gating_comm_penalty not in COMM_PENALTIES:
            raise unknown_name("communication penalty", self.gating_comm_penalty, COMM_PENALTIES)
        _positive_int("gating_protect_top", self.gating_protect_top, 0, "an integer >= 0")
        if self.gating_coefficients is not None and not (
                isinstance(self.gating_coefficients, Sequence)
                and len(self.gating_coefficients) == 2
                and all(_number(c) for c in self.gating_coefficients)):
            raise ConfigError(f"gating_coefficients must be None or two finite numbers "
                              f"(r_comp, r_comm), got {self.gating_coefficients!r}")
        if not 0 <= int(self.gating_protect_top) <= self.model_spec.top_k:
            raise ConfigError(f"gating_protect_top must lie in [0, k={self.model_spec.top_k}], "
                              f"got {self.gating_protect_top}")
        self.accuracies()                                  # validates predictor_accuracy
        if self.gammas is not None:
            try:
                g = np.asarray(self.gammas, dtype=np.float64)
            except (TypeError, ValueError):
                raise ConfigError(f"gammas must be numbers, one per layer (L={L}), got "
                                  f"{self.gammas!r}") from None
            if g.ndim == 1 and not (np.isfinite(g).all() and (g > 0).all()):
                raise ConfigError(f"gammas must be finite and > 0, got {g.tolist()}")
            if g.shape != (L,):
                raise ConfigError(f"gammas must have one value per layer (L={L}), got shape "
                                  f"{g.shape}")

    # ------------------------------------------------------------------ resolved views
    @classmethod
    def from_run(cls, run: RunSpec, **kwargs: Any) -> EnvConfig:
        """Return the configuration of ``run`` (already resolved) with further env arguments.

        Args:
            run: The run; its specs are used as they are (no name is looked up again).
            **kwargs: Any other ``EnvConfig`` argument (not one of the run's).

        Raises:
            ConfigError: ``kwargs`` repeats an argument of the run.
        """
        clash = sorted(set(kwargs) & {*RUN_FIELDS, "hardware"})
        if clash:
            raise ConfigError(f"{clash} are part of the run; change the RunSpec instead "
                              "(dataclasses.replace(run, ...)) or pass names without run=")
        return cls(model=run.model, setting=run.setting, mesh=run.mesh, topology=run.topology,
                   batch=run.batch, conventions=run.conventions, trace=run.trace,
                   trace_requests=run.trace_requests, trace_skew=run.trace_skew,
                   hardware=run.hardware, **kwargs)

    @property
    def run_spec(self) -> RunSpec:
        """The run this env simulates (model, chip, topology, profile, B, trace), resolved."""
        return RunSpec(model=self.model_spec, hardware=self.hardware_spec,
                       topology=self.topology_spec, conventions=self.conv, batch=int(self.batch),
                       setting=str(self.setting),
                       mesh="x".join(str(v) for v in self.hardware_spec.mesh_shape),
                       trace=self.trace, trace_requests=self.trace_requests,
                       trace_skew=self.trace_skew)

    @property
    def model_spec(self) -> ModelSpec:
        """The resolved model."""
        assert isinstance(self.model, ModelSpec)
        return self.model

    @property
    def hardware_spec(self) -> HardwareSpec:
        """The resolved hardware."""
        assert self.hardware is not None
        return self.hardware

    @property
    def topology_spec(self) -> TopologySpec:
        """The resolved topology."""
        assert isinstance(self.topology, TopologySpec)
        return self.topology

    @property
    def conv(self) -> Conventions:
        """The resolved conventions (profile object, possibly derived with overrides)."""
        assert isinstance(self.conventions, Conventions)
        return self.conventions

    @property
    def resolved_batch_mode(self) -> str:
        """``batch_mode``, or the profile's when None."""
        return self.batch_mode if self.batch_mode is not None else self.conv.batch_mode

    def load_trace(self) -> RoutingTrace:
        """Load the env's routing trace (the one place the env's trace defaults live).

        A synthetic trace has ``trace_requests`` requests (default 32) and ``trace_tokens``
        rows (default max(8192, 16·B)) and popularity skew ``trace_skew``; it records predicted
        sets only for the ``trace`` predictor. Files and ``RoutingTrace`` objects are returned
        as read.
        """
        return load_trace(self.trace, self.model_spec, seed=int(self.trace_seed),
                          requests=int(self.trace_requests or 32),
                          tokens=int(self.trace_tokens or max(8192, 16 * int(self.batch))),
                          predictor="noisy_oracle" if self.predictor == "trace" else None,
                          skew=self.trace_skew)

    def accuracies(self) -> NDArray[np.float64]:
        """Return the noisy-oracle accuracy per layer (entry 0 unused; traces.md §7.6).

        Raises:
            ConfigError: Wrong shape or a value outside [0, 1].
        """
        L = self.model_spec.num_moe_layers
        value = self.predictor_accuracy
        if value is None:
            return synthetic.default_oracle_accuracy(L)
        if isinstance(value, str | bytes | bool | np.bool_):
            raise ConfigError(f"predictor_accuracy must be None, a number in [0, 1] or one per "
                              f"layer, got {value!r}")
        try:
            acc = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            raise ConfigError(f"predictor_accuracy must be None, a number in [0, 1] or one per "
                              f"layer, got {value!r}") from None
        if acc.ndim == 0:
            acc = np.full(L, float(acc))
        elif acc.shape == (L - 1,):
            acc = np.concatenate(([np.nan], acc))
        elif acc.shape != (L,):
            raise ConfigError(f"predictor_accuracy must be a scalar or have L={L} (or L-1) "
                              f"values, got shape {acc.shape}")
        acc = acc.copy()
        acc[0] = np.nan
        if not np.isfinite(acc[1:]).all() or ((acc[1:] < 0) | (acc[1:] > 1)).any():
            raise ConfigError(f"predictor_accuracy must lie in [0, 1], got {acc[1:].tolist()}")
        return acc

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Return the names of every argument, in constructor order."""
        return tuple(f.name for f in fields(cls))
