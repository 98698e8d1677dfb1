"""One run configuration (hdamoe_env/config/run.py): one default, one check, one resolution."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import Counter

import numpy as np
import pytest

from hdamoe_env.config import profiles, specs
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.run import RUN_DEFAULTS, RUN_OPTIONS, RunSpec, check_batch, profile_key
from hdamoe_env.config.specs import MODEL_PRESETS, ModelSpec

TINY = ModelSpec(key="tiny-run", name="tiny-run", num_moe_layers=2, num_experts=4, top_k=2,
                 hidden_size=64, expert_intermediate=128, attn_weight_elements=4 * 64 * 64,
                 kv_elements_per_token=2 * 64, core_flops_per_ctx_token=4 * 64,
                 hybrid_regions=2)
RESOLVERS = ((specs, "get_model"), (profiles, "get_profile"), (specs, "hardware_from_setting"))


@pytest.fixture
def resolutions(monkeypatch):
    """Count the name lookups (string arguments) of model, profile and setting, everywhere.

    Every module that imported a resolver by name gets the counting wrapper, so a lookup from
    any module of the project is seen.
    """
    counts: Counter[str] = Counter()
    monkeypatch.setitem(MODEL_PRESETS, TINY.key, TINY)
    for module, name in RESOLVERS:
        original = getattr(module, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            if args and isinstance(args[0], str):
                counts[_name] += 1
            return _original(*args, **kwargs)

        for mod in list(sys.modules.values()):
            if getattr(mod, name, None) is original:
                monkeypatch.setattr(mod, name, counting)
    return counts


def test_check_batch_is_the_one_validation():
    from traces import batching

    assert check_batch is batching.check_batch
    assert check_batch(8) == 8 and check_batch(np.int64(3)) == 3
    for bad in (0, -1, True, 2.5, "16", None):
        with pytest.raises(ConfigError, match="batch"):
            check_batch(bad)


@pytest.mark.parametrize("where", ["env", "bench", "place", "run"])
def test_a_bad_batch_gets_the_same_error_everywhere(where):
    from baselines.pipeline import PlaceConfig
    from hdamoe_env.app.bench import BenchConfig
    from hdamoe_env.env.config import EnvConfig

    build = {"env": EnvConfig, "bench": BenchConfig.create, "place": PlaceConfig.create,
             "run": RunSpec.resolve}[where]
    with pytest.raises(ConfigError) as exc:
        build(batch=0)
    with pytest.raises(ConfigError) as ref:
        check_batch(0)
    assert str(exc.value) == str(ref.value)


def test_every_configuration_and_command_takes_its_run_defaults_from_run_options():
    from baselines.pipeline import PlaceConfig
    from baselines.store import StoreConfig
    from hdamoe_env.app.bench import BenchConfig
    from hdamoe_env.app.cli import build_parser
    from hdamoe_env.env.config import EnvConfig

    env = EnvConfig()
    assert env.run_spec == RunSpec.resolve()
    for config in (BenchConfig(), StoreConfig(), PlaceConfig()):
        assert config.run == RunSpec.resolve()
    assert BenchConfig().place_batch == RUN_DEFAULTS.batch == StoreConfig().place_batch
    parser = build_parser()
    for command in (["simulate"], ["bench"], ["bench-env"], ["tune", "--out", "x"],
                    ["train", "--out", "x"], ["place", "--model", "qwen", "--out", "x"]):
        args = parser.parse_args(command)
        given = {"model"} if command[0] == "place" else set()    # place requires --model
        for name, option in RUN_OPTIONS.items():
            if hasattr(args, name) and name not in given:
                assert getattr(args, name) == option.default, (command, name)


def test_cli_batch_and_skew_are_checked_at_parse_time(capsys):
    from hdamoe_env.app.cli import main

    for argv in (["simulate", "--batch", "0"], ["bench", "--trace-skew", "-1"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and argv[1] in err


def test_run_bench_resolves_each_name_once(resolutions, tmp_path):
    from hdamoe_env.app.bench import BenchConfig, run_bench

    config = BenchConfig.create(model=TINY.key, mesh="2x2", setting="1/1", batch=8, steps=1,
                                conventions="paper", trace_requests=4,
                                cache_dir=str(tmp_path / "cache"), place_batch=8,
                                env_kwargs={"trace_tokens": 256})
    result = run_bench(config, ["tp", "ep"], [0, 1], progress=False)
    assert len(result.records) == 4
    assert resolutions == {"get_model": 1, "get_profile": 1, "hardware_from_setting": 1}


def test_simulate_command_resolves_each_name_once(resolutions, capsys):
    from hdamoe_env.app.cli import main

    assert main(["simulate", "--model", TINY.key, "--mesh", "2x2", "--setting", "1/1",
                 "--batch", "8", "--requests", "4", "--steps", "2",
                 "--conventions", "faithful+b_psum=4"]) == 0
    assert "tiny-run" in capsys.readouterr().out
    assert resolutions == {"get_model": 1, "get_profile": 1, "hardware_from_setting": 1}


def test_an_env_resolves_each_name_once(resolutions):
    from hdamoe_env.env.environment import HdMoeEnv

    env = HdMoeEnv(model=TINY.key, setting="1/1", mesh="2x2", batch=8, trace_requests=4,
                   trace_tokens=256, placement="ep")
    env.reset(seed=0)
    env.step(env.action_space.sample())
    assert resolutions == {"get_model": 1, "get_profile": 1, "hardware_from_setting": 1}


def test_resolve_keeps_specs_and_labels():
    run = RunSpec.resolve(model="deepseek", setting="10/25", mesh=(2, 4), topology="torus",
                          conventions="faithful+b_psum=2", batch=32)
    assert run.model is MODEL_PRESETS["deepseek-v2-lite"] and run.batch == 32
    assert run.mesh == "2x4" and run.mesh_shape == (2, 4) and run.topology.kind == "torus"
    assert run.hardware.compute_tflops == 10 and run.hardware.link_bw_gbps == 25
    assert run.profile == "faithful+b_psum=2" and profile_key(run.conventions) == run.profile
    assert RunSpec.resolve(conventions=run.conventions).conventions is run.conventions
    edited = dataclasses.replace(run.conventions, b_psum=8)          # name no longer says it
    assert isinstance(profile_key(edited), dict)
    with pytest.raises(ConfigError, match="did you mean"):
        RunSpec.resolve(model="deepsek-v2-lite")
    with pytest.raises(ConfigError, match="trace"):
        RunSpec.resolve(trace=3)


def test_generated_options_carry_the_declared_help():
    from hdamoe_env.app.argtypes import add_run_arguments

    parser = argparse.ArgumentParser()
    add_run_arguments(parser, ("batch", "trace_requests"), defaults={"batch": None})
    actions = {a.dest: a for a in parser._actions}
    assert actions["batch"].help == RUN_OPTIONS["batch"].help and actions["batch"].default is None
    assert parser.parse_args(["--requests", "5"]).trace_requests == 5
