"""hdamoe-env: MoE inference on 3D near-memory processing (HDA-MoE), as a simulator and an RL env.

Core public API (the simulator knows nothing of RL; see README and docs/):

* specs: ``ModelSpec``, ``HardwareSpec``, ``TopologySpec``, ``MODEL_PRESETS``,
  ``HARDWARE_PRESETS``;
* conventions: ``Conventions``, ``PROFILES`` (``faithful`` default, ``paper``, ``paper-hd``);
* placements: ``Placement``, ``tensor_parallel``, ``expert_parallel``;
* simulation: ``MoESimulator``, ``hdamoe_env.des.simulate_messages`` (explicit
  message lists on any topology);
* environment: ``gymnasium.make("hdamoe_env/HdMoE-v0", ...)`` (``hdamoe_env.env.HdMoeEnv``),
  registered at import with a string entry point (the env module is imported only on ``make``).
"""

from __future__ import annotations

from hdamoe_env.errors import (ConfigError, DependencyNotInstalled, HdMoeError, InfeasibleError,
                               InvalidAction, SolverError, TraceFormatError)
from hdamoe_env.placement import Placement, expert_parallel, tensor_parallel
from hdamoe_env.profiles import PROFILES, Conventions, get_profile
from hdamoe_env.specs import (HARDWARE_PRESETS, MODEL_PRESETS, HardwareSpec, ModelSpec,
                              TopologySpec, get_model, hardware_from_setting)

__version__ = "0.1.0"

import gymnasium as _gymnasium  # noqa: E402 - registration needs the package metadata above

if "hdamoe_env/HdMoE-v0" not in _gymnasium.registry:  # a re-import must not warn
    _gymnasium.register(id="hdamoe_env/HdMoE-v0", entry_point="hdamoe_env.env:HdMoeEnv")

__all__ = [
    "HARDWARE_PRESETS",
    "MODEL_PRESETS",
    "PROFILES",
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
