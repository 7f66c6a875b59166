"""Stop strings: a reply also ends at the first of some strings it writes, as vLLM's ``SamplingParams.stop`` does.

    reply = y_1 … y_k,   k = min { j : some s ∈ strings occurs in decode(y_1 … y_j) }     (no such j: as sampled)

The token that completes the string is the reply's last: the update trains on it, and the text the rewards and the
environment read holds the string (vLLM's ``include_stop_str_in_output=True``; vLLM's default leaves it out of the
text while its tokens still write it). A ReAct-style tool loop ends a reply so (Search-R1's ``</search>``), or an
answer format (``</answer>``). The text is decoded without special tokens, as a reply's text is.

Every engine's replies are cut here after sampling (:meth:`StopStrings.cut`), so the rule holds for any engine. The
lean sampler and HFGenerate also stop sampling a row once it writes one, the static-cache sampler within its
``finished_check_every`` steps; vLLM (built without a tokenizer: token ids in and out) samples on to a stop token or
the budget, and the cut drops what it wrote after the string.
"""

from __future__ import annotations

import torch
from torch import Tensor


class StopStrings:
    """The strings replies end at, read through ``tokenizer``.

    Args:
        tokenizer: the policy's tokenizer (it decodes the replies).
        strings: non-empty strings; a reply ends at the first it writes.
    """

    def __init__(self, tokenizer, strings: list[str]):
        self.tokenizer, self.strings = tokenizer, check_stop_strings(strings)
        # the tokens that write a string's characters, with room for tokens that write none (special, partial bytes)
        self.window = 2 * max(map(len, self.strings)) + 4

    def __repr__(self) -> str:
        return f"StopStrings({list(self.strings)!r})"

    def found(self, ids: list[int]) -> bool:
        """Whether the text of ``ids`` holds a stop string."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in self.strings)

    def end(self, ids: list[int]) -> int | None:
        """k of the module docstring: the length of the reply ``ids`` through the token completing its first stop
        string, or None where it writes none."""
        if not self.found(ids):
            return None
        low, high = 1, len(ids)  # the shortest prefix that holds one: a prefix of a prefix that does not, does not
        while low < high:
            middle = (low + high) // 2
            if self.found(ids[:middle]):
                high = middle
            else:
                low = middle + 1
        return low

    def cut(self, completions: Tensor, mask: Tensor) -> Tensor:
        """``mask`` (N, T) of ``completions`` ending, in each row, at the token that completes its first stop string."""
        mask = mask.clone()
        for row, (ids, keep) in enumerate(zip(completions.tolist(), mask.tolist())):
            k = self.end([i for i, kept in zip(ids, keep) if kept])
            if k is not None:
                mask[row, k:] = False
        return mask

    def written(self, replies: Tensor, new: int = 1) -> Tensor:
        """(R,) bool: whether each reply so far (R, t) has written a stop string with its last ``new`` tokens, for a
        sampler that asks every ``new`` tokens (a string written before was seen then). Only the tail such a string can
        lie in is decoded; a row whose tail holds one is confirmed on its whole text."""
        tails = self.tokenizer.batch_decode(replies[:, -(self.window + new) :].tolist(), skip_special_tokens=True)
        hits = [i for i, text in enumerate(tails) if any(s in text for s in self.strings)]
        written = torch.zeros(len(replies), dtype=torch.bool)
        for i in hits:
            written[i] = self.found(replies[i].tolist())
        return written.to(replies.device)


def check_stop_strings(strings) -> tuple[str, ...]:
    """``strings`` as a tuple of non-empty strings, or a ValueError naming the value and what is valid."""
    if isinstance(strings, str) or not isinstance(strings, (list, tuple)) or not strings:
        raise ValueError(
            f"stop must be a list of strings, e.g. ['</answer>'], or null (stop tokens only); got {strings!r}"
        )
    bad = [s for s in strings if not isinstance(s, str) or not s]
    if bad:
        raise ValueError(f"stop strings must be non-empty strings; got {bad!r} in {list(strings)!r}")
    return tuple(dict.fromkeys(strings))
