"""RLModule: the Lightning adapter around the four stages of one RL step.

    training_step(rows):
        rollout  = collect(rows)              Environment × RolloutEngine → trajectories, rewards   (rl/collect)
        snapshot(rollout)                     reference log-probs, old values, MoE routes          (rl/learn/learner.py)
        Â        = advantage(rollout)         group, RLOO, GAE, ...                                 (rl/advantages.py)
        metrics  = learn(rollout)             K epochs × M minibatches of optimiser steps           (rl/learn/learner.py)
        log(metrics)

Built by ``rl/stages.py``; a fit's hooks here, each stage's Lightning side in its own file (``validation.py``,
``step_log.py``, ``warm_start.py``, ``schedule.py``, ``export.py``, ``checks.py``, ``run_state.py``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.utilities import rank_zero_info

from lit_gspo.lightning import export
from lit_gspo.lightning.async_rollouts import FitRollouts, StopAsyncRollouts, async_mismatch, check_async
from lit_gspo.lightning.callbacks import run_callbacks
from lit_gspo.lightning.checks import (
    check_data,
    check_param_dtype,
    check_prompt_source,
    check_rows_batch,
    check_stages_fit,
    check_validation_schedule,
)
from lit_gspo.lightning.device_defaults import DeviceDefaults
from lit_gspo.lightning.fp16 import GradScalerStep
from lit_gspo.lightning.lightning_callbacks import refuse_unsupported_callbacks
from lit_gspo.lightning.lightning_plugins import check_plugins
from lit_gspo.lightning.module_hooks import check_hooks
from lit_gspo.lightning.monitors import check_monitors, logged_names, object_monitors
from lit_gspo.lightning.plain_settings import from_plain, is_plain, plain
from lit_gspo.lightning.plateau import plateau_monitor, step_plateau
from lit_gspo.lightning.precisions import check_precision
from lit_gspo.lightning.prediction import predict_rows
from lit_gspo.lightning.progress import SkippedSteps, is_last_rl_step, reward_trainer_state
from lit_gspo.lightning.quiet import silence_lightning_noise
from lit_gspo.lightning.rl_step_optimizer import RLStepOptimizer
from lit_gspo.lightning.run_state import load_run_state, save_run_state
from lit_gspo.lightning.same_batches import check_same_batch_counts
from lit_gspo.lightning.schedule import ScheduleCadence, after_epoch, after_rl_step, learner_schedule
from lit_gspo.lightning.seed import VALIDATION_STREAM, resolve_seed, seed_ranks_apart, stream_seed
from lit_gspo.lightning.step_log import StepLog
from lit_gspo.lightning.strategy import check_strategy
from lit_gspo.lightning.validation import ValidationPass
from lit_gspo.lightning.warm_start import supervised_warm_start
from lit_gspo.models.cast_parameters import PARAM_DTYPES
from lit_gspo.rl.advantages import AdvantageEstimator, get_advantage
from lit_gspo.rl.config import Generation, Policy, Update, Validation
from lit_gspo.rl.engines import RolloutEngine
from lit_gspo.rl.engines.checkpoint_settings import checkpoint_sampling_settings
from lit_gspo.rl.envs import Environment
from lit_gspo.rl.objectives import GSPO, Objective
from lit_gspo.rl.reference_sync import sync_reference
from lit_gspo.rl.rollout import RolloutBatch
from lit_gspo.rl.stages import build_stages
from lit_gspo.rl.stop_tokens import describe_stop_tokens
from lit_gspo.runtime.collectives import any_rank, gather_objects
from lit_gspo.runtime.optim import shard_aware
from lit_gspo.runtime.rng import local_rng_state, restore_local_rng_state
from lit_gspo.runtime.sharding import apply_fsdp2


def default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)


class RLModule(LightningModule):
    """Reinforcement learning of a causal LM with a pluggable :class:`~lit_gspo.rl.objectives.Objective`.

    Args:
        policy: the policy RL starts from: its model (``name``), config overrides, LoRA, warm start, reference.
        objective: the loss; by class name in YAML/CLI (``--model.objective GSPO``).
        advantage: the advantage estimator (``GroupNormalized``, ``GroupMean``, ``BatchNormalized``, ``RLOO``,
            ``GAE``); None: the objective's paper's (``Objective.paper_advantage``).
        rewards: reward functions ``(prompts, completions, **columns) -> list[float | None]`` (TRL's contract).
        reward_weights: one weight per reward function (default 1 each).
        environment: what the policy talks to (default :class:`~lit_gspo.rl.envs.SingleTurn`: the row's prompt, one
            reply); it also holds ``system_prompt`` and ``chat_template``.
        engine: what samples (default: :class:`~lit_gspo.rl.engines.StaticCacheSampler` on CUDA, else
            :class:`~lit_gspo.rl.engines.HFGenerate`, chosen in ``setup``; ``LeanSampler`` is faster on CPU).
        optimizer, lr_scheduler: LightningCLI's optimiser and schedule (stepped at ``update.scheduler_interval``; a
            ``ReduceLROnPlateau`` with its ``monitor`` when that is logged).
        generation: the rollouts: G completions per prompt, their length and distribution, dynamic sampling, staleness.
        update: how each rollout batch updates the policy: K epochs × M minibatches, micro-batches, clipping, π_old.
        validation: greedy or sampled completions of the held-out prompts, scored (``val/reward``), and their logging.

    The settings groups are ``lit_gspo/rl/config.py``'s, each a YAML section (``--model.validation.every_n_steps 25``;
    each setting's doc is in ``--help``). The run's seed is ``seed_everything``'s.
    """

    def __init__(
        self,
        policy: Policy = Policy(),
        objective: Objective | None = None,
        advantage: AdvantageEstimator | None = None,
        rewards: list[Callable] | None = None,
        reward_weights: list[float] | None = None,
        environment: Environment | None = None,
        engine: RolloutEngine | None = None,
        optimizer: OptimizerCallable = default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
        generation: Generation = Generation(),
        update: Update = Update(),
        validation: Validation = Validation(),
    ):
        super().__init__()
        check_hooks(type(self), RLModule)  # a subclass's hooks, before anything is built (module_hooks.py)
        silence_lightning_noise()  # before Trainer.fit checks its configuration (lightning/quiet.py says what and why)
        policy, generation, update, validation = (
            from_plain(cls, value, f"model.{name}")  # as load_from_checkpoint gives a Python-built module's settings
            for cls, value, name in (
                (Policy, policy, "policy"),
                (Generation, generation, "generation"),
                (Update, update, "update"),
                (Validation, validation, "validation"),
            )
        )
        self.save_hyperparameters(
            ignore=["objective", "advantage", "optimizer", "lr_scheduler", "rewards", "environment", "engine"]
        )
        if not is_plain(dict(self.hparams)):  # built in Python: saved as the CLI saves its config (plain_settings.py)
            with contextlib.suppress(TypeError):  # a subclass's argument that no config describes stays as it is
                self.save_hyperparameters(plain(dict(self.hparams)))
        self.automatic_optimization = False
        # copies: the defaults above are one instance for every module (several fits run in one process: ablate)
        self.settings, self.generation = replace(policy), replace(generation)
        self.validation, update = replace(validation), replace(update)
        self.objective = objective if objective is not None else GSPO()
        self.advantage = advantage if advantage is not None else get_advantage(self.objective.paper_advantage)
        self.optimizer_factory, self.scheduler_factory = optimizer, lr_scheduler
        self.schedule_cadence = ScheduleCadence(update.scheduler_interval, update.scheduler_frequency).check(
            lr_scheduler
        )
        self.optimizer_steps = 0  # taken, across resumes (a schedule's cadence counts them)
        check_stages_fit(self.objective, self.advantage, self.generation)
        self.seed = resolve_seed(None)
        self.rl_step = 0  # RL steps (rollout batches) done, across epochs and resumes: the ``step`` of the logs
        self.skipped_steps = SkippedSteps(self.generation.max_skipped_steps)
        self.warm_started = False  # saved in checkpoints: a resume never warm-starts again
        self.async_rollouts = FitRollouts(self) if self.generation.max_staleness else None  # docs/async.md
        self.device_defaults = DeviceDefaults(engine_given=engine is not None)
        stages = build_stages(
            self.settings,
            self.objective,
            engine or self.device_defaults.engine,
            self.generation,
            update,
            rewards=rewards,
            reward_weights=reward_weights,
            environment=environment,
            mismatch=async_mismatch(self.generation, update.mismatch),  # K >= 1: π_old chosen once
            seed=self.seed,
        )
        self.policy, self.tokenizer, self.value_head = stages.policy, stages.tokenizer, stages.value_head
        self.ref_policy = stages.reference  # saved with the run
        self.collector, self.learner = stages.collector, stages.learner
        self.step_log = StepLog()
        self.refill_generator = torch.Generator().manual_seed(self.seed)  # per rank from setup on
        self.refill_ranked = False
        self._scaled_step: GradScalerStep | None = None  # fp16: set in setup from Lightning's precision plugin
        self.plateau_metric: str | None = None  # the metric a ReduceLROnPlateau follows

    # ------------------------------------------------------------------ one RL step
    def training_step(self, rows: list[dict], batch_idx: int) -> dict[str, torch.Tensor]:
        """One RL step; returns ``{"loss": the step's mean surrogate loss}`` (NaN for a step without update), the
        ``outputs`` callbacks' ``on_train_batch_end`` receive (the optimiser steps were taken inside)."""
        check_rows_batch(rows)
        trainer_state = reward_trainer_state(self.trainer, self)
        with torch.profiler.record_function("lit_gspo.rollout"):  # named regions for torch.profiler
            if self.async_rollouts:
                rollout, stats = self.async_rollouts.next(rows, trainer_state)
            else:
                rollout, stats = self.collector.rollout(
                    self.policy, rows, self.refill_rows, trainer_state, synced_gpus=self.synced_gpus()
                )
        if not any_rank(rollout is not None and bool(rollout.completion_mask.any())):
            rollout = None  # every sample of every rank failed: no rank updates, all count a skipped step alike
        elif rollout is None:  # this rank's sampling kept nothing, another's did: it takes part in the update, rowless
            rollout = RolloutBatch.without_rows(self.device)
        if rollout is not None:
            start = time.perf_counter()
            with torch.profiler.record_function("lit_gspo.update"):
                self.rl_update(rollout, stats)
            stats["time/update_s"] = time.perf_counter() - start
        if self.async_rollouts:
            self.async_rollouts.publish(stats)
        self.skipped_steps.count(rollout is not None, stats, lambda: gather_objects(self.collector.rewards.last_error))
        values = self.step_log.values(stats, rollout if rollout is not None and len(rollout) else None)
        self.step_log.log(self, values, batch_size=len(rows))
        step_plateau(self, values, "train")
        sync = self.settings.ref_sync
        if sync is not None and (self.rl_step + 1) % sync.every_n_steps == 0:  # after the step's logged KL
            sync_reference(self.ref_policy, self.policy, sync.mixup_alpha)
        self.rl_step += 1
        if is_last_rl_step(self.trainer, self):
            self.trainer.should_stop = True  # Lightning's loop then validates after this step (val/reward at the end)
        return {"loss": torch.tensor(values.get("train/loss", float("nan")))}

    def rl_update(self, rollout, stats: dict) -> None:
        """Snapshot, advantages, K × M optimiser steps (one Lightning step per RL step); the step's metrics into ``stats``."""
        self.learner.snapshot(rollout)
        rollout.advantages = self.advantage(rollout, self.generation.num_generations)
        every = self.generation.dump_every_n_steps
        if every and self.rl_step and self.rl_step % every == 0:
            export.save_rollout(self, rollout)
        optimizer = RLStepOptimizer(self.optimizers(), self.trainer.strategy, self._count_optimizer_step)
        schedule, world, strategy = learner_schedule(self), self.trainer.world_size, self.trainer.strategy
        metrics = self.learner.learn(
            rollout,
            optimizer,
            schedule,
            backward=self.manual_backward,
            step=self._scaled_step,
            world_size=world,
            gradient_sync_blocked=strategy.block_backward_sync if isinstance(strategy, ParallelStrategy) else None,
        )
        stats.update(metrics)
        after_rl_step(self, stats)

    def _count_optimizer_step(self) -> None:  # an optimiser step taken
        self.optimizer_steps += 1

    def refill_rows(self, count: int, generator: torch.Generator | None = None) -> list[dict]:
        """``count`` training rows drawn with ``generator`` (None: the run's refill generator): dynamic sampling's
        extra prompts."""
        pool = self.trainer.datamodule.train_rows
        idx = torch.randint(len(pool), (count,), generator=generator or self.refill_generator)
        return [pool[int(i)] for i in idx]

    def attached(self) -> bool:
        """Whether a Trainer runs this module (``self.trainer`` raises otherwise)."""
        try:
            return self.trainer is not None
        except RuntimeError:
            return False

    def synced_gpus(self) -> bool:
        """Sharded parameters (FSDP2 over several processes): every rank must take part in every forward."""
        strategy = self.trainer.strategy if self.attached() else None
        return isinstance(strategy, ModelParallelStrategy) and self.trainer.world_size > 1

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if self.value_head is not None:
            params += list(self.value_head.parameters())
        opt = shard_aware(self.optimizer_factory(params))  # bitsandbytes on FSDP2 shards: update local shards
        if self.scheduler_factory is None:
            return opt
        scheduler = self.scheduler_factory(opt)
        self.plateau_metric = plateau_monitor(scheduler, logged_names(self).val)
        self.schedule_cadence.check(scheduler)  # a ReduceLROnPlateau steps when its monitor is logged
        # stepped at its cadence (lit_gspo/lightning/schedule.py); a ReduceLROnPlateau by step_plateau
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, **self.schedule_cadence.lightning_config()}}

    def setup(self, stage: str) -> None:
        trainer = self.trainer
        if stage == "fit":
            check_prompt_source(self)
        if stage == "fit" and self.validation.every_n_steps is not None and not trainer.fast_dev_run:
            check_validation_schedule(trainer, self.validation.every_n_steps)
        if stage == "fit" and self.async_rollouts:
            check_async(self)
        if stage == "fit" and not self.refill_ranked:  # each rank its own refill prompts (rank 0: the run's seed)
            self.refill_generator.manual_seed(stream_seed(self.seed, rank=self.global_rank))
            self.refill_ranked = True
        check_precision(trainer.precision, stage)
        check_plugins([trainer.precision_plugin, trainer.strategy.checkpoint_io])
        check_param_dtype(self.learner.cfg.param_dtype, trainer.precision)
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # fp16's GradScaler (public attributes of both)
        self._scaled_step = GradScalerStep(scaler) if scaler is not None else None
        if stage == "fit" and trainer.log_every_n_steps > 1:
            rank_zero_info(f"train/* metrics every {trainer.log_every_n_steps} RL steps (log_every_n_steps)")
        if stage == "fit" and len(self.collector.stop_ids) > 1:
            rank_zero_info(f"replies end at any of {describe_stop_tokens(self.tokenizer, self.collector.stop_ids)}")
        if stage == "fit" and self.collector.stop_strings is not None:
            rank_zero_info(f"replies also end at the strings {list(self.collector.stop_strings.strings)!r}")
        if stage == "fit" and (ignored := checkpoint_sampling_settings(self.policy)):
            g = self.generation
            rank_zero_info(
                f"the model's generation_config sets {ignored}; no engine applies them: replies are sampled with "
                f"model.generation's temperature={g.temperature}, top_p={g.top_p}, top_k={g.top_k}, min_p={g.min_p}, "
                f"repetition_penalty={g.repetition_penalty} only"
            )
        self.device_defaults.apply(self)

    def on_before_optimizer_step(self, optimizer) -> None:
        """fp16: Lightning's GradScaler has just unscaled the gradients; clip them now (``GradScalerStep``)."""
        if self._scaled_step is not None:
            self._scaled_step.clip_unscaled()

    def configure_model(self) -> None:
        """FSDP2 (``ModelParallelStrategy``): ``fully_shard`` each decoder layer, then the root."""
        if self.device_mesh is not None:
            apply_fsdp2(self, self.device_mesh, PARAM_DTYPES.get(self.learner.cfg.param_dtype))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        save_run_state(self, checkpoint)  # RNG states, RL steps, ... (Lightning saves none of them)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        load_run_state(self, checkpoint)

    def on_fit_start(self) -> None:
        """The fit's first stages, once the policy is on its device and a checkpoint restored: the data checked, then a
        fresh run's warm start and every rank's own random streams (``seed_ranks_apart``). Lightning's sanity check
        follows: over every held-out batch it is ``val/reward`` at step 0, the policy RL starts from (``lit-gspo fit``'s
        default, ``Trainer(num_sanity_val_steps=-1)``)."""
        check_data(self)
        check_monitors(logged_names(self), object_monitors(self.plateau_metric, self.trainer.callbacks))
        if not self.warm_started and self.global_step == 0:  # never after a resume (it restores every rank's RNGs)
            self.warm_started = True
            supervised_warm_start(self)
            seed_ranks_apart(self.seed, self.global_rank)  # from here on each rank samples its own draws

    def on_train_epoch_end(self) -> None:
        after_epoch(self)

    def on_train_end(self) -> None:
        if not self.trainer.fast_dev_run:  # a dry run writes nothing
            export.export_policy(self)

    def on_fit_end(self) -> None:
        if not self.trainer.fast_dev_run:
            export.export_if_missing(self)

    def configure_callbacks(self) -> list:
        """Run lock, cleanup of killed writes, logs continued on resume, SIGINT/SIGTERM saved (``lit_gspo.lightning.callbacks``).
        Lightning asks for them before any callback's ``setup``: the trainer's strategy and callbacks are checked here
        first (``strategy.py``, ``lightning_callbacks.py``: a refused one stops the run before it acts)."""
        check_strategy(self.trainer.strategy)
        refuse_unsupported_callbacks(self.trainer.callbacks, self.trainer.strategy)
        return run_callbacks() + ([StopAsyncRollouts()] if self.async_rollouts else [])

    # ------------------------------------------------------------------ validation (Lightning's loop)
    def on_validation_start(self) -> None:
        """:meth:`_before_held_out_sampling`, a fresh tally."""
        self._before_held_out_sampling()
        self._val = ValidationPass(self)

    def _before_held_out_sampling(self) -> None:
        """Before a validation, test or prediction: the RNG state is kept aside so that how often one validates does
        not change the training run (greedy sampling, environments and samplers may draw). A sampled validation draws
        from its own seeded stream (``VALIDATION_STREAM``)."""
        if self.trainer.state.fn != "fit":
            check_data(self)
        check_same_batch_counts(self.trainer)
        self._rng_before_validation = local_rng_state()
        if self.validation.num_generations:
            torch.manual_seed(stream_seed(self.seed, rank=self.global_rank, stream=VALIDATION_STREAM))
        if self.async_rollouts:
            self.async_rollouts.pause()
        self.collector.trainer_state = reward_trainer_state(self.trainer, self)

    def on_validation_epoch_start(self) -> None:
        """Weights to the engine here, after the callbacks' own epoch start: one that swaps weights in for validation
        (``WeightAveraging``, ``EMAWeightAveraging``: the average) is validated with what it swapped in, whichever
        engine samples (vLLM holds its own copy)."""
        self.collector.engine.sync_weights(self.policy)

    def validation_step(self, rows: list[dict], batch_idx: int) -> None:
        check_rows_batch(rows)
        self._val.step(rows)

    def on_validation_epoch_end(self, split: str = "val") -> None:
        metrics = self._val.log(split)
        if metrics is not None:
            step_plateau(self, metrics, split)

    def on_validation_end(self) -> None:
        restore_local_rng_state(self._rng_before_validation)
        if self.async_rollouts:
            self.async_rollouts.resume()

    on_test_start, test_step, on_test_end = on_validation_start, validation_step, on_validation_end
    on_test_epoch_start = on_validation_epoch_start

    def on_test_epoch_end(self) -> None:
        self.on_validation_epoch_end("test")

    # ------------------------------------------------------------------ predict (Lightning's loop)
    def predict_step(self, rows: list[dict], batch_idx: int) -> list[dict]:
        """Completions of a batch of prompt rows, drawn as a validation draws them, with their rewards: one dict per
        row, ``{"row", "completions", "rewards", "scores"}`` (``lit_gspo/lightning/prediction.py``)."""
        check_rows_batch(rows)
        return predict_rows(self, rows)

    on_predict_start = _before_held_out_sampling
    on_predict_epoch_start = on_validation_epoch_start
    on_predict_end = on_validation_end
