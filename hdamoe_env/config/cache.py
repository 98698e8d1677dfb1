"""One bounded least-recently-used cache for every process-wide memo table of the package.

Several layers keep results that are pure functions of their key for the life of the process:
built topologies, all-reduce times, synthetic traces, the γ fit of the analytic twin, the
holder tables of a placement. Each such table is a ``BoundedCache`` with an explicit
``maxsize``: a hit returns the very object the computation returned before, so a cached value
is bit-identical to an uncached one, and the bound keeps a long-running process (a bench
sweep, a training run) from growing without limit. Eviction drops the least recently used
entry, one at a time.

Every named cache registers itself in ``CACHES``; ``clear_caches`` empties them all (tests that
need a cold start, or a process that changed something a key does not capture). Nothing here
knows what is cached: the owner module builds the key and decides what a value is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

from hdamoe_env.config.errors import ConfigError

__all__ = ["CACHES", "BoundedCache", "cache_stats", "clear_caches"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: Every named cache of the process, by name (style.md R9: a plain dict in the defining module).
CACHES: dict[str, BoundedCache[Any, Any]] = {}


class BoundedCache(Generic[K, V]):
    """A mapping of at most ``maxsize`` entries that evicts the least recently used one.

    ``get`` and ``put`` both count as a use. ``None`` cannot be stored (``get`` returns it for
    a miss). Not thread-safe: the package's parallelism is process-based, and every process
    has its own caches.

    Args:
        maxsize: Largest number of entries (>= 1).
        name: Name under which the cache registers in ``CACHES`` (e.g.
            ``"hdamoe_env.noc.topology.make_topology"``); None keeps it out of the registry
            (a cache owned by one object rather than by the process). Registering a name again
            replaces the earlier cache in the registry (a reloaded module).

    Raises:
        ConfigError: ``maxsize`` < 1.
    """

    __slots__ = ("_data", "evictions", "hits", "maxsize", "misses", "name")

    def __init__(self, maxsize: int, name: str | None = None) -> None:
        if not (isinstance(maxsize, int) and maxsize >= 1):
            raise ConfigError(f"maxsize must be an integer >= 1, got {maxsize!r}")
        self.maxsize = maxsize
        self.name = name
        self._data: OrderedDict[K, V] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        if name is not None:
            CACHES[name] = self

    def get(self, key: K) -> V | None:
        """Return the value stored under ``key`` (now the most recently used), or None."""
        data = self._data
        value = data.get(key)
        if value is None:
            self.misses += 1
            return None
        data.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: K, value: V) -> V:
        """Store ``value`` under ``key`` as the most recently used entry; return ``value``.

        When the cache then holds more than ``maxsize`` entries the least recently used one is
        dropped.

        Raises:
            ConfigError: ``value`` is None (it would read back as a miss).
        """
        if value is None:
            raise ConfigError(f"cache {self.name or '(unnamed)'}: None cannot be cached")
        data = self._data
        data[key] = value
        data.move_to_end(key)
        if len(data) > self.maxsize:
            data.popitem(last=False)
            self.evictions += 1
        return value

    def clear(self) -> None:
        """Drop every entry (the hit, miss and eviction counters are kept)."""
        self._data.clear()

    def keys(self) -> list[K]:
        """Return the keys from the least to the most recently used."""
        return list(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is stored (does not count as a use)."""
        return key in self._data

    def __repr__(self) -> str:
        return (f"BoundedCache(name={self.name!r}, size={len(self._data)}/{self.maxsize}, "
                f"hits={self.hits}, misses={self.misses}, evictions={self.evictions})")


def clear_caches() -> None:
    """Empty every registered cache (``CACHES``)."""
    for cache in CACHES.values():
        cache.clear()


def cache_stats() -> dict[str, dict[str, int]]:
    """Return size, bound, hits, misses and evictions of every registered cache, by name."""
    return {name: {"size": len(c), "maxsize": c.maxsize, "hits": c.hits, "misses": c.misses,
                   "evictions": c.evictions} for name, c in sorted(CACHES.items())}
