"""Several processes: FSDP2 sharding of the policy, metric reduction across ranks, strategy checks.

DDP (``strategy: ddp``): every rank holds the whole policy, samples and scores its own shard of the
prompts (``PromptDataModule`` shards by rank; groups never straddle ranks, so group advantages are
computed where the group lives), and the objective is normalised by the token/sequence counts of the
*global* minibatch (``RLModule.global_counts``). Each rank's loss is its share of the global loss;
it is multiplied by the world size before backward because DDP averages gradients, so the summed
gradient is exactly the single-process gradient of the global batch.

FSDP2 (``strategy: lightning.pytorch.strategies.ModelParallelStrategy`` with
``data_parallel_size: <world>`` and ``tensor_parallel_size: 1``): :func:`apply_fsdp2` shards every
decoder layer and then the root (:func:`shard_model`) of the policy (and of the frozen reference) with ``fully_shard``.
FSDP2 also averages gradients (reduce-scatter), so the same ×world scaling holds.

FSDP1 (``FSDPStrategy``) is refused: manual optimisation with it is broken in Lightning (#19626,
#19685: manual optimisation calls backward inside the wrapped module's "forward" — ``training_step``
— which FSDP1's wrapper does not support, and Lightning has no workaround like the one it uses for
DDP), and it refuses CPU.
"""

from __future__ import annotations

import math
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

FSDP1_MESSAGE = ("FSDPStrategy (FSDP1) is not supported by lit_gspo: Lightning's FSDP1 with manual optimisation is "
                 "broken (Lightning #19626, #19685). Use FSDP2 instead: --trainer.strategy "
                 "lightning.pytorch.strategies.ModelParallelStrategy --trainer.strategy.data_parallel_size <devices> "
                 "--trainer.strategy.tensor_parallel_size 1 (see configs/scale/fsdp2_cpu.yaml and fsdp2_cuda.yaml).")


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_fsdp1_strategy(strategy: Any) -> bool:
    """True for ``FSDPStrategy`` instances/classes or the registry names that build one (``fsdp``, ``fsdp_...``)."""
    if isinstance(strategy, str):
        return strategy == "fsdp" or strategy.startswith("fsdp_") or strategy.endswith("FSDPStrategy")
    try:
        from lightning.pytorch.strategies import FSDPStrategy
    except ImportError:  # pragma: no cover
        return False
    return isinstance(strategy, FSDPStrategy) or (isinstance(strategy, type) and issubclass(strategy, FSDPStrategy))


def strategy_from_path(strategy: Any) -> Any:
    """A strategy given as a dotted class path string (``--trainer.strategy lightning.pytorch.strategies.ModelParallelStrategy``,
    which jsonargparse leaves a string when no init_args follow) built with its defaults; anything else as it is.

    Lightning takes a string for a registry name only ("invalid strategy name: lightning.pytorch.strategies...").
    """
    if not isinstance(strategy, str) or "." not in strategy:
        return strategy
    from lightning.pytorch.strategies import Strategy

    from lit_gspo.imports import import_path

    try:
        cls = import_path(strategy)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--trainer.strategy {strategy}: no such class ({err})") from None
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ValueError(f"--trainer.strategy {strategy} is not a Lightning Strategy class")
    return cls()


def check_strategy(strategy: Any) -> None:
    if is_fsdp1_strategy(strategy):
        raise ValueError(FSDP1_MESSAGE)


