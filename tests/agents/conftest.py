"""Fixtures of the agent tests: a tiny model (L = 2, E = 4, k = 2) on a 2×2 mesh (style.md R15)."""

from __future__ import annotations

import pytest

from hdamoe_env.config.specs import ModelSpec


@pytest.fixture
def tiny_agent_model() -> ModelSpec:
    return ModelSpec(key="tiny", name="tiny", num_moe_layers=2, num_experts=4, top_k=2,
                     hidden_size=64, expert_intermediate=128, attn_weight_elements=4 * 64 * 64,
                     kv_elements_per_token=2 * 64, core_flops_per_ctx_token=4 * 64,
                     hybrid_regions=2)


@pytest.fixture
def env_kwargs(tiny_agent_model):
    """Keyword arguments of a tiny ``HdMoeEnv``: EP on a 2×2 mesh, 2 decode steps of B = 8."""
    return dict(model=tiny_agent_model, mesh="2x2", setting="1/1", batch=8, steps_per_episode=2,
                placement="ep", k_b=2, trace_requests=4, trace_tokens=256)


@pytest.fixture
def make_tiny_env(env_kwargs):
    from hdamoe_env.env.environment import HdMoeEnv

    def make(**kwargs):
        return HdMoeEnv(**{**env_kwargs, **kwargs})

    return make


@pytest.fixture
def replicated_placements(tiny_agent_model):
    """(EP, EP plus one whole copy of expert 0 per layer on another node) on the 2×2 mesh."""
    import numpy as np

    from hdamoe_env.sim.placement import Placement, expert_parallel

    layers = tiny_agent_model.num_moe_layers
    ep = expert_parallel(layers, tiny_agent_model.num_experts, 4, np.random.default_rng(0))
    reps = np.zeros(ep.P.shape, dtype=bool)
    for layer in range(layers):
        reps[layer, 0, int(np.flatnonzero(ep.P[layer, 0] == 0)[0])] = True
    return ep, Placement(ep.P, ep.pi, "ep+rep", replicas=reps)
