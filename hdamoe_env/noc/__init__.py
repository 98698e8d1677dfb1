"""The network-on-chip: topologies, the per-link message DES and the traffic it carries.

What lives here: mesh / torus / fat-tree builders with link tables and routes (``topology``),
message lists for the DES — validation, chunk expansion, tie rules (``messages``) — the compiled
busy-until DES and its bit-exact oracle (``des``, paper-model.md §6.3), MoE dispatch / combine
traffic and aggregator choice (``linksim``, §6.1–6.2), collectives such as the TP all-reduce
(``collectives``) and pre-broadcast traffic on a spanning tree (``broadcast``, §10.4, §10.8).

May import: hdamoe_env.config
"""
