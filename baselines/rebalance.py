"""Periodic EPLB rebalancing inside an env episode (the bench method ``eplb-dynamic``).

Production MoE serving re-places its redundant experts from recent loads (DeepSeek's EPLB,
vLLM and SGLang rebalance periodically). :class:`EplbRebalanceWrapper` does that on a running
``HdMoeEnv``: it counts the experts the env executed (``env.last_sets``, after gating) per layer,
and every ``period`` decode steps re-places the copies from the last window with
:func:`baselines.eplb_dynamic.rebalance`, simulates the weight moves on the NoC with the
message DES (:func:`baselines.eplb_dynamic.simulate_moves`, W_e bytes per move, the profile's hop
latency, switching and network-interface ports) and swaps the placement with ``HdMoeEnv.replace_placement``, which charges the moves'
makespan to the next layer [decision: serially, not overlapped with compute — an upper bound on
the cost; over a long run this equals the makespan amortised over ``period`` steps]. Every
episode starts from the wrapped env's initial placement (the static ``eplb`` one), so seeds are
comparable.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from numpy.typing import NDArray

from baselines.eplb import eplb_placement, expert_weight_bytes
from baselines.eplb_dynamic import (
    check_rebalance_options,
    plan_moves,
    rebalance,
    result_of,
    simulate_moves,
)
from hdamoe_env.config.errors import ConfigError

__all__ = ["DEFAULT_MIN_GAIN", "EplbRebalanceWrapper"]

#: [judgement] A window of a few decode steps is noisy: at B = 128 a 4-step window holds about
#: 48 tokens per DeepSeek-V2-Lite expert (±15 % sampling noise each), so small "gains" measured
#: on it are noise and the moves they trigger do not pay. Measured on DeepSeek-V2-Lite 4×8 5/50
#: B = 128 (16 decode steps × 2 seeds, period 4; static EPLB 6777 µs): min_gain 0.02 → 8510
#: µs (≈ 300 moves per rebalance), 0.10 → 8144 µs, 0.20 → 6854 µs (0–27 moves).
DEFAULT_MIN_GAIN = 0.2


class EplbRebalanceWrapper(gym.Wrapper):  # type: ignore[type-arg]
    """Rebalance an env's EPLB placement every ``period`` decode steps (module docstring).

    Args:
        env: An ``HdMoeEnv`` (or a wrapper of one) whose placement holds whole copies
            (``"eplb"``).
        period: Decode steps between rebalances (>= 1).
        mode: ``"incremental"`` (default) or ``"full"`` (:func:`baselines.eplb_dynamic.eplb_dynamic`).
        min_gain: Incremental: smallest relative drop of a layer's max node load (on the
            window's loads) worth moving weights for (:data:`DEFAULT_MIN_GAIN`).
        max_swaps: Incremental: greedy move/swap rounds per layer and rebalance.
        chunks: Pipelined messages per moved expert in the move DES.

    ``info`` of the first layer after a rebalance carries ``rebalance_us`` (the charge);
    :attr:`history` lists per rebalance the decode step, the number of moves and the makespan.
    """

    def __init__(self, env: gym.Env, *, period: int = 4,  # type: ignore[type-arg]
                 mode: str = "incremental", min_gain: float = DEFAULT_MIN_GAIN,
                 max_swaps: int = 4, chunks: int = 8) -> None:
        super().__init__(env)
        if int(period) < 1:
            raise ConfigError(f"rebalance period={period!r} must be >= 1 decode step")
        check_rebalance_options(mode, min_gain)
        if int(chunks) < 1:
            raise ConfigError(f"chunks={chunks!r} must be >= 1 message per moved expert")
        base = env.unwrapped
        self.period, self.mode = int(period), mode
        self.min_gain, self.max_swaps, self.chunks = float(min_gain), int(max_swaps), int(chunks)
        self.initial = base.placement
        self._current = result_of(self.initial)                # raises for sharded placements
        self._expert_bytes = expert_weight_bytes(base.model, base.conv)
        self._hop_s = base.hw.hop_latency_for(base.conv)
        self._window = np.zeros((base.num_layers, base.num_experts))
        self._steps = 0
        self.history: list[dict[str, Any]] = []

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        """Restore the initial placement (no charge), clear the window, reset the env."""
        base = self.env.unwrapped
        if base.placement is not self.initial:
            base.replace_placement(self.initial)
        self._current = result_of(self.initial)
        self._window[:] = 0.0
        self._steps = 0
        self.history = []
        return self.env.reset(**kwargs)

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        """Step the env, count the executed experts, rebalance at the end of every period."""
        base = self.env.unwrapped
        layer = base.current_layer
        obs, reward, terminated, truncated, info = self.env.step(action)
        sets: NDArray[np.int64] | None = base.last_sets
        if sets is not None:
            self._window[layer] += np.bincount(sets.ravel(), minlength=base.num_experts)
        if "tbt_us" in info:
            self._steps += 1
            if self._steps % self.period == 0 and not (terminated or truncated):
                fresh = self._rebalance(base)
                obs = obs if fresh is None else fresh
        return obs, reward, terminated, truncated, info

    def _rebalance(self, base: Any) -> Any:
        """Re-place from the window; return the new observation (None: nothing moved)."""
        new = rebalance(self._current, self._window, mode=self.mode, min_gain=self.min_gain,
                        max_swaps=self.max_swaps)
        self._window[:] = 0.0
        moves = plan_moves(self._current.holds, new.holds, topology=base.topology,
                           pi=base.placement.pi)
        conv = base.conv
        makespan = (simulate_moves(base.topology, moves, self._expert_bytes,
                                   pi=base.placement.pi, hop_latency_s=self._hop_s,
                                   chunks=self.chunks, switching=conv.switching,
                                   ni_bw_Bps=conv.ni_bw_for(base.topology.bw_end_Bps),
                                   ni_latency_s=conv.ni_latency_for(self._hop_s)
                                   ).makespan_s if moves else 0.0)
        self.history.append({"decode_step": self._steps, "moves": len(moves),
                             "makespan_us": makespan * 1e6})
        self._current = new
        if not moves:
            return None
        placement = eplb_placement(new, pi=base.placement.pi, method="eplb-dynamic",
                                   period=self.period, rebalance_mode=self.mode)
        return base.replace_placement(placement, charge_s=makespan)
