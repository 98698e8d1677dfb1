"""Message lists for the DES: validation, chunk expansion and the tie rules (paper-model.md §6.3).

A DES run takes M messages (source and destination endpoints, bytes, release times, flow keys)
and a tie rule for equal event times (``TIE_BREAKS``: ``fifo`` or the reference's ``ref``).
``prepare_messages`` validates such a list once and cuts every message into equal chunks
(store-and-forward per chunk) — the input handling shared by the compiled DES and its oracle
(``hdamoe_env.noc.des``), the collectives on the DES (``hdamoe_env.noc.collectives``) and the
fused MoE-layer kernel (``hdamoe_env.noc.linksim``); the scalar checks here are the ones every
one of them applies to seconds, bytes and chunk counts. Units are SI.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.errors import ConfigError, unknown_name
from hdamoe_env.noc.topology import Topology

__all__ = ["TIE_BREAKS", "PreparedMessages", "check_chunks", "check_ref_size", "check_scalar",
           "prepare_messages", "tie_break_is_ref"]

#: Tie rules for equal event times (§6.3): insertion order, or the reference's (quirk Q19).
TIE_BREAKS = ("fifo", "ref")

# ref tie key = dense rank of size_rank * (num_routes + 1) + route_rank: the limit keeps that
# product far below 2**63
_MAX_REF_MESSAGES = 1 << 22


def check_ref_size(tie_ref: bool, num_messages: int) -> None:
    """Check that a ``tie_break="ref"`` run stays within the tie key's range.

    Args:
        tie_ref: Whether the run uses the reference tie rule (``tie_break_is_ref``).
        num_messages: DES messages of the run (after chunk expansion).

    Raises:
        ConfigError: More than 2**22 messages with ``tie_break="ref"``.
    """
    if tie_ref and num_messages > _MAX_REF_MESSAGES:
        raise ConfigError(f"tie_break='ref' supports at most {_MAX_REF_MESSAGES} messages per DES "
                          f"run, got {num_messages}; use tie_break='fifo' or fewer chunks")


def tie_break_is_ref(tie_break: str) -> bool:
    """Return whether ``tie_break`` is the reference rule ``"ref"`` (else ``"fifo"``).

    Raises:
        ConfigError: A name outside ``TIE_BREAKS`` (with a near-miss suggestion).
    """
    if tie_break not in TIE_BREAKS:
        raise unknown_name("tie_break", tie_break, TIE_BREAKS)
    return tie_break == "ref"


def check_scalar(name: str, value: float) -> float:
    """Return ``value`` as a float after checking it is finite and >= 0 (a time or a size).

    Args:
        name: The argument's name, for the message.
        value: Seconds or bytes.

    Raises:
        ConfigError: Not finite, or negative.
    """
    v = float(value)
    if not (np.isfinite(v) and v >= 0):
        raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
    return v


def check_chunks(chunks: int) -> int:
    """Return the number of chunks per message as an int after checking it is >= 1.

    Raises:
        ConfigError: Not an integer (bools refused), or < 1.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int | np.integer) or chunks < 1:
        raise ConfigError(f"chunks must be an integer >= 1, got {chunks!r}")
    return int(chunks)


@dataclass(frozen=True, slots=True)
class PreparedMessages:
    """Validated, chunk-expanded messages (M·chunks rows, message-major).

    Attributes:
        num_input: M, messages before chunk expansion.
        src: int64 [M'] sending endpoints. dst: int64 [M'] receiving endpoints.
        size: float64 [M'] bytes per (chunk) message. ready: float64 [M'] release times, s.
        keys: int64 [M'] or [M', K] flow keys (ties between equal times).
        tie_ref: Whether the reference tie rule applies.
        hop_latency: Seconds after every link traversal.
        chunks: Chunks per input message.
    """

    num_input: int
    src: NDArray[np.int64]
    dst: NDArray[np.int64]
    size: NDArray[np.float64]
    ready: NDArray[np.float64]
    keys: NDArray[np.int64]        # [M'] int keys or [M', K] tuple keys
    tie_ref: bool
    hop_latency: float
    chunks: int


