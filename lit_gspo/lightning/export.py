"""What a run writes besides its checkpoints: the policy in Hugging Face format (``hf_model/``, and ``hf_adapter/``
under LoRA), written aside and swapped in so that a kill never leaves a partial one, with the run's settings inside;
and the rollouts ``lit-gspo compare`` replays (``rollouts/step_K.pt``, ``lit_gspo.rl.rollout_io``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from lit_gspo.lightning.run_dir import save_export_config
from lit_gspo.models.hf_weights import hf_weights
from lit_gspo.models.lora import is_lora, merged_for_saving
from lit_gspo.rl.rollout_io import policy_dir, rollout_path, save_optimizer_state
from lit_gspo.rl.rollout_io import save_rollout as write_rollout
from lit_gspo.runtime.files import export_is_complete, written_aside
from lit_gspo.runtime.sharding import full_state_dict, is_sharded, unsharded_class


def adapter_path(path: Path) -> Path:
    """Where the LoRA adapter goes beside the merged model: ``<root>/hf_adapter`` for ``<root>/hf_model``
    (``PeftModel.from_pretrained(base, <root>/hf_adapter)`` reproduces the merged model)."""
    return Path(path).parent / "hf_adapter"


@dataclass
class Gathered:
    """An FSDP2-sharded policy's weights as rank 0 saves them: its full state dict and, under LoRA, the merged model's
    weights (a sharded policy cannot be copied to merge one)."""

    state_dict: dict[str, Tensor]
    merged: dict[str, Tensor] | None = None


def gather_for_saving(module) -> Gathered | None:
    """What :func:`save_hf_model` needs of a sharded policy, gathered (collective under FSDP2: every rank calls it);
    None for a policy each process holds whole."""
    if not is_sharded(module.policy):
        return None
    merged = dict(hf_weights(module.policy)) if module.settings.lora is not None else None
    return Gathered(full_state_dict(module.policy), merged)


def save_hf_model(module, path: Path, gathered: Gathered | None = None) -> None:
    """``module``'s policy in Hugging Face format at ``path``; ``gathered``: the weights of an FSDP2-sharded policy
    (:func:`gather_for_saving`). Under LoRA: the merged model at ``path`` and the adapter alone beside it
    (:func:`adapter_path`)."""
    state_dict = gathered.state_dict if gathered else None
    if module.settings.lora is None:
        return save_pretrained(module, module.policy, path, state_dict)
    if gathered is None:
        save_pretrained(module, merged_for_saving(module.policy), path, None)
    else:  # the base model under the adapters, saved with the merged weights in place of its own
        save_pretrained(module, module.policy.get_base_model(), path, gathered.merged)
    save_pretrained(
        module, module.policy, adapter_path(path), state_dict, "the LoRA adapter"
    )  # a PeftModel saves that only


def save_pretrained(module, model: nn.Module, path: Path, state_dict: dict | None, what: str = "the policy") -> None:
    """``model.save_pretrained`` with the tokenizer and the run's settings, written aside and swapped in."""
    with written_aside(path) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict)
        if state_dict is not None and not is_lora(model):  # fully_shard renamed the class (FSDPLlamaForCausalLM)
            model.config.architectures = [unsharded_class(model).__name__]
            model.config.save_pretrained(tmp)
        module.tokenizer.save_pretrained(tmp)
        save_export_config(module.trainer if module.attached() else None, tmp)  # the settings travel with a copy (eval)
    rank_zero_info(f"saved {what} in Hugging Face format to {path}")


def save_rollout(module, rollout) -> None:
    """``<root>/rollouts/step_K.pt``: the rollout of RL step K with the trainer's old log-probs, what a replay needs to
    compute the same log-probs and minibatches, and (``generation.dump_policy``) the policy that sampled it with
    the optimiser's state then. Every rank takes part (FSDP2 collectives); rank 0 writes its share of the rollout."""
    old = rollout.old_logprobs
    if old is None:  # on-policy training never computes them: one no-grad pass (every rank: FSDP2 collectives)
        old = module.learner.old_logprobs(rollout, torch.arange(len(rollout)))
    trainer = module.trainer
    path = rollout_path(trainer.default_root_dir, module.rl_step)
    opt = module.optimizers()
    opt = opt.optimizer if hasattr(opt, "optimizer") else opt
    with_policy = module.generation.dump_policy
    if with_policy:
        gathered = gather_for_saving(module)
        if trainer.is_global_zero:
            save_hf_model(module, policy_dir(path), gathered)
            if (
                gathered is None and module.settings.lora is None and module.value_head is None
            ):  # its state fits the HF policy
                save_optimizer_state(policy_dir(path), opt.state_dict())
    if not trainer.is_global_zero:
        return
    group = opt.param_groups[0]
    meta = {
        "temperature": module.generation.temperature,
        "max_len": module.learner.max_len,
        "group_size": module.generation.num_generations,
        "update": asdict(module.learner.cfg),
        "objective": repr(module.objective),
        "objective_class": type(module.objective).__name__,
        "advantage": type(module.advantage).__name__,
        "model": str(module.settings.name),
        "model_config": module.settings.config,
        "trust_remote_code": module.settings.trust_remote_code,
        "lora": module.settings.lora is not None,
        "seed": module.seed,
        "optimizer": type(opt).__name__,
        "optimizer_hparams": {
            k: v for k, v in group.items() if k != "params" and isinstance(v, (int, float, bool, tuple))
        },
        "world_size": trainer.world_size,
        "policy": policy_dir(path).name if with_policy else None,
    }
    write_rollout(path, replace(rollout, old_logprobs=old), module.rl_step, meta)
    rank_zero_info(f"saved the rollout of step {module.rl_step} to {path}")


def export_path(module) -> Path:
    return Path(module.trainer.default_root_dir) / "hf_model"


def export_policy(module) -> None:
    """The policy to ``<default_root_dir>/hf_model`` (collective under FSDP2; rank 0 writes)."""
    gathered = gather_for_saving(module)
    if module.trainer.is_global_zero:
        save_hf_model(module, export_path(module), gathered)


def export_if_missing(module) -> None:
    """A resume of a finished run skips the training loop and ``on_train_end``: write the export if a kill stopped it."""
    paths = [export_path(module)] + ([adapter_path(export_path(module))] if module.settings.lora is not None else [])
    if module.trainer.strategy.broadcast(not all(export_is_complete(p) for p in paths)):
        export_policy(module)


def load_trained_policy(module, path) -> None:
    """The policy's weights from a run's Hugging Face export (``<run>/hf_model``), to validate or test it: the run's
    warm start is in them, so none is done again."""
    from transformers import AutoModelForCausalLM

    if module.settings.lora is not None:
        raise ValueError(
            f"{path}: a LoRA run's hf_model holds the merged weights; validate it without --model.policy.lora"
        )
    trained = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, trust_remote_code=module.settings.trust_remote_code
    )
    module.policy.load_state_dict(trained.state_dict())
    module.warm_started = True
    rank_zero_info(f"loaded the policy from {path}")
