"""The bounded process-wide cache (``hdamoe_env.config.cache``): bound, LRU order, registry."""

from __future__ import annotations

import pytest

from hdamoe_env.config import cache as cache_module
from hdamoe_env.config.cache import CACHES, BoundedCache, cache_stats, clear_caches
from hdamoe_env.config.errors import ConfigError


def test_bound_and_least_recently_used_eviction_order():
    cache: BoundedCache[str, int] = BoundedCache(3)
    for i, key in enumerate("abc"):
        cache.put(key, i)
    assert cache.keys() == ["a", "b", "c"] and len(cache) == 3
    assert cache.get("a") == 0                      # a use: "a" becomes the most recent
    cache.put("d", 3)                               # evicts "b", the least recently used
    assert cache.keys() == ["c", "a", "d"]
    assert "b" not in cache and cache.get("b") is None
    cache.put("c", 20)                              # overwriting is a use and keeps the bound
    assert cache.keys() == ["a", "d", "c"] and cache.get("c") == 20
    cache.put("e", 4)
    cache.put("f", 5)
    assert cache.keys() == ["c", "e", "f"] and len(cache) == cache.maxsize == 3
    assert cache.evictions == 3


def test_hits_misses_and_identity_of_values():
    cache: BoundedCache[tuple[int, int], list[int]] = BoundedCache(2)
    value = [1, 2, 3]
    assert cache.put((1, 2), value) is value
    assert cache.get((1, 2)) is value               # the stored object itself, never a copy
    assert cache.get((2, 1)) is None
    assert (cache.hits, cache.misses) == (1, 1)


def test_clear_and_the_registry(monkeypatch):
    # a private registry: clearing the package's real caches would only slow the other tests
    monkeypatch.setattr(cache_module, "CACHES", {})
    cache: BoundedCache[int, str] = BoundedCache(4, name="tests.test_cache.registry")
    other: BoundedCache[int, str] = BoundedCache(2, name="tests.test_cache.other")
    assert cache_module.CACHES == {"tests.test_cache.registry": cache,
                                   "tests.test_cache.other": other}
    cache.put(1, "x")
    other.put(1, "z")
    assert cache_stats()["tests.test_cache.registry"]["size"] == 1
    clear_caches()
    assert len(cache) == len(other) == 0 and cache.get(1) is None
    cache.put(2, "y")
    cache.clear()
    assert len(cache) == 0
    again: BoundedCache[int, str] = BoundedCache(4, name="tests.test_cache.registry")
    assert cache_module.CACHES["tests.test_cache.registry"] is again   # a reloaded module


def test_unnamed_caches_stay_out_of_the_registry():
    before = dict(CACHES)
    BoundedCache(2)
    assert CACHES == before


def test_the_package_caches_are_registered():
    import hdamoe_env.env.environment  # noqa: F401 - imports every core cache owner
    import baselines.pipeline  # noqa: F401

    assert {"hdamoe_env.noc.topology.make_topology", "hdamoe_env.noc.collectives.allreduce_time",
            "hdamoe_env.noc.linksim.phase_codes", "hdamoe_env.decisions.dispatch.holder_lists",
            "hdamoe_env.decisions.gating.prepared_arrays", "hdamoe_env.sim.sources.synthetic_traces",
            "hdamoe_env.sim.calibrate.twin_gammas", "baselines.pipeline.simulators"} <= set(CACHES)


@pytest.mark.parametrize("bad", [0, -1, 1.5, None])
def test_bad_bounds_and_none_values_are_refused(bad):
    with pytest.raises(ConfigError, match="maxsize"):
        BoundedCache(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="None"):
        BoundedCache(1).put("k", None)
