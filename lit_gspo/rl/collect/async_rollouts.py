"""Asynchronous rollouts with bounded staleness (``sampling.max_staleness`` K ≥ 1; docs/async.md).

    trainer (RLModule.training_step)                    worker (a RolloutWorker: a thread here)
    step s:  submit(rows_s)                ──rows───►    before each rollout: the newest published weights (version v)
             produced = get()              ◄─rollout──   collect(rows) with its own copy of the policy, wholly under v
             s − v > K: dropped, counted, rows refilled, next one
             snapshot → advantage → learn                (the worker samples the next rows meanwhile)
             publish(policy, version s + 1) ──weights─►

The first step of a fit (and of a resume: in-flight rollouts are not checkpointed) submits its rows and K more batches
drawn like dynamic sampling's refills, so the worker is always K batches ahead: step s trains on rows submitted K steps
earlier, sampled under a version ≥ s − K. Weights change only between the worker's rollouts (no partial rollouts).

The worker is behind :class:`RolloutWorker` (start, submit, get, publish, stop, paused). Two are built in:
:class:`ThreadRolloutWorker`, a daemon thread of the trainer's process with its own copy of the policy (torch kernels
release the GIL; rewards, environments and tools are used as they are; the default on an accelerator), and
``process_worker.ProcessRolloutWorker``, a forked process (no GIL shared; the default on CPU).
Nothing here is in the objectives: π_old is chosen once through the mismatch layer
(``lit_gspo.lightning.async_rollouts.async_mismatch``).
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from lit_gspo.runtime.threads import start_thread

#: ``sampling.async_old_logprobs``: what the ratio's denominator π_old is under K ≥ 1
ASYNC_OLD_LOGPROBS = ("sampler", "proximal")

#: (policy copy, rows, trainer_state) → (rollout or None, stats): one whole rollout, e.g. ``Collector.collect``
SampleFn = Callable[[nn.Module, list, object], tuple]


@dataclass
class Produced:
    """One rollout of the worker: its rows, the rollout (None: dynamic sampling kept no group), its stats, and the
    policy version (RL steps done) of the weights it was sampled with, all of it."""

    rows: list
    rollout: object
    stats: dict
    version: int
    seconds: float = 0.0


class WorkerFailed(RuntimeError):
    """The rollout worker raised or died: one line naming it and the error."""


class RolloutWorker:
    """What generates rollouts beside the trainer. Every method is called from the trainer's thread."""

    def start(self) -> None:
        raise NotImplementedError

    def submit(self, rows: list, trainer_state=None) -> None:
        """Queue ``rows`` for a rollout (FIFO)."""
        raise NotImplementedError

    def get(self) -> Produced:
        """The oldest finished rollout, waiting for it; raises :class:`WorkerFailed` if the worker failed."""
        raise NotImplementedError

    def publish(self, policy: nn.Module, version: int) -> None:
        """The policy's weights after ``version`` RL steps; rollouts started from now on use them."""
        raise NotImplementedError

    def stop(self) -> None:
        """End the worker (idempotent; never hangs): in-flight rollouts are discarded."""
        raise NotImplementedError

    def pause(self) -> None:
        """No rollout starts until :meth:`resume` (one in progress finishes first): validation uses the same reward
        functions and environment, user objects that need not be thread-safe."""

    def resume(self) -> None:
        pass

    @contextmanager
    def paused(self):
        self.pause()
        try:
            yield
        finally:
            self.resume()


