"""The learner without Lightning: old log-probs only where a step was taken, rows skipped without changing the
update, micro-batching and prompt sharing that change the work and not the result."""

import copy
import math

import pytest
import torch

from lit_gspo.models import enable_gradient_checkpointing, load_policy
from lit_gspo.rl.advantages import GroupNormalized
from lit_gspo.rl.collect import Collector
from lit_gspo.rl.config import Generation, Update
from lit_gspo.rl.engines import HFGenerate
from lit_gspo.rl.envs import SingleTurn
from lit_gspo.rl.learn.hooks import UpdateHook
from lit_gspo.rl.learn.learner import Learner
from lit_gspo.rl.learn.old_policy import RecomputedBeforeFirstStep
from lit_gspo.rl.learn.optimizer_step import clip_then_step
from lit_gspo.rl.objectives import GSPO
from lit_gspo.rl.rewards import CharAccuracy, RewardSet
from lit_gspo.rl.rollout import RolloutBatch, token_logprobs

ROWS = [
    {"prompt": "rev 12=", "answer": "21"},
    {"prompt": "rev 1234567=", "answer": "7654321"},
    {"prompt": "rev 345=", "answer": "543"},
    {"prompt": "rev 98765=", "answer": "56789"},
]
G, MAX_NEW = 3, 6


def make_learner(update: Update, objective=None, gradient_checkpointing: bool = False) -> Learner:
    policy, _ = load_policy("tiny-llama", seed=0)
    if gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    return Learner(
        policy,
        objective or GSPO(clip_low=0.02, clip_high=0.02),
        update,
        max_len=MAX_NEW,
        group_size=G,
        gradient_checkpointing=gradient_checkpointing,
    )


def make_collector(engine=None, reward=None, generation: Generation | None = None, **kwargs) -> Collector:
    """The tiny model's collector: ``engine`` (HFGenerate), one ``reward`` (CharAccuracy), G completions of MAX_NEW tokens."""
    _, tokenizer = load_policy("tiny-llama", seed=0)
    return Collector(
        SingleTurn(),
        engine or HFGenerate(),
        RewardSet([reward or CharAccuracy()]),
        tokenizer,
        generation or Generation(num_generations=G, max_new_tokens=MAX_NEW),
        **kwargs,
    )


def sample_rollout(policy, seed: int = 0):
    """G completions of each of ROWS, as the trainer collects them."""
    collector = make_collector()
    torch.manual_seed(seed)
    rollout, _, _ = collector.sample(policy, ROWS)
    return rollout.trimmed()


def with_rewards(learner: Learner, rollout, rewards: list[float]):
    """A copy of ``rollout`` with these rewards, snapshotted and with group advantages, as a training step makes it."""
    rollout = copy.deepcopy(rollout)
    rollout.rewards = torch.tensor(rewards)
    learner.snapshot(rollout)
    rollout.advantages = GroupNormalized()(rollout, G)
    return rollout


def learn(learner: Learner, rollout, momentum_sgd: bool = False, seed: int = 1) -> dict:
    """One ``learn`` with plain backward and a fresh optimiser (SGD with momentum: linear in the gradient)."""
    params = learner.policy.parameters()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9) if momentum_sgd else torch.optim.AdamW(params, lr=1e-2)
    torch.manual_seed(seed)
    return learner.learn(rollout, opt)


