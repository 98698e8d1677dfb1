"""The one progress helper (hdamoe_env/app/progress.py): plain lines off a terminal."""

from __future__ import annotations

import io

from hdamoe_env.app import progress


class _Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_off_a_terminal_one_plain_line_per_stage(monkeypatch):
    err = _Pipe()
    monkeypatch.setattr("sys.stderr", err)
    b = progress.bar(3, "layers", unit="layer")
    for _ in range(3):
        b.update(1)
    b.set_postfix_str("12 steps/s")
    b.close()
    b.close()                                            # idempotent
    list(progress.wrap(range(2), 2, "bench env steps"))
    lines = err.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in err.getvalue()
    assert lines[0].startswith("layers: 3/3 layer in ") and lines[0].endswith(", 12 steps/s")
    assert lines[1].startswith("bench env steps: 2/2 it in ")


def test_long_stage_prints_interval_lines(monkeypatch):
    err = _Pipe()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr(progress, "LINE_INTERVAL_S", 0.0)
    b = progress.bar(None, "placement")
    b.update(1)
    b.close()
    lines = err.getvalue().splitlines()
    assert lines[0].startswith("placement: 1 it in ") and lines[0].endswith("(running)")
    assert len(lines) == 2


def test_disabled_and_quiet_print_nothing(monkeypatch):
    err = _Pipe()
    monkeypatch.setattr("sys.stderr", err)
    progress.bar(2, "x", enabled=False).close()
    progress.set_quiet(True)
    try:
        progress.bar(2, "y").close()
        progress.stage("z").close()
    finally:
        progress.set_quiet(False)
    assert err.getvalue() == ""
