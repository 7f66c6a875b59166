"""Minibatch-gradient noise against completion length, token ratios (GRPO) vs sequence ratios (GSPO).

    python benchmarks/length_noise.py --rollout runs/length_noise/rollouts/step_10.pt --out docs/compare/length_noise

Issue 18 §4, claim 1: "noise grows with length under token ratios, not under sequence ratios". One frozen rollout
(``lit-gspo fit ... --model.generation.dump_every_n_steps N``), the weights that sampled it (θ0), and the machinery
of ``lit-gspo compare`` (``lit_gspo/tools/compare.py``: the same ``Learner`` as ``fit``, its normalisers, micro-batches
and zero-advantage row skipping; the run's optimiser and its saved state):

1. **Weights that moved.** A driver objective (default the plain policy gradient ``pg``, which favours neither
   side) takes K full-batch optimiser steps on the whole rollout (K epochs × 1 minibatch, step 1 on-policy);
   θ0, θ1, …, θK are kept. Every objective is then measured from the same θk, so it sees the same ratios.
2. **Buckets.** The rollout's non-empty rows, sorted by completion length, are cut into ``--buckets`` groups of
   (near) equal count.
3. **Noise.** For each k, bucket and objective: the gradient of the whole bucket as one minibatch (ḡ, with the
   objective's normalisers over the bucket) and the gradients g_1..g_D of ``--draws`` minibatches of
   ``--minibatch_size`` rows drawn from the bucket without replacement (the same draws for every objective and
   k). Ratios are taken against θ0 (the rollout's old log-probs), so at k = 0 they are 1. Reported:
   ``rel_trace_cov`` = tr Cov(g_d) / ‖ḡ‖² (sample covariance over the draws) and ``rel_msd`` = mean_d ‖g_d − ḡ‖² / ‖ḡ‖²,
   the noise of one minibatch's gradient relative to the signal, comparable across objectives of other scales.
   The same for ``on-policy at θk``: the first objective with its old log-probs θk's own (ratios 1; at θk GRPO and
   GSPO are then the same gradient), the row-sampling noise that any objective has at θk; each objective's
   ``inflation`` = its rel_trace_cov / that one's, the share of the noise the importance ratios (and clipping) add.
4. **Ratio spread** per bucket at each θk (against θ0): std over the bucket's tokens of log r_t, std over its
   rows of GSPO's log s_i = mean_t log r_t and of log ∏_t r_t = Σ_t log r_t.

At k = 0 GRPO and GSPO (both ``seq-mean-token-mean``) have the same gradient on any minibatch: both are
(1/B) Σ_i Â_i (1/|y_i|) Σ_t ∇ log π(y_it), so their noise is equal there (tests/test_length_noise.py). Writes
``<out>/length_noise.json`` and ``<out>/length_noise.png``, prints a markdown table and the command.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

from lit_gspo.rl.learn.diagnostics import sequence_log_ratio
from lit_gspo.rl.learn.learner import Learner
from lit_gspo.rl.learn.old_policy import GivenOldLogprobs
from lit_gspo.rl.objectives import Objective
from lit_gspo.runtime.extras import pyplot
from lit_gspo.tools.compare_replay import (
    PolicyGradient,
    Replay,
    ReplayLearner,
    _Optimizer,
    fresh_optimizer,
    load_replay,
    parse_spec,
    replay_optimizer,
    update_of,
)

ON_POLICY = "on-policy at θk"  # the first objective with ratios 1 at θk: GRPO's and GSPO's (seq-mean-token-mean) alike
DEFAULT_OBJECTIVES = ["grpo", "gspo", "grpo:clip_low=inf,clip_high=inf", "gspo:clip_low=inf,clip_high=inf"]


def minibatch_gradient(replay: Replay, objective: Objective, rows: Tensor, old_logprobs: Tensor) -> Tensor:
    """The flat gradient (before clipping) of ``rows`` as one minibatch at the policy's current weights, the
    objective's normalisers over those rows, ratios against ``old_logprobs`` (N, T); the weights do not change."""
    sub = replay.batch.select(rows)
    sub.old_logprobs = old_logprobs[rows].clone()
    # π_old = the rollout's old log-probs (θ0's), not the first step's own forward: ratios against θ0
    learner = ReplayLearner(
        replay.policy,
        objective,
        update_of(replay.meta, epochs=1, num_minibatches=1),
        orders=[torch.arange(len(rows))],
        old_policy=GivenOldLogprobs(),
        **replay.learner_kwargs,
    )
    learner.learn(sub, _Optimizer(replay.policy))
    return learner.steps[0]["grad"]


