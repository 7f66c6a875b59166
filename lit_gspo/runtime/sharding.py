"""FSDP2 sharding of a causal LM: ``fully_shard`` each decoder layer, then the root; the full state dict back.

FSDP2 (``strategy: lightning.pytorch.strategies.ModelParallelStrategy`` with ``data_parallel_size: <world>`` and
``tensor_parallel_size: 1``): :func:`apply_fsdp2` shards every decoder layer and then the root (:func:`shard_model`)
of the policy (and of the frozen reference) with ``fully_shard``. FSDP2 averages gradients (reduce-scatter), so the
learner's ×world scaling of the loss holds as under DDP. Pure torch: the Lightning strategy is checked in
``lit_gspo.lightning.strategy``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def decoder_of(model: nn.Module) -> nn.Module:
    """The backbone of a Hugging Face causal LM, whose output is the states its LM head reads: ``get_decoder()``, else
    ``base_model``, else ``model.model``; the first that holds the input embeddings and is not the model itself
    (Llama 4's ``get_decoder()`` is the model, ModernBERT-decoder's its head, both found under ``model``)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    candidates = (
        model.get_decoder() if hasattr(model, "get_decoder") else None,
        getattr(model, "base_model", None),
        getattr(model, "model", None),
    )
    for decoder in candidates:
        if isinstance(decoder, nn.Module) and decoder is not model and any(m is embeddings for m in decoder.modules()):
            return decoder
    return model.get_decoder() if hasattr(model, "get_decoder") else model


def decoder_layer_list(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of the transformer blocks of a Hugging Face causal LM (``model.model.layers`` and the
    like), which the decoder's forward iterates."""
    decoder = decoder_of(model)
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None) or getattr(decoder, "blocks", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers`` and the like)."""
    return list(decoder_layer_list(model))


def is_sharded(module: nn.Module) -> bool:
    """Whether :func:`shard_model` (or ``fully_shard``) sharded ``module``: its forward root is an FSDP2 module."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(forward_root(module), FSDPModule)


def forward_root(model: nn.Module) -> nn.Module:
    """The module every pass enters by: under LoRA peft's wrapped model, whose forward ``generate`` calls directly
    (not the wrapper's). FSDP2 gathers the root's own parameters (embeddings, LM head, final norm) before the root's
    forward only, and needs the first forward to enter there."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def shard_model(model: nn.Module, mesh, param_dtype: torch.dtype | None = None) -> None:
    """``fully_shard`` each decoder layer of a causal LM, then the root, over ``mesh`` (a 1-D device mesh).

    The root keeps its parameters unsharded between forward and backward (FSDP2's default for the
    root), which ``token_logprobs`` relies on to use the LM head weight after the root's forward.
    ``param_dtype`` (``update.param_dtype``): the gathered parameters are cast to it, gradients reduced in fp32
    (FSDP2's ``MixedPrecisionPolicy``; the shards stay the fp32 master weights).
    """
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision(param_dtype)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(forward_root(model), mesh=mesh, mp_policy=policy)


def resharded(model: nn.Module | str | None) -> None:
    """Free the parameters ``model``'s root gathered for a forward without backward (no-op unless sharded).

    FSDP2 keeps the root's parameters (embeddings, LM head, final norm) gathered after its forward, for the backward;
    after a no-grad forward nothing reshards them, and until the next backward ``parameters()`` and ``state_dict()``
    then name the gathered copies, not the shards: an optimiser built then, a reference synced then, stepped the copies
    and left the shards as they were (a tiny MoE's embeddings were not trained after the routing measure's pass), and
    reading them once freed crashed the process."""
    if isinstance(model, nn.Module) and is_sharded(model):
        forward_root(model).reshard()


def mixed_precision(param_dtype: torch.dtype | None):
    """FSDP2's policy for ``param_dtype``: gathered parameters in it, gradients reduced in fp32 (None: as they are)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def apply_fsdp2(module: nn.Module, mesh, param_dtype: torch.dtype | None = None) -> None:
    """:func:`shard_model` ``module.policy`` and ``module.ref_policy`` over the data-parallel part of ``mesh``.

    The critic head (PPO) is sharded on its own so that its gradient is reduced as well.
    """
    from torch.distributed.fsdp import fully_shard

    dp_mesh = _data_parallel_mesh(mesh)
    for name in ("policy", "ref_policy"):
        model = getattr(module, name, None)
        if model is not None and not is_sharded(model):
            shard_model(model, dp_mesh, param_dtype)
    value_head = getattr(module, "value_head", None)
    if value_head is not None and not is_sharded(value_head):
        fully_shard(value_head, mesh=dp_mesh, mp_policy=mixed_precision(param_dtype))


def unsharded_class(model: nn.Module) -> type:
    """The model's own class: ``fully_shard`` swaps in a subclass named ``FSDP<Class>``."""
    cls = type(model)
    if is_sharded(model):
        for base in cls.__mro__[1:]:
            if f"FSDP{base.__name__}" == cls.__name__:
                return base
    return cls


def _data_parallel_mesh(mesh):
    names = mesh.mesh_dim_names or ()
    if "data_parallel" in names:
        dp = mesh["data_parallel"]
        tp_size = mesh["tensor_parallel"].size() if "tensor_parallel" in names else 1
        if tp_size > 1:
            raise ValueError(
                f"lit_gspo shards with FSDP2 over the data-parallel dimension only; the ModelParallelStrategy mesh has "
                f"tensor_parallel_size={tp_size}. Set --trainer.strategy.data_parallel_size {mesh.size()} "
                "--trainer.strategy.tensor_parallel_size 1."
            )
        return dp
    return mesh


def full_state_dict(model: nn.Module, cpu_offload: bool = True) -> dict[str, Tensor]:
    """The full (unsharded) state dict; collective under FSDP2 (every rank must call it). ``cpu_offload``: on CPU,
    and on rank 0 only (the others get an empty dict); else on the parameters' device, on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))
