"""``lit-gspo compare``: one frozen rollout replayed through every objective, from the same weights.

    lit-gspo fit --config configs/quickstart.yaml --trainer.max_steps 101 --model.generation.dump_every_n_steps 100
    lit-gspo compare --rollout runs/quickstart/rollouts/step_100.pt --objectives gspo grpo dapo sapo --out docs/compare/x

The rollout file (``lit_gspo/rl/rollout_io.py``) holds the tokens, masks, rewards and advantages of one RL step;
its ``step_K_policy/`` the weights that sampled it. For each objective, from a fresh copy of those weights:

1. **on-policy gradient**: the ``Learner`` runs one epoch × one minibatch over the whole rollout (the ratio is
   exactly 1) and the gradient is read before any step: its norm, its cosine with every other objective's
   and with the plain policy gradient PG = ∇θ (1/N_tokens) Σ_i Σ_t m_it Â_it log π_θ(y_it) (REINFORCE with the
   rollout's advantages as the baseline-corrected return; DAPO's on-policy gradient equals it exactly);
2. **off-policy replay**: ``--minibatch_steps K`` real optimiser steps by the ``Learner`` (K / M epochs × M
   minibatches, the run's ``model.update`` settings otherwise), an optimiser of the run's class and
   hyperparameters (and the run's optimiser state when the rollout's policy was saved with it), the same seed
   and the same minibatch order for every objective. At each step: the
   gradient norm (before clipping), its cosine with the PG of the same minibatch's rows at the starting
   weights (what an on-policy step on those rows would follow), the clip fraction (the objective's
   ``clip_frac``: tokens whose gradient the clip zeroes) and the share of tokens carrying gradient; after
   each step, over the whole rollout, the spread of the sequence log-ratio log ∏_t r_t = Σ_t log r_t (std),
   of GSPO's log s_i = Σ_t log r_t / |y_i| (std), the share of sequences whose s_i lies outside GSPO's
   default clip range and the share of tokens whose r_t lies outside GRPO's.

Tokens carrying gradient: the valid (mask = 1) completion tokens of the minibatch whose per-token gradient
weight w_t = ∂loss/∂log π_θ(y_t) is non-zero in fp32 (the parameter gradient is Σ_t w_t ∇θ log π_θ(y_t)); rows
the Learner skips because Â = 0 everywhere count as tokens without gradient (their w_t is exactly 0).

Objectives are given by registered name (``OBJECTIVES``, so new ones appear without changes here) with
optional hyperparameters: ``grpo:aggregation=token-mean``, ``gspo:clip_low=5e-4,clip_high=6e-4``.
Objectives that need a critic (PPO) are left out: a frozen rollout has no values to train one on.
Writes ``<out>/report.md``, ``<out>/compare.json``, ``<out>/gradient_cosine.png`` and ``<out>/ratio_spread.png``
(the plots need matplotlib, ``pip install 'lit-gspo[plot]'``; without it the report says so and the rest is written).
"""

from __future__ import annotations

import shlex

from jsonargparse import ArgumentParser

DESCRIPTION = (
    "Replay one saved rollout through several objectives from the same weights: gradients, cosines, "
    "clipping, tokens with gradient, ratio spread after K off-policy minibatch steps."
)


def default_specs() -> list[str]:
    """Every registered objective that needs no critic, in registry order."""
    from lit_gspo.rl.objectives import OBJECTIVES

    return [name for name, cls in OBJECTIVES.items() if not cls.needs_critic]


def make_parser() -> ArgumentParser:
    """The ``lit-gspo compare`` arguments (``lit-gspo --help`` lists this parser's description)."""
    parser = ArgumentParser(prog="lit-gspo compare", description=DESCRIPTION)
    parser.add_argument(
        "--rollout",
        type=str,
        required=True,
        help="a rollout file of a fit run with --model.generation.dump_every_n_steps N: <run>/rollouts/step_K.pt",
    )
    parser.add_argument(
        "--model",
        type=str | None,
        default=None,
        help="the weights to replay from: an HF dir, a built-in name, a hub id, or the run's .ckpt of that "
        "step (null: the rollout's own <run>/rollouts/step_K_policy/, the policy that sampled it)",
    )
    parser.add_argument(
        "--objectives",
        type=str,
        nargs="+",
        default=None,
        help="registered objectives, each NAME or NAME:key=value,... e.g. gspo grpo dapo "
        "grpo:aggregation=token-mean gspo:clip_high=5e-4 (null: every registered objective "
        f"without a critic: {' '.join(default_specs())})",
    )
    parser.add_argument(
        "--minibatch_steps",
        type=int,
        default=4,
        help="K: the off-policy optimiser steps each objective takes on the rollout (the first is on-policy)",
    )
    parser.add_argument(
        "--num_minibatches",
        type=int | None,
        default=None,
        help="M: minibatches the rollout is split into; K/M epochs (null: K, one epoch)",
    )
    parser.add_argument(
        "--optimizer",
        type=str | None,
        default=None,
        help="torch.optim class of the replay's fresh optimiser (null: the run's, else AdamW)",
    )
    parser.add_argument(
        "--lr",
        type=float | None,
        default=None,
        help="its learning rate (null: the run's when the rollout was saved, else 1e-3)",
    )
    parser.add_argument(
        "--optimizer_state",
        type=bool,
        default=True,
        help="start from the run's optimiser state saved with the policy (step_K_policy/optimizer.pt: "
        "Adam's moments), as the run's next minibatch step would; false, or none saved: a fresh state",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the minibatch order (the same for every objective)"
    )
    parser.add_argument("--device", type=str, default="cpu", help="e.g. cpu, cuda")
    parser.add_argument(
        "--out",
        type=str | None,
        default=None,
        help="output folder: report.md, compare.json, gradient_cosine.png, ratio_spread.png (the plots need the "
        "plot extra; null: <run>/rollouts/compare_step_K/)",
    )
    return parser


def main(argv: list[str]) -> dict:
    """``lit-gspo compare ARGS``."""
    ns = make_parser().parse_args(argv)
    from lit_gspo.tools.compare_replay import run_compare

    command = "lit-gspo compare " + shlex.join(argv)
    return run_compare(
        ns.rollout,
        model=ns.model,
        objectives=ns.objectives,
        minibatch_steps=ns.minibatch_steps,
        num_minibatches=ns.num_minibatches,
        optimizer=ns.optimizer,
        lr=ns.lr,
        optimizer_state=ns.optimizer_state,
        seed=ns.seed,
        device=ns.device,
        out=ns.out,
        command=command,
    )
