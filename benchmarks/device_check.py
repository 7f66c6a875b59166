"""The device check: everything issue 36 asks of one GPU, in one call of ≤ 8 minutes, one table at the end.

    python benchmarks/device_check.py --out $OUT                # on the GPU machine (below: the whole call)
    python benchmarks/device_check.py --dry-run --out runs/dc   # here, on CPU: tiny shapes, the same code paths

Parts, each a subprocess with its own time limit (a crash or a time-out is one row, the next part still runs; a time-out
ends every process the part started; each log line is stamped with the seconds since its part started); the first
three time nothing and run side by side (190 s), the last alone (290 s):

1. ``cuda tests`` and ``cuda fits``: ``pytest -m cuda`` (tests/test_cuda.py and every other test marked ``cuda``),
   the fits that compile the static-cache step (``CUDA_FITS``) beside the other tests; on the dry run all of them in
   one part on the CPU (``LIT_GSPO_CUDA_TESTS_ON=cpu``).
2. ``correctness``: ``benchmarks/gpu_check.py`` on Qwen3-0.6B's shape: bf16 under FSDP2 on one GPU (it crashed on
   the first run), checked against its RL step replayed on CPU in fp32; and the quickstart in fp32 and bf16 on the
   device (val/reward before its warm start → after). bf16 alone and 8-bit AdamW under FSDP2 run in the cuda tests'
   fits and in vs TRL; README's GPU command (the quickstart through the CLI) in the cuda tests.
3. ``vs TRL 8x8x256``: ``benchmarks/vs_trl.py`` at 8 × 8 × 256 a rollout (4 prompts per update), Qwen3-0.6B's shape,
   each side with its defaults on CUDA (lit_gspo: StaticCacheSampler, micro-batches from free memory): seconds per
   update, each side's rollout tok/s (lit_gspo's is the sampler's target, ≥ 20,000 at 64 rows × 256 new tokens in
   bf16: the fit's own sampling, prefill and rewards included), update-phase MFU, peak GPU memory and host RSS (two
   timed cycles after the warm-up), and each side's host and GPU memory by phase, with the seconds each phase was
   reached at (in ``vs_trl_8x8x256.log``). The dry run's ``vs TRL tiny`` runs it on CPU (SmolLM2-135M, 1 prompt × 2
   × 8 tokens), and the dry run's ``sampler`` the sampler part below.

On the workplace's GPU machine (no network): here, ``scripts/device_wheels.sh --trl``, then one ``run`` with
``carry [".whl"]`` and ``timeout_s 600``:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && python3 benchmarks/device_check.py --out $OUT

More parts run only when named (``--only``), in a second call in the warm window after the first, in the order
named: ``update variants`` (``benchmarks/update_speed.py``: the update alone at vs TRL's 8 × 8 × 256, eager, with
plain activations, compiled, on bf16 casts and both, alternated in one process on the same rollouts without sampling:
each one's seconds, MFU, peak memory and first gradient against the eager one's; what decides the CUDA defaults of
``update.compile`` and ``update.param_dtype``, and what ``update.lean_activations`` saves, ~2 min), ``lit compiled
8x8x256`` (lit_gspo alone with ``update.compile``, ~4 min),
``sampler`` (``benchmarks/sampler_speed.py``: StaticCacheSampler alone at 64 rows × 256 new tokens, its warm-up and
samples, and a profile of one sample), ``lit compiled bf16 casts 8x8x256`` (both opt-ins), ``lit bf16 casts 8x8x256``
(``update.param_dtype: bf16``: the update on bf16 casts of the fp32 parameters, ~3 min), ``profiles 8x8x256`` (vs TRL
with a ``torch.profiler`` profile of one more cycle's update on each side: ``profile/profile_{lit,trl}.txt``, the
row gives each side's shares of matmul, LM head, attention, optimizer and its syncs), ``vs TRL 16x8x256`` (the
issue's other shape, ~4 min), ``vs TRL 32x8x256 in 80 GB`` (both sides capped at an H100's 79.6 GiB,
``--gpu-memory-gb``: a side that runs out of memory is its row), and two A/Bs of the defaults: ``lit padded
8x8x256`` (``update.align_rows`` off: the update's attention under a padding mask, ~3 min) and ``sampler sdpa
decode`` (the decoding step's attention as transformers' sdpa runs it, which copies the KV cache once per query
head, ~1.5 min):

    python3 benchmarks/device_check.py --out $OUT --only "update variants,sampler"

Writes ``device_check.json`` and each part's log under ``--out``; docs/gpu.md holds the latest table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN3_SHAPE = ROOT / "benchmarks/shapes/qwen3-0.6b.config.json"
sys.path.insert(0, str(ROOT / "benchmarks"))
import sampler_speed  # noqa: E402  (the wording of its profile's summary)


def parts(dry_run: bool, out: Path) -> list[dict]:
    """Each part: name, command, time limit (s), and how to read its result from its output."""
    py = sys.executable
    if dry_run:
        return [
            dict(
                name="cuda tests",
                limit=300,
                env={"LIT_GSPO_CUDA_TESTS_ON": "cpu"},
                cmd=[py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "tests"],
            ),
            dict(
                name="correctness",
                limit=600,
                cmd=[
                    py,
                    "benchmarks/gpu_check.py",
                    "--device",
                    "cpu",
                    "--models",
                    "tiny-qwen3",
                    "--cases",
                    "fp32,bf16-fsdp2",
                    "--more-cases",
                    "",
                    "--out",
                    str(out / "gpu_check.json"),
                ],
            ),
            dict(
                name="sampler",
                limit=300,
                cmd=[
                    py,
                    "benchmarks/sampler_speed.py",
                    "--device",
                    "cpu",
                    "--dry-run",
                    "--repeats",
                    "1",
                    "--json",
                    str(out / "sampler_speed.json"),
                    "--profile-dir",
                    str(out / "profile"),
                ],
            ),
            dict(
                name="update variants",
                limit=180,  # ~20 s on 2 CPU cores
                cmd=[
                    py,
                    "benchmarks/update_speed.py",
                    "--dry-run",
                    "--repeats",
                    "1",
                    "--json",
                    str(out / "update_speed.json"),
                ],
            ),
            dict(
                name="vs TRL tiny",
                limit=180,  # ~60 s on 2 CPU cores
                cmd=[
                    py,
                    "benchmarks/vs_trl.py",
                    "--model-dir",
                    "runs/smollm2-135m-instruct-hf",
                    "--prompts-per-update",
                    "1",
                    "--num-generations",
                    "2",
                    "--max-new-tokens",
                    "8",
                    "--rounds",
                    "1",
                    "--cycles",
                    "2",
                    "--checkpointing",
                    "off",
                    "--skip-zero-advantage",
                    "off",
                    "--profile-dir",
                    str(out / "profile"),
                ],
            ),
        ]
    return [
        dict(
            name="cuda tests",
            group="checks",  # beside the fits and the correctness cases: none of them times anything
            limit=190,  # on the H100 (2026-11-27) 18 of 21 ran in 170 s, the fits last: now the fits run beside them
            cmd=cuda_tests(f"not ({CUDA_FITS})"),
        ),
        dict(name="cuda fits", group="checks", limit=190, cmd=cuda_tests(CUDA_FITS)),
        dict(
            name="correctness",
            group="checks",
            limit=190,  # FSDP2 on one GPU (it crashed) with its CPU fp32 replay, then the quickstart in fp32 and bf16
            cmd=[
                py,
                "benchmarks/gpu_check.py",
                "--device",
                "cuda",
                "--models",
                "qwen3-0.6b",
                "--cases",
                "bf16-fsdp2",  # bf16 alone: the cuda tests' fits and vs TRL; 8-bit FSDP2: the cuda tests' fits
                "--more-cases",
                "",
                "--T",
                "24",  # its CPU fp32 replay's cost grows with the tokens: half of gpu_check's 48 (FSDP2 is the point)
                "--budget-s",
                "185",  # on the H100 165 s ended the bf16-fsdp2 case's CPU replay before its check
                "--out",
                str(out / "gpu_check.json"),
            ],
        ),
        dict(
            name="vs TRL 8x8x256",  # the sampler's target is its lit row's rollout tok/s: 64 rows × 256 tokens, bf16
            limit=290,  # the H100: TRL 97 s with loading; lit_gspo > 180 s with its profile (now the extra part below)
            cmd=vs_trl_at(4),  # 4 prompts an update, 2 updates a rollout; 190 + 290 = 480 s
        ),
        # asked for by name only (--only), in a second call, most wanted first
        dict(  # the update alone, every candidate CUDA default of it beside the others in one process (no sampling)
            name="update variants",
            extra=True,
            limit=240,
            cmd=[py, "benchmarks/update_speed.py", "--device", "cuda", "--json", str(out / "update_speed.json")],
        ),
        dict(
            name="sampler",  # StaticCacheSampler alone, with a profile of one sample (host or device bound?)
            extra=True,
            limit=140,  # the H200: a compile of 39 s, a sample 1.4 s; the H100 (2026-11-27): not done in 100 s
            cmd=sampler_with("StaticCacheSampler", out / "sampler_speed.json", "--profile-dir", str(out / "profile")),
        ),
        dict(  # where each side's update time goes: a torch.profiler profile of one more cycle's update on each side
            name="profiles 8x8x256", extra=True, limit=300, cmd=vs_trl_at(4, "--profile-dir", str(out / "profile"))
        ),
        dict(name="vs TRL 16x8x256", extra=True, limit=240, cmd=vs_trl_at(8)),
        dict(  # the issue's 32 × 8 × 256 within an H100's memory (both sides ran out of its 80 GB on 2026-11-26)
            name="vs TRL 32x8x256 in 80 GB", extra=True, limit=300, cmd=vs_trl_at(16, "--gpu-memory-gb", "79.6")
        ),
        dict(  # the H100's eager update: elementwise kernels 64 % of its device time, matmuls 21 %: what compile fuses
            name="lit compiled 8x8x256", extra=True, limit=250, cmd=vs_trl_at(4, "--only", "lit", "--lit-compile", "on")
        ),
        dict(  # both opt-ins together: the candidate CUDA default
            name="lit compiled bf16 casts 8x8x256",
            extra=True,
            limit=250,
            cmd=vs_trl_at(4, "--only", "lit", "--lit-compile", "on", "--lit-param-dtype", "bf16"),
        ),
        dict(  # update.param_dtype bf16: the update's passes on bf16 casts (fewer elementwise bytes and saved activations)
            name="lit bf16 casts 8x8x256",
            extra=True,
            limit=200,
            cmd=vs_trl_at(4, "--only", "lit", "--lit-param-dtype", "bf16"),
        ),
        dict(
            name="lit padded 8x8x256",  # update.align_rows off: the update's attention under a padding mask
            extra=True,
            limit=200,
            cmd=vs_trl_at(4, "--only", "lit", "--lit-align-rows", "off"),
        ),
        dict(
            name="sampler sdpa decode",  # the decoding step's attention as transformers' sdpa runs it (repeat_kv)
            extra=True,
            limit=90,
            cmd=sampler_with("StaticCacheSampler(decode_attention=None)", out / "sampler_sdpa.json"),
        ),
    ]


#: the ``cuda`` tests of the part "cuda fits" (``pytest -k``): the fits that compile the static-cache step (each in a
#: process of its own, about a minute on the GPU), beside the other tests ("cuda tests": every test this does not pick)
CUDA_FITS = "fit and not AdamW8bit"


def cuda_tests(selection: str) -> list[str]:
    """``pytest -m cuda`` on the tests whose names ``selection`` picks (``-k``), each test's line and time in the log."""
    command = [sys.executable, "-m", "pytest", "-v", "--tb=short", "--durations=12", "-p", "no:cacheprovider"]
    return command + ["-m", "cuda", "-k", selection, "tests"]


