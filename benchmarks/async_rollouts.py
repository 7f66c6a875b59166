"""Wall time per RL step and val/reward, synchronous (K = 0) against asynchronous rollouts (K ≥ 1, a thread or a
process worker), on the same config and seeds, side by side in one sitting (issue 38; docs/async.md).

    python benchmarks/async_rollouts.py --config configs/quickstart.yaml --steps 20 --seeds 0 1
    python benchmarks/async_rollouts.py --config configs/quickstart.yaml --steps 20 --seeds 0 --reward-latency-s 0.05
    python benchmarks/async_rollouts.py --config configs/quickstart.yaml --steps 20 --seeds 0 \\
        --runs k0 k1-process -- --model.policy.config '{hidden_size: 256, num_hidden_layers: 4}'

Each run is a fresh process (``lit-gspo fit`` with the given config, ``--trainer.max_steps`` = ``--steps``, no
intermediate validation: val/reward is Lightning's step-0 sanity check and the end's), one after another; the runs
of one seed are interleaved (k0, k1-thread, k1-process, then the next seed) so a drift of the machine touches them
alike. Per-step wall time is the time between the ends of consecutive RL steps (a callback's ``on_train_batch_end``),
median over steps 2..N (step 1 starts the worker and primes it). Arguments after ``--`` go to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RUNS = {
    "k0": ["--model.generation.max_staleness", "0"],
    "k1-thread": ["--model.generation.max_staleness", "1", "--model.generation.async_worker", "thread"],
    "k1-process": ["--model.generation.max_staleness", "1", "--model.generation.async_worker", "process"],
    "k2-process": ["--model.generation.max_staleness", "2", "--model.generation.async_worker", "process"],
}


class SlowCharAccuracy:
    """The quickstart's CharAccuracy behind a fixed latency per call (``--reward-latency-s``): a remote verifier, a
    code sandbox, an LLM judge, during which a synchronous loop's cores idle."""

    def __init__(self, latency_s: float = 0.1, weight: float = 1.0):
        from lit_gspo.rl.rewards import CharAccuracy

        self.latency_s, self.weight, self.inner = latency_s, weight, CharAccuracy()

    def __call__(self, prompts, completions, **columns):
        time.sleep(self.latency_s)
        return self.inner(prompts, completions, **columns)


def one_run(args: list[str]) -> dict:
    """In this process: one fit of ``args``; its step times and val/reward (a JSON line on stdout)."""
    import csv

    from lightning.pytorch import Callback

    from lit_gspo.tools.main import cli_main

    class StepClock(Callback):
        def __init__(self):
            self.ends: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())

    clock = StepClock()
    cli = cli_main(args, run=False)
    cli.trainer.callbacks.append(clock)
    start = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    fit_s = time.perf_counter() - start
    steps = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    metrics = sorted(Path(cli.trainer.default_root_dir).glob("**/metrics.csv"))[-1]
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    val = [float(r["val/reward"]) for r in rows if r.get("val/reward")]
    stale = [float(r["train/staleness"]) for r in rows if r.get("train/staleness")]

    def median_of(key: str) -> float:
        values = [float(r[key]) for r in rows if r.get(key)][1:]  # step 1 starts and primes the worker
        return statistics.median(values) if values else 0.0

    return {
        "rollout_s": median_of("time/rollout_s"),
        "update_s": median_of("time/update_s"),
        "wait_s": median_of("time/rollout_wait_s"),
        "step_s": statistics.median(steps) if steps else float("nan"),
        "loop_s": clock.ends[-1] - clock.ends[0] if len(clock.ends) > 1 else float("nan"),
        "fit_s": fit_s,
        "val_first": val[0] if val else float("nan"),
        "val_last": val[-1] if val else float("nan"),
        "staleness_mean": statistics.fmean(stale) if stale else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--runs", nargs="+", default=["k0", "k1-thread", "k1-process"], choices=sorted(RUNS))
    parser.add_argument(
        "--reward-latency-s",
        type=float,
        default=0.0,
        help="score with CharAccuracy behind this latency per call (the quickstart's reward; a remote verifier)",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one fit (a JSON list of CLI arguments)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.one:
        print("RESULT " + json.dumps(one_run(json.loads(args.one))), flush=True)
        return
    if args.reward_latency_s:
        slow = {"class_path": "async_rollouts.SlowCharAccuracy", "init_args": {"latency_s": args.reward_latency_s}}
        extra = ["--model.rewards", json.dumps([slow]), *extra]
    from lit_gspo.runtime.hardware import cpu_model

    cpu = cpu_model()
    results: dict[str, list[dict]] = {name: [] for name in args.runs}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for name in args.runs:
                run_args = ["--config", args.config, "--trainer.max_steps", str(args.steps)]
                run_args += ["--seed_everything", str(seed), "--model.validation.every_n_steps", "0"]
                run_args += ["--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false"]
                run_args += ["--trainer.default_root_dir", f"{tmp}/{name}-{seed}", *RUNS[name], *extra]
                env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
                out = subprocess.run(
                    [sys.executable, __file__, "--one", json.dumps(run_args)],
                    capture_output=True,
                    text=True,
                    env=env,
                    cwd=ROOT,
                )
                line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                if out.returncode or not line:
                    sys.exit(f"{name} seed {seed} failed ({out.returncode}):\n{out.stderr[-3000:]}")
                result = json.loads(line[-1][7:])
                results[name].append(result)
                print(f"{name:11s} seed {seed}: " + ", ".join(f"{k} {v:.4g}" for k, v in result.items()), flush=True)
    print(f"\nCPU: {cpu}; torch threads {os.cpu_count()} cores; {args.steps} RL steps; seeds {args.seeds}")
    print(f"reproduce: python benchmarks/async_rollouts.py {' '.join(sys.argv[1:])}\n")
    base = statistics.median(r["step_s"] for r in results[args.runs[0]])
    print("| run | step_s (median over seeds) | vs " + args.runs[0] + " | fit_s | val/reward first → last (mean) |")
    print("|---|---|---|---|---|")
    for name, rs in results.items():
        step = statistics.median(r["step_s"] for r in rs)
        fit = statistics.median(r["fit_s"] for r in rs)
        first = statistics.fmean(r["val_first"] for r in rs)
        last = statistics.fmean(r["val_last"] for r in rs)
        print(f"| {name} | {step * 1000:.1f} ms | {base / step:.2f}× | {fit:.1f} s | {first:.3f} → {last:.3f} |")


if __name__ == "__main__":
    main()
