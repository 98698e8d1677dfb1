"""TensorBoard adapter: tensorboardX, the EventFileWriter wrapper, the no-op writer (tb.py)."""

from __future__ import annotations

import logging
import sys

import pytest

from hdamoe_env.app import tb


def _scalars(logdir, tag):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.parametrize("backend", ["tensorboardX", "tensorboard"])
def test_writers_write_event_files(tmp_path, backend):
    pytest.importorskip(backend)
    logdir = tmp_path / tb.run_dir_name("hd-moe", 3, timestamp="20260101-000000")
    assert logdir.name == "HdMoE-v1__hd-moe__3__20260101-000000"
    with tb.make_writer(logdir, backend=backend) as writer:
        assert writer.backend == backend
        writer.add_scalar("latency/tbt_us", 12.5, 0)
        writer.add_scalar("latency/tbt_us", 11.0, 1)
        writer.add_scalar("links/max_util", float("nan"), 1)     # skipped, not an error
    assert list(logdir.glob("events.out.tfevents.*"))
    assert _scalars(logdir, "latency/tbt_us") == [(0, 12.5), (1, 11.0)]


def test_noop_writer_warns_once(tmp_path, monkeypatch, caplog):
    for name in [m for m in sys.modules if m.split(".")[0] in ("tensorboardX", "tensorboard")]:
        monkeypatch.setitem(sys.modules, name, None)     # also block cached submodules
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setattr(tb, "_warned_noop", False)
    with caplog.at_level(logging.WARNING, logger="hdamoe_env.app.tb"):
        first = tb.make_writer(tmp_path / "a")
        second = tb.make_writer(tmp_path / "b")
    assert first.backend == second.backend == "noop"
    first.add_scalar("latency/tbt_us", 1.0, 0)
    first.close()
    assert len([r for r in caplog.records if "TensorBoard logging is off" in r.message]) == 1
    assert not (tmp_path / "a").exists()


def test_run_dir_name_is_path_safe():
    name = tb.run_dir_name("agent:runs/ppo.zip", 0, env_id="hdamoe_env/HdMoE-v1",
                           timestamp="t")
    assert "/" not in name and name.startswith("HdMoE-v1__agent-runs-ppo.zip__0__")


@pytest.mark.parametrize("backend", ["tensorboardX", "tensorboard"])
def test_writers_write_config_text(tmp_path, backend):
    pytest.importorskip(backend)
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    name = tb.run_dir_name("hda-moe", 1, timestamp="20260101-000000", model="mixtral-8x7b",
                           setting="5/50", batch=128)
    assert name == "HdMoE-v1__mixtral-8x7b__5-50__B128__hda-moe__1__20260101-000000"
    with tb.make_writer(tmp_path / name, backend=backend) as writer:
        writer.add_text("config", tb.config_markdown({"model": "mixtral-8x7b", "a|b": 1}))
    acc = EventAccumulator(str(tmp_path / name), size_guidance={"tensors": 0})
    acc.Reload()
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| model | mixtral-8x7b |" in text and "a\\|b" in text
