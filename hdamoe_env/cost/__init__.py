"""The cost model: closed-form compute and communication terms of one MoE layer.

What lives here: the expert phase, TP all-reduce and the analytic estimator of Eq. 2
(``perf``, paper-model.md §5), the non-MoE term (``nonmoe``, §5.3), the α–β broadcast time,
the pre-broadcast budget and the plan of a layer (``broadcast``: ``broadcast_plan``,
``broadcast_slots``, §10.3–10.4), the per-request context lengths of decode steps and their
attention/KV cost (``context``, docs/PHYSICS.md §13), the energy per event with its
``EnergySpec`` per profile (``energy``, §18) and the unit and shape checks they share
(``units``).

May import: hdamoe_env.config, hdamoe_env.noc
"""
