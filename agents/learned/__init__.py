"""Learned policies: SB3 / sb3-contrib training, saving and loading (torch, lazy).

What lives here: the ``LearnedAgent`` that wraps a trained policy behind the ``predict``
protocol and its loader (``policy``); the training pipeline of ``hdamoe train`` (``train``:
the SB3 loop, callbacks, checkpoints and resume), its training envs and action designs
(``envs``) and its RL-Zoo style hyperparameters and their YAML files (``hyperparams``).
The only place torch is imported.

May import: agents, hdamoe_env, hdamoe_env.config, hdamoe_env.noc, hdamoe_env.cost,
hdamoe_env.decisions, hdamoe_env.sim, hdamoe_env.env, traces
"""