def trainable_parameters(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters an update changes (LoRA: the adapters only), by name."""
    return {name: p for name, p in policy.named_parameters() if p.requires_grad}


class ThreadRolloutWorker(RolloutWorker):
    """A daemon thread with its own copy of the policy (made at :meth:`start`, frozen, in eval mode).

    Args:
        sample: what one rollout is (``(policy copy, rows, trainer_state) -> (rollout, stats)``).
        policy: the trainer's policy, copied at :meth:`start` as version ``version``.
        version: the policy version at start (RL steps done).
        num_threads: torch's intra-op threads of the worker thread (OpenMP's setting is per thread: the trainer's
            own thread keeps its count); None: torch's.
        context: entered around every rollout in the worker thread (autocast is per thread: Lightning's precision).
        poll_s: how often a waiting side looks whether the other is still alive.
    """

    def __init__(
        self,
        sample: SampleFn,
        policy: nn.Module,
        *,
        version: int = 0,
        num_threads: int | None = None,
        context: Callable[[], object] = nullcontext,
        name: str = "lit-gspo-rollout-worker",
        poll_s: float = 0.05,
    ):
        self.sample, self.policy, self.version, self.num_threads = sample, policy, version, num_threads
        self.context, self.name, self.poll_s = context, name, poll_s
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._weights = threading.Lock()  # the staged weights and their version
        self._sampling = threading.Lock()  # held by the worker around each rollout, by paused() around validation
        self._thread: threading.Thread | None = None
        self._copy: nn.Module | None = None
        self._staged: dict[str, torch.Tensor] = {}
        self._staged_version = version
        self.error: BaseException | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._copy = copy.deepcopy(self.policy)
        for p in self._copy.parameters():
            p.requires_grad_(False)
            p.grad = None
        self._copy.eval()
        self._staged = {n: p.detach().clone() for n, p in trainable_parameters(self.policy).items()}
        self._thread = start_thread(self._run, self.name)  # on the trainer thread's device (a rank's GPU)

    def submit(self, rows, trainer_state=None):
        self._inbox.put((rows, trainer_state))

    def publish(self, policy, version):
        with self._weights:
            if version < self._staged_version:  # a late delivery never takes the worker back to older weights
                return
            for name, p in trainable_parameters(policy).items():
                self._staged[name].copy_(p.detach())
            self._staged_version = version

    def get(self) -> Produced:
        while True:
            try:
                item = self._outbox.get(timeout=self.poll_s)
            except queue.Empty:
                if not self.alive:  # ended without a word (stopped, or killed by something uncatchable)
                    raise WorkerFailed(
                        f"the rollout worker ({self.name}) is not running: "
                        f"{'it was stopped' if self._stop.is_set() else 'it died'}"
                    ) from self.error
                continue
            if isinstance(item, BaseException):
                raise WorkerFailed(
                    f"the rollout worker ({self.name}) failed: {type(item).__name__}: {one_line(item)}"
                ) from item
            return item

    def pause(self):
        self._sampling.acquire()

    def resume(self):
        self._sampling.release()

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)  # a rollout in progress finishes first; a daemon thread never blocks the exit

    # ------------------------------------------------------------------ the worker's thread
    def _run(self) -> None:
        try:
            if self.num_threads:
                torch.set_num_threads(self.num_threads)  # this thread's OpenMP threads only
            own = trainable_parameters_of_copy(self._copy, self._staged)
            while not self._stop.is_set():
                try:
                    rows, state = self._inbox.get(timeout=self.poll_s)
                except queue.Empty:
                    continue
                while not self._sampling.acquire(timeout=self.poll_s):  # paused (validation)
                    if self._stop.is_set():
                        return
                try:
                    if self._stop.is_set():
                        return
                    with self._weights:  # the newest weights, for the whole rollout
                        for name, staged in self._staged.items():
                            own[name].copy_(staged)
                        version = self._staged_version
                    start = time.perf_counter()
                    with torch.no_grad(), self.context():
                        rollout, stats = self.sample(self._copy, rows, state)
                    self._outbox.put(Produced(rows, rollout, stats, version, time.perf_counter() - start))
                finally:
                    self._sampling.release()
        except BaseException as error:  # noqa: BLE001 - handed to the trainer, which raises it in one line
            self.error = error
            self._outbox.put(error)


def trainable_parameters_of_copy(copy_: nn.Module, staged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    params = dict(copy_.named_parameters())
    missing = sorted(set(staged) - set(params))
    if missing:
        raise RuntimeError(f"the worker's copy of the policy lacks {missing[:3]}")
    return {name: params[name] for name in staged}


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 400 else text[:400] + " ..."


@dataclass
class AsyncRollouts:
    """The trainer's side of the pipeline: keeps the worker ``max_staleness`` batches ahead and hands out rollouts at
    most ``max_staleness`` versions old (older ones are dropped, counted, and their rows replaced by ``refill``)."""

    worker: RolloutWorker
    max_staleness: int
    refill: Callable[[int], list]
    primed: bool = False
    histogram: Counter = field(default_factory=Counter)  # staleness → rollouts trained on, over the run
    dropped_total: int = 0

    def next(self, rows: list, version: int, trainer_state=None) -> tuple[Produced, dict[str, float]]:
        """The rollout step ``version`` (RL steps done) trains on, after submitting ``rows``; and the async metrics."""
        start = time.perf_counter()
        if not self.primed:  # the worker runs K batches ahead from the first step on
            ahead = [self.refill(len(rows)) for _ in range(self.max_staleness)]
            for batch in [rows, *ahead]:
                self.worker.submit(batch, trainer_state)
            self.primed = True
        else:
            self.worker.submit(rows, trainer_state)
        dropped = 0
        while True:
            produced = self.worker.get()
            staleness = version - produced.version
            if staleness <= self.max_staleness:
                break
            dropped += count_samples(produced)
            self.worker.submit(self.refill(len(produced.rows)), trainer_state)  # keep the worker K batches ahead
        self.dropped_total += dropped
        self.histogram[staleness] += 1
        runs = sum(self.histogram.values())
        stats = {
            "staleness": float(staleness),
            "async/dropped": float(dropped),
            "async/dropped_total": float(self.dropped_total),
            "time/rollout_wait_s": time.perf_counter() - start,
        }
        stats.update({f"async/staleness_hist_{k}": self.histogram[k] / runs for k in range(self.max_staleness + 1)})
        return produced, stats

    def publish(self, policy: nn.Module, version: int) -> None:
        self.worker.publish(policy, version)

    on_stop: Callable[[], None] | None = None

    def stop(self) -> None:
        self.worker.stop()
        if self.on_stop is not None:
            self.on_stop()
            self.on_stop = None


def count_samples(produced: Produced) -> int:
    rollout = produced.rollout
    return len(rollout) if rollout is not None and hasattr(rollout, "__len__") else 0


def staleness_tagged(stats: dict, staleness: int) -> dict[str, float]:
    """The step's clip fraction and k3 (sampler or π_prox against π_behav) under keys naming its staleness."""
    out = {}
    for key, name in (("clip_frac", "clip_frac"), ("mismatch/k3", "k3")):
        if key in stats:
            out[f"async/{name}_staleness{staleness}"] = stats[key]
    return out


def worker_threads(num_threads: int | None) -> tuple[int, int]:
    """(trainer's, worker's) torch intra-op threads: ``sampling.async_worker_threads``, or half of torch's each."""
    total = torch.get_num_threads()
    worker = num_threads or max(1, total // 2)
    return max(1, total - worker) if num_threads is None else total, worker
