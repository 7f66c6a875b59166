"""Every rank's RNG states (torch CPU and CUDA, numpy, python, and a generator of the run's), to save in a
checkpoint and restore on resume: Lightning saves none, and a resume that continues bit for bit needs them all."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from lit_gspo.runtime.collectives import gather_objects


def seed_default_streams(seed: int) -> None:
    """Seed this process's default random streams: torch's (every device), numpy's and python's."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def local_rng_state(refill_generator: torch.Generator | None = None) -> dict[str, Any]:
    """This process's torch (CPU and CUDA), numpy and python RNG states (and the refill generator's)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if refill_generator is not None:
        state["refill"] = refill_generator.get_state()
    return state


def rng_states(refill_generator: torch.Generator | None = None) -> list[dict[str, Any]]:
    """Every rank's RNG states, rank-ordered (collective: all ranks must call it)."""
    return gather_objects(local_rng_state(refill_generator))


def restore_rng_states(
    states: list[dict[str, Any]], rank: int, refill_generator: torch.Generator | None = None
) -> None:
    """Restore this rank's RNG states saved by :func:`rng_states` (needs the same number of ranks)."""
    if rank >= len(states):
        raise ValueError(
            f"the checkpoint holds RNG states of {len(states)} processes; this is rank {rank}: resume with "
            "the same number of processes to continue exactly"
        )
    restore_local_rng_state(states[rank], refill_generator)


def restore_local_rng_state(state: dict[str, Any], refill_generator: torch.Generator | None = None) -> None:
    """Restore this process's RNG states saved by :func:`local_rng_state`."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if refill_generator is not None and "refill" in state:
        refill_generator.set_state(state["refill"])
