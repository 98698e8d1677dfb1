"""Routing-fidelity metrics of paper-model.md §12 on a real transformers MoE model.

Everything here needs the real model (hidden states and expert weights), so torch and
transformers are imported lazily; the module is optional and not used by the simulator.

* :func:`run_reference` — one forward pass per token sequence with the model's own routing:
  next-token log-probabilities, router scores and the original top-k of every (token, layer).
* :func:`routing_impact` — the same sequences with a routing policy (hardware-aware gating, the
  Cache-prior reference, ...) patched into the routers; the end-to-end metrics of §12 Table IX:
  KL(p‖q), PPL ratio, top-1 agreement, RMS shift, top-1 routing retention, and the changed-token
  ratio, top-k overlap and replaced ratio per rank. The gated "batch" is decided by the policy
  (``hdamoe_env.app.model_gating`` gates consecutive rows in chunks of B, a decode step).
* :func:`substitutability` — the boundary-expert substitutability matrix of §12 (Fig. 14) with its
  two controls.
* :func:`cache_prior_policy` — the Cache-prior reference routing adjustment of §12 (numpy only).

Definitions (§12): p_t and q_t are the next-token distributions of the original and adjusted runs
at position t (positions 0..T−2 of every sequence, predicting the observed token y_t = x_{t+1});
KL = mean_t Σ_v p_t(v)·(log p_t(v) − log q_t(v)); PPL ratio = exp(NLL_gated − NLL_orig) with NLL the
mean token negative log-likelihood; top-1 agreement = % of positions with argmax p_t = argmax q_t;
RMS shift = 100·sqrt(mean_t (q_t(y_t) − p_t(y_t))²) in percentage points; top-1 routing retention =
fraction of (token, layer) pairs whose highest-scored expert (scores of the adjusted run, before the
adjustment) is in the adjusted top-k set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from traces.capture.record import RouterAdapter, RoutingPolicy, RoutingRecorder
from traces.capture.tiny_model import import_torch_transformers

__all__ = [
    "ImpactMetrics",
    "ReferenceRun",
    "Substitutability",
    "cache_prior_policy",
    "expert_output",
    "impact_table",
    "routing_impact",
    "run_reference",
    "substitutability",
]


@dataclass(frozen=True, eq=False)
class ReferenceRun:
    """Forward passes with the original routing.

    Attributes:
        logprobs: Per sequence float32 [T, V] next-token log-probabilities.
        tokens: Per sequence int64 [T] token ids.
        orig_ids: int64 [L, N, k] original top-k (rank order), N = Σ T over sequences.
        scores: float32 [L, N, E] router probabilities.
    """

    logprobs: list[NDArray[np.float32]]
    tokens: list[NDArray[np.int64]]
    orig_ids: NDArray[np.int64]
    scores: NDArray[np.float32]


def _forward(model: Any, adapter: RouterAdapter, seqs: Sequence[Sequence[int]],
             policy: RoutingPolicy | None, *, keep_inputs: bool = False
             ) -> tuple[list[NDArray[np.float32]], RoutingRecorder]:
    """Run one forward pass per sequence under a recorder; return log-probs and the recorder."""
    torch, _ = import_torch_transformers()
    out_lp = []
    recorder = RoutingRecorder(model, adapter, extra_candidates=0, policy=policy,
                               keep_scores=True, keep_inputs=keep_inputs)
    with recorder, torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([list(seq)], dtype=torch.long)
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            out_lp.append(torch.log_softmax(logits, dim=-1).numpy().astype(np.float32))
    return out_lp, recorder


def run_reference(model: Any, adapter: RouterAdapter, seqs: Sequence[Sequence[int]]
                  ) -> ReferenceRun:
    """Return the original-routing run of ``seqs`` (one forward pass each, no KV cache).

    Args:
        model: transformers MoE causal LM.
        adapter: Its router adapter.
        seqs: Token-id sequences.
    """
    logprobs, rec = _forward(model, adapter, seqs, None)
    return ReferenceRun(logprobs, [np.asarray(s, dtype=np.int64) for s in seqs],
                        rec.stacked("orig"), rec.stacked("scores"))


@dataclass(frozen=True, eq=False)
class ImpactMetrics:
    """End-to-end routing impact of one policy (§12 Table IX).

    Attributes:
        kl: mean_t KL(p_t ‖ q_t), nats.
        nll_orig: Mean NLL of the observed next tokens, original routing (nats/token).
        nll_gated: The same with the policy.
        ppl_ratio: exp(nll_gated − nll_orig).
        top1_agreement: % of positions with argmax p_t = argmax q_t.
        rms_shift_pp: 100·sqrt(mean_t (q_t(y_t) − p_t(y_t))²), percentage points.
        top1_retention: Fraction of (token, layer) pairs whose top-1 expert stays selected.
        changed_token_ratio: Fraction of (token, layer) pairs whose expert set changed.
        topk_overlap: Mean |S ∩ S′|/k over (token, layer) pairs.
        replaced_per_rank: Fraction of pairs whose original rank-r expert was dropped, per r.
        retention_per_layer: Top-1 retention per layer.
        positions: Number of next-token positions compared.
        gated_ids: int64 [L, N, k] routing used in the adjusted run.
        orig_ids: int64 [L, N, k] router top-k of the adjusted run (before the adjustment).
    """

    kl: float
    nll_orig: float
    nll_gated: float
    ppl_ratio: float
    top1_agreement: float
    rms_shift_pp: float
    top1_retention: float
    changed_token_ratio: float
    topk_overlap: float
    replaced_per_rank: list[float]
    retention_per_layer: list[float]
    positions: int
    gated_ids: NDArray[np.int64] = field(repr=False)
    orig_ids: NDArray[np.int64] = field(repr=False)

    def summary(self) -> dict[str, Any]:
        """Return the scalar metrics as a JSON-ready dict."""
        return {"kl": self.kl, "ppl_ratio": self.ppl_ratio,
                "top1_agreement_pct": self.top1_agreement, "rms_shift_pp": self.rms_shift_pp,
                "top1_retention": self.top1_retention,
                "changed_token_ratio": self.changed_token_ratio,
                "topk_overlap": self.topk_overlap, "replaced_per_rank": self.replaced_per_rank,
                "retention_per_layer": self.retention_per_layer, "nll_orig": self.nll_orig,
                "nll_gated": self.nll_gated, "positions": self.positions}


def routing_metrics(orig_ids: NDArray[np.integer[Any]], new_ids: NDArray[np.integer[Any]]
                    ) -> dict[str, Any]:
    """Return retention, changed ratio, top-k overlap and replaced-per-rank of a routing change.

    Args:
        orig_ids: int [L, N, k] original top-k, rank order (top-1 first).
        new_ids: int [L, N, k] adjusted sets (any order).
    """
    orig = np.asarray(orig_ids)
    new = np.asarray(new_ids)
    kept = (orig[..., :, None] == new[..., None, :]).any(axis=-1)     # [L, N, k]
    return {"top1_retention": float(kept[..., 0].mean()),
            "retention_per_layer": kept[..., 0].mean(axis=1).tolist(),
            "changed_token_ratio": float((~kept.all(axis=-1)).mean()),
            "topk_overlap": float(kept.mean()),
            "replaced_per_rank": (1.0 - kept.mean(axis=(0, 1))).tolist()}


def routing_impact(model: Any, adapter: RouterAdapter, seqs: Sequence[Sequence[int]],
                   policy: RoutingPolicy, *, reference: ReferenceRun | None = None
                   ) -> ImpactMetrics:
    """Measure the end-to-end impact of a routing policy on ``seqs`` (§12 Table IX).

    Args:
        model: transformers MoE causal LM.
        adapter: Its router adapter.
        seqs: Token-id sequences (the same for both runs).
        policy: Routing policy patched into every router.
        reference: The original run (computed when None).

    Returns:
        The metrics (with the adjusted routing for the simulator).
    """
    ref = reference if reference is not None else run_reference(model, adapter, seqs)
    logprobs, rec = _forward(model, adapter, seqs, policy)
    kl_sum = nll_o = nll_g = agree = sq = 0.0
    count = 0
    for lp, lq, tok in zip(ref.logprobs, logprobs, ref.tokens, strict=True):
        lp64, lq64 = lp[:-1].astype(np.float64), lq[:-1].astype(np.float64)
        y = tok[1:]
        p = np.exp(lp64)
        kl_sum += float((p * (lp64 - lq64)).sum())
        rows = np.arange(y.size)
        nll_o -= float(lp64[rows, y].sum())
        nll_g -= float(lq64[rows, y].sum())
        agree += float((lp64.argmax(axis=1) == lq64.argmax(axis=1)).sum())
        sq += float(((np.exp(lq64[rows, y]) - p[rows, y]) ** 2).sum())
        count += y.size
    count = max(count, 1)
    gated, orig = rec.stacked("ids"), rec.stacked("orig")
    rm = routing_metrics(orig, gated)
    return ImpactMetrics(
        kl=kl_sum / count, nll_orig=nll_o / count, nll_gated=nll_g / count,
        ppl_ratio=float(np.exp((nll_g - nll_o) / count)), top1_agreement=100.0 * agree / count,
        rms_shift_pp=100.0 * float(np.sqrt(sq / count)), positions=count,
        gated_ids=gated, orig_ids=orig, **rm)


# ---------------------------------------------------------------------------------- experts


def _experts_module(model: Any, router_name: str) -> Any:
    parent = router_name.rsplit(".", 1)[0]
    block = model.get_submodule(parent)
    experts = getattr(block, "experts", None)
    if experts is None:
        raise ValueError(f"MoE block {parent!r} has no 'experts' module")
    return experts


def expert_output(experts: Any, expert: int, x: Any) -> Any:
    """Return Expert_i(x) [n, h] (un-weighted) for the fused expert modules of transformers 5.x.

    Args:
        experts: The block's ``experts`` module (``gate_up_proj`` [E, 2I, h], ``down_proj``
            [E, h, I], ``act_fn``), or a 4.x ``ModuleList`` of MLPs.
        expert: Expert id i.
        x: Router inputs [n, h].
    """
    torch, _ = import_torch_transformers()
    functional = torch.nn.functional
    if hasattr(experts, "gate_up_proj"):
        gate, up = functional.linear(x, experts.gate_up_proj[expert]).chunk(2, dim=-1)
        return functional.linear(experts.act_fn(gate) * up, experts.down_proj[expert])
    return experts[expert](x)


@dataclass(frozen=True, eq=False)
class Substitutability:
    """Boundary-expert substitutability (§12, Fig. 14).

    Attributes:
        matrix: float [J, k] mean cos(y, y_ij) over tokens then layers (row j = candidate of rank
            k+1+j, column i = selected expert of rank 1+i).
        per_layer: float [L, J, k] the per-layer means.
        control_random_sum: mean cos(y, Σ of k random non-top-k contributions).
        control_replace_random: mean cos(y, y with one random selected expert replaced by a random
            non-top-k expert).
        tokens_per_layer: Tokens sampled per layer.
    """

    matrix: NDArray[np.float64]
    per_layer: NDArray[np.float64]
    control_random_sum: float
    control_replace_random: float
    tokens_per_layer: int

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return {"matrix": self.matrix.tolist(), "per_layer": self.per_layer.tolist(),
                "control_random_sum": self.control_random_sum,
                "control_replace_random": self.control_replace_random,
                "tokens_per_layer": self.tokens_per_layer}

    def format(self) -> str:
        """Return the matrix and the controls as text."""
        k = self.matrix.shape[1]
        lines = ["          " + "  ".join(f"sel{i + 1:>4}" for i in range(k))]
        for j, row in enumerate(self.matrix):
            lines.append(f"cand{k + j + 1:>3}:  " + "  ".join(f"{v:7.4f}" for v in row))
        lines.append(f"control cos(y, k random non-top-k): {self.control_random_sum:.4f}")
        lines.append(f"control cos(y, one selected -> random non-top-k): "
                     f"{self.control_replace_random:.4f}")
        return "\n".join(lines)


def _cos(a: NDArray[np.float64], b: NDArray[np.float64]) -> NDArray[np.float64]:
    num = (a * b).sum(axis=-1)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return num / np.where(den > 0, den, 1.0)


def substitutability(model: Any, adapter: RouterAdapter, seqs: Sequence[Sequence[int]], *,
                     num_tokens: int = 32, extra: int | None = None, seed: int = 0
                     ) -> Substitutability:
    """Compute the boundary-expert substitutability matrix and its controls (§12).

    Per layer, ``num_tokens`` rows are drawn (seeded numpy Generator) from the router inputs of the
    original run. For a token: T = ranks 1..k, U = ranks k+1..k+J by original score (J = k by
    default); contributions c_i = s_i·Expert_i(x) with the original un-normalised probabilities;
    y = Σ_{i∈T} c_i; sim_ij = cos(y, y − c_{T_i} + c_{U_j}). Controls: cos(y, Σ of k random
    non-top-k contributions) and cos(y, y with one random selected expert replaced by a random
    non-top-k expert). Means over tokens, then layers. Shared experts are not involved (only the
    routed experts' contributions enter y).

    Args:
        model: transformers MoE causal LM.
        adapter: Its router adapter.
        seqs: Token-id sequences.
        num_tokens: Tokens sampled per layer.
        extra: J (default k).
        seed: Seed of the token and control draws.
    """
    torch, _ = import_torch_transformers()
    _, rec = _forward(model, adapter, seqs, None, keep_inputs=True)
    k, num_experts = rec.k, rec.E
    J = k if extra is None else int(extra)
    if k + J > num_experts:
        raise ValueError(f"k + J = {k + J} exceeds E = {num_experts}")
    rng = np.random.default_rng(seed)
    per_layer, ctrl_sum, ctrl_rep = [], [], []
    n_used = 0
    for layer, (name, _) in enumerate(rec.named_routers):
        x_all = torch.cat([call.inputs[layer] for call in rec.calls], dim=0)
        s_all = np.concatenate([call.scores[layer] for call in rec.calls], axis=0)
        rows = rng.choice(x_all.shape[0], size=min(num_tokens, x_all.shape[0]), replace=False)
        experts = _experts_module(model, name)
        x = x_all[torch.from_numpy(rows)]
        with torch.no_grad():
            outs = np.stack([expert_output(experts, e, x).double().numpy()
                             for e in range(num_experts)], axis=1)     # [n, E, h]
        s = s_all[rows].astype(np.float64)
        contrib = s[:, :, None] * outs
        order = np.argsort(-s, axis=1, kind="stable")
        top, cand, rest = order[:, :k], order[:, k:k + J], order[:, k:]
        n = n_used = int(rows.size)
        pick = np.arange(n)[:, None]
        c_top = contrib[pick, top]                                     # [n, k, h]
        c_cand = contrib[pick, cand]                                   # [n, J, h]
        y = c_top.sum(axis=1)                                          # [n, h]
        y_ij = (y[:, None, None, :] - c_top[:, None, :, :] + c_cand[:, :, None, :])
        per_layer.append(_cos(y[:, None, None, :], y_ij).mean(axis=0))  # [J, k]
        rand_sum, rand_rep = [], []
        for t in range(n):
            chosen = rng.choice(rest[t], size=min(k, rest.shape[1]), replace=False)
            rand_sum.append(_cos(y[t], contrib[t, chosen].sum(axis=0)))
            i = int(rng.integers(k))
            r = int(rng.choice(rest[t]))
            rand_rep.append(_cos(y[t], y[t] - c_top[t, i] + contrib[t, r]))
        ctrl_sum.append(float(np.mean(rand_sum)))
        ctrl_rep.append(float(np.mean(rand_rep)))
    stack = np.stack(per_layer)
    return Substitutability(stack.mean(axis=0), stack, float(np.mean(ctrl_sum)),
                            float(np.mean(ctrl_rep)), n_used)


# ---------------------------------------------------------------------------------- Cache-prior


def cache_prior_policy(orig_ids: NDArray[np.integer[Any]], scores: NDArray[np.floating[Any]],
                       *, lam: float = 0.5, keep_top: int = 1,
                       resident: int | None = None) -> RoutingPolicy:
    """Return the Cache-prior reference routing adjustment of §12 as a routing policy.

    Per layer l a resident set R_l = the ``resident`` (default k) most frequently selected experts
    of ``orig_ids[l]`` (the same prompts, original routing). Resident experts get a logit bonus
    λ·range_l, with range_l the layer's logit range (mean over tokens of max − min logit, computed
    from the log-probabilities, which differ from the logits by a per-token constant). The top
    ``keep_top`` (J = 1) original experts are always kept; the other k − J slots are the best of the
    remaining experts on the biased logits. Weights: the original probabilities (applied by the
    recorder with the model's rule).

    Args:
        orig_ids: int [L, N, k] original routing of the prompts.
        scores: float [L, N, E] router probabilities of the same rows.
        lam: λ.
        keep_top: J, original top experts always kept.
        resident: |R_l| (default k).

    Returns:
        ``policy(layer, scores [N, E], orig_ids [N, k]) -> ids [N, k]``.
    """
    ids = np.asarray(orig_ids)
    probs = np.asarray(scores, dtype=np.float64)
    num_layers, _, k = ids.shape
    num_experts = probs.shape[2]
    size = k if resident is None else int(resident)
    masks = np.zeros((num_layers, num_experts))
    ranges = np.zeros(num_layers)
    for layer in range(num_layers):
        counts = np.bincount(ids[layer].ravel(), minlength=num_experts)
        masks[layer, np.argsort(-counts, kind="stable")[:size]] = 1.0
        logp = np.log(np.maximum(probs[layer], 1e-30))
        ranges[layer] = float((logp.max(axis=1) - logp.min(axis=1)).mean())

    def policy(layer: int, s: NDArray[np.float64], orig: NDArray[np.int64]) -> NDArray[np.int64]:
        biased = np.log(np.maximum(s, 1e-30)) + lam * ranges[layer] * masks[layer][None, :]
        kept = orig[:, :keep_top]
        biased = biased.copy()
        np.put_along_axis(biased, kept, -np.inf, axis=1)
        rest = np.argsort(-biased, axis=1, kind="stable")[:, : k - keep_top]
        return np.concatenate([kept, rest], axis=1).astype(np.int64)

    return policy


def impact_table(rows: Sequence[dict[str, Any]]
                 ) -> tuple[list[str], list[list[Any]], list[str]]:
    """Lay ``routing_impact`` summaries (plus latency columns if present) out as a table.

    The application's one table renderer prints it (``hdamoe_env.app.tables.render_table``,
    ``hdamoe traces fidelity``); this module stays free of presentation code.

    Returns:
        ``(head, rows, formats)``: column titles, one row of values per summary (None where a
        summary lacks the column) and one format per column.
    """
    cols = [("policy", "policy", "{}"), ("kl", "KL(p‖q)", "{:.2e}"),
            ("ppl_ratio", "PPL ratio", "{:.4f}"), ("top1_agreement_pct", "top-1 agr. %",
                                                   "{:.2f}"),
            ("rms_shift_pp", "RMS shift pp", "{:.3f}"), ("top1_retention", "top-1 ret.",
                                                         "{:.4f}"),
            ("changed_token_ratio", "changed", "{:.4f}"), ("topk_overlap", "top-k overlap",
                                                           "{:.4f}"),
            ("tbt_orig_us", "TBT orig µs", "{:.2f}"), ("tbt_gated_us", "TBT gated µs", "{:.2f}"),
            ("speedup", "speed-up", "{:.4f}")]
    cols = [c for c in cols if any(c[0] in r for r in rows)]
    body = [[r.get(c[0]) for c in cols] for r in rows]
    return [c[1] for c in cols], body, [c[2] for c in cols]
