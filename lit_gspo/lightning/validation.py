"""One validation (or test) of an RLModule: a greedy completion of each held-out prompt, or n sampled ones
(``validation.num_generations``), scored, reduced over the ranks and logged as ``<split>/reward``,
``<split>/response_length``, ``<split>/clipped_ratio``, the multi-turn metrics and, sampled, ``<split>/pass@<k>``, with
some of the completions shown (``completions.csv``, the loggers' tables, the terminal)."""

from __future__ import annotations

import time

import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_gspo.lightning.completions_log import due, log_completions, terminal_table
from lit_gspo.lightning.same_batches import check_same_batch
from lit_gspo.rl.evaluate import PassAtK, RewardTally, sampling
from lit_gspo.runtime.collectives import all_reduce_sum

#: what a validation logs for every environment: the tally's own sums, then its keyed means
VALIDATION_NAMES = ("val/reward", "val/response_length", "val/clipped_ratio")


def validation_metric_keys(collector) -> list[str]:
    """The keyed means validation reports besides reward and length: the share of replies the budget cut, each reward
    function's mean over the replies it scored (TRL's eval ``rewards/<function>/mean``), and a multi-turn environment's
    episode metrics."""
    rewards = [f"rewards/{name}/mean" for name in collector.rewards.names]
    return ["clipped_ratio", *rewards, *episode_metric_keys(collector.environment)]


def episode_metric_keys(environment) -> list[str]:
    """The multi-turn metrics validation reports (none for a single-turn environment)."""
    if environment.max_turns == 1:
        return []
    return (
        ["turns", "success"]
        + [f"success_turn{k}" for k in range(1, environment.max_turns + 1)]
        + list(environment.metric_names)
    )


class ValidationPass:
    """The tally of one pass over the held-out batches, and the completions it shows."""

    def __init__(self, module):
        self.module = module
        self.tally = RewardTally(validation_metric_keys(module.collector))
        validation = module.validation
        self.passes = (
            PassAtK(validation.num_generations, validation.pass_ks(), validation.pass_threshold)
            if validation.num_generations
            else None
        )
        self.shown = ([], [], [])  # rows, replies, rewards of the completions logged with this validation
        self.shown_scores: dict[str, list[float]] = {}  # each reward function's scores of those
        self.start = time.perf_counter()

    def step(self, rows: list[dict]) -> None:
        """Completions of this rank's share of the held-out batch, scored: one greedy, or n sampled per prompt."""
        module = self.module
        drawn = sample_share(module, rows)
        if drawn is None:
            return
        rows, batch, replies, stats = drawn
        self.tally.add(batch, stats)
        if self.passes is not None:
            self.passes.add(batch)
        samples = [row for row in rows for _ in range(len(replies) // len(rows))]
        room = max(module.validation.num_logged_completions - len(self.shown[0]), 0)
        for part, new in zip(self.shown, (samples, replies, batch.rewards.tolist())):
            part.extend(new[:room])
        for name, scores in module.collector.last_per_function.items():
            self.shown_scores.setdefault(name, []).extend(scores[:room])

    def log(self, split: str) -> dict | None:
        """The metrics over every held-out prompt of every rank, through ``module.log`` (callbacks and loggers see
        them; the row's ``step`` is the number of RL steps done). Lightning's sanity check logs nothing, unless it is
        the step-0 validation (:func:`is_step_zero`), which goes to the loggers directly; None then."""
        module, trainer = self.module, self.module.trainer
        metrics = self.tally.reduce(all_reduce_sum, prefix=split)
        if self.passes is not None:
            metrics.update(self.passes.reduce(all_reduce_sum, prefix=split))
        if trainer.sanity_checking and not is_step_zero(trainer, module):
            return None
        seconds = time.perf_counter() - self.start
        if trainer.sanity_checking:  # Lightning drops what is logged in its sanity check
            if trainer.is_global_zero:
                for logger in module.loggers:
                    logger.log_metrics({**metrics, "time/val_s": seconds}, step=0)
                    logger.save()
        else:
            # fp64 tensors: Lightning keeps their dtype (a float would be stored as fp32); the same value on every rank.
            # On the module's device: sync_dist reduces them with the process group's backend (NCCL: CUDA tensors only)
            module.log_dict(
                {k: torch.tensor(v, dtype=torch.float64, device=module.device) for k, v in metrics.items()},
                sync_dist=True,
            )
            # sync_dist: the same step on every rank, the mean validation time (Lightning warns about epoch-level logs
            # without it)
            module.log_dict({"step": float(module.rl_step), "time/val_s": seconds}, sync_dist=True)
        if due(module.rl_step, module.validation.log_completions_every_n_steps) and trainer.is_global_zero:
            log_completions(module.loggers, module.rl_step, *self.shown)
            if module.validation.print_completions and self.shown[0]:
                bar = trainer.progress_bar_callback  # prints above its bars, not into them
                (bar.print if bar is not None else print)(
                    terminal_table(
                        module.rl_step,
                        split,
                        *self.shown,
                        self.shown_scores,
                        samples_per_prompt=module.validation.num_generations,
                    )
                )
        rank_zero_info(f"step {module.rl_step}: {split}/reward = {metrics[f'{split}/reward']:.4f} ({seconds:.1f} s)")
        return None if trainer.sanity_checking else metrics


def sample_share(module, rows: list[dict]):
    """This rank's share of a held-out batch (``rows[rank::world_size]``; every rank is given the same batch:
    ``same_batches.py``), sampled as ``validation`` says: one greedy completion, or n at its temperature, each
    prompt's n rows together, within ``generation.validation_budget``.
    Returns (share, batch, replies, stats), or None when the batch leaves this rank no row."""
    check_same_batch(rows)
    rows = rows[module.global_rank :: module.trainer.world_size]
    n, generation = module.validation.num_generations, module.collector.generation
    # Lightning validates and predicts under inference mode; FSDP2 on one device makes its unsharded parameters at
    # their first forward and keeps them: as inference tensors they could not be written in training ("Inference
    # tensors do not track version counter"). no_grad is what sampling needs.
    with torch.inference_mode(False), torch.no_grad():
        if not rows:  # a batch smaller than the world: under FSDP2 this rank still generates with the others
            if module.synced_gpus():
                module.collector.generate_nothing(module.policy, True, True)
            return None
        if not n:
            drawn = module.collector.sample(module.policy, rows, greedy=True, synced_gpus=module.synced_gpus())
        else:
            with sampling(module.collector, n, module.validation.temperature, generation.validation_budget):
                drawn = module.collector.sample(module.policy, rows, synced_gpus=module.synced_gpus())
    return (rows, *drawn)


def is_step_zero(trainer, module) -> bool:
    """Whether Lightning's sanity check is the fit's validation before the first update: a fresh run's (no RL step
    done), over every held-out batch (``num_sanity_val_steps=-1``, or at least as many as there are)."""
    return module.rl_step == 0 and trainer.num_sanity_val_batches == trainer.num_val_batches
