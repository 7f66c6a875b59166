"""The run's seed: the one given, or ``seed_everything``'s (Lightning keeps it in ``PL_GLOBAL_SEED``)."""

from __future__ import annotations

import os


def resolve_seed(seed: int | None) -> int:
    """``seed``, or the run's ``seed_everything`` value when None (so one flag seeds a whole run)."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else int(seed)


def stream_seed(seed: int, *, rank: int = 0, stream: int = 0) -> int:
    """The seed of one random stream of one rank: ``seed`` itself for rank 0's first stream (a single process is
    unchanged), a distinct one for every other (rank, stream): ranks that drew from one seed would draw alike."""
    if rank == 0 and stream == 0:
        return seed
    return (seed * 1_000_003 + rank * 7_919 + stream * 104_729 + 1) % 2**63
