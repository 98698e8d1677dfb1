"""``hdamoe traces train-tiny|record|fidelity``: real routing from transformers MoE models.

Application layer (style.md §2): imports ``traces.capture.record``/``traces.capture.tiny_model``/``traces.capture.fidelity``
and ``hdamoe_env.app.model_gating`` inside the command functions, so that ``hdamoe --help`` and the other
subcommands never import torch or transformers.

* ``train-tiny`` — train the tiny Mixtral model on stdlib sources (``traces.capture.tiny_model``);
* ``record`` — run ``model.generate()`` over prompts with router hooks and write a canonical trace
  (``traces.capture.record``), printing the next-layer prediction accuracy;
* ``fidelity`` — routing-fidelity metrics of paper-model.md §12 for hardware-aware gating at
  several strengths, the zero-coefficient control and the Cache-prior reference, plus the simulated
  latency of the original vs the gated routing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from hdamoe_env.app.tables import render_table
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled

__all__ = ["cmd_fidelity", "cmd_record", "cmd_train_tiny"]


def _deps() -> None:
    """Raise ``DependencyNotInstalled`` when the ``record`` extra is missing."""
    from traces.capture.tiny_model import RecordDependencyError, import_torch_transformers

    try:
        import_torch_transformers()
    except RecordDependencyError as exc:
        raise DependencyNotInstalled(str(exc)) from exc


def _load(model_dir: str | None) -> tuple[Any, Any]:
    """Load a model directory; turn the trace layer's errors into ``ConfigError``."""
    from traces.capture import record

    try:
        return record.load_model(_model_dir(model_dir))
    except record.ModelFormatError as exc:
        raise ConfigError(str(exc)) from exc


def _model_dir(value: str | None) -> Path:
    from traces.capture.tiny_model import DEFAULT_MODEL_DIR

    return Path(value).expanduser() if value else DEFAULT_MODEL_DIR


def cmd_train_tiny(args: argparse.Namespace) -> int:
    """Run ``hdamoe traces train-tiny``."""
    _deps()
    from traces.capture.tiny_model import TinyModelSpec, train_tiny

    spec = TinyModelSpec(hidden_size=args.hidden, num_layers=args.layers,
                         intermediate_size=2 * args.hidden)
    res = train_tiny(_model_dir(args.out), minutes=args.minutes, seed=args.seed, spec=spec,
                     seq_len=args.seq_len, batch_size=args.batch, lr=args.lr,
                     max_steps=args.max_steps)
    print(json.dumps({k: getattr(res, k) for k in res.__dataclass_fields__}, indent=1))
    return 0


def _prompts(args: argparse.Namespace, tokenizer: Any) -> list[str]:
    from traces.capture.record import stdlib_heldout_prompts

    if args.prompts:
        path = Path(args.prompts)
        if not path.is_file():
            raise ConfigError(f"--prompts {str(path)!r} is not a file; pass a text file with "
                              "one prompt per paragraph (blank-line separated) or use "
                              "--stdlib-heldout")
        text = path.read_text()
        prompts = [p.strip("\n") for p in text.split("\n\n") if p.strip()]
        if not prompts:
            raise ConfigError(f"--prompts {str(path)!r} holds no prompt")
        return prompts[: args.num_prompts]
    return stdlib_heldout_prompts(args.num_prompts, args.prompt_bytes, seed=args.seed)


