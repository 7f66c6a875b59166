"""The update's decoder layers compiled (regional ``torch.compile``), in place only while the learner runs.

A small model's update on a GPU is bound by its elementwise kernels: each layer's RMSNorms, rotary embedding,
activation and autocast's casts run as dozens of separate kernels over the activations (on an H200, Qwen3-0.6B's
shape: matmuls 21 % of the update's device time, elementwise kernels and casts most of the rest). Compiling a layer
fuses them. Compiling one layer compiles them all (they share their code; the parameters are inputs), so the cost is
one compile per distinct call signature (grad or no grad), not per layer; not with a KV cache, whose per-layer slot
the compiled layer guards on (a graph per layer: the learner shares no prompt forward under compiled layers). Sizes
are dynamic, except that a first micro-batch whose row count or length equals a size of the model (head_dim, the
hidden size, ...) or each other is compiled with it fixed (torch's duck sizing): the next other one compiles once more.

:class:`CompiledLayers` swaps the compiled layers into the decoder's ``ModuleList`` for the duration of
``active(policy)`` and puts the originals back after it: the samplers, a checkpoint's state dict and the user's model
never see them. The compiled modules share their parameters with the originals and are kept between updates.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from lit_gspo.runtime.sharding import decoder_layer_list


class CompiledLayers:
    """``with compiled.active(policy):`` the policy's decoder layers are ``torch.compile``\\ d ones (dynamic shapes:
    micro-batches change length every update)."""

    def __init__(self):
        self.pairs: list[tuple[nn.Module, nn.Module]] = []  # (a layer, its compiled module)

    @contextmanager
    def active(self, policy: nn.Module):
        layers = decoder_layer_list(policy)
        originals = list(layers)
        if [layer for layer, _ in self.pairs] != originals:  # a new policy (or none yet): compile its layers
            self.pairs = [(layer, torch.compile(layer, dynamic=True)) for layer in originals]
        try:
            for i, (_, compiled) in enumerate(self.pairs):
                layers[i] = compiled
            yield
        finally:
            for i, layer in enumerate(originals):
                layers[i] = layer
