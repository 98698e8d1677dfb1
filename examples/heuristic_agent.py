"""Step HdMoE-v1 with the HDA-MoE heuristic agent; print the TBT of each decode step."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import gymnasium as gym

import hdamoe_env  # noqa: F401 - registers hdamoe_env/HdMoE-v1
from agents import HDAMoEAgent


def main(argv: Sequence[str] | None = None) -> float:
    """Run one episode; return its mean TBT in µs."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="deepseek-v2-lite", help="model preset id")
    p.add_argument("--mesh", default="4x8", help="node grid XxY")
    p.add_argument("--batch", type=int, default=128, help="tokens per decode step")
    p.add_argument("--steps", type=int, default=4, help="decode steps per episode")
    p.add_argument("--seed", type=int, default=0, help="episode seed")
    args = p.parse_args(argv)
    env = gym.make("hdamoe_env/HdMoE-v1", model=args.model, mesh=args.mesh, batch=args.batch,
                   steps_per_episode=args.steps)
    agent = HDAMoEAgent.from_env(env.unwrapped)    # built from the env's specs
    obs, info = env.reset(seed=args.seed)
    done = False
    while not done:
        action, _ = agent.predict(obs)
        obs, _, terminated, truncated, info = env.step(action)
        if "tbt_us" in info:
            print(f"decode step {info['decode_step']}: TBT {info['tbt_us']:.1f} us")
        done = terminated or truncated
    print(f"episode mean TBT {info['episode_tbt_us']:.1f} us")
    return float(info["episode_tbt_us"])


if __name__ == "__main__":
    main()
