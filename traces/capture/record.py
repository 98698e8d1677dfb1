"""Record real routing (ids, router scores, next-layer predictions) from transformers MoE models.

A :class:`RoutingRecorder` attaches forward hooks to the MoE routers of a Hugging Face
``transformers`` model and records, for every forward call (one prefill call with the prompt's
rows, then one call per decode step in ``model.generate()``) and every MoE layer l:

* the top-k expert ids the layer actually used, rank-ordered by router score (top-1 first);
* the router scores (softmax probabilities over all E experts, ``score_kind = "softmax_all"``) of
  the top-(k+J) candidates (traces.md §5 ``cand_ids``/``cand_scores``: the original top-k first,
  then the J best of the other experts);
* the next-layer prediction of paper-model.md §10.2: **layer l+1's router applied to the hidden
  state that entered layer l's router**, i.e. to the output of layer l's
  ``post_attention_layernorm`` (the normalised residual stream after layer l's attention — the
  exact tensor layer l's router multiplies). Ŝ_t(l+1) = top-k(softmax(W_gate,l+1 · x_l[t])) with
  layer l+1's own selection rule; it is stored row-aligned in ``pred_ids[l+1]`` (layer 0: −1).

Optionally a *routing policy* replaces the router's top-k during the forward pass (hardware-aware
gating, the Cache-prior reference): ``policy(layer, scores [N, E], orig_ids [N, k]) -> ids [N, k]``
with numpy arrays; the selected experts get their **original** probabilities, post-processed by the
model's own weight rule (Mixtral: renormalised over the k; Qwen2-MoE: ``norm_topk_prob``;
DeepSeek-V2: not renormalised, × ``routed_scaling_factor``), paper-model.md §11.5. The policy comes
from the caller (``hdamoe_env.app.model_gating`` builds the hardware-aware one), so this module needs no
import from the upper layers (style.md §2).

Router adapters (:data:`ADAPTERS`) map an architecture (``config.model_type``) to its router
modules. In transformers 5.x the routers are ``mlp.gate`` modules (``MixtralTopKRouter``,
``Qwen2MoeTopKRouter``, ``DeepseekV2TopkRouter``, ...) returning ``(logits, weights, indices)``; in
4.x they were plain ``nn.Linear`` gates returning logits (``block_sparse_moe.gate`` for Mixtral,
``mlp.gate`` for Qwen2-MoE) — those are recorded (top-k recomputed from the logits with the same
rule) but cannot be re-routed by a policy.

``record_generate`` runs ``generate()`` prompt by prompt (batch size 1, like the authors' traces:
one request per prompt; rows of a request are its prefill rows then one row per decode step;
``phase`` 0/1 marks them) and returns a canonical :class:`traces.RoutingTrace`; write it with
:func:`traces.save`. :func:`prediction_accuracy` measures the recorded prediction.

torch and transformers are imported lazily (``traces`` is the bottom layer); nothing is ever
downloaded (offline mode is forced).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from traces.errors import TraceFormatError, unknown_name
from traces.capture.tiny_model import (
    ByteTokenizer,
    RecordDependencyError,
    import_torch_transformers,
    is_heldout,
)
from traces.trace import RoutingTrace

__all__ = [
    "ADAPTERS",
    "ModelFormatError",
    "RouterAdapter",
    "RoutingPolicy",
    "RoutingRecorder",
    "load_model",
    "prediction_accuracy",
    "record_generate",
    "resolve_adapter",
    "stdlib_heldout_prompts",
]

#: ``policy(layer, scores [N, E] float64, orig_ids [N, k] int64) -> ids [N, k]``.
RoutingPolicy = Callable[[int, NDArray[np.float64], NDArray[np.int64]], NDArray[np.integer[Any]]]


class ModelFormatError(ValueError):
    """A model directory or architecture cannot be recorded; the message names it and the fix."""


@dataclass(frozen=True, slots=True)
class RouterAdapter:
    """How to find and interpret the routers of one architecture family.

    Attributes:
        name: Adapter key.
        model_types: ``config.model_type`` values it serves.
        router_classes: Router class names of transformers 5.x (modules returning
            ``(logits, weights, indices)``).
        legacy_gate: Regex of the 4.x ``nn.Linear`` gate module names (record only).
        experts_key: Config attribute holding E.
        weight_rule: ``"renorm"`` (always renormalise over the k), ``"norm_topk_prob"`` (as the
            config says), or ``"scaled"`` (× ``routed_scaling_factor``, no renormalisation).
    """

    name: str
    model_types: tuple[str, ...]
    router_classes: tuple[str, ...]
    legacy_gate: str
    experts_key: str
    weight_rule: str

    # ------------------------------------------------------------------ model structure
    def num_experts(self, model: Any) -> int:
        """Return E of ``model``."""
        return int(getattr(model.config, self.experts_key))

    def top_k(self, model: Any) -> int:
        """Return k of ``model``."""
        return int(model.config.num_experts_per_tok)

    def routers(self, model: Any) -> list[tuple[str, Any]]:
        """Return ``(module name, router)`` of every MoE layer, in layer order.

        Raises:
            ModelFormatError: No router found.
        """
        found = [(name, mod) for name, mod in model.named_modules()
                 if type(mod).__name__ in self.router_classes]
        if not found:
            pattern = re.compile(self.legacy_gate)
            found = [(name, mod) for name, mod in model.named_modules()
                     if pattern.search(name) and hasattr(mod, "weight")]
        if not found:
            raise ModelFormatError(
                f"no MoE router found in {type(model).__name__} (adapter {self.name!r}: classes "
                f"{list(self.router_classes)} or modules matching {self.legacy_gate!r}); this "
                "transformers version names its routers differently — add an adapter to "
                "traces.capture.record.ADAPTERS")
        return found

    def is_legacy(self, router: Any) -> bool:
        """Return whether ``router`` is a 4.x ``nn.Linear`` gate (logits only)."""
        return type(router).__name__ not in self.router_classes

    # ------------------------------------------------------------------ scores and weights
    def logits(self, router: Any, x: Any) -> Any:
        """Return router logits [N, E] (float32) of hidden states x [N, h]."""
        torch, _ = import_torch_transformers()
        return torch.nn.functional.linear(x.float(), router.weight.float())

    def choice_scores(self, router: Any, probs: Any) -> Any:
        """Return the scores the router ranks by (probabilities, group-masked for DeepSeek)."""
        method = getattr(router, "topk_method", "greedy")
        if method == "group_limited_greedy":
            torch, _ = import_torch_transformers()
            groups = int(router.num_group)
            n, e = probs.shape
            gscore = probs.view(n, groups, e // groups).max(dim=-1).values
            keep = torch.topk(gscore, k=int(router.topk_group), dim=-1).indices
            mask = torch.zeros_like(gscore).scatter_(1, keep, 1.0)
            mask = mask.unsqueeze(-1).expand(n, groups, e // groups).reshape(n, e)
            return probs.masked_fill(mask == 0, 0.0)
        return probs

    def weights(self, router: Any, model: Any, selected_probs: Any) -> Any:
        """Apply the model's weight rule to the original probabilities of the selected experts."""
        rule = self.weight_rule
        if rule == "renorm" or (rule == "norm_topk_prob"
                                and bool(getattr(model.config, "norm_topk_prob", False))):
            return selected_probs / selected_probs.sum(dim=-1, keepdim=True)
        if rule == "scaled":
            return selected_probs * float(getattr(router, "routed_scaling_factor", 1.0))
        return selected_probs


