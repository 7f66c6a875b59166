"""benchmarks/device_check.py's runner: parts side by side where they time nothing, and a part that outruns its limit
ended with every process it started (a test's fit left on the GPU would slow the parts after it)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import device_check  # noqa: E402


def part(name, limit, code, group=None):
    return dict(name=name, limit=limit, group=group, cmd=[sys.executable, "-c", code])


def test_the_gpu_parts_fit_eight_minutes_and_only_the_untimed_checks_share_the_device(tmp_path):
    groups = device_check.groups([p for p in device_check.parts(dry_run=False, out=tmp_path) if not p.get("extra")])
    assert [[p["name"] for p in g] for g in groups] == [["cuda tests", "cuda fits", "correctness"], ["vs TRL 8x8x256"]]
    assert sum(max(p["limit"] for p in g) for g in groups) <= 480  # the 8 minutes


def test_every_part_writes_its_own_log_and_the_sampler_parts_read_their_own_results(tmp_path):
    """Two parts once shared a log (``vs TRL 8x8x256`` and ``vs TRL 16x8x256`` both wrote ``vs.log``)."""
    import json

    names = [p["name"] for p in device_check.parts(dry_run=False, out=tmp_path)]
    assert len({device_check.log_name(name) for name in names}) == len(names)
    for name, file, rate in (
        ("sampler", "sampler_speed.json", 12000),
        ("sampler sdpa decode", "sampler_sdpa.json", 9000),
    ):
        (tmp_path / file).write_text(json.dumps(dict(engines={"StaticCacheSampler": dict(tok_s=rate)})))
        assert device_check.summary(name, "", tmp_path) == f"StaticCacheSampler: {rate} tok/s"


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups")
def test_a_part_past_its_limit_ends_with_the_processes_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    spawner = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    start = time.perf_counter()
    running = device_check.start(part("slow one", 3, spawner), tmp_path)
    row = device_check.finish(running, tmp_path)
    assert row["rc"] == "time-out 3 s" and time.perf_counter() - start < 20
    assert "started" in Path(row["log"]).read_text()  # streamed while it ran, kept after the kill
    child = int(pid_file.read_text())
    for _ in range(50):  # the kill is sent; the child's exit is reaped by init
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{child}/stat").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the part's child {child} outlived its time-out")


def test_parts_of_one_group_run_side_by_side(tmp_path):
    both = [part(f"p{i}", 30, "import time; time.sleep(2)", group="checks") for i in range(2)]
    start = time.perf_counter()
    rows = [device_check.finish(r, tmp_path) for r in [device_check.start(p, tmp_path) for p in both]]
    assert [r["rc"] for r in rows] == [0, 0] and time.perf_counter() - start < 3.8


def test_a_side_that_runs_out_of_memory_is_named_with_its_error():
    """vs_trl.py at 32 × 8 × 256 in 80 GB: a side that fails is a row of the table with the line that says why."""
    import json

    import vs_trl

    stderr = "Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    assert vs_trl.failure_line(stderr, 1).startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert vs_trl.failure_line("", -9) == "exit code -9"
    lit = dict(sec_per_update=2.0, update_phase_s=0.5, mfu=0.2, peak_gpu_mb=60 * 1024)
    output = "JSON " + json.dumps(dict(lit=lit, failed={"trl": "torch.OutOfMemoryError: CUDA out of memory."}))
    line = device_check.summary("vs TRL 32x8x256 in 80 GB", output, Path("."))
    assert "no ratio" in line and "lit 2.00 s/update" in line and "trl FAILED: torch.OutOfMemoryError" in line


def test_named_parts_run_in_the_order_given_and_an_unknown_name_lists_the_parts(tmp_path, monkeypatch, capsys):
    """The warm-window call names the parts that matter most first: should its time run out, they have run."""
    ran = []
    monkeypatch.setattr(device_check, "start", lambda part, out: ran.append(part["name"]) or part)
    monkeypatch.setattr(
        device_check, "finish", lambda part, out: dict(part=part["name"], rc=0, seconds=0.0, result="", log="")
    )
    device_check.main(["--out", str(tmp_path), "--only", "lit compiled 8x8x256, vs TRL 16x8x256"])
    assert ran == ["lit compiled 8x8x256", "vs TRL 16x8x256"]
    with pytest.raises(SystemExit):
        device_check.main(["--out", str(tmp_path), "--only", "lit compiled"])
    assert "no part named 'lit compiled'; the parts: 'cuda tests'" in capsys.readouterr().err


def test_a_part_cut_off_by_its_limit_keeps_the_side_vs_trl_measured_before(tmp_path):
    """On the H100 the lit side of ``vs TRL 8x8x256`` had measured its cycles when the part's limit ended the run
    during TRL's turn, and its row said only "no ratio": the SIDE line it prints as each side ends is the row now."""
    import json

    lit = dict(sec_per_update=1.5, update_phase_s=0.36, mfu=0.12, peak_gpu_mb=20 * 1024, rollout_tok_s=18000.0)
    output = "round 1 lit: cycles [9.0, 2.1, 2.0] s\nSIDE " + json.dumps(dict(lit=lit)) + "\n"
    line = device_check.summary("vs TRL 8x8x256", output, tmp_path)
    assert (
        line == "no ratio; lit 1.50 s/update, rollout 18000 tok/s, update phase 0.36 s (MFU 12.0 %), peak GPU 20.0 GiB"
    )