def gradient_noise(grads: list[Tensor], full: Tensor) -> dict[str, float]:
    """Noise of the minibatch gradients ``grads`` around ``full`` (the whole bucket's), absolute and relative to ‖full‖²."""
    g = torch.stack([x.double() for x in grads])  # (D, P)
    full = full.double()
    trace_cov = float(((g - g.mean(0)) ** 2).sum(1).sum() / (len(g) - 1)) if len(g) > 1 else float("nan")
    msd = float(((g - full) ** 2).sum(1).mean())
    norm2 = float(full @ full)
    rel = lambda v: v / norm2 if norm2 > 0 else float("nan")
    return {
        "trace_cov": trace_cov,
        "msd": msd,
        "full_norm2": norm2,
        "rel_trace_cov": rel(trace_cov),
        "rel_msd": rel(msd),
    }


def length_buckets(lengths: Tensor, num_buckets: int) -> list[Tensor]:
    """Row indices of the non-empty rows, sorted by length (then index), cut into up to ``num_buckets`` parts of
    near-equal count; rows of one length stay in one bucket (so a cut moves to the next change of length)."""
    rows = torch.nonzero(lengths > 0).flatten()
    rows = rows[torch.sort(lengths[rows], stable=True).indices]
    sorted_lengths, cuts = lengths[rows], [0]
    for i in range(1, num_buckets):
        cut = max(round(i * len(rows) / num_buckets), cuts[-1])
        while 0 < cut < len(rows) and sorted_lengths[cut] == sorted_lengths[cut - 1]:
            cut += 1
        cuts.append(cut)
    cuts.append(len(rows))
    return [rows[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]


def bucket_spread(logprobs: Tensor, start: Tensor, mask: Tensor, rows: Tensor) -> dict[str, float]:
    """Spread of the log-ratios of ``logprobs`` against ``start`` over ``rows``: per token and per sequence."""
    mask = mask[rows].bool()
    token = (logprobs[rows].double() - start[rows].double())[mask]
    sums, lengths = sequence_log_ratio(logprobs[rows], start[rows], mask)
    std = lambda x: float(x.std(unbiased=False)) if x.numel() >= 2 else float("nan")
    return {"token_logr_std": std(token), "seq_logs_std": std(sums / lengths), "seq_sum_logr_std": std(sums)}


def run_length_noise(
    rollout: str,
    model: str | None = None,
    objectives: list[str] | None = None,
    driver: str = "pg",
    steps: int = 3,
    num_buckets: int = 4,
    minibatch_size: int = 8,
    draws: int = 32,
    lr: float | None = None,
    optimizer_state: bool = True,
    seed: int = 0,
    device: str = "cpu",
    command: str | None = None,
) -> dict:
    """The measurement of the module docstring; returns what length_noise.json holds."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    specs = [parse_spec(s) for s in (objectives or DEFAULT_OBJECTIVES)]
    replay = load_replay(rollout, model, device)
    batch, policy = replay.batch, replay.policy
    n, mask = len(batch), batch.completion_mask
    every = torch.arange(n)
    base = Learner(policy, PolicyGradient(), update_of(replay.meta), **replay.learner_kwargs)
    start = base.old_logprobs(batch, every)  # θ0's log-probs: the old policy of every ratio
    lengths = mask.sum(1).cpu()
    buckets = length_buckets(lengths, num_buckets)
    size = min([minibatch_size] + [len(b) - 1 for b in buckets])
    if size < 1:
        raise ValueError(f"buckets of {min(len(b) for b in buckets)} rows are too small: lower --buckets")
    gen = torch.Generator().manual_seed(seed)
    draw_rows = [[b[torch.randperm(len(b), generator=gen)[:size]] for _ in range(draws)] for b in buckets]

    # 1. θ0..θK: K full-batch steps of the driver on the whole rollout
    snapshots = [{k: v.detach().clone() for k, v in policy.state_dict().items()}]
    driver_label, driver_obj = ("pg", PolicyGradient()) if driver == "pg" else parse_spec(driver)
    opt_name, opt_hparams, saved_state = replay_optimizer(replay, lr=lr, optimizer_state=optimizer_state)
    if steps:
        stepper = ReplayLearner(
            policy,
            driver_obj,
            update_of(replay.meta, epochs=steps, num_minibatches=1),
            orders=[every] * steps,
            **replay.learner_kwargs,
        )
        after = lambda: snapshots.append({k: v.detach().clone() for k, v in policy.state_dict().items()})
        stepper.learn(
            batch.select(every), _Optimizer(policy, fresh_optimizer(policy, opt_name, opt_hparams, saved_state), after)
        )

    # 2-4. per θk, bucket and objective
    results = []
    for k, weights in enumerate(snapshots):
        policy.load_state_dict(weights)
        current = base.old_logprobs(batch, every)
        for b, rows in enumerate(buckets):
            entry = {
                "k": k,
                "bucket": b,
                "rows": len(rows),
                "min_length": int(lengths[rows].min()),
                "max_length": int(lengths[rows].max()),
                "mean_length": float(lengths[rows].double().mean()),
                **bucket_spread(current.cpu(), start.cpu(), mask.cpu(), rows),
                "objectives": {},
            }
            for label, objective, old in [(ON_POLICY, specs[0][1], current)] + [(lb, o, start) for lb, o in specs]:
                full = minibatch_gradient(replay, objective, rows, old)
                grads = [minibatch_gradient(replay, objective, r, old) for r in draw_rows[b]]
                entry["objectives"][label] = noise = gradient_noise(grads, full)
                noise["inflation"] = noise["rel_trace_cov"] / entry["objectives"][ON_POLICY]["rel_trace_cov"]
            results.append(entry)
            print(
                f"length_noise: k={k} bucket {b} (lengths {entry['min_length']}-{entry['max_length']}) "
                + ", ".join(f"{label} {v['rel_trace_cov']:.3g}" for label, v in entry["objectives"].items()),
                flush=True,
            )
    return {
        "command": command,
        "rollout": str(replay.rollout_file),
        "step": replay.payload["step"],
        "model": replay.model_source,
        "rows": n,
        "objectives": [ON_POLICY] + [label for label, _ in specs],
        "settings": {
            "driver": driver_label,
            "steps": steps,
            "buckets": len(buckets),
            "minibatch_size": size,
            "draws": draws,
            "optimizer": opt_name,
            "optimizer_hparams": opt_hparams,
            "optimizer_state": saved_state is not None,
            "seed": seed,
            "device": device,
        },
        "results": results,
        "seconds": time.perf_counter() - t0,
    }


def short(label: str) -> str:
    return label.replace(":clip_low=inf,clip_high=inf", " (no clip)")


def table(report: dict, key: str = "rel_trace_cov") -> list[str]:
    """One row per (k, bucket): lengths, ratio spreads, then ``key`` per objective."""
    labels = report["objectives"]
    head = ["k", "lengths", "rows", "std log r_t", "std log s_i", "std Σ log r"] + [short(label) for label in labels]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for e in report["results"]:
        cells = [
            str(e["k"]),
            f"{e['min_length']}–{e['max_length']} (mean {e['mean_length']:.1f})",
            str(e["rows"]),
            f"{e['token_logr_std']:.3g}",
            f"{e['seq_logs_std']:.3g}",
            f"{e['seq_sum_logr_std']:.3g}",
        ]
        cells += [f"{e['objectives'][label][key]:.3g}" for label in labels]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(path: Path, report: dict) -> None:
    plt = pyplot("Plotting the length-noise report")

    ks = sorted({e["k"] for e in report["results"]})
    fig, axes = plt.subplots(1, len(ks) + 1, figsize=(3.6 * (len(ks) + 1), 3.3), dpi=80)
    for ax, k in zip(axes, ks):
        rows = [e for e in report["results"] if e["k"] == k]
        x = [e["mean_length"] for e in rows]
        for i, label in enumerate(report["objectives"]):
            ax.plot(
                x,
                [e["objectives"][label]["rel_trace_cov"] for e in rows],
                label=short(label),
                marker="o",
                ms=3,
                ls=["-", "--", ":", "-."][i % 4],
            )
        ax.set_yscale("log")
        ax.set_title(f"tr Cov(g_B) / ‖ḡ‖², after {k} step(s)", fontsize=9)
    ax = axes[-1]
    for k in ks:
        rows = [e for e in report["results"] if e["k"] == k]
        x = [e["mean_length"] for e in rows]
        (line,) = ax.plot(x, [e["token_logr_std"] for e in rows], marker="o", ms=3, label=f"std log r_t, k={k}")
        ax.plot(
            x,
            [e["seq_logs_std"] for e in rows],
            marker="s",
            ms=3,
            ls="--",
            color=line.get_color(),
            label=f"std log s_i, k={k}",
        )
    ax.set_title("ratio spread against θ0", fontsize=9)
    for ax in axes:
        ax.set_xlabel("mean completion length of the bucket", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    axes[-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rollout", required=True, help="<run>/rollouts/step_K.pt of a fit with --model.generation.dump_every_n_steps"
    )
    parser.add_argument("--model", default=None, help="weights to start from (default: the rollout's step_K_policy/)")
    parser.add_argument(
        "--objectives",
        nargs="+",
        default=None,
        help=f"objective specs as in lit-gspo compare (default: {' '.join(DEFAULT_OBJECTIVES)})",
    )
    parser.add_argument("--driver", default="pg", help="objective that moves the weights: pg (plain PG) or a spec")
    parser.add_argument("--steps", type=int, default=3, help="K full-batch optimiser steps of the driver")
    parser.add_argument("--buckets", type=int, default=4, help="length buckets of near-equal row counts")
    parser.add_argument("--minibatch_size", type=int, default=8, help="rows per drawn minibatch")
    parser.add_argument("--draws", type=int, default=32, help="minibatches drawn per bucket")
    parser.add_argument("--lr", type=float, default=None, help="the driver's learning rate (default: the run's)")
    parser.add_argument("--fresh_optimizer", action="store_true", help="not the run's saved optimiser state")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="output folder (default: <run>/rollouts/length_noise_step_K/)")
    ns = parser.parse_args(argv)
    command = "python benchmarks/length_noise.py " + shlex.join(argv)
    report = run_length_noise(
        ns.rollout,
        ns.model,
        ns.objectives,
        ns.driver,
        ns.steps,
        ns.buckets,
        ns.minibatch_size,
        ns.draws,
        ns.lr,
        not ns.fresh_optimizer,
        ns.seed,
        ns.device,
        command,
    )
    out = Path(ns.out) if ns.out else Path(ns.rollout).parent / f"length_noise_{Path(ns.rollout).stem}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "length_noise.json").write_text(json.dumps(report, indent=1))
    plot(out / "length_noise.png", report)
    print("tr Cov(g_B) / ‖ḡ‖²:\n" + "\n".join(table(report)))
    print("\ninflation (÷ on-policy at θk):\n" + "\n".join(table(report, "inflation")))
    print(f"\nlength_noise: wrote {out / 'length_noise.json'}, {out / 'length_noise.png'} ({report['seconds']:.0f} s)")
    print(f"reproduce: {command}", flush=True)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
