"""learn: the old-policy snapshot and K epochs × M minibatches of optimiser steps (``learner.py``), the
sampler–trainer mismatch corrections (``mismatch.py``) and the ratio diagnostics (``diagnostics.py``)."""

from lit_gspo.rl.learn.learner import Learner

__all__ = ["Learner"]
