"""Decode-step formation (traces.md §6): determinism and the invariants of `streams`."""

from __future__ import annotations

import numpy as np
import pytest

import traces
from tests.traces.trace_helpers import make_trace
from traces import RoutingTrace


@pytest.fixture(scope="module")
def conversations() -> RoutingTrace:
    """12 requests (6 conversations × 2 turns) with a 'prefix' of 3 rows excluded per request."""
    lengths = [20, 25, 7, 9, 30, 12, 15, 15, 5, 40, 11, 13]
    num_tokens = sum(lengths)
    rng = np.random.default_rng(0)
    ids = np.stack([np.argsort(rng.random((num_tokens, 8)), axis=1)[:, :2] for _ in range(3)])
    req = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths])
    return make_trace(ids, E=8, req_lengths=lengths, keep=pos >= 3, conv_id=req // 2, turn=req % 2)


def _position_map(trace: RoutingTrace, view: str) -> dict[int, tuple[int, int]]:
    """Row → (request index, position in the request's row list)."""
    out = {}
    for index, rows in enumerate(traces.requests(trace, view)):
        for position, row in enumerate(rows.tolist()):
            out[row] = (index, position)
    return out


def test_requests_group_turns(conversations: RoutingTrace) -> None:
    reqs = traces.requests(conversations)
    assert len(reqs) == 6
    assert reqs[0].size == (20 - 3) + (25 - 3)
    assert all((np.diff(r) > 0).all() for r in reqs)
    assert all(conversations.keep[r].all() for r in reqs)
    assert sum(r.size for r in traces.requests(conversations, "raw")) == conversations.num_tokens


@pytest.mark.parametrize("B", [1, 4, 6, 13])
def test_streams_invariants(conversations: RoutingTrace, B: int) -> None:
    steps = traces.take(traces.streams(conversations, B, np.random.default_rng(1)), 200)
    assert steps.shape == (200, B)
    reqs = traces.requests(conversations)
    where = _position_map(conversations, "content")
    assert all(conversations.keep[steps.ravel()])
    for step in range(199):
        for slot in range(B):
            req, position = where[int(steps[step, slot])]
            nxt_req, nxt_position = where[int(steps[step + 1, slot])]
            if position + 1 < reqs[req].size:  # cursor advances by one
                assert (nxt_req, nxt_position) == (req, position + 1)
            else:  # next request starts at row 0
                assert nxt_position == 0
    if B <= 6:
        # slots serve distinct requests while there are enough requests
        first = [where[int(row)][0] for row in steps[0]]
        assert len(set(first)) == B
    counts = traces.distinct_requests(conversations, steps)
    assert counts.shape == (200,) and (counts >= 1).all() and (counts <= min(B, 6)).all()


def test_streams_deterministic_and_stagger(conversations: RoutingTrace) -> None:
    a = traces.take(traces.streams(conversations, 4, np.random.default_rng(9)), 50)
    b = traces.take(traces.streams(conversations, 4, np.random.default_rng(9)), 50)
    c = traces.take(traces.streams(conversations, 4, np.random.default_rng(10)), 50)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    flat = traces.take(traces.streams(conversations, 4, np.random.default_rng(9), stagger=False), 1)
    starts = {int(r[0]) for r in traces.requests(conversations)}
    assert set(flat[0].tolist()) <= starts  # unstaggered: every cursor at 0


def test_streams_without_cycle_stops(conversations: RoutingTrace) -> None:
    total = sum(r.size for r in traces.requests(conversations))
    steps = traces.take(
        traces.streams(conversations, 2, np.random.default_rng(0), cycle=False, stagger=False),
        10_000,
    )
    assert 0 < steps.shape[0] < total
    with pytest.raises(ValueError, match="cycle=False"):
        traces.streams(conversations, 7, np.random.default_rng(0), cycle=False)


def test_random_rows(conversations: RoutingTrace) -> None:
    steps = traces.take(traces.random_rows(conversations, 16, np.random.default_rng(2)), 30)
    assert steps.shape == (30, 16)
    assert all(len(set(step.tolist())) == 16 for step in steps)  # without replacement
    assert conversations.keep[steps].all()
    again = traces.take(traces.random_rows(conversations, 16, np.random.default_rng(2)), 30)
    np.testing.assert_array_equal(steps, again)
    raw = traces.take(
        traces.random_rows(conversations, 8, np.random.default_rng(2), view="raw"), 200
    )
    assert not conversations.keep[raw].all()


def test_random_rows_per_layer(conversations: RoutingTrace) -> None:
    steps = traces.take(traces.random_rows_per_layer(conversations, 8, np.random.default_rng(3)), 5)
    assert steps.shape == (5, conversations.num_layers, 8)
    assert not np.array_equal(steps[:, 0], steps[:, 1])


def test_identical_and_windows(conversations: RoutingTrace) -> None:
    same = traces.take(traces.identical(conversations, 5, np.random.default_rng(4)), 20)
    assert same.shape == (20, 5) and (same == same[:, :1]).all()
    where = _position_map(conversations, "content")
    windows = traces.take(traces.windows(conversations, 10, np.random.default_rng(5)), 50)
    for window in windows:
        located = [where[int(row)] for row in window]
        assert len({req for req, _ in located}) == 1
        assert [p for _, p in located] == list(range(located[0][1], located[0][1] + 10))
    walk = traces.take(
        traces.windows(conversations, 10, np.random.default_rng(5), sequential=True), 8
    )
    assert walk.shape == (8, 10)
    with pytest.raises(ValueError, match="no request"):
        traces.windows(conversations, 500, np.random.default_rng(0))


def test_make_steps_registry(conversations: RoutingTrace) -> None:
    steps = traces.take(
        traces.make_steps("streams", conversations, 3, np.random.default_rng(1), n_steps=7), 100
    )
    assert steps.shape == (7, 3)
    with pytest.raises(traces.UnknownNameError, match="did you mean 'random_rows'"):
        traces.make_steps("random_row", conversations, 3, np.random.default_rng(1))


def _streams_per_slot(trace: RoutingTrace, B: int, rng: np.random.Generator, n_steps: int,
                      cycle: bool, stagger: bool) -> list[np.ndarray]:
    """The per-slot reference of `streams`: one scalar `rng.integers` per initial slot, the
    queue refilled by `rng.permutation` whenever it runs empty (the draw order `streams` keeps)."""
    reqs = traces.requests(trace)
    lengths = np.array([r.size for r in reqs])
    queue: list[int] = []
    shuffles = 0

    def next_request() -> int | None:
        nonlocal shuffles
        if not queue:
            if shuffles and not cycle:
                return None
            queue.extend(rng.permutation(lengths.size)[::-1].tolist())
            shuffles += 1
        return queue.pop()

    slots = []
    for _ in range(B):
        request = next_request()
        assert request is not None
        slots.append([request, int(rng.integers(lengths[request])) if stagger else 0])
    out = []
    for _ in range(n_steps):
        out.append(np.array([reqs[r][c] for r, c in slots]))
        for slot in slots:
            slot[1] += 1
        for slot in slots:
            if slot[1] >= lengths[slot[0]]:
                request = next_request()
                if request is None:
                    return out
                slot[0], slot[1] = request, 0
    return out


@pytest.mark.parametrize(("B", "cycle", "stagger"),
                         [(1, True, True), (5, True, True), (13, True, True), (40, True, False),
                          (6, False, True), (4, False, False)])
def test_streams_match_the_per_slot_draws(conversations: RoutingTrace, B: int, cycle: bool,
                                          stagger: bool) -> None:
    # the chunked initial draws consume the generator exactly as one draw per slot
    for seed in range(5):
        a, b = np.random.default_rng(seed), np.random.default_rng(seed)
        got = list(traces.streams(conversations, B, a, n_steps=60, cycle=cycle,
                                  stagger=stagger))
        ref = _streams_per_slot(conversations, B, b, 60, cycle, stagger)
        assert len(got) == len(ref)
        for x, y in zip(got, ref, strict=True):
            np.testing.assert_array_equal(x, y)
        assert a.random() == b.random()                  # same stream position afterwards
