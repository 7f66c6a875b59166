"""Every precision Lightning's Trainer takes, classified once for RLModule: honoured, or refused when a run starts, in
one line that says what to use instead.

:data:`PRECISIONS` covers every value of ``Trainer(precision=...)``'s annotation; ``tests/test_precisions.py``
enumerates them from Lightning's signature, so a value a new release adds fails that test until it is classified here.
:func:`check_precision` runs in ``RLModule.setup``, before the warm start and the first RL step.
"""

from __future__ import annotations

from lit_gspo.lightning.trainer_flags import HONOURED, REFUSED, Flag

_FP16_WEIGHTS = (
    "fp16 weights: an optimiser's state underflows in fp16 (Adam's squared gradients, its eps=1e-8), so the first "
    "optimiser step writes inf/NaN into the policy: 16-mixed keeps fp32 weights (with a GradScaler), bf16-true and "
    "bf16-mixed have fp32's range"
)
_TRANSFORMER_ENGINE = (
    "Transformer Engine swaps the policy's Linear layers for its own, which RLModule's update (fp32 log-probs through "
    "its LM head, FSDP2's shards) was never run with: bf16-mixed"
)

#: ``Trainer(precision=...)``'s values (as text) → how an RL run treats them
PRECISIONS: dict[str, Flag] = {
    "32-true": Flag(HONOURED, "fp32"),
    "32": Flag(HONOURED, "32-true"),
    "64-true": Flag(HONOURED, "fp64 (slow; a reference for numerics)"),
    "64": Flag(HONOURED, "64-true"),
    "bf16-mixed": Flag(HONOURED, "fp32 weights, bf16 autocast; log-probs and the loss in fp32"),
    "bf16": Flag(HONOURED, "bf16-mixed"),
    "bf16-true": Flag(HONOURED, "bf16 weights; log-probs and the loss in fp32"),
    "16-mixed": Flag(HONOURED, "fp32 weights, fp16 autocast, a GradScaler (on a CPU Lightning makes it bf16-mixed)"),
    "16": Flag(HONOURED, "16-mixed"),
    "16-true": Flag(REFUSED, _FP16_WEIGHTS + "; validate, test and predict take it"),
    "transformer-engine": Flag(REFUSED, _TRANSFORMER_ENGINE),
    "transformer-engine-float16": Flag(REFUSED, _TRANSFORMER_ENGINE),
}

#: refused for a fit only: a validation, test or prediction samples without an optimiser
FITS_ONLY = {"16-true"}


def check_precision(precision, stage: str) -> None:
    """Raise :class:`SettingsError` (``lit-gspo``: one line) for a precision RLModule refuses in ``stage`` (Lightning's
    ``fit``, ``validate``, ``test``, ``predict``), saying what to use."""
    text = str(precision)
    flag = PRECISIONS.get(text)
    if flag is None or flag.kind != REFUSED or (text in FITS_ONLY and stage != "fit"):
        return
    raise flag.refusal(f"--trainer.precision {text}")
