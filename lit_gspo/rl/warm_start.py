"""A supervised warm start: teacher-forced demonstrations so RL starts from a policy that knows the format.

A demonstration is the environment's (``Environment.demonstration(row)``): by default the row's answer;
for a multi-turn environment the replies of a whole episode, with the environment's real answers
between them (loss mask 0), built exactly as the collector builds a sampled episode.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

from lit_gspo.models import module_mode
from lit_gspo.rl.collect.episodes import Episode, assemble, step_all
from lit_gspo.rl.config import WarmStart
from lit_gspo.rl.envs import Environment, SingleTurn
from lit_gspo.rl.rollout import RolloutBatch, left_pad, token_logprobs
from lit_gspo.rl.stop_strings import StopStrings


def warm_start(
    policy: nn.Module,
    tokenizer,
    rows: list[dict],
    encode: Callable[[list[dict]], list[list[int]]],
    cfg: WarmStart,
    seed: int,
    environment: Environment | None = None,
    end_id: int | None = None,
    stop: StopStrings | None = None,
) -> float:
    """``cfg.steps`` AdamW steps of −mean log π(demonstrated replies + end | prompt, observations) on random rows
    that have a demonstration; returns the last loss. ``end_id``: the token a reply ends with (the collector's first
    stop id: the chat template's turn closing where prompts use it); None: the tokenizer's eos. ``stop``: the run's
    stop strings (:func:`demonstration_batch`)."""
    environment = environment or SingleTurn()
    rows = [r for r in rows if environment.demonstration(r) is not None]
    if not rows:
        raise ValueError(
            f"warm_start needs training rows with a demonstration ({type(environment).__name__}: "
            "by default an 'answer' column); the training data has none"
        )
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr)
    generator = torch.Generator().manual_seed(seed)
    device = next(p for p in policy.parameters()).device
    loss = torch.zeros(())
    with module_mode(policy, training=True):  # supervised: dropout (a LoRA adapter's too) as in any fine-tune
        for _ in range(cfg.steps):
            pick = torch.randint(len(rows), (cfg.batch_size,), generator=generator)
            chosen = [rows[int(i)] for i in pick]
            batch = demonstration_batch(environment, tokenizer, chosen, encode(chosen), end_id, stop).to(device)
            logp = token_logprobs(policy, batch).logprobs
            loss = -(logp * batch.completion_mask).sum() / batch.completion_mask.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    opt.zero_grad()  # the last gradients are applied: not held on the device through the fit's first rollout
    return float(loss.detach())


def demonstration_batch(
    environment: Environment,
    tokenizer,
    rows: list[dict],
    prompt_ids: list[list[int]],
    end_id: int | None = None,
    stop: StopStrings | None = None,
) -> RolloutBatch:
    """Each row's demonstrated episode: its replies (loss mask 1) and the environment's answers (mask 0). A reply ends
    as a sampled one does: with the end token, or where it writes one of the ``stop`` strings, through the token that
    completes the first (what the demonstration writes after it is dropped: a sampled reply never gets there)."""
    end = tokenizer.eos_token_id if end_id is None else end_id
    if end is None:
        raise ValueError("a demonstration needs a token that ends a reply: the tokenizer has no eos and none was given")
    episodes = []
    for row in rows:
        replies = environment.demonstration(row)
        episode = Episode(row, environment.reset(row), budget=sys.maxsize)
        for k, reply in enumerate(replies):
            ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
            at_string = stop.end(ids) if stop is not None else None
            ids = ids[:at_string] if at_string is not None else ids + [end]
            text = reply if at_string is None else tokenizer.decode(ids, skip_special_tokens=True)
            episode.add_reply(ids, None, text)
            if k == len(replies) - 1:
                break
            step_all(environment, [episode], [text])
            if episode.done:
                raise ValueError(
                    f"{type(environment).__name__} ended the demonstration {replies!r} after reply {k + 1} "
                    f"on row {row!r}; a demonstration's replies must all be answered"
                )
            reply_end = "" if at_string is not None else tokenizer.decode([end])  # the stop token's text, as sampled
            episode.add_observation(environment.encode_observation(tokenizer, episode.turns[-1].observation, reply_end))
        episodes.append(episode)
    ids, attn = left_pad(prompt_ids, tokenizer.pad_token_id)
    prompts = RolloutBatch(
        input_ids=ids,
        attention_mask=attn,
        prompt_length=ids.shape[1],
        completion_mask=torch.zeros(len(rows), 0, dtype=torch.bool),
    )
    return assemble(prompts, episodes, tokenizer.pad_token_id)
