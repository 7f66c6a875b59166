"""What one token keeps for backward per layer, plain modules against ``update.lean_activations``' lean ones.

Autograd's saved storages (``runtime/token_budget.saved_bytes_per_token``: a forward of one row at 64 and 192 tokens,
the difference over the difference of lengths), through ``model.model`` (no LM head) of 2 layers at SmolLM2-135M's
and Qwen3-0.6B's shapes (random weights), in fp32, under bf16 autocast and on bf16 casts (``update.param_dtype``);
per layer, the final norm's share included. CPU, ~20 s:

    python benchmarks/activation_bytes.py
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from lit_gspo.models.cast_parameters import CastParameters
from lit_gspo.models.lean_activations import LeanActivations
from lit_gspo.runtime.token_budget import saved_bytes_per_token

ROOT = Path(__file__).resolve().parents[1]
LAYERS = 2


def models():
    smollm2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    yield "SmolLM2-135M", LlamaForCausalLM, LlamaConfig(num_hidden_layers=LAYERS, vocab_size=1024, **smollm2)
    qwen = json.loads((ROOT / "benchmarks/shapes/qwen3-0.6b.config.json").read_text())
    qwen.update(num_hidden_layers=LAYERS, layer_types=qwen["layer_types"][:LAYERS], vocab_size=1024)
    yield "Qwen3-0.6B's shape", Qwen3ForCausalLM, Qwen3Config(**qwen)


def precision(model, name: str):
    if name == "bf16 autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
    if name == "bf16 casts":
        return CastParameters(torch.bfloat16).active(model)
    return contextlib.nullcontext()


def per_layer(model, setting: str, lean: bool) -> float:
    def forward(length: int):
        return model.model(input_ids=torch.arange(length)[None] % 1024).last_hidden_state

    with LeanActivations().active(model) if lean else contextlib.nullcontext(), precision(model, setting):
        return saved_bytes_per_token(forward) / LAYERS


def main() -> None:
    print("| per token and layer | plain | lean | less |\n|---|---|---|---|")
    for name, cls, config in models():
        torch.manual_seed(0)
        model = cls(config)
        for setting in ("fp32", "bf16 autocast", "bf16 casts"):
            plain, lean = per_layer(model, setting, lean=False), per_layer(model, setting, lean=True)
            print(f"| {name}, {setting} | {plain / 1000:.1f} KB | {lean / 1000:.1f} KB | {1 - lean / plain:.0%} |")
    print("\nreproduce: python benchmarks/activation_bytes.py")


if __name__ == "__main__":
    main()
