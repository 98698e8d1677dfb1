"""Tests of hdamoe_env.config.profiles: the convention profiles (paper-model.md §4) — preset
knobs, validation, derived profiles and the names they travel as."""

from __future__ import annotations

import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.profiles import PROFILES, get_profile


def test_derived_name_round_trips_to_the_same_profile():
    derived = get_profile("faithful", b_psum=2, chunks=2, bc_charge_excess=False)
    assert derived.name == "faithful+b_psum=2+bc_charge_excess=False+chunks=2"
    again = get_profile(derived.name)
    assert again == derived and again.b_psum == 2 and again.chunks == 2
    assert again.bc_charge_excess is False
    assert again.to_dict()["knobs_sha256"] == derived.to_dict()["knobs_sha256"]


def test_plain_names_are_the_presets():
    for name, conv in PROFILES.items():
        assert get_profile(name) is conv


def test_float_and_tuple_knobs_parse():
    conv = get_profile("paper+bc_alpha_s=2e-07+gamma_paper_batches=(128, 256, 4)")
    assert conv.bc_alpha_s == 2e-7 and conv.gamma_paper_batches == (128, 256, 4)
    assert conv.is_paper


@pytest.mark.parametrize("bad, match", [
    ("faithful+nope=1", "unknown convention knob 'nope'"),
    ("faithful+b_psum", "is not knob=value"),
    ("faithful+b_psum=four", "b_psum='four' is not a valid int"),
    ("faithful+weight_streaming=maybe", "not a valid bool"),
    ("faithfull", "did you mean 'faithful'"),
])
def test_bad_derived_names_raise_typed_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        get_profile(bad)


def test_alpha_beta_knobs_round_trip_and_validate():
    """α–β knobs (docs/PHYSICS.md): bc_alpha_s None follows msg_alpha_s; negatives refused."""
    faithful = PROFILES["faithful"]
    assert faithful.bc_alpha_s is None and faithful.broadcast_alpha_s == faithful.msg_alpha_s
    derived = get_profile("faithful+msg_alpha_s=5e-08")
    assert derived.broadcast_alpha_s == 5e-8
    pinned = get_profile("paper+bc_alpha_s=None")
    assert pinned.broadcast_alpha_s == 0.0 == pinned.msg_alpha_s
    with pytest.raises(ConfigError, match="msg_alpha_s must be a finite number >= 0"):
        get_profile("faithful", msg_alpha_s=-1e-9)


def test_ni_port_latency_knob():
    """docs/PHYSICS.md §16: a port pays ``ni_latency_hops`` hop latencies (BookSim: 3 of 4)."""
    f = PROFILES["faithful"]
    assert f.ni_latency_hops == 0.75 and f.ni_latency_for(4e-9) == pytest.approx(3e-9, rel=1e-15)
    assert get_profile("faithful+ni_latency_hops=1.0").ni_latency_for(2e-9) == 2e-9
    assert f.ni_latency_for(0.0) == 0.0
    for bad in (-0.5, float("nan")):
        with pytest.raises(ConfigError, match="ni_latency_hops must be a finite number >= 0"):
            f.derive(ni_latency_hops=bad)


def test_tile_cols_must_be_positive():
    with pytest.raises(ConfigError, match="tile_cols"):
        PROFILES["faithful"].derive(tile_cols=0)


def test_profiles_knobs():  # §4.1
    f, p, hd = PROFILES["faithful"], PROFILES["paper"], PROFILES["paper-hd"]
    assert (f.expert_matrices, f.b_msg, f.kappa_a, f.moe_comm) == (3, 2, 2.0, "dispatch+combine")
    assert (p.expert_matrices, p.b_msg, p.kappa_a, p.moe_comm) == (1, 1, 4.0, "2xcombine")
    assert (p.tp_const, hd.tp_const) == (16.0, 8.0)
    assert (p.nonmoe, p.nonmoe_ctx_len, hd.nonmoe, hd.nonmoe_ctx_len) == ("journal", 64,
                                                                          "generic", 1024)
    assert p.is_paper and hd.is_paper and not f.is_paper


def test_derived_profile_records_overrides():
    conv = get_profile("faithful", b_msg=1)
    assert conv.name == "faithful+b_msg=1" and conv.b_msg == 1
    assert get_profile("faithful", b_msg=2) is PROFILES["faithful"]
    with pytest.raises(ConfigError, match="did you mean 'b_msg'"):
        get_profile("faithful", b_mgs=1)
    with pytest.raises(ConfigError, match="aggregator"):
        get_profile("faithful", aggregator="nearest")
    with pytest.raises(ConfigError, match="unknown convention profile"):
        get_profile("papr")
    assert conv.to_dict()["knobs_sha256"] != PROFILES["faithful"].to_dict()["knobs_sha256"]


def test_derived_profile_refuses_a_repeated_knob():
    from hdamoe_env.config.errors import ConfigError
    from hdamoe_env.config.profiles import get_profile

    with pytest.raises(ConfigError, match="b_psum"):
        get_profile("faithful+b_psum=1+b_psum=2")
    assert get_profile("faithful+b_psum=2").b_psum == 2
