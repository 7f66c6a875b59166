"""Sample completions as a text table (step, prompt, completion, reward, answer) in the configured loggers.

``RLModule`` calls :func:`log_completions` from its validation with the first completions of the held-out prompts
(greedy, or each prompt's n samples), so a run shows what the model writes, not only its reward:

    CSVLogger          <log_dir>/completions.csv, one row per completion, appended at every logged step
    TensorBoardLogger  add_text("val/completions", a Markdown table, step)
    WandbLogger        log_table("val/completions", columns, rows, step)
    MLFlowLogger       log_text: completions/step_<step>.md in the run's artifacts
    other loggers      nothing (a logger with a ``log_dir`` gets the CSV file)

With ``validation.print_completions`` they are also printed on the terminal, as TRL's ``log_completions`` does: one line per
completion with its prompt, the completion, the reward and each reward function's score (:func:`terminal_table`).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger

COLUMNS = ["step", "prompt", "completion", "reward", "answer"]
FILE_NAME = "completions.csv"


def due(step: int, every: int | None) -> bool:
    """Whether a validation at ``step`` logs completions: every validation (None), never (0), or steps that are multiples of ``every``."""
    return every is None or (every > 0 and step % every == 0)


def prompt_text(prompt) -> str:
    """A prompt as one string: text as is, chat messages as ``role: content`` lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in prompt)


def table(step: int, rows: list[dict], replies: list[str], rewards: list[float]) -> list[list]:
    """One ``COLUMNS`` row per completion."""
    return [
        [
            step,
            prompt_text(row.get("prompt", "")),
            reply,
            float(reward),
            "" if row.get("answer") is None else str(row["answer"]),
        ]
        for row, reply, reward in zip(rows, replies, rewards)
    ]


def markdown(data: list[list]) -> str:
    """A Markdown table (TensorBoard renders it); cells on one line, ``|`` escaped."""

    def cell(value) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in data])


def _clip(text: str, width: int) -> str:
    """One line of at most ``width`` characters (newlines as ⏎, the cut marked with …)."""
    text = str(text).replace("\r", "").replace("\n", "⏎")
    return text if len(text) <= width else text[: width - 1] + "…"


def terminal_table(
    step: int,
    split: str,
    rows: list[dict],
    replies: list[str],
    rewards: list[float],
    per_function: dict[str, list[float]],
    width: int = 48,
    samples_per_prompt: int = 0,
) -> str:
    """The completions as a text table for the terminal: prompt, completion, reward, then each function's score
    (``-`` where it failed or gave None); prompts and completions cut to ``width`` characters. ``samples_per_prompt``:
    0 for greedy completions (one per prompt), else n sampled per prompt."""
    header = ["prompt", "completion", "reward", *per_function]
    body = [
        [
            _clip(prompt_text(row.get("prompt", "")), width),
            _clip(reply, width),
            f"{float(reward):.3f}",
            *("-" if value != value else f"{value:.3f}" for value in (scores[i] for scores in per_function.values())),
        ]
        for i, (row, reply, reward) in enumerate(zip(rows, replies, rewards))
    ]
    widths = [max(len(line[c]) for line in [header, *body]) for c in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) if c < 2 else cell.rjust(w) for c, (cell, w) in enumerate(zip(line, widths)))
        for line in [header, *body]
    ]
    which = (
        f"{samples_per_prompt} sampled per prompt, the first {len(body)}"
        if samples_per_prompt
        else f"greedy, the first {len(body)} held-out prompts"
    )
    title = f"step {step}: {split} completions, {which}"
    return "\n".join([title, *lines])


def write_csv(path: Path, data: list[list]) -> None:
    """Append to ``path`` (with a header when the file is new)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(COLUMNS)
        writer.writerows(data)


def truncate_after(path: Path, step: int) -> int:
    """Drop the rows of ``path`` (a ``completions.csv``) logged after RL step ``step``; returns how many were dropped."""
    if not path.is_file():
        return 0
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[:1], rows[1:]
    kept = [row for row in body if not row or not row[0].lstrip("-").isdigit() or int(row[0]) <= step]
    if len(kept) < len(body):
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "w", newline="") as f:
            csv.writer(f).writerows(header + kept)
        os.replace(tmp, path)
    return len(body) - len(kept)


def log_completions(
    loggers: list[Logger], step: int, rows: list[dict], replies: list[str], rewards: list[float]
) -> None:
    """Log ``rows``' completions ``replies`` and their ``rewards`` at ``step`` to each logger (call on rank 0 only)."""
    if not rows:
        return
    data = table(step, rows, replies, rewards)
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text("val/completions", markdown(data), global_step=step)
        elif isinstance(logger, WandbLogger):
            logger.log_table(key="val/completions", columns=COLUMNS, data=data, step=step)
        elif isinstance(logger, MLFlowLogger):
            logger.experiment.log_text(logger.run_id, markdown(data), f"completions/step_{step:06d}.md")
        elif isinstance(logger, CSVLogger) or getattr(logger, "log_dir", None):
            write_csv(Path(os.fspath(logger.log_dir)) / FILE_NAME, data)
