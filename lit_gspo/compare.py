"""``lit-gspo compare``: one frozen rollout replayed through every objective, from the same weights.

    lit-gspo fit --config configs/quickstart.yaml --trainer.max_steps 101 --model.save_rollouts_every_n_steps 100
    lit-gspo compare --rollout runs/quickstart/rollouts/step_100.pt --objectives gspo grpo dapo sapo --out docs/compare/x

The rollout file (``lit_gspo/rollout_io.py``) holds the tokens, masks, rewards and advantages of one RL step;
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

import copy
import dataclasses
import shlex
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml
from jsonargparse import ArgumentParser
from torch import Tensor

from lit_gspo.config import Update
from lit_gspo.diagnostics import sequence_log_ratio
from lit_gspo.hardware import deterministic_on_cpu
from lit_gspo.learner import Learner
from lit_gspo.objectives import OBJECTIVES, Counts, LossOutput, Objective, aggregate, get_objective
from lit_gspo.rollout import RolloutBatch
from lit_gspo.rollout_io import load_optimizer_state, load_rollout, policy_dir

DESCRIPTION = ("Replay one saved rollout through several objectives from the same weights: gradients, cosines, "
               "clipping, tokens with gradient, ratio spread after K off-policy minibatch steps.")


class PolicyGradient(Objective, register=False):
    """The plain policy gradient: ℓ = −Σ_i Σ_t m_it Â_it log π_θ(y_it) / N_tokens (no ratio, no clip)."""

    name = "pg"
    zero_advantage_has_no_gradient = True

    def policy_loss(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                    counts: Counts, **extra) -> LossOutput:
        zero = torch.zeros((), device=logprobs.device)
        return LossOutput(aggregate(-advantages * logprobs, mask, "token-mean", counts), {"clip_frac": zero})


def parse_spec(spec: str) -> tuple[str, Objective]:
    """``name[:key=value,...]`` → (label, objective); values are read as YAML scalars (``5e-4``, ``token-mean``)."""
    name, _, args = spec.partition(":")
    hparams = {}
    for item in filter(None, args.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"objective {spec!r}: expected key=value after ':', got {item!r}")
        hparams[key.strip()] = yaml.safe_load(value)
    objective = get_objective(name, **hparams)
    if objective.needs_critic:
        raise ValueError(f"objective {spec!r} trains a critic: a frozen rollout has no values for it")
    return spec, objective


def default_specs() -> list[str]:
    """Every registered objective that needs no critic, in registry order."""
    return [name for name, cls in OBJECTIVES.items() if not cls.needs_critic]


class _RecordingObjective:
    """Wraps an objective for the Learner: keeps each call's log-probs (to read ∂loss/∂logp after backward)."""

    def __init__(self, objective: Objective):
        self.objective, self.calls = objective, []

    def __getattr__(self, name):
        return getattr(self.objective, name)

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, **kwargs) -> LossOutput:
        if logprobs.requires_grad:
            logprobs.retain_grad()
        out = self.objective(logprobs, old_logprobs, advantages, mask, **kwargs)
        self.calls.append((logprobs, mask.bool(), float(out.metrics["clip_frac"]), float(mask.sum())))
        return out


class ReplayLearner(Learner):
    """The Learner with given minibatch orders, recording each optimiser step's gradient before clipping."""

    def __init__(self, *args, orders: list[Tensor], **kwargs):
        super().__init__(*args, **kwargs)
        self.objective = _RecordingObjective(self.objective)
        self.orders, self.steps, self._counts = list(orders), [], None

    def minibatch_order(self, n: int) -> Tensor:
        return self.orders.pop(0)

    def global_counts(self, mask: Tensor, emptied: int = 0) -> Counts:
        self._counts = super().global_counts(mask, emptied)
        return self._counts

    def clip_and_norm(self) -> float:
        grad = flat_grad(self.policy)
        calls, self.objective.calls = self.objective.calls, []
        tokens = max(self._counts.tokens, 1.0)  # every valid token of the minibatch, skipped rows included
        with_grad = sum(float((lp.grad.ne(0) & m).sum()) for lp, m, _, _ in calls if lp.grad is not None)
        self.steps.append({"grad": grad, "grad_norm": float(grad.double().norm()),
                           "clip_frac": sum(cf * n for _, _, cf, n in calls) / tokens, "grad_token_share": with_grad / tokens})
        return super().clip_and_norm()


