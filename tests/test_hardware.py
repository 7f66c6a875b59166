"""bf16 on a CPU that emulates it is slower than fp32: fit says so, and only then."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import lit_gspo.runtime.hardware as hardware
from lit_gspo.runtime.hardware import SlowPrecisionWarning, bf16_on_cpu_warning, cpu_flags
from lit_gspo.tools.main import cli_main

ROOT = Path(__file__).resolve().parents[1]

BASE = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi1 bmi2"
AVX512 = "avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bitalg avx512_vpopcntdq"
# /proc/cpuinfo flag lines (abridged) and whether the CPU multiplies bf16 natively
CPUS = {
    "Zen 3 / AVX2 laptop": (BASE, False),
    "Ice Lake (AVX-512, no bf16)": (f"{BASE} {AVX512} avx512ifma avx512vbmi", False),
    "Cooper Lake / Zen 4 (AVX512-BF16)": (f"{BASE} {AVX512} avx512_bf16", True),
    "Sapphire Rapids (AMX)": (f"{BASE} {AVX512} avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8", True),
    "AMX-BF16 without AVX512-BF16": (f"{BASE} {AVX512} amx_bf16 amx_tile", True),
}
BF16 = ("bf16-mixed", "bf16-true", "bf16")
NOT_BF16 = ("32-true", "32", 32, "16-mixed", "64-true", None)


@pytest.mark.parametrize("cpu", list(CPUS))
def test_advice_exactly_for_bf16_on_a_cpu_without_native_bf16(cpu):
    flags, native = CPUS[cpu]
    flags = flags.split()
    for precision in BF16:
        advice = bf16_on_cpu_warning(precision, "cpu", flags)
        assert (advice is None) == native, (cpu, precision)
        if not native:
            assert repr(precision) in advice and "--trainer.precision 32-true" in advice
        assert bf16_on_cpu_warning(precision, "cuda", flags) is None  # a GPU's bf16 is native
    for precision in NOT_BF16:
        assert bf16_on_cpu_warning(precision, "cpu", flags) is None, (cpu, precision)


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="no /proc/cpuinfo")
def test_this_cpus_flags_are_what_the_kernel_reports():
    """torch's probes (what the warning uses by default) agree with /proc/cpuinfo on this machine."""
    lines = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")]
    if not lines:
        pytest.skip("/proc/cpuinfo lists no flags (not x86)")
    reported = set(lines[0].split(":", 1)[1].split())
    assert cpu_flags() == hardware.NATIVE_BF16_FLAGS & reported
    assert (bf16_on_cpu_warning("bf16-mixed", "cpu") is None) == (
        bf16_on_cpu_warning("bf16-mixed", "cpu", reported) is None
    )


@pytest.mark.parametrize("native", [True, False])
def test_fit_warns_for_bf16_on_a_cpu_without_native_bf16(monkeypatch, tmp_path, native):
    flags = CPUS["Sapphire Rapids (AMX)" if native else "Ice Lake (AVX-512, no bf16)"][0]
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags.split()))
    args = [
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.accelerator",
        "cpu",
        "--trainer.precision",
        "bf16-mixed",
        "--trainer.max_steps",
        "1",
        "--trainer.enable_progress_bar",
        "false",
        "--model.policy.warm_start.steps",
        "0",
        "--model.validation.every_n_steps",
        "0",
        "--data.num_train",
        "8",
        "--data.num_val",
        "4",
        "--data.prompts_per_step",
        "2",
        "--model.generation.num_generations",
        "2",
        "--model.generation.max_new_tokens",
        "2",
    ]
    cli = cli_main(args, run=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    slow = [w for w in caught if issubclass(w.category, SlowPrecisionWarning)]
    assert len(slow) == (0 if native else 1)


@pytest.fixture
def nondeterministic_torch():
    """Deterministic algorithms off, as in a fresh process; restored afterwards."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.set_num_threads(threads)


def moe_fit_weights(tmp_path: Path, name: str) -> dict[str, torch.Tensor]:
    """2 warm-start steps + 1 RL step (2 minibatches) of a 4-layer Qwen3-MoE with 16 experts, top-4 (the size whose
    backward varied run to run: without deterministic kernels ~40 of its 47 tensors differ between two such fits,
    validation or not)."""
    args = [
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(tmp_path / name),
        "--trainer.accelerator",
        "cpu",
        "--trainer.max_steps",
        "1",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_checkpointing",
        "false",
        "--model.validation.every_n_steps",
        "0",
        "--model.policy.name",
        "tiny-qwen3-moe",
        "--model.policy.config",
        "{hidden_size: 64, num_hidden_layers: 4, moe_intermediate_size: 32, num_experts: 16, num_experts_per_tok: 4}",
        "--model.update.num_minibatches",
        "2",
        "--model.policy.warm_start.steps",
        "2",
        "--data.num_train",
        "32",
        "--data.num_val",
        "0",  # no validation: its generation is forward-only and, on 2 busy cores, most of the time
        "--data.prompts_per_step",
        "8",
    ]
    cli = cli_main(args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return {k: v.detach().clone() for k, v in cli.model.policy.state_dict().items()}


def test_a_cpu_fit_turns_torchs_deterministic_algorithms_on(tmp_path, nondeterministic_torch):
    """What the two-thread test below relies on, in a 1-thread fit of the tiny dense quickstart: the fit turns them on."""
    args = ["--config", str(ROOT / "configs/quickstart.yaml"), "--trainer.default_root_dir", str(tmp_path)]
    args += [
        "--trainer.max_steps",
        "1",
        "--trainer.enable_progress_bar",
        "false",
        "--model.policy.warm_start.steps",
        "1",
    ]
    args += ["--data.num_train", "8", "--data.num_val", "0", "--data.prompts_per_step", "2"]
    cli = cli_main(args, run=False)
    assert not torch.are_deterministic_algorithms_enabled()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()


@pytest.mark.slow  # 2 threads: ~1 s on an idle machine, 40-100 s while other processes share its 2 cores
def test_cpu_fits_of_one_seed_are_bit_identical_on_two_threads(tmp_path, nondeterministic_torch):
    # Without deterministic kernels this MoE's backward differs between identical passes on 2 threads (every
    # gradient below the last MoE block), so two fits of one seed drift apart from the warm start on.
    torch.set_num_threads(2)
    first, second = moe_fit_weights(tmp_path, "a"), moe_fit_weights(tmp_path, "b")
    assert torch.are_deterministic_algorithms_enabled()
    differ = [k for k in first if not torch.equal(first[k], second[k])]
    assert not differ, f"{len(differ)} tensors differ between two fits of seed 0, e.g. {differ[:3]}"


def test_gpu_runs_keep_their_own_determinism_setting(nondeterministic_torch):
    hardware.deterministic_on_cpu("cuda")
    assert not torch.are_deterministic_algorithms_enabled()
    hardware.deterministic_on_cpu("cpu")
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
