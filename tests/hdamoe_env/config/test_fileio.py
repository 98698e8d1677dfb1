"""Tests of hdamoe_env.config.fileio: atomic writes, JSON of numpy values, output-path checks.

``atomic_write`` creates missing parents, writes bytes exactly, leaves no temporary file behind,
keeps the old content when the writer fails and gives the file the umask's permissions;
``write_json`` converts numpy values; ``check_output_dir`` / ``check_output_file`` refuse unusable
paths before any work, without creating anything.
"""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest

from hdamoe_env.config.errors import OutputPathError
from hdamoe_env.config.fileio import (
    apply_umask,
    atomic_write,
    check_output_dir,
    check_output_file,
    json_default,
    write_json,
)

needs_non_root = pytest.mark.skipif(os.geteuid() == 0,
                                    reason="root may write into read-only directories")


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_atomic_write_creates_parents_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "a" / "b" / "out.txt"
    assert atomic_write(path, lambda fh: fh.write("one\r\ntwo\n")) == path
    assert path.read_bytes() == b"one\r\ntwo\n"                # no newline translation
    assert os.listdir(path.parent) == ["out.txt"]
    binary = tmp_path / "raw.bin"
    atomic_write(binary, lambda fh: fh.write(bytes(range(256))), mode="wb")
    assert binary.read_bytes() == bytes(range(256))


def test_a_failing_writer_keeps_the_old_content(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")

    def fail(fh):
        fh.write("half of the new")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        atomic_write(path, fail)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.txt"]                  # the temporary file is gone


def test_written_files_follow_the_umask(tmp_path, umask_027):
    path = atomic_write(tmp_path / "out.txt", lambda fh: fh.write("x"))
    assert _mode(path) == 0o640                                 # not mkstemp's 0600
    other = tmp_path / "plain"
    other.write_text("y")
    os.chmod(other, 0o600)
    apply_umask(other, 0o777)
    assert _mode(other) == 0o750


def test_atomic_write_refuses_a_directory_and_a_file_parent(tmp_path):
    with pytest.raises(OutputPathError, match="it is a directory"):
        atomic_write(tmp_path, lambda fh: fh.write("x"))
    blocker = tmp_path / "blocker"
    blocker.write_text("keep")
    with pytest.raises(OutputPathError, match="a parent is a file"):
        atomic_write(blocker / "out.txt", lambda fh: fh.write("x"))
    assert blocker.read_text() == "keep"


def test_write_json_converts_numpy_values(tmp_path):
    data = {"b": np.arange(3), "a": np.int64(2), "c": np.float32(0.5), "d": np.bool_(True),
            "e": [np.int16(-1)]}
    path = write_json(tmp_path / "out.json", data, sort_keys=True)
    text = path.read_text()
    assert json.loads(text) == {"a": 2, "b": [0, 1, 2], "c": 0.5, "d": True, "e": [-1]}
    assert text.endswith("}\n") and text.splitlines()[1] == ' "a": 2,'   # indent 1, sorted
    assert list(json.loads(write_json(tmp_path / "o2.json", data).read_text())) == list(data)


def test_unknown_values_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(TypeError, match="not JSON-serialisable: set"):
        json_default({1, 2})
    with pytest.raises(TypeError, match="not JSON-serialisable: object"):
        write_json(tmp_path / "out.json", {"x": object()})
    assert not (tmp_path / "out.json").exists()


def test_check_output_dir(tmp_path):
    new = tmp_path / "runs" / "one"
    assert check_output_dir(new) == new and not (tmp_path / "runs").exists()   # not created
    assert check_output_dir(tmp_path) == tmp_path
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    with pytest.raises(OutputPathError, match="output directory .* is a file; expected a dir"):
        check_output_dir(blocker)
    with pytest.raises(OutputPathError, match="is a file, not a directory"):
        check_output_dir(blocker / "sub", "placement directory")


def test_check_output_file(tmp_path):
    target = tmp_path / "new" / "out.json"
    assert check_output_file(target) == target and not target.parent.exists()
    with pytest.raises(OutputPathError, match="does not exist"):
        check_output_file(target, parent_must_exist=True)
    with pytest.raises(OutputPathError, match="is a directory; expected a file path"):
        check_output_file(tmp_path, "--json")
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    assert check_output_file(blocker) == blocker               # an existing file may be replaced
    with pytest.raises(OutputPathError, match="is a file, not a directory"):
        check_output_file(blocker / "out.json")


@needs_non_root
def test_unwritable_directories_are_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    try:
        with pytest.raises(OutputPathError, match="not writable"):
            check_output_dir(locked)
        with pytest.raises(OutputPathError, match="not writable"):
            check_output_file(locked / "out.json")
    finally:
        os.chmod(locked, 0o700)


# ---------------------------------------------------------------------------- output_lock
def test_second_writer_is_refused_naming_the_first(tmp_path):
    import subprocess
    import sys
    import time

    from hdamoe_env.config.errors import LockedError
    from hdamoe_env.config.fileio import lock_path, output_lock

    out = tmp_path / "run"
    code = ("import sys, time; from hdamoe_env.config.fileio import output_lock\n"
            f"with output_lock([({str(out)!r}, 'dir')], 'hdamoe train --out run'):\n"
            "    print('locked', flush=True); time.sleep(30)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(LockedError) as err:
            with output_lock([(out, "dir")], "second"):
                pass
        text = str(err.value)
        assert f"pid {holder.pid}" in text and "hdamoe train --out run" in text
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.05)
    with output_lock([(out, "dir"), (tmp_path / "o.json", "file")], "third"):
        assert lock_path(out, "dir").exists()
    assert not lock_path(out, "dir").exists() and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
