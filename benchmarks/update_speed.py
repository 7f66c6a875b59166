"""The update alone, variant beside variant: which of ``update.compile`` and ``update.param_dtype`` makes it fastest,
and what ``update.lean_activations`` (on in every variant but ``plain activations``) saves of its memory.

Issue 36's update-phase MFU target (≥ 25 % on an H100; eager it was elementwise-bound) rests on two opt-ins that only
a GPU can rank. ``benchmarks/vs_trl.py`` measures one configuration per process, each paying its model load and its
sampler's compile; this times every variant of the update in one process, on the same rollouts, alternated
(A B C D, B C D A, ...), without sampling:

- the policy: Qwen3-0.6B's shape with SmolLM2's 49,152-token vocabulary (``benchmarks/shapes/qwen3-0.6b.config.json``,
  as vs_trl's GPU runs), random weights (seed 0);
- one update as vs_trl's lit_gspo runs it: 64 rows (8 prompts × 8) × (32 prompt + 256 completion) tokens, completions
  full length (at random weights vs_trl's completions average 255.7 of 256 tokens), 2 minibatches of GSPO token-mean,
  the second with its old log-probs, AdamW fused, gradient clipping at 1, bf16 autocast without its cast cache (as
  Lightning's ``bf16-mixed``), every other ``Update`` setting its default (the micro-batches' token budget, aligned rows);
- per variant: its first learn (with its compile), the median seconds of a learn over ``--repeats``, MFU as vs_trl
  counts it (6 · parameters · tokens · (1 + 1/6) over the learn's seconds and an 8192³ bf16 matmul's FLOP/s), the
  peak device memory of a learn (weights, gradients, optimiser state, activations; no sampler's caches), and how far
  the gradient of its first optimiser step is from the first variant's (each takes its first learn from the same
  weights, optimiser state and minibatch: ‖g_variant − g_first‖ / ‖g_first‖; bf16's rounding is ~1e-2).

    python benchmarks/update_speed.py --device cuda                    # the five default variants, 3 repeats
    python benchmarks/update_speed.py --device cuda --variants eager,compiled --repeats 5
    python benchmarks/update_speed.py --dry-run                        # CPU, a 2-layer Qwen3, 8 rows × (8 + 24)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

#: name -> the Update settings that make the variant (every other setting its default)
VARIANTS = {
    "eager": {},
    "plain activations": dict(lean_activations=False),
    "compiled": dict(compile=True),
    "bf16 casts": dict(param_dtype="bf16"),
    "compiled bf16 casts": dict(compile=True, param_dtype="bf16"),
    "padded": dict(align_rows=False),
}
DEFAULT_VARIANTS = "eager,plain activations,compiled,bf16 casts,compiled bf16 casts"
#: executed FLOPs relative to 6 · params · tokens: forward and backward of every row, and a forward of the second
#: minibatch's half for its old log-probs (vs_trl's ``work_fraction``)
WORK_FRACTION = 1 + 1 / 6


def build_policy(args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = json.loads((ROOT / "benchmarks/shapes/qwen3-0.6b.config.json").read_text())
    if args.dry_run:
        config.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        config.update(vocab_size=512)
    layers = args.layers or config["num_hidden_layers"]
    config.update(num_hidden_layers=layers, layer_types=config["layer_types"][:layers])
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**config)).to(args.device), config["vocab_size"]


def learner_for(policy, variant: str, args):
    from lit_gspo.rl.config import Update
    from lit_gspo.rl.learn.learner import Learner
    from lit_gspo.rl.objectives import GSPO

    update = Update(
        **{**dict(num_minibatches=2, max_grad_norm=1.0, skip_zero_advantage_rows=False), **VARIANTS[variant]}
    )
    objective = GSPO(clip_low=3e-4, clip_high=4e-4, beta=0.0, aggregation="token-mean")
    return Learner(policy, objective, update, max_len=args.completion, group_size=args.G)


def rollout(args, vocab: int, seed: int):
    from host_reads import random_rollout

    rows = args.prompts * args.G
    batch = random_rollout(rows, args.prompt, args.completion, args.G, vocab, seed=seed, min_completion=args.completion)
    return batch.to(torch.device(args.device))


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_learn(learner, batch, optimizer, device: str, step=None) -> tuple[float, float | None]:
    """Seconds of one learn under bf16 autocast as Lightning's ``bf16-mixed`` enters it, and the device's peak memory
    (GB; None on the CPU). ``step``: the learner's optimiser step (its default if None)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    synchronize(device)
    start = time.perf_counter()
    with torch.autocast(device_type=device, dtype=torch.bfloat16, cache_enabled=False):
        metrics = learner.learn(batch, optimizer, step=step)
    synchronize(device)
    seconds = time.perf_counter() - start
    if not all(math.isfinite(metrics[key]) for key in ("loss", "grad_norm")):
        raise RuntimeError(f"a non-finite loss or gradient norm in the learn: {metrics}")
    return seconds, (torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None)


