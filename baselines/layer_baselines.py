"""Per-layer baseline placements as plain arrays, for scoring in the placement env.

The placement env (``hdamoe_env.env.place.HdMoePlaceEnv``) builds one layer's placement and
scores any layer placement with ``evaluate_placement(P_layer, pi_layer, allreduce)``. This
module turns the offline pipeline's per-layer outcome (``baselines.pipeline_layer``, paper-model.md
§8.5) into those arrays, one :class:`LayerCandidate` per method:

| name | placement | mapping |
|---|---|---|
| ``ep`` | EP (§9.2, the run's seeded shares) — the NoOp of the placement lever | π0 (random) |
| ``tp`` | TP (§9.1), every share 1/D | identity |
| ``tp-tiled`` | tile-aligned TP (``tensor_parallel_tiled``), all-reduce layer | identity |
| ``hybrid`` | compute-balanced hybrid TP-EP (§9.3) | identity (§9.3) |
| ``node_balance`` | Node Balance (§7) | π0 |
| ``node_link`` | Node + Link Balance with the pipeline's guard (§7–8) | Link Balance's |

The env never imports ``baselines`` (style.md §2); the caller composes the two (the headroom
benchmark, ``benchmarks/headroom.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from baselines.pipeline import run_pipeline
from baselines.pipeline_config import PlaceConfig
from baselines.pipeline_layer import LayerOutcome
from hdamoe_env.sim.placement import identity_mapping, share_unit, tensor_parallel_tiled

__all__ = ["LAYER_BASELINES", "LayerCandidate", "layer_candidates", "pipeline_candidates"]

#: Method names of :func:`layer_candidates`, in table order.
LAYER_BASELINES = ("ep", "tp", "tp-tiled", "hybrid", "node_balance", "node_link")


@dataclass(frozen=True)
class LayerCandidate:
    """One layer's placement as arrays.

    Attributes:
        P: float64 [E, D] shares (rows sum to 1).
        pi: int64 [D] cluster → endpoint.
        allreduce: The layer is an all-reduce (tile-aligned TP) layer.
    """

    P: NDArray[np.float64]
    pi: NDArray[np.int64]
    allreduce: bool = False


def layer_candidates(outcome: LayerOutcome, config: PlaceConfig) -> dict[str, LayerCandidate]:
    """Return the baselines of one pipeline layer, by the names of :data:`LAYER_BASELINES`.

    Args:
        outcome: The pipeline's result for the layer (``place_layer``).
        config: The pipeline's configuration (model, hardware, profile).

    Returns:
        ``{name: LayerCandidate}`` in :data:`LAYER_BASELINES` order.
    """
    arrays: dict[str, Any] = outcome.arrays
    model, conv = config.model_spec, config.conv
    D = config.hardware.num_nodes
    E = model.num_experts
    ident = identity_mapping(1, D)[0]
    tiled = tensor_parallel_tiled(1, E, D, share_unit(model, conv)).P[0] if conv.tile_cols > 1 \
        else np.full((E, D), 1.0 / D)
    return {
        "ep": LayerCandidate(arrays["P_ep"], arrays["pi0"]),
        "tp": LayerCandidate(np.full((E, D), 1.0 / D), ident),
        "tp-tiled": LayerCandidate(tiled, ident, True),
        "hybrid": LayerCandidate(arrays["P_hybrid"], ident),
        "node_balance": LayerCandidate(arrays["P_nb"], arrays["pi0"]),
        "node_link": LayerCandidate(arrays["P"], arrays["pi"], bool(arrays["allreduce"])),
    }


def pipeline_candidates(config: PlaceConfig, trace: Any, layers: Sequence[int],
                        out_dir: str, *, workers: int = 1, resume: bool = True
                        ) -> dict[int, dict[str, LayerCandidate]]:
    """Run the offline pipeline on ``layers`` and return every layer's baselines.

    Args:
        config: The pipeline configuration (e.g. ``QUICK_PLACEMENT`` budgets).
        trace: The loaded routing trace (the env's, so both see the same statistics).
        layers: MoE layers to place.
        out_dir: Pipeline output directory (artifacts; resumable).
        workers: Worker processes.
        resume: Skip layers already finished in ``out_dir``.

    Returns:
        ``{layer: {name: LayerCandidate}}``.
    """
    res = run_pipeline(config, out_dir, layers=list(layers), workers=workers, resume=resume,
                       trace=trace)
    return {layer: layer_candidates(res.layers[layer], config) for layer in layers}
