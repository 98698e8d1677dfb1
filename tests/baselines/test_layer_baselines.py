"""Per-layer baselines as arrays (``baselines.layer_baselines``), scored by the placement env."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pulp")

from baselines.layer_baselines import LAYER_BASELINES, pipeline_candidates
from hdamoe_env.env.place import HdMoePlaceEnv
from hdamoe_env.sim.placement import tensor_parallel_tiled


def test_pipeline_candidates_are_scored_by_the_env(cfg, trace, nb_model, tmp_path):
    cands = pipeline_candidates(cfg, trace, [1], str(tmp_path))
    assert list(cands) == [1] and tuple(cands[1]) == LAYER_BASELINES
    c = cands[1]
    np.testing.assert_array_equal(c["tp-tiled"].P, tensor_parallel_tiled(1, 4, 4, 0.5).P[0])
    assert c["tp-tiled"].allreduce and not c["ep"].allreduce
    for cand in c.values():
        np.testing.assert_allclose(cand.P.sum(axis=1), 1.0)
        assert sorted(cand.pi) == [0, 1, 2, 3]
    env = HdMoePlaceEnv(model=nb_model, mesh="2x2", setting="1/1", trace=trace, split="all",
                        evaluator="static")
    env.reset(seed=0, options={"layer": 1})
    scores = {name: env.evaluate_placement(cand.P, cand.pi, cand.allreduce)
              for name, cand in c.items()}
    assert scores["tp"]["ratio"] == pytest.approx(1.0)
    assert all(np.isfinite(s["latency_us"]) and s["latency_us"] > 0 for s in scores.values())
    # resuming reads the finished layer back: the same arrays
    again = pipeline_candidates(cfg, trace, [1], str(tmp_path))
    np.testing.assert_array_equal(again[1]["node_link"].P, c["node_link"].P)
