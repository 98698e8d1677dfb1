"""EPLB's two per-layer steps, replication and balanced packing, and one global-policy layer.

The core of the expert-parallelism load balancer written from DeepSeek's published description
(no code of that repository is used): :func:`replicate` (step 1: one copy per expert, then every
further copy to the expert with the largest load per copy) and :func:`balanced_packing` (step 2:
heaviest item first to the least-loaded bin with room that lacks its key; a repair swap, else
the round-robin fallback), and :func:`eplb_layer`, both steps for one layer under the global
policy (one node group). ``baselines.eplb`` (the offline placement, node groups, slot budget and
the ``Placement``) and ``hdamoe_env.env.drift`` (the drift env's re-placement) both use them;
the algorithm and its decisions are described in ``baselines.eplb``.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.errors import ConfigError, InfeasibleError

__all__ = ["balanced_packing", "eplb_layer", "place_copies", "replicate"]


def replicate(loads: ArrayLike, num_physical: int, max_copies: int) -> NDArray[np.int64]:
    """Return the copy count of every expert: greedy replication by load per copy (step 1).

    Args:
        loads: float [E] expert loads (>= 0).
        num_physical: Physical experts to create (>= E).
        max_copies: Cap on the copies of one expert (the nodes that could hold them).

    Returns:
        int64 [E] counts c_i ≥ 1, Σ c_i = min(num_physical, E·max_copies).
    """
    f = np.asarray(loads, dtype=np.float64)
    counts = np.ones(f.size, dtype=np.int64)
    target = min(int(num_physical), f.size * int(max_copies))
    for _ in range(target - f.size):
        per_copy = np.where(counts < max_copies, f / counts, -np.inf)
        counts[int(np.argmax(per_copy))] += 1       # argmax: first maximum = lower expert id
    return counts


def balanced_packing(item_loads: ArrayLike, num_bins: int, capacity: int,
                     item_keys: ArrayLike | None = None) -> tuple[NDArray[np.int64], bool]:
    """Pack items to bins: heaviest first, each to the least-loaded bin with room (step 2).

    Args:
        item_loads: float [N] item loads.
        num_bins: Number of bins (nodes or node groups).
        capacity: Items per bin at most (N ≤ num_bins·capacity).
        item_keys: int [N] expert id of every item: two items with the same key never share a
            bin (None: all distinct). Items with one key must have equal loads (copies).

    Returns:
        (int64 [N] bin of every item, True when the round-robin fallback was used).

    Raises:
        InfeasibleError: More items than slots, or more items of one key than bins.
    """
    w = np.asarray(item_loads, dtype=np.float64)
    n = w.size
    keys = np.arange(n) if item_keys is None else np.asarray(item_keys, dtype=np.int64)
    if n > num_bins * capacity:
        raise InfeasibleError(f"{n} items do not fit in {num_bins} bins of {capacity} slots; "
                              "raise the slot budget S")
    _, key_index, key_count = np.unique(keys, return_inverse=True, return_counts=True)
    if key_count.size and key_count.max() > num_bins:
        raise InfeasibleError(f"an expert has {key_count.max()} copies but only {num_bins} "
                              "nodes can hold one each; cap the copies at the node count")
    order = np.lexsort((keys, -w))                     # descending load, then key
    bin_of = np.full(n, -1, dtype=np.int64)
    load = np.zeros(num_bins)
    used = np.zeros(num_bins, dtype=np.int64)
    holds = np.zeros((key_count.size, num_bins), dtype=bool)
    for item in order:
        k = key_index[item]
        ok = (used < capacity) & ~holds[k]
        if not ok.any() and not _repair(bin_of, key_index, w, holds, load, used, capacity, k):
            # [decision] documented fallback: the always-valid round-robin layout
            grouped = np.argsort(key_index, kind="stable")
            out = np.empty(n, dtype=np.int64)
            out[grouped] = np.arange(n, dtype=np.int64) % num_bins
            return out, True
        ok = (used < capacity) & ~holds[k]
        b = int(np.argmin(np.where(ok, load, np.inf)))  # first minimum = lower bin id
        bin_of[item] = b
        load[b] += w[item]
        used[b] += 1
        holds[k, b] = True
    return bin_of, False


def _repair(bin_of: NDArray[np.int64], key_index: NDArray[np.int64], w: NDArray[np.float64],
            holds: NDArray[np.bool_], load: NDArray[np.float64], used: NDArray[np.int64],
            capacity: int, k: int) -> bool:
    """Free a slot for key ``k``: move a placed item from a full bin lacking k to a free bin."""
    free_bins = np.flatnonzero(used < capacity)
    full_bins = np.flatnonzero((used >= capacity) & ~holds[k])
    for dst in free_bins[np.argsort(load[free_bins], kind="stable")]:
        for src in full_bins[np.argsort(load[full_bins], kind="stable")]:
            for item in np.flatnonzero(bin_of == src):
                j = key_index[item]
                if holds[j, dst]:
                    continue
                bin_of[item] = dst
                load[src] -= w[item]
                load[dst] += w[item]
                used[src] -= 1
                used[dst] += 1
                holds[j, src], holds[j, dst] = False, True
                return True
    return False


def eplb_layer(loads: ArrayLike, num_nodes: int, slots_per_node: int
               ) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
    """Return EPLB's copies of one layer: (int64 [E] copy counts, bool [E, D] holders).

    The global policy: :func:`replicate` to D·S physical experts (at most D copies of one
    expert), then :func:`balanced_packing` of the copies (load f_i / c_i each) to the D nodes
    of S slots, copies of one expert on distinct nodes.

    Raises:
        ConfigError: Negative or non-finite loads, or D·S < E.
    """
    f = np.asarray(loads, dtype=np.float64)
    D, S = int(num_nodes), int(slots_per_node)
    if f.ndim != 1 or not np.all(np.isfinite(f)) or (f < 0).any():
        raise ConfigError(f"loads must be finite, >= 0, of shape [E]; got {np.shape(loads)}")
    if D < 1 or S < 1 or D * S < f.size:
        raise ConfigError(f"EPLB needs D·S >= E slots, got D={D}, S={S}, E={f.size}")
    counts, items, bins, _ = place_copies(f, D, S)
    holds = np.zeros((f.size, D), dtype=bool)
    holds[items, bins] = True
    return counts, holds


def place_copies(loads: NDArray[np.float64], num_nodes: int, slots_per_node: int
                 ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64], bool]:
    """Both steps on one set of experts and nodes (no checks): :func:`replicate` to D·S
    physical experts (at most D copies each), then :func:`balanced_packing` of the copies (load
    f_i / c_i each) to the D nodes of S slots, copies of one expert on distinct nodes.

    Returns:
        ``(counts int64 [E], items int64 [Σc] the expert of every copy, bins int64 [Σc] its
        node, True when the round-robin fallback was used)``.
    """
    counts = replicate(loads, num_nodes * slots_per_node, num_nodes)
    items = np.repeat(np.arange(loads.size), counts)
    bins, fell_back = balanced_packing((loads / counts)[items], num_nodes, slots_per_node, items)
    return counts, items, bins, fell_back
