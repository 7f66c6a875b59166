"""Small config groups of RLModule (each becomes a YAML section, e.g. ``model.generation.max_new_tokens``).

Each field's doc is the string literal right after it (an attribute docstring): ``lit-gspo fit --help`` shows it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from lit_gspo.models.cast_parameters import PARAM_DTYPES
from lit_gspo.rl.stop_strings import check_stop_strings


@dataclass
class Generation:
    """The rollouts, whatever the engine: G completions per prompt (``num_generations``), their length, the sampling
    distribution; which groups an RL step learns from (dynamic sampling), how stale they may be (asynchronous
    rollouts), which are written to disk. Which engine samples, and its kernels, is ``model.engine``."""

    num_generations: int = 8
    """G: completions sampled per prompt (one group; group-relative advantages compare them)."""
    max_new_tokens: int = 16
    """new-token limit of each sampled completion."""
    val_max_new_tokens: int | None = None
    """new-token limit of validation's completions; None resolves to ``max_new_tokens`` (set it to score with a longer
    budget than the rollouts are sampled with)."""
    max_prompt_length: int = 256
    """the longest prompt in tokens; a longer one is an error naming the prompt."""
    temperature: float = 1.0
    """sampling temperature (> 0; validation decodes greedily unless ``validation.num_generations`` is set)."""
    top_p: float = 1.0
    """nucleus sampling: sample among the most probable tokens whose probabilities sum to top_p (1: no cut)."""
    top_k: int = 0
    """sample among the k most probable tokens only (0: no top-k)."""
    min_p: float = 0.0
    """sample among the tokens at least ``min_p`` times as probable as the most probable one (0: no cut); applied after
    temperature, top-k and top-p, as transformers' warpers (vLLM applies it before top-k and top-p)."""
    repetition_penalty: float = 1.0
    """p: while sampling, a token the context already holds (the prompt, not its padding, and the reply so far) has its
    logit z divided by p where z > 0, multiplied by p where not, before temperature (transformers' and vLLM's; 1: none;
    > 1 discourages repeats). Greedy validation decodes without it."""

    stop: list[str] | None = None
    """strings a reply also ends at, besides the stop tokens: it ends with the token that completes the first it
    writes, and its text (what rewards and the environment read) holds the string — vLLM's ``stop`` with
    ``include_stop_str_in_output`` (lit_gspo/rl/stop_strings.py). E.g. ``['</answer>']``; null: stop tokens only."""
    dynamic_sampling: bool | None = None
    """drop the groups whose rewards are all equal (nothing to learn: Â = 0) and sample more prompts to refill the
    batch (DAPO's dynamic sampling); None resolves to the objective's paper's (``Objective.paper_dynamic_sampling``:
    on for DAPO, off for the others)."""
    max_sampling_rounds: int = 4
    """with ``dynamic_sampling``: at most this many generation rounds per RL step."""
    max_skipped_steps: int = 20
    """this many RL steps in a row with nothing to learn from (every group's rewards equal, or every reward failed)
    stop the run with an error; skipped steps make no optimiser step."""
    max_staleness: int = 0
    """Asynchronous rollouts (docs/async.md): K >= 1 generates the next steps' rollouts while the current step
    updates, in a worker with its own copy of the policy; no sample trained on is more than K policy versions (RL
    steps) old, older ones are dropped (``train/async/dropped``). 0: the synchronous loop (sample, update, sample)."""
    async_old_logprobs: str = "proximal"
    """π_old, the ratio's denominator, when ``max_staleness`` >= 1: ``proximal`` (the trainer's log-probs before the
    update, with TIS on π_prox/π_behav: decoupled PPO) or ``sampler`` (the worker's log-probs, ratio π_θ/π_behav)."""
    async_worker: Literal["auto", "process", "thread"] = "auto"
    """where the rollout worker runs when ``max_staleness`` >= 1: ``process`` (a forked process: its own interpreter,
    no GIL shared with the trainer, one intra-op thread; CPU only), ``thread`` (a thread of the trainer's process, its
    own torch threads; any device); ``auto``: process on CPU, thread on an accelerator."""
    async_worker_threads: int | None = None
    """torch intra-op threads of a ``thread`` rollout worker when ``max_staleness`` >= 1 (the trainer's thread keeps
    the rest); None: half of torch's threads each. A ``process`` worker samples with one (a forked child cannot run
    an OpenMP team); the trainer keeps the others."""
    dump_every_n_steps: int = 0
    """rollouts on disk for ``lit-gspo compare`` (``lit_gspo/rl/rollout_io.py``; training is unchanged by them): the
    rollout of every RL step K that is a positive multiple of n, after its advantages and before its update, goes to
    ``<default_root_dir>/rollouts/step_K.pt`` (0: never)."""
    dump_policy: bool = True
    """with each dumped rollout, the policy that sampled it (``rollouts/step_K_policy/``, Hugging Face format), so that
    ``compare`` replays it from the very weights."""

    @property
    def validation_budget(self) -> int:
        """The new tokens a validation's (and ``lit-gspo eval``'s) completion may have."""
        return self.val_max_new_tokens or self.max_new_tokens

    def __post_init__(self):
        if self.val_max_new_tokens is not None and self.val_max_new_tokens < 1:
            raise ValueError(f"val_max_new_tokens must be >= 1 or null, got {self.val_max_new_tokens}")
        if self.num_generations < 1 or self.max_new_tokens < 1:
            raise ValueError(
                f"num_generations and max_new_tokens must be >= 1, got {self.num_generations} and {self.max_new_tokens}"
            )
        if self.temperature <= 0:
            raise ValueError(
                f"temperature must be > 0 (validation decodes greedily by default), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p} (1: no nucleus cut; 0 would sample nothing)")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no top-k), got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1: none), got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0: no min-p cut), got {self.min_p}")
        if self.stop is not None:
            check_stop_strings(self.stop)
        if self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {self.max_prompt_length}")
        if self.max_sampling_rounds < 1:
            raise ValueError(f"max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}")
        if self.max_skipped_steps < 1:
            raise ValueError(f"max_skipped_steps must be >= 1, got {self.max_skipped_steps}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (0: synchronous), got {self.max_staleness}")
        if self.async_old_logprobs not in ("sampler", "proximal"):
            raise ValueError(f"async_old_logprobs must be 'sampler' or 'proximal', got {self.async_old_logprobs!r}")
        if self.async_worker not in ("auto", "process", "thread"):
            raise ValueError(f"async_worker must be 'auto', 'process' or 'thread', got {self.async_worker!r}")
        if self.async_worker_threads is not None and self.async_worker_threads < 1:
            raise ValueError(f"async_worker_threads must be >= 1 or null, got {self.async_worker_threads}")
        if self.dump_every_n_steps < 0:
            raise ValueError(f"dump_every_n_steps must be >= 0 (0: never), got {self.dump_every_n_steps}")


