"""Offline placement methods: TP, EP, hybrid, Node Balance, Link Balance (paper-model.md §7–9).

TP and EP are data constructors in ``hdamoe_env.placement``; the optimisers arrive with the
offline-placement issue.
"""

METHODS: dict[str, object] = {}
