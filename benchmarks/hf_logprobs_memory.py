"""Peak host RSS of one HFGenerate rollout that returns the sampler's log-probs (SmolLM2-135M, fp32, 16 prompts × 8,
≤ 64 new tokens), for the lit_gspo checkout given (compare two commits through a ``git worktree``):

    python benchmarks/hf_logprobs_memory.py /path/to/checkout [--model checkpoints/smollm2-135m-instruct]

Until 2026-11-28 HFGenerate asked transformers for ``output_scores`` and stacked them: (rows, T, vocabulary) in fp32,
several of them alive at once. One process per measurement (the peak RSS is the process's).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", help="the lit_gspo checkout to import")
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct")
    args = parser.parse_args()
    sys.path.insert(0, args.checkout)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import lit_gspo
    from lit_gspo.rl.engines import HFGenerate

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [tokenizer(f"Write a long story about the number {i}.")["input_ids"] for i in range(16)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    torch.manual_seed(0)
    start = time.perf_counter()
    batch = HFGenerate().sample(
        model,
        prompts,
        num_generations=8,
        max_new_tokens=64,
        pad_id=tokenizer.pad_token_id or 0,
        eos_id=tokenizer.eos_token_id,
        temperature=1.0,
        return_logprobs=True,
    )
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"{lit_gspo.__file__}: peak RSS {before:.0f} MB loaded -> {after:.0f} MB after the rollout ({after - before:+.0f}); "
        f"completions {tuple(batch.completion_mask.shape)}, {seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
