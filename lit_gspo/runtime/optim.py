"""Optimizers on sharded parameters: bitsandbytes 8-bit optimizers under FSDP2, and state accounting.

bitsandbytes' fused update ops (``optimizer_update_8bit_blockwise``, ``optimizer_update_32bit``) have no
DTensor sharding rule, so they cannot run on FSDP2's sharded parameters directly. :func:`shard_aware`
builds, from an optimizer instance, one of a subclass that, for every DTensor parameter, runs the update on the rank's
local shard (``p._local_tensor`` and ``p.grad._local_tensor``): Adam-style updates are element-wise, so
updating each shard on its own is the same update as on the full tensor (bitsandbytes' block-wise
quantisation blocks are then cut per shard, which is a different — equally valid — blocking).

Which parameters keep 32-bit state: bitsandbytes keeps fp32 state for tensors with fewer than
``min_8bit_size`` elements (default 4096: norms, biases, small embeddings). Here the rule is applied
to the *full* parameter's size, so single-process, DDP and FSDP2 runs choose the same state dtype.

Checkpoints: ``state_dict()`` returns each shard's state tensors as a DTensor ``Shard(0)`` of a flat
``(world × L,)`` tensor (each rank's flattened state padded to a common L), so torch distributed
checkpointing saves every rank's shard and loads it back on the same world size.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import Tensor

from lit_gspo.runtime.collectives import all_reduce
from lit_gspo.runtime.installed import check_extra

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - very old torch
    DTensor, Shard = (), None


def _is_dtensor(t: Any) -> bool:
    return bool(DTensor) and isinstance(t, DTensor)


def needs_local_updates(optimizer: torch.optim.Optimizer) -> bool:
    """bitsandbytes optimizers: their fused update ops know nothing of DTensor."""
    return any(c.__module__.startswith("bitsandbytes") for c in type(optimizer).__mro__)


class LocalShardUpdates:
    """Mixin: run the wrapped optimizer's step on each DTensor parameter's local shard.

    The optimizer's ``param_groups`` keep the real (DTensor) parameters, so
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` maps states to parameter names;
    only during ``step`` are the shards swapped in.
    """

    def _swap_in_shards(self) -> list[tuple[dict, int, Tensor, Tensor]]:
        swapped = []
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                if not _is_dtensor(p):
                    continue
                local = p._local_tensor
                local.grad = None if p.grad is None else p.grad._local_tensor
                if p in self.state:
                    self.state[local] = self.state.pop(p)
                group["params"][i] = local
                swapped.append((group, i, p, local))
        return swapped

    def _swap_out_shards(self, swapped) -> None:
        for group, i, p, local in swapped:
            group["params"][i] = p
            if local in self.state:
                self.state[p] = self.state.pop(local)
            local.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._global_numel = {
            id(p._local_tensor): p.numel() for g in self.param_groups for p in g["params"] if _is_dtensor(p)
        }
        swapped = self._swap_in_shards()
        try:
            super().step()
        finally:
            self._swap_out_shards(swapped)
        return loss

    def get_config(self, gindex, pindex, group):
        """bitsandbytes' ``min_8bit_size`` rule decided on the full parameter, not the shard."""
        config = super().get_config(gindex, pindex, group)
        p = self.param_groups[gindex]["params"][pindex]
        full = getattr(self, "_global_numel", {}).get(id(p))
        if full is not None:
            config["min_8bit_size"] = 0 if full >= config["min_8bit_size"] else math.inf
        return config

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self):
        state_dict = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        entries = []  # (container, key, local tensor, param)
        for index, p in enumerate(params):
            if not _is_dtensor(p) or index not in state_dict["state"]:
                continue
            for container in _containers(state_dict["state"][index]):
                for key, value in container.items():
                    if isinstance(value, Tensor) and not _is_dtensor(value) and key not in ("qmap1", "qmap2"):
                        entries.append((container, key, value, p))
        if not entries:
            return state_dict
        sizes = torch.tensor([e[2].numel() for e in entries], dtype=torch.int64)
        mesh = entries[0][3].device_mesh
        if torch.distributed.is_initialized() and mesh.size() > 1:
            all_reduce(sizes, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group())  # CPU sizes: NCCL-safe
        for (container, key, value, p), size in zip(entries, sizes.tolist()):
            flat = torch.zeros(size, dtype=value.dtype, device=value.device)
            flat[: value.numel()] = value.reshape(-1)
            container[key] = DTensor.from_local(flat, p.device_mesh, [Shard(0)] * p.device_mesh.ndim, run_check=False)
        return state_dict

    def load_state_dict(self, state_dict, *args, **kwargs):
        params = [p for g in self.param_groups for p in g["params"]]
        if any(_is_dtensor(p) for p in params):
            self._ensure_state()
            state_dict = {**state_dict, "state": dict(state_dict["state"])}
            # saved keys are matched to parameters by order, like torch.optim.Optimizer.load_state_dict
            # (ids from state_dict(), or names from torch.distributed.checkpoint's set_optimizer_state_dict)
            saved_keys = [k for g in state_dict["param_groups"] for k in g["params"]]
            for key, p in zip(saved_keys, params):
                if not _is_dtensor(p) or key not in state_dict["state"] or p not in self.state:
                    continue
                index = key
                entry = _deep_copy_dicts(state_dict["state"][index])
                current = self.state[p]
                for container in _containers(entry):
                    for key, value in list(container.items()):
                        if _is_dtensor(value):
                            template = current.get(key)
                            local = value.to_local()
                            if template is None or not isinstance(template, Tensor):
                                raise ValueError(
                                    f"optimizer state {key!r} of a sharded parameter has no local template"
                                )
                            container[key] = local.reshape(-1)[: template.numel()].view(template.shape).clone()
                state_dict["state"][index] = entry
        return super().load_state_dict(state_dict, *args, **kwargs)

    def _ensure_state(self) -> None:
        """Create empty state (shapes of the local shards) for parameters that have none yet."""
        missing = [p for g in self.param_groups for p in g["params"] if _is_dtensor(p) and not self.state.get(p)]
        if not missing or not hasattr(self, "init_state"):
            return
        self._global_numel = {id(p._local_tensor): p.numel() for p in missing}
        swapped = self._swap_in_shards()
        try:
            for gindex, group in enumerate(self.param_groups):
                for pindex, local in enumerate(group["params"]):
                    if id(local) in self._global_numel and not self.state.get(local):
                        self.init_state(group, local, gindex, pindex)
        finally:
            self._swap_out_shards(swapped)


def _containers(entry: dict) -> list[dict]:
    """A parameter's state dict and the nested dicts bitsandbytes wraps its quantisation state in."""
    out = [entry]
    out += [v for v in entry.values() if isinstance(v, dict)]
    return out


def _deep_copy_dicts(entry: dict) -> dict:
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in entry.items()}


_CLASSES: dict[type, type] = {}


def shard_aware(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A fresh ``optimizer`` that updates DTensor parameters shard by shard (``ShardAware<Class>``), or ``optimizer``.

    Only bitsandbytes optimizers over DTensor (FSDP2) parameters are changed; torch's own optimizers
    handle DTensors natively, and unsharded parameters need nothing. The user's factory builds the optimizer, so
    the subclass is built here from the same settings, read back from it: its parameter groups (each with its own
    options), its defaults and bitsandbytes' ``args`` and ``is_paged``, as far as the constructor takes them.
    """
    if not needs_local_updates(optimizer) or isinstance(optimizer, LocalShardUpdates):
        return optimizer
    check_extra("bitsandbytes")  # every optimizer of a fit passes here; an old one fails on the CPU naming a GPU
    if not any(_is_dtensor(p) for g in optimizer.param_groups for p in g["params"]):
        return optimizer
    cls = type(optimizer)
    if optimizer.state:
        raise ValueError(f"shard_aware takes a {cls.__name__} that has not stepped yet (its state would be lost)")
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ShardAware{cls.__name__}", (LocalShardUpdates, cls), {"__module__": __name__})
    return _rebuild(_CLASSES[cls], optimizer)


def _rebuild(subclass: type, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``subclass`` built with ``optimizer``'s parameter groups and defaults; the bitsandbytes settings kept in its
    ``args`` are passed where the rebuilt one's differ (AdamW8bit's constructor refuses its own ``optim_bits=8``)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    groups = [dict(g) for g in optimizer.param_groups]
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    if "is_paged" in accepted:
        settings["is_paged"] = optimizer.is_paged
    aware = subclass(groups, **settings)
    wanted = vars(getattr(optimizer, "args", object()))
    differing = {k: v for k, v in wanted.items() if getattr(aware.args, k, None) != v}
    if not differing:
        return aware
    if not differing.keys() <= accepted.keys():
        raise ValueError(
            f"shard_aware cannot rebuild {type(optimizer).__name__} with its {sorted(differing)}: its "
            "constructor does not take them all"
        )
    return subclass(groups, **settings, **differing)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by this process's optimizer state tensors (local shards under FSDP2); shared qmaps once."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in _flat_values(state):
            if isinstance(value, Tensor):
                local = value._local_tensor if _is_dtensor(value) else value
                key = (local.untyped_storage().data_ptr(), local.numel(), local.dtype)
                if key in seen:
                    continue
                seen.add(key)
                total += local.numel() * local.element_size()
    return total


def state_dtypes(optimizer: torch.optim.Optimizer) -> dict[str, set]:
    """{state key: dtypes seen} over all parameters (e.g. ``state1: {torch.uint8, torch.float32}``)."""
    out: dict[str, set] = {}
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, Tensor):
                out.setdefault(key, set()).add(value.dtype)
    return out


def _flat_values(state: dict):
    for value in state.values():
        if isinstance(value, dict):
            yield from value.values()
        else:
            yield value
