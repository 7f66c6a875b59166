"""Rollout-mismatch correction (lit_gspo/rl/learn/mismatch.py): hand-computed weights and masks, no change when the sampler is
the trainer, split-invariance, the sampler's log-probs as π_old, config errors, and a CLI fit with it on."""

import copy
import csv
import math
from pathlib import Path

import pytest
import torch
from test_learner import MAX_NEW, G, learn, make_learner, sample_rollout, with_rewards

from lit_gspo.rl.config import Update
from lit_gspo.rl.learn.learner import Learner
from lit_gspo.rl.learn.mismatch import MIS, OPSM, TIS, Mismatch, SequenceMIS, SequenceTIS, mismatch_metrics
from lit_gspo.rl.objectives import CISPO, DAPO, GMPO, GRPO, GSPO, SAPO, GSPOToken
from lit_gspo.rl.rollout import RolloutBatch

ROOT = Path(__file__).resolve().parents[1]
REWARDS = [0.0, 1.0, 3.0] * 4  # every group has a signal
ALL = (TIS, SequenceTIS, MIS, SequenceMIS, OPSM)
log = math.log


def hand_batch(delta: list[list[float]], mask: list[list[int]], advantages: list[float]) -> RolloutBatch:
    """A rollout whose trainer log-probs are −1 and whose sampler's are −1 − δ (so log π_old − log π_sampler = δ)."""
    mask = torch.tensor(mask, dtype=torch.bool)
    old = torch.full(mask.shape, -1.0)
    n, t = mask.shape
    return RolloutBatch(
        input_ids=torch.zeros(n, 1 + t, dtype=torch.long),
        attention_mask=torch.ones(n, 1 + t, dtype=torch.long),
        prompt_length=1,
        completion_mask=mask,
        old_logprobs=old,
        engine_logprobs=torch.where(mask, old - torch.tensor(delta), torch.zeros(())),
        advantages=torch.tensor(advantages),
    )


# ------------------------------------------------------------------ hand examples
def test_tis_truncates_the_ratio_at_c_and_folds_it_into_the_advantage():
    batch = hand_batch([[log(4), 0.0, log(0.25)], [log(1.5), 0.0, 0.0]], [[1, 1, 1], [1, 1, 0]], [2.0, -1.0])
    out, emptied, records = Mismatch([TIS(cap=2.0)]).before_update(batch)
    expected = torch.tensor([[2 * 2.0, 2 * 1.0, 2 * 0.25], [-1.5, -1.0, -1.0]])
    torch.testing.assert_close(out.advantages[out.completion_mask], expected[out.completion_mask])
    assert torch.equal(out.completion_mask, batch.completion_mask) and not emptied.any()
    metrics = records[0][0]
    assert metrics["mismatch/truncated_token_frac"] == pytest.approx(1 / 5)
    assert metrics["mismatch/masked_token_frac"] == 0
    k3 = [4 - log(4) - 1, 0, 0.25 - log(0.25) - 1, 1.5 - log(1.5) - 1, 0]  # r − log r − 1, r = π_old/π_sampler
    assert metrics["mismatch/k3"] == pytest.approx(sum(k3) / 5, rel=1e-5)
    assert metrics["mismatch/log_ratio_abs_max"] == pytest.approx(log(4), rel=1e-6)
    assert metrics["mismatch/log_ratio_abs_mean"] == pytest.approx((2 * log(4) + log(1.5)) / 5, rel=1e-6)
    assert batch.advantages.shape == (2,)  # the caller's rollout is untouched


def test_mis_masks_tokens_outside_the_band_and_keeps_its_bounds():
    ratios = [0.4, 0.5, 1.0, 5.0, 6.0]
    batch = hand_batch([[log(r) for r in ratios]], [[1] * 5], [1.0])
    out, _, records = Mismatch([MIS(low=0.5, high=5.0)]).before_update(batch)
    assert out.completion_mask.tolist() == [[False, True, True, True, False]]
    assert torch.equal(out.advantages, batch.advantages)  # masks only
    assert records[0][0]["mismatch/masked_token_frac"] == pytest.approx(2 / 5)


