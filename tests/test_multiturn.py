"""Multi-turn episodes: token in, token out; environment tokens outside the loss; per-turn credit."""

import copy
import warnings

import pytest
import torch

from lit_gspo.models.loading import load_policy
from lit_gspo.rl.advantages import GAE, GroupNormalized, TurnGroupNormalized, gae
from lit_gspo.rl.collect import Collector
from lit_gspo.rl.config import Generation, Update
from lit_gspo.rl.engines import HFGenerate, RolloutEngine
from lit_gspo.rl.envs import Environment, RetryWithFeedback, Turn
from lit_gspo.rl.learn.learner import Learner
from lit_gspo.rl.objectives import Counts, get_objective
from lit_gspo.rl.rewards import CharAccuracy, RewardSet
from lit_gspo.rl.rollout import RolloutBatch

ROWS = [{"prompt": "rev 12=", "answer": "21"}, {"prompt": "rev 345=", "answer": "543"}]


class Talker(Environment):
    """Answers every reply with ``observation`` until ``max_turns``; turn k earns reward k; success on turn 2."""

    def __init__(self, observation=" more=", **kwargs):
        super().__init__(**kwargs)
        self.observation = observation

    def step(self, row, reply, state):
        return Turn(
            observation=self.observation,
            done=False,
            reward=float(state["turn"]),
            success=state["turn"] == 2,
            metrics={"asked": 1.0},
        )


class ScriptedEngine(RolloutEngine):
    """Replies with scripted token ids (call k: ``script[k]``, one list per row), and records its prompts."""

    def __init__(self, script):
        super().__init__()
        self.script, self.calls = script, []

    def generate(
        self,
        policy,
        input_ids,
        attention_mask,
        *,
        num_generations,
        max_new_tokens,
        pad_id,
        eos_id,
        sampling,
        synced_gpus,
        return_logprobs,
    ):
        prompts = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask)]
        replies = self.script[len(self.calls)]
        self.calls.append(prompts)
        rows = input_ids.repeat_interleave(num_generations, 0)
        width = max(len(r) for r in replies)
        out = torch.full((len(rows), width), pad_id, dtype=torch.long)
        for i, reply in enumerate(replies):
            out[i, : len(reply)] = torch.tensor(reply[:max_new_tokens])
        return torch.cat([rows, out[:, :max_new_tokens]], 1), None


@pytest.fixture(scope="module")
def tiny():
    return load_policy("tiny-llama", seed=0)


def collector(tokenizer, env, engine=None, G=2, max_new=4, rewards=None):
    return Collector(
        env,
        engine or HFGenerate(),
        RewardSet(rewards or [CharAccuracy()]),
        tokenizer,
        Generation(num_generations=G, max_new_tokens=max_new),
    )


