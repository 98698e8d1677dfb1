"""TensorBoard adapter for the package's own scalars (dependencies.md §5, style.md R16).

Application layer: the simulator and the env return data; only ``bench`` (and ``cli``) write
through this module. Writers are looked up lazily, in this order:

1. ``tensorboardX.SummaryWriter`` (torch-free, the ``tb`` extra);
2. a small wrapper over ``tensorboard.summary.writer.event_file_writer.EventFileWriter`` that
   writes ``Event`` protocol buffers with ``simple_value`` summaries (the ``log`` extra) — the
   same files TensorBoard reads;
3. a no-op writer that logs one warning per process.

Tags are namespaced (``latency/tbt_us``, ``latency/comm_us``, ``links/max_util``,
``nodes/balancedness``, ``gating/top1_retention``, ``train/*``, ``eval/*``), each group on one
x-axis, and the run's configuration goes to the Text tab (``config``); run directories are named
``{env_id}__{model}__{setting}__B{batch}__{method}__{seed}__{timestamp}`` (:func:`run_dir_name`).
docs/TENSORBOARD.md lists every tag and its x-axis.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from hdamoe_env.app.tables import render_table
from hdamoe_env.config.errors import DependencyNotInstalled

__all__ = [
    "BACKENDS",
    "read_scalars",
    "ENV_ID",
    "NoOpWriter",
    "ScalarWriter",
    "config_markdown",
    "make_writer",
    "run_dir_name",
]

log = logging.getLogger(__name__)

#: The registered Gymnasium id without its namespace (a slash does not belong in a directory).
ENV_ID = "HdMoE-v1"
#: Writer back ends in the order they are tried.
BACKENDS = ("tensorboardX", "tensorboard", "noop")

_warned_noop = False
_SAFE = re.compile(r"[^A-Za-z0-9._+=-]+")


class ScalarWriter(Protocol):
    """What ``bench`` needs from a TensorBoard writer."""

    backend: str
    logdir: Path | None

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """Record ``value`` under ``tag`` at global step ``step``."""

    def add_text(self, tag: str, text: str, step: int = 0) -> None:
        """Record a Markdown text under ``tag``."""

    def flush(self) -> None:
        """Write pending events to disk."""

    def close(self) -> None:
        """Flush and close the event file."""


class _WriterBase:
    backend = "base"
    logdir: Path | None = None

    def add_scalar(self, tag: str, value: float, step: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def add_text(self, tag: str, text: str, step: int = 0) -> None:  # pragma: no cover
        """Record a Markdown text (TensorBoard's Text tab) under ``tag``."""
        raise NotImplementedError

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        """Record several scalars at the same step; non-finite values are skipped."""
        for tag, value in values.items():
            self.add_scalar(tag, value, step)

    def flush(self) -> None:  # pragma: no cover - overridden
        """Write pending events to disk."""

    def close(self) -> None:  # pragma: no cover - overridden
        """Flush and close."""

    def __enter__(self) -> _WriterBase:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class NoOpWriter(_WriterBase):
    """A writer that drops everything (no TensorBoard package installed)."""

    backend = "noop"

    def __init__(self, logdir: str | Path | None = None) -> None:
        self.logdir = None if logdir is None else Path(logdir)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """Drop the scalar."""

    def add_text(self, tag: str, text: str, step: int = 0) -> None:
        """Drop the text."""

    def flush(self) -> None:
        """Do nothing."""

    def close(self) -> None:
        """Do nothing."""


class _TensorboardXWriter(_WriterBase):
    backend = "tensorboardX"

    def __init__(self, logdir: Path, summary_writer: Any) -> None:
        self.logdir = logdir
        self._writer = summary_writer(logdir=str(logdir))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        value = float(value)
        if math.isfinite(value):
            self._writer.add_scalar(tag, value, int(step))

    def add_text(self, tag: str, text: str, step: int = 0) -> None:
        self._writer.add_text(tag, text, int(step))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _EventFileWriter(_WriterBase):
    """Scalars as ``Event`` protobufs through the ``tensorboard`` package's file writer."""

    backend = "tensorboard"

    def __init__(self, logdir: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.logdir = logdir
        self._event = event_pb2.Event
        self._summary = summary_pb2.Summary
        self._summary_pb2 = summary_pb2
        self._writer = EventFileWriter(str(logdir))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        value = float(value)
        if not math.isfinite(value):
            return
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=value)])
        self._writer.add_event(self._event(wall_time=time.time(), step=int(step),
                                           summary=summary))

    def add_text(self, tag: str, text: str, step: int = 0) -> None:
        from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2, types_pb2

        meta = self._summary_pb2.SummaryMetadata(
            plugin_data=self._summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING, string_val=[text.encode("utf-8")],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(
                dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]))
        summary = self._summary(value=[self._summary.Value(   # tensorboardX's tag naming
            tag=f"{tag}/text_summary", metadata=meta, tensor=tensor)])
        self._writer.add_event(self._event(wall_time=time.time(), step=int(step),
                                           summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def make_writer(logdir: str | Path, *, backend: str | None = None) -> _WriterBase:
    """Return a scalar writer for ``logdir`` (created), trying the back ends in order.

    Args:
        logdir: Run directory of the event file.
        backend: Force one of ``BACKENDS`` (None: the first that imports).

    Returns:
        A writer with ``add_scalar(tag, value, step)``, ``add_scalars``, ``flush`` and
        ``close``; usable as a context manager. ``writer.backend`` names the back end.

    Raises:
        ValueError: ``backend`` is not one of ``BACKENDS``.
    """
    global _warned_noop
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown TensorBoard backend {backend!r}; expected one of "
                         f"{list(BACKENDS)}")
    path = Path(logdir)
    if backend in (None, "tensorboardX"):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            if backend == "tensorboardX":
                raise
        else:
            path.mkdir(parents=True, exist_ok=True)
            return _TensorboardXWriter(path, SummaryWriter)
    if backend in (None, "tensorboard"):
        try:
            writer = _EventFileWriter(path)
        except ImportError:
            if backend == "tensorboard":
                raise
        else:
            return writer
    if not _warned_noop and backend is None:
        log.warning("TensorBoard logging is off: neither tensorboardX nor tensorboard is "
                    "installed (pip install \"hdamoe-env[tb]\" or \"hdamoe-env[log]\")")
        _warned_noop = True
    return NoOpWriter(path)


def run_dir_name(method: str, seed: int, *, env_id: str = ENV_ID,
                 timestamp: str | None = None, model: str | None = None,
                 setting: str | None = None, batch: int | None = None) -> str:
    """Return the run directory name, path-safe (style.md R16, docs/TENSORBOARD.md).

    ``{env_id}__{model}__{setting}__B{batch}__{method}__{seed}__{timestamp}``; the model,
    setting and batch parts are left out when not given (``{env_id}__{method}__{seed}__{time}``).

    Args:
        method: Method name (``"hd-moe"``, ``"agent:greedy-prebroadcast"``, ...).
        seed: Episode seed.
        env_id: Environment id (namespace dropped).
        timestamp: ``YYYYmmdd-HHMMSS`` (default: now).
        model: Model preset id.
        setting: "TFLOPS/GBps" (the slash becomes ``-``).
        batch: Tokens per decode step B.
    """
    stamp = timestamp or time.strftime("%Y%m%d-%H%M%S")
    config = [p for p in (model, setting, None if batch is None else f"B{batch}") if p]
    parts = [env_id.rsplit("/", 1)[-1], *config, method, str(seed), stamp]
    return "__".join(_SAFE.sub("-", p).strip("-") or "x" for p in parts)


def config_markdown(config: dict[str, Any]) -> str:
    """Return a run's configuration as a two-column Markdown table (the ``config`` text)."""
    def cell(x: Any) -> str:
        return str(x).replace("\n", " ")

    return render_table(["key", "value"], [[cell(k), cell(v)] for k, v in config.items()],
                        style="markdown")


def read_scalars(out_dir: str | os.PathLike[str],
                 tags: Sequence[str] = ("latency/tbt_us", "rollout/ep_rew_mean")
                 ) -> dict[str, list[tuple[int, float]]]:
    """Read TensorBoard scalars of a training run (``out_dir/tb``), all runs merged by step.

    Returns:
        ``{tag: [(step, value), ...]}`` sorted by step (tags without data are omitted).

    Raises:
        DependencyNotInstalled: The tensorboard package is missing.
    """
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as exc:
        raise DependencyNotInstalled('reading TensorBoard logs needs tensorboard; run '
                                     '`pip install "hdamoe-env[log]"`') from exc
    out: dict[str, dict[int, float]] = {}
    for events in sorted((Path(out_dir) / "tb").rglob("events.out.tfevents*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in tags:
            if tag in acc.Tags().get("scalars", []):
                out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return {tag: sorted(values.items()) for tag, values in out.items()}