class _Optimizer:
    """The real optimiser (or none: ``step`` does nothing) with a hook after each step."""

    def __init__(self, policy, optimizer=None, after_step=None):
        self.policy, self._optimizer, self.after_step = policy, optimizer, after_step
        self.param_groups = optimizer.param_groups if optimizer is not None else [{"lr": 0.0}]

    def zero_grad(self) -> None:
        self.policy.zero_grad(set_to_none=True)

    def step(self) -> None:
        if self._optimizer is not None:
            self._optimizer.step()
        if self.after_step is not None:
            self.after_step()


def flat_grad(model: torch.nn.Module) -> Tensor:
    """Every trainable parameter's gradient (0 where none), flattened, fp32 on CPU."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().flatten().cpu()
                      for p in model.parameters() if p.requires_grad])


def cosine(a: Tensor, b: Tensor) -> float:
    """cos(a, b) in float64 (NaN when either is 0)."""
    a, b = a.double(), b.double()
    denom = float(a.norm()) * float(b.norm())
    return float(a @ b) / denom if denom > 0 else float("nan")


def ratio_spread(logprobs: Tensor, start: Tensor, mask: Tensor) -> dict[str, float]:
    """Spread of the log-ratios of ``logprobs`` against ``start`` over the rollout's non-empty rows."""
    sums, lengths = sequence_log_ratio(logprobs, start, mask)
    keep = lengths > 0
    sums, lengths = sums[keep], lengths[keep]
    geo = sums / lengths
    gspo, grpo = OBJECTIVES["gspo"], OBJECTIVES["grpo"]
    outside = (geo.exp() < 1 - gspo.default_clip_low) | (geo.exp() > 1 + gspo.default_clip_high)
    token_ratio = (logprobs.double() - start.double())[mask.bool()].exp()
    token_out = (token_ratio < 1 - grpo.default_clip_low) | (token_ratio > 1 + grpo.default_clip_high)
    std = (lambda x: float(x.std(unbiased=False)) if x.numel() >= 2 else float("nan"))
    return {"seq_logratio_std": std(sums), "seq_geo_logratio_std": std(geo),
            "seqs_outside_gspo_clip": float(outside.double().mean()) if len(geo) else float("nan"),
            "tokens_outside_grpo_clip": float(token_out.double().mean()) if token_out.numel() else float("nan")}


def load_model(model: str | None, rollout_file: Path, meta: dict):
    """The policy: ``model`` (HF dir, built-in, hub id, or a run's ``.ckpt``), default the rollout's ``step_K_policy/``."""
    from lit_gspo.models import load_policy

    if model is None:
        found = policy_dir(rollout_file)
        if not found.is_dir():
            raise FileNotFoundError(f"{found} not found (the run saved no policy with the rollout): pass --model, the "
                                    "weights that sampled it (an HF dir or the run's .ckpt of that step)")
        model = str(found)
    if model.endswith(".ckpt"):
        from lit_gspo.eval_cli import load_policy_weights

        if meta.get("lora"):
            raise ValueError("a LoRA run's .ckpt holds adapters: pass the rollout's step_K_policy/ or hf_model/ (merged)")
        policy, _ = load_policy(meta["model"], config_overrides=meta.get("model_config"), seed=meta.get("seed", 0))
        load_policy_weights(SimpleNamespace(policy=policy), model)
    else:
        overrides = meta.get("model_config") if model == meta.get("model") else None
        policy, _ = load_policy(model, config_overrides=overrides, seed=meta.get("seed", 0))
    return policy, model


def update_of(meta: dict, **changes) -> Update:
    """The run's ``model.update`` (fields this version knows), with ``changes``."""
    known = {f.name for f in dataclasses.fields(Update)}
    return Update(**{**{k: v for k, v in (meta.get("update") or {}).items() if k in known}, **changes})


def make_optimizer(params, name: str, hparams: dict) -> torch.optim.Optimizer:
    """A fresh ``torch.optim.<name>`` with the hyperparameters its signature takes."""
    import inspect

    cls = getattr(torch.optim, name, None)
    if cls is None:
        raise ValueError(f"--optimizer {name!r} is not a torch.optim class (the run's may be bitsandbytes': pass e.g. AdamW)")
    accepted = inspect.signature(cls.__init__).parameters
    return cls(params, **{k: v for k, v in hparams.items() if k in accepted and k != "params"})


