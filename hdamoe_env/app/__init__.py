"""The application layer: the ``hdamoe`` commands, their output, and the experiment drivers.

What lives here: the command-line parsers, pre-flight checks and ``main`` (``cli``), option
types, the generated run options and the flags shared by the commands (``argtypes``,
``flags``), logging and memory limits (``logs``, ``limits``); one module per command
(``simulate``, ``simbench``, ``tracetools``, ``record``, ``bench`` with ``methods``,
``envbench``, ``vecbench``, ``place``, ``train``, ``evaluate``, ``compare``, ``tune``,
``reproduce``, ``crossover`` with ``robust`` for ``crossover --robust``); their output
(``records``, ``tables`` — the one table renderer —, ``intervals``, ``progress``, ``tb``,
``plots``, ``report``, ``claims``) and helpers of the gating commands (``matched``,
``model_gating``).
Nothing imports it.

May import: everything (hdamoe_env and its sub-packages, agents, baselines, traces)
"""
