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

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lit_gspo.data.prompts import check_prompt_lengths
from lit_gspo.lightning import export
from lit_gspo.lightning.async_rollouts import StopAsyncRollouts, async_mismatch, build_async_rollouts, check_async
from lit_gspo.lightning.callbacks import run_callbacks
from lit_gspo.lightning.completions_log import due, log_completions, terminal_table
from lit_gspo.lightning.fp16 import GradScalerStep
from lit_gspo.lightning.monitors import check_monitors, logged_names, object_monitors
from lit_gspo.lightning.progress import optimizer_steps_per_rl_step, total_rl_steps
from lit_gspo.lightning.quiet import silence_lightning_noise
from lit_gspo.lightning.schedule import Interval, ScheduleCadence
from lit_gspo.lightning.seed import resolve_seed
from lit_gspo.lightning.strategy import check_strategy
from lit_gspo.models.policies import build_policies
from lit_gspo.rl.advantages import AdvantageEstimator, get_advantage
from lit_gspo.rl.collect import Collector
from lit_gspo.rl.collect.async_rollouts import AsyncRollouts, staleness_tagged
from lit_gspo.rl.config import Generation, LoRA, RolloutDumps, Routing, Sampling, Update, Validation, WarmStart
from lit_gspo.rl.engines import RolloutEngine, default_engine
from lit_gspo.rl.envs import Environment, SingleTurn
from lit_gspo.rl.evaluate import GreedyTally
from lit_gspo.rl.learn.learner import Learner
from lit_gspo.rl.learn.mismatch import Mismatch
from lit_gspo.rl.objectives import GSPO, Objective
from lit_gspo.rl.rewards import ExactMatch, RewardSet, TrainerState
from lit_gspo.rl.warm_start import warm_start
from lit_gspo.runtime.collectives import all_reduce_sum, any_rank, gather_objects, reduce_step_stats
from lit_gspo.runtime.files import export_is_complete
from lit_gspo.runtime.hardware import SlowPrecisionWarning, bf16_on_cpu_warning, deterministic_on_cpu
from lit_gspo.runtime.optim import shard_aware
from lit_gspo.runtime.rng import local_rng_state, restore_local_rng_state, restore_rng_states, rng_states
from lit_gspo.runtime.sharding import apply_fsdp2
from lit_gspo.runtime.user_errors import SettingsError


def default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)