#: Architecture family -> adapter (checked against transformers 5.23).
ADAPTERS: dict[str, RouterAdapter] = {
    "mixtral": RouterAdapter("mixtral", ("mixtral",), ("MixtralTopKRouter",),
                             r"block_sparse_moe\.gate$", "num_local_experts", "renorm"),
    "qwen2_moe": RouterAdapter("qwen2_moe", ("qwen2_moe", "qwen3_moe", "olmoe"),
                               ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "OlmoeTopKRouter"),
                               r"mlp\.gate$", "num_experts", "norm_topk_prob"),
    "deepseek_v2": RouterAdapter("deepseek_v2", ("deepseek_v2",), ("DeepseekV2TopkRouter",),
                                 r"mlp\.gate$", "n_routed_experts", "scaled"),
}


def resolve_adapter(model: Any, name: str | None = None) -> RouterAdapter:
    """Return the adapter of ``model`` (by ``config.model_type``) or the one named ``name``.

    Raises:
        ModelFormatError: Unknown architecture; the message lists the supported ones.
    """
    if name is not None:
        if name not in ADAPTERS:
            raise ModelFormatError(str(unknown_name("router adapter", name, ADAPTERS)))
        return ADAPTERS[name]
    model_type = str(getattr(getattr(model, "config", None), "model_type", None))
    for adapter in ADAPTERS.values():
        if model_type in adapter.model_types:
            if adapter.name == "deepseek_v2" and not hasattr(model.config, "n_routed_experts"):
                return RouterAdapter("deepseek_v2", ("deepseek_v2",), adapter.router_classes,
                                     adapter.legacy_gate, "num_experts", "scaled")
            return adapter
    supported = sorted(t for a in ADAPTERS.values() for t in a.model_types)
    raise ModelFormatError(
        f"unknown MoE architecture {model_type!r} (config.model_type of "
        f"{type(model).__name__}); supported: {supported}. Pass a model of one of these "
        "architectures or add a RouterAdapter to traces.capture.record.ADAPTERS")


