"""The update's forward takes shortcuts through a policy's own forward; each is checked against it on a few tokens before
a run trusts it, so an architecture that does not allow one is refused (or goes without it), by name, instead of
training on log-probs other than those it samples:

- the whole sequence at once, left-padded, through lit_gspo's LM head (``lm_head.py``: chunked, never the whole
  (rows, T, vocab) logits, with the model's ``LogitMap``) gives each row's log-probs as the model computes them for
  that row alone, token by token: :func:`check_policy_forward`, for every policy a run loads (causal, padding
  honoured, the head's logits the model's);
- packing (``rollout.completion_states_packed``) keeps the rows apart: a row's states do not depend on the rows packed
  before it, their tokens or their lengths (which holds only where the model builds its attention mask from the
  restarting positions): :func:`packing_keeps_rows_apart`, before the first packed update.
"""

from __future__ import annotations

import torch
from torch import nn

from lit_gspo.rl.logit_map import VERIFIED, LogitMap, config_logit_map
from lit_gspo.rl.rollout import RolloutBatch, completion_states_packed, position_ids_of, token_logprobs
from lit_gspo.runtime.sharding import decoder_of

#: how a refusal ends: the way around it, for a model refused wrongly
SKIP = " (model.policy.check_forward: false skips this check)"
#: (prompt, completion) rows of other lengths: one prompt left-padded by 2, completions right-padded by 1 and 0
PROBE_ROWS = [([11, 12, 13], [14, 15]), ([31, 32, 33], [34, 35, 36]), ([41], [42, 43, 44])]


def probe_batch(model: nn.Module, rows: list[tuple[list[int], list[int]]]) -> RolloutBatch:
    """(prompt, completion) token rows as one batch on the model's device: prompts left-padded, completions right-padded
    (token 0 as padding; a row's token ids taken modulo the vocabulary)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    P, T = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    ids = torch.zeros(len(rows), P + T, dtype=torch.long)
    attention = torch.zeros_like(ids)
    completion_mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for r, (prompt, completion) in enumerate(rows):
        ids[r, P - len(prompt) : P] = torch.tensor(prompt) % vocab
        ids[r, P : P + len(completion)] = torch.tensor(completion) % vocab
        attention[r, P - len(prompt) : P + len(completion)] = 1
        completion_mask[r, : len(completion)] = True
    device = model.get_input_embeddings().weight.device
    return RolloutBatch(ids, attention, P, completion_mask).to(device)


def tolerance(dtype: torch.dtype, scale: float) -> float:
    """How far two computations of one value of magnitude ``scale`` may differ in ``dtype`` (sums in another order)."""
    return 1e-4 * (1.0 + scale) if dtype == torch.float32 else 4 * torch.finfo(dtype).eps * (1.0 + scale)


def check_policy_forward(model: nn.Module) -> None:
    """Raise ``ValueError``, naming what fails, unless on a left-padded probe batch (a) the model is causal: a row's
    logits do not change when tokens follow; (b) it honours left padding: each padded row's logits (attention mask,
    positions counted over real tokens) are the row's logits alone; (c) ``token_logprobs`` (lit_gspo's head) gives the
    log-softmax of the model's logits, with the logit map its config names or else none (the one that does is kept on
    the model: ``logit_map.VERIFIED``). Each to the rounding of the model's dtype; in eval mode (no dropout drawn)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _check_policy_forward(model)
    finally:
        model.train(was_training)


def _check_policy_forward(model: nn.Module) -> None:
    batch = probe_batch(model, PROBE_ROWS)
    P, T = batch.prompt_length, batch.completion_mask.shape[1]
    dtype = model.get_output_embeddings().weight.dtype
    padded = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=position_ids_of(batch.attention_mask),
        use_cache=False,
    ).logits.float()
    allowed = tolerance(dtype, float(padded.abs().max()))
    name = f"{type(model).__name__} (model_type {getattr(getattr(model, 'config', None), 'model_type', None)!r})"
    for row in range(len(batch)):
        real = batch.attention_mask[row].bool()
        alone = model(input_ids=batch.input_ids[row][real][None], use_cache=False).logits[0].float()
        shorter = model(input_ids=batch.input_ids[row][real][None, :-2], use_cache=False).logits[0].float()
        if not float((shorter - alone[:-2]).abs().max()) <= allowed:
            raise ValueError(
                f"{name} is not causal: its logits at a position change when tokens follow it, so the full "
                "sequence's log-probs that train it are not those it sampled token by token. lit_gspo trains "
                f"autoregressive (causal) language models{SKIP}"
            )
        if not float((padded[row][real] - alone).abs().max()) <= allowed:
            raise ValueError(
                f"{name} does not honour left padding: a padded row's logits (with its attention mask and positions "
                "counted over its real tokens) are not the row's logits alone, so rollouts batched with prompts of "
                "other lengths would sample and train other log-probs than the model's. lit_gspo needs a model whose "
                f"forward takes attention_mask and position_ids{SKIP}"
            )
    targets = batch.input_ids[:, P : P + T, None]
    theirs = padded[:, P - 1 : P - 1 + T].log_softmax(-1).gather(-1, targets).squeeze(-1)
    gaps = []
    for candidate in dict.fromkeys((config_logit_map(model), LogitMap())):  # the config's, then none
        setattr(model, VERIFIED, candidate)  # what token_logprobs applies from now on
        try:
            ours = token_logprobs(model, batch).logprobs
        except (RuntimeError, AttributeError, IndexError, TypeError) as error:
            delattr(model, VERIFIED)
            raise ValueError(
                f"lit_gspo's forward fails on {name} (it reads the states its LM head takes from the output of its "
                f"backbone, a {type(decoder_of(model)).__name__} here): {error}"
            ) from error
        gaps.append(float((ours - theirs)[batch.completion_mask].abs().max()))
        if gaps[-1] <= allowed:
            return
    delattr(model, VERIFIED)
    raise ValueError(
        f"lit_gspo's LM head gives log-probs up to {gaps[0]:.3g} nats away from those of {name}'s own logits "
        f"(allowed {allowed:.2g}) with the logit map its config names ({config_logit_map(model)}), and "
        f"{gaps[-1]:.3g} without one: its forward does something to its logits that lit_gspo's head does not "
        "(lit_gspo.rl.logit_map knows soft caps and the scales of Cohere, Granite, HyperCLOVA X, Falcon-H1 and "
        f"MiniCPM3), so training would optimise other log-probs than those it samples{SKIP}"
    )


@torch.no_grad()
def packing_keeps_rows_apart(model: nn.Module) -> bool:
    """Whether a row's packed states are the same after a row of other tokens and another length (each row then runs
    as alone: positions restarted, the others masked), to the rounding of the dtype they are computed in (in bf16 a
    dependence below bf16's rounding, as ALiBi's small one, passes)."""
    last = ([31, 32, 33], [34, 35, 36])
    states = []
    for before in (([11, 12, 13], [14, 15]), ([21], [22, 23, 24, 25])):
        batch = probe_batch(model, [before, last])
        with torch.autocast(batch.input_ids.device.type, enabled=False):
            states.append(completion_states_packed(model, batch)[1, : len(last[1])])
    a, b = (s.float() for s in states)  # to the rounding of what they were computed in (bf16 under FSDP2's casts)
    return bool((a - b).abs().max() <= tolerance(states[0].dtype, float(a.abs().max())))
