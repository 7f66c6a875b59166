"""A rollout worker in a process of its own (``generation.async_worker: process``; docs/async.md).

    trainer's process                                   worker process (forked at the fit's first RL step)
    submit(rows)              ──pipe (pickled rows)──►   its own interpreter (no GIL shared with the trainer),
    get() ◄── Produced        ◄──pipe (pickled bytes)──  its own copy of everything: policy, engine, environment,
    publish(policy, v): copy the trainable               reward functions (a fork needs nothing to be picklable);
        parameters into shared memory, v into a shared    before each rollout: the newest published weights, copied
        integer, under a shared lock                      under the lock into its policy → a rollout wholly under v

Forked, not spawned: the worker inherits the trainer's objects as they are (a user's lambda reward included) and
starts in milliseconds. The price is GNU OpenMP's: a team of threads cannot run in a forked child (measured: a
2-thread matmul in the child hangs), so the worker samples with one intra-op thread, and CUDA cannot be used in a
forked child at all (the thread worker serves accelerators). What crosses the pipes is pickled to bytes here,
tensors included: torch's own reduction would pass file descriptors that vanish with a worker that ends before the
trainer reads them.

Ends: :meth:`stop` asks the worker to finish, then kills it; the worker ignores SIGINT (a terminal's Ctrl-C reaches
the whole process group; the trainer handles it and stops the worker), ends after its current rollout on SIGTERM,
and ends by itself when the trainer's process is gone. A worker that raises sends its error in one line; one that
dies (SIGKILL, out of memory) is noticed by the trainer's next :meth:`get` or :meth:`publish`, which raise
:class:`WorkerFailed` naming its pid and exit signal.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import signal
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

from lit_gspo.rl.collect.async_rollouts import (
    Produced,
    RolloutWorker,
    SampleFn,
    WorkerFailed,
    one_line,
    trainable_parameters,
    trainable_parameters_of_copy,
)
from lit_gspo.runtime.rng import seed_default_streams


class Failure(tuple):
    """(error in one line,) sent by a worker that raised (an exception object need not pickle)."""


class ProcessRolloutWorker(RolloutWorker):
    """A forked process sampling with its own copy of the policy, one intra-op thread.

    Args:
        sample: what one rollout is (``(policy, rows, trainer_state) -> (rollout, stats)``), run in the worker.
        policy: the trainer's policy; the worker's copy is the one it inherits at :meth:`start` (version ``version``).
        version: the policy version at start (RL steps done).
        seed: the seed of the worker's torch, numpy and python random streams (a fork would otherwise repeat the
            trainer's streams).
        context: entered around every rollout in the worker (Lightning's precision: autocast).
        poll_s: how often a waiting side looks whether the other is still alive.
        stop_grace_s: how long :meth:`stop` lets a rollout in progress finish before it kills the worker.
    """

    def __init__(
        self,
        sample: SampleFn,
        policy: nn.Module,
        *,
        version: int = 0,
        seed: int = 0,
        context: Callable[[], object] = nullcontext,
        name: str = "lit-gspo-rollout-worker",
        poll_s: float = 0.05,
        stop_grace_s: float = 2.0,
    ):
        self.sample, self.policy, self.version, self.seed = sample, policy, version, seed
        self.context, self.name, self.poll_s, self.stop_grace_s = context, name, poll_s, stop_grace_s
        self._process = None

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        if any(p.device.type != "cpu" for p in self.policy.parameters()):
            raise RuntimeError(
                "the process rollout worker forks, and CUDA cannot be used in a forked child: "
                "use --model.generation.async_worker thread on an accelerator"
            )
        ctx = multiprocessing.get_context("fork")
        self._staged = {n: p.detach().clone().share_memory_() for n, p in trainable_parameters(self.policy).items()}
        self._staged_version = ctx.Value("q", self.version, lock=False)
        self._weights = ctx.Lock()  # the staged weights and their version
        self._may_start = ctx.Event()  # cleared by pause(): no rollout starts
        self._may_start.set()
        self._stop = ctx.Event()
        self._inbox, self._outbox = ctx.Queue(), ctx.Queue()
        self._process = ctx.Process(target=self._run, name=self.name, daemon=True)
        self._process.start()

    def submit(self, rows, trainer_state=None):
        self._inbox.put(pickle.dumps((rows, trainer_state)))

    def publish(self, policy, version):
        while not self._weights.acquire(timeout=self.poll_s):  # a worker killed holding the lock never frees it
            self._raise_if_dead()
        try:
            if version < self._staged_version.value:  # a late delivery never takes the worker back
                return
            for name, p in trainable_parameters(policy).items():
                self._staged[name].copy_(p.detach())
            self._staged_version.value = version
        finally:
            self._weights.release()

    def get(self) -> Produced:
        while True:
            try:
                item = self._outbox.get(timeout=self.poll_s)
            except queue.Empty:
                self._raise_if_dead()
                continue
            item = pickle.loads(item)
            if isinstance(item, Failure):
                raise WorkerFailed(f"the rollout worker ({self.name}, pid {self.pid}) failed: {item[0]}")
            return item

    def pause(self):
        self._may_start.clear()

    def resume(self):
        self._may_start.set()

    def stop(self, timeout: float | None = None) -> None:
        if self._process is None:
            return
        self._stop.set()
        self._process.join(self.stop_grace_s if timeout is None else timeout)
        if self._process.is_alive():  # in-flight rollouts are discarded anyway
            self._process.kill()
            self._process.join(5.0)
        for q in (self._inbox, self._outbox):
            q.cancel_join_thread()  # unread items never block the trainer's exit
            q.close()

    def _raise_if_dead(self) -> None:
        if not self.alive:
            code = self._process.exitcode
            why = "it was stopped" if self._stop.is_set() else f"it died ({exit_description(code)})"
            raise WorkerFailed(f"the rollout worker ({self.name}, pid {self.pid}) is not running: {why}")

    # ------------------------------------------------------------------ the worker's process
    def _run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer handles Ctrl-C and stops the worker
        signal.signal(signal.SIGTERM, lambda *_: self._stop.set())  # finish the rollout in progress, then end
        try:
            torch.set_num_threads(1)  # GNU OpenMP cannot run a team of threads in a forked child
            seed_default_streams(self.seed)  # torch's, numpy's and python's: a fork would repeat the trainer's
            for p in self.policy.parameters():
                p.requires_grad_(False)
                p.grad = None
            self.policy.eval()
            own = trainable_parameters_of_copy(self.policy, self._staged)
            trainer = multiprocessing.parent_process()
            while not self._stop.is_set() and trainer.is_alive():
                try:
                    rows, state = pickle.loads(self._inbox.get(timeout=self.poll_s))
                except queue.Empty:
                    continue
                while not self._may_start.wait(self.poll_s):  # paused (validation)
                    if self._stop.is_set():
                        return
                with self._weights:  # the newest weights, for the whole rollout
                    for name, staged in self._staged.items():
                        own[name].copy_(staged)
                    version = self._staged_version.value
                start = time.perf_counter()
                with torch.no_grad(), self.context():
                    rollout, stats = self.sample(self.policy, rows, state)
                self._outbox.put(pickle.dumps(Produced(rows, rollout, stats, version, time.perf_counter() - start)))
        except BaseException as error:  # noqa: BLE001 - handed to the trainer, which raises it in one line
            self._outbox.put(pickle.dumps(Failure((f"{type(error).__name__}: {one_line(error)}",))))


def exit_description(code: int | None) -> str:
    """``exit code 1`` / ``killed by SIGKILL`` from a multiprocessing exit code."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
