"""Peak memory and optimizer-state bytes per parameter: AdamW vs bitsandbytes AdamW8bit, one process vs FSDP2.

    python benchmarks/memory.py                      # ~24M-parameter Llama (tiny-llama scaled up), CPU
    python benchmarks/memory.py --hidden 768 --layers 8 --intermediate 2048   # ~45M

Each configuration runs in fresh processes (so peak RSS is that configuration's own): build the model
(FSDP2: ``lit_gspo.runtime.sharding.shard_model`` over 2 gloo ranks, as ``RLModule.configure_model``
does), then ``--steps`` forward/backward/optimizer steps on random tokens. Reported per rank (the
maximum over ranks): peak RSS (``ru_maxrss``), its growth over the process after imports, and the
optimizer state held by the rank; "state bytes / param" divides the state of all ranks by the model's
parameter count. Prints a markdown table and the command that reproduces it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time

OPTIMIZERS = {"AdamW": "torch.optim.AdamW", "AdamW8bit": "bitsandbytes.optim.AdamW8bit"}


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(args) -> None:
    import importlib

    import torch

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(1)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
    from lit_gspo.models import load_policy
    from lit_gspo.runtime.optim import optimizer_state_bytes, shard_aware
    from lit_gspo.runtime.sharding import shard_model

    if args.optimizer != "AdamW":
        from lit_gspo.runtime.extras import require

        require("bitsandbytes", "An 8-bit optimizer")  # import before measuring the baseline
    baseline = rss_mb()
    policy, _ = load_policy(
        "tiny-llama",
        config_overrides={
            "hidden_size": args.hidden,
            "num_hidden_layers": args.layers,
            "intermediate_size": args.intermediate,
            "num_attention_heads": args.hidden // 64,
            "num_key_value_heads": max(1, args.hidden // 128),
        },
        seed=0,
    )
    n_params = sum(p.numel() for p in policy.parameters())
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        shard_model(policy, init_device_mesh("cpu", (world,)))
    module, name = OPTIMIZERS[args.optimizer].rsplit(".", 1)
    opt = shard_aware(getattr(importlib.import_module(module), name)(policy.parameters(), lr=1e-4))
    policy.train()
    generator = torch.Generator().manual_seed(rank)
    start = time.perf_counter()
    for _ in range(args.steps):
        ids = torch.randint(4, policy.config.vocab_size, (args.batch, args.seq), generator=generator)
        loss = policy(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    seconds = (time.perf_counter() - start) / args.steps
    print(
        json.dumps(
            {
                "rank": rank,
                "params": n_params,
                "peak_rss_mb": rss_mb(),
                "baseline_mb": baseline,
                "state_bytes": optimizer_state_bytes(opt),
                "s_per_step": seconds,
            }
        ),
        flush=True,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args, optimizer: str, world: int) -> dict:
    port = str(_free_port())
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--optimizer",
        optimizer,
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--intermediate",
        str(args.intermediate),
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
    ]
    procs = [
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": "1",
                "PYTHONWARNINGS": "ignore",
            },
        )
        for r in range(world)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{optimizer} world={world} failed:\n{err[-3000:]}")
        results.append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1]))
    return {
        "optimizer": optimizer,
        "world": world,
        "params": results[0]["params"],
        "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
        "growth_mb": max(r["peak_rss_mb"] - r["baseline_mb"] for r in results),
        "state_mb_per_rank": max(r["state_bytes"] for r in results) / 2**20,
        "state_bytes_per_param": sum(r["state_bytes"] for r in results) / results[0]["params"],
        "s_per_step": max(r["s_per_step"] for r in results),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--optimizer", default="AdamW", choices=sorted(OPTIMIZERS))
    parser.add_argument("--worlds", default="1,2", help="process counts to measure (1 = single process, 2 = FSDP2)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    rows = [measure(args, opt, int(w)) for w in args.worlds.split(",") for opt in OPTIMIZERS]
    print(
        f"\nModel: tiny-llama, hidden {args.hidden}, {args.layers} layers, MLP {args.intermediate}: "
        f"{rows[0]['params'] / 1e6:.1f}M parameters; batch {args.batch}×{args.seq} tokens, {args.steps} steps, CPU.\n"
    )
    print(
        "| setup | optimizer | peak RSS / rank (MiB) | RSS growth / rank (MiB) | optimizer state / rank (MiB) "
        "| state bytes / param | s / step |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        setup = "1 process" if r["world"] == 1 else f"FSDP2, {r['world']} ranks"
        print(
            f"| {setup} | {r['optimizer']} | {r['peak_rss_mb']:.0f} | {r['growth_mb']:.0f} | {r['state_mb_per_rank']:.1f} "
            f"| {r['state_bytes_per_param']:.2f} | {r['s_per_step']:.2f} |"
        )
    extra = " ".join(f"--{k} {getattr(args, k)}" for k in ("hidden", "layers", "intermediate", "steps", "batch", "seq"))
    print(f"\nReproduce: python benchmarks/memory.py {extra}")


if __name__ == "__main__":
    main()
