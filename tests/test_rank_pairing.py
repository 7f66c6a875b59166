"""Two processes (gloo) whose rows need different numbers of passes learn what one process learns from all the rows.

DDP reduces gradients at every backward and FSDP2 gathers parameters at every forward, so a rank that ran fewer
micro-batches than the other left it waiting: a fit hung (seen with DAPO's dynamic sampling keeping no group on one
rank, and with ``skip_zero_advantage_rows`` skipping more rows on one rank; a token budget sized from each rank's free
GPU memory does the same). Each case here gives the two ranks rows that need different numbers of passes and compares
the weights after ``learn`` with one process learning all the rows. The batch-wide statistics of the advantage
estimators (BatchNormalized's std, GDPO's and GAE's whitening) are likewise those of all the rows, not of each rank's.

The ranks are this file run as a script (``python tests/test_rank_pairing.py RANK PORT OUT``).
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
G = 3
REWARDS = [0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]  # rank 0: rows 0-5 (its first group flat)
HALVES = (torch.arange(0, 6), torch.arange(6, 12))
#: an adaptive entropy bonus whose c grows after each step (H* above any entropy)
BONUS = {"entropy_coef": 0.2, "entropy_target": 100.0}
QUANTILE = {"top_entropy_quantile": 0.3, "micro_batch_size": None}
ROUTER_AUX = 0.05
#: case → (rank 0's rows, rank 1's rows, rank 0's update settings, rank 1's); None: a rank whose sampling kept nothing
CASES = {
    "skipped rows": (HALVES[0], HALVES[1], {}, {}),  # rank 0: 3 rows with a gradient (1 micro-batch), rank 1: 6 (2)
    "no rows": (None, HALVES[1], {}, {}),  # dynamic sampling kept no group on rank 0
    "other budgets": (HALVES[0], HALVES[1], {"micro_batch_size": 1}, {}),  # rank 0: 3 micro-batches, rank 1: 2
    # every row runs (the bonus' gradient); N and H̄ over both ranks; the second epoch applies the adapted c
    "entropy bonus": (HALVES[0], HALVES[1], BONUS, BONUS),
    # the quantile over both ranks' tokens of the micro-batch (one each: the whole minibatch's rows)
    "top entropy quantile": (HALVES[0], HALVES[1], QUANTILE, QUANTILE),
}
#: rank 0: 3 micro-batches, rank 1: 1 and 2 fillers, which join rank 0's gathers of the entropies
QUANTILE_FILLERS = ({**QUANTILE, "micro_batch_size": 1}, QUANTILE)
STRATEGIES = ("ddp", "fsdp2")


def moe_learner(**settings):
    """A tiny MoE policy's learner that records the old pass's experts and measures how the update moved them."""
    from test_learner import MAX_NEW

    from lit_gspo.models import load_policy
    from lit_gspo.rl.learn.learner import Learner
    from lit_gspo.rl.objectives import GSPO

    policy, _ = load_policy("tiny-qwen3-moe", seed=0)
    return Learner(policy, GSPO(), update_settings(**settings), max_len=MAX_NEW, group_size=G, record_routing=True)


def update_settings(**overrides):
    from lit_gspo.rl.config import Update

    return Update(**{"epochs": 2, "micro_batch_size": 3, **overrides})


def rollout_of(learner, rollout, rows):
    """``rollout``'s ``rows`` with REWARDS, snapshotted and with group advantages (a rowless rollout for None)."""
    from test_learner import with_rewards

    from lit_gspo.rl.rollout import RolloutBatch

    if rows is None:
        empty = RolloutBatch.without_rows()
        learner.snapshot(empty)
        empty.advantages = torch.zeros(0)
        return empty
    return with_rewards(learner, rollout.select(rows), [REWARDS[i] for i in rows])


def full_weights(policy) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in policy.state_dict().items()
    }


def learn(learner, rollout, backward=None, world_size: int = 1, gradient_sync_blocked=None) -> dict[str, float]:
    torch.manual_seed(1)
    optimizer = torch.optim.SGD(learner.policy.parameters(), lr=0.5)
    return learner.learn(
        rollout, optimizer, backward=backward, world_size=world_size, gradient_sync_blocked=gradient_sync_blocked
    )


def with_estimator_inputs(rollout):
    """``rollout`` with REWARDS, GDPO's normalised sum (here 3R − 1) and a critic's values (a ramp over the rows)."""
    rollout.rewards = torch.tensor(REWARDS)
    rollout.decoupled_rewards = rollout.rewards * 3 - 1
    n, T = rollout.completion_mask.shape
    rollout.old_values = torch.linspace(-1, 1, n * T).view(n, T)
    return rollout


def estimator_outputs(rollout) -> dict[str, torch.Tensor]:
    """BatchNormalized's, GDPO's and GAE's advantages of ``rollout``."""
    from lit_gspo.rl.advantages import GAE, GDPO, BatchNormalized

    return {"batch": BatchNormalized()(rollout, G), "gdpo": GDPO()(rollout, G), "gae": GAE()(rollout, G)}


