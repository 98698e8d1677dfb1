"""Shared fixtures (style.md R15): tiny hardware, tiny model, a seeded rng; the tiny env of the
agent and application tests (L = 2, E = 4, k = 2 on a 2×2 mesh)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# the model-signing key of the tests (hdamoe_env.config.trust): never the user's key file
os.environ["HDAMOE_SIGNING_KEY"] = "hdamoe-env test signing key"
# SB3 configures a logger directory in $TMPDIR (SB3-<time>) on every learn() without one of
# its own: the tests' models log (nothing) into one directory that the run removes at exit
_SB3_DIR = tempfile.mkdtemp(prefix="hdamoe-tests-sb3-")
os.environ["SB3_LOGDIR"] = _SB3_DIR
atexit.register(shutil.rmtree, _SB3_DIR, True)

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


@pytest.fixture
def tiny_agent_model() -> ModelSpec:
    """The tiny model with two hybrid regions: the model of ``env_kwargs`` / ``make_tiny_env``."""
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
    from hdamoe_env.sim.placement import Placement, expert_parallel

    layers = tiny_agent_model.num_moe_layers
    ep = expert_parallel(layers, tiny_agent_model.num_experts, 4, np.random.default_rng(0))
    reps = np.zeros(ep.P.shape, dtype=bool)
    for layer in range(layers):
        reps[layer, 0, int(np.flatnonzero(ep.P[layer, 0] == 0)[0])] = True
    return ep, Placement(ep.P, ep.pi, "ep+rep", replicas=reps)
