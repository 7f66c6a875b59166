"""What one update launches and moves under bf16: autocast on fp32 parameters vs ``update.param_dtype: bf16``.

On a GPU a small model's update is bound by its elementwise kernels and their launches (the H200's profile of
Qwen3-0.6B's shape: matmuls 21 % of the update's device time, casts 18 %, elementwise kernels most of the rest). This
counts, on the CPU, what decides that there, for one ``learn`` (after one to warm up) at Qwen3-0.6B's layer shape
(``benchmarks/shapes/qwen3-0.6b.config.json`` with ``--layers`` of its 28 layers) as ``benchmarks/vs_trl.py`` runs the
update on a GPU (aligned rows, bf16 autocast without its cast cache as Lightning enters it, GSPO token-mean, two
minibatches, the second one's old log-probs):

- ``ops``: the aten ops dispatched (views left out): on a GPU, the kernels launched;
- ``casts``: of them, dtype conversions (``_to_copy``);
- ``elementwise GB``: bytes read and written by every op but the matmuls, attention and the optimiser (the traffic
  that unfused elementwise kernels cost; the LM head's own fp32 kernels included);
- ``saved GB``: the most activations one micro-batch's forward keeps for its backward (autograd's saved tensors, each
  storage once): the update's peak memory beyond weights, gradients and optimiser state;
- ``s``: the CPU's wall time for the learn, median of ``--repeats`` alternated runs (a CPU with native bf16 matmuls
  says something of the compute; the counts say what a GPU would run).

    python benchmarks/update_traffic.py                       # 2 layers, 16 rows × (32 + 256) tokens
    python benchmarks/update_traffic.py --layers 4 --rows 32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lit_gspo.runtime.token_budget import SavedStorages

ROOT = Path(__file__).resolve().parents[1]
#: ops whose work is a matmul, attention or the optimiser step (not elementwise traffic)
COMPUTE = ("mm", "addmm", "bmm", "matmul", "linear", "attention", "_fused_adamw", "embedding_dense_backward")
MODES = {"autocast on fp32 parameters": None, "param_dtype: bf16": "bf16"}


class Traffic(TorchDispatchMode):
    """Counts ops, casts and the bytes elementwise ops read and write."""

    def __init__(self):
        super().__init__()
        self.ops = self.casts = self.elementwise_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        self.ops += 1
        name = func.overloadpacket.__name__
        self.casts += name == "_to_copy"
        if not any(part in name for part in COMPUTE):
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.elementwise_bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def build(args, param_dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lit_gspo.rl.config import Update
    from lit_gspo.rl.learn.learner import Learner
    from lit_gspo.rl.objectives import GSPO

    config = json.loads((ROOT / "benchmarks/shapes/qwen3-0.6b.config.json").read_text())
    config.update(num_hidden_layers=args.layers, layer_types=config["layer_types"][: args.layers])
    torch.manual_seed(0)
    policy = Qwen3ForCausalLM(Qwen3Config(**config))
    update = Update(
        num_minibatches=2,
        align_rows=True,
        share_prompt_forward=False,
        skip_zero_advantage_rows=False,
        param_dtype=param_dtype,
    )
    objective = GSPO(clip_low=3e-4, clip_high=4e-4, aggregation="token-mean")
    learner = Learner(policy, objective, update, max_len=args.completion, group_size=args.group)
    return learner, torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=True), config["vocab_size"]


def measure(args) -> dict:
    from host_reads import random_rollout

    results = {}
    autocast = dict(device_type="cpu", dtype=torch.bfloat16, cache_enabled=False)  # as Lightning's bf16-mixed
    built = {name: build(args, dtype) for name, dtype in MODES.items()}
    times = {name: [] for name in MODES}
    for name, (learner, optimizer, vocab) in built.items():
        shape = (args.rows, args.prompt, args.completion, args.group, vocab)
        with torch.autocast(**autocast):
            learner.learn(random_rollout(*shape, seed=0), optimizer)  # warm-up
            traffic, saved, peak = Traffic(), SavedStorages(), [0]

            def backward(loss):  # what the micro-batch's forward and loss keep, as its backward starts
                peak[0] = max(peak[0], saved.bytes)
                saved.clear()
                loss.backward()

            with traffic, saved.counting():
                learner.learn(random_rollout(*shape, seed=1), optimizer, backward=backward)
        results[name] = dict(
            ops=traffic.ops,
            casts=traffic.casts,
            elementwise_gb=traffic.elementwise_bytes / 1e9,
            saved_gb=peak[0] / 1e9,
        )
    for repeat in range(args.repeats):  # alternated: A B A B ...
        for name, (learner, optimizer, vocab) in built.items():
            rollout = random_rollout(args.rows, args.prompt, args.completion, args.group, vocab, seed=2 + repeat)
            with torch.autocast(**autocast):
                start = time.perf_counter()
                learner.learn(rollout, optimizer)
                times[name].append(time.perf_counter() - start)
    for name in MODES:
        results[name]["s"] = statistics.median(times[name]) if times[name] else float("nan")
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2, help="of Qwen3-0.6B's 28 layers")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32, help="prompt columns (left-padded)")
    p.add_argument("--completion", type=int, default=256, help="completion columns (right-padded)")
    p.add_argument("--group", type=int, default=8, help="rows per prompt")
    p.add_argument("--repeats", type=int, default=3, help="timed learns per mode, alternated (0: counts only)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = measure(args)
    print(
        f"one learn, Qwen3-0.6B's layer shape × {args.layers} layers, {args.rows} rows × ({args.prompt} + "
        f"{args.completion}) tokens, 2 minibatches, bf16 autocast, {args.threads} thread(s)"
    )
    print(f"{'':>30} {'ops':>7} {'casts':>6} {'elementwise GB':>15} {'saved GB':>9} {'s (CPU)':>8}")
    for name, r in results.items():
        print(
            f"{name:>30} {r['ops']:>7} {r['casts']:>6} {r['elementwise_gb']:>15.2f} {r['saved_gb']:>9.2f} {r['s']:>8.2f}"
        )
    a, b = results.values()
    print(
        f"ratio param_dtype/autocast: ops {b['ops'] / a['ops']:.2f}, elementwise bytes "
        f"{b['elementwise_gb'] / a['elementwise_gb']:.2f}, saved {b['saved_gb'] / a['saved_gb']:.2f}, CPU time "
        f"{b['s'] / a['s']:.2f}"
    )
    print(
        "reproduce: python benchmarks/update_traffic.py "
        + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    )


if __name__ == "__main__":
    main()
