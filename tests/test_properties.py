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


# ------------------------------------------------ every parser and public constructor (issue 29)
_anything = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
              st.sampled_from([np.int64(3), np.float64(2.5), np.bool_(True), "4x8", "5/50",
                               "faithful+b_psum=2", "mixtral", "tp,ep", "0,1"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner),
                            st.dictionaries(st.text(max_size=4), inner, max_size=2)),
    max_leaves=6)

_ENV_FIELDS = ("batch", "mesh", "setting", "trace_skew", "trace_seed", "gating_levels",
               "batch_options", "predictor_accuracy", "reward_scale", "dispatch_rules",
               "gammas", "gating_coefficients", "steps_per_episode", "k_b", "conventions",
               "hardware", "topology", "trace", "trace_requests", "gating_protect_top")


def _parsers():
    import argparse

    from hdamoe_env.app import argtypes
    from hdamoe_env.config import limits, profiles, run, specs
    from traces import io

    text = {"seed_list": argtypes.seed_list, "name_list": argtypes.name_list,
            "int_list": argtypes.int_list, "hp_item": argtypes.hp_item,
            "float_list": argtypes.float_list(), "bounded_float": argtypes.bounded_float(0, 1),
            "finite_float": argtypes.finite_float, "positive_int": argtypes.positive_int,
            "model_list": argtypes.model_list, "setting_list": argtypes.setting_list,
            "batch_list": argtypes.batch_list}
    api = {"parse_mesh": specs.parse_mesh, "parse_setting": specs.parse_setting,
           "get_model": specs.get_model, "get_profile": profiles.get_profile,
           "check_seed": run.check_seed, "check_batch": run.check_batch,
           "check_trace_skew": run.check_trace_skew,
           "check_trace_requests": run.check_trace_requests,
           "check_bound": lambda v: limits.check_bound("x", v, limits.SKEW_RANGE),
           "loads_json": io.loads_json, "mesh_label": run.mesh_label}
    return text, api, argparse.ArgumentTypeError


def _check_parsers(value):
    text, api, arg_error = _parsers()
    for parse in text.values():               # command-line types: one argparse error line
        try:
            parse(str(value))
        except (arg_error, HdMoeError):
            pass
    for name, parse in api.items():
        if name == "loads_json" and not isinstance(value, str | bytes):
            continue
        try:
            parse(value)
        except HdMoeError:
            pass
        except ValueError as exc:             # json.JSONDecodeError is the one documented one
            assert name == "loads_json" and isinstance(exc, json.JSONDecodeError), (name, exc)


@_FAST
@given(value=_anything)
def test_parsers_raise_only_package_errors(value):
    _check_parsers(value)


@pytest.mark.slow
@_SLOW
@given(value=_anything)
def test_parsers_raise_only_package_errors_500(value):
    _check_parsers(value)


def _check_constructors(field, value):
    from hdamoe_env.config.run import RunSpec
    from hdamoe_env.config.specs import HardwareSpec, TopologySpec
    from hdamoe_env.env.config import EnvConfig

    calls = [lambda: EnvConfig(model="mixtral-8x7b", **{**{"mesh": "2x2"}, field: value}),
             lambda: EnvConfig.create(**{field + "_x": value}),
             lambda: HardwareSpec(mesh_shape=value if field == "mesh" else (2, 2),
                                  hop_latency_ns=value if field == "reward_scale" else None),
             lambda: TopologySpec(kind=value)]
    if field in ("batch", "mesh", "setting", "trace_skew", "conventions", "trace",
                 "trace_requests", "topology"):
        calls.append(lambda: RunSpec.resolve(model="mixtral", **{field: value}))
    for call in calls:
        try:
            call()
        except HdMoeError:
            pass


_ctor = dict(field=st.sampled_from(_ENV_FIELDS), value=_anything)


@_FAST
@given(**_ctor)
def test_constructors_raise_only_package_errors(field, value):
    _check_constructors(field, value)


@pytest.mark.slow
@_SLOW
@given(**_ctor)
def test_constructors_raise_only_package_errors_500(field, value):
    _check_constructors(field, value)
