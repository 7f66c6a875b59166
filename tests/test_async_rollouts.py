"""Asynchronous rollouts (``generation.max_staleness`` K, docs/async.md): K = 0 is the synchronous run bit for bit; no
trained sample is more than K versions old; each rollout is sampled wholly under one version; a failing worker stops
the fit in one line; no thread outlives a fit; π_old is the sampler's or the trainer's proximal pass; a K = 1
quickstart learns."""

from __future__ import annotations

import csv
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from test_trainer import tiny_args as trainer_tiny_args
from torch import nn

from lit_gspo.lightning.async_rollouts import async_mismatch, check_async
from lit_gspo.rl.collect.async_rollouts import AsyncRollouts, Produced, RolloutWorker, ThreadRolloutWorker, WorkerFailed
from lit_gspo.rl.collect.process_worker import ProcessRolloutWorker
from lit_gspo.rl.config import Generation
from lit_gspo.rl.engines import HFGenerate
from lit_gspo.rl.learn.mismatch import TIS, Mismatch
from lit_gspo.rl.learn.old_policy import GivenOldLogprobs, TrainerPassOverEveryRow
from lit_gspo.runtime.user_errors import SettingsError
from lit_gspo.tools.main import cli_main

ROOT = Path(__file__).resolve().parents[1]
WORKER = "lit-gspo-rollout-worker"


def tiny_args(root, *extra):
    """test_trainer's seconds-long run (4 prompts × 4 completions, 4 new tokens, no warm start), without the bar."""
    return trainer_tiny_args(root, "--trainer.enable_progress_bar", "false", *extra)


def read_metrics(root: Path) -> list[dict]:
    with open(sorted(root.glob("**/metrics.csv"))[-1]) as f:
        return list(csv.DictReader(f))


def column(rows, key):
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


def staleness_by_step(root: Path) -> dict[int, float]:
    """``train/staleness`` of every RL step, over every metrics file under ``root`` (a fit and its resume)."""
    rows = [r for f in sorted(root.glob("**/metrics.csv")) for r in csv.DictReader(open(f))]
    return {int(r["step"]): float(r["train/staleness"]) for r in rows if r.get("train/staleness")}


def assert_k1_staleness(staleness: dict[int, float], steps: int, primed: set[int]) -> None:
    """K = 1: a step right after the worker was (re)primed trains on rows sampled under its own version (staleness 0).
    Any other step t trains on rows submitted a step before, which the worker samples under the newest weights it has
    when it begins them: version t-1, or t if the trainer published first (a race the worker usually wins; a loaded
    machine may not let it, and the fresher rollout is as valid)."""
    assert sorted(staleness) == list(range(steps)), staleness
    assert all(staleness[t] == 0.0 if t in primed else staleness[t] in (0.0, 1.0) for t in range(steps)), staleness


def workers_alive() -> list:
    """The rollout workers still running: threads of this process and processes forked by it."""
    threads = [t for t in threading.enumerate() if t.name.startswith(WORKER) and t.is_alive()]
    return threads + [p for p in multiprocessing.active_children() if p.name.startswith(WORKER)]


# ---------------------------------------------------------------------- the pipeline on its own (a fake collector)
class Rollout(list):
    """A stand-in rollout: one entry per sample."""


def versioned_policy() -> nn.Module:
    policy = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        policy.weight.fill_(0.0)
    return policy


def set_version(policy: nn.Module, version: int) -> None:
    with torch.no_grad():
        policy.weight.fill_(float(version))


def slow_sampler(delays: list[float]):
    """A sampling function slowed by the drawn sleeps; it reads the weights (= the version) before and after."""
    draws = iter(delays * 1000)

    def sample(policy, rows, trainer_state):
        before = float(policy.weight)
        time.sleep(next(draws))
        after = float(policy.weight)
        return Rollout(rows), {"seen_before": before, "seen_after": after}

    return sample


def late_weights(base: type[RolloutWorker]) -> type[RolloutWorker]:
    """``base`` with weights that arrive late (as from another machine): each publish lands after a drawn delay, so
    the worker sometimes samples under older weights than the trainer's and the trainer must drop what is too
    stale."""

    class LateWeights(base):
        def __init__(self, *args, publish_delays: list[float], **kwargs):
            super().__init__(*args, **kwargs)
            self.publish_delays = iter(publish_delays * 1000)
            self.timers: list[threading.Timer] = []

        def publish(self, policy, version):
            frozen = versioned_policy()
            set_version(frozen, version)
            timer = threading.Timer(next(self.publish_delays), base.publish, (self, frozen, version))
            timer.start()
            self.timers.append(timer)

    return LateWeights


