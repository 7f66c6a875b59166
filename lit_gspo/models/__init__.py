"""Model layer: policy loading (built-ins, local dirs, hub ids, GGUF), tiny builders, LoRA, MoE routing replay."""

from .builders import build_from_config, tiny_llama_config, tiny_qwen3_moe_config
from .gguf_utils import GGUF_ALIASES, drop_quantizer, packaged_gguf_path
from .loading import BUILTIN_MODELS, known_names, load_policy, parse_dtype
from .lora import apply_lora, is_lora, merged_for_saving, reference_mode
from .routing import (
    RoutingRecord,
    RoutingRecorder,
    moe_routers,
    record_routing,
    replay_routing,
    routing_volatility,
)
from .tokenizer import char_tokenizer
from .utils import (
    ParameterCount,
    checkpointing_active,
    checkpointing_paused,
    count_parameters,
    enable_gradient_checkpointing,
    eval_mode,
    freeze,
    module_mode,
)

__all__ = [
    "BUILTIN_MODELS",
    "GGUF_ALIASES",
    "ParameterCount",
    "RoutingRecord",
    "RoutingRecorder",
    "apply_lora",
    "build_from_config",
    "char_tokenizer",
    "count_parameters",
    "drop_quantizer",
    "checkpointing_active",
    "checkpointing_paused",
    "enable_gradient_checkpointing",
    "eval_mode",
    "module_mode",
    "freeze",
    "is_lora",
    "known_names",
    "load_policy",
    "merged_for_saving",
    "moe_routers",
    "packaged_gguf_path",
    "parse_dtype",
    "record_routing",
    "reference_mode",
    "replay_routing",
    "routing_volatility",
    "tiny_llama_config",
    "tiny_qwen3_moe_config",
]