def load_model(model_dir: str | os.PathLike[str]) -> tuple[Any, ByteTokenizer]:
    """Load a local ``save_pretrained`` MoE model (never downloads) and its byte tokenizer.

    Raises:
        ModelFormatError: The directory is missing, has no ``config.json``, cannot be loaded, or
            the architecture has no router adapter.
        RecordDependencyError: torch/transformers are not installed.
    """
    torch, transformers = import_torch_transformers()
    path = Path(model_dir).expanduser()
    if not (path / "config.json").is_file():
        raise ModelFormatError(
            f"model directory {str(path)!r} has no config.json; create one with "
            f"`hdamoe traces train-tiny --out {path}` or pass a directory written by "
            "save_pretrained (models are never downloaded)")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelFormatError(
            f"cannot load model directory {str(path)!r} ({type(exc).__name__}: {exc}); expected "
            "a local save_pretrained directory of a Mixtral / Qwen2-MoE / DeepSeek-V2 model"
        ) from exc
    model.eval()
    resolve_adapter(model)
    return model, ByteTokenizer.load(path)


# ---------------------------------------------------------------------------------- recorder


@dataclass
class _Call:
    """Per forward call: arrays of every MoE layer (filled by the hooks)."""

    rows: int = -1
    ids: dict[int, NDArray[np.int64]] = field(default_factory=dict)
    orig: dict[int, NDArray[np.int64]] = field(default_factory=dict)
    cand_ids: dict[int, NDArray[np.int64]] = field(default_factory=dict)
    cand_scores: dict[int, NDArray[np.float32]] = field(default_factory=dict)
    scores: dict[int, NDArray[np.float32]] = field(default_factory=dict)
    pred: dict[int, NDArray[np.int64]] = field(default_factory=dict)
    inputs: dict[int, Any] = field(default_factory=dict)