def test_sequence_mis_masks_whole_sequences_by_their_product_or_geometric_ratio():
    delta = [[log(2), log(2), 0.0], [log(2), log(1.2), 0.0], [log(5), 0.0, 0.0]]
    batch = hand_batch(delta, [[1, 1, 0], [1, 1, 0], [1, 0, 0]], [1.0, -1.0, 1.0])
    out, emptied, records = Mismatch([SequenceMIS(cap=3.0)]).before_update(batch)  # products 4, 2.4, 5
    assert emptied.tolist() == [True, False, True]
    assert out.completion_mask.tolist() == [[False] * 3, [True, True, False], [False] * 3]
    assert records[1][0]["mismatch/masked_seq_frac"] == pytest.approx(2 / 3) and records[1][1] == 3
    out, emptied, _ = Mismatch([SequenceMIS(cap=3.0, ratio="geometric")]).before_update(batch)  # 2, √2.4, 5
    assert emptied.tolist() == [False, False, True]
    _, emptied, _ = Mismatch([SequenceMIS(cap=3.0, low=2.2)]).before_update(batch)  # 4 > 3, 2.4 kept, 5 > 3
    assert emptied.tolist() == [True, False, True]


def test_tis_with_a_lower_bound_raises_small_ratios_to_it_as_trls_token_truncate():
    batch = hand_batch([[log(4), log(0.25), log(0.8)]], [[1, 1, 1]], [1.0])
    out, _, records = Mismatch([TIS(cap=2.0, low=0.5)]).before_update(batch)
    torch.testing.assert_close(out.advantages, torch.tensor([[2.0, 0.5, 0.8]]))
    assert records[0][0]["mismatch/truncated_token_frac"] == pytest.approx(2 / 3)  # 4 and 0.25: not their ratio


def test_sequence_tis_weighs_each_sequence_by_its_truncated_ratio_as_trls_sequence_truncate():
    """TRL's vllm_importance_sampling_mode: sequence_truncate: Â_{i,t} ← clamp(ρ_i, clip_min, clip_max) · Â_{i,t}."""
    delta = [[log(2), log(2), 0.0], [log(2), log(0.6), 0.0], [log(0.1), 0.0, 0.0]]
    batch = hand_batch(delta, [[1, 1, 0], [1, 1, 0], [1, 0, 0]], [1.0, -1.0, 2.0])  # products 4, 1.2, 0.1
    out, emptied, records = Mismatch([SequenceTIS(cap=3.0, low=0.2)]).before_update(batch)
    kept = out.completion_mask
    assert torch.equal(kept, batch.completion_mask) and not emptied.any()
    torch.testing.assert_close(out.advantages[kept], torch.tensor([3.0, 3.0, -1.2, -1.2, 0.4]))
    assert records[0][0]["mismatch/truncated_token_frac"] == pytest.approx(3 / 5)  # sequences 1 and 3's tokens
    assert records[0][0]["mismatch/masked_token_frac"] == 0
    geometric, _, _ = Mismatch([SequenceTIS(cap=3.0, ratio="geometric")]).before_update(batch)  # 2, √1.2, 0.1
    torch.testing.assert_close(geometric.advantages[kept], torch.tensor([2.0, 2.0, -(1.2**0.5), -(1.2**0.5), 0.2]))


def test_a_weighted_mis_weights_the_band_by_its_ratio_and_the_rest_by_zero_in_the_normalisers():
    """Yao et al.'s MIS, TRL's token_mask: Â_t ← ρ_t · 1[low ≤ ρ_t ≤ high] · Â_t, the mask unchanged."""
    ratios = [0.4, 0.5, 1.0, 5.0, 6.0]
    batch = hand_batch([[log(r) for r in ratios]], [[1] * 5], [2.0])
    out, emptied, records = Mismatch([MIS(low=0.5, high=5.0, weighted=True)]).before_update(batch)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.0, 1.0, 2.0, 10.0, 0.0]]))
    assert torch.equal(out.completion_mask, batch.completion_mask) and not emptied.any()
    assert records[0][0]["mismatch/masked_token_frac"] == pytest.approx(2 / 5)
    assert records[0][0]["mismatch/truncated_token_frac"] == 0


