"""Golden runs: fits whose every logged value and final weights a refactor must reproduce bit for bit.

Each run is ``lit-gspo fit`` as a user types it, in a fresh process, for 40 RL steps. The process is
pinned to one thread and to code paths that gave the same bits on every CPU of one vendor seen so far:

- ATen's AVX2 kernels: IEEE adds, multiplies, FMAs, divides and square roots, no approximate reciprocals.
- MKL's ``COMPATIBLE`` branch (SSE2 without rcpps/rsqrtps). MKL's other reproducible branches (``AVX2``,
  ``AVX2,STRICT``) exist on Intel CPUs only: elsewhere MKL silently takes its ``AUTO`` branch. Files
  recorded under ``AVX2,STRICT`` passed CI on one machine and failed on an Intel Emerald Rapids, ~1e-7
  apart from the first RL step on. ``COMPATIBLE``'s GEMMs are also the same at every alignment of the
  operands (``AVX2`` without ``STRICT``'s are not); ``tests/test_golden.py`` checks the pinned ones.
- oneDNN capped at AVX2 (the fp32 fits here make no oneDNN call; a future one stays pinned).

Not across vendors: on an AMD EPYC Zen 4 (family 25 model 17, 2026-11-28) every run differed from the files
recorded on Intel by ~1e-7 from step 0 (the entropy and gradient norm after the warm start; the samples, rewards
and loss equal), the same bits run after run, although the process made only SGEMM calls, every one
``CNR:COMPATIBLE`` and free of FMAs. What is left to differ is how ``COMPATIBLE`` blocks the sum over K: on that
CPU a GEMM with K ≤ 64 is the plain sequential fp32 sum, and with 64 < K ≤ 200 the sequential sums over blocks of
112 added up (``python tests/golden/runs.py k-block`` finds the block), a size MKL most likely derives from the
caches (32 KB L1d and 1 MB L2 a core there, 48 KB and 2 MB on an Emerald Rapids; not measured on Intel yet). The
backward's weight gradients sum over every token (K in the thousands). So each vendor has its own recording of the same fits
(``tests/golden/<vendor_id>/NAME.json``, ``vendor_id`` as /proc/cpuinfo names it), both made by the same code;
a CPU of a vendor without one skips the check, naming it.

    python tests/golden/runs.py record          # (re)write this vendor's files from the current code
    python tests/golden/runs.py check [NAME..]  # compare the current code with this vendor's files
    python tests/golden/runs.py k-block         # the K-block of the pinned process's fp32 GEMMs on this CPU

Re-recording is a decision, not a fix: say in the commit which values changed and why. A change that moves the
numbers re-records on the vendor it runs on and deletes the other vendor's files it cannot re-record (that
vendor then skips until a session on such a CPU records it again): a stale recording fails there.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RL_STEPS = 40

PINNED_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",  # ATen's vectorised kernels
    "MKL_CBWR": "COMPATIBLE",  # MKL's conditional numerical reproducibility: the one branch on Intel and AMD alike
    "MKL_DYNAMIC": "FALSE",  # MKL and OpenMP keep the thread count they are given
    "OMP_DYNAMIC": "FALSE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "1",  # reductions split over threads would change the summation order
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "PYTHONHASHSEED": "0",
}

QUICKSTART = ["--config", "configs/quickstart.yaml", "--model.validation.every_n_steps", "10"]
MOE = [
    "--model.policy.name",
    "tiny-qwen3-moe",
    "--model.policy.config",
    "{hidden_size: 64, num_hidden_layers: 2, moe_intermediate_size: 32}",
    "--model.update.num_minibatches",
    "4",
    "--model.update.skip_zero_advantage_rows",
    "false",
    "--model.objective",
    "GRPO",
    "--model.policy.routing.replay",
    "true",
]

#: name -> extra ``fit`` arguments
RUNS: dict[str, list[str]] = {
    "quickstart": [],
    "ppo": ["--config", "configs/objectives/ppo.yaml"],
    "moe_routing_replay": MOE,
    "dapo_dynamic_sampling": ["--config", "configs/objectives/dapo.yaml"],
    "lora": ["--model.policy.lora", "{r: 8, alpha: 16}"],
    "minibatches4_epochs2": ["--model.update.num_minibatches", "4", "--model.update.epochs", "2"],
}


def fit_args(name: str, run_dir: Path) -> list[str]:
    return [
        *QUICKSTART,
        *RUNS[name],
        "--trainer.max_steps",
        str(RL_STEPS),  # RL steps
        "--trainer.default_root_dir",
        str(run_dir),
        "--trainer.enable_progress_bar",
        "false",
    ]


def run(name: str) -> dict:
    """Fit ``name`` in a fresh, pinned process; return its logged values (``repr`` floats) and weights' hash."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / name
        env = {**os.environ, **PINNED_ENV}
        cmd = [sys.executable, "-m", "lit_gspo.tools.main", "fit", *fit_args(name, run_dir)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"golden run {name!r} failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
        (metrics_file,) = run_dir.glob("**/metrics.csv")
        return {
            "args": fit_args(name, Path("RUN_DIR")),
            "metrics": logged_values(metrics_file),
            "weights_sha256": weights_hash(run_dir / "hf_model"),
        }


def logged_values(path: Path) -> dict[str, dict[str, str]]:
    """step -> {key: repr(value)} of every ``train/*`` and ``val/*`` value logged (timings left out)."""
    out: dict[str, dict[str, str]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            values = {
                k: repr(float(v))
                for k, v in row.items()
                if v not in ("", None) and (k.startswith("train/") or k.startswith("val/"))
            }
            if values:
                out.setdefault(row["step"], {}).update(values)
    return out


def weights_hash(hf_dir: Path) -> str:
    """sha256 over the saved tensors (name, dtype, shape, bytes) in name order."""
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors = load_file(file)
        for key in sorted(tensors):
            t = tensors[key].contiguous()
            digest.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
            digest.update(t.view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return digest.hexdigest()


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it (``GenuineIntel``, ``AuthenticAMD``); ``unknown`` elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def golden_path(name: str, vendor: str | None = None) -> Path:
    """The recording of run ``name`` for ``vendor`` (default: this CPU's)."""
    return HERE / (vendor or cpu_vendor()) / f"{name}.json"


def recorded_vendors() -> list[str]:
    return sorted(d.name for d in HERE.iterdir() if d.is_dir() and any(d.glob("*.json")))


def differences(name: str, got: dict) -> list[str]:
    """Human-readable differences between a run and its recorded golden file (empty when bit-exact)."""
    want = json.loads(golden_path(name).read_text())
    out = []
    if got["weights_sha256"] != want["weights_sha256"]:
        out.append(f"final weights differ (sha256 {got['weights_sha256'][:12]} vs {want['weights_sha256'][:12]})")
    for step in sorted(set(want["metrics"]) | set(got["metrics"]), key=int):
        w, g = want["metrics"].get(step, {}), got["metrics"].get(step, {})
        for key in sorted(set(w) | set(g)):
            if w.get(key) != g.get(key):
                out.append(f"step {step} {key}: recorded {w.get(key)}, now {g.get(key)}")
    return out


def gemm_k_block(max_block: int = 512) -> int | None:
    """The K-block of this process's fp32 GEMM: the kc for which ``A @ B`` (8 × 2kc × 8) equals, bit for bit, the
    sequential fp32 sums over K's blocks of kc added into C (0: sequential over all K ≤ ``max_block``; None: neither)."""
    import numpy as np
    import torch

    def blocked(a, b, kc):
        c = np.zeros((a.shape[0], b.shape[1]), np.float32)
        for start in range(0, a.shape[1], kc):
            part = np.zeros_like(c)
            for k in range(start, min(start + kc, a.shape[1])):
                part = part + a[:, k, None] * b[None, k, :]  # fp32 multiply, then fp32 add: no FMA
            c = c + part
        return c

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 2 * max_block, generator=gen), torch.randn(2 * max_block, 8, generator=gen)

    def same(k, kc):  # A @ B over the first k of K, against blocks of kc
        return np.array_equal((a[:, :k] @ b[:k]).numpy(), blocked(a[:, :k].numpy(), b[:k].numpy(), kc))

    first = next((k for k in range(4, max_block + 1, 4) if not same(k, k)), None)  # where one block stops matching
    if first is None:
        return 0
    return next((kc for kc in range(4, first, 4) if same(2 * kc, kc)), None)


def main(argv: list[str]) -> int:
    if argv[:1] == ["k-block"]:  # in the pinned process, as the runs compute
        probe = "import runs; print('fp32 GEMM K-block:', runs.gemm_k_block())"
        env = {**os.environ, **PINNED_ENV, "PYTHONPATH": str(HERE)}
        return subprocess.run([sys.executable, "-c", probe], env=env).returncode
    if not argv or argv[0] not in ("record", "check"):
        print(__doc__)
        return 2
    names = argv[1:] or list(RUNS)
    if argv[0] == "check" and not golden_path(names[0]).exists():
        print(
            f"no golden runs recorded for this CPU's vendor ({cpu_vendor()}; recorded: {recorded_vendors()}): "
            "python tests/golden/runs.py record"
        )
        return 1
    failed = 0
    for name in names:
        got = run(name)
        if argv[0] == "record":
            golden_path(name).parent.mkdir(exist_ok=True)
            golden_path(name).write_text(json.dumps(got, indent=0, sort_keys=True) + "\n")
            print(
                f"recorded {name} for {cpu_vendor()}: {len(got['metrics'])} steps, weights {got['weights_sha256'][:12]}"
            )
        else:
            diff = differences(name, got)
            failed += bool(diff)
            print(f"{name}: {'bit-exact' if not diff else f'{len(diff)} differences'}")
            for line in diff[:20]:
                print("   ", line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
