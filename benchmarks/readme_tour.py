"""Replay the README's tour, as written, in a temporary directory with few steps; print each command's outcome.

    python benchmarks/readme_tour.py                 # prints a Markdown table (docs/readme_tour.md holds one)
    python benchmarks/readme_tour.py --steps 5 --keep /tmp/tour

The commands are read from README.md's ``bash`` blocks (:func:`tour_commands`): every ``lit-gspo fit --config
configs/quickstart.yaml ...`` that writes the quickstart's own directory (no ``--trainer.default_root_dir`` of its
own; the install line's is included) and every ``lit-gspo eval``, in README order. Each runs as ``python -m
lit_gspo.tools.main`` in a directory holding a link to ``configs/`` and the ``test.jsonl`` the README's second eval line
reads (reversal prompts with their answers). Fits get :func:`tiny` settings appended (``--trainer.max_steps N`` and
a small data set; a resume ``2N`` steps, so that it has steps to continue), which the README's own options do not
override: each command keeps its meaning, only shorter.

For each command: exit code, seconds, and one line (the ``fit:``/``eval:`` notes the command printed, else its last
line). Exits non-zero when a command failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lit_gspo.runtime.hardware import cpu_model

ROOT = Path(__file__).resolve().parents[1]

#: appended to each fit: a small data set, few generations, a short warm start, validation every 2 steps
TINY_FIT = [
    "--model.policy.warm_start.steps",
    "5",
    "--model.validation.every_n_steps",
    "2",
    "--data.num_train",
    "64",
    "--data.num_val",
    "8",
    "--data.prompts_per_step",
    "8",
    "--model.generation.num_generations",
    "4",
    "--trainer.enable_progress_bar",
    "false",
]


def tour_commands(readme: str) -> list[list[str]]:
    """The tour's commands (the arguments after ``lit-gspo``) from README.md's ``bash`` blocks, in order."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("&&")[-1].strip()  # the install line: the part after `pip install ... &&`
            if not line.startswith("lit-gspo "):
                continue
            argv = shlex.split(line, comments=True)[1:]
            quickstart_fit = argv[:3] == ["fit", "--config", "configs/quickstart.yaml"]
            if (quickstart_fit and "--trainer.default_root_dir" not in argv) or argv[:1] == ["eval"]:
                commands.append(argv)
    return commands


def tiny(argv: list[str], steps: int) -> list[str]:
    """``argv`` with the few-steps settings of a fit appended (a resume gets twice the steps: it continues)."""
    if argv[:1] != ["fit"] or "--print_config" in argv:
        return list(argv)
    return list(argv) + TINY_FIT + ["--trainer.max_steps", str(2 * steps if "--ckpt_path" in argv else steps)]


def prepare(workdir: Path) -> None:
    """``configs/`` (a link to the repository's) and ``test.jsonl`` (reversal prompts and answers) in ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "configs").exists():
        (workdir / "configs").symlink_to(ROOT / "configs")
    numbers = ["123", "450", "907", "318", "562", "774"]
    (workdir / "test.jsonl").write_text(
        "".join(json.dumps({"prompt": f"rev {n}=", "answer": n[::-1]}) + "\n" for n in numbers)
    )


def summary(output: str) -> str:
    """One line: the ``fit:``/``eval:`` notes and ``error:`` lines of a command's output, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    notes = [line for line in lines if line.startswith(("fit:", "eval:", "error:", "Restored all states"))]
    notes = [n for n in notes if not n.startswith("eval: wrote")]
    text = " / ".join(notes) if notes else (lines[-1] if lines else "")
    return text if len(text) <= 400 else text[:397] + "..."


def run(argv: list[str], workdir: Path, timeout: float = 600) -> tuple[int, float, str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
        "PYTHONWARNINGS": "ignore",
    }
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "lit_gspo.tools.main", *argv],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    seconds = time.perf_counter() - start
    if "--print_config" in argv and proc.returncode == 0:
        nulls = sum(line.rstrip().endswith(": null") for line in proc.stdout.splitlines())
        return proc.returncode, seconds, f"printed the config: {len(proc.stdout.splitlines())} lines, {nulls} null"
    return proc.returncode, seconds, summary(proc.stdout + "\n" + proc.stderr).replace(f"{workdir}/", "")


def cpu_name() -> str:
    return f"{cpu_model()}, {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="RL steps of each fit (a resume: twice as many)")
    parser.add_argument("--keep", type=Path, default=None, help="run in this directory and keep it")
    args = parser.parse_args(argv)
    commands = tour_commands((ROOT / "README.md").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep or Path(tmp)
        prepare(workdir)
        print(
            f"# The README's tour, replayed\n\nGenerated by `python benchmarks/readme_tour.py --steps {args.steps}` "
            f"({time.strftime('%Y-%m-%d')}, {cpu_name()}): the README's commands as written, in order, in an empty "
            f"directory; each fit with {args.steps} RL steps (a resume {2 * args.steps}) on a small data set "
            f"(`{' '.join(TINY_FIT)}`). Seconds include starting Python; load average at the start: "
            f"{os.getloadavg()[0]:.1f}.\n"
        )
        print("| # | command (after `lit-gspo`) | exit | s | outcome |\n|---:|---|---:|---:|---|")
        failed = 0
        for i, command in enumerate(commands, 1):
            code, seconds, line = run(tiny(command, args.steps), workdir)
            failed += code != 0
            print(f"| {i} | `{shlex.join(command)}` | {code} | {seconds:.1f} | {line.replace('|', '/')} |", flush=True)
        runs = sorted(p.relative_to(workdir).as_posix() for p in (workdir / "runs").glob("*") if p.is_dir())
        print(
            f"\nRun directories written: {', '.join(f'`{r}`' for r in runs)}. {len(commands) - failed} of "
            f"{len(commands)} commands exited 0."
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