def test_trained_ids_are_the_sampled_and_appended_ids_never_a_retokenisation(tiny):
    """Replies contain a token that decodes to nothing (<bos>) and one that decodes like two others; the
    rollout keeps exactly the engine's ids, the next turn is sampled on exactly them, and the
    observation's ids are its text tokenised once."""
    policy, tok = tiny
    vocab = tok.get_vocab()
    ids = lambda text: [vocab[c] for c in text]  # noqa: E731
    eos, bos = tok.eos_token_id, tok.bos_token_id
    first = [ids("1") + [bos] + ids("2") + [eos], ids("9") + [eos], ids("34") + [eos], ids("5") + [bos, eos]]
    second = [ids("7") + [eos], ids("8") + [eos], ids("6") + [eos], ids("2") + [eos]]
    engine = ScriptedEngine([first, second])
    env = Talker(max_turns=2)
    batch, replies, stats = collector(tok, env, engine).sample(policy, ROWS)
    obs = tok(" more=", add_special_tokens=False)["input_ids"]
    P = batch.prompt_length
    for i in range(4):
        expected = first[i] + obs + second[i]
        row = batch.input_ids[i, P:][batch.attention_mask[i, P:].bool()].tolist()
        assert row == expected
        assert batch.completion_mask[i].tolist()[: len(expected)] == [True] * len(first[i]) + [False] * len(obs) + [
            True
        ] * len(second[i])
        assert batch.turn_ids[i, : len(expected)].tolist() == [0] * (len(first[i]) + len(obs)) + [1] * len(second[i])
        prompt = batch.input_ids[i, :P][batch.attention_mask[i, :P].bool()].tolist()
        assert engine.calls[1][i] == prompt + first[i] + obs  # turn 2 sampled on exactly these ids
    assert replies == ["7", "8", "6", "2"]
    # rewards: CharAccuracy of the last reply + turn rewards 1 + 2, on the last token of each reply
    char_acc = torch.tensor([0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(batch.rewards, char_acc + 3.0)
    torch.testing.assert_close(batch.token_rewards.sum(1), batch.rewards)
    assert batch.token_rewards[0, len(first[0]) - 1] == 1.0
    assert stats["turns"] == 2 and stats["asked"] == 2 and stats["success_turn2"] == 1 and stats["success_turn1"] == 0
    assert stats["truncated_episodes"] == 1.0  # never done: ended by max_turns


def test_max_turns_and_the_token_budget_end_episodes(tiny):
    policy, tok = tiny
    torch.manual_seed(0)
    batch, _, stats = collector(tok, Talker(max_turns=3)).sample(policy, ROWS)
    assert stats["turns"] == 3
    assert (batch.turn_ids[batch.completion_mask] <= 2).all()
    # a budget of 4 reply tokens + 6 observation tokens + 1: the third turn never starts
    torch.manual_seed(0)
    batch, _, stats = collector(tok, Talker(max_turns=3, max_episode_tokens=4 + 6 + 1)).sample(policy, ROWS)
    lengths = batch.attention_mask[:, batch.prompt_length :].sum(1)
    assert (lengths <= 11).all()
    assert stats["turns"] < 3 and stats["truncated_episodes"] == 1.0


def test_an_observation_longer_than_the_whole_budget_ends_its_episode_truncated_and_says_so_once(tiny):
    """A tool's answer is as long as what the policy asked for: one too long for the budget ends that episode (counted
    as truncated) instead of stopping the run mid-way, with one warning naming the numbers."""
    policy, tok = tiny
    env = Talker(observation=" " + "x" * 40 + "=", max_turns=2, max_episode_tokens=20)
    talk = collector(tok, env)
    with pytest.warns(
        RuntimeWarning,
        match=r"observation of 42 tokens at turn 2.*budget is 20 tokens.*"
        r"max_episode_tokens=20.*end there, truncated",
    ):
        batch, _, stats = talk.sample(policy, ROWS)
    assert stats["turns"] == 1 and stats["truncated_episodes"] == 1.0
    assert (batch.turn_ids[batch.completion_mask] == 0).all()  # the first reply is kept and trained on
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per run, not at every step
        talk.sample(policy, ROWS)


@pytest.mark.parametrize(
    "bad, message",
    [
        (Turn(reward="1"), r"reward='1' \(str\); a turn's reward is a float or None"),
        ("done", r"must return a lit_gspo.rl.envs.Turn, got str"),
        (Turn(done=False), r"done=False without an observation"),
    ],
)
def test_an_environment_answering_wrongly_is_named(tiny, bad, message):
    policy, tok = tiny

    class Bad(Environment):
        def step(self, row, reply, state):
            return bad

    with pytest.raises((TypeError, ValueError), match=message):
        collector(tok, Bad(max_turns=2)).sample(policy, ROWS)


def test_retry_with_feedback_blanks_wrong_characters_and_charges_each_wrong_try():
    env = RetryWithFeedback(max_turns=3, retry_penalty=0.25)
    row = {"prompt": "rev 382=", "answer": "283"}
    assert env.hint("293", "283") == "2_3" and env.hint("2", "283") == "2__" and env.hint("28345", "283") == "283"
    turn = env.step(row, " 293 ", {"turn": 1})
    assert (turn.observation, turn.done, turn.success) == (" 2_3=", False, False)
    assert turn.reward == pytest.approx(2 / 3 - 1 - 0.25)  # two of three characters right, minus the penalty
    assert env.step(row, "283", {"turn": 2}) == Turn(done=True, success=True)
    assert env.step(row, "111", {"turn": 3}) == Turn(done=True, success=False)  # the last try gets no hint
    with pytest.raises(ValueError, match="must contain"):
        RetryWithFeedback(feedback="try again")


# ---------------------------------------------------------------- environment tokens outside the loss

NAMES = [
    "grpo",
    "dapo",
    "gspo",
    "gspo_token",
    "dr_grpo",
    "cispo",
    "gmpo",
    "sapo",
    "dppo",
    "clip_cov",
    "kl_cov",
    "vespo",
    "luspo",
]


def multi_turn_batch(seed=0):
    """(logprobs, old, per-token advantages, mask with environment columns) for 4 rows × 9 tokens."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 9, generator=g) * 3
    lp = old + 0.3 * torch.randn(4, 9, generator=g)
    mask = torch.tensor(
        [
            [1, 1, 0, 0, 1, 1, 1, 0, 0],
            [1, 0, 0, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 1, 1, 1],
            [1, 1, 1, 0, 0, 0, 1, 0, 0],
        ],
        dtype=torch.bool,
    )
    adv = torch.randn(4, 9, generator=g)
    return lp, old, adv, mask


@pytest.mark.parametrize("name", NAMES)
def test_environment_tokens_get_no_gradient_and_no_share_of_any_normaliser(name):
    """The loss equals the loss of the same batch with the environment's columns deleted (each row's policy
    tokens packed to the left), and the environment's positions get exactly zero gradient."""
    lp, old, adv, mask = multi_turn_batch()
    hp = {"clip_low": 0.05, "clip_high": 0.05} if name.startswith("gspo") or name == "luspo" else {}
    obj = get_objective(name, **hp)
    counts = Counts.of(mask, max_len=9)
    leaf = lp.clone().requires_grad_(True)
    torch.manual_seed(0)  # Clip-Cov draws its tokens with torch's RNG: the same draw in both calls
    out = obj(leaf, old, adv, mask, counts=counts)
    out.loss.backward()
    assert (leaf.grad[~mask] == 0).all() and leaf.grad[mask].abs().sum() > 0
    width = int(mask.sum(1).max())
    packed = lambda x, fill: torch.stack(
        [
            torch.cat([r[m], torch.full((width - int(m.sum()),), fill)])  # noqa: E731
            for r, m in zip(x, mask)
        ]
    )
    packed_mask = packed(mask.float(), 0.0).bool()
    leaf2 = packed(lp, 0.0).requires_grad_(True)
    torch.manual_seed(0)
    out2 = obj(leaf2, packed(old, 0.0), packed(adv, 0.0), packed_mask, counts=Counts.of(packed_mask, max_len=9))
    out2.loss.backward()
    torch.testing.assert_close(out.loss, out2.loss)
    torch.testing.assert_close(leaf.grad[mask], leaf2.grad[packed_mask])
    for key in out.metrics:
        torch.testing.assert_close(out.metrics[key], out2.metrics[key], msg=key)


def test_gspo_token_with_per_turn_advantages_follows_its_formula():
    """ℓ_i = (1/|y_i|) Σ_t −min(s_i Â_t, clip(s_i) Â_t), ∂ℓ_i/∂logp_t = −s_i Â_t / |y_i| where unclipped;
    with one advantage per row it equals GSPO in value and gradient."""
    lp, old, adv, mask = multi_turn_batch(1)
    obj = get_objective("gspo_token", clip_low=0.2, clip_high=0.2)
    leaf = lp.clone().requires_grad_(True)
    out = obj(leaf, old, adv, mask, counts=Counts.of(mask))
    out.loss.backward()
    n = mask.sum(1)
    s = torch.exp(((lp - old) * mask).sum(1) / n)
    a = torch.where(mask, adv, 0.0)
    per_token = -torch.minimum(s[:, None] * a, s[:, None].clamp(0.8, 1.2) * a)
    expected = ((per_token * mask).sum(1) / n).mean()
    torch.testing.assert_close(out.loss, expected)
    unclipped = ((s > 0.8) & (s < 1.2))[:, None] & mask
    torch.testing.assert_close(leaf.grad[unclipped], (-s[:, None] * a / n[:, None] / 4).expand_as(a)[unclipped])
    row_adv = torch.randn(4)
    grads = []
    for name in ("gspo", "gspo_token"):
        leaf = lp.clone().requires_grad_(True)
        o = get_objective(name, clip_low=0.2, clip_high=0.2)(
            leaf, old, row_adv[:, None].expand(4, 9), mask, counts=Counts.of(mask)
        )
        o.loss.backward()
        grads.append((o.loss.detach(), leaf.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])


# ---------------------------------------------------------------- per-turn credit


def rollout_of(turns: list[list[int]], rewards: list[list[float]]) -> RolloutBatch:
    """A rollout whose row i has replies of ``turns[i]`` tokens (one environment token between replies)."""
    width = max(sum(t) + len(t) - 1 for t in turns)
    mask = torch.zeros(len(turns), width, dtype=torch.bool)
    turn_ids = torch.zeros(len(turns), width, dtype=torch.long)
    token_rewards = torch.zeros(len(turns), width)
    for i, (lengths, rs) in enumerate(zip(turns, rewards)):
        t = 0
        for k, (n, r) in enumerate(zip(lengths, rs)):
            mask[i, t : t + n] = True
            turn_ids[i, t : t + n + 1] = k
            token_rewards[i, t + n - 1] = r
            t += n + 1
    return RolloutBatch(
        input_ids=torch.zeros(len(turns), width + 1, dtype=torch.long),
        attention_mask=torch.ones(len(turns), width + 1, dtype=torch.long),
        prompt_length=1,
        completion_mask=mask,
        rewards=token_rewards.sum(1),
        turn_ids=turn_ids,
        token_rewards=token_rewards,
    )


def test_turn_group_normalized_by_hand():
    """Group of 3: returns-to-go per turn, normalised among the episodes that reached that turn."""
    r = rollout_of([[2, 1], [1], [1, 2]], [[-0.2, 1.0], [1.0], [-0.2, 0.5]])
    adv = TurnGroupNormalized()(r, 3)
    first = torch.tensor([0.8, 1.0, 0.3])  # G_{i,1}
    first = (first - first.mean()) / (first.std() + 1e-6)
    second = torch.tensor([1.0, 0.5])
    second = (second - second.mean()) / (second.std() + 1e-6)
    expected = torch.zeros_like(adv)
    expected[0, :2], expected[0, 3] = first[0], second[0]
    expected[1, 0] = first[1]
    expected[2, 0], expected[2, 2:4] = first[2], second[1]
    torch.testing.assert_close(adv, expected)


def test_turn_group_normalized_is_group_normalized_for_single_turn_episodes():
    r = rollout_of([[2], [3], [1], [1], [2], [2]], [[0.1], [0.7], [0.2], [1.0], [1.0], [1.0]])
    adv = TurnGroupNormalized()(r, 3)
    expected = GroupNormalized()(r, 3)[:, None] * r.completion_mask
    torch.testing.assert_close(adv, expected)
    assert (adv[3:] == 0).all()  # an all-equal group carries no signal


def test_gae_skips_environment_tokens():
    """Multi-turn GAE equals GAE on the replies packed into one sequence, the rewards on each reply's end."""
    r = rollout_of([[2, 2], [3]], [[0.5, 1.0], [0.3]])
    r.old_values = torch.randn(r.completion_mask.shape, generator=torch.Generator().manual_seed(0))
    adv = GAE(gamma=0.9, lam=0.8, whiten=False)(r, 1)
    packed_values = torch.stack([r.old_values[0, [0, 1, 3, 4]], torch.cat([r.old_values[1, :3], torch.zeros(1)])])
    packed_rewards = torch.tensor([[0, 0.5, 0, 1.0], [0, 0, 0.3, 0]])
    packed_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    expected, returns = gae(packed_rewards, packed_values, packed_mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv[0, [0, 1, 3, 4]], expected[0])
    torch.testing.assert_close(adv[1, :3], expected[1, :3])
    assert adv[0, 2] == 0 and r.returns[0, 2] == 0
    torch.testing.assert_close(r.returns[0, [0, 1, 3, 4]], returns[0])


# ---------------------------------------------------------------- the learner on multi-turn batches


def multi_turn_rollout(policy, tok):
    torch.manual_seed(3)
    rollout, _, _ = collector(tok, RetryWithFeedback(max_turns=3), G=3, max_new=4).sample(policy, ROWS * 2)
    assert (
        rollout.turn_ids is not None
        and (~rollout.completion_mask & rollout.attention_mask[:, rollout.prompt_length :].bool()).any()
    )
    rollout.rewards = torch.tensor([0.1, 0.9, 0.4] * 4)
    rollout.token_rewards = torch.zeros_like(rollout.token_rewards)
    last = rollout.completion_mask.long().cumsum(1).argmax(1)
    rollout.token_rewards[torch.arange(len(rollout)), last] = rollout.rewards
    return rollout.trimmed()


@pytest.mark.parametrize(
    "split",
    [dict(micro_batch_size=1), dict(micro_batch_tokens=40), dict(micro_batch_size=2, share_prompt_forward=False)],
)
def test_multi_turn_updates_are_split_and_padding_invariant(tiny, split):
    """Micro-batches of one row, a token budget, or two rows without shared prompt forwards, and
    extra padding columns, give the update of the whole batch."""
    policy, tok = tiny
    rollout = multi_turn_rollout(policy, tok)
    padded = copy.deepcopy(rollout)
    extra = 5
    padded.input_ids = torch.cat([padded.input_ids, torch.zeros(len(padded), extra, dtype=torch.long)], 1)
    padded.attention_mask = torch.cat([padded.attention_mask, torch.zeros(len(padded), extra, dtype=torch.long)], 1)
    for name in ("completion_mask", "turn_ids", "token_rewards"):
        value = getattr(padded, name)
        setattr(padded, name, torch.cat([value, torch.zeros(len(padded), extra, dtype=value.dtype)], 1))
    results = []
    for cfg, batch in ((Update(), rollout), (Update(**split), rollout), (Update(), padded)):
        learner = Learner(
            copy.deepcopy(policy),
            get_objective("gspo_token", clip_low=0.05, clip_high=0.05),
            Update(**{**cfg.__dict__, "skip_zero_advantage_rows": False}),
            max_len=12,
            group_size=3,
        )
        batch = copy.deepcopy(batch)
        learner.snapshot(batch)
        batch.advantages = TurnGroupNormalized()(batch, 3)
        torch.manual_seed(1)
        opt = torch.optim.SGD(learner.policy.parameters(), lr=0.5)
        learner.learn(batch, opt)
        results.append(list(learner.policy.parameters()))
    for other in results[1:]:
        for p, q in zip(results[0], other):
            torch.testing.assert_close(p, q, rtol=0, atol=2e-6)
    assert any(not torch.equal(p, q) for p, q in zip(policy.parameters(), results[0]))


# ---------------------------------------------------------------- demonstrations for the warm start


def test_a_tool_demonstration_is_the_replies_with_the_tools_real_answers_between_them():
    from lit_gspo.models.tokenizer import char_tokenizer
    from lit_gspo.rl.envs import ToolUse
    from lit_gspo.rl.warm_start import demonstration_batch

    tok = char_tokenizer()
    env = ToolUse(
        call_format="plain", chat_template=False, demonstration=['CALL calculator("{expression}")', "{answer}"]
    )
    row = {"prompt": "12*34=", "answer": "408", "expression": "12 * 34"}
    batch = demonstration_batch(
        env,
        tok,
        [row, {"prompt": "2*3=", "answer": "6", "expression": "2 * 3"}],
        [tok("12*34=")["input_ids"], tok("2*3=")["input_ids"]],
    )
    P = batch.prompt_length
    real = batch.attention_mask[0, P:].bool()
    text = tok.decode(batch.input_ids[0, P:][real])
    call, result = 'CALL calculator("12 * 34")<eos>', env.call_format.results_text(["408"])
    assert text == call + result + "408<eos>"
    expected_mask = [True] * len(call.replace("<eos>", "x")) + [False] * len(result) + [True] * 4
    assert batch.completion_mask[0][real].tolist() == expected_mask
    single = demonstration_batch(RetryWithFeedback(), tok, [row], [tok("12*34=")["input_ids"]])
    assert tok.decode(single.input_ids[0, single.prompt_length :]) == "408<eos>" and single.completion_mask.all()
    with pytest.raises(
        ValueError, match=r"names the column 'operands'.*columns are \['answer', 'expression', 'prompt'\]"
    ):
        ToolUse(demonstration=["{operands}"]).demonstration(row)
    # any environment takes templates (the hidden-rule config demonstrates the string as shown, not the answer)
    assert RetryWithFeedback(demonstration=["{string}"]).demonstration({"answer": "283", "string": "382"}) == ["382"]
    with pytest.raises(ValueError, match="a list of reply templates, got the string '{answer}'"):
        RetryWithFeedback(demonstration="{answer}")


def test_the_multi_turn_quickstart_fits_and_logs_success_per_turn(tmp_path):
    """`lit-gspo fit --config configs/multiturn/reversal_retry.yaml` end to end, a few steps."""
    import csv
    from pathlib import Path

    from lit_gspo.tools.main import cli_main

    config = Path(__file__).resolve().parents[1] / "configs" / "multiturn" / "reversal_retry.yaml"
    cli = cli_main(
        [
            "fit",
            "--config",
            str(config),
            "--trainer.max_steps",
            "2",
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
        ]
    )
    assert cli.trainer.global_step == 2
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    train = [r for r in rows if r.get("train/reward")]
    val = [r for r in rows if r.get("val/reward")]
    assert len(train) == 2 and len(val) == 2
    for r in train:
        assert 1 <= float(r["train/turns"]) <= 3 and float(r["train/reached_turn1"]) == 1.0
        assert 0 <= float(r["train/success_turn1"]) <= 1
    assert all(0 <= float(r["val/success"]) <= 1 and 1 <= float(r["val/turns"]) <= 3 for r in val)


def test_episode_stats_by_hand():
    """4 episodes: right at turn 1; wrong then right; wrong, wrong, right; wrong three times (max_turns 3)."""
    from lit_gspo.rl.collect.episodes import Episode, episode_stats
    from lit_gspo.rl.envs import Turn

    def episode(*successes):
        e = Episode(row={}, state={}, budget=10)
        e.replies = ["x"] * len(successes)
        e.turns = [
            Turn(observation=None if i == len(successes) - 1 else "o", done=i == len(successes) - 1, success=ok)
            for i, ok in enumerate(successes)
        ]
        return e

    stats = episode_stats(
        [episode(True), episode(False, True), episode(False, False, True), episode(False, False, False)]
    )
    assert stats["turns"] == (1 + 2 + 3 + 3) / 4
    assert (stats["success_turn1"], stats["success_turn2"], stats["success_turn3"]) == (1 / 4, 1 / 3, 1 / 2)
    assert (stats["reached_turn1"], stats["reached_turn2"], stats["reached_turn3"]) == (1.0, 3 / 4, 2 / 4)
    assert stats["success"] == 3 / 4
    assert stats["success_after_feedback"] == 2 / 3  # of the 3 episodes that got feedback, 2 were solved later
    assert "success_after_feedback" not in episode_stats([episode(True), episode(False)])  # no one got feedback
