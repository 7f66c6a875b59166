"""How often one update reads the device on the host, and how many of those reads fall between a micro-step's forward
and its backward (where, on a GPU, the device idles while the host waits and then launches the backward).

Counted on the CPU with a dispatch mode over the ops that read a tensor's value or a value-dependent size
(``HOST_READS``); a CPU index used on a GPU tensor also waits there, which only CUDA's sync debug mode sees (the
``cuda`` test ``test_an_update_waits_for_the_device_once_between_a_forward_and_its_backward``). A tiny Qwen3 of the
given depth learns once from a random rollout at the given shape, as ``benchmarks/vs_trl.py`` runs the update on a GPU
(aligned rows, bf16 autocast, GSPO with token-mean, two minibatches); a first update warms up, the second is counted.

    python benchmarks/host_reads.py                      # 64 rows × (32 + 64) tokens, 2 minibatches
    python benchmarks/host_reads.py --micro-batch-size 8 --align off
"""

from __future__ import annotations

import argparse

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops whose result the host has to wait for (a value, or a size that depends on values)
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "_unique2", "unique_consecutive"}


class Timeline(TorchDispatchMode):
    """Every host read (its op's name), in order with the marks a caller appends to ``events``."""

    def __init__(self):
        super().__init__()
        self.events: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in HOST_READS:
            self.events.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def reads_between_forward_and_backward(events: list[str]) -> list[int]:
    """For each ``"backward"`` mark: the reads since the last ``"forward"`` mark before it."""
    counts, since = [], None
    for event in events:
        if event == "forward":
            since = 0
        elif event == "backward":
            counts.append(since)
            since = None
        elif since is not None:
            since += 1
    return counts


def random_rollout(
    rows: int, prompt: int, completion: int, group: int, vocab: int, seed: int, min_completion: int | None = None
):
    """Left-padded prompts (a group's rows share one) and right-padded completions of random lengths, from
    ``min_completion`` (default a quarter of ``completion``) to ``completion`` tokens."""
    from lit_gspo.rl.rollout import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (rows, prompt + completion), generator=g)
    attention = torch.ones(rows, prompt + completion, dtype=torch.long)
    prompt_len = torch.randint(prompt // 2, prompt + 1, (rows // group,), generator=g).repeat_interleave(group)
    for row in range(rows):
        attention[row, : prompt - int(prompt_len[row])] = 0
    shortest = completion // 4 if min_completion is None else min_completion
    mask = torch.arange(completion)[None] < torch.randint(shortest, completion + 1, (rows, 1), generator=g)
    attention[:, prompt:] = mask
    batch = RolloutBatch(ids, attention, prompt, mask)
    batch.advantages = torch.randn(rows, generator=g)
    return batch


def count(args) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lit_gspo.rl.config import Update
    from lit_gspo.rl.learn.learner import Learner
    from lit_gspo.rl.objectives import GSPO

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        pad_token_id=0,
        eos_token_id=1,
    )
    policy = Qwen3ForCausalLM(config)
    update = Update(
        num_minibatches=args.minibatches,
        micro_batch_size=args.micro_batch_size,
        align_rows=args.align == "on",
        share_prompt_forward=False,
        skip_zero_advantage_rows=False,
    )
    objective = GSPO(clip_low=3e-4, clip_high=4e-4, aggregation="token-mean")
    shape = (args.rows, args.prompt, args.completion, args.group, config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        learner = Learner(policy, objective, update, max_len=args.completion, group_size=args.group)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=True)  # as on a GPU: no reads of its own
        learner.learn(random_rollout(*shape, seed=0), optimizer)
        rollout, timeline = random_rollout(*shape, seed=1), Timeline()
        policy.register_forward_hook(lambda *_: timeline.events.append("forward"))

        def backward(loss):
            timeline.events.append("backward")
            loss.backward()

        with timeline:
            learner.learn(rollout, optimizer, backward=backward)
    reads = [e for e in timeline.events if e not in ("forward", "backward")]
    return {"reads": len(reads), "between": reads_between_forward_and_backward(timeline.events)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32, help="prompt columns (left-padded)")
    p.add_argument("--completion", type=int, default=64, help="completion columns (right-padded)")
    p.add_argument("--group", type=int, default=8, help="rows per prompt")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--align", choices=["on", "off"], default="on")
    args = p.parse_args(argv)
    result = count(args)
    print(
        f"host reads in one learn: {result['reads']}; between each micro-step's forward and its backward: "
        f"{result['between']}"
    )


if __name__ == "__main__":
    main()
