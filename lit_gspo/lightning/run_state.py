"""What a checkpoint of an RL run holds beyond Lightning's own state: every rank's torch/numpy/python RNG states and the
refill generator, the RL-step counter, whether the warm start was done, the optimiser steps taken, the adaptive entropy
bonus' coefficient. A resume restores them, so that it continues the uninterrupted run bit for bit.

Only a fit restores the RNG states: ``trainer.validate``, ``test`` and ``predict`` with a ``ckpt_path``, and
``RLModule.load_from_checkpoint``, leave the process's random state as it is (Lightning restores none), and so run on
any number of processes (a fit's states are one per rank)."""

from __future__ import annotations

from lit_gspo.runtime.rng import restore_rng_states, rng_states

#: every rank's RNG states, rank-ordered: as many as the run had processes
RNG_STATES = "rng_states"


def save_run_state(module, checkpoint: dict) -> None:
    checkpoint[RNG_STATES] = rng_states(module.refill_generator)
    checkpoint["rl_step"] = module.rl_step
    checkpoint["warm_started"] = module.warm_started
    checkpoint["optimizer_steps"] = module.optimizer_steps
    if module.learner.entropy_bonus is not None:
        checkpoint["entropy_bonus"] = module.learner.entropy_bonus.state_dict()


def load_run_state(module, checkpoint: dict) -> None:
    if module.attached() and module.trainer.state.fn == "fit":
        restore_rng_states(checkpoint[RNG_STATES], module.global_rank, module.refill_generator)
    module.rl_step = checkpoint["rl_step"]
    module.warm_started = checkpoint["warm_started"]
    module.optimizer_steps = checkpoint["optimizer_steps"]
    if module.learner.entropy_bonus is not None and "entropy_bonus" in checkpoint:
        module.learner.entropy_bonus.load_state_dict(checkpoint["entropy_bonus"])