@dataclass
class Update:
    """K epochs × M minibatches of optimiser steps per rollout batch; micro-batches accumulate gradients.
    One epoch and one minibatch is on-policy: the ratio is exactly 1 and no old-log-prob pass runs."""

    epochs: int = 1
    """K: passes over each rollout batch."""
    num_minibatches: int = 1
    """M: optimiser steps per epoch, each on 1/M of the rollout's rows."""
    micro_batch_size: int | None = None
    """rows per forward/backward; micro-batches accumulate into one minibatch's step (None: the whole minibatch)."""
    micro_batch_tokens: int | Literal["auto"] | None = "auto"
    """a budget of padded tokens per micro-batch; rows are then grouped by length (``rollout.micro_batch_rows``) so
    that short completions are not padded to the longest one. ``auto``: on a GPU, sized at each update from the memory
    free then (``runtime/token_budget.py``: half of it over the bytes a token's activations keep, measured once by the
    update's own forward), so a batch that fits TRL's settings fits ours; on the CPU no budget. None: no budget."""
    pack_sequences: bool | None = None
    """run a micro-batch's rows as one sequence without padding (``rollout.completion_states_packed``: the same
    log-probs and gradients). None: where the attention kernel skips the other rows' blocks (``flash_attention_2``/``3``,
    ``flex_attention``); with ``sdpa``/``eager`` the packed mask is dense (S × S). Never with MoE routing records."""
    max_grad_norm: float | None = 1.0
    """clip the gradient norm of each optimiser step to this (> 0); None: no clipping."""
    mask_truncated_completions: bool = False
    """DAPO's overlong filtering (TRL's ``mask_truncated_completions``): a sample whose last reply the token budget cut
    (ended by no stop token or string: what ``train/clipped_ratio`` counts) trains on none of its tokens. Its reward
    still counts in its group's advantages, and it counts as a sequence in ``seq-mean`` normalisers, as in TRL."""
    top_entropy_quantile: float = 1.0
    """ρ: only the tokens whose entropy under π_θ is in the top ρ of their micro-batch's tokens carry the policy
    gradient; the others' Â is 0 (the KL term stays on every token). "Beyond the 80/20 rule" (Wang et al., 2025, the
    Qwen team) trains on the top 20 %: 0.2. TRL's ``top_entropy_quantile``; as TRL's, the quantile is taken per
    forward over every rank's tokens of it (a micro-batch), so this alone depends on the micro-batch split. 1: every
    token."""
    entropy_coef: float = 0.0
    """c: an entropy bonus, the loss gets −c · H̄ with H̄ π_θ's mean entropy per completion token of the minibatch
    (``rl/learn/entropy_bonus.py``): c > 0 keeps the policy from collapsing to near-deterministic replies. TRL's
    ``entropy_coef``: one normaliser for every objective (not its aggregation's); with ``top_entropy_quantile`` < 1 on
    the tokens it keeps. With ``entropy_target``, the starting c. 0: no bonus. Every row then runs forward and
    backward (a row whose Â is 0 still has the bonus' gradient)."""
    entropy_target: float | None = None
    """H*: adaptive entropy control (Skywork-OR1; TRL's ``use_adaptive_entropy`` with its ``entropy_target``): after
    each optimiser step c grows by ``entropy_coef_delta`` if the step's H̄ ≤ H*, else shrinks by it, within
    [``entropy_coef_min``, ``entropy_coef_max``]; a step applies c only while the last H̄ ≤ H* (none before the first
    measure). In nats: language models sit at about 0.5 to 10, and TRL's 0.2 acts only on a collapse. None: c fixed."""
    entropy_coef_delta: float = 0.005
    """δ: how much c moves per optimiser step under ``entropy_target``."""
    entropy_coef_min: float = 0.0
    """the least c under ``entropy_target``."""
    entropy_coef_max: float = 1.0
    """the largest c under ``entropy_target``."""
    router_aux_loss_coef: float | None = 0.0
    """an MoE policy's load-balancing loss (the model's own ``load_balancing_loss_func`` over each micro-batch's real
    tokens) added to the loss times this, each micro-batch's weighted by its share of the minibatch's completion
    tokens over every rank. TRL's ``router_aux_loss_coef``; None: the model config's own (TRL's default; Qwen3-MoE's
    is 0.001). 0: none. Logged: ``train/router_aux_loss``. With it, rows run padded (not packed nor aligned) and every
    row runs forward and backward. Refused for a model without router logits."""
    skip_zero_advantage_rows: bool = True
    """leave out of the forward/backward the rows whose advantage is 0 everywhere when the objective's gradient
    vanishes there (β = 0, no critic, no entropy bonus or router loss). Loss and gradient are unchanged (those rows
    still count in the normalisers); ``clip_frac`` stays a fraction of every token; entropy, KL and ratio statistics
    are then over the rows that carry a signal (one row when none does; no ratio statistics then)."""
    share_prompt_forward: bool | Literal["auto"] = "auto"
    """rows of a micro-batch with the same prompt run it once and continue from its KV cache (P + G·T tokens per
    group instead of G·(P + T)); the same log-probs and gradients (``rollout.completion_states_shared_prompts``).
    Off by itself for MoE, gradient checkpointing, FSDP2 and ``compile``. ``auto``: on the CPU whenever rows share a
    prompt; on a GPU only where it saves at least half the tokens, since the two passes launch every layer's kernels
    twice (on an H200 at 32 prompt and 256 completion tokens, G = 8, it saved 10 % of the tokens and doubled the
    update's kernels)."""
    align_rows: bool | Literal["auto"] = "auto"
    """run each row with its tokens first and its padding after, without an attention mask
    (``rollout.completion_states_aligned``: the same log-probs and gradients). Without a padding mask sdpa runs its
    causal flash kernel and reads grouped key-value heads as they are; with one, transformers copies the keys and
    values once per query head in every layer (``repeat_kv``) and keeps the copies for backward. ``auto``: on a GPU
    computing in bf16 or fp16 (in fp32 CUDA's sdpa takes grouped heads only in its math kernel, which holds every
    (L, L) score; on the CPU the padded forward, as before). Never with MoE routing records (padded positions)."""
    compile: bool = False
    """compile the policy's decoder layers for the update (regional ``torch.compile``, dynamic shapes), swapped in
    only while it runs (``models/regional_compile.py``): fuses each layer's norms, rotary embedding, activation and
    autocast's casts. The first update pays the compile. Not with gradient checkpointing, FSDP2 or MoE routing records
    (it then runs eagerly, with a warning). Numbers within float rounding of the eager update's, not bit for bit."""
    lean_activations: bool = True
    """the policy keeps less for backward, the same gradients bit for bit: its RMSNorms keep x and 1/rms, not the
    normalised x, its SwiGLUs the gate and up projections, not silu(gate), recomputing the rest in backward
    (``models/lean_activations.py``), and under autocast the Linears that read one tensor read one bf16 copy of it
    (``models/shared_casts.py``). Two fifths less activation memory at Qwen3-0.6B's shape under bf16 autocast, a quarter
    at SmolLM2's in fp32. Norms and MLPs only of the classes a probe shows to give the same bits; not under
    ``compile``, whose compiler chooses what to keep."""
    param_dtype: Literal["bf16"] | None = None
    """the dtype the update's passes (its forward and backward, the old-policy and reference passes) read the
    parameters in: ``bf16`` casts every floating parameter once per optimiser step (``models/cast_parameters.py``), so
    the whole forward computes in bf16, residual stream and norms included (Megatron's and verl's mixed precision);
    the fp32 parameters stay the master weights (the optimiser, checkpoints and exports see them) and receive the
    gradient in fp32, summed over micro-batches. None: as the parameters are (under ``bf16-mixed``, autocast casts
    each Linear's weight and input at every call and the residual stream stays fp32). The in-process samplers read
    the same casts (cast once per rollout), so that they compute what the update computes; ``VLLMEngine`` keeps its
    own weights, built in this dtype (its ``dtype: auto``). Under FSDP2, FSDP2's own mixed precision casts the
    parameters as it gathers them and reduces the gradients in fp32 (``runtime/sharding.py``)."""
    shuffle: str = "rows"
    """how rows are dealt to minibatches each epoch: ``rows`` (rows in random order, as TRL) or ``groups`` (whole
    groups in random order, as verl's consecutive minibatches: each minibatch holds every row of its prompts, so its
    advantages sum to 0 per group and a shared prompt forward covers all G rows)."""
    max_nonfinite_steps: int = 3
    """a minibatch whose loss or gradient norm is NaN/inf makes no optimiser step (counted as ``nonfinite_steps``,
    with a warning); this many such minibatches in a row stop the run."""
    scheduler_interval: Literal["step", "rl_step", "epoch"] = "step"
    """when ``model.lr_scheduler`` steps (Lightning's ``interval``, in RL terms): ``step`` (after each optimiser step),
    ``rl_step`` (after each RL step that updated the policy) or ``epoch`` (after each data epoch)."""
    scheduler_frequency: int = 1
    """the schedule steps every n-th ``scheduler_interval`` (Lightning's ``frequency``)."""
    mismatch: Mismatch | None = None
    """measure the sampler–trainer mismatch every step (``train/mismatch/*``) and correct it: ``corrections`` (TIS, MIS,
    SequenceMIS, OPSM) and ``old_logprobs`` (``trainer``, or ``sampler``: the engine's log-probs are π_old);
    ``lit_gspo/rl/learn/mismatch.py``, docs/mismatch.md. None: off."""

    def __post_init__(self):
        if self.epochs < 1 or self.num_minibatches < 1:
            raise ValueError(f"epochs and num_minibatches must be >= 1, got {self.epochs} and {self.num_minibatches}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or null, got {self.micro_batch_size}")
        if self.micro_batch_tokens not in (None, "auto") and not (
            isinstance(self.micro_batch_tokens, int) and self.micro_batch_tokens >= 1
        ):
            raise ValueError(f"micro_batch_tokens must be >= 1, 'auto' or null, got {self.micro_batch_tokens!r}")
        for name in ("share_prompt_forward", "align_rows"):
            if getattr(self, name) not in (True, False, "auto"):
                raise ValueError(f"{name} must be true, false or 'auto', got {getattr(self, name)!r}")
        if self.param_dtype is not None and self.param_dtype not in PARAM_DTYPES:
            valid = " or ".join(repr(name) for name in PARAM_DTYPES)
            raise ValueError(f"param_dtype must be {valid} or null, got {self.param_dtype!r}")
        if self.shuffle not in ("groups", "rows"):
            raise ValueError(f"shuffle must be 'groups' or 'rows', got {self.shuffle!r}")
        if (
            self.max_grad_norm is not None and not self.max_grad_norm > 0
        ):  # a negative norm would turn descent into ascent
            raise ValueError(f"max_grad_norm must be > 0 or null (no clipping), got {self.max_grad_norm}")
        if self.max_nonfinite_steps < 1:
            raise ValueError(f"max_nonfinite_steps must be >= 1, got {self.max_nonfinite_steps}")
        if not 0 < self.top_entropy_quantile <= 1:
            raise ValueError(
                f"top_entropy_quantile must be in (0, 1] (the share of tokens trained on; 1: all), got "
                f"{self.top_entropy_quantile}"
            )

        self.check_entropy_control()
        coef = self.router_aux_loss_coef
        if coef is not None and not (math.isfinite(coef) and coef >= 0):
            raise ValueError(
                f"router_aux_loss_coef must be >= 0 (0: no load-balancing loss) or null (the model config's), got {coef}"
            )

    def check_entropy_control(self) -> None:
        if not math.isfinite(self.entropy_coef):
            raise ValueError(f"entropy_coef must be a finite number (0: no entropy bonus), got {self.entropy_coef}")
        adaptive = {"entropy_coef_delta": 0.005, "entropy_coef_min": 0.0, "entropy_coef_max": 1.0}
        if self.entropy_target is None:
            changed = {
                name: getattr(self, name) for name, default in adaptive.items() if getattr(self, name) != default
            }
            if changed:
                settings = ", ".join(f"{name}={value}" for name, value in changed.items())
                raise ValueError(
                    f"{settings} only act under adaptive entropy control, which entropy_target=None leaves off: set "
                    "entropy_target (the mean entropy per token, in nats, below which the bonus applies), or leave "
                    f"{' and '.join(changed)} at their defaults"
                )
            return
        if not (math.isfinite(self.entropy_target) and self.entropy_target >= 0):
            raise ValueError(
                f"entropy_target must be a number >= 0 (nats per token) or null, got {self.entropy_target}"
            )
        if not self.entropy_coef_delta > 0:
            raise ValueError(f"entropy_coef_delta must be > 0 under entropy_target, got {self.entropy_coef_delta}")
        if not 0 <= self.entropy_coef_min <= self.entropy_coef_max:
            raise ValueError(
                "entropy_coef_min and entropy_coef_max must satisfy 0 <= min <= max, got "
                f"{self.entropy_coef_min} and {self.entropy_coef_max}"
            )

    @property
    def on_policy(self) -> bool:
        return self.epochs == 1 and self.num_minibatches == 1


