"""Next-layer expert prediction: which experts the tokens of the next layer will need.

Implements paper-model.md §10.2 with the noisy-oracle semantics of traces.md §7.6: exact
O(1) sampling of experts by popularity (``AliasSampler``) and a fast, exact, vectorised noisy
oracle (``noisy_oracle_sets``). The predicted per-expert counts feed the pre-broadcast
selection (``hdamoe_env.decisions.broadcast``) and the env's observation. Pure numpy; every
random draw comes from the ``rng`` argument (style.md R7).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.errors import ConfigError

__all__ = ["AliasSampler", "noisy_oracle_sets"]


class AliasSampler:
    """Exact O(1) sampling of experts ∝ popularity p_l (Walker/Vose alias tables, one per layer).

    Args:
        shares: float [E] or [L, E] non-negative popularity (each row with a positive sum).
    """

    def __init__(self, shares: ArrayLike) -> None:
        p = np.atleast_2d(np.asarray(shares, dtype=np.float64))
        if p.ndim != 2 or (p < 0).any() or not (p.sum(axis=1) > 0).all():
            raise ConfigError("shares must be a non-negative [E] or [L, E] array with positive "
                              "row sums")
        self.num_layers, self.num_experts = p.shape
        self.prob = np.ones(p.shape)
        self.alias = np.tile(np.arange(self.num_experts), (self.num_layers, 1))
        for layer in range(self.num_layers):
            self._build(layer, p[layer] / p[layer].sum())

    def _build(self, layer: int, p: NDArray[np.float64]) -> None:
        scaled = (p * self.num_experts).tolist()
        small = [i for i, v in enumerate(scaled) if v < 1.0]
        large = [i for i, v in enumerate(scaled) if v >= 1.0]
        prob, alias = self.prob[layer], self.alias[layer]
        while small and large:
            s_i, l_i = small.pop(), large.pop()
            prob[s_i] = scaled[s_i]
            alias[s_i] = l_i
            scaled[l_i] = scaled[l_i] + scaled[s_i] - 1.0
            (small if scaled[l_i] < 1.0 else large).append(l_i)
        for i in small + large:                       # numerical leftovers: probability 1
            prob[i] = 1.0

    def sample(self, layers: NDArray[np.int64] | None, size: int, rng: np.random.Generator
               ) -> NDArray[np.int64]:
        """Return int64 [R, size] experts drawn ∝ p of each row's layer.

        Args:
            layers: int64 [R] layer of every row (zeros for 1-D shares); None draws one row of
                layer 0.
            size: Draws per row.
            rng: Generator. One uniform per draw: its integer part (× E) picks the column, its
                fraction flips the column's coin.
        """
        rows = 1 if layers is None else layers.size
        v = rng.random((rows, size)) * self.num_experts
        col = v.astype(np.int64)
        np.minimum(col, self.num_experts - 1, out=col)
        coin = v - col
        flat = col if layers is None else col + (layers * self.num_experts)[:, None]
        keep = coin < self.prob.ravel().take(flat)
        return np.where(keep, col, self.alias.ravel().take(flat))


def noisy_oracle_sets(actual: NDArray[np.int64], acc: float | NDArray[np.float64],
                      sampler: AliasSampler, rng: np.random.Generator, *,
                      layer_of_row: NDArray[np.int64] | None = None, oversample: int = 3
                      ) -> NDArray[np.int64]:
    """Predict sets with a noisy oracle (traces.md §7.6 semantics, vectorised).

    Every expert of a row's actual set is kept with probability acc and otherwise replaced by an
    expert drawn ∝ p_l from those not in the actual set, never twice in a row. Rejection
    sampling, exact: in every round each pending replaced slot draws ``oversample`` candidates
    ∝ p and takes the first not in the actual set nor among the row's accepted replacements;
    when two pending slots of a row pick the same expert the earlier slot keeps it and the other
    draws again. The expected overlap |S ∩ Ŝ|/k is exactly acc. Rows of several layers can be
    predicted in one call.

    Args:
        actual: int64 [N, k] actual sets.
        acc: Accuracy in [0, 1], scalar or float [N] per row.
        sampler: Popularity sampler (one layer, or per layer with ``layer_of_row``).
        rng: Generator.
        layer_of_row: int64 [N] layer of every row (default: layer 0 of the sampler).
        oversample: Candidates drawn per pending slot and round.

    Returns:
        int64 [N, k] predicted sets.
    """
    num_rows, top_k = actual.shape
    pred = actual.copy()
    accuracy = np.asarray(acc, dtype=np.float64)
    replace = rng.random((num_rows, top_k)) >= (accuracy if accuracy.ndim == 0
                                                 else accuracy[:, None])
    rows, cols = np.nonzero(replace)                  # row-major: slots in column order
    if rows.size == 0:
        return pred
    num_experts = sampler.num_experts
    lay = (np.zeros(rows.size, dtype=np.int64) if layer_of_row is None
           else np.asarray(layer_of_row, dtype=np.int64)[rows])
    pred[rows, cols] = -1
    pending = np.arange(rows.size)
    small = num_experts <= 64
    one = np.uint64(1)
    if small:                                         # forbidden experts as row bitmasks
        forbid = np.bitwise_or.reduce(np.left_shift(one, actual.astype(np.uint64)), axis=1)
    for _ in range(64):
        r = rows[pending]
        cand = sampler.sample(lay[pending], oversample, rng)               # [P, m]
        # Forbidden: the actual set and the replacements accepted so far.
        if small:
            member = (np.right_shift(forbid[r][:, None], cand.astype(np.uint64)) & one) \
                .astype(bool)
        else:
            taken = np.concatenate([actual[r], pred[r]], axis=1)
            member = (taken[:, None, :] == cand[:, :, None]).any(axis=2)
        ok = ~member.all(axis=1)
        pick = cand[np.arange(pending.size), np.argmax(~member, axis=1)]
        key = np.where(ok, r * num_experts + pick, -1 - np.arange(pending.size))
        order = np.argsort(key, kind="stable")       # stable: the earlier slot of a row wins
        dup = np.zeros(pending.size, dtype=bool)
        dup[order[1:]] = key[order][1:] == key[order][:-1]
        accept = ok & ~dup
        pred[r[accept], cols[pending[accept]]] = pick[accept]
        if small:
            np.bitwise_or.at(forbid, r[accept], np.left_shift(one, pick[accept].astype(
                np.uint64)))
        pending = pending[~accept]
        if pending.size == 0:
            return pred
    for slot in pending.tolist():                    # pathological popularity: uniform fallback
        t = int(rows[slot])
        allowed = np.setdiff1d(np.arange(num_experts), np.concatenate([actual[t], pred[t]]))
        pred[t, int(cols[slot])] = int(rng.choice(allowed))
    return pred
