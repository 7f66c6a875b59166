"""The machinery of ``lit-gspo compare`` (``lit_gspo/tools/compare.py`` says what it measures): a saved rollout and the
weights that sampled it loaded for replay, the ``Learner`` run through its public hooks with a given minibatch order
(:class:`ReplayLearner`), and the measurements: gradients, cosines, clipping, tokens with gradient, ratio spread."""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

import torch
import yaml
from torch import Tensor

from lit_gspo.rl.config import Update
from lit_gspo.rl.learn.diagnostics import sequence_log_ratio
from lit_gspo.rl.learn.hooks import UpdateHook
from lit_gspo.rl.learn.learner import Learner, Minibatch, UpdateState
from lit_gspo.rl.objectives import OBJECTIVES, Counts, LossOutput, Objective, aggregate, get_objective
from lit_gspo.rl.rollout import RolloutBatch
from lit_gspo.rl.rollout_io import load_optimizer_state, load_rollout, policy_dir
from lit_gspo.runtime.hardware import deterministic_on_cpu
from lit_gspo.tools.compare import default_specs


class PolicyGradient(Objective, register=False):
    """The plain policy gradient: ℓ = −Σ_i Σ_t m_it Â_it log π_θ(y_it) / N_tokens (no ratio, no clip)."""

    name = "pg"
    zero_advantage_has_no_gradient = True

    def policy_loss(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, counts: Counts, **extra
    ) -> LossOutput:
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


class _RecordingObjective:
    """Wraps an objective for the Learner: keeps each call's log-probs (to read ∂loss/∂logp after backward)."""

    def __init__(self, objective: Objective):
        self.objective, self.calls = objective, []

    def __getattr__(self, name):
        return getattr(self.objective, name)

    def __call__(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, **kwargs
    ) -> LossOutput:
        if logprobs.requires_grad:
            logprobs.retain_grad()
        out = self.objective(logprobs, old_logprobs, advantages, mask, **kwargs)
        self.calls.append((logprobs, mask.bool(), float(out.metrics["clip_frac"]), float(mask.sum())))
        return out


class MinibatchGradients(UpdateHook):
    """Each minibatch's gradient before clipping, its clip fraction and its share of tokens with a gradient, appended
    to ``steps`` (``objective``: the recording wrapper the learner's loss goes through)."""

    def __init__(self, policy: torch.nn.Module, objective: _RecordingObjective, steps: list[dict]):
        self.policy, self.objective, self.steps = policy, objective, steps

    def after_backward(self, update: UpdateState, minibatch: Minibatch) -> None:
        grad = flat_grad(self.policy)
        calls, self.objective.calls = self.objective.calls, []
        tokens = max(minibatch.counts.tokens, 1.0)  # every valid token of the minibatch, skipped rows included
        with_grad = sum(float((lp.grad.ne(0) & m).sum()) for lp, m, _, _ in calls if lp.grad is not None)
        self.steps.append(
            {
                "grad": grad,
                "grad_norm": float(grad.double().norm()),
                "clip_frac": sum(cf * n for _, _, cf, n in calls) / tokens,
                "grad_token_share": with_grad / tokens,
            }
        )


class ReplayLearner(Learner):
    """The Learner with given minibatch orders (:meth:`Learner.minibatch_order`), recording each minibatch's gradient
    before clipping (the :class:`MinibatchGradients` hook), so ``learn`` runs exactly as in ``fit``."""

    def __init__(
        self, policy: torch.nn.Module, objective: Objective, update: Update, *, orders: list[Tensor], **kwargs
    ):
        self.orders, self.steps = list(orders), []
        recording = _RecordingObjective(objective)
        super().__init__(policy, recording, update, hooks=[MinibatchGradients(policy, recording, self.steps)], **kwargs)

    def minibatch_order(self, n: int) -> Tensor:
        return self.orders.pop(0)


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
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().flatten().cpu()
            for p in model.parameters()
            if p.requires_grad
        ]
    )


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
    gspo, grpo = OBJECTIVES["gspo"](), OBJECTIVES["grpo"]()  # their papers' ε
    outside = (geo.exp() < 1 - gspo.clip_low) | (geo.exp() > 1 + gspo.clip_high)
    token_ratio = (logprobs.double() - start.double())[mask.bool()].exp()
    token_out = (token_ratio < 1 - grpo.clip_low) | (token_ratio > 1 + grpo.clip_high)
    std = lambda x: float(x.std(unbiased=False)) if x.numel() >= 2 else float("nan")
    return {
        "seq_logratio_std": std(sums),
        "seq_geo_logratio_std": std(geo),
        "seqs_outside_gspo_clip": float(outside.double().mean()) if len(geo) else float("nan"),
        "tokens_outside_grpo_clip": float(token_out.double().mean()) if token_out.numel() else float("nan"),
    }


