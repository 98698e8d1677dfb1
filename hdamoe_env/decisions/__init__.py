"""Online decisions: what the scheduler decides for one layer, given predictions.

What lives here: next-layer expert-load prediction and the predictors a run chooses from
(``prediction``, paper-model.md §10.2, traces.md §7.6), priority selection of the experts to
pre-broadcast (``broadcast``, §10.5), dispatch of tokens to broadcast copies and redundant
replicas (``dispatch``, §10.6–10.7), hardware-aware gating (``gating``: the public API and
statistics, §11; ``gating_kernels``: its compiled row loop) and the matched-quality search of a
gating scale (``quality``). Pure decisions on arrays: how much time they cost is the
simulator's business (``hdamoe_env.sim.online``).

May import: hdamoe_env.config
"""
