"""Rollout engines: what samples the completions (``--model.engine HFGenerate`` or ``LeanSampler``, or your class path)."""

from lit_gspo.rl.engines.base import RolloutEngine
from lit_gspo.rl.engines.hf import HFGenerate
from lit_gspo.rl.engines.lean import LeanSampler

__all__ = ["HFGenerate", "LeanSampler", "RolloutEngine"]
