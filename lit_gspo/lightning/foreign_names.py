"""TRL's, transformers' and vLLM's names for lit_gspo's settings, for the error about an option or a YAML key that is
one of theirs.

A GRPOTrainer user types ``--model.beta 0.1`` or writes ``num_iterations: 2`` in a YAML; a vLLM user
``--model.engine.init_args.gpu_memory_utilization 0.5`` or ``--model.generation.max_tokens 64``; the parser knows
none of them. :func:`foreign_hint` says where the setting is here, in one line: every field ``trl.GRPOConfig`` adds to
``transformers.TrainingArguments`` (:data:`GRPO_CONFIG`, the first column of docs/from_trl.md, which says the rest),
the TrainingArguments a GRPO run sets most, vLLM's engine and sampling arguments and transformers' generation
settings (:data:`TABLES`); any other field of TrainingArguments or GenerationConfig is named as one.
``tests/test_from_trl.py`` checks the tables against docs/from_trl.md, the installed libraries and the options the
CLI accepts; ``tests/test_unknown_option.py`` tries every name.
"""

from __future__ import annotations

import dataclasses
import functools

NOT_SUPPORTED = "not supported"
ALWAYS_ON = "always on, no option"

#: each field GRPOConfig adds to TrainingArguments (TRL 1.16, its order) → lit_gspo's option, or why there is none
GRPO_CONFIG: dict[str, str] = {
    "model_init_kwargs": "--model.policy.config",
    "trust_remote_code": "--model.policy.trust_remote_code",
    "router_aux_loss_coef": "--model.update.router_aux_loss_coef",
    "disable_dropout": ALWAYS_ON,
    "cast_lm_head_to_fp32": ALWAYS_ON,
    "num_generations": "--model.generation.num_generations",
    "num_generations_eval": "--model.validation.num_generations",
    "max_completion_length": "--model.generation.max_new_tokens",
    "ds3_gather_for_generation": NOT_SUPPORTED,
    "shuffle_dataset": ALWAYS_ON,
    "pad_to_multiple_of": NOT_SUPPORTED,
    "generation_batch_size": "--data.prompts_per_step",
    "steps_per_generation": "--model.update.num_minibatches",
    "temperature": "--model.generation.temperature",
    "top_p": "--model.generation.top_p",
    "top_k": "--model.generation.top_k",
    "min_p": "--model.generation.min_p",
    "generation_kwargs": NOT_SUPPORTED,
    "chat_template_kwargs": "--model.environment.init_args.chat_template_kwargs",
    "repetition_penalty": "--model.generation.repetition_penalty",
    "cache_implementation": "--model.engine StaticCacheSampler",
    "use_vllm": "--model.engine VLLMEngine",
    "vllm_mode": "--model.engine VLLMEngine",
    "vllm_model_impl": "--model.engine.init_args.llm_kwargs",
    "vllm_enable_sleep_mode": NOT_SUPPORTED,
    "vllm_structured_outputs_regex": NOT_SUPPORTED,
    "vllm_server_base_url": NOT_SUPPORTED,
    "vllm_server_host": NOT_SUPPORTED,
    "vllm_server_port": NOT_SUPPORTED,
    "vllm_server_timeout": NOT_SUPPORTED,
    "vllm_group_port": NOT_SUPPORTED,
    "vllm_gpu_memory_utilization": "--model.engine.init_args.kv_cache_gb",
    "vllm_max_model_length": "--model.engine.init_args.max_model_len",
    "vllm_tensor_parallel_size": NOT_SUPPORTED,
    "beta": "--model.objective.beta",
    "num_iterations": "--model.update.epochs",
    "epsilon": "--model.objective.clip_low",
    "delta": "--model.objective.dual_clip",
    "epsilon_high": "--model.objective.clip_high",
    "sapo_temperature_neg": "--model.objective.tau_neg",
    "sapo_temperature_pos": "--model.objective.tau_pos",
    "vespo_k_pos": "--model.objective.k_pos",
    "vespo_lambda_pos": "--model.objective.lambda_pos",
    "vespo_k_neg": "--model.objective.k_neg",
    "vespo_lambda_neg": "--model.objective.lambda_neg",
    "importance_sampling_level": "--model.objective",
    "reward_weights": "--model.reward_weights",
    "multi_objective_aggregation": "--model.advantage",
    "scale_rewards": "--model.advantage",
    "loss_type": "--model.objective",
    "mask_truncated_completions": "--model.update.mask_truncated_completions",
    "sync_ref_model": "--model.policy.ref_sync",
    "ref_model_mixup_alpha": "--model.policy.ref_sync.mixup_alpha",
    "ref_model_sync_steps": "--model.policy.ref_sync.every_n_steps",
    "top_entropy_quantile": "--model.update.top_entropy_quantile",
    "entropy_coef": "--model.update.entropy_coef",
    "use_adaptive_entropy": "--model.update.entropy_target",
    "entropy_coef_min": "--model.update.entropy_coef_min",
    "entropy_coef_max": "--model.update.entropy_coef_max",
    "entropy_coef_delta": "--model.update.entropy_coef_delta",
    "entropy_target": "--model.update.entropy_target",
    "max_tool_calling_iterations": "--model.environment.init_args.max_turns",
    "vllm_importance_sampling_correction": "--model.update.mismatch.corrections",
    "vllm_importance_sampling_mode": "--model.update.mismatch.corrections",
    "vllm_importance_sampling_clip_max": "--model.update.mismatch.corrections",
    "vllm_importance_sampling_clip_min": "--model.update.mismatch.corrections",
    "off_policy_mask_threshold": "--model.update.mismatch.corrections",
    "use_bias_correction_kl": "--model.objective.kl_estimator",
    "log_completions": "--model.validation.print_completions",
    "log_multimodal": NOT_SUPPORTED,
    "num_completions_to_print": "--model.validation.num_logged_completions",
    "log_unique_prompts": ALWAYS_ON,
    "log_completions_hub_repo": NOT_SUPPORTED,
    "use_transformers_continuous_batching": NOT_SUPPORTED,
    "transformers_continuous_batching_config": NOT_SUPPORTED,
    "use_transformers_paged": NOT_SUPPORTED,
    "vllm_importance_sampling_cap": "--model.update.mismatch.corrections",
}