class RoutingRecorder:
    """Context manager: hooks on every MoE router of ``model`` that record (and re-route).

    Args:
        model: A transformers causal-LM MoE model.
        adapter: Router adapter (default: resolved from ``config.model_type``).
        extra_candidates: J, candidates beyond the top-k kept with scores (default k).
        policy: Optional routing policy replacing the top-k (see the module docstring).
        keep_scores: Also keep the full score rows [N, E] of every layer (fidelity metrics).
        keep_inputs: Also keep the router inputs x_l [N, h] as torch tensors (substitutability).

    Attributes:
        calls: One :class:`_Call` per forward call since entering (or the last :meth:`reset`).
    """

    def __init__(self, model: Any, adapter: RouterAdapter | None = None, *,
                 extra_candidates: int | None = None, policy: RoutingPolicy | None = None,
                 keep_scores: bool = False, keep_inputs: bool = False) -> None:
        self.model = model
        self.adapter = adapter or resolve_adapter(model)
        self.k = self.adapter.top_k(model)
        self.E = self.adapter.num_experts(model)
        self.J = self.k if extra_candidates is None else int(extra_candidates)
        if not 0 <= self.J <= self.E - self.k:
            raise ValueError(f"extra_candidates J={self.J} must lie in [0, E-k={self.E - self.k}]")
        self.named_routers = self.adapter.routers(model)
        self.routers = [r for _, r in self.named_routers]
        self.policy = policy
        if policy is not None and any(self.adapter.is_legacy(r) for r in self.routers):
            raise ModelFormatError(
                f"{type(model).__name__} uses transformers-4.x linear gates that return logits "
                "only; a routing policy needs the 5.x router modules — upgrade transformers "
                "(pip install -c constraints.txt 'transformers>=5')")
        self.keep_scores, self.keep_inputs = keep_scores, keep_inputs
        self.calls: list[_Call] = []
        self._handles: list[Any] = []
        self._pending: _Call | None = None

    @property
    def num_layers(self) -> int:
        """L, the MoE layers."""
        return len(self.routers)

    def layer_keys(self) -> list[str]:
        """Return the decoder-layer index of every router (``moe_layer_keys`` of the trace)."""
        keys = []
        for name, _ in self.named_routers:
            match = re.search(r"layers\.(\d+)\.", name)
            keys.append(match.group(1) if match else name)
        return keys

    def reset(self) -> None:
        """Forget the recorded calls."""
        self.calls = []
        self._pending = None

    def __enter__(self) -> RoutingRecorder:
        """Register the hooks."""
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int) -> Callable[..., Any]:
        torch, _ = import_torch_transformers()
        adapter, k, J = self.adapter, self.k, self.J

        def hook(module: Any, inputs: tuple[Any, ...], output: Any) -> Any:
            with torch.no_grad():
                x = inputs[0].reshape(-1, module.weight.shape[1])
                if layer == 0 or self._pending is None:
                    self._pending = _Call(rows=int(x.shape[0]))
                    self.calls.append(self._pending)
                call = self._pending
                legacy = not isinstance(output, tuple)
                logits = (output if legacy else output[0]).float()
                probs = torch.softmax(logits, dim=-1)
                choice = adapter.choice_scores(module, probs)
                if legacy:
                    own = torch.topk(choice, k, dim=-1).indices
                else:
                    own = output[2].long()
                # rank-order the router's own selection by its score (top-1 first)
                own_scores = choice.gather(1, own)
                order = torch.argsort(own_scores, dim=1, descending=True, stable=True)
                orig = own.gather(1, order)
                rest = choice.scatter(1, orig, -1.0)
                extra = torch.topk(rest, J, dim=-1).indices if J else orig[:, :0]
                cand = torch.cat([orig, extra], dim=1)
                orig_np = orig.cpu().numpy().astype(np.int64)
                call.orig[layer] = orig_np
                call.cand_ids[layer] = cand.cpu().numpy().astype(np.int64)
                call.cand_scores[layer] = probs.gather(1, cand).cpu().numpy().astype(np.float32)
                if self.keep_scores:
                    call.scores[layer] = probs.cpu().numpy().astype(np.float32)
                if self.keep_inputs:
                    call.inputs[layer] = x.detach().clone()
                if layer + 1 < len(self.routers):
                    nxt = self.routers[layer + 1]
                    p_next = torch.softmax(adapter.logits(nxt, x), dim=-1)
                    c_next = adapter.choice_scores(nxt, p_next)
                    call.pred[layer + 1] = torch.topk(c_next, k, dim=-1).indices.cpu().numpy(
                    ).astype(np.int64)
                if self.policy is None:
                    call.ids[layer] = orig_np
                    return None
                new = np.asarray(self.policy(layer, choice.cpu().numpy().astype(np.float64),
                                             orig_np), dtype=np.int64)
                if new.shape != orig_np.shape:
                    raise ValueError(f"routing policy returned shape {new.shape} for layer "
                                     f"{layer}; expected {orig_np.shape}")
                call.ids[layer] = new
                idx = torch.from_numpy(new).to(output[2].device)
                weights = adapter.weights(module, self.model, probs.gather(1, idx))
                return (output[0], weights.to(output[1].dtype), idx.to(output[2].dtype))

        return hook

    # ------------------------------------------------------------------ assembly
    def stacked(self, name: str, calls: Sequence[_Call] | None = None) -> NDArray[Any]:
        """Return one recorded field stacked over calls: [L, rows, ...] (``pred``: layer 0 −1)."""
        calls = self.calls if calls is None else calls
        out = []
        for layer in range(self.num_layers):
            parts = []
            for call in calls:
                values = getattr(call, name)
                if name == "pred" and layer == 0:
                    parts.append(np.full((call.rows, self.k), -1, dtype=np.int64))
                else:
                    parts.append(values[layer])
            out.append(np.concatenate(parts, axis=0))
        return np.stack(out)


