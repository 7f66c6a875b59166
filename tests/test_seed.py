"""Each rank's random streams: rank 0 keeps the run's seed (one process is unchanged), every other rank draws its own."""

import random

import numpy as np
import torch

from lit_gspo.lightning.seed import DEFAULT_STREAMS, seed_ranks_apart, stream_seed


def draws() -> tuple:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def seeded_like_everything(seed: int) -> None:
    torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)


def test_rank_0_keeps_the_runs_streams_and_every_other_rank_draws_its_own():
    by_rank = {}
    for rank in (0, 1, 2):
        seeded_like_everything(5)  # seed_everything: every rank alike
        seed_ranks_apart(5, rank)
        by_rank[rank] = draws()
    seeded_like_everything(5)
    assert by_rank[0] == draws()  # untouched
    for rank in (1, 2):
        assert all(a != b for a, b in zip(by_rank[rank], by_rank[0]))  # torch, numpy and python each apart
    assert all(a != b for a, b in zip(by_rank[1], by_rank[2]))
    seeded_like_everything(5)
    seed_ranks_apart(5, 1)
    assert draws() == by_rank[1]  # reproducible: a function of (seed, rank)


def test_a_ranks_default_streams_are_none_of_its_generators_streams():
    """The refill prompts' generator is stream 0 of the rank, the async worker's are streams 1 + step: the default
    streams share a seed with none of them (two streams of one seed would draw alike)."""
    for rank in (1, 2, 7):
        default = stream_seed(11, rank=rank, stream=DEFAULT_STREAMS)
        assert default not in {stream_seed(11, rank=rank, stream=s) for s in range(1000)}
        assert default not in {stream_seed(11, rank=r, stream=DEFAULT_STREAMS) for r in range(64) if r != rank}
