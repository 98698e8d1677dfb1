"""Shared fixtures (style.md R15): tiny hardware, tiny model, a seeded rng."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
import pytest

from hdamoe_env.config.specs import HardwareSpec, ModelSpec

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_TRACES = ROOT.parent / "shared" / "reference-traces"

try:  # dependencies.md §6: one thread for torch when it is installed
    import torch  # noqa: F401

    torch.set_num_threads(1)
except ImportError:
    pass


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)


@pytest.fixture
def tiny_hw() -> HardwareSpec:
    return HardwareSpec(mesh_shape=(2, 2), compute_tflops=1.0, link_bw_gbps=1.0)


@pytest.fixture
def tiny_model() -> ModelSpec:
    return ModelSpec(key="tiny", name="tiny", num_moe_layers=2, num_experts=4, top_k=2,
                     hidden_size=64, expert_intermediate=128, attn_weight_elements=4 * 64 * 64,
                     kv_elements_per_token=2 * 64, core_flops_per_ctx_token=4 * 64)


@pytest.fixture
def reference_traces() -> Path:
    if not REFERENCE_TRACES.is_dir():
        pytest.skip(f"reference traces not found at {REFERENCE_TRACES} (../shared/reference-traces)")
    return REFERENCE_TRACES
