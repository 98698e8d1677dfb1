"""Fixtures of the trace tests: tiny synthetic traces and the optional reference traces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import traces

REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE_DIR = (REPO_ROOT / ".." / "shared" / "reference-traces").resolve()


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    """The authors' traces (traces.md §1); skip when ../shared/reference-traces is absent."""
    if not REFERENCE_DIR.is_dir():
        pytest.skip(
            f"reference traces not found at {REFERENCE_DIR} (../shared/reference-traces "
            "relative to the repository root); they are never copied into the repo"
        )
    return REFERENCE_DIR


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)


@pytest.fixture(scope="session")
def tiny_trace() -> traces.RoutingTrace:
    """Synthetic DeepSeek-like trace generated at test time (no licence question)."""
    return traces.generate("deepseek-v2-lite", n_requests=6, n_tokens=600, seed=7)


@pytest.fixture(scope="session")
def tiny_mixtral() -> traces.RoutingTrace:
    return traces.generate("mixtral-8x7b", n_requests=8, n_tokens=1200, seed=3)
