"""The one process pool: spawn workers that exit with their parent.

:func:`spawn_pool_map` runs calls in a ``spawn`` ``ProcessPoolExecutor`` and hands each result
to a callback in completion order; an error or Ctrl-C cancels what has not started and stops
the running workers. It runs the layers of ``baselines.pipeline.run_pipeline`` and the cells of
``hdamoe reproduce``. :func:`ray_pool_map` is its Ray counterpart (one task per call on a local
instance or a cluster), used by ``hdamoe reproduce --backend ray`` and
``benchmarks/learned_matrix.py --backend ray``.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from hdamoe_env.config.errors import DependencyNotInstalled

__all__ = ["ray_pool_map", "spawn_pool_map"]

#: How to get Ray when it is missing (the ``ray`` extra).
RAY_HINT = ("backend='ray' needs Ray (`pip install -c constraints.txt -e '.[ray]'`); or use "
            "backend='process' (--workers N)")


def ray_pool_map(fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], workers: int,
                 done: Callable[[Any], None] | None = None, *, ray_address: str | None = None,
                 log_to_driver: bool = False) -> list[Any]:
    """Run ``fn(*call)`` as one Ray task per call; return the results in call order.

    Starts a local Ray instance of ``workers`` CPUs (or connects to ``ray_address``) unless one
    is running, and shuts down only an instance it started. ``done`` gets each result in
    completion order (resumable callers write it at once).

    Raises:
        DependencyNotInstalled: Ray is not installed (the message says how to get it).
    """
    try:
        import ray
    except ImportError as exc:
        raise DependencyNotInstalled(RAY_HINT) from exc
    started = False
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": log_to_driver,
                                  "ignore_reinit_error": True}
        if ray_address:
            kwargs["address"] = ray_address
        else:
            kwargs["num_cpus"] = max(1, workers)
        ray.init(**kwargs)
        started = True
    try:
        remote = ray.remote(num_cpus=1)(fn)
        refs = [remote.remote(*call) for call in calls]
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            result = ray.get(ready[0])
            results[index[ready[0]]] = result
            if done is not None:
                done(result)
        return results
    finally:
        if started:
            ray.shutdown()


def spawn_pool_map(fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], workers: int,
                   done: Callable[[Any], None]) -> None:
    """Run ``fn(*args)`` for every ``args`` in ``calls`` in a spawn process pool.

    ``done`` gets each result in completion order; on an error or interruption the calls not
    started yet are cancelled, the running workers are terminated (within seconds) and the
    exception propagates. Workers exit by themselves when the parent dies (``kill -9``)
    (finished results were already handed to ``done``, so a resumable caller loses nothing).
    One BLAS/OpenMP thread per worker (dependencies.md §4), inherited by the children.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    ctx = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx,
                                                  initializer=_watch_parent,
                                                  initargs=(os.getpid(),))
    futures = [pool.submit(fn, *args) for args in calls]
    try:
        for fut in concurrent.futures.as_completed(futures):
            done(fut.result())
    except BaseException:
        # Ctrl-C or an error: drop the calls not started and stop the running workers now
        # (finished results were already handed to ``done``)
        _stop(pool)
        raise
    pool.shutdown(wait=True)


def _stop(pool: concurrent.futures.ProcessPoolExecutor, timeout_s: float = 5.0) -> None:
    """Stop a pool at once without ever waiting on a cancelled future.

    The pool's own manager thread cancels the calls not started (``cancel_futures``) and drops
    them from its table *before* the workers are terminated: a future cancelled from outside
    would stay in that table, and on Python 3.11 the manager thread then fails with
    ``InvalidStateError`` when it marks the table broken, after which the interpreter can wait
    for it forever at exit. The manager thread is joined with a timeout and, if it is still
    alive, forgotten by ``concurrent.futures``' exit hook, so the process always exits.
    """
    # shutdown() forgets the workers and the manager thread: take them first
    procs = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)
    pending = getattr(pool, "_pending_work_items", None) or {}
    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + 0.5          # let the manager drop the cancelled calls
    while manager is not None and time.monotonic() < deadline and any(
            not item.future.running() and not item.future.done()
            for item in list(pending.values())):
        time.sleep(0.01)
    _terminate_workers(procs)
    if manager is not None:
        manager.join(timeout_s)
        if manager.is_alive():
            from concurrent.futures import process

            getattr(process, "_threads_wakeups", {}).pop(manager, None)


def _terminate_workers(procs: Sequence[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()


def _watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Pool-worker initializer: exit as soon as the parent process is gone.

    On Linux the kernel sends SIGKILL when the parent dies (``PR_SET_PDEATHSIG``); everywhere a
    daemon thread polls ``os.getppid()`` as well, so a ``kill -9`` of the parent never leaves
    workers blocked on their pipes.
    """
    import signal
    import sys
    import threading

    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)      # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:                            # died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="hdamoe-parent-watch", daemon=True).start()