def record_generate(model: Any, tokenizer: ByteTokenizer, prompts: Sequence[str], *,
                    max_new_tokens: int = 64, extra_candidates: int | None = None,
                    policy: RoutingPolicy | None = None, seed: int = 0,
                    temperature: float | None = None, model_key: str | None = None,
                    adapter: RouterAdapter | None = None) -> RoutingTrace:
    """Run ``model.generate()`` on every prompt (batch size 1) and return the recorded trace.

    Each prompt is one request (``req_id``); its rows are the prefill rows (``phase`` 0, one per
    prompt token) followed by one row per decode step (``phase`` 1; the last generated token is
    never fed back, so a request has prompt + generated − 1 rows). Decoding is greedy unless
    ``temperature`` is given; sampling then runs under ``torch.random.fork_rng`` seeded with
    ``seed + request`` (generate() offers no Generator argument; the caller's global RNG state is
    restored).

    Args:
        model: transformers MoE causal LM (eval mode).
        tokenizer: Byte tokenizer.
        prompts: Prompt texts.
        max_new_tokens: Tokens generated per prompt.
        extra_candidates: J (default k).
        policy: Optional routing policy (gated routing in ``topk_ids``, original in
            ``orig_topk_ids``).
        seed: Seed of the sampling.
        temperature: Sampling temperature (None = greedy).
        model_key: ``meta["model"]`` (default ``"<model_type>-recorded"``).
        adapter: Router adapter (default: resolved).

    Returns:
        The trace (validated).

    Raises:
        TraceFormatError: An empty prompt list.
    """
    torch, transformers = import_torch_transformers()
    if not prompts:
        raise TraceFormatError("record_generate: no prompts given; pass at least one prompt")
    limit = int(getattr(model.config, "max_position_embeddings", 4096))
    recorder = RoutingRecorder(model, adapter, extra_candidates=extra_candidates, policy=policy)
    req, pos, phase = [], [], []
    calls: list[_Call] = []
    requests_meta = []
    with recorder:
        for r, prompt in enumerate(prompts):
            ids = tokenizer.encode(prompt)[: max(1, limit - max_new_tokens)]
            recorder.reset()
            kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "use_cache": True,
                                      "pad_token_id": tokenizer.pad_id,
                                      "eos_token_id": tokenizer.eos_id}
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + r)
                if temperature is None:
                    kwargs["do_sample"] = False
                else:
                    kwargs.update(do_sample=True, temperature=float(temperature), top_k=0,
                                  top_p=1.0)
                out = model.generate(torch.tensor([ids]),
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     **kwargs)
            n_rows = sum(c.rows for c in recorder.calls)
            calls.extend(recorder.calls)
            req += [r] * n_rows
            pos += list(range(n_rows))
            phase += [0] * recorder.calls[0].rows + [1] * (n_rows - recorder.calls[0].rows)
            requests_meta.append({"prompt_tokens": len(ids),
                                  "generated_tokens": int(out.shape[1] - len(ids)),
                                  "rows": n_rows, "forward_calls": len(recorder.calls)})
    topk = recorder.stacked("ids", calls)
    orig = recorder.stacked("orig", calls)
    model_type = str(getattr(model.config, "model_type", "unknown"))
    meta = {
        "model": model_key or f"{model_type}-recorded", "E": recorder.E, "k": recorder.k,
        "L": recorder.num_layers, "J": recorder.J, "moe_layer_keys": recorder.layer_keys(),
        "ids_rank_ordered": policy is None, "score_kind": "softmax_all",
        "predictor": {"kind": "gate_next_layer",
                      "input": "router input of layer l (post_attention_layernorm output)",
                      "rule": "top-k of softmax(W_gate[l+1] x_l) with the router's selection"},
        "source": {"kind": "recorded", "architecture": type(model).__name__,
                   "adapter": recorder.adapter.name, "transformers": transformers.__version__,
                   "name_or_path": str(getattr(model.config, "_name_or_path", ""))},
        "dataset": "prompts", "batch_size": 1, "decoding": "greedy" if temperature is None
        else f"sample T={temperature}", "requests": requests_meta,
        "gated": policy is not None,
    }
    n = len(req)
    trace = RoutingTrace(
        topk_ids=topk, orig_topk_ids=orig if policy is not None else None,
        cand_ids=recorder.stacked("cand_ids", calls),
        cand_scores=recorder.stacked("cand_scores", calls),
        pred_ids=recorder.stacked("pred", calls), req_id=np.asarray(req, np.int32),
        conv_id=np.asarray(req, np.int32), turn=np.zeros(n, np.int16),
        pos=np.asarray(pos, np.int32), phase=np.asarray(phase, np.uint8),
        keep=np.ones(n, bool), meta=meta)
    trace.validate("record_generate")
    return trace


