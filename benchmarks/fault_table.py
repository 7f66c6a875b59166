"""Run the fault and bad-input test cases and write docs/faults.md: each case tried → its outcome, with counts.

    python benchmarks/fault_table.py                    # the in-process and 2-process cases (a few minutes)
    python benchmarks/fault_table.py --faults           # also the subprocess fault injection (signals, SIGKILLs, a
                                                        # hung rank; tests/test_faults.py, several minutes more)
    python benchmarks/fault_table.py --out docs/faults.md

The table comes from running them: pytest writes a JUnit XML report, and each test case (each parameter of a
parametrised one) becomes a row with its result. A case's *expected outcome* is read from its test's source: a test
that expects an error (``pytest.raises``, a non-zero exit code) checks a **clear error** (its message is asserted
too); the others check **correct handling** (the run goes on, resumes exactly, keeps or writes the right files; a
signalled run that saves, exits 130/143 and resumes counts here).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (area, test file, ``-k`` expression or None for the whole file)
AREAS = [
    ("Config validated at start", "tests/test_validation.py", None),
    ("Bad data files and small clear errors", "tests/test_data_errors.py", None),
    ("Non-finite values (loss, gradient, inputs)", "tests/test_learner.py", "non_finite"),
    ("Non-finite values (loss, gradient, inputs)", "tests/test_objectives.py", "non_finite"),
    ("Checkpoint integrity", "tests/test_checkpoint_integrity.py", None),
    ("Safe ends: signals, exports, run lock, metrics rows", "tests/test_safe_ends.py", None),
    ("Liveness: stuck and failing rewards", "tests/test_liveness.py", None),
    ("Liveness: stuck and failing rewards", "tests/test_distributed.py", "failing_on_every_rank"),
    ("Subprocess faults: SIGTERM/SIGINT, SIGKILLs, a hung DDP rank", "tests/test_faults.py", None),
]
#: a test expects an error when it expects an exception (not one the test injects itself: an interrupt, a full disk)
#: or a failed subprocess; a signalled run that saves, exits 130/143 and is resumed (``ckpt_path``) is correct handling
EXPECTS_ERROR = re.compile(r"pytest\.raises\((?!RunInterrupted|OSError|KeyboardInterrupt)|returncode != 0")
#: tests whose expected exception is the fault they inject, not the outcome they check
CORRECT_HANDLING = {
    "test_the_lock_is_released_when_a_fit_fails",
    "test_a_lock_file_of_a_dead_process_is_taken_over",
    "test_stale_temporaries_of_dead_writers_are_removed_at_start_live_ones_kept",
}


def expects_error(path: Path) -> dict[str, bool]:
    """test name → whether its body expects an error."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            body = ast.get_source_segment(path.read_text(), node) or ""
            resumed = "SystemExit" in body and "ckpt_path" in body
            out[node.name] = bool(EXPECTS_ERROR.search(body)) and not resumed and node.name not in CORRECT_HANDLING
    return out


def run(files: list[str], selection: str | None, faults: bool, report: Path) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *files]
    if selection:
        cmd += ["-k", selection]
    if faults:
        cmd += ["--faults"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
    }
    subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def results(report: Path) -> list[tuple[str, str, str]]:
    """(file stem, case name, result) for each test case of a JUnit XML report."""
    out = []
    for case in ET.parse(report).getroot().iter("testcase"):
        result = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                result = "FAILED"
            elif child.tag == "skipped":
                result = "skipped" + (" (needs --faults)" if "--faults" in (child.get("message") or "") else "")
        out.append((case.get("classname", "").rsplit(".", 1)[-1], case.get("name", ""), result))
    return out


def describe(name: str) -> str:
    """``test_an_empty_checkpoint_is_reported[x]`` → ``an empty checkpoint is reported [x]``."""
    base, _, param = name.partition("[")
    text = base.removeprefix("test_").replace("_", " ")
    return (text + (f" [{param.rstrip(']')}]" if param else "")).replace("\\", "").replace("|", "\\|")


def table(rows: list[tuple[str, str, str, str]], seconds: float, faults: bool) -> str:
    kinds = {"clear error": 0, "correct handling": 0}
    by_result: dict[str, int] = {}
    for _, _, kind, result in rows:
        kinds[kind] += 1
        by_result[result.split(" ")[0]] = by_result.get(result.split(" ")[0], 0) + 1
    areas: dict[str, list[int]] = {}
    for area, _, kind, result in rows:
        a = areas.setdefault(area, [0, 0, 0, 0])  # cases, clear errors, correct handling, passed
        a[0] += 1
        a[1 if kind == "clear error" else 2] += 1
        a[3] += result == "passed"
    lines = [
        "# Faults and bad inputs: the cases tried and their outcome",
        "",
        "Generated by `python benchmarks/fault_table.py" + (" --faults" if faults else "") + "` (do not edit by hand): "
        "it runs the fault and bad-input test cases and writes this page from their results "
        f"({time.strftime('%Y-%m-%d')}, {seconds:.0f} s). **Clear error**: the case must fail at once with a message "
        "that names the problem and what is valid (the message is asserted); **correct handling**: the run must go on, "
        "resume exactly, or keep the last good state.",
        "",
        f"**{len(rows)} cases: {kinds['clear error']} clear errors, {kinds['correct handling']} correct handling; "
        + ", ".join(f"{n} {r}" for r, n in sorted(by_result.items()))
        + ".**",
        "",
        "| area | cases | clear error | correct handling | passed |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {area} | {n} | {e} | {h} | {p} |" for area, (n, e, h, p) in areas.items()]
    lines += ["", "| area | case | outcome checked | result | test |", "|---|---|---|---|---|"]
    lines += [
        f"| {area} | {describe(test.split('::')[-1])} | {kind} | {result} | `{test.split('[')[0]}` |"
        for area, test, kind, result in rows
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs/faults.md")
    parser.add_argument("--faults", action="store_true", help="also run the subprocess fault injection (minutes)")
    args = parser.parse_args()
    start = time.monotonic()
    rows, seen = [], set()
    with tempfile.TemporaryDirectory() as tmp:
        for i, (area, file, selection) in enumerate(AREAS):
            report = Path(tmp) / f"{i}.xml"
            print(f"running {file}{' -k ' + selection if selection else ''}", flush=True)
            run([file], selection, args.faults, report)
            errors = expects_error(ROOT / file)
            for _stem, name, result in results(report):
                test = f"{file}::{name}"
                if test in seen:
                    continue
                seen.add(test)
                kind = "clear error" if errors.get(re.sub(r"\[.*", "", name)) else "correct handling"
                rows.append((area, test, kind, result))
    text = table(rows, time.monotonic() - start, args.faults)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text.split("\n\n")[2])
    print(f"wrote {args.out}")
    if any(r[3] == "FAILED" for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
