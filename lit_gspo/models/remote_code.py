"""A model that brings its own Python (``auto_map`` in its config.json) loads only when its user says to trust it.

Transformers, given ``trust_remote_code=None``, asks on the terminal whether to run such code (and gives up after
15 seconds); given False, it refuses. lit_gspo always passes a bool, and turns the refusal into one line naming the
option that allows it.
"""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def code_trusted_by(option: str, what: str, trust_remote_code: bool):
    """Around ``from_pretrained(..., trust_remote_code=trust_remote_code)`` of ``what``: transformers' refusal of
    untrusted code becomes ``ValueError("<what>: its config maps it to Python of its own (auto_map), which runs only
    with <option> ...")``."""
    try:
        yield
    except ValueError as err:
        if trust_remote_code or "trust_remote_code" not in str(err):
            raise
        raise ValueError(
            f"{what}: its config maps it to Python of its own (auto_map), which runs only with {option} "
            "(TRL's trust_remote_code; only for a source you trust)"
        ) from None
