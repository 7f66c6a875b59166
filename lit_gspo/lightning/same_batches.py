"""Every rank is given the same held-out batches: each samples its share of one batch (``validation.sample_share``:
rank r takes rows r, r + W, ...), and the shares are summed (``val/reward``) or gathered (``trainer.predict``).

``PromptDataModule``'s loaders give every rank the whole batch. A ``DataLoader`` passed to ``trainer.validate``,
``test`` or ``predict`` is split over the ranks by Lightning (a distributed sampler): each rank would score its share
of its own part, half the rows under two ranks, silently, and a rank given fewer batches would leave the others
waiting in a collective. Both are refused on every rank at once: different numbers of batches when the stage starts,
different rows at the first batch that differs.
"""

from __future__ import annotations

import hashlib
import json

from lit_gspo.runtime.collectives import gather_objects, world_size
from lit_gspo.runtime.user_errors import UserError

#: the Trainer's count of held-out batches in each stage that samples them
STAGE_BATCHES = {
    "sanity_check": "num_sanity_val_batches",
    "validate": "num_val_batches",
    "test": "num_test_batches",
    "predict": "num_predict_batches",
}

HINT = (
    "Lightning splits a DataLoader over the ranks; pass the rows as lit_gspo.RowBatches(rows, batch_size=8), or as a "
    "PromptDataModule's eval_dataset, which every rank reads whole"
)


class RanksGivenOtherBatches(UserError, ValueError):
    """The ranks were given different held-out batches."""


def check_same_batch_counts(trainer) -> None:
    """Refuse, on every rank, a stage whose ranks were given different numbers of held-out batches (collective)."""
    if trainer.world_size == 1:
        return
    counts = gather_objects(list(getattr(trainer, STAGE_BATCHES[trainer.state.stage.value])))
    if any(count != counts[0] for count in counts):
        per_rank = ", ".join(f"rank {rank} {count}" for rank, count in enumerate(counts))
        raise RanksGivenOtherBatches(
            f"every rank samples its share of the same held-out batches, but the ranks were given different numbers "
            f"of batches per loader ({per_rank}): {HINT}"
        )


def check_same_batch(rows: list[dict]) -> None:
    """Refuse, on every rank, a held-out batch whose rows differ between the ranks (collective)."""
    if world_size() == 1:
        return
    digests = gather_objects(_digest(rows))
    if len(set(digests)) > 1:
        first = rows[0].get("prompt") if rows else None
        raise RanksGivenOtherBatches(
            f"every rank samples its share of the same held-out batch, but the ranks were given different rows "
            f"({len(set(digests))} different batches; this rank's first prompt {first!r}): {HINT}"
        )


def _digest(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()
