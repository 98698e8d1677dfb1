"""Tests of baselines.pool: pool workers die with their parent (``kill -9`` or Ctrl-C)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("pulp")


_POOL_SCRIPT = '''
import os, signal, sys, time
# a test run started in the background inherits SIGINT ignored: Ctrl-C must work here
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {root!r})
from baselines.pool import spawn_pool_map

def slow(i, folder):
    open(os.path.join(folder, f"worker_{{os.getpid()}}"), "w").close()
    time.sleep(120)
    return i

if __name__ == "__main__":
    spawn_pool_map(slow, [(i, sys.argv[1]) for i in range(4)], 2, print)
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                            # a zombie is dead too
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGINT"])
def test_pool_workers_die_with_their_parent(tmp_path, sig):
    """`kill -9` (or Ctrl-C) of the parent leaves no pool worker behind."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    script = tmp_path / "pool.py"
    script.write_text(_POOL_SCRIPT.format(root=root))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("worker_*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = [int(p.name.split("_")[1]) for p in tmp_path.glob("worker_*")]
        assert len(workers) == 2
        proc.send_signal(getattr(signal, sig))
        if sig == "SIGINT":
            proc.wait(timeout=15)                  # stops within seconds
        deadline = time.monotonic() + 8
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(w) for w in workers)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


_FAIL_SCRIPT = '''
import errno, os, signal, sys, time
# a test run started in the background inherits SIGINT ignored: Ctrl-C must work here
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {root!r})
from baselines.pool import spawn_pool_map

def work(i, folder):
    open(os.path.join(folder, f"worker_{{os.getpid()}}_{{i}}"), "w").close()
    time.sleep(0.1 if i == 0 else 120)
    return i

def done(result):
    print("failing", flush=True)
    if sys.argv[2] == "ENOSPC":       # the cache write of a finished result on a full disk
        raise OSError(errno.ENOSPC, "No space left on device")
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)

if __name__ == "__main__":
    spawn_pool_map(work, [(i, sys.argv[1]) for i in range(6)], 2, done)
'''


@pytest.mark.parametrize("fault", ["ENOSPC", "SIGINT"])
def test_pool_exits_within_5_s_of_an_error_or_interrupt(tmp_path, fault):
    """A failing result callback (full disk) or Ctrl-C: the process exits within 5 s, with no
    InvalidStateError from the pool's manager thread, and leaves no worker behind."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    script = tmp_path / "fail.py"
    script.write_text(_FAIL_SCRIPT.format(root=root))
    folder = tmp_path / "w"
    folder.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), str(folder), fault],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "failing"       # blocks until the fault
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert elapsed < 5.0, f"exit took {elapsed:.1f} s"
    assert "InvalidStateError" not in err
    assert ("No space left" in err) if fault == "ENOSPC" else ("KeyboardInterrupt" in err)
    workers = {int(p.name.split("_")[1]) for p in folder.glob("worker_*")}
    time.sleep(0.5)
    assert workers and not any(_alive(w) for w in workers)


def _square(x: int) -> int:
    return x * x


def test_ray_pool_map_without_ray_says_how_to_get_it(monkeypatch):
    import sys

    from baselines.pool import ray_pool_map
    from hdamoe_env.config.errors import DependencyNotInstalled

    monkeypatch.setitem(sys.modules, "ray", None)          # import ray -> ImportError
    with pytest.raises(DependencyNotInstalled, match=r"needs Ray .*\[ray\]"):
        ray_pool_map(_square, [(1,), (2,)], 1)


@pytest.mark.slow
def test_ray_pool_map_returns_call_order_and_reports_each_result():
    pytest.importorskip("ray")
    from baselines.pool import ray_pool_map

    seen: list[int] = []
    out = ray_pool_map(_square, [(k,) for k in range(5)], 2, seen.append)
    assert out == [0, 1, 4, 9, 16] and sorted(seen) == out
