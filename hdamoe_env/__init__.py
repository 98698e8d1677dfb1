"""hdamoe-env: MoE inference on 3D near-memory processing (HDA-MoE), as a simulator and an RL env.

Core public API (the simulator knows nothing of RL; see README and docs/):

* specs: ``ModelSpec``, ``HardwareSpec``, ``TopologySpec``, ``MODEL_PRESETS``,
  ``HARDWARE_PRESETS``;
* conventions: ``Conventions``, ``PROFILES`` (``faithful`` default, ``paper``, ``paper-hd``);
* placements: ``Placement``, ``tensor_parallel``, ``expert_parallel``;
* simulation: ``MoESimulator``, ``simulate_messages`` (explicit message lists on any topology).
"""

from __future__ import annotations

from hdamoe_env.errors import (ConfigError, DependencyNotInstalled, HdMoeError, InfeasibleError,
                               InvalidAction, SolverError, TraceFormatError)
from hdamoe_env.placement import Placement, expert_parallel, tensor_parallel
from hdamoe_env.profiles import PROFILES, Conventions, get_profile
from hdamoe_env.specs import (HARDWARE_PRESETS, MODEL_PRESETS, HardwareSpec, ModelSpec,
                              TopologySpec, get_model, hardware_from_setting)

__version__ = "0.1.0"

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
