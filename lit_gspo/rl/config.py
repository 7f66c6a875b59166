"""Small config groups of RLModule (each becomes a YAML section, e.g. ``model.generation.max_new_tokens``)."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class Sampling:
    """Which rollouts an RL step learns from.

    ``dynamic``: drop the groups whose rewards are all equal (nothing to learn: Â = 0) and sample more prompts to
    refill the batch, up to ``max_rounds`` generation rounds (DAPO's dynamic sampling); None: the objective's paper's
    (on for DAPO). ``max_skipped_steps``: this many RL steps in a row with nothing to learn from (every group's rewards
    equal, or every reward failed) stop the run with an error; skipped steps make no optimiser step, so they do not
    count towards ``trainer.max_steps``.
    """

    dynamic: bool | None = None
    max_rounds: int = 4
    max_skipped_steps: int = 20
    max_staleness: int = 0
    """Asynchronous rollouts (docs/async.md): K >= 1 generates the next steps' rollouts while the current step
    updates, in a worker with its own copy of the policy; no sample trained on is more than K policy versions (RL
    steps) old, older ones are dropped (``train/async/dropped``). 0: the synchronous loop (sample, update, sample)."""
    async_old_logprobs: str = "proximal"
    """π_old, the ratio's denominator, when ``max_staleness`` >= 1: ``proximal`` (the trainer's log-probs before the
    update, with TIS on π_prox/π_behav: decoupled PPO) or ``sampler`` (the worker's log-probs, ratio π_θ/π_behav)."""
    async_worker_threads: int | None = None
    """torch intra-op threads of the rollout worker's thread when ``max_staleness`` >= 1 (the trainer's thread keeps
    the rest); None: half of torch's threads each."""

    def __post_init__(self):
        if self.max_rounds < 1:
            raise ValueError(f"sampling.max_rounds must be >= 1, got {self.max_rounds}")
        if self.max_skipped_steps < 1:
            raise ValueError(f"sampling.max_skipped_steps must be >= 1, got {self.max_skipped_steps}")
        if self.max_staleness < 0:
            raise ValueError(f"sampling.max_staleness must be >= 0 (0: synchronous), got {self.max_staleness}")
        if self.async_old_logprobs not in ("sampler", "proximal"):
            raise ValueError(f"sampling.async_old_logprobs must be 'sampler' or 'proximal', got {self.async_old_logprobs!r}")
        if self.async_worker_threads is not None and self.async_worker_threads < 1:
            raise ValueError(f"sampling.async_worker_threads must be >= 1 or null, got {self.async_worker_threads}")


@dataclass
class Validation:
    """Greedy completions of the held-out prompts, scored: ``val/reward`` and what the loggers show.

    ``every_n_steps``: the CLI's name for ``Trainer(val_check_interval=n, check_val_every_n_epoch=None)``: Lightning's
    validation loop every n RL steps (one Lightning batch is one RL step) and after the last one; ``lit-gspo fit`` also
    validates before the first update (``trainer.validate`` before ``trainer.fit``; do the same from Python). 0: only
    before and after training. None: the Trainer's schedule as it is.
    ``log_completions_every_n_steps``: log the greedy completions of the first ``num_logged_completions`` held-out
    prompts (prompt, completion, reward) with the validations at steps that are multiples of n (None: every
    validation; 0: never) through the configured loggers (``lit_gspo/lightning/completions_log.py``).
    ``print_completions``: also print them on the terminal, as TRL's ``log_completions`` does: prompt, completion,
    reward and each reward function's score.
    """

    every_n_steps: int | None = None
    log_completions_every_n_steps: int | None = None
    num_logged_completions: int = 8
    print_completions: bool = False

    def __post_init__(self):
        if self.every_n_steps is not None and self.every_n_steps < 0:
            raise ValueError(f"validation.every_n_steps must be >= 0 (0: only before and after training), got "
                             f"{self.every_n_steps}")
        if (self.log_completions_every_n_steps or 0) < 0 or self.num_logged_completions < 0:
            raise ValueError(f"validation.log_completions_every_n_steps and validation.num_logged_completions must be "
                             f">= 0, got {self.log_completions_every_n_steps} and {self.num_logged_completions}")


@dataclass
class Routing:
    """Mixture-of-Experts routing (an MoE policy only).

    ``replay``: record each layer's top-k experts in the old-policy pass (which then runs even on-policy) and force
    the update's forward to use them (Routing Replay, GSPO paper §5.3).
    ``track_volatility``: log ``train/routing_volatility``, the share of (completion token, layer, top-k slot) choices
    that differ between the old-policy pass and the policy after the step's updates, and ``train/routing/*``: the
    share of tokens rerouted and their mean |log-ratio| against the others' (``Learner.measure_routing``; one extra
    no-grad forward over the rollout; the old pass runs even on-policy).
    """

    replay: bool = False
    track_volatility: bool = True


@dataclass
class RolloutDumps:
    """Rollouts on disk for ``lit-gspo compare`` (``lit_gspo/rl/rollout_io.py``); training is unchanged by them.

    ``every_n_steps``: write the rollout of every RL step K that is a positive multiple of n, after its advantages and
    before its update, to ``<default_root_dir>/rollouts/step_K.pt`` (0: never). ``with_policy``: with each, the policy
    that sampled it (``rollouts/step_K_policy/``, Hugging Face format), so that ``compare`` replays it from the very
    weights.
    """

    every_n_steps: int = 0
    with_policy: bool = True

    def __post_init__(self):
        if self.every_n_steps < 0:
            raise ValueError(f"rollout_dumps.every_n_steps must be >= 0 (0: never), got {self.every_n_steps}")


#: settings that moved into a group: old ``model.<key>`` → new ``model.<group>.<key>`` (``lit_gspo.tools.main`` reads
#: the old names in a user's command line and config files as the new ones, saying so; saved runs are read alike)
MOVED_SETTINGS = {
    "dynamic_sampling": "sampling.dynamic", "max_sampling_rounds": "sampling.max_rounds",
    "max_skipped_steps": "sampling.max_skipped_steps",
    "val_every_n_steps": "validation.every_n_steps",
    "log_completions_every_n_steps": "validation.log_completions_every_n_steps",
    "num_logged_completions": "validation.num_logged_completions", "print_completions": "validation.print_completions",
    "routing_replay": "routing.replay", "track_routing_volatility": "routing.track_volatility",
    "save_rollouts_every_n_steps": "rollout_dumps.every_n_steps", "save_rollout_policy": "rollout_dumps.with_policy",
}