@dataclass
class WarmStart:
    """Supervised steps on the task's (prompt, answer) pairs before the first RL step (synthetic tasks)."""

    steps: int = 0
    """supervised steps before the first RL step (0: no warm start)."""
    lr: float = 1e-3
    """learning rate of the warm start's AdamW."""
    batch_size: int = 32
    """(prompt, answer) pairs per warm-start step."""

    def __post_init__(self):
        if self.steps < 0 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError(
                f"warm_start needs steps >= 0 (0: none), batch_size >= 1 and lr > 0, got steps={self.steps}, "
                f"batch_size={self.batch_size}, lr={self.lr}"
            )


@dataclass
class LoRA:
    """Train low-rank adapters only; the reference policy is the base model with adapters off."""

    r: int = 8
    """rank of the adapters."""
    alpha: int = 16
    """LoRA's scaling numerator: the adapters' update is scaled by alpha / r."""
    dropout: float = 0.0
    """dropout on the adapters' input, in the supervised warm start only (RL updates run without dropout)."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """module-name suffixes that get adapters (or ``all-linear``)."""

    @classmethod
    def from_peft(cls, config) -> LoRA:
        """TRL's ``peft_config``, a peft ``LoraConfig``, as these settings: ``r``, ``lora_alpha``, ``lora_dropout`` and
        ``target_modules``. Any other of its fields set off peft's default (DoRA, rsLoRA, biases, modules to save, ...)
        is refused, naming it, not dropped: lit_gspo applies plain LoRA."""
        if not hasattr(config, "lora_alpha"):
            raise TypeError(
                f"policy.lora takes LoRA(r=, alpha=, dropout=, target_modules=) or a peft LoraConfig, got a "
                f"{type(config).__name__}"
            )
        read = {"r", "lora_alpha", "lora_dropout", "target_modules", "task_type"}
        kept = {"peft_type", "peft_version", "base_model_name_or_path", "revision", "inference_mode"}
        default = type(config)()
        off = [
            f"{f.name}={getattr(config, f.name)!r}"
            for f in dataclasses.fields(config)
            if f.name not in read | kept and getattr(config, f.name) != getattr(default, f.name)
        ]
        if config.task_type not in (None, "CAUSAL_LM"):
            off.append(f"task_type={config.task_type!r}")
        if off:
            raise ValueError(
                f"policy.lora: the LoraConfig sets {', '.join(off)}, which lit_gspo does not apply (it trains plain "
                "LoRA on a causal LM: r, lora_alpha, lora_dropout and target_modules); leave it at peft's default"
            )
        if config.target_modules is None:
            raise ValueError(
                "policy.lora: the LoraConfig leaves target_modules to peft's choice for the architecture; name them, "
                "e.g. target_modules='all-linear' or ['q_proj', 'v_proj']"
            )
        targets = config.target_modules
        return cls(
            r=config.r,
            alpha=config.lora_alpha,
            dropout=config.lora_dropout,
            target_modules=[targets] if isinstance(targets, str) else sorted(targets),
        )


@dataclass
class Validation:
    """Completions of the held-out prompts, greedy or sampled, scored: ``val/reward`` and what the loggers show."""

    every_n_steps: int | None = None
    """validate every n RL steps and after the last one (``Trainer(val_check_interval=n,
    check_val_every_n_epoch=None)``: one Lightning batch is one RL step); ``lit-gspo fit`` also validates before the
    first update. 0: only before and after training. None: ``lit-gspo fit`` resolves it to
    ``trainer.val_check_interval`` when that is given, else 10; from Python, the Trainer's schedule as it is."""
    log_completions_every_n_steps: int | None = None
    """log the first ``num_logged_completions`` completions of the held-out prompts (prompt, completion, reward)
    through the configured loggers with the validations at steps that are multiples of n (None: every
    validation; 0: never)."""
    num_logged_completions: int = 8
    """how many completions are logged (and printed): the first held-out prompts' greedy ones, or with
    ``num_generations`` n their n samples each."""
    print_completions: bool = False
    """also print the logged completions on the terminal, as TRL's ``log_completions`` does: prompt, completion,
    reward and each reward function's score."""
    num_generations: int = 0
    """0: one greedy completion per held-out prompt. n >= 1: n completions sampled per prompt (TRL's
    ``num_generations_eval``) at ``temperature`` and the generation's other sampling settings (top-p, top-k, min-p, the
    repetition penalty); ``val/reward`` is then their mean (mean@n). Every validation draws from one seeded stream, so two validations differ by the policy, not the draws."""
    temperature: float | None = None
    """the sampling temperature of a sampled validation (``num_generations`` >= 1); None: ``generation.temperature``."""
    pass_at_k: list[int] | None = None
    """the k of ``val/pass@k`` in a sampled validation: the share of held-out prompts with a solved completion among k
    of their n (the unbiased estimator of Chen et al. 2021; pass@1 is the share of samples solved). Each k in
    [1, ``num_generations``]; None: 1, 2, 4, ... up to n; []: none."""
    pass_threshold: float = 1.0
    """a sampled completion is solved, for pass@k, when its reward is >= this (and its reward did not fail)."""

    def pass_ks(self) -> list[int]:
        """The k of the pass@k a validation logs (none when it is greedy)."""
        from lit_gspo.rl.evaluate import default_ks

        if not self.num_generations:
            return []
        return default_ks(self.num_generations) if self.pass_at_k is None else sorted(set(self.pass_at_k))

    def __post_init__(self):
        if self.num_generations < 0:
            raise ValueError(
                f"validation.num_generations must be >= 0 (0: greedy, n: n samples per prompt), got {self.num_generations}"
            )
        if self.temperature is not None and not self.num_generations:
            raise ValueError(
                f"validation.temperature={self.temperature} samples nothing: validation decodes greedily unless "
                "validation.num_generations >= 1"
            )
        if self.temperature is not None and self.temperature <= 0:
            raise ValueError(f"validation.temperature must be > 0 or null, got {self.temperature}")
        if (self.pass_at_k or self.pass_threshold != 1.0) and not self.num_generations:
            given = f"pass_at_k={self.pass_at_k}" if self.pass_at_k else f"pass_threshold={self.pass_threshold}"
            raise ValueError(
                f"validation.{given} counts sampled completions, but validation decodes greedily unless "
                "validation.num_generations >= 1"
            )
        if any(not 1 <= k <= self.num_generations for k in self.pass_at_k or ()):
            raise ValueError(
                f"validation.pass_at_k must hold k in [1, validation.num_generations={self.num_generations}], "
                f"got {self.pass_at_k}"
            )
        if self.every_n_steps is not None and self.every_n_steps < 0:
            raise ValueError(
                f"validation.every_n_steps must be >= 0 (0: only before and after training), got {self.every_n_steps}"
            )
        if (self.log_completions_every_n_steps or 0) < 0 or self.num_logged_completions < 0:
            raise ValueError(
                f"validation.log_completions_every_n_steps and validation.num_logged_completions must be "
                f">= 0, got {self.log_completions_every_n_steps} and {self.num_logged_completions}"
            )


