"""The simulator: placements, trace sources, the layer evaluator and the step simulator.

What lives here: ``Placement`` arrays and their files (``placement``, paper-model.md §7), the
trace by name, its router scores and a decode step's candidates (``sources``), the one
layer-latency evaluator (``evaluator``: expert phase plus DES or analytic communication),
``MoESimulator`` with its placement checks (``simulator``), layers under online decisions —
gating, pre-broadcast, dispatch, broadcast slots (``online``: ``DecisionEvaluator``,
§10–11) — EPLB's replication and balanced packing of one layer (``eplb``, shared by
``baselines.eplb`` and the drift env) — the γ fit of the analytic twin with its cache
(``calibrate``, §5.5) and the energy of layers and steps (``energy``: ``EnergyAccount``,
docs/PHYSICS.md §18). It knows nothing of RL.

May import: hdamoe_env.config, hdamoe_env.noc, hdamoe_env.cost, hdamoe_env.decisions, traces
"""