def plain_and_sharded_updates(update: Update, param_dtype=None, between=None) -> tuple[Learner, Learner]:
    """Two learners of the same tiny model, the second's policy sharded by FSDP2 in one process (gloo), ``param_dtype``
    its mixed precision; ``between(plain, sharded)`` runs once it is sharded; then each learns the same rollout with
    SGD (at lr 0.5: the steps show)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lit_gspo.runtime.sharding import shard_model

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        plain, sharded = make_learner(update), make_learner(update)
        rollout = sample_rollout(plain.policy)
        shard_model(sharded.policy, init_device_mesh("cpu", (1,)), param_dtype)
        if between is not None:
            between(plain, sharded)
        rewards = [0.0, 1.0, 0.5, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
        for learner in (plain, sharded):
            torch.manual_seed(1)
            params = learner.policy.parameters()
            learner.learn(with_rewards(learner, rollout, rewards), torch.optim.SGD(params, lr=0.5))
    finally:
        dist.destroy_process_group()
    return plain, sharded


class RowsForwarded:
    """Counts the sequences (and padded tokens) the policy runs forward on."""

    def __init__(self, model):
        self.rows, self.tokens, self.model = 0, 0, model

    def __enter__(self):
        self.handle = self.model.register_forward_pre_hook(self.count, with_kwargs=True)
        return self

    def count(self, module, args, kwargs):
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]
        self.rows, self.tokens = self.rows + ids.shape[0], self.tokens + ids.numel()

    def __exit__(self, *exc):
        self.handle.remove()


def test_lazy_old_logprobs_match_a_full_old_pass_and_skip_the_first_minibatch():
    base = make_learner(Update(epochs=2, num_minibatches=2, micro_batch_size=3, share_prompt_forward=False))
    rollout = with_rewards(base, sample_rollout(base.policy), [0.0, 1.0, 3.0] * 4)  # every row has a signal
    assert rollout.old_logprobs is None  # no pass before the update

    eager, lazy = copy.deepcopy(base), copy.deepcopy(base)
    eager_rollout, lazy_rollout = copy.deepcopy(rollout), copy.deepcopy(rollout)
    with torch.no_grad():  # the reference: every row's old log-probs from one pass before any step
        eager_rollout.old_logprobs = token_logprobs(eager.policy, eager_rollout).logprobs
    with RowsForwarded(eager.policy) as eager_rows:
        eager_metrics = learn(eager, eager_rollout)
    with RowsForwarded(lazy.policy) as lazy_rows:
        lazy_metrics = learn(lazy, lazy_rollout)

    n = len(rollout)
    assert eager_rows.rows == 2 * n  # two epochs of training forwards
    assert lazy_rows.rows == 2 * n + n // 2  # + old log-probs of the second minibatch only
    mask = rollout.completion_mask
    torch.testing.assert_close(lazy_rollout.old_logprobs[mask], eager_rollout.old_logprobs[mask], rtol=0, atol=1e-6)
    for p, q in zip(eager.policy.parameters(), lazy.policy.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert lazy_metrics["clip_frac"] == eager_metrics["clip_frac"] and eager_metrics["clip_frac"] > 0


def test_rows_without_advantage_are_skipped_with_the_same_gradient_steps():
    """Groups 0 and 2 have equal rewards (Â = 0): skipping them changes no parameter, only the work done."""
    update = dict(epochs=2, num_minibatches=2, micro_batch_size=2, share_prompt_forward=False)  # one forward per row
    base = make_learner(Update(**update))
    rollout = sample_rollout(base.policy)
    rewards = [1.0, 1.0, 1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # groups of 3
    # SGD: the step is linear in the gradient (Adam would magnify float-order noise in ~0 gradients)
    full = copy.deepcopy(base)
    full.cfg = Update(**update, skip_zero_advantage_rows=False)
    lean = copy.deepcopy(base)
    opts = {id(x): torch.optim.SGD(x.policy.parameters(), lr=0.1, momentum=0.9) for x in (full, lean)}
    for step_rewards in (rewards, [1.0] * 12):  # the second rollout has no signal at all: momentum still moves
        ran, clip = [], []
        for learner in (full, lean):
            batch = with_rewards(learner, rollout, step_rewards)
            with RowsForwarded(learner.policy) as counter:
                torch.manual_seed(1)
                clip.append(learner.learn(batch, opts[id(learner)])["clip_frac"])
            ran.append(counter.rows)
        assert clip[1] == pytest.approx(clip[0], abs=1e-9)  # still a fraction of every token
        for p, q in zip(full.policy.parameters(), lean.policy.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        assert ran[0] == 2 * 12 + 6  # two epochs + the second minibatch's old log-probs
        if step_rewards == rewards:
            assert clip[0] > 0
            assert ran[1] < ran[0] and ran[1] <= 2 * 6 + 6  # only the 6 rows with signal (+ their old log-probs)
        else:
            assert ran[1] == 2 * 2  # one placeholder row per minibatch, no old-log-prob pass
    assert any(not torch.equal(p, q) for p, q in zip(base.policy.parameters(), lean.policy.parameters()))


def test_built_in_objectives_flagged_inert_have_no_gradient_on_zero_advantage_rows():
    from lit_gspo.rl.objectives import OBJECTIVES

    g = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(4, 5, generator=g) * 3).requires_grad_()
    old = logprobs.detach() + torch.randn(4, 5, generator=g)  # far off-policy: clipping active
    advantages = torch.tensor([1.5, 0.0, -0.7, 0.0])
    mask = torch.ones(4, 5, dtype=torch.bool)
    flagged = [cls for cls in OBJECTIVES.values() if cls.zero_advantage_has_no_gradient]
    assert {c.name for c in flagged} >= {"ppo", "grpo", "dapo", "dr_grpo", "gspo", "gspo_token", "cispo", "gmpo"}
    for cls in flagged:
        logprobs.grad = None
        cls()(logprobs, old, advantages, mask).loss.backward()
        assert torch.all(logprobs.grad[[1, 3]] == 0), cls.name
        assert logprobs.grad[[0, 2]].abs().sum() > 0, cls.name


def test_gradient_checkpointing_changes_memory_not_the_update():
    plain = make_learner(Update(num_minibatches=2), GSPO())
    checkpointed = make_learner(Update(num_minibatches=2), GSPO(), gradient_checkpointing=True)

    def checkpointing(model):  # what transformers' is_activation_checkpointing (5.25; older: is_gradient_...) reads
        return any(getattr(module, "gradient_checkpointing", False) for module in model.modules())

    assert checkpointing(checkpointed.policy) and not checkpointing(plain.policy)
    assert not checkpointed.policy.training  # as from_pretrained leaves it: checkpointing must still run
    rollout = sample_rollout(plain.policy)
    saved = []
    for learner in (plain, checkpointed):
        batch = with_rewards(learner, rollout, [0.0, 1.0, 3.0] * 4)
        count = []
        # tensors autograd keeps for backward outside a checkpoint (inside one, the checkpoint's own hooks
        # take them and keep only the layer inputs)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: count.append(1) or t, lambda t: t):
            learn(learner, batch, momentum_sgd=True)
        saved.append(len(count))
    assert saved[1] < saved[0] / 2
    for p, q in zip(plain.policy.parameters(), checkpointed.policy.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert any(
        not torch.equal(p, q) for p, q in zip(make_learner(Update()).policy.parameters(), plain.policy.parameters())
    )
    again = sample_rollout(checkpointed.policy)  # sampling runs in eval mode: the KV cache works with checkpointing on
    assert again.input_ids.shape[0] == len(ROWS) * G


def padded_tokens(batch, groups) -> int:
    return sum(len(rows) * batch.select(rows).trimmed().input_ids.shape[1] for rows in groups)


def test_token_budget_groups_rows_by_length_and_respects_the_budget():
    from lit_gspo.rl.rollout import RolloutBatch, micro_batch_rows

    prompt_len = [3, 5, 3, 5, 4, 2]  # real prompt tokens (left-padded to 5)
    completion_len = [1, 8, 2, 7, 0, 8]  # used completion tokens (right-padded to 8)
    attention = torch.tensor([[0] * (5 - p) + [1] * p + [1] * 8 for p in prompt_len])
    completion = torch.tensor([[True] * c + [False] * (8 - c) for c in completion_len])
    batch = RolloutBatch(
        input_ids=torch.zeros(6, 13, dtype=torch.long),
        attention_mask=attention,
        prompt_length=5,
        completion_mask=completion,
    )
    groups = micro_batch_rows(batch, max_tokens=26)
    # longest first (13, 12, 10, 5, 4, 4), filled greedily; a group costs rows × (widest prompt + widest completion):
    # [1, 3] 2 × 13, then [5, 2] 2 × (3 + 8) (adding 0 would make 3 × 11), then [0, 4] 2 × (4 + 1)
    assert [g.tolist() for g in groups] == [[1, 3], [5, 2], [0, 4]]
    assert sorted(torch.cat(groups).tolist()) == list(range(6))
    assert all(len(g) * (max(prompt_len[i] for i in g) + max(completion_len[i] for i in g)) <= 26 for g in groups)
    consecutive = micro_batch_rows(batch, 2)  # [0, 1] 2 × (5 + 8), [2, 3] 2 × (5 + 7), [4, 5] 2 × (4 + 8)
    assert padded_tokens(batch, groups) == 26 + 22 + 10 < padded_tokens(batch, consecutive) == 26 + 24 + 24
    assert [g.tolist() for g in micro_batch_rows(batch, max_rows=3, max_tokens=100)] == [[1, 3, 5], [2, 0, 4]]
    assert [g.tolist() for g in micro_batch_rows(batch, max_tokens=1)] == [[1], [3], [5], [2], [0], [4]]  # each alone
    assert [g.tolist() for g in micro_batch_rows(batch, 4)] == [[0, 1, 2, 3], [4, 5]]  # no budget: consecutive


def test_token_budget_micro_batches_change_the_work_not_the_update():
    update = dict(epochs=2, num_minibatches=2, skip_zero_advantage_rows=False, share_prompt_forward=False)
    base = make_learner(Update(**update))
    rollout = sample_rollout(base.policy)
    whole, budgeted = copy.deepcopy(base), copy.deepcopy(base)
    budgeted.cfg = Update(**update, micro_batch_tokens=3 * rollout.input_ids.shape[1])
    clip, tokens = [], []
    for learner in (whole, budgeted):
        with RowsForwarded(learner.policy) as counter:
            clip.append(
                learn(learner, with_rewards(learner, rollout, [0.0, 1.0, 3.0] * 4), momentum_sgd=True)["clip_frac"]
            )
        tokens.append(counter.tokens)
    assert tokens[1] < tokens[0]  # less padding forwarded
    assert clip[0] > 0 and clip[1] == pytest.approx(clip[0], abs=1e-7)
    for p, q in zip(whole.policy.parameters(), budgeted.policy.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert any(not torch.equal(p, q) for p, q in zip(base.policy.parameters(), budgeted.policy.parameters()))


def test_sharing_prompt_forwards_changes_the_work_not_the_update():
    """G rows of a group run their prompt once: fewer tokens through the policy, the same parameters."""
    update = dict(epochs=2, num_minibatches=2, skip_zero_advantage_rows=False)
    base = make_learner(Update(**update))
    rollout = sample_rollout(base.policy)
    per_row, shared = copy.deepcopy(base), copy.deepcopy(base)
    per_row.cfg = Update(**update, share_prompt_forward=False)
    assert shared.shares_prompts and not per_row.shares_prompts
    clip, tokens = [], []
    for learner in (per_row, shared):
        with RowsForwarded(learner.policy) as counter:
            clip.append(
                learn(learner, with_rewards(learner, rollout, [0.0, 1.0, 3.0] * 4), momentum_sgd=True)["clip_frac"]
            )
        tokens.append(counter.tokens)
    assert tokens[1] < tokens[0]
    assert clip[0] > 0 and clip[1] == pytest.approx(clip[0], abs=1e-7)
    for p, q in zip(per_row.policy.parameters(), shared.policy.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert any(not torch.equal(p, q) for p, q in zip(base.policy.parameters(), shared.policy.parameters()))


def test_packing_changes_the_work_not_the_update():
    """The rows of a micro-batch as one sequence without padding: fewer tokens through the policy, the same parameters."""
    update = dict(epochs=2, num_minibatches=2, skip_zero_advantage_rows=False, share_prompt_forward=False)
    base = make_learner(Update(**update))
    rollout = sample_rollout(base.policy)
    padded, packed = copy.deepcopy(base), copy.deepcopy(base)
    packed.cfg = Update(**update, pack_sequences=True)
    assert packed.packs and not padded.packs  # the tiny model's sdpa: packing only when asked
    clip, tokens = [], []
    for learner in (padded, packed):
        with RowsForwarded(learner.policy) as counter:
            clip.append(
                learn(learner, with_rewards(learner, rollout, [0.0, 1.0, 3.0] * 4), momentum_sgd=True)["clip_frac"]
            )
        tokens.append(counter.tokens)
    assert tokens[1] < tokens[0]
    assert clip[0] > 0 and clip[1] == pytest.approx(clip[0], abs=1e-7)
    for p, q in zip(padded.policy.parameters(), packed.policy.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_packing_by_default_only_where_the_attention_kernel_skips_other_rows():
    learner = make_learner(Update())
    assert not learner.packs
    learner.policy.config._attn_implementation = "flex_attention"
    assert learner.packs
    assert not make_learner(Update(pack_sequences=False)).packs


def test_the_automatic_token_budget_is_the_gpus_free_memory_and_none_on_the_cpu(monkeypatch):
    from lit_gspo.runtime.token_budget import saved_bytes_per_token

    learner = make_learner(Update())
    assert learner.cfg.micro_batch_tokens == "auto" and learner.micro_batch_tokens() is None  # CPU: as configured
    assert not learner.bytes_per_token  # nothing measured where there is no budget
    monkeypatch.setattr(Learner, "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 2**31))
    with learner.lean():  # the tiny model's fp32 weights, no autocast, its norms and MLPs lean as the update runs them
        per_token = saved_bytes_per_token(learner.probe_forward)
    assert learner.micro_batch_tokens() == max(256, 2**29 // per_token)
    assert make_learner(Update(micro_batch_tokens=64)).micro_batch_tokens() == 64


class FreshForward(UpdateHook):
    """Records, for every micro-batch, a fresh forward of the weights as they are now next to the update's own."""

    def __init__(self):
        self.learner, self.seen = None, []

    def before_loss(self, update, step):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            fresh = self.learner.completion_logprobs(self.learner.policy, step.batch).logprobs
        self.seen.append((fresh, step.logprobs.detach()))


