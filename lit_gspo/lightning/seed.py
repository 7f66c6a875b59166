"""The run's seed: the one given, or ``seed_everything``'s (Lightning keeps it in ``PL_GLOBAL_SEED``); the seeds of
each rank's random streams."""

from __future__ import annotations

import os

from lit_gspo.runtime.rng import seed_default_streams

#: the stream number of a rank's default random streams (:func:`seed_ranks_apart`); the run's generators are ≥ 0
DEFAULT_STREAMS = -1
#: the stream a rank's sampled validation draws from: the same at every validation, so that two validations differ by
#: the policy, not by the draws (common random numbers), and whatever training drew before
VALIDATION_STREAM = -2


def resolve_seed(seed: int | None) -> int:
    """``seed``, or the run's ``seed_everything`` value when None (so one flag seeds a whole run)."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else int(seed)


def stream_seed(seed: int, *, rank: int = 0, stream: int = 0) -> int:
    """The seed of one random stream of one rank: ``seed`` itself for rank 0's first stream (a single process is
    unchanged), a distinct one for every other (rank, stream): ranks that drew from one seed would draw alike."""
    if rank == 0 and stream == 0:
        return seed
    return (seed * 1_000_003 + rank * 7_919 + stream * 104_729 + 1) % 2**63


def seed_ranks_apart(seed: int, rank: int) -> None:
    """Every rank but rank 0 reseeds its default random streams (torch on every device, numpy, python) with a seed of
    its own; rank 0 keeps the run's, so one process is unchanged.

    ``seed_everything`` seeds every rank alike, which the policy's initialisation and the warm start need (their ranks
    must stay equal). Sampling must not: ranks drawing the same uniforms for their different prompts sample
    correlated completions — from a policy that hardly reads its prompt yet (early RL) the same ones — so the
    global batch holds fewer distinct samples than it counts. The fit calls this once, after the warm start; a resume
    restores every rank's streams from the checkpoint instead."""
    if rank == 0:
        return
    seed_default_streams(stream_seed(seed, rank=rank, stream=DEFAULT_STREAMS))