WORKERS = [ThreadRolloutWorker, ProcessRolloutWorker]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    K=st.integers(1, 3),
    steps=st.integers(3, 9),
    sample_delays=st.lists(st.floats(0, 0.02), min_size=1, max_size=8),
    update_delays=st.lists(st.floats(0, 0.02), min_size=1, max_size=8),
    publish_delays=st.lists(st.floats(0, 0.04), min_size=1, max_size=8),
)
@pytest.mark.parametrize("kind", WORKERS, ids=lambda w: w.__name__)
def test_no_trained_sample_is_older_than_k_versions_and_each_is_sampled_under_one_version(
    kind, K, steps, sample_delays, update_delays, publish_delays
):
    policy = versioned_policy()
    worker = late_weights(kind)(slow_sampler(sample_delays), policy, publish_delays=publish_delays, poll_s=0.005)
    worker.start()
    pipeline = AsyncRollouts(worker, K, refill=lambda n: [("refill", i) for i in range(n)])
    trained, dropped = [], 0
    update = iter(update_delays * 1000)
    try:
        for step in range(steps):
            produced, stats = pipeline.next([(step, i) for i in range(4)], version=step)
            assert 0 <= step - produced.version <= K, (step, produced.version)
            assert stats["staleness"] == step - produced.version
            # the whole rollout saw the weights of the version it carries: no partial rollout
            assert produced.stats["seen_before"] == produced.stats["seen_after"] == produced.version
            trained.append(step - produced.version)
            dropped += stats["async/dropped"]
            time.sleep(next(update))  # the update
            set_version(policy, step + 1)
            pipeline.publish(policy, step + 1)
        assert stats["async/dropped_total"] == dropped
        assert sum(stats[f"async/staleness_hist_{k}"] for k in range(K + 1)) == pytest.approx(1.0)
    finally:
        pipeline.stop()
        for timer in worker.timers:
            timer.cancel()
    assert not worker.alive


class ScriptedWorker(RolloutWorker):
    """Hands out rollouts of the scripted versions, in order; records what was submitted."""

    def __init__(self, versions):
        self.versions, self.submitted = list(versions), []

    def submit(self, rows, trainer_state=None):
        self.submitted.append(rows)

    def get(self):
        return Produced(rows=["r"] * 2, rollout=Rollout(["s"] * 8), stats={}, version=self.versions.pop(0))


def test_too_stale_rollouts_are_dropped_counted_and_their_rows_replaced():
    worker = ScriptedWorker([0, 3, 1, 4])
    pipeline = AsyncRollouts(worker, max_staleness=1, refill=lambda n: ["new"] * n)
    produced, stats = pipeline.next(["a", "b"], version=4)  # versions 0, 3 are 4 and 1 behind... 0 and 1 dropped
    assert produced.version == 3 and stats["staleness"] == 1.0 and stats["async/dropped"] == 8.0
    assert worker.submitted == [["a", "b"], ["new", "new"], ["new", "new"]]  # the first step primes K = 1 batch ahead
    produced, stats = pipeline.next(["c", "d"], version=5)
    assert produced.version == 4 and stats["async/dropped"] == 8.0 and stats["async/dropped_total"] == 16.0
    assert stats["async/staleness_hist_1"] == 1.0


@pytest.mark.parametrize("kind", WORKERS, ids=lambda w: w.__name__)
def test_a_worker_error_reaches_the_trainer_in_one_line_and_the_worker_ends(kind):
    def sample(policy, rows, state):
        raise ValueError("boom\nsecond line")

    worker = kind(sample, versioned_policy(), poll_s=0.01)
    worker.start()
    worker.submit([1])
    with pytest.raises(WorkerFailed, match="rollout worker .* failed: ValueError: boom second line") as raised:
        worker.get()
    assert "\n" not in str(raised.value)
    worker.stop()
    assert not worker.alive


def echo(policy, rows, state):
    return Rollout(rows), {}


