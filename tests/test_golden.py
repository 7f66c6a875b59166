"""The trainer's numbers do not move under a refactor: six fits reproduce their recorded values bit for bit.

Each fit (``tests/golden/runs.py``) runs 40 RL steps in a fresh process pinned to one thread and to
code paths that gave the same bits on the CPUs of one vendor (ATen's AVX2 kernels, MKL's ``COMPATIBLE`` branch);
every logged ``train/*`` and ``val/*`` value and the sha256 of the saved weights must equal the ones recorded for
this CPU's vendor exactly (Intel and AMD differ by ~1e-7: runs.py says what was seen). A change that moves a
number on purpose re-records (``python tests/golden/runs.py record NAME``) and says why in its commit.
"""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "golden"))
import runs  # noqa: E402

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="golden values were recorded with AVX2 kernels; this CPU has none",
)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(runs.RUNS))
def test_fit_reproduces_its_golden_values_bit_for_bit(name):
    path = runs.golden_path(name)
    if not path.exists():
        pytest.skip(
            f"no golden run {name!r} recorded for this CPU's vendor ({runs.cpu_vendor()}; recorded for "
            f"{runs.recorded_vendors()}): python tests/golden/runs.py record {name}"
        )
    diff = runs.differences(name, runs.run(name))
    assert not diff, f"{len(diff)} values differ from {path.relative_to(runs.ROOT)}:\n" + "\n".join(diff[:30])


def test_every_vendors_recording_is_of_the_same_fits():
    """The vendors' files are recordings of the same runs: the same names, arguments and logged keys at every step
    (a run re-recorded for one vendor with other settings, or a new metric in one vendor's files only, fails)."""
    vendors = runs.recorded_vendors()
    assert vendors, "no golden runs recorded"
    for vendor in vendors:
        names = sorted(p.stem for p in (runs.HERE / vendor).glob("*.json"))
        assert set(names) <= set(runs.RUNS), (vendor, names)
        for name in names:
            got = json.loads(runs.golden_path(name, vendor).read_text())
            assert got["args"] == runs.fit_args(name, Path("RUN_DIR")), (vendor, name)
            for other in vendors:
                if other != vendor and runs.golden_path(name, other).exists():
                    want = json.loads(runs.golden_path(name, other).read_text())
                    shape = {step: sorted(values) for step, values in got["metrics"].items()}
                    assert shape == {step: sorted(values) for step, values in want["metrics"].items()}, (
                        vendor,
                        other,
                        name,
                    )


#: run in the pinned process: the CPU capability ATen dispatches to, and GEMMs at every alignment and layout
PINNED_PATHS_PROBE = """
import torch
print("aten", torch.backends.cpu.get_cpu_capability())
torch.manual_seed(0)
for m, k, n in [(37, 64, 128), (64, 777, 128), (128, 1000, 64)]:
    a, b = torch.randn(m, k), torch.randn(k, n)
    want = a @ b
    for offset in range(1, 16):  # floats: 4..60 bytes past the allocator's 64-byte alignment
        a_buf, b_buf = torch.empty(m * k + offset), torch.empty(k * n + offset)
        a_off, b_off = a_buf[offset:].view(m, k).copy_(a), b_buf[offset:].view(k, n).copy_(b)
        for x, y in ((a_off, b), (a, b_off), (a_off, b_off), (a.t().contiguous().t(), b)):
            assert torch.equal(x @ y, want), (m, k, n, offset)
print("gemm same at every alignment")
"""


def test_the_pinned_process_runs_the_code_paths_pinned():
    """The pins hold on this CPU: ATen dispatches to AVX2 and MKL reports the ``COMPATIBLE`` branch on every GEMM
    (MKL falls back to another branch, silently, where the one asked for is not offered), whose results do not
    depend on the operands' alignment or layout."""
    env = {**os.environ, **runs.PINNED_ENV, "MKL_VERBOSE": "1"}
    proc = subprocess.run([sys.executable, "-c", PINNED_PATHS_PROBE], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "aten AVX2" in out and "gemm same at every alignment" in out, out[-2000:]
    gemm_calls = [line for line in out.splitlines() if line.startswith("MKL_VERBOSE SGEMM")]
    assert gemm_calls and all("CNR:COMPATIBLE " in line for line in gemm_calls), gemm_calls[:3]