def sampler_with(engines: str, json_file: Path, *more: str) -> list[str]:
    """``benchmarks/sampler_speed.py`` on CUDA at its defaults (Qwen3-0.6B's shape, bf16-mixed, 64 rows × 256 new
    tokens), each engine sampled once to warm up and twice timed."""
    command = [sys.executable, "benchmarks/sampler_speed.py", "--device", "cuda", "--engines", engines]
    return command + ["--repeats", "2", "--json", str(json_file), *more]


def vs_trl_at(prompts_per_update: int, *more: str) -> list[str]:
    """``benchmarks/vs_trl.py`` on CUDA at Qwen3-0.6B's shape, bf16, 8 completions × 256 tokens a prompt, each side with
    its defaults: a warm-up cycle, then two timed ones."""
    return [
        sys.executable,
        "benchmarks/vs_trl.py",
        "--device",
        "cuda",
        "--precision",
        "bf16",
        "--checkpointing",
        "off",
        "--skip-zero-advantage",
        "off",
        "--model-dir",
        ".whl/smollm2-135m-shape",
        "--model-config",
        str(QWEN3_SHAPE),
        "--prompts-per-update",
        str(prompts_per_update),
        "--max-new-tokens",
        "256",
        "--rounds",
        "1",
        "--cycles",
        "3",
        *more,
    ]


