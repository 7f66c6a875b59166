"""Every rank runs as many forward and backward passes in an update, whatever rows it holds.

DDP reduces the gradients over ranks at each backward and FSDP2 gathers the parameters at each forward, so these
passes are collectives: a rank that runs one fewer leaves the others waiting in it (a hang), or pairs their next
collective with a different one. A rank can have fewer micro-batches than another where its rows are fewer or
longer (dynamic sampling keeps a different number of groups on each rank, and none on some), where more of them
have Â = 0 everywhere (``update.skip_zero_advantage_rows`` leaves those out), or where its token budget, sized from
its own free GPU memory, is smaller. So each loop over micro-batches first agrees on their number (the largest of any
rank) and a rank short of it runs *fillers*: one row's pass whose output is not used, and in the update a backward of
0 × that output, which adds exactly nothing to any gradient.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain, repeat
from typing import NamedTuple

import torch
from torch import Tensor

from lit_gspo.rl.rollout import RolloutBatch, RowExtents
from lit_gspo.runtime.collectives import max_over_ranks


class MicroBatch(NamedTuple):
    """One micro-batch of a loop: its rows in the batch the loop deals, the rows, their extents (None where unread);
    a ``filler`` runs a pass for the other ranks' sake and its output is not used (``rows`` empty)."""

    rows: Tensor
    batch: RolloutBatch
    extents: RowExtents | None
    filler: bool = False


def agreed_count(own: int, at_least: int = 0) -> int:
    """The number of passes every rank runs: the most any rank needs, at least ``at_least`` (collective)."""
    return max_over_ranks(max(own, at_least))


def filler_row(batch: RolloutBatch) -> RolloutBatch:
    """One row to run a filler pass on: ``batch``'s first, trimmed; for a batch without rows, two prompt tokens and
    one completion token (token ids 0, 1, 2: the output is not used)."""
    if len(batch):
        return batch.select(torch.tensor([0])).trimmed()
    device = batch.input_ids.device
    ids = torch.arange(3, device=device)[None]
    return RolloutBatch(ids, torch.ones_like(ids), 2, torch.ones(1, 1, dtype=torch.bool, device=device))


def with_fillers(
    micro_batches: Iterable[MicroBatch], count: int, batch: RolloutBatch, at_least: int = 0
) -> Iterator[MicroBatch]:
    """The ``count`` ``micro_batches`` of ``batch``, then fillers up to :func:`agreed_count` of them. The count is agreed
    here, before any pass runs (collective: every rank must call it)."""
    missing = agreed_count(count, at_least) - count
    if missing <= 0:
        return iter(micro_batches)
    filler = MicroBatch(torch.zeros(0, dtype=torch.long), filler_row(batch), None, filler=True)
    return chain(micro_batches, repeat(filler, missing))


def filler_loss(output: Tensor, *more: Tensor | None) -> Tensor:
    """0 × a filler pass's outputs: a backward through every parameter that took part, adding 0 to each gradient."""
    loss = output.sum() * 0
    for extra in more:
        if extra is not None:
            loss = loss + extra.sum() * 0
    return loss
