"""The update reads the device on the host only where it must: between a micro-batch's forward and its backward, once
(the objective's check of its inputs). On a GPU every ``float(tensor)``, ``bool(tensor)`` or size of a masked
selection waits for the device to finish what is queued, and a wait there leaves the device idle while the host
launches the backward. The metrics are read together at the end, value for value what ``float`` gives."""

import math
import sys
from pathlib import Path

import pytest
import torch
from test_learner import G, learn, make_learner, sample_rollout, with_rewards

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
sys.path.insert(0, BENCHMARKS)
from host_reads import Timeline, main, reads_between_forward_and_backward  # noqa: E402

sys.path.remove(BENCHMARKS)

from lit_gspo.rl.config import Update
from lit_gspo.rl.learn.hooks import UpdateHook
from lit_gspo.rl.learn.host_reads import host_floats, records_on_host
from lit_gspo.rl.objectives import GRPO, GSPO, OBJECTIVES, Counts

#: objectives whose algorithm sizes a selection by the micro-batch's data, read on the host: the share of its tokens with
#: the largest covariance (KL-Cov: their count), or a random draw among the tokens in a covariance band (Clip-Cov: their
#: count and the candidates' indices)
SELECTIONS = {"kl_cov": 1, "clip_cov": 2}


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@pytest.mark.parametrize("align", [False, True])
def test_a_micro_step_reads_the_device_once_between_its_forward_and_its_backward(name, align):
    """Every registered objective: its input check, and the reads its own selection needs (``SELECTIONS``)."""
    learner = make_learner(
        Update(num_minibatches=2, micro_batch_size=2, align_rows=align, skip_zero_advantage_rows=False),
        OBJECTIVES[name](),
    )
    rollout = with_rewards(learner, sample_rollout(learner.policy), [0.1 * i for i in range(4 * G)])
    timeline = Timeline()
    learner.policy.register_forward_hook(lambda *_: timeline.events.append("forward"))
    opt = torch.optim.AdamW(learner.policy.parameters(), lr=1e-3)

    def backward(loss):
        timeline.events.append("backward")
        loss.backward()

    with timeline:
        metrics = learner.learn(rollout, opt, backward=backward)
    counts = reads_between_forward_and_backward(timeline.events)
    assert len(counts) == 6  # 2 minibatches of 6 rows, 3 micro-batches each
    assert counts == [1 + SELECTIONS.get(name, 0)] * 6  # the objective's finiteness check of its inputs (+ its own)
    assert {"clip_frac", "entropy", "ratio_mean", "loss"} <= set(metrics)


def test_an_objective_given_its_counts_reads_the_device_once_and_still_names_a_non_finite_input():
    logprobs = -torch.rand(3, 4)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2] = False  # an empty row: the ratio statistics are over the others
    counts = Counts(tokens=8.0, seqs=3.0, max_len=4.0)  # (the learner's, summed over the minibatch on the host)
    reads = Timeline()
    with reads:
        out = GSPO()(logprobs, logprobs - 0.1, torch.tensor([1.0, -1.0, 0.5]), mask, counts=counts)
    assert len(reads.events) == 1
    assert float(out.metrics["ratio_min"]) == pytest.approx(math.exp(0.1), rel=1e-6)
    bad = logprobs.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"old_logprobs has 1 non-finite value\(s\) inside the mask.*\(1, 2\)"):
        GRPO()(logprobs, bad, torch.ones(3), mask)
    empty = GSPO()(logprobs, logprobs, torch.ones(3), torch.zeros(3, 4, dtype=torch.bool))
    assert [float(empty.metrics[k]) for k in ("ratio_mean", "ratio_min", "ratio_max")] == [1.0, 1.0, 1.0]


def test_host_floats_are_what_float_gives_in_order():
    values = [
        torch.tensor(1 / 3),
        2.5,
        torch.tensor(1 / 7, dtype=torch.float64),
        torch.tensor(0.1, dtype=torch.bfloat16),
        torch.tensor(True),
        torch.tensor(12345, dtype=torch.long),
        torch.tensor([float("nan")]),
        3,  # a hook's int: a float, as float() makes it
    ]
    read = host_floats(values)
    expected = [float(v) for v in values]
    assert read[:-2] == expected[:-2] and read[-1] == 3.0 and all(type(x) is float for x in read)
    assert math.isnan(read[-2])
    records = [({"a": torch.tensor(0.25), "b": lambda: torch.tensor([1.0, 2.0]).mean()}, 3.0), ({"c": 4.0}, 1.0)]
    assert records_on_host(records) == [({"a": 0.25, "b": 1.5}, 3.0), ({"c": 4.0}, 1.0)]


def test_the_update_with_its_metrics_read_at_the_end_is_the_one_that_read_them_at_once():
    """The same rollout, two learners: metrics and parameters agree exactly with per-micro-batch reads (forced by a
    hook that reads every metric as it is made) and without."""

    class ReadEveryMetric(UpdateHook):
        def after_backward(self, update, minibatch):
            for metrics, _ in update.records:
                for key, value in list(metrics.items()):
                    metrics[key] = float(value() if callable(value) else value)

    update = Update(num_minibatches=2, micro_batch_size=2)
    results = []
    for read_at_once in (False, True):
        learner = make_learner(update)
        if read_at_once:
            learner.hooks.hooks.append(ReadEveryMetric())
        rollout = with_rewards(learner, sample_rollout(learner.policy), [0.1 * i for i in range(4 * G)])
        metrics = learn(learner, rollout)
        results.append((metrics, [p.detach().clone() for p in learner.policy.parameters()]))
    (deferred, params), (at_once, params_at_once) = results
    assert deferred.keys() == at_once.keys()
    for key in deferred:
        assert deferred[key] == at_once[key] or (math.isnan(deferred[key]) and math.isnan(at_once[key])), key
    assert all(torch.equal(a, b) for a, b in zip(params, params_at_once))


def test_the_benchmark_counts_one_read_between_each_forward_and_its_backward(capsys):
    main(
        [
            "--rows",
            "16",
            "--prompt",
            "8",
            "--completion",
            "12",
            "--group",
            "4",
            "--layers",
            "1",
            "--micro-batch-size",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert "between each micro-step's forward and its backward: [1, 1, 1, 1]" in out  # 2 minibatches × 2 micro-batches