def prediction_accuracy(trace: RoutingTrace) -> dict[str, Any]:
    """Measure the recorded next-layer prediction against the actual routing (§10.2).

    The actual set of layer l is ``orig_topk_ids`` when present (the router's own top-k), else
    ``topk_ids``; rows whose prediction is −1 (layer 0) are skipped.

    Returns:
        ``{"overlap": [L] mean |S ∩ Ŝ|/k (the reference accuracy metric; NaN for layer 0),
        "top1_in_pred": [L] fraction of rows whose actual top-1 is in Ŝ, "exact": [L] fraction of
        identical sets, "mean_overlap": mean of ``overlap`` over layers ≥ 1, "rows": T}``.

    Raises:
        TraceFormatError: The trace has no ``pred_ids``.
    """
    if trace.pred_ids is None:
        raise TraceFormatError("prediction_accuracy: the trace has no 'pred_ids'; record it with "
                               "traces.capture.record or add a predictor")
    actual = trace.orig_topk_ids if trace.orig_topk_ids is not None else trace.topk_ids
    pred = trace.pred_ids.astype(np.int64)
    act = actual.astype(np.int64)
    k = trace.top_k
    overlap, top1, exact = [], [], []
    for layer in range(trace.num_layers):
        valid = (pred[layer] >= 0).all(axis=1)
        if not valid.any():
            overlap.append(float("nan"))
            top1.append(float("nan"))
            exact.append(float("nan"))
            continue
        a, p = act[layer, valid], pred[layer, valid]
        hits = (a[:, :, None] == p[:, None, :]).any(axis=2)          # [T, k]
        overlap.append(float(hits.sum(axis=1).mean() / k))
        top1.append(float(hits[:, 0].mean()))
        exact.append(float(hits.all(axis=1).mean()))
    valid_layers = [v for v in overlap if not np.isnan(v)]
    return {"overlap": overlap, "top1_in_pred": top1, "exact": exact,
            "mean_overlap": float(np.mean(valid_layers)) if valid_layers else float("nan"),
            "rows": trace.num_tokens}


def stdlib_heldout_prompts(count: int, num_bytes: int, *, seed: int = 0) -> list[str]:
    """Return ``count`` text snippets of ``num_bytes`` bytes from the held-out stdlib files.

    Files are the held-out part of :func:`traces.capture.tiny_model.stdlib_corpus`; a seeded numpy
    Generator picks a file (without replacement while possible) and a line-aligned start.

    Args:
        count: Number of snippets.
        num_bytes: Bytes per snippet (ASCII sources: about one token per byte).
        seed: Seed of the choice.
    """
    from traces.capture.tiny_model import stdlib_corpus

    corpus = stdlib_corpus(max_train_bytes=0)
    texts = [t for t in corpus.heldout_texts if len(t.encode()) > num_bytes]
    if not texts:
        raise TraceFormatError(f"no held-out stdlib file is longer than {num_bytes} bytes")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(texts))
    out = []
    for i in range(count):
        text = texts[int(order[i % len(order)])].encode()
        start = int(rng.integers(0, len(text) - num_bytes + 1))
        nl = text.rfind(b"\n", 0, start)
        start = nl + 1 if nl >= 0 and len(text) - (nl + 1) >= num_bytes else start
        out.append(text[start:start + num_bytes].decode("utf-8", errors="replace"))
    return out


__all__ += ["RecordDependencyError", "is_heldout"]