def test_later_minibatches_see_the_stepped_weights_under_an_autocast_that_caches_casts():
    """torch.autocast caches each weight's bf16 copy until the outermost autocast exits; an in-place optimiser
    step inside it must not leave the next minibatch on the pre-step copy."""
    policy, _ = load_policy("tiny-llama", seed=0)
    fresh = FreshForward()
    learner = Learner(
        policy,
        GSPO(clip_low=0.02, clip_high=0.02),
        Update(num_minibatches=2, skip_zero_advantage_rows=False),
        max_len=MAX_NEW,
        group_size=G,
        hooks=[fresh],
    )
    fresh.learner = learner
    batch = with_rewards(learner, sample_rollout(policy), [0.0, 1.0, 3.0] * 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # cache_enabled=True, as a user's own autocast would be
        learn(learner, batch)  # AdamW, lr 1e-2: a step moves the weights far beyond bf16 rounding
    assert len(fresh.seen) == 2
    for now, used in fresh.seen:
        torch.testing.assert_close(used, now, rtol=0, atol=1e-6)


def test_minibatches_take_whole_groups_or_shuffled_rows():
    learner = make_learner(Update(num_minibatches=2, shuffle="groups"))
    torch.manual_seed(0)
    order = learner.minibatch_order(12)
    assert sorted(order.tolist()) == list(range(12))
    groups = order.view(4, 3)  # consecutive triples are whole groups, in a random group order
    assert all(g.tolist() == [3 * (int(g[0]) // 3) + i for i in range(3)] for g in groups)
    assert groups[:, 0].tolist() != [0, 3, 6, 9]  # shuffled (this seed)
    learner.cfg = Update(num_minibatches=2, shuffle="rows")
    rows = torch.stack([learner.minibatch_order(12) for _ in range(5)])
    assert any(sorted(r.view(4, 3).tolist()) != [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]] for r in rows)
    learner.cfg = Update(num_minibatches=1)
    assert learner.minibatch_order(12).tolist() == list(range(12))
    with pytest.raises(ValueError, match="'groups' or 'rows', got 'prompts'"):
        Update(shuffle="prompts")


class FaultyGSPO(GSPO, register=False):
    """GSPO whose loss is multiplied by ``factor`` on the calls numbered in ``calls`` (1-based): NaN, or 0 for a reference."""

    def __init__(self, calls, factor, **kwargs):
        super().__init__(**kwargs)
        self.calls, self.factor, self.n = set(calls), factor, 0

    def policy_loss(self, *args, **kwargs):
        out = super().policy_loss(*args, **kwargs)
        self.n += 1
        if self.n in self.calls:
            out.loss = out.loss * self.factor
        return out


def test_a_non_finite_minibatch_makes_no_optimiser_step_and_n_in_a_row_stop_the_run():
    update = Update(num_minibatches=3, share_prompt_forward=False)  # one micro-batch, one objective call per minibatch
    policy = make_learner(update).policy
    rollout = sample_rollout(policy)
    runs = {}
    for name, factor in (("nan", float("nan")), ("zero", 0.0)):  # "zero": minibatch 2 steps on a zero gradient
        learner = Learner(
            copy.deepcopy(policy),
            FaultyGSPO([2], factor, clip_low=0.02, clip_high=0.02),
            update,
            max_len=MAX_NEW,
            group_size=G,
        )
        batch = with_rewards(learner, rollout, [0.0, 1.0, 3.0] * 4)
        opt = torch.optim.SGD(learner.policy.parameters(), lr=0.1)  # no momentum: a zero-gradient step changes nothing
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        torch.manual_seed(1)
        if name == "nan":
            with pytest.warns(RuntimeWarning, match=r"update 2 .*loss=nan.*skipped the optimiser step \(1 in a row"):
                metrics = learner.learn(batch, opt, scheduler)
        else:
            metrics = learner.learn(batch, opt, scheduler)
        runs[name] = learner, metrics, scheduler.last_epoch
    (nan, nan_metrics, nan_sched), (zero, zero_metrics, zero_sched) = runs["nan"], runs["zero"]
    assert nan_metrics["nonfinite_steps"] == 1 and zero_metrics["nonfinite_steps"] == 0
    assert (nan_sched, zero_sched) == (2, 3)  # no scheduler step for the skipped minibatch
    assert math.isfinite(nan_metrics["loss"]) and math.isfinite(nan_metrics["grad_norm"])  # over the steps taken
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in nan.policy.parameters())  # NaN gradients zeroed
    assert any(not torch.equal(p, q) for p, q in zip(policy.parameters(), nan.policy.parameters()))
    for p, q in zip(nan.policy.parameters(), zero.policy.parameters()):
        assert torch.equal(p, q) and torch.isfinite(p).all()  # the same weights as the other two steps alone

    stuck = Learner(
        copy.deepcopy(policy),
        FaultyGSPO(range(1, 100), float("nan"), clip_low=0.02, clip_high=0.02),
        Update(max_nonfinite_steps=2),
        max_len=MAX_NEW,
        group_size=G,
    )
    opt = torch.optim.AdamW(stuck.policy.parameters(), lr=1e-2)
    batch = with_rewards(stuck, rollout, [0.0, 1.0, 3.0] * 4)
    with pytest.warns(RuntimeWarning, match="1 in a row"):
        stuck.learn(copy.deepcopy(batch), opt)
    assert not opt.state  # AdamW never stepped
    with (
        pytest.raises(RuntimeError, match=r"2 optimiser steps in a row .*non-finite.*max_nonfinite_steps=2"),
        pytest.warns(RuntimeWarning),
    ):
        stuck.learn(copy.deepcopy(batch), opt)
    for p, q in zip(policy.parameters(), stuck.policy.parameters()):
        assert torch.equal(p, q)


def test_snapshot_keeps_rollout_row_order_when_a_token_budget_sorts_rows_by_length():
    """micro_batch_tokens deals rows to micro-batches longest first; reference and old log-probs must land on their rows."""
    update = dict(epochs=2, num_minibatches=2, share_prompt_forward=False)
    whole = make_learner(Update(**update))
    whole.reference = copy.deepcopy(whole.policy)
    rollout = sample_rollout(whole.policy)
    budgeted = copy.deepcopy(whole)
    budgeted.cfg = Update(**update, micro_batch_tokens=3 * rollout.input_ids.shape[1])
    batches = [copy.deepcopy(rollout), copy.deepcopy(rollout)]
    whole.snapshot(batches[0])
    budgeted.snapshot(batches[1])
    mask = rollout.completion_mask
    torch.testing.assert_close(batches[1].ref_logprobs[mask], batches[0].ref_logprobs[mask], rtol=0, atol=1e-6)


class HookOrder(UpdateHook):
    """Records the steps of ``learn``, through its hooks and an optimiser step that notes each call."""

    def __init__(self):
        self.calls = []

    def before_update(self, update):
        self.calls.append("begin")

    def before_loss(self, update, step):
        self.calls.append(f"micro {len(step.batch)}" + (" (own forward is old)" if step.old_is_current else ""))

    def after_backward(self, update, minibatch):
        self.calls.append(f"backward done {minibatch.epoch}.{minibatch.index}")

    def may_step(self, update, minibatch, loss, grad_norm):
        self.calls.append("may step")
        return True

    def metrics(self, update):
        self.calls.append("metrics")
        return {}

    def step(self, optimizer, clip, may_step):
        self.calls.append("clip")
        norm = clip_then_step(optimizer, clip, may_step)
        self.calls.append("step")
        return norm


def test_learn_runs_the_algorithm_in_order_through_its_hooks():
    """``learn`` is the loop epochs × minibatches → micro-batches → backward → clip → step; the replay of
    ``lit-gspo compare`` (``MinibatchGradients``) relies on this order through the hooks only."""
    policy, _ = load_policy("tiny-llama", seed=0)
    hook = HookOrder()
    learner = Learner(
        policy,
        GSPO(clip_low=0.02, clip_high=0.02),
        Update(epochs=2, num_minibatches=2, micro_batch_size=4, skip_zero_advantage_rows=False),
        max_len=MAX_NEW,
        group_size=G,
        hooks=[hook],
    )
    assert isinstance(learner.old_policy, RecomputedBeforeFirstStep)
    batch = with_rewards(learner, sample_rollout(policy), [0.0, 1.0, 3.0] * 4)  # 12 rows: minibatches of 6 = 4 + 2
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    torch.manual_seed(1)
    learner.learn(batch, opt, step=hook.step)
    step = ["clip", "may step", "step"]
    first = ["micro 4 (own forward is old)", "micro 2 (own forward is old)", "backward done 0.0", *step]
    later = [["micro 4", "micro 2", f"backward done {e}.{m}", *step] for e, m in ((0, 1), (1, 0), (1, 1))]
    assert hook.calls == ["begin", *first, *[c for minibatch in later for c in minibatch], "metrics"]


def test_compare_replays_through_the_learners_public_hooks_only():
    from lit_gspo.tools.compare_replay import MinibatchGradients, ReplayLearner

    overridden = {name for name, value in vars(ReplayLearner).items() if callable(value) and name != "__init__"}
    assert overridden <= {"minibatch_order"}
    assert {name for name, value in vars(MinibatchGradients).items() if callable(value)} <= {
        "__init__",
        "after_backward",
    }


def test_gradients_are_freed_once_applied_by_the_update_and_the_warm_start():
    """Held after the last step, the gradients (the model's size again) would sit on the device through the next
    rollout and reach the host at Lightning's teardown; the optimiser's state is kept (a checkpoint after fit saves it)."""
    from lit_gspo.rl.config import WarmStart
    from lit_gspo.rl.warm_start import warm_start

    learner = make_learner(Update(num_minibatches=2))
    rollout = with_rewards(learner, sample_rollout(learner.policy), [float(i % 3) for i in range(len(ROWS) * G)])
    params = list(learner.policy.parameters())
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-2)
    learner.learn(rollout, opt)
    assert any(not torch.equal(p, b) for p, b in zip(params, before))  # it stepped
    assert all(p.grad is None for p in params)
    assert opt.state and all("exp_avg" in s for s in opt.state.values())

    policy, tokenizer = load_policy("tiny-llama", seed=0)
    rows = [dict(row) for row in ROWS]
    encode = lambda chosen: [tokenizer(r["prompt"])["input_ids"] for r in chosen]  # noqa: E731
    warm_start(policy, tokenizer, rows, encode, WarmStart(steps=2, batch_size=2), seed=0)
    assert all(p.grad is None for p in policy.parameters())


def test_a_compiled_update_gives_the_eager_updates_parameters_and_leaves_the_policys_layers_as_they_were():
    """``update.compile``: the decoder layers run compiled inside ``learn`` and ``snapshot`` only (the samplers, the
    state dict and the user's model see the originals after it); two updates of different shapes (other rewards, other
    rows with a gradient) give the parameters of the eager learner within float rounding."""
    from lit_gspo.runtime.sharding import decoder_layer_list

    class LayersSeen(UpdateHook):
        def __init__(self):
            self.swapped = []

        def before_loss(self, update, step):
            self.swapped.append(list(decoder_layer_list(compiled.policy)) != layers)

    update = dict(epochs=2, num_minibatches=2)
    eager, compiled = make_learner(Update(**update)), make_learner(Update(**update, compile=True))
    layers, keys = list(decoder_layer_list(compiled.policy)), list(compiled.policy.state_dict())
    seen = LayersSeen()
    compiled.hooks.hooks.append(seen)
    rollout = sample_rollout(eager.policy)
    for rewards in ([1.0, 0.0, 0.0] * 4, [0.0, 1.0, 0.5, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]):
        metrics = {}
        for name, learner in (("eager", eager), ("compiled", compiled)):
            metrics[name] = learn(learner, with_rewards(learner, rollout, rewards), momentum_sgd=True)
        assert metrics["compiled"]["loss"] == pytest.approx(metrics["eager"]["loss"], abs=1e-6)
        for (name, a), b in zip(eager.policy.named_parameters(), compiled.policy.parameters()):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4, msg=name)
    assert seen.swapped and all(seen.swapped)  # every loss of the update came from the compiled layers
    assert list(decoder_layer_list(compiled.policy)) == layers and list(compiled.policy.state_dict()) == keys


