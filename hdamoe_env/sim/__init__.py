"""The simulator: placements, trace sources, the layer evaluator and the step simulator.

What lives here: ``Placement`` arrays and their files (``placement``, paper-model.md §7), the
trace by name (``sources``), the one layer-latency evaluator (``evaluator``: expert phase plus
DES or analytic communication), ``MoESimulator`` (``simulator``), the γ fit of the analytic
twin with its cache (``calibrate``, §5.5). It knows nothing of RL.

May import: hdamoe_env.config, hdamoe_env.noc, hdamoe_env.cost, hdamoe_env.decisions, traces
"""
