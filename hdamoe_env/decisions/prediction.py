"""Next-layer expert prediction: which experts the tokens of the next layer will need.

Implements paper-model.md §10.2 with the noisy-oracle semantics of traces.md §7.6: exact
O(1) sampling of experts by popularity (``AliasSampler``), a fast, exact, vectorised noisy
oracle (``noisy_oracle_sets``) and the predictors a run chooses from (``PREDICTORS``,
``StepPredictor``: every layer of a decode step, each prediction made at the previous layer).
The predicted per-expert counts feed the pre-broadcast selection
(``hdamoe_env.decisions.broadcast``) and the env's observation. Pure numpy; every random draw
comes from the ``rng`` argument (style.md R7).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.errors import ConfigError, unknown_name
from hdamoe_env.decisions import prediction_kernels

__all__ = ["PREDICTORS", "AliasSampler", "StepPrediction", "StepPredictor", "noisy_oracle_sets",
           "noisy_oracle_sets_many"]

#: Next-layer predictors (§10.2): ``noisy_oracle`` (the actual sets kept with an accuracy per
#: layer, traces.md §7.6), ``oracle`` (the actual sets), ``trace`` (sets recorded in the trace,
#: ``pred_ids``) and ``frequency`` (no sets: the long-term counts f_i·B).
PREDICTORS = ("noisy_oracle", "oracle", "trace", "frequency")


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
        return self.sample_uniform(layers, rng.random((rows, size)))

    def sample_uniform(self, layers: NDArray[np.int64] | None, u: NDArray[np.float64]
                       ) -> NDArray[np.int64]:
        """Return int64 [R, size] experts from uniforms ``u`` [R, size] (``sample``'s draws).

        Args:
            layers: int64 [R] layer of every row, or None (layer 0).
            u: float64 [R, size] uniforms in [0, 1).
        """
        v = u * self.num_experts
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
        pending = _accept_round(cand, r, pending, cols, pred, actual,
                                forbid if small else None, num_experts)
        if pending.size == 0:
            return pred
    for slot in pending.tolist():                    # pathological popularity: uniform fallback
        t = int(rows[slot])
        allowed = np.setdiff1d(np.arange(num_experts), np.concatenate([actual[t], pred[t]]))
        pred[t, int(cols[slot])] = int(rng.choice(allowed))
    return pred


def noisy_oracle_sets_many(actual: NDArray[np.int64], acc: float | NDArray[np.float64],
                           sampler: AliasSampler, rngs: list[np.random.Generator], *,
                           layer_of_row: NDArray[np.int64] | None = None, oversample: int = 3
                           ) -> NDArray[np.int64]:
    """Predict the sets of n independent problems, each with its own generator, in one pass.

    Returns exactly ``[noisy_oracle_sets(actual[j], acc, sampler, rngs[j], ...) for j]``
    (the same draws from every generator, in the same order): every rejection round draws each
    problem's uniforms from its own generator (in problem order) and resolves all problems'
    pending slots with the same array operations as ``noisy_oracle_sets``; problems' rows never
    share a key, so they never interact.

    Args:
        actual: int64 [n, N, k] actual sets of every problem.
        acc: Accuracy in [0, 1], scalar or float [N] per row (the same for every problem).
        sampler: Popularity sampler.
        rngs: n generators, one per problem.
        layer_of_row: int64 [N] layer of every row (default: layer 0 of the sampler).
        oversample: Candidates drawn per pending slot and round.

    Returns:
        int64 [n, N, k] predicted sets.
    """
    num_problems, num_rows, top_k = actual.shape
    flat_actual = actual.reshape(num_problems * num_rows, top_k)
    accuracy = np.asarray(acc, dtype=np.float64)
    u = np.concatenate([rng.random((num_rows, top_k)) for rng in rngs]).reshape(actual.shape)
    if sampler.num_experts <= 64:
        return _noisy_many_compiled(flat_actual, u, accuracy, sampler, rngs, layer_of_row,
                                    oversample).reshape(actual.shape)
    pred = flat_actual.copy()
    replace = (u >= (accuracy if accuracy.ndim == 0 else accuracy[:, None])).reshape(
        flat_actual.shape)
    rows, cols = np.nonzero(replace)                  # row-major: problems, then slots in order
    if rows.size == 0:
        return pred.reshape(actual.shape)
    problem = rows // num_rows
    num_experts = sampler.num_experts
    lay = (np.zeros(rows.size, dtype=np.int64) if layer_of_row is None
           else np.asarray(layer_of_row, dtype=np.int64)[rows % num_rows])
    pred[rows, cols] = -1
    pending = np.arange(rows.size)
    small = num_experts <= 64
    one = np.uint64(1)
    if small:
        forbid = np.bitwise_or.reduce(np.left_shift(one, flat_actual.astype(np.uint64)), axis=1)
    for _ in range(64):
        r = rows[pending]
        per = np.bincount(problem[pending], minlength=num_problems).tolist()
        u = np.concatenate([rngs[j].random((c, oversample)) for j, c in enumerate(per) if c])
        cand = sampler.sample_uniform(lay[pending], u)                        # [P, m]
        pending = _accept_round(cand, r, pending, cols, pred, flat_actual,
                                forbid if small else None, num_experts)
        if pending.size == 0:
            return pred.reshape(actual.shape)
    for slot in pending.tolist():                    # pathological popularity: uniform fallback
        t = int(rows[slot])
        allowed = np.setdiff1d(np.arange(num_experts),
                               np.concatenate([flat_actual[t], pred[t]]))
        pred[t, int(cols[slot])] = int(rngs[int(problem[slot])].choice(allowed))
    return pred.reshape(actual.shape)


def _noisy_many_compiled(flat_actual: NDArray[np.int64], u: NDArray[np.float64],
                         accuracy: NDArray[np.float64], sampler: AliasSampler,
                         rngs: list[np.random.Generator],
                         layer_of_row: NDArray[np.int64] | None, oversample: int
                         ) -> NDArray[np.int64]:
    """``noisy_oracle_sets_many`` for E <= 64 with the compiled round (``prediction_kernels``)."""
    num_problems = len(rngs)
    num_rows = flat_actual.shape[0] // num_problems
    acc_row = np.broadcast_to(accuracy, (num_rows,)).astype(np.float64)
    lay_row = (np.zeros(num_rows, dtype=np.int64) if layer_of_row is None
               else np.ascontiguousarray(layer_of_row, dtype=np.int64))
    rows, cols, lay, problem, forbid, pred = prediction_kernels.start_kernel(
        flat_actual, u.reshape(flat_actual.shape), acc_row, lay_row, num_problems)
    count = rows.size
    if count == 0:
        return pred
    prob, alias = sampler.prob, np.ascontiguousarray(sampler.alias, dtype=np.int64)
    per = np.bincount(problem, minlength=num_problems)
    for _ in range(64):
        draws = np.concatenate([rngs[j].random((c, oversample))
                                for j, c in enumerate(per.tolist()) if c])
        count = prediction_kernels.round_kernel(rows, cols, lay, problem, count, draws,
                                                sampler.num_experts, prob, alias, forbid, pred,
                                                per)
        if count == 0:
            return pred
    for slot in range(count):                        # pathological popularity: uniform fallback
        t = int(rows[slot])
        allowed = np.setdiff1d(np.arange(sampler.num_experts),
                               np.concatenate([flat_actual[t], pred[t]]))
        pred[t, int(cols[slot])] = int(rngs[int(problem[slot])].choice(allowed))
    return pred


@dataclass(frozen=True, eq=False)
class StepPrediction:
    """The predictions of one decode step, every layer predicted at the layer before it.

    Attributes:
        sets: int64 [L, B, k] predicted expert sets (−1 at layer 0, which has no prediction),
            or None for the ``frequency`` predictor (counts only).
        counts: float64 [L, E] predicted tokens per expert n̂_i (0 at layer 0).
    """

    sets: NDArray[np.int64] | None
    counts: NDArray[np.float64]


class StepPredictor:
    """Predict the expert sets and counts of every layer of a decode step (§10.2).

    Args:
        predictor: One of ``PREDICTORS``.
        freqs: float [L, E] long-term activation frequencies f_i of every layer (the
            popularity the noisy oracle draws replacements from, ∝ f_i / k, and the
            ``frequency`` predictor's counts f_i·B).
        top_k: k.
        batch: Tokens per decode step B.
        accuracies: float [L] noisy-oracle accuracy per layer (entry 0 unused).
        recorded: int [L, T, k] predicted sets recorded in the trace (``pred_ids``; the
            ``trace`` predictor only).

    Raises:
        ConfigError: Unknown predictor, or ``"trace"`` without recorded predictions.
    """

    def __init__(self, predictor: str, freqs: ArrayLike, top_k: int, batch: int,
                 accuracies: ArrayLike, recorded: NDArray[np.integer] | None = None) -> None:
        if predictor not in PREDICTORS:
            raise unknown_name("predictor", predictor, PREDICTORS)
        if predictor == "trace" and recorded is None:
            raise ConfigError("predictor='trace' needs a trace with recorded pred_ids; use "
                              "predictor='noisy_oracle' or a trace with predictions")
        self.predictor = predictor
        self.freqs = np.asarray(freqs, dtype=np.float64)
        self.num_layers, self.num_experts = self.freqs.shape
        self.top_k, self.batch = int(top_k), int(batch)
        self.recorded = recorded
        acc = np.asarray(accuracies, dtype=np.float64)
        L = self.num_layers
        self.sampler = AliasSampler(np.maximum(self.freqs / self.top_k, 1e-12))
        self.layer_rows = np.repeat(np.arange(1, L), self.batch)
        self.row_acc = np.repeat(acc[1:], self.batch) if L > 1 else np.zeros(0)

    def predict(self, sets: NDArray[np.int64], rows: NDArray[np.int64],
                rng: np.random.Generator) -> StepPrediction:
        """Predict layers 1..L−1 of one decode step (layer 0 has no prediction).

        Args:
            sets: int64 [L, B, k] the step's actual expert sets.
            rows: int [B] the step's trace rows (the ``trace`` predictor reads them).
            rng: Generator of the noisy oracle's draws (one ``noisy_oracle_sets`` call covering
                every predicted layer; the other predictors draw nothing).

        Returns:
            The predicted sets and per-expert counts.
        """
        L, B, k, E = self.num_layers, self.batch, self.top_k, self.num_experts
        pred: NDArray[np.int64] | None
        if self.predictor == "noisy_oracle":
            pred = np.full((L, B, k), -1, dtype=np.int64)
            if L > 1:
                flat = noisy_oracle_sets(sets[1:].reshape(-1, k), self.row_acc, self.sampler,
                                         rng, layer_of_row=self.layer_rows)
                pred[1:] = flat.reshape(L - 1, B, k)
        elif self.predictor == "oracle":
            pred = sets.copy()
            pred[0] = -1
        elif self.predictor == "trace":
            assert self.recorded is not None
            pred = self.recorded[:, rows].astype(np.int64)
            pred[0] = -1
        else:
            pred = None
        if pred is None:                                     # frequency: long-term f_i·B
            counts = self.freqs * B
            counts[0] = 0.0
        else:
            valid = pred >= 0
            keys = np.where(valid, pred + (np.arange(L) * E)[:, None, None], L * E)
            counts = np.bincount(keys.ravel(), minlength=L * E + 1)[:L * E].reshape(
                L, E).astype(np.float64)
        return StepPrediction(pred, counts)

    @property
    def compiled_one(self) -> bool:
        """True when :meth:`predict_into` runs the compiled per-step kernel (noisy oracle,
        E <= 64)."""
        return self.predictor == "noisy_oracle" and self.num_experts <= 64

    def predict_into(self, sets: NDArray[np.int64], rng: np.random.Generator,
                     pred_out: NDArray[np.int64], counts_out: NDArray[np.float64]) -> None:
        """``predict`` of one decode step written into ``pred_out`` / ``counts_out``, compiled.

        The same draws from ``rng`` in the same order and the same sets and counts as
        ``predict(sets, rows, rng)`` (``prediction_kernels.noisy_step``); only when
        :attr:`compiled_one`.

        Args:
            sets: int64 [L, B, k] the step's actual expert sets (C-contiguous).
            rng: The step's generator.
            pred_out: int64 [L, B, k] output, the predicted sets.
            counts_out: float64 [L, E] output, the predicted tokens per expert.
        """
        assert self.compiled_one
        state = prediction_kernels.generator_state(rng)
        if state is None:                            # not PCG64: the numpy path
            out = self.predict(sets, np.zeros(0, dtype=np.int64), rng)
            assert out.sets is not None
            pred_out[:] = out.sets
            counts_out[:] = out.counts
            return
        counts_out[:] = 0.0
        count, rows, cols = prediction_kernels.noisy_step(
            sets, state, self.row_acc, self.layer_rows, self.sampler.prob, self.alias64,
            self.num_experts, 3, pred_out, counts_out)
        self.fallback(sets, rng, count, rows, cols, pred_out, counts_out)

    def fallback(self, sets: NDArray[np.int64], rng: np.random.Generator, count: int,
                 rows: NDArray[np.int64], cols: NDArray[np.int64], pred_out: NDArray[np.int64],
                 counts_out: NDArray[np.float64]) -> None:
        """The uniform fallback of the ``count`` slots a compiled step left pending after 64
        rounds (pathological popularity), drawn from ``rng`` as ``noisy_oracle_sets`` does;
        recounts ``counts_out``. No-op when ``count`` is 0."""
        if count:
            k = self.top_k
            actual = sets[1:].reshape(-1, k)
            flat = pred_out[1:].reshape(-1, k)
            for slot in range(count):
                t = int(rows[slot])
                allowed = np.setdiff1d(np.arange(self.num_experts),
                                       np.concatenate([actual[t], flat[t]]))
                flat[t, int(cols[slot])] = int(rng.choice(allowed))
            counts_out[:] = prediction_kernels.count_sets(pred_out[None], self.num_experts)[
                :, :].reshape(counts_out.shape)

    @property
    def alias64(self) -> NDArray[np.int64]:
        """The sampler's alias table as C-contiguous int64 (the compiled kernels' input)."""
        alias = self.__dict__.get("_alias_cache")
        if alias is None:
            alias = np.ascontiguousarray(self.sampler.alias, dtype=np.int64)
            self.__dict__["_alias_cache"] = alias
        return alias

    def predict_many(self, sets: NDArray[np.int64], rows: NDArray[np.int64],
                     rngs: list[np.random.Generator]) -> StepPrediction:
        """Predict n decode steps at once; the same as one ``predict`` per step.

        Args:
            sets: int64 [n, L, B, k] the steps' actual expert sets.
            rows: int [n, B] the steps' trace rows.
            rngs: n generators (step j draws only from ``rngs[j]``, as ``predict`` does).

        Returns:
            ``sets`` int64 [n, L, B, k] (or None: ``frequency``) and ``counts`` float64
            [n, L, E].
        """
        n = sets.shape[0]
        L, B, k, E = self.num_layers, self.batch, self.top_k, self.num_experts
        if self.predictor != "noisy_oracle":
            outs = [self.predict(sets[j], rows[j], rngs[j]) for j in range(n)]
            pred_sets = None if outs[0].sets is None else np.stack([o.sets for o in outs])
            return StepPrediction(pred_sets, np.stack([o.counts for o in outs]))
        pred = np.full((n, L, B, k), -1, dtype=np.int64)
        if L > 1:
            flat = noisy_oracle_sets_many(sets[:, 1:].reshape(n, -1, k), self.row_acc,
                                          self.sampler, rngs, layer_of_row=self.layer_rows)
            pred[:, 1:] = flat.reshape(n, L - 1, B, k)
        counts = prediction_kernels.count_sets(pred, E).reshape(n, L, E)
        return StepPrediction(pred, counts)


def _accept_round(cand: NDArray[np.int64], r: NDArray[np.int64], pending: NDArray[np.int64],
                  cols: NDArray[np.int64], pred: NDArray[np.int64], actual: NDArray[np.int64],
                  forbid: NDArray[np.uint64] | None, num_experts: int) -> NDArray[np.int64]:
    """One rejection round of the noisy oracle: accept each pending slot's first candidate that
    is neither in its row's actual set nor already predicted (the earlier slot of a row wins a
    tie); write it to ``pred`` (and to the row bitmask ``forbid`` when E ≤ 64) and return the
    slots still pending. ``r`` are the pending slots' rows, ``cand`` their candidates [P, m].
    """
    one = np.uint64(1)
    if forbid is not None:
        member = (np.right_shift(forbid[r][:, None], cand.astype(np.uint64)) & one).astype(bool)
    else:
        taken = np.concatenate([actual[r], pred[r]], axis=1)
        member = (taken[:, None, :] == cand[:, :, None]).any(axis=2)
    ok = ~member.all(axis=1)
    pick = cand[np.arange(pending.size), np.argmax(~member, axis=1)]
    key = np.where(ok, r * num_experts + pick, -1 - np.arange(pending.size))
    order = np.argsort(key, kind="stable")           # stable: the earlier slot of a row wins
    dup = np.zeros(pending.size, dtype=bool)
    dup[order[1:]] = key[order][1:] == key[order][:-1]
    accept = ok & ~dup
    pred[r[accept], cols[pending[accept]]] = pick[accept]
    if forbid is not None:
        np.bitwise_or.at(forbid, r[accept], np.left_shift(one, pick[accept].astype(np.uint64)))
    return pending[~accept]