@pytest.mark.parametrize("kind", WORKERS, ids=lambda w: w.__name__)
def test_paused_worker_starts_no_rollout_until_resumed(kind):
    worker = kind(echo, versioned_policy(), poll_s=0.01)
    worker.start()
    try:
        worker.pause()
        worker.submit([1])
        time.sleep(0.3)
        assert worker._outbox.empty()
        worker.resume()
        assert worker.get().rows == [1]
    finally:
        worker.stop()


# ---------------------------------------------------------------------- the process worker's ends
def sleepy(seconds: float):
    def sample(policy, rows, state):
        time.sleep(seconds)
        return Rollout(rows), {"pid": os.getpid()}

    return sample


def test_a_killed_process_worker_fails_get_and_publish_in_one_line_without_a_hang():
    policy = versioned_policy()
    worker = ProcessRolloutWorker(sleepy(30), policy, poll_s=0.01)
    worker.start()
    worker.submit([1])
    time.sleep(0.2)
    os.kill(worker.pid, signal.SIGKILL)
    start = time.perf_counter()
    with pytest.raises(WorkerFailed, match=r"rollout worker .*pid \d+\) is not running: it died \(killed by SIGKILL\)"):
        worker.get()
    with pytest.raises(WorkerFailed, match="killed by SIGKILL"):
        worker._weights.acquire()  # as if it had died holding the weights' lock
        worker.publish(policy, 1)
    assert time.perf_counter() - start < 5
    worker.stop()
    assert not worker.alive


def test_a_process_worker_ignores_sigint_and_ends_after_its_rollout_on_sigterm():
    worker = ProcessRolloutWorker(sleepy(0.5), versioned_policy(), poll_s=0.01)
    worker.start()
    worker.submit(["a"])
    time.sleep(0.1)
    os.kill(worker.pid, signal.SIGINT)  # Ctrl-C reaches the process group: the trainer, not the worker, handles it
    time.sleep(0.1)
    assert worker.alive
    os.kill(worker.pid, signal.SIGTERM)  # mid-rollout: it finishes and delivers it, then ends
    assert worker.get().rows == ["a"]
    worker._process.join(5)
    assert not worker.alive and worker._process.exitcode == 0
    worker.stop()