class RLModule(LightningModule):
    """Reinforcement learning of a causal LM with a pluggable :class:`~lit_gspo.rl.objectives.Objective`.

    Args:
        model: a built-in name (``tiny-llama``, ``tiny-qwen3-moe``, ``smollm2-135m-instruct``), a local
            Hugging Face directory, a ``.gguf`` file, or a hub id.
        model_config: overrides of the built-in model's config (layers, hidden size, ...).
        objective: the loss; by class name in YAML/CLI (``--model.objective GSPO``).
        lr_scheduler_interval: when ``lr_scheduler`` steps: ``step`` (each optimiser step), ``rl_step`` (each RL step
            that updated the policy) or ``epoch`` (each data epoch): Lightning's ``interval``
            (``lit_gspo/lightning/schedule.py``).
        lr_scheduler_frequency: the schedule steps every n-th interval (Lightning's ``frequency``).
        rewards: reward functions ``(prompts, completions, **columns) -> list[float | None]``.
        reward_weights: one weight per reward function (default 1 each).
        environment: what the policy talks to (default :class:`~lit_gspo.rl.envs.SingleTurn`: the row's
            prompt, one reply); it also holds ``system_prompt`` and ``chat_template``.
        engine: what samples (default: :class:`~lit_gspo.rl.engines.StaticCacheSampler` on CUDA, else
            :class:`~lit_gspo.rl.engines.HFGenerate`, chosen in ``setup``; ``LeanSampler`` is faster on CPU).
        advantage: the advantage estimator (``GroupNormalized``, ``GroupMean``, ``BatchNormalized``,
            ``RLOO``, ``GAE``); None: the objective's paper's (``Objective.paper_advantage``).
        generation: what is sampled: G completions per prompt, their length, the sampling distribution. This
            group and the next ones are ``lit_gspo/rl/config.py``'s, each a YAML section
            (``--model.validation.every_n_steps 25``; each setting's doc is in ``--help``).
        update: how each rollout batch updates the policy: K epochs × M minibatches, micro-batches, clipping.
        sampling: which rollouts an RL step learns from (dynamic sampling).
        validation: greedy completions of the held-out prompts, scored (``val/reward``), and their logging.
        routing: Mixture-of-Experts routing (an MoE policy only).
        rollout_dumps: rollouts on disk for ``lit-gspo compare``.
        warm_start: supervised steps on the task's (prompt, answer) pairs before the first RL step.
        lora: train low-rank adapters only (None: the full model; ``--model.lora.help LoRA`` lists its settings).
        kl_to_ref: keep a frozen reference policy to log ``train/kl`` even when β = 0.
        gradient_checkpointing: recompute each decoder layer's activations in backward (less memory,
            about a third more compute; TRL's GRPOTrainer turns it on by default).
        seed: the run's seed (None: ``seed_everything``'s).
        mismatch: measure the sampler–trainer mismatch (``train/mismatch/*``) and correct it (TIS, MIS, SequenceMIS,
            OPSM; or the sampler's log-probs as π_old): ``lit_gspo/rl/learn/mismatch.py``, docs/mismatch.md. None: off.
    """

    def __init__(
        self,
        model: str = "tiny-llama",
        model_config: dict | None = None,
        gguf_file: str | None = None,
        objective: Objective | None = None,
        optimizer: OptimizerCallable = default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
        lr_scheduler_interval: Interval = "step",
        lr_scheduler_frequency: int = 1,
        rewards: list[Callable] | None = None,
        reward_weights: list[float] | None = None,
        environment: Environment | None = None,
        engine: RolloutEngine | None = None,
        advantage: AdvantageEstimator | None = None,
        generation: Generation = Generation(),
        update: Update = Update(),
        sampling: Sampling = Sampling(),
        validation: Validation = Validation(),
        routing: Routing = Routing(),
        rollout_dumps: RolloutDumps = RolloutDumps(),
        warm_start: WarmStart = WarmStart(),
        lora: LoRA | None = None,
        kl_to_ref: bool = True,
        gradient_checkpointing: bool = False,
        seed: int | None = None,
        mismatch: Mismatch | None = None,
    ):
        super().__init__()
        silence_lightning_noise()  # before Trainer.fit checks its configuration (lit_gspo/lightning/quiet.py says what and why)
        self.save_hyperparameters(
            ignore=[
                "objective",
                "optimizer",
                "lr_scheduler",
                "rewards",
                "environment",
                "engine",
                "advantage",
                "mismatch",
            ]
        )
        self.automatic_optimization = False
        self.objective = objective if objective is not None else GSPO()
        self.advantage = advantage if advantage is not None else get_advantage(self.objective.paper_advantage)
        self.optimizer_factory, self.scheduler_factory = optimizer, lr_scheduler
        self.schedule_cadence = ScheduleCadence(lr_scheduler_interval, lr_scheduler_frequency).check(lr_scheduler)
        # copies: the defaults above are one instance for every module (several fits run in one process: ablate)
        generation, update, sampling, validation, routing, rollout_dumps, warm_start = (
            replace(group) if group is not None else kind()
            for group, kind in (
                (generation, Generation),
                (update, Update),
                (sampling, Sampling),
                (validation, Validation),
                (routing, Routing),
                (rollout_dumps, RolloutDumps),
                (warm_start, WarmStart),
            )
        )
        self.generation, self.warm_start_cfg = generation, warm_start
        self.sampling, self.validation = sampling, validation
        self.routing, self.rollout_dumps, self.lora = routing, rollout_dumps, lora
        check_stages_fit(self.objective, self.advantage, self.generation)
        self.seed = resolve_seed(seed)
        self.rl_step = 0  # RL steps (rollout batches) done, across epochs and resumes: the ``step`` of the logs
        self._skipped_in_a_row = 0
        self._logged_keys: set[str] = set()
        self._warm_started = False  # saved in checkpoints: a resume never warm-starts again
        self._warned_precision = False

        models = build_policies(
            model,
            model_config=model_config,
            gguf_file=gguf_file,
            seed=self.seed,
            lora=lora,
            gradient_checkpointing=gradient_checkpointing,
            reference=self.objective.beta > 0 or kl_to_ref,
            critic=self.objective.needs_critic,
        )
        if self.routing.replay and not models.is_moe:
            raise ValueError(f"routing.replay needs an MoE policy with top-k routers; {model!r} has none")
        self.policy, self.tokenizer, self.value_head = models.policy, models.tokenizer, models.value_head
        self.ref_policy = models.reference if isinstance(models.reference, nn.Module) else None  # saved with the run

        dynamic = self.objective.paper_dynamic_sampling if self.sampling.dynamic is None else self.sampling.dynamic
        mismatch = async_mismatch(self.sampling, mismatch)  # K >= 1: π_old chosen once (sampler, or proximal + TIS)
        self._async: AsyncRollouts | None = None  # K >= 1: the rollout worker of this fit (docs/async.md)
        self._default_engine = None if engine is not None else default_engine("cpu")  # resolved for the device in setup
        self.collector = Collector(
            environment or SingleTurn(),
            engine or self._default_engine,
            RewardSet(list(rewards) if rewards else [ExactMatch()], reward_weights),
            self.tokenizer,
            self.generation,
            dynamic_sampling=dynamic,
            max_sampling_rounds=self.sampling.max_rounds,
            engine_logprobs=mismatch is not None,
        )
        self.learner = Learner(
            self.policy,
            self.objective,
            update,
            value_head=self.value_head,
            reference=models.reference,
            temperature=self.generation.temperature,
            max_len=self.generation.max_new_tokens * self.collector.environment.max_turns,
            group_size=self.generation.num_generations,
            routing_replay=self.routing.replay,
            record_routing=models.is_moe and self.routing.track_volatility,
            gradient_checkpointing=gradient_checkpointing,
            mismatch=mismatch,
        )
        self._refill_generator = torch.Generator().manual_seed(self.seed)
        self._scaled_step: GradScalerStep | None = None  # fp16: set in setup from Lightning's precision plugin

    # ------------------------------------------------------------------ one RL step
    def training_step(self, rows: list[dict], batch_idx: int) -> None:
        start = time.perf_counter()
        if self.sampling.max_staleness:  # the worker's rollout, at most K policy versions old
            rollout, stats = self._async_rollout(rows)
        else:
            self.collector.trainer_state = self._reward_trainer_state()
            self.collector.engine.sync_weights(self.policy)
            sync_s = self.collector.engine.last_sync_s  # an engine with its own copy of the weights (VLLMEngine)
            rollout, stats = self.collector.collect(
                self.policy, rows, self._refill_rows, synced_gpus=self._synced_gpus()
            )
            stats["time/rollout_s"] = time.perf_counter() - start
            if sync_s is not None:
                stats["time/weight_sync_s"] = sync_s
        if not self._anything_to_learn(rollout):
            rollout = None  # every sample of every rank failed: no rank updates, all count a skipped step alike
        if rollout is not None:
            start = time.perf_counter()
            self.learner.snapshot(rollout)
            rollout.advantages = self.advantage(rollout, self.generation.num_generations)
            every = self.rollout_dumps.every_n_steps
            if every and self.rl_step and self.rl_step % every == 0:
                self.save_rollout(rollout)
            stats.update(
                self.learner.learn(
                    rollout,
                    self.optimizers(),
                    self._scheduler_per_step(),
                    backward=self.manual_backward,
                    step=self._scaled_step,
                    world_size=self.trainer.world_size,
                )
            )
            self._step_schedule_per_rl_step(stats)
            stats["time/update_s"] = time.perf_counter() - start
        if self._async is not None:  # the worker's next rollouts use the weights after this step
            self._async.publish(self.policy, self.rl_step + 1)
            stats.update(staleness_tagged(stats, int(stats["staleness"])))
        self._check_progress(rollout is not None, stats)
        self.log_step(stats, rollout, batch_size=len(rows))
        self.rl_step += 1
        if self._last_step():
            self.trainer.should_stop = True  # Lightning's loop then validates after this step (val/reward at the end)

    def _async_rollout(self, rows: list[dict]):
        """K >= 1: submit ``rows`` to the worker (started at the first step of a fit, or of a resume: in-flight rollouts
        are never checkpointed) and take the oldest rollout no more than K versions old."""
        if self._async is None:
            self._async = build_async_rollouts(self)
        produced, stats = self._async.next(rows, self.rl_step, self._reward_trainer_state())
        stats.update(produced.stats)
        stats["time/rollout_s"] = produced.seconds
        return produced.rollout, stats

    def stop_async_rollouts(self) -> None:
        """End the rollout worker (the fit's end, an error, a signal); rollouts in flight are discarded."""
        if self._async is not None:
            self._async.stop()
            self._async = None

    def _last_step(self) -> bool:
        """Whether the run ends after this RL step (``max_steps`` optimiser steps, or the last batch of the last epoch)."""
        trainer = self.trainer
        if trainer.max_steps is not None and trainer.max_steps >= 0 and self.global_step >= trainer.max_steps:
            return True
        last_epoch = (
            trainer.max_epochs is not None
            and trainer.max_epochs >= 0
            and trainer.current_epoch + 1 >= trainer.max_epochs
        )
        return last_epoch and trainer.is_last_batch

    def _reward_trainer_state(self) -> TrainerState:
        """What TRL passes its reward functions as ``trainer_state``: the RL step, the run's length, the epoch."""
        trainer = self.trainer
        return TrainerState(
            global_step=self.rl_step,
            max_steps=total_rl_steps(trainer, self) or 0,
            epoch=float(trainer.current_epoch),
            num_train_epochs=max(trainer.max_epochs or 0, 0),
        )

    def _anything_to_learn(self, rollout) -> bool:
        """Whether any rank kept a sample (collective under several processes: every rank decides the same; a rank
        whose samples all failed still takes part in the update of the others, with a zero mask)."""
        return any_rank(rollout is not None and bool(rollout.completion_mask.any()))

    def _check_progress(self, updated: bool, stats: dict) -> None:
        """A skipped step makes no optimiser step, so ``max_steps`` alone would never end a run that keeps skipping.
        ``updated`` is the same on every rank (:meth:`_anything_to_learn`), so all ranks stop at the same step, each
        with the first rank's reward error."""
        self._skipped_in_a_row = 0 if updated else self._skipped_in_a_row + 1
        if self._skipped_in_a_row >= self.sampling.max_skipped_steps:
            errors = [e for e in gather_objects(self.collector.rewards.last_error) if e]
            raise RuntimeError(
                f"{self._skipped_in_a_row} RL steps in a row had nothing to learn from (frac_zero_std_groups="
                f"{stats.get('frac_zero_std_groups', float('nan')):.2f}, reward_failed={stats.get('reward_failed', 0):.0f}): "
                "every group's rewards were equal or every reward failed. Check the reward functions, or raise "
                f"sampling.max_skipped_steps={self.sampling.max_skipped_steps}"
                + (f". The last reward error: {errors[0]}" if errors else "")
            )

    def log_step(self, stats: dict, rollout, batch_size: int) -> None:
        """``train/*`` over every rank (a step without some metric logs NaN for it, not its last value) and the progress bar."""
        stats = reduce_step_stats(
            stats,
            None if rollout is None else rollout.rewards,
            None if rollout is None else rollout.completion_mask.sum(1),
        )
        # fp32, as self.log stores them: the logged values are those of earlier runs bit for bit
        values = {
            f"train/{k}" if not k.startswith("time/") else k: float(torch.tensor(float(v), dtype=torch.float32))
            for k, v in stats.items()
        }
        values.update({k: float("nan") for k in self._logged_keys - values.keys()})
        self._logged_keys |= values.keys()
        # The row goes to the loggers now, before ModelCheckpoint saves this step in on_train_batch_end (Lightning
        # would log it only after that, and a kill in between would lose it: the resume starts after this step).
        # self.log(logger=False) still gives callbacks (EarlyStopping/ModelCheckpoint on train/*) every value.
        every = self.trainer.log_every_n_steps
        if every and self.rl_step % every == 0 and self.trainer.is_global_zero:
            for logger in self.loggers:
                logger.log_metrics({**values, "epoch": self.current_epoch}, step=self.rl_step)
                logger.save()
        self.log_dict(values, on_step=True, on_epoch=False, batch_size=batch_size, logger=False)
        self._step_plateau(values, "train")
        self.log_dict(
            {"reward": float(stats["reward"]), "clip": float(stats.get("clip_frac", 0.0))},
            prog_bar=True,
            logger=False,
            on_step=True,
            on_epoch=False,
            batch_size=batch_size,
        )

    def _refill_rows(self, count: int) -> list[dict]:
        pool = self.trainer.datamodule.train_rows
        idx = torch.randint(len(pool), (count,), generator=self._refill_generator)
        return [pool[int(i)] for i in idx]

    def _attached(self) -> bool:
        """Whether a Trainer runs this module (``self.trainer`` raises otherwise)."""
        try:
            return self.trainer is not None
        except RuntimeError:
            return False

    def _synced_gpus(self) -> bool:
        """Sharded parameters (FSDP2 over several processes): every rank must take part in every forward."""
        return (
            self._attached()
            and self.trainer.world_size > 1
            and isinstance(self.trainer.strategy, ModelParallelStrategy)
        )

    # ------------------------------------------------------------------ Lightning plumbing
    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if self.value_head is not None:
            params += list(self.value_head.parameters())
        opt = shard_aware(self.optimizer_factory(params))  # bitsandbytes on FSDP2 shards: update local shards
        if self.scheduler_factory is None:
            return opt
        scheduler = self.scheduler_factory(opt)
        self._plateau_monitor = plateau_monitor(
            scheduler, ["val/reward", "val/response_length"] + [f"val/{k}" for k in self._episode_metric_keys()]
        )
        self.schedule_cadence.check(scheduler)  # a ReduceLROnPlateau steps when its monitor is logged
        # stepped here at its cadence (lit_gspo/lightning/schedule.py); a ReduceLROnPlateau by _step_plateau
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, **self.schedule_cadence.lightning_config()}}

    def _schedule(self):
        """The schedule stepped at its cadence (None: none, or a ReduceLROnPlateau)."""
        return None if getattr(self, "_plateau_monitor", None) else self.lr_schedulers()

    def _scheduler_per_step(self):
        """What the learner steps after each optimiser step (None: no schedule, or not at this cadence)."""
        return self.schedule_cadence.per_optimizer_step(self._schedule(), lambda: self.global_step)

    def _step_schedule_per_rl_step(self, stats: dict) -> None:
        """An ``rl_step`` schedule steps after the RL step's updates; ``train/lr`` is then the rate after it."""
        if self.schedule_cadence.after("rl_step", self._schedule(), self.rl_step + 1):
            stats["lr"] = self.optimizers().param_groups[0]["lr"]

    def on_train_epoch_end(self) -> None:
        self.schedule_cadence.after("epoch", self._schedule(), self.current_epoch + 1)

    def _step_plateau(self, values: dict, split: str) -> None:
        """Step a ReduceLROnPlateau with its monitored metric when ``split``'s metrics (``train``/``val``) are logged during
        fit; a ``train/*`` monitor the step did not log is refused in one line."""
        monitor = getattr(self, "_plateau_monitor", None)
        if not monitor or not monitor.startswith(f"{split}/") or self.trainer.state.fn != "fit":
            return
        if monitor not in values:
            raise SettingsError(
                f"--model.lr_scheduler.monitor {monitor}: not logged; the {split}/* metrics are "
                + ", ".join(sorted(k for k in values if k.startswith(f"{split}/")))
            )
        value = float(values[monitor])
        if value == value:  # NaN (a step that logged nothing for it): not a measurement
            self.lr_schedulers().step(value)

    def setup(self, stage: str) -> None:
        every = self.validation.every_n_steps
        if stage == "fit" and every is not None and not self.trainer.fast_dev_run:
            check_validation_schedule(self.trainer, every)
        if stage == "fit" and self.sampling.max_staleness:
            check_async(self)
        # fp16's GradScaler (Lightning's MixedPrecision plugin; public attributes of both)
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        self._scaled_step = GradScalerStep(scaler) if scaler is not None else None
        if stage == "fit" and self.trainer.log_every_n_steps > 1:
            rank_zero_info(
                f"train/* metrics every {self.trainer.log_every_n_steps} RL steps (log_every_n_steps; 1: every "
                "step, as `lit-gspo fit` does)"
            )
        # the default engine depends on the device, known now; an engine given or set since is kept
        if self.collector.engine is self._default_engine:
            engine = default_engine(self.trainer.strategy.root_device, sharded=self._synced_gpus())
            if type(engine) is not type(self._default_engine):
                self.collector.engine = self._default_engine = engine
        deterministic_on_cpu(self.trainer.strategy.root_device.type)  # before the warm start's first backward
        advice = bf16_on_cpu_warning(self.trainer.precision, self.trainer.strategy.root_device.type)
        if (
            advice and not self._warned_precision
        ):  # bf16 emulated on this CPU: slower than fp32 (once: validate, then fit)
            self._warned_precision = True
            rank_zero_warn(advice, category=SlowPrecisionWarning)

    def on_before_optimizer_step(self, optimizer) -> None:
        """fp16: Lightning's GradScaler has just unscaled the gradients; clip them now (``GradScalerStep``)."""
        if self._scaled_step is not None:
            self._scaled_step.clip_unscaled()

    def configure_model(self) -> None:
        """FSDP2 (``ModelParallelStrategy``): ``fully_shard`` each decoder layer, then the root; FSDP1 is refused."""
        if self._attached():
            check_strategy(self.trainer.strategy)
        if self.device_mesh is not None:
            apply_fsdp2(self, self.device_mesh)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Every rank's torch/numpy/python RNG states, the refill generator and the RL-step counter (Lightning saves none)."""
        checkpoint["rng_states"] = rng_states(self._refill_generator)
        checkpoint["rl_step"] = self.rl_step
        checkpoint["warm_started"] = self._warm_started

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "rng_states" in checkpoint:
            restore_rng_states(checkpoint["rng_states"], self.global_rank, self._refill_generator)
        # checkpoints written before the counter was saved: one RL step is K × M optimiser steps
        self.rl_step = checkpoint.get("rl_step", checkpoint.get("global_step", 0) // optimizer_steps_per_rl_step(self))
        self._warm_started = checkpoint.get("warm_started", True)

    def on_fit_start(self) -> None:
        self._check_data()
        plateau, callbacks = getattr(self, "_plateau_monitor", None), self.trainer.callbacks
        check_monitors(logged_names(self), object_monitors(plateau, callbacks))  # a misspelt one: before any step

    def _check_data(self) -> None:
        """A reward function whose parameters no dataset column fills, or a prompt too long for the context, fails
        now (named by its file row), not after N steps."""
        dm = self.trainer.datamodule
        rows = getattr(dm, "train_rows", None)
        if rows:
            self.collector.rewards.check(list(rows[0]))
        for split in ("train", "val"):
            check_prompt_lengths(
                getattr(dm, f"{split}_rows", None) or [],
                lambda r: self.collector.encode(self.policy, r),
                lambda i: dm.describe_row(split, i) if hasattr(dm, "describe_row") else f"{split} row {i}",
            )

    def on_train_start(self) -> None:
        self._warm_start_once()  # a fit without a validation before it (trainer.fit alone)

    def on_train_end(self) -> None:
        if not self.trainer.fast_dev_run:  # a dry run writes nothing
            self._export()

    def on_fit_end(self) -> None:
        """A resume of a finished run skips the training loop and ``on_train_end``: write the export if a kill stopped it."""
        if self.trainer.fast_dev_run:
            return
        paths = [self._export_path()] + ([export.adapter_path(self._export_path())] if self.lora is not None else [])
        if self.trainer.strategy.broadcast(not all(export_is_complete(p) for p in paths)):
            self._export()

    def configure_callbacks(self) -> list:
        """Run lock, cleanup of killed writes, logs continued on resume, SIGINT/SIGTERM saved (``lit_gspo.lightning.callbacks``)."""
        return run_callbacks() + ([StopAsyncRollouts()] if self.sampling.max_staleness else [])

    def _export_path(self) -> Path:
        return Path(self.trainer.default_root_dir) / "hf_model"

    def _export(self) -> None:
        gathered = export.gather_for_saving(self)  # collective under FSDP2
        if self.trainer.is_global_zero:
            self.save_hf_model(self._export_path(), gathered)

    # ------------------------------------------------------------------ validation (Lightning's loop)
    def _warm_start_once(self) -> None:
        """Supervised warm start of a fresh run, before the first validation or update, whichever comes first
        (``trainer.validate`` before ``trainer.fit`` measures the policy RL starts from). Never after a resume."""
        if self._warm_started or self.global_step > 0:
            return
        self._warm_started = True
        if self.warm_start_cfg.steps <= 0:
            return
        with torch.inference_mode(False), torch.enable_grad():  # validation hooks run under inference mode
            loss = warm_start(
                self.policy,
                self.tokenizer,
                self.trainer.datamodule.train_rows,
                lambda rows: self.collector.encode(self.policy, rows),
                self.warm_start_cfg,
                self.seed,
                environment=self.collector.environment,
            )
        rank_zero_info(f"warm start: {self.warm_start_cfg.steps} supervised steps, last loss {loss:.4f}")
        if self.ref_policy is not None:  # the reference is the policy RL starts from
            self.ref_policy.load_state_dict(self.policy.state_dict())

    def on_validation_start(self) -> None:
        """Warm start (fresh run), weights to the engine, a fresh tally; the RNG state is kept aside so that how often
        one validates does not change the training run (greedy sampling, environments and samplers may draw)."""
        if self.trainer.state.fn != "fit":
            self._check_data()
        self._warm_start_once()
        self._rng_before_validation = local_rng_state()
        if self._async is not None:  # greedy validation on the trainer's policy; no rollout meanwhile
            self._async.worker.pause()
        self.collector.trainer_state = self._reward_trainer_state()
        self.collector.engine.sync_weights(self.policy)
        self._val = GreedyTally(self._episode_metric_keys())
        self._val_shown = ([], [], [])  # rows, replies, rewards of the completions logged with this validation
        self._val_shown_scores: dict[str, list[float]] = {}  # each reward function's scores of those
        self._val_start = time.perf_counter()

    def on_test_start(self) -> None:
        self.on_validation_start()

    def validation_step(self, rows: list[dict], batch_idx: int) -> None:
        """Greedy completions of this rank's share of the held-out batch, scored; reduced at the epoch's end."""
        rows = rows[self.global_rank :: self.trainer.world_size]
        if not rows:  # every rank runs every step: FSDP2's sharded forward needs all of them
            return
        # Lightning validates under inference mode; FSDP2 on one device makes its unsharded parameters at their first
        # forward and keeps them: as inference tensors they could not be written in training ("Inference tensors do not
        # track version counter"). no_grad is what sampling needs.
        with torch.inference_mode(False), torch.no_grad():
            batch, replies, stats = self.collector.sample(
                self.policy, rows, greedy=True, synced_gpus=self._synced_gpus()
            )
        self._val.add(rows, batch, stats)
        room = max(self.validation.num_logged_completions - len(self._val_shown[0]), 0)
        for part, new in zip(self._val_shown, (rows, replies, batch.rewards.tolist())):
            part.extend(new[:room])
        for name, scores in self.collector.last_per_function.items():
            self._val_shown_scores.setdefault(name, []).extend(scores[:room])

    def test_step(self, rows: list[dict], batch_idx: int) -> None:
        self.validation_step(rows, batch_idx)

    def on_validation_epoch_end(self) -> None:
        self._log_greedy_metrics("val")

    def on_test_epoch_end(self) -> None:
        self._log_greedy_metrics("test")

    def _log_greedy_metrics(self, split: str) -> None:
        """``<split>/reward`` (mean reward of greedy completions over every held-out prompt of every rank),
        ``<split>/response_length`` and the multi-turn metrics, through ``self.log``: callbacks and loggers see them.
        The row's ``step`` is the number of RL steps done."""
        metrics = self._val.reduce(all_reduce_sum, prefix=split)
        if self.trainer.sanity_checking:
            return
        # fp64 tensors: Lightning keeps their dtype (a float would be stored as fp32); the same value on every rank
        self.log_dict({k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()}, sync_dist=True)
        # sync_dist: the same step on every rank, the mean validation time (Lightning warns about epoch-level logs without it)
        self.log_dict(
            {"step": float(self.rl_step), "time/val_s": time.perf_counter() - self._val_start}, sync_dist=True
        )
        self._step_plateau(metrics, split)
        if due(self.rl_step, self.validation.log_completions_every_n_steps) and self.trainer.is_global_zero:
            log_completions(self.loggers, self.rl_step, *self._val_shown)
            if self.validation.print_completions and self._val_shown[0]:
                bar = self.trainer.progress_bar_callback  # prints above its bars, not into them
                (bar.print if bar is not None else print)(
                    terminal_table(self.rl_step, split, *self._val_shown, self._val_shown_scores)
                )
        rank_zero_info(
            f"step {self.rl_step}: {split}/reward = {metrics[f'{split}/reward']:.4f} "
            f"({time.perf_counter() - self._val_start:.1f} s)"
        )

    def on_validation_end(self) -> None:
        restore_local_rng_state(self._rng_before_validation)
        if self._async is not None:
            self._async.worker.resume()

    def on_test_end(self) -> None:
        self.on_validation_end()

    def _episode_metric_keys(self) -> list[str]:
        """The multi-turn metrics validation reports (none for a single-turn environment)."""
        environment = self.collector.environment
        if environment.max_turns == 1:
            return []
        return (
            ["turns", "success"]
            + [f"success_turn{k}" for k in range(1, environment.max_turns + 1)]
            + list(environment.metric_names)
        )

    def load_trained_policy(self, path: str | Path) -> None:
        """The policy's weights from a run's Hugging Face export (``<run>/hf_model``), to validate or test it: the run's
        warm start is in them, so none is done again."""
        from transformers import AutoModelForCausalLM

        if self.lora is not None:
            raise ValueError(
                f"{path}: a LoRA run's hf_model holds the merged weights; validate it without --model.lora"
            )
        trained = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
        self.policy.load_state_dict(trained.state_dict())
        self._warm_started = True
        rank_zero_info(f"loaded the policy from {path}")

    def save_rollout(self, rollout) -> None:
        """``<root>/rollouts/step_K.pt`` with the trainer's old log-probs (and the sampling policy): ``lit_gspo.lightning.export``."""
        export.save_rollout(self, rollout)

    def save_hf_model(self, path: Path, gathered: export.Gathered | None = None) -> None:
        """Save in Hugging Face format, written aside and swapped in (``lit_gspo.lightning.export``); ``gathered``: the
        weights of an FSDP2-sharded policy. Under LoRA: the merged model at ``path`` and the adapter beside it."""
        export.save_hf_model(self, path, gathered)


def check_stages_fit(objective: Objective, advantage: AdvantageEstimator, generation: Generation) -> None:
    """An estimator and an objective that cannot work together, or groups too small for the estimator, fail at start."""
    if advantage.needs_values != objective.needs_critic:
        raise ValueError(
            f"{type(advantage).__name__} {'needs' if advantage.needs_values else 'does not use'} a critic's "
            f"values, and {type(objective).__name__} {'has' if objective.needs_critic else 'has no'} critic: "
            "use GAE with PPO, and GroupNormalized, GroupMean, BatchNormalized or RLOO with the others"
        )
    if advantage.needs_groups and generation.num_generations < 2:
        raise ValueError(
            f"generation.num_generations={generation.num_generations}, but {type(advantage).__name__} compares "
            "the completions of a prompt with each other (Â = 0 for a group of 1, nothing is learned): use "
            "num_generations >= 2, or an estimator without groups (GAE with PPO)"
        )


def plateau_monitor(scheduler, val_metrics: list[str] | None) -> str | None:
    """The metric a ReduceLROnPlateau follows (Lightning's ``lightning.pytorch.cli.ReduceLROnPlateau`` carries it as
    ``monitor``), None for another schedule; :func:`check_plateau_monitor` refuses what cannot work."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return None
    return check_plateau_monitor(getattr(scheduler, "monitor", None), val_metrics)


def check_plateau_monitor(monitor: str | None, val_metrics: list[str] | None) -> str:
    """Refused in one line: no monitor (torch's ReduceLROnPlateau), a monitor that is neither ``train/*`` nor one of
    ``val_metrics`` (None: any ``val/*``)."""
    if monitor is None:
        raise SettingsError(
            "--model.lr_scheduler torch.optim.lr_scheduler.ReduceLROnPlateau has no monitor: use "
            "lightning.pytorch.cli.ReduceLROnPlateau with --model.lr_scheduler.monitor val/reward "
            "--model.lr_scheduler.mode max"
        )
    if not (monitor.startswith("train/") or (monitor in val_metrics if val_metrics else monitor.startswith("val/"))):
        names = ", ".join(val_metrics or ["val/reward", "val/response_length"])
        raise SettingsError(
            f"--model.lr_scheduler.monitor {monitor}: never logged; monitor one of {names} (after each "
            "validation) or a train/* metric (each RL step)"
        )
    return monitor


#: ``val_check_interval`` of a run that validates only before and after training (``validation.every_n_steps=0``)
NEVER = 2**62


def validation_schedule(every_n_steps: int) -> dict:
    """The Trainer settings of ``validation.every_n_steps``: Lightning's validation loop every n batches (= RL steps)."""
    return {"val_check_interval": every_n_steps or NEVER, "check_val_every_n_epoch": None}


def check_validation_schedule(trainer, every_n_steps: int) -> None:
    """``RLModule(validation=Validation(every_n_steps=n))`` under a Trainer that schedules otherwise: one line naming
    the Trainer flags."""
    want = validation_schedule(every_n_steps)
    have = {
        "val_check_interval": trainer.val_check_interval,
        "check_val_every_n_epoch": trainer.check_val_every_n_epoch,
    }
    if have != want:
        raise ValueError(
            f"validation.every_n_steps={every_n_steps} needs Trainer(val_check_interval="
            f"{want['val_check_interval']}, check_val_every_n_epoch=None) (one Lightning batch is one RL "
            f"step); this Trainer has {have}. Set those on the Trainer, or leave validation.every_n_steps=None"
        )
