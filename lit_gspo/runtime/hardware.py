"""What the CPU can do fast (bf16 autocast only pays on CPUs with native bf16 matmuls), and reproducible CPU runs.

On a CPU with AMX (Sapphire Rapids and later) or AVX512-BF16, oneDNN runs bf16 matmuls several times
faster than fp32 (README: 444 vs 92 GFLOP/s). Without them bf16 is emulated and *slower* than fp32
(an AVX-512 Ice Lake: 23 vs 71 GFLOP/s for a 2048² matmul on 2 threads), so ``bf16-mixed`` on such
a CPU costs time instead of saving it.
"""

from __future__ import annotations

import platform
import subprocess
from collections.abc import Iterable

import torch

#: The CPU flags (named as in /proc/cpuinfo) of the instructions oneDNN's fast bf16 matmuls use.
NATIVE_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` prints it (benchmarks name the CPU beside every timing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def deterministic_on_cpu(device_type: str) -> None:
    """On ``device_type`` "cpu", switch on ``torch.use_deterministic_algorithms`` (``warn_only``): same seed, same bits.

    Without it the backward through a transformers MoE block is not reproducible on more than one thread (which op
    was not pinned down): a Qwen3-MoE with 16 experts and top-4 on 2 threads gave a different gradient for every
    layer below its last MoE block on each of three identical backward passes, so two runs of one seed started RL
    from different warm-started weights. The deterministic kernels gave the single-thread gradient on 2 threads
    too, at no measured cost (0.42 vs 0.46 s per 10 forward-backward passes). GPUs are left alone: there the
    deterministic kernels cost speed, and ``Trainer(deterministic=True)`` is the choice to make.
    """
    if device_type == "cpu" and not torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(True, warn_only=True)


class SlowPrecisionWarning(UserWarning):
    """The chosen precision is slower than fp32 on this hardware."""


def cpu_flags() -> frozenset[str]:
    """This CPU's ``NATIVE_BF16_FLAGS`` as torch detects them (CPUID, and for AMX the OS's support too).

    torch probes AMX tiles; every AMX CPU so far has AMX-BF16 with them.
    """
    probes = {"amx_bf16": torch.cpu._is_amx_tile_supported, "avx512_bf16": torch.cpu._is_avx512_bf16_supported}
    return frozenset(flag for flag, probe in probes.items() if probe())


def cpu_has_native_bf16(flags: Iterable[str] | None = None) -> bool:
    """True when the CPU has AMX-BF16 or AVX512-BF16; ``flags``: a CPU's flags as in /proc/cpuinfo (default: this one)."""
    return bool(NATIVE_BF16_FLAGS & set(cpu_flags() if flags is None else flags))


def bf16_on_cpu_warning(precision, device_type: str, flags: Iterable[str] | None = None) -> str | None:
    """The advice to give when ``precision`` asks for bf16 on a ``device_type`` "cpu" without native bf16, else None.

    ``flags``: the CPU's flags as in /proc/cpuinfo (default: this CPU's).
    """
    if not (str(precision).startswith("bf16") and device_type == "cpu") or cpu_has_native_bf16(flags):
        return None
    return (
        f"precision={precision!r} on a CPU without native bf16 matmuls (no AMX, no AVX512-BF16): bf16 "
        "is emulated here and runs slower than fp32 (about 3x on an AVX-512 Ice Lake). Pass "
        "`--trainer.precision 32-true` for speed; log-probs and ratios are fp32 either way."
    )


#: ``--trainer.precision auto``: resolved at start by :func:`resolve_auto_precision`.
AUTO = "auto"


def resolve_auto_precision(
    device_type: str, flags: Iterable[str] | None = None, cuda_bf16: bool | None = None
) -> tuple[str, str]:
    """What ``precision: auto`` means on ``device_type`` ("cuda", "cpu", ...): ``bf16-mixed`` where bf16 matmuls are
    native (a CUDA GPU that supports bf16, a CPU with AMX-BF16 or AVX512-BF16), ``32-true`` elsewhere (bf16 emulated
    on a CPU is slower than fp32: about 3x on an AVX-512 Ice Lake). Returns (precision, the one line that says why).

    ``flags``: the CPU's flags as in /proc/cpuinfo (default: this CPU's); ``cuda_bf16``: whether the GPU supports bf16
    (default: ``torch.cuda.is_bf16_supported()``).
    """
    if device_type == "cuda":
        native = torch.cuda.is_bf16_supported() if cuda_bf16 is None else cuda_bf16
        why = "this GPU supports bf16" if native else "this GPU has no bf16"
    elif device_type == "cpu":
        found = sorted(NATIVE_BF16_FLAGS & set(cpu_flags() if flags is None else flags))
        native = bool(found)
        why = (
            f"this CPU has {'/'.join(found)}"
            if native
            else "this CPU has no native bf16 (no AMX, no AVX512-BF16): bf16 would be emulated, slower than fp32"
        )
    else:
        native, why = False, f"bf16 is not known to be native on {device_type}"
    precision = "bf16-mixed" if native else "32-true"
    return precision, f"precision auto → {precision} ({why})"


def cuda_matmul_flops(dtype=None) -> float:
    """FLOP/s of an 8192³ matmul on the current GPU (bf16 by default): the mean of 10 after 3 warm-ups.
    The peak the benchmarks' MFU figures divide by."""
    import torch

    dtype = dtype or torch.bfloat16
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (start.elapsed_time(end) / 1e3)
