"""The trainer's numbers do not move under a refactor: six fits reproduce their recorded values bit for bit.

Each fit (``tests/golden/runs.py``) runs 40 RL steps in a fresh process pinned to one thread and to
AVX2 kernels; every logged ``train/*`` and ``val/*`` value and the sha256 of the saved weights must equal
the recorded ones exactly. A change that moves a number on purpose re-records (``python
tests/golden/runs.py record NAME``) and says why in its commit.
"""

import platform
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
    diff = runs.differences(name, runs.run(name))
    assert not diff, f"{len(diff)} values differ from tests/golden/{name}.json:\n" + "\n".join(diff[:30])
