"""Train MaskablePPO (sb3-contrib) on HdMoE-v1 with the public wrappers; print the speed.

The env comes from ``gymnasium.make``; ``FlattenReplicasWrapper`` gives SB3's ``MultiInputPolicy``
1-D boxes and ``RankedBroadcastWrapper`` the learnable pre-broadcast action (slot = c-th
most-loaded predicted expert). MaskablePPO reads the wrapper's ``action_masks()`` through
``get_wrapper_attr``. Needs the ``rl`` extra (torch, stable-baselines3, sb3-contrib).

Run: python examples/train_maskable_ppo.py --timesteps 2048
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import gymnasium as gym

import hdamoe_env  # noqa: F401 - registers the env ids
from hdamoe_env.env.wrappers import FlattenReplicasWrapper, RankedBroadcastWrapper


def make_env(num_candidates: int, **env_kwargs: object) -> gym.Env:
    """Return the training env: ``gymnasium.make`` + the public wrappers + SB3's Monitor."""
    from stable_baselines3.common.monitor import Monitor

    env = gym.make("hdamoe_env/HdMoE-v1", **env_kwargs)
    env = FlattenReplicasWrapper(env)
    env = RankedBroadcastWrapper(env, num_candidates=num_candidates)
    return Monitor(env)


def main(argv: Sequence[str] | None = None) -> float:
    """Train, evaluate one episode; return the training speed in env steps per second."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deepseek-v2-lite", help="model preset id")
    p.add_argument("--fidelity", default="analytic", help="analytic (fast twin) or des")
    p.add_argument("--mesh", default="4x8", help="node grid XxY")
    p.add_argument("--batch", type=int, default=128, help="tokens per decode step")
    p.add_argument("--k-b", type=int, default=None, help="force pre-broadcast slots per layer")
    p.add_argument("--timesteps", type=int, default=2048, help="training env steps")
    p.add_argument("--n-steps", type=int, default=256, help="rollout length per update")
    p.add_argument("--candidates", type=int, default=4, help="K of the ranked action")
    p.add_argument("--seed", type=int, default=0, help="seed of SB3 and the episodes")
    p.add_argument("--save", default=None, help="save the model to this .zip path")
    args = p.parse_args(argv)

    import torch
    from sb3_contrib import MaskablePPO
    from sb3_contrib.common.maskable.evaluation import evaluate_policy

    torch.set_num_threads(1)                          # dependencies.md §6
    kwargs = {"model": args.model, "mesh": args.mesh, "batch": args.batch,
              "fidelity": args.fidelity}
    if args.k_b is not None:
        kwargs["k_b"] = args.k_b
    env = make_env(args.candidates, **kwargs)
    model = MaskablePPO("MultiInputPolicy", env, n_steps=args.n_steps,
                        batch_size=min(64, args.n_steps), seed=args.seed, device="cpu")
    t0 = time.perf_counter()
    model.learn(total_timesteps=args.timesteps)
    fps = model.num_timesteps / (time.perf_counter() - t0)
    print(f"MaskablePPO: {model.num_timesteps} env steps at {fps:.0f} steps/s (training "
          f"included)")
    mean, _ = evaluate_policy(model, make_env(args.candidates, **kwargs),
                              n_eval_episodes=1, use_masking=True)
    print(f"evaluation episode reward {mean:.2f} (-latency / TP's latency, summed over layers)")
    if args.save:
        model.save(args.save)
    return fps


if __name__ == "__main__":
    main()
