"""RLModule: the Lightning adapter around the four stages of one RL step.

    training_step(rows):
        rollout  = collect(rows)              Environment × RolloutEngine → trajectories, rewards   (collect.py)
        snapshot(rollout)                     reference log-probs, old values, MoE routes          (learner.py)
        Â        = advantage(rollout)         group, RLOO, GAE, ...                                 (advantages.py)
        metrics  = learn(rollout)             K epochs × M minibatches of optimiser steps           (learner.py)
        log(metrics)

This file owns what needs Lightning: the optimiser and scheduler, manual backward, hooks, logging,
validation, the RL-step counter in checkpoints, and saving the policy.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lit_gspo.advantages import AdvantageEstimator, get_advantage
from lit_gspo.checkpointing import export_is_complete, restore_rng_states, rng_states, written_aside
from lit_gspo.collect import Collector
from lit_gspo.completions_log import due, log_completions
from lit_gspo.config import Generation, LoRA, Update, WarmStart, resolve_seed
from lit_gspo.data.prompts import check_prompt_lengths
from lit_gspo.distributed import (all_reduce_sum, apply_fsdp2, check_strategy, full_state_dict, gather_objects, is_sharded,
                                  reduce_step_stats, sum_over_ranks)
from lit_gspo.engines import HFGenerate, RolloutEngine
from lit_gspo.envs import Environment, SingleTurn
from lit_gspo.hardware import SlowPrecisionWarning, bf16_on_cpu_warning, deterministic_on_cpu
from lit_gspo.learner import Learner
from lit_gspo.mismatch import Mismatch
from lit_gspo.models import enable_gradient_checkpointing, load_policy
from lit_gspo.models.lora import apply_lora, is_lora, merged_for_saving
from lit_gspo.models.routing import moe_routers
from lit_gspo.objectives import GSPO, Objective
from lit_gspo.optim import shard_aware
from lit_gspo.quiet import silence_lightning_noise
from lit_gspo.rewards import ExactMatch, RewardSet
from lit_gspo.safe_ends import SafeEnds
from lit_gspo.warm_start import warm_start


def default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)


class RLModule(LightningModule):
    """Reinforcement learning of a causal LM with a pluggable :class:`~lit_gspo.objectives.Objective`.

    Args:
        model: a built-in name (``tiny-llama``, ``tiny-qwen3-moe``, ``smollm2-135m-instruct``), a local
            Hugging Face directory, a ``.gguf`` file, or a hub id.
        model_config: overrides of the built-in model's config (layers, hidden size, ...).
        objective: the loss; by class name in YAML/CLI (``--model.objective GSPO``).
        rewards: reward functions ``(prompts, completions, **columns) -> list[float | None]``.
        reward_weights: one weight per reward function (default 1 each).
        environment: what the policy talks to (default :class:`~lit_gspo.envs.SingleTurn`: the row's
            prompt, one reply); it also holds ``system_prompt`` and ``chat_template``.
        engine: what samples (default :class:`~lit_gspo.engines.HFGenerate`; ``LeanSampler`` is faster on CPU).
        advantage: the advantage estimator (``GroupNormalized``, ``GroupMean``, ``BatchNormalized``,
            ``RLOO``, ``GAE``); None: the objective's paper's (``Objective.paper_advantage``).
        dynamic_sampling: drop groups whose rewards are all equal and refill; None: the objective's paper's
            (DAPO's is on).
        max_sampling_rounds: generation rounds allowed per step when refilling.
        max_skipped_steps: stop with an error after this many RL steps in a row without an update (all
            groups' rewards equal, or every reward failed). Skipped steps make no optimiser step, so they
            do not count towards ``trainer.max_steps``.
        kl_to_ref: keep a frozen reference policy to log ``train/kl`` even when β = 0.
        gradient_checkpointing: recompute each decoder layer's activations in backward (less memory,
            about a third more compute; TRL's GRPOTrainer turns it on by default).
        val_every_n_steps: greedy validation every n RL steps (also once before the first update and once at
            the end; 0: only those two).
        log_completions_every_n_steps: log the greedy completions of the first ``num_logged_completions``
            held-out prompts (prompt, completion, reward) with the validations at steps that are multiples of n
            (None: every validation; 0: never) through the configured loggers (``lit_gspo/completions_log.py``).
        routing_replay: MoE only: record each layer's top-k experts in the old-policy pass (which then runs even
            on-policy) and force the update's forward to use them (Routing Replay, GSPO paper §5.3).
        track_routing_volatility: MoE only: log ``train/routing_volatility``, the share of (completion token,
            layer, top-k slot) choices that differ between the old-policy pass and the policy after the step's
            updates, and ``train/routing/*``: the share of tokens rerouted and their mean |log-ratio| against the
            others' (``Learner.measure_routing``; one extra no-grad forward over the rollout; the old pass runs
            even on-policy).
        save_rollouts_every_n_steps: write the rollout of every RL step K that is a positive multiple of n, after
            its advantages and before its update, to ``<default_root_dir>/rollouts/step_K.pt`` (0: never), for
            ``lit-gspo compare`` (``lit_gspo/rollout_io.py``). Training is unchanged by it.
        save_rollout_policy: with each rollout file, the policy that sampled it (``rollouts/step_K_policy/``, Hugging
            Face format), so that ``lit-gspo compare`` replays it from the very weights.
        mismatch: measure the sampler–trainer mismatch (``train/mismatch/*``) and correct it (TIS, MIS, SequenceMIS,
            OPSM; or the sampler's log-probs as π_old): ``lit_gspo/mismatch.py``, docs/mismatch.md. None: off.
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
        environment: Environment | None = None,
        engine: RolloutEngine | None = None,
        advantage: AdvantageEstimator | None = None,
        generation: Generation | None = None,
        update: Update | None = None,
        dynamic_sampling: bool | None = None,
        max_sampling_rounds: int = 4,
        max_skipped_steps: int = 20,
        kl_to_ref: bool = True,
        lora: LoRA | None = None,
        gradient_checkpointing: bool = False,
        warm_start: WarmStart | None = None,
        val_every_n_steps: int = 10,
        log_completions_every_n_steps: int | None = None,
        num_logged_completions: int = 8,
        routing_replay: bool = False,
        track_routing_volatility: bool = True,
        save_rollouts_every_n_steps: int = 0,
        save_rollout_policy: bool = True,
        seed: int | None = None,
        mismatch: Mismatch | None = None,
    ):
        super().__init__()
        silence_lightning_noise()  # before Trainer.fit checks its configuration (lit_gspo/quiet.py says what and why)
        self.save_hyperparameters(ignore=["objective", "optimizer", "lr_scheduler", "rewards", "environment", "engine",
                                          "advantage", "mismatch"])
        self.automatic_optimization = False
        self.objective = objective if objective is not None else GSPO()
        self.advantage = advantage if advantage is not None else get_advantage(self.objective.paper_advantage)
        if self.advantage.needs_values != self.objective.needs_critic:
            raise ValueError(
                f"{type(self.advantage).__name__} {'needs' if self.advantage.needs_values else 'does not use'} a critic's "
                f"values, and {type(self.objective).__name__} {'has' if self.objective.needs_critic else 'has no'} critic: "
                "use GAE with PPO, and GroupNormalized, GroupMean, BatchNormalized or RLOO with the others")
        self.optimizer_factory, self.scheduler_factory = optimizer, lr_scheduler
        self.generation, self.warm_start_cfg = generation or Generation(), warm_start or WarmStart()
        if self.advantage.needs_groups and self.generation.num_generations < 2:
            raise ValueError(
                f"generation.num_generations={self.generation.num_generations}, but {type(self.advantage).__name__} compares "
                "the completions of a prompt with each other (Â = 0 for a group of 1, nothing is learned): use "
                "num_generations >= 2, or an estimator without groups (GAE with PPO)")
        if max_skipped_steps < 1:
            raise ValueError(f"max_skipped_steps must be >= 1, got {max_skipped_steps}")
        if val_every_n_steps < 0:
            raise ValueError(f"val_every_n_steps must be >= 0 (0: only before and after training), got {val_every_n_steps}")
        if (log_completions_every_n_steps or 0) < 0 or num_logged_completions < 0:
            raise ValueError(f"log_completions_every_n_steps and num_logged_completions must be >= 0, got "
                             f"{log_completions_every_n_steps} and {num_logged_completions}")
        self.max_skipped_steps, self._skipped_in_a_row = max_skipped_steps, 0
        if save_rollouts_every_n_steps < 0:
            raise ValueError(f"save_rollouts_every_n_steps must be >= 0 (0: never), got {save_rollouts_every_n_steps}")
        self.save_rollouts_every_n_steps, self.save_rollout_policy = save_rollouts_every_n_steps, save_rollout_policy
        self.val_every_n_steps, self.seed = val_every_n_steps, resolve_seed(seed)
        self.log_completions_every_n_steps, self.num_logged_completions = log_completions_every_n_steps, num_logged_completions
        self.rl_step = 0  # RL steps (rollout batches) done, across epochs and resumes: the ``step`` of the logs
        self._logged_keys: set[str] = set()
        self._last_val_step: int | None = None
        self._last_val_metrics: dict[str, float] = {}

        self.policy, self.tokenizer = load_policy(model, gguf_file=gguf_file, config_overrides=model_config, seed=self.seed)
        if routing_replay and not moe_routers(self.policy):
            raise ValueError(f"routing_replay needs an MoE policy with top-k routers; {model!r} has none")
        self.lora = lora
        if lora is not None:
            self.policy = apply_lora(self.policy, r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                                     target_modules=tuple(lora.target_modules))
        if gradient_checkpointing:
            enable_gradient_checkpointing(self.policy)
        use_ref = self.objective.beta > 0 or kl_to_ref
        self.ref_policy = _frozen_copy(self.policy) if use_ref and lora is None else None
        self.value_head = nn.Linear(self.policy.config.hidden_size, 1) if self.objective.needs_critic else None

        dynamic = self.objective.paper_dynamic_sampling if dynamic_sampling is None else dynamic_sampling
        self.collector = Collector(environment or SingleTurn(), engine or HFGenerate(),
                                   RewardSet(list(rewards) if rewards else [ExactMatch()], reward_weights),
                                   self.tokenizer, self.generation, dynamic_sampling=dynamic,
                                   max_sampling_rounds=max_sampling_rounds, engine_logprobs=mismatch is not None)
        self.learner = Learner(
            self.policy, self.objective, update or Update(), value_head=self.value_head,
            reference=(self.ref_policy if lora is None else "adapters_off") if use_ref else None,
            temperature=self.generation.temperature,
            max_len=self.generation.max_new_tokens * self.collector.environment.max_turns,
            group_size=self.generation.num_generations, routing_replay=routing_replay,
            record_routing=bool(moe_routers(self.policy)) and track_routing_volatility,
            gradient_checkpointing=gradient_checkpointing, mismatch=mismatch)
        self._refill_generator = torch.Generator().manual_seed(self.seed)

    # ------------------------------------------------------------------ one RL step
    def training_step(self, rows: list[dict], batch_idx: int) -> None:
        start = time.perf_counter()
        self.collector.engine.sync_weights(self.policy)
        rollout, stats = self.collector.collect(self.policy, rows, self._refill_rows, synced_gpus=self._synced_gpus())
        stats["time/rollout_s"] = time.perf_counter() - start
        if not self._anything_to_learn(rollout):
            rollout = None  # every sample of every rank failed: no rank updates, all count a skipped step alike
        if rollout is not None:
            start = time.perf_counter()
            self.learner.snapshot(rollout)
            rollout.advantages = self.advantage(rollout, self.generation.num_generations)
            if self.save_rollouts_every_n_steps and self.rl_step and self.rl_step % self.save_rollouts_every_n_steps == 0:
                self.save_rollout(rollout)
            stats.update(self.learner.learn(rollout, self.optimizers(), self.lr_schedulers(),
                                            backward=self.manual_backward, world_size=self.trainer.world_size))
            stats["time/update_s"] = time.perf_counter() - start
        self._check_progress(rollout is not None, stats)
        self.log_step(stats, rollout, batch_size=len(rows))
        self.rl_step += 1
        if self.val_every_n_steps and self.rl_step % self.val_every_n_steps == 0:
            self.run_validation(step=self.rl_step)

    def _anything_to_learn(self, rollout) -> bool:
        """Whether any rank kept a sample (collective under several processes: every rank decides the same; a rank
        whose samples all failed still takes part in the update of the others, with a zero mask)."""
        mine = rollout is not None and bool(rollout.completion_mask.any())
        return sum_over_ranks(float(mine)) > 0 if self.trainer.world_size > 1 else mine

    def _check_progress(self, updated: bool, stats: dict) -> None:
        """A skipped step makes no optimiser step, so ``max_steps`` alone would never end a run that keeps skipping.
        ``updated`` is the same on every rank (:meth:`_anything_to_learn`), so all ranks stop at the same step, each
        with the first rank's reward error."""
        self._skipped_in_a_row = 0 if updated else self._skipped_in_a_row + 1
        if self._skipped_in_a_row >= self.max_skipped_steps:
            errors = [e for e in gather_objects(self.collector.rewards.last_error) if e]
            raise RuntimeError(
                f"{self._skipped_in_a_row} RL steps in a row had nothing to learn from (frac_zero_std_groups="
                f"{stats.get('frac_zero_std_groups', float('nan')):.2f}, reward_failed={stats.get('reward_failed', 0):.0f}): "
                "every group's rewards were equal or every reward failed. Check the reward functions, or raise "
                f"max_skipped_steps={self.max_skipped_steps}" + (f". The last reward error: {errors[0]}" if errors else ""))

    def log_step(self, stats: dict, rollout, batch_size: int) -> None:
        """``train/*`` over every rank (a step without some metric logs NaN for it, not its last value) and the progress bar."""
        stats = reduce_step_stats(stats, None if rollout is None else rollout.rewards,
                                  None if rollout is None else rollout.completion_mask.sum(1))
        values = {f"train/{k}" if not k.startswith("time/") else k: float(v) for k, v in stats.items()}
        values.update({k: float("nan") for k in self._logged_keys - values.keys()})
        self._logged_keys |= values.keys()
        self.log_dict(values, on_step=True, on_epoch=False, batch_size=batch_size)
        self.log_dict({"reward": float(stats["reward"]), "clip": float(stats.get("clip_frac", 0.0))},
                      prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=batch_size)

    def _refill_rows(self, count: int) -> list[dict]:
        pool = self.trainer.datamodule.train_rows
        idx = torch.randint(len(pool), (count,), generator=self._refill_generator)
        return [pool[int(i)] for i in idx]

    def _synced_gpus(self) -> bool:
        """Sharded parameters (FSDP2 over several processes): every rank must take part in every forward."""
        return self._trainer is not None and self.trainer.world_size > 1 and isinstance(self.trainer.strategy,
                                                                                         ModelParallelStrategy)

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
        # One Lightning batch is one RL step (seconds to minutes, not milliseconds): every RL step writes its
        # train/* row, as every validation writes its val/* row. Lightning's default of a row every 50 batches
        # (the CLI's is 1) would leave a short plain-Trainer run without a train/reward. Set on the trainer
        # rather than by writing rows past Lightning, so the rows keep Lightning's step, epoch and flushing;
        # 0 (logging off) is kept.
        if self.trainer.log_every_n_steps > 1:
            self.trainer.log_every_n_steps = 1
        deterministic_on_cpu(self.trainer.strategy.root_device.type)  # before the warm start's first backward
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
        """Every rank's torch/numpy/python RNG states, the refill generator and the RL-step counter (Lightning saves none)."""
        checkpoint["rng_states"] = rng_states(self._refill_generator)
        checkpoint["rl_step"] = self.rl_step

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "rng_states" in checkpoint:
            restore_rng_states(checkpoint["rng_states"], self.global_rank, self._refill_generator)
        # checkpoints written before the counter was saved: Lightning's count of batches is the same number
        self.rl_step = checkpoint.get("rl_step", _batches_that_stepped(checkpoint))

    def on_fit_start(self) -> None:
        dm = self.trainer.datamodule
        rows = getattr(dm, "train_rows", None)
        if rows:  # a reward function whose parameters no dataset column fills fails now, not after N steps
            self.collector.rewards.check(list(rows[0]))
        for split in ("train", "val"):  # a prompt too long for the context fails now, named by its file row
            check_prompt_lengths(getattr(dm, f"{split}_rows", None) or [], lambda r: self.collector.encode(self.policy, r),
                                 lambda i: dm.describe_row(split, i) if hasattr(dm, "describe_row") else f"{split} row {i}")

    def on_train_start(self) -> None:
        if self.global_step == 0:
            if self.warm_start_cfg.steps > 0:
                loss = warm_start(self.policy, self.tokenizer, self.trainer.datamodule.train_rows,
                                  lambda rows: self.collector.encode(self.policy, rows), self.warm_start_cfg, self.seed,
                                  environment=self.collector.environment)
                rank_zero_info(f"warm start: {self.warm_start_cfg.steps} supervised steps, last loss {loss:.4f}")
                if self.ref_policy is not None:  # the reference is the policy RL starts from
                    self.ref_policy.load_state_dict(self.policy.state_dict())
            self.run_validation()

    def on_train_end(self) -> None:
        self.run_validation()
        self._export()

    def on_fit_end(self) -> None:
        """A resume of a finished run skips the training loop and ``on_train_end``: write the export if a kill stopped it."""
        paths = [self._export_path()] + ([self.adapter_path(self._export_path())] if self.lora is not None else [])
        if self.trainer.strategy.broadcast(not all(export_is_complete(p) for p in paths)):
            self._export()

    def configure_callbacks(self) -> list:
        """Run lock, cleanup of killed writes, rows before checkpoints, SIGINT/SIGTERM saved (``lit_gspo.safe_ends``)."""
        return [SafeEnds()]

    def _export_path(self) -> Path:
        return Path(self.trainer.default_root_dir) / "hf_model"

    def _export(self) -> None:
        state_dict = full_state_dict(self.policy) if is_sharded(self.policy) else None  # collective under FSDP2
        if self.trainer.is_global_zero:
            self.save_hf_model(self._export_path(), state_dict)

    # ------------------------------------------------------------------ validation, saving
    @torch.no_grad()
    def run_validation(self, step: int | None = None) -> dict[str, float]:
        """Mean reward of greedy completions on the held-out prompts, logged as ``val/reward``.

        Runs on a fork of the RNG state: how often one validates does not change the training run
        (a DataLoader iterator alone draws from the global generator). Called again at the same step (e.g.
        after ``fit``, which validates at its end), it returns that validation's metrics without re-running.
        """
        dm = self.trainer.datamodule if self._trainer is not None else None
        step = self.rl_step if step is None else step
        if dm is None or not hasattr(dm, "val_dataloader"):
            return {}
        if step == self._last_val_step:  # the last periodic validation may coincide with the one at the end
            return dict(self._last_val_metrics)
        self._last_val_step = step
        device_type = self.device.type
        devices = [self.device.index or 0] if device_type not in ("cpu", "meta") else []
        with torch.random.fork_rng(devices=devices, device_type=device_type if devices else None):
            self._last_val_metrics = self._validate(dm, step)
        return dict(self._last_val_metrics)

    def _validate(self, dm, step: int) -> dict[str, float]:
        start = time.perf_counter()
        self.collector.engine.sync_weights(self.policy)
        episode_keys = self._episode_metric_keys()
        total, count, lengths = 0.0, 0, 0.0
        episode_sums = torch.zeros(2, len(episode_keys), dtype=torch.float64)  # value × rows, rows reporting it
        shown = ([], [], []) if due(step, self.log_completions_every_n_steps) else None  # rows, replies, rewards
        for rows in dm.val_dataloader():
            rows = rows[self.global_rank::self.trainer.world_size]
            if not rows:
                continue
            batch, replies, stats = self.collector.sample(self.policy, rows, greedy=True, synced_gpus=self._synced_gpus())
            if shown is not None:
                room = max(self.num_logged_completions - len(shown[0]), 0)
                for part, new in zip(shown, (rows, replies, batch.rewards.tolist())):
                    part.extend(new[:room])
            total += float(batch.rewards.sum())
            lengths += float(batch.completion_mask.sum())
            count += len(rows)
            for j, key in enumerate(episode_keys):
                if key in stats:  # success_turn{k} is a rate over the episodes that reached turn k
                    reached = stats[key.replace("success_", "reached_")] if key.startswith("success_turn") else 1.0
                    weight = len(rows) * reached
                    episode_sums[:, j] += torch.tensor([stats[key] * weight, weight], dtype=torch.float64)
        sums = all_reduce_sum(torch.cat([torch.tensor([total, float(count), lengths], dtype=torch.float64),
                                         episode_sums.flatten()]))
        metrics = {"val/reward": float(sums[0] / sums[1].clamp(min=1)),
                   "val/response_length": float(sums[2] / sums[1].clamp(min=1))}
        episode_sums = sums[3:].view(2, -1)
        metrics.update({f"val/{key}": float(episode_sums[0, j] / episode_sums[1, j])
                        for j, key in enumerate(episode_keys) if episode_sums[1, j] > 0})
        metrics["time/val_s"] = time.perf_counter() - start
        for logger in self.loggers:
            logger.log_metrics(metrics, step=step)
        if shown is not None and self.trainer.is_global_zero:
            log_completions(self.loggers, step, *shown)
        rank_zero_info(f"step {step}: val/reward = {metrics['val/reward']:.4f} ({metrics['time/val_s']:.1f} s)")
        return metrics

    def _episode_metric_keys(self) -> list[str]:
        """The multi-turn metrics validation reports (none for a single-turn environment)."""
        environment = self.collector.environment
        if environment.max_turns == 1:
            return []
        return (["turns", "success"] + [f"success_turn{k}" for k in range(1, environment.max_turns + 1)]
                + list(environment.metric_names))

    def save_rollout(self, rollout) -> None:
        """``<root>/rollouts/step_K.pt`` with the trainer's old log-probs (and the sampling policy): ``lit_gspo.rollout_io``."""
        from dataclasses import asdict, replace

        from lit_gspo.rollout_io import policy_dir, rollout_path, save_optimizer_state, save_rollout

        old = rollout.old_logprobs
        if old is None:  # on-policy training never computes them: one no-grad pass (every rank: FSDP2 collectives)
            old = self.learner.old_logprobs(rollout, torch.arange(len(rollout)))
        path = rollout_path(self.trainer.default_root_dir, self.rl_step)
        opt = self.optimizers()
        opt = opt.optimizer if hasattr(opt, "optimizer") else opt
        if self.save_rollout_policy:
            state_dict = full_state_dict(self.policy) if is_sharded(self.policy) else None
            if self.trainer.is_global_zero:
                self.save_hf_model(policy_dir(path), state_dict)
                if state_dict is None and self.lora is None and self.value_head is None:  # its state fits the HF policy
                    save_optimizer_state(policy_dir(path), opt.state_dict())
        if not self.trainer.is_global_zero:
            return  # rank 0's share of the rollout
        group = opt.param_groups[0]
        meta = {"temperature": self.generation.temperature, "max_len": self.learner.max_len,
                "group_size": self.generation.num_generations, "update": asdict(self.learner.cfg),
                "objective": repr(self.objective), "objective_class": type(self.objective).__name__,
                "advantage": type(self.advantage).__name__, "model": str(self.hparams.model),
                "model_config": self.hparams.model_config, "lora": self.lora is not None, "seed": self.seed,
                "optimizer": type(opt).__name__,
                "optimizer_hparams": {k: v for k, v in group.items() if k != "params" and isinstance(v, (int, float, bool, tuple))},
                "world_size": self.trainer.world_size, "policy": policy_dir(path).name if self.save_rollout_policy else None}
        save_rollout(path, replace(rollout, old_logprobs=old), self.rl_step, meta)
        rank_zero_info(f"saved the rollout of step {self.rl_step} to {path}")

    def save_hf_model(self, path: Path, state_dict: dict | None = None) -> None:
        """Save in Hugging Face format (written aside, then swapped in); ``state_dict``: the full weights of an FSDP2-sharded
        policy. Under LoRA: the merged model at ``path`` and the adapter alone beside it (:meth:`adapter_path`)."""
        if self.lora is None:
            return self._save_pretrained(self.policy, path, state_dict)
        self._save_pretrained(merged_for_saving(self.policy), path, state_dict)
        self._save_pretrained(self.policy, self.adapter_path(path), state_dict, "the LoRA adapter")  # a PeftModel saves that only

    @staticmethod
    def adapter_path(path: Path) -> Path:
        """Where the LoRA adapter goes beside the merged model: ``<root>/hf_adapter`` for ``<root>/hf_model``
        (``PeftModel.from_pretrained(base, <root>/hf_adapter)`` reproduces the merged model)."""
        return Path(path).parent / "hf_adapter"

    def _save_pretrained(self, model: nn.Module, path: Path, state_dict: dict | None, what: str = "the policy") -> None:
        with written_aside(path) as tmp:
            model.save_pretrained(tmp, state_dict=state_dict)
            if state_dict is not None and not is_lora(model):  # fully_shard renamed the class (FSDPLlamaForCausalLM)
                from lit_gspo.distributed import unsharded_class

                model.config.architectures = [unsharded_class(model).__name__]
                model.config.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
        rank_zero_info(f"saved {what} in Hugging Face format to {path}")


def _frozen_copy(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


def _batches_that_stepped(checkpoint: dict) -> int:
    loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.state_dict", {})
    return int(loop.get("_batches_that_stepped", 0))
