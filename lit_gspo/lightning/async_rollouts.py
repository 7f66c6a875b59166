"""The trainer's side of asynchronous rollouts (``sampling.max_staleness`` K >= 1): refusals, the worker of one fit,
and the callback that stops it with the fit. The pipeline itself is ``lit_gspo/rl/collect/async_rollouts.py``."""

from __future__ import annotations

import copy

import torch
from lightning.pytorch import Callback

from lit_gspo.rl.collect.async_rollouts import AsyncRollouts, ThreadRolloutWorker, worker_threads
from lit_gspo.rl.learn.mismatch import TIS, Mismatch
from lit_gspo.runtime.user_errors import SettingsError


def async_mismatch(sampling, mismatch: Mismatch | None) -> Mismatch | None:
    """The mismatch layer a run with ``sampling.max_staleness`` K uses, chosen once (None: K = 0, unchanged).

    ``sampler``: π_old = the engine's log-probs (``Mismatch(old_logprobs="sampler")``: the ratio is π_θ/π_behav);
    ``proximal``: π_old = the trainer's pass before the update (decoupled PPO's π_prox), with TIS on π_prox/π_behav
    (the behaviour-policy correction). A ``model.mismatch`` given is kept when it agrees, refused when it does not.
    """
    if not sampling.max_staleness:
        return mismatch
    want = "sampler" if sampling.async_old_logprobs == "sampler" else "trainer"
    if mismatch is None:
        return Mismatch(old_logprobs="sampler") if want == "sampler" else Mismatch(corrections=[TIS()])
    if mismatch.old_logprobs != want:
        raise SettingsError(
            f"--model.sampling.async_old_logprobs {sampling.async_old_logprobs} needs "
            f"--model.mismatch.old_logprobs {want}, got {mismatch.old_logprobs}: set one of them"
        )
    return mismatch


def check_async(module) -> None:
    """What K >= 1 does not support yet, refused in one line naming the setting."""
    K = module.sampling.max_staleness
    trainer = module.trainer
    if trainer.world_size > 1:
        raise SettingsError(
            f"--model.sampling.max_staleness {K}: asynchronous rollouts run in one process for now; "
            f"this fit has {trainer.world_size} (use --model.sampling.max_staleness 0 with several "
            "devices or nodes)"
        )
    if module.rollout_dumps.every_n_steps:
        raise SettingsError(
            f"--model.sampling.max_staleness {K} with --model.rollout_dumps.every_n_steps "
            f"{module.rollout_dumps.every_n_steps}: a dump's policy would not be the one that sampled "
            "it; set one of them to 0"
        )
    try:
        copy.deepcopy(module.collector.engine)
    except Exception as error:  # noqa: BLE001 - a server, another process
        raise SettingsError(
            f"--model.sampling.max_staleness {K}: the worker needs its own copy of --model.engine "
            f"{type(module.collector.engine).__name__}, which cannot be copied ({type(error).__name__}); "
            "use LeanSampler, HFGenerate or StaticCacheSampler"
        ) from None


def build_async_rollouts(module) -> AsyncRollouts:
    """The pipeline of one fit of ``module`` (an RLModule), started: a worker thread with a copy of the policy as it is
    now (after the warm start, or as the resumed checkpoint left it), its own engine and collector (the same
    environment, reward functions and tokenizer), Lightning's precision context around each rollout."""
    collector = copy.copy(module.collector)  # its own trainer_state and last_* (the reward set and environment shared)
    collector.engine = copy.deepcopy(module.collector.engine)
    collector.last_extra, collector.last_per_function = {}, {}
    refill = module._refill_rows

    def sample(policy, rows, trainer_state):
        collector.trainer_state = trainer_state
        collector.engine.sync_weights(policy)
        return collector.collect(policy, rows, refill)

    before = torch.get_num_threads()
    main, worker = worker_threads(module.sampling.async_worker_threads)
    torch.set_num_threads(main)
    thread = ThreadRolloutWorker(
        sample,
        module.policy,
        version=module.rl_step,
        num_threads=worker,
        context=module.trainer.precision_plugin.forward_context,
    )
    thread.start()

    def on_stop():
        collector.engine.close()
        torch.set_num_threads(before)

    return AsyncRollouts(thread, module.sampling.max_staleness, refill, on_stop=on_stop)


class StopAsyncRollouts(Callback):
    """The rollout worker stops when the fit ends, finished or failed (SIGINT/SIGTERM end in an exception that
    Lightning reports to ``on_exception``): no thread outlives the fit."""

    def teardown(self, trainer, pl_module, stage):
        if stage == "fit":
            pl_module.stop_async_rollouts()

    def on_exception(self, trainer, pl_module, exception):
        pl_module.stop_async_rollouts()
