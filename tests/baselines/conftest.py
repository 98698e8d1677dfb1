"""Fixtures of the placement-baseline tests: a tiny model, tiny hardware and a tiny trace."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.config.specs import HardwareSpec, ModelSpec


@pytest.fixture
def nb_model() -> ModelSpec:
    return ModelSpec(key="tiny-nb", name="tiny-nb", num_moe_layers=2, num_experts=4, top_k=2,
                     hidden_size=64, expert_intermediate=128, hybrid_regions=2,
                     attn_weight_elements=4 * 64 * 64, kv_elements_per_token=2 * 64,
                     core_flops_per_ctx_token=4 * 64)


@pytest.fixture
def hw22() -> HardwareSpec:
    return HardwareSpec(mesh_shape=(2, 2), compute_tflops=1.0, link_bw_gbps=1.0)


def random_trace(num_layers: int, num_experts: int, top_k: int, tokens: int, seed: int = 0):
    """A small skewed routing trace (one request, every row kept)."""
    from traces import RoutingTrace

    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, num_experts + 1) ** 0.7
    ids = np.empty((num_layers, tokens, top_k), dtype=np.int16)
    for layer in range(num_layers):
        p = rng.permutation(weights)
        p = p / p.sum()
        for t in range(tokens):
            ids[layer, t] = rng.choice(num_experts, size=top_k, replace=False, p=p)
    return RoutingTrace(topk_ids=ids, req_id=np.zeros(tokens, np.int32),
                        pos=np.arange(tokens, dtype=np.int32),
                        phase=np.full(tokens, 2, np.uint8), keep=np.ones(tokens, bool),
                        meta={"E": num_experts, "model": "tiny"})


@pytest.fixture
def make_trace():
    return random_trace


@pytest.fixture
def cfg(nb_model):
    """The pipeline configuration of the tiny model on a 2x2 mesh (local-search Link Balance)."""
    from baselines.pipeline_config import PlaceConfig

    return PlaceConfig.create(model=nb_model, mesh=(2, 2), setting="1/1", trace="given",
                              lb_method="local", bo_calls=6, time_limit_s=10, seed=5)


@pytest.fixture
def trace(make_trace):
    """A 300-row skewed trace of the tiny model."""
    return make_trace(2, 4, 2, 300, seed=1)
