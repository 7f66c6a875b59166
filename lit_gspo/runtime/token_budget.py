"""How many tokens one micro-batch of the update may hold, from the GPU memory free at the time (``micro_batch_tokens: auto``).

The update's memory beyond the weights, gradients and optimiser state (already allocated when this is asked) is
the activations kept for backward, linear in the tokens of a micro-batch. A Llama-style block keeps per token about

    8·hidden + 4·intermediate   values   (the norms' inputs and outputs, q/k/v/o's inputs, attention's output, the
                                           MLP's gate, up, activation and product)

in the compute dtype, so a token costs ``layers × (8·hidden + 4·intermediate) × bytes``; with gradient checkpointing a
block keeps only its input (``hidden``) and one block at a time is recomputed. The LM head's fp32 logits are chunked
(``token_logprobs``) and bounded apart from this. Half the free memory goes to the micro-batch: the estimate leaves
room for the allocator's fragmentation and for what it does not count (attention's workspace, the loss's temporaries).
On the CPU there is no budget (None): memory is the machine's, and the micro-batches stay as configured.
"""

from __future__ import annotations

import torch

#: share of the free GPU memory one micro-batch's activations may take
FREE_MEMORY_SHARE = 0.5
#: never fewer tokens than this in a micro-batch (a row longer than the budget still runs alone)
MIN_TOKENS = 256


def activation_bytes_per_token(config, dtype_bytes: int = 2, checkpointing: bool = False) -> int:
    """Bytes the update keeps for backward per token of a micro-batch (see the module docstring)."""
    config = getattr(config, "text_config", config)
    hidden, layers = config.hidden_size, config.num_hidden_layers
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    block = (8 * hidden + 4 * intermediate) * dtype_bytes
    if checkpointing:
        return layers * hidden * dtype_bytes + block
    return layers * block


def token_budget(config, device: torch.device | str, dtype: torch.dtype, *, checkpointing: bool = False) -> int | None:
    """Tokens per micro-batch that fit in half the free memory of ``device`` (a GPU) now; None on the CPU.

    ``dtype``: what the activations are kept in (the autocast dtype under mixed precision, else the weights')."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    per_token = activation_bytes_per_token(config, torch.finfo(dtype).bits // 8, checkpointing)
    return max(MIN_TOKENS, int(free * FREE_MEMORY_SHARE) // per_token)
