"""MoE Routing Replay and expert volatility for transformers' top-k routers (Qwen3-MoE & co).

In transformers 5.x a sparse MoE block calls its router module (``Qwen3MoeTopKRouter``,
``block.gate``) on the flattened hidden states ``(tokens, hidden)``; the router returns
``(router_logits, routing_weights, selected_experts)`` with shapes ``(tokens, E)``, ``(tokens, k)``
and ``(tokens, k)``, where the weights are ``softmax(logits)`` at the top-k experts (float32
softmax), renormalised to sum 1 when ``norm_topk_prob``. The experts only see the indices and weights.

* :func:`record_routing` puts forward hooks on the routers and keeps the top-k indices of each pass.
* :func:`replay_routing` replaces each router's output: the indices become the recorded ones and the
  weights are ``softmax(logits)`` gathered at those indices (renormalised like the model does), so
  the router weight still gets a gradient through the weights of the chosen experts. With unchanged
  parameters a replayed pass is bit-identical to the recorded one.
* :func:`routing_volatility` is the share of (token, layer, slot) choices that changed.

Records are per-sample tensors, like the log-probs of a rollout: ``record.indices[l]`` has shape
``(B, T, k)``, ``record[rows]`` slices the batch and ``RoutingRecord.cat`` joins chunks, so a
rollout recorded in chunks can be replayed in differently-composed minibatches (same T).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

#: Router classes whose forward is softmax → top-k → (optional) renormalisation; replay reproduces them exactly.
SOFTMAX_TOPK_ROUTERS = frozenset({"Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter", "MixtralTopKRouter"})


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE router modules (class name ending in ``TopKRouter``) in layer order; ``[]`` for dense models."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def _router_parents(model: nn.Module, routers: list[nn.Module]) -> list[nn.Module | None]:
    parent_of: dict[int, nn.Module] = {}
    for module in model.modules():
        for child in module.children():
            parent_of.setdefault(id(child), module)
    return [parent_of.get(id(r)) for r in routers]


@dataclass
class RoutingRecord:
    """Top-k expert indices of one batch: ``indices[l]`` is a ``(B, T, k)`` integer tensor for MoE layer ``l``."""

    indices: list[torch.Tensor]

    @property
    def num_layers(self) -> int:
        """Number of MoE layers recorded."""
        return len(self.indices)

    @property
    def shape(self) -> tuple[int, ...]:
        """``(B, T, k)`` of every layer."""
        return tuple(self.indices[0].shape) if self.indices else ()

    def __getitem__(self, rows) -> RoutingRecord:
        """Select batch rows (int, slice, index tensor or bool mask), keeping the ``(B, T, k)`` layout."""
        if isinstance(rows, int):
            rows = slice(rows, rows + 1)
        return RoutingRecord([t[rows] for t in self.indices])

    def to(self, device: torch.device | str) -> RoutingRecord:
        """Copy the indices to ``device``."""
        return RoutingRecord([t.to(device) for t in self.indices])

    @classmethod
    def cat(cls, records: Sequence[RoutingRecord]) -> RoutingRecord:
        """Concatenate records along the batch dimension (all must have the same layers, T and k)."""
        if not records:
            raise ValueError("RoutingRecord.cat needs at least one record")
        layers = {r.num_layers for r in records}
        if len(layers) != 1:
            raise ValueError(f"records have different numbers of MoE layers: {sorted(layers)}")
        tails = {tuple(r.shape[1:]) for r in records}
        if len(tails) != 1:
            raise ValueError(f"records have different (T, k) shapes {sorted(tails)}; pad the batches to one length")
        return cls([torch.cat(ts, dim=0) for ts in zip(*(r.indices for r in records))])


class RoutingRecorder:
    """Context manager recording the top-k expert indices of every forward pass run inside it.

    ``calls[j]`` is the :class:`RoutingRecord` of the j-th forward pass; ``record`` joins all passes
    along the batch dimension (e.g. an old-policy pass run in chunks).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.routers = moe_routers(model)
        self._per_layer: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._shapes: list[tuple[int, ...] | None] = [None for _ in self.routers]
        self._handles: list = []

    def __enter__(self) -> RoutingRecorder:
        parents = _router_parents(self.model, self.routers)
        for layer, (router, parent) in enumerate(zip(self.routers, parents)):
            if parent is not None:
                self._handles.append(parent.register_forward_pre_hook(self._shape_hook(layer), with_kwargs=True))
            self._handles.append(router.register_forward_hook(self._record_hook(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _shape_hook(self, layer: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else next(iter(kwargs.values()), None)
            if isinstance(hidden, torch.Tensor):
                self._shapes[layer] = tuple(hidden.shape[:-1])

        return hook

    def _record_hook(self, layer: int):
        def hook(module, args, output):
            if not (isinstance(output, tuple) and len(output) == 3 and not output[2].is_floating_point()):
                raise TypeError(
                    f"{type(module).__name__} returned {type(output).__name__}; routing recording expects "
                    "(router_logits, routing_weights, expert_indices) as in transformers' *TopKRouter"
                )
            idx = output[2].detach()
            shape = self._shapes[layer]
            self._shapes[layer] = None
            if shape is None or math.prod(shape) != idx.shape[0]:
                shape = (1, idx.shape[0])
            self._per_layer[layer].append(idx.reshape(*shape, idx.shape[-1]).clone())

        return hook

    @property
    def calls(self) -> list[RoutingRecord]:
        """One record per forward pass run inside the context, in order."""
        counts = {len(per) for per in self._per_layer}
        if len(counts) > 1:
            raise RuntimeError(f"MoE layers were called unequal numbers of times: {sorted(counts)}")
        n = counts.pop() if counts else 0
        return [RoutingRecord([per[j] for per in self._per_layer]) for j in range(n)]

    @property
    def record(self) -> RoutingRecord:
        """All recorded passes concatenated along the batch dimension."""
        calls = self.calls
        if not calls:
            raise RuntimeError("no forward pass of an MoE model was recorded")
        return calls[0] if len(calls) == 1 else RoutingRecord.cat(calls)


def record_routing(model: nn.Module) -> RoutingRecorder:
    """``with record_routing(model) as rec: model(...)`` then ``rec.record`` (or ``rec.calls``) holds the choices."""
    return RoutingRecorder(model)


@contextlib.contextmanager
def replay_routing(model: nn.Module, recorded: RoutingRecord) -> Iterator[None]:
    """Force every router to pick the recorded experts in forward passes run inside the context.

    Routing weights are recomputed from the current logits: ``softmax(logits)`` gathered at the
    recorded indices (in the recorded slot order), divided by their sum when the router has
    ``norm_topk_prob`` (Mixtral always normalises). Gradients flow to the router weight through them.
    Each forward inside must cover exactly the recorded tokens (``B * T``). With gradient
    checkpointing, call ``backward()`` inside the context too: recomputed layers route again.
    """
    routers = moe_routers(model)
    if len(routers) != recorded.num_layers:
        raise ValueError(f"record has {recorded.num_layers} MoE layers but the model has {len(routers)} routers")
    unsupported = sorted({type(r).__name__ for r in routers} - SOFTMAX_TOPK_ROUTERS)
    if unsupported:
        raise NotImplementedError(f"routing replay supports {sorted(SOFTMAX_TOPK_ROUTERS)}, not {unsupported}")
    flat = [idx.reshape(-1, idx.shape[-1]) for idx in recorded.indices]
    handles = []

    def make_hook(layer: int):
        def hook(module, args, output):
            logits, weights, chosen = output
            idx = flat[layer].to(device=logits.device, dtype=chosen.dtype)
            if idx.shape != chosen.shape:
                raise ValueError(
                    f"MoE layer {layer}: recorded indices {tuple(idx.shape)} do not match this pass's "
                    f"(tokens, k) = {tuple(chosen.shape)}; replay the same batch rows and padding as recorded"
                )
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            top = probs.gather(-1, idx)
            if getattr(module, "norm_topk_prob", True):
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(weights.dtype), idx

        return hook

    try:
        for layer, router in enumerate(routers):
            handles.append(router.register_forward_hook(make_hook(layer), prepend=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def changed_slots(before: RoutingRecord, after: RoutingRecord) -> list[torch.Tensor]:
    """Per MoE layer, a ``(B, T)`` count of each token's top-k slots whose expert is not among ``before``'s.

    The k chosen experts are compared as sets (slot order is ignored): a token whose experts went from
    {1, 4} to {4, 2} has 1 changed slot of 2.
    """
    if before.num_layers != after.num_layers or before.shape != after.shape:
        raise ValueError(
            f"records differ: {before.num_layers} layers {before.shape} vs {after.num_layers} layers {after.shape}"
        )
    k = before.shape[-1] if before.num_layers else 0
    return [
        k - (a.unsqueeze(-1) == b.to(a.device).unsqueeze(-2)).any(-1).sum(-1)
        for a, b in zip(before.indices, after.indices)
    ]


def routing_volatility(before: RoutingRecord, after: RoutingRecord, mask: torch.Tensor | None = None) -> float:
    """Share of (token, layer, top-k slot) expert choices that differ between two records (see :func:`changed_slots`).

    ``mask`` ((B, T), bool or 0/1) restricts the count to valid tokens, e.g. the completion mask. Returns a float
    in [0, 1].
    """
    changed = total = 0.0
    for per_token in changed_slots(before, after):
        k = before.shape[-1]
        m = (
            torch.ones_like(per_token, dtype=torch.float32)
            if mask is None
            else mask.to(device=per_token.device, dtype=torch.float32).reshape(per_token.shape)
        )
        changed += float((per_token * m).sum())
        total += float(m.sum()) * k
    return changed / total if total else 0.0


def rerouted_tokens(before: RoutingRecord, after: RoutingRecord) -> torch.Tensor:
    """``(B, T)`` bool: tokens with at least one top-k expert changed in at least one MoE layer."""
    per_layer = changed_slots(before, after)
    return torch.stack(per_layer).gt(0).any(0) if per_layer else torch.zeros(before.shape[:2], dtype=torch.bool)


def router_aux_coefficient(coef: float | None, policy: nn.Module) -> float:
    """The load-balancing loss coefficient an update applies (``update.router_aux_loss_coef``): ``coef``, or with None
    the model config's ``router_aux_loss_coef`` (0 for a model without router logits). A non-zero ``coef`` for a model
    whose config has no ``output_router_logits`` (no load-balancing loss to add) is refused, naming the model."""
    config = getattr(policy, "config", None)
    routed = config is not None and hasattr(config, "output_router_logits")
    if coef is None:
        return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if routed else 0.0
    if coef and not routed:
        raise ValueError(
            f"update.router_aux_loss_coef={coef}: {type(policy).__name__} is not a Mixture-of-Experts model with a "
            "load-balancing loss (its config has no output_router_logits); set it to 0"
        )
    return float(coef)
