"""Routing statistics: skew, co-activation, fluctuation, reuse and predictability.

Implements the definitions of traces.md §4.1 (tables §4.2–4.5 and the generator validation of
§7.3 use them). All statistics are computed per layer on the rows of one view ("content" by
default) and averaged over layers. Shapes: L layers, N rows in the view, E experts, k top-k.

Choices this module makes where traces.md leaves room [decision]:

* **Null model** for co-activation ("independent draws of k experts calibrated to the per-expert
  marginals"): the maximum-entropy distribution over k-subsets with the observed inclusion
  frequencies, P(S) ∝ Π_{e∈S} λ_e (conditional Poisson sampling). λ is fitted by the fixed point
  λ_i ← λ_i · f_i / π_i(λ) until the inclusion probabilities π_i = λ_i e_{k−1}(λ₋ᵢ) / e_k(λ) match
  f_i (e_r = elementary symmetric polynomials, computed exactly with prefix/suffix products). The
  null pair probabilities are then exact: P(i, j ∈ S) = λ_i λ_j e_{k−2}(λ₋ᵢ₋ⱼ) / e_k(λ). It is
  "popularity without affinity" in the log-linear sense (main effects only).
* **Pair distribution**: every row contributes its C(k, 2) unordered pairs; observed and null
  distributions are normalised over pairs. Pair TV = ½ Σ |observed − null|.
* **Reuse (independent)**: Σ_i f_i² / k, the expected overlap of two independent rows with the
  layer's marginals.
* **Fluctuation**: ``n_batches`` random batches (B rows without replacement from the view, same
  rows for all layers) and ``n_batches`` contiguous windows (B consecutive rows of one request,
  uniform over all valid starts); TV against the layer's long-term expert shares of the view and
  max/mean of the batch's expert loads.
* **Next-layer prediction from routing history**: lookup tables fitted **on the trace itself**
  (in-sample, hence optimistic; traces.md §4.2 used leave-one-category-out tables). table(l): the
  sorted set at layer l → the k experts most often active at layer l+1 for that set (ties to the
  lower id); table(l−1, l) keys on the pair of sets. Accuracy = mean |Ŝ ∩ S| / k. For E = 64 or
  256 almost every set is unique, so in-sample tables memorise; ``next_layer_table_acc_cv`` is the
  honest variant: table(l) fitted on every other request (by first appearance) and tested on the
  rest, both ways, with the static top-k for unseen sets.
* **Floors**: the same statistic for uniform random k-subsets with the same row count (up to 4
  layers sampled, averaged).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from itertools import combinations
from typing import Any

import numpy as np
from numpy.typing import NDArray

from traces.batching import random_rows, requests, take, windows
from traces.trace import RoutingTrace, unique_rows

__all__ = [
    "stats_table",
    "gini",
    "null_pair_probabilities",
    "pair_frequencies",
    "top_share",
    "trace_stats",
    "zipf_slope",
]

_FLOOR_LAYERS = 4
_NULL_MAX_ITER = 2000
_NULL_TOL = 1e-10


# ----------------------------------------------------------------------------- load skew


def top_share(shares: NDArray[np.floating[Any]], fraction: float = 0.1) -> float:
    """Return the share taken by the ⌈fraction·E⌉ busiest experts.

    Args:
        shares: float [E] expert shares (sum 1).
        fraction: Fraction of experts counted.

    Returns:
        The summed share.
    """
    count = max(1, math.ceil(fraction * shares.size))
    return float(np.sort(shares)[::-1][:count].sum())


def gini(loads: NDArray[np.floating[Any]]) -> float:
    """Return the Gini coefficient of expert loads (0 = equal, → 1 = concentrated).

    Args:
        loads: float [E], non-negative.

    Returns:
        G = Σ_i (2i − E − 1) x_(i) / (E Σ x) with x sorted ascending, i = 1..E.
    """
    x = np.sort(np.asarray(loads, dtype=np.float64))
    total = x.sum()
    if total <= 0:
        return 0.0
    index = np.arange(1, x.size + 1)
    return float(((2 * index - x.size - 1) * x).sum() / (x.size * total))


def zipf_slope(shares: NDArray[np.floating[Any]]) -> float:
    """Return the Zipf exponent s: minus the least-squares slope of log share vs log rank.

    Experts with zero share are left out.

    Args:
        shares: float [E].

    Returns:
        s (NaN when fewer than two experts are active).
    """
    ordered = np.sort(np.asarray(shares, dtype=np.float64))[::-1]
    ordered = ordered[ordered > 0]
    if ordered.size < 2:
        return float("nan")
    ranks = np.log(np.arange(1, ordered.size + 1))
    slope = np.polyfit(ranks, np.log(ordered), 1)[0]
    return float(-slope)


# ----------------------------------------------------------------------------- co-activation


def _pair_index(num_experts: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    return np.triu_indices(num_experts, k=1)


def pair_frequencies(ids: NDArray[np.integer[Any]], num_experts: int) -> NDArray[np.float64]:
    """Return the observed unordered-pair distribution of rows of one layer.

    Args:
        ids: int [N, k] expert sets.
        num_experts: E.

    Returns:
        float64 [E·(E−1)/2] over pairs (i < j) in ``np.triu_indices`` order; sums to 1.
    """
    ordered = np.sort(np.asarray(ids, dtype=np.int64), axis=1)
    counts = np.zeros(num_experts * num_experts, dtype=np.int64)
    for a, b in combinations(range(ordered.shape[1]), 2):
        counts += np.bincount(
            ordered[:, a] * num_experts + ordered[:, b], minlength=num_experts * num_experts
        )
    upper_i, upper_j = _pair_index(num_experts)
    pairs = counts.reshape(num_experts, num_experts)[upper_i, upper_j].astype(np.float64)
    return pairs / max(pairs.sum(), 1.0)


def _esp_prefix_suffix(
    lam: NDArray[np.float64], degree: int
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Prefix/suffix elementary symmetric polynomials up to ``degree``.

    Args:
        lam: float [..., E] non-negative weights.
        degree: Highest degree kept.

    Returns:
        ``(prefix, suffix)`` of shape [..., E+1, degree+1]: prefix[..., j] are the ESPs of
        λ_0..λ_{j−1}, suffix[..., j] those of λ_j..λ_{E−1}.
    """
    num = lam.shape[-1]
    shape = (*lam.shape[:-1], num + 1, degree + 1)
    prefix = np.zeros(shape)
    suffix = np.zeros(shape)
    prefix[..., 0, 0] = 1.0
    suffix[..., num, 0] = 1.0
    for j in range(num):
        prefix[..., j + 1, :] = prefix[..., j, :]
        prefix[..., j + 1, 1:] += lam[..., j, None] * prefix[..., j, :-1]
        back = num - 1 - j
        suffix[..., back, :] = suffix[..., back + 1, :]
        suffix[..., back, 1:] += lam[..., back, None] * suffix[..., back + 1, :-1]
    return prefix, suffix