def load_model(model: str | None, rollout_file: Path, meta: dict):
    """The policy: ``model`` (HF dir, built-in, hub id, or a run's ``.ckpt``), default the rollout's ``step_K_policy/``."""
    from lit_gspo.models import load_policy
    from lit_gspo.rl.forward_checks import check_policy_forward

    trust = bool(meta.get("trust_remote_code"))  # the run's policy.trust_remote_code
    if model is None:
        found = policy_dir(rollout_file)
        if not found.is_dir():
            raise FileNotFoundError(
                f"{found} not found (the run saved no policy with the rollout): pass --model, the "
                "weights that sampled it (an HF dir or the run's .ckpt of that step)"
            )
        model = str(found)
    if model.endswith(".ckpt"):
        from lit_gspo.models.loading import load_checkpoint_policy

        if meta.get("lora"):
            raise ValueError(
                "a LoRA run's .ckpt holds adapters: pass the rollout's step_K_policy/ or hf_model/ (merged)"
            )
        policy, _ = load_policy(
            meta["model"], config_overrides=meta.get("model_config"), seed=meta.get("seed", 0), trust_remote_code=trust
        )
        load_checkpoint_policy(policy, model)
    else:
        overrides = meta.get("model_config") if model == meta.get("model") else None
        policy, _ = load_policy(model, config_overrides=overrides, seed=meta.get("seed", 0), trust_remote_code=trust)
    check_policy_forward(policy)  # as the run did: the logit map its forward applies kept on it
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
        raise ValueError(
            f"--optimizer {name!r} is not a torch.optim class (the run's may be bitsandbytes': pass e.g. AdamW)"
        )
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
    policy.to(dev).eval()  # as a fit leaves it: no dropout (Learner.learn and snapshot run in eval mode anyway)
    moved = {
        f.name: getattr(batch, f.name).to(dev)
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), Tensor)
    }
    batch = dataclasses.replace(batch, **{**moved, "old_logprobs": None})  # the Learner computes its own
    learner_kwargs = dict(
        temperature=meta.get("temperature", 1.0),
        max_len=meta.get("max_len", batch.completion_mask.shape[1]),
        group_size=meta.get("group_size", 1),
    )
    return Replay(rollout_file, batch, payload, policy, model_source, learner_kwargs)


def replay_optimizer(
    replay: Replay, optimizer: str | None = None, lr: float | None = None, optimizer_state: bool = True
):
    """(name, hyperparameters, saved state or None) of the replay's optimiser: the run's class and hyperparameters
    (else AdamW, lr 1e-3) with ``lr`` if given, and the run's state saved with the policy when ``optimizer_state``."""
    meta = replay.meta
    opt_name = optimizer or meta.get("optimizer") or "AdamW"
    opt_hparams = {**(meta.get("optimizer_hparams") or {}), **({"lr": lr} if lr is not None else {})}
    opt_hparams.setdefault("lr", 1e-3)
    saved_state = None
    if optimizer_state and Path(replay.model_source).is_dir() and opt_name == meta.get("optimizer"):
        saved_state = load_optimizer_state(
            replay.model_source
        )  # the run's optimiser as it was when the rollout was sampled
    return opt_name, opt_hparams, saved_state


def fresh_optimizer(
    policy: torch.nn.Module, name: str, hparams: dict, saved_state: dict | None
) -> torch.optim.Optimizer:
    """:func:`make_optimizer` over the trainable parameters, from a copy of ``saved_state`` (lr: ``hparams``') if given."""
    opt = make_optimizer([p for p in policy.parameters() if p.requires_grad], name, hparams)
    if saved_state is not None:
        opt.load_state_dict(copy.deepcopy(saved_state))  # its tensors would be shared (and stepped) otherwise
        for group in opt.param_groups:
            group["lr"] = hparams["lr"]
    return opt


