"""The outputs of ``lit-gspo compare``: the terminal table, report.md, compare.json and two plots (matplotlib Agg, the
``plot`` extra: without it the rest is written and the report says how to get them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from lit_gspo.runtime.extras import MissingExtraError, pyplot

COLUMNS = [  # (header, how to read the value out of one objective's results)
    ("aggregation", lambda r: r["aggregation"] or "–"),
    ("‖g‖ on-policy", lambda r: r["on_policy"]["grad_norm"]),
    ("cos(g, PG) on-policy", lambda r: r["on_policy"]["cos_pg"]),
    ("tokens w/ grad on-policy", lambda r: r["on_policy"]["grad_token_share"]),
    ("clip frac, off-policy steps", lambda r: _mean([s["clip_frac"] for s in r["steps"][1:]])),
    ("tokens w/ grad, off-policy steps", lambda r: _mean([s["grad_token_share"] for s in r["steps"][1:]])),
    ("cos(g_K, PG_K)", lambda r: r["steps"][-1]["cos_pg"]),
    ("std Σlog r after K", lambda r: r["spread"][-1]["seq_logratio_std"]),
    ("std log s after K", lambda r: r["spread"][-1]["seq_geo_logratio_std"]),
    ("seqs outside GSPO clip after K", lambda r: r["spread"][-1]["seqs_outside_gspo_clip"]),
    ("tokens outside GRPO clip after K", lambda r: r["spread"][-1]["tokens_outside_grpo_clip"]),
]


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def _cell(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def table(report: dict) -> list[str]:
    """The markdown table: one row per objective."""
    lines = ["| objective | " + " | ".join(h for h, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    pg = report["pg"]
    lines.append(
        f"| PG (plain ∇ Σ Â log π) | token-mean | {_cell(pg['grad_norm'])} | 1 | {_cell(pg['grad_token_share'])} |"
        + " |" * (len(COLUMNS) - 4)
    )
    for label, result in report["objectives"].items():
        lines.append(f"| {label} | " + " | ".join(_cell(get(result)) for _, get in COLUMNS) + " |")
    return lines


def cosine_table(matrix: dict) -> list[str]:
    labels = matrix["labels"]
    lines = ["| | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for label, row in zip(labels, matrix["matrix"]):
        lines.append(f"| {label} | " + " | ".join(f"{v:.3f}" for v in row) + " |")
    return lines


def markdown(report: dict, images: list[str], reading: str | None = None, no_plots: str | None = None) -> str:
    s = report["settings"]
    run = report["run"]
    state = "the run's" if s.get("optimizer_state") else "a fresh"
    lines = [
        f"# lit-gspo compare: the rollout of step {report['step']}, {len(report['objectives'])} objectives",
        "",
        f"Rollout `{report['rollout']}`: {report['rows']} completions, {report['tokens']} completion tokens "
        f"(mean length {report['mean_length']:.2f}), mean reward {_cell(report['mean_reward'])}, "
        f"{report['rows_with_nonzero_advantage']} rows with a non-zero advantage. Sampled by a run of "
        f"`{run.get('objective')}` with `{run.get('advantage')}` advantages.",
        "",
        f"Weights `{report['model']}`: max |log π − saved old log π| over the rollout = {_cell(report['weights_gap'])} "
        "(0: the policy that sampled it).",
        "",
        f"Replay: {s['minibatch_steps']} optimiser steps ({s['epochs']} epoch(s) × {s['num_minibatches']} minibatches), "
        f"{state} `{s['optimizer']}` state "
        f"(lr {_cell(s['optimizer_hparams'].get('lr'))}), gradient clipping "
        f"{_cell(s['max_grad_norm'])}, seed {s['seed']}, the same minibatch order for every objective, {s['device']}, "
        f"{report['seconds']:.0f} s.",
        "",
        "Reproduce:",
        "",
        "```",
        report.get("command") or "lit-gspo compare ...",
        "```",
        "",
        "## Results",
        "",
        *table(report),
        "",
        "- **‖g‖ on-policy**: norm of the gradient of the whole rollout from the starting weights, before clipping "
        "(ratio exactly 1). **cos(g, PG)**: its cosine with the plain policy gradient PG = ∇ (1/N_tokens) Σ Â log π.",
        "- **clip frac**: the objective's `clip_frac` (tokens whose gradient the clip zeroes; for GSPO every token "
        "of a clipped sequence), mean over the replay's minibatch steps after the first (the off-policy ones).",
        "- **tokens w/ grad**: share of the minibatch's valid tokens with ∂loss/∂log π(y_t) ≠ 0 (fp32); tokens of "
        "rows whose Â is 0 count as without gradient.",
        f"- **cos(g_K, PG_K)**: the K-th (last) minibatch gradient against PG_K, the plain policy gradient of the "
        "same minibatch's rows at the starting weights (the on-policy direction for those rows). **std Σlog r**, "
        f"**std log s**: spread over sequences of log ∏_t r_t and of GSPO's log s_i = mean_t log r_t, r against "
        f"the starting weights, after the K steps. **outside GSPO clip**: share of sequences with s_i outside "
        f"[1 − {s['gspo_clip'][0]:g}, 1 + {s['gspo_clip'][1]:g}]; **outside GRPO clip**: share of tokens with "
        f"r_t outside [1 − {s['grpo_clip'][0]:g}, 1 + {s['grpo_clip'][1]:g}].",
        "",
        "## Gradient cosines, on-policy (the starting weights)",
        "",
        *cosine_table(report["cosine_on_policy"]),
        "",
        "## Gradient cosines at the last minibatch step",
        "",
        *cosine_table(report["cosine_last_step"]),
        "",
    ]
    if reading:
        lines += ["## Reading", "", reading.strip(), ""]
    lines += (
        ["## Plots", ""]
        + [f"![{name}]({name})" for name in images]
        + ([f"No plots: {no_plots}.", ""] if no_plots else [""])
    )
    return "\n".join(lines)


def plot_cosines(path: Path, report: dict) -> None:
    plt = pyplot("Plotting a compare report")

    panels = [
        ("on-policy gradients", report["cosine_on_policy"]),
        ("gradients at the last minibatch step", report["cosine_last_step"]),
    ]
    n = len(report["cosine_on_policy"]["labels"])
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.1 * n, 1.8 + 0.5 * n), dpi=80)
    for ax, (title, m) in zip(axes, panels):
        image = ax.imshow(m["matrix"], vmin=-1, vmax=1, cmap="RdBu_r")
        ax.set_xticks(range(len(m["labels"])), m["labels"], rotation=45, ha="right", fontsize=7)
        ax.set_yticks(range(len(m["labels"])), m["labels"], fontsize=7)
        for i, row in enumerate(m["matrix"]):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.3f}", ha="center", va="center", fontsize=6)
        ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=list(axes), shrink=0.8)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def plot_spread(path: Path, report: dict) -> None:
    plt = pyplot("Plotting a compare report")

    panels = [
        ("std over sequences of Σ_t log r_t", "spread", "seq_logratio_std"),
        ("sequences outside GSPO's clip range", "spread", "seqs_outside_gspo_clip"),
        ("clip_frac of the minibatch step", "steps", "clip_frac"),
        ("cos(minibatch gradient, PG of its rows at θ0)", "steps", "cos_pg"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.3), dpi=80)
    for i, (label, result) in enumerate(report["objectives"].items()):
        for ax, (_title, part, key) in zip(axes, panels):
            values = [s[key] for s in result[part]]
            x = range(len(values)) if part == "spread" else range(1, len(values) + 1)
            ax.plot(list(x), values, label=label, lw=1.3, marker="o", ms=3, ls=["-", "--", ":", "-."][i % 4])
    for ax, (title, part, _) in zip(axes, panels):
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("optimiser steps taken" if part == "spread" else "minibatch step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_outputs(report: dict, out: Path) -> None:
    """Print the table and the command; write report.md, compare.json and, with matplotlib (the ``plot`` extra), the
    PNGs under ``out``. Without matplotlib the report and JSON are still written, and say how to get the plots."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(report, indent=1, default=str))
    images, no_plots = [], None
    try:
        for name, plot in (("gradient_cosine.png", plot_cosines), ("ratio_spread.png", plot_spread)):
            plot(out / name, report)
            images.append(name)
    except MissingExtraError as err:  # the replay is done: keep its numbers, say how to get the plots
        no_plots = str(err)
    reading = out / "reading.md"
    (out / "report.md").write_text(
        markdown(report, images, reading.read_text() if reading.exists() else None, no_plots)
    )
    print("\n".join(table(report)))
    print(f"\ncompare: wrote {', '.join(str(out / name) for name in ['report.md', 'compare.json', *images])}")
    if no_plots:
        print(f"no plots: {no_plots}")
    print(f"reproduce: {report.get('command') or 'lit-gspo compare ...'}", flush=True)
