"""Collectives over the ranks of a run (identity in one process): sums, gathers, and the reductions of logged metrics.

DDP and FSDP2 average gradients over ranks; the learner normalises each rank's loss by the *global* token and
sequence counts (:func:`all_reduce_sum`) and multiplies it by the world size, so the summed gradient is exactly the
single-process gradient of the global batch. Pure ``torch.distributed``: no Lightning here.
"""

from __future__ import annotations

import math
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lit_gspo.runtime.sample_stats import merge_stats, without_weights


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def end_process_group() -> None:
    """Destroy the default process group of a run that finished on every rank (Lightning leaves it alive).

    A process that exits with it alive can abort at interpreter shutdown ("terminate called without an active
    exception", exit -6): gloo's worker threads still hold work whose tensors need the interpreter being torn down
    (pytorch/pytorch#190489). Only after success: a rank destroying its group while another waits in a collective
    can hang the other."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(tensor: Tensor, op=None, group=None) -> Tensor:
    """``tensor`` reduced in place over the ranks of ``group`` (default: all; op: ``dist.ReduceOp``, default SUM),
    wherever it lives; unchanged in one process.

    NCCL reduces only CUDA tensors ("No backend type associated with device type cpu"): under it a CPU tensor
    travels through the current GPU and back. Gloo reduces both.
    """
    if world_size() > 1:
        op = dist.ReduceOp.SUM if op is None else op
        if dist.get_backend(group) == "nccl" and tensor.device.type == "cpu":
            on_gpu = tensor.to(f"cuda:{torch.cuda.current_device()}")
            dist.all_reduce(on_gpu, op=op, group=group)
            tensor.copy_(on_gpu.cpu())
        else:
            dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """``tensor`` summed over ranks (unchanged in one process), on its own device."""
    return all_reduce(tensor)


def sum_over_ranks(value: float) -> float:
    return float(all_reduce_sum(torch.tensor([value], dtype=torch.float64))) if world_size() > 1 else value


def max_over_ranks(value: int) -> int:
    """The largest ``value`` of any rank (collective: all ranks must call it)."""
    if world_size() == 1:
        return value
    return int(all_reduce(torch.tensor([value], dtype=torch.int64), op=dist.ReduceOp.MAX))


def mean_and_std(values: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and Bessel-corrected std of ``values`` (any shape) over every rank's values (collective: all ranks must
    call it, with any number of values, none included); std is 0 for fewer than two values in all.

    In one process torch's own reductions; over several, the sums of n, x and x² in fp64."""
    if world_size() == 1:
        return values.mean(), values.std() if values.numel() > 1 else torch.zeros((), device=values.device)
    x = values.double().flatten()
    n, total, squares = all_reduce_sum(
        torch.stack([torch.tensor(float(x.numel()), dtype=x.dtype, device=x.device), x.sum(), (x * x).sum()])
    )
    mean = total / n.clamp(min=1)
    variance = ((squares - n * mean * mean) / (n - 1).clamp(min=1)).clamp(min=0) * (n > 1)
    return mean.to(values.dtype), variance.sqrt().to(values.dtype)