def _esp_excluding(
    prefix: NDArray[np.float64], suffix: NDArray[np.float64], degree: int
) -> NDArray[np.float64]:
    """Return e_degree(λ without j) for every j, float [..., E], from prefix/suffix ESPs."""
    left = prefix[..., :-1, : degree + 1]
    right = suffix[..., 1:, degree::-1]
    return (left * right).sum(axis=-1)


def null_pair_probabilities(freq: NDArray[np.floating[Any]], top_k: int) -> NDArray[np.float64]:
    """Return the null-model pair distribution for one layer (module docstring: "Null model").

    Args:
        freq: float [E] activation frequencies f_i (sum k).
        top_k: k.

    Returns:
        float64 [E·(E−1)/2] over pairs (i < j) in ``np.triu_indices`` order; sums to 1.
    """
    lam = _calibrate_lambda(np.asarray(freq, dtype=np.float64)[None, :], top_k)[0]
    return _null_pairs(lam, top_k)


def _calibrate_lambda(freq: NDArray[np.float64], top_k: int) -> NDArray[np.float64]:
    """Fit conditional-Poisson weights λ [L, E] to inclusion frequencies f [L, E] (sum k)."""
    target = np.clip(freq, 0.0, 1.0 - 1e-9)
    active = target > 0
    lam = np.where(active, target / np.maximum(1.0 - target, 1e-12), 0.0)
    for _ in range(_NULL_MAX_ITER):
        lam *= top_k / lam.sum(axis=1, keepdims=True)  # scale-free; keeps ESPs moderate
        prefix, suffix = _esp_prefix_suffix(lam, top_k)
        total = prefix[..., -1, top_k][:, None]
        inclusion = lam * _esp_excluding(prefix, suffix, top_k - 1) / total
        error = np.abs(inclusion - target).max()
        if error < _NULL_TOL:
            break
        ratio = np.divide(target, inclusion, out=np.zeros_like(target), where=inclusion > 0)
        lam = np.where(active, lam * ratio, 0.0)
    return lam


