"""Capture of real routing: recording router choices from transformers MoE models.

What lives here: recording the router's ids, scores and next-layer predictions of a Hugging Face
model into a trace (``record``), a tiny Mixtral-architecture model trained on built-in text so
that recording and gating run on a CPU without downloads (``tiny_model``) and the routing
fidelity metrics of paper-model.md §12 on a real model (``fidelity``). torch and transformers
are imported lazily.

May import: traces
"""
