"""The application layer: the ``hdamoe`` commands, their output, and the experiment drivers.

What lives here: the command-line parsers and ``main`` (``cli``, ``argtypes``), the benchmark
runner and its records (``bench``, ``records``, ``progress``, ``tb``, ``plots``), experiment
grids (``reproduce``, ``report``, ``crossover``, ``claims``), and the commands that compose
agents and baselines (``place``, ``train``, ``tune``, ``record``, ``model_gating``,
``matched``, ``simbench``, ``envbench``). Nothing imports it.

May import: everything (hdamoe_env and its sub-packages, agents, baselines, traces)
"""