def test_a_weighted_sequence_mis_is_trls_sequence_mask():
    """TRL's default vllm_importance_sampling_mode: sequence i weighted by ρ_i = e^(Σ_t δ_t) where ρ_i ≤ 3, else 0."""
    delta = [[log(2), log(2), 0.0], [log(2), log(1.2), 0.0], [log(5), 0.0, 0.0]]
    batch = hand_batch(delta, [[1, 1, 0], [1, 1, 0], [1, 0, 0]], [1.0, -1.0, 1.0])  # products 4, 2.4, 5
    out, emptied, records = Mismatch([SequenceMIS(cap=3.0, weighted=True)]).before_update(batch)
    kept = out.completion_mask
    assert torch.equal(kept, batch.completion_mask) and not emptied.any()
    torch.testing.assert_close(out.advantages[kept], torch.tensor([0.0, 0.0, -2.4, -2.4, 0.0]))
    assert records[0][0]["mismatch/masked_token_frac"] == pytest.approx(3 / 5)


def test_a_weighted_sequence_mis_update_has_trls_grpo_loss():
    """On-policy GRPO (seq-mean-token-mean, ratio 1): TRL's loss ((−Â_i ρ_i 1[ρ_i ≤ C]) · m).sum(-1) / |y_i|, mean over
    every row = −(1/N) Σ_i ρ_i 1[ρ_i ≤ C] Â_i, the masked rows counted."""
    base = make_learner(Update(), GRPO())
    rollout = mismatched_rollout(base, noise=0.3)
    for k in (2, 7):  # sequences SequenceMIS weighs 0
        rollout.engine_logprobs[k] -= 2.0 * rollout.completion_mask[k]
    learner = learner_with(Update(), GRPO(), Mismatch([SequenceMIS(cap=3.0, weighted=True)]))
    learner.policy.load_state_dict(base.policy.state_dict())
    batch = with_rewards(learner, rollout, REWARDS)
    m = learn(learner, batch)
    delta = (batch.old_logprobs - rollout.engine_logprobs).masked_fill(~rollout.completion_mask, 0.0)
    rho = delta.sum(1).exp()
    assert 0 < int((rho > 3).sum()) < len(rho)  # some sequences weighted 0, others by their ratio
    expected = -float((rho * (rho <= 3) * batch.advantages).sum()) / len(rho)
    assert m["loss"] == pytest.approx(expected, rel=1e-5)


def test_opsm_drops_negative_advantage_sequences_that_drifted_more_than_delta():
    # mean log(π_sampler/π_θ) per sequence: 0.6, 0.6, 0.4 (over its valid tokens)
    sampler = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    logprobs = torch.tensor([[-1.6, -1.6], [-1.6, -1.6], [-1.4, -5.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]], dtype=torch.bool)
    keep = OPSM(delta=0.5).keep_in_update(logprobs, sampler, mask, torch.tensor([-1.0, 1.0, -1.0]))
    assert keep.tolist() == [[False, False], [True, True], [True, True]]
    per_token = torch.tensor([[-1.0, 2.0], [1.0, 1.0], [-1.0, -1.0]])  # Â_{i,t}: only its negative tokens go
    assert OPSM(delta=0.5).keep_in_update(logprobs, sampler, mask, per_token).tolist() == [
        [False, True],
        [True, True],
        [True, True],
    ]


def test_corrections_combine_weights_and_masks():
    batch = hand_batch([[log(3), log(0.2), 0.0], [log(6), log(6), 0.0]], [[1, 1, 1], [1, 1, 1]], [1.0, 1.0])
    out, emptied, _ = Mismatch([TIS(), MIS(), SequenceMIS()]).before_update(batch)
    assert out.completion_mask.tolist() == [[True, False, True], [False, False, False]]
    assert emptied.tolist() == [False, True]
    torch.testing.assert_close(out.advantages[0, [0, 2]], torch.tensor([2.0, 1.0]))


# ------------------------------------------------------------------ in the learner
def learner_with(update: Update, objective, mismatch):
    policy = make_learner(update, objective).policy
    return Learner(
        policy,
        objective or GSPO(clip_low=0.02, clip_high=0.02),
        update,
        max_len=MAX_NEW,
        group_size=G,
        mismatch=mismatch,
    )


def trainer_logprobs(learner, rollout):
    """The trainer's old-policy log-probs of ``rollout`` exactly as ``snapshot`` computes them."""
    probe = Learner(
        learner.policy,
        learner.objective,
        learner.cfg,
        temperature=learner.temperature,
        max_len=learner.max_len,
        group_size=learner.group_size,
        mismatch=Mismatch(),
    )  # every row's π_old
    batch = copy.deepcopy(rollout)
    probe.snapshot(batch)
    return batch.old_logprobs.masked_fill(~batch.completion_mask, 0.0)


