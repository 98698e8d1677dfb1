"""``hdamoe traces stats|gen|convert``: statistics, synthetic generation and conversion of traces.

The trace tools of the command line over the ``traces`` package (traces.md); real-model recording
(``train-tiny``, ``record``, ``fidelity``) is :mod:`hdamoe_env.app.record`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hdamoe_env.app.tables import render_table
from hdamoe_env.app.argtypes import run_from_args
from hdamoe_env.config.fileio import write_json
from hdamoe_env.config.specs import get_model
from hdamoe_env.sim.sources import load_trace

__all__ = ["cmd_traces_convert", "cmd_traces_gen", "cmd_traces_stats"]


def cmd_traces_stats(args: argparse.Namespace) -> int:
    """Run ``hdamoe traces stats PATH...`` (``synthetic:<model>`` generates one)."""
    from traces import stats

    columns = {}
    for spec in args.paths:
        if spec.startswith("synthetic"):
            key = spec.split(":", 1)[1] if ":" in spec else "mixtral-8x7b"
            model = get_model(key)
            trace = load_trace("synthetic", model, seed=args.seed, requests=args.trace_requests)
            label = f"synthetic:{model.key}"
        else:
            model = None
            trace = load_trace(spec, None)
            label = Path(spec).name
        columns[label] = stats.trace_stats(trace, view=args.view, B=args.batch,
                                           rng_seed=args.seed)
    head, rows = stats.stats_table(columns)
    print(render_table(head, rows, align="l" + "r" * (len(head) - 1)))
    if args.json:
        write_json(args.json, columns)
    return 0


def cmd_traces_gen(args: argparse.Namespace) -> int:
    """Run ``hdamoe traces gen``: write a synthetic trace in the canonical format."""
    import traces

    model = run_from_args(args).model
    trace = load_trace("synthetic", model, seed=args.seed, requests=args.trace_requests,
                       skew=args.skew)
    path = traces.save(trace, args.out)
    print(f"wrote {path}: {trace.num_layers} layers × {trace.num_tokens} rows × "
          f"top-{trace.top_k}, trace id {trace.trace_id[:12]}")
    return 0


def cmd_traces_convert(args: argparse.Namespace) -> int:
    """Run ``hdamoe traces convert``: reference JSON → canonical ``.npz``."""
    import traces

    kwargs: dict[str, Any] = {}
    if args.model:
        model = get_model(args.model)
        kwargs = {"model_key": model.key, "E": model.num_experts, "k": model.top_k,
                  "layer_key_offset": model.layer_key_offset,
                  "num_layers": model.num_moe_layers}
    trace = traces.read_reference_json(args.path, **kwargs)
    path = traces.save(trace, args.out)
    print(f"wrote {path}: {trace.num_layers} layers × {trace.num_tokens} rows; keep it outside "
          "the repository (it redistributes reference-trace content; see NOTICE)")
    return 0
