"""Up-front resource estimates of the commands (defined in ``hdamoe_env.config.limits``).

The estimates and the memory check live in the configuration layer so that the Python API
(``HdMoeEnv``, ``RunSpec.resolve``) refuses the same runs as the command line; this module
re-exports them for the application layer.
"""

from __future__ import annotations

from hdamoe_env.config.limits import (ROWS_PER_REQUEST, available_bytes, batch_bytes,
                                      check_fits, mesh_bytes, trace_bytes)

__all__ = ["ROWS_PER_REQUEST", "available_bytes", "batch_bytes", "check_fits", "mesh_bytes",
           "trace_bytes"]
