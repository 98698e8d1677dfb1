"""Fixtures of the benchmark scripts' tests: the scripts as modules, a tiny drift env where
re-placing pays, and a three-policy grid (seconds instead of the benchmark's 28 policies)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hdamoe_env.config.specs import ModelSpec
from hdamoe_env.env.drift import HdMoeDriftEnv, periodic_policy, static_policy

ROOT = Path(__file__).resolve().parents[2]
DRIFT_MODEL = ModelSpec(key="tiny-drift-bench", name="tiny-drift-bench", num_moe_layers=2,
                        num_experts=8, top_k=2, hidden_size=64, expert_intermediate=256,
                        attn_weight_elements=4 * 64 * 64, kv_elements_per_token=2 * 64,
                        core_flops_per_ctx_token=4 * 64)


@pytest.fixture
def load_benchmark() -> Callable[[str], ModuleType]:
    """Load ``benchmarks/<name>.py`` as a module (the scripts are not a package)."""
    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load


@pytest.fixture
def tiny_drift_env() -> Callable[..., HdMoeDriftEnv]:
    """Slow compute and skewed regimes: re-placing pays here (the oracle re-places)."""
    def make(*_args: Any) -> HdMoeDriftEnv:
        return HdMoeDriftEnv(model=DRIFT_MODEL, mesh="2x4", setting="0.05/1", batch=64,
                             trace_requests=4, trace_tokens=256, num_regimes=2,
                             regime_skews=(1.0, 3.0), window=8, num_windows=3, mean_dwell=4.0)
    return make


@pytest.fixture
def small_drift_grid() -> Callable[[int], dict[str, Any]]:
    """Three candidates of the tuned grid instead of the benchmark's 28."""
    def grid(levels: int, cooldowns: tuple[int, ...] = ()) -> dict[str, Any]:
        return {"static": static_policy(), "periodic@8 r2": periodic_policy(8, levels - 1),
                "periodic@16 r0": periodic_policy(16, 0)}
    return grid
