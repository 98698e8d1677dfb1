"""A native batched vector env: N copies of ``HdMoeEnv`` stepped in one process, physics batched.

Implements the per-layer env of paper-model.md §10–11 (``hdamoe_env.env.environment``) for N
independent copies at once, as a ``gymnasium.vector.VectorEnv`` registered as the
``vector_entry_point`` of the env ids (``gymnasium.make_vec(id, num_envs=N,
vectorization_mode="vector_entry_point")``). Every copy's trajectory (observations, rewards,
terminations, truncations) is bit-identical to a single env built with the same arguments and
seed (``tests/hdamoe_env/env/test_vector.py`` checks N = 1, 7, 64).

How the work is shared:

* Static data (model, topology, trace arrays, placement, evaluator constants, the γ of the
  analytic twin, the synthesised router scores) is built once: copies 1..N−1 are shallow clones
  of copy 0 (:func:`spawn`) with their own episode state and their own ``np_random``.
* The batched path (:class:`_BatchedLayers`): for the copies whose action is "no pre-broadcast,
  gating off" on the analytic twin of a placement without redundant experts (the common case of a
  learning policy at a layer with k_b = 0, and of every no-op action), the layer latency —
  expert phase (tile model or FLOP rate, weight streaming) from per-expert counts, the sampled
  V_c of Eq. 2, reward — and the observation gather run as a handful of numpy operations over
  the whole batch, with the same floating-point operations in the same order as
  ``LayerEvaluator.evaluate`` (hence bit-identical). On the DES (:class:`_BatchedDes`), plain
  copies draw their aggregators from their own generators, then one compiled call simulates
  every copy's layer (``noc.linksim.simulate_layers_comm``) and the expert phase is batched;
  layers with partial shards or TP keep the per-copy evaluator. Copies with gating on and no
  pre-broadcast (:class:`_BatchedGating`) gate their own router candidates with the compiled
  call of ``DecisionEvaluator.gate`` (``gating.gated_sets``) and then take the same batched
  evaluation (analytic or DES) on the gated sets. On the DES, copies with a pre-broadcast
  (``_step_broadcast``, gated or not) decode, gate and dispatch per copy (the compiled
  dispatch loop), simulate the uncached broadcasts' traffic in one compiled call
  (``DecisionEvaluator.broadcast_charges``) and their layers in another
  (``simulate_layers_comm`` with per-copy holder masks and extra holders). Every other action
  (analytic pre-broadcast, replica rules, TP or partial-shard layers) goes through the copy's
  own ``HdMoeEnv.step``.
* Decode steps of all copies are formed together (:class:`_Copy` defers them), with the
  noisy-oracle predictor in one compiled call (``hdamoe_env.sim.batch_kernels.form_steps``):
  routing rows, per-expert counts and V_c peaks of every layer, and the predictions, every
  copy drawing from its own generator in the single env's order (numpy's PCG64
  ``next_double`` on the copy's state, ``prediction_kernels.generator_state``); then the TP
  latencies batched. Other predictors, E or D > 64: ``StepPredictor.predict_many``.

``info`` is batched the Gymnasium way (arrays plus ``_key`` masks) but carries only what a
learner reads: ``action_mask`` [N, sum(nvec)] every step, ``tbt_us`` when a decode step ends and
``episode_tbt_us`` when an episode ends (the single env's per-layer breakdown is not built;
use the single env to inspect it). Autoreset: Gymnasium 1.x ``NEXT_STEP`` (default),
``SAME_STEP`` (``final_obs`` / ``final_info``) and ``DISABLED`` (``reset(options={"reset_mask":
...})``).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space
from numpy.typing import NDArray

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.cost.energy import EnergyBreakdown
from hdamoe_env.env.config import EnvConfig
from hdamoe_env.env.environment import HdMoeEnv
from hdamoe_env.decisions import gating as gating_mod
from hdamoe_env.decisions import prediction_kernels
from hdamoe_env.noc import linksim
from hdamoe_env.sim import batch_kernels
from hdamoe_env.sim.evaluator import partial_shards

__all__ = ["HdMoeVectorEnv", "spawn"]

#: Episode-state attributes of ``HdMoeEnv`` that a clone must not share with its prototype
#: (everything else — specs, trace, placement, evaluators, caches, spaces — is shared).
_EPISODE_STATE = ("_pending_charge_s", "_pending_busy_s", "_pending_fractions", "_rows",
                  "_sets", "_decode_step", "_layer", "_episode_over", "_pred_all",
                  "_pred_counts_all", "_obs_pred", "_obs_node", "_prev_busy", "_step_latency_s",
                  "_tp_totals", "_tp_energy", "_step_energy_j", "_tbts_us", "_twin_rng",
                  "last_layer", "last_sets", "last_info", "_coerced", "_cand_key", "_cand_step")


def spawn(env: HdMoeEnv) -> HdMoeEnv:
    """Return a copy of ``env`` sharing its static data, with a fresh episode state.

    The clone shares the specs, trace, placement, evaluators, caches and spaces (read-only once
    built; the caches hold pure functions of their keys) and has its own episode state and an
    unseeded ``np_random``, as a new ``HdMoeEnv(**same arguments)`` would. Fit the lazily built
    parts first (:meth:`HdMoeVectorEnv.__init__` does: γ of the analytic twin, router scores) or
    every clone fits its own.

    Args:
        env: The prototype (reset or not).

    Returns:
        The clone, to be ``reset`` before use.
    """
    clone = copy.copy(env)
    L, E, D = env.num_layers, env.num_experts, env.num_nodes
    state: dict[str, Any] = {
        "_pending_charge_s": 0.0, "_pending_busy_s": None, "_pending_fractions": None,
        "_rows": np.zeros((0, env.batch), dtype=np.int64),
        "_sets": np.zeros((L, env.batch, env.top_k), dtype=np.int64), "_decode_step": 0,
        "_layer": 0, "_episode_over": True, "_pred_all": None,
        "_pred_counts_all": np.zeros((L, E)), "_obs_pred": np.zeros((L, E), dtype=np.float32),
        "_obs_node": np.zeros((L, D), dtype=np.float32), "_prev_busy": env._zeros_links,
        "_step_latency_s": 0.0, "_tp_totals": np.zeros(L), "_tp_energy": np.zeros(L),
        "_step_energy_j": EnergyBreakdown(), "_tbts_us": [],
        "_twin_rng": np.random.default_rng(0), "last_layer": None, "last_sets": None,
        "last_info": {}, "_coerced": (), "_cand_key": None, "_cand_step": None,
    }
    assert set(state) == set(_EPISODE_STATE)
    clone.__dict__.update(state)
    clone._np_random = None
    clone._np_random_seed = None
    return clone


class _Copy(HdMoeEnv):
    """``HdMoeEnv`` whose decode steps are formed by the vector env, for all copies at once.

    ``_begin_decode_step`` only resets the layer state and flags the copy; the vector env then
    gathers the routing, the TP latencies and the predictions of every flagged copy in one
    batched call (``HdMoeVectorEnv._form_steps``), before anything else draws from the copy's
    ``np_random``, so its random stream is consumed exactly as by a single env.
    """

    _begin_pending = False

    def _observation(self) -> dict[str, NDArray[np.float32]]:
        # the vector env builds every copy's observation in its batched buffers
        # (``HdMoeVectorEnv._write_obs``); the copy's own (returned by its ``reset`` / ``step``,
        # which only the vector env calls) would be discarded
        return {}

    def _begin_decode_step(self) -> None:
        self._layer = 0
        self._step_latency_s = 0.0
        self._step_energy_j = EnergyBreakdown()
        self._prev_busy = self._zeros_links
        self._begin_pending = True


class _BatchedLayers:
    """The analytic layer latency of ``LayerEvaluator.evaluate`` over a batch of copies.

    Per-layer constants stacked over L: non-MoE time, TP flags, expert-phase matrices, holder
    lists and γ. ``latency`` reproduces the evaluator's operations (same order, same
    dtypes) for layers without a broadcast, gating or redundant experts.
    """

    def __init__(self, env: HdMoeEnv, gammas: NDArray[np.float64]) -> None:
        ev = env.evaluator
        consts = ev.layers
        assert all(c is not None for c in consts)
        self.ev = ev
        self.E = env.num_experts
        self.D = env.num_nodes
        self.nm_total = np.array([c.nm_total for c in consts])              # [L]
        self.is_tp = np.array([c.is_tp for c in consts])                     # [L]
        self.tp_time = ev.tp_allreduce.time_s if self.is_tp.any() else 0.0
        self.tiled = ev.tiled
        self.streaming = ev.conv.weight_streaming
        if self.tiled:
            for c in consts:
                if c.tile_work is None:
                    c.tile_work = ev._tile_matrix(c.P)
            self.mats = [c.tile_work for c in consts]                           # [2E, D] each
        self.P = [c.P for c in consts]
        self.support = np.stack([c.support for c in consts])                  # [L, E, D]
        self.holders = batch_kernels.holder_csr(self.support)
        self.gammas = gammas
        conv = ev.conv
        self.comm_scale = (conv.kappa_a, float(ev.model.hidden_size),
                           ev.sim.topology.bw_end_Bps, 2.0 if conv.gamma_combine_only else 1.0)

    def tables(self, sets: NDArray[np.int64]) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Return counts float64 [n, L, E] and V_c peaks float64 [n, L] of decode steps.

        Args:
            sets: int64 [n, L, B, k] the steps' expert sets.
        """
        n, L = sets.shape[:2]
        if self.D <= 64:
            return batch_kernels.step_tables(sets, *self.holders, self.E, self.D)
        groups = n * L
        flat = (sets.reshape(groups, -1) + (np.arange(groups) * self.E)[:, None]).ravel()
        counts = np.bincount(flat, minlength=groups * self.E).astype(np.float64).reshape(
            n, L, self.E)
        touch = self.support[np.arange(L)[None, :, None, None], sets].any(axis=3)  # [n,L,B,D]
        return counts, touch.sum(axis=2).max(axis=2, initial=0).astype(np.float64)

    def layer_tables(self, layer: int, sets: NDArray[np.int64]
                     ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Return counts float64 [n, E] and V_c peaks float64 [n] of one layer's sets.

        Args:
            layer: The MoE layer.
            sets: int64 [n, B, k] expert sets of that layer (C-contiguous).
        """
        if self.D <= 64:
            h_ptr, h_node = self.holders
            counts, peak = batch_kernels.step_tables(sets[:, None], h_ptr[layer:layer + 1],
                                                     h_node[layer:layer + 1], self.E, self.D)
            return counts[:, 0], peak[:, 0]
        n = sets.shape[0]
        flat = (sets.reshape(n, -1) + (np.arange(n) * self.E)[:, None]).ravel()
        counts = np.bincount(flat, minlength=n * self.E).astype(np.float64).reshape(n, self.E)
        touch = self.support[layer][sets].any(axis=2)                          # [n, B, D]
        return counts, touch.sum(axis=1).max(axis=1, initial=0).astype(np.float64)

    def expert_phase(self, layers: NDArray[np.int64], counts: NDArray[np.float64]
                     ) -> NDArray[np.float64]:
        """Return the expert phase t_comp [n] of layer ``layers[i]`` of every copy.

        Args:
            layers: int64 [n] MoE layer of every copy.
            counts: float64 [n, E] tokens per expert of that layer (``tables``).
        """
        n = layers.size
        E, ev = self.E, self.ev
        active = counts > 0
        t_comp = np.empty(n)
        if self.tiled:
            x = np.empty((n, 2 * E))
            ci = counts.astype(np.intp)
            if ci.max(initial=0) < ev._rows_table.size:
                x[:, :E] = ev._rows_table[ci]
            else:
                tile_t = ev.conv.tile_tokens
                x[:, :E] = np.ceil(counts / tile_t - 1e-9).clip(0.0) * tile_t
            x[:, E:] = active
        act = active.astype(np.float64)
        for layer in np.unique(layers).tolist():
            idx = np.flatnonzero(layers == layer)
            if self.tiled:
                # [n, 1, 2E] @ [2E, D]: one vector-matrix product per copy, the operation of
                # the single env (a [n, 2E] @ [2E, D] GEMM sums in another order and differs
                # in the last bit)
                compute = np.matmul(x[idx][:, None, :], self.mats[layer])[:, 0]
            else:
                compute = np.einsum("...ed,...e->...d", self.P[layer][None], counts[idx]) \
                    * ev.flops_per_s
            t_compute = compute.max(axis=1)
            if self.streaming:
                stream = np.einsum("...ed,...e->...d", self.P[layer][None], act[idx]) \
                    * ev.stream_per_s
                t_comp[idx] = np.maximum(t_compute, stream.max(axis=1))
            else:
                t_comp[idx] = t_compute
        return t_comp

    def latency(self, layers: NDArray[np.int64], counts: NDArray[np.float64],
                peak: NDArray[np.float64]) -> NDArray[np.float64]:
        """Return the total latency [n] of layer ``layers[i]`` of every copy.

        Args:
            layers: int64 [n] MoE layer of every copy.
            counts: float64 [n, E] tokens per expert of that layer (``tables``).
            peak: float64 [n] sampled V_c / h of that layer (``tables``).
        """
        t_comp = self.expert_phase(layers, counts)
        kappa, h, bw, factor = self.comm_scale
        x_comm = kappa * (h * peak) / bw
        t_moe = self.gammas[layers] * x_comm * factor
        if self.is_tp.any():
            t_moe = np.where(self.is_tp[layers], self.tp_time, t_moe)
        return self.nm_total[layers] + t_comp + t_moe + 0.0


class _BatchedDes:
    """The DES layer latency of ``LayerEvaluator.evaluate`` over a batch of copies.

    For layers without partial shards and not TP: each copy draws its aggregators from its own
    generator (``choose_aggregators`` of ``simulate_moe_comm``, compiled over the copies:
    ``linksim.aggregators_many``), then one compiled call simulates every copy's layer
    (``linksim.simulate_layers_comm``) and the expert phase is batched
    (``_BatchedLayers.expert_phase``); the sums are the evaluator's, in its order.
    Other layers take ``LayerEvaluator.evaluate`` per copy (``usable`` False).
    """

    def __init__(self, env: HdMoeEnv, tables: _BatchedLayers, threads: int = 1) -> None:
        ev = env.evaluator
        consts = ev.layers
        sim, conv = ev.sim, ev.conv
        self.ev = ev
        self.tables = tables
        self.usable = np.array([c.partial is None and not c.is_tp for c in consts])
        self.holders = [c.holders for c in consts]
        self.holder_arrays = linksim.holder_arrays(self.holders)
        self.masks = np.ascontiguousarray(np.stack([c.support for c in consts]))   # [L, E, D]
        self.pis = np.ascontiguousarray(np.stack([c.pi for c in consts]), dtype=np.int64)
        self.rule = conv.aggregator
        self.both = conv.moe_comm == "dispatch+combine"
        hop = sim.hw.hop_latency_for(conv)
        self.topology = sim.topology
        self.msg = np.ascontiguousarray(ev.msg, dtype=np.float64)
        self.options: dict[str, Any] = dict(
            phases=("dispatch", "combine") if self.both else ("combine",),
            tie_break=conv.tie_break, hop_latency_s=hop, chunks=conv.chunks,
            alpha_s=conv.msg_alpha_s, switching=conv.switching,
            ni_bw_Bps=conv.ni_bw_for(sim.topology.bw_end_Bps),
            ni_latency_s=conv.ni_latency_for(hop), threads=threads)

    def latency(self, layers: NDArray[np.int64], sets: NDArray[np.int64],
                counts: NDArray[np.float64], rngs: list[np.random.Generator]
                ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Return the total latency [n] and link busy time [n, num_links] of usable layers.

        Args:
            layers: int64 [n] MoE layer of every copy (``usable``).
            sets: int64 [n, B, k] that layer's expert sets.
            counts: float64 [n, E] tokens per expert of that layer.
            rngs: Every copy's generator (aggregator draws, in the copies' order).
        """
        aggs = self._aggregators(layers, sets, rngs)
        t_moe, link_busy = self.moe_comm(*linksim.simulate_layers_comm(
            self.topology, sets, self.msg, self.masks, self.pis, aggs, layers, **self.options))
        t_comp = self.tables.expert_phase(layers, counts)
        return self.tables.nm_total[layers] + t_comp + t_moe + 0.0, link_busy

    def moe_comm(self, makespan: NDArray[np.float64], busy: NDArray[np.float64]
                 ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Return the MoE communication time [n] and link busy time [n, num_links] of
        ``simulate_layers_comm``'s outputs, summed as the layer evaluator sums them (dispatch
        plus combine, or twice the combine)."""
        if self.both:
            return makespan[:, 0] + makespan[:, 1], busy.sum(axis=1)
        return 2.0 * makespan[:, 0], 2.0 * busy.sum(axis=1)

    def _aggregators(self, layers: NDArray[np.int64], sets: NDArray[np.int64],
                     rngs: list[np.random.Generator]) -> NDArray[np.int64]:
        """Draw every copy's aggregators from its own generator: one compiled call on the
        copies' PCG64 states (``linksim.aggregators_many``), ``choose_aggregators`` per copy
        for another bit generator or a token without a held expert."""
        aggs = np.empty(sets.shape[:2], dtype=np.int64)
        states = [prediction_kernels.generator_state(rng) for rng in rngs]
        if any(state is None for state in states):
            for j, (layer, rng) in enumerate(zip(layers.tolist(), rngs, strict=True)):
                aggs[j] = linksim.choose_aggregators(sets[j], self.holders[layer], self.rule,
                                                     rng, None)
            return aggs
        addr = np.array(states, dtype=np.uint64)
        start = 0
        while start < layers.size:
            out, stop = linksim.aggregators_many(sets[start:], layers[start:],
                                                 self.holder_arrays, self.rule, addr[start:])
            if stop < 0:
                aggs[start:] = out
                break
            i = start + stop
            aggs[start:i] = out[:stop]
            aggs[i] = linksim.choose_aggregators(sets[i], self.holders[int(layers[i])],
                                                 self.rule, rngs[i], None)   # raises as the env
            start = i + 1
        return aggs


class _BatchedGating:
    """Hardware-aware gating of copies without a pre-broadcast (the batched paths).

    The gated sets of ``DecisionEvaluator.gate`` from the same compiled call
    (``gating.gated_sets``, the fused path of ``hardware_aware_gating``), without its
    statistics and per-call checks: the arguments are the env's, fixed at construction.
    ``usable`` is False when the env's gating options leave the fused path (a candidate window,
    ``include_future``); every gated copy then steps through its own ``HdMoeEnv.step``.
    """

    def __init__(self, env: HdMoeEnv) -> None:
        dec = env.decisions
        opts = dec.gating_options
        self.usable = (opts.get("candidate_window") is None
                       and not opts.get("include_future", False)
                       and not opts.get("diagnostics", True))
        self.k = env.top_k
        self.P = [np.asarray(P, dtype=np.float64) for P in dec.expected_shares]
        self.tile_costs = [dec.gating_tile_cost(layer) for layer in range(env.num_layers)]
        self.w_flops, self.compute_flops = dec.w_flops, dec.compute_flops
        self.coefficients = dec.gating_coefficients
        self.options = dict(comp_penalty=opts.get("comp_penalty", "marginal_max"),
                            comm_penalty=opts.get("comm_penalty", "dispersion"),
                            protect_top=int(opts.get("protect_top", 0)))
        self.many = gating_mod.GatedSetsMany(self.P, self.k, self.w_flops, self.compute_flops,
                                             self.tile_costs, **self.options)

    def sets(self, layer: int, level: float,
             candidates: tuple[NDArray[np.int64], NDArray[np.float64]]
             ) -> NDArray[np.int64] | None:
        """Return the gated sets [B, k] of ``layer`` at ``level``, or None (take the copy's
        own ``HdMoeEnv.step``)."""
        r_comp, r_comm = self.coefficients
        return gating_mod.gated_sets(candidates, self.k, self.P[layer], self.w_flops,
                                     self.compute_flops, level * r_comp, level * r_comm,
                                     tile_cost=self.tile_costs[layer], **self.options)

    def sets_many(self, layers: NDArray[np.int64], levels: NDArray[np.float64],
                  candidates: list[tuple[NDArray[np.int64], NDArray[np.float64]]],
                  threads: int = 1) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
        """Return ``sets`` of every run in one compiled call (``gating.GatedSetsMany``):
        int64 [n, B, k] and bool [n], False where ``sets`` returns None.

        Args:
            layers: int64 [n] layer of every run.
            levels: float64 [n] gating level of every run.
            candidates: Every run's router candidates (ids, scores) [B, k + J].
            threads: numba threads the runs are spread over.
        """
        r_comp, r_comm = self.coefficients
        ids = np.stack([c[0] for c in candidates])
        vals = np.stack([c[1] for c in candidates])
        if threads > 1 and layers.size > 1:
            with linksim.numba_threads(threads):
                return self.many(ids, vals, layers, levels * r_comp, levels * r_comm,
                                 parallel=True)
        return self.many(ids, vals, layers, levels * r_comp, levels * r_comm)


class HdMoeVectorEnv(VectorEnv):
    """N copies of ``HdMoeEnv`` in one process, the common layers batched (module docstring).

    Args:
        num_envs: Number of copies N >= 1.
        max_episode_steps: Truncate an episode after this many steps (the ``TimeLimit`` of the
            registered id; ``gymnasium.make_vec`` passes it), or None.
        autoreset_mode: ``AutoresetMode`` (or its value); ``NEXT_STEP`` by default.
        config: An ``EnvConfig``; ``**kwargs`` replace its fields, as in ``HdMoeEnv``.
        des_threads: numba threads the batched DES calls spread the copies' runs over
            (``linksim.simulate_layers_comm(threads=...)``, the pre-broadcast traffic, the
            gating of the gated copies of a DES env), and the decode-step formation its
            copies (``batch_kernels.form_steps_par``, both fidelities); at most numba's pool
            size (``NUMBA_NUM_THREADS``, fixed at process start). 1 (default) runs them on
            the calling thread. Results are bit-identical for every value.
        **kwargs: The fields of ``EnvConfig``.

    Raises:
        ConfigError: A bad ``num_envs`` / ``max_episode_steps`` / ``autoreset_mode`` /
            ``des_threads``, or any argument ``HdMoeEnv`` rejects.
    """

    def __init__(self, num_envs: int = 1, *, max_episode_steps: int | None = None,
                 autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
                 config: EnvConfig | None = None, des_threads: int = 1,
                 **kwargs: Any) -> None:
        if isinstance(num_envs, bool) or not isinstance(num_envs, int | np.integer) \
                or num_envs < 1:
            raise ConfigError(f"num_envs must be an integer >= 1, got {num_envs!r}")
        if max_episode_steps is not None and (isinstance(max_episode_steps, bool) or not isinstance(
                max_episode_steps, int | np.integer) or max_episode_steps < 1):
            raise ConfigError(f"max_episode_steps must be an integer >= 1 or None, got "
                              f"{max_episode_steps!r}")
        try:
            mode = AutoresetMode(autoreset_mode)
        except ValueError:
            raise ConfigError(f"unknown autoreset_mode {autoreset_mode!r}; expected one of "
                              f"{[m.value for m in AutoresetMode]}") from None
        self.des_threads = linksim.check_threads(des_threads, "des_threads")
        proto = _Copy(config, **kwargs)
        if proto.render_mode is not None:
            raise ConfigError(f"the vector env does not render (render_mode="
                              f"{proto.render_mode!r}); pass render_mode=None")
        self.num_envs = int(num_envs)
        self.max_episode_steps = None if max_episode_steps is None else int(max_episode_steps)
        self.autoreset_mode = mode
        self.metadata = {"autoreset_mode": mode, "render_modes": []}
        self.render_mode = None
        self.closed = False
        # --- shared static data: fit the lazy parts once, then clone
        # the batched paths compute latency rewards only; energy and EDP rewards step every
        # copy through its own HdMoeEnv.step (bit-identical by construction)
        plain_reward = proto.reward_kind == "latency"
        batched = (proto.fidelity == "analytic" and not proto.measure_twin_error
                   and not proto.replica_rules and plain_reward)
        if proto.fidelity == "analytic" or proto.measure_twin_error:
            proto._gamma(0)
        if any(level > 0 for level in proto.gating_levels):
            proto._scored_trace()
        self.envs: list[HdMoeEnv] = [proto] + [spawn(proto) for _ in range(self.num_envs - 1)]
        self.single_observation_space = proto.observation_space
        self.single_action_space = proto.action_space
        self.observation_space = batch_space(proto.observation_space, self.num_envs)
        self.action_space = batch_space(proto.action_space, self.num_envs)
        self._layers = (_BatchedLayers(proto, np.asarray(proto._gammas, dtype=np.float64))
                        if batched else None)
        # DES copies with plain actions: the layer evaluator called directly (no action
        # decoding, no info dict), the rest batched
        self._des_plain = (proto.fidelity == "des" and not proto.measure_twin_error
                           and not proto.replica_rules and plain_reward)
        self._des = (_BatchedDes(proto, _BatchedLayers(proto, np.zeros(proto.num_layers)),
                                 self.des_threads)
                     if self._des_plain and all(c is not None for c in proto.evaluator.layers)
                     else None)
        # the per-decode-step tables (counts, V_c peaks) of the batched paths
        self._tables = self._layers if self._des is None else self._des.tables
        # copies with gating and no pre-broadcast: gated sets per copy, the rest batched
        # (``_step_gated``)
        self._gating: _BatchedGating | None = None
        if self._tables is not None and any(level > 0 for level in proto.gating_levels):
            gating = _BatchedGating(proto)
            self._gating = gating if gating.usable else None
        # --- per-layer static observation parts and masks, stacked over L
        L, E, D, N = proto.num_layers, proto.num_experts, proto.num_nodes, self.num_envs
        self._L = L
        self._nvec = proto._nvec
        self._mb = proto.max_broadcast
        self._zero_level = np.array([lv == 0 for lv in proto.gating_levels])
        self._replicas = np.stack(proto._replicas)
        self._layer_frac = np.stack(proto._layer_frac)
        self._budget_frac = np.stack(proto._budget_frac)
        self._masks = np.stack(proto._masks)                                  # [L, M]
        # --- batched episode state (the copies' HdMoeEnv hold the decode-step state)
        B, k = proto.batch, proto.top_k
        self._layer = np.zeros(N, dtype=np.int64)
        self._step_lat = np.zeros(N)
        self._elapsed = np.zeros(N, dtype=np.int64)
        self._over = np.ones(N, dtype=bool)          # episode ended (or never reset)
        self._needs_reset = np.ones(N, dtype=bool)   # ended or truncated by the time limit
        self._prev_busy = np.zeros((N, proto.topology.num_links), dtype=np.float32)
        self._sets = np.zeros((N, L, B, k), dtype=np.int64)
        self._counts = np.zeros((N, L, E))                  # tokens per expert (batched path)
        self._peak = np.zeros((N, L))                       # sampled V_c / h (batched path)
        self._tp_totals = np.zeros((N, L))
        self._obs_pred = np.zeros((N, L, E), dtype=np.float32)
        self._obs_node = np.zeros((N, L, D), dtype=np.float32)
        self._autoreset = np.zeros(N, dtype=bool)
        self._pending = np.zeros(N, dtype=bool)      # decode step to form (``_form_steps``)
        # decode steps formed by compiled per-copy kernels (noisy oracle, E and D <= 64)
        self._compiled_steps = proto._predictor.compiled_one and D <= 64
        if self._compiled_steps:
            self._routing_t = np.ascontiguousarray(proto._routing.transpose(1, 0, 2))  # [T, L, k]
            self._pred = np.zeros((N, L, B, k), dtype=np.int64)
            self._pred_counts = np.zeros((N, L, E))
            self._no_holders = (np.zeros((L, E + 1), dtype=np.int64),
                                np.zeros((L, 1), dtype=np.int64))
        self._rewards = np.zeros(N)
        self._term = np.zeros(N, dtype=bool)
        self._trunc = np.zeros(N, dtype=bool)
        self._obs: dict[str, NDArray[np.float32]] = {
            key: np.zeros((N, *space.shape), dtype=np.float32)
            for key, space in proto.observation_space.spaces.items()}

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | list[int | None] | None = None,
              options: dict[str, Any] | None = None
              ) -> tuple[dict[str, NDArray[np.float32]], dict[str, Any]]:
        """Reset every copy (or those of ``options["reset_mask"]``).

        Args:
            seed: None, an int (copy i gets ``seed + i``) or one seed per copy.
            options: ``{"reset_mask": bool [N]}`` resets only those copies.

        Returns:
            The batched observation (a copy) and info.

        Raises:
            ConfigError: Seeds of the wrong length or a bad ``reset_mask``.
        """
        N = self.num_envs
        if seed is None:
            seeds: list[int | None] = [None] * N
        elif isinstance(seed, int | np.integer):
            seeds = [int(seed) + i for i in range(N)]
        else:
            seeds = list(seed)
        if len(seeds) != N:
            raise ConfigError(f"seed must be None, an int or {N} seeds, got {len(seeds)}")
        mask = np.ones(N, dtype=bool)
        if options and "reset_mask" in options:
            mask = np.asarray(options["reset_mask"])
            if mask.shape != (N,) or mask.dtype != np.bool_ or not mask.any():
                raise ConfigError(f"options['reset_mask'] must be a bool array of shape ({N},) "
                                  f"with at least one True, got {mask!r}")
        for i in np.flatnonzero(mask).tolist():
            self._reset_one(i, seeds[i])
        self._autoreset[mask] = False
        self._form_steps()
        self._write_obs(np.flatnonzero(mask))
        return self._obs_copy(), {"action_mask": self._masks[self._layer],
                                  "_action_mask": np.ones(N, dtype=bool)}

    def step(self, actions: Any) -> tuple[dict[str, NDArray[np.float32]], NDArray[np.float64],
                                          NDArray[np.bool_], NDArray[np.bool_], dict[str, Any]]:
        """Step every copy with its row of ``actions`` (autoreset per ``autoreset_mode``).

        Args:
            actions: int [N, len(nvec)] one action per copy.

        Returns:
            ``(obs, rewards [N], terminated [N], truncated [N], info)``.

        Raises:
            InvalidAction: A row outside the action space (the copy's own message).
            ConfigError: ``step`` before ``reset``.
        """
        N = self.num_envs
        a = np.asarray(actions)
        if a.shape != (N, self._nvec.size):
            a = np.asarray(a).reshape(N, -1) if a.size == N * self._nvec.size else a
        resetting = np.zeros(N, dtype=bool)
        if self.autoreset_mode == AutoresetMode.NEXT_STEP:
            resetting = self._autoreset.copy()
        elif self.autoreset_mode == AutoresetMode.DISABLED and self._autoreset.any():
            raise ConfigError("autoreset_mode=DISABLED: reset the finished copies with "
                              "reset(options={'reset_mask': ...}) before stepping")
        stepping = ~resetting
        if (self._needs_reset & stepping).any():
            raise ConfigError("step() called before reset(); call reset()")
        self._rewards[:] = 0.0
        self._term[:] = False
        self._trunc[:] = False
        infos: dict[str, Any] = {}
        fast = np.zeros(N, dtype=bool)
        gated = np.zeros(N, dtype=bool)
        bcast = np.zeros(N, dtype=bool)
        if (self._layers is not None or self._des_plain) and stepping.any():
            no_bc, level_off, with_bc = self._plain(a)
            fast = stepping & no_bc & level_off
            if self._gating is not None:
                gated = stepping & no_bc & ~level_off
            if self._des is not None:
                bcast = stepping & with_bc
        if fast.any():
            self._step_batched(np.flatnonzero(fast))
        if gated.any():
            gated[np.flatnonzero(gated)] = self._step_gated(np.flatnonzero(gated), a)
        if bcast.any():
            bcast[np.flatnonzero(bcast)] = self._step_broadcast(np.flatnonzero(bcast), a)
        batched = fast | gated | bcast
        slow = np.flatnonzero(stepping & ~batched).tolist()
        for i in slow:
            self._step_one(i, a[i])
        ended = np.flatnonzero(stepping & ~batched & (self._layer == 0)).tolist()
        if batched.any():
            ended = sorted(ended + self._advance(np.flatnonzero(batched)))
        if ended:
            tbt = np.zeros(N)
            tbt[ended] = [self.envs[i]._tbts_us[-1] for i in ended]
            has = np.zeros(N, dtype=bool)
            has[ended] = True
            infos["tbt_us"], infos["_tbt_us"] = tbt, has
            if self.envs[0].reward_kind != "latency":   # every copy stepped by its own env
                jpt = np.zeros(N)
                jpt[ended] = [float(self.envs[i].last_info.get("j_per_token", np.nan))
                              for i in ended]
                infos["j_per_token"], infos["_j_per_token"] = jpt, has.copy()
        if self.max_episode_steps is not None:
            self._elapsed[stepping] += 1
            self._trunc |= stepping & (self._elapsed >= self.max_episode_steps)
        done = self._term | self._trunc
        if done.any():
            ep = np.zeros(N)
            for i in np.flatnonzero(done).tolist():
                tb = self.envs[i]._tbts_us
                ep[i] = float(np.mean(tb)) if tb else 0.0
                self._needs_reset[i] = True
            infos["episode_tbt_us"], infos["_episode_tbt_us"] = ep, done.copy()
        if resetting.any():
            for i in np.flatnonzero(resetting).tolist():
                self._reset_one(i, None)
        self._autoreset = done.copy()
        self._form_steps()
        written = np.flatnonzero(stepping | resetting)
        self._write_obs(written)
        if self.autoreset_mode == AutoresetMode.SAME_STEP and done.any():
            final = {key: value[done].copy() for key, value in self._obs.items()}
            for i in np.flatnonzero(done).tolist():
                self._reset_one(i, None)
            self._form_steps()
            self._write_obs(np.flatnonzero(done))
            self._autoreset[:] = False
            final_obs = np.empty(N, dtype=object)
            rows = np.flatnonzero(done)
            for j, i in enumerate(rows.tolist()):
                final_obs[i] = {key: value[j] for key, value in final.items()}
            infos["final_obs"], infos["_final_obs"] = final_obs, done.copy()
        infos["action_mask"] = self._masks[self._layer]
        infos["_action_mask"] = np.ones(N, dtype=bool)
        return (self._obs_copy(), self._rewards.copy(), self._term.copy(), self._trunc.copy(),
                infos)

    def action_masks(self) -> NDArray[np.bool_]:
        """Return bool [N, sum(nvec)] the flat action masks of every copy (MaskablePPO)."""
        return self._masks[self._layer]

    def close_extras(self, **kwargs: Any) -> None:
        """Drop the copies."""
        self.envs = []

    # ------------------------------------------------------------------ internals
    def _plain(self, a: NDArray[Any]
               ) -> tuple[NDArray[np.bool_], NDArray[np.bool_], NDArray[np.bool_]]:
        """Return bool [N] three times: rows that are legal and without broadcast, rows whose
        gating is off, and rows that are legal with a broadcast slot set."""
        nvec, mb = self._nvec, self._mb
        if a.ndim != 2 or a.shape[1] != nvec.size or a.dtype.kind not in "iu":
            no = np.zeros(self.num_envs, dtype=bool)
            return no, no.copy(), no.copy()
        legal = ((a >= 0) & (a < nvec)).all(axis=1)
        none = (a[:, :mb] == nvec[0] - 1).all(axis=1) if mb else np.ones(len(a), dtype=bool)
        level = np.clip(a[:, mb + 1], 0, self._zero_level.size - 1)
        return legal & none, self._zero_level[level], legal & ~none

    def _reset_one(self, i: int, seed: int | None) -> None:
        env = self.envs[i]
        env.reset(seed=seed)
        self._layer[i] = 0
        self._step_lat[i] = 0.0
        self._elapsed[i] = 0
        self._over[i] = False
        self._needs_reset[i] = False
        self._prev_busy[i] = 0.0
        self._pending[i] = True

    def _form_steps(self) -> None:
        """Form the decode step of every flagged copy: routing, TP latencies, predictions."""
        idx = np.flatnonzero(self._pending)
        if idx.size == 0:
            return
        proto = self.envs[0]
        copies = [self.envs[i] for i in idx.tolist()]
        if self._compiled_steps:
            self._form_steps_compiled(idx, copies)
            return
        rows = np.stack([env._rows[env._decode_step] for env in copies])          # [n, B]
        sets = proto._routing[:, rows, :].transpose(1, 0, 2, 3).astype(np.int64)  # [n, L, B, k]
        if self._tables is not None:
            counts_actual, peak = self._tables.tables(sets)
            self._counts[idx] = counts_actual
            self._peak[idx] = peak
            tp = proto._tp_evaluator.tp_totals(sets, counts=counts_actual)          # [n, L]
        else:
            tp = proto._tp_evaluator.tp_totals(sets)
        pred = proto._predictor.predict_many(sets, rows, [env.np_random for env in copies])
        counts = pred.counts                                                       # [n, L, E]
        node = np.matmul(proto._node_scale_all, counts[..., None])[..., 0]        # [n, L, D]
        self._sets[idx] = sets
        self._tp_totals[idx] = tp
        self._obs_pred[idx] = np.minimum(counts / proto.batch, 1.0).astype(np.float32)
        self._obs_node[idx] = np.minimum(node, float(proto.num_nodes)).astype(np.float32)
        for j, (i, env) in enumerate(zip(idx.tolist(), copies, strict=True)):
            env._sets = self._sets[i]
            env._tp_totals = self._tp_totals[i]
            env._tp_energy = env._tp_energy_of(env._sets, env._tp_totals)
            env._pred_all = None if pred.sets is None else pred.sets[j]
            env._pred_counts_all = counts[j]
            env._obs_pred = self._obs_pred[i]
            env._obs_node = self._obs_node[i]
            env._begin_pending = False
        self._pending[idx] = False

    def _form_steps_compiled(self, idx: NDArray[np.int64], copies: list[HdMoeEnv]) -> None:
        """``_form_steps`` in one compiled call for every copy (``batch_kernels.form_steps``):
        gather, counts and V_c peaks, noisy-oracle predictions drawn from each copy's own
        generator in the single env's order, straight into the batched buffers; then the TP
        latencies and the observation parts batched. With ``des_threads`` > 1 the copies are
        spread over numba's threads (``form_steps_par``); a copy that needs the predictor's
        fallback gets its generator's state back and is formed again by the serial call."""
        proto = self.envs[0]
        predictor = proto._predictor
        layers = self._tables
        rows = np.stack([env._rows[env._decode_step] for env in copies])          # [n, B]
        states = [prediction_kernels.generator_state(env.np_random) for env in copies]
        if any(s is None for s in states):        # a generator other than PCG64: per copy
            for i, env in zip(idx.tolist(), copies, strict=True):
                prediction_kernels.gather_sets(self._routing_t, env._rows[env._decode_step],
                                               self._sets[i])
                if layers is not None:
                    self._counts[i] = 0.0
                    batch_kernels.step_table_one(self._sets[i], *layers.holders, layers.D,
                                                 self._counts[i], self._peak[i])
                predictor.predict_into(self._sets[i], env.np_random, self._pred[i],
                                       self._pred_counts[i])
        else:
            h_ptr, h_node = layers.holders if layers is not None else self._no_holders
            addr = np.array(states, dtype=np.uint64)
            model = (predictor.row_acc, predictor.layer_rows, predictor.sampler.prob,
                     predictor.alias64, proto.num_experts, 3, h_ptr, h_node, proto.num_nodes,
                     layers is not None)
            out = (self._sets, self._counts, self._peak, self._pred, self._pred_counts)
            run = np.arange(idx.size)            # copies left to the serial call
            if self.des_threads > 1 and idx.size > 1 and np.unique(addr).size == addr.size:
                saved = [env.np_random.bit_generator.state for env in copies]
                with linksim.numba_threads(self.des_threads):
                    pending = batch_kernels.form_steps_par(self._routing_t, rows, idx, addr,
                                                           *model, *out)
                run = np.flatnonzero(pending)    # the fallback's copies: formed again below
                for j in run.tolist():
                    copies[j].np_random.bit_generator.state = saved[j]
            start = 0
            while start < run.size:
                stop, count, prow, pcol = batch_kernels.form_steps(
                    self._routing_t, rows[run], idx[run], addr[run], start, *model, *out)
                if stop < run.size:                 # pathological popularity: the fallback
                    j = int(run[stop])
                    i = int(idx[j])
                    predictor.fallback(self._sets[i], copies[j].np_random, count, prow,
                                       pcol, self._pred[i], self._pred_counts[i])
                start = stop + 1
        if layers is not None:       # the sets are read for their shape only (no copy)
            shape = np.broadcast_to(self._sets[0], (idx.size, *self._sets.shape[1:]))
            tp = proto._tp_evaluator.tp_totals(shape, counts=self._counts[idx])
        else:
            tp = proto._tp_evaluator.tp_totals(self._sets[idx])
        counts = self._pred_counts[idx]
        node = np.matmul(proto._node_scale_all, counts[..., None])[..., 0]        # [n, L, D]
        self._tp_totals[idx] = tp
        self._obs_pred[idx] = np.minimum(counts / proto.batch, 1.0).astype(np.float32)
        self._obs_node[idx] = np.minimum(node, float(proto.num_nodes)).astype(np.float32)
        for i, env in zip(idx.tolist(), copies, strict=True):
            env._sets = self._sets[i]
            env._tp_totals = self._tp_totals[i]
            env._tp_energy = env._tp_energy_of(env._sets, env._tp_totals)
            env._pred_all = self._pred[i]
            env._pred_counts_all = self._pred_counts[i]
            env._obs_pred = self._obs_pred[i]
            env._obs_node = self._obs_node[i]
            env._begin_pending = False
        self._pending[idx] = False

    def _step_one(self, i: int, action: Any) -> None:
        """Step copy i with its own ``HdMoeEnv.step`` (what the batched paths leave)."""
        env = self.envs[i]
        env._layer = int(self._layer[i])
        env._step_latency_s = float(self._step_lat[i])
        env._prev_busy = self._prev_busy[i].copy()
        _, reward, term, trunc, _ = env.step(action)
        self._rewards[i] = reward
        self._term[i] = term
        self._trunc[i] = trunc
        self._layer[i] = env._layer
        self._step_lat[i] = env._step_latency_s
        self._prev_busy[i] = env._prev_busy
        self._over[i] = env._episode_over
        if env._begin_pending:
            self._pending[i] = True

    def _step_batched(self, idx: NDArray[np.int64]) -> None:
        """Step copies ``idx`` (plain actions): analytic in one batched evaluation, DES by
        the layer evaluator of each copy (its own aggregator draws), then batched."""
        layers = self._layer[idx]
        if self._layers is not None:
            total = self._layers.latency(layers, self._counts[idx, layers],
                                         self._peak[idx, layers])
        else:
            total = self._des_latency(idx, layers)
            scale = self.envs[0].reward_scale
            tp = self._tp_totals[idx, layers]
            self._rewards[idx] = -total / (tp if scale is None else scale)
            self._step_lat[idx] += total
            return
        scale = self.envs[0].reward_scale
        tp = self._tp_totals[idx, layers]
        self._rewards[idx] = -total / (tp if scale is None else scale)
        self._step_lat[idx] += total
        self._prev_busy[idx] = 0.0

    def _step_gated(self, idx: NDArray[np.int64], a: NDArray[np.int64]) -> NDArray[np.bool_]:
        """Step copies ``idx`` (no broadcast, gating on): gated sets per copy, then the layer
        batched on the gated sets as for plain actions (analytic: counts, V_c peaks and
        latency; DES: ``_BatchedDes``); return bool [n], False for the copies left to their
        own ``HdMoeEnv.step``.

        Bit-identical to ``HdMoeEnv.step``: the decision evaluator gates the copy's candidates
        with the same compiled call (no random draws), and without a broadcast or replicas
        the evaluator's layer is that of the executed sets (on the DES with the copy's own
        aggregator draws).
        """
        assert self._gating is not None and self._tables is not None
        layers = self._layer[idx]
        levels = a[idx, self._mb + 1]
        proto = self.envs[0]
        sets = np.empty((idx.size, proto.batch, proto.top_k), dtype=np.int64)
        done = np.zeros(idx.size, dtype=bool)
        if self._des is not None:                  # the rest take the per-copy evaluator
            usable = self._des.usable[layers]
        runs = [j for j in range(idx.size) if self._des is None or usable[j]]
        if runs:
            rows = np.array(runs, dtype=np.int64)
            cands = [self.envs[int(idx[j])]._candidates(int(layers[j])) for j in runs]
            level_of = np.array(proto.gating_levels, dtype=np.float64)
            out, ok = self._gating.sets_many(layers[rows], level_of[levels[rows]], cands,
                                             self.des_threads if self._des is not None else 1)
            sets[rows[ok]] = out[ok]
            done[rows[ok]] = True
        if not done.all():
            idx, layers, sets = idx[done], layers[done], np.ascontiguousarray(sets[done])
        if idx.size == 0:
            return done
        counts = np.empty((idx.size, proto.num_experts))
        peak = np.empty(idx.size)
        for layer in np.unique(layers).tolist():
            rows = np.flatnonzero(layers == layer)
            part = sets if rows.size == idx.size else np.ascontiguousarray(sets[rows])
            counts[rows], peak[rows] = self._tables.layer_tables(layer, part)
        if self._des is not None:
            total, busy = self._des.latency(layers, sets, counts,
                                            [self.envs[i].np_random for i in idx.tolist()])
            self._set_busy(idx, total, busy)
        else:
            assert self._layers is not None
            total = self._layers.latency(layers, counts, peak)
            self._prev_busy[idx] = 0.0
        scale = proto.reward_scale
        tp = self._tp_totals[idx, layers]
        self._rewards[idx] = -total / (tp if scale is None else scale)
        self._step_lat[idx] += total
        return done

    def _step_broadcast(self, idx: NDArray[np.int64], a: NDArray[np.int64]
                        ) -> NDArray[np.bool_]:
        """Step copies ``idx`` (DES, a pre-broadcast in the action): the decisions per copy,
        the layer DES of all of them in one compiled call; return bool [n], False for the
        copies left to their own ``HdMoeEnv.step``.

        Bit-identical to ``HdMoeEnv.step`` (``DecisionEvaluator.evaluate``): per copy the
        action decoded by the copy (masked or repeated slots coerced, or ``InvalidAction``),
        the gated sets (``_BatchedGating``, no draws), the dispatch of the broadcast experts
        and the broadcast traffic and charge (``DecisionEvaluator.dispatch`` /
        ``broadcast_charges``: the uncached broadcasts' DES in one compiled call, on
        ``des_threads``), the expert phase (``LayerEvaluator.expert_phase``) and the
        aggregators drawn from the copy's generator (``choose_aggregators`` with the dispatch
        nodes as extra holders); then one ``simulate_layers_comm`` call with every copy's holder
        mask (broadcast rows zeroed) and extra holders. Layers with partial shards or TP, and
        actions whose broadcast is coerced away, keep the per-copy step (nothing is drawn for
        them here).
        """
        des = self._des
        assert des is not None and self._tables is not None
        proto = self.envs[0]
        dec, ev = proto.decisions, proto.evaluator
        conv = ev.conv
        E = proto.num_experts
        done = np.zeros(idx.size, dtype=bool)
        runs: list[tuple[int, NDArray[np.int64], NDArray[np.int64], NDArray[np.bool_],
                         NDArray[np.int64] | None, float]] = []
        items: list[tuple[int, list[int]]] = []
        # pass 1: decode every action (the copy's own checks); gate the gated copies at once
        decoded: list[tuple[int, int, int, list[int], str, float]] = []
        for j, i in enumerate(idx.tolist()):
            layer = int(self._layer[i])
            if not des.usable[layer]:
                continue
            env = self.envs[i]
            env._layer = layer
            broadcast, rule_idx, level_idx, _ = env._decode_action(a[i])
            if not broadcast:
                continue
            level = float(env.gating_levels[level_idx])
            if level > 0 and self._gating is None:
                continue
            decoded.append((j, i, layer, broadcast, env.dispatch_rules[rule_idx], level))
        gated_sets: dict[int, NDArray[np.int64]] = {}
        gate = [d for d in decoded if d[5] > 0]
        if gate:
            assert self._gating is not None
            out, ok = self._gating.sets_many(
                np.array([d[2] for d in gate], dtype=np.int64),
                np.array([d[5] for d in gate]),
                [self.envs[d[1]]._candidates(d[2]) for d in gate], self.des_threads)
            gated_sets = {d[0]: out[g] for g, d in enumerate(gate) if ok[g]}
        # pass 2: dispatch, expert phase and aggregator draws per copy
        for j, i, layer, broadcast, rule, level in decoded:
            env = self.envs[i]
            if level > 0:
                if j not in gated_sets:
                    continue
                sets = gated_sets[j]
            else:
                sets = self._sets[i, layer]
            disp = dec.dispatch(layer, sets, broadcast, rule)
            P_layer = disp.P_layer
            support = P_layer > 0
            if partial_shards(P_layer, conv) is not None:
                continue
            counts = np.bincount(sets.ravel(), minlength=E).astype(np.float64)
            t_comp = ev.expert_phase(layer, counts, P_layer=P_layer,
                                     extra_compute_s=disp.extra_compute_s,
                                     extra_stream_s=disp.extra_stream_s)[5]
            holders = linksim.HolderTable.from_shares(support)
            agg = linksim.choose_aggregators(sets, holders, conv.aggregator, env.np_random,
                                             disp.extra_holders)
            runs.append((layer, sets, agg, support, disp.extra_holders, t_comp))
            items.append((layer, broadcast))
            done[j] = True
        n = len(runs)
        if n == 0:
            return done
        # the broadcast traffic and charge (no draws): the uncached ones in one DES call
        charges = dec.broadcast_charges(items, threads=self.des_threads)
        idx = idx[done]
        layers = np.array([r[0] for r in runs], dtype=np.int64)
        sets_all = np.stack([r[1] for r in runs])
        aggs = np.stack([r[2] for r in runs])
        masks = np.stack([r[3] for r in runs])
        width = max(0 if r[4] is None else r[4].shape[1] for r in runs)
        extras = np.full((n, sets_all.shape[1], width), -1, dtype=np.int64)
        for j, r in enumerate(runs):
            if r[4] is not None:
                extras[j, :, :r[4].shape[1]] = r[4]
        t_moe, link_busy = des.moe_comm(*linksim.simulate_layers_comm(
            des.topology, sets_all, des.msg, masks, des.pis, aggs, layers,
            mask_of=np.arange(n), extra_holders=extras, **des.options))
        t_comp = np.array([r[5] for r in runs])
        extra = np.array([c[1] for c in charges])
        # LayerResult.total_s (t_nm + t_comp + t_comm + t_extra), + the (zero) pending charge
        total = self._tables.nm_total[layers] + t_comp + t_moe + extra + 0.0
        link_busy = link_busy + np.stack([c[0].link_busy_s for c in charges])
        self._set_busy(idx, total, link_busy)
        scale = proto.reward_scale
        tp = self._tp_totals[idx, layers]
        self._rewards[idx] = -total / (tp if scale is None else scale)
        self._step_lat[idx] += total
        return done

    def _set_busy(self, idx: NDArray[np.int64], total: NDArray[np.float64],
                  busy: NDArray[np.float64]) -> None:
        """Set the link-busy observation of copies ``idx`` from their layer's busy time
        [n, num_links] and latency [n], as ``HdMoeEnv.step``."""
        live = total > 0
        self._prev_busy[idx[~live]] = 0.0
        self._prev_busy[idx[live]] = np.minimum(busy[live] / total[live, None], 1.0).astype(
            np.float32)

    def _des_latency(self, idx: NDArray[np.int64], layers: NDArray[np.int64]
                     ) -> NDArray[np.float64]:
        """Return the DES latency [n] of copies ``idx`` (``HdMoeEnv.step`` without decisions)
        and set their link-busy observation."""
        ev = self.envs[0].evaluator
        total = np.empty(idx.size)
        batched = np.zeros(idx.size, dtype=bool)
        if self._des is not None:
            batched = self._des.usable[layers]
        if batched.any():        # one compiled DES call for these copies (``_BatchedDes``)
            bi, bl = idx[batched], layers[batched]
            t, busy = self._des.latency(bl, self._sets[bi, bl], self._counts[bi, bl],
                                        [self.envs[i].np_random for i in bi.tolist()])
            total[batched] = t
            self._set_busy(bi, t, busy)
        for j in np.flatnonzero(~batched).tolist():
            i, layer = int(idx[j]), int(layers[j])
            res = ev.evaluate(layer, self._sets[i, layer], rng=self.envs[i].np_random,
                              fidelity="des")
            t = res.total_s + 0.0                 # + the (zero) pending charge, as the env
            total[j] = t
            busy = res.link_busy_s
            if busy is None or t <= 0:
                self._prev_busy[i] = 0.0
            else:
                self._prev_busy[i] = np.minimum(busy / t, 1.0).astype(np.float32)
        return total

    def _advance(self, idx: NDArray[np.int64]) -> list[int]:
        """Move copies ``idx`` to their next layer; end their decode steps; return those."""
        nxt = self._layer[idx] + 1
        going = nxt < self._L
        self._layer[idx[going]] = nxt[going]
        ended = idx[~going].tolist()
        for i in ended:
            env = self.envs[i]
            env._tbts_us.append((float(self._step_lat[i]) + env._dense_s) * 1e6)
            env._decode_step += 1
            self._layer[i] = 0
            self._step_lat[i] = 0.0
            self._prev_busy[i] = 0.0                  # a decode step starts with idle links
            if env._decode_step >= env.steps_per_episode:
                self._term[i] = self._over[i] = env._episode_over = True
            elif env._decode_step >= env._rows.shape[0]:
                self._trunc[i] = self._over[i] = env._episode_over = True
            else:
                env._begin_decode_step()
                self._pending[i] = True
        return ended

    def _write_obs(self, idx: NDArray[np.int64]) -> None:
        """Write the observation of copies ``idx`` (their current layer) into the buffers."""
        if idx.size == 0:
            return
        obs = self._obs
        layers = self._layer[idx]
        over = self._over[idx]
        live = idx[~over]
        obs["pred_load"][live] = self._obs_pred[live, self._layer[live]]
        obs["node_load"][live] = self._obs_node[live, self._layer[live]]
        dead = idx[over]
        if dead.size:
            obs["pred_load"][dead] = 0.0
            obs["node_load"][dead] = 0.0
            self._prev_busy[dead] = 0.0
        obs["link_busy"][idx] = self._prev_busy[idx]
        rows: slice | NDArray[np.int64] = slice(None) if idx.size == self.num_envs else idx
        if (layers == layers[0]).all():             # copies in lock step: broadcast one row
            layer = int(layers[0])
            obs["replicas"][rows] = self._replicas[layer]
            obs["layer"][rows] = self._layer_frac[layer]
            obs["budget"][rows] = self._budget_frac[layer]
        else:
            obs["replicas"][rows] = self._replicas[layers]
            obs["layer"][rows] = self._layer_frac[layers]
            obs["budget"][rows] = self._budget_frac[layers]

    def _obs_copy(self) -> dict[str, NDArray[np.float32]]:
        return {key: value.copy() for key, value in self._obs.items()}
