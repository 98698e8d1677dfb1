"""Tests of hdamoe_env.app.vecbench: single vs batched env steps/s (``bench-env --num-envs``)."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
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


def test_bench_vector_k_b_makes_random_masked_copies_pre_broadcast(monkeypatch):
    """``k_b`` reaches the envs: random masked actions then pre-broadcast (the batched
    pre-broadcast step runs); the result records it."""
    from hdamoe_env.env.vector import HdMoeVectorEnv

    stepped = []
    original = HdMoeVectorEnv._step_broadcast

    def spy(self, idx, a):
        done = original(self, idx, a)
        stepped.append(int(done.sum()))
        return done

    monkeypatch.setattr(HdMoeVectorEnv, "_step_broadcast", spy)
    res = bench_vector(3, seconds=0.05, mesh="2x2", batch=8, fidelities=("des",), k_b=1)
    assert res["k_b"] == 1 and sum(stepped) > 0
    assert res["des_random_masked_batched_steps_per_s"] > 0


def test_bench_vector_rejects_repeated_or_bad_des_threads():
    with pytest.raises(ConfigError, match="must not repeat"):
        bench_vector(2, fidelities=("des",), des_threads=(1, 1))
    with pytest.raises(ConfigError, match="des_threads must be an integer >= 1, got 0"):
        bench_vector(2, fidelities=("des",), des_threads=(0,))


def test_format_vector_bench_has_one_row_per_thread_count():
    res = {"num_envs": 4, "des_threads": [1, 2]}
    for policy in ("noop", "random_masked"):
        res.update({f"des_{policy}_single_steps_per_s": 100.0,
                    f"des_{policy}_batched_steps_per_s": 300.0, f"des_{policy}_ratio": 3.0,
                    f"des_{policy}_batched_2t_steps_per_s": 500.0,
                    f"des_{policy}_ratio_2t": 5.0})
    lines = format_vector_bench(res, ("des",)).splitlines()
    assert len(lines) == 5
    assert "noop, batched 2 threads" in lines[2] and "500" in lines[2] and "5.00" in lines[2]
    assert "random masked, batched 1 thread " in lines[3]
