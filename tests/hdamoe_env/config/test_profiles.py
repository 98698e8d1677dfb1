"""Convention profiles (paper-model.md §4): derived profiles travel as names."""

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