def test_a_process_worker_ends_when_the_trainer_process_is_gone(tmp_path):
    """A trainer killed outright (no teardown) leaves no worker behind."""
    script = tmp_path / "trainer.py"
    script.write_text(
        "import os, sys, time, torch\n"
        "from lit_gspo.rl.collect.process_worker import ProcessRolloutWorker\n"
        "def sample(policy, rows, state):\n"
        "    return rows, {}\n"
        "w = ProcessRolloutWorker(sample, torch.nn.Linear(1, 1), poll_s=0.01)\n"
        "w.start()\n"
        "print(w.pid, flush=True)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True)
    pid = int(out.stdout.split()[0])
    deadline = time.time() + 10
    while time.time() < deadline and process_running(pid):
        time.sleep(0.05)
    assert not process_running(pid)


def process_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has ended (nobody reaped it yet)


def test_a_process_worker_draws_its_own_random_streams():
    """torch's, numpy's and python's: a forked child would otherwise draw what the trainer draws next (a reward or an
    environment drawing from numpy or python in the worker did, before)."""

    def draw(policy, rows, state):
        return Rollout(rows), {"draws": (float(torch.rand(())), float(np.random.rand()), random.random())}

    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    worker = ProcessRolloutWorker(draw, versioned_policy(), seed=123, poll_s=0.01)
    worker.start()
    try:
        worker.submit([1])
        theirs = worker.get().stats["draws"]
    finally:
        worker.stop()
    mine = (float(torch.rand(())), float(np.random.rand()), random.random())
    assert all(a != b for a, b in zip(theirs, mine))
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    assert theirs == (float(torch.rand(())), float(np.random.rand()), random.random())


# ---------------------------------------------------------------------- settings
def test_the_ratio_denominator_is_chosen_once_through_the_mismatch_layer():
    assert async_mismatch(Generation(), None) is None  # K = 0: untouched
    sampler = async_mismatch(Generation(max_staleness=1, async_old_logprobs="sampler"), None)
    assert sampler.sampler_is_old and not sampler.corrections
    proximal = async_mismatch(Generation(max_staleness=2), None)
    assert proximal.old_logprobs == "trainer" and [type(c) for c in proximal.corrections] == [TIS]
    mine = Mismatch(corrections=[TIS(cap=5.0)])
    assert async_mismatch(Generation(max_staleness=1), mine) is mine
    with pytest.raises(
        SettingsError, match="async_old_logprobs sampler needs --model.update.mismatch.old_logprobs sampler"
    ):
        async_mismatch(Generation(max_staleness=1, async_old_logprobs="sampler"), mine)
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        Generation(max_staleness=-1)
    with pytest.raises(ValueError, match="async_old_logprobs must be"):
        Generation(max_staleness=1, async_old_logprobs="behaviour")


def test_what_k_ge_1_does_not_support_is_refused_in_one_line():
    module = SimpleNamespace(
        generation=Generation(max_staleness=1),
        trainer=SimpleNamespace(world_size=2, strategy=ModelParallelStrategy()),
        collector=SimpleNamespace(engine=HFGenerate()),
    )
    with pytest.raises(SettingsError, match=r"max_staleness 1 under FSDP2 \(ModelParallelStrategy\)"):
        check_async(module)
    module.trainer.strategy = SimpleNamespace(root_device=torch.device("cpu"))  # DDP's, as far as this reads
    check_async(module)  # several processes: each rank has its own worker (tests/test_distributed.py)
    module.generation.dump_every_n_steps = 5
    with pytest.raises(SettingsError, match="generation.dump_every_n_steps 5"):
        check_async(module)
    module.generation.dump_every_n_steps = 0
    module.generation.async_worker_threads = 2  # auto on CPU: a forked process, which has one thread
    with pytest.raises(SettingsError, match="async_worker_threads 2 with --model.generation.async_worker process"):
        check_async(module)
    module.generation.async_worker = "thread"
    check_async(module)
    module.generation.async_worker, module.generation.async_worker_threads = "process", None
    module.trainer.strategy.root_device = torch.device("cuda", 0)
    with pytest.raises(SettingsError, match="async_worker process forks, and cuda cannot be used in a forked child"):
        check_async(module)
    module.generation.async_worker = "auto"  # a thread on an accelerator
    check_async(module)
    module.collector.engine = SimpleNamespace(lock=threading.Lock())  # cannot be copied, as a server's client
    with pytest.raises(SettingsError, match="its own copy of --model.engine"):
        check_async(module)


# ---------------------------------------------------------------------- fits
def test_k0_is_the_synchronous_run_bit_for_bit(tmp_path):
    """The settings present with K = 0 change nothing: the same metrics, the same weights, no worker."""
    runs = []
    for name, extra in (
        ("absent", []),
        (
            "present",
            [
                "--model.generation.max_staleness",
                "0",
                "--model.generation.async_old_logprobs",
                "sampler",
                "--model.generation.async_worker_threads",
                "1",
            ],
        ),
    ):
        cli = cli_main(tiny_args(tmp_path / name, "--seed_everything", "3", *extra), run=False)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        assert cli.model.async_rollouts is None and not workers_alive()
        rows = [
            {k: v for k, v in r.items() if k.startswith(("train/", "val/")) and v != ""}
            for r in read_metrics(tmp_path / name)
        ]
        runs.append((rows, {k: v.clone() for k, v in cli.model.policy.state_dict().items()}))
    assert runs[0][0] == runs[1][0] and len(column(runs[0][0], "train/reward")) == 3
    assert "train/staleness" not in {k for r in runs[0][0] for k in r}
    for k, v in runs[0][1].items():
        assert torch.equal(v, runs[1][1][k]), k


@pytest.mark.parametrize("worker", ["process", "thread"])
@pytest.mark.parametrize("old", ["sampler", "proximal"])
def test_k1_fit_logs_staleness_and_stops_its_worker(tmp_path, old, worker):
    cli = cli_main(
        tiny_args(
            tmp_path,
            "--trainer.max_steps",
            "4",
            "--model.generation.max_staleness",
            "1",
            "--model.generation.async_old_logprobs",
            old,
            "--model.generation.async_worker",
            worker,
            "--model.rewards",  # a signal on every step: k3 and clip_frac computed, the policy moved
            "[{class_path: fault_helpers.Alternating}]",
        ),
        run=False,
    )
    expected = GivenOldLogprobs if old == "sampler" else TrainerPassOverEveryRow
    assert isinstance(cli.model.learner.old_policy, expected) and cli.model.collector.engine_logprobs
    before = {k: v.clone() for k, v in cli.model.policy.state_dict().items()}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert not workers_alive() and cli.model.async_rollouts.pipeline is None
    rows = read_metrics(tmp_path)
    staleness = column(rows, "train/staleness")
    assert_k1_staleness(dict(enumerate(staleness)), 4, primed={0})
    assert column(rows, "train/async/dropped") == [0.0] * 4
    assert column(rows, "train/async/staleness_hist_1")[-1] == staleness.count(1.0) / 4
    for key, tagged in (("train/mismatch/k3", "k3"), ("train/clip_frac", "clip_frac")):  # the step's, by staleness
        steps = [r for r in rows if r.get("train/staleness")]
        assert all(r[key] == r[f"train/async/{tagged}_staleness{r['train/staleness'][0]}"] != "" for r in steps)
        assert all(float(r[key]) == float(r[key]) for r in steps), key  # finite: computed on every step
    assert column(rows, "train/async/clip_frac_staleness0")[0] == column(rows, "train/clip_frac")[0]
    assert len(column(rows, "val/reward")) == 3  # before, step 2, the end: validation on the trainer's policy
    assert any(not torch.equal(v, cli.model.policy.state_dict()[k]) for k, v in before.items())


class DrawsFromTorch(Callback):
    """The trainer's thread drawing from torch's default random stream at every step, as a user's callback may."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        torch.rand(3)


def test_a_thread_workers_samples_do_not_depend_on_the_trainers_draws(tmp_path):
    """The thread worker's engine draws from its own stream: a run whose trainer thread also draws from torch's default
    stream samples the same rollouts (before, what the worker drew depended on when the trainer's thread drew)."""
    logged = {}
    for name, callbacks in (("plain", []), ("drawing", ["--trainer.callbacks+=test_async_rollouts.DrawsFromTorch"])):
        root = tmp_path / name
        args = ["--trainer.max_steps", "3", "--model.generation.max_staleness", "1"]
        args += ["--model.generation.async_worker", "thread", *callbacks]
        cli = cli_main(tiny_args(root, *args), run=False)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        rows = [r for r in read_metrics(root) if r.get("train/staleness")]
        logged[name] = [{k: r[k] for k in ("train/staleness", "train/reward", "train/response_length")} for r in rows]
    staleness = [[r["train/staleness"] for r in rows] for rows in logged.values()]
    if staleness[0] != staleness[1]:  # the worker lost its race for the newest weights in one run only (a busy machine)
        pytest.skip(f"the runs trained on rollouts of different versions: staleness {staleness}")
    assert logged["plain"] == logged["drawing"]


class FailingEngine(HFGenerate):
    """Samples for validation (greedy), fails in the worker's second rollout."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def sample(self, policy, prompt_ids, **kwargs):
        if not kwargs.get("greedy"):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("engine fell over")
        return super().sample(policy, prompt_ids, **kwargs)


@pytest.mark.parametrize("worker", ["process", "thread"])
def test_a_failing_worker_stops_the_fit_in_one_line_without_a_hang(tmp_path, worker):
    cli = cli_main(
        tiny_args(
            tmp_path,
            "--model.generation.async_worker",
            worker,
            "--trainer.max_steps",
            "6",
            "--model.generation.max_staleness",
            "1",
            "--trainer.enable_checkpointing",
            "true",
            "--checkpoint_every_n_steps",
            "1",
        ),
        run=False,
    )
    cli.model.collector.engine = FailingEngine()
    start = time.perf_counter()
    with pytest.raises(WorkerFailed, match="the rollout worker .* failed: RuntimeError: engine fell over") as raised:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert "\n" not in str(raised.value) and time.perf_counter() - start < 60
    assert not workers_alive()
    last = tmp_path / "checkpoints" / "last.ckpt"  # the step before the failure, intact
    assert torch.load(last, weights_only=True)["global_step"] >= 1


def test_a_resume_regenerates_the_rollouts_in_flight(tmp_path):
    """In-flight rollouts are not checkpointed: the resumed fit primes its worker again (staleness 0 first)."""
    extra = [
        "--model.generation.max_staleness",
        "1",
        "--trainer.enable_checkpointing",
        "true",
        "--checkpoint_every_n_steps",
        "1",
    ]
    cli = cli_main(tiny_args(tmp_path, "--trainer.max_steps", "2", *extra), run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    cli = cli_main(tiny_args(tmp_path, "--trainer.max_steps", "4", *extra), run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path="last")
    assert cli.trainer.global_step == 4 and not workers_alive()
    assert_k1_staleness(staleness_by_step(tmp_path), 4, primed={0, 2})  # the resume primes again at step 2


@pytest.mark.parametrize("worker", ["process", "thread"])
def test_sigterm_with_k1_saves_the_finished_step_stops_the_worker_and_the_resume_goes_on(tmp_path, worker):
    """A stop signal mid-run under K = 1: the RL step finishes, its checkpoint is saved, the process exits 143, no
    rollout worker outlives the fit (in-flight rollouts are discarded), and the resume samples afresh (staleness 0)."""
    import signal

    from test_safe_ends import SendSignal

    extra = ["--model.generation.max_staleness", "1", "--trainer.enable_checkpointing", "true"]
    extra += ["--checkpoint_every_n_steps", "100", "--model.generation.async_worker", worker]
    cli = cli_main(tiny_args(tmp_path, "--trainer.max_steps", "4", *extra), run=False)
    cli.trainer.callbacks.append(SendSignal(1, signal.SIGTERM))
    with pytest.raises(SystemExit) as exit_info:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert exit_info.value.code == 143 and not workers_alive()
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["rl_step"] == 2 and checkpoint["global_step"] == 2  # RL step 1 finished, then saved
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)  # the handlers put back
    cli = cli_main(tiny_args(tmp_path, "--trainer.max_steps", "4", *extra), run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path="last")
    assert cli.trainer.global_step == 4 and not workers_alive()
    assert_k1_staleness(staleness_by_step(tmp_path), 4, primed={0, 2})  # the resume primes again at step 2


@pytest.mark.parametrize("config", ["multiturn/reversal_retry.yaml"])
def test_multi_turn_and_dynamic_sampling_run_in_the_worker(tmp_path, config):
    cli = cli_main(
        [
            "--config",
            str(ROOT / "configs" / config),
            "--trainer.max_steps",
            "3",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
            "--model.policy.warm_start.steps",
            "2",
            "--data.num_val",
            "8",
            "--data.num_train",
            "16",
            "--data.prompts_per_step",
            "4",
            "--model.generation.max_staleness",
            "1",
            "--model.generation.dynamic_sampling",
            "true",
            "--model.validation.every_n_steps",
            "0",
        ],
        run=False,
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    rows = [r for r in read_metrics(tmp_path) if r.get("train/staleness")]
    assert rows and all(1 <= float(r["train/turns"]) <= 3 for r in rows if r.get("train/turns"))
    assert all(float(r["train/sampling_rounds"]) >= 1 for r in rows) and not workers_alive()


def test_lora_runs_with_k1_publishing_the_adapters(tmp_path):
    cli = cli_main(
        tiny_args(
            tmp_path,
            "--model.policy.lora",
            "{r: 4, alpha: 8}",
            "--model.optimizer.lr",
            "0.01",
            "--model.generation.max_staleness",
            "1",
        ),
        run=False,
    )
    base = {k: v.clone() for k, v in cli.model.policy.state_dict().items() if "lora_" not in k}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    after = cli.model.policy.state_dict()
    assert all(torch.equal(base[k], after[k]) for k in base) and not workers_alive()
    assert_k1_staleness(dict(enumerate(column(read_metrics(tmp_path), "train/staleness"))), 3, primed={0})


def test_a_k1_quickstart_learns(tmp_path):
    """The quickstart (warm start included) with K = 1: val/reward after 20 RL steps above the one before."""
    cli = cli_main(
        [
            "--config",
            str(ROOT / "configs/quickstart.yaml"),
            "--trainer.max_steps",
            "20",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
            "--model.validation.every_n_steps",
            "0",
            "--seed_everything",
            "0",
            "--model.generation.max_staleness",
            "1",
        ],
        run=False,
    )
    cli.trainer.validate(cli.model, datamodule=cli.datamodule)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    val = column(read_metrics(tmp_path), "val/reward")
    assert len(val) >= 2 and val[-1] > val[0], val
