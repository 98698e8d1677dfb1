"""Node Balance: the per-layer placement MILP and its heuristic (paper-model.md §7).

What lives here: the MILP's arrays and objective (``model``), the PuLP / HiGHS solve with group
compression and warm starts (``milp``) and the fast heuristic mode (``heuristic``).

May import: hdamoe_env.config, hdamoe_env.noc, hdamoe_env.cost, hdamoe_env.sim, traces
"""
