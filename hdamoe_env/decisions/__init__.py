"""Online decisions: what the scheduler decides for one layer, given predictions.

What lives here: next-layer expert-load prediction (``prediction``, traces.md §7.6), priority
selection of the experts to pre-broadcast (``broadcast``, paper-model.md §10.5), dispatch of
tokens to broadcast copies and redundant replicas (``dispatch``, §10.6), hardware-aware gating
(``gating``, §11) and the matched-quality search of a gating scale (``quality``).

May import: hdamoe_env.config, hdamoe_env.noc, hdamoe_env.cost, traces
"""
