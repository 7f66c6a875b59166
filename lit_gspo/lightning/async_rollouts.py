"""The trainer's side of asynchronous rollouts (``generation.max_staleness`` K >= 1): refusals, the worker of one fit,
and the callback that stops it with the fit. The pipeline itself is ``lit_gspo/rl/collect/async_rollouts.py``."""

from __future__ import annotations

import copy
import functools

import torch
from lightning.pytorch import Callback
from lightning.pytorch.strategies import ModelParallelStrategy

from lit_gspo.lightning.seed import stream_seed
from lit_gspo.rl.collect.async_rollouts import AsyncRollouts, ThreadRolloutWorker, staleness_tagged, worker_threads
from lit_gspo.rl.collect.process_worker import ProcessRolloutWorker
from lit_gspo.rl.learn.mismatch import TIS, Mismatch
from lit_gspo.runtime.user_errors import SettingsError


def async_mismatch(generation, mismatch: Mismatch | None) -> Mismatch | None:
    """The mismatch layer a run with ``generation.max_staleness`` K uses, chosen once (None: K = 0, unchanged).

    ``sampler``: π_old = the engine's log-probs (``Mismatch(old_logprobs="sampler")``: the ratio is π_θ/π_behav);
    ``proximal``: π_old = the trainer's pass before the update (decoupled PPO's π_prox), with TIS on π_prox/π_behav
    (the behaviour-policy correction). An ``update.mismatch`` given is kept when it agrees, refused when it does not.
    """
    if not generation.max_staleness:
        return mismatch
    want = "sampler" if generation.async_old_logprobs == "sampler" else "trainer"
    if mismatch is None:
        return Mismatch(old_logprobs="sampler") if want == "sampler" else Mismatch(corrections=[TIS()])
    if mismatch.old_logprobs != want:
        raise SettingsError(
            f"--model.generation.async_old_logprobs {generation.async_old_logprobs} needs "
            f"--model.update.mismatch.old_logprobs {want}, got {mismatch.old_logprobs}: set one of them"
        )
    return mismatch


def check_async(module) -> None:
    """What K >= 1 does not support yet, refused in one line naming the setting."""
    K = module.generation.max_staleness
    if module.generation.dump_every_n_steps:
        raise SettingsError(
            f"--model.generation.max_staleness {K} with --model.generation.dump_every_n_steps "
            f"{module.generation.dump_every_n_steps}: a dump's policy would not be the one that sampled "
            "it; set one of them to 0"
        )
    if isinstance(module.trainer.strategy, ModelParallelStrategy):
        raise SettingsError(
            f"--model.generation.max_staleness {K} under FSDP2 (ModelParallelStrategy): a worker's copy of a sharded "
            "policy would gather its parameters beside the trainer's collectives (measured: a forked worker hangs, "
            "a thread's copy is refused by FSDP); use DDP or --model.generation.max_staleness 0"
        )
    if worker_kind(module) == "process":
        device = module.trainer.strategy.root_device
        if device.type != "cpu":
            raise SettingsError(
                f"--model.generation.async_worker process forks, and {device.type} cannot be used in a forked "
                "child: use --model.generation.async_worker thread (or auto)"
            )
        if (module.generation.async_worker_threads or 1) > 1:
            raise SettingsError(
                f"--model.generation.async_worker_threads {module.generation.async_worker_threads} with "
                "--model.generation.async_worker process: a forked worker samples with one thread (GNU OpenMP "
                "cannot run a team of threads in a forked child); use --model.generation.async_worker thread "
                "to give the worker more"
            )
    try:
        copy.deepcopy(module.collector.engine)
    except Exception as error:  # noqa: BLE001 - a server, another process
        raise SettingsError(
            f"--model.generation.max_staleness {K}: the worker needs its own copy of --model.engine "
            f"{type(module.collector.engine).__name__}, which cannot be copied ({type(error).__name__}); "
            "use LeanSampler, HFGenerate or StaticCacheSampler"
        ) from None


def worker_kind(module) -> str:
    """``generation.async_worker`` resolved: ``auto`` is a process on CPU, a thread on an accelerator."""
    kind = module.generation.async_worker
    if kind == "auto":
        return "process" if module.trainer.strategy.root_device.type == "cpu" else "thread"
    return kind


