"""Shared constants of the cost-model tests: the model presets, profiles and settings of the
check values of paper-model.md §14, and the rounding comparison they are stated with."""

from __future__ import annotations

from hdamoe_env.config.profiles import PROFILES
from hdamoe_env.config.specs import MODEL_PRESETS

US = 1e6
MODELS = {
    "deepseek": MODEL_PRESETS["deepseek-v2-lite"],
    "mixtral": MODEL_PRESETS["mixtral-8x7b"],
    "qwen2": MODEL_PRESETS["qwen2-57b-a14b"],
    "qwen35": MODEL_PRESETS["qwen3.5-35b-a3b"],
}
PAPER = PROFILES["paper"]
PAPER_HD = PROFILES["paper-hd"]
FAITHFUL = PROFILES["faithful"]
# faithful with the pre-PHYSICS.md cost knobs (no α, no hop latency, bf16 partial sums, ideal
# DRAM, 1024-token context): the profile the faithful check values of paper-model.md §14 are
# stated for
FAITHFUL_V1 = FAITHFUL.derive(b_psum=2, msg_alpha_s=0.0, hop_latency_s=0.0, tile_tokens=1,
                               tile_cols=1, gemm_overhead_s=0.0, tp_allreduce="ring",
                               nonmoe_allreduce=False, psum_combine=False,
                               dram_efficiency=1.0, nonmoe_ctx_len=1024,
                               switching="store_and_forward", ni_ports=False)
# faithful before the sourced compute, partial-sum, DRAM and context knobs (docs/PHYSICS.md
# §2, §4, §5, §6): columns padded to the 64-column share grid, partial sums of shard holders
# at b_msg, ideal DRAM, 1024-token context, store-and-forward DES without NI ports
FAITHFUL_V2 = FAITHFUL.derive(col_granularity=64, psum_combine=False, dram_efficiency=1.0,
                               nonmoe_ctx_len=1024, switching="store_and_forward",
                               ni_ports=False)
SETTINGS = ("2.5/75", "5/50", "10/25")


def close(x: float, value: float, digits: int = 2) -> bool:
    """Whether ``x`` rounds to ``value`` at ``digits`` decimals (tie-tolerant)."""
    return abs(x - value) <= 0.5 * 10.0**-digits + 1e-9
