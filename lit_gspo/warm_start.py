"""A supervised warm start: teacher-forced (prompt, answer) steps so RL starts from a policy that knows the format."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lit_gspo.config import WarmStart
from lit_gspo.rollout import RolloutBatch, left_pad, token_logprobs


def warm_start(policy: nn.Module, tokenizer, rows: list[dict], encode: Callable[[list[dict]], list[list[int]]],
               cfg: WarmStart, seed: int) -> float:
    """``cfg.steps`` AdamW steps of −mean log π(answer + EOS | prompt) on random rows with an ``answer``; returns the last loss."""
    rows = [r for r in rows if r.get("answer") is not None]
    if not rows:
        raise ValueError("warm_start needs training rows with an 'answer' column; the training data has none")
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr)
    generator = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    policy.train()
    loss = torch.zeros(())
    for _ in range(cfg.steps):
        pick = torch.randint(len(rows), (cfg.batch_size,), generator=generator)
        chosen = [rows[int(i)] for i in pick]
        answers = [tokenizer(str(r["answer"]), add_special_tokens=False)["input_ids"] + [eos] for r in chosen]
        batch = teacher_forcing_batch(encode(chosen), answers, tokenizer.pad_token_id)
        logp = token_logprobs(policy, batch).logprobs
        loss = -(logp * batch.completion_mask).sum() / batch.completion_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def teacher_forcing_batch(prompts: list[list[int]], answers: list[list[int]], pad_id: int) -> RolloutBatch:
    """Prompts left-padded, the given answers as completions (loss mask 1 on every answer token)."""
    ids, attn = left_pad(prompts, pad_id)
    width = max(len(a) for a in answers)
    completion = torch.full((len(answers), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(answers), width), dtype=torch.bool)
    for row, answer in enumerate(answers):
        completion[row, :len(answer)] = torch.tensor(answer)
        mask[row, :len(answer)] = True
    return RolloutBatch(input_ids=torch.cat([ids, completion], 1), attention_mask=torch.cat([attn, mask.long()], 1),
                        prompt_length=ids.shape[1], completion_mask=mask)
