"""Placements shared by the simulator-room tests."""

from __future__ import annotations

import numpy as np

from hdamoe_env.config.specs import get_model
from hdamoe_env.sim.placement import Placement


def deepseek_ep_placement(row: np.ndarray | None = None) -> Placement:
    """DeepSeek-V2-Lite on 32 nodes, EP (2 whole experts a node); ``row`` replaces expert 17 of
    layer 3 (shares over the 32 nodes) when given."""
    model = get_model("deepseek")
    P = np.zeros((model.num_moe_layers, model.num_experts, 32))
    P[:, np.arange(64), np.arange(64) // 2] = 1.0                  # EP: 2 whole experts a node
    if row is not None:
        P[3, 17] = row
    return Placement(P=P, pi=np.tile(np.arange(32), (model.num_moe_layers, 1)))