def build_async_rollouts(module) -> AsyncRollouts:
    """The pipeline of one fit of ``module`` (an RLModule), started: a worker with a copy of the policy as it is now
    (after the warm start, or as the resumed checkpoint left it), its own engine and collector (a thread shares the
    environment, reward functions and tokenizer; a process has its own copies), Lightning's precision context around
    each rollout, its own refill prompts and its own random streams: the engine's samples (either worker) and torch's
    default one (a process)."""
    collector = copy.copy(module.collector)  # its own trainer_state and last_* (the reward set and environment shared)
    seed = stream_seed(module.seed, rank=module.global_rank, stream=1 + module.rl_step)  # a resume draws afresh
    collector.engine = copy.deepcopy(module.collector.engine)
    # a thread's samples never depend on when the trainer's thread draws; a seed apart from the refill generator's
    # and the process's default stream's (streams of one seed would draw alike)
    collector.engine.own_random_stream(stream_seed(seed, stream=1))
    collector.last_extra, collector.last_per_function = {}, {}
    refill = functools.partial(module.refill_rows, generator=torch.Generator().manual_seed(seed))

    def sample(policy, rows, trainer_state):
        return collector.rollout(policy, rows, refill, trainer_state)

    before = torch.get_num_threads()
    kind = worker_kind(module)
    common = dict(
        version=module.rl_step, context=module.trainer.precision_plugin.forward_context, name=worker_name(module)
    )
    if kind == "process":
        torch.set_num_threads(max(1, before - 1))
        worker = ProcessRolloutWorker(sample, module.policy, seed=seed, **common)
    else:
        main, threads = worker_threads(module.generation.async_worker_threads)
        torch.set_num_threads(main)
        worker = ThreadRolloutWorker(sample, module.policy, num_threads=threads, **common)
    worker.start()

    def on_stop():
        collector.engine.close()
        torch.set_num_threads(before)

    return AsyncRollouts(worker, module.generation.max_staleness, module.refill_rows, on_stop=on_stop)


def worker_name(module) -> str:
    """``lit-gspo-rollout-worker``, with the rank where there are several (each rank has its own worker)."""
    world = module.trainer.world_size
    return "lit-gspo-rollout-worker" + (f"-rank{module.global_rank}" if world > 1 else "")


class StopAsyncRollouts(Callback):
    """The rollout worker stops when the fit ends, finished or failed (SIGINT/SIGTERM end in an exception that
    Lightning reports to ``on_exception``): no thread outlives the fit."""

    def teardown(self, trainer, pl_module, stage):
        if stage == "fit":
            pl_module.async_rollouts.stop()

    def on_exception(self, trainer, pl_module, exception):
        pl_module.async_rollouts.stop()


class FitRollouts:
    """The asynchronous rollouts of one fit of ``module``: the worker starts at the fit's first RL step (or a resume's:
    in-flight rollouts are never checkpointed), pauses for validation, and stops with the fit."""

    def __init__(self, module):
        self.module = module
        self.pipeline: AsyncRollouts | None = None

    def next(self, rows: list[dict], trainer_state):
        """Submit ``rows``; the oldest rollout no more than K versions old, and its statistics."""
        if self.pipeline is None:
            self.pipeline = build_async_rollouts(self.module)
        produced, stats = self.pipeline.next(rows, self.module.rl_step, trainer_state)
        stats.update(produced.stats)
        stats["time/rollout_s"] = produced.seconds
        return produced.rollout, stats

    def publish(self, stats: dict) -> None:
        """The weights after this step, for the worker's next rollouts; the step's metrics by staleness."""
        if self.pipeline is not None:
            self.pipeline.publish(self.module.policy, self.module.rl_step + 1)
            stats.update(staleness_tagged(stats, int(stats["staleness"])))

    def pause(self) -> None:
        if self.pipeline is not None:  # validation on the trainer's policy; no rollout meanwhile
            self.pipeline.worker.pause()

    def resume(self) -> None:
        if self.pipeline is not None:
            self.pipeline.worker.resume()

    def stop(self) -> None:
        """End the worker (the fit's end, an error, a signal); rollouts in flight are discarded."""
        if self.pipeline is not None:
            self.pipeline.stop()
            self.pipeline = None
