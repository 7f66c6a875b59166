"""collect: Environment × RolloutEngine → scored episodes, refilled when groups carry no signal.

prompt ids  = environment.encode(rows)                      (rendered once, never truncated)
episodes    = engine.sample(policy, prompt ids, G per prompt), then, while the environment answers
              and max_turns allows, its observation appended and the next reply sampled (lit_gspo.rl.collect.episodes)
rewards     = Σ_k w_k · reward_k(prompt, last reply, **columns) + Σ_turns the environment's turn reward
              (TRL's reward contract: chat prompts give message-list completions; the first scoring
              of a run fails at once when a reward function fails as a whole: RewardSet.score strict)
a sample a reward function failed on keeps its row (groups stay whole) with loss mask 0 and its
group's mean valid reward, so it moves neither the group's mean nor anyone's advantage
dynamic sampling: drop groups whose rewards are all equal, sample new prompts, ≤ max_rounds rounds"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from lit_gspo.data.prompts import prompt_length_limit
from lit_gspo.rl.collect.episodes import Episode, assemble, episode_stats, replies_of, step_all
from lit_gspo.rl.config import Generation
from lit_gspo.rl.engines import RolloutEngine
from lit_gspo.rl.envs import Environment
from lit_gspo.rl.rewards import RewardSet, TrainerState, conversation_completions
from lit_gspo.rl.rewards.decoupled import group_decoupled_sum
from lit_gspo.rl.rollout import RolloutBatch, concat_rollouts
from lit_gspo.rl.stop_strings import StopStrings
from lit_gspo.rl.stop_tokens import environment_stop_ids
from lit_gspo.runtime.collectives import any_rank
from lit_gspo.runtime.sample_stats import WEIGHT, merge_stats, weighted
from lit_gspo.runtime.user_errors import option


class Collector:
    """Samples and scores rollouts for the trainer and for validation (greedy).

    Attributes:
        trainer_state: what the reward functions get as ``trainer_state`` (TRL's input for curricula); the
            trainer updates it every step. None: a default ``TrainerState()`` (step 0, max_steps 0).
        last_extra: the ``log_extra(column, values)`` columns of the last scoring (column → one value per sample).
        last_per_function: each reward function's unweighted scores of the last scoring (name → one per sample, NaN
            where it failed or gave None).
    """

    def __init__(
        self,
        environment: Environment,
        engine: RolloutEngine,
        rewards: RewardSet,
        tokenizer,
        generation: Generation,
        dynamic_sampling: bool = False,
        max_sampling_rounds: int = 4,
        engine_logprobs: bool = False,
        param_dtype: torch.dtype | None = None,
        stop_ids: list[int] | None = None,
    ):
        if max_sampling_rounds < 1:
            raise ValueError(f"max_sampling_rounds must be >= 1, got {max_sampling_rounds}")
        self.environment, self.engine, self.rewards, self.tokenizer = environment, engine, rewards, tokenizer
        self.generation, self.dynamic_sampling, self.max_sampling_rounds = (
            generation,
            dynamic_sampling,
            max_sampling_rounds,
        )
        self.engine_logprobs = engine_logprobs  # keep the sampler's log-probs of sampled tokens (mismatch correction)
        self.param_dtype = param_dtype  # the update's (``update.param_dtype``): the sampler reads the parameters so too
        # where a reply ends (lit_gspo.rl.stop_tokens); None: those the tokenizer and the chat template name
        self.stop_ids = environment_stop_ids(tokenizer, environment) if stop_ids is None else list(stop_ids)
        self.stop_strings = StopStrings(tokenizer, generation.stop) if generation.stop else None
        self.trainer_state: TrainerState | None = None
        self.last_extra: dict[str, list] = {}
        self.last_per_function: dict[str, list[float]] = {}
        self._scored = False  # the first scoring of the run is strict: a reward that fails as a whole stops it
        self._warned_long_observation = False

    def encode(self, policy: nn.Module, rows: list[dict]) -> list[list[int]]:
        """First-prompt ids of ``rows``, checked to leave room for the longest completion in the context."""
        g = self.generation
        new_tokens = max(g.max_new_tokens, g.val_max_new_tokens or 0)
        context = _context_length(policy, g)
        if context - new_tokens < 1:
            limit = prompt_length_limit(g, context)
            raise ValueError(
                f"{option(limit.new_tokens_setting, new_tokens)} leaves no room for a prompt in the "
                f"model's context of {context} tokens"
            )
        return self.environment.encode(self.tokenizer, rows, max_prompt_length=prompt_length_limit(g, context))

    def sample(
        self, policy: nn.Module, rows: list[dict], *, greedy: bool = False, synced_gpus: bool = False
    ) -> tuple[RolloutBatch, list[str], dict[str, float]]:
        """Run the episodes of ``rows`` (G per row, or one greedy) and score them.

        Returns the batch, each episode's last reply and the step's stats.
        """
        g, env = self.generation, self.environment
        group = 1 if greedy else g.num_generations
        max_new_tokens = g.validation_budget if greedy else g.max_new_tokens
        prompt_ids = self.encode(policy, rows)
        batch = self._generate(policy, prompt_ids, group, max_new_tokens, greedy, synced_gpus)
        pad_id = self.tokenizer.pad_token_id
        completion_ids = batch.input_ids[:, batch.prompt_length :].masked_fill(~batch.completion_mask, pad_id)
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        episode_rows = [r for r in rows for _ in range(group)]
        context = _context_length(policy, self.generation)
        episodes = [
            Episode(row, env.reset(row), budget=min(env.max_episode_tokens or context, context - len(ids)))
            for row, ids in zip(episode_rows, (p for p in prompt_ids for _ in range(group)))
        ]
        for episode, ids, logprobs, text in zip(episodes, *replies_of(batch), texts):
            episode.add_reply(ids[: episode.budget], None if logprobs is None else logprobs[: episode.budget], text)
        step_all(env, episodes, texts)
        if env.max_turns > 1:
            self._continue_episodes(
                policy, episodes, [p for p in prompt_ids for _ in range(group)], max_new_tokens, greedy, synced_gpus
            )
            batch = assemble(batch, episodes, pad_id)
        for episode in episodes:
            episode.truncated = episode.truncated or not episode.done
        batch.rewards, batch.token_rewards, stats = self._score(batch, episodes, group, max_new_tokens)
        return batch, [e.replies[-1] for e in episodes], stats

    def generate_nothing(self, policy: nn.Module, greedy: bool, synced_gpus: bool) -> None:
        """One token after a pad token, not used: under sharded parameters (``synced_gpus``) every rank must generate as
        often as the others (each forward gathers the parameters from all ranks), also where it has nothing to sample."""
        self._generate(policy, [[self.tokenizer.pad_token_id]], 1, 1, greedy, synced_gpus)

    def _generate(
        self,
        policy: nn.Module,
        prompt_ids: list[list[int]],
        group: int,
        max_new_tokens: int,
        greedy: bool,
        synced_gpus: bool,
    ) -> RolloutBatch:
        g = self.generation
        return self.engine.sample(
            policy,
            prompt_ids,
            num_generations=group,
            max_new_tokens=max_new_tokens,
            pad_id=self.tokenizer.pad_token_id,
            eos_id=self.stop_ids,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            min_p=g.min_p,
            repetition_penalty=g.repetition_penalty,
            greedy=greedy,
            synced_gpus=synced_gpus,
            return_logprobs=self.engine_logprobs and not greedy,
            param_dtype=self.param_dtype,
            stop=self.stop_strings,
        )

    def _continue_episodes(
        self,
        policy: nn.Module,
        episodes: list[Episode],
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        greedy: bool,
        synced_gpus: bool,
    ) -> None:
        """Turns 2..max_turns: append each observation, sample the next reply on exactly the ids so far."""
        env, tok = self.environment, self.tokenizer
        for turn in range(2, env.max_turns + 1):
            active, contexts = [], []
            for i, episode in enumerate(episodes):
                if episode.done:
                    continue
                last = episode.reply_ids[-1:]
                reply_end = tok.decode(last) if last and last[0] in self.stop_ids else ""  # a stop token's text
                ids = env.encode_observation(tok, episode.turns[-1].observation, reply_end=reply_end)
                if len(ids) + 1 > episode.budget:  # no room for the observation and one reply token: the episode ends
                    episode.truncated = True
                    if len(ids) + 1 > episode.budget + len(episode.ids) and not self._warned_long_observation:
                        self._warned_long_observation = True  # longer than any episode could hold: say so, once
                        warnings.warn(
                            f"{type(env).__name__} returned an observation of {len(ids)} tokens at turn {turn}; the "
                            f"episode's whole budget is {episode.budget + len(episode.ids)} tokens after the first prompt "
                            f"(max_episode_tokens={env.max_episode_tokens}, context "
                            f"{_context_length(policy, self.generation)}): such episodes end there, truncated "
                            "(train/truncated_episodes counts them). Shorten the observation or raise the budget",
                            RuntimeWarning,
                            stacklevel=2,
                        )
                    continue
                episode.add_observation(ids)
                active.append(episode)
                contexts.append(prompt_ids[i] + episode.ids)
            if not active and not synced_gpus:
                break
            if not active:
                self.generate_nothing(policy, greedy, synced_gpus)
                continue
            batch = self._generate(
                policy, contexts, 1, min(max_new_tokens, max(e.budget for e in active)), greedy, synced_gpus
            )
            for episode, ids, logprobs in zip(active, *replies_of(batch)):
                ids = ids[: episode.budget]
                episode.add_reply(
                    ids, None if logprobs is None else logprobs[: len(ids)], tok.decode(ids, skip_special_tokens=True)
                )
            step_all(env, active, [e.replies[-1] for e in active])

    def ended(self, episode: Episode) -> bool:
        """Whether the episode's last reply ended at a stop id or a stop string (not cut by the token budget)."""
        if not episode.reply_ids:
            return False
        if episode.reply_ids[-1] in self.stop_ids:
            return True
        return self.stop_strings is not None and self.stop_strings.found(episode.reply_ids)

    def _score(
        self, batch: RolloutBatch, episodes: list[Episode], group: int, max_new_tokens: int
    ) -> tuple[Tensor, Tensor | None, dict[str, float]]:
        """Episode rewards: the reward functions' score of the last reply plus every turn's own reward.

        A sample a reward function failed on keeps its row (groups stay whole) with loss mask 0 and its
        group's mean valid reward. Multi-turn batches also get each reply's reward on its last token.
        """
        rows = [e.row for e in episodes]
        columns = {k: [r.get(k) for r in rows] for k in rows[0] if k != "prompt"}
        columns["completion_lengths"] = [len(e.reply_ids) for e in episodes]
        columns["max_completion_length"] = max_new_tokens
        columns["turns"] = [len(e.replies) for e in episodes]
        columns["replies"] = [list(e.replies) for e in episodes]
        prompts = [r["prompt"] for r in rows]
        completions = conversation_completions(
            prompts, [e.replies for e in episodes], [[t.observation for t in e.turns] for e in episodes]
        )
        scores = self.rewards.score(
            prompts,
            completions,
            columns,
            completion_ids=[e.reply_ids for e in episodes],
            trainer_state=self.trainer_state,
            strict=not self._scored,
        )
        self._scored = True
        self.last_extra = scores.extra
        self.last_per_function = {name: values.tolist() for name, values in scores.per_function.items()}
        turn_rewards = [[float(t.reward or 0.0) for t in e.turns] for e in episodes]
        total = scores.total.float()
        if any(t.reward is not None for e in episodes for t in e.turns):
            total = total + torch.tensor([sum(r) for r in turn_rewards], dtype=torch.float32)
        device = batch.completion_mask.device
        rewards = fill_failed_with_group_mean(total, scores.valid, group)  # on the CPU, like the reward functions
        per_function = torch.stack([scores.per_function[name] for name in self.rewards.names], 1)
        per_function = per_function.masked_fill(~scores.valid[:, None], float("nan"))  # a failed sample: in no mean
        decoupled = group_decoupled_sum(per_function, torch.tensor(self.rewards.weights), group)
        batch.decoupled_rewards = decoupled.to(device)  # what the GDPO estimator reads
        # a failed sample keeps its row (groups stay intact) but carries no gradient
        batch.completion_mask = batch.completion_mask & scores.valid[:, None].to(device)
        token_rewards = None
        if batch.turn_ids is not None:
            token_rewards = torch.zeros(batch.turn_ids.shape, dtype=torch.float32)
            for i, e in enumerate(episodes):
                turn_rewards[i][-1] += float(rewards[i]) - sum(turn_rewards[i])  # the reward functions' (filled) share
                last_token = {turn: t for t, (turn, policy) in enumerate(zip(e.turn_ids, e.is_policy)) if policy}
                for turn, t in last_token.items():
                    token_rewards[i, t] = turn_rewards[i][turn]
            token_rewards = token_rewards.to(batch.turn_ids.device)
        # TRL's completions/clipped_ratio: the share of last replies cut by the token budget, not ended by a stop id
        batch.truncated = torch.tensor([not self.ended(e) for e in episodes], device=device)
        stats = {"reward_failed": float(scores.num_failed), "clipped_ratio": float(batch.truncated.float().mean())}
        stats.update(per_function_stats(scores.per_function))
        stats.update({name: value for name, value in scores.metrics.items() if name not in stats})  # log_metric
        if self.environment.max_turns > 1:
            stats.update(episode_stats(episodes))
        weighted(stats, len(episodes))  # means over this call's samples
        return rewards.to(device), token_rewards, stats  # the advantages are computed where the rollout lives

    def rollout(
        self,
        policy: nn.Module,
        rows: list[dict],
        refill: Callable[[int], list[dict]],
        trainer_state: TrainerState | None,
        synced_gpus: bool = False,
    ) -> tuple[RolloutBatch | None, dict[str, float]]:
        """One RL step's rollout: ``policy``'s weights to the engine, then :meth:`collect`; with ``time/rollout_s`` (and
        ``time/weight_sync_s`` for an engine with its own copy of the weights, as vLLM's)."""
        start = time.perf_counter()
        self.trainer_state = trainer_state
        self.engine.sync_weights(policy)
        sync_s = self.engine.last_sync_s
        rollout, stats = self.collect(policy, rows, refill, synced_gpus=synced_gpus)
        stats["time/rollout_s"] = time.perf_counter() - start
        if sync_s is not None:
            stats["time/weight_sync_s"] = sync_s
        return rollout, stats

    def collect(
        self, policy: nn.Module, rows: list[dict], refill: Callable[[int], list[dict]], synced_gpus: bool = False
    ) -> tuple[RolloutBatch | None, dict[str, float]]:
        """Sample and score ``rows``; with dynamic sampling, drop all-equal groups and refill (bounded rounds).

        Returns the trimmed rollout (None when dynamic sampling kept no group) and the step's stats.
        """
        G = self.generation.num_generations
        kept, sampled, round_stats, rounds, zero_std, seen = [], [], [], 0, 0, 0
        pending = rows
        for _ in range(self.max_sampling_rounds if self.dynamic_sampling else 1):
            if not (any_rank(bool(pending)) if synced_gpus else pending):
                break
            if not pending:  # others refill: under sharded parameters this rank generates with them
                self.generate_nothing(policy, False, synced_gpus)
                continue
            rounds += 1
            batch, _, stats = self.sample(policy, pending, synced_gpus=synced_gpus)
            round_stats.append(stats)
            sampled.append(batch.rewards)
            rewards = batch.rewards.view(-1, G)
            constant = (rewards == rewards[:, :1]).all(1)  # (groups,)
            zero_std += int(constant.sum())
            seen += constant.numel()
            if self.dynamic_sampling:
                keep_groups = (~constant).nonzero().flatten()
                batch = batch.select((keep_groups[:, None] * G + torch.arange(G, device=keep_groups.device)).flatten())
            kept.append(batch)
            missing = len(rows) - sum(len(b) for b in kept) // G
            pending = refill(missing) if missing > 0 and self.dynamic_sampling else []
        non_empty = [b for b in kept if len(b)]
        rollout = concat_rollouts(non_empty, self.tokenizer.pad_token_id) if non_empty else None
        all_rewards = torch.cat(sampled)  # the groups dynamic sampling dropped too
        stats = merge_stats(round_stats)  # the samples' stats: of every round's
        stats.update(
            frac_zero_std_groups=zero_std / max(seen, 1),
            sampling_rounds=float(rounds),
            reward_all_groups=float(all_rewards.mean()),
            **{WEIGHT + "frac_zero_std_groups": float(seen), WEIGHT + "reward_all_groups": float(len(all_rewards))},
        )
        if rollout is None:
            stats.update(reward=float("nan"), response_length=float("nan"))
            return None, stats
        stats.update(
            reward=float(rollout.rewards.mean()),
            reward_std=float(rollout.rewards.std()) if len(rollout) > 1 else 0.0,
            response_length=float(rollout.completion_mask.sum(1).float().mean()),
        )
        return rollout.trimmed(), stats


