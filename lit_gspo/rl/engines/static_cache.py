"""Sampling at GPU speed: a static KV cache and a compiled (CUDA-graph) one-token decoding step.

On a GPU, decoding a small model is bound by kernel launches and Python, not by arithmetic: each token runs
hundreds of small kernels. A static cache gives every decoding step the same shapes at the same addresses, so
``torch.compile(mode="reduce-overhead")`` records the step once as a CUDA graph and replays it, one launch per
token. To keep replaying the same graphs across RL steps:

- the batch is padded to a **row bucket** (a power of two, at least 8), and each row bucket has **one cache**, as
  long as the longest prompt + ``max_new_tokens`` seen so far rounded up to a multiple of 64 (or ``max_cache_len``):
  a shorter prompt reuses it, the slots it does not use are masked;
- **finished rows stay in the batch** (their tokens forced to ``pad_id`` after EOS) instead of leaving it, and
  whether every row has finished (and which wrote a stop string) is read every ``finished_check_every`` steps, not
  every token (a host sync);
- the prompt's **prefill runs once per prompt** (eager, dynamic shapes) and its keys and values are copied G
  times into the static cache;
- under autocast the step reads **Linear weights cast once per rollout** (``precast.py``), not at every token, and
  the cache **stores keys and values in autocast's dtype** (the attention casts them to it anyway: the same numbers);
- the step's attention reads **each layer's keys and values once** (``lit_gqa_eager``): transformers' sdpa under a
  padding mask, compiled, first copies them once per query head (``repeat_kv``);
- **the whole token is the step** (:func:`decode_next`): the forward, the draw, its log-prob, the EOS check and the
  next input, written in place into a :class:`DecodeState` whose tensors keep their addresses. Between two replays
  the host copies the token and its log-prob out and the next uniform draw in, nothing else.

Sampling is :func:`~lit_gspo.rl.engines.fast_generate.filter_logits` and
:func:`~lit_gspo.rl.engines.fast_generate.sample_tokens` in fp32, as in the lean sampler, at uniform draws made once
per rollout (so the compiled and the eager step draw the same tokens); the log-probs are those of the distribution
sampled from. ``compile=None`` compiles on CUDA only: on CPU the same static-cache loop runs eagerly (testable;
greedy tokens equal the lean sampler's).
"""

from __future__ import annotations

import copy
import functools
import threading
import warnings

import torch
from torch import Tensor, nn
from torch.torch_version import TorchVersion
from transformers.cache_utils import StaticLayer

from lit_gspo.models.cache_keyword import cache_kwargs
from lit_gspo.rl.engines.base import RolloutEngine
from lit_gspo.rl.engines.fast_generate import (
    ATTENTION_IMPLEMENTATIONS,
    ATTENTION_SLOTS,
    GQA_EAGER,
    attention_implementation,
    fast_generate,
    filter_logits,
    penalize_repeats,
    sample_tokens,
    tokens_seen,
)
from lit_gspo.rl.engines.precast import PrecastLinears
from lit_gspo.runtime.sharding import is_sharded

CACHE_LENGTH_MULTIPLE = 64
MIN_ROW_BUCKET = 8
#: at most this many attention lengths per cache (a decoding step reads the written slots rounded up to one of them)
SLOT_BUCKETS = 8
#: slots a cache has past the longest a step reads, never written or read: the slots read are then never the whole
#: cache, whose view torch.compile would take for another (contiguous) case and compile the step again for
SPARE_SLOTS = 1
#: the compiler's own failures, after which the step decodes eagerly: inductor's (code generation failed at a real
#: vocabulary on the H100, torch 2.11) and Dynamo's internal errors (one traced the step's cache keyword on torch 2.11).
#: Not its refusals (a recompile under ``fail_on_recompile``, a graph break under ``fullgraph``), nor the model's errors
COMPILER_FAILURES = (torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.InternalTorchDynamoError)


def row_bucket(rows: int) -> int:
    """The batch size the cache and the graph are built for: the next power of two, at least 8."""
    return max(MIN_ROW_BUCKET, 1 << (rows - 1).bit_length())


