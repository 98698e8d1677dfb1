"""Property-based robustness: trace readers, the placement loader, CLI value parsers
and env actions raise nothing outside the package's error classes.

50 examples each in the default suite; the 500-example runs are marked ``slow``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from traces.errors import HdMoeError  # noqa: E402

_FAST = settings(max_examples=50, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow])
_SLOW = settings(max_examples=500, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow])

_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 40),
                       st.floats(allow_nan=False), st.text(max_size=3))
_rows = st.lists(st.lists(_json_leaf, min_size=0, max_size=4), min_size=0, max_size=4)
_doc = st.one_of(
    st.dictionaries(st.text(alphabet="0123\u0661\u00b2 -a", min_size=0, max_size=3),
                    st.one_of(_rows, _json_leaf), max_size=4),
    st.lists(_json_leaf, max_size=3), _json_leaf)


def _check_reference(tmp_path, doc, k):
    import traces

    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    try:
        traces.read_reference_json(path, E=8, k=k)
    except HdMoeError:
        pass


@_FAST
@given(doc=_doc, k=st.sampled_from([None, 2]))
def test_reference_reader(tmp_path, doc, k):
    _check_reference(tmp_path, doc, k)


@pytest.mark.slow
@_SLOW
@given(doc=_doc, k=st.sampled_from([None, 2]))
def test_reference_reader_500(tmp_path, doc, k):
    _check_reference(tmp_path, doc, k)


def _valid_npz(tmp_path) -> bytes:
    from hdamoe_env.sim.placement import expert_parallel

    path = tmp_path / "good.npz"
    expert_parallel(2, 4, 4, np.random.default_rng(0)).save(path)
    return path.read_bytes()


def _check_damaged_files(tmp_path, data, cut, flips):
    import traces
    from hdamoe_env.sim.placement import Placement

    buf = bytearray(data[:cut] if cut else data)
    for pos, val in flips:
        if buf:
            buf[pos % len(buf)] ^= val
    path = tmp_path / "bad.npz"
    path.write_bytes(bytes(buf))
    for load in (Placement.load, traces.load):
        try:
            load(path)
        except HdMoeError:
            pass


_damage = dict(cut=st.integers(0, 4000),
               flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)),
                              max_size=4))


@_FAST
@given(**_damage)
def test_damaged_placement_and_trace_files(tmp_path, cut, flips):
    _check_damaged_files(tmp_path, _valid_npz(tmp_path), cut, flips)


@pytest.mark.slow
@_SLOW
@given(**_damage)
def test_damaged_placement_and_trace_files_500(tmp_path, cut, flips):
    _check_damaged_files(tmp_path, _valid_npz(tmp_path), cut, flips)


def _check_cli_values(option, text):
    from hdamoe_env.app.cli import build_parser

    parser = build_parser()
    argv = {"steps": ["simulate", "--steps", text], "requests": ["simulate", "--requests", text],
            "batch": ["simulate", "--batch", text], "mesh": ["simulate", "--mesh", text],
            "setting": ["simulate", "--setting", text],
            "rho": ["sweep-mem", "--model", "mixtral", "--out", "o", "--rho-values", text],
            "time": ["place", "--model", "mixtral", "--out", "o", "--time-limit", text],
            "hp": ["train", "--out", "o", "--hp", text],
            "seeds": ["bench", "--seeds", text]}[option]
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        assert exc.code == 2
        return
    if option in ("mesh", "setting"):             # parsed by the specs at the boundary
        from hdamoe_env.config.specs import hardware_from_setting

        try:
            hardware_from_setting(args.setting, args.mesh)
        except HdMoeError:
            pass


_cli = dict(option=st.sampled_from(["steps", "requests", "batch", "mesh", "setting", "rho",
                                    "time", "hp", "seeds"]),
            text=st.text(alphabet="0123456789-.,x/=abe none", min_size=1, max_size=8))


@_FAST
@given(**_cli)
def test_cli_value_parsers(option, text, capsys):
    _check_cli_values(option, text)
    capsys.readouterr()


@pytest.mark.slow
@_SLOW
@given(**_cli)
def test_cli_value_parsers_500(option, text, capsys):
    _check_cli_values(option, text)
    capsys.readouterr()


@pytest.fixture(scope="module")
def small_env():
    from hdamoe_env.env.environment import HdMoeEnv

    return HdMoeEnv(model="mixtral-8x7b", mesh="2x2", steps_per_episode=1, fidelity="analytic",
                    trace_requests=2, trace_tokens=256, batch=8, invalid_action="raise")


def _check_action(env, action):
    env.reset(seed=0)
    try:
        env.step(action)
    except HdMoeError:
        pass


_actions = st.one_of(
    st.lists(st.integers(-3, 20), min_size=0, max_size=14).map(np.array),
    st.lists(st.floats(allow_nan=True), min_size=1, max_size=12).map(np.array),
    st.integers(-5, 5), st.none(), st.text(max_size=3))


@_FAST
@given(action=_actions)
def test_env_actions(small_env, action):
    _check_action(small_env, action)


@pytest.mark.slow
@_SLOW
@given(action=_actions)
def test_env_actions_500(small_env, action):
    _check_action(small_env, action)