def case_verdict(case: dict) -> str:
    """gpu_check's row of one case: FAILED, its check against the CPU fp32 replay, the quickstart's val/reward."""
    if case.get("error"):
        return "FAILED " + case["error"].strip().splitlines()[-1][:80]
    s = case.get("summary") or {}
    if case["case"].startswith("quickstart") and s.get("val_after") is not None:
        return f"val/reward {s['val_before']:.2f} → {s['val_after']:.2f}"
    check = case.get("check")
    if check:
        return f"{'ok' if check['ok'] else 'OUT OF TOLERANCE'} (|Δloss| {check['max_loss_diff']:.1e}, Δθ rel {check['param_rel_err']:.3f})"
    return case.get("check_error") or "ran, not checked"


def profile_brief(side: str, p: dict) -> str:
    """vs_trl.py's profile of one side's update, short: ``lit update 812 ms device (2 steps): matmul 41%, ...``."""
    if "error" in p:
        return f"{side} profile failed: {p['error'][:80]}"
    shares = ", ".join(f"{k} {100 * p['shares'][k]:.0f}%" for k in ("matmul", "head", "attention", "optimizer"))
    line = f"{side} update {p['total_ms']:.0f} ms {p['time']} ({p['optimizer_steps']} step{'s' * (p['optimizer_steps'] != 1)}): {shares}"
    if p.get("syncs") is not None:
        line += f", syncs {p['syncs']}, GPU busy {100 * p['busy']:.0f}%"
    return line