def run_compare(
    rollout: str,
    model: str | None = None,
    objectives: list[str] | None = None,
    minibatch_steps: int = 4,
    num_minibatches: int | None = None,
    optimizer: str | None = None,
    lr: float | None = None,
    optimizer_state: bool = True,
    seed: int = 0,
    device: str = "cpu",
    out: str | None = None,
    command: str | None = None,
) -> dict:
    """Run the comparison; write report.md, compare.json and the plots under ``out``; returns what compare.json holds."""
    from lit_gspo.tools.compare_report import write_outputs

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
    base = Learner(
        policy, PolicyGradient(), update_of(meta, epochs=minibatch_steps // M, num_minibatches=M), **learner_kwargs
    )
    start_logprobs = base.old_logprobs(batch, torch.arange(len(batch)))  # π_θ0 over the whole rollout
    weights_gap = (
        float((start_logprobs.cpu() - saved_old).abs()[mask.cpu()].max())
        if saved_old is not None and mask.any()
        else float("nan")
    )
    if weights_gap > 1e-3:
        print(
            f"compare: the weights' log-probs differ from the rollout's saved old log-probs by up to {weights_gap:.3g}: "
            "not the policy that sampled it. The replay starts on-policy for these weights all the same.",
            flush=True,
        )
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
    minibatch_pg = [
        on_policy(PolicyGradient(), order[start : start + size])["grad"]  # PG of each step's rows at θ0
        for order in orders
        for start in range(0, len(batch), size)
    ]
    results = {}
    for label, objective in specs:
        print(f"compare: {label} ({objective!r})", flush=True)
        first = on_policy(objective)
        spreads = [ratio_spread(start_logprobs.cpu(), start_logprobs.cpu(), mask.cpu())]
        replay = learner(
            objective, update_of(meta, epochs=minibatch_steps // M, num_minibatches=M), [o.clone() for o in orders]
        )
        after = lambda: spreads.append(
            ratio_spread(replay.old_logprobs(batch, torch.arange(len(batch))).cpu(), start_logprobs.cpu(), mask.cpu())
        )
        opt = fresh_optimizer(policy, opt_name, opt_hparams, saved_state)
        metrics = replay.learn(batch.select(torch.arange(len(batch))), _Optimizer(policy, opt, after))
        steps = replay.steps
        results[label] = {
            "objective": repr(objective),
            "aggregation": getattr(objective, "aggregation", None),
            "on_policy": {
                "grad_norm": first["grad_norm"],
                "cos_pg": cosine(first["grad"], pg["grad"]),
                "clip_frac": first["clip_frac"],
                "grad_token_share": first["grad_token_share"],
                "loss": first["loss"],
            },
            "steps": [
                {
                    "grad_norm": s["grad_norm"],
                    "cos_pg": cosine(s["grad"], pg_k),
                    "cos_own_on_policy": cosine(s["grad"], first["grad"]),
                    "clip_frac": s["clip_frac"],
                    "grad_token_share": s["grad_token_share"],
                }
                for s, pg_k in zip(steps, minibatch_pg)
            ],
            "spread": spreads,  # after 0..K optimiser steps
            "nonfinite_steps": metrics["nonfinite_steps"],
            "_grad": first["grad"],
            "_last_grad": steps[-1]["grad"],
        }
    names = ["pg"] + labels
    grads = [pg["grad"]] + [results[label]["_grad"] for label in labels]
    last = [results[label].pop("_last_grad") for label in labels]
    for label in labels:
        results[label].pop("_grad")
    valid = mask.cpu()
    report = {
        "command": command,
        "rollout": str(rollout_file),
        "step": payload["step"],
        "model": model_source,
        "rows": len(batch),
        "tokens": int(valid.sum()),
        "rows_with_nonzero_advantage": int(
            (
                (batch.advantages.cpu() != 0)
                if batch.advantages.dim() == 1
                else ((batch.advantages.cpu() != 0) & valid).any(1)
            ).sum()
        ),
        "mean_reward": float(batch.rewards.mean()) if batch.rewards is not None else None,
        "mean_length": float(valid.sum(1).float().mean()),
        "weights_gap": weights_gap,
        "run": {k: meta.get(k) for k in ("objective", "advantage", "model", "update", "temperature")},
        "settings": {
            "minibatch_steps": minibatch_steps,
            "num_minibatches": M,
            "epochs": minibatch_steps // M,
            "optimizer": opt_name,
            "optimizer_hparams": opt_hparams,
            "optimizer_state": saved_state is not None,
            "seed": seed,
            "device": str(dev),
            "max_grad_norm": base.cfg.max_grad_norm,
            "gspo_clip": [OBJECTIVES["gspo"]().clip_low, OBJECTIVES["gspo"]().clip_high],
            "grpo_clip": [OBJECTIVES["grpo"]().clip_low, OBJECTIVES["grpo"]().clip_high],
        },
        "pg": {"grad_norm": pg["grad_norm"], "grad_token_share": pg["grad_token_share"]},
        "objectives": results,
        "cosine_on_policy": {"labels": names, "matrix": [[cosine(a, b) for b in grads] for a in grads]},
        "cosine_last_step": {"labels": labels, "matrix": [[cosine(a, b) for b in last] for a in last]},
    }
    report["seconds"] = time.perf_counter() - start_time
    out_dir = Path(out) if out else rollout_file.parent / f"compare_{rollout_file.stem}"
    write_outputs(report, out_dir)
    return report


__all__ = [
    "PolicyGradient",
    "Replay",
    "ReplayLearner",
    "flat_grad",
    "fresh_optimizer",
    "load_replay",
    "parse_spec",
    "ratio_spread",
    "replay_optimizer",
    "run_compare",
]
