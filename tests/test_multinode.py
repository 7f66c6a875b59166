"""Several nodes on Lightning's own launcher: `--trainer.num_nodes 2` with plain env vars, torchrun or SLURM.

Two "nodes" × 1 process are two launches on this machine (node ranks 0 and 1, rendezvous on 127.0.0.1 and a
free port) sharing one ``default_root_dir``, as nodes share a file system. They must give the same bits as 2
processes on one node (``--trainer.devices 2 --trainer.strategy ddp``): the same global ranks, the same prompt
shards and the same gloo all-reduce over 2 ranks, so the final weights and every logged value are equal, not
close. A SLURM job is simulated by the variables ``srun`` sets for each task (no ``srun`` here).

Each launch's output goes to a file; a launch that fails (or a timeout) kills every launch's process group, so a
rank waiting in a collective for a dead peer cannot hang the test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "golden"))
from runs import logged_values, weights_hash  # noqa: E402

#: launcher variables a test must not inherit from the shell it runs in (a CI job under SLURM or torchrun)
LAUNCHER_VARS = (
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PL_GLOBAL_SEED",
)
TIMEOUT_S = 120


def fit_args(root: Path, *extra: str) -> list[str]:
    """3 RL steps of 2 prompts × 4 completions per process, validation at steps 0, 2, 3, a checkpoint at step 2.

    The format reward (first character 0-4) is non-zero for some completions from the first step on, so the
    advantages and the updates are not zero."""
    return [
        "fit",
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(root),
        "--trainer.accelerator",
        "cpu",
        "--trainer.max_steps",
        "3",
        "--trainer.enable_progress_bar",
        "false",
        "--model.policy.warm_start.steps",
        "0",
        "--model.validation.every_n_steps",
        "2",
        "--data.num_train",
        "64",
        "--data.num_val",
        "8",
        "--data.prompts_per_step",
        "2",
        "--model.generation.num_generations",
        "4",
        "--model.generation.max_new_tokens",
        "4",
        "--checkpoint_every_n_steps",
        "2",
        "--model.optimizer.lr",
        "0.01",
        "--model.rewards",
        '[{class_path: lit_gspo.rl.rewards.FormatReward, init_args: {pattern: "[0-4].*"}}]',
        *extra,
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))
    }
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def run_together(launches: list[tuple[list[str], dict]], logs: Path, timeout: float = TIMEOUT_S) -> list[str]:
    """Start every ``(argv, env)`` at once; wait for all to exit 0 and return their outputs.

    The first launch to fail, or the deadline, kills every launch's process group (torchrun's workers included)."""
    logs.mkdir(parents=True, exist_ok=True)
    files = [open(logs / f"launch{i}.log", "w+") for i in range(len(launches))]
    procs = [
        subprocess.Popen(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        for (argv, env), f in zip(launches, files)
    ]
    deadline, failure = time.monotonic() + timeout, None
    try:
        while failure is None and any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                failure = f"launch {failed[0]} exited with {procs[failed[0]].returncode}"
            elif time.monotonic() > deadline:
                failure = f"timed out after {timeout} s"
            time.sleep(0.2)
        if failure is None and any(p.returncode for p in procs):
            failure = "exit codes " + str([p.returncode for p in procs])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    outputs = []
    for f in files:
        f.seek(0)
        outputs.append(f.read())
        f.close()
    if failure:
        pytest.fail(f"{failure}:\n" + "\n".join(f"--- launch {i}:\n{out[-3000:]}" for i, out in enumerate(outputs)))
    return outputs


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "lit_gspo.tools.main", *args]


def two_node_launches(kind: str, root: Path) -> list[tuple[list[str], dict]]:
    """Node 0 and node 1 of a `num_nodes: 2`, `devices: 1` job, as ``kind`` starts them."""
    port, args = str(free_port()), fit_args(root, "--trainer.num_nodes", "2", "--trainer.devices", "1")
    if kind == "env":  # Lightning's own launcher (LightningEnvironment)
        return [
            (cli(*args), clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node))) for node in (0, 1)
        ]
    if kind == "torchrun":  # static rendezvous (TorchElasticEnvironment)
        return [
            (
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "1",
                    "--node-rank",
                    str(node),
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    port,
                    "-m",
                    "lit_gspo.tools.main",
                    *args,
                ],
                clean_env(),
            )
            for node in (0, 1)
        ]
    if kind == "slurm":  # what `srun` sets in each task of `sbatch --nodes 2 --ntasks-per-node 1` (SLURMEnvironment)
        return [
            (cli(*args), clean_env(**slurm_vars(task=node, node=node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
            for node in (0, 1)
        ]
    raise ValueError(kind)


def slurm_vars(task: int, node: int, local: int = 0, ntasks_per_node: int = 1, nodes: int = 2) -> dict[str, str]:
    return {
        "SLURM_NTASKS": str(nodes * ntasks_per_node),
        "SLURM_PROCID": str(task),
        "SLURM_LOCALID": str(local),
        "SLURM_NODEID": str(node),
        "SLURM_NTASKS_PER_NODE": str(ntasks_per_node),
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "lit_gspo",
        "SLURM_NODELIST": "node[0-1]",
    }


def summary(root: Path) -> dict:
    (metrics,) = root.glob("lightning_logs/*/metrics.csv")
    return {"weights": weights_hash(root / "hf_model"), "metrics": logged_values(metrics)}


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> dict:
    """The reference: 2 processes on one node (Lightning launches rank 1)."""
    root = tmp_path_factory.mktemp("one_node")
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    run_together(
        [(cli(*fit_args(root / "run", "--trainer.devices", "2", "--trainer.strategy", "ddp")), env)], root / "logs"
    )
    return summary(root / "run")


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["env", "torchrun", "slurm"])
def test_two_nodes_give_the_bits_of_two_processes_on_one_node(tmp_path, one_node, kind):
    run = tmp_path / "run"  # one default_root_dir for both nodes: a shared file system
    outputs = run_together(two_node_launches(kind, run), tmp_path / "logs")
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in outputs[0] and "GLOBAL_RANK: 1, MEMBER: 2/2" in outputs[1]
    ours = summary(run)
    assert len(ours["metrics"]) == 4 and any(
        float(v["train/grad_norm"]) > 0 for v in ours["metrics"].values() if "train/grad_norm" in v
    )
    assert ours == one_node
    # rank 0 alone wrote the run: one export, one metrics file, one checkpoint; the lock is released
    assert "saved the policy in Hugging Face format" in outputs[0]
    assert "saved the policy" not in outputs[1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt", "last.ckpt.sha256"]
    assert len(list(run.glob("lightning_logs/*"))) == 1


@pytest.mark.parametrize("kind", ["env", "torchrun", "slurm"])
def test_the_ranks_lightning_derives_for_node_1(tmp_path, monkeypatch, kind):
    """Which cluster environment and ranks Lightning gives our Trainer on node 1 of 2 (no training, no process group)."""
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment
    from lightning.fabric.utilities import rank_zero as fabric_rank_zero
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.utilities import rank_zero as pytorch_rank_zero
    from lightning_utilities.core import rank_zero as utilities_rank_zero

    from lit_gspo.tools.main import cli_main

    # the Trainer of "rank 1" sets the process-wide rank of rank_zero_only: put it back for the tests after this one
    for module in (utilities_rank_zero, fabric_rank_zero, pytorch_rank_zero):
        monkeypatch.setattr(module.rank_zero_only, "rank", getattr(module.rank_zero_only, "rank", 0))
    for key in list(os.environ):
        if key in LAUNCHER_VARS or key.startswith(("SLURM_", "TORCHELASTIC_")):
            monkeypatch.delenv(key)
    variables = {
        "env": {"NODE_RANK": "1"},
        "torchrun": {
            "TORCHELASTIC_RUN_ID": "none",
            "GROUP_RANK": "1",
            "RANK": "1",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
        },
        "slurm": slurm_vars(task=1, node=1),
    }[kind]
    for key, value in {**variables, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}.items():
        monkeypatch.setenv(key, value)
    trainer = cli_main(fit_args(tmp_path, "--trainer.num_nodes", "2", "--trainer.devices", "1")[1:], run=False).trainer
    expected = {"env": LightningEnvironment, "torchrun": TorchElasticEnvironment, "slurm": SLURMEnvironment}[kind]
    assert type(trainer.strategy) is DDPStrategy  # num_nodes > 1 makes "auto" DDP
    assert type(trainer.strategy.cluster_environment) is expected
    assert (trainer.num_nodes, trainer.node_rank, trainer.local_rank, trainer.global_rank, trainer.world_size) == (
        2,
        1,
        0,
        1,
        2,
    )
    assert not trainer.is_global_zero


def test_a_slurm_job_whose_tasks_per_node_disagree_with_devices_fails_at_launch(tmp_path):
    """Lightning's SLURMEnvironment checks `--ntasks-per-node` against `devices` when fit launches, before any
    rendezvous: a mismatched job ends at once with a hint instead of waiting for ranks that never come."""
    env = clean_env(
        **slurm_vars(task=0, node=0, ntasks_per_node=2), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    proc = subprocess.run(
        cli(*fit_args(tmp_path, "--trainer.num_nodes", "2", "--trainer.devices", "1")),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert (
        "You set `devices=1` in Lightning, but the number of tasks per node configured in SLURM "
        "`--ntasks-per-node=2` does not match. HINT: Set `devices=2`." in proc.stderr
    ), proc.stderr[-3000:]
    assert not (tmp_path / "hf_model").exists()


RESUME_CHECK = textwrap.dedent("""
    import os, sys, torch.distributed as dist
    from lit_gspo.runtime.collectives import check_ranks_resume_alike
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2)
    path, step = (sys.argv[1] or None), int(sys.argv[2])
    try:
        check_ranks_resume_alike(path, step, f"/data/node{os.environ['RANK']}")
        print("agreed")
    except RuntimeError as err:
        print(err)
    dist.destroy_process_group()
