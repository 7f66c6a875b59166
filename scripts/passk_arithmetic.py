"""pass@k and mean@1 of a model on the held-out arithmetic sets: how far reinforcing its own samples can reach.

    python scripts/passk_arithmetic.py smollm2-135m-instruct            # the base model
    python scripts/passk_arithmetic.py runs/smollm2_gspo_arithmetic/hf_model --k 64 --n 64

For each of ``n`` held-out prompts per set (the training wording, ``scripts/eval_arithmetic.py``'s
``add`` and ``sub``), ``k`` replies are sampled as in training (temperature ``T``, ≤ ``max_new_tokens``)
and scored with the training reward (last number = answer) by ``lit-gspo eval``'s ``evaluate``. pass@k = share
of prompts with at least one correct reply (the unbiased estimator with c correct of k samples is 1 if
c > 0); mean@1 = mean reward (``evaluate``'s mean@k: the expected reward of one sample).
A prompt with pass@k = 0 gives GRPO-style objectives no signal: every reward of its group is equal.
"""

from __future__ import annotations

import argparse

from eval_arithmetic import eval_sets, load


def main(argv: list[str] | None = None) -> dict:
    import torch

    from lit_gspo.rl.evaluate import evaluate

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="HF model dir, or a name load_policy knows (e.g. smollm2-135m-instruct)")
    parser.add_argument("--k", type=int, default=64, help="samples per prompt")
    parser.add_argument("--n", type=int, default=64, help="held-out prompts per set")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max_new_tokens", type=int, default=16, help="as in configs/smollm2 (sampling)")
    parser.add_argument("--prompts_per_batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.k < 1 or args.n < 1:
        parser.error(f"--k and --n must be ≥ 1, got k={args.k}, n={args.n}")
    torch.set_num_threads(args.threads)
    module = load(args.model, max_new_tokens=args.max_new_tokens, seed=args.seed, device=args.device)
    sets, results = eval_sets(args.n), {}
    for i, name in enumerate(("add", "sub")):
        out = evaluate(
            module.policy,
            module.collector,
            sets[name],
            greedy=False,
            samples=args.k,
            ks=[args.k],
            temperature=args.temperature,
            sample_batch_size=args.prompts_per_batch,
            seed=args.seed if i == 0 else None,
        )["sampled"]  # seeded once: the sets share one stream
        results[name] = {f"pass@{args.k}": out[f"pass@{args.k}"], "mean@1": out[f"mean@{args.k}"]}
        print(
            f"{name}: pass@{args.k} {results[name][f'pass@{args.k}']:.3f}  mean@1 {results[name]['mean@1']:.3f}"
            f"  ({args.n} prompts × {args.k} samples, T {args.temperature}, ≤ {args.max_new_tokens} tokens)",
            flush=True,
        )
    print(
        f"reproduce: python scripts/passk_arithmetic.py {args.model} --k {args.k} --n {args.n} "
        f"--temperature {args.temperature} --max_new_tokens {args.max_new_tokens} --seed {args.seed}"
    )
    return results


if __name__ == "__main__":
    main()