def update_speed_brief(measured: dict) -> str:
    """``benchmarks/update_speed.py``'s variants, short: ``eager 0.52 s (MFU 12.0 %, 31.0 GB, gradient off 0e+00; first
    3 s); compiled FAILED ...``."""

    def brief(r: dict) -> str:
        if "error" in r:
            return f"FAILED {r['error'][:100]}"
        if r["median_s"] is None:
            return f"first learn {r['first_s']:.0f} s, no timed learn"
        peak = f", {r['peak_gb']:.1f} GB" if r.get("peak_gb") is not None else ""
        return f"{r['median_s']:.2f} s (MFU {100 * r['mfu']:.1f} %{peak}, gradient off {r['gradient_off']:.0e}; first {r['first_s']:.0f} s)"

    return "; ".join(f"{name} {brief(r)}" for name, r in measured["variants"].items()) or "no variant ran"


def summary(name: str, output: str, out: Path) -> str:
    """One line of what the part measured, read from its output."""
    if name.startswith("cuda"):
        found = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?) in [\d.]+s", output, re.M)
        return found[-1] if found else "no pytest summary"
    if name == "correctness" and (out / "gpu_check.json").exists():
        cases = json.loads((out / "gpu_check.json").read_text()).get("cases", [])
        return "; ".join(f"{c['case']}: {case_verdict(c)}" for c in cases) or "no case ran"
    measured = out / {"sampler": "sampler_speed.json", "sampler sdpa decode": "sampler_sdpa.json"}.get(name, "-")
    if measured.is_file():
        engines = json.loads(measured.read_text())["engines"]
        return "; ".join(
            (f"{n}: {r['tok_s']:.0f} tok/s" if "tok_s" in r else f"{n}: {r['error'][:60]}")
            + (f" ({sampler_speed.profile_brief(r['profile'])})" if "profile" in r else "")
            for n, r in engines.items()
        )
    if name == "update variants" and (out / "update_speed.json").is_file():
        return update_speed_brief(json.loads((out / "update_speed.json").read_text()))
    if name.startswith(("vs TRL", "lit ")):
        ratio = re.findall(r"^ratio trl/lit: .*$", output, re.M)
        found = re.findall(r"^JSON (.*)$", output, re.M)
        # cut off before its table: each side measured by then (vs_trl.py prints a SIDE line per side as it ends)
        sides_so_far = [json.loads(line) for line in re.findall(r"^SIDE (.*)$", output, re.M)]
        measured = json.loads(found[-1]) if found else {k: v for side in sides_so_far for k, v in side.items()}
        profiles = measured.get("profile") or {}
        sides = [
            f"{side} {r['sec_per_update']:.2f} s/update"
            + (f", rollout {r['rollout_tok_s']:.0f} tok/s" if r.get("rollout_tok_s") else "")
            + f", update phase {r['update_phase_s']:.2f} s (MFU {100 * r['mfu']:.1f} %)"
            + (f", peak GPU {r['peak_gpu_mb'] / 1024:.1f} GiB" if r.get("peak_gpu_mb") else "")
            for side, r in measured.items()
            if side in ("lit", "trl")
        ]
        head = ratio[-1:] if ratio else (["no ratio"] if name.startswith("vs TRL") else [])
        failures = [f"{side} FAILED: {error[:120]}" for side, error in (measured.get("failed") or {}).items()]
        profiled = [profile_brief(s, p) for s, p in profiles.items() if p]
        return "; ".join(head + sides + failures + profiled) or "no result"
    return ""


