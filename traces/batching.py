"""Decode-step batches: which trace rows form each simulated step.

Implements traces.md §6. A decode step of batch B is an int64 array [B] of row indices used for
every layer, so cross-layer structure and next-layer prediction stay meaningful; the only
exception is :func:`random_rows_per_layer`, whose steps are [L, B]. Every mode takes an explicit
``rng: np.random.Generator`` (style.md R7) and a ``view`` ("content" default, "unique", "raw"),
and is deterministic given the generator state.

A *request* here is one conversation (``conv_id``; ``req_id`` when absent): the rows of its turns
in the chosen view, in generation order (content view: turn-1 rows after the shared prefix, then
turn-2 rows after the replay). The step functions return (possibly infinite) iterators; use
:func:`take` to stack the first ``n_steps`` into an array [n_steps, B].
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from numpy.typing import NDArray

from traces.errors import ConfigError, unknown_name
from traces.trace import RoutingTrace

__all__ = [
    "BATCH_MODES",
    "check_batch",
    "distinct_requests",
    "identical",
    "make_steps",
    "random_rows",
    "random_rows_per_layer",
    "requests",
    "streams",
    "take",
    "windows",
]

Steps = Iterator[NDArray[np.int64]]


def requests(trace: RoutingTrace, view: str = "content") -> list[NDArray[np.int64]]:
    """Return the requests of a trace: per conversation, its rows in the view, in order.

    Args:
        trace: The trace.
        view: "content", "unique" or "raw".

    Returns:
        One int64 array of row indices per request with at least one row in the view, ordered by
        first appearance in the trace.
    """
    cached = _REQUESTS.get(trace, {}).get(view)
    if cached is not None:                       # a trace's arrays are read-only: reuse them
        return list(cached)
    rows = trace.view(view)
    if rows.size == 0:
        return []
    groups = trace.group_ids()[rows]
    order = np.argsort(groups, kind="stable")  # rows ascending within each group
    _, first, counts = np.unique(groups[order], return_index=True, return_counts=True)
    pieces = np.split(rows[order], np.cumsum(counts)[:-1])
    appearance = np.argsort(order[first], kind="stable")
    out = [pieces[i] for i in appearance]
    for piece in out:
        piece.flags.writeable = False
    _REQUESTS.setdefault(trace, {})[view] = out
    return list(out)


#: ``requests`` per trace and view (every env reset forms its decode steps from them); weak
#: keys: the entries go with the trace.
_REQUESTS: weakref.WeakKeyDictionary[RoutingTrace, dict[str, list[NDArray[np.int64]]]] = \
    weakref.WeakKeyDictionary()


def check_batch(value: Any) -> int:
    """Return the batch size B (tokens per decode step) as an int: the project's one check of B.

    ``hdamoe_env.config.run`` resolves a run's ``batch`` with it, and every decode-step former
    here checks its ``B`` with it.

    Args:
        value: An integer >= 1 (a bool is not one).

    Raises:
        ConfigError: Not an integer, or < 1 (the message names the value and a fix).
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer) or value < 1:
        raise ConfigError(f"batch must be a positive integer (tokens per decode step B), got "
                          f"{value!r}; e.g. batch=128")
    return int(value)


def _step_range(n_steps: int | None) -> Iterator[int]:
    if n_steps is not None and n_steps < 0:
        raise ValueError(f"n_steps must be >= 0 or None, got {n_steps}")
    return itertools.count() if n_steps is None else iter(range(n_steps))


