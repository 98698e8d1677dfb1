"""The Gymnasium environment: configuration, action layout, ``HdMoeEnv`` and public wrappers.

What lives here: the env's configuration (``config``), the action layout and its masks
(``actions``), ``HdMoeEnv`` (``environment``: translates actions into simulator decisions and
results into observations, reward and ``info``; no physics) and wrappers that need only the env
(``wrappers``); the numpy-only link heat map of ``render_mode="rgb_array"`` (``render``); the
placement env ``HdMoePlaceEnv`` (``place``: one MoE layer's placement built one expert at a
time); the drift env ``HdMoeDriftEnv`` (``drift``: keep, re-place or replicate one
layer's experts under drifting traffic).

May import: hdamoe_env.config, hdamoe_env.noc, hdamoe_env.cost, hdamoe_env.decisions,
hdamoe_env.sim, traces
"""
