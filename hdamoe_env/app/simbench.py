"""Throughput benchmark of the layer communication simulator (paper-model.md §6.2–6.3).

Measures, in one run, how many layer simulations per second the production path
(``simulate_layer_comm``: message generation plus the compiled DES, dispatch and combine) and the
pure-Python oracle (``simulate_messages_oracle`` on the same messages) achieve, and checks that
both give identical makespans. Workload: DeepSeek-V2-Lite (E = 64, top-6, h = 2048, b_msg = 2,
i.e. 4096 B per token message), B = 128 tokens, 4×8 mesh at 50 GB/s, EP placement (seeded
shuffle, 2 whole experts per node), random mapping pi, ``uniform`` aggregators drawn once. Library
code: returns numbers, never prints.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.fileio import write_json
from hdamoe_env.noc.des import simulate_messages_oracle
from hdamoe_env.noc.linksim import (
    choose_aggregators,
    layer_flow_keys,
    layer_messages,
    simulate_layer_comm,
)
from hdamoe_env.config.specs import HardwareSpec
from hdamoe_env.noc.topology import make_topology

__all__ = ["bench_sim", "cmd_bench_sim", "zipf_token_sets"]

_NUM_EXPERTS = 64
_TOP_K = 6
_HIDDEN = 2048
_B_MSG = 2
_BATCH = 128


def zipf_token_sets(rng: np.random.Generator, num_tokens: int, num_experts: int, top_k: int,
                    s: float = 0.7) -> NDArray[np.int64]:
    """Draw ``num_tokens`` sets of ``top_k`` distinct experts from a Zipf-like popularity.

    Expert popularity p_i ∝ (rank_i + 1)^-s with a random rank permutation; every set is a draw
    without replacement from p (Gumbel top-k, equivalent to sequential weighted sampling).

    Args:
        rng: The random generator.
        num_tokens: T.
        num_experts: E.
        top_k: k <= E.
        s: Zipf exponent.

    Returns:
        Int64 array [T, k] of expert ids (each row sorted ascending).
    """
    rank = rng.permutation(num_experts)
    logp = -s * np.log(rank + 1.0)
    keys = logp[None, :] + rng.gumbel(size=(num_tokens, num_experts))
    top = np.argsort(-keys, axis=1, kind="stable")[:, :top_k]
    return np.sort(top, axis=1).astype(np.int64)


def bench_sim(seconds: float = 3.0, seed: int = 0,
              token_sets: ArrayLike | None = None) -> dict[str, Any]:
    """Benchmark fast versus oracle layer simulations on the DeepSeek-V2-Lite 4×8 workload.

    Half of ``seconds`` is spent on each path (at least one call each, after one warm-up call of
    the fast path that also triggers compilation or loads the numba cache).

    Args:
        seconds: Total measurement time budget in seconds.
        seed: Seed of the placement shuffle, mapping, token sets and aggregators.
        token_sets: Optional int array [B, 6] of expert ids (E = 64); default 128 Zipf (s = 0.7)
            sets drawn with ``zipf_token_sets``.

    Returns:
        ``fast_sims_per_s``, ``oracle_sims_per_s``, ``ratio`` (fast / oracle),
        ``messages_per_sim`` (dispatch + combine), ``agreement`` (makespans bitwise equal), and
        ``fast_makespan_us`` (dispatch, combine) for reference.
    """
    streams = np.random.default_rng(np.random.SeedSequence(seed))
    hw = HardwareSpec(mesh_shape=(4, 8), link_bw_gbps=50.0)
    topo = make_topology("mesh", hw)
    num_nodes = hw.num_nodes
    perm = streams.permutation(_NUM_EXPERTS)
    holder_mask = np.zeros((_NUM_EXPERTS, num_nodes), dtype=bool)
    holder_mask[perm, np.arange(_NUM_EXPERTS) // (_NUM_EXPERTS // num_nodes)] = True
    pi = streams.permutation(num_nodes).astype(np.int64)
    if token_sets is None:
        ts = zipf_token_sets(streams, _BATCH, _NUM_EXPERTS, _TOP_K)
    else:
        ts = np.asarray(token_sets, dtype=np.int64)
    agg = choose_aggregators(ts, holder_mask, "uniform", streams)
    msg_bytes = np.full(ts.shape[0], float(_HIDDEN * _B_MSG))

    def fast() -> Any:
        return simulate_layer_comm(topo, ts, msg_bytes, holder_mask, pi, agg)

    result = fast()  # warm-up / compile
    budget = max(float(seconds), 0.0) / 2.0
    calls = 0
    t0 = time.perf_counter()
    while True:
        fast()
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= budget:
            break
    fast_rate = calls / elapsed

    phases = []
    for direction in ("dispatch", "combine"):
        src, dst, size, task = layer_messages(ts, msg_bytes, holder_mask, agg, pi,
                                              direction=direction)
        phases.append((src, dst, size, layer_flow_keys(0, task, src)))
    calls = 0
    t0 = time.perf_counter()
    while True:
        oracle = [simulate_messages_oracle(topo, s, d, z, flow_keys=k).makespan_s
                  for s, d, z, k in phases]
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= budget:
            break
    oracle_rate = calls / elapsed
    return {
        "fast_sims_per_s": fast_rate,
        "oracle_sims_per_s": oracle_rate,
        "ratio": fast_rate / oracle_rate,
        "messages_per_sim": int(sum(result.num_messages)),
        "agreement": bool(tuple(oracle) == result.makespan_s),
        "fast_makespan_us": tuple(x * 1e6 for x in result.makespan_s),
    }


def cmd_bench_sim(args: argparse.Namespace) -> int:
    """Run ``hdamoe bench-sim``: fast DES path vs the pure-Python oracle, same run."""
    from hdamoe_env.app.simbench import bench_sim

    res = bench_sim(seconds=args.seconds, seed=args.seed)
    print("DES benchmark: DeepSeek-V2-Lite (E=64, top-6), B=128, 4x8 mesh 50 GB/s, EP, "
          "dispatch + combine per layer simulation")
    for key, value in res.items():
        print(f"  {key:>22}: {value:.4g}" if isinstance(value, float) else
              f"  {key:>22}: {value}")
    if args.json:
        write_json(args.json, res)
    return 0