def test_a_parts_log_stamps_each_line_with_the_seconds_since_it_started(tmp_path):
    code = "import time; print('first', flush=True); time.sleep(1.2); print('second', flush=True)"
    row = device_check.finish(device_check.start(part("stamped", 30, code), tmp_path), tmp_path)
    stamps = {
        line.split("] ")[1]: float(line[1:].split(" s]")[0]) for line in Path(row["log"]).read_text().splitlines()
    }
    assert row["rc"] == 0 and stamps["first"] < 1.0 <= stamps["second"] - stamps["first"]


def test_a_worker_that_hangs_after_its_result_is_ended_and_its_result_kept():
    """vs_trl.py's driver gives a worker ``exit_grace_s`` to exit once it has printed its result: a hang at exit
    must not cost the other side its turn within the part's limit."""
    import vs_trl

    code = (
        "import time\n"
        "print('PHASE loaded at 0.1 s', flush=True)\n"
        "print('RESULT {\"cycle_s\": [1.0]}', flush=True)\n"
        "time.sleep(60)\n"
    )
    start = time.perf_counter()
    returncode, stdout, _ = vs_trl.run_worker([sys.executable, "-c", code], dict(os.environ), "lit", exit_grace_s=1)
    assert returncode == vs_trl.EXIT_HUNG and time.perf_counter() - start < 10
    assert 'RESULT {"cycle_s": [1.0]}' in stdout
    returncode, stdout, stderr = vs_trl.run_worker(
        [sys.executable, "-c", "import sys; sys.exit(3)"], dict(os.environ), "trl"
    )
    assert returncode == 3 and stdout == ""


def test_the_two_cuda_parts_run_every_cuda_test_once(tmp_path):
    """The cuda tests run in two parts side by side: one selects the fits, the other exactly what that does not select
    (pytest's ``not (...)``), so every test runs once; the fits' selection picks the fits that compile the step."""
    import subprocess

    parts = {p["name"]: p for p in device_check.parts(dry_run=False, out=tmp_path)}
    tests, fits = parts["cuda tests"]["cmd"], parts["cuda fits"]["cmd"]
    selection = fits[fits.index("-k") + 1]
    assert tests[tests.index("-k") + 1] == f"not ({selection})"
    assert [a for a in tests if a != f"not ({selection})"] == [a for a in fits if a != selection]
    cmd = [*fits[:-1], "tests/test_cuda.py", "-q"]  # every cuda test is in tests/test_cuda.py
    cmd[cmd.index("-v")] = "--collect-only"
    env = dict(os.environ, LIT_GSPO_CUDA_TESTS_ON="cpu")
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=device_check.ROOT, env=env).stdout
    picked = [line.split("::")[1] for line in out.splitlines() if "::" in line]
    assert len(picked) == 4 and all("fit" in name and "AdamW8bit" not in name for name in picked), picked
