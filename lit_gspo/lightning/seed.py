"""The run's seed: the one given, or ``seed_everything``'s (Lightning keeps it in ``PL_GLOBAL_SEED``)."""

from __future__ import annotations

import os


def resolve_seed(seed: int | None) -> int:
    """``seed``, or the run's ``seed_everything`` value when None (so one flag seeds a whole run)."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else int(seed)