def round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def cuda_graphs_serve_this_thread() -> bool:
    """Whether ``torch.compile(mode="reduce-overhead")`` can record CUDA graphs in the calling thread. Before torch
    2.13 its CUDA graph trees keep their state in the thread that imported torch (and autograd's threads): in any other
    thread, such as the asynchronous rollouts' worker, the first step fails a bare ``assert`` (pytorch/pytorch#123177,
    fixed by #184357; seen on an H200 with torch 2.11)."""
    return threading.current_thread() is threading.main_thread() or TorchVersion(torch.__version__) >= "2.13"


def decode_logits(
    model: nn.Module, cache, tokens: Tensor, positions: Tensor, mask: Tensor, slots: Tensor | None = None
) -> Tensor:
    """One decoding step on the static cache: fp32 logits (R, V) of the next token. ``slots``: the attention reads
    the first ``len(slots)`` cache slots only (``lit_gqa_eager``)."""
    out = model(
        input_ids=tokens,
        attention_mask=mask,
        position_ids=positions,
        **cache_kwargs(model, cache),
        use_cache=True,
        logits_to_keep=1,
        **({ATTENTION_SLOTS: slots} if slots is not None else {}),
    )
    return out.logits[:, -1].float()


def next_tokens(
    logits: Tensor,
    finished: Tensor,
    eos: Tensor,
    pad_id: int,
    uniform: Tensor | None,
    sampling: dict,
    seen: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's next token from its fp32 ``logits`` (R, V): drawn by inverting the CDF at ``uniform`` (R,) after
    temperature (``sampling["temperature"]``: a tensor, so that another value reuses the compiled step), top-k, top-p
    and min-p, or the argmax where ``sampling`` is empty; ``pad_id`` where the row has finished. ``seen`` (R, V): the
    tokens each row holds, penalised first by ``sampling["repetition_penalty"]``; the chosen ones are added to it.
    Returns the tokens, their log-probs under the distribution drawn from (0 where finished) and which rows have
    finished after them."""
    if sampling:
        if seen is not None:
            logits = penalize_repeats(logits, seen, sampling["repetition_penalty"])
        top_k, top_p, min_p = sampling.get("top_k", 0), sampling.get("top_p", 1.0), sampling.get("min_p", 0.0)
        logits = filter_logits(logits / sampling["temperature"], top_k=top_k, top_p=top_p, min_p=min_p)
        chosen = sample_tokens(logits.softmax(-1), uniform=uniform)
    else:
        chosen = logits.argmax(-1)
    chosen = chosen.masked_fill(finished, pad_id)
    if seen is not None:
        seen.scatter_(1, chosen[:, None], True)
    logprobs = logits.log_softmax(-1).gather(-1, chosen[:, None]).squeeze(1).masked_fill(finished, 0.0)
    return chosen, logprobs, finished | torch.isin(chosen, eos)


def decode_next(
    model: nn.Module, cache, state: DecodeState, eos: Tensor, pad_id: int, sampling: dict, slots: Tensor | None
):
    """One token of every row, in place: the forward of the rows' last tokens on the cache, the next tokens drawn from
    its logits, written back as the rows' last tokens, positions advanced, finished rows marked. What a CUDA graph
    replays once per token: nothing of a token's work is left to run op by op from Python. Returns the tokens and
    their log-probs (the graph's outputs, valid until the next step). ``slots``: see :func:`decode_logits`."""
    logits = decode_logits(model, cache, state.tokens, state.positions, state.mask, slots)
    seen = state.seen if "repetition_penalty" in sampling else None
    chosen, logprobs, finished = next_tokens(logits, state.finished, eos, pad_id, state.uniform, sampling, seen)
    state.tokens.copy_(chosen[:, None])
    state.positions.add_(1)
    state.finished.copy_(finished)
    return chosen, logprobs


def decode_next_greedy(
    model: nn.Module, cache, state: DecodeState, eos: Tensor, pad_id: int, sampling: dict, slots: Tensor | None
):
    """:func:`decode_next` as a function of its own for greedy decoding (validation's): torch.compile keeps its
    compiled graphs per function, so greedy and sampled steps do not share one recompile limit."""
    return decode_next(model, cache, state, eos, pad_id, sampling, slots)


class DecodeState:
    """What the decoding step reads and advances in place, at addresses fixed per row bucket (a CUDA graph replays
    them): each row's last token, next position, mask over the cache slots and whether it has finished, the uniform
    draw its next token inverts and the sampling temperature (and, under a repetition penalty, the tokens each row
    holds: :meth:`seen_buffer`). Rows past the batch's own are finished from the start."""

    def __init__(self, rows: int, cache_len: int, device: torch.device):  # cache_len: the slots a step may read
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.mask = torch.ones(rows, cache_len + SPARE_SLOTS, dtype=torch.bool, device=device)
        self.finished = torch.ones(rows, dtype=torch.bool, device=device)
        self.uniform = torch.zeros(rows, device=device)
        self.temperature = torch.ones((), device=device)
        self.slot_index = torch.arange(cache_len, device=device)  # its first S: the slots the attention reads
        for tensor in vars(self).values():  # unguarded: a new state is a new CUDA graph recording, not a recompile
            torch._dynamo.mark_static_address(tensor, guard=False)
        self.slot_views: dict[int, Tensor] = {}
        self.seen: Tensor | None = None

    def seen_buffer(self, vocab: int) -> Tensor:
        """The (rows, vocab) bool of the tokens each row holds, at its fixed address (made at the first call)."""
        if self.seen is None or self.seen.shape[1] != vocab:
            self.seen = torch.zeros(self.finished.shape[0], vocab, dtype=torch.bool, device=self.finished.device)
            torch._dynamo.mark_static_address(self.seen, guard=False)
        return self.seen

    def slots(self, written: int) -> Tensor:
        """The first S slot indices, S ≥ ``written`` rounded up to one of at most :data:`SLOT_BUCKETS` lengths (each
        length is another CUDA graph of the one compiled step; its size is dynamic to torch.compile)."""
        length = len(self.slot_index)
        step = round_up(-(-length // SLOT_BUCKETS), CACHE_LENGTH_MULTIPLE)
        S = min(length, round_up(written, step))
        if S not in self.slot_views:
            self.slot_views[S] = self.slot_index[:S]
            torch._dynamo.maybe_mark_dynamic(self.slot_views[S], 0)
        return self.slot_views[S]


def outside_inference_mode(generate):
    """Run ``generate`` on normal tensors under ``no_grad``, even when the caller is in inference mode (``eval``, a
    user's loop): an inference tensor reaching the compiled step fails its guards (another dispatch key set), and it
    would compile and capture again. (Leaving inference mode turns gradients back on, hence ``no_grad``.)"""

    @functools.wraps(generate)
    def outside(*args, **kwargs):
        with torch.inference_mode(False), torch.no_grad():
            return generate(*args, **kwargs)

    return outside


def plain_attention(model: nn.Module) -> bool:
    """Whether the model's attention is plain scaled dot-product attention, as ``lit_gqa_eager`` computes it, and can be
    switched to it: a transformers model (``set_attn_implementation``) without logit soft-capping (Gemma 2) or
    attention sinks (gpt-oss). (Sliding windows are refused by ``lit_gqa_eager`` itself.)"""
    if not hasattr(model, "set_attn_implementation"):
        return False
    if getattr(model.config, "attn_logit_softcapping", None) is not None:
        return False
    return not any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters())


class StoredInCacheDtype(StaticLayer):
    """A static cache layer that stores new keys and values in its own dtype (autocast's, where the attention casts
    them to it anyway); transformers' ``StaticLayer`` requires the computed dtype."""

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return super().update(key_states.to(self.keys.dtype), value_states.to(self.values.dtype), *args, **kwargs)


class StaticCacheSampler(RolloutEngine):
    """Decoding on a static KV cache with a compiled one-token step (CUDA graphs on CUDA; the default engine there).

    Args:
        attn_implementation: the attention kernel while sampling (see :class:`RolloutEngine`).
        compile: compile the decoding step (``torch.compile(mode="reduce-overhead")``); None: on CUDA only.
        fullgraph: raise at a graph break in the decoding step (another transformers version, another model) instead
            of running the break eagerly, which leaves part of the step outside the CUDA graph: slower, not wrong.
        max_cache_len: the cache length (prompt + completion tokens) of every cache, so one graph per row bucket
            for the whole run; a longer prompt + ``max_new_tokens`` is refused. None: grown as needed (multiples of 64).
        finished_check_every: decoding steps between two checks whether every row has emitted EOS.
        precast_weights: under autocast, the decoding step reads Linear weights cast once per rollout
            (:class:`~lit_gspo.rl.engines.precast.PrecastLinears`: the same numbers, a copy of those weights in
            autocast's dtype) instead of casting them at every token inside the compiled graph.
        decode_attention: the attention kernel of the one-token decoding step (the prompt's prefill runs
            ``attn_implementation``). ``lit_gqa_eager`` (default) reads each layer's cached keys and values once
            per token; transformers' ``sdpa`` under a padding mask first copies them once per query head
            (``repeat_kv``): for Qwen3-0.6B's 16 query and 8 key-value heads, 5× the cache's bytes moved per token.
            None: ``attn_implementation``'s. A model whose attention is more than plain attention (soft-capping,
            sinks) decodes with ``attn_implementation``'s.

    Under sharded parameters (``synced_gpus``) it samples with ``generate``, as :class:`LeanSampler` does; FSDP2 in one
    process decodes eagerly on the policy's own weights; a model with sliding-window or other non-full-attention cache
    layers samples with the lean sampler's loop.
    """

    samples_sharded = False  # RolloutEngine.sample uses generate's synchronised loop there
    #: under autocast, keys and values stored in its dtype (False: as computed; the rotary embedding's keys are fp32)
    store_in_autocast_dtype = True

    def __init__(
        self,
        attn_implementation: str | None = None,
        compile: bool | None = None,
        max_cache_len: int | None = None,
        finished_check_every: int = 8,
        precast_weights: bool = True,
        fullgraph: bool = False,
        decode_attention: str | None = GQA_EAGER,
    ):
        super().__init__(attn_implementation)
        if finished_check_every < 1:
            raise ValueError(f"finished_check_every must be ≥ 1, got {finished_check_every}")
        if decode_attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"decode_attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {decode_attention!r}")
        self.decode_attention = decode_attention
        self.compile, self.max_cache_len, self.finished_check_every = compile, max_cache_len, finished_check_every
        self.precast_weights, self.precast = precast_weights, PrecastLinears()
        self.fullgraph = fullgraph
        self.caches: dict[int, object] = {}  # row bucket -> its StaticCache
        self.states: dict[int, DecodeState] = {}  # row bucket -> the decoding step's inputs
        self.caches_built = 0
        self._compiled_steps: dict[tuple[str, bool], object] = {}  # (mode, greedy) -> the compiled step

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(attn_implementation={self.attn_implementation!r}, compile={self.compile!r}, "
            f"max_cache_len={self.max_cache_len!r}, precast_weights={self.precast_weights!r}, "
            f"decode_attention={self.decode_attention!r})"
        )

    def __deepcopy__(self, memo) -> StaticCacheSampler:
        """The same settings without the runtime state (caches, compiled step, precast weights, which reference the
        policy): an async worker's copy builds its own instead of duplicating KV caches and weights on the device."""
        fresh = copy.copy(self)
        fresh.caches, fresh.states, fresh.caches_built = {}, {}, 0
        fresh._compiled_steps, fresh.precast = {}, PrecastLinears()
        return fresh

    def parameters_in(self, policy: nn.Module, dtype: torch.dtype | None):
        """Under ``update.param_dtype`` the step reads a copy of every parameter cast to ``dtype`` (``precast.py``),
        refreshed once per rollout in place: the compiled step's CUDA graphs keep reading the same addresses."""
        return self.reading_in(dtype)

    def close(self) -> None:
        self.caches.clear()
        self.states.clear()
        self._compiled_steps.clear()
        self.precast.close()

    def _decode_step(self, device: torch.device, policy: nn.Module, greedy: bool):
        step = decode_next_greedy if greedy else decode_next
        if not (self.compile if self.compile is not None else device.type == "cuda"):
            return step
        if is_sharded(policy):
            warnings.warn(
                "StaticCacheSampler decodes eagerly under FSDP2 (its hooks unshard and reshard the parameters around "
                "every forward, which a compiled, graph-captured step cannot follow): DDP or one device samples faster",
                stacklevel=3,
            )
            return step
        mode = "reduce-overhead" if cuda_graphs_serve_this_thread() else "default"
        if (mode, greedy) not in self._compiled_steps:
            if mode != "reduce-overhead":
                warnings.warn(
                    f"StaticCacheSampler compiles its decoding step without CUDA graphs in thread "
                    f"{threading.current_thread().name!r}: torch {torch.__version__}'s CUDA graph trees serve only the "
                    "main thread (torch ≥ 2.13 serves every thread)",
                    stacklevel=3,
                )
            compiled = torch.compile(step, mode=mode, dynamic=False, fullgraph=self.fullgraph)

            def replay(*args):
                nonlocal compiled
                if compiled is step:  # the compiler failed on it: eager from then on
                    return step(*args)
                if mode == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are used up: buffers free
                try:
                    return compiled(*args)
                except COMPILER_FAILURES as error:  # the compiler's failure, not the model's: it fails before the
                    # step runs (nothing written), and the eager step computes the same tokens
                    cause = getattr(error, "inner_exception", error)
                    warnings.warn(
                        f"StaticCacheSampler decodes eagerly (slower): torch {torch.__version__} failed to compile "
                        f"its decoding step ({type(cause).__name__}: {str(cause)[:200]}); "
                        "StaticCacheSampler(compile=False) decodes eagerly without trying",
                        stacklevel=2,
                    )
                    compiled = step
                    return step(*args)

            self._compiled_steps[mode, greedy] = replay
        return self._compiled_steps[mode, greedy]

    def _cache_for(self, policy: nn.Module, rows: int, length: int, like: Tensor, like_values: Tensor, dtype):
        """The row bucket's static cache, built (again) when it is shorter than ``length`` or its keys or values are of
        another device than ``like``/``like_values`` or dtype than ``dtype`` (None: theirs)."""
        from transformers import StaticCache

        keys_dtype, values_dtype = dtype or like.dtype, dtype or like_values.dtype
        cache = self.caches.get(rows)
        layer = cache.layers[0] if cache is not None else None
        if (
            layer is None
            or layer.max_cache_len < length + SPARE_SLOTS
            or (layer.keys.dtype, layer.values.dtype) != (keys_dtype, values_dtype)
            or layer.keys.device != like.device
        ):
            self.caches.pop(rows, None)  # free the old one before allocating
            self.states.pop(rows, None)
            cache = StaticCache(config=policy.config, max_cache_len=length + SPARE_SLOTS)  # normal tensors (generate)
            cache.layers = [StoredInCacheDtype(max_cache_len=length + SPARE_SLOTS) for _ in cache.layers]
            for layer in cache.layers:
                layer.lazy_initialization(
                    like.new_empty(rows, *like.shape[1:], dtype=keys_dtype),
                    like_values.new_empty(rows, *like_values.shape[1:], dtype=values_dtype),
                )
            self.caches[rows] = cache
            self.states[rows] = DecodeState(rows, length, like.device)
            self.caches_built += 1
        return cache

    @outside_inference_mode
    def generate(
        self,
        policy: nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor,
        *,
        num_generations: int,
        max_new_tokens: int,
        pad_id: int,
        eos_id: int | list[int],
        sampling: dict,
        synced_gpus: bool,
        return_logprobs: bool,
    ) -> tuple[Tensor, Tensor | None]:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        device = input_ids.device
        n, P = input_ids.shape
        G, rows = num_generations, input_ids.shape[0] * num_generations
        needed = P + max_new_tokens
        if self.max_cache_len is not None and needed > self.max_cache_len:
            raise ValueError(
                f"max_cache_len={self.max_cache_len} is shorter than the prompt ({P} tokens) + "
                f"max_new_tokens ({max_new_tokens})"
            )

        positions = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
        # the weights the step reads (FSDP2's modules cannot be copied: under it the policy's own); under
        # ``update.param_dtype`` every parameter cast, and the prefill reads them too
        cast_dtype = self.reading_dtype
        precast = (self.precast_weights or cast_dtype is not None) and not is_sharded(policy)
        decoder = self.precast.view(policy, cast_dtype) if precast else policy
        policy = decoder if cast_dtype is not None else policy
        prefill = DynamicCache(config=policy.config)
        out = policy(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            **cache_kwargs(policy, prefill),
            use_cache=True,
            logits_to_keep=1,
        )
        if not all(type(layer) is DynamicLayer for layer in prefill.layers):  # sliding window, linear attention, ...
            warnings.warn(
                "StaticCacheSampler samples with the lean sampler's loop: the model's cache has layers other "
                "than full attention",
                stacklevel=2,
            )
            out = fast_generate(
                policy,
                input_ids,
                attention_mask,
                num_generations=G,
                max_new_tokens=max_new_tokens,
                eos_id=eos_id,
                pad_id=pad_id,
                do_sample=bool(sampling),
                return_logprobs=return_logprobs,
                generator=self.generator(device),
                **sampling,
            )
            return out if return_logprobs else (out, None)
        logits = out.logits[:, -1].float().repeat_interleave(G, 0)  # (rows, V)

        bucket = row_bucket(rows)
        length = self.max_cache_len or round_up(needed, CACHE_LENGTH_MULTIPLE)
        first = prefill.layers[0]
        # under autocast the attention reads keys and values in its dtype: stored so, the same numbers in less memory
        # (the rotary embedding leaves the keys in fp32: half the cache's bytes, and of each step's reads of it)
        autocast = torch.is_autocast_enabled(device.type) and self.store_in_autocast_dtype
        dtype = torch.get_autocast_dtype(device.type) if autocast else None
        cache = self._cache_for(policy, bucket, length, first.keys, first.values, dtype)
        for static, dynamic in zip(cache.layers, prefill.layers):  # each prompt's keys and values, G times
            static.keys[:rows, :, :P].copy_(dynamic.keys.repeat_interleave(G, 0))
            static.values[:rows, :, :P].copy_(dynamic.values.repeat_interleave(G, 0))
            static.cumulative_length.fill_(P)  # where the first new token goes
        del prefill, out

        # every row sees its prompt's real tokens and every slot from P on (the causal mask hides the future ones)
        state = self.states[bucket]
        state.mask.fill_(True)
        state.mask[:rows, :P] = attention_mask.bool().repeat_interleave(G, 0)
        state.positions.zero_()
        state.positions[:rows] = positions[:, -1:].repeat_interleave(G, 0) + 1
        state.finished.fill_(True)  # the bucket's spare rows
        state.finished[:rows] = False
        if sampling:  # every draw of the rollout at once: the step reads its row of them
            uniforms = torch.rand(max_new_tokens, bucket, device=device, generator=self.generator(device))
            state.temperature.fill_(sampling["temperature"])
            sampling = dict(sampling, temperature=state.temperature)
        decode = self._decode_step(device, policy, greedy=not sampling)

        eos = torch.tensor(eos_id if isinstance(eos_id, list) else [eos_id], dtype=torch.long, device=device)
        tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((rows, max_new_tokens), device=device) if return_logprobs else None
        seen = None
        if "repetition_penalty" in sampling:  # the prompts' tokens (not their left padding); the replies' added
            seen = state.seen_buffer(logits.shape[-1])
            seen.zero_()
            prompts, valid = input_ids.repeat_interleave(G, 0), attention_mask.bool().repeat_interleave(G, 0)
            seen[:rows] = tokens_seen(prompts, valid, seen.shape[1])
        chosen, chosen_logprobs, finished = next_tokens(
            logits,
            state.finished[:rows],
            eos,
            pad_id,
            uniforms[0, :rows] if sampling else None,
            sampling,
            seen[:rows] if seen is not None else None,
        )  # the first token from the prefill's logits, then one decoding step per token
        state.tokens.fill_(pad_id)
        state.tokens[:rows, 0] = chosen
        state.finished[:rows] = finished
        tokens[:, 0] = chosen
        if logprobs is not None:
            logprobs[:, 0] = chosen_logprobs
        used = 1
        decoding_kernel = self.decode_attention if plain_attention(policy) else self.attn_implementation
        with attention_implementation(decoder, decoding_kernel):
            while used < max_new_tokens:
                if used % self.finished_check_every == 0:  # a host sync: read every few steps only
                    if self.stopping is not None:
                        state.finished[:rows] |= self.stopping.written(tokens[:, :used], self.finished_check_every)
                    if bool(state.finished.all()):
                        break
                if sampling:
                    state.uniform.copy_(uniforms[used])
                # this step writes slot P + used - 1: lit_gqa_eager reads the slots up to it, not the whole cache
                slots = state.slots(P + used) if decoding_kernel == GQA_EAGER else None
                chosen, chosen_logprobs = decode(decoder, cache, state, eos, pad_id, sampling, slots)
                tokens[:, used] = chosen[:rows]
                if logprobs is not None:
                    logprobs[:, used] = chosen_logprobs[:rows]
                used += 1
        prompts = input_ids.repeat_interleave(G, 0)
        sequences = torch.cat([prompts, tokens[:, :used]], 1)
        return sequences, (logprobs[:, :used] if logprobs is not None else None)
