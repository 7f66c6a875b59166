"""Rollout mechanics: EOS masks, padding, chunked fp32 log-probs, what the learner reads."""

import torch

from lit_gspo.rl.rollout import (
    RolloutBatch,
    completion_mask_through_eos,
    concat_rollouts,
    left_pad,
    token_logprobs,
)

PAD, EOS = 0, 1  # as in conftest.py's tiny model


def batch_of(prompts, completions):
    ids, attn = left_pad(prompts, PAD)
    width = max(len(c) for c in completions)
    comp = torch.full((len(completions), width), PAD)
    mask = torch.zeros((len(completions), width), dtype=torch.bool)
    for i, c in enumerate(completions):
        comp[i, : len(c)] = torch.tensor(c)
        mask[i, : len(c)] = True
    return RolloutBatch(torch.cat([ids, comp], 1), torch.cat([attn, mask.long()], 1), ids.shape[1], mask)


def naive_logprobs(model, prompt, completion):
    """Log-probs of one unpadded sequence through the full (T, V) log-softmax."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0].float().log_softmax(-1)
    return torch.stack([logits[len(prompt) - 1 + t, tok] for t, tok in enumerate(completion)])


def test_completion_mask_keeps_tokens_through_first_eos():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS], [5, 6, 7, 8, 9], [EOS, 3, 3, 3, 3]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(completion_mask_through_eos(tokens, EOS), expected)


def test_logprobs_match_naive_per_sequence_despite_left_padding(model):
    prompts, completions = [[2, 5, 6, 7, 8], [2, 9]], [[10, 11, 12], [13, EOS]]
    lp = token_logprobs(model, batch_of(prompts, completions)).logprobs
    for row, (p, c) in enumerate(zip(prompts, completions)):
        torch.testing.assert_close(lp[row, : len(c)], naive_logprobs(model, p, c), atol=1e-5, rtol=1e-5)
    assert lp.dtype == torch.float32


def test_chunked_logprobs_and_gradients_equal_unchunked(model):
    batch = batch_of([[2, 5, 6], [2, 7]], [[10, 11, 12, 13], [14, 15, EOS]])
    model.zero_grad()
    full = token_logprobs(model, batch, with_entropy=True)
    (full.logprobs * batch.completion_mask).sum().backward()
    grad_full = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()
    # 2 rows × 23 vocab × 1 position per chunk: four chunks, each recomputed in backward
    chunked = token_logprobs(model, batch, with_entropy=True, max_chunk_elements=2 * 23)
    (chunked.logprobs * batch.completion_mask).sum().backward()
    torch.testing.assert_close(chunked.logprobs, full.logprobs)
    torch.testing.assert_close(chunked.entropy, full.entropy)
    torch.testing.assert_close(model.model.embed_tokens.weight.grad, grad_full)
    model.zero_grad()
    assert (full.entropy >= 0).all() and (full.entropy <= torch.log(torch.tensor(23.0)) + 1e-5).all()


def test_concat_and_trim_keep_every_rows_logprobs(model):
    a = batch_of([[2, 5, 6, 7]], [[10, 11]])
    b = batch_of([[2, 9]], [[12, 13, 14, EOS]])
    both = concat_rollouts([a, b], PAD)
    assert both.prompt_length == 4 and both.completion_mask.shape == (2, 4)
    lp = token_logprobs(model, both).logprobs
    torch.testing.assert_close(lp[0, :2], token_logprobs(model, a).logprobs[0])
    torch.testing.assert_close(lp[1], token_logprobs(model, b).logprobs[0])
    trimmed = both.select(torch.tensor([0])).trimmed()
    assert trimmed.prompt_length == 4 and trimmed.completion_mask.shape == (1, 2)
    trimmed_b = both.select(torch.tensor([1])).trimmed()
    assert trimmed_b.prompt_length == 2
    torch.testing.assert_close(token_logprobs(model, trimmed_b).logprobs[0], lp[1])


def test_shared_prompt_forward_gives_the_full_forwards_logprobs_and_gradients(model):
    """Rows sharing a prompt run it once; log-probs, entropy and gradients equal the full-sequence forward."""
    prompts = [[2, 5, 6, 7], [2, 9], [2, 5, 6, 7], [2, 9], [2, 5, 6, 7]]  # 2 distinct prompts, rows interleaved
    completions = [[10, 11, 12, EOS], [13, EOS], [14], [15, 16, 17, 18, 19], [20, 21, EOS]]
    batch = batch_of(prompts, completions)
    weights = torch.randn(batch.completion_mask.shape)  # an arbitrary loss, so every row's gradient matters

    def forward_backward(share):
        model.zero_grad()
        out = token_logprobs(model, batch, with_entropy=True, share_prompts=share)
        (out.logprobs * weights * batch.completion_mask).sum().backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters()}

    full, full_grads = forward_backward(False)
    shared, shared_grads = forward_backward(True)
    model.zero_grad()
    mask = batch.completion_mask
    torch.testing.assert_close(shared.logprobs[mask], full.logprobs[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared.entropy[mask], full.entropy[mask], atol=1e-5, rtol=1e-5)
    for name, grad in full_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    for row, (p, c) in enumerate(zip(prompts, completions)):  # and the naive per-sequence values
        torch.testing.assert_close(shared.logprobs[row, : len(c)], naive_logprobs(model, p, c), atol=1e-5, rtol=1e-5)


def test_shared_prompt_forward_runs_each_distinct_prompt_once(model):
    from lit_gspo.rl.rollout import completion_states_shared_prompts

    batch = batch_of([[2, 5, 6, 7]] * 3 + [[2, 9]] * 3, [[10, 11, 12]] * 6)
    seen = []
    handle = model.model.register_forward_hook(
        lambda m, args, kw, out: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        states = completion_states_shared_prompts(model, batch)
    finally:
        handle.remove()
    assert seen == [(2, 4), (6, 2)]  # 2 distinct prompts of 4 tokens, then 6 rows × completion tokens 0..T-2
    assert states.shape == (6, 3, 32)
    distinct = batch_of([[2, 5], [2, 6]], [[10], [11]])  # nothing shared: the caller runs the full forward
    assert completion_states_shared_prompts(model, distinct) is None


def test_a_shared_prompt_forward_runs_only_where_it_saves_the_share_of_tokens_asked(model):
    """1 − (D·P + N·T) / (N·(P + T)): 6 rows of 2 distinct 4-token prompts with 3 completion tokens save
    1 − (2·4 + 6·3) / (6·7) = 16/42 of the tokens; asked for more, the caller runs the full forward."""
    from lit_gspo.rl.rollout import completion_states_shared_prompts, prompt_sharing_saving

    assert prompt_sharing_saving(6, 2, 4, 3) == 1 - 26 / 42
    assert abs(prompt_sharing_saving(64, 8, 32, 256) - 0.0972) < 1e-4  # the H200 run's shape: 10 % saved
    batch = batch_of([[2, 5, 6, 7]] * 3 + [[2, 9]] * 3, [[10, 11, 12]] * 6)
    assert completion_states_shared_prompts(model, batch, min_saving=16 / 42) is not None
    assert completion_states_shared_prompts(model, batch, min_saving=0.5) is None
    full = token_logprobs(model, batch, share_prompts=True, min_prompt_saving=0.5).logprobs
    torch.testing.assert_close(full, token_logprobs(model, batch).logprobs, atol=0, rtol=0)


def test_the_learner_shares_prompts_on_a_gpu_only_where_that_saves_half_the_tokens():
    from types import SimpleNamespace

    import pytest

    from lit_gspo.rl.config import Update
    from lit_gspo.rl.learn.learner import SHARED_PROMPT_MIN_SAVING_ON_GPU, Learner

    def floor(setting, device):
        fake = SimpleNamespace(cfg=Update(share_prompt_forward=setting), device=torch.device(device))
        return Learner.min_prompt_saving.fget(fake)

    assert SHARED_PROMPT_MIN_SAVING_ON_GPU == 0.5
    assert floor("auto", "cpu") == 0.0 and floor("auto", "meta") == 0.5 and floor(True, "meta") == 0.0
    with pytest.raises(ValueError, match="share_prompt_forward must be true, false or 'auto', got 'yes'"):
        Update(share_prompt_forward="yes")
