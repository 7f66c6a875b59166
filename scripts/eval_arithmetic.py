"""Greedy accuracy of a Hugging Face model dir on held-out two-digit arithmetic, per prompt wording.

    python scripts/eval_arithmetic.py runs/smollm2_gspo_arithmetic/hf_model [--n 128] [--json out.json]
    python scripts/eval_arithmetic.py smollm2-135m-instruct          # the base model (GGUF alias)

Sets (all operand pairs are held out from training: the training prompt "What is A op B? Answer
with just the number." of each pair falls in the task's held-out split):

- ``add``: "What is A + B? Answer with just the number."        (the training wording)
- ``sub``: "What is A - B? Answer with just the number."        (A ≥ B, the training wording)
- ``reworded_add``: "Compute A plus B."  and  "A + B = ?"      (half each; wordings never trained on)
- ``reworded_sub``: "Compute A minus B."  and  "A - B = ?"

A reply is correct when its last number equals the answer (``AnswerMatch(mode="last_number")``,
the reward used in training). Prompts go through the chat template with its default system prompt.
Subtraction sets are also scored apart by whether the units column borrows (``a % 10 < b % 10``):
``sub_borrow`` and ``sub_no_borrow`` in the JSON, with their counts.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

TRAIN_TEMPLATE = "What is {a} {op} {b}? Answer with just the number."
WORDINGS = {
    "add": [TRAIN_TEMPLATE],
    "sub": [TRAIN_TEMPLATE],
    "reworded_add": ["Compute {a} plus {b}.", "{a} {op} {b} = ?"],
    "reworded_sub": ["Compute {a} minus {b}.", "{a} {op} {b} = ?"],
}


def held_out_pairs(op: str, n: int, seed: int = 1234) -> list[tuple[int, int]]:
    """``n`` distinct two-digit (a, b) pairs whose training-wording prompt is in the held-out split."""
    from lit_gspo.data import is_held_out

    rng, pairs = random.Random(f"eval:{op}:{seed}"), []
    while len(pairs) < n:
        a, b = rng.randrange(100), rng.randrange(100)
        if op == "-" and a < b:
            a, b = b, a
        if (a, b) not in pairs and is_held_out(TRAIN_TEMPLATE.format(a=a, op=op, b=b)):
            pairs.append((a, b))
    return pairs


def eval_sets(n: int) -> dict[str, list[dict]]:
    sets = {}
    for name, templates in WORDINGS.items():
        op = "-" if "sub" in name else "+"
        rows = []
        for i, (a, b) in enumerate(held_out_pairs(op, n)):
            template = templates[i % len(templates)]
            rows.append({"prompt": template.format(a=a, op=op, b=b), "answer": str(a + b if op == "+" else a - b),
                         "borrow": op == "-" and a % 10 < b % 10})
        sets[name] = rows
    return sets


@torch.no_grad()
def replies_to(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int, *,
               num_generations: int = 1, temperature: float | None = None) -> list[str]:
    """Replies to ``prompts`` (``num_generations`` consecutive ones per prompt): greedy, or sampled at ``temperature``."""
    from lit_gspo.data import encode_prompts
    from lit_gspo.engines import LeanSampler

    engine, pad_id = LeanSampler(), tokenizer.pad_token_id
    replies = []
    for start in range(0, len(prompts), batch_size):
        batch = engine.sample(model, encode_prompts(tokenizer, prompts[start:start + batch_size], max_prompt_length=512),
                              num_generations=num_generations, max_new_tokens=max_new_tokens, pad_id=pad_id,
                              eos_id=tokenizer.eos_token_id, greedy=temperature is None, temperature=temperature or 1.0)
        completions = batch.input_ids[:, batch.prompt_length:].masked_fill(~batch.completion_mask, pad_id)
        replies += tokenizer.batch_decode(completions, skip_special_tokens=True)
    return replies


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="HF model dir, or a name load_policy knows (e.g. smollm2-135m-instruct)")
    parser.add_argument("--n", type=int, default=128, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--show", type=int, default=2, help="print this many replies per set")
    args = parser.parse_args(argv)

    from lit_gspo.models import load_policy
    from lit_gspo.rewards import AnswerMatch

    model, tokenizer = load_policy(args.model)
    model.eval()
    judge = AnswerMatch(mode="last_number")
    results = {"model": args.model, "n": args.n, "max_new_tokens": args.max_new_tokens}
    start = time.perf_counter()
    for name, rows in eval_sets(args.n).items():
        prompts = [r["prompt"] for r in rows]
        replies = replies_to(model, tokenizer, prompts, args.max_new_tokens, args.batch_size)
        scores = judge(prompts, replies, answer=[r["answer"] for r in rows])
        results[name] = sum(scores) / len(scores)
        print(f"{name:>13}: {100 * results[name]:5.1f}%  ({int(sum(scores))}/{len(scores)})", flush=True)
        if "sub" in name:
            for part, borrow in (("borrow", True), ("no_borrow", False)):
                kept = [s for s, r in zip(scores, rows) if r["borrow"] == borrow]
                results[f"{name}_{part}"] = {"correct": int(sum(kept)), "of": len(kept)}
                print(f"{'':>15}{part.replace('_', ' ')}: {int(sum(kept))}/{len(kept)}")
        for p, r, s in list(zip(prompts, replies, scores))[:args.show]:
            print(f"    {p!r} -> {r!r} ({'ok' if s else 'wrong'})")
    results["seconds"] = time.perf_counter() - start
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
