"""Multi-turn episodes, token in and token out: the policy's sampled ids and the environment's appended ids.

    row i:  prompt | reply 1 | observation 1 | reply 2 | … | reply K          (one token sequence)
    loss mask:  0  |    1    |       0       |    1    | … |    1
    turn_ids:      |    0    |       0       |    1    | … |   K−1

Every reply is the engine's sampled ids up to and including its first EOS; every observation is the
environment's text rendered and tokenised once (:meth:`Environment.encode_observation`). The next
turn samples on exactly these ids, so what is trained is what was sampled: nothing is re-tokenised.
An episode ends when the environment says done, after ``max_turns`` replies, or when its token
budget has no room for the next observation and one reply token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lit_gspo.rl.envs import Environment, Turn
from lit_gspo.rl.rollout import RolloutBatch
from lit_gspo.runtime.sample_stats import WEIGHT


@dataclass
class Episode:
    """One row's conversation so far: the segments after the first prompt, and what each turn returned."""

    row: dict
    state: dict
    budget: int  # tokens left after the first prompt
    ids: list[int] = field(default_factory=list)
    is_policy: list[bool] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    engine_logprobs: list[float] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    reply_ids: list[int] = field(default_factory=list)  # the last reply's ids
    turns: list[Turn] = field(default_factory=list)
    truncated: bool = False

    @property
    def done(self) -> bool:
        return self.truncated or bool(self.turns) and self.turns[-1].done

    def add_reply(self, ids: list[int], logprobs: list[float] | None, text: str) -> None:
        turn = len(self.replies)
        self.ids += ids
        self.is_policy += [True] * len(ids)
        self.turn_ids += [turn] * len(ids)
        self.engine_logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.replies.append(text)
        self.reply_ids = ids
        self.budget -= len(ids)

    def add_observation(self, ids: list[int]) -> None:
        self.ids += ids
        self.is_policy += [False] * len(ids)
        self.turn_ids += [len(self.replies) - 1] * len(ids)
        self.engine_logprobs += [0.0] * len(ids)
        self.budget -= len(ids)


def replies_of(batch: RolloutBatch) -> tuple[list[list[int]], list[list[float] | None]]:
    """Each row's sampled ids (through its first EOS) and, if the engine gave them, their log-probs (else None)."""
    P, mask = batch.prompt_length, batch.completion_mask
    ids = [row[m].tolist() for row, m in zip(batch.input_ids[:, P:], mask)]
    if batch.engine_logprobs is None:
        return ids, [None] * len(ids)
    return ids, [row[m].tolist() for row, m in zip(batch.engine_logprobs, mask)]


def step_all(environment: Environment, episodes: list[Episode], texts: list[str]) -> None:
    """The environment's answer to each episode's latest reply."""
    for episode, text in zip(episodes, texts):
        episode.state["turn"] = len(episode.replies)
        turn = environment.step(episode.row, text, episode.state)
        if not isinstance(turn, Turn):
            raise TypeError(
                f"{type(environment).__name__}.step must return a lit_gspo.rl.envs.Turn, got "
                f"{type(turn).__name__}: {turn!r}"
            )
        if turn.reward is not None and not isinstance(turn.reward, (int, float)):
            raise TypeError(
                f"{type(environment).__name__}.step returned reward={turn.reward!r} "
                f"({type(turn.reward).__name__}); a turn's reward is a float or None"
            )
        if not turn.done and turn.observation is None:
            raise ValueError(
                f"{type(environment).__name__}.step returned done=False without an observation: "
                "a continuing episode needs something for the policy to answer"
            )
        episode.turns.append(turn)


def assemble(first: RolloutBatch, episodes: list[Episode], pad_id: int) -> RolloutBatch:
    """The episodes as one rollout: the first batch's prompts, then each episode's segments, right-padded."""
    P, N = first.prompt_length, len(episodes)
    T = max(1, max(len(e.ids) for e in episodes))
    ids = torch.full((N, T), pad_id, dtype=torch.long)
    real = torch.zeros((N, T), dtype=torch.long)
    policy = torch.zeros((N, T), dtype=torch.bool)
    turn_ids = torch.zeros((N, T), dtype=torch.long)
    logprobs = torch.zeros((N, T), dtype=torch.float32)
    for i, e in enumerate(episodes):
        n = len(e.ids)
        ids[i, :n] = torch.tensor(e.ids, dtype=torch.long)
        real[i, :n] = 1
        policy[i, :n] = torch.tensor(e.is_policy)
        turn_ids[i, :n] = torch.tensor(e.turn_ids, dtype=torch.long)
        logprobs[i, :n] = torch.tensor(e.engine_logprobs, dtype=torch.float32)
    device = first.input_ids.device
    return RolloutBatch(
        input_ids=torch.cat([first.input_ids[:, :P], ids.to(device)], 1),
        attention_mask=torch.cat([first.attention_mask[:, :P], real.to(device)], 1),
        prompt_length=P,
        completion_mask=policy.to(device),
        engine_logprobs=None if first.engine_logprobs is None else logprobs.to(device),
        turn_ids=turn_ids.to(device),
    )


def episode_stats(episodes: list[Episode]) -> dict[str, float]:
    """Turns per episode, truncations, success per turn index (of the episodes that reached it) and after feedback
    (of the episodes that reached turn 2), summed metrics; the rates over a subset with its size (``sample_stats``)."""
    n = len(episodes)
    stats = {
        "turns": sum(len(e.replies) for e in episodes) / n,
        "truncated_episodes": sum(e.truncated or not e.turns[-1].done for e in episodes) / n,
    }
    for k in range(max(len(e.turns) for e in episodes)):
        known = [e.turns[k].success for e in episodes if len(e.turns) > k and e.turns[k].success is not None]
        if known:
            stats[f"success_turn{k + 1}"] = sum(known) / len(known)
            stats[WEIGHT + f"success_turn{k + 1}"] = float(len(known))
            stats[f"reached_turn{k + 1}"] = len(known) / n  # the share success_turn{k + 1} is a rate of
    if any(t.success is not None for e in episodes for t in e.turns):
        stats["success"] = sum(any(t.success for t in e.turns) for e in episodes) / n
        after_feedback = [any(t.success for t in e.turns[1:]) for e in episodes if len(e.turns) > 1]
        if after_feedback:  # of the episodes that got feedback, the share solved at a later turn
            stats["success_after_feedback"] = sum(after_feedback) / len(after_feedback)
            stats[WEIGHT + "success_after_feedback"] = float(len(after_feedback))
    keys = sorted({key for e in episodes for t in e.turns for key in t.metrics})
    for key in keys:
        stats[key] = sum(float(t.metrics.get(key, 0.0)) for e in episodes for t in e.turns) / n
    return stats
