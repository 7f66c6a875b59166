"""Fault injection: SIGKILL a quickstart-sized run again and again, resume it each time, compare with an uninterrupted run.

    python benchmarks/faults.py                       # 5 random kills + 1 inside a checkpoint write + 1 inside the export
    python benchmarks/faults.py --kills 10 --steps 20 --seed 3

One uninterrupted reference run (``lit-gspo fit`` on configs/quickstart.yaml, checkpoint every step), then the same
run in another directory killed with SIGKILL: ``--kills`` times at a random moment, once while a checkpoint is being
written (its write stalls half-way so the kill lands inside it), and once while the Hugging Face export is being
written (after its files, before the swap). Each kill is followed by a restart with ``--ckpt_path last`` (from
scratch when no checkpoint exists yet); the last restart finishes the run, or, when the run had finished before its
export, writes the export.

An attempt is an exact resume when every value it logged equals the reference's value for that step and key;
"lost" counts reference values (step, key) that no attempt logged. The final weights (``hf_model``) must be
bitwise equal to the reference's. Prints "N kills, N exact resumes, 0 lost" when all is well, and exits non-zero
otherwise.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the stalls a run can be asked for (read by the runner below, in the child process)
STALL_ENV, MARKER_ENV = "LIT_GSPO_FAULT_STALL", "LIT_GSPO_FAULT_MARKER"


# ---------------------------------------------------------------------- the child: the CLI, with an optional stall
def run_cli(argv: list[str]) -> None:
    """``lit-gspo fit ...``; with $LIT_GSPO_FAULT_STALL = ``checkpoint:K`` the K-th checkpoint write of this process
    stops half-way, = ``export`` the export stops after its files are written; either touches $LIT_GSPO_FAULT_MARKER
    and sleeps until killed."""
    stall, marker = os.environ.get(STALL_ENV), os.environ.get(MARKER_ENV)
    if stall:
        import lit_gspo.lightning.checkpoint_io as checkpoint_io

        def hang() -> None:
            Path(marker).write_text(stall)
            time.sleep(3600)

        if stall.startswith("checkpoint:"):
            target, count, write = int(stall.split(":")[1]), [0], checkpoint_io.AtomicCheckpointIO._write

            def _write(self, checkpoint, f):
                count[0] += 1
                if count[0] < target:
                    return write(self, checkpoint, f)
                import io

                import torch

                buffer = io.BytesIO()
                torch.save(checkpoint, buffer)
                f.write(buffer.getvalue()[: buffer.tell() // 2])
                f.flush()
                hang()

            checkpoint_io.AtomicCheckpointIO._write = _write
        elif stall == "export":
            import lit_gspo.runtime.files as files

            def fsync_tree(directory):  # inside written_aside: the files are written, the swap has not happened
                hang()

            files.fsync_tree = fsync_tree
    from lit_gspo.tools.main import main

    main(argv)


# ---------------------------------------------------------------------- the driver
def fit_args(root: Path, steps: int) -> list[str]:
    return [
        "fit",
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(root),
        "--trainer.max_steps",
        str(steps),
        "--trainer.enable_checkpointing",
        "true",
        "--checkpoint_every_n_steps",
        "1",
        "--trainer.enable_progress_bar",
        "false",
        "--model.policy.warm_start.steps",
        "5",
        "--model.validation.every_n_steps",
        "2",
        "--data.num_train",
        "128",
        "--data.num_val",
        "16",
        "--data.prompts_per_step",
        "8",
    ]


def start(
    root: Path, steps: int, resume: bool, stall: str | None = None, marker: Path | None = None
) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop(STALL_ENV, None)
    if stall:
        env[STALL_ENV], env[MARKER_ENV] = stall, str(marker)
    argv = fit_args(root, steps) + (["--ckpt_path", "last"] if resume else [])
    return subprocess.Popen(
        [sys.executable, __file__, "--child", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def kill(proc: subprocess.Popen) -> bool:
    """SIGKILL the run (and anything it started); True if it was still running."""
    running = proc.poll() is None
    if running:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return running


def logged(path: Path) -> dict[tuple[int, str], str]:
    out = {}
    with open(path) as fh:
        for row in csv.DictReader(fh):
            for key, value in row.items():
                if key not in ("step", "epoch") and value not in (None, "") and not key.startswith("time/"):
                    out[(int(row["step"]), key)] = value
    return out


def weights(root: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(root / "hf_model" / "model.safetensors")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return run_cli(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--kills",
        type=int,
        default=5,
        help="SIGKILLs at random moments (plus one inside a checkpoint write and one inside the export)",
    )
    parser.add_argument("--steps", type=int, default=12, help="RL steps of the run")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill times")
    parser.add_argument("--root", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = args.root or Path(tempfile.mkdtemp(prefix="lit_gspo_faults_"))
    reference, faulty = root / "reference", root / "killed"

    begin = time.monotonic()
    proc = start(reference, args.steps, resume=False)
    while not list(reference.glob("**/metrics.csv")) and proc.poll() is None:
        time.sleep(0.05)
    startup = time.monotonic() - begin  # imports, model, warm start, first validation
    _, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"the reference run failed ({proc.returncode}):\n{err[-3000:]}")
    duration = time.monotonic() - begin
    step_s = max(duration - startup, 0.1) / args.steps
    expected = logged(next(reference.glob("**/metrics.csv")))
    print(
        f"reference: {args.steps} steps in {duration:.0f} s ({startup:.0f} s to its first row), {len(expected)} logged values"
    )

    # the plan: random kills, one inside a checkpoint write second, the export kill last
    plan = ["random"] * args.kills
    plan.insert(min(1, len(plan)), "checkpoint")
    plan.append("export")
    done: list[str] = []
    marker = root / "stalled"
    for what in plan:
        resume = (faulty / "checkpoints" / "last.ckpt").exists()
        before = _rows(faulty)  # a resume continues the same metrics.csv: its own rows are the ones not seen before
        if what == "random":
            proc = start(faulty, args.steps, resume)
            first = _first_step_left(faulty)
            # a random kill always leaves a step to run, so that the run cannot finish under it
            if rng.random() < 0.25 or first > args.steps - 3:  # while starting: imports, model, restore, warm start
                time.sleep(rng.uniform(0, 0.5 * startup))
            else:  # during a random remaining step, at a random point of it (a checkpoint write included)
                target = rng.randrange(first, args.steps - 2)
                while proc.poll() is None and target not in _logged_steps(faulty, before):
                    time.sleep(0.02)
                time.sleep(rng.uniform(0, 0.5 * step_s))
        else:
            marker.unlink(missing_ok=True)
            proc = start(
                faulty, args.steps, resume, stall="checkpoint:1" if what == "checkpoint" else "export", marker=marker
            )
            while not marker.exists() and proc.poll() is None:
                time.sleep(0.05)
        if kill(proc):
            done.append(what)
            print(f"kill {len(done)}: {what:10s} ({'resumed' if resume else 'from scratch'})")
        else:
            print(
                f"(the {what} attempt ended before its kill: rc {proc.returncode}"
                f"{' ' + proc.stderr.read()[-500:] if proc.returncode else ''})"
            )
    proc = start(faulty, args.steps, resume=(faulty / "checkpoints" / "last.ckpt").exists())
    _, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"the final resume failed ({proc.returncode}):\n{err[-3000:]}")

    # one file per run since resumes continue it (lit_gspo/lightning/metrics_file.py); older runs had one per attempt
    attempts = sorted(faulty.glob("**/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[-1]))
    union, wrong_attempts = {}, 0
    for i, path in enumerate(attempts):
        values = logged(path)
        wrong = {k: (v, expected.get(k)) for k, v in values.items() if expected.get(k) != v}
        union.update(values)
        wrong_attempts += bool(wrong)
        if wrong:
            print(
                f"attempt {i} logged {len(wrong)} values that differ from the reference, e.g. {list(wrong.items())[:3]}"
            )
    lost = sorted(set(expected) - set(union))
    if lost:
        print(f"lost: {lost[:10]}{' ...' if len(lost) > 10 else ''}")
    a, b = weights(reference), weights(faulty)
    same_weights = a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    # every kill is followed by a restart; a restart is exact when it logged only the reference's values (and the
    # last one also ends on the reference's weights)
    exact = max(len(done) - wrong_attempts - (not same_weights), 0)
    stale = [p.name for p in (faulty / "checkpoints").iterdir() if ".tmp-" in p.name] + [
        p.name for p in faulty.iterdir() if ".tmp-" in p.name or ".old-" in p.name
    ]
    kinds = {k: done.count(k) for k in ("random", "checkpoint", "export")}
    print(
        f"{len(done)} kills, {exact} exact resumes, {len(lost)} lost "
        f"({kinds['random']} at random times, {kinds['checkpoint']} inside a checkpoint write, {kinds['export']} inside "
        f"the export; final weights {'bitwise equal' if same_weights else 'DIFFER'}; "
        f"{len(stale)} temporary files left)"
    )
    print(f"runs in {root}")
    if lost or exact != len(done) or len(done) != len(plan) or stale:
        sys.exit(1)


def _rows(root: Path) -> set[tuple]:
    """Every metrics row under ``root``, whole (its time/* columns tell one attempt's row from another's)."""
    rows = set()
    for path in root.glob("**/metrics.csv"):
        try:
            with open(path) as fh:
                rows |= {tuple(sorted(r.items())) for r in csv.DictReader(fh)}
        except (OSError, ValueError):
            pass
    return rows


def _logged_steps(root: Path, before: set[tuple]) -> set[int]:
    """The RL steps whose train row was logged since ``before`` was taken."""
    return {int(dict(r)["step"]) for r in _rows(root) - before if dict(r).get("train/reward")}


def _first_step_left(root: Path) -> int:
    """The first RL step a restart will run: the last checkpoint's counter (0 without one)."""
    last = root / "checkpoints" / "last.ckpt"
    if not last.exists():
        return 0
    import torch

    return int(torch.load(last, map_location="cpu", weights_only=True).get("rl_step", 0))


if __name__ == "__main__":
    main()
