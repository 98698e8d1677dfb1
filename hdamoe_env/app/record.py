"""``hdamoe traces train-tiny|record|fidelity``: real routing from transformers MoE models (issue 7).

Application layer (style.md §2): imports ``traces.record``/``traces.tiny_model``/``traces.fidelity``
and ``hdamoe_env.app.model_gating`` inside the command functions, so that ``hdamoe --help`` and the other
subcommands never import torch or transformers.

* ``train-tiny`` — train the tiny Mixtral model on stdlib sources (``traces.tiny_model``);
* ``record`` — run ``model.generate()`` over prompts with router hooks and write a canonical trace
  (``traces.record``), printing the next-layer prediction accuracy;
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

from hdamoe_env.errors import ConfigError, DependencyNotInstalled

__all__ = ["add_record_parsers"]


def _deps() -> None:
    """Raise ``DependencyNotInstalled`` when the ``record`` extra is missing."""
    from traces.tiny_model import RecordDependencyError, import_torch_transformers

    try:
        import_torch_transformers()
    except RecordDependencyError as exc:
        raise DependencyNotInstalled(str(exc)) from exc


def _load(model_dir: str | None) -> tuple[Any, Any]:
    """Load a model directory; turn the trace layer's errors into ``ConfigError``."""
    from traces import record

    try:
        return record.load_model(_model_dir(model_dir))
    except record.ModelFormatError as exc:
        raise ConfigError(str(exc)) from exc


def _model_dir(value: str | None) -> Path:
    from traces.tiny_model import DEFAULT_MODEL_DIR

    return Path(value).expanduser() if value else DEFAULT_MODEL_DIR


def cmd_train_tiny(args: argparse.Namespace) -> int:
    """Run ``hdamoe traces train-tiny``."""
    _deps()
    from traces.tiny_model import TinyModelSpec, train_tiny

    spec = TinyModelSpec(hidden_size=args.hidden, num_layers=args.layers,
                         intermediate_size=2 * args.hidden)
    res = train_tiny(_model_dir(args.out), minutes=args.minutes, seed=args.seed, spec=spec,
                     seq_len=args.seq_len, batch_size=args.batch, lr=args.lr,
                     max_steps=args.max_steps)
    print(json.dumps({k: getattr(res, k) for k in res.__dataclass_fields__}, indent=1))
    return 0


def _prompts(args: argparse.Namespace, tokenizer: Any) -> list[str]:
    from traces.record import stdlib_heldout_prompts

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
    from traces import record

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
        from hdamoe_env.fileio import write_json

        write_json(args.json, {"trace": str(path), "trace_id": trace.trace_id,
                               "wall_s": wall, "prediction": acc})
    return 0


def _levels(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--levels must be a comma list of numbers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise ConfigError(f"--levels must be non-negative numbers, got {text!r}")
    return values


def cmd_fidelity(args: argparse.Namespace) -> int:
    """Run ``hdamoe traces fidelity``."""
    _deps()
    from hdamoe_env.app import model_gating
    from traces import fidelity, record

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
    print(fidelity.format_table(rows))
    print("\nboundary-expert substitutability (mean cos(y, y_ij), rows = candidate j, "
          "cols = selected i):")
    print(subs.format())
    if args.json:
        from hdamoe_env.fileio import write_json

        write_json(args.json, {"rows": rows, "substitutability": subs.to_dict(),
                               "wall_s": wall, "texts": len(seqs),
                               "tokens": int(sum(len(s) for s in seqs)),
                               "setup": setup.describe()})
    print(f"\n{len(seqs)} held-out texts, {sum(len(s) for s in seqs)} tokens, {wall:.1f} s")
    return 0


def add_record_parsers(tsub: Any) -> None:
    """Register ``train-tiny``, ``record`` and ``fidelity`` under ``hdamoe traces``."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    tt = tsub.add_parser("train-tiny", formatter_class=fmt,
                         help="train the tiny Mixtral model on stdlib sources (needs [record])")
    tt.add_argument("--out", default=None,
                    help="output directory (default ~/.cache/hdamoe-env/tiny-mixtral)")
    tt.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget")
    tt.add_argument("--seed", type=int, default=0)
    tt.add_argument("--hidden", type=int, default=96)
    tt.add_argument("--layers", type=int, default=4)
    tt.add_argument("--seq-len", type=int, default=128)
    tt.add_argument("--batch", type=int, default=16)
    tt.add_argument("--lr", type=float, default=3e-3)
    tt.add_argument("--max-steps", type=int, default=None)
    tt.set_defaults(func=cmd_train_tiny)

    rec = tsub.add_parser("record", formatter_class=fmt,
                          help="record routing (ids, scores, next-layer predictions) during "
                          "generate() of a transformers MoE model (needs [record])")
    rec.add_argument("--model-dir", default=None,
                     help="save_pretrained directory (default: the train-tiny output)")
    src = rec.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", default=None,
                     help="text file, prompts separated by blank lines")
    src.add_argument("--stdlib-heldout", action="store_true",
                     help="prompts from the held-out stdlib files")
    rec.add_argument("--num-prompts", type=int, default=16)
    rec.add_argument("--prompt-bytes", type=int, default=256,
                     help="--stdlib-heldout: bytes per prompt")
    rec.add_argument("--max-new-tokens", type=int, default=64)
    rec.add_argument("--extra-candidates", type=int, default=None,
                     help="J: candidates beyond the top-k stored with scores (default k)")
    rec.add_argument("--model-key", default=None, help="meta['model'] of the trace")
    rec.add_argument("--seed", type=int, default=0)
    rec.add_argument("--out", required=True, help="trace path (.hdtrace.npz)")
    rec.add_argument("--json", default=None, help="write the prediction accuracy here")
    rec.set_defaults(func=cmd_record)

    fid = tsub.add_parser("fidelity", formatter_class=fmt,
                          help="routing fidelity of hardware-aware gating on held-out text "
                          "(paper-model.md §12; needs [record])")
    fid.add_argument("--model-dir", default=None)
    fid.add_argument("--num-texts", type=int, default=16)
    fid.add_argument("--text-bytes", type=int, default=512)
    fid.add_argument("--max-len", type=int, default=512)
    fid.add_argument("--batch", type=int, default=32,
                     help="gating batch: consecutive rows gated together (a decode step)")
    fid.add_argument("--levels", default="0.01,0.1,1",
                     help="multiples of the default (r_comp, r_comm) of --sim-model")
    fid.add_argument("--cache-lambda", type=float, default=0.5)
    fid.add_argument("--sub-tokens", type=int, default=256,
                     help="tokens per layer for the substitutability matrix")
    fid.add_argument("--sim-model", default="mixtral-8x7b",
                     help="preset whose layer shapes (h, I) and coefficients are used; its "
                     "layer count is replaced by the recorded model's")
    fid.add_argument("--setting", default="5/50")
    fid.add_argument("--mesh", default="4x8")
    fid.add_argument("--conventions", default="paper")
    fid.add_argument("--placement", default="ep", choices=("ep", "tp"))
    fid.add_argument("--no-simulate", dest="simulate", action="store_false")
    fid.add_argument("--seed", type=int, default=0)
    fid.add_argument("--json", default=None)
    fid.set_defaults(func=cmd_fidelity)