def rank_main(rank: int, port: int, out: Path) -> None:
    import torch.distributed as dist
    from dist_run import count_syncs_hook
    from test_learner import make_learner, sample_rollout
    from torch.distributed.device_mesh import init_device_mesh

    from lit_gspo.runtime.sharding import shard_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    rollout = with_estimator_inputs(sample_rollout(make_learner(update_settings()).policy))
    results["estimators"] = estimator_outputs(rollout.select(HALVES[rank]))
    cases = {**CASES, "quantile fillers": (*HALVES, *QUANTILE_FILLERS)}
    for strategy in STRATEGIES:
        for case, (*rows, settings0, settings1) in cases.items():
            learner = make_learner(update_settings(**(settings0, settings1)[rank]))
            backward, no_sync, syncs = None, None, []
            if strategy == "ddp":  # as Lightning's manual_backward and block_backward_sync
                ddp = torch.nn.parallel.DistributedDataParallel(learner.policy)
                ddp.register_comm_hook(None, count_syncs_hook(syncs))
                no_sync = ddp.no_sync

                def backward(loss, ddp=ddp):
                    if ddp.require_backward_grad_sync:
                        ddp.reducer.prepare_for_backward([])
                    loss.backward()

            else:
                shard_model(learner.policy, init_device_mesh("cpu", (2,)))
            metrics = learn(
                learner, rollout_of(learner, rollout, rows[rank]), backward, world_size=2, gradient_sync_blocked=no_sync
            )
            results[strategy, case] = full_weights(learner.policy)
            results[strategy, case, "metrics"] = metrics
            results[strategy, case, "syncs"] = len(syncs)
    # under FSDP2 the routing measure after the update is a pass too: rank 0 (no rows) runs it with rank 1
    learner = moe_learner()
    shard_model(learner.policy, init_device_mesh("cpu", (2,)))
    metrics = learn(learner, rollout_of(learner, rollout, (None, HALVES[1])[rank]), world_size=2)
    results["moe"] = full_weights(learner.policy), metrics
    learner = moe_learner()  # both ranks with rows: the measures are means over both ranks' tokens
    shard_model(learner.policy, init_device_mesh("cpu", (2,)))
    results["moe both"] = learn(learner, rollout_of(learner, rollout, HALVES[rank]), world_size=2)
    learner = moe_learner(router_aux_loss_coef=ROUTER_AUX)  # each rank's router loss weighted by its global share
    shard_model(learner.policy, init_device_mesh("cpu", (2,)))
    learn(learner, rollout_of(learner, rollout, HALVES[rank]), world_size=2)
    results["moe router loss"] = full_weights(learner.policy)
    torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("rank_pairing")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(HERE)}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        logs = [proc.communicate(timeout=240)[0] for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail("the ranks did not finish in 240 s: a pass of one rank left the other waiting")
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log[-4000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def one_process(case: str, with_metrics: bool = False):
    """The weights (and the metrics) of one process learning both ranks' rows."""
    from test_learner import make_learner, sample_rollout

    rows0, rows1, settings0, settings1 = CASES[case]
    rollout = sample_rollout(make_learner(update_settings()).policy)
    learner = make_learner(update_settings(**{k: v for k, v in settings0.items() if settings1.get(k) == v}))
    rows = rows1 if rows0 is None else torch.cat([rows0, rows1])
    metrics = learn(learner, rollout_of(learner, rollout, rows))
    return (full_weights(learner.policy), metrics) if with_metrics else full_weights(learner.policy)


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_ratio_diagnostics_are_over_every_ranks_sequences(ranks, strategy):
    """2 epochs: the second's ratios move. ``ratio/*`` (stds, max |.|, correlations, variances by position) of two ranks
    are one process's over all the rows, not each rank's own (whose mean over ranks, the absmax's included, is not)."""
    _, expected = one_process("skipped rows", with_metrics=True)
    ratio_keys = [k for k in expected if k.startswith("ratio/")]
    assert ratio_keys and any(math.isfinite(expected[k]) and expected[k] != 0 for k in ratio_keys)
    for rank in (0, 1):
        got = ranks[rank][strategy, "skipped rows", "metrics"]
        for key in ratio_keys:
            assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-7, nan_ok=True), (rank, key)


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_with_unequal_passes_learn_what_one_process_learns_from_all_their_rows(ranks, strategy, case):
    expected = one_process(case)
    start = make_learner_weights()
    assert any(not torch.equal(expected[k], start[k]) for k in start)  # the update moved the weights
    if strategy == "ddp":  # 2 epochs of one minibatch: 2 optimiser steps, each reducing the gradients once
        assert ranks[0][strategy, case, "syncs"] == ranks[1][strategy, case, "syncs"] == 2
    for rank in (0, 1):
        got = ranks[rank][strategy, case]
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=0, msg=f"rank {rank}: {name}")


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_rank_with_fewer_micro_batches_joins_the_others_entropy_quantiles(ranks, strategy):
    """top_entropy_quantile with rank 0 in 3 micro-batches and rank 1 in 1: rank 1's fillers gather with rank 0's
    micro-batches (without them gloo raises, NCCL waits), and both ranks hold the same moved weights."""
    start = make_learner_weights()
    weights = [ranks[rank][strategy, "quantile fillers"] for rank in (0, 1)]
    assert any(not torch.equal(weights[0][k], start[k]) for k in start)
    for name in start:
        torch.testing.assert_close(weights[1][name], weights[0][name], atol=1e-6, rtol=0, msg=name)


