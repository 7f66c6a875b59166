"""Measure the sampler–trainer mismatch of a config's policy: the engine's own log-probs against the trainer's forward.

    python scripts/measure_mismatch.py --config configs/quickstart.yaml
    python scripts/measure_mismatch.py --config configs/smollm2/gspo_arithmetic.yaml \\
        --model.policy.name /path/to/smollm2-135m-instruct-hf --prompts 16

The config's policy (after its warm start, if it has one), tokenizer, task, engine and generation settings
sample ``--prompts`` training prompts × G under each sampler precision; the trainer then recomputes the
sampled tokens' log-probs with ``token_logprobs`` (the update's forward: LM head and log-softmax in fp32).
Pairs (sampler / trainer):
  fp32 / fp32           the same weights and dtype: what differs is the kernel path (incremental KV cache
                        vs one full forward): the floor
  bf16 / fp32           bf16-autocast sampling (as an inference engine in bf16) against fp32 training
  bf16 / bf16-autocast  a ``trainer.precision bf16-mixed`` run: both under autocast, the LM head fp32 only
                        in the trainer
Per token: k3 = r − log r − 1 with r = π_trainer/π_sampler (KL(π_sampler ‖ π_trainer)), mean and max
|log r|, and the shares TIS (C = 2) would truncate and MIS ([0.5, 5]) / SequenceMIS (product > 3) would mask.
Prints one line per pair and a JSON record (``--json PATH`` writes it).
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from dataclasses import replace

import torch

from lit_gspo.runtime.hardware import cpu_model


def autocast(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else nullcontext()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="training prompts to sample (× G completions)")
    parser.add_argument("--json", default=None, help="write the record to this file")
    own, rest = parser.parse_known_args(argv)

    from lit_gspo.rl.learn.mismatch import MIS, TIS, Mismatch, SequenceMIS, mismatch_metrics
    from lit_gspo.rl.rollout import token_logprobs
    from lit_gspo.rl.warm_start import warm_start
    from lit_gspo.tools.main import cli_main

    cli = cli_main(rest + ["--trainer.logger", "false"], run=False)
    module, dm = cli.model, cli.datamodule
    dm.setup("fit")
    policy, tok, gen = module.policy.eval(), module.tokenizer, module.generation
    encode = lambda rows: module.collector.encode(policy, rows)  # noqa: E731
    if module.warm_start_cfg.steps > 0:  # the policy RL starts from
        warm_start(
            policy,
            tok,
            dm.train_rows,
            encode,
            module.warm_start_cfg,
            module.seed,
            environment=module.collector.environment,
            end_id=module.collector.stop_ids[0],
        )
        policy.eval()
    prompt_ids = encode(dm.train_rows[: own.prompts])
    engine = module.collector.engine
    record = {
        "config": rest,
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "engine": repr(engine),
        "prompts": len(prompt_ids),
        "num_generations": gen.num_generations,
        "max_new_tokens": gen.max_new_tokens,
        "temperature": gen.temperature,
        "top_p": gen.top_p,
        "top_k": gen.top_k,
        "pairs": {},
    }
    corrections = Mismatch([TIS(), MIS(), SequenceMIS()])
    for sampler_bf16, trainer_bf16 in ((False, False), (True, False), (True, True)):
        torch.manual_seed(module.seed)
        with torch.no_grad(), autocast(sampler_bf16):
            batch = engine.sample(
                policy,
                prompt_ids,
                num_generations=gen.num_generations,
                max_new_tokens=gen.max_new_tokens,
                pad_id=tok.pad_token_id,
                eos_id=module.collector.stop_ids,
                temperature=gen.temperature,
                top_p=gen.top_p,
                top_k=gen.top_k,
                return_logprobs=True,
            )
        with torch.no_grad(), autocast(trainer_bf16):
            trainer = token_logprobs(policy, batch, temperature=gen.temperature).logprobs
        mask = batch.completion_mask
        metrics = {k.split("/")[1]: float(v) for k, v in mismatch_metrics(trainer, batch.engine_logprobs, mask).items()}
        corrected = replace(batch, old_logprobs=trainer, advantages=torch.zeros(len(batch)))
        _, _, records = corrections.before_update(corrected)
        for part, _ in records:
            metrics.update({k.split("/")[1]: v for k, v in part.items() if "frac" in k})
        metrics["tokens"] = int(mask.sum())
        name = f"sampler {'bf16' if sampler_bf16 else 'fp32'} / trainer {'bf16-autocast' if trainer_bf16 else 'fp32'}"
        record["pairs"][name] = metrics
        print(
            f"{name:40s} k3 {metrics['k3']:.3e}  max|log r| {metrics['log_ratio_abs_max']:.3e}  "
            f"mean|log r| {metrics['log_ratio_abs_mean']:.3e}  TIS-truncated {metrics['truncated_token_frac']:.4f}  "
            f"masked tokens {metrics['masked_token_frac']:.4f}  masked seqs {metrics['masked_seq_frac']:.4f}  "
            f"({metrics['tokens']} tokens)"
        )
    print(f"CPU: {record['cpu']} ({record['cpu_capability']}), torch {record['torch']}, {record['engine']}")
    print(json.dumps(record))
    if own.json:
        with open(own.json, "w") as fh:
            json.dump(record, fh, indent=1)
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
