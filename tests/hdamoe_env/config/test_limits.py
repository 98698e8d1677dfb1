"""Numeric limits of a run (hdamoe_env/config/limits.py) and their checks at the boundary."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.config import limits
from hdamoe_env.config.errors import ConfigError, ResourceLimitError
from hdamoe_env.config.run import RunSpec, check_seed


@pytest.mark.parametrize("seed", [0, 7, np.int64(3), np.uint32(5), limits.SEED_MAX])
def test_check_seed_accepts_non_negative_integers(seed):
    assert check_seed(seed) == int(seed) and type(check_seed(seed)) is int


@pytest.mark.parametrize("seed", [-1, 1.5, 2.0, "0", True, np.bool_(False), None,
                                  limits.SEED_MAX + 1, [1]])
def test_check_seed_refuses_everything_else(seed):
    with pytest.raises(ConfigError, match="seed"):
        check_seed(seed)


@pytest.mark.parametrize("setting", ["1000000/50", "5/1e7", "0.00001/50"])
def test_settings_outside_their_bounds_are_refused(setting):
    with pytest.raises(ConfigError, match="compute_tflops|link_bw_gbps|setting"):
        RunSpec.resolve(model="mixtral", mesh="2x2", setting=setting)


@pytest.mark.parametrize("field", ["mem_bw_gbps", "hop_latency_ns", "node_dram_gib"])
def test_hardware_values_outside_their_bounds_are_refused(field):
    bound = limits.HARDWARE_BOUNDS[field]
    for bad in (bound.high * 10, float("inf")):
        with pytest.raises(ConfigError, match=field):
            RunSpec.resolve(model="mixtral", mesh="2x2", hardware_overrides={field: bad})
    inside = RunSpec.resolve(model="mixtral", mesh="2x2", hardware_overrides={field: bound.high})
    assert getattr(inside.hardware, field) == bound.high


def test_check_bound_names_the_value_range_and_reason():
    with pytest.raises(ConfigError) as err:
        limits.check_bound("--hop-latency-ns", 1e308, limits.HARDWARE_BOUNDS["hop_latency_ns"])
    text = str(err.value)
    assert "1e+308" in text and "[0, 1e+06]" in text and "ns" in text
    with pytest.raises(ConfigError, match="number"):
        limits.check_bound("x", "abc", limits.SKEW_RANGE)


def test_unknown_hardware_override_is_refused():
    for name in ("nosuch", "compute_tflops", "mesh_shape"):
        with pytest.raises(ConfigError, match=name):
            RunSpec.resolve(hardware_overrides={name: 1})


@pytest.mark.parametrize("skew", [1e308, 1e3, 1e-5])
def test_skew_outside_its_range_is_refused(skew):
    with pytest.raises(ConfigError, match="trace_skew"):
        RunSpec.resolve(trace_skew=skew)


@pytest.mark.parametrize("kwargs", [{"batch": 2**40}, {"mesh": (1000, 16)}])
def test_python_api_has_the_memory_preflight(kwargs, monkeypatch):
    monkeypatch.setattr(limits, "available_bytes", lambda: 2**30)
    with pytest.raises(ResourceLimitError, match="GiB"):
        RunSpec.resolve(model="mixtral", **{"mesh": "2x2", **kwargs})


def test_huge_mesh_is_refused_before_anything_is_built():
    with pytest.raises(ConfigError, match="mesh"):
        RunSpec.resolve(mesh=(2**31, 2**31))


def test_input_size_cap_reads_the_environment(monkeypatch):
    monkeypatch.setenv("HDAMOE_MAX_INPUT_BYTES", "1234")
    assert limits.max_input_bytes() == 1234
    monkeypatch.setenv("HDAMOE_MAX_INPUT_BYTES", "junk")
    assert limits.max_input_bytes() == limits.MAX_INPUT_BYTES