@pytest.mark.parametrize(
    "objective",
    [
        GSPO(clip_low=0.02, clip_high=0.02),
        GSPOToken(clip_low=0.02, clip_high=0.02),
        GRPO(),
        DAPO(),
        CISPO(),
        SAPO(),
        GMPO(),
    ],
    ids=lambda o: type(o).__name__,
)
@pytest.mark.parametrize(
    "update", [Update(), Update(epochs=2, num_minibatches=2, micro_batch_size=2)], ids=["on-policy", "off-policy"]
)
def test_a_sampler_identical_to_the_trainer_changes_nothing_bit_for_bit(objective, update):
    base = make_learner(update, objective)
    rollout = sample_rollout(base.policy)
    rollout.engine_logprobs = trainer_logprobs(base, rollout)
    # on-policy the update never reads a pass before it, so "off" is no mismatch at all; off-policy the
    # pass before the update runs over every row in both (measure only vs every correction)
    off = None if update.on_policy else Mismatch()
    runs = []
    every = [*(c() for c in ALL), MIS(weighted=True), SequenceMIS(weighted=True)]
    for mismatch in (off, Mismatch(every)):
        learner = learner_with(update, copy.deepcopy(objective), mismatch)
        learner.policy.load_state_dict(base.policy.state_dict())
        batch = with_rewards(learner, rollout, REWARDS)
        runs.append((learn(learner, batch, momentum_sgd=True), learner))
    (m0, l0), (m1, l1) = runs
    for p, q in zip(l0.policy.parameters(), l1.policy.parameters()):
        assert torch.equal(p, q)
    shared = set(m0) & set(m1) - {"lr"}
    assert shared >= {"loss", "grad_norm", "clip_frac", "entropy", "kl"} - {"kl"}
    assert {k: m0[k] for k in shared} == pytest.approx({k: m1[k] for k in shared}, abs=0, nan_ok=True)
    assert m1["mismatch/k3"] == 0 and m1["mismatch/log_ratio_abs_max"] == 0
    assert m1["mismatch/masked_token_frac"] == 0 and m1["mismatch/truncated_token_frac"] == 0
    assert m1["mismatch/opsm_masked_token_frac"] == 0


def mismatched_rollout(learner, noise: float = 0.4, seed: int = 3):
    rollout = sample_rollout(learner.policy)
    gen = torch.Generator().manual_seed(seed)
    old = trainer_logprobs(learner, rollout)
    rollout.engine_logprobs = (old + noise * torch.randn(old.shape, generator=gen)).masked_fill(
        ~rollout.completion_mask, 0.0
    )
    return rollout


