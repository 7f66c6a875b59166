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
Scored by ``lit-gspo eval``'s ``evaluate`` (``lit_gspo/rl/evaluate.py``) on these sets, with the settings in
``load`` below; ``lit-gspo eval --config configs/smollm2/gspo_arithmetic.yaml --ckpt <model>`` scores that
config's own held-out prompts with its settings instead.
Subtraction sets are also scored apart by whether the units column borrows (``a % 10 < b % 10``):
``sub_borrow`` and ``sub_no_borrow`` in the JSON, with their counts.
"""

from __future__ import annotations

import argparse
import json
import random
import time

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
            rows.append(
                {
                    "prompt": template.format(a=a, op=op, b=b),
                    "answer": str(a + b if op == "+" else a - b),
                    "borrow": op == "-" and a % 10 < b % 10,
                }
            )
        sets[name] = rows
    return sets


def load(model: str, *, max_new_tokens: int, seed: int = 0, device: str = "cpu"):
    """``lit-gspo eval``'s model and trainer pieces, set as these scripts score: the training reward (the last
    number of the reply equals the answer), the lean sampler with the model's attention, fp32, the chat template
    with its default system prompt. An explicit config: not the settings of the run the model comes from."""
    from lit_gspo.tools.eval import load as load_eval

    config = {
        "seed_everything": seed,
        "trainer": {"precision": "32-true"},
        "model": {
            "rewards": [{"class_path": "lit_gspo.rl.rewards.AnswerMatch", "init_args": {"mode": "last_number"}}],
            "engine": {"class_path": "lit_gspo.rl.engines.LeanSampler"},
            "generation": {"max_new_tokens": max_new_tokens, "max_prompt_length": 512},
        },
    }
    return load_eval(["--config", json.dumps(config), "--ckpt", model, "--device", device]).model


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="HF model dir, or a name load_policy knows (e.g. smollm2-135m-instruct)")
    parser.add_argument("--n", type=int, default=128, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--show", type=int, default=2, help="print this many replies per set")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    from lit_gspo.rl.evaluate import evaluate

    module = load(args.model, max_new_tokens=args.max_new_tokens, device=args.device)
    results = {"model": args.model, "n": args.n, "max_new_tokens": args.max_new_tokens}
    start = time.perf_counter()
    for name, rows in eval_sets(args.n).items():
        out = evaluate(module.policy, module.collector, rows, greedy=True, greedy_batch_size=args.batch_size)
        scores = [p["greedy_reward"] for p in out["per_prompt"]]
        results[name] = out["greedy"]["accuracy"]
        print(f"{name:>13}: {100 * results[name]:5.1f}%  ({int(sum(scores))}/{len(scores)})", flush=True)
        if "sub" in name:
            for part, borrow in (("borrow", True), ("no_borrow", False)):
                kept = [s for s, r in zip(scores, rows) if r["borrow"] == borrow]
                results[f"{name}_{part}"] = {"correct": int(sum(kept)), "of": len(kept)}
                print(f"{'':>15}{part.replace('_', ' ')}: {int(sum(kept))}/{len(kept)}")
        for p in out["per_prompt"][: args.show]:
            print(f"    {p['prompt']!r} -> {p['greedy_completion']!r} ({'ok' if p['greedy_solved'] else 'wrong'})")
    results["seconds"] = time.perf_counter() - start
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