#: the TrainingArguments a GRPOTrainer config sets most → lit_gspo's option (docs/from_trl.md, the second table)
TRAINING_ARGUMENTS: dict[str, str] = {
    "output_dir": "--trainer.default_root_dir",
    "per_device_train_batch_size": "--data.prompts_per_step",
    "gradient_accumulation_steps": "--model.update.micro_batch_size",
    "learning_rate": "--model.optimizer.lr",
    "weight_decay": "--model.optimizer.weight_decay",
    "adam_beta1": "--model.optimizer.betas",
    "adam_beta2": "--model.optimizer.betas",
    "adam_epsilon": "--model.optimizer.eps",
    "optim": "--model.optimizer",
    "max_grad_norm": "--model.update.max_grad_norm",
    "lr_scheduler_type": "--model.lr_scheduler",
    "warmup_steps": "--model.lr_scheduler LinearLR",
    "num_train_epochs": "--trainer.max_epochs",
    "max_steps": "--trainer.max_steps",
    "logging_steps": "--trainer.log_every_n_steps",
    "report_to": "--trainer.logger",
    "eval_strategy": "--model.validation.every_n_steps",
    "eval_steps": "--model.validation.every_n_steps",
    "per_device_eval_batch_size": "--data.val_batch_size",
    "save_steps": "--checkpoint_every_n_steps",
    "resume_from_checkpoint": "--ckpt_path last",
    "seed": "--seed_everything",
    "data_seed": "--data.seed",
    "bf16": "--trainer.precision bf16-mixed",
    "fp16": "--trainer.precision 16-mixed",
    "gradient_checkpointing": "--model.policy.gradient_checkpointing",
    "torch_compile": "--model.update.compile",
    "use_cpu": "--trainer.accelerator cpu",
    "fsdp": "--trainer.strategy",
    "deepspeed": NOT_SUPPORTED,
    "push_to_hub": "--push_to_hub",
    "hub_model_id": "--push_to_hub",
    "hub_private_repo": "--hub_private",
}