def log_name(part: str) -> str:
    """``vs TRL 8x8x256`` → ``vs_trl_8x8x256.log``: one log per part."""
    return re.sub(r"\W+", "_", part.lower()).strip("_") + ".log"


def start(part: dict, out: Path) -> dict:
    """The part's process, started in its own session (a time-out ends it with every process it started: a test's
    fit, a benchmark's worker), its output streamed to its log as it runs, each line stamped with the seconds since
    the part started (a part cut off by its limit shows how far it got, and when)."""
    log = out / log_name(part["name"])
    env = dict(
        os.environ,
        **part.get("env", {}),
        PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])),
    )
    began = time.perf_counter()
    proc = subprocess.Popen(
        part["cmd"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines: list[str] = []

    def copy_to_log() -> None:
        with log.open("w") as handle:
            for line in proc.stdout:
                lines.append(line)
                handle.write(f"[{time.perf_counter() - began:6.1f} s] {line}")
                handle.flush()

    reader = threading.Thread(target=copy_to_log, daemon=True)
    reader.start()
    return dict(part=part, proc=proc, log=log, lines=lines, reader=reader, start=began)


def finish(running: dict, out: Path) -> dict:
    """Wait for a started part until its time limit, then its row."""
    part, proc = running["part"], running["proc"]
    try:
        rc = proc.wait(timeout=max(part["limit"] - (time.perf_counter() - running["start"]), 0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = f"time-out {part['limit']} s"
    running["reader"].join(timeout=10)  # the pipe closes once every process of the part has ended
    return dict(
        part=part["name"],
        rc=rc,
        seconds=round(time.perf_counter() - running["start"], 1),
        result=summary(part["name"], "".join(running["lines"]), out),
        log=str(running["log"]),
    )


def groups(parts: list[dict]) -> list[list[dict]]:
    """Consecutive parts of one ``group`` run side by side (checks that time nothing); every other part alone."""
    out: list[list[dict]] = []
    for part in parts:
        if out and part.get("group") and out[-1][0].get("group") == part["group"]:
            out[-1].append(part)
        else:
            out.append([part])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/device_check")))
    p.add_argument("--dry-run", action="store_true", help="on CPU: tiny shapes, the same code paths")
    p.add_argument(
        "--only",
        help="comma-separated part names to run, in that order (default: the parts not marked extra; an unknown name "
        "lists them all)",
    )
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    every = {part["name"]: part for part in parts(args.dry_run, args.out)}
    names = [name.strip() for name in args.only.split(",")] if args.only else None
    unknown = [name for name in names or () if name not in every]
    if unknown:
        p.error(f"--only: no part named {', '.join(map(repr, unknown))}; the parts: {', '.join(map(repr, every))}")
    # named: in the order given (the first named runs first, should the call's time run out)
    chosen = [every[name] for name in names] if names else [part for part in every.values() if not part.get("extra")]
    rows = []
    for group in groups(chosen):
        running = [start(part, args.out) for part in group]
        for one in running:
            row = finish(one, args.out)
            rows.append(row)
            print(f"{row['part']}: rc {row['rc']}, {row['seconds']} s: {row['result']}", flush=True)
    import torch

    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.dry_run else "CPU (dry run)"
    print(f"\ndevice check on {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print("| part | rc | s | result |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['part']} | {row['rc']} | {row['seconds']} | {row['result']} |")
    (args.out / "device_check.json").write_text(
        json.dumps(dict(device=where, torch=torch.__version__, rows=rows), indent=1)
    )
    return 0 if all(row["rc"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