def prepare_messages(topology: Topology, src: ArrayLike, dst: ArrayLike, size_bytes: ArrayLike,
                     ready_s: ArrayLike | None, tie_break: str, hop_latency_s: float,
                     flow_keys: ArrayLike | None, chunks: int) -> PreparedMessages:
    """Validate messages and expand them into chunks: the input handling of every DES entry.

    Args:
        topology: The NoC (endpoint ids).
        src: int [M] sending endpoints. dst: int [M] receiving endpoints.
        size_bytes: float [M] bytes per message, finite and >= 0.
        ready_s: float [M] (or a scalar) release times, s; None = all 0.
        tie_break: One of ``TIE_BREAKS``.
        hop_latency_s: Seconds after every link traversal, >= 0.
        flow_keys: int [M] or [M, K] flow keys, or None (the message index).
        chunks: Chunks per message (>= 1); each carries size / chunks bytes.

    Returns:
        The messages, message-major, ``chunks`` rows per input message.

    Raises:
        ConfigError: Any malformed input (the message names it, the value and the fix).
    """
    tie_ref = tie_break_is_ref(tie_break)
    hop = check_scalar("hop_latency_s", hop_latency_s)
    chunks = check_chunks(chunks)
    s = np.asarray(src)
    d = np.asarray(dst)
    z = np.asarray(size_bytes, dtype=np.float64)
    if s.ndim != 1 or d.ndim != 1 or z.ndim != 1:
        raise ConfigError(f"src, dst and size_bytes must be 1-D arrays [M]; got shapes {s.shape}, "
                          f"{d.shape}, {z.shape}")
    m = s.shape[0]
    if d.shape[0] != m or z.shape[0] != m:
        raise ConfigError(f"src, dst and size_bytes must have equal lengths; got {m}, "
                          f"{d.shape[0]}, {z.shape[0]}")
    if m and not (np.issubdtype(s.dtype, np.integer) and np.issubdtype(d.dtype, np.integer)):
        raise ConfigError(f"src and dst must be integer endpoint ids, got dtypes {s.dtype}, "
                          f"{d.dtype}")
    s = s.astype(np.int64)
    d = d.astype(np.int64)
    n = topology.num_endpoints
    for name, arr in (("src", s), ("dst", d)):
        bad = np.flatnonzero((arr < 0) | (arr >= n))
        if bad.size:
            raise ConfigError(f"{name}[{bad[0]}]={arr[bad[0]]} is not an endpoint id; expected "
                              f"0 <= {name} < {n}")
    bad = np.flatnonzero(~(np.isfinite(z) & (z >= 0)))
    if bad.size:
        raise ConfigError(f"size_bytes[{bad[0]}]={z[bad[0]]!r} must be finite and >= 0")
    if ready_s is None:
        ready = np.zeros(m)
    else:
        ready = np.asarray(ready_s, dtype=np.float64)
        if ready.ndim == 0:
            ready = np.full(m, float(ready))
        if ready.shape != (m,):
            raise ConfigError(f"ready_s must have shape [{m}], got {ready.shape}")
        bad = np.flatnonzero(~(np.isfinite(ready) & (ready >= 0)))
        if bad.size:
            raise ConfigError(f"ready_s[{bad[0]}]={ready[bad[0]]!r} must be finite and >= 0")
    if flow_keys is None:
        keys = np.arange(m, dtype=np.int64)  # [decision] default key = message index
    else:
        keys = np.asarray(flow_keys)
        if keys.shape[:1] != (m,) or keys.ndim not in (1, 2) or (
                m and not np.issubdtype(keys.dtype, np.integer)):
            raise ConfigError(f"flow_keys must be an integer array [{m}] or [{m}, K], got shape "
                              f"{keys.shape} and dtype {keys.dtype}")
        keys = keys.astype(np.int64)
    if chunks > 1:
        s = np.repeat(s, chunks)
        d = np.repeat(d, chunks)
        z = np.repeat(z / chunks, chunks)
        ready = np.repeat(ready, chunks)
        chunk_idx = np.tile(np.arange(chunks, dtype=np.int64), m)
        keys2 = keys.reshape(m, -1)
        keys = np.column_stack([np.repeat(keys2, chunks, axis=0), chunk_idx])
    check_ref_size(tie_ref, m * chunks)
    return PreparedMessages(m, s, d, z, ready, keys, tie_ref, hop, chunks)