#: vllm.LLM's arguments (vLLM's EngineArgs) typed as VLLMEngine's: lit_gspo's option, or the pass-through
VLLM_LLM: dict[str, str] = {
    "gpu_memory_utilization": "--model.engine.init_args.kv_cache_gb",
    "enable_sleep_mode": NOT_SUPPORTED,
    "tensor_parallel_size": "--model.engine.init_args.llm_kwargs",
    "max_num_seqs": "--model.engine.init_args.llm_kwargs",
    "max_num_batched_tokens": "--model.engine.init_args.llm_kwargs",
    "enable_chunked_prefill": "--model.engine.init_args.llm_kwargs",
    "enable_prefix_caching": "--model.engine.init_args.llm_kwargs",
    "block_size": "--model.engine.init_args.llm_kwargs",
    "kv_cache_dtype": "--model.engine.init_args.llm_kwargs",
    "quantization": "--model.engine.init_args.llm_kwargs",
    "cpu_offload_gb": "--model.engine.init_args.llm_kwargs",
    "compilation_config": "--model.engine.init_args.llm_kwargs",
    "model_impl": "--model.engine.init_args.llm_kwargs",
}

#: vllm.SamplingParams' names for the sampling settings
VLLM_SAMPLING: dict[str, str] = {
    "n": "--model.generation.num_generations",
    "max_tokens": "--model.generation.max_new_tokens",
    "min_tokens": NOT_SUPPORTED,
    "presence_penalty": NOT_SUPPORTED,
    "frequency_penalty": NOT_SUPPORTED,
    "ignore_eos": NOT_SUPPORTED,
}

#: transformers' GenerationConfig names for the sampling settings
GENERATION_CONFIG: dict[str, str] = {
    "num_return_sequences": "--model.generation.num_generations",
    "do_sample": "--model.validation.num_generations",
    "stop_strings": "--model.generation.stop",
    "min_new_tokens": NOT_SUPPORTED,
    "typical_p": NOT_SUPPORTED,
    "num_beams": NOT_SUPPORTED,
    "no_repeat_ngram_size": NOT_SUPPORTED,
}

#: whose names, in the order a name is looked up (the first table that has it answers)
TABLES: dict[str, dict[str, str]] = {
    "TRL's GRPOConfig": GRPO_CONFIG,
    "TRL's TrainingArguments": TRAINING_ARGUMENTS,
    "vLLM's LLM": VLLM_LLM,
    "vLLM's SamplingParams": VLLM_SAMPLING,
    "transformers' GenerationConfig": GENERATION_CONFIG,
}


def looked_up(key: str) -> tuple[str, str | None, str | None]:
    """``key``'s last name (``beta`` of ``--model.beta``), the first table's that has it (``TRL's GRPOConfig``) and what
    it says (``--model.objective.beta``); None, None where no table has it."""
    name = key.lstrip("-").rpartition(".")[2]
    whose, where = next(((whose, table[name]) for whose, table in TABLES.items() if name in table), (None, None))
    return name, whose, where


def foreign_hint(key: str) -> str:
    """What to add to the error about the unknown option or YAML key ``key`` (``model.beta``, ``--beta``) when its
    last name is TRL's, transformers' or vLLM's: where the setting is here, one sentence; "" otherwise."""
    name, whose, where = looked_up(key)
    if whose is None:
        if name in training_arguments():
            return (
                f"{name} is one of transformers' TrainingArguments, which lit_gspo does not read: a run's settings "
                "are Lightning's Trainer's (--trainer.*) and lit_gspo's (--model.*, --data.*); docs/from_trl.md"
            )
        if name in generation_config():
            return (
                f"{name} is one of transformers' GenerationConfig settings, which lit_gspo does not read: the "
                "engines sample with --model.generation.temperature, top_p, top_k, min_p, repetition_penalty and stop"
            )
        return ""
    if where == NOT_SUPPORTED:
        return f"{whose} {name} is {NOT_SUPPORTED} here (docs/from_trl.md says why)"
    if where == ALWAYS_ON:
        return f"{whose} {name}: {ALWAYS_ON} here (docs/from_trl.md)"
    return f"{whose} {name} is {where} here (docs/from_trl.md says how they differ)"


def foreign_option(key: str) -> str | None:
    """The lit_gspo option another library's name ``key`` (its last name) maps to (``--model.objective.beta``),
    None if none."""
    where = looked_up(key)[2] or ""
    return where.split()[0] if where.startswith("--") else None


@functools.cache
def training_arguments() -> frozenset[str]:
    """The fields of the installed ``transformers.TrainingArguments`` (none where it does not import)."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return frozenset()
    return frozenset(field.name for field in dataclasses.fields(TrainingArguments))


@functools.cache
def generation_config() -> frozenset[str]:
    """The settings of the installed ``transformers.GenerationConfig`` (its public attributes by default)."""
    from transformers import GenerationConfig

    return frozenset(name for name in GenerationConfig().to_dict() if not name.startswith("_"))