def flat_gradient(policy) -> torch.Tensor:
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).float().flatten().cpu() for p in policy.parameters()]
    )


def measure(args, save=lambda measured: None) -> dict:
    """Every variant's first learn, then ``--repeats`` rounds of one learn each; ``save(measured)`` after each learn
    (a run cut off keeps what it measured). A variant that fails (a compiler's error, out of memory) is its row."""
    from vs_trl import matmul_peak

    from lit_gspo.rl.learn.optimizer_step import clip_then_step

    policy, vocab = build_policy(args)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, weight_decay=0.0, fused=args.device == "cuda")
    initial = {k: v.detach().to("cpu", copy=True) for k, v in policy.state_dict().items()}  # not in the peak
    first = rollout(args, vocab, seed=0)
    params, tokens = sum(p.numel() for p in policy.parameters()), float(first.attention_mask.sum())
    flops = 6 * params * tokens * WORK_FRACTION  # executed by one learn; MFU divides them by the matmul rate
    matmul = matmul_peak(torch.bfloat16, torch.get_num_threads(), args.device)
    measured = dict(
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        torch=torch.__version__,
        params=params,
        tokens_per_learn=tokens,
        matmul_tflops=matmul / 1e12,
        variants={},
    )
    results, learners, reference = measured["variants"], {}, None

    def record(variant: str, seconds: float, peak: float | None) -> None:
        r = results[variant]
        r["times"].append(seconds)
        r["peak_gb"] = max(filter(None, [r["peak_gb"], peak]), default=None)
        r["median_s"] = statistics.median(r["times"])
        r["mfu"] = flops / r["median_s"] / matmul
        save(measured)

    def failed(variant: str, error: Exception) -> None:
        results[variant] = dict(error=f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}")
        learners.pop(variant, None)
        optimizer.zero_grad()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        print(f"{variant}: FAILED {results[variant]['error']}", flush=True)
        save(measured)

    for variant in args.variants:
        # its first learn (its compile, the token budget's measuring forward) from the same weights and optimiser state;
        # the gradient of its first optimiser step (the first minibatch's, before clipping) is compared
        policy.load_state_dict(initial)
        optimizer.state.clear()
        torch.manual_seed(0)  # the same rows in the first minibatch
        gradients = []

        def first_gradient(optimizer, clip, may_step):
            if not gradients:
                gradients.append(flat_gradient(policy))
            return clip_then_step(optimizer, clip, may_step)

        try:
            learners[variant] = learner_for(policy, variant, args)
            seconds, _ = timed_learn(learners[variant], first, optimizer, args.device, step=first_gradient)
        except Exception as error:  # noqa: BLE001 - the variant's row says what failed; the others still run
            failed(variant, error)
            continue
        reference = gradients[0] if reference is None else reference
        off = float((gradients[0] - reference).norm()) / max(float(reference.norm()), 1e-30)
        results[variant] = dict(first_s=seconds, times=[], peak_gb=None, median_s=None, mfu=None, gradient_off=off)
        print(
            f"{variant}: first learn {seconds:.2f} s (with its compile), its first gradient off the first's by {off:.1e}"
        )
        save(measured)
    policy.load_state_dict(initial)  # (the optimiser keeps its state: a first step's allocation is no one's time)
    batch = rollout(args, vocab, seed=1)  # one batch for every timed learn: a new shape's first learn is slower
    for repeat in range(args.repeats):  # alternated, each round starting one later: A B C D, B C D A, ...
        order = list(learners)
        start = repeat % max(len(order), 1)
        for variant in order[start:] + order[:start]:
            try:
                seconds, peak = timed_learn(learners[variant], batch, optimizer, args.device)
            except Exception as error:  # noqa: BLE001
                failed(variant, error)
                continue
            record(variant, seconds, peak)
            print(f"  repeat {repeat + 1} {variant}: {seconds:.3f} s", flush=True)
    return measured


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dry-run", action="store_true", help="CPU, a 2-layer Qwen3 of width 64, 8 rows × (8 + 24) tokens")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--layers", type=int, help="of Qwen3-0.6B's 28 (default all; dry run 2)")
    p.add_argument("--prompts", type=int, help="prompts an update (default 8 = vs_trl's 4 × 2 updates; dry run 1)")
    p.add_argument("--G", type=int, default=8, help="completions per prompt")
    p.add_argument("--prompt", type=int, help="prompt columns, left-padded (default 32; dry run 8)")
    p.add_argument("--completion", type=int, help="completion tokens, all full length (default 256; dry run 24)")
    p.add_argument("--repeats", type=int, default=3, help="timed learns per variant, alternated")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        p.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    if args.dry_run:
        args.device = "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (--dry-run runs tiny shapes on the CPU)")
    small = args.dry_run
    args.layers = args.layers or (2 if small else None)
    args.prompts = args.prompts or (1 if small else 8)
    args.prompt = args.prompt or (8 if small else 32)
    args.completion = args.completion or (24 if small else 256)
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = measure(
        args, save=lambda measured: args.json.write_text(json.dumps(measured, indent=1)) if args.json else None
    )
    print(
        f"\nthe update alone on {out['device']} (torch {out['torch']}): {out['params']:,} parameters, "
        f"{args.prompts * args.G} rows × ({args.prompt} + {args.completion}) tokens = {out['tokens_per_learn']:.0f} a "
        f"learn, 2 minibatches, bf16 autocast; MFU against {out['matmul_tflops']:.2f} TFLOP/s (vs_trl's bf16 matmul)"
    )
    print(f"{'variant':>22} {'first s':>8} {'median s':>9} {'MFU':>6} {'peak GB':>8} {'gradient off':>15}")
    for variant, r in out["variants"].items():
        if "error" in r:
            print(f"{variant:>22} FAILED {r['error']}")
            continue
        if r["median_s"] is None:
            print(f"{variant:>22} {r['first_s']:8.2f} (no timed learn)")
            continue
        peak = f"{r['peak_gb']:8.1f}" if r["peak_gb"] is not None else f"{'-':>8}"
        print(
            f"{variant:>22} {r['first_s']:8.2f} {r['median_s']:9.3f} {100 * r['mfu']:5.1f}% {peak} "
            f"{r['gradient_off']:15.2e}"
        )
    timed = {v: r for v, r in out["variants"].items() if r.get("median_s")}
    if len(timed) > 1:  # each against the first variant timed (eager, by default)
        first, base = next(iter(timed.items()))
        ratios = ", ".join(f"{v} {base['median_s'] / r['median_s']:.2f}×" for v, r in timed.items() if v != first)
        print(f"speed against {first} (its median over theirs): {ratios}")
    print("reproduce: python benchmarks/update_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    return out


if __name__ == "__main__":
    main()
