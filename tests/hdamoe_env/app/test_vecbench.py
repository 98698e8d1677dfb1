"""Tests of hdamoe_env.app.vecbench: single vs batched env steps/s (``bench-env --num-envs``)."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.app.vecbench import bench_vector, format_vector_bench, masked_sample


def test_masked_sample_respects_the_masks():
    rng = np.random.default_rng(0)
    nvec = np.array([3, 2])
    masks = np.array([[False, True, False, True, False], [True, True, True, False, True]])
    for _ in range(20):
        a = masked_sample(masks, nvec, rng)
        assert a[0].tolist() == [1, 0] and a[1, 1] == 1 and 0 <= a[1, 0] < 3


@pytest.mark.slow                         # ~1,000 DES steps: about 20 s on the shared machine
def test_bench_vector_reports_both_sides_and_the_ratio():
    res = bench_vector(3, seconds=0.05, mesh="2x2", batch=8, fidelities=("des",))
    for policy in ("noop", "random_masked"):
        s = res[f"des_{policy}_single_steps_per_s"]
        b = res[f"des_{policy}_batched_steps_per_s"]
        assert s > 0 and b > 0 and res[f"des_{policy}_ratio"] == b / s
    table = format_vector_bench(res, ("des",))
    assert "batched N=3" in table and "random masked" in table