""")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "node1, agreed",
    [(("", "0"), False), (("/shared/run/checkpoints/last.ckpt", "3"), True), (("/other/last.ckpt", "1"), False)],
    ids=["no_ckpt", "same", "other_step"],
)
def test_ranks_that_resume_from_different_states_fail_on_every_rank(tmp_path, node1, agreed):
    """Node 0 resumed at step 3; node 1 found no checkpoint (its own default_root_dir), the same, or another step.

    Before: no check; with `--ckpt_path last` and a default_root_dir per node, node 1 started at step 0 while node 0
    continued at step 3, and both hung in mismatched collectives (until gloo's 30 min timeout)."""
    port = str(free_port())
    launches = [
        (
            [sys.executable, "-c", RESUME_CHECK, *args],
            clean_env(RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
        )
        for rank, args in enumerate([("/shared/run/checkpoints/last.ckpt", "3"), node1])
    ]
    outputs = run_together(launches, tmp_path, timeout=60)
    for out in outputs:
        if agreed:
            assert "agreed" in out
        else:
            assert "the ranks did not resume from the same checkpoint" in out, out
            assert "rank 0 on" in out and "resumed from /shared/run/checkpoints/last.ckpt at step 3" in out
            assert (
                "found no checkpoint (default_root_dir /data/node1), starts at step 0" in out
                if not node1[0]
                else "resumed from /other/last.ckpt at step 1" in out
            )