def test_an_update_on_aligned_rows_gives_the_padded_updates_parameters():
    """``update.align_rows`` (on a GPU by default): every forward of the update (the old policy's pass, each
    minibatch's loss) on rows aligned to their front without a mask; the parameters of the padded update."""
    update = dict(epochs=2, num_minibatches=2, share_prompt_forward=False)
    padded, aligned = make_learner(Update(**update, align_rows=False)), make_learner(Update(**update, align_rows=True))
    assert not padded.aligns and aligned.aligns
    assert not make_learner(Update()).aligns  # auto: the padded forward on the CPU, as before
    rollout = sample_rollout(padded.policy)
    assert rollout.attention_mask[:, : rollout.prompt_length].eq(0).any()  # prompts of different lengths
    for learner in (padded, aligned):
        rewards = [0.0, 1.0, 0.5, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
        learn(learner, with_rewards(learner, rollout, rewards), momentum_sgd=True)  # (Adam's g/√v: noise of ~0)
    for (name, a), b in zip(padded.policy.named_parameters(), aligned.policy.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=name)
    assert any(
        not torch.equal(a, b) for a, b in zip(padded.policy.parameters(), make_learner(Update()).policy.parameters())
    )


@pytest.mark.slow
@pytest.mark.parametrize("param_dtype", [None, "bf16"], ids=["fp32-params", "bf16-casts"])
def test_one_compiled_graph_serves_every_layer_and_updates_of_other_lengths_compile_nothing_more(param_dtype):
    """A layer compiled per layer would be a recompile of the same code per layer, and past torch's recompile limit (8)
    the rest would run eagerly (Qwen3-0.6B has 28 layers): 10 layers, rows sharing their prompts (whose KV-cache pass
    made every layer a graph of its own: shared prompts are off under compiled layers), compile one graph, and
    updates of other lengths and row counts compile nothing more (grad mode only: on-policy, one minibatch). Row
    counts and lengths are kept off the model's sizes: a first one equal to one is compiled fixed (duck sizing).
    With ``update.param_dtype`` the parameters are new casts at every step: the graph reads them as inputs."""
    from torch._dynamo.utils import counters  # (torch's own tests count compiled graphs so)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=10, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    assert config.num_hidden_layers > torch._dynamo.config.recompile_limit
    policy = Qwen3ForCausalLM(config)
    update = Update(compile=True, share_prompt_forward=True, skip_zero_advantage_rows=False, param_dtype=param_dtype)
    learner = Learner(policy, GSPO(), update, max_len=12, group_size=3)
    assert learner.old_policy.ratios_move is False and not learner.shares_prompts
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)

    def learn_from(seed, groups, P, T):
        generator = torch.Generator().manual_seed(seed)
        prompts = torch.randint(2, 64, (groups, P), generator=generator).repeat_interleave(3, 0)
        rows = len(prompts)
        mask = torch.arange(T)[None] < torch.randint(1, T + 1, (rows, 1), generator=generator)
        ids = torch.cat([prompts, torch.randint(2, 64, (rows, T), generator=generator)], 1)
        batch = RolloutBatch(ids, torch.cat([torch.ones(rows, P, dtype=torch.long), mask.long()], 1), P, mask)
        batch.advantages = torch.randn(rows, generator=generator)
        assert math.isfinite(learner.learn(batch, optimizer)["loss"])

    torch._dynamo.reset()  # (graphs compiled by earlier tests)
    counters.clear()
    learn_from(0, 2, 9, 12)  # 6 rows of 10 to 21 tokens
    assert counters["stats"]["unique_graphs"] == 1  # the 10 layers' forwards: one graph (with its backward)
    with torch.compiler.set_stance("fail_on_recompile"):  # (any compile raises now)
        learn_from(1, 5, 11, 9)
        learn_from(2, 1, 3, 6)