def _null_pairs(lam: NDArray[np.float64], top_k: int) -> NDArray[np.float64]:
    num = lam.size
    upper_i, upper_j = _pair_index(num)
    if top_k < 2:
        return np.zeros(upper_i.size)
    total = _esp_prefix_suffix(lam, top_k)[0][-1, top_k]
    without = np.broadcast_to(lam, (num, num)).copy()  # row i: λ with λ_i removed
    np.fill_diagonal(without, 0.0)
    prefix2, suffix2 = _esp_prefix_suffix(without, top_k - 2)
    both = _esp_excluding(prefix2, suffix2, top_k - 2)  # [i, j]: e_{k−2}(λ₋ᵢ₋ⱼ)
    joint = lam[:, None] * lam[None, :] * both / total
    pairs = joint[upper_i, upper_j]
    return pairs / pairs.sum()


# ----------------------------------------------------------------------------- helpers


def _overlap(a: NDArray[np.integer[Any]], b: NDArray[np.integer[Any]]) -> NDArray[np.float64]:
    """Return |a_t ∩ b_t| / k for rows of distinct ids, float [..., N]."""
    top_k = a.shape[-1]
    same = np.zeros(a.shape[:-1], dtype=np.int64)
    for i in range(top_k):
        same += (a[..., i, None] == b).sum(axis=-1)
    return same / top_k


def _batch_loads(
    ids: NDArray[np.integer[Any]], batches: NDArray[np.int64], num_experts: int
) -> NDArray[np.int64]:
    """Per layer and batch the expert counts: int [L, n_batches, E]."""
    num_layers = ids.shape[0]
    num_batches = batches.shape[0]
    chosen = ids[:, batches.ravel()].reshape(num_layers, num_batches, -1).astype(np.int64)
    base = (
        np.arange(num_layers)[:, None, None] * num_batches + np.arange(num_batches)[None, :, None]
    ) * num_experts
    counts = np.bincount((base + chosen).ravel(), minlength=num_layers * num_batches * num_experts)
    return counts.reshape(num_layers, num_batches, num_experts)