def gather_cat(values: Tensor) -> Tensor:
    """Every rank's 1-D ``values`` joined in rank order (collective: all ranks must call it, each with any number of
    values, none included); ``values`` itself in one process. Two sums over ranks: the counts, then the values padded
    to the longest (``all_reduce`` carries CPU tensors through the GPU under NCCL)."""
    if world_size() == 1:
        return values
    rank, world = dist.get_rank(), world_size()
    counts = torch.zeros(world, dtype=torch.int64, device=values.device)
    counts[rank] = values.numel()
    counts = all_reduce(counts).tolist()
    rows = torch.zeros(world, max(counts), dtype=values.dtype, device=values.device)
    rows[rank, : values.numel()] = values
    rows = all_reduce(rows)
    return torch.cat([rows[r, :count] for r, count in enumerate(counts)])


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on any (collective: all ranks must call it)."""
    return sum_over_ranks(float(flag)) > 0 if world_size() > 1 else flag


def gather_objects(obj: Any) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` (just ``[obj]`` in one process)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def check_ranks_resume_alike(ckpt_path: Any, global_step: int, root_dir: Any) -> None:
    """Raise on every rank when the ranks did not all restore the same training state (collective).

    On several nodes ``--ckpt_path last`` is looked up by each node in its own
    ``<default_root_dir>/checkpoints``, and a rank that finds nothing starts from step 0 (Lightning only
    warns, on rank 0). Nodes that do not share the file system holding ``default_root_dir`` (where
    rank 0 wrote the checkpoints) thus resume on node 0 and restart on the others: their collectives no
    longer pair up and the run hangs until the process group's timeout (30 min). Call after the
    checkpoint is restored (``on_fit_start``) with ``trainer.ckpt_path``, ``trainer.global_step`` and
    ``trainer.default_root_dir``.
    """
    if world_size() == 1:
        return
    mine = (
        None if ckpt_path is None else str(ckpt_path),
        int(global_step),
        os.path.abspath(str(root_dir)),
        socket.gethostname(),
    )
    parts = gather_objects(mine)
    if len({(path is None, step) for path, step, _, _ in parts}) == 1:
        return
    lines = [
        f"  rank {rank} on {host}: "
        + (
            f"resumed from {path} at step {step}"
            if path
            else f"found no checkpoint (default_root_dir {root}), starts at step {step}"
        )
        for rank, (path, step, root, host) in enumerate(parts)
    ]
    raise RuntimeError(
        "the ranks did not resume from the same checkpoint:\n" + "\n".join(lines) + "\nEvery node must "
        "see rank 0's --trainer.default_root_dir (a shared file system), or be given a --ckpt_path "
        "file it can read; otherwise the ranks train from different steps and their collectives hang."
    )


def reduce_weighted_means(records: list[tuple[dict, float]]) -> dict[str, float]:
    """Token-weighted means of micro-batch metrics over every rank's micro-batches; ``*_min``/``*_max`` reduce by min/max."""
    sums: dict[str, list] = {}
    for metrics, weight in records:
        for key, value in metrics.items():
            if not math.isfinite(value):
                continue
            s = sums.setdefault(key, [0.0, 0.0, 0, 0.0, math.inf, -math.inf])  # Σvw, Σw, n, Σv, min, max
            s[0] += value * weight
            s[1] += weight
            s[2] += 1
            s[3] += value
            s[4], s[5] = min(s[4], value), max(s[5], value)
    total: dict[str, list] = {}
    for part in gather_objects(sums):
        for key, s in part.items():
            t = total.setdefault(key, [0.0, 0.0, 0, 0.0, math.inf, -math.inf])
            t[0], t[1], t[2], t[3] = t[0] + s[0], t[1] + s[1], t[2] + s[2], t[3] + s[3]
            t[4], t[5] = min(t[4], s[4]), max(t[5], s[5])
    out = {}
    for key, (vw, w, n, v, lo, hi) in total.items():
        if key.endswith("_min"):
            out[key] = lo
        elif key.endswith("_max"):
            out[key] = hi
        else:
            out[key] = vw / w if w else v / n
    return out


def reduce_step_stats(stats: dict[str, float], rewards: Tensor | None, lengths: Tensor | None) -> dict[str, float]:
    """Reduce one RL step's logged stats over ranks, as the stats of all their samples (``sample_stats.merge_stats``:
    weighted means, pooled stds, counts (``reward_failed``, ``async/dropped``) summed, ``time/*`` and
    ``sampling_rounds`` the max, other keys the mean, the update's metrics already global and identical on every
    rank); ``reward``, ``reward_std`` and ``response_length`` are recomputed over the global rollout (every rank's kept
    samples). Without the weights."""
    if world_size() == 1:
        return without_weights(stats)
    mine = (
        stats,
        [] if rewards is None else rewards.float().tolist(),
        [] if lengths is None else lengths.float().tolist(),
    )
    parts = gather_objects(mine)
    out = without_weights(merge_stats([s for s, _, _ in parts]))
    all_rewards = torch.tensor([r for _, rs, _ in parts for r in rs], dtype=torch.float64)
    all_lengths = torch.tensor([n for _, _, ls in parts for n in ls], dtype=torch.float64)
    if all_rewards.numel():
        out["reward"] = float(all_rewards.mean())
        out["reward_std"] = float(all_rewards.std()) if all_rewards.numel() > 1 else 0.0
        out["response_length"] = float(all_lengths.mean())
    return out