def test_a_compiled_update_runs_eagerly_with_a_warning_where_it_is_not_supported():
    learner = make_learner(Update(compile=True), gradient_checkpointing=True)
    rollout = sample_rollout(learner.policy)
    with pytest.warns(UserWarning, match="update.compile: the update runs eagerly under gradient checkpointing"):
        learn(learner, with_rewards(learner, rollout, [1.0, 0.0, 0.0] * 4))


@pytest.mark.slow
def test_under_bf16_autocast_a_compiled_qwen3_update_is_as_close_to_fp32_as_the_eager_one():
    """Qwen3 (per-head q/k norms; its decoder reads each layer's ``attention_type``) with rows sharing prompts (the
    KV-cache pass through the compiled layers): compiled and eager fp32 updates agree to float rounding; under bf16
    autocast, where fused kernels round less often, the compiled update is no further from fp32 than the eager one."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lit_gspo.rl.rollout import RolloutBatch

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    base = Qwen3ForCausalLM(config)
    N, P, T = 8, 5, 7
    ids = torch.randint(3, 64, (N, P + T))
    ids[:4, :P], ids[4:, :P] = ids[0, :P], ids[4, :P]  # two groups of four rows sharing a prompt
    batch = RolloutBatch(ids, torch.ones_like(ids), P, torch.ones(N, T, dtype=torch.bool))

    def update(compile: bool, bf16: bool) -> list[torch.Tensor]:
        policy = copy.deepcopy(base)
        learner = Learner(policy, GSPO(), Update(num_minibatches=2, compile=compile), max_len=T, group_size=4)
        rollout = copy.deepcopy(batch)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            learner.snapshot(rollout)
            rollout.advantages = torch.linspace(-1, 1, N)
            opt = torch.optim.SGD(policy.parameters(), lr=0.1)
            torch.manual_seed(1)
            learner.learn(rollout, opt)
        return [p.detach() for p in policy.parameters()]

    def distance(a, b) -> float:
        return max((x - y).abs().max().item() for x, y in zip(a, b))

    fp32 = update(compile=False, bf16=False)
    assert distance(update(compile=True, bf16=False), fp32) < 1e-6
    eager_bf16 = distance(update(compile=False, bf16=True), fp32)
    assert 0 < distance(update(compile=True, bf16=True), fp32) <= 1.5 * eager_bf16


def test_an_update_draws_no_dropout_whatever_mode_the_policy_was_left_in():
    """A policy with attention dropout 0.5 left in train mode (a callback's ``policy.train()``): the old-policy pass
    and the update run in eval mode, as the sampler does, so the update ends where the same update of the policy in
    eval mode ends, bit for bit (with dropout drawn it does not); each module's mode is restored after. The warm start
    trains in train mode and leaves the mode as it found it."""
    from lit_gspo.rl.config import WarmStart
    from lit_gspo.rl.warm_start import warm_start

    def dropping_learner(train_mode: bool) -> Learner:
        policy, _ = load_policy("tiny-llama", seed=0, config_overrides={"attention_dropout": 0.5})
        policy.train(train_mode)
        return Learner(policy, GSPO(), Update(num_minibatches=2), max_len=MAX_NEW, group_size=G)

    learners = {mode: dropping_learner(mode) for mode in (True, False)}
    rollout = sample_rollout(learners[False].policy)
    for mode, learner in learners.items():
        learn(learner, with_rewards(learner, rollout, [float(i % 3) for i in range(len(ROWS) * G)]))
        assert all(m.training == mode for m in learner.policy.modules())  # restored
    for a, b in zip(learners[True].policy.parameters(), learners[False].policy.parameters()):
        assert torch.equal(a, b)

    policy, tokenizer = load_policy("tiny-llama", seed=0, config_overrides={"attention_dropout": 0.5})
    encode = lambda chosen: [tokenizer(r["prompt"])["input_ids"] for r in chosen]  # noqa: E731
    warm_start(policy, tokenizer, [dict(row) for row in ROWS], encode, WarmStart(steps=1, batch_size=2), seed=0)
    assert not any(m.training for m in policy.modules())


def test_dynamic_samplings_reward_all_groups_is_over_the_groups_it_dropped_too():
    """``train/reward_all_groups`` is the policy's reward before dynamic sampling filters groups (``train/reward`` is
    the kept groups'). Before, it was computed from the kept batches and equalled ``train/reward``."""
    policy, _ = load_policy("tiny-llama", seed=0)

    def first_group_flat(prompts, completions, **columns):  # group 0 all 1 (dropped), the others 0, 1, 0
        return [1.0 if i < G else float(i % G == 1) for i in range(len(completions))]

    collector = make_collector(reward=first_group_flat, dynamic_sampling=True, max_sampling_rounds=1)
    torch.manual_seed(0)
    rollout, stats = collector.collect(policy, ROWS, refill=lambda n: [])
    assert len(rollout) == 3 * G and stats["reward"] == pytest.approx(1 / 3)
    assert stats["frac_zero_std_groups"] == 0.25
    assert stats["reward_all_groups"] == pytest.approx((G + 3) / (4 * G))  # 3 + 3 × 1 ones over 12 samples
