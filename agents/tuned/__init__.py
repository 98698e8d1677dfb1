"""The tuned heuristic: HDA-MoE's greedy agents with every knob searched, and its hindsight bound.

The paper's online agents (``agents.composite.HDAMoEAgent``: greedy pre-broadcast, a dispatch
rule, hardware-aware gating) have knobs the paper fixes by hand. This package searches them on
the *training* part of a trace and reports the best point under a model-quality constraint, so
that a learned policy can be compared with the strongest heuristic of the same levers rather
than with the defaults.

What lives here: one point of the knob space and the search space (``knobs``: gating level,
protect-top, dispatch rule, k_b, replica rule, imbalance threshold); the search under the
quality constraint with its measurement on the env, its resumable journal and the
``tuned.json`` file (``search``); and the per-layer hindsight oracle over the same grid with its
LP-shares twin (``oracle``). The public names of the three modules are re-exported here, so
``from agents import tuned`` gives ``tuned.tune``, ``tuned.per_layer_oracle`` and the rest.

``hdamoe tune`` (``hdamoe_env.app.tune``) is the command; ``hdamoe bench --methods
tuned:PATH/tuned.json`` runs the result as a method. Nothing here imports the application layer.

May import: agents, hdamoe_env, hdamoe_env.config, hdamoe_env.noc, hdamoe_env.cost,
hdamoe_env.decisions, hdamoe_env.sim, hdamoe_env.env, traces
"""

from __future__ import annotations

from agents.tuned.knobs import (
    LP_SHARES,
    REPLICA_RULE_ENV_KWARG,
    REPLICA_RULES,
    KnobGrid,
    TunedKnobs,
)
from agents.tuned.oracle import OracleResult, balanced_replica_fractions, per_layer_oracle
from agents.tuned.search import (
    DEFAULT_PENALTY,
    DEFAULT_QUALITY_TARGET,
    SEARCH_METHODS,
    TUNED_FORMAT,
    EpisodeEvaluator,
    Measurement,
    PointRecord,
    TuneResult,
    load_tuned,
    penalised_objective,
    run_key_of,
    tune,
    write_tuned,
)

__all__ = [
    "DEFAULT_PENALTY",
    "DEFAULT_QUALITY_TARGET",
    "LP_SHARES",
    "REPLICA_RULES",
    "REPLICA_RULE_ENV_KWARG",
    "SEARCH_METHODS",
    "TUNED_FORMAT",
    "EpisodeEvaluator",
    "KnobGrid",
    "Measurement",
    "OracleResult",
    "PointRecord",
    "TuneResult",
    "TunedKnobs",
    "balanced_replica_fractions",
    "load_tuned",
    "penalised_objective",
    "per_layer_oracle",
    "run_key_of",
    "tune",
    "write_tuned",
]
