"""Pre-broadcast selection: which experts of the next layer to replicate on every node.

Implements paper-model.md §10.5 (paper §V-C): priority detection and repeated selection on the
most congested node, with both bookkeeping variants of §10.9 (``priority_broadcast``). How many
experts fit (k_b, the budget of §10.3–10.4) is ``hdamoe_env.cost.broadcast.broadcast_plan``;
the traffic of the broadcast on the NoC is ``hdamoe_env.noc.broadcast.simulate_broadcast``; the
dispatch of the broadcast experts' tokens is ``hdamoe_env.decisions.dispatch``. Pure numpy, no
RL (style.md R1).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.decisions.dispatch import dispatch_broadcast

__all__ = ["priority_broadcast"]


def priority_broadcast(P_next: ArrayLike, pred_counts: ArrayLike, w: float, C: float, k_b: int,
                       *, ref_bookkeeping: bool = False, skip_zero_priority: bool = True,
                       token_sets_pred: ArrayLike | None = None,
                       shard_time: ArrayLike | None = None) -> list[int]:
    """Choose up to k_b experts to pre-broadcast by priority on the congested node (§10.5, §10.9).

    Each round: predicted loads L̂_c, congested node c* = argmax L̂ (lowest index on ties),
    prio_i = P_{i,c*}·n̂_i·w/C, pick e* = argmax prio (highest id on ties), zero P_{e*,:}.
    Already picked experts are never picked again. Loads per round:

    * ``ref_bookkeeping=True``: Σ_i P_ic·n̂_i·w over the working copy (a picked expert's load
      disappears);
    * ``False``: the same plus the predicted dispatch of the picked experts — the least-loaded
      greedy of §10.6 on the predicted sets ``token_sets_pred``; without sets
      [decision] a picked expert's predicted work is spread evenly over the D nodes.

    Args:
        P_next: float [E, D] placement of the layer the broadcast is for.
        pred_counts: float [E] predicted tokens per expert n̂_i.
        w: Work per (token, expert), FLOP.
        C: Node throughput, FLOP/s.
        k_b: Number of rounds.
        ref_bookkeeping: Reference bookkeeping (see above).
        skip_zero_priority: Stop when the best priority is 0 (``faithful``); otherwise the
            highest unpicked id wins, as in the reference.
        token_sets_pred: int [B, k] predicted sets (``ref_bookkeeping=False``).
        shard_time: float [E, D] tile-model seconds of every shard at the predicted counts
            (``perf.gemm_tile_time(n̂_i, P_ic·I)``), or None. When given, loads and priorities
            are these seconds instead of the fluid P_ic·n̂_i·w/C: L̂_c = Σ_{i unpicked}
            shard_time_ic (plus the bookkeeping's dispatched work / C) and prio_i =
            shard_time_{i,c*}, so a broadcast that removes a padded tile (9 → 0 tokens of an
            8-token tile) is worth what the evaluator charges for it.

    Returns:
        The chosen experts in pick order (at most k_b).
    """
    P = np.array(P_next, dtype=np.float64)
    n = np.asarray(pred_counts, dtype=np.float64)
    if P.ndim != 2 or n.shape != (P.shape[0],):
        raise ConfigError(f"P_next must be [E, D] and pred_counts [E]; got {P.shape} and "
                          f"{n.shape}")
    num_experts, num_nodes = P.shape
    orig = P.copy()
    chosen: list[int] = []
    picked = np.zeros(num_experts, dtype=bool)
    st = None
    if shard_time is not None:
        st = np.array(shard_time, dtype=np.float64)
        if st.shape != P.shape:
            raise ConfigError(f"shard_time must be [E, D] = {P.shape}, got {st.shape}")
    scale = 1.0 if st is None else 1.0 / C                    # bookkeeping work in seconds
    for _ in range(min(int(k_b), num_experts)):
        loads = (n @ P) * w if st is None else st.sum(axis=0)
        if not ref_bookkeeping and chosen:
            if token_sets_pred is not None:
                d = dispatch_broadcast(token_sets_pred, orig, chosen, w)
                loads = loads + d.node_flops * scale
            else:
                loads = loads + n[chosen].sum() * w / num_nodes * scale
        c_star = int(np.argmax(loads))
        prio = P[:, c_star] * n * w / C if st is None else st[:, c_star].copy()
        prio[picked] = -np.inf
        best = float(prio.max())
        if best == -np.inf or (skip_zero_priority and best <= 0):
            break
        e = num_experts - 1 - int(np.argmax(prio[::-1]))     # ties: highest expert id
        chosen.append(e)
        picked[e] = True
        P[e, :] = 0.0
        if st is not None:
            st[e, :] = 0.0
    return chosen
