"""Model layer: policy loading (built-ins, local dirs, hub ids, GGUF), tiny builders, LoRA, MoE routing replay."""

from .builders import build_from_config, tiny_llama_config, tiny_qwen3_moe_config
from .gguf_utils import GGUF_ALIASES, drop_quantizer, packaged_gguf_path
from .loading import BUILTIN_MODELS, known_names, load_policy, parse_dtype
from .tokenizer import char_tokenizer

__all__ = [
    "BUILTIN_MODELS",
    "GGUF_ALIASES",
    "build_from_config",
    "char_tokenizer",
    "drop_quantizer",
    "known_names",
    "load_policy",
    "packaged_gguf_path",
    "parse_dtype",
    "tiny_llama_config",
    "tiny_qwen3_moe_config",
]
