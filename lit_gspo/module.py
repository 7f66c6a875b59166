"""RLModule: the policy, its reference and old-policy snapshot, and one RL step.

    training_step(prompts):
        rollout  = generate G completions per prompt (policy in eval mode)       ── collect_rollout
        rewards  = Σ_k w_k · reward_k(prompt, completion)   (failed samples masked)
        Â        = advantages(rewards)                       (objective's estimator unless overridden)
        snapshot = old log-probs (fp32), reference log-probs, old values         ── only what is needed
        for epoch in 1..K, minibatch in 1..M:                                     ── update
            loss = objective(logp, old_logp, Â, mask, counts of the whole minibatch)
            backward per micro-batch, clip, optimiser step, scheduler step
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from lit_gspo import advantages as adv
from lit_gspo.checkpointing import restore_rng_states, rng_states
from lit_gspo.config import Generation, LoRA, Update, WarmStart, resolve_seed
from lit_gspo.data import encode_prompts
from lit_gspo.diagnostics import RatioStats
from lit_gspo.distributed import (
    apply_fsdp2, check_strategy, full_state_dict, is_sharded, reduce_step_stats, reduce_weighted_means, sum_over_ranks,
)
from lit_gspo.hardware import SlowPrecisionWarning, bf16_on_cpu_warning
from lit_gspo.models import checkpointing_active, enable_gradient_checkpointing, load_policy
from lit_gspo.models.lora import apply_lora, merged_for_saving, reference_mode
from lit_gspo.models.routing import RoutingRecord, moe_routers, record_routing, replay_routing, routing_volatility
from lit_gspo.objectives import GSPO, Counts, Objective
from lit_gspo.optim import shard_aware
from lit_gspo.rewards import ExactMatch, RewardSet
from lit_gspo.rollout import RolloutBatch, TokenForward, concat_rollouts, generate, left_pad, micro_batch_rows, token_logprobs


def default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)


class RLModule(LightningModule):
    """Reinforcement learning of a causal LM with a pluggable :class:`~lit_gspo.objectives.Objective`.

    Args:
        model: a built-in name (``tiny-llama``, ``tiny-qwen3-moe``, ``smollm2-135m-instruct``), a local
            Hugging Face directory, a ``.gguf`` file, or a hub id.
        model_config: overrides of the built-in model's config (layers, hidden size, ...).
        objective: the policy objective; by class name in YAML/CLI (``--model.objective GSPO``).
        rewards: reward functions ``(prompts, completions, **columns) -> list[float | None]``.
        reward_weights: one weight per reward function (default 1 each).
        advantage_estimator: ``group``, ``group_mean``, ``batch``, ``rloo`` or ``gae``; None = the objective's.
        dynamic_sampling: drop groups whose rewards are all equal and refill; None = the objective's.
        max_sampling_rounds: generation rounds allowed per step when refilling.
        max_skipped_steps: stop with an error after this many RL steps in a row without an update (all
            groups' rewards equal, or every reward failed). Skipped steps make no optimiser step, so they
            do not count towards ``trainer.max_steps``.
        kl_to_ref: keep a frozen reference policy to log ``train/kl`` even when β = 0.
        gradient_checkpointing: recompute each decoder layer's activations in backward (less memory,
            about a third more compute; TRL's GRPOTrainer turns it on by default).
        val_every_n_steps: greedy validation every n RL steps (also once before the first update).
        routing_replay: MoE only: record each layer's top-k experts in the old-policy pass (which then runs even
            on-policy) and force the update's forward to use them (Routing Replay, GSPO paper §5.3).
        track_routing_volatility: MoE only: log ``train/routing_volatility``, the share of (completion token,
            layer, top-k slot) choices that differ between the old-policy pass and the policy after the step's
            updates (one extra no-grad forward over the rollout; the old pass runs even on-policy).
    """

    def __init__(
        self,
        model: str = "tiny-llama",
        model_config: dict | None = None,
        gguf_file: str | None = None,
        objective: Objective | None = None,
        optimizer: OptimizerCallable = default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
        rewards: list[Callable] | None = None,
        reward_weights: list[float] | None = None,
        generation: Generation | None = None,
        update: Update | None = None,
        advantage_estimator: str | None = None,
        dynamic_sampling: bool | None = None,
        max_sampling_rounds: int = 4,
        max_skipped_steps: int = 20,
        kl_to_ref: bool = True,
        gamma: float = 1.0,
        lam: float = 0.95,
        chat_template: bool | None = None,
        system_prompt: str | None = None,
        lora: LoRA | None = None,
        gradient_checkpointing: bool = False,
        warm_start: WarmStart | None = None,
        val_every_n_steps: int = 10,
        routing_replay: bool = False,
        track_routing_volatility: bool = True,
        seed: int | None = None,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["objective", "optimizer", "lr_scheduler", "rewards"])
        self.automatic_optimization = False
        self.objective = objective if objective is not None else GSPO()
        self.optimizer_factory, self.scheduler_factory = optimizer, lr_scheduler
        self.generation = generation or Generation()
        self.update_cfg = update or Update()
        self.warm_start_cfg = warm_start or WarmStart()
        self.advantage_estimator = advantage_estimator or self.objective.advantage_estimator
        self.dynamic_sampling = self.objective.dynamic_sampling if dynamic_sampling is None else dynamic_sampling
        self.max_sampling_rounds, self.gamma, self.lam = max_sampling_rounds, gamma, lam
        self.max_skipped_steps, self._skipped_in_a_row = max_skipped_steps, 0
        self._logged_keys: set[str] = set()
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.val_every_n_steps, self.seed = val_every_n_steps, resolve_seed(seed)
        if self.advantage_estimator == "gae" and not self.objective.needs_critic:
            raise ValueError(f"advantage_estimator 'gae' needs a critic; {type(self.objective).__name__} has none "
                             "(use PPO, or 'group', 'group_mean', 'batch', 'rloo')")

        self.policy, self.tokenizer = load_policy(model, gguf_file=gguf_file, config_overrides=model_config, seed=self.seed)
        self.lora = lora
        self.is_moe = bool(moe_routers(self.policy))
        if routing_replay and not self.is_moe:
            raise ValueError(f"routing_replay needs an MoE policy with top-k routers; {model!r} has none")
        self.routing_replay = routing_replay
        self.records_routing = self.is_moe and (routing_replay or track_routing_volatility)
        if lora is not None:
            self.policy = apply_lora(self.policy, r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                                     target_modules=tuple(lora.target_modules))
        if gradient_checkpointing:
            enable_gradient_checkpointing(self.policy)
        self.gradient_checkpointing = gradient_checkpointing
        needs_ref = (self.objective.beta > 0 or kl_to_ref) and lora is None
        self.ref_policy = _frozen_copy(self.policy) if needs_ref else None
        self.use_ref = self.objective.beta > 0 or kl_to_ref
        self.value_head = nn.Linear(self.policy.config.hidden_size, 1) if self.objective.needs_critic else None
        self.reward_set = RewardSet(list(rewards) if rewards else [ExactMatch()], reward_weights)
        self._refill_generator = torch.Generator().manual_seed(self.seed)
        self._last_val_step: int | None = None

    # ------------------------------------------------------------------ Lightning plumbing
    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if self.value_head is not None:
            params += list(self.value_head.parameters())
        opt = shard_aware(self.optimizer_factory(params))  # bitsandbytes on FSDP2 shards: update local shards
        if self.scheduler_factory is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.scheduler_factory(opt), "interval": "step"}}

    def setup(self, stage: str) -> None:
        advice = bf16_on_cpu_warning(self.trainer.precision, self.trainer.strategy.root_device.type)
        if advice:  # bf16 emulated on this CPU: slower than fp32
            rank_zero_warn(advice, category=SlowPrecisionWarning)

    def configure_model(self) -> None:
        """FSDP2 (``ModelParallelStrategy``): ``fully_shard`` each decoder layer, then the root; FSDP1 is refused."""
        if self._trainer is not None:
            check_strategy(self.trainer.strategy)
        if self.device_mesh is not None:
            apply_fsdp2(self, self.device_mesh)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Every rank's torch/numpy/python RNG states and the refill generator (Lightning saves none)."""
        checkpoint["rng_states"] = rng_states(self._refill_generator)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "rng_states" in checkpoint:
            restore_rng_states(checkpoint["rng_states"], self.global_rank, self._refill_generator)

    def on_train_start(self) -> None:
        if self.global_step == 0:
            if self.warm_start_cfg.steps > 0:
                self.run_warm_start()
            self.run_validation()

    def on_train_end(self) -> None:
        self.run_validation()
        state_dict = full_state_dict(self.policy) if is_sharded(self.policy) else None  # collective under FSDP2
        if self.trainer.is_global_zero:
            self.save_hf_model(Path(self.trainer.default_root_dir) / "hf_model", state_dict)

    def training_step(self, rows: list[dict], batch_idx: int):
        start = time.perf_counter()
        rollout, stats = self.collect_rollout(rows)
        stats["time/rollout_s"] = time.perf_counter() - start
        if rollout is not None and not rollout.completion_mask.any() and self.trainer.world_size == 1:
            rollout = None  # every sample failed: nothing to learn from (other ranks would wait for us under DDP)
        if rollout is not None:
            start = time.perf_counter()
            stats.update(self.update(rollout))
            stats["time/update_s"] = time.perf_counter() - start
        self._skipped_in_a_row = 0 if rollout is not None else self._skipped_in_a_row + 1
        if self._skipped_in_a_row >= self.max_skipped_steps:
            # a skipped step makes no optimiser step, so max_steps alone would never end such a run
            raise RuntimeError(
                f"{self._skipped_in_a_row} RL steps in a row had nothing to learn from (frac_zero_std_groups="
                f"{stats.get('frac_zero_std_groups', float('nan')):.2f}, reward_failed={stats.get('reward_failed', 0):.0f}): "
                "every group's rewards were equal or every reward failed. Check the reward functions, or raise "
                f"max_skipped_steps={self.max_skipped_steps}")
        stats = reduce_step_stats(stats, None if rollout is None else rollout.rewards,  # over ranks (DDP/FSDP2)
                                  None if rollout is None else rollout.completion_mask.sum(1))
        values = {f"train/{k}" if not k.startswith("time/") else k: float(v) for k, v in stats.items()}
        # a step without a metric (e.g. clip_frac when no row carried a signal) logs NaN, not the last value
        values.update({k: float("nan") for k in self._logged_keys - values.keys()})
        self._logged_keys |= values.keys()
        self.log_dict(values, on_step=True, on_epoch=False, batch_size=len(rows))
        self.log_dict({"reward": float(stats["reward"]), "clip": float(stats.get("clip_frac", 0.0))},
                      prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=len(rows))
        if self.val_every_n_steps and (self.rl_step + 1) % self.val_every_n_steps == 0:
            self.run_validation(step=self.rl_step + 1)

    @property
    def rl_step(self) -> int:
        """RL steps (rollout batches) done so far, across epochs and resumes: the ``step`` of the logs."""
        return self.trainer.fit_loop.epoch_loop._batches_that_stepped

    # ------------------------------------------------------------------ rollout
    def encode(self, rows: list[dict]) -> list[list[int]]:
        g = self.generation
        new_tokens = max(g.max_new_tokens, g.val_max_new_tokens or 0)
        context = getattr(self.policy.config, "max_position_embeddings", None) or g.max_prompt_length + new_tokens
        if context - new_tokens < 1:
            raise ValueError(f"generation.max_new_tokens={new_tokens} leaves no room for a prompt in the "
                             f"model's context of {context} tokens")
        return encode_prompts(self.tokenizer, [r["prompt"] for r in rows], chat_template=self.chat_template,
                              max_prompt_length=min(g.max_prompt_length, context - new_tokens),
                              system_prompt=self.system_prompt)

    def sample(self, rows: list[dict], *, greedy: bool = False) -> tuple[RolloutBatch, list[str], dict]:
        """Generate (G per prompt, or one greedy) and score; returns the batch, completions and reward stats."""
        g = self.generation
        group = 1 if greedy else g.num_generations
        max_new_tokens = (g.val_max_new_tokens or g.max_new_tokens) if greedy else g.max_new_tokens
        batch = generate(self.policy, self.encode(rows), num_generations=group, max_new_tokens=max_new_tokens,
                         pad_id=self.tokenizer.pad_token_id, eos_id=self.tokenizer.eos_token_id,
                         temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, do_sample=not greedy,
                         synced_gpus=self._synced_gpus(), backend=g.backend, attn_implementation=g.attn_implementation)
        completion_ids = batch.input_ids[:, batch.prompt_length:].masked_fill(~batch.completion_mask, self.tokenizer.pad_token_id)
        completions = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        prompts = [r["prompt"] for r in rows for _ in range(group)]
        columns = {k: [r.get(k) for r in rows for _ in range(group)] for k in rows[0] if k != "prompt"}
        columns["completion_lengths"] = batch.completion_mask.sum(1).tolist()
        columns["max_completion_length"] = max_new_tokens
        scores = self.reward_set.score(prompts, completions, columns)
        valid = scores.valid
        batch.rewards = _fill_failed_with_group_mean(scores.total.float(), valid, group)
        stats = {"reward_failed": float(scores.num_failed)}
        for name, values in scores.per_function.items():
            ok = torch.isfinite(values)
            stats[f"reward/{name}"] = float(values[ok].mean()) if ok.any() else float("nan")
        # a failed sample keeps its row (groups stay intact) but carries no gradient
        batch.completion_mask = batch.completion_mask & valid[:, None]
        return batch, completions, stats

    def collect_rollout(self, rows: list[dict]) -> tuple[RolloutBatch | None, dict]:
        """Sample and score; with dynamic sampling, drop all-equal groups and refill (bounded rounds)."""
        G = self.generation.num_generations
        kept, stats, rounds, zero_std, seen = [], {}, 0, 0, 0
        pending = rows
        while pending and rounds < (self.max_sampling_rounds if self.dynamic_sampling else 1):
            rounds += 1
            batch, _, round_stats = self.sample(pending)
            stats = stats or round_stats
            rewards = batch.rewards.view(-1, G)
            constant = (rewards == rewards[:, :1]).all(1)  # (groups,)
            zero_std += int(constant.sum())
            seen += constant.numel()
            if self.dynamic_sampling:
                keep_groups = (~constant).nonzero().flatten()
                batch = batch.select((keep_groups[:, None] * G + torch.arange(G)).flatten())
            kept.append(batch)
            missing = len(rows) - sum(len(b) for b in kept) // G
            pending = self._refill_rows(missing) if missing > 0 and self.dynamic_sampling else []
        rollout = concat_rollouts([b for b in kept if len(b)], self.tokenizer.pad_token_id) if any(len(b) for b in kept) else None
        stats.update(frac_zero_std_groups=zero_std / max(seen, 1), sampling_rounds=float(rounds))
        all_rewards = torch.cat([b.rewards for b in kept]) if kept else torch.zeros(0)
        if rollout is None:
            stats.update(reward=float("nan"), response_length=float("nan"))
            return None, stats
        stats.update(reward=float(rollout.rewards.mean()), reward_std=float(rollout.rewards.std()) if len(rollout) > 1 else 0.0,
                     response_length=float(rollout.completion_mask.sum(1).float().mean()),
                     reward_all_groups=float(all_rewards.mean()))
        rollout = rollout.trimmed()
        self.snapshot(rollout)
        return rollout, stats

    def _refill_rows(self, count: int) -> list[dict]:
        pool = self._train_rows()
        idx = torch.randint(len(pool), (count,), generator=self._refill_generator)
        return [pool[int(i)] for i in idx]

    def _train_rows(self) -> list[dict]:
        dm = self.trainer.datamodule
        return dm.train_rows

    @torch.no_grad()
    def snapshot(self, rollout: RolloutBatch) -> None:
        """Reference log-probs, old values, routing and advantages; old-policy log-probs when the critic or routing needs the pass.

        Otherwise old log-probs wait for :meth:`update`: the first minibatch's equal its own detached
        log-probs (no optimiser step has been taken yet), so only the other minibatches need a pass.
        """
        need_old = self.value_head is not None or self.records_routing
        olds, refs, vals, routes = [], [], [], []
        for micro in self._micro_batches(rollout):
            if need_old:
                with record_routing(self.policy) if self.records_routing else nullcontext() as recorder:
                    fwd = self.completion_logprobs(self.policy, micro, value_head=self.value_head)
                if recorder is not None:
                    routes.append(recorder.record)
                olds.append(fwd.logprobs)
                if fwd.values is not None:
                    vals.append(fwd.values.float())
            if self.use_ref:
                refs.append(self._ref_logprobs(micro))
        if need_old and not self.update_cfg.on_policy:
            rollout.old_logprobs = torch.cat(olds)
        if routes:
            rollout.routing = RoutingRecord.cat(routes)  # (N, P + T, k) per MoE layer
        if refs:
            rollout.ref_logprobs = torch.cat(refs)
        mask = rollout.completion_mask
        if self.advantage_estimator == "gae":
            values = torch.cat(vals)
            token_rewards = torch.zeros_like(values)
            last = (mask.sum(1) - 1).clamp(min=0)
            token_rewards[torch.arange(len(rollout)), last] = rollout.rewards
            advantages, returns = adv.gae(token_rewards, values, mask, gamma=self.gamma, lam=self.lam)
            valid = advantages[mask]
            if valid.numel() > 1:  # whiten over the batch, as PPO does
                advantages = (advantages - valid.mean()) / (valid.std() + 1e-8)
            rollout.advantages, rollout.returns, rollout.old_values = advantages * mask, returns, values
        else:
            rollout.advantages = adv.compute_advantages(self.advantage_estimator, rollout.rewards,
                                                        self.generation.num_generations)

    def _ref_logprobs(self, micro: RolloutBatch) -> Tensor:
        if self.lora is not None:
            with reference_mode(self.policy):
                return self.completion_logprobs(self.policy, micro).logprobs
        return self.completion_logprobs(self.ref_policy, micro).logprobs

    # ------------------------------------------------------------------ update
    def update(self, rollout: RolloutBatch) -> dict[str, float]:
        """K epochs × M minibatches of optimiser steps; normalisers are those of each whole minibatch."""
        with checkpointing_active(self.policy):  # a no-op unless gradient_checkpointing is on
            return self._update(rollout)

    def _update(self, rollout: RolloutBatch) -> dict[str, float]:
        cfg = self.update_cfg
        opt = self.optimizers()
        scheduler = self.lr_schedulers()
        n = len(rollout)
        size = math.ceil(n / cfg.num_minibatches)
        world = self.trainer.world_size if self._trainer is not None else 1
        records: list[tuple[dict, float]] = []
        grad_norms, step_losses = [], []
        ratio_stats, steps_done = RatioStats(), 0  # ratios seen after ≥1 optimiser step (before it they are 1)
        active = self.rows_with_gradient(rollout)  # (N,) bool
        for epoch in range(cfg.epochs):
            order = self.minibatch_order(n)
            if not cfg.on_policy and rollout.old_logprobs is None:  # rows order[:size]: filled by their own forward
                later = order[size:]
                rollout.old_logprobs = self.old_logprobs(rollout, later[active[later]])
            for start in range(0, n, size):
                rows = order[start:start + size]
                counts = self.global_counts(rollout.completion_mask[rows])  # normalisers count every row
                # rows without gradient are left out; if none has one, a single row still runs (its loss is 0)
                # so that every rank backpropagates and the optimiser steps as it would on a zero gradient
                kept = active[rows].clone()
                placeholder = not bool(kept.any())
                kept[0] |= placeholder
                skipped_tokens = float(rollout.completion_mask[rows[~kept]].sum())
                rows = rows[kept]
                opt.zero_grad()
                step_loss = 0.0  # this rank's share of the minibatch loss (normalised by global counts)
                for micro_rows, micro in self._micro_batches(rollout.select(rows), with_rows=True):
                    micro = micro.trimmed()
                    with self._replayed_routing(micro):  # backward inside too: checkpointed layers route again
                        out, tokens, logprobs = self.micro_step(micro, counts, with_entropy=epoch == 0,
                                                                ratio_stats=ratio_stats if steps_done and not placeholder else None,
                                                                current_is_old=steps_done == 0 or placeholder)
                        self.manual_backward(out.loss * world)  # DDP/FSDP average gradients over ranks
                    if steps_done == 0 and rollout.old_logprobs is not None:  # later epochs reuse these rows
                        rollout.old_logprobs[rows[micro_rows], :logprobs.shape[1]] = logprobs
                    micro_metrics = {k: float(v) for k, v in out.metrics.items()}
                    if placeholder:  # its ratio is 1 by construction: keep only what it measures for real
                        micro_metrics = {k: v for k, v in micro_metrics.items()
                                         if k.startswith("clip_frac") or k in ("entropy", "kl")}
                    records.append((micro_metrics, tokens))
                    step_loss += float(out.loss.detach())
                if skipped_tokens:  # Â = 0: no clipping can zero a gradient there, so clip fractions stay over every token
                    records.append(({k: 0.0 for k in micro_metrics if k.startswith("clip_frac")}, skipped_tokens))
                step_losses.append(step_loss)
                grad_norms.append(self.clip_and_norm())
                opt.step()
                # an autocast with its cast cache on (not Lightning's) would keep the pre-step bf16 weights
                torch.clear_autocast_cache()
                steps_done += 1
                if scheduler is not None:
                    scheduler.step()
        metrics = reduce_weighted_means(records)  # token-weighted over every rank's micro-batches
        metrics["loss"] = sum_over_ranks(sum(step_losses) / len(step_losses))  # micro-batch and rank shares add up
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["rows_with_gradient"] = float(active.float().mean())  # share of rows the update ran (this rank)
        metrics["lr"] = opt.param_groups[0]["lr"] if not hasattr(opt, "optimizer") else opt.optimizer.param_groups[0]["lr"]
        if not cfg.on_policy:  # ratio diagnostics (lit_gspo.diagnostics); NaN where undefined, same keys every step
            metrics.update({f"ratio/{k}": v for k, v in ratio_stats.compute(self.generation.max_new_tokens).items()})
        if self.records_routing and rollout.routing is not None:
            metrics["routing_volatility"] = self.measure_routing_volatility(rollout)
        return metrics

    def _replayed_routing(self, micro: RolloutBatch):
        if self.routing_replay and micro.routing is not None:
            return replay_routing(self.policy, micro.routing)
        return nullcontext()

    @torch.no_grad()
    def measure_routing_volatility(self, rollout: RolloutBatch) -> float:
        """Share of (completion token, layer, top-k slot) choices of the current policy that differ from ``rollout.routing``.

        One no-grad forward over the whole rollout, in micro-batches, without replay.
        """
        with record_routing(self.policy) as recorder:
            for micro in self._micro_batches(rollout):
                token_logprobs(self.policy, micro, temperature=self.generation.temperature)
        mask = torch.cat([torch.zeros_like(rollout.input_ids[:, :rollout.prompt_length], dtype=torch.bool),
                          rollout.completion_mask], 1)
        return routing_volatility(rollout.routing, recorder.record, mask)

    def rows_with_gradient(self, rollout: RolloutBatch) -> Tensor:
        """(N,) bool: rows whose loss can have a gradient.

        With ``update.skip_zero_advantage_rows``, an objective whose loss vanishes with Â
        (``zero_advantage_has_no_gradient``), β = 0 and no critic, a row whose advantage is 0 on every
        completion token (e.g. a group whose rewards are all equal) adds exactly nothing to the
        gradient, so the update skips its forward and backward. It still counts in the normalisers.
        """
        n = len(rollout)
        if not (self.update_cfg.skip_zero_advantage_rows and self.objective.zero_advantage_has_no_gradient
                and self.objective.beta == 0 and self.value_head is None):
            return torch.ones(n, dtype=torch.bool)
        adv = rollout.advantages.to(rollout.completion_mask.device)
        nonzero = adv != 0 if adv.dim() == 1 else ((adv != 0) & rollout.completion_mask).any(1)
        return (nonzero & rollout.completion_mask.any(1)).cpu()

    def minibatch_order(self, n: int) -> Tensor:
        """The rows of a group-major rollout in the order minibatches take them (``update.shuffle``)."""
        cfg, G = self.update_cfg, self.generation.num_generations
        if cfg.num_minibatches == 1:
            return torch.arange(n)
        if cfg.shuffle == "rows" or n % G:
            return torch.randperm(n)
        return (torch.randperm(n // G)[:, None] * G + torch.arange(G)).flatten()

    @property
    def shares_prompts(self) -> bool:
        """Whether rows with the same prompt share one forward of it (``update.share_prompt_forward``).

        Off where the two-part forward would not be the same computation: MoE routing records and
        replays positions of one whole-sequence forward, checkpointed layers would append to the KV
        cache again when recomputed, and FSDP2 expects one root forward per backward.
        """
        return (self.update_cfg.share_prompt_forward and not self.is_moe and not self.gradient_checkpointing
                and not is_sharded(self.policy))

    def completion_logprobs(self, model: nn.Module, micro: RolloutBatch, **kwargs) -> TokenForward:
        """:func:`token_logprobs` at the sampling temperature, sharing prompts where :attr:`shares_prompts`."""
        return token_logprobs(model, micro, temperature=self.generation.temperature, share_prompts=self.shares_prompts,
                              **kwargs)

    @torch.no_grad()
    def old_logprobs(self, rollout: RolloutBatch, rows: Tensor) -> Tensor:
        """(N, T) log-probs of the policy before this update's first optimiser step, computed for ``rows`` (0 elsewhere)."""
        old = torch.zeros(rollout.completion_mask.shape, dtype=torch.float32, device=rollout.input_ids.device)
        if len(rows):
            for micro_rows, micro in self._micro_batches(rollout.select(rows), with_rows=True):
                micro = micro.trimmed()
                logprobs = self.completion_logprobs(self.policy, micro).logprobs
                old[rows[micro_rows], :logprobs.shape[1]] = logprobs
        return old

    def micro_step(self, micro: RolloutBatch, counts: Counts, with_entropy: bool, ratio_stats: RatioStats | None = None,
                   current_is_old: bool = False):
        """Loss of one (trimmed) micro-batch; returns (loss output, completion tokens, detached log-probs).

        ``current_is_old``: no optimiser step since the rollout, so the old log-probs are these very
        log-probs (detached) and ``micro.old_logprobs`` is not read.
        """
        fwd = self.completion_logprobs(self.policy, micro, with_entropy=with_entropy, value_head=self.value_head)
        old = fwd.logprobs.detach() if current_is_old or micro.old_logprobs is None else micro.old_logprobs
        if ratio_stats is not None and micro.old_logprobs is not None:
            ratio_stats.add(fwd.logprobs, old, micro.completion_mask)
        extra = {}
        if self.value_head is not None:
            extra = dict(values=fwd.values, old_values=micro.old_values, returns=micro.returns)
        out = self.objective(fwd.logprobs, old, micro.advantages, micro.completion_mask, counts=counts,
                             ref_logprobs=micro.ref_logprobs, **extra)
        mask = micro.completion_mask
        if fwd.entropy is not None and mask.any():
            out.metrics["entropy"] = fwd.entropy[mask].mean()
        return out, float(mask.sum()), fwd.logprobs.detach()

    def global_counts(self, mask: Tensor) -> Counts:
        """Tokens and sequences of the whole minibatch, summed over ranks."""
        local = torch.tensor([float(mask.sum()), float(mask.shape[0])], dtype=torch.float64, device=mask.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(local)
        return Counts(tokens=float(local[0]), seqs=float(local[1]), max_len=float(self.generation.max_new_tokens))

    def clip_and_norm(self) -> float:
        params = [p for p in self.parameters() if p.grad is not None]
        max_norm = self.update_cfg.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def _micro_batches(self, batch: RolloutBatch, with_rows: bool = False):
        """Micro-batches of ``batch`` (with their row indices into it when ``with_rows``); see ``micro_batch_rows``."""
        for rows in micro_batch_rows(batch, self.update_cfg.micro_batch_size, self.update_cfg.micro_batch_tokens):
            yield (rows, batch.select(rows)) if with_rows else batch.select(rows)

    # ------------------------------------------------------------------ validation, warm start, saving
    @torch.no_grad()
    def run_validation(self, step: int | None = None) -> dict[str, float]:
        """Mean reward of greedy completions on the held-out prompts, logged as ``val/reward``.

        Runs on a fork of the RNG state: how often one validates does not change the training run
        (a DataLoader iterator alone draws from the global generator).
        """
        dm = self.trainer.datamodule if self._trainer is not None else None
        step = self.rl_step if step is None else step
        if dm is None or not hasattr(dm, "val_dataloader") or step == self._last_val_step:
            return {}  # (the last periodic validation may coincide with the one at the end)
        self._last_val_step = step
        device_type = self.device.type
        devices = [self.device.index or 0] if device_type not in ("cpu", "meta") else []
        with torch.random.fork_rng(devices=devices, device_type=device_type if devices else None):
            return self._validate(dm, step)

    def _validate(self, dm, step: int) -> dict[str, float]:
        start = time.perf_counter()
        total, count, lengths = 0.0, 0, 0.0
        for rows in dm.val_dataloader():
            rows = rows[self.global_rank::self.trainer.world_size]
            if not rows:
                continue
            batch, _, _ = self.sample(rows, greedy=True)
            total += float(batch.rewards.sum())
            lengths += float(batch.completion_mask.sum())
            count += len(rows)
        sums = torch.tensor([total, float(count), lengths], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        metrics = {"val/reward": float(sums[0] / sums[1].clamp(min=1)),
                   "val/response_length": float(sums[2] / sums[1].clamp(min=1)),
                   "time/val_s": time.perf_counter() - start}
        for logger in self.loggers:
            logger.log_metrics(metrics, step=step)
        rank_zero_info(f"step {step}: val/reward = {metrics['val/reward']:.4f} ({metrics['time/val_s']:.1f} s)")
        return metrics

    def run_warm_start(self) -> None:
        """Supervised steps on (prompt, answer) pairs so RL starts from a policy that knows the format."""
        cfg = self.warm_start_cfg
        rows = [r for r in self._train_rows() if r.get("answer") is not None]
        if not rows:
            raise ValueError("warm_start needs training rows with an 'answer' column; the training data has none")
        opt = torch.optim.AdamW([p for p in self.policy.parameters() if p.requires_grad], lr=cfg.lr)
        generator = torch.Generator().manual_seed(self.seed)
        eos = self.tokenizer.eos_token_id
        self.policy.train()
        for step in range(cfg.steps):
            pick = torch.randint(len(rows), (cfg.batch_size,), generator=generator)
            chosen = [rows[int(i)] for i in pick]
            prompts = self.encode(chosen)
            answers = [self.tokenizer(str(r["answer"]), add_special_tokens=False)["input_ids"] + [eos] for r in chosen]
            batch = _teacher_forcing_batch(prompts, answers, self.tokenizer.pad_token_id)
            logp = token_logprobs(self.policy, batch).logprobs
            loss = -(logp * batch.completion_mask).sum() / batch.completion_mask.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        rank_zero_info(f"warm start: {cfg.steps} supervised steps, last loss {float(loss):.4f}")
        if self.ref_policy is not None:  # the reference is the policy RL starts from
            self.ref_policy.load_state_dict(self.policy.state_dict())

    def save_hf_model(self, path: Path, state_dict: dict | None = None) -> None:
        """Save in Hugging Face format; ``state_dict``: the full weights of an FSDP2-sharded policy."""
        model = self.policy
        if self.lora is not None:
            model = merged_for_saving(self.policy)
        model.save_pretrained(path, state_dict=state_dict)
        if state_dict is not None:  # fully_shard renamed the class (FSDPLlamaForCausalLM): record the real one
            from lit_gspo.distributed import unsharded_class

            model.config.architectures = [unsharded_class(model).__name__]
            model.config.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        rank_zero_info(f"saved the policy in Hugging Face format to {path}")

    def _synced_gpus(self) -> bool:
        return self._trainer is not None and self.trainer.world_size > 1 and "ModelParallel" in type(self.trainer.strategy).__name__


def _fill_failed_with_group_mean(rewards: Tensor, valid: Tensor, group: int) -> Tensor:
    """A failed sample takes its group's mean valid reward, so it shifts neither mean nor advantages."""
    r, ok = rewards.view(-1, group), valid.view(-1, group)
    mean = (r * ok).sum(1, keepdim=True) / ok.sum(1, keepdim=True).clamp(min=1)
    return torch.where(ok, r, mean).flatten()


def _frozen_copy(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


def _teacher_forcing_batch(prompts: list[list[int]], answers: list[list[int]], pad_id: int) -> RolloutBatch:
    ids, attn = left_pad(prompts, pad_id)
    width = max(len(a) for a in answers)
    completion = torch.full((len(answers), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(answers), width), dtype=torch.bool)
    for row, answer in enumerate(answers):
        completion[row, :len(answer)] = torch.tensor(answer)
        mask[row, :len(answer)] = True
    return RolloutBatch(input_ids=torch.cat([ids, completion], 1), attention_mask=torch.cat([attn, mask.long()], 1),
                        prompt_length=ids.shape[1], completion_mask=mask)


def _weighted_means(records: list[tuple[dict, float]]) -> dict[str, float]:
    """Token-weighted means of micro-batch metrics; min/max keys take the min/max."""
    out: dict[str, float] = {}
    keys = {k for metrics, _ in records for k in metrics}
    for key in keys:
        pairs = [(m[key], w) for m, w in records if key in m and math.isfinite(m[key])]
        if not pairs:
            continue
        if key.endswith("_min"):
            out[key] = min(v for v, _ in pairs)
        elif key.endswith("_max"):
            out[key] = max(v for v, _ in pairs)
        else:
            weight = sum(w for _, w in pairs)
            out[key] = sum(v * w for v, w in pairs) / weight if weight else sum(v for v, _ in pairs) / len(pairs)
    return out
