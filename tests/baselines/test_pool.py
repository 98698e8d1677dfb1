"""Tests of baselines.pool: pool workers die with their parent (``kill -9`` or Ctrl-C)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("pulp")


_POOL_SCRIPT = '''
import os, sys, time
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