def _context_length(policy: nn.Module, generation: Generation) -> int:
    return (
        getattr(policy.config, "max_position_embeddings", None)
        or generation.max_prompt_length + generation.max_new_tokens
    )


def fill_failed_with_group_mean(rewards: Tensor, valid: Tensor, group: int) -> Tensor:
    """A failed sample takes its group's mean valid reward, so it shifts neither mean nor advantages."""
    r, ok = rewards.view(-1, group), valid.view(-1, group)
    mean = (r * ok).sum(1, keepdim=True) / ok.sum(1, keepdim=True).clamp(min=1)
    return torch.where(ok, r, mean).flatten()


def per_function_stats(per_function: dict[str, Tensor]) -> dict[str, float]:
    """``rewards/<function>/mean`` and ``rewards/<function>/std`` (Bessel-corrected) of each reward function's fp32
    scores over the samples it scored (NaN: a mean of none, a std of fewer than two), as TRL's GRPOTrainer names and
    computes them. No such key is also the folder of another (``reward``, the weighted sum, is a sibling of
    ``rewards/``), which MLflow's file store and TensorBoard's tag tree need. Each mean comes with how many samples it
    is over, so that several rounds' and ranks' merge into the stats of all their samples (``runtime/sample_stats.py``).
    """
    out = {}
    for name, values in per_function.items():
        scored = values[torch.isfinite(values)]
        out[f"rewards/{name}/mean"] = float(scored.mean()) if len(scored) else float("nan")
        out[f"rewards/{name}/std"] = float(scored.std()) if len(scored) > 1 else float("nan")
        out[WEIGHT + f"rewards/{name}/mean"] = float(len(scored))
    return out
