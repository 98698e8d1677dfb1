"""Tests of benchmarks.docs_examples: every example of README.md and docs/*.md is checked.

Default suite: every ``hdamoe …`` command in the docs parses with ``hdamoe``'s own parser,
every console block with output says whether it is regenerated (``run``) or recorded
(``static``), every python block compiles. Slow: the python blocks run and the ``run``
outputs are not stale (``make docs`` regenerates them).
"""

from __future__ import annotations

import pytest

from benchmarks import docs_examples as de

EXAMPLES = [ex for path in de.doc_files() for ex in de.find_examples(path)]
PYTHON = [ex for ex in EXAMPLES if ex.kind == "python"]
RUN = [ex for ex in EXAMPLES if ex.kind == "console" and "run" in ex.options]


def test_examples_are_found():
    kinds = {ex.kind for ex in EXAMPLES}
    assert {"python", "console", "sketch"} <= kinds
    assert any("simulate" in ex.code[0] for ex in RUN)


def test_every_command_parses_and_every_output_is_accounted_for():
    assert de.check_commands(EXAMPLES) == []


def test_a_renamed_flag_is_caught(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("```\nhdamoe bench --no-such-flag 1\n```\n\n```\n$ hdamoe bench-sim\nout\n```\n")
    problems = de.check_commands(de.find_examples(doc))
    assert len(problems) == 2
    assert "--no-such-flag" in problems[0] and "example: run" in problems[1]


def test_abridge_and_mask():
    ex = de.Example(de.ROOT / "README.md", 0, 0, "console", ["hdamoe bench-sim"],
                    output=["a", "speed 1.0", "b"], options={"mask": "speed"})
    assert not de.stale(ex, ["a", "speed 2.0", "b"])
    assert de.stale(ex, ["a", "speed 2.0", "c"])
    assert de._abridge(list("abcdef"), {"head": "2", "tail": "1"}) == ["a", "b", de.ABRIDGED, "f"]


@pytest.mark.parametrize("ex", PYTHON, ids=[ex.where for ex in PYTHON])
def test_python_examples_compile(ex):
    compile("\n".join(ex.code), ex.where, "exec")


@pytest.mark.slow
@pytest.mark.parametrize("ex", [ex for ex in PYTHON if "static" not in ex.options],
                         ids=lambda ex: ex.where)
def test_python_examples_run(ex):
    de.run_python(ex)


@pytest.mark.slow
@pytest.mark.parametrize("ex", [ex for ex in RUN if "slow" not in ex.options],
                         ids=lambda ex: ex.where)
def test_run_examples_are_not_stale(ex):
    assert not de.stale(ex, de.regenerate(ex)), f"{ex.where}: stale output; run `make docs`"