@dataclasses.dataclass
class Replay:
    """A saved rollout ready to replay: the batch on ``device`` (saved old log-probs dropped: the Learner computes
    its own), the file's payload, and the policy in train mode with the weights that sampled it."""

    rollout_file: Path
    batch: RolloutBatch
    payload: dict
    policy: torch.nn.Module
    model_source: str
    learner_kwargs: dict

    @property
    def meta(self) -> dict:
        return self.payload["meta"]


def load_replay(rollout: str | Path, model: str | None = None, device: str = "cpu") -> Replay:
    """The rollout file ``rollout`` (with advantages) and the policy to replay it from (see :func:`load_model`)."""
    rollout_file = Path(rollout)
    batch, payload = load_rollout(rollout_file)
    meta = payload["meta"]
    if batch.advantages is None:
        raise ValueError(f"{rollout_file} has no advantages")
    policy, model_source = load_model(model, rollout_file, meta)
    dev = torch.device(device)
    deterministic_on_cpu(dev.type)  # as fit does
    policy.to(dev).train()  # as in fit (Lightning's train mode)
    moved = {f.name: getattr(batch, f.name).to(dev) for f in dataclasses.fields(batch)
             if isinstance(getattr(batch, f.name), Tensor)}
    batch = dataclasses.replace(batch, **{**moved, "old_logprobs": None})  # the Learner computes its own
    learner_kwargs = dict(temperature=meta.get("temperature", 1.0), max_len=meta.get("max_len", batch.completion_mask.shape[1]),
                          group_size=meta.get("group_size", 1))
    return Replay(rollout_file, batch, payload, policy, model_source, learner_kwargs)


def replay_optimizer(replay: Replay, optimizer: str | None = None, lr: float | None = None, optimizer_state: bool = True):
    """(name, hyperparameters, saved state or None) of the replay's optimiser: the run's class and hyperparameters
    (else AdamW, lr 1e-3) with ``lr`` if given, and the run's state saved with the policy when ``optimizer_state``."""
    meta = replay.meta
    opt_name = optimizer or meta.get("optimizer") or "AdamW"
    opt_hparams = {**(meta.get("optimizer_hparams") or {}), **({"lr": lr} if lr is not None else {})}
    opt_hparams.setdefault("lr", 1e-3)
    saved_state = None
    if optimizer_state and Path(replay.model_source).is_dir() and opt_name == meta.get("optimizer"):
        saved_state = load_optimizer_state(replay.model_source)  # the run's optimiser as it was when the rollout was sampled
    return opt_name, opt_hparams, saved_state


def fresh_optimizer(policy: torch.nn.Module, name: str, hparams: dict, saved_state: dict | None) -> torch.optim.Optimizer:
    """:func:`make_optimizer` over the trainable parameters, from a copy of ``saved_state`` (lr: ``hparams``') if given."""
    opt = make_optimizer([p for p in policy.parameters() if p.requires_grad], name, hparams)
    if saved_state is not None:
        opt.load_state_dict(copy.deepcopy(saved_state))  # its tensors would be shared (and stepped) otherwise
        for group in opt.param_groups:
            group["lr"] = hparams["lr"]
    return opt