@dataclass
class Routing:
    """Mixture-of-Experts routing (an MoE policy only)."""

    replay: bool = False
    """record each layer's top-k experts in the old-policy pass (which then runs even on-policy) and force the
    update's forward to use them (Routing Replay, GSPO paper §5.3)."""
    track_volatility: bool = True
    """log ``train/routing_volatility``, the share of (completion token, layer, top-k slot) choices that differ
    between the old-policy pass and the policy after the step's updates, and ``train/routing/*``: the share of tokens
    rerouted and their mean |log-ratio| against the others' (one extra no-grad forward over the rollout; the old pass
    runs even on-policy)."""


@dataclass
class ReferenceSync:
    """The reference policy moved toward the policy during training (TR-DPO's syncing, TRL's ``sync_ref_model``):
    after every ``every_n_steps``-th RL step, π_ref ← α · π_θ + (1 − α) · π_ref, parameter by parameter."""

    every_n_steps: int = 512
    """RL steps between two syncs (TRL's ``ref_model_sync_steps``)."""
    mixup_alpha: float = 0.6
    """α (TRL's ``ref_model_mixup_alpha``); 1 resets the reference to the policy (ProRL's reference reset)."""

    def __post_init__(self):
        if self.every_n_steps < 1:
            raise ValueError(f"ref_sync.every_n_steps must be >= 1, got {self.every_n_steps}")
        if not 0 < self.mixup_alpha <= 1:
            raise ValueError(f"ref_sync.mixup_alpha must be in (0, 1] (1: a reset), got {self.mixup_alpha}")


