"""Rollout engines: what samples the completions (``--model.engine HFGenerate`` or ``LeanSampler``, or your class path)."""

from lit_gspo.engines.base import RolloutEngine
from lit_gspo.engines.hf import HFGenerate
from lit_gspo.engines.lean import LeanSampler

__all__ = ["HFGenerate", "LeanSampler", "RolloutEngine"]
