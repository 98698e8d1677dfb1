"""hdamoe-env: MoE inference on 3D near-memory processing (HDA-MoE), as a simulator and an RL env.

Core public API (the simulator knows nothing of RL; see README and docs/):

* specs: ``ModelSpec``, ``HardwareSpec``, ``TopologySpec``, ``MODEL_PRESETS``,
  ``HARDWARE_PRESETS``;
* conventions: ``Conventions``, ``PROFILES`` (``faithful`` default, ``paper``, ``paper-hd``);
* placements: ``Placement``, ``tensor_parallel``, ``expert_parallel``;
* simulation: ``MoESimulator``, ``hdamoe_env.noc.des.simulate_messages`` (explicit
  message lists on any topology);
* environment: ``gymnasium.make("hdamoe_env/HdMoE-v1", ...)`` (``hdamoe_env.env.environment.HdMoeEnv``),
  registered at import with a string entry point (the env module is imported only on ``make``);
  variants ``hdamoe_env/HdMoE-analytic-v1`` and ``hdamoe_env/HdMoE-Mixtral-v1``
  (``REGISTERED_ENVS``); the placement env ``hdamoe_env/HdMoE-Place-v1``
  (``hdamoe_env.env.place.HdMoePlaceEnv``, ``PLACE_ENVS``); the drift env
  ``hdamoe_env/HdMoE-Drift-v1`` (``hdamoe_env.env.drift.HdMoeDriftEnv``, ``DRIFT_ENVS``); ``gymnasium.make_vec(id, num_envs=N,
  vectorization_mode="vector_entry_point")`` gives the batched ``hdamoe_env.env.vector.HdMoeVectorEnv``;
  the retired -v0 ids raise a ``ConfigError`` naming -v1 (``hdamoe_env.env.versions``).

May import: hdamoe_env.config, hdamoe_env.sim (re-exports only; the env module is named by
its string entry point and imported on ``make``)
"""

from __future__ import annotations

from hdamoe_env.config.errors import (ConfigError, DependencyNotInstalled, HdMoeError, InfeasibleError,
                                      InvalidAction, SolverError, TraceFormatError)
from hdamoe_env.sim.placement import Placement, expert_parallel, tensor_parallel
from hdamoe_env.config.profiles import PROFILES, Conventions, get_profile
from hdamoe_env.config.specs import (HARDWARE_PRESETS, MODEL_PRESETS, HardwareSpec, ModelSpec,
                                     TopologySpec, get_model, hardware_from_setting)

__version__ = "0.1.0"

import gymnasium as _gymnasium  # noqa: E402 - registration needs the package metadata above

