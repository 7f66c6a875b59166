"""Rollout batches (the trajectories the learner trains on) and per-token log-probs in fp32 without (B, T, V).

Layout of a rollout: every row is one prompt, left-padded to P tokens, followed by its completion,
right-padded to T tokens. ``completion_mask`` (N, T) is the per-token loss mask: 1 on tokens the policy
sampled (each reply up to and including its first EOS), 0 on padding and on the tokens the
environment appended between replies (multi-turn); ``attention_mask`` marks every real token. Rows are group-major: prompt 0's G
completions, then prompt 1's, and so on. Engines (``lit_gspo.rl.engines``) produce them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lit_gspo.models.cache_keyword import cache_kwargs
from lit_gspo.rl.lm_head import chunk_logprobs_and_entropy, head_weights
from lit_gspo.rl.logit_map import logit_map
from lit_gspo.runtime.sharding import decoder_of


@dataclass
class RolloutBatch:
    """One rollout batch: tokens, masks, the old-policy snapshot and what the update needs."""

    input_ids: Tensor  # (N, P + T)
    attention_mask: Tensor  # (N, P + T)
    prompt_length: int  # P
    completion_mask: Tensor  # (N, T) bool, the loss mask: 1 on policy tokens
    engine_logprobs: Tensor | None = None  # (N, T) fp32, the sampler's own log-probs of the sampled tokens
    rewards: Tensor | None = None  # (N,) fp32
    advantages: Tensor | None = None  # (N,) or (N, T) fp32
    old_logprobs: Tensor | None = None  # (N, T) fp32; None = on-policy (reuse the update's detached log-probs)
    ref_logprobs: Tensor | None = None  # (N, T) fp32
    old_values: Tensor | None = None  # (N, T) fp32, PPO critic
    returns: Tensor | None = None  # (N, T) fp32, PPO critic
    turn_ids: Tensor | None = (
        None  # (N, T) long, multi-turn: the 0-based reply each completion token belongs to or follows
    )
    token_rewards: Tensor | None = (
        None  # (N, T) fp32, multi-turn: each reply's reward on its last token; sums to rewards
    )
    routing: Any = None  # RoutingRecord of the old-policy pass, (N, P + T, k) per MoE layer; select/trimmed slice it
    truncated: Tensor | None = (
        None  # (N,) bool: the row's last reply was cut by the token budget (no stop token/string)
    )
    decoupled_rewards: Tensor | None = None  # (N,) fp32: GDPO's group-normalised reward sum (rewards/decoupled.py)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def without_rows(cls, device: torch.device | str = "cpu") -> RolloutBatch:
        """A rollout of no rows, with every per-row field a sampled rollout has (the sampler's log-probs, rewards, …):
        what a rank whose sampling kept nothing brings to an update the other ranks take."""
        ids = torch.zeros(0, 2, dtype=torch.long, device=device)
        return cls(
            ids,
            ids.clone(),
            1,
            torch.zeros(0, 1, dtype=torch.bool, device=device),
            engine_logprobs=torch.zeros(0, 1, device=device),
            rewards=torch.zeros(0, device=device),
            truncated=torch.zeros(0, dtype=torch.bool, device=device),
            decoupled_rewards=torch.zeros(0, device=device),
        )

    def select(self, index: Tensor) -> RolloutBatch:
        """Rows ``index`` of every per-row tensor (the index copied to their device once: :func:`index_on`), and of the
        routing record (``RoutingRecord[rows]``)."""
        out, on_device = {}, {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor) and value.dim() > 0:
                if value.device not in on_device:
                    on_device[value.device] = index_on(index, value)
                value = value[on_device[value.device]]
            elif f.name == "routing" and value is not None:
                value = value[index]
            out[f.name] = value
        return replace(self, **out)

    def to(self, device: torch.device | str) -> RolloutBatch:
        """Every tensor (and the routing record) on ``device``; ``self`` when all already are."""
        device = torch.device(device)
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            tensors = [value] if isinstance(value, Tensor) else value.indices if f.name == "routing" and value else []
            if any(t.device != device for t in tensors):
                moved[f.name] = value.to(device)
        return replace(self, **moved) if moved else self

    def trimmed(self, extents: RowExtents | None = None) -> RolloutBatch:
        """Drop prompt columns that are padding in every row and completion columns no row uses. ``extents``: this
        batch's :class:`RowExtents`, where the caller holds them (else read from the masks: one copy to the host)."""
        P = self.prompt_length
        first_real, used = (extents or RowExtents.of(self)).trim(P)
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("input_ids", "attention_mask"):
                value = value[:, first_real : P + used]
            elif isinstance(value, Tensor) and value.dim() == 2:  # (N, T) completion-aligned
                value = value[:, :used]
            elif f.name == "routing" and value is not None:  # RoutingRecord over input_ids' columns: (N, P + T, k)
                value = type(value)([t[:, first_real : P + used] for t in value.indices])
            out[f.name] = value
        out["prompt_length"] = P - first_real
        return replace(self, **out)


def concat_rollouts(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Stack rollouts of different prompt/completion widths (prompts stay left-, completions right-padded)."""
    P = max(b.prompt_length for b in batches)
    T = max(b.completion_mask.shape[1] for b in batches)

    def pad(x: Tensor, left: int, right: int, value) -> Tensor:
        return F.pad(x, (left, right), value=value)

    out: dict[str, Any] = {"prompt_length": P, "routing": None}
    for f in fields(RolloutBatch):
        if f.name in out:
            continue
        parts = []
        for b in batches:
            value = getattr(b, f.name)
            if value is None:
                parts = None
                break
            t = b.completion_mask.shape[1]
            if f.name in ("input_ids", "attention_mask"):
                fill = pad_id if f.name == "input_ids" else 0
                value = torch.cat(
                    [
                        pad(value[:, : b.prompt_length], P - b.prompt_length, 0, fill),
                        pad(value[:, b.prompt_length :], 0, T - t, fill),
                    ],
                    1,
                )
            elif value.dim() == 2:
                value = pad(value, 0, T - t, False if value.dtype == torch.bool else 0)
            parts.append(value)
        out[f.name] = torch.cat(parts, 0) if parts else None
    return RolloutBatch(**out)


def index_on(index, tensor: Tensor) -> Tensor:
    """``index`` (rows chosen on the host) on ``tensor``'s device, to index it with. A host index used on a GPU tensor
    is copied there by the indexing op, which then waits for every kernel queued before it (a full stop of the host
    between, e.g., a forward and its backward); copied here without waiting, it runs in order with those kernels."""
    index = torch.as_tensor(index)
    return index.to(tensor.device, non_blocking=True) if index.device != tensor.device else index


@dataclass
class RowExtents:
    """Each row's extent in a rollout's columns, on the host: what trimming a batch and dealing rows to micro-batches
    read, taken from the masks in one copy (on a GPU each read of a mask's size or content stops the host until the
    device catches up; an update reads these once). Index with a tensor of rows for theirs."""

    prompt_first: Tensor  # (N,) the first real prompt column (P where the prompt has no real token)
    prompt_tokens: Tensor  # (N,) real prompt tokens
    completion_used: Tensor  # (N,) the last completion column in the loss mask + 1 (0: none)
    completion_tokens: Tensor  # (N,) completion tokens in the loss mask

    @classmethod
    def of(cls, batch: RolloutBatch) -> RowExtents:
        P, (n, T) = batch.prompt_length, batch.completion_mask.shape
        prompt = batch.attention_mask[:, :P].bool()
        mask = batch.completion_mask.bool()
        none = torch.zeros(n, dtype=torch.long, device=mask.device)
        first = torch.where(prompt.any(1), prompt.long().argmax(1), P) if P else none
        used = (mask * torch.arange(1, T + 1, device=mask.device)).amax(1) if T else none
        return cls(*torch.stack([first.to(mask.device), prompt.sum(1).to(mask.device), used, mask.sum(1)]).cpu())

    def __getitem__(self, rows: Tensor) -> RowExtents:
        return RowExtents(*(getattr(self, f.name)[rows] for f in fields(self)))

    def trim(self, P: int) -> tuple[int, int]:
        """(the first prompt column any row uses, the completion columns any row uses) of these rows; at least one
        completion column, so that a batch of empty rows still has a loss to backpropagate."""
        first = int(self.prompt_first.min()) if len(self.prompt_first) else P
        used = int(self.completion_used.max()) if len(self.completion_used) else 0
        return (first if first < P else 0), max(used, 1)


def micro_batch_rows(
    batch: RolloutBatch,
    max_rows: int | None = None,
    max_tokens: int | None = None,
    extents: RowExtents | None = None,
) -> list[Tensor]:
    """Row indices of ``batch``'s micro-batches: at most ``max_rows`` rows and ``max_tokens`` padded tokens each.

    Without a token budget: consecutive chunks of ``max_rows``. With one, rows are sorted by length
    (real prompt tokens + used completion tokens, longest first) and filled greedily, so that a
    micro-batch costs ``rows × (longest prompt + longest completion)`` after ``trimmed()``: rows of
    similar length go together and little padding is computed. A row longer than the budget runs alone.
    ``extents``: the batch's :class:`RowExtents`, where the caller holds them.
    """
    n = len(batch)
    max_rows = max_rows or max(n, 1)
    if not max_tokens:
        return [torch.arange(start, min(start + max_rows, n)) for start in range(0, n, max_rows)]
    extents = extents or RowExtents.of(batch)
    prompt_len, completion_len = extents.prompt_tokens, extents.completion_used
    order = torch.argsort(prompt_len + completion_len, descending=True, stable=True)
    groups, current, widest_prompt, widest_completion = [], [], 0, 0
    for row in order.tolist():
        p, c = int(prompt_len[row]), int(completion_len[row])
        width = max(widest_prompt, p) + max(widest_completion, c)  # the trimmed width with this row added
        if current and (len(current) == max_rows or (len(current) + 1) * width > max_tokens):
            groups.append(torch.tensor(current))
            current, widest_prompt, widest_completion = [], 0, 0
        current.append(row)
        widest_prompt, widest_completion = max(widest_prompt, p), max(widest_completion, c)
    return groups + [torch.tensor(current)] if current else groups


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Stack token lists left-padded: (ids, attention_mask), both (N, max_len)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            attn[row, width - len(seq) :] = 1
    return ids, attn


def completion_mask_through_eos(completions: Tensor, eos_id: int | list[int]) -> Tensor:
    """(N, T) bool: True up to and including the first EOS of each row (all True if none)."""
    eos_ids = torch.tensor(
        eos_id if isinstance(eos_id, list) else [eos_id], dtype=torch.long, device=completions.device
    )
    is_eos = torch.isin(completions, eos_ids).long()
    after_eos = (is_eos.cumsum(1) - is_eos) > 0
    return ~after_eos


@dataclass
class TokenForward:
    """Per completion token: log π(y_t) (fp32, with grad), entropy (detached unless asked with grad) and critic
    values."""

    logprobs: Tensor  # (N, T)
    entropy: Tensor | None = None  # (N, T)
    values: Tensor | None = None  # (N, T)
    router_aux_loss: Tensor | None = None  # () an MoE model's load-balancing loss over the rows' tokens, with grad


def position_ids_of(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens, so left padding gives the same positions as generate()."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


def token_logprobs(
    model: nn.Module,
    batch: RolloutBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    value_head: nn.Module | None = None,
    max_chunk_elements: int = 2**26,
    share_prompts: bool = False,
    min_prompt_saving: float = 0.0,
    pack: bool = False,
    align: bool = False,
    router_aux_loss: bool = False,
) -> TokenForward:
    """log π(y_t | y_<t) of every completion token, gathering chunk by chunk in fp32.

    The backbone runs once; the LM head and log-softmax run over chunks of positions so that at
    most ``max_chunk_elements`` logits exist at a time, and (with grad) each chunk is recomputed in
    backward instead of keeping its (B, c, V) logits alive. ``share_prompts``: rows with the same
    prompt share one forward of it (:func:`completion_states_shared_prompts`) where it saves at least
    ``min_prompt_saving`` of the tokens; ``pack``: the rows run as one sequence without padding
    (:func:`completion_states_packed`); ``align``: each row's tokens first, its padding after, and no attention mask
    (:func:`completion_states_aligned`). ``entropy_grad``: the entropy with its gradient (an entropy bonus), implies
    ``with_entropy``. ``router_aux_loss``: an MoE model's load-balancing loss of the padded forward, over the rows'
    real tokens (the model's own ``load_balancing_loss_func``; the padded path only: packed and aligned rows hold no
    padding mask for it).
    """
    if router_aux_loss and (pack or share_prompts or align):
        raise ValueError("router_aux_loss runs the padded forward only: not with pack, share_prompts or align")
    with_entropy = with_entropy or entropy_grad
    batch = batch.to(model.get_input_embeddings().weight.device)  # the caller's tensors may be elsewhere (CPU)
    P, T = batch.prompt_length, batch.completion_mask.shape[1]
    hidden = completion_states_packed(model, batch) if pack else None
    if hidden is None and share_prompts:
        hidden = completion_states_shared_prompts(model, batch, min_prompt_saving)
    if hidden is None and align:
        hidden = completion_states_aligned(model, batch)
    aux = {} if router_aux_loss else None
    if hidden is None:
        hidden = _decoder_output_through_root(model, batch.input_ids, batch.attention_mask, router_aux=aux)
        hidden = hidden[:, P - 1 : P - 1 + T]  # the state that predicts completion token t
    targets = batch.input_ids[:, P : P + T]
    head = model.get_output_embeddings()
    if type(head.weight).__name__ == "DTensor":
        raise RuntimeError(
            "the LM head weight is still sharded after the root's forward: do not set "
            "reshard_after_forward=True on the root fully_shard (lit_gspo.runtime.sharding.apply_fsdp2)"
        )
    weights = head_weights(head, logit_map(model))  # fp32, or bf16x3 on CUDA in bf16 (lm_head.py)
    chunk = max(1, max_chunk_elements // max(1, hidden.shape[0] * head.weight.shape[0]))
    logps, ents = [], []
    for start in range(0, T, chunk):
        h, y = hidden[:, start : start + chunk], targets[:, start : start + chunk]
        args = (h, y, weights, temperature, with_entropy, entropy_grad)
        if torch.is_grad_enabled() and chunk < T:  # the chunk's (B, c, V) logits are recomputed in backward
            logp, entropy = checkpoint(chunk_logprobs_and_entropy, *args, use_reentrant=False)
        else:
            logp, entropy = chunk_logprobs_and_entropy(*args)
        logps.append(logp)
        if with_entropy:
            ents.append(entropy)
    values = value_head(hidden.float()).squeeze(-1) if value_head is not None else None
    empty = hidden.new_zeros(hidden.shape[0], 0, dtype=torch.float32)
    return TokenForward(
        logprobs=torch.cat(logps, 1) if logps else empty,
        entropy=(torch.cat(ents, 1) if ents else empty) if with_entropy else None,
        values=values,
        router_aux_loss=None if aux is None else aux["loss"],
    )


def completion_states_packed(model: nn.Module, batch: RolloutBatch) -> Tensor:
    """The decoder states that predict each completion token, (N, T, H), with every row's real tokens packed into one
    sequence: no padding runs through the backbone.

    The packed row's positions restart at 0 for each row and no attention mask is given, from which transformers
    builds the block-diagonal causal mask (``find_packed_sequence_indices``): each token sees its own row only, so the
    states are the padded forward's. It pays where attention skips the other rows' blocks (``flash_attention_2``,
    ``flex_attention``); ``sdpa`` and ``eager`` get a dense (S, S) mask over the S packed tokens.
    """
    P, T = batch.prompt_length, batch.completion_mask.shape[1]
    real = batch.attention_mask.bool()
    ids, positions = batch.input_ids[real][None], position_ids_of(batch.attention_mask)[real][None]  # (1, S)
    hidden = _decoder_output_through_root(model, ids, None, position_ids=positions)[0]  # (S, H)
    where = torch.zeros(real.shape, dtype=torch.long, device=real.device)  # (N, P + T): each real token's place in S
    where[real] = torch.arange(ids.shape[1], device=real.device)
    return hidden[where[:, P - 1 : P - 1 + T]]  # padding positions read token 0's state: masked out of every loss


def completion_states_aligned(model: nn.Module, batch: RolloutBatch) -> Tensor | None:
    """The decoder states that predict each completion token, (N, T, H), with each row's tokens moved to its front
    (the prompt's left padding moved behind the completion) and no attention mask: causal attention alone keeps every
    token from the padding after it, and the real tokens' positions are the padded rows'. The states are the padded
    forward's (tested); without a mask, sdpa runs its causal flash kernel and reads grouped key-value heads natively,
    where a padding mask makes transformers copy keys and values once per query head (``repeat_kv``) and keep the
    copies for backward. Returns None where a row's tokens are not contiguous (a mask with a hole: padded then).
    """
    P, T = batch.prompt_length, batch.completion_mask.shape[1]
    real = batch.attention_mask.bool()
    length = real.sum(1)
    first = real.long().argmax(1)  # each row's left padding
    last = real.shape[1] - 1 - real.flip(1).long().argmax(1)
    if not bool((last - first + 1 == length).all()):
        return None
    columns = torch.arange(real.shape[1], device=real.device)
    source = (columns + first[:, None]).clamp(max=real.shape[1] - 1)  # aligned column c ← padded column c + first
    ids = batch.input_ids.gather(1, source)
    # the real tokens' positions, 0 on; the padding behind them goes on counting (positions that restart would read
    # as packed sequences, for which transformers builds a mask)
    positions = columns.expand_as(ids)
    hidden = _decoder_output_through_root(model, ids, None, position_ids=positions)  # (N, P + T, H)
    back = torch.arange(P - 1, P - 1 + T, device=real.device) - first[:, None]  # padded column P - 1 + t, aligned
    return hidden[torch.arange(len(hidden), device=real.device)[:, None], back.clamp(min=0)]


def completion_states_shared_prompts(model: nn.Module, batch: RolloutBatch, min_saving: float = 0.0) -> Tensor | None:
    """The decoder states that predict each completion token, running each distinct prompt once.

    A group's G rows share their prompt, so its forward (with grad) runs once per distinct prompt and
    its KV cache is indexed out to the rows; the completions then run on top of that cache. The
    states are those of the full-sequence forward (same computation, tested), and in backward the
    rows' gradients meet in the shared prompt's graph. Tokens through the backbone per group:
    P + G·T instead of G·(P + T). Returns None when no two rows share a prompt (nothing to save), or when the share of
    the tokens it saves is below ``min_saving`` (:func:`prompt_sharing_saving`).
    Needs a model whose forward takes a KV cache (decoder-only HF models; not with
    gradient checkpointing, which recomputes layers that would append to the cache twice).
    """
    from transformers import DynamicCache

    P, T = batch.prompt_length, batch.completion_mask.shape[1]
    prompt_rows = torch.cat([batch.input_ids[:, :P], batch.attention_mask[:, :P].long()], 1)
    distinct, row_to_prompt = torch.unique(prompt_rows, dim=0, return_inverse=True)
    if len(distinct) == len(batch) or prompt_sharing_saving(len(batch), len(distinct), P, T) < min_saving:
        return None
    cache = DynamicCache(config=model.config)
    prompt_states = _decoder_output_through_root(model, distinct[:, :P], distinct[:, P:], cache=cache)
    states = prompt_states[row_to_prompt, -1:]  # (N, 1, H): predicts completion token 0
    if T > 1:  # completion tokens 0..T-2 predict tokens 1..T-1
        cache.batch_select_indices(row_to_prompt)
        mask = batch.attention_mask[:, : P + T - 1]
        completion_states = _decoder_output_through_root(
            model,
            batch.input_ids[:, P : P + T - 1],
            mask,
            position_ids=position_ids_of(mask)[:, P:],
            cache=cache,
        )
        states = torch.cat([states, completion_states], 1)
    return states


def prompt_sharing_saving(rows: int, distinct_prompts: int, P: int, T: int) -> float:
    """The share of the backbone's tokens a shared prompt forward saves: 1 − (D·P + N·T) / (N·(P + T))."""
    return 1.0 - (distinct_prompts * P + rows * T) / (rows * (P + T))


def _decoder_output_through_root(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    *,
    position_ids: Tensor | None = None,
    cache: Any = None,
    router_aux: dict | None = None,
) -> Tensor:
    """The decoder's last hidden state, running the *root* module's forward; with a dict ``router_aux``, the root's
    MoE load-balancing loss (``output_router_logits``) is put in it under ``loss``.

    Going through the root keeps every wrapper's hooks in play (FSDP2, PEFT, Routing Replay). Under
    FSDP2 only the root's forward unshards the root's own parameters (embeddings, final norm, LM head)
    and sets up their gradient reduction; calling the decoder directly would see sharded
    DTensors. The root runs with ``logits_to_keep`` = no positions (logits (B, 0, V): nothing is
    materialised) and a forward hook hands back the decoder's output. The root stays unsharded after
    its forward (FSDP2's default for the root), so the LM head weight is usable afterwards.
    """
    captured = {}

    def keep(module, args, output):
        captured["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    handle = decoder_of(model).register_forward_hook(keep)
    try:
        output = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_of(attention_mask) if position_ids is None else position_ids,
            **cache_kwargs(model, cache),
            use_cache=cache is not None,
            logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device),
            **({"output_router_logits": True} if router_aux is not None else {}),
        )
    finally:
        handle.remove()
    if router_aux is not None:
        router_aux["loss"] = output.aux_loss
    return captured["hidden"]
