"""DAPO's soft overlong punishment, from completion lengths in tokens."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO soft overlong punishment of completion lengths L:

    0                                 if L ≤ L_max − L_cache
    (L_max − L_cache − L) / L_cache   if L_max − L_cache < L ≤ L_max
    −1                                if L > L_max
    """
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"need 0 <= cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    lengths = torch.as_tensor(lengths).float()
    start = max_len - cache_len
    ramp = (start - lengths) / max(cache_len, 1)
    penalty = torch.where(lengths <= start, torch.zeros_like(lengths), ramp)
    return torch.where(lengths > max_len, -torch.ones_like(lengths), penalty)


class OverlongPenalty:
    """DAPO soft overlong punishment (``overlong_penalty``) as a reward function.

    Reads the trainer-provided ``completion_lengths`` column (tokens). ``max_len`` None uses the
    trainer's ``max_completion_length`` column (the generation budget), as in DAPO where L_max is
    the maximum response length.

    Args:
        max_len: L_max in tokens, or None for ``max_completion_length``.
        cache_len: L_cache in tokens, the width of the linear ramp; 0 < cache_len <= L_max.
        weight: the weight ``RewardSet`` gives this function.
    """

    def __init__(self, max_len: int | None, cache_len: int, weight: float = 1.0) -> None:
        if cache_len <= 0:
            raise ValueError(f"OverlongPenalty cache_len must be > 0 tokens, got {cache_len}")
        if max_len is not None and cache_len > max_len:
            raise ValueError(f"OverlongPenalty cache_len ({cache_len}) must be <= max_len ({max_len})")
        self.max_len = max_len
        self.cache_len = cache_len
        self.weight = weight

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        completion_lengths: list[int] | None = None,
        max_completion_length: int | None = None,
        **columns,
    ) -> list[float]:
        if completion_lengths is None:
            raise KeyError("OverlongPenalty needs the 'completion_lengths' column (tokens per completion)")
        max_len = self.max_len if self.max_len is not None else max_completion_length
        if max_len is None:
            raise KeyError("OverlongPenalty has max_len=None and no 'max_completion_length' column to fall back on")
        if self.cache_len > max_len:
            raise ValueError(f"OverlongPenalty cache_len ({self.cache_len}) must be <= max_len ({max_len})")
        return overlong_penalty(torch.tensor(completion_lengths), max_len, self.cache_len).tolist()