#: Registered ids -> (kwargs, max_episode_steps). An episode is steps_per_episode (4) decode
#: steps × L MoE layers; the env terminates itself there, and the TimeLimit of a variant (whose
#: model is fixed) says the same. The base id takes any model through kwargs, so it has none.
#: Real traces are not registered: they live outside the package (pass ``trace=PATH``).
#: Every id has the single env (``ENTRY_POINT``) and the batched vector env
#: (``VECTOR_ENTRY_POINT``: ``gymnasium.make_vec(id, num_envs=N,
#: vectorization_mode="vector_entry_point")``). The -v0 ids are retired (docs/ENV.md, Versions):
#: ``make`` raises a ``ConfigError`` naming the -v1 id.
REGISTERED_ENVS: dict[str, tuple[dict[str, object], int | None]] = {
    "hdamoe_env/HdMoE-v1": ({}, None),
    # DeepSeek-V2-Lite (L = 26) on the γ-calibrated analytic twin: ~3x faster steps
    "hdamoe_env/HdMoE-analytic-v1": ({"fidelity": "analytic"}, 4 * 26),
    # Mixtral-8x7B (L = 32, E = 8, top-2) on a synthetic Mixtral-like trace
    "hdamoe_env/HdMoE-Mixtral-v1": ({"model": "mixtral-8x7b"}, 4 * 32),
}
ENTRY_POINT = "hdamoe_env.env.environment:HdMoeEnv"
#: The placement env: one episode builds one MoE layer's placement, one expert per
#: step (E steps; the env terminates itself). Single env only (no vector entry point).
PLACE_ENVS: dict[str, dict[str, object]] = {"hdamoe_env/HdMoE-Place-v1": {}}
PLACE_ENTRY_POINT = "hdamoe_env.env.place:HdMoePlaceEnv"
#: The drift env: keep, re-place or replicate one layer's experts every K decode steps
#: of a stream that switches between regimes; weight moves charged. Single env only.
DRIFT_ENVS: dict[str, dict[str, object]] = {"hdamoe_env/HdMoE-Drift-v1": {}}
DRIFT_ENTRY_POINT = "hdamoe_env.env.drift:HdMoeDriftEnv"
#: The quality-budget env: one gating action per MoE layer and decode step, a top-1
#: retention budget per episode enforced by masks. Single env only.
QUALITY_ENVS: dict[str, dict[str, object]] = {"hdamoe_env/HdMoE-Quality-v1": {}}
QUALITY_ENTRY_POINT = "hdamoe_env.env.quality:HdMoeQualityEnv"
VECTOR_ENTRY_POINT = "hdamoe_env.env.vector:HdMoeVectorEnv"
_RETIRED_ENTRY_POINT = "hdamoe_env.env.versions:retired_env"

for _env_id, (_kwargs, _max_steps) in REGISTERED_ENVS.items():
    if _env_id not in _gymnasium.registry:  # a re-import must not warn
        _gymnasium.register(id=_env_id, entry_point=ENTRY_POINT,
                            vector_entry_point=VECTOR_ENTRY_POINT,
                            kwargs=dict(_kwargs), max_episode_steps=_max_steps)
for _env_id, _kwargs in PLACE_ENVS.items():
    if _env_id not in _gymnasium.registry:
        _gymnasium.register(id=_env_id, entry_point=PLACE_ENTRY_POINT, kwargs=dict(_kwargs))
for _env_id, _kwargs in DRIFT_ENVS.items():
    if _env_id not in _gymnasium.registry:
        _gymnasium.register(id=_env_id, entry_point=DRIFT_ENTRY_POINT, kwargs=dict(_kwargs))
for _env_id, _kwargs in QUALITY_ENVS.items():
    if _env_id not in _gymnasium.registry:
        _gymnasium.register(id=_env_id, entry_point=QUALITY_ENTRY_POINT, kwargs=dict(_kwargs))
for _env_id in ("hdamoe_env/HdMoE-v0", "hdamoe_env/HdMoE-analytic-v0",
                "hdamoe_env/HdMoE-Mixtral-v0"):
    if _env_id not in _gymnasium.registry:
        _gymnasium.register(id=_env_id, entry_point=_RETIRED_ENTRY_POINT,
                            vector_entry_point=_RETIRED_ENTRY_POINT,
                            kwargs={"retired_id": _env_id})

__all__ = [
    "HARDWARE_PRESETS",
    "MODEL_PRESETS",
    "PROFILES",
    "DRIFT_ENTRY_POINT",
    "DRIFT_ENVS",
    "ENTRY_POINT",
    "PLACE_ENTRY_POINT",
    "PLACE_ENVS",
    "QUALITY_ENTRY_POINT",
    "QUALITY_ENVS",
    "REGISTERED_ENVS",
    "VECTOR_ENTRY_POINT",
    "ConfigError",
    "Conventions",
    "DependencyNotInstalled",
    "HardwareSpec",
    "HdMoeError",
    "InfeasibleError",
    "InvalidAction",
    "ModelSpec",
    "Placement",
    "SolverError",
    "TopologySpec",
    "TraceFormatError",
    "__version__",
    "expert_parallel",
    "get_model",
    "get_profile",
    "hardware_from_setting",
    "tensor_parallel",
]
