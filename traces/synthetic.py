"""Synthetic routing traces: set-level and expert-level mixtures, scores and predictions.

Implements traces.md §7 with the parameters of ``traces/data/generator-params.json``
(:data:`GENERATOR_PARAMS`):

* §7.1 set-level mixture (Mixtral-8x7B: 28 possible sets, 64 clusters): a token-level cluster
  z_t shared by all layers (persistence ρ), per-request tilts τ_l ~ Dirichlet(κ_l·p_l)/p_l and
  per-block tilts β ~ Dirichlet(κ_block,l·p_l)/p_l (skipped when κ_block,l ≥ 1e5), copy
  probability γ_l, and a set drawn ∝ θ[z_t, l, g]·Π_{e∈g} τ_l[e]·β_{l,b(t)}[e];
* §7.2 expert-level mixture (E = 64, 256): Zipf popularity p_l over a seeded random rank
  permutation per layer, cluster weights θ[z, l] ~ Dirichlet(κ_cluster·p_l), the same tilts,
  copies and cluster chain, and top-k by Gumbel-perturbed logits y_e = log w_e + Gumbel_e
  (sampling k without replacement ∝ w);
* §7.5 router scores: expert-level softmax(y/T_s) over all experts with ``cand_ids`` the top k+J by
  y (``score_kind`` "softmax_all"); set-level and real traces get score synthesis
  (``score_kind`` "synthetic", λ = 0, i.e. no lift tilt);
* §7.6 noisy-oracle predictions.

Randomness (style.md R7): the sample stream is ``SeedSequence(seed)``, spawned into independent
streams for request lengths, clusters, each layer and predictions. The structure of the
expert-level synthetic *model* (rank permutations, cluster weights θ) comes from a separate
``model_seed`` (default 0) [decision], so traces of different seeds are different workloads of the
same synthetic model — like the categories of one real model — and a placement fitted on one seed
can be evaluated on another. Request lengths follow the empirical list of the parameters when
present (Mixtral), else the log-normal of §7.1 (μ = 6.483, σ = 0.515 in ln rows) [decision].

Skew power τ (``skew``, default 1) [decision]: one definition for both families — the long-term
expert popularity p_l is raised to the power τ and renormalised, p_l ← p_l^τ / Σ_e p_l[e]^τ, so
τ > 1 sharpens and τ < 1 flattens it (τ → 0 approaches uniform routing). Expert level: the Zipf
law p_l ∝ rank^(−s_l) becomes rank^(−τ·s_l) (``zipf_s`` × τ) and the cluster weights follow
(θ[z, l] ~ Dirichlet(κ_cluster·p_l^τ), so E[θ] is the new popularity). Set level: every set is
reweighted by the product of its experts' old shares to the power τ − 1,
θ[z, l, g] ← θ[z, l, g]·Π_{e∈g} p_l[e]^(τ−1) (renormalised per cluster and layer), which gives
set g the weight Π_{e∈g} p_l[e]^τ when θ factorises over experts, and the shares used by the
tilts, the score synthesis and the predictions become p_l^τ. The request and block tilts keep
their mean 1, so τ changes popularity, not drift. At τ = 1 nothing is recomputed (the skew step
is skipped and draws nothing). ``meta["generator"]["skew"]`` records τ.

One module, over 700 lines, on purpose: the generator, the score synthesis and the noisy-oracle
predictions draw through the same private sampling blocks (Gumbel keys, top-by-key, chunking)
from the same fitted parameters, and that shared code fixes the draws of every seeded trace.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

import numpy as np
from numpy.typing import NDArray

from traces.errors import unknown_name
from traces.trace import FORMAT_NAME, FORMAT_VERSION, RoutingTrace

__all__ = [
    "DEFAULT_ORACLE_ACCURACY",
    "GENERATOR_PARAMS",
    "MODEL_KEYS",
    "check_skew",
    "default_oracle_accuracy",
    "generate",
    "model_params",
    "noisy_oracle_predictions",
    "synthesize_scores",
    "with_noisy_oracle",
]


def _load_params() -> dict[str, Any]:
    text = resources.files("traces").joinpath("data/generator-params.json").read_text("utf-8")
    params: dict[str, Any] = json.loads(text)
    return params


GENERATOR_PARAMS: dict[str, Any] = _load_params()
"""The generator parameters of traces.md §7.3–7.4, keyed by package model key."""

MODEL_KEYS: tuple[str, ...] = tuple(
    key for key, value in GENERATOR_PARAMS.items() if isinstance(value, dict) and "kind" in value
)
"""Model keys with generator parameters: mixtral-8x7b, deepseek-v2-lite, qwen2-57b-a14b,
qwen3.5-35b-a3b."""

# Layer key of MoE layer 0 (traces.md §2); DeepSeek-V2-Lite's decoder layer 0 is dense.
_LAYER_KEY_OFFSET = {"deepseek-v2-lite": 1}
_NO_BLOCK_TILT = 1e5  # κ_block at or above this means "no block tilt" (traces.md §7.1)
_LOGNORMAL_MU, _LOGNORMAL_SIGMA = 6.483, 0.515
_DEFAULT_REQUESTS = 30
_TINY = 1e-300  # floor before log: Dirichlet draws with small α can underflow to 0
_CHUNK_ELEMENTS = 1 << 22  # rows × experts per vectorised block (bounds memory for E = 256)

DEFAULT_ORACLE_ACCURACY: tuple[float, float, float] = (0.62, 0.68, 0.83)
"""Noisy-oracle targets (traces.md §7.6) for MoE layers 1, 2 and >= 3 [assumption]."""


# ----------------------------------------------------------------------------- parameters


def _per_layer(
    value: Any, num_layers: int, name: str, default: float | None = None
) -> NDArray[np.float64]:
    """Expand a scalar, a per-layer list or a {layer: value} mapping to float64 [L]."""
    if isinstance(value, Mapping):
        if default is None:
            raise ValueError(f"parameter {name!r} given per layer as a mapping needs a default")
        out = np.full(num_layers, float(default))
        for key, item in value.items():
            out[int(key)] = float(item)
        return out
    array = np.asarray(value, dtype=np.float64)
    if array.ndim == 0:
        return np.full(num_layers, float(array))
    if array.shape != (num_layers,):
        raise ValueError(
            f"parameter {name!r} must be a scalar or have {num_layers} per-layer "
            f"values, got shape {array.shape}"
        )
    return array


def _decode_theta(spec: Mapping[str, Any]) -> NDArray[np.float64]:
    """Decode θ (base64 float16, little endian) and renormalise every (cluster, layer) row."""
    raw = base64.b64decode(spec["data"])
    theta = np.frombuffer(raw, dtype="<f2").reshape(spec["shape"]).astype(np.float64)
    theta = np.clip(theta, 0.0, None)
    return theta / theta.sum(axis=-1, keepdims=True)


def check_skew(skew: Any) -> float:
    """Return the skew power τ as a float, or raise ``ValueError`` when it is not finite and > 0.

    Args:
        skew: The skew power τ of the popularity (module docstring; 1 = the fitted generator).

    Returns:
        ``float(skew)``.

    Raises:
        ValueError: ``skew`` is not a number, not finite, or <= 0 (the message names the value).
    """
    try:
        value = float(skew)
    except (TypeError, ValueError):
        raise ValueError(f"skew must be a finite number > 0 (1 = the fitted popularity), got "
                         f"{skew!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"skew must be a finite number > 0 (1 = the fitted popularity, > 1 "
                         f"sharper, < 1 flatter), got {skew!r}")
    return value


def _apply_skew(out: dict[str, Any], skew: float) -> None:
    """Raise the popularity of ``out`` to the power ``skew`` in place (module docstring)."""
    if out["kind"] == "expert_mixture":
        out["zipf_s"] = out["zipf_s"] * skew  # (rank^−s)^τ = rank^−τs
        return
    p = out["p"]  # [L, E]
    log_p = np.log(np.maximum(p, _TINY))
    # log Π_{e∈g} p_l[e] for every layer and set: [L, G]
    log_set = log_p[:, out["sets"]].sum(axis=2)
    log_theta = np.log(np.maximum(out["theta"], _TINY)) + (skew - 1.0) * log_set[None, :, :]
    log_theta -= log_theta.max(axis=-1, keepdims=True)
    theta = np.exp(log_theta)
    out["theta"] = theta / theta.sum(axis=-1, keepdims=True)
    sharpened = np.exp(skew * (log_p - log_p.max(axis=1, keepdims=True)))
    out["p"] = sharpened / sharpened.sum(axis=1, keepdims=True)


def model_params(model_key: str, overrides: Mapping[str, Any] | None = None, *,
                 skew: float = 1.0) -> dict[str, Any]:
    """Return the normalised generator parameters of one model.

    Args:
        model_key: One of :data:`MODEL_KEYS`.
        overrides: Raw parameter values replacing those of the JSON file (same names, e.g.
            ``{"rho": 0.3, "zipf_s": 0.55}``) — for calibration studies.
        skew: Skew power τ of the popularity (module docstring): p_l ← p_l^τ, renormalised.
            1 (the default) leaves every parameter untouched.

    Returns:
        A dict with ``kind``, ``E``, ``k``, ``L``, ``C``, ``block``, ``rho`` and per-layer float64
        [L] arrays ``kappa``, ``kappa_block``, ``gamma``; set-level: ``sets`` int [G, k], ``pi``
        [C], ``theta`` [C, L, G], ``p`` [L, E], ``request_tokens``; expert-level: ``zipf_s`` [L],
        ``kappa_cluster``. ``raw`` holds the merged JSON entry and ``sha256`` its hash (of the
        JSON entry, before the skew); ``skew`` is τ.

    Raises:
        UnknownNameError: For an unknown model key (with a near-miss suggestion).
        ValueError: ``skew`` is not finite and > 0.
    """
    if model_key not in MODEL_KEYS:
        raise unknown_name("synthetic model key", model_key, MODEL_KEYS)
    skew = check_skew(skew)
    raw = copy.deepcopy(GENERATOR_PARAMS[model_key])
    raw.update(copy.deepcopy(dict(overrides or {})))
    num_layers = int(raw["L"])
    out: dict[str, Any] = {
        "kind": raw["kind"],
        "E": int(raw["E"]),
        "k": int(raw["k"]),
        "L": num_layers,
        "C": int(raw["clusters"]),
        "block": int(raw["block"]),
        "rho": float(raw["rho"]),
        "kappa": _per_layer(raw["kappa"], num_layers, "kappa"),
        "kappa_block": _per_layer(raw["kappa_block"], num_layers, "kappa_block"),
        "gamma": _per_layer(raw["gamma"], num_layers, "gamma"),
        "request_tokens": raw.get("request_tokens"),
        "raw": raw,
        "sha256": hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest(),
    }
    if raw["kind"] == "set_mixture":
        out["sets"] = np.asarray(raw["sets"], dtype=np.int64)
        pi = np.asarray(raw["pi"], dtype=np.float64)
        out["pi"] = pi / pi.sum()
        theta = raw["theta"]
        out["theta"] = (
            _decode_theta(theta)
            if isinstance(theta, Mapping)
            else np.asarray(theta, dtype=np.float64)
        )
        p = np.asarray(raw["p"], dtype=np.float64)
        out["p"] = p / p.sum(axis=1, keepdims=True)
    elif raw["kind"] == "expert_mixture":
        if "zipf_s" in raw:
            out["zipf_s"] = _per_layer(raw["zipf_s"], num_layers, "zipf_s")
        else:
            out["zipf_s"] = _per_layer(
                raw["zipf_s_measured"],
                num_layers,
                "zipf_s_measured",
                default=raw["zipf_s_default_other_layers"],
            )
        out["kappa_cluster"] = float(raw["kappa_cluster"])
    else:
        raise ValueError(f"model {model_key!r} has unknown generator kind {raw['kind']!r}")
    if skew != 1.0:  # τ = 1 recomputes nothing (the skew step is skipped)
        _apply_skew(out, skew)
    out["skew"] = skew
    return out


# ----------------------------------------------------------------------------- building blocks


def _request_lengths(
    params: Mapping[str, Any],
    n_requests: int | None,
    n_tokens: int | None,
    request_lengths: Sequence[int] | None,
    rng: np.random.Generator,
) -> NDArray[np.int64]:
    """Draw request lengths (rows per request)."""
    if request_lengths is not None:
        if n_requests is not None or n_tokens is not None:
            raise ValueError("give either request_lengths or n_requests/n_tokens, not both")
        lengths = np.asarray(request_lengths, dtype=np.int64)
        if lengths.ndim != 1 or lengths.size == 0 or (lengths < 1).any():
            raise ValueError("request_lengths must be a non-empty list of positive integers")
        return lengths
    empirical = params.get("request_tokens")

    def draw(count: int) -> NDArray[np.int64]:
        if empirical:
            return rng.choice(np.asarray(empirical, dtype=np.int64), size=count)
        values = np.exp(rng.normal(_LOGNORMAL_MU, _LOGNORMAL_SIGMA, size=count))
        return np.maximum(np.rint(values), 1).astype(np.int64)

    for name, value in (("n_requests", n_requests), ("n_tokens", n_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if n_tokens is None:
        return draw(_DEFAULT_REQUESTS if n_requests is None else n_requests)
    if n_requests is None:
        lengths = draw(max(1, math.ceil(2 * n_tokens / 700)))
        while lengths.sum() < n_tokens:
            lengths = np.concatenate([lengths, draw(max(1, lengths.size))])
        cumulative = np.cumsum(lengths)
        count = int(np.searchsorted(cumulative, n_tokens)) + 1
        lengths = lengths[:count].copy()
        lengths[-1] -= int(cumulative[count - 1]) - n_tokens
        return lengths
    if n_tokens < n_requests:
        raise ValueError(f"n_tokens={n_tokens} is smaller than n_requests={n_requests}")
    # Both given: split n_tokens in proportion to drawn lengths (largest remainder, each >= 1).
    weights = draw(n_requests).astype(np.float64)
    spare = n_tokens - n_requests
    share = weights / weights.sum() * spare
    lengths = np.floor(share).astype(np.int64)
    remainder = spare - int(lengths.sum())
    lengths[np.argsort(-(share - lengths), kind="stable")[:remainder]] += 1
    return lengths + 1


def _chain(
    rows: int, persist: float, request_start: NDArray[np.bool_], rng: np.random.Generator
) -> NDArray[np.int64]:
    """Return, per row, the index of the last row that drew afresh (persistence ``persist``).

    Row t keeps the value of row t−1 with probability ``persist`` except at request starts.
    """
    index = np.arange(rows)
    if persist <= 0.0:
        return index
    stay = rng.random(rows) < persist
    stay &= ~request_start
    return np.maximum.accumulate(np.where(stay, 0, index))


def _dirichlet_tilt(
    kappa: float, p: NDArray[np.float64], count: int, rng: np.random.Generator
) -> NDArray[np.float64]:
    """Return log(Dirichlet(κ·p) / p), float64 [count, E]."""
    draws = rng.dirichlet(kappa * p, size=count)
    return np.log(np.maximum(draws, _TINY)) - np.log(p)


def _exp_gumbel(shape: tuple[int, ...], rng: np.random.Generator) -> NDArray[np.float32]:
    """Return standard Gumbel noise as −log(Exp(1)) in float32 (fast)."""
    draws = rng.standard_exponential(shape, dtype=np.float32)
    return -np.log(np.maximum(draws, np.float32(1e-38)))


def _top_by_key(keys: NDArray[np.floating[Any]], count: int) -> NDArray[np.int64]:
    """Return the ``count`` column indices with the largest keys per row, largest first."""
    if count < keys.shape[1]:
        part = np.argpartition(-keys, count - 1, axis=1)[:, :count]
    else:
        part = np.broadcast_to(np.arange(keys.shape[1]), keys.shape).copy()
    order = np.argsort(-np.take_along_axis(keys, part, axis=1), axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1)


def _softmax_at(
    logits: NDArray[np.floating[Any]], columns: NDArray[np.int64], temperature: float
) -> NDArray[np.float32]:
    """Return softmax(logits / T) over all columns, evaluated at ``columns`` (float32 maths)."""
    scaled = logits.astype(np.float32, copy=False) * np.float32(1.0 / temperature)
    peak = scaled.max(axis=1, keepdims=True)
    total = np.exp(scaled - peak).sum(axis=1, keepdims=True, dtype=np.float64)
    picked = np.take_along_axis(scaled, columns, axis=1) - peak
    return (np.exp(picked.astype(np.float64)) / total).astype(np.float32)


def _synthesize_rows(
    sets: NDArray[np.integer[Any]],
    log_p: NDArray[np.float64],
    num_candidates: int,
    temperature: float,
    rank_known: bool,
    rng: np.random.Generator,
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """Score synthesis of traces.md §7.5 for rows [n, k] of one layer.

    y_e = log p_e + Gumbel_e; the sorted values go, largest first, to the members of the set (in
    row order when ``rank_known``, else in descending order of their own y — a random order) and
    then to the other experts in descending order of their own y. Scores are softmax(values / T)
    over all E experts.

    Returns:
        ``(cand_ids [n, k+J], cand_scores [n, k+J])``; ``cand_ids[:, :k]`` is the set.
    """
    rows, top_k = sets.shape
    num_experts = log_p.size
    y = log_p[None, :] + _exp_gumbel((rows, num_experts), rng).astype(np.float64)
    values = -np.sort(-y, axis=1)
    key = y.copy()
    boost = 4.0 * (np.abs(y).max() + 1.0)  # lifts members above every non-member
    if rank_known:
        # Position r of the row gets key (k + 1 − r)·boost: above every non-member, in row order.
        member_key = (top_k + 1 - np.arange(top_k, dtype=np.float64)) * boost
        np.put_along_axis(
            key, sets.astype(np.int64), np.broadcast_to(member_key, (rows, top_k)), axis=1
        )
    else:
        np.put_along_axis(
            key,
            sets.astype(np.int64),
            np.take_along_axis(y, sets.astype(np.int64), axis=1) + boost,
            axis=1,
        )
    order = np.argsort(-key, axis=1, kind="stable")[:, :num_candidates]
    scaled = values / temperature
    log_norm = scaled[:, :1] + np.log(np.exp(scaled - scaled[:, :1]).sum(axis=1, keepdims=True))
    scores = np.exp(scaled[:, :num_candidates] - log_norm).astype(np.float32)
    return order.astype(np.int64), scores


def _structure_expert_level(
    params: Mapping[str, Any], model_seed: int
) -> tuple[NDArray[np.float64], NDArray[np.float32]]:
    """Zipf popularity p [L, E] and log cluster weights log θ [L, C, E] of the synthetic model."""
    num_layers, num_experts, clusters = params["L"], params["E"], params["C"]
    root = np.random.SeedSequence(model_seed, spawn_key=(0x4D4F44,))  # "MOD"
    p = np.empty((num_layers, num_experts))
    log_theta = np.empty((num_layers, clusters, num_experts), dtype=np.float32)
    for layer, child in enumerate(root.spawn(num_layers)):
        rng = np.random.default_rng(child)
        rank = np.empty(num_experts)
        rank[rng.permutation(num_experts)] = np.arange(1, num_experts + 1)
        weights = rank ** (-params["zipf_s"][layer])
        p[layer] = weights / weights.sum()
        theta = rng.dirichlet(params["kappa_cluster"] * p[layer], size=clusters)
        log_theta[layer] = np.log(np.maximum(theta, _TINY))
    return p, log_theta


# ----------------------------------------------------------------------------- generator


def generate(
    model_key: str,
    n_requests: int | None = None,
    n_tokens: int | None = None,
    seed: int = 0,
    *,
    J: int | None = None,
    with_scores: bool = True,
    predictor: Any = None,
    request_lengths: Sequence[int] | None = None,
    model_seed: int = 0,
    score_temperature: float = 1.0,
    params: Mapping[str, Any] | None = None,
    skew: float = 1.0,
) -> RoutingTrace:
    """Generate a synthetic routing trace (traces.md §7).

    Args:
        model_key: "mixtral-8x7b" (set-level mixture), "deepseek-v2-lite", "qwen2-57b-a14b" or
            "qwen3.5-35b-a3b" (expert-level mixture).
        n_requests: Number of requests (default 30 when ``n_tokens`` is also None).
        n_tokens: Total rows. Alone: requests are drawn until the total is reached (the last one
            truncated). With ``n_requests``: the total is split in proportion to drawn lengths.
        seed: Seed of the sample stream (requests, clusters, routing, scores, predictions).
        J: Extra router candidates per row (default k); only with ``with_scores``.
        with_scores: Emit ``cand_ids``/``cand_scores`` (traces.md §7.5).
        predictor: None; "noisy_oracle" (default accuracies); a float or per-layer sequence of
            accuracies; or {"kind": "noisy_oracle", "acc": ...}. Fills ``pred_ids`` (§7.6).
        request_lengths: Explicit rows per request (e.g. the 30 empirical Mixtral lengths);
            excludes ``n_requests``/``n_tokens``.
        model_seed: Seed of the expert-level model structure (rank permutations, θ); see the
            module docstring.
        score_temperature: T_s of the score softmax (default 1 [assumption]).
        params: Overrides of the JSON parameters (see :func:`model_params`).
        skew: Skew power τ of the expert popularity (module docstring): > 1 sharpens, < 1
            flattens; 1 (default) is the fitted generator, bit for bit.

    Returns:
        A trace with rank-ordered ``topk_ids`` (top-1 first; ``meta["ids_rank_ordered"]`` true),
        one request per conversation (``req_id`` = ``conv_id``, ``turn`` 0), every row kept and
        decode phase (1).

    Raises:
        UnknownNameError: For an unknown model key.
        ValueError: For inconsistent sizes, or ``skew`` not finite and > 0.
    """
    spec = model_params(model_key, params, skew=skew)
    num_layers, num_experts, top_k = spec["L"], spec["E"], spec["k"]
    extra = top_k if J is None else int(J)
    if extra < 0 or top_k + extra > num_experts:
        raise ValueError(
            f"J={extra} gives k+J={top_k + extra} candidates but E={num_experts}; "
            f"use 0 <= J <= {num_experts - top_k}"
        )
    num_candidates = top_k + extra if with_scores else top_k
    if score_temperature <= 0:
        raise ValueError(f"score_temperature must be > 0, got {score_temperature}")

    sample_root = np.random.SeedSequence(seed, spawn_key=(0x534D50,))  # "SMP"
    len_seed, cluster_seed, layer_seed, pred_seed = sample_root.spawn(4)
    lengths = _request_lengths(
        spec, n_requests, n_tokens, request_lengths, np.random.default_rng(len_seed)
    )
    num_tokens = int(lengths.sum())
    num_requests = lengths.size
    req = np.repeat(np.arange(num_requests), lengths)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    pos = np.arange(num_tokens) - starts[req]
    request_start = np.zeros(num_tokens, dtype=bool)
    request_start[starts] = True
    block = spec["block"]
    blocks_per_request = -(-lengths // block)
    block_offset = np.concatenate(([0], np.cumsum(blocks_per_request)[:-1]))
    token_block = block_offset[req] + pos // block  # global block id [T]
    block_request = np.repeat(np.arange(num_requests), blocks_per_request)
    num_blocks = int(blocks_per_request.sum())

    cluster_rng = np.random.default_rng(cluster_seed)
    if spec["kind"] == "set_mixture":
        pi = spec["pi"]
        p_layers = spec["p"]
        log_theta = np.log(np.maximum(spec["theta"], _TINY)).transpose(1, 0, 2)  # [L, C, G]
    else:
        pi = np.full(spec["C"], 1.0 / spec["C"])  # [decision] uniform π
        p_layers, log_theta = _structure_expert_level(spec, model_seed)
    fresh = cluster_rng.choice(pi.size, size=num_tokens, p=pi)
    clusters = fresh[_chain(num_tokens, spec["rho"], request_start, cluster_rng)]

    topk_ids = np.empty((num_layers, num_tokens, top_k), dtype=np.int16)
    cand_ids = (
        np.empty((num_layers, num_tokens, num_candidates), dtype=np.int16) if with_scores else None
    )
    cand_scores = (
        np.empty((num_layers, num_tokens, num_candidates), dtype=np.float32)
        if with_scores
        else None
    )
    for layer, child in enumerate(layer_seed.spawn(num_layers)):
        rng = np.random.default_rng(child)
        p = p_layers[layer]
        log_tilt = _dirichlet_tilt(spec["kappa"][layer], p, num_requests, rng)[block_request]
        if spec["kappa_block"][layer] < _NO_BLOCK_TILT:
            log_tilt = log_tilt + _dirichlet_tilt(spec["kappa_block"][layer], p, num_blocks, rng)
        source = _chain(
            num_tokens,
            float(spec["gamma"][layer]) if spec["gamma"][layer] > 0 else 0.0,
            request_start,
            rng,
        )
        anchors = np.flatnonzero(source == np.arange(num_tokens))  # rows drawn afresh
        scores: NDArray[np.float32] | None
        if spec["kind"] == "set_mixture":
            cand, scores = _set_level_layer(
                spec,
                log_theta[layer],
                log_tilt,
                np.log(p),
                clusters[anchors],
                token_block[anchors],
                num_candidates,
                score_temperature,
                rng,
            )
        else:
            cand, scores = _expert_level_layer(
                log_theta[layer],
                log_tilt.astype(np.float32),
                clusters[anchors],
                token_block[anchors],
                num_candidates,
                score_temperature,
                with_scores,
                rng,
            )
        expand = np.searchsorted(anchors, source)  # copies reuse S_{t−1}
        topk_ids[layer] = cand[expand, :top_k]
        if cand_ids is not None and cand_scores is not None and scores is not None:
            cand_ids[layer] = cand[expand]
            cand_scores[layer] = scores[expand]

    offset = _LAYER_KEY_OFFSET.get(model_key, 0)
    meta: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "model": model_key,
        "E": num_experts,
        "k": top_k,
        "L": num_layers,
        "J": extra if with_scores else 0,
        "moe_layer_keys": [str(layer + offset) for layer in range(num_layers)],
        "ids_rank_ordered": True,
        "score_kind": (
            ("synthetic" if spec["kind"] == "set_mixture" else "softmax_all")
            if with_scores
            else None
        ),
        "score_temperature": score_temperature if with_scores else None,
        "predictor": None,
        "source": {
            "kind": "synthetic",
            "file": None,
            "sha256": None,
            "repository": None,
            "commit": None,
            "license": None,
        },
        "category": None,
        "dataset": "synthetic",
        "generator": {
            "name": spec["kind"],
            "model": model_key,
            "params_sha256": spec["sha256"],
            "seed": int(seed),
            "model_seed": int(model_seed),
            "n_requests": int(num_requests),
            "n_tokens": num_tokens,
            "overrides": sorted(params) if params else [],
            "skew": spec["skew"],
        },
    }
    trace = RoutingTrace(
        topk_ids=topk_ids,
        cand_ids=cand_ids,
        cand_scores=cand_scores,
        req_id=req.astype(np.int32),
        conv_id=req.astype(np.int32),
        turn=np.zeros(num_tokens, dtype=np.int16),
        pos=pos.astype(np.int32),
        phase=np.ones(num_tokens, dtype=np.uint8),
        keep=np.ones(num_tokens, dtype=bool),
        unique=np.ones(num_tokens, dtype=bool),
        meta=meta,
    )
    if predictor is not None:
        trace = with_noisy_oracle(
            trace, _predictor_accuracy(predictor), np.random.default_rng(pred_seed), shares=p_layers
        )
    return trace


def _set_level_layer(
    spec: Mapping[str, Any],
    log_theta: NDArray[np.float64],
    log_tilt: NDArray[np.float64],
    log_p: NDArray[np.float64],
    clusters: NDArray[np.int64],
    blocks: NDArray[np.int64],
    num_candidates: int,
    temperature: float,
    rng: np.random.Generator,
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """Draw the sets of one layer (traces.md §7.1) and synthesise their scores (§7.5)."""
    sets = spec["sets"]
    set_tilt = log_tilt[:, sets].sum(axis=2)  # [blocks, G]
    logits = log_theta[clusters] + set_tilt[blocks]
    choice = np.argmax(logits + _exp_gumbel(logits.shape, rng), axis=1)  # ∝ θ·Πτβ
    return _synthesize_rows(sets[choice], log_p, num_candidates, temperature, False, rng)


def _expert_level_layer(
    log_theta: NDArray[np.float32],
    log_tilt: NDArray[np.float32],
    clusters: NDArray[np.int64],
    blocks: NDArray[np.int64],
    num_candidates: int,
    temperature: float,
    with_scores: bool,
    rng: np.random.Generator,
) -> tuple[NDArray[np.int64], NDArray[np.float32] | None]:
    """Draw the top-k (and candidates) of one layer by Gumbel-perturbed logits (traces.md §7.2)."""
    rows = clusters.size
    num_experts = log_theta.shape[1]
    cand = np.empty((rows, num_candidates), dtype=np.int64)
    scores = np.empty((rows, num_candidates), dtype=np.float32) if with_scores else None
    step = max(1, _CHUNK_ELEMENTS // num_experts)
    for begin in range(0, rows, step):
        end = min(rows, begin + step)
        y = log_theta[clusters[begin:end]] + log_tilt[blocks[begin:end]]
        y += _exp_gumbel(y.shape, rng)
        top = _top_by_key(y, num_candidates)
        cand[begin:end] = top
        if scores is not None:
            scores[begin:end] = _softmax_at(y, top, temperature)
    return cand, scores


# ----------------------------------------------------------------------------- scores


def synthesize_scores(
    trace: RoutingTrace,
    rng: np.random.Generator,
    *,
    J: int | None = None,
    temperature: float = 1.0,
    shares: NDArray[np.floating[Any]] | None = None,
) -> RoutingTrace:
    """Add synthetic router scores to a trace without scores (traces.md §7.5, λ = 0).

    The original top-k of the synthetic scores is exactly each row's set: the first k candidates
    are the set (in row order when ``meta["ids_rank_ordered"]`` is true, else in a random order)
    followed by the J best other experts.

    Args:
        trace: The trace (its ``topk_ids``, or ``orig_topk_ids`` when present, are scored).
        rng: Random generator.
        J: Extra candidates (default k).
        temperature: Softmax temperature T_s.
        shares: float [L, E] popularity p_l (default: the trace's own frequencies ÷ k).

    Returns:
        A new trace with ``cand_ids``, ``cand_scores`` and ``meta["score_kind"]`` = "synthetic".
    """
    num_layers, top_k, num_experts = trace.num_layers, trace.top_k, trace.num_experts
    extra = top_k if J is None else int(J)
    if extra < 0 or top_k + extra > num_experts:
        raise ValueError(f"J={extra} needs k+J <= E={num_experts}")
    base = trace.orig_topk_ids if trace.orig_topk_ids is not None else trace.topk_ids
    p = _shares(trace, shares)
    rank_known = bool(trace.meta.get("ids_rank_ordered"))
    cand_ids = np.empty((num_layers, trace.num_tokens, top_k + extra), dtype=np.int16)
    cand_scores = np.empty(cand_ids.shape, dtype=np.float32)
    step = max(1, _CHUNK_ELEMENTS // num_experts)
    for layer in range(num_layers):
        log_p = np.log(np.maximum(p[layer], _TINY))
        for begin in range(0, trace.num_tokens, step):
            end = min(trace.num_tokens, begin + step)
            cand, scores = _synthesize_rows(
                base[layer, begin:end], log_p, top_k + extra, temperature, rank_known, rng
            )
            cand_ids[layer, begin:end] = cand
            cand_scores[layer, begin:end] = scores
    meta = dict(trace.meta)
    meta.update(score_kind="synthetic", score_temperature=temperature, J=extra)
    return trace.replace(cand_ids=cand_ids, cand_scores=cand_scores, meta=meta)


# ----------------------------------------------------------------------------- predictions


def default_oracle_accuracy(num_layers: int) -> NDArray[np.float64]:
    """Return the default per-layer noisy-oracle accuracy (traces.md §7.6) [assumption].

    Layer 0 has no prediction (NaN); MoE layer 1 (the first predicted layer) 0.62, layer 2 0.68,
    later layers 0.83.

    Returns:
        float64 [L].
    """
    first, second, later = DEFAULT_ORACLE_ACCURACY
    acc = np.full(num_layers, later)
    acc[0] = np.nan
    if num_layers > 1:
        acc[1] = first
    if num_layers > 2:
        acc[2] = second
    return acc


def _predictor_accuracy(predictor: Any) -> Any:
    if isinstance(predictor, str):
        if predictor != "noisy_oracle":
            raise unknown_name("predictor", predictor, ["noisy_oracle"])
        return None
    if isinstance(predictor, Mapping):
        if predictor.get("kind", "noisy_oracle") != "noisy_oracle":
            raise unknown_name("predictor", predictor.get("kind"), ["noisy_oracle"])
        return predictor.get("acc")
    return predictor


def _accuracy_vector(acc: Any, num_layers: int) -> NDArray[np.float64]:
    if acc is None:
        return default_oracle_accuracy(num_layers)
    values = np.asarray(acc, dtype=np.float64)
    if values.ndim == 0:
        out = np.full(num_layers, float(values))
    elif values.shape == (num_layers,):
        out = values.copy()
    elif values.shape == (num_layers - 1,):
        out = np.concatenate(([np.nan], values))
    else:
        raise ValueError(
            f"acc must be a scalar or have L={num_layers} (entry 0 ignored) or "
            f"L-1={num_layers - 1} per-layer values, got shape {values.shape}"
        )
    out[0] = np.nan
    if ((out[1:] < 0) | (out[1:] > 1)).any():
        raise ValueError(f"accuracies must lie in [0, 1], got {out[1:].tolist()}")
    return out


def _shares(trace: RoutingTrace, shares: NDArray[np.floating[Any]] | None) -> NDArray[np.float64]:
    if shares is not None:
        p = np.asarray(shares, dtype=np.float64)
        if p.shape != (trace.num_layers, trace.num_experts):
            raise ValueError(
                f"shares must have shape [L, E] = [{trace.num_layers}, "
                f"{trace.num_experts}], got {p.shape}"
            )
        return p
    return np.stack(
        [trace.layer_frequencies(layer) / trace.top_k for layer in range(trace.num_layers)]
    )


def noisy_oracle_predictions(
    trace: RoutingTrace,
    acc: Any,
    rng: np.random.Generator,
    *,
    shares: NDArray[np.floating[Any]] | None = None,
) -> NDArray[np.int16]:
    """Predict each layer's set with a noisy oracle (traces.md §7.6).

    Every expert of the actual set is kept with probability acc_l and otherwise replaced by an
    expert drawn ∝ p_l from those not in the set (no expert twice), so the expected overlap
    |S ∩ Ŝ| / k is exactly acc_l. Replaced positions keep their place in the row.

    Args:
        trace: The trace whose ``topk_ids`` are predicted.
        acc: None (defaults of :func:`default_oracle_accuracy`), a scalar, or per-layer values
            (length L with entry 0 ignored, or L−1 for layers 1..L−1).
        rng: Random generator.
        shares: float [L, E] p_l used for replacements (default: the trace's frequencies ÷ k).

    Returns:
        int16 [L, T, k]; layer 0 is −1 (no previous layer to predict from).
    """
    num_layers, num_tokens, top_k = trace.topk_ids.shape
    accuracy = _accuracy_vector(acc, num_layers)
    p = _shares(trace, shares)
    pred = np.full(trace.topk_ids.shape, -1, dtype=np.int16)
    step = max(1, _CHUNK_ELEMENTS // trace.num_experts)
    for layer in range(1, num_layers):
        log_p = np.log(np.maximum(p[layer], _TINY)).astype(np.float32)  # finite for idle experts
        for begin in range(0, num_tokens, step):
            end = min(num_tokens, begin + step)
            actual = trace.topk_ids[layer, begin:end].astype(np.int64)
            keys = log_p[None, :] + _exp_gumbel((end - begin, trace.num_experts), rng)
            np.put_along_axis(keys, actual, -np.inf, axis=1)  # never re-draw a member
            replacements = _top_by_key(keys, top_k)
            replace = rng.random((end - begin, top_k)) >= accuracy[layer]
            rank = np.maximum(np.cumsum(replace, axis=1) - 1, 0)
            drawn = np.take_along_axis(replacements, rank, axis=1)
            pred[layer, begin:end] = np.where(replace, drawn, actual)
    return pred


def with_noisy_oracle(
    trace: RoutingTrace,
    acc: Any,
    rng: np.random.Generator,
    *,
    shares: NDArray[np.floating[Any]] | None = None,
) -> RoutingTrace:
    """Return the trace with noisy-oracle ``pred_ids`` and ``meta["predictor"]`` (§7.6).

    Args:
        trace: The trace.
        acc: Accuracies, as for :func:`noisy_oracle_predictions`.
        rng: Random generator.
        shares: Replacement popularity p_l [L, E] (default: the trace's own frequencies ÷ k).

    Returns:
        A new trace.
    """
    pred = noisy_oracle_predictions(trace, acc, rng, shares=shares)
    accuracy = _accuracy_vector(acc, trace.num_layers)
    meta = dict(trace.meta)
    meta["predictor"] = {
        "kind": "noisy_oracle",
        "acc": [None if math.isnan(a) else float(a) for a in accuracy],
        "shares": "generator" if shares is not None else "trace",
    }
    return trace.replace(pred_ids=pred, meta=meta)