def streams(
    trace: RoutingTrace,
    B: int,
    rng: np.random.Generator,
    n_steps: int | None = None,
    cycle: bool = True,
    stagger: bool = True,
    view: str = "content",
) -> Steps:
    """Yield decode steps of B request streams advancing one token per step (traces.md §6.2).

    The request queue is a seeded permutation of the requests (reshuffled when exhausted if
    ``cycle``). Each of the B slots takes the next request; with ``stagger`` its first cursor is
    uniform over the request's rows, later requests start at row 0. After every step each cursor
    advances by one; a slot whose request ended takes the next request from the queue.

    Args:
        trace: The trace.
        B: Batch size (slots).
        rng: Random generator (queue permutations, stagger offsets).
        n_steps: Steps to yield; None = until the queue is exhausted (forever when ``cycle``).
        cycle: Reshuffle the requests when the queue is exhausted; otherwise stop at that point.
        stagger: Start the initial slots at random positions (desynchronised streams).
        view: Row view.

    Yields:
        int64 [B] row indices, slot order b = 0..B−1.

    Raises:
        ValueError: When the view has no rows, or ``cycle`` is False and B exceeds the number of
            requests.
    """
    check_batch(B)
    steps = _step_range(n_steps)
    reqs = requests(trace, view)
    if not reqs:
        raise ValueError(f"view {view!r} of the trace has no rows")
    if not cycle and B > len(reqs):
        raise ValueError(
            f"B={B} slots need at least B requests when cycle=False, but view "
            f"{view!r} has {len(reqs)}; use cycle=True or a smaller B"
        )
    flat = np.concatenate(reqs)
    lengths = np.array([r.size for r in reqs], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    return _stream_steps(flat, lengths, offsets, B, rng, steps, cycle, stagger)


def _stream_steps(
    flat: NDArray[np.int64],
    lengths: NDArray[np.int64],
    offsets: NDArray[np.int64],
    batch: int,
    rng: np.random.Generator,
    steps: Iterator[int],
    cycle: bool,
    stagger: bool,
) -> Steps:
    # The queue is the current permutation, taken from the front; a new permutation is drawn
    # when it is exhausted (only with ``cycle`` after the first). The first B slots are filled
    # a queue's worth at a time, their stagger offsets drawn with one ``rng.integers`` call
    # per chunk: an array ``high`` draws the same values, in the same order, as one scalar
    # call per slot (tests/traces/test_batching.py checks the stream against that loop).
    queue = np.zeros(0, dtype=np.int64)
    head = 0
    shuffles = 0

    def refill() -> bool:
        nonlocal queue, head, shuffles
        if shuffles and not cycle:
            return False
        queue = rng.permutation(lengths.size)
        head = 0
        shuffles += 1
        return True

    start = np.empty(batch, dtype=np.int64)
    length = np.empty(batch, dtype=np.int64)
    cursor = np.zeros(batch, dtype=np.int64)
    slot = 0
    while slot < batch:
        if head >= queue.size:
            filled = refill()
            assert filled  # B <= number of requests was checked
        take = min(queue.size - head, batch - slot)
        chunk = queue[head:head + take]
        head += take
        start[slot:slot + take] = offsets[chunk]
        length[slot:slot + take] = lengths[chunk]
        if stagger:
            cursor[slot:slot + take] = rng.integers(length[slot:slot + take])
        slot += take
    for _ in steps:
        yield flat[start + cursor]
        cursor += 1
        for slot in np.flatnonzero(cursor >= length).tolist():
            if head >= queue.size and not refill():
                return
            request = queue[head]
            head += 1
            start[slot], length[slot], cursor[slot] = offsets[request], lengths[request], 0


def random_rows(
    trace: RoutingTrace,
    B: int,
    rng: np.random.Generator,
    n_steps: int | None = None,
    view: str = "content",
) -> Steps:
    """Yield steps of B rows drawn uniformly without replacement from the view (traces.md §6.1).

    Args:
        trace: The trace.
        B: Batch size; at most the number of rows in the view.
        rng: Random generator.
        n_steps: Steps to yield (None = forever).
        view: Row view.

    Yields:
        int64 [B] row indices (the same rows for every layer).
    """
    check_batch(B)
    steps = _step_range(n_steps)
    rows = trace.view(view)
    if B > rows.size:
        raise ValueError(
            f"B={B} exceeds the {rows.size} rows of view {view!r}; random_rows "
            "draws without replacement"
        )
    return (rows[rng.choice(rows.size, size=B, replace=False)] for _ in steps)


def random_rows_per_layer(
    trace: RoutingTrace,
    B: int,
    rng: np.random.Generator,
    n_steps: int | None = None,
    view: str = "content",
) -> Steps:
    """Yield steps of independent random rows per layer (traces.md §6.1).

    This destroys cross-layer structure; never use it with next-layer prediction.

    Args:
        trace: The trace.
        B: Batch size; at most the number of rows in the view.
        rng: Random generator.
        n_steps: Steps to yield (None = forever).
        view: Row view.

    Yields:
        int64 [L, B] row indices, one independent draw without replacement per layer.
    """
    check_batch(B)
    steps = _step_range(n_steps)
    rows = trace.view(view)
    if B > rows.size:
        raise ValueError(f"B={B} exceeds the {rows.size} rows of view {view!r}")
    num_layers = trace.num_layers

    def draw() -> NDArray[np.int64]:
        return np.stack(
            [rows[rng.choice(rows.size, size=B, replace=False)] for _ in range(num_layers)]
        )

    return (draw() for _ in steps)


def identical(
    trace: RoutingTrace,
    B: int,
    rng: np.random.Generator,
    n_steps: int | None = None,
    view: str = "content",
) -> Steps:
    """Yield steps of one row replicated B times (the authors' adaptive traces, traces.md §2.4).

    The replicated row follows a single request stream (B identical copies of one prompt being
    decoded): a random start inside a random request, then one row per step, then the next
    request of a seeded queue [decision].

    Args:
        trace: The trace.
        B: Batch size (copies).
        rng: Random generator.
        n_steps: Steps to yield (None = forever).
        view: Row view.

    Yields:
        int64 [B] row indices, all equal.
    """
    check_batch(B)
    single = streams(trace, 1, rng, n_steps=n_steps, cycle=True, stagger=True, view=view)
    return (np.repeat(step, B) for step in single)


def windows(
    trace: RoutingTrace,
    B: int,
    rng: np.random.Generator,
    n_steps: int | None = None,
    view: str = "content",
    sequential: bool = False,
) -> Steps:
    """Yield steps of B consecutive rows of one request (prefill-like chunks, traces.md §6.1).

    Args:
        trace: The trace.
        B: Window length; requests shorter than B are skipped.
        rng: Random generator.
        n_steps: Steps to yield (None = forever).
        view: Row view.
        sequential: False: every step is a window drawn uniformly over all valid window starts of
            all requests. True: walk through the requests in a seeded order, in consecutive
            non-overlapping windows (one request over time; a remainder shorter than B is
            dropped), reshuffling when all requests are done.

    Yields:
        int64 [B] row indices, consecutive in the request.
    """
    check_batch(B)
    steps = _step_range(n_steps)
    reqs = [r for r in requests(trace, view) if r.size >= B]
    if not reqs:
        raise ValueError(f"no request of view {view!r} has B={B} rows; use a smaller B")
    flat = np.concatenate(reqs)
    lengths = np.array([r.size for r in reqs], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    span = np.arange(B, dtype=np.int64)
    if not sequential:
        valid = lengths - B + 1
        cumulative = np.cumsum(valid)

        def draw() -> NDArray[np.int64]:
            index = int(rng.integers(cumulative[-1]))
            request = int(np.searchsorted(cumulative, index, side="right"))
            start = index - (cumulative[request] - valid[request])
            return flat[offsets[request] + start + span]

        return (draw() for _ in steps)

    def walk() -> Steps:
        while True:
            for request in rng.permutation(lengths.size):
                for start in range(0, int(lengths[request]) - B + 1, B):
                    yield flat[offsets[request] + start + span]

    return (step for _, step in zip(steps, walk(), strict=False))


def take(steps: Steps, n_steps: int) -> NDArray[np.int64]:
    """Stack the first ``n_steps`` steps of an iterator.

    Args:
        steps: An iterator from one of the batching modes.
        n_steps: Maximum number of steps.

    Returns:
        int64 [n, B] (or [n, L, B] for :func:`random_rows_per_layer`), n <= n_steps.
    """
    collected = list(itertools.islice(steps, n_steps))
    if not collected:
        return np.zeros((0, 0), dtype=np.int64)
    return np.stack(collected).astype(np.int64, copy=False)


def distinct_requests(trace: RoutingTrace, steps: NDArray[np.integer[Any]]) -> NDArray[np.int64]:
    """Count the distinct requests (conversations) per step (traces.md §6.2 note).

    Args:
        trace: The trace the rows index.
        steps: int [n_steps, B] row indices.

    Returns:
        int64 [n_steps].
    """
    groups = trace.group_ids()[np.asarray(steps)]
    ordered = np.sort(groups, axis=1)
    return 1 + (ordered[:, 1:] != ordered[:, :-1]).sum(axis=1).astype(np.int64)


BATCH_MODES: dict[str, Callable[..., Steps]] = {
    "streams": streams,
    "random_rows": random_rows,
    "random_rows_per_layer": random_rows_per_layer,
    "identical": identical,
    "windows": windows,
}


def make_steps(
    mode: str, trace: RoutingTrace, B: int, rng: np.random.Generator, **kwargs: Any
) -> Steps:
    """Return the step iterator of a batching mode by name.

    Args:
        mode: A key of :data:`BATCH_MODES`.
        trace: The trace.
        B: Batch size.
        rng: Random generator.
        **kwargs: Mode options (``n_steps``, ``view``, ``cycle``, ``stagger``, ``sequential``).

    Returns:
        The iterator of steps.

    Raises:
        UnknownNameError: For an unknown mode (with a near-miss suggestion).
    """
    try:
        build = BATCH_MODES[mode]
    except KeyError:
        raise unknown_name("batching mode", mode, BATCH_MODES) from None
    return build(trace, B, rng, **kwargs)
