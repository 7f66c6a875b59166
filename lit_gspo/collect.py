"""collect: Environment × RolloutEngine → scored trajectories, refilled when groups carry no signal.

    prompt ids  = environment.encode(rows)                      (rendered once, never truncated)
    rollout     = engine.sample(policy, prompt ids, G per prompt)
    rewards     = Σ_k w_k · reward_k(prompt, reply, **columns) + the environment's turn reward
    a sample a reward function failed on keeps its row (groups stay whole) with loss mask 0 and its
    group's mean valid reward, so it moves neither the group's mean nor anyone's advantage
    dynamic sampling: drop groups whose rewards are all equal, sample new prompts, ≤ max_rounds rounds
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from lit_gspo.config import Generation
from lit_gspo.engines import RolloutEngine
from lit_gspo.envs import Environment
from lit_gspo.rewards import RewardSet
from lit_gspo.rollout import RolloutBatch, concat_rollouts


class Collector:
    """Samples and scores rollouts for the trainer and for validation (greedy)."""

    def __init__(self, environment: Environment, engine: RolloutEngine, rewards: RewardSet, tokenizer,
                 generation: Generation, dynamic_sampling: bool = False, max_sampling_rounds: int = 4):
        if max_sampling_rounds < 1:
            raise ValueError(f"max_sampling_rounds must be >= 1, got {max_sampling_rounds}")
        self.environment, self.engine, self.rewards, self.tokenizer = environment, engine, rewards, tokenizer
        self.generation, self.dynamic_sampling, self.max_sampling_rounds = generation, dynamic_sampling, max_sampling_rounds

    def encode(self, policy: nn.Module, rows: list[dict]) -> list[list[int]]:
        """First-prompt ids of ``rows``, checked to leave room for the longest completion in the context."""
        g = self.generation
        new_tokens = max(g.max_new_tokens, g.val_max_new_tokens or 0)
        context = getattr(policy.config, "max_position_embeddings", None) or g.max_prompt_length + new_tokens
        if context - new_tokens < 1:
            raise ValueError(f"generation.max_new_tokens={new_tokens} leaves no room for a prompt in the "
                             f"model's context of {context} tokens")
        return self.environment.encode(self.tokenizer, rows, max_prompt_length=min(g.max_prompt_length, context - new_tokens))

    def sample(self, policy: nn.Module, rows: list[dict], *, greedy: bool = False, synced_gpus: bool = False
               ) -> tuple[RolloutBatch, list[str], dict[str, float]]:
        """Generate (G per prompt, or one greedy) and score; returns the batch, the replies and reward stats."""
        g = self.generation
        group = 1 if greedy else g.num_generations
        max_new_tokens = (g.val_max_new_tokens or g.max_new_tokens) if greedy else g.max_new_tokens
        pad_id = self.tokenizer.pad_token_id
        batch = self.engine.sample(policy, self.encode(policy, rows), num_generations=group,
                                   max_new_tokens=max_new_tokens, pad_id=pad_id, eos_id=self.tokenizer.eos_token_id,
                                   temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, greedy=greedy,
                                   synced_gpus=synced_gpus)
        completion_ids = batch.input_ids[:, batch.prompt_length:].masked_fill(~batch.completion_mask, pad_id)
        replies = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        episode_rows = [r for r in rows for _ in range(group)]
        turns = [self.environment.step(row, reply, {**self.environment.reset(row), "turn": 1}) for row, reply in zip(episode_rows, replies)]
        if not all(turn.done for turn in turns):
            raise NotImplementedError(f"{type(self.environment).__name__} continued an episode after the first reply; "
                                      "multi-turn episodes are not collected yet (single-turn environments only)")
        columns = {k: [r.get(k) for r in episode_rows] for k in rows[0] if k != "prompt"}
        columns["completion_lengths"] = batch.completion_mask.sum(1).tolist()
        columns["max_completion_length"] = max_new_tokens
        ids = [row[mask].tolist() for row, mask in zip(batch.input_ids[:, batch.prompt_length:], batch.completion_mask)]
        scores = self.rewards.score([r["prompt"] for r in episode_rows], replies, columns, completion_ids=ids)
        turn_rewards = torch.tensor([turn.reward or 0.0 for turn in turns], dtype=torch.float32)
        total = scores.total.float() + turn_rewards if any(turn.reward is not None for turn in turns) else scores.total.float()
        batch.rewards = fill_failed_with_group_mean(total, scores.valid, group)
        # a failed sample keeps its row (groups stay intact) but carries no gradient
        batch.completion_mask = batch.completion_mask & scores.valid[:, None]
        stats = {"reward_failed": float(scores.num_failed)}
        stats.update({f"reward/{name}": value for name, value in scores.means().items()})
        return batch, replies, stats

    def collect(self, policy: nn.Module, rows: list[dict], refill: Callable[[int], list[dict]], synced_gpus: bool = False
                ) -> tuple[RolloutBatch | None, dict[str, float]]:
        """Sample and score ``rows``; with dynamic sampling, drop all-equal groups and refill (bounded rounds).

        Returns the trimmed rollout (None when dynamic sampling kept no group) and the step's stats.
        """
        G = self.generation.num_generations
        kept, stats, rounds, zero_std, seen = [], {}, 0, 0, 0
        pending = rows
        while pending and rounds < (self.max_sampling_rounds if self.dynamic_sampling else 1):
            rounds += 1
            batch, _, round_stats = self.sample(policy, pending, synced_gpus=synced_gpus)
            stats = stats or round_stats
            rewards = batch.rewards.view(-1, G)
            constant = (rewards == rewards[:, :1]).all(1)  # (groups,)
            zero_std += int(constant.sum())
            seen += constant.numel()
            if self.dynamic_sampling:
                keep_groups = (~constant).nonzero().flatten()
                batch = batch.select((keep_groups[:, None] * G + torch.arange(G)).flatten())
            kept.append(batch)
            missing = len(rows) - sum(len(b) for b in kept) // G
            pending = refill(missing) if missing > 0 and self.dynamic_sampling else []
        non_empty = [b for b in kept if len(b)]
        rollout = concat_rollouts(non_empty, self.tokenizer.pad_token_id) if non_empty else None
        stats.update(frac_zero_std_groups=zero_std / max(seen, 1), sampling_rounds=float(rounds))
        if rollout is None:
            stats.update(reward=float("nan"), response_length=float("nan"))
            return None, stats
        all_rewards = torch.cat([b.rewards for b in kept])
        stats.update(reward=float(rollout.rewards.mean()), reward_std=float(rollout.rewards.std()) if len(rollout) > 1 else 0.0,
                     response_length=float(rollout.completion_mask.sum(1).float().mean()),
                     reward_all_groups=float(all_rewards.mean()))
        return rollout.trimmed(), stats


def fill_failed_with_group_mean(rewards: Tensor, valid: Tensor, group: int) -> Tensor:
    """A failed sample takes its group's mean valid reward, so it shifts neither mean nor advantages."""
    r, ok = rewards.view(-1, group), valid.view(-1, group)
    mean = (r * ok).sum(1, keepdim=True) / ok.sum(1, keepdim=True).clamp(min=1)
    return torch.where(ok, r, mean).flatten()