def cmd_record(args: argparse.Namespace) -> int:
    """Run ``hdamoe traces record``."""
    _deps()
    import traces
    from traces.capture import record

    model, tokenizer = _load(args.model_dir)
    prompts = _prompts(args, tokenizer)
    t0 = time.perf_counter()
    trace = record.record_generate(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                                   extra_candidates=args.extra_candidates, seed=args.seed,
                                   model_key=args.model_key)
    wall = time.perf_counter() - t0
    path = traces.save(trace, args.out)
    acc = record.prediction_accuracy(trace)
    print(f"wrote {path}: {trace.num_layers} MoE layers × {trace.num_tokens} rows × "
          f"top-{trace.top_k} (E={trace.num_experts}, J={trace.meta['J']}), "
          f"{len(prompts)} requests, {wall:.1f} s, trace id {trace.trace_id[:12]}")
    print("next-layer prediction (gate of layer l+1 on the router input of layer l):")
    for layer, (overlap, recall_k, exact) in enumerate(zip(acc["overlap"], acc["top1_in_pred"],
                                                           acc["exact"], strict=True)):
        if layer == 0:
            continue
        print(f"  layer {layer}: overlap |S∩Ŝ|/k = {overlap:.3f}, top-1 ∈ Ŝ = {recall_k:.3f}, "
              f"exact set = {exact:.3f}")
    print(f"  mean over layers 1..{trace.num_layers - 1}: overlap {acc['mean_overlap']:.3f}")
    if args.json:
        from hdamoe_env.config.fileio import write_json

        write_json(args.json, {"trace": str(path), "trace_id": trace.trace_id,
                               "wall_s": wall, "prediction": acc})
    return 0


def _levels(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--gating-levels must be a comma list of numbers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise ConfigError(f"--gating-levels must be non-negative numbers, got {text!r}")
    return values


def cmd_fidelity(args: argparse.Namespace) -> int:
    """Run ``hdamoe traces fidelity``."""
    _deps()
    from hdamoe_env.app import model_gating
    from traces.capture import fidelity
    from traces.capture import record

    model, tokenizer = _load(args.model_dir)
    adapter = record.resolve_adapter(model)
    texts = record.stdlib_heldout_prompts(args.num_texts, args.text_bytes, seed=args.seed)
    # whole gating chunks only, so that every chunk is one simulated decode step of B rows
    seqs = [ids[: (min(len(ids), args.max_len) // args.batch) * args.batch]
            for ids in (tokenizer.encode(t) for t in texts)]
    seqs = [s for s in seqs if s]
    if not seqs:
        raise ConfigError(f"no held-out text has --batch {args.batch} tokens; raise "
                          "--text-bytes or lower --batch")
    setup = model_gating.GatingSetup.for_model(
        adapter.num_experts(model), adapter.top_k(model), len(adapter.routers(model)),
        sim_model=args.sim_model, setting=args.setting, mesh=args.mesh,
        conventions=args.conventions, placement=args.placement, seed=args.seed)
    base_coef = setup.coefficients
    policies: list[tuple[str, Any]] = [("zero control (r=0)", setup.policy(0.0, batch=args.batch))]
    for level in _levels(args.levels):
        policies.append((f"HAG ×{level:g} (r_comp={level * base_coef[0]:.3g}, "
                         f"r_comm={level * base_coef[1]:.3g})",
                         setup.policy(level, batch=args.batch)))
    t0 = time.perf_counter()
    base = fidelity.run_reference(model, adapter, seqs)
    cache = fidelity.cache_prior_policy(base.orig_ids, base.scores, lam=args.cache_lambda)
    policies.append((f"Cache-prior (λ={args.cache_lambda:g}, J=1)", cache))
    rows = []
    for label, policy in policies:
        metrics = fidelity.routing_impact(model, adapter, seqs, policy, reference=base)
        lat = setup.simulate(base.orig_ids, metrics.gated_ids, batch=args.batch,
                             seed=args.seed) if args.simulate else {}
        rows.append({"policy": label, **metrics.summary(), **lat})
        print(json.dumps(rows[-1]))
    subs = fidelity.substitutability(model, adapter, seqs, num_tokens=args.sub_tokens,
                                     seed=args.seed)
    wall = time.perf_counter() - t0
    head, cells, formats = fidelity.impact_table(rows)
    print(render_table(head, cells, style="markdown", formats=formats, missing=""))
    print("\nboundary-expert substitutability (mean cos(y, y_ij), rows = candidate j, "
          "cols = selected i):")
    print(subs.format())
    if args.json:
        from hdamoe_env.config.fileio import write_json

        write_json(args.json, {"rows": rows, "substitutability": subs.to_dict(),
                               "wall_s": wall, "texts": len(seqs),
                               "tokens": int(sum(len(s) for s in seqs)),
                               "setup": setup.describe()})
    print(f"\n{len(seqs)} held-out texts, {sum(len(s) for s in seqs)} tokens, {wall:.1f} s")
    return 0