def run_compare(rollout: str, model: str | None = None, objectives: list[str] | None = None, minibatch_steps: int = 4,
                num_minibatches: int | None = None, optimizer: str | None = None, lr: float | None = None,
                optimizer_state: bool = True, seed: int = 0,
                device: str = "cpu", out: str | None = None, command: str | None = None) -> dict:
    """Run the comparison; write report.md, compare.json and the plots under ``out``; returns what compare.json holds."""
    from lit_gspo.compare_report import write_outputs

    start_time = time.perf_counter()
    M = num_minibatches or minibatch_steps
    if minibatch_steps < 1 or minibatch_steps % M:
        raise ValueError(f"--minibatch_steps {minibatch_steps} must be a positive multiple of --num_minibatches {M}")
    specs = [parse_spec(s) for s in (objectives or default_specs())]
    labels = [label for label, _ in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"objectives must be distinct, got {labels}")
    replay_ = load_replay(rollout, model, device)
    rollout_file, batch, payload, meta = replay_.rollout_file, replay_.batch, replay_.payload, replay_.meta
    policy, model_source, learner_kwargs = replay_.policy, replay_.model_source, replay_.learner_kwargs
    dev = torch.device(device)
    saved_old = payload["tensors"].get("old_logprobs")
    init = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    mask = batch.completion_mask
    base = Learner(policy, PolicyGradient(), update_of(meta, epochs=minibatch_steps // M, num_minibatches=M), **learner_kwargs)
    start_logprobs = base.old_logprobs(batch, torch.arange(len(batch)))  # π_θ0 over the whole rollout
    weights_gap = (float((start_logprobs.cpu() - saved_old).abs()[mask.cpu()].max()) if saved_old is not None and mask.any()
                   else float("nan"))
    if weights_gap > 1e-3:
        print(f"compare: the weights' log-probs differ from the rollout's saved old log-probs by up to {weights_gap:.3g}: "
              "not the policy that sampled it. The replay starts on-policy for these weights all the same.", flush=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        orders = [base.minibatch_order(len(batch)) for _ in range(base.cfg.epochs)]
    opt_name, opt_hparams, saved_state = replay_optimizer(replay_, optimizer, lr, optimizer_state)

    def learner(objective: Objective, update: Update, orders_: list[Tensor]) -> ReplayLearner:
        policy.load_state_dict(init)
        policy.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        return ReplayLearner(policy, objective, update, orders=orders_, **learner_kwargs)

    def on_policy(objective: Objective, rows: Tensor | None = None) -> dict:
        rows = torch.arange(len(batch)) if rows is None else rows
        replay = learner(objective, update_of(meta, epochs=1, num_minibatches=1), [torch.arange(len(rows))])
        metrics = replay.learn(batch.select(rows), _Optimizer(policy))
        step = replay.steps[0]
        return {"grad": step.pop("grad"), **step, "loss": metrics["loss"]}

    pg = on_policy(PolicyGradient())
    size = -(-len(batch) // M)  # the Learner's minibatch size
    minibatch_pg = [on_policy(PolicyGradient(), order[start:start + size])["grad"]  # PG of each step's rows at θ0
                    for order in orders for start in range(0, len(batch), size)]
    results = {}
    for label, objective in specs:
        print(f"compare: {label} ({objective!r})", flush=True)
        first = on_policy(objective)
        spreads = [ratio_spread(start_logprobs.cpu(), start_logprobs.cpu(), mask.cpu())]
        replay = learner(objective, update_of(meta, epochs=minibatch_steps // M, num_minibatches=M),
                         [o.clone() for o in orders])
        after = lambda: spreads.append(ratio_spread(replay.old_logprobs(batch, torch.arange(len(batch))).cpu(),
                                                    start_logprobs.cpu(), mask.cpu()))
        opt = fresh_optimizer(policy, opt_name, opt_hparams, saved_state)
        metrics = replay.learn(batch.select(torch.arange(len(batch))), _Optimizer(policy, opt, after))
        steps = replay.steps
        results[label] = {
            "objective": repr(objective), "aggregation": getattr(objective, "aggregation", None),
            "on_policy": {"grad_norm": first["grad_norm"], "cos_pg": cosine(first["grad"], pg["grad"]),
                          "clip_frac": first["clip_frac"], "grad_token_share": first["grad_token_share"], "loss": first["loss"]},
            "steps": [{"grad_norm": s["grad_norm"], "cos_pg": cosine(s["grad"], pg_k),
                       "cos_own_on_policy": cosine(s["grad"], first["grad"]), "clip_frac": s["clip_frac"],
                       "grad_token_share": s["grad_token_share"]} for s, pg_k in zip(steps, minibatch_pg)],
            "spread": spreads,  # after 0..K optimiser steps
            "nonfinite_steps": metrics["nonfinite_steps"],
            "_grad": first["grad"], "_last_grad": steps[-1]["grad"],
        }
    names = ["pg"] + labels
    grads = [pg["grad"]] + [results[label]["_grad"] for label in labels]
    last = [results[label].pop("_last_grad") for label in labels]
    for label in labels:
        results[label].pop("_grad")
    valid = mask.cpu()
    report = {
        "command": command, "rollout": str(rollout_file), "step": payload["step"], "model": model_source,
        "rows": len(batch), "tokens": int(valid.sum()), "rows_with_nonzero_advantage": int(
            ((batch.advantages.cpu() != 0) if batch.advantages.dim() == 1 else ((batch.advantages.cpu() != 0) & valid).any(1)).sum()),
        "mean_reward": float(batch.rewards.mean()) if batch.rewards is not None else None,
        "mean_length": float(valid.sum(1).float().mean()),
        "weights_gap": weights_gap, "run": {k: meta.get(k) for k in ("objective", "advantage", "model", "update", "temperature")},
        "settings": {"minibatch_steps": minibatch_steps, "num_minibatches": M, "epochs": minibatch_steps // M,
                     "optimizer": opt_name, "optimizer_hparams": opt_hparams, "optimizer_state": saved_state is not None,
                     "seed": seed, "device": str(dev),
                     "max_grad_norm": base.cfg.max_grad_norm,
                     "gspo_clip": [OBJECTIVES["gspo"].default_clip_low, OBJECTIVES["gspo"].default_clip_high],
                     "grpo_clip": [OBJECTIVES["grpo"].default_clip_low, OBJECTIVES["grpo"].default_clip_high]},
        "pg": {"grad_norm": pg["grad_norm"], "grad_token_share": pg["grad_token_share"]},
        "objectives": results,
        "cosine_on_policy": {"labels": names, "matrix": [[cosine(a, b) for b in grads] for a in grads]},
        "cosine_last_step": {"labels": labels, "matrix": [[cosine(a, b) for b in last] for a in last]},
    }
    report["seconds"] = time.perf_counter() - start_time
    out_dir = Path(out) if out else rollout_file.parent / f"compare_{rollout_file.stem}"
    write_outputs(report, out_dir)
    return report


def make_parser() -> ArgumentParser:
    """The ``lit-gspo compare`` arguments (``lit-gspo --help`` lists this parser's description)."""
    parser = ArgumentParser(prog="lit-gspo compare", description=DESCRIPTION)
    parser.add_argument("--rollout", type=str, required=True,
                        help="a rollout file of a fit run with --model.save_rollouts_every_n_steps N: <run>/rollouts/step_K.pt")
    parser.add_argument("--model", type=str | None, default=None,
                        help="the weights to replay from: an HF dir, a built-in name, a hub id, or the run's .ckpt of that "
                             "step (null: the rollout's own <run>/rollouts/step_K_policy/, the policy that sampled it)")
    parser.add_argument("--objectives", type=str, nargs="+", default=None,
                        help="registered objectives, each NAME or NAME:key=value,... e.g. gspo grpo dapo "
                             "grpo:aggregation=token-mean gspo:clip_high=5e-4 (null: every registered objective "
                             f"without a critic: {' '.join(default_specs())})")
    parser.add_argument("--minibatch_steps", type=int, default=4,
                        help="K: the off-policy optimiser steps each objective takes on the rollout (the first is on-policy)")
    parser.add_argument("--num_minibatches", type=int | None, default=None,
                        help="M: minibatches the rollout is split into; K/M epochs (null: K, one epoch)")
    parser.add_argument("--optimizer", type=str | None, default=None,
                        help="torch.optim class of the replay's fresh optimiser (null: the run's, else AdamW)")
    parser.add_argument("--lr", type=float | None, default=None,
                        help="its learning rate (null: the run's when the rollout was saved, else 1e-3)")
    parser.add_argument("--optimizer_state", type=bool, default=True,
                        help="start from the run's optimiser state saved with the policy (step_K_policy/optimizer.pt: "
                             "Adam's moments), as the run's next minibatch step would; false, or none saved: a fresh state")
    parser.add_argument("--seed", type=int, default=0, help="seed of the minibatch order (the same for every objective)")
    parser.add_argument("--device", type=str, default="cpu", help="e.g. cpu, cuda")
    parser.add_argument("--out", type=str | None, default=None,
                        help="output folder: report.md, compare.json, gradient_cosine.png, ratio_spread.png (the plots need the "
                             "plot extra; null: <run>/rollouts/compare_step_K/)")
    return parser


def main(argv: list[str]) -> dict:
    """``lit-gspo compare ARGS``."""
    ns = make_parser().parse_args(argv)
    command = "lit-gspo compare " + shlex.join(argv)
    return run_compare(ns.rollout, model=ns.model, objectives=ns.objectives, minibatch_steps=ns.minibatch_steps,
                       num_minibatches=ns.num_minibatches, optimizer=ns.optimizer, lr=ns.lr,
                       optimizer_state=ns.optimizer_state, seed=ns.seed,
                       device=ns.device, out=ns.out, command=command)


__all__ = ["PolicyGradient", "Replay", "ReplayLearner", "flat_grad", "fresh_optimizer", "load_replay", "main", "make_parser",
           "parse_spec", "ratio_spread", "replay_optimizer", "run_compare"]
