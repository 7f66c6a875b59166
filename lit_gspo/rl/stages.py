"""The stages of one RL step, built from a run's settings: the policies, the collector that samples and scores, the
learner that updates. ``RLModule`` (the Lightning adapter) holds what this returns; a script can use it alone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from lit_gspo.models.cast_parameters import PARAM_DTYPES
from lit_gspo.models.policies import build_policies
from lit_gspo.rl.collect import Collector
from lit_gspo.rl.config import Generation, Policy, Update
from lit_gspo.rl.engines import RolloutEngine
from lit_gspo.rl.envs import Environment, SingleTurn
from lit_gspo.rl.forward_checks import check_policy_forward
from lit_gspo.rl.learn.learner import Learner
from lit_gspo.rl.learn.mismatch import Mismatch
from lit_gspo.rl.objectives import Objective
from lit_gspo.rl.reference_sync import check_reference_sync
from lit_gspo.rl.rewards import ExactMatch, RewardSet
from lit_gspo.rl.stop_tokens import environment_stop_ids
from lit_gspo.runtime.installed import check_installed


@dataclass
class Stages:
    policy: nn.Module
    tokenizer: object
    value_head: nn.Module | None
    reference: nn.Module | None  # a frozen copy (None: none, or LoRA's base model with adapters off)
    collector: Collector
    learner: Learner


def build_stages(
    policy: Policy,
    objective: Objective,
    engine: RolloutEngine,
    generation: Generation,
    update: Update,
    *,
    rewards: list[Callable] | None,
    reward_weights: list[float] | None,
    environment: Environment | None,
    mismatch: Mismatch | None,
    seed: int,
) -> Stages:
    """The policy (and its reference and critic), a collector over ``environment`` × ``engine`` scored by ``rewards``,
    and a learner of ``objective`` with ``update``'s schedule and ``mismatch``'s π_old (``update.mismatch`` as the run
    resolved it)."""
    check_installed()  # the Python API's start, as `lit-gspo` checks at its own
    models = build_policies(
        policy.name,
        model_config=policy.config,
        gguf_file=policy.gguf_file,
        seed=seed,
        lora=policy.lora,
        gradient_checkpointing=policy.gradient_checkpointing,
        reference=objective.beta > 0 or policy.kl_to_ref,
        critic=objective.needs_critic,
        trust_remote_code=policy.trust_remote_code,
    )
    if policy.check_forward:  # the reference too: a copy made before the check, its logit map is the policy's
        for model in (models.policy, models.reference):
            if isinstance(model, nn.Module):
                check_policy_forward(model)
    if policy.ref_sync is not None:
        check_reference_sync(isinstance(models.reference, nn.Module), lora=policy.lora is not None)
    if policy.routing.replay and not models.is_moe:
        raise ValueError(f"policy.routing.replay needs an MoE policy with top-k routers; {policy.name!r} has none")
    dynamic = objective.paper_dynamic_sampling if generation.dynamic_sampling is None else generation.dynamic_sampling
    environment = environment or SingleTurn()
    stop_ids = environment_stop_ids(models.tokenizer, environment, models.policy)
    collector = Collector(
        environment,
        engine,
        RewardSet(list(rewards) if rewards else [ExactMatch()], reward_weights),
        models.tokenizer,
        generation,
        dynamic_sampling=dynamic,
        max_sampling_rounds=generation.max_sampling_rounds,
        engine_logprobs=mismatch is not None,
        param_dtype=PARAM_DTYPES.get(update.param_dtype),
        stop_ids=stop_ids,
    )
    learner = Learner(
        models.policy,
        objective,
        update,
        value_head=models.value_head,
        reference=models.reference,
        temperature=generation.temperature,
        max_len=generation.max_new_tokens * collector.environment.max_turns,
        group_size=generation.num_generations,
        routing_replay=policy.routing.replay,
        record_routing=models.is_moe and policy.routing.track_volatility,
        gradient_checkpointing=policy.gradient_checkpointing,
        mismatch=mismatch,
    )
    reference = models.reference if isinstance(models.reference, nn.Module) else None
    return Stages(models.policy, models.tokenizer, models.value_head, reference, collector, learner)
