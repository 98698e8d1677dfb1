"""Online policies: pre-broadcast, dispatch and hardware-aware gating (paper-model.md §10–11).

The reference agents arrive with the environment issue; this package is importable but empty.
"""

AGENTS: dict[str, type] = {}
