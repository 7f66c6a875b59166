"""How many tokens one micro-batch of the update may hold, from the GPU memory free at the time (``micro_batch_tokens: auto``).

The update's memory beyond the weights, gradients and optimiser state (already allocated when this is asked) is
the activations autograd keeps for backward, linear in the tokens of a micro-batch. What a token costs is measured,
not estimated from the config: a micro-batch's forward of one row at two lengths, under the update's own settings
(autocast or ``update.param_dtype``'s casts, aligned or padded rows, compiled layers), counting the storages autograd
saves; their difference over the difference of lengths is a token's bytes (the weights' casts and whatever else a
call keeps once cancel):

    bytes per token = (saved(T₂) − saved(T₁)) / (T₂ − T₁)

A count from the config, ``layers × (8·hidden + 4·intermediate)`` values in the compute dtype, was half the measured
cost at Qwen3-0.6B's shape under bf16 autocast (41 KB a token and layer against 81 KB: the norms keep fp32 copies of
their inputs, Qwen3's q/k norms too, the residual stream is fp32; docs/gpu.md), so a budget of half the free memory
was all of it. With gradient checkpointing a block keeps its input (``hidden`` values of the residual stream, fp32
under autocast's fp32 parameters) and one block at a time is recomputed: ``layers × hidden × bytes`` + the measured
cost of one layer. The LM head's fp32 logits are chunked
(``token_logprobs``) and bounded apart from this. Half the free memory goes to the micro-batch: the rest is room for
the allocator's fragmentation and for what the count leaves out (attention's workspace, the loss's temporaries). On
the CPU there is no budget (None): memory is the machine's, and the micro-batches stay as configured.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch

#: share of the free GPU memory one micro-batch's activations may take
FREE_MEMORY_SHARE = 0.5
#: never fewer tokens than this in a micro-batch (a row longer than the budget still runs alone)
MIN_TOKENS = 256
#: the two lengths of the measuring forward
PROBE_LENGTHS = (64, 192)


class SavedStorages:
    """``with saved.counting():`` remembers every tensor autograd saves for backward; :attr:`bytes` is the size of the
    storages still saved (a graph's part that was dropped frees its own), each counted once."""

    def __init__(self):
        self.saved: list[weakref.ref] = []

    def pack(self, tensor):
        self.saved.append(weakref.ref(tensor))
        return tensor

    def counting(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)

    @property
    def bytes(self) -> int:
        storages = {}  # alive together: no address is shared by two of them
        for ref in self.saved:
            tensor = ref()
            if tensor is not None:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def clear(self) -> None:
        self.saved = []


def saved_bytes_per_token(forward: Callable[[int], object], lengths: tuple[int, int] = PROBE_LENGTHS) -> int:
    """Bytes autograd saves per token in ``forward(length)`` (a forward of one row of ``length`` tokens, with grad)."""
    saved = []
    for length in lengths:
        counter = SavedStorages()
        with torch.enable_grad(), counter.counting():
            out = forward(length)
        saved.append(counter.bytes)  # (while ``out`` holds the graph)
        del out
    return max(1, math.ceil((saved[1] - saved[0]) / (lengths[1] - lengths[0])))


def checkpointed_bytes_per_token(config, full: int, dtype_bytes: int) -> int:
    """Per token under gradient checkpointing: every block's input kept, one block's activations (of ``full``, the
    measured cost of all of them) while it is recomputed."""
    config = getattr(config, "text_config", config)
    layers = config.num_hidden_layers
    return layers * config.hidden_size * dtype_bytes + math.ceil(full / layers)


def token_budget(bytes_per_token: int, device: torch.device | str) -> int | None:
    """Tokens per micro-batch whose activations fit in half the free memory of ``device`` (a GPU) now; None on the
    CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return max(MIN_TOKENS, int(free * FREE_MEMORY_SHARE) // bytes_per_token)