def _fluctuation(
    ids: NDArray[np.integer[Any]], batches: NDArray[np.int64], shares: NDArray[np.float64]
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Per layer, mean TV vs long-term shares and per (layer, batch) max/mean loads."""
    num_experts = shares.shape[1]
    loads = _batch_loads(ids, batches, num_experts)
    per_batch = loads.sum(axis=2, keepdims=True)
    tv = 0.5 * np.abs(loads / per_batch - shares[:, None, :]).sum(axis=2)
    max_over_mean = loads.max(axis=2) / (per_batch[..., 0] / num_experts)
    return tv.mean(axis=1), max_over_mean


def _sparse_table(
    keys: NDArray[np.int64], target: NDArray[np.integer[Any]], num_experts: int
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """Fit a lookup table key → the k experts most often active in ``target`` (sparse counts).

    Args:
        keys: int [N] history keys (non-negative).
        target: int [N, k] sets to predict (k distinct ids per row).
        num_experts: E.

    Returns:
        ``(table_keys [G], table [G, k], hits [G])``: sorted distinct keys, their predicted experts
        (most frequent first, ties to the lower id) and the in-sample hits (sum of the k largest
        counts). Every key has at least k distinct experts because each row has k.
    """
    top_k = target.shape[1]
    table_keys, dense = np.unique(keys, return_inverse=True)
    pairs, counts = np.unique(
        (dense.ravel()[:, None] * num_experts + target).ravel(), return_counts=True
    )
    key, expert = pairs // num_experts, pairs % num_experts
    most = int(counts.max()) + 1
    order = np.argsort((key * most + (most - 1 - counts)) * num_experts + expert)  # one int64 key
    key, expert, counts = key[order], expert[order], counts[order]
    first = np.flatnonzero(np.diff(key, prepend=-1))
    rank = np.arange(key.size) - np.repeat(first, np.diff(np.append(first, key.size)))
    chosen = rank < top_k
    table = expert[chosen].reshape(table_keys.size, top_k)
    hits = counts[chosen].reshape(table_keys.size, top_k).sum(axis=1)
    return table_keys, table, hits


def _table_accuracy(
    keys: NDArray[np.int64], target: NDArray[np.integer[Any]], num_experts: int
) -> float:
    """In-sample accuracy of predicting ``target`` sets [N, k] from a history key [N]."""
    _, _, hits = _sparse_table(keys, target, num_experts)
    return float(hits.sum() / (target.shape[0] * target.shape[1]))


def _table_accuracy_cv(
    keys: NDArray[np.int64],
    target: NDArray[np.integer[Any]],
    fold: NDArray[np.bool_],
    num_experts: int,
) -> float:
    """Two-fold cross-validated table accuracy (fit on one fold of requests, test on the other).

    Keys unseen in the fitting fold fall back to the fitting fold's static top-k (ties to the
    lower expert id).
    """
    top_k = target.shape[1]
    hits, total = 0.0, 0
    for fit in (fold, ~fold):
        test = ~fit
        if not fit.any() or not test.any():
            continue
        table_keys, table, _ = _sparse_table(keys[fit], target[fit], num_experts)
        popularity = np.bincount(target[fit].ravel(), minlength=num_experts)
        static = np.argsort(-popularity, kind="stable")[:top_k]
        slot = np.minimum(np.searchsorted(table_keys, keys[test]), table_keys.size - 1)
        seen = table_keys[slot] == keys[test]
        predicted = np.where(seen[:, None], table[slot], static[None, :])
        hits += float(_overlap(predicted, target[test]).sum())
        total += int(test.sum())
    return hits / total if total else float("nan")


def _uniform_sets(
    rows: int, num_experts: int, top_k: int, rng: np.random.Generator
) -> NDArray[np.int64]:
    keys = rng.random((rows, num_experts))
    return np.argpartition(keys, top_k - 1, axis=1)[:, :top_k].astype(np.int64)


def _skew_row(freq: NDArray[np.float64], top_k: int) -> dict[str, float]:
    shares = freq / top_k
    return {
        "top10_share": top_share(shares),
        "max_over_mean": float(freq.max() / freq.mean()),
        "gini": gini(freq),
        "zipf_s": zipf_slope(shares),
    }


def _group_stats(
    ids: NDArray[np.int64], freq: NDArray[np.float64], num_experts: int
) -> dict[str, list[float]]:
    """Per-layer co-activation statistics: groups, set masses, entropy, pairs vs the null."""
    num_layers, num_rows, top_k = ids.shape
    lam = _calibrate_lambda(freq, top_k) if top_k >= 2 else None
    out: dict[str, list[float]] = {
        name: [] for name in ("distinct_groups", "top3_set_mass", "top100_set_mass", "set_entropy")
    }
    if lam is not None:
        out.update(pair_tv_vs_null=[], top3_pair_mass=[], top3_pair_mass_null=[])
    for layer in range(num_layers):
        sets = np.sort(ids[layer], axis=1)
        counts = unique_rows(sets)[2]
        f_g = np.sort(counts / num_rows)[::-1]
        out["distinct_groups"].append(float(f_g.size))
        out["top3_set_mass"].append(float(f_g[:3].sum()))
        out["top100_set_mass"].append(float(f_g[:100].sum()))
        out["set_entropy"].append(
            float(-(f_g * np.log(f_g)).sum() / math.log(f_g.size)) if f_g.size > 1 else 0.0
        )
        if lam is not None:
            observed = pair_frequencies(sets, num_experts)
            null = _null_pairs(lam[layer], top_k)
            out["pair_tv_vs_null"].append(float(0.5 * np.abs(observed - null).sum()))
            out["top3_pair_mass"].append(float(np.sort(observed)[::-1][:3].sum()))
            out["top3_pair_mass_null"].append(float(np.sort(null)[::-1][:3].sum()))
    return out


# ----------------------------------------------------------------------------- trace_stats


def trace_stats(
    trace: RoutingTrace,
    view: str = "content",
    B: int = 64,
    rng_seed: int = 0,
    *,
    n_batches: int = 400,
    floors: bool = True,
) -> dict[str, Any]:
    """Compute the statistics of traces.md §4.1 for one trace (means over layers).

    Args:
        trace: The trace.
        view: Row view ("content", "unique", "raw").
        B: Batch / window size of the fluctuation statistics.
        rng_seed: Seed of the random batches, windows and floors.
        n_batches: Random batches and contiguous windows drawn.
        floors: Also compute the uniform-routing floors (suffix ``_floor``).

    Returns:
        A dict of scalars (means over layers unless the name says otherwise): ``rows``,
        ``layers``, ``E``, ``k``, ``top10_share``, ``max_over_mean``, ``max_over_mean_worst``,
        ``gini``, ``zipf_s``, ``pair_tv_vs_null``, ``top3_pair_mass``, ``top3_pair_mass_null``,
        ``top3_set_mass``, ``distinct_groups``, ``top100_set_mass``, ``set_entropy``,
        ``reuse_lag1``, ``reuse_independent``, ``tv_random_B{B}``, ``max_over_mean_random_B{B}``,
        ``tv_contiguous_B{B}``, ``max_over_mean_contiguous_B{B}`` (and ``_p95``),
        ``next_layer_table_acc`` (table(l), in-sample), ``next_layer_table_acc_cv`` (table(l),
        two folds of requests), ``next_layer_table2_acc`` (table(l−1, l), in-sample), floors,
        plus ``per_layer``: a dict of per-layer lists. Statistics that cannot be computed (e.g.
        no request with B rows) are NaN.
    """
    rows = trace.view(view)
    if rows.size == 0:
        raise ValueError(f"view {view!r} of the trace has no rows")
    ids = trace.topk_ids[:, rows].astype(np.int64)  # [L, N, k]
    num_layers, num_rows, top_k = ids.shape
    num_experts = trace.num_experts
    rng = np.random.default_rng(rng_seed)
    freq = np.stack(
        [
            np.bincount(ids[layer].ravel(), minlength=num_experts) / num_rows
            for layer in range(num_layers)
        ]
    )  # f [L, E], rows sum to k
    shares = freq / top_k
    per_layer: dict[str, list[float]] = {}

    def put(name: str, values: Any) -> None:
        per_layer[name] = [float(v) for v in values]

    skew = [_skew_row(freq[layer], top_k) for layer in range(num_layers)]
    for name in ("top10_share", "max_over_mean", "gini", "zipf_s"):
        put(name, [row[name] for row in skew])

    per_layer.update(_group_stats(ids, freq, num_experts))

    # Reuse: consecutive rows of one request (view rows), traces.md §4.1.
    reqs = requests(trace, view)
    prev = np.concatenate([r[:-1] for r in reqs])
    nxt = np.concatenate([r[1:] for r in reqs])
    if prev.size:
        put("reuse_lag1", _overlap(trace.topk_ids[:, prev], trace.topk_ids[:, nxt]).mean(axis=1))
    else:
        put("reuse_lag1", [float("nan")] * num_layers)
    put("reuse_independent", (freq**2).sum(axis=1) / top_k)

    # Fluctuation at B (random batches and contiguous windows).
    suffix = f"_B{B}"
    full_ids = trace.topk_ids
    if rows.size >= B:
        random_batches = take(random_rows(trace, B, rng, view=view), n_batches)
        tv_random, mm_random = _fluctuation(full_ids, random_batches, shares)
        put("tv_random" + suffix, tv_random)
        put("max_over_mean_random" + suffix, mm_random.mean(axis=1))
    try:
        window_batches = take(windows(trace, B, rng, view=view), n_batches)
    except ValueError:
        window_batches = None
    if window_batches is not None:
        tv_contig, mm_contig = _fluctuation(full_ids, window_batches, shares)
        put("tv_contiguous" + suffix, tv_contig)
        put("max_over_mean_contiguous" + suffix, mm_contig.mean(axis=1))
        put("max_over_mean_contiguous" + suffix + "_p95", np.percentile(mm_contig, 95, axis=1))

    # Next-layer prediction from routing history: in-sample tables, and table(l) cross-validated
    # over two folds of requests (alternating by first appearance).
    if num_layers >= 2:
        set_keys = [unique_rows(np.sort(ids[layer], axis=1))[1] for layer in range(num_layers)]
        put(
            "next_layer_table_acc",
            [
                _table_accuracy(set_keys[layer], ids[layer + 1], num_experts)
                for layer in range(num_layers - 1)
            ],
        )
        position = np.searchsorted(rows, np.concatenate(reqs))
        fold = np.zeros(num_rows, dtype=bool)
        fold[position] = np.repeat(np.arange(len(reqs)) % 2 == 0, [r.size for r in reqs])
        put(
            "next_layer_table_acc_cv",
            [
                _table_accuracy_cv(set_keys[layer], ids[layer + 1], fold, num_experts)
                for layer in range(num_layers - 1)
            ],
        )
        if num_layers >= 3:
            put(
                "next_layer_table2_acc",
                [
                    _table_accuracy(
                        set_keys[layer - 1] * (int(set_keys[layer].max()) + 1) + set_keys[layer],
                        ids[layer + 1],
                        num_experts,
                    )
                    for layer in range(1, num_layers - 1)
                ],
            )

    result: dict[str, Any] = {
        "view": view,
        "rows": int(num_rows),
        "layers": num_layers,
        "E": num_experts,
        "k": top_k,
    }
    order = [
        "top10_share",
        "max_over_mean",
        "gini",
        "zipf_s",
        "pair_tv_vs_null",
        "top3_pair_mass",
        "top3_pair_mass_null",
        "top3_set_mass",
        "distinct_groups",
        "top100_set_mass",
        "set_entropy",
        "reuse_lag1",
        "reuse_independent",
        "tv_random" + suffix,
        "max_over_mean_random" + suffix,
        "tv_contiguous" + suffix,
        "max_over_mean_contiguous" + suffix,
        "max_over_mean_contiguous" + suffix + "_p95",
        "next_layer_table_acc",
        "next_layer_table_acc_cv",
        "next_layer_table2_acc",
    ]
    for name in order:
        values = per_layer.get(name) or []
        result[name] = float(np.mean(values)) if values else float("nan")
        if name == "max_over_mean":
            result["max_over_mean_worst"] = float(np.max(values))
    if floors:
        result.update(_floors(num_rows, num_experts, top_k, min(num_layers, _FLOOR_LAYERS), rng))
    result["per_layer"] = per_layer
    return result


def _floors(
    rows: int, num_experts: int, top_k: int, layers: int, rng: np.random.Generator
) -> dict[str, float]:
    """Uniform-routing floors with the same row count (traces.md §4.1)."""
    rows_stats: list[dict[str, float]] = []
    for _ in range(layers):
        sets = _uniform_sets(rows, num_experts, top_k, rng)
        freq = np.bincount(sets.ravel(), minlength=num_experts) / rows
        row = _skew_row(freq, top_k)
        if top_k >= 2:
            null = null_pair_probabilities(freq, top_k)
            row["pair_tv"] = 0.5 * float(np.abs(pair_frequencies(sets, num_experts) - null).sum())
        rows_stats.append(row)
    return {
        f"{name}_floor": float(np.mean([row[name] for row in rows_stats])) for name in rows_stats[0]
    }


# ----------------------------------------------------------------------------- table


def stats_table(columns: Mapping[str, Mapping[str, Any]], *,
                digits: int = 4) -> tuple[list[str], list[list[str]]]:
    """Lay several :func:`trace_stats` results side by side as table cells.

    The cells are rendered by the application's one table renderer
    (``hdamoe_env.app.tables.render_table``, ``hdamoe traces stats``); this module stays free of
    presentation code.

    Args:
        columns: Column title → stats dict (one column per trace).
        digits: Decimals of floating-point values.

    Returns:
        ``(head, rows)``: head ``["statistic", *titles]``; one row of strings per scalar
        statistic (in first-seen order); missing values are "–". Nested values (``per_layer``)
        are skipped.
    """
    names: list[str] = []
    for stats in columns.values():
        for name, value in stats.items():
            if name not in names and isinstance(value, int | float | str | np.number):
                names.append(name)

    def cell(value: Any) -> str:
        if value is None:
            return "–"
        if isinstance(value, bool | str):
            return str(value)
        if isinstance(value, int | np.integer):
            return str(int(value))
        number = float(value)
        return "nan" if math.isnan(number) else f"{number:.{digits}f}"

    header = ["statistic", *columns]
    body = [[name, *(cell(stats.get(name)) for stats in columns.values())] for name in names]
    return header, body
