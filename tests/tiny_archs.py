"""Every causal-LM architecture transformers ships (``AutoModelForCausalLM``'s mapping), built tiny from its own default
config with the sizes shrunk: what ``tests/test_forward_checks.py`` enumerates."""

from __future__ import annotations

import warnings

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

#: the sizes set wherever a config has the attribute (a model family names them its own way)
SMALL = dict(
    hidden_size=32,
    n_embd=32,
    d_model=32,
    num_hidden_layers=2,
    n_layer=2,
    num_layers=2,
    decoder_layers=2,
    num_attention_heads=4,
    n_head=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    ffn_dim=64,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    linear_num_value_heads=2,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    vocab_size=64,
    max_position_embeddings=128,
)
#: the depth's names (a hybrid's first 2 layers may both be recurrent: then 4 or 8)
DEPTHS = ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers")
#: per-layer lists sized for the default depth: None lets the config derive them for 2 layers
PER_LAYER = ("layer_types", "mlp_layer_types", "full_attn_idxs", "block_types")
MAX_PARAMETERS = 5_000_000


def derived(config_class: type, name: str) -> bool:
    """Whether the config computes ``name`` from its other fields (a property: not to be set)."""
    return isinstance(getattr(config_class, name, None), property)


def causal_lm_types() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_causal_lm(model_type: str, **overrides) -> torch.nn.Module | None:
    """``model_type``'s causal LM, fp32, eval mode, seeded, or None where its default config does not shrink this way
    (a composite config, a size that must divide another, more than :data:`MAX_PARAMETERS` parameters)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:
            shrunk = shrunk_sizes(model_type, overrides)
            if shrunk is None:
                return None
            sizes, depths = shrunk
            for heads in ({}, {"num_key_value_heads": 4}):  # latent attention (DeepSeek-V3) has as many as queries
                model = built(model_type, {**sizes, **heads}, depths)
                if model is not None:
                    return model
            return None
        finally:
            transformers.logging.set_verbosity(verbosity)


def shrunk_sizes(model_type: str, overrides: dict) -> tuple[dict, list[str]] | None:
    """The config arguments of the tiny model and the config's names of its depth; None for a composite config, or
    one whose sizes are per layer."""
    try:
        default = AutoConfig.for_model(model_type)
        if default.get_text_config() is not default:
            return None
        return small_sizes(default, overrides), [k for k in DEPTHS if hasattr(default, k)]
    except Exception:  # noqa: BLE001 - a config that cannot be read this way (per-layer sizes)
        return None


def small_sizes(config, overrides: dict) -> dict:
    """The arguments that shrink ``config``: :data:`SMALL` where it has the attribute, per-layer lists derived again,
    the tiny tokenizer's special ids, then ``overrides``."""
    sizes = {k: v for k, v in SMALL.items() if hasattr(config, k)}
    sizes.update({k: None for k in PER_LAYER if hasattr(config, k) and not derived(type(config), k)})
    return {**sizes, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, **overrides}


def built(model_type: str, sizes: dict, depths: list[str]) -> torch.nn.Module | None:
    """The model of ``sizes``, deeper (``depths``: the config's names of it) where its first layers are all recurrent;
    None where it does not build or run."""
    try:
        config = AutoConfig.for_model(model_type, **sizes)
        for depth in (4, 8):  # a hybrid's first layers may all be recurrent (linear attention): its pattern's
            if any(hasattr(layer, "batch_repeat_interleave") for layer in DynamicCache(config=config).layers):
                break  # attention layers come further on, and a cache of recurrent layers alone cannot decode
            config = AutoConfig.for_model(model_type, **{**sizes, **dict.fromkeys(depths, depth)})
        else:
            return None
        with torch.device("meta"):
            if sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters()) > MAX_PARAMETERS:
                return None
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 4, 5]]), use_cache=False)
        return model
    except Exception:  # noqa: BLE001 - any failure to build or run is "does not shrink this way"
        return None


def tiny_composite_lm(model_type: str, **text_overrides) -> torch.nn.Module:
    """A composite (vision + text) checkpoint's causal LM, as ``AutoModelForCausalLM`` loads Gemma 3's or Qwen3.5's,
    its text config shrunk as :func:`tiny_causal_lm` shrinks one and its vision tower to one small layer."""
    default = AutoConfig.for_model(model_type)
    text_sizes = small_sizes(default.get_text_config(), text_overrides)
    vision = default.vision_config.to_dict() if getattr(default, "vision_config", None) is not None else {}
    small_vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, depth=1, num_attention_heads=4)
    small_vision.update(num_heads=4, out_hidden_size=32, embed_dim=32)
    vision_sizes = {k: v for k, v in small_vision.items() if k in vision}
    config = AutoConfig.for_model(model_type, text_config=text_sizes, vision_config=vision_sizes)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config).eval()
