"""Completion tokens per second of each rollout engine at one shape: issue 36's sampler target.

    python benchmarks/sampler_speed.py --device cuda                      # Qwen3-0.6B's shape, bf16-mixed, 8 prompts × 8 × 256
    python benchmarks/sampler_speed.py --device cpu --dry-run             # a 2-layer Qwen3, fp32, 2 × 4 × 16: the code path

The policy has random weights of ``--model-config``'s shape (default ``benchmarks/shapes/qwen3-0.6b.config.json``):
no download. Prompts are random token ids of ``--prompt-length``; no token is an EOS, so every row decodes
``--max-new-tokens`` tokens (the EOS id is one past the vocabulary) and the rate is that of the full shape (the target: ≥ 20,000 completion tokens/s on an
H100 for 64 rows × 256 new tokens in bf16). ``--precision``: as a fit's rollouts run under Lightning's precision of that
name: ``bf16-mixed`` (the CUDA default: fp32 weights under bf16 autocast, as training holds them), ``bf16-true`` (bf16
weights), ``32-true``. Each engine samples once untimed (warm-up: CUDA graphs, compilation), then ``--repeats`` times;
the median is reported. Engines run one after another in this process.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the GPU machine runs the working tree, lit_gspo not installed
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # vs_trl's profile summary

DRY_RUN_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


PRECISIONS = ("bf16-mixed", "bf16-true", "32-true")


def build_policy(config_path: Path, device: str, dtype, dry_run: bool):
    from transformers import AutoConfig, Qwen3Config

    from lit_gspo.models import build_from_config

    config = Qwen3Config(**DRY_RUN_CONFIG) if dry_run else AutoConfig.from_pretrained(config_path)
    return build_from_config(config, seed=0).to(device=device, dtype=dtype).eval(), config.vocab_size


def engine_specs(text: str) -> list[tuple[str, str, dict]]:
    """``"StaticCacheSampler,StaticCacheSampler(decode_attention=None),LeanSampler"`` → (label, class name, keyword
    arguments) each: an engine class of lit_gspo.rl.engines, optionally with literal arguments (an A/B of one setting in
    one run)."""
    import ast

    specs, depth, start = [], 0, 0
    for i, char in enumerate(text + ","):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            label = text[start:i].strip()
            start = i + 1
            node = ast.parse(label, mode="eval").body
            if isinstance(node, ast.Name):
                specs.append((label, node.id, {}))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args:
                kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                specs.append((label, node.func.id, kwargs))
            else:
                raise ValueError(f"an engine is Name or Name(key=literal, ...), got {label!r}")
    return specs


def measure(engine, policy, prompts, *, G: int, T: int, repeats: int, device: str, never: int) -> dict:
    import torch

    def once() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        batch = engine.sample(
            policy, prompts, num_generations=G, max_new_tokens=T, pad_id=0, eos_id=never, temperature=1.0
        )
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        once.tokens = int(batch.completion_mask.sum())
        return elapsed

    warmup = once()  # on CUDA: torch.compile of the decoding step and its CUDA graphs' recording
    print(f"  warm-up: {warmup:.1f} s, {once.tokens} tokens", flush=True)
    times = []
    for repeat in range(repeats):
        times.append(once())
        print(f"  sample {repeat + 1}: {times[-1]:.2f} s, {once.tokens / times[-1]:.0f} tok/s", flush=True)
    median = statistics.median(times)
    return dict(warmup_s=warmup, median_s=median, tokens=once.tokens, tok_s=once.tokens / median)


def profiled(engine, policy, prompts, *, G: int, T: int, device: str, never: int, table: Path) -> dict:
    """One more, untimed ``sample`` under ``torch.profiler``: where a decoding step's time goes, on the device
    (kernels; a CUDA graph's replay is one launch) and on the host (the ops' own CPU time: Python, dispatch, the
    compiled step's guards). Writes the top ops by host time to ``table``."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vs_trl import profile_summary

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        with torch.profiler.record_function("lit_gspo.sample"):
            engine.sample(policy, prompts, num_generations=G, max_new_tokens=T, pad_id=0, eos_id=never, temperature=1.0)
        if cuda:
            torch.cuda.synchronize()
    table.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    host = profile_summary(prof, "lit_gspo.sample", cuda=False)
    out = dict(host=host, per_step_ms=round(host.get("region_ms", 0) / T, 3))
    if cuda:
        out["device"] = profile_summary(prof, "lit_gspo.sample", cuda=True)
        out["graph_launches"] = sum(e.name == "cudaGraphLaunch" for e in prof.events())
    return out


def profile_brief(p: dict) -> str:
    """``5.40 ms a step; host: other 60%, ...; device 1.1 ms a step, busy 20%, 256 graph launches``."""
    host = p["host"]
    if "error" in host:
        return host["error"]
    line = f"{p['per_step_ms']:.2f} ms a step; host top ops: " + ", ".join(
        f"{n} {t} ms" for n, t in host["top_ops"][:5]
    )
    device = p.get("device")
    if device and "error" not in device:
        steps = max(p["per_step_ms"] and host["region_ms"] / p["per_step_ms"], 1)
        line += (
            f"; device {device['total_ms'] / steps:.2f} ms a step, busy {100 * device['busy']:.0f}%, "
            f"{p['graph_launches']} graph launches; device top ops: "
            + ", ".join(f"{n} {t} ms" for n, t in device["top_ops"][:5])
        )
    return line


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes (a 2-layer Qwen3, 2 prompts × 4 × 16 tokens)")
    p.add_argument("--model-config", type=Path, default=ROOT / "benchmarks/shapes/qwen3-0.6b.config.json")
    p.add_argument("--precision", choices=PRECISIONS, help="default: bf16-mixed on CUDA, 32-true on CPU")
    p.add_argument("--prompts", type=int, help="default 8 (dry run 2)")
    p.add_argument("--G", type=int, help="completions per prompt (default 8, dry run 4)")
    p.add_argument("--max-new-tokens", type=int, help="default 256 (dry run 16)")
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--engines",
        default="StaticCacheSampler,LeanSampler,HFGenerate",
        help="class names in lit_gspo.rl.engines, each optionally with literal keyword arguments "
        "(StaticCacheSampler(decode_attention=None)); one missing there is reported as such",
    )
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--profile-dir",
        type=Path,
        help="profile one more sample of the first engine (torch.profiler): sampler_profile.txt there, a summary in "
        "the JSON",
    )
    args = p.parse_args(argv)
    import torch

    import lit_gspo.rl.engines as engines

    small = args.dry_run
    prompts_n, G, T = (
        args.prompts or (2 if small else 8),
        args.G or (4 if small else 8),
        args.max_new_tokens or (16 if small else 256),
    )
    precision = args.precision or ("bf16-mixed" if args.device == "cuda" else "32-true")
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    policy, vocab = build_policy(args.model_config, args.device, dtype, small)
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (prompts_n, args.prompt_length), generator=generator).tolist()
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else args.device
    shape = f"{prompts_n} prompts × {G} × {T} new tokens, prompt {args.prompt_length}, {precision}"
    print(f"sampler speed on {where}: {'dry run' if small else args.model_config.name}, {shape}", flush=True)
    results = {}

    def save() -> None:  # as rows are measured: a time limit that ends the run keeps them
        if args.json:
            args.json.write_text(json.dumps(dict(device=where, shape=shape, engines=results), indent=1))

    specs = engine_specs(args.engines)
    for name, class_name, kwargs in specs:
        cls = getattr(engines, class_name, None)
        if cls is None:
            results[name] = dict(error="not in lit_gspo.rl.engines")
            continue
        torch.manual_seed(0)
        engine = cls(**kwargs)
        try:
            with autocast:
                results[name] = measure(
                    engine, policy, prompts, G=G, T=T, repeats=args.repeats, device=args.device, never=vocab
                )  # an id past the vocabulary: no row ends early
                save()  # the speed, before the profile
                if args.profile_dir and name == specs[0][0]:
                    args.profile_dir.mkdir(parents=True, exist_ok=True)
                    results[name]["profile"] = profiled(
                        engine,
                        policy,
                        prompts,
                        G=G,
                        T=T,
                        device=args.device,
                        never=vocab,
                        table=args.profile_dir / "sampler_profile.txt",
                    )
                    print(f"{name} profile: {profile_brief(results[name]['profile'])}", flush=True)
        except Exception as error:  # a crash is one row of the table
            results[name] = dict(results.get(name, {}), error=f"{type(error).__name__}: {error}"[:300])
        save()
        print(f"{name}: {results[name]}", flush=True)
    width = max(20, *(len(name) + 1 for name in results))
    print(f"{'engine':<{width}} {'tok/s':>10} {'median s':>9} {'warm-up s':>10} {'tokens':>7}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<{width}} FAILED: {r['error']}")
        else:
            print(f"{name:<{width}} {r['tok_s']:10.0f} {r['median_s']:9.3f} {r['warmup_s']:10.2f} {r['tokens']:7d}")
    command = "python benchmarks/sampler_speed.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"reproduce: {command}")
    out = dict(device=where, shape=shape, engines=results, command=command)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
