"""Small config groups of RLModule (each becomes a YAML section, e.g. ``model.generation.max_new_tokens``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def resolve_seed(seed: int | None) -> int:
    """``seed``, or the run's ``seed_everything`` value when None (so one flag seeds a whole run)."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else int(seed)


@dataclass
class Generation:
    """What is sampled, whatever the engine: G completions per prompt (``num_generations``), their length,
    the sampling distribution. Which engine samples, and its kernels, is ``model.engine``."""

    num_generations: int = 8
    max_new_tokens: int = 16
    #: new-token limit of the greedy validation (None: ``max_new_tokens``), e.g. to score with a longer
    #: budget than the rollouts are sampled with
    val_max_new_tokens: int | None = None
    max_prompt_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.val_max_new_tokens is not None and self.val_max_new_tokens < 1:
            raise ValueError(f"val_max_new_tokens must be >= 1 or null, got {self.val_max_new_tokens}")
        if self.num_generations < 1 or self.max_new_tokens < 1:
            raise ValueError(f"num_generations and max_new_tokens must be >= 1, got {self.num_generations} "
                             f"and {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (greedy decoding is used for validation), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p} (1: no nucleus cut; 0 would sample nothing)")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no top-k), got {self.top_k}")
        if self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {self.max_prompt_length}")


@dataclass
class Update:
    """K epochs × M minibatches of optimiser steps per rollout batch; micro-batches accumulate gradients.

    One epoch and one minibatch is on-policy: the ratio is exactly 1 and no old-log-prob pass runs.
    ``skip_zero_advantage_rows``: leave out of the forward/backward the rows whose advantage is 0
    everywhere when the objective's gradient vanishes there (β = 0, no critic). The loss and gradient
    are unchanged (those rows still count in the normalisers). ``clip_frac`` stays a fraction of every
    token (clipping never zeroes a gradient where Â = 0); entropy, KL and ratio statistics are then
    over the rows that carry a signal (one row when none does; no ratio statistics then).
    ``micro_batch_tokens``: a budget of padded tokens per micro-batch; rows are then grouped by length
    (``rollout.micro_batch_rows``) so that short completions are not padded to the longest one.
    ``share_prompt_forward``: rows of a micro-batch with the same prompt run it once and continue from
    its KV cache (P + G·T tokens per group instead of G·(P + T)); the same log-probs and gradients
    (``rollout.completion_states_shared_prompts``). Off by itself for MoE, gradient checkpointing, FSDP2.
    ``shuffle``: how rows are dealt to minibatches each epoch: ``"rows"`` (rows in random order, as
    TRL) or ``"groups"`` (whole groups in random order, as verl's consecutive minibatches: each
    minibatch holds every row of its prompts, so its advantages sum to 0 per group and a shared prompt
    forward covers all G rows).
    ``max_grad_norm``: clip the gradient norm to this (> 0), or null for no clipping.
    ``max_nonfinite_steps``: a minibatch whose loss or gradient norm is NaN/inf makes no optimiser step
    (counted as ``nonfinite_steps``, with a warning); this many such minibatches in a row stop the run.
    """

    epochs: int = 1
    num_minibatches: int = 1
    micro_batch_size: int | None = None
    micro_batch_tokens: int | None = None
    max_grad_norm: float | None = 1.0
    skip_zero_advantage_rows: bool = True
    share_prompt_forward: bool = True
    shuffle: str = "rows"
    max_nonfinite_steps: int = 3

    def __post_init__(self):
        if self.epochs < 1 or self.num_minibatches < 1:
            raise ValueError(f"epochs and num_minibatches must be >= 1, got {self.epochs} and {self.num_minibatches}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or null, got {self.micro_batch_size}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1 or null, got {self.micro_batch_tokens}")
        if self.shuffle not in ("groups", "rows"):
            raise ValueError(f"shuffle must be 'groups' or 'rows', got {self.shuffle!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:  # a negative norm would turn descent into ascent
            raise ValueError(f"max_grad_norm must be > 0 or null (no clipping), got {self.max_grad_norm}")
        if self.max_nonfinite_steps < 1:
            raise ValueError(f"max_nonfinite_steps must be >= 1, got {self.max_nonfinite_steps}")

    @property
    def on_policy(self) -> bool:
        return self.epochs == 1 and self.num_minibatches == 1


@dataclass
class WarmStart:
    """Supervised steps on the task's (prompt, answer) pairs before the first RL step (synthetic tasks)."""

    steps: int = 0
    lr: float = 1e-3
    batch_size: int = 32


@dataclass
class LoRA:
    """Train low-rank adapters only; the reference policy is the base model with adapters off."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