def make_learner_weights() -> dict[str, torch.Tensor]:
    return full_weights(make_learner_weights_policy())


def make_learner_weights_policy():
    """The dense policy the rollouts are sampled from (as every process builds it: seed 0)."""
    from test_learner import make_learner

    return make_learner(update_settings()).policy


@pytest.mark.distributed
def test_under_fsdp2_a_rank_without_rows_measures_the_moe_routing_alongside_the_other(ranks):
    """The routing measure after an update is a forward over the rollout; a rank without rows used to skip it."""
    from test_learner import sample_rollout

    learner = moe_learner()
    rollout = sample_rollout(make_learner_weights_policy())
    metrics = learn(learner, rollout_of(learner, rollout, HALVES[1]))
    expected = full_weights(learner.policy)
    (weights0, metrics0), (weights1, metrics1) = ranks[0]["moe"], ranks[1]["moe"]
    for name in expected:
        torch.testing.assert_close(weights0[name], expected[name], atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(weights1[name], expected[name], atol=1e-5, rtol=0, msg=name)
    assert 0 < metrics["routing/rerouted_tokens"] and metrics1["routing_volatility"] == pytest.approx(
        metrics["routing_volatility"]
    )
    assert math.isnan(metrics0["routing_volatility"])  # rank 0 had no rows to measure


@pytest.mark.distributed
def test_the_moe_routing_measures_of_two_ranks_reduce_to_one_processs_over_all_rows(ranks):
    """The step's routing_volatility, rerouted_tokens and abs_logratio_* are means over every rank's tokens (the step log
    merges the ranks' by their token weights), not the mean of the ranks' means."""
    from test_learner import sample_rollout

    from lit_gspo.runtime.sample_stats import merge_stats, without_weights

    learner = moe_learner()
    rollout = sample_rollout(make_learner_weights_policy())
    expected = without_weights(learn(learner, rollout_of(learner, rollout, torch.cat(HALVES))))
    merged = without_weights(merge_stats([ranks[0]["moe both"], ranks[1]["moe both"]]))
    keys = [
        "routing_volatility",
        "routing/rerouted_tokens",
        "routing/abs_logratio_rerouted",
        "routing/abs_logratio_kept",
    ]
    assert all(math.isfinite(expected[k]) for k in keys) and expected["routing/rerouted_tokens"] > 0
    for key in keys:
        assert merged[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-7), key


@pytest.mark.distributed
def test_under_fsdp2_the_router_loss_of_two_ranks_is_one_processs(ranks):
    """update.router_aux_loss_coef: each micro-batch's load-balancing loss weighted by its share of the minibatch's
    tokens over both ranks; here the ranks' micro-batches are one process's (3 rows each, every row runs)."""
    from test_learner import sample_rollout

    learner = moe_learner(router_aux_loss_coef=ROUTER_AUX)
    rollout = sample_rollout(make_learner_weights_policy())
    learn(learner, rollout_of(learner, rollout, torch.cat(HALVES)))
    expected = full_weights(learner.policy)
    without = moe_learner()
    learn(without, rollout_of(without, rollout, torch.cat(HALVES)))
    assert any((full_weights(without.policy)[k] - expected[k]).abs().max() > 1e-4 for k in expected)  # it acts
    for rank in (0, 1):
        for name in expected:
            got = ranks[rank]["moe router loss"][name]
            torch.testing.assert_close(got, expected[name], atol=1e-5, rtol=0, msg=f"rank {rank}: {name}")


@pytest.mark.distributed
def test_batch_wide_advantage_statistics_are_over_every_ranks_rows(ranks):
    from test_learner import make_learner, sample_rollout

    rollout = with_estimator_inputs(sample_rollout(make_learner(update_settings()).policy))
    whole = estimator_outputs(rollout)
    alone = [estimator_outputs(rollout.select(half)) for half in HALVES]  # each rank's rows on their own
    for name, expected in whole.items():
        got = torch.cat([ranks[0]["estimators"][name], ranks[1]["estimators"][name]])
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6, msg=name)
        assert not torch.allclose(torch.cat([alone[0][name], alone[1][name]]), expected, atol=1e-3), name


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