# ---------------------------------------------------------------------- FSDP2
def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers`` and the like)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None) or getattr(decoder, "blocks", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return list(layers)


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def shard_model(model: nn.Module, mesh) -> None:
    """``fully_shard`` each decoder layer of a causal LM, then the root, over ``mesh`` (a 1-D device mesh).

    The root keeps its parameters unsharded between forward and backward (FSDP2's default for the
    root), which ``token_logprobs`` relies on to use the LM head weight after the root's forward.
    """
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def apply_fsdp2(module: nn.Module, mesh) -> None:
    """:func:`shard_model` ``module.policy`` and ``module.ref_policy`` over the data-parallel part of ``mesh``.

    The critic head (PPO) is sharded on its own so that its gradient is reduced as well.
    """
    from torch.distributed.fsdp import fully_shard

    dp_mesh = _data_parallel_mesh(mesh)
    for name in ("policy", "ref_policy"):
        model = getattr(module, name, None)
        if model is not None and not is_sharded(model):
            shard_model(model, dp_mesh)
    value_head = getattr(module, "value_head", None)
    if value_head is not None and not is_sharded(value_head):
        fully_shard(value_head, mesh=dp_mesh)


def unsharded_class(model: nn.Module) -> type:
    """The model's own class: ``fully_shard`` swaps in a subclass named ``FSDP<Class>``."""
    cls = type(model)
    if is_sharded(model):
        for base in cls.__mro__[1:]:
            if f"FSDP{base.__name__}" == cls.__name__:
                return base
    return cls


def _data_parallel_mesh(mesh):
    names = mesh.mesh_dim_names or ()
    if "data_parallel" in names:
        dp = mesh["data_parallel"]
        tp_size = mesh["tensor_parallel"].size() if "tensor_parallel" in names else 1
        if tp_size > 1:
            raise ValueError(
                f"lit_gspo shards with FSDP2 over the data-parallel dimension only; the ModelParallelStrategy mesh has "
                f"tensor_parallel_size={tp_size}. Set --trainer.strategy.data_parallel_size {mesh.size()} "
                "--trainer.strategy.tensor_parallel_size 1.")
        return dp
    return mesh


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The full (unsharded) state dict on CPU; collective under FSDP2 (every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ---------------------------------------------------------------------- metrics
def all_reduce_sum(tensor: Tensor) -> Tensor:
    """``tensor`` summed over ranks (unchanged in one process), on its own device.

    NCCL reduces only CUDA tensors: under it a CPU tensor travels through the current GPU and back.
    """
    if world_size() > 1:
        if dist.get_backend() == "nccl" and tensor.device.type == "cpu":
            on_gpu = tensor.to(f"cuda:{torch.cuda.current_device()}")
            dist.all_reduce(on_gpu)
            tensor.copy_(on_gpu.cpu())
        else:
            dist.all_reduce(tensor)
    return tensor


def sum_over_ranks(value: float) -> float:
    return float(all_reduce_sum(torch.tensor([value], dtype=torch.float64))) if world_size() > 1 else value


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
    mine = (None if ckpt_path is None else str(ckpt_path), int(global_step), os.path.abspath(str(root_dir)),
            socket.gethostname())
    parts = gather_objects(mine)
    if len({(path is None, step) for path, step, _, _ in parts}) == 1:
        return
    lines = [f"  rank {rank} on {host}: " + (f"resumed from {path} at step {step}" if path else
                                             f"found no checkpoint (default_root_dir {root}), starts at step {step}")
             for rank, (path, step, root, host) in enumerate(parts)]
    raise RuntimeError("the ranks did not resume from the same checkpoint:\n" + "\n".join(lines) + "\nEvery node must "
                       "see rank 0's --trainer.default_root_dir (a shared file system), or be given a --ckpt_path "
                       "file it can read; otherwise the ranks train from different steps and their collectives hang.")


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
    """Reduce one RL step's logged stats over ranks (identity in one process).

    ``reward``, ``reward_std`` and ``response_length`` are recomputed over the global rollout (every
    rank's kept samples); ``reward_failed`` is summed; ``time/*`` and ``sampling_rounds`` take the max;
    every other key is the mean over the ranks that report it (the update's metrics are already global
    and identical on every rank).
    """
    if world_size() == 1:
        return stats
    mine = (stats, [] if rewards is None else rewards.float().tolist(), [] if lengths is None else lengths.float().tolist())
    parts = gather_objects(mine)
    out: dict[str, float] = {}
    keys = {k for s, _, _ in parts for k in s}
    for key in keys:
        values = [float(s[key]) for s, _, _ in parts if key in s]
        finite = [v for v in values if math.isfinite(v)]
        if key == "reward_failed":
            out[key] = sum(values)
        elif key.startswith("time/") or key == "sampling_rounds":
            out[key] = max(finite) if finite else float("nan")
        else:
            out[key] = sum(finite) / len(finite) if finite else float("nan")
    all_rewards = torch.tensor([r for _, rs, _ in parts for r in rs], dtype=torch.float64)
    all_lengths = torch.tensor([n for _, _, ls in parts for n in ls], dtype=torch.float64)
    if all_rewards.numel():
        out["reward"] = float(all_rewards.mean())
        out["reward_std"] = float(all_rewards.std()) if all_rewards.numel() > 1 else 0.0
        out["response_length"] = float(all_lengths.mean())
    return out
