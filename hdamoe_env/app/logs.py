"""Logging configuration of the ``hdamoe`` command (application layer; library code only logs).

``configure_logging(verbose, quiet)`` is called once by ``hdamoe_env.app.cli.main`` with the
global ``-v/--verbose`` (count) and ``-q/--quiet`` flags:

| flags | level of the package loggers | also |
|---|---|---|
| (none) | WARNING | progress lines / bars on stderr |
| ``-v`` | INFO | |
| ``-vv`` | DEBUG | the MILP solver's log (on stderr, ``baselines.node_balance.milp.make_solver``) |
| ``-q`` | ERROR | no progress output (``hdamoe_env.app.progress.set_quiet``) |

Only the loggers of this distribution's packages (``hdamoe_env``, ``agents``, ``baselines``,
``traces``) get the level; third-party loggers stay at WARNING. Records go to stderr, one line
each; stdout is left to the commands' results.
"""

from __future__ import annotations

import logging
import sys

from hdamoe_env.app import progress

__all__ = ["PACKAGES", "configure_logging"]

#: Top-level packages whose loggers the flags control.
PACKAGES = ("hdamoe_env", "agents", "baselines", "traces")

_HANDLER_NAME = "hdamoe-cli"


def configure_logging(verbose: int = 0, quiet: bool = False) -> int:
    """Configure logging for one ``hdamoe`` run; return the level set on the package loggers.

    Idempotent: calling it again replaces the handler it installed before.

    Args:
        verbose: Number of ``-v`` flags (0 = WARNING, 1 = INFO, 2+ = DEBUG).
        quiet: ``-q``: errors only, and no progress output (wins over ``verbose``).
    """
    if quiet:
        level = logging.ERROR
    elif verbose >= 2:
        level = logging.DEBUG
    elif verbose == 1:
        level = logging.INFO
    else:
        level = logging.WARNING
    progress.set_quiet(quiet)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if handler.get_name() == _HANDLER_NAME:
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("hdamoe: %(levelname)s: %(name)s: %(message)s"))
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > logging.WARNING:
        root.setLevel(logging.WARNING)
    for name in PACKAGES:
        logging.getLogger(name).setLevel(level)
    return level