@dataclass
class Policy:
    """The policy RL starts from: which model, built how, warm-started how, and its reference."""

    name: str = "tiny-llama"
    """a built-in name (``tiny-llama``, ``tiny-qwen3-moe``, ``smollm2-135m-instruct``), a local Hugging Face directory,
    a ``.gguf`` file, or a hub id."""
    config: dict | None = None
    """overrides of the model's config (layers, hidden size, ...)."""
    gguf_file: str | None = None
    """the ``.gguf`` file inside ``name`` when it is a directory or hub id holding several."""
    trust_remote_code: bool = False
    """load a model whose directory or hub repo brings its own Python for its architecture or tokenizer (``auto_map``
    in its config.json; TRL's ``trust_remote_code``): that code runs in every process, so only for a source you trust.
    false: such a model is refused at start."""
    lora: LoRA | None = None
    """train low-rank adapters only (None: the full model; ``--model.policy.lora.help LoRA`` lists its settings)."""
    gradient_checkpointing: bool = False
    """recompute each decoder layer's activations in backward (less memory, about a third more compute; TRL's
    GRPOTrainer turns it on by default)."""
    kl_to_ref: bool = True
    """keep a frozen reference policy (the policy after the warm start) to log ``train/kl`` even when β = 0."""
    ref_sync: ReferenceSync | None = None
    """move the reference toward the policy every n RL steps (``ReferenceSync``); None: it stays frozen."""
    routing: Routing = field(default_factory=Routing)
    """Mixture-of-Experts routing (an MoE policy only)."""
    warm_start: WarmStart = field(default_factory=WarmStart)
    """supervised steps on the task's (prompt, answer) pairs before the first RL step."""
    check_forward: bool = True
    """at load, check on a few tokens that the update computes the log-probs the model samples (causal, left padding
    honoured, the model's logit map in lit_gspo's head: ``rl/forward_checks.py``) and refuse the model otherwise.
    false: skip it, for a model it refuses wrongly (a Mixture-of-Experts router on a near-tie, say)."""

    def __post_init__(self):
        if self.lora is not None and not isinstance(self.lora, LoRA):  # TRL's peft_config: a peft LoraConfig
            self.lora = LoRA.from_peft(self.lora)


# last: the mismatch module's package (rl/learn) imports this one's Update
from lit_gspo.rl.learn.mismatch import Mismatch  # noqa: E402
