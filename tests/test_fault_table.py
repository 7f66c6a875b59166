"""benchmarks/fault_table.py writes docs/faults.md from test results (a JUnit report), not from hand-typed rows."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import fault_table  # noqa: E402

sys.path.remove(str(ROOT / "benchmarks"))

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_x" name="test_an_empty_file_is_refused[jsonl]" time="0.1"/>
<testcase classname="tests.test_x" name="test_a_resume_is_exact" time="0.1"><failure message="boom"/></testcase>
<testcase classname="tests.test_x" name="test_a_kill_is_survived" time="0.1"><skipped message="fault injection (minutes): run with `pytest -m faults --faults`"/></testcase>
</testsuite></testsuites>"""

SOURCE = """
import pytest

def test_an_empty_file_is_refused(kind):
    with pytest.raises(ValueError, match="empty"):
        load(kind)

def test_a_resume_is_exact():
    assert resume() == straight()

def test_a_kill_is_survived():
    assert survived()
"""


def test_the_table_counts_what_ran_and_reads_each_cases_kind_from_its_test(tmp_path):
    (tmp_path / "r.xml").write_text(REPORT)
    (tmp_path / "test_x.py").write_text(SOURCE)
    kinds = fault_table.expects_error(tmp_path / "test_x.py")
    assert kinds == {
        "test_an_empty_file_is_refused": True,
        "test_a_resume_is_exact": False,
        "test_a_kill_is_survived": False,
    }
    cases = fault_table.results(tmp_path / "r.xml")
    assert [r for _, _, r in cases] == ["passed", "FAILED", "skipped (needs --faults)"]
    rows = [
        ("Data", f"tests/test_x.py::{name}", "clear error" if kinds[name.split("[")[0]] else "correct handling", result)
        for _, name, result in cases
    ]
    text = fault_table.table(rows, 1.0, faults=False)
    assert "**3 cases: 1 clear errors, 2 correct handling; 1 FAILED, 1 passed, 1 skipped.**" in text
    assert "| Data | 3 | 1 | 2 | 1 |" in text
    assert (
        "| Data | an empty file is refused [jsonl] | clear error | passed | `tests/test_x.py::test_an_empty_file_is_refused` |"
        in text
    )