@pytest.mark.parametrize("objective", [GSPO(clip_low=0.02, clip_high=0.02), DAPO()], ids=lambda o: type(o).__name__)
def test_a_corrected_update_does_not_depend_on_the_micro_batch_split(objective):
    update = dict(epochs=2, num_minibatches=2, skip_zero_advantage_rows=False, share_prompt_forward=False)
    base = make_learner(Update(**update), objective)
    rollout = mismatched_rollout(base)
    rollout.engine_logprobs[7] -= 2.0 * rollout.completion_mask[7]  # a sequence SequenceMIS masks whole
    mismatch = Mismatch([TIS(), MIS(), SequenceMIS(), OPSM(delta=0.05)])
    results = []
    for split in (
        dict(),
        dict(micro_batch_size=1),
        dict(micro_batch_size=5),
        dict(micro_batch_tokens=3 * rollout.input_ids.shape[1]),
    ):
        learner = learner_with(Update(**update, **split), copy.deepcopy(objective), mismatch)
        learner.policy.load_state_dict(base.policy.state_dict())
        results.append((learn(learner, with_rewards(learner, rollout, REWARDS), momentum_sgd=True), learner))
    metrics, first = results[0]
    assert metrics["mismatch/masked_token_frac"] > 0 and metrics["mismatch/masked_seq_frac"] > 0
    assert metrics["mismatch/truncated_token_frac"] > 0 and metrics["mismatch/opsm_masked_token_frac"] > 0
    for other_metrics, other in results[1:]:
        for p, q in zip(first.policy.parameters(), other.policy.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        for key in ("mismatch/k3", "mismatch/masked_token_frac", "mismatch/masked_seq_frac", "clip_frac"):
            assert other_metrics[key] == pytest.approx(metrics[key], abs=1e-6)


def test_a_sequence_masked_whole_leaves_the_sequence_count_as_if_it_were_not_there():
    """seq-mean-token-mean: masking sequence k gives the update of the rollout without row k (N_seqs − 1)."""
    base = make_learner(Update())
    rollout = sample_rollout(base.policy)
    old = trainer_logprobs(base, rollout)
    k = 4
    drift = torch.zeros_like(old)
    drift[k] = 2.0  # π_old/π_sampler = e^2 per token: product ≫ 3
    rollout.engine_logprobs = (old - drift).masked_fill(~rollout.completion_mask, 0.0)
    masked = learner_with(Update(), GSPO(clip_low=0.02, clip_high=0.02), Mismatch([SequenceMIS()]))
    without = learner_with(Update(), GSPO(clip_low=0.02, clip_high=0.02), None)
    for learner in (masked, without):
        learner.policy.load_state_dict(base.policy.state_dict())
    batch = with_rewards(masked, rollout, REWARDS)
    rest = torch.tensor([i for i in range(len(rollout)) if i != k])
    m = learn(masked, batch, momentum_sgd=True)
    learn(without, batch.select(rest), momentum_sgd=True)
    assert m["mismatch/masked_seq_frac"] == pytest.approx(1 / len(rollout))
    for p, q in zip(masked.policy.parameters(), without.policy.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ the sampler's log-probs as π_old
def test_sampler_logprobs_as_old_give_a_first_ratio_away_from_one_and_skip_the_old_pass():
    from test_learner import RowsForwarded

    base = make_learner(Update())
    rollout = mismatched_rollout(base, noise=0.1)
    learner = learner_with(Update(), GRPO(), Mismatch(old_logprobs="sampler"))
    learner.policy.load_state_dict(base.policy.state_dict())
    batch = with_rewards(learner, rollout, REWARDS)
    assert batch.old_logprobs is None  # no old-policy pass
    with RowsForwarded(learner.policy) as counter:
        metrics = learn(learner, batch)
    assert counter.rows == len(rollout) + len(rollout) // G  # the update's own forward only (prompts shared)
    assert abs(metrics["ratio_mean"] - 1) > 1e-3 and metrics["clip_frac"] > 0
    assert metrics["mismatch/k3"] > 0 and math.isfinite(metrics["ratio/seq_logratio_std"])
    normal = learner_with(Update(), GRPO(), None)
    normal.policy.load_state_dict(base.policy.state_dict())
    assert learn(normal, with_rewards(normal, rollout, REWARDS))["ratio_mean"] == 1.0


def test_sampler_logprobs_equal_to_the_trainers_give_the_normal_update():
    base = make_learner(Update())
    rollout = sample_rollout(base.policy)
    with torch.no_grad():  # the update's first forward, as it runs it (one micro-batch of every row)
        rollout.engine_logprobs = base.completion_logprobs(base.policy, rollout).logprobs.masked_fill(
            ~rollout.completion_mask, 0
        )
    runs = []
    for mismatch in (None, Mismatch(old_logprobs="sampler")):
        learner = learner_with(Update(), GRPO(), mismatch)
        learner.policy.load_state_dict(base.policy.state_dict())
        runs.append((learn(learner, with_rewards(learner, rollout, REWARDS), momentum_sgd=True), learner))
    (m0, l0), (m1, l1) = runs
    for p, q in zip(l0.policy.parameters(), l1.policy.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    assert m1["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m1["loss"] == pytest.approx(m0["loss"], abs=1e-7)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: TIS(cap=0), ["cap", "0"]),
        (lambda: MIS(low=2.0, high=1.0), ["low=2.0", "high=1.0", "low < high"]),
        (lambda: SequenceMIS(cap=-1), ["cap=-1"]),
        (lambda: SequenceMIS(ratio="mean"), ["'mean'", "'product'", "'geometric'"]),
        (lambda: TIS(cap=2.0, low=3.0), ["TIS", "cap=2.0", "low=3.0", "0 <= low < cap"]),
        (lambda: SequenceTIS(cap=0), ["SequenceTIS", "cap=0"]),
        (lambda: SequenceTIS(ratio="mean"), ["SequenceTIS", "'mean'", "'geometric'"]),
        (lambda: OPSM(delta=-0.1), ["delta", "-0.1", ">= 0"]),
        (lambda: Mismatch(old_logprobs="engine"), ["'engine'", "trainer", "sampler"]),
        (lambda: Mismatch([TIS(), OPSM()], old_logprobs="sampler"), ["TIS", "OPSM", "sampler"]),
        (lambda: Mismatch(["tis"]), ["'tis'", "TIS, MIS, SequenceMIS or OPSM"]),
    ],
)
def test_bad_settings_name_the_value_and_what_is_valid(build, words):
    with pytest.raises(ValueError) as err:
        build()
    assert all(w in str(err.value) for w in words), str(err.value)


def test_an_engine_without_logprobs_is_named():
    learner = learner_with(Update(), GRPO(), Mismatch([TIS()]))
    rollout = with_rewards(learner, sample_rollout(learner.policy), REWARDS)
    rollout.engine_logprobs = None
    with pytest.raises(ValueError, match="engine_logprobs"):
        learn(learner, rollout)


def test_mismatch_metrics_are_zero_for_equal_logprobs_and_ignore_padding():
    lp = torch.tensor([[-1.0, -2.0, 5.0]])
    m = mismatch_metrics(lp, torch.tensor([[-1.0, -2.0, -50.0]]), torch.tensor([[1, 1, 0]]))
    assert all(float(v) == 0 for v in m.values())


# ------------------------------------------------------------------ end to end
@pytest.mark.parametrize("engine", ["HFGenerate", "LeanSampler"])
def test_the_collector_keeps_the_engines_logprobs_only_when_asked(engine):
    from lit_gspo.models import load_policy
    from lit_gspo.rl.collect import Collector
    from lit_gspo.rl.config import Generation
    from lit_gspo.rl.engines import HFGenerate, LeanSampler
    from lit_gspo.rl.envs import SingleTurn
    from lit_gspo.rl.rewards import CharAccuracy, RewardSet

    policy, tokenizer = load_policy("tiny-llama", seed=0)
    for keep in (False, True):
        collector = Collector(
            SingleTurn(),
            {"HFGenerate": HFGenerate, "LeanSampler": LeanSampler}[engine](),
            RewardSet([CharAccuracy()]),
            tokenizer,
            Generation(num_generations=2, max_new_tokens=4),
            engine_logprobs=keep,
        )
        batch, _, _ = collector.sample(policy, [{"prompt": "rev 12=", "answer": "21"}])
        assert (batch.engine_logprobs is not None) == keep
        if keep:
            assert batch.engine_logprobs.shape == batch.completion_mask.shape
            assert (batch.engine_logprobs[batch.completion_mask] < 0).all()
        greedy, _, _ = collector.sample(policy, [{"prompt": "rev 12=", "answer": "21"}], greedy=True)
        assert greedy.engine_logprobs is None  # validation never needs them


def test_a_cli_fit_with_corrections_logs_the_mismatch(tmp_path):
    from lit_gspo.tools.main import cli_main

    args = [
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--config",
        str(ROOT / "configs/mismatch/tis_opsm.yaml"),
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.max_steps",
        "2",
        "--trainer.enable_progress_bar",
        "false",
        "--model.policy.warm_start.steps",
        "0",
        "--model.validation.every_n_steps",
        "0",
        "--data.num_train",
        "16",
        "--data.num_val",
        "4",
        "--data.prompts_per_step",
        "4",
        "--model.generation.num_generations",
        "4",
        "--model.update.num_minibatches",
        "2",
        "--model.engine",
        "LeanSampler",
    ]
    cli = cli_main(args, run=False)
    assert [type(c).__name__ for c in cli.model.learner.mismatch.corrections] == ["TIS", "OPSM"]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    rows = [r for f in tmp_path.rglob("metrics.csv") for r in csv.DictReader(open(f)) if r.get("train/mismatch/k3")]
    assert len(rows) == 2  # max_steps counts RL steps (of two minibatches each)
    for row in rows:
        assert 0 <= float(row["train/mismatch/k3"]) < 1e-6  # fp32 sampling: the sampler is the trainer up to rounding
        assert float(row["train/mismatch/masked_token_frac"]) == 0 and math.isfinite(float(row["train/reward"]))
